"""CUDA-graph execution of decode steps: ``cudagraph_mode`` FULL and PIECEWISE.

A decode step runs every layer on every row, so its forward needs no per-step row sets:
``DecodeForward`` is the runtime model's decode arithmetic (the same weights, layer pieces and
backend ops, in the same order as ``RuntimeModel.forward``) written as pure tensor work on
fixed-address buffers at a declared width ``(bs, bs * q)``. Host work (the plan's arrays, the
Engram row lookup, the cursor values) happens in ``DecodeForward.load`` before the forward;
padding rows carry the planner's sentinels (batch id -1, slot -1, last row -1) and every
scatter redirects them to the pools' sink rows.

- FULL: ``GraphRunner`` captures the whole decode forward once per capture bucket
  ``(bs, q)`` (the spec's ``capture`` lists, filtered by ``max_num_seqs`` and
  ``max_num_batched_tokens``); a decode step pads to the smallest bucket that holds it and is
  one replay. Larger batches run eager (logged and counted).
- PIECEWISE: per layer and width, the dense piece before attention (Engram, mHC, norms, q and
  window-KV projections) and the dense piece after it (output projection, mHC, MoE) are graphs;
  ring writes, compression, index scoring and sparse attention run eager between them.

Capture binds the serving pools: synthetic requests in STATE slots ``[0, bs)`` naming PAGE 0 in
every block-table entry, starting behind a full window. Every page from ``ceil((W + q) /
page_tokens)`` on and every slot from the largest bucket on is checked byte-identical across
warm-up and capture, then the whole pool is restored. A warm-up runs every captured width
eagerly first; capture runs under ``capture_guard``: a host sync (``set_sync_debug_mode
("error")``), a first Triton compile or a caching-allocator segment created outside the graph
pool fails the capture. A primer capture of the smallest width runs first (checked for syncs and
compiles) and takes the one-time allocations a process's first capture makes outside the pool
(on the H200 one 2 MiB default-pool segment); the capture report lists them.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.model.layers import hc_collapse, hc_expand, hc_predict, rms_norm, sparse_attention
from v41plan.model.quant import dequant_fp8_blocks
from v41plan.runtime.collectives import tp_score_candidates_topk, tp_score_topk

log = logging.getLogger(__name__)


class CaptureGuardError(RuntimeError):
    """A capture saw what a replay would not repeat (a host sync, a first compile), or changed
    bytes it must leave alone."""


# ---------------------------------------------------------------------------------------------
# buckets
def capture_buckets(spec, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The ``(bs, q)`` buckets captured for ``spec``: its capture lists, keeping ``bs <=
    max_num_seqs`` and ``bs * q <= max_num_batched_tokens`` (the static buffers' width)."""
    cap = spec.capture
    out = sorted(
        {
            (bs, q)
            for bs in cap.batch_sizes
            for q in cap.query_buckets
            if bs <= max_num_seqs and bs * q <= max_num_batched_tokens
        }
    )
    dropped = [bs for bs in cap.batch_sizes if bs > max_num_seqs]
    if dropped:
        log.warning(
            "capture sizes %s exceed max_num_seqs=%d and are not captured", dropped, max_num_seqs
        )
    return out


def select_bucket(buckets, num_requests: int, rows_per_request: int) -> tuple[int, int] | None:
    """The smallest captured ``(bs, q)`` with ``bs >= num_requests`` and ``q >= rows_per_request``
    (fewest padded rows), or None when the step is larger than every bucket."""
    fits = [(bs * q, bs, q) for bs, q in buckets if bs >= num_requests and q >= rows_per_request]
    if not fits:
        return None
    _, bs, q = min(fits)
    return bs, q


def pad_decode_step(step, bucket: tuple[int, int], table_width: int):
    """A decode ``StepInput`` padded to ``bucket``: ``running_bs = bs``, ``running_tokens = bs * q``
    and the model's block-table width (so every replay reads one fixed shape)."""
    bs, q = bucket
    return replace(step, running_bs=bs, running_tokens=bs * q, block_table_width=table_width)


# ---------------------------------------------------------------------------------------------
# capture guard
def _segments() -> list[dict]:
    """The caching allocator's segments (address, pool id when reported, size, stream)."""
    return torch.cuda.memory_snapshot()


