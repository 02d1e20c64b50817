"""Torch implementation of the kernel backend (CPU, and the GPU baseline).

Storage codecs live here too: they turn values into the pool's bytes and back, and what the
bytes hold is the model's fake quantizer of the value (an E2M1 code times an E4M3 or
power-of-two scale, an E4M3 code times a power-of-two scale), so values already on the model's
grid are stored losslessly (the E4M3-scaled FP4 only for normal scales, see
``encode_fp4_e4m3_scales``). Every scatter redirects a sentinel row to the pool's sink row and
writes back the bytes the sink holds, so padding changes no byte.
"""

from __future__ import annotations

import torch

from v41plan.model import quant as Q
from v41plan.model.layers import sparse_attention as _attend


# -- codecs: the quantizers' own rounding (v41plan.model.quant), split into codes and scales ------
# Values are divided and rounded in their own precision (float64 stays float64), as the fake
# quantizers do: a float32 cast first would round a float64 value twice.
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // block, block))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the quantizers' arithmetic dtype: float64 for float64, else float32."""
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _amax(xb: torch.Tensor, floor: float) -> torch.Tensor:
    return xb.abs().amax(-1, keepdim=True).to(torch.float32).clamp_min(floor)


def encode_fp4_e4m3_scales(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Main-KV FP4 row bytes: packed E2M1 values (``d/2`` bytes) then E4M3 scales per ``block``
    lanes; decodes to ``quant.fake_fp4_e4m3(x)``. Values already on that grid come back exactly
    when their block's E4M3 scale is a normal number (amax >= 6 * 2**-6); a subnormal scale is
    re-derived from the rounded values and can differ (a known gap, see tests/model)."""
    xb = _blocks(_wide(x), block)
    s = Q.round_e4m3(Q.div_rn(_amax(xb, Q.FP4_E4M3_AMAX_FLOOR), Q.E2M1_MAX))
    codes = Q.round_e2m1(xb / s).flatten(-2)
    return torch.cat((Q.pack_e2m1(codes), Q.e4m3_encode(s.squeeze(-1)).view(torch.uint8)), dim=-1)


def decode_fp4_e4m3_scales(
    row: torch.Tensor, d: int, dtype: torch.dtype, block: int = 16
) -> torch.Tensor:
    """Values of main-KV FP4 rows ``[..., d/2 + d/block]``."""
    v = _blocks(Q.unpack_e2m1(row[..., : d // 2]), block)
    s = row[..., d // 2 :].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (v * s.unsqueeze(-1)).flatten(-2).to(dtype)


def encode_fp4_e8m0(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Index-key FP4 (``quant.fake_fp4``'s grid): ``(packed E2M1 [..., d/2], E8M0 bytes [...,
    d/32])``."""
    xb = _blocks(_wide(x), block)
    s = Q.pow2ceil(Q.div_rn(_amax(xb, Q.FP4_E8M0_AMAX_FLOOR), Q.E2M1_MAX))
    codes = Q.round_e2m1(xb / s).flatten(-2)
    return Q.pack_e2m1(codes), Q.e8m0_encode(s.squeeze(-1)).view(torch.uint8)


def decode_fp4_e8m0(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = 32
) -> torch.Tensor:
    """Values of index-key FP4 rows."""
    v = _blocks(Q.unpack_e2m1(values), block)
    return (v * Q.e8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


def encode_fp8_e8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Ring row bytes under FP4 main (``quant.fake_fp8``'s grid): E4M3 values then E8M0 scales."""
    xb = _blocks(_wide(x), block)
    s = Q.pow2ceil(Q.div_rn(_amax(xb, Q.FP8_AMAX_FLOOR), Q.E4M3_MAX))
    q = Q.round_e4m3(xb / s).flatten(-2)
    return torch.cat(
        (Q.e4m3_encode(q).view(torch.uint8), Q.e8m0_encode(s.squeeze(-1)).view(torch.uint8)), -1
    )


def decode_fp8_e8m0(row: torch.Tensor, d: int, dtype: torch.dtype, block: int = 32) -> torch.Tensor:
    """Values of ring FP8 rows ``[..., d + d/block]``."""
    q = _blocks(row[..., :d].contiguous().view(torch.float8_e4m3fn).to(torch.float32), block)
    s = Q.e8m0_decode(row[..., d:])
    return (q * s.unsqueeze(-1)).flatten(-2).to(dtype)


def encode_fp8_row(x: torch.Tensor) -> torch.Tensor:
    """FP8 index-plane row bytes: E4M3 codes then the fp32 row scale (``quant.quant_fp8_rows``)."""
    xf = _wide(x)
    scale = Q.div_rn(_amax(xf, Q.FP8_AMAX_FLOOR), Q.E4M3_MAX)
    codes = Q.round_e4m3(xf / scale)
    return torch.cat((Q.e4m3_encode(codes).view(torch.uint8), scale.view(torch.uint8)), -1)


def decode_fp8_row(row: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of FP8 index-plane rows ``[..., d + 4]``."""
    q = row[..., :d].contiguous().view(torch.float8_e4m3fn).to(dtype)
    return q * row[..., d:].contiguous().view(torch.float32).to(dtype)


# -- helpers ------------------------------------------------------------------------------------
def _put_rows(
    dest: torch.Tensor,
    idx: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    keep: torch.Tensor,
    sink: tuple[int, ...],
) -> None:
    """``dest[idx] = rows`` where ``keep``; other rows go to ``sink`` with the bytes it already
    holds."""
    sink_idx = tuple(torch.full_like(i, s) for i, s in zip(idx, sink))
    idx = tuple(torch.where(keep, i, s) for i, s in zip(idx, sink_idx))
    held = dest[tuple(s[:1] for s in sink_idx)].expand_as(rows)
    shape = (-1,) + (1,) * (rows.dim() - 1)
    dest.index_put_(idx, torch.where(keep.view(shape), rows, held))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64, else float32 (as ``layers.acc_dtype``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def plane_format(planes: tuple[torch.Tensor, ...]) -> str:
    """``fp8`` for one index plane of bytes+fp32 scale, ``fp4`` for a values/scales pair."""
    return "fp4" if len(planes) == 2 else "fp8"


class TorchBackend:
    """Plain-torch kernels over the pools' typed views (see ``backend.KernelBackend``)."""

    name = "torch"

    # -- rings ----------------------------------------------------------------------------
    def ring_write(self, ring, kv, slot, position, write_from, sink_slot):
        rows = ring.shape[1]
        keep = (slot >= 0) & (position >= 0) & (position >= write_from)
        if ring.dtype == torch.uint8:
            data = encode_fp8_e8m0(kv, 32)
        else:
            data = Q.to_bf16(kv)
        _put_rows(ring, (slot, position.clamp(min=0) % rows), data, keep, (sink_slot, 0))

    def ring_values(self, ring_rows: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        """Ring rows decoded to ``dtype``."""
        if ring_rows.dtype == torch.uint8:
            return decode_fp8_e8m0(ring_rows, d, dtype, 32)
        return ring_rows.to(dtype)

    def gather_window(self, ring, kv, rows, slot, position, window_lo, ring_until, window):
        t = rows.shape[0]
        j = torch.arange(window, device=kv.device)
        keypos = position.unsqueeze(1) - (window - 1) + j  # [Tq, W], oldest first
        valid = (keypos >= window_lo.unsqueeze(1)) & (keypos >= 0) & (slot >= 0).unsqueeze(1)
        from_ring = keypos < ring_until.unsqueeze(1)
        rs = torch.where(slot >= 0, slot, ring.shape[0] - 1).unsqueeze(1).expand(t, window)
        ring_keys = self.ring_values(
            ring[rs, keypos.clamp(min=0) % ring.shape[1]], kv.shape[1], kv.dtype
        )
        fwd_keys = kv[
            (rows.unsqueeze(1) - (position.unsqueeze(1) - keypos)).clamp(0, kv.shape[0] - 1)
        ]
        return torch.where(from_ring.unsqueeze(-1), ring_keys, fwd_keys), valid

    # -- compressor ---------------------------------------------------------------------------
    def compress_groups(
        self,
        values,
        scores,
        position,
        slot,
        first_row,
        last_row,
        tail_values,
        tail_scores,
        sink_slot,
    ):
        t = values.shape[0]
        s = torch.where(slot >= 0, slot, sink_slot)
        prev = torch.arange(t, device=values.device).sub(1).clamp(min=0)
        from_tail = first_row.unsqueeze(-1)
        pv = torch.where(from_tail, tail_values[s], values[prev])
        ps = torch.where(from_tail, tail_scores[s], scores[prev])
        pair_v = torch.stack((pv, values), 1)
        pair_s = torch.stack((ps, scores), 1)
        keep = last_row & (position % 2 == 0) & (slot >= 0)
        _put_rows(tail_values, (slot,), values.to(tail_values.dtype), keep, (sink_slot,))
        _put_rows(tail_scores, (slot,), scores.to(tail_scores.dtype), keep, (sink_slot,))
        return pair_v, pair_s

    def main_scatter(self, plane, latent, page, row, keep, sink_page):
        if plane.dtype == torch.uint8:
            data = encode_fp4_e4m3_scales(latent, 16)
        else:
            data = Q.to_bf16(latent)
        _put_rows(plane, (page, row), data, keep, (sink_page, 0))

    def main_values(self, rows: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        """Main-plane rows decoded to ``dtype``."""
        if rows.dtype == torch.uint8:
            return decode_fp4_e4m3_scales(rows, d, dtype, 16)
        return rows.to(dtype)

    # -- index plane --------------------------------------------------------------------------
    def index_key_store(self, planes, key, key_scale, page, row, keep, sink_page):
        if plane_format(planes) == "fp8":
            (plane,) = planes
            data = torch.cat(
                (
                    Q.e4m3_encode(key).view(torch.uint8),
                    key_scale.to(torch.float32).reshape(-1, 1).contiguous().view(torch.uint8),
                ),
                -1,
            )
            _put_rows(plane, (page, row), data, keep, (sink_page, 0))
        else:
            vals, scales = planes
            v, sc = encode_fp4_e8m0(key, 32)
            _put_rows(vals, (page, row), v, keep, (sink_page, 0))
            _put_rows(scales, (page, row), sc, keep, (sink_page, 0))

    def index_keys(
        self, planes, pages: torch.Tensor, d: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Index keys of each query row's page list, ``([T, P*rows, d], fp32 row scales [T, P*rows]
        or None)``: fp8 gives E4M3 code values and the row scale, fp4 dequantized values. These are
        the scorer's tile reads; the plane is small (``d_ih`` bytes a row)."""
        pg = pages.clamp(min=0)
        if plane_format(planes) == "fp8":
            (plane,) = planes
            raw = plane[pg]  # [T, P, rows, d + 4]
            codes = raw[..., :d].contiguous().view(torch.float8_e4m3fn).to(dtype)
            scale = raw[..., d:].contiguous().view(torch.float32)[..., 0]
            return codes.flatten(1, 2), scale.flatten(1, 2)
        vals, scales = planes
        return decode_fp4_e8m0(vals[pg], scales[pg], dtype, 32).flatten(1, 2), None

    def scores(self, planes, q, weights, bound, pages):
        """Index scores ``[T, P*rows]`` of every query row over its own pages, ``-inf`` past its
        bound or on a missing page. The query is rounded to the plane's grid here (fp8: E4M3 per
        (row, head) with an fp32 scale; fp4: E2M1 with E8M0 per 32 lanes), and the score is
        ``sum_h relu(q_h . k) * w_h`` in the same operation order as
        ``layers.Attention.index_scores``."""
        d = q.shape[-1]
        keys, k_scale = self.index_keys(planes, pages, d, q.dtype)
        if k_scale is None:
            qq = Q.fake_fp4(q, 32)
            logits = torch.einsum("thc,tmc->thm", qq, keys.to(qq.dtype))
            score = (torch.relu(logits) * weights[:, :, None].to(qq.dtype)).sum(1)
        else:
            a = acc_dtype(q.dtype)
            codes, qs = Q.quant_fp8_rows(q)
            logits = (
                torch.einsum("thc,tmc->thm", codes.to(a), keys.to(a)) * k_scale.to(a)[:, None, :]
            )
            score = (torch.relu(logits) * (weights.to(a) * qs[..., 0].to(a))[:, :, None]).sum(1)
        rows = keys.shape[1] // pages.shape[1]
        n = torch.arange(keys.shape[1], device=q.device)
        ok = (n.unsqueeze(0) < bound.unsqueeze(1)) & (pages >= 0).repeat_interleave(rows, 1)
        return score.masked_fill(~ok, float("-inf"))

    def topk_ids(self, score: torch.Tensor, topk: int) -> torch.Tensor:
        """Top-``topk`` ids per row, ties to the smaller position, ascending, -1 padded."""
        n = score.shape[1]
        if n < topk:
            score = torch.nn.functional.pad(score, (0, topk - n), value=float("-inf"))
        order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :topk]
        picked = torch.gather(score, 1, order)
        big = torch.iinfo(torch.int64).max
        ids = torch.where(picked > float("-inf"), order, big).sort(dim=1).values
        return torch.where(ids == big, -1, ids)

    def score_topk(self, planes, q, weights, bound, pages, topk, candidates):
        score = self.scores(planes, q, weights, bound, pages)
        if candidates is not None:
            score = score.masked_fill(~candidates, float("-inf"))
        return self.topk_ids(score, topk)

    def score_candidates_topk(
        self, planes, q, weights, bound, pages, topk, block_rows, topk_blocks
    ):
        """The candidate source's call: its own top-k (not restricted) and the candidate mask
        ``[T, P*rows]`` later Reindex layers score inside, from one score matrix."""
        score = self.scores(planes, q, weights, bound, pages)
        return self.topk_ids(score, topk), self.candidate_blocks(
            score, bound, block_rows, topk_blocks
        )

    def candidate_blocks(self, scores, bound, block_rows, topk_blocks):
        t, n = scores.shape
        nb = n // block_rows
        bscore = scores.view(t, nb, block_rows).amax(-1)
        newest = (bound - 1).clamp(min=0) // block_rows
        force = (torch.arange(nb, device=scores.device).unsqueeze(0) == newest.unsqueeze(1)) & (
            bound > 0
        ).unsqueeze(1)
        bscore = torch.where(force, float("inf"), bscore)
        k = min(topk_blocks, nb)
        order = torch.sort(bscore, dim=1, descending=True, stable=True).indices[:, :k]
        kept = torch.gather(bscore, 1, order) > float("-inf")
        mask = torch.zeros(t, nb, dtype=torch.bool, device=scores.device)
        mask.scatter_(1, order, kept)
        rows = torch.arange(n, device=scores.device).unsqueeze(0)
        return mask.repeat_interleave(block_rows, 1) & (rows < bound.unsqueeze(1))

    # -- attention gather ---------------------------------------------------------------------
    def gather_selected(self, plane, ids, pages, rows_per_page, head_dim, dtype):
        valid = ids >= 0
        c = ids.clamp(min=0)
        col = (c // rows_per_page).clamp(max=pages.shape[1] - 1)
        page = torch.gather(pages, 1, col)
        valid = valid & (page >= 0)
        page = torch.where(valid, page, plane.shape[0] - 1)
        return self.main_values(plane[page, c % rows_per_page], head_dim, dtype), valid

    def sparse_attention(
        self,
        q,
        sink,
        scale,
        ring,
        kv,
        rows,
        slot,
        position,
        window_lo,
        ring_until,
        window,
        plane,
        ids,
        pages,
        rows_per_page,
        out,
    ):
        keys, valid = self.gather_window(
            ring, kv, rows, slot, position, window_lo, ring_until, window
        )
        if plane is not None:
            sel, ok = self.gather_selected(plane, ids, pages, rows_per_page, kv.shape[1], kv.dtype)
            keys, valid = torch.cat((keys, sel), 1), torch.cat((valid, ok), 1)
        nq, k = valid.shape
        idx = torch.where(valid, torch.arange(nq * k, device=valid.device).view(nq, k), -1)
        out.copy_(_attend(q, keys.reshape(nq * k, -1), idx, sink, scale))

    # -- cursor -------------------------------------------------------------------------------
    def cursor_write(self, cursor, slot, values, sink_slot):
        """Commit ``[position, history...]`` rows ``values [B, 1+h]`` into the slots' cursors."""
        _put_rows(cursor, (slot,), values.to(cursor.dtype), slot >= 0, (sink_slot,))

    # -- checkpoints --------------------------------------------------------------------------
    def copy_spans(self, backing, src, dst, nbytes):
        for s, d, n in zip(src, dst, nbytes, strict=True):
            backing[d : d + n].copy_(backing[s : s + n])

    def copy_image(self, backing, src, dst):
        """Byte-index form of an image copy (tests; the runtime uses ``copy_spans``)."""
        backing.index_copy_(0, dst, backing.index_select(0, src))
