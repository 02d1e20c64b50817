"""Dense references for the replayed forwards: decoder SWA bounded replay and the encoder rebuild.

``ReferenceModel`` runs a cold prefill and one-token decodes. The paged runtime also runs
forwards whose rows see truncated windows, by the specification's replay rules; this module
computes those forwards densely, for one request, from the rules themselves (no plan, no pools,
no gathers), so the paged runtime's replayed forwards can be compared with something.

A request is a sequence of ``Forward`` calls on one ``DenseRequest``, each a prefill forward
over positions ``[start, end)`` or a one-row decode. The request's state between them is what
the runtime keeps: per layer a ring of ``W`` window-KV rows (position ``p`` at ``p % W``), per
KV owner the compressed rows and index keys written so far (the prefix cache's pages: kept by a
fresh slot), per ratio-2 owner the FP32 projection of an open group's first member (the tail).

Rules of one forward (``write_from`` the resume point or hit, ``W`` the window):

- Rebuild (a fresh slot with ``write_from > 0``, encoder replay): rings and tails are dropped;
  ``cached_until = forward start``, and encoder windows start at the forward's first row.
  Otherwise ``cached_until = write_from`` and encoder windows start at 0.
- A row at or past ``cached_until`` reads window positions below ``cached_until`` from the
  slot's ring and the rest from this forward; a row below it (a recomputed row of a backed-off
  forward) reads only this forward's rows, floored at the forward's start.
- Compressed groups are written when their last member is at or past ``write_from`` (older
  groups stay as the cache holds them); a group whose first member lies below
  ``cached_until`` takes it from the tail. An odd forward end stores its open member's
  projection into the tail.
- Ring writes: each layer's last ``W`` rows at or past ``cached_until``.
- ``decoder="tail"`` (decoder replay, the forward that finishes its prompt): the last KV source
  compresses every row; the decoder runs on the tail, the last ``W`` rows (never below the
  forward's start), every decoder window starting at the tail's first position and reading only
  this forward's rows; the last layer runs its attention and FFN on the last row only (its window
  KV on the tail). Each decoder layer writes its whole tail to its ring. Only the last row's
  logits are defined. ``decoder="none"`` (decoder replay, a forward that does not finish its
  prompt): the decoder runs nothing but the last KV source's compression. ``decoder="all"``:
  every row runs every layer (replay off, or a ``full_rows`` request), decoder windows floored
  as the encoder's.
- ``decode=True`` (a step in which every request decodes, the captured graph): the ring row is
  written first and the whole window read from the ring.
- Engram rows depend only on token ids: they come from the whole sequence, however the forward
  starts.

``kv_cache_dtype`` (``"bf16"``/``"fp4"``, None for none) models the pools' storage formats:
every value read back from a ring, a main plane or an index plane is rounded as that storage
holds it (rings: bf16, or FP8 E4M3 with E8M0/32 scales under fp4; main rows: bf16, or FP4 with
E4M3/16 scales; index keys: the plane's grid). With the fake quantizers on these roundings are
identities (the values are on the storage grids already); with them off they are what makes a
float64 comparison of the paged runtime exact. The FP8 index plane is modelled with the
quantizers on only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.model.layers import (
    NEG_INF,
    candidate_mask,
    hc_collapse,
    hc_expand,
    hc_predict,
    rms_norm,
    sparse_attention,
    topk_ids,
)
from v41plan.model.quant import (
    dequant_fp8_blocks,
    fake_fp4,
    fake_fp4_e4m3,
    fake_fp8,
    fake_quant,
    fake_quant_enabled,
    to_bf16,
)
from v41plan.model.reference import ReferenceModel

DecoderRows = Literal["all", "tail", "none"]


@dataclass(frozen=True)
class Forward:
    """One forward of a request, described by the replay rules' inputs (all positions)."""

    start: int
    """First position the forward computes (after any back-off)."""
    end: int
    """One past its last position."""
    write_from: int
    """The resume point (or prefix hit): compressed groups ending below it are not written."""
    fresh_slot: bool = False
    """The slot holds no state (an encoder-replay rebuild when ``write_from > 0``)."""
    decoder: DecoderRows = "all"
    """Which rows the decoder runs: ``all``, ``tail`` (a replayed final forward) or ``none`` (a
    non-final forward under decoder replay)."""
    decode: bool = False
    """A decode step (one row, ring written before it is read)."""