_JIT_FUNCTIONS: list = []


def find_triton_kernels() -> int:
    """Record this process's Triton JIT functions (one heap walk; call after imports and
    warm-up). Returns how many there are (0 without Triton or with only torch kernels)."""
    import sys

    _JIT_FUNCTIONS.clear()
    if "triton" not in sys.modules:
        return 0
    import gc

    from triton.runtime.jit import JITFunction

    _JIT_FUNCTIONS.extend(o for o in gc.get_objects() if isinstance(o, JITFunction))
    return len(_JIT_FUNCTIONS)


def _triton_cache_size() -> int:
    """Compiled variants held by the recorded Triton JIT functions."""
    total = 0
    for fn in _JIT_FUNCTIONS:
        caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", None) or {}
        for v in caches.values():
            v = v[0] if isinstance(v, tuple) else v
            total += len(v) if hasattr(v, "__len__") else 1
    return total


@contextmanager
def capture_guard(what: str, pool=None, record: list | None = None, refuse_outside: bool = True):
    """Fail loudly on a host sync, a first compile or (with ``pool`` given and ``refuse_outside``)
    a caching-allocator segment created outside the graph pool ``pool`` inside the block (a
    capture): each would be frozen into, missing from, or leaked past every replay. Segments the
    block creates are appended to ``record``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as the capture's own entry does, so the comparison below is stable
    before = {seg["address"] for seg in _segments()}
    compiled = _triton_cache_size()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        raise CaptureGuardError(
            f"capture of {what} failed (a host sync or a non-capturable op "
            f"inside the decode forward): {exc}"
        ) from exc
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if _triton_cache_size() != compiled:
        raise CaptureGuardError(
            f"capture of {what} compiled a kernel for the first time (warm-up missed it)"
        )
    if record is not None or pool is not None:
        record = record if record is not None else []
        new = [seg for seg in _segments() if seg["address"] not in before]
        ids = [tuple(seg["segment_pool_id"]) if "segment_pool_id" in seg else None for seg in new]
        outside = [
            (i, seg["total_size"])
            for i, seg in zip(ids, new, strict=True)
            if pool is not None and i is not None and i != tuple(pool)
        ]
        record.append(
            {
                "what": what,
                "new_segments": len(new),
                "pool_ids_reported": all(i is not None for i in ids),
                "outside_pool": outside,
            }
        )
        if outside and refuse_outside:
            raise CaptureGuardError(
                f"capture of {what} allocated outside the graph pool {tuple(pool)}: "
                f"{outside} (pool id, bytes)"
            )


# ---------------------------------------------------------------------------------------------
@dataclass
class DecodeBuffers:
    """Static inputs of a decode forward beyond the model's ``StepBuffers`` (fixed addresses)."""

    token_ids: torch.Tensor
    """``[max_tokens]`` long."""
    cursors: torch.Tensor
    """``[max_bs, 1 + history]`` long: each request's committed ``[position, history...]``."""
    rows: torch.Tensor
    """``[max_tokens]`` long: ``arange`` (flat row ids)."""
    engram_codes: list[torch.Tensor]
    """Per Engram layer ``[max_tokens, cols, width]`` E4M3 rows, prepared on the host."""
    engram_scales: list[torch.Tensor]
    """Per Engram layer ``[max_tokens, cols, width/32]`` E8M0 scales."""


@dataclass
class _Width:
    """Views of the static buffers at one declared width, and the residual stream state."""

    t: int
    b: int
    pos: torch.Tensor
    bid: torch.Tensor
    b_: torch.Tensor
    slot_tok: torch.Tensor
    pages_tok: torch.Tensor
    X: torch.Tensor
    pre: torch.Tensor
    o: torch.Tensor


