"""The paged runtime model: the reference's weights and arithmetic over PAGE/STATE pools.

A forward consumes a ``StepPlan`` (``v41plan.planner.step``): its arrays are copied into
fixed-address buffers sized to the largest width the model was built for, and every layer
runs each sub-step (``ring_write``, ``compress``, ``attention``, ``ffn``) on the rows the plan
gives it. With decoder replay off (or in decode) that is every row of the flat batch; with it
on, the stage table narrows the decoder to each finishing request's tail and the last layer's
query to its last row. Layers run by the plan's graph stages, each stage's rows gathered
once. Model arithmetic comes from ``v41plan.model.layers`` (the pieces the
dense reference calls); pool reads and writes go through a kernel backend
(``kernels.backend``).

Order of pool reads and writes per layer: window KV, then (Full owners) the compressed groups
closing in the forward, paired with the FP32 tails, written to the main and index planes;
then the query's index selection over the plane (each row its own bound and pages); then
attention over window rows (the ring below the forward's start, this forward's rows above)
and the selected compressed rows; a prefill writes its ring rows after attention (the old
rows stay until every query read its prefix), a decode forward writes first. Positions and
Engram history (the cursor) are committed after the forward.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, CacheSpec
from v41plan.model.config import ModelConfig, config_from_cache_spec
from v41plan.model.layers import (
    Attention,
    EngramLayer,
    HcParams,
    MoE,
    acc_dtype,
    apply_rope,
    hc_collapse,
    hc_expand,
    hc_predict,
    rms_norm,
    sparse_attention,
)
from v41plan.model.quant import dequant_fp8_blocks
from v41plan.runtime.collectives import SINGLE, TPGroup, tp_score_candidates_topk, tp_score_topk
from v41plan.runtime.kernels.torch_ref import TorchBackend
from v41plan.runtime.pools import Pools


def check_formats(kv_cache_dtype: str, index_cache_dtype: str) -> None:
    """Refuse an unsupported pool format pair (called before any weight loads)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; "
            f"accepted: {', '.join(KV_CACHE_DTYPES)}"
        )
    if index_cache_dtype not in INDEX_CACHE_DTYPES:
        raise ValueError(
            f"index_cache_dtype={index_cache_dtype!r} is not supported; "
            f"accepted: {', '.join(INDEX_CACHE_DTYPES)}"
        )