@dataclass
class ForwardOutput:
    """What one dense forward computed."""

    positions: torch.Tensor
    """Positions ``[n]`` of the forward's rows."""
    logits: torch.Tensor
    """``[n, vocab]``; NaN on rows that did not run every layer."""
    defined: torch.Tensor
    """bool ``[n]``: the rows whose logits are defined."""
    selections: dict[int, torch.Tensor] = field(default_factory=dict)
    """Index top-k ``[n, index_topk]`` per index source, -1 on rows that did not score."""
    experts: dict[int, torch.Tensor] = field(default_factory=dict)
    """Routed expert ids ``[n, k]`` per layer, -1 on rows that did not run the FFN."""


@dataclass
class _Owner:
    comp: torch.Tensor
    keys: torch.Tensor
    key_scale: torch.Tensor | None
    written: torch.Tensor
    tail: tuple[int, torch.Tensor, torch.Tensor] | None = None


class DenseRequest:
    """One request's dense replayed forwards over a ``ReferenceModel``'s weights and pieces."""

    def __init__(
        self,
        ref: ReferenceModel,
        token_ids,
        kv_cache_dtype: str | None = None,
        max_len: int | None = None,
    ):
        if kv_cache_dtype not in (None, "bf16", "fp4"):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: accepted None, bf16, fp4")
        self.ref, self.cfg = ref, ref.cfg
        self.ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long).reshape(-1)
        self.kv_fmt = kv_cache_dtype
        self.max_len = int(max_len or self.ids.numel())
        self.forced_selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[max_len, index_topk]`` by position to use instead of the computed one
        (teacher forcing), per index source."""
        self.forced_experts: dict[int, torch.Tensor] = {}
        """Routed expert ids ``[max_len, k]`` by position, per layer."""
        cfg, dev, dt = self.cfg, ref.device, ref.dtype
        W = cfg.sliding_window
        self.ring = [torch.zeros(W, cfg.head_dim, dtype=dt, device=dev) for _ in cfg.layers]
        self.ring_pos = [torch.full((W,), -1, dtype=torch.long, device=dev) for _ in cfg.layers]
        self.owners: dict[int, _Owner] = {}
        for info in cfg.layers:
            if info.role == "full":
                m = self.max_len // info.ratio
                self.owners[info.index] = _Owner(
                    torch.zeros(m, cfg.head_dim, dtype=dt, device=dev),
                    torch.zeros(m, cfg.index_head_dim, dtype=dt, device=dev),
                    torch.ones(m, 1, dtype=torch.float32, device=dev)
                    if ref.index_fmt == "fp8"
                    else None,
                    torch.zeros(m, dtype=torch.bool, device=dev),
                )
        self.last_kv = max(i.index for i in cfg.layers if i.role == "full")
        self.last_layer = len(cfg.layers) - 1
        engram_rows, _ = ref.engram.prepare(self.ids[: self.max_len].numpy(), None)
        self.engram_rows = engram_rows

    # -- storage -----------------------------------------------------------------------------
    def _stored_ring(self, kv: torch.Tensor) -> torch.Tensor:
        if self.kv_fmt is None:
            return kv
        if self.kv_fmt == "bf16":
            return to_bf16(kv).to(kv.dtype)
        with fake_quant(True):
            return fake_fp8(kv, 32)

    def _stored_main(self, comp: torch.Tensor) -> torch.Tensor:
        if self.kv_fmt is None:
            return comp
        if self.kv_fmt == "bf16":
            return to_bf16(comp).to(comp.dtype)
        with fake_quant(True):
            return fake_fp4_e4m3(comp, 16)

    def _stored_keys(self, keys: torch.Tensor) -> torch.Tensor:
        if self.kv_fmt is None:
            return keys
        if self.ref.index_fmt == "fp8":
            if not fake_quant_enabled():
                raise NotImplementedError("the FP8 index plane is modelled with quantizers on")
            return keys
        with fake_quant(True):
            return fake_fp4(keys, 32)

    # -- one forward ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, fwd: Forward) -> ForwardOutput:
        """Run one forward; updates the request's rings, owners' rows and tails."""
        cfg, ref = self.cfg, self.ref
        dev, dt = ref.device, ref.dtype
        fs, end, r = fwd.start, fwd.end, fwd.write_from
        if not 0 <= fs <= r < end <= self.max_len:
            raise ValueError(f"bad forward {fwd}")
        if fwd.decode and (end - fs != 1 or fwd.decoder != "all"):
            raise ValueError("a decode forward is one row through every layer")
        W = cfg.sliding_window
        rebuild = fwd.fresh_slot and r > 0
        if fwd.fresh_slot:
            for L in range(len(cfg.layers)):
                self.ring_pos[L].fill_(-1)
            for o in self.owners.values():
                o.tail = None
        cached = fs if rebuild else r
        enc_floor = fs if rebuild else 0
        tail_lo = max(fs, end - W)
        n = end - fs
        pos = torch.arange(fs, end, device=dev)
        ids = self.ids[fs:end]
        X = ref.embed[ids.to(dev)].to(dt)
        X = X[:, None, :].expand(n, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros(n, cfg.hc_mult, dtype=ref.acc, device=dev)
        pre[:, 0] = 1
        everyone = torch.arange(n, device=dev)
        tail = everyone[pos >= tail_lo]
        out = ForwardOutput(pos, torch.empty(0), torch.zeros(n, dtype=torch.bool, device=dev))
        cand: torch.Tensor | None = None  # candidate mask of the attention rows, by local row
        eps = cfg.rms_norm_eps
        for info in cfg.layers:
            L = info.index
            dec = info.segment == "decoder"
            at = everyone
            comp_rows = everyone if info.role == "full" else everyone[:0]
            ring_rows = everyone
            tail_floor = False
            if dec and fwd.decoder != "all":
                if info.role == "full" and L != self.last_kv:
                    raise NotImplementedError("a KV owner past the last KV source")
                ring_rows = tail if fwd.decoder == "tail" else everyone[:0]
                at = ring_rows if L < self.last_layer else ring_rows[-1:]
                tail_floor = fwd.decoder == "tail"
            if at.numel() + comp_rows.numel() + ring_rows.numel() == 0:
                continue
            if info.engram:
                if dec and fwd.decoder != "all":
                    raise NotImplementedError("an Engram layer in a replayed decoder")
                li = cfg.engram_layer_ids.index(L)
                codes, scales = ref.engram.gather(li, self.engram_rows[fs:end, li])
                emb = dequant_fp8_blocks(codes, scales, dt).to(dev)
                X = ref.engram_layers[L](X, emb)
            att = ref.attn[L]
            a_pre, a_post, a_C = hc_predict(
                X, ref.hc_attn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            xin = rms_norm(hc_collapse(X, pre), ref.attn_norm[L], eps)
            cos, sin = att.rope.cos_sin(pos, dt)
            kv = att.window_kv(xin, cos, sin)
            if fwd.decode:  # the captured decode step writes its ring row before reading
                self._ring_write(L, kv, pos, ring_rows, cached, end, tail_floor)
            if comp_rows.numel():
                self._compress(L, att, xin, pos, fwd, cached)
            if at.numel():
                floor = tail_lo if tail_floor else enc_floor
                y, cand = self._attention(
                    L,
                    info,
                    att,
                    xin,
                    cos,
                    sin,
                    kv,
                    pos,
                    at,
                    fwd,
                    cached,
                    floor,
                    tail_floor,
                    out,
                    cand,
                )
                X[at] = hc_expand(y, X[at], a_post[at], a_C[at])
                Xf = X[at]
                f_pre, f_post, f_C = hc_predict(
                    Xf, ref.hc_ffn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
                )
                xf = rms_norm(hc_collapse(Xf, a_pre[at]), ref.ffn_norm[L], eps)
                forced = self.forced_experts.get(L)
                yf, eids = ref.moe[L](xf, None if forced is None else forced[pos[at]].to(dev))
                ex = torch.full((n, eids.shape[1]), -1, dtype=torch.long, device=dev)
                ex[at] = eids
                out.experts[L] = ex
                X[at] = hc_expand(yf, Xf, f_post, f_C)
                pre[at] = f_pre
            if not fwd.decode:  # a prefill reads the ring as it was before the forward
                self._ring_write(L, kv, pos, ring_rows, cached, end, tail_floor)
            if L == self.last_layer:
                out.defined[at] = True
        x = rms_norm(hc_collapse(X, pre), ref.norm, eps)
        logits = F.linear(x.to(ref.acc), ref.head)
        out.logits = logits.masked_fill(~out.defined[:, None], float("nan"))
        return out

    def _ring_write(self, L, kv, pos, rows, cached, end, tail_floor) -> None:
        """A layer's ring rows: its last ``W`` rows at or past ``cached`` (a tail-floored decoder
        layer: its whole tail)."""
        W = self.cfg.sliding_window
        p = pos[rows]
        keep = p >= end - W
        if not tail_floor:
            keep &= p >= cached
        p = p[keep]
        self.ring[L][p % W] = self._stored_ring(kv[rows][keep])
        self.ring_pos[L][p % W] = p

    def _window(self, L, kv, pos, at, fwd, cached, floor, tail_floor):
        """Window keys ``[q, W, d]`` (oldest first) and their validity for query rows ``at``."""
        W = self.cfg.sliding_window
        fs = fwd.start
        qp = pos[at]
        kp = qp[:, None] - (W - 1) + torch.arange(W, device=qp.device)[None]
        if fwd.decode:
            lo = torch.zeros_like(qp)
            ring_until = qp + 1
        elif tail_floor:
            lo = torch.full_like(qp, floor)
            ring_until = torch.full_like(qp, fs)
        else:
            above = qp >= cached
            lo = torch.where(above, torch.full_like(qp, floor), torch.full_like(qp, max(floor, fs)))
            ring_until = torch.where(above, torch.full_like(qp, cached), torch.full_like(qp, fs))
        valid = (kp >= lo[:, None]) & (kp >= 0)
        from_ring = valid & (kp < ring_until[:, None])
        slot = kp.clamp(min=0) % W
        held = self.ring_pos[L][slot]
        if not torch.equal(held[from_ring], kp[from_ring]):
            raise AssertionError(f"layer {L}: a window reads a position its ring does not hold")
        from_fwd = valid & ~from_ring
        if (kp[from_fwd] < fs).any():
            raise AssertionError(f"layer {L}: a window reads a row below the forward's start")
        keys = torch.where(
            from_ring[..., None],
            self.ring[L][slot],
            kv[(kp - fs).clamp(0, kv.shape[0] - 1)],
        )
        return keys, valid

    def _attention(
        self, L, info, att, xin, cos, sin, kv, pos, at, fwd, cached, floor, tail_floor, out, cand
    ):
        """Index selection and sparse attention of rows ``at``; returns (output, candidates)."""
        cfg, ref = self.cfg, self.ref
        n = pos.shape[0]
        x, c, s = xin[at], cos[at], sin[at]
        q, qr = att.q_path(x, c, s)
        keys, valid = self._window(L, kv, pos, at, fwd, cached, floor, tail_floor)
        parts, masks = [keys], [valid]
        if info.ratio > 0:
            o = self.owners[info.kv_owner]
            qp = pos[at]
            vis = (qp + 1) // info.ratio
            m = int(vis.max())
            if not bool(o.written[:m].all()):
                raise AssertionError(f"layer {L}: a visible compressed row was never written")
            if info.role in ("full", "reindex"):
                qi, qs, wts = att.index_queries(qr, x, c, s, ref.index_fmt)
                ks = None if o.key_scale is None else o.key_scale[:m]
                scores = att.index_scores(qi, qs, wts, o.keys[:m], ks)
                scores = scores.masked_fill(
                    torch.arange(m, device=qp.device)[None] >= vis[:, None], NEG_INF
                )
                if L == cfg.candidate_source_layer_id:
                    cand = torch.zeros(n, m, dtype=torch.bool, device=qp.device)
                    cand[at] = candidate_mask(
                        scores, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks
                    )
                if info.role == "reindex" and info.uses_candidates:
                    scores = scores.masked_fill(~cand[at][:, :m], NEG_INF)
                top = topk_ids(scores, cfg.index_topk)
                if L in self.forced_selections:
                    top = self.forced_selections[L][qp].to(top.device)
                sel = torch.full((n, cfg.index_topk), -1, dtype=torch.long, device=qp.device)
                sel[at] = top
                out.selections[L] = sel
            else:
                top = out.selections[info.topk_owner][at]
            ok = top >= 0
            parts.append(o.comp[top.clamp(min=0)])
            masks.append(ok)
        k = torch.cat(parts, 1)
        ok = torch.cat(masks, 1)
        nq, kk = ok.shape
        idx = torch.where(ok, torch.arange(nq * kk, device=ok.device).view(nq, kk), -1)
        o = sparse_attention(q, k.reshape(nq * kk, -1), idx, att.sink, att.scale)
        return att.output(o, c, s), cand

    def _compress(self, L, att, xin, pos, fwd, cached) -> None:
        """The owner's groups closing in the forward at or past ``write_from``; the tail."""
        o = self.owners[L]
        r = att.ratio
        fs, end, wf = fwd.start, fwd.end, fwd.write_from
        v, g = att.compress_project(xin)
        # groups whose last member lies in the forward, at or past write_from
        j = torch.arange(max(fs, wf) // r, end // r, device=pos.device)
        if r == 1:
            latent = att.ratio1_latent(v[j - fs])
        else:
            second = 2 * j + 1 - fs
            first = 2 * j
            from_tail = first < cached
            if from_tail.sum() > 1:
                raise AssertionError(f"layer {L}: more than one group starts in the tail")
            if bool(from_tail.any()) and (o.tail is None or o.tail[0] != int(first[from_tail][0])):
                raise AssertionError(f"layer {L}: the group's first member is not in the tail")
            idx = (first - fs).clamp(min=0)
            v0, g0 = v[idx], g[idx]
            if bool(from_tail.any()):
                v0 = torch.where(from_tail[:, None], o.tail[1][None], v0)
                g0 = torch.where(from_tail[:, None], o.tail[2][None], g0)
            latent = att.pool(v0, g0, v[second], g[second])
            if end % 2:
                o.tail = (end - 1, v[end - 1 - fs].clone(), g[end - 1 - fs].clone())
        if j.numel() == 0:
            return
        cos, sin = att.rope.cos_sin(j * r, self.ref.dtype)
        keys, kscale = att.index_keys(latent, cos, sin, self.ref.index_fmt)
        o.keys[j] = self._stored_keys(keys).to(o.keys.dtype)
        if kscale is not None:
            o.key_scale[j] = kscale
        o.comp[j] = self._stored_main(att.compressed_kv(latent, cos, sin))
        o.written[j] = True