class DecodeForward:
    """The runtime model's decode forward as fixed-shape tensor work (capturable).

    Results equal ``RuntimeModel.forward`` on decode plans (same pieces, same order); row sets
    are implicit: every row runs every layer, padding rows write only the sinks.
    """

    def __init__(self, model):
        self.model = m = model
        cfg = m.cfg
        T, B = m.buf.positions.shape[0], m.buf.slots.shape[0]
        dev = m.device
        h = cfg.engram_max_ngram_size - 1
        codes, scales = [], []
        if cfg.engram_layer_ids and m.engram.tables:
            rows, _ = m.engram.prepare(np.zeros(1, dtype=np.int64), None)  # [1, layers, cols]
            for tab in m.engram.tables:
                c, s = tab.read(rows[:, 0])  # one row: the dtypes and widths of the table
                codes.append(torch.zeros(T, *c.shape[1:], dtype=c.dtype, device=dev))
                scales.append(torch.zeros(T, *s.shape[1:], dtype=s.dtype, device=dev))
        self.buf = DecodeBuffers(
            token_ids=torch.zeros(T, dtype=torch.long, device=dev),
            cursors=torch.zeros(B, 1 + h, dtype=torch.long, device=dev),
            rows=torch.arange(T, device=dev),
            engram_codes=codes,
            engram_scales=scales,
        )
        self.X = torch.zeros(T, cfg.hc_mult, cfg.hidden_size, dtype=m.dtype, device=dev)
        self.pre = torch.zeros(T, cfg.hc_mult, dtype=m.acc, device=dev)
        self.o = torch.zeros(T, cfg.num_attention_heads, cfg.head_dim, dtype=m.dtype, device=dev)
        self.kv = torch.zeros(T, cfg.head_dim, dtype=m.dtype, device=dev)

    # -- host side ------------------------------------------------------------------------
    def load(self, plan, token_ids) -> None:
        """Copy a decode plan, its token ids, Engram rows and cursor values into the buffers."""
        m = self.model
        if m.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CaptureGuardError(
                "decode inputs are prepared on the host, never while a stream is capturing"
            )
        if plan.graph_key[0] != "decode":
            raise ValueError(f"the decode forward runs decode steps only, not {plan.graph_key[0]}")
        t, b = plan.running_tokens, plan.running_bs
        ids = np.zeros(t, dtype=np.int64)
        raw = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if raw.shape[0] < plan.scheduled_tokens or raw.shape[0] > t:
            raise ValueError(
                f"decode forward given {raw.shape[0]} rows for a step of "
                f"{plan.scheduled_tokens} scheduled / {t} declared rows"
            )
        ids[: raw.shape[0]] = raw
        m.buf.load(plan)
        rows, cursors = m._engram_rows(plan, ids)  # host Engram preparation (reads the cursors)
        self.buf.token_ids[:t].copy_(torch.from_numpy(ids))
        self.buf.cursors[:b].copy_(torch.from_numpy(cursors))
        if rows is not None:
            for li in range(len(self.buf.engram_codes)):
                c, s = m.engram.gather(li, rows[:, li])
                self.buf.engram_codes[li][:t].copy_(c)
                self.buf.engram_scales[li][:t].copy_(s)

    # -- device side (pure tensor work) ---------------------------------------------------------
    def width(self, t: int, b: int) -> _Width:
        """Views at width ``(b requests, t rows)`` with the token-level addressing built."""
        buf = self.model.buf
        pos, bid = buf.positions[:t], buf.batch_ids[:t]
        b_ = bid.clamp(min=0)
        slot_tok = torch.where(bid >= 0, buf.slots[b_], -1)
        pages_tok = torch.where((bid >= 0).unsqueeze(1), buf.block_tables[b_], -1)
        return _Width(t, b, pos, bid, b_, slot_tok, pages_tok, self.X[:t], self.pre[:t], self.o[:t])

    def embed(self, w: _Width) -> None:
        """Initial residual streams and mHC ``pre``."""
        m = self.model
        x = m.embed[self.buf.token_ids[: w.t]].to(m.dtype)
        w.X.copy_(x[:, None, :].expand_as(w.X))
        w.pre.zero_()
        w.pre[:, 0] = 1

    def pre_attention(self, L: int, w: _Width):
        """Dense piece before attention: Engram, mHC prediction and collapse, norm, q and window
        KV."""
        m, cfg = self.model, self.model.cfg
        info = cfg.layers[L]
        eps = cfg.rms_norm_eps
        X = w.X
        if info.engram and self.buf.engram_codes:
            li = cfg.engram_layer_ids.index(L)
            emb = dequant_fp8_blocks(
                self.buf.engram_codes[li][: w.t], self.buf.engram_scales[li][: w.t], m.dtype
            )
            X.copy_(m.engram_layers[L](X, emb))
        att = m.attn[L]
        a_pre, a_post, a_C = hc_predict(
            X, m.hc_attn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
        )
        xin = rms_norm(hc_collapse(X, w.pre), m.attn_norm[L], eps)
        cos, sin = att.rope.cos_sin(w.pos, m.dtype)
        kv = att.window_kv(xin, cos, sin)
        q, qr = att.q_path(xin, cos, sin)
        return a_pre, a_post, a_C, xin, cos, sin, kv, q, qr

    def attention(self, L: int, w: _Width, pieces, cand, selections) -> torch.Tensor:
        """Pool work of one layer: ring write, compression, index selection, sparse attention.
        Writes the attention output into ``w.o`` and returns the candidate mask."""
        m, cfg = self.model, self.model.cfg
        info = cfg.layers[L]
        pools, kb, buf = m.pools, m.backend, m.buf
        _, _, _, xin, cos, sin, kv, q, qr = pieces
        att = m.attn[L]
        t, pos, bid, b_ = w.t, w.pos, w.bid, w.b_
        W = cfg.sliding_window
        # ring write first (decode reads its own row from the ring)
        lo = buf.forward_end[b_] - W
        ring_from = torch.where(
            bid >= 0, torch.maximum(lo, buf.cached_until[b_]), torch.iinfo(torch.long).max
        )
        ring = pools.ring(L)
        kb.ring_write(ring, kv, w.slot_tok, pos, ring_from, pools.sink_slot)
        if info.role == "full":
            self._compress(L, att, w, xin)
        keys, valid = kb.gather_window(
            ring, kv, self.buf.rows[:t], w.slot_tok, pos, torch.zeros_like(pos), pos + 1, W
        )
        parts, masks = [keys], [valid]
        if info.ratio > 0:
            owner = info.kv_owner
            pages = w.pages_tok
            if info.role in ("full", "reindex"):
                qi, wts = m._index_query(att, qr, xin, cos, sin)
                bound = (pos + 1) // info.ratio
                planes = m._index_planes(owner)
                if L == cfg.candidate_source_layer_id:
                    ids, cand = tp_score_candidates_topk(
                        kb,
                        m.tp,
                        planes,
                        qi,
                        wts,
                        bound,
                        pages,
                        cfg.index_topk,
                        cfg.candidate_block_size,
                        cfg.candidate_topk_blocks,
                    )
                else:
                    use = cand if (info.role == "reindex" and info.uses_candidates) else None
                    ids = tp_score_topk(
                        kb, m.tp, planes, qi, wts, bound, pages, cfg.index_topk, use
                    )
                selections[L] = ids
            else:
                ids = selections[info.topk_owner]
            ids = torch.where((bid >= 0).unsqueeze(1), ids, -1)
            rows, ok = kb.gather_selected(
                pools.main[owner], ids, pages, pools.rows_per_page[owner], cfg.head_dim, m.dtype
            )
            parts.append(rows)
            masks.append(ok)
        kvs = torch.cat(parts, 1)
        ok = torch.cat(masks, 1)
        nq, k = ok.shape
        idx = torch.where(ok, torch.arange(nq * k, device=ok.device).view(nq, k), -1)
        w.o.copy_(sparse_attention(q, kvs.reshape(nq * k, -1), idx, att.sink, att.scale))
        return cand

    def _compress(self, L: int, att, w: _Width, xin: torch.Tensor) -> None:
        """Every row's group: a group closes on its last member; ratio 2 pairs through the tails."""
        m = self.model
        pools, kb, buf = m.pools, m.backend, m.buf
        r = att.ratio
        pos, bid = w.pos, w.bid
        v, g = att.compress_project(xin)
        real = bid >= 0
        if r == 2:
            first = real & (pos == buf.forward_start[w.b_])
            last = real & (self.buf.rows[: w.t] == buf.last_rows[w.b_])
            ti = pools.tail_index[L]
            pv, ps = kb.compress_groups(
                v,
                g,
                pos,
                w.slot_tok,
                first,
                last,
                pools.tail_values[:, ti],
                pools.tail_scores[:, ti],
                pools.sink_slot,
            )
            latent = att.pool(pv[:, 0], ps[:, 0], pv[:, 1], ps[:, 1])
            closes = real & ((pos + 1) % 2 == 0)
        else:
            latent = att.ratio1_latent(v)
            closes = real
        g_b = torch.where(closes, bid.to(torch.long), -1)
        g_c = torch.where(closes, pos // r, 0)
        cos, sin = att.rope.cos_sin(g_c * r, m.dtype)
        keys, key_scale = att.index_keys(latent, cos, sin, m.index_fmt)
        comp = att.compressed_kv(latent, cos, sin)
        addr = pools.row_address(L, buf.block_tables, g_b, g_c)
        keep = g_b >= 0
        kb.main_scatter(pools.main[L], comp, addr.page, addr.row, keep, pools.sink_page)
        kb.index_key_store(
            m._index_planes(L), keys, key_scale, addr.page, addr.row, keep, pools.sink_page
        )

    def post_attention(self, L: int, w: _Width, pieces) -> None:
        """Dense piece after attention: output projection, mHC expand, FFN (MoE); updates
        ``X``/``pre``."""
        m, cfg = self.model, self.model.cfg
        eps = cfg.rms_norm_eps
        a_pre, a_post, a_C, _, cos, sin, _, _, _ = pieces
        y = m.attn[L].output(w.o, cos, sin)
        X = hc_expand(y, w.X, a_post, a_C)
        f_pre, f_post, f_C = hc_predict(
            X, m.hc_ffn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
        )
        xf = rms_norm(hc_collapse(X, a_pre), m.ffn_norm[L], eps)
        yf, _ = m.moe[L](xf)
        w.X.copy_(hc_expand(yf, X, f_post, f_C))
        w.pre.copy_(f_pre)

    def head(self, w: _Width) -> torch.Tensor:
        """Logits ``[b, vocab]`` at each request's last row (zeros for padding), then the cursor
        commit."""
        m = self.model
        last = m.buf.last_rows[: w.b]
        lr = last.clamp(min=0)
        x = rms_norm(hc_collapse(w.X[lr], w.pre[lr]), m.norm, m.cfg.rms_norm_eps)
        logits = F.linear(x.to(m.acc), m.head) * (last >= 0).unsqueeze(1)
        m.backend.cursor_write(
            m.pools.cursor, m.buf.slots[: w.b], self.buf.cursors[: w.b], m.pools.sink_slot
        )
        return logits

    @torch.no_grad()
    def run(self, t: int, b: int) -> torch.Tensor:
        """The whole decode forward at width ``(b, t)`` on the loaded buffers (what FULL
        captures)."""
        w = self.width(t, b)
        self.embed(w)
        cand, selections = None, {}
        for info in self.model.cfg.layers:
            pieces = self.pre_attention(info.index, w)
            cand = self.attention(info.index, w, pieces, cand, selections)
            self.post_attention(info.index, w, pieces)
        return self.head(w)

    @torch.no_grad()
    def forward(self, plan, token_ids) -> torch.Tensor:
        """Load and run eagerly: logits ``[running_bs, vocab]`` (the CPU path and the warm-up)."""
        self.load(plan, token_ids)
        return self.run(plan.running_tokens, plan.running_bs)


# ---------------------------------------------------------------------------------------------
def synthetic_plan(model, spec, bs: int, q: int):
    """The capture step: ``bs`` decode requests in slots ``[0, bs)``, every block-table entry
    PAGE 0, each starting behind a full window (``position = W``)."""
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    W = spec.dims.sliding_window
    width = model.buf.block_tables.shape[1]
    reqs = tuple(
        RequestInput(
            slot=i, block_table=(0,) * width, prompt_len=W, start=W, chunk_len=q, phase="decode"
        )
        for i in range(bs)
    )
    return plan_step(
        StepInput(reqs, running_bs=bs, running_tokens=bs * q, block_table_width=width), spec
    )


class GraphRunner:
    """Captured decode graphs for one runtime model (FULL or PIECEWISE) and their replay."""

    def __init__(self, model, spec, buckets, mode: str = "FULL"):
        if mode not in ("FULL", "PIECEWISE"):
            raise ValueError(
                f"cudagraph_mode={mode!r} has no graphs to capture; accepted: FULL, PIECEWISE"
            )
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.spec, self.mode = model, spec, mode
        self.buckets = list(buckets)
        self.decode = DecodeForward(model)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pieces: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.stats: Counter = Counter()
        self.report: dict = {}
        self.pool = None
        self.allocations: list[dict] = []
        """Per capture: segments it created and those outside the graph pool (see
        ``capture_guard``)."""
        self.primer_allocations: list[dict] = []
        """The same for the primer capture (see ``_prime``)."""
        self._primer = None

    # -- capture ------------------------------------------------------------------------------
    def capture(self) -> dict:
        """Warm up every width, capture every bucket under the guard, check the untouched pages
        and slots, restore the pools; returns the capture report."""
        m, spec = self.model, self.spec
        pools = m.pools
        before = pools.backing.clone()
        W = spec.dims.sliding_window
        P = pools.geometry.page_tokens
        max_q = max(q for _, q in self.buckets)
        max_bs = max(bs for bs, _ in self.buckets)
        for bs, q in self.buckets:  # warm-up: every kernel at every width runs once before capture
            self.decode.forward(synthetic_plan(m, spec, bs, q), np.zeros(bs * q, dtype=np.int64))
        torch.cuda.synchronize()
        find_triton_kernels()
        self.pool = torch.cuda.graph_pool_handle()
        self._prime()
        for bs, q in sorted(
            self.buckets, reverse=True
        ):  # largest first: smaller ones reuse its pool
            plan = synthetic_plan(m, spec, bs, q)
            self.decode.load(plan, np.zeros(bs * q, dtype=np.int64))
            if self.mode == "FULL":
                self._capture_full(bs, q)
            else:
                self._capture_pieces(bs, q)
        torch.cuda.synchronize()
        first_page = math.ceil((W + max_q) / P)
        after = pools.backing
        untouched_pages = self._pages_equal(before, after, first_page)
        s0, _ = pools.state_region
        sb = pools.geometry.state_bytes
        untouched_slots = bool(torch.equal(before[s0 + max_bs * sb :], after[s0 + max_bs * sb :]))
        pools.backing.copy_(before)
        del before
        self.report = {
            "mode": self.mode,
            "graph_shapes": [[bs, q, bs * q] for bs, q in self.buckets],
            "graphs": len(self.graphs) + len(self.pieces),
            "untouched_from_page": first_page,
            "pages_untouched": untouched_pages,
            "slots_untouched_from": max_bs,
            "slots_untouched": untouched_slots,
            "primer_segments_outside_graph_pool": [
                o for a in self.primer_allocations for o in a["outside_pool"]
            ],
            "new_segments_in_capture": sum(a["new_segments"] for a in self.allocations),
            "segments_outside_graph_pool": [o for a in self.allocations for o in a["outside_pool"]],
            "pool_ids_reported": all(a["pool_ids_reported"] for a in self.allocations),
        }
        if not (untouched_pages and untouched_slots):
            raise CaptureGuardError(f"capture changed bytes it must not touch: {self.report}")
        return self.report

    def _pages_equal(self, before: torch.Tensor, after: torch.Tensor, first_page: int) -> bool:
        """Every PAGE unit from ``first_page`` on (main page and its index-plane slices) is
        unchanged."""
        pools = self.model.pools
        g = pools.geometry
        lo, n = pools.page_region
        if not torch.equal(
            before[lo + first_page * g.page_bytes : lo + n],
            after[lo + first_page * g.page_bytes : lo + n],
        ):
            return False
        for pl in g.planes:
            if pl.kind == "main":
                continue
            base = pools._plane_regions[pl.name]
            end = base + (pools.num_pages + 1) * pl.bytes_per_page
            start = base + first_page * pl.bytes_per_page
            if not torch.equal(before[start:end], after[start:end]):
                return False
        return True

    def _prime(self) -> None:
        """Capture the smallest width once, unreplayed and kept alive, before the guarded captures.

        The first capture of a process (or after every graph was freed) makes one-time allocations
        outside the graph pool: torch's graph-safe RNG state (``CUDAGeneratorState::register_graph``
        in ``capture_begin``, one 2 MiB default-pool segment on the H200, found with
        ``scripts/gpu_capture_probe.py``). The primer takes them, still checked for
        host syncs and first compiles, and reports them as ``primer_segments_outside_graph_pool``;
        every serving graph captured after it must allocate inside the pool or fail."""
        bs, q = min(self.buckets)
        d = self.decode
        w = None if self.mode == "FULL" else d.width(bs * q, bs)
        L = self.model.cfg.layers[0].index
        self._primer = torch.cuda.CUDAGraph()
        with (
            torch.no_grad(),
            capture_guard(
                f"primer[bs={bs}, q={q}]", self.pool, self.primer_allocations, refuse_outside=False
            ),
            torch.cuda.graph(self._primer, pool=self.pool),
        ):
            if w is None:
                d.run(bs * q, bs)
            else:
                d.pre_attention(L, w)

    def _capture_full(self, bs: int, q: int) -> None:
        g = torch.cuda.CUDAGraph()
        t = bs * q
        with (
            capture_guard(f"decode[bs={bs}, q={q}]", self.pool, self.allocations),
            torch.cuda.graph(g, pool=self.pool),
        ):
            out = self.decode.run(t, bs)
        self.graphs[(bs, q)] = g
        self.outputs[(bs, q)] = out

    def _capture_pieces(self, bs: int, q: int) -> None:
        d = self.decode
        t = bs * q
        w = d.width(t, bs)
        with torch.no_grad():
            for info in self.model.cfg.layers:
                L = info.index
                g = torch.cuda.CUDAGraph()
                with (
                    capture_guard(f"layer {L} pre[t={t}]", self.pool, self.allocations),
                    torch.cuda.graph(g, pool=self.pool),
                ):
                    pieces = d.pre_attention(L, w)
                self.pieces[(bs, q, f"pre{L}")] = (g, pieces)
                g2 = torch.cuda.CUDAGraph()
                with (
                    capture_guard(f"layer {L} post[t={t}]", self.pool, self.allocations),
                    torch.cuda.graph(g2, pool=self.pool),
                ):
                    d.post_attention(L, w, pieces)
                self.pieces[(bs, q, f"post{L}")] = (g2, None)

    # -- replay --------------------------------------------------------------------------------
    def bucket_of(self, plan) -> tuple[int, int] | None:
        """The captured bucket a plan was padded to (None: not a captured decode width)."""
        if plan.graph_key[0] != "decode" or plan.running_bs == 0:
            return None
        q = plan.running_tokens // plan.running_bs
        key = (plan.running_bs, q)
        if plan.running_tokens != plan.running_bs * q:
            return None
        if self.mode == "FULL":
            return key if key in self.graphs else None
        return key if (key[0], key[1], "pre0") in self.pieces else None

    @torch.no_grad()
    def replay(self, plan, token_ids) -> torch.Tensor:
        """Run a padded decode plan: one replay (FULL) or per-layer pieces with eager attention
        (PIECEWISE). Returns logits ``[running_bs, vocab]``."""
        key = self.bucket_of(plan)
        if key is None:
            raise ValueError(f"no captured graph for {plan.graph_key}")
        d = self.decode
        d.load(plan, token_ids)
        bs, q = key
        if self.mode == "FULL":
            self.graphs[key].replay()
            self.stats["replays"] += 1
            self.stats["graph_steps"] += 1
            return self.outputs[key].clone()
        w = d.width(bs * q, bs)
        d.embed(w)
        cand, selections = None, {}
        for info in self.model.cfg.layers:
            L = info.index
            g, pieces = self.pieces[(bs, q, f"pre{L}")]
            g.replay()
            cand = d.attention(L, w, pieces, cand, selections)
            self.pieces[(bs, q, f"post{L}")][0].replay()
            self.stats["replays"] += 2
        self.stats["graph_steps"] += 1
        return d.head(w)


def build_graph_runner(model, spec, options) -> GraphRunner | None:
    """The graph runner an engine's options ask for (None under eager execution), captured."""
    mode = str(options.cudagraph_mode).upper()
    if options.enforce_eager or mode == "NONE":
        return None
    if model.device.type != "cuda":
        log.warning("cudagraph_mode=%s needs CUDA; running eager on %s", mode, model.device)
        return None
    buckets = capture_buckets(
        spec, options.max_num_seqs, max(options.max_num_batched_tokens, options.max_num_seqs)
    )
    runner = GraphRunner(model, spec, buckets, mode)
    runner.capture()
    return runner


def graph_forward(
    graphs: GraphRunner | None, model, plan, token_ids, *, all_row_logits: bool = False
):
    """One planned forward: a replay when ``plan`` is a captured decode width, else eager
    ``model.forward`` (an uncaptured decode width is logged and counted)."""
    from v41plan.runtime.paged_model import StepOutput

    if graphs is not None and not all_row_logits and graphs.bucket_of(plan) is not None:
        return StepOutput(graphs.replay(plan, token_ids), None)
    if graphs is not None and plan.graph_key[0] == "decode":
        graphs.stats["eager_decode_steps"] += 1
        log.info("decode step %s has no captured graph; running eager", plan.graph_key)
    return model.forward(plan, token_ids, all_row_logits=all_row_logits)


def pad_for_graphs(graphs: GraphRunner | None, step, is_decode: bool):
    """A decode ``StepInput`` padded to its capture bucket when graphs exist (others unchanged)."""
    if graphs is None or not is_decode or not step.requests:
        return step
    q = max(r.chunk_len for r in step.requests)
    bucket = select_bucket(graphs.buckets, len(step.requests), q)
    if bucket is None:
        return step
    return pad_decode_step(step, bucket, graphs.model.buf.block_tables.shape[1])


def graph_validation(
    graph_results: dict, eager_results: dict, graph_stats: dict, events: list[dict]
) -> dict:
    """The ``--graph`` acceptance case: every scenario's tokens match eager's, every decode step
    of the graph runner is accounted for (FULL: one replay each; at most 2 allowed), and the
    capture's untouched-page check passed. ``events`` tagged with a ``runner`` ran on another
    runner and are not counted."""
    compared = sorted(k for k, r in graph_results.items() if "tokens" in r)
    mismatched = [
        k for k in compared if graph_results[k]["tokens"] != eager_results.get(k, {}).get("tokens")
    ]
    stats = graph_stats.get("stats", {})
    capture = graph_stats.get("capture", {})
    decode_steps = sum(1 for ev in events if ev.get("phase") == "decode" and "runner" not in ev)
    graph_steps = stats.get("graph_steps", 0)
    eager_steps = stats.get("eager_decode_steps", 0)
    per_step = stats.get("replays", 0) / graph_steps if graph_steps else 0.0
    out = {
        "scenarios_compared": compared,
        "tokens_equal_eager": not mismatched,
        "mismatched": mismatched,
        "graph_shapes": capture.get("graph_shapes", []),
        "decode_steps": decode_steps,
        "graph_steps": graph_steps,
        "eager_decode_steps": eager_steps,
        "replays": stats.get("replays", 0),
        "replays_per_decode_step": per_step,
        "untouched_from_page": capture.get("untouched_from_page"),
        "pages_untouched": capture.get("pages_untouched", False),
        "slots_untouched": capture.get("slots_untouched", False),
    }
    errors = []
    if mismatched:
        errors.append(f"tokens differ from eager in {mismatched}")
    if not graph_steps:
        errors.append("no decode step replayed a graph (CUDA graphs need --device cuda)")
    if graph_steps + eager_steps != decode_steps:
        errors.append(
            f"{decode_steps} decode steps, but {graph_steps} replayed and {eager_steps} ran eager"
        )
    if graph_stats.get("mode") == "FULL" and per_step > 2:
        errors.append(f"{per_step:.1f} replays per decode step (at most 2)")
    if not (out["pages_untouched"] and out["slots_untouched"]):
        errors.append("capture changed pages or slots it must not touch")
    out["passed"] = not errors
    if errors:
        out["error"] = "; ".join(errors)
    return out