@dataclass
class StepBuffers:
    """Fixed-address metadata buffers; a plan is copied in, never reallocated.

    Per row (``[max_tokens]``): ``positions``, ``batch_ids`` (-1 padding). Per request
    (``[max_bs]``): ``slots`` (-1 padding), ``block_tables`` (``[max_bs, table_width]``, -1
    past a table) and the plan's ``forward_start``, ``forward_end``, ``cached_until``,
    ``swa_cached_until``, ``swa_replay_start``, ``encoder_window_floor``, ``tail_start`` and
    ``last_rows``, with the meanings ``StepPlan`` gives them.
    """

    positions: torch.Tensor
    batch_ids: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    forward_start: torch.Tensor
    forward_end: torch.Tensor
    cached_until: torch.Tensor
    swa_cached_until: torch.Tensor
    swa_replay_start: torch.Tensor
    encoder_window_floor: torch.Tensor
    tail_start: torch.Tensor
    last_rows: torch.Tensor

    @classmethod
    def allocate(cls, max_tokens: int, max_bs: int, table_width: int, device) -> StepBuffers:
        """Buffers for graph keys up to ``(max_bs, max_tokens)`` and ``table_width`` pages."""

        def z(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        return cls(
            z(max_tokens),
            z(max_tokens),
            z(max_bs),
            z(max_bs, table_width),
            *(z(max_bs) for _ in range(8)),
        )

    def load(self, plan) -> None:
        """Copy a plan's arrays in (padding keeps its sentinels); refuses a wider plan."""
        t, b = plan.running_tokens, plan.running_bs
        if t > self.positions.shape[0] or b > self.slots.shape[0]:
            raise ValueError(
                f"step width ({b} requests, {t} rows) exceeds the buffers "
                f"({self.slots.shape[0]}, {self.positions.shape[0]})"
            )
        w = plan.block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            raise ValueError(
                f"block table width {w} exceeds the buffers' {self.block_tables.shape[1]}"
            )
        self.positions[:t].copy_(torch.from_numpy(plan.positions))
        self.batch_ids[:t].copy_(torch.from_numpy(plan.batch_ids.astype(np.int64)))
        self.slots[:b].copy_(torch.from_numpy(plan.slots.astype(np.int64)))
        self.block_tables.fill_(-1)
        self.block_tables[:b, :w].copy_(torch.from_numpy(plan.block_tables.astype(np.int64)))
        for name in (
            "forward_start",
            "forward_end",
            "cached_until",
            "swa_cached_until",
            "swa_replay_start",
            "encoder_window_floor",
            "tail_start",
            "last_rows",
        ):
            getattr(self, name)[:b].copy_(torch.from_numpy(getattr(plan, name).astype(np.int64)))


@dataclass
class StepOutput:
    """What a forward returns."""

    logits: torch.Tensor
    """``[running_bs, vocab]`` at each request's last row (zeros for padding requests)."""
    row_logits: torch.Tensor | None
    """``[running_tokens, vocab]`` at every row when asked for (decoder replay off only)."""


@dataclass
class _Frame:
    """The rows one graph stage runs, gathered once (or every row of the width, in place)."""

    rows: torch.Tensor
    """Flat row of each frame row ``[n]``."""
    loc: torch.Tensor
    """Frame row of each flat row ``[t]`` (-1 outside the frame)."""
    X: torch.Tensor
    pre: torch.Tensor
    pos: torch.Tensor
    bid: torch.Tensor
    b: torch.Tensor
    slot: torch.Tensor
    pages: torch.Tensor
    kv: torch.Tensor
    """This stage's window-KV rows of the current layer ``[n, d]``."""

    @classmethod
    def of(cls, S, t, X, pre, pos, bid, slot, pages, d, dtype) -> _Frame:
        """Gather rows ``S`` (None: every row, aliasing the full tensors)."""
        dev = X.device
        if S is None:
            rows = torch.arange(t, device=dev)
            kv = torch.zeros(t, d, dtype=dtype, device=dev)
            return cls(rows, rows, X, pre, pos, bid, bid.clamp(min=0), slot, pages, kv)
        loc = torch.full((t,), -1, dtype=torch.long, device=dev)
        loc[S] = torch.arange(S.numel(), device=dev)
        fb = bid[S]
        kv = torch.zeros(S.numel(), d, dtype=dtype, device=dev)
        return cls(S, loc, X[S], pre[S], pos[S], fb, fb.clamp(min=0), slot[S], pages[S], kv)


class RuntimeModel:
    """The paged V4.1 model over ``Pools`` for one (kv_cache_dtype, index_cache_dtype) pair."""

    def __init__(
        self,
        cache_spec: CacheSpec,
        weights: dict[str, torch.Tensor],
        engram,
        *,
        kv_cache_dtype: str = "bf16",
        index_cache_dtype: str = "fp8",
        num_pages: int = 64,
        num_slots: int = 4,
        max_tokens: int = 512,
        max_bs: int = 8,
        table_width: int = 32,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        cfg: ModelConfig | None = None,
        backend=None,
        tp: TPGroup = SINGLE,
    ):
        check_formats(kv_cache_dtype, index_cache_dtype)
        self.spec = cache_spec
        self.cfg = cfg = cfg or config_from_cache_spec(cache_spec)
        self.geometry = cache_spec.geometry(kv_cache_dtype, index_cache_dtype)
        self.index_fmt = "fp8" if index_cache_dtype == "fp8" else None
        self.dtype, self.acc, self.device = dtype, acc_dtype(dtype), torch.device(device)
        self.backend = backend or TorchBackend()
        self.tp = tp
        """Tensor-parallel group; ``weights`` are then this rank's shard (``tp.shard_weights``)."""
        self.pools = Pools(self.geometry, num_pages, num_slots, device)
        self.buf = StepBuffers.allocate(max_tokens, max_bs, table_width, self.device)
        self.engram = engram
        w = weights
        self.embed = w["embed.weight"]
        self.norm = w["norm.weight"]
        self.head = w["head.weight"].to(self.acc)
        self.attn, self.moe, self.hc_attn, self.hc_ffn, self.attn_norm, self.ffn_norm = (
            [],
            [],
            [],
            [],
            [],
            [],
        )
        self.engram_layers: dict[int, EngramLayer] = {}
        for info in cfg.layers:
            p = f"layers.{info.index}"
            self.attn.append(Attention(cfg, info, w, p, dtype, tp=tp))
            self.moe.append(MoE(cfg, w, p, dtype, tp=tp))
            self.hc_attn.append(
                HcParams(*(w[f"{p}.hc_attn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.hc_ffn.append(
                HcParams(*(w[f"{p}.hc_ffn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.attn_norm.append(w[f"{p}.attn_norm.weight"])
            self.ffn_norm.append(w[f"{p}.ffn_norm.weight"])
            if info.engram:
                self.engram_layers[info.index] = EngramLayer(cfg, w, p, dtype)
        self.row_counts: Counter = Counter()
        """Rows each ``(layer, sub_step)`` ran, summed over forwards (the replay row-count
        check)."""
        self.selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[running_tokens, index_topk]`` per index source in the last forward (-1 on
        rows that did not select)."""
        self._routed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._width = 0
        self.forced_selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[running_tokens, index_topk]`` by flat row to use instead of the
        scorer's, per index source (teacher forcing, as ``ReferenceModel.forced_selections``);
        Reuse layers inherit it. The candidate mask still comes from the scores."""
        self.forced_experts: dict[int, torch.Tensor] = {}
        """Routed expert ids ``[running_tokens, num_experts_per_tok]`` by flat row to use instead
        of the router's, per layer."""

    @property
    def experts(self) -> dict[int, torch.Tensor]:
        """Routed expert ids ``[running_tokens, num_experts_per_tok]`` per layer in the last
        forward (-1 on rows that did not run the layer's FFN); built when read, so a forward
        (or a captured graph) launches nothing for it."""
        out = {}
        for L, (rows, ids) in self._routed.items():
            ex = torch.full((self._width, ids.shape[1]), -1, dtype=torch.long, device=ids.device)
            ex[rows] = ids
            out[L] = ex
        return out

    @classmethod
    def from_checkpoint(
        cls,
        path,
        cache_spec: CacheSpec,
        *,
        kv_cache_dtype: str = "bf16",
        index_cache_dtype: str = "fp8",
        dtype: torch.dtype = torch.float32,
        **kw,
    ) -> RuntimeModel:
        """Load a checkpoint directory; the format pair is refused before any weight is read."""
        check_formats(kv_cache_dtype, index_cache_dtype)
        from v41plan.model.checkpoint import load_checkpoint

        ckpt = load_checkpoint(path, cache_spec, dtype=dtype, device=kw.get("device", "cpu"))
        return cls(
            cache_spec,
            ckpt.weights,
            ckpt.engram_host(),
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
            dtype=dtype,
            cfg=ckpt.config,
            **kw,
        )

    # ------------------------------------------------------------------------------------
    def _index_planes(self, owner: int) -> tuple[torch.Tensor, ...]:
        p = self.pools
        return (
            (p.index[owner],)
            if owner in p.index
            else (p.index_values[owner], p.index_scales[owner])
        )

    def _rows(self, plan, layer: int, sub: str, t: int) -> torch.Tensor:
        """Flat rows of a sub-step: every row of the width when the plan runs all real rows."""
        arr = plan.layer_rows.get((layer, sub))
        if arr is None:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        self.row_counts[(layer, sub)] += len(arr)
        # layers share a handful of row arrays: copy each to the device once per forward
        key = ("all", t) if len(arr) == plan.scheduled_tokens else id(arr)
        hit = self._row_cache.get(key)
        if hit is None:
            if isinstance(key, tuple):
                hit = torch.arange(t, device=self.device)
            else:
                hit = torch.from_numpy(arr.astype(np.int64)).to(self.device)
            self._row_cache[key] = hit
        return hit

    def _engram_rows(self, plan, token_ids: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Host Engram preparation: row ids ``[T, n_layers, cols]`` and the committed cursors."""
        t, b = plan.running_tokens, plan.running_bs
        h = self.cfg.engram_max_ngram_size - 1
        cursors = np.zeros((b, 1 + h), dtype=np.int64)
        rows = None
        cur = self.pools.cursor.cpu().numpy()
        cu = plan.cu_seqlens_q
        for i in range(plan.scheduled_bs):  # host input preparation, once per request
            lo, hi = int(cu[i]), int(cu[i + 1])
            if plan.history_from_plan[i]:
                hist = plan.history_ids[i][::-1].copy()  # plan: oldest first; cursor: newest first
            else:
                hist = cur[int(plan.slots[i]), 1:].copy()
            r, new_hist = self.engram.prepare(token_ids[lo:hi], hist)
            if rows is None:
                rows = np.zeros((t,) + r.shape[1:], dtype=np.int64)
            rows[lo:hi] = r
            cursors[i, 0] = plan.forward_end[i]
            cursors[i, 1:] = new_hist
        return rows, cursors

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, plan, token_ids, *, all_row_logits: bool = False) -> StepOutput:
        """Run one planned forward over ``token_ids`` (``[scheduled_tokens]`` or the width)."""
        ids_np = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        t = plan.running_tokens
        if ids_np.shape[0] > t:
            raise ValueError(f"forward given {ids_np.shape[0]} rows but its step declares {t}")
        if ids_np.shape[0] < plan.scheduled_tokens:
            raise ValueError(
                f"forward given {ids_np.shape[0]} rows but its step schedules "
                f"{plan.scheduled_tokens}"
            )
        ids_full = np.zeros(t, dtype=np.int64)
        ids_full[: ids_np.shape[0]] = ids_np
        self._row_cache: dict = {}  # per forward: the plan's arrays stay alive, so ids are stable
        self.buf.load(plan)
        engram_rows, cursors = self._engram_rows(plan, ids_full)
        cfg, buf, pools, kb = self.cfg, self.buf, self.pools, self.backend
        pos = buf.positions[:t]
        bid = buf.batch_ids[:t]
        b = bid.clamp(min=0)
        slot_tok = torch.where(bid >= 0, buf.slots[b], -1)
        pages_tok = torch.where((bid >= 0).unsqueeze(1), buf.block_tables[b], -1)
        decode_graph = plan.graph_key[0] == "decode"

        X = self.embed[torch.from_numpy(ids_full).to(self.device)].to(self.dtype)
        X = X[:, None, :].expand(t, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre = torch.zeros(t, cfg.hc_mult, dtype=self.acc, device=self.device)
        pre[:, 0] = 1
        self.selections, self._routed, self._width = {}, {}, t
        cand: torch.Tensor | None = None
        eps = cfg.rms_norm_eps
        for stage in plan.stages:
            S = self._stage_rows(plan, stage, t)
            if S is not None and S.numel() == 0:
                continue  # a stage the plan runs on no row (the decoder of a non-final chunk)
            # the stage's rows gathered once (every row: the tensors themselves, updated in place)
            fr = _Frame.of(S, t, X, pre, pos, bid, slot_tok, pages_tok, cfg.head_dim, self.dtype)
            for L in range(stage.first_layer, stage.last_layer + 1):
                cand = self._layer(L, plan, fr, t, cand, decode_graph, engram_rows)
            if S is not None:
                X[S] = fr.X
                pre[S] = fr.pre

        last = buf.last_rows[: plan.running_bs]
        lr = last.clamp(min=0)
        x = rms_norm(hc_collapse(X[lr], pre[lr]), self.norm, eps)
        logits = F.linear(x.to(self.acc), self.head) * (last >= 0).unsqueeze(1)
        row_logits = None
        if all_row_logits:
            xa = rms_norm(hc_collapse(X, pre), self.norm, eps)
            row_logits = F.linear(xa.to(self.acc), self.head)
            if plan.decoder_replay:
                # Under decoder replay only the rows of requests that ran every layer (decode or a
                # full-rows scoring request) are defined; the rest read as NaN, never as numbers.
                bids = plan.batch_ids
                full = (plan.row_phase == 2)[np.maximum(bids, 0)] & (bids >= 0)
                undefined = torch.from_numpy(~full).to(self.device)
                row_logits = row_logits.masked_fill(undefined.unsqueeze(1), float("nan"))
        # positions and Engram history advance after the forward
        kb.cursor_write(
            pools.cursor,
            buf.slots[: plan.running_bs],
            torch.from_numpy(cursors).to(self.device),
            pools.sink_slot,
        )
        return StepOutput(logits, row_logits)

    # ------------------------------------------------------------------------------------
    def _stage_rows(self, plan, stage, t: int) -> torch.Tensor | None:
        """Flat rows a graph stage runs (the union of its layers' row sets), or None for every
        row of the width."""
        sets = [
            arr
            for (layer, _), arr in plan.layer_rows.items()
            if stage.first_layer <= layer <= stage.last_layer
        ]
        if any(len(arr) == plan.scheduled_tokens for arr in sets):
            return None
        rows = np.unique(np.concatenate(sets)) if sets else np.zeros(0, dtype=np.int64)
        return torch.from_numpy(rows.astype(np.int64)).to(self.device)

    def _layer(self, L, plan, fr, t, cand, decode_graph, engram_rows):
        """One layer over a stage's rows ``fr``; returns the candidate mask (flat rows)."""
        cfg, pools, kb = self.cfg, self.pools, self.backend
        eps = cfg.rms_norm_eps
        info = cfg.layers[L]
        at = fr.loc[self._rows(plan, L, "attention", t)]
        rw = fr.loc[self._rows(plan, L, "ring_write", t)]
        cp = fr.loc[self._rows(plan, L, "compress", t)] if info.role == "full" else rw[:0]
        ff = fr.loc[self._rows(plan, L, "ffn", t)]
        need = cp if cp.numel() >= rw.numel() else rw
        if need.numel() == 0:
            return cand
        n = fr.X.shape[0]
        loc = torch.full((n,), -1, dtype=torch.long, device=self.device)
        loc[need] = torch.arange(need.numel(), device=self.device)
        X, pre, pos = fr.X, fr.pre, fr.pos
        if info.engram and engram_rows is not None:
            li = cfg.engram_layer_ids.index(L)
            flat = fr.rows[need].cpu().numpy()
            codes, scales = self.engram.gather(li, engram_rows[flat, li])
            emb = dequant_fp8_blocks(codes, scales, self.dtype).to(self.device)
            X[need] = self.engram_layers[L](X[need], emb)
        att = self.attn[L]
        Xn = X[need]
        a_pre, a_post, a_C = hc_predict(
            Xn, self.hc_attn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
        )
        xin = rms_norm(hc_collapse(Xn, pre[need]), self.attn_norm[L], eps)
        cos, sin = att.rope.cos_sin(pos[need], self.dtype)
        rwl = loc[rw]
        fr.kv[rw] = att.window_kv(xin[rwl], cos[rwl], sin[rwl])
        ring = pools.ring(L)
        ring_from = self._ring_write_from(info, plan, fr.b, fr.bid)
        if decode_graph:  # decode: write the ring row first, then read the window from the ring
            kb.ring_write(ring, fr.kv[rw], fr.slot[rw], pos[rw], ring_from[rw], pools.sink_slot)
        if info.role == "full" and cp.numel():
            self._compress(L, att, plan, xin[loc[cp]], cp, fr)
        y = None
        if at.numel():
            y, cand = self._attention(
                L,
                info,
                att,
                xin[loc[at]],
                cos[loc[at]],
                sin[loc[at]],
                at,
                t,
                fr,
                cand,
                decode_graph,
            )
        if not decode_graph:  # prefill: the old ring rows stay until every query has read them
            kb.ring_write(ring, fr.kv[rw], fr.slot[rw], pos[rw], ring_from[rw], pools.sink_slot)
        if y is None:
            return cand
        atl = loc[at]
        X[at] = hc_expand(y, X[at], a_post[atl], a_C[atl])
        if ff.numel() == 0:
            return cand
        Xf = X[ff]
        f_pre, f_post, f_C = hc_predict(
            Xf, self.hc_ffn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
        )
        xf = rms_norm(hc_collapse(Xf, a_pre[loc[ff]]), self.ffn_norm[L], eps)
        flat_ff = fr.rows[ff]
        forced = self.forced_experts.get(L)
        yf, ids = self.moe[L](xf, None if forced is None else forced.to(self.device)[flat_ff])
        self._routed[L] = (flat_ff, ids)
        X[ff] = hc_expand(yf, Xf, f_post, f_C)
        pre[ff] = f_pre
        return cand

    # ------------------------------------------------------------------------------------
    def _ring_write_from(self, info, plan, b: torch.Tensor, bid: torch.Tensor) -> torch.Tensor:
        """Per row, the lowest position whose window KV a ring keeps: the request's last ``W``
        rows, at or past ``cached_until`` (the rows a backed-off forward recomputes stay as the
        rings hold them); a decoder layer replayed on a tail writes the whole tail."""
        buf, W = self.buf, self.cfg.sliding_window
        lo = buf.forward_end[b] - W
        keep_from = buf.cached_until[b]
        if info.segment == "decoder":
            keep_from = torch.where(buf.tail_start[b] >= 0, buf.forward_start[b], keep_from)
        return torch.where(bid >= 0, torch.maximum(lo, keep_from), torch.iinfo(torch.long).max)

    def _compress(self, L, att, plan, xin_cp, cp, fr) -> None:
        """Close every group of this owner's ratio in the batch in one call and store it."""
        pools, kb = self.pools, self.backend
        t, pos, bid = fr.X.shape[0], fr.pos, fr.bid
        r = att.ratio
        cpl = plan.compress[r]
        # the plan's groups, padded to the width with sentinel batch id -1 (a fixed shape)
        g_rows = torch.zeros(t, dtype=torch.long, device=self.device)
        g_b = torch.full((t,), -1, dtype=torch.long, device=self.device)
        g_c = torch.zeros(t, dtype=torch.long, device=self.device)
        n = len(cpl.rows)
        g_rows[:n] = fr.loc[torch.from_numpy(cpl.rows.astype(np.int64)).to(self.device)].clamp(
            min=0
        )
        g_b[:n] = torch.from_numpy(cpl.batch_ids.astype(np.int64))
        g_c[:n] = torch.from_numpy(cpl.compressed_rows.astype(np.int64))
        v, g = att.compress_project(xin_cp)
        v_full = torch.zeros(t, v.shape[1], dtype=v.dtype, device=self.device)
        v_full[cp] = v
        if r == 2:
            g_full = torch.zeros_like(v_full)
            g_full[cp] = g
            # A group's first member comes from the slot's tail when it lies below where the
            # rows that read the slot's state begin (the resume point of a backed-off forward,
            # else the forward's first row): the tail holds it exactly as an unreplayed run did.
            scu = self.buf.swa_cached_until[bid.clamp(min=0)]
            first = (pos % 2 == 1) & (pos - 1 < scu) & (pos >= scu) & (bid >= 0)
            store = torch.zeros(t, dtype=torch.bool, device=self.device)
            store[
                fr.loc[torch.from_numpy(cpl.tail_store_rows.astype(np.int64)).to(self.device)]
            ] = True
            ti = pools.tail_index[L]
            pv, ps = kb.compress_groups(
                v_full,
                g_full,
                pos,
                fr.slot,
                first,
                store,
                pools.tail_values[:, ti],
                pools.tail_scores[:, ti],
                pools.sink_slot,
            )
            latent = att.pool(pv[g_rows, 0], ps[g_rows, 0], pv[g_rows, 1], ps[g_rows, 1])
        else:
            latent = att.ratio1_latent(v_full[g_rows])
        cos, sin = att.rope.cos_sin(g_c * r, self.dtype)
        keys, key_scale = att.index_keys(latent, cos, sin, self.index_fmt)
        comp = att.compressed_kv(latent, cos, sin)
        addr = pools.row_address(L, self.buf.block_tables, g_b, g_c)
        keep = g_b >= 0
        kb.main_scatter(pools.main[L], comp, addr.page, addr.row, keep, pools.sink_page)
        kb.index_key_store(
            self._index_planes(L), keys, key_scale, addr.page, addr.row, keep, pools.sink_page
        )
        self.row_counts[(L, "compress_groups")] += n

    def _index_query(self, att, qr, x, cos, sin):
        """The index query before rounding (the scorer rounds it to its plane's grid)."""
        qi = apply_rope(att.idx_wq_b(qr).reshape(x.shape[0], att.nih, att.ihd), cos, sin)
        wts = F.linear(x, att.idx_weights_proj) * att.idx_scale
        return qi, wts

    def _attention(self, L, info, att, x, cos, sin, at, t, fr, cand, decode_graph):
        """Index selection and sparse attention of the query rows ``at`` (local to ``fr``);
        selections and the candidate mask are kept by flat row."""
        cfg, buf, pools, kb = self.cfg, self.buf, self.pools, self.backend
        W = cfg.sliding_window
        q, qr = att.q_path(x, cos, sin)
        pa, ba, bida = fr.pos[at], fr.b[at], fr.bid[at]
        flat = fr.rows[at]
        fs = buf.forward_start[ba]
        if decode_graph:
            window_lo = torch.zeros_like(pa)
            ring_until = pa + 1
        else:
            scu = buf.swa_cached_until[ba]
            floor = (
                buf.swa_replay_start[ba]
                if info.segment == "decoder"
                else buf.encoder_window_floor[ba]
            )
            above = pa >= scu
            ring_until = torch.where(above, scu, fs)
            window_lo = torch.where(above, floor, torch.maximum(floor, fs))
            if info.segment == "decoder":  # a replayed tail reads only its own rows
                ring_until = torch.where(buf.tail_start[ba] >= 0, fs, ring_until)
        keys, valid = kb.gather_window(
            pools.ring(L), fr.kv, at, fr.slot[at], pa, window_lo, ring_until, W
        )
        parts, masks = [keys], [valid]
        if info.ratio > 0:
            owner = info.kv_owner
            pages = fr.pages[at]
            if info.role in ("full", "reindex"):
                qi, wts = self._index_query(att, qr, x, cos, sin)
                bound = (pa + 1) // info.ratio
                planes = self._index_planes(owner)
                if L == cfg.candidate_source_layer_id:
                    ids, cmask = tp_score_candidates_topk(
                        kb,
                        self.tp,
                        planes,
                        qi,
                        wts,
                        bound,
                        pages,
                        cfg.index_topk,
                        cfg.candidate_block_size,
                        cfg.candidate_topk_blocks,
                    )
                    cand = torch.zeros(t, cmask.shape[1], dtype=torch.bool, device=self.device)
                    cand[flat] = cmask
                else:
                    use = cand[flat] if (info.role == "reindex" and info.uses_candidates) else None
                    ids = tp_score_topk(
                        kb, self.tp, planes, qi, wts, bound, pages, cfg.index_topk, use
                    )
                if L in self.forced_selections:
                    ids = self.forced_selections[L].to(self.device)[flat]
                sel = torch.full((t, cfg.index_topk), -1, dtype=torch.long, device=self.device)
                sel[flat] = ids
                self.selections[L] = sel
            else:
                ids = self.selections[info.topk_owner][flat]
            ids = torch.where((bida >= 0).unsqueeze(1), ids, -1)
            rows, ok = kb.gather_selected(
                pools.main[owner], ids, pages, pools.rows_per_page[owner], cfg.head_dim, self.dtype
            )
            parts.append(rows)
            masks.append(ok)
        kv = torch.cat(parts, 1)
        ok = torch.cat(masks, 1)
        nq, k = ok.shape
        idx = torch.where(ok, torch.arange(nq * k, device=self.device).view(nq, k), -1)
        o = sparse_attention(q, kv.reshape(nq * k, -1), idx, att.sink, att.scale)
        return att.output(o, cos, sin), cand
