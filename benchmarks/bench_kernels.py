"""TritonBackend kernels on the GPU: each op against its floor and an in-image peer, one run.

    python benchmarks/bench_kernels.py [--out FILE] [--budget-s 170] [--only "SUBSTRING|..."]

Both ceilings (copy bandwidth, bf16 matmul rate: ``ceilings.py``) are measured first in this
process. A row's floor is ``max(bytes / copy bandwidth, FLOPs / bf16 rate)`` with the bytes the
op must move (the keys it reads, at the pool's row size, its inputs and outputs; never the
kernel's own scratch) and the FLOPs it must compute (valid keys only); ``of_floor`` is
``floor_ms / ms``. Every timing is the median of CUDA-graph replays (``_bench``; the
reports committed up to ccb1108 timed ``triton.testing.do_bench`` calls from the host, L2
flushed, which at decode sizes measured the launch), and the pools are far larger than L2
with random block tables. Each row is checked against ``TorchBackend`` before it is timed
(``check``).

Peers, in this process: FlexAttention with a block mask and torch SDPA (math backend) for
attention, both over keys gathered from the pools with torch indexing (the gather is part of
the peer's time; no fused torch attention takes head_dim 512), with the sink as an extra key of
value zero; the ``TorchBackend`` op for the rest.

A failing row is reported with its error and the run goes on; rows past ``--budget-s`` are
skipped. Prints a table and writes JSON (``{device, torch, triton, commit, ceilings, rows}``,
each row ``{kernel, shape, ms, floor_ms, of_floor, peer, peer_ms, ...}``) to ``--out``, by
default ``$OUT/bench_kernels.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import measure_ceilings
from report_io import write_report

D, W, K, RPP, PAGE, INDEX_D = 512, 128, 512, 64, 128, 128
"""Latent width, window, top-k, compressed rows a PAGE (ratio 2 at PAGE 128), PAGE tokens, index
head width."""
WIDTHS = {"medium": (16, 16), "flash": (64, 32)}
"""Attention heads and index heads: MEDIUM, and V4.1-Flash."""
DEV = "cuda"
SIZES = {"decode_rows": 64, "context": 8192, "long_context": 65536, "prefill_rows": 8192}


def _smoke() -> None:
    """``--smoke``: every row at tiny sizes on the CPU through the Triton interpreter (checks
    the script itself, times nothing meaningful)."""
    global D, W, K, RPP, PAGE, INDEX_D, DEV
    os.environ["TRITON_INTERPRET"] = "1"
    D, W, K, RPP, PAGE, INDEX_D, DEV = 64, 16, 16, 16, 32, 32, "cpu"
    SIZES.update(decode_rows=4, context=256, long_context=512, prefill_rows=64)


def _commit() -> str:
    """The commit of the tree measured: ``provenance``'s (``V41PLAN_COMMIT`` where the caller
    names it: a device machine's copy can carry a stale ``.git``), else ``unknown``."""
    from v41plan.validation.provenance import provenance

    return provenance().get("commit") or "unknown"


def _bench(fn) -> float:
    """Median ms of ``fn`` by CUDA-graph replay (``bench_gemm_moe.time_ms``; eager where it does
    not capture): what the runtime's replays pay. ``triton.testing.do_bench`` timed each call
    from the host, whose launch cost (tens of microseconds for a Triton launch of forty
    arguments) swamped the decode kernels: one batch-1 attention form read 42 to 157 us in one
    process where its replay took 19 (a one-off A/B on an H100, no report)."""
    if DEV == "cpu":  # --smoke: one run
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from bench_gemm_moe import time_ms

    return float(time_ms(fn)[0])


# -- pools --------------------------------------------------------------------------------------
class Pools:
    """Standalone ring, main plane and index planes at the pool's row formats, filled with
    values on their grids (random pages: many times the L2)."""

    def __init__(self, batch: int, pages_per_request: int, kv: str, ix: str, seed: int = 0):
        from v41plan.model import quant as Q
        from v41plan.runtime.kernels import torch_ref as R

        g = torch.Generator(device=DEV).manual_seed(seed)
        self.batch, self.n_pages = batch, batch * pages_per_request
        n = self.n_pages + 1  # + the sink page
        self.kv, self.ix = kv, ix
        lat = torch.empty(n * RPP, D, device=DEV)
        if kv == "bf16":
            self.plane = torch.empty(n, RPP, D, dtype=torch.bfloat16, device=DEV)
            for i in range(0, n * RPP, 1 << 18):
                lat[i : i + (1 << 18)].normal_(generator=g)
            self.plane.view(-1, D).copy_(Q.fake_fp4_e4m3(lat, 16))
            self.ring = Q.fake_fp8(torch.randn(batch + 1, W, D, generator=g, device=DEV))
            self.ring = self.ring.to(torch.bfloat16)
        else:
            self.plane = torch.empty(n, RPP, D // 2 + D // 16, dtype=torch.uint8, device=DEV)
            for i in range(0, n * RPP, 1 << 18):
                x = torch.randn(min(1 << 18, n * RPP - i), D, generator=g, device=DEV)
                self.plane.view(-1, self.plane.shape[-1])[i : i + len(x)] = (
                    R.encode_fp4_e4m3_scales(x)
                )
            self.ring = R.encode_fp8_e8m0(torch.randn(batch + 1, W, D, generator=g, device=DEV))
        del lat
        keys = torch.randn(n * RPP, INDEX_D, generator=g, device=DEV)
        if ix == "fp8":
            self.index = (R.encode_fp8_row(keys).view(n, RPP, INDEX_D + 4),)
        else:
            v, s = R.encode_fp4_e8m0(keys)
            self.index = (v.view(n, RPP, INDEX_D // 2), s.view(n, RPP, INDEX_D // 32))
        self.tables = torch.randperm(self.n_pages, generator=g, device=DEV).view(batch, -1)

    def main_row_bytes(self) -> int:
        """Bytes of one main-plane row."""
        return self.plane.shape[-1] * self.plane.element_size()

    def ring_row_bytes(self) -> int:
        """Bytes of one ring row."""
        return self.ring.shape[-1] * self.ring.element_size()

    def index_row_bytes(self) -> int:
        """Bytes of one index row (both planes of the fp4 format)."""
        return sum(p.shape[-1] for p in self.index)


# -- attention --------------------------------------------------------------------------------
def _attention_inputs(pools: Pools, heads: int, rows: int, context: int, prefill: bool):
    """Decode: ``rows`` requests one token each at ``context - 1``, the window in the ring.
    Prefill: one request's ``rows`` tokens from 0, the window in this forward's rows, each row's
    top-k over its visible compressed rows (fewer below 2K tokens: -1 padded)."""
    g = torch.Generator(device=DEV).manual_seed(1)
    dev = DEV
    q = torch.randn(rows, heads, D, generator=g, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(rows, D, generator=g, device=dev).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g, device=dev)
    n_comp = context // 2
    if prefill:
        position = torch.arange(rows, device=dev)
        slot = torch.zeros(rows, dtype=torch.long, device=dev)
        ring_until = torch.zeros(rows, dtype=torch.long, device=dev)  # the forward starts at 0
        bound = (position + 1) // 2
        pages = pools.tables[0].expand(rows, -1)
    else:
        position = torch.full((rows,), context - 1, device=dev)
        slot = torch.arange(rows, device=dev)
        ring_until = position + 1
        bound = torch.full((rows,), n_comp, device=dev)
        pages = pools.tables[:rows]
    vis = torch.arange(n_comp, device=dev)[None, :] < bound[:, None]
    top = torch.rand(rows, n_comp, generator=g, device=dev).masked_fill(~vis, -1).topk(K, 1)
    ids = _pad_last(torch.where(top.values >= 0, top.indices, -1))
    window_lo = torch.zeros(rows, dtype=torch.long, device=dev)
    rows_t = torch.arange(rows, device=dev)
    args = (q, sink, D**-0.5, pools.ring, kv, rows_t, slot, position, window_lo, ring_until, W)
    return args, (pools.plane, ids.contiguous(), pages.contiguous(), RPP)


def _pad_last(ids: torch.Tensor) -> torch.Tensor:
    """Each row's valid ids ascending, then the -1s."""
    big = torch.iinfo(torch.long).max
    s = torch.where(ids >= 0, ids, big).sort(1).values
    return torch.where(s == big, -1, s)


def _valid_keys(args, sel) -> tuple[torch.Tensor, torch.Tensor]:
    """Window and selected key counts per row (what the op must read and compute)."""
    position, window_lo, slot = args[7], args[8], args[6]
    lo = torch.maximum(torch.maximum(window_lo, position - (W - 1)), torch.zeros_like(position))
    n_win = torch.where(slot >= 0, position - lo + 1, 0)
    n_sel = (sel[1] >= 0).sum(1)
    return n_win, n_sel


def _gathered(kb, args, sel):
    """Keys ``[T, S, D]`` (window, selected, one zero key for the sink) and validity."""
    keys, valid = kb.gather_window(*args[3:11])
    rows, ok = kb.gather_selected(sel[0], sel[1], sel[2], sel[3], D, torch.bfloat16)
    t = keys.shape[0]
    zero = torch.zeros(t, 1, D, dtype=keys.dtype, device=keys.device)
    s = torch.cat((keys, rows, zero), 1)
    v = torch.cat((valid, ok, torch.ones(t, 1, dtype=torch.bool, device=keys.device)), 1)
    return s, v


def _sdpa_peer(kb, args, sel):
    """Gather, then SDPA (math) with the heads as the query length (one latent: MQA) and the
    sink as the additive mask value of the zero key."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, sink, scale = args[0], args[1], args[2]

    def run():
        keys, valid = _gathered(kb, args, sel)
        t, s, _ = keys.shape
        mask = torch.zeros(t, 1, q.shape[1], s, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
        mask[..., -1] = sink.to(q.dtype)[None, None, :]
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(
                q[:, None], keys[:, None], keys[:, None], attn_mask=mask, scale=scale
            )

    return run


def _flex_peer(kb, args, sel):
    """Gather, then FlexAttention (compiled, 32 x 32 tiles: D = 512) with a block mask of the
    valid keys and the sink as a score_mod on the zero key."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, sink, scale = args[0], args[1], args[2]
    keys, valid = _gathered(kb, args, sel)
    t, s, _ = keys.shape
    h = q.shape[1]

    def mask_mod(b, hh, q_idx, kv_idx):
        return valid[b, kv_idx]

    def score_mod(score, b, hh, q_idx, kv_idx):
        return torch.where(kv_idx == s - 1, sink[q_idx].to(score.dtype), score)

    block = create_block_mask(mask_mod, t, None, h, s, device=DEV, BLOCK_SIZE=32)
    flex = torch.compile(flex_attention, dynamic=False)
    opts = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}

    def run():
        keys2, _ = _gathered(kb, args, sel)
        return flex(
            q[:, None],
            keys2[:, None],
            keys2[:, None],
            score_mod=score_mod,
            block_mask=block,
            scale=scale,
            kernel_options=opts,
        )

    return run


def _attention_cost(pools, args, sel, prefill) -> tuple[int, int]:
    """Bytes the op must move and FLOPs it must compute (valid keys only)."""
    q = args[0]
    heads, rows = q.shape[1], q.shape[0]
    n_win, n_sel = _valid_keys(args, sel)
    keys = int((n_win + n_sel).sum())
    if prefill:  # window rows come from this forward's rows; selected rows from the plane
        key_bytes = int(n_sel.sum()) * pools.main_row_bytes() + rows * D * 2
    else:
        key_bytes = int(n_win.sum()) * pools.ring_row_bytes() + int(n_sel.sum()) * (
            pools.main_row_bytes()
        )
    io = 2 * q.numel() * 2 + sel[1].numel() * 8 + sel[2].numel() * 8
    return key_bytes + io, 4 * heads * D * keys


def _attention_setup(width, prefill, kv, rows=None):
    heads, _ = WIDTHS[width]
    rows = rows or (SIZES["prefill_rows"] if prefill else SIZES["decode_rows"])
    context = SIZES["prefill_rows"] if prefill else SIZES["context"]
    pools = Pools(1 if prefill else rows, context // PAGE, kv, "fp8")
    args, sel = _attention_inputs(pools, heads, rows, context, prefill)
    shape = (
        f"{width} H={heads} D={D} W={W} top-{K} {'prefill' if prefill else 'decode'} "
        f"T={rows} ctx={context} ring={'bf16' if kv == 'bf16' else 'fp8'} main={kv}"
    )
    return pools, args, sel, shape


def attention_rows(width, prefill, kv, peers, ceil, kb, ref):
    """Sparse attention at one width and format, a row per peer."""
    pools, args, sel, shape = _attention_setup(width, prefill, kv)
    out = torch.empty_like(args[0])
    want = torch.empty_like(args[0])
    kb.sparse_attention(*args, *sel, out)
    ref.sparse_attention(*args, *sel, want)
    err = (out.float() - want.float()).abs().max().item()
    nbytes, flops = _attention_cost(pools, args, sel, prefill)
    ms = _bench(lambda: kb.sparse_attention(*args, *sel, out))
    base = _row("sparse_attention", shape, ms, nbytes, flops, ceil)
    base["check"] = {"max_abs_err_vs_torch": err, "tolerance": 2e-2}
    q = args[0]
    base["config"] = kb.attention_config(
        q.shape[0], q.shape[1], D, W, K, torch.device(DEV), q.dtype, kv == "fp4"
    )
    out_rows = []
    for name in peers:
        r = dict(base)
        r["peer"] = name
        try:
            if name == "torch_backend":
                r["peer_ms"] = _bench(lambda: ref.sparse_attention(*args, *sel, want))
            elif name == "sdpa_math":
                r["peer_ms"] = _bench(_sdpa_peer(ref, args, sel))
            elif name == "flex_block_mask":
                r["peer_ms"] = _bench(_flex_peer(ref, args, sel))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape: say why, keep the row
            r["peer_ms"] = None
            r["peer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out_rows.append(r)
    del pools
    return out_rows


def attention_sweep(width, configs, ceil, kb, ref, prefill=False, rows=None):
    """Decode (or prefill) attention under other launch settings (head block, key splits,
    tile, warps, output columns), so the defaults can follow the measurements; ``rows`` query
    rows (default: the decode or prefill size)."""
    pools, args, sel, shape = _attention_setup(width, prefill, "bf16", rows)
    want = torch.empty_like(args[0])
    ref.sparse_attention(*args, *sel, want)
    nbytes, flops = _attention_cost(pools, args, sel, prefill)
    rows = []
    for cfg in configs:
        out = torch.empty_like(args[0])
        if DEV == "cpu" and cfg.get("DV", 0) >= args[0].shape[-1]:  # --smoke: narrower latent
            cfg = {**cfg, "DV": args[0].shape[-1] // 2}
        kb.attention_override = cfg
        try:
            kb.sparse_attention(*args, *sel, out)
            err = (out.float() - want.float()).abs().max().item()
            r = _row(
                "sparse_attention",
                f"{shape} sweep {cfg}",
                _bench(lambda out=out: kb.sparse_attention(*args, *sel, out)),
                nbytes,
                flops,
                ceil,
            )
            r["check"] = {"max_abs_err_vs_torch": err, "tolerance": 2e-2}
            r["config"] = cfg
        except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
            r = {
                "kernel": "sparse_attention",
                "shape": f"{shape} sweep {cfg}",
                "error": str(e)[:300],
            }
        finally:
            kb.attention_override = None
        rows.append(r)
    del pools
    return rows


# -- scorer -------------------------------------------------------------------------------------
def scorer_rows(width, prefill, ix, context, ceil, kb, ref, peer=True):
    """The scorer and its top-k (one call, as the runtime makes it) over a plane format."""
    _, hi = WIDTHS[width]
    rows = context if prefill else SIZES["decode_rows"]
    pools = Pools(1 if prefill else rows, context // PAGE, "bf16" if ix == "fp8" else "fp4", ix)
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(rows, hi, INDEX_D, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(rows, hi, generator=g, device=DEV, dtype=torch.bfloat16)
    n_comp = context // 2
    if prefill:
        bound = (torch.arange(rows, device=DEV) + 1) // 2
        pages = pools.tables[0].expand(rows, -1).contiguous()
    else:
        bound = torch.full((rows,), n_comp, device=DEV)
        pages = pools.tables
    planes = pools.index
    ids = kb.score_topk(planes, q, w, bound, pages, K, None)
    want = ref.score_topk(planes, q, w, bound, pages, K, None)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids[:64], want[:64]))
    overlap = same / max(1, sum(len(set(b.tolist())) for b in want[:64]))
    visible = int(bound.clamp(max=n_comp).sum())
    key_bytes = visible * pools.index_row_bytes()
    nbytes = key_bytes + q.numel() * 2 + w.numel() * 2 + rows * K * 8
    flops = 2 * hi * INDEX_D * visible
    ms = _bench(lambda: kb.score_topk(planes, q, w, bound, pages, K, None))
    shape = (
        f"{width} index {hi}x{INDEX_D} {ix} {'prefill' if prefill else 'decode'} T={rows} "
        f"ctx={context} (ratio 2: {n_comp} rows) top-{K}"
    )
    r = _row("score_topk", shape, ms, nbytes, flops, ceil)
    r["check"] = {"topk_overlap_vs_torch": overlap}
    r["peer"] = "torch_backend"
    try:
        r["peer_ms"] = (
            _bench(lambda: ref.score_topk(planes, q, w, bound, pages, K, None)) if peer else None
        )
    except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
        r["peer_ms"] = None
        r["peer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del pools
    return [r]


def _scores_row(kb, args, want, shape, nbytes, flops, ceil) -> dict:
    """A ``scores`` row: ``kb.scores(*args)`` timed, with its largest error against ``want``."""
    err = (kb.scores(*args) - want).abs().nan_to_num(0.0).max()
    r = _row("scores", shape, _bench(lambda: kb.scores(*args)), nbytes, flops, ceil)
    r["check"] = {"max_abs_err_vs_torch": err.item()}
    return r


def scorer_sweep(width, ix, context, ceil, kb, ref):
    """Decode scoring alone (``scores``: the fp32 score rows) in the scorer's forms (the
    backend's ``score_*`` settings: the chunk's pages loaded first, the prefetch, 32-key tiles,
    other chunks), and the default with its top-k in both select forms: where the time goes."""
    _, hi = WIDTHS[width]
    rows = SIZES["decode_rows"]
    pools = Pools(rows, context // PAGE, "bf16" if ix == "fp8" else "fp4", ix)
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(rows, hi, INDEX_D, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(rows, hi, generator=g, device=DEV, dtype=torch.bfloat16)
    n_comp = context // 2
    bound = torch.full((rows,), n_comp, device=DEV)
    pages, planes = pools.tables, pools.index
    key_bytes = rows * n_comp * pools.index_row_bytes()
    flops = 2 * hi * INDEX_D * rows * n_comp
    want = ref.scores(planes, q, w, bound, pages)
    shape = f"{width} index {hi}x{INDEX_D} {ix} decode T={rows} ctx={context}"
    args = (planes, q, w, bound, pages)
    out = []
    forms = [
        {},  # the default, in the same run
        {"score_chunk_pages": True},  # staged off
        {"score_prefetch": 1},
        {"score_block": 32},
        {"score_block": 32, "score_chunk_pages": True},
    ]
    # fixed chunks (the growth to score_row_programs off)
    forms += [{"score_chunk": c, "score_row_programs": 0} for c in (256, 512, 1024, 2048)]
    forms += [{"select_programs": 1, "topk": True}, {"select_programs": 0, "topk": True}]
    forms.append({"select_resident_max": 0, "topk": True})  # the digit select
    forms.append({"select_early_exit": False, "topk": True})  # the 32-step search
    forms.append({"select_loose_bounds": False, "select_ternary": False, "topk": True})
    forms.append({"select_lists_held": False, "topk": True})
    # the scorer and its select as dependent launches at every row count (triton_common.PDL on,
    # PDL_MAX_ROWS lifted): the select's launch overlaps the scorer's tail. Lost on an H100:
    # 0.0330 against 0.0253 ms at medium 8K
    # (reports/gpu/bench_kernels_pdl_scorer_h100_6cd5df9.json).
    forms.append({"pdl": True, "topk": True})
    from v41plan.runtime.kernels import triton_common as TC

    pdl_shipped = (TC.PDL, TC.PDL_MAX_ROWS)
    for form in forms:
        attrs = {k: v for k, v in form.items() if k not in ("topk", "pdl")}
        shipped = {k: getattr(kb, k) for k in attrs}
        try:
            for k, v in attrs.items():
                setattr(kb, k, v)
            if form.get("pdl"):
                TC.PDL, TC.PDL_MAX_ROWS = "on", 1 << 30
                attrs = {"pdl": True}
            if form.get("topk"):
                ms = _bench(lambda: kb.score_topk(planes, q, w, bound, pages, K, None))
                name = f"{shape} top-{K} sweep {attrs}"
                out.append(_row("score_topk", name, ms, key_bytes + rows * K * 8, flops, ceil))
            else:
                nbytes = key_bytes + rows * n_comp * 4
                out.append(
                    _scores_row(kb, args, want, f"{shape} sweep {attrs}", nbytes, flops, ceil)
                )
        except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
            out.append(
                {"kernel": "scores", "shape": f"{shape} sweep {form}", "error": str(e)[:300]}
            )
        finally:
            for k, v in shipped.items():
                setattr(kb, k, v)
            TC.PDL, TC.PDL_MAX_ROWS = pdl_shipped
    del pools
    return out


def select_rows(context, ceil, kb, ref):
    """The top-k select and the candidate blocks alone, over one score matrix."""
    rows, n = SIZES["decode_rows"], context
    g = torch.Generator(device=DEV).manual_seed(3)
    score = torch.randn(rows, n, generator=g, device=DEV)
    bound = torch.full((rows,), n, device=DEV)
    out = []
    for name, fn, peer, check in (
        (
            "topk_ids",
            lambda: kb.topk_ids(score, K),
            lambda: ref.topk_ids(score, K),
            lambda: torch.equal(kb.topk_ids(score, K), ref.topk_ids(score, K)),
        ),
        (
            "candidate_blocks",
            lambda: kb.candidate_blocks(score, bound, 8, 2048),
            lambda: ref.candidate_blocks(score, bound, 8, 2048),
            lambda: torch.equal(
                kb.candidate_blocks(score, bound, 8, 2048),
                ref.candidate_blocks(score, bound, 8, 2048),
            ),
        ),
    ):
        nbytes = score.numel() * 4 + (rows * K * 8 if name == "topk_ids" else rows * n)
        r = _row(
            name,
            f"T={rows} N={n} k={K if name == 'topk_ids' else '2048 x 8'}",
            _bench(fn),
            nbytes,
            0,
            ceil,
        )
        r["check"] = {"exact_vs_torch": bool(check())}
        r["peer"], r["peer_ms"] = "torch_backend", _bench(peer)
        out.append(r)
    return out


def _decode_scores_inputs(rows: int, context: int, heads: int, seed: int):
    """Pools of ``rows`` requests over ``context`` tokens (fp8 index plane), their index
    queries and head weights, the ratio-2 rows each sees and its bound:
    ``(pools, q, w, n_comp, bound)``."""
    pools = Pools(rows, context // PAGE, "bf16", "fp8")
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(rows, heads, INDEX_D, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(rows, heads, generator=g, device=DEV, dtype=torch.bfloat16)
    n_comp = context // 2
    return pools, q, w, n_comp, torch.full((rows,), n_comp, device=DEV)


def scorer_split(width, context, ceil, kb):
    """Where a decode ``score_topk`` spends its time (fp8 plane, 64 rows): the whole op; its
    scorer alone (``fill`` off, as the op launches it); its select alone on the scorer's own
    output and on random scores of the same shape (both with the rows' bounds); and each
    kernel's device time in eager calls under ``torch.profiler``, so a select slower after the
    scorer than on its own shows as such."""
    _, hi = WIDTHS[width]
    rows = SIZES["decode_rows"]
    pools, q, w, n_comp, bound = _decode_scores_inputs(rows, context, hi, 2)
    pages, planes = pools.tables, pools.index
    n = pages.shape[1] * planes[0].shape[1]
    key_bytes = rows * n_comp * pools.index_row_bytes()
    flops = 2 * hi * INDEX_D * rows * n_comp
    shape = f"{width} index {hi}x{INDEX_D} fp8 decode T={rows} ctx={context}"
    work = torch.empty(rows, n, dtype=torch.float32, device=DEV)
    ids = torch.empty(rows, K, dtype=torch.long, device=DEV)
    kb._score(planes, q, w, bound, pages, None, work, fill=False)
    g = torch.Generator(device=DEV).manual_seed(9)
    noise = torch.randn(rows, n, generator=g, device=DEV)
    out = []
    timed = [
        ("score_topk", "", lambda: kb.score_topk(planes, q, w, bound, pages, K, None)),
        (
            "scores",
            " scorer alone",
            lambda: kb._score(planes, q, w, bound, pages, None, work, False),
        ),
        ("topk_ids", " select of the scorer's output", lambda: kb._select(work, bound, K, ids)),
        ("topk_ids", " select of random scores", lambda: kb._select(noise, bound, K, ids)),
    ]
    for kernel, what, fn in timed:
        # a select's floor: its scores' bytes (it does none of the scorer's products)
        nbytes, nflops = (rows * n_comp * 4, 0) if kernel == "topk_ids" else (key_bytes, flops)
        out.append(_row(kernel, f"{shape}{what} split", _bench(fn), nbytes, nflops, ceil))
    from torch.profiler import ProfilerActivity, profile

    if DEV != "cuda":  # --smoke
        return out
    fn = timed[0][2]
    fn()
    torch.cuda.synchronize()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_name: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / reps
    out[0]["kernels_us"] = {k[:80]: round(v, 2) for k, v in sorted(by_name.items())}
    print(f"  {shape} eager kernels (us a call): {out[0]['kernels_us']}")
    del pools
    return out


def scorer_tile_sweep(width, context, ceil, kb, ref):
    """Decode scores alone (fp8 plane) over the keys a program covers (``score_chunk``: more
    programs, fewer tiles each) and the keys a tile holds (``score_block``)."""
    _, hi = WIDTHS[width]
    rows = SIZES["decode_rows"]
    pools, q, w, n_comp, bound = _decode_scores_inputs(rows, context, hi, 2)
    pages, planes = pools.tables, pools.index
    want = ref.scores(planes, q, w, bound, pages)
    shape = f"{width} index {hi}x{INDEX_D} fp8 decode T={rows} ctx={context}"
    out = []
    saved = kb.score_chunk, kb.score_block
    for chunk, block in ((512, 32), (128, 32), (256, 32), (1024, 32), (256, 16), (512, 16)):
        kb.score_chunk, kb.score_block = chunk, block
        try:
            r = _scores_row(
                kb,
                (planes, q, w, bound, pages),
                want,
                f"{shape} sweep score_chunk={chunk} score_block={block}",
                rows * n_comp * (pools.index_row_bytes() + 4),
                2 * hi * INDEX_D * rows * n_comp,
                ceil,
            )
            r["config"] = {"score_chunk": chunk, "score_block": block}
        except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
            r = {"kernel": "scores", "shape": f"chunk={chunk} block={block}", "error": str(e)[:300]}
        finally:
            kb.score_chunk, kb.score_block = saved
        out.append(r)
    del pools
    return out


def scorer_short_sweep(ceil, kb, ref):
    """Decode index scores over short contexts (flash index widths, fp8 plane), alone and with
    their top-k: the keys a program covers halved until the programs cover the device
    (``score_fill_sms``, shipped) against one ``score_chunk`` a program."""
    out = []
    for rows, context in ((1, 2 * PAGE), (1, 16 * PAGE), (8, 16 * PAGE), (64, 2 * PAGE)):
        out += _scorer_short_case(rows, context, ceil, kb, ref)
    return out


def _scorer_short_case(rows, context, ceil, kb, ref):
    """``scorer_short_sweep``'s rows at ``rows`` decode rows over ``context`` tokens."""
    _, hi = WIDTHS["flash"]
    out = []
    pools, q, w, n_comp, bound = _decode_scores_inputs(rows, context, hi, 4)
    pages, planes = pools.tables, pools.index
    n = pages.shape[1] * planes[0].shape[1]
    want = ref.scores(planes, q, w, bound, pages)
    key_bytes = rows * n_comp * pools.index_row_bytes()
    flops = 2 * hi * INDEX_D * rows * n_comp
    top = min(K, n_comp)
    shipped = kb.score_fill_sms
    for fill in (shipped, not shipped):
        kb.score_fill_sms = fill
        chunk = kb.score_chunk_for(rows, n, kb.score_tile_rows(rows, hi), q.device)
        tag = f"decode T={rows} ctx={context} sweep score_fill_sms={int(fill)} (chunk {chunk})"
        try:
            nbytes = key_bytes + rows * n_comp * 4
            args = (planes, q, w, bound, pages)
            r = _scores_row(
                kb, args, want, f"flash index {hi}x{INDEX_D} fp8 {tag}", nbytes, flops, ceil
            )
            r["config"] = {"score_fill_sms": fill, "chunk": chunk}
            out.append(r)
            ids = kb.score_topk(planes, q, w, bound, pages, top, None)
            r = _row(
                "score_topk",
                f"flash index {hi}x{INDEX_D} fp8 top-{top} {tag}",
                _bench(lambda: kb.score_topk(planes, q, w, bound, pages, top, None)),
                key_bytes + rows * top * 8,
                flops,
                ceil,
            )
            r["check"] = {
                "exact_vs_torch": bool(
                    torch.equal(ids, ref.score_topk(planes, q, w, bound, pages, top, None))
                )
            }
            r["config"] = {"score_fill_sms": fill, "chunk": chunk}
            out.append(r)
        except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
            out.append({"kernel": "scores", "shape": tag, "error": str(e)[:300]})
        finally:
            kb.score_fill_sms = shipped
    del pools
    return out


def scorer_prefill_split(context, ceil, kb, ref):
    """An 8K prefill's index scores alone and with their top-k (medium fp8): how much of the
    prefill row is the select (one program a row, over the row's own bound)."""
    _, hi = WIDTHS["medium"]
    rows = context
    pools = Pools(1, context // PAGE, "bf16", "fp8")
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(rows, hi, INDEX_D, generator=g, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(rows, hi, generator=g, device=DEV, dtype=torch.bfloat16)
    bound = (torch.arange(rows, device=DEV) + 1) // 2
    pages, planes = pools.tables[0].expand(rows, -1).contiguous(), pools.index
    visible = int(bound.sum())
    flops = 2 * hi * INDEX_D * visible
    shape = f"medium index {hi}x{INDEX_D} fp8 prefill T={rows} ctx={context}"
    out = [
        _row(
            "scores",
            f"{shape} split",
            _bench(lambda: kb.scores(planes, q, w, bound, pages)),
            visible * (pools.index_row_bytes() + 4),
            flops,
            ceil,
        ),
        _row(
            "score_topk",
            f"{shape} top-{K} split",
            _bench(lambda: kb.score_topk(planes, q, w, bound, pages, K, None)),
            visible * pools.index_row_bytes() + rows * K * 8,
            flops,
            ceil,
        ),
    ]
    del pools
    return out


def _select_form(kb, rows: int, n: int) -> str:
    """Which select ``kb._select`` launches for ``rows`` rows of ``n`` scores, in words."""
    resident = kb.select_resident_max
    if kb.select_programs == 0 and n > resident > 0:
        return f"long-row, {-(-n // resident)} segments"
    segments = kb.select_segments_for(rows, n, DEV)
    if segments == 1 and 1 << (n - 1).bit_length() <= resident:  # next_pow2(n)
        return "resident"
    return f"digit, {segments} a row"


def select_sweep(n, ceil, kb, ref):
    """The top-k select alone over ``n`` scores a row (decode rows): the default (the resident
    select up to ``select_resident_max``, the long-row select past it), the same without its
    early exit (``select_early_exit``), without its loose segment bounds
    (``select_loose_bounds``) or its ternary search (``select_ternary``), with 8 and 32 keys a
    thread (``select_thread_elems``), with the long-row final's list written first
    (``select_lists_held`` off), the digit select (``select_resident_max`` 0) by the
    device and in one program a row, and the long-row select over segments of 4,096."""
    rows = SIZES["decode_rows"]
    g = torch.Generator(device=DEV).manual_seed(3)
    score = torch.randn(rows, n, generator=g, device=DEV)
    want = ref.topk_ids(score, K)
    # the default; the digit select (one program, then segments); the resident select past
    # its default length (one program a row, the row in registers: spills at 16,384 and more)
    exact = {"select_loose_bounds": False}
    forms = [{}, {"select_early_exit": False}, {"select_ternary": False}, exact]
    forms.append({**exact, "select_ternary": False})
    forms += [{"select_thread_elems": e} for e in (8, 32)]
    forms.append({"select_lists_held": False})
    forms.append({"select_resident_max": 0})  # the digit select, by the device
    forms.append({"select_programs": 1, "select_resident_max": 0})  # in one program a row
    forms.append({"select_resident_max": 4096})  # long rows: segments of 4,096
    out = []
    for attrs in forms:
        shipped = {a: getattr(kb, a) for a in attrs}
        tag = " ".join(f"{a.removeprefix('select_')}={v}" for a, v in attrs.items())
        try:
            for a, v in attrs.items():
                setattr(kb, a, v)
            segments = kb.select_segments_for(rows, n, score.device)
            r = _row(
                "topk_ids",
                f"T={rows} N={n} k={K} sweep {tag} ({_select_form(kb, rows, n)})",
                _bench(lambda: kb.topk_ids(score, K)),
                score.numel() * 4 + rows * K * 8,
                0,
                ceil,
            )
            r["check"] = {"exact_vs_torch": bool(torch.equal(kb.topk_ids(score, K), want))}
            r["config"] = {**attrs, "segments": segments}
        except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
            r = {"kernel": "topk_ids", "shape": tag, "error": str(e)[:300]}
        finally:
            for a, v in shipped.items():
                setattr(kb, a, v)
        out.append(r)
    return out


# -- scatters -----------------------------------------------------------------------------------
def scatter_rows(rows, ceil, kb, ref):
    """Ring write, main-plane store, index-key store, the compressor tails and the cursor for
    ``rows`` rows (a decode batch, or a prefill chunk's rows)."""
    from v41plan.model import quant as Q

    g = torch.Generator(device=DEV).manual_seed(4)
    dev = DEV
    out = []
    slots = SIZES["decode_rows"]
    i = torch.arange(rows, device=dev)
    n_pages = max(2, rows // RPP + 1)
    page = torch.randperm(n_pages, generator=g, device=dev)[i // RPP % n_pages]
    row = i % RPP
    keep = torch.ones(rows, dtype=torch.bool, device=dev)
    x = Q.fake_fp8(torch.randn(rows, D, generator=g, device=dev)).to(torch.bfloat16)
    lat = Q.fake_fp4_e4m3(torch.randn(rows, D, generator=g, device=dev), 16).to(torch.bfloat16)
    key = torch.randn(rows, INDEX_D, generator=g, device=dev)
    cases = []
    for fmt in ("bf16", "fp8"):
        width, dt = (D, torch.bfloat16) if fmt == "bf16" else (D + D // 32, torch.uint8)
        ring = [torch.zeros(slots + 1, W, width, dtype=dt, device=dev) for _ in range(2)]
        slot = i % slots
        pos = i // slots  # distinct (slot, ring row) up to 64 x 128 rows
        wf = torch.zeros(rows, dtype=torch.long, device=dev)
        n_w = min(rows, slots * W)
        nbytes = rows * D * 2 + n_w * width * ring[0].element_size()
        cases.append(
            (
                "ring_write",
                f"T={rows} ring={fmt}",
                (lambda r=ring[0], s=slot, p=pos, w=wf: kb.ring_write(r, x, s, p, w, slots)),
                (lambda r=ring[1], s=slot, p=pos, w=wf: ref.ring_write(r, x, s, p, w, slots)),
                (lambda r=ring: torch.equal(r[0], r[1])),
                nbytes,
            )
        )
    for fmt in ("bf16", "fp4"):
        width, dt = (D, torch.bfloat16) if fmt == "bf16" else (D // 2 + D // 16, torch.uint8)
        pl = [torch.zeros(n_pages + 1, RPP, width, dtype=dt, device=dev) for _ in range(2)]
        nbytes = rows * D * 2 + rows * width * pl[0].element_size()
        cases.append(
            (
                "main_scatter",
                f"T={rows} main={fmt}",
                (lambda p=pl[0]: kb.main_scatter(p, lat, page, row, keep, n_pages)),
                (lambda p=pl[1]: ref.main_scatter(p, lat, page, row, keep, n_pages)),
                (lambda p=pl: torch.equal(p[0], p[1])),
                nbytes,
            )
        )
    for fmt in ("fp8", "fp4"):
        if fmt == "fp8":
            k8, s8 = Q.quant_fp8_rows(key)
            pl = [
                (torch.zeros(n_pages + 1, RPP, INDEX_D + 4, dtype=torch.uint8, device=dev),)
                for _ in range(2)
            ]
            kk, ks, rb = k8, s8, INDEX_D + 4
        else:
            kk, ks, rb = Q.fake_fp4(key, 32), None, INDEX_D // 2 + INDEX_D // 32
            pl = [
                (
                    torch.zeros(n_pages + 1, RPP, INDEX_D // 2, dtype=torch.uint8, device=dev),
                    torch.zeros(n_pages + 1, RPP, INDEX_D // 32, dtype=torch.uint8, device=dev),
                )
                for _ in range(2)
            ]
        nbytes = rows * INDEX_D * 4 + rows * rb
        cases.append(
            (
                "index_key_store",
                f"T={rows} index={fmt}",
                (
                    lambda p=pl[0], kk=kk, ks=ks: kb.index_key_store(
                        p, kk, ks, page, row, keep, n_pages
                    )
                ),
                (
                    lambda p=pl[1], kk=kk, ks=ks: ref.index_key_store(
                        p, kk, ks, page, row, keep, n_pages
                    )
                ),
                (lambda p=pl: all(torch.equal(a, b) for a, b in zip(*p))),
                nbytes,
            )
        )
    v = torch.randn(rows, D, generator=g, device=dev)
    sc = torch.randn(rows, D, generator=g, device=dev)
    slot = i * slots // rows
    pos = i % max(1, rows // slots)
    first = pos == 0
    last = pos == pos.max()
    tails = [
        (torch.zeros(slots + 1, D, device=dev), torch.zeros(slots + 1, D, device=dev))
        for _ in range(2)
    ]
    got = {}

    def comp(kbk, tv, ts, key):
        got[key] = kbk.compress_groups(v, sc, pos, slot, first, last, tv, ts, slots)

    cases.append(
        (
            "compress_groups",
            f"T={rows} d={D} fp32 tails",
            (lambda: comp(kb, *tails[0], "t")),
            (lambda: comp(ref, *tails[1], "r")),
            (
                lambda: (
                    torch.equal(got["t"][0], got["r"][0]) and torch.equal(tails[0][0], tails[1][0])
                )
            ),
            rows * D * 4 * 2 + rows * 2 * D * 4 * 2,
        )
    )
    for name, shape, fn, peer, check, nbytes in cases:
        ms = _bench(fn)
        peer_ms = _bench(peer)
        r = _row(name, shape, ms, nbytes, 0, ceil)
        r["check"] = {"exact_vs_torch": bool(check())}
        r["peer"], r["peer_ms"] = "torch_backend", peer_ms
        out.append(r)
    return out


# -- rows ---------------------------------------------------------------------------------------
def _row(kernel, shape, ms, nbytes, flops, ceil) -> dict:
    t_bytes = nbytes / ceil["copy_bytes_per_s"] * 1e3
    t_flops = flops / ceil["bf16_flop_per_s"] * 1e3
    floor = max(t_bytes, t_flops)
    return {
        "kernel": kernel,
        "shape": shape,
        "ms": ms,
        "floor_ms": floor,
        "of_floor": floor / ms if ms else None,
        "bound": "bytes" if t_bytes >= t_flops else "flops",
        "bytes": int(nbytes),
        "flops": int(flops),
        "peer": None,
        "peer_ms": None,
    }


def main(argv=None) -> int:
    """Run the rows in order of interest within the budget; print and write the report."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_kernels.json)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip rows past this time")
    ap.add_argument(
        "--only",
        default=None,
        help="run the rows whose name contains this (alternatives split by '|')",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (interpreter)")
    args = ap.parse_args(argv)
    if args.smoke:
        _smoke()
    elif not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA device (or --smoke)")
        return 2
    import triton

    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    if DEV == "cpu":
        from v41plan.runtime.kernels.triton_common import patch_interpreter

        patch_interpreter()

    t0 = time.perf_counter()
    ceil = (
        measure_ceilings() if DEV == "cuda" else {"copy_bytes_per_s": 1e11, "bf16_flop_per_s": 1e12}
    )
    kb, ref = TritonBackend(), TorchBackend()
    attn_peers = ("flex_block_mask", "sdpa_math", "torch_backend")
    if DEV == "cpu":
        attn_peers = ("sdpa_math", "torch_backend")
    ctx, long_ctx, pre = SIZES["context"], SIZES["long_context"], SIZES["prefill_rows"]
    plan = [
        (
            "attention decode flash bf16",
            lambda: attention_rows("flash", False, "bf16", attn_peers, ceil, kb, ref),
        ),
        (
            "attention decode medium bf16",
            lambda: attention_rows("medium", False, "bf16", attn_peers, ceil, kb, ref),
        ),
        (
            "scorer decode medium fp8 8K",
            lambda: scorer_rows("medium", False, "fp8", ctx, ceil, kb, ref),
        ),
        (
            "scorer decode medium fp8 64K",
            lambda: scorer_rows("medium", False, "fp8", long_ctx, ceil, kb, ref),
        ),
        (
            "attention prefill flash bf16",
            lambda: attention_rows("flash", True, "bf16", ("sdpa_math",), ceil, kb, ref),
        ),
        (
            "scorer prefill medium fp8 8K",
            lambda: scorer_rows("medium", True, "fp8", pre, ceil, kb, ref),
        ),
        (
            "attention decode flash fp4",
            lambda: attention_rows("flash", False, "fp4", ("torch_backend",), ceil, kb, ref),
        ),
        (
            "attention prefill medium bf16",
            lambda: attention_rows("medium", True, "bf16", ("torch_backend",), ceil, kb, ref),
        ),
        (
            "scorer decode flash fp8 8K",
            lambda: scorer_rows("flash", False, "fp8", ctx, ceil, kb, ref),
        ),
        (
            "scorer decode medium fp4 8K",
            lambda: scorer_rows("medium", False, "fp4", ctx, ceil, kb, ref),
        ),
        ("select 32K", lambda: select_rows(long_ctx // 2, ceil, kb, ref)),
        ("scatters decode", lambda: scatter_rows(SIZES["decode_rows"], ceil, kb, ref)),
        ("scatters prefill", lambda: scatter_rows(pre, ceil, kb, ref)),
        (
            "attention decode sweep flash",
            lambda: attention_sweep(
                "flash",
                [
                    {},  # the default, in the same run
                    # the forms before the selected ids were resolved first (RESOLVE) and the
                    # splits shared each row's own blocks (BALANCE): 0.0651 ms on an H100
                    {"RESOLVE": False, "BALANCE": False, "num_stages": 2},
                    {"num_stages": 2},  # resolved, two stages
                    {"BALANCE": False},
                    {"SPLITS": 1},
                    {"SPLITS": 3},
                    {"HB": 32, "SPLITS": 1, "num_warps": 8},
                    {"num_warps": 16},
                ],
                ceil,
                kb,
                ref,
            ),
        ),
        (
            "attention decode sweep flash T=1",  # batch 1: a program a head block and split
            lambda: attention_sweep(
                "flash",
                [
                    {},  # the default, in the same run
                    {"HB": 64, "SPLITS": 8},
                    {"HB": 32, "SPLITS": 16, "num_warps": 8},
                    {"HB": 32, "SPLITS": 8, "num_warps": 8},
                    {"HB": 16, "SPLITS": 16, "num_warps": 4},
                    {"HB": 16, "SPLITS": 8, "num_warps": 4},
                    {"HB": 16, "SPLITS": 20, "num_warps": 4},
                    {"HB": 16, "SPLITS": 10, "BN": 16, "num_warps": 4},
                    {"num_warps": 16},
                    {"HB": 32, "SPLITS": 10, "num_warps": 8},
                ],
                ceil,
                kb,
                ref,
                rows=1,
            ),
        ),
        *(
            (
                f"attention decode sweep flash T={t}",  # a few rows: head blocks and splits
                lambda t=t: attention_sweep(
                    "flash",
                    [
                        {},  # the default, in the same run
                        {"HB": 16, "SPLITS": 20, "num_warps": 4},
                        {"HB": 16, "SPLITS": 10, "num_warps": 4},
                        {"HB": 16, "SPLITS": 5, "num_warps": 4},
                        {"HB": 32, "SPLITS": 10, "num_warps": 8},
                    ],
                    ceil,
                    kb,
                    ref,
                    rows=t,
                ),
            )
            for t in (2, 4, 8, 16)
        ),
        ("scorer prefill split sweep", lambda: scorer_prefill_split(pre, ceil, kb, ref)),
        ("scorer short decode sweep", lambda: scorer_short_sweep(ceil, kb, ref)),
        ("scorer tile sweep medium 8K", lambda: scorer_tile_sweep("medium", ctx, ceil, kb, ref)),
        (
            "scorer tile sweep flash 64K",
            lambda: scorer_tile_sweep("flash", long_ctx, ceil, kb, ref),
        ),
        ("select sweep 4K", lambda: select_sweep(ctx // 2, ceil, kb, ref)),
        ("select sweep 32K", lambda: select_sweep(long_ctx // 2, ceil, kb, ref)),
        (
            "scorer decode sweep medium fp8 8K",
            lambda: scorer_sweep("medium", "fp8", ctx, ceil, kb, ref),
        ),
        (
            "scorer decode sweep flash fp8 64K",
            lambda: scorer_sweep("flash", "fp8", long_ctx, ceil, kb, ref),
        ),
        (
            "attention prefill sweep flash",
            lambda: attention_sweep(
                "flash",
                [
                    {},  # the default (RESOLVE_SELECTED's form), in the same run
                    {"RESOLVE": False, "num_stages": 2},  # before it: 5.52 ms on an H100
                    {"num_stages": 2},
                    {"HB": 32},
                ],
                ceil,
                kb,
                ref,
                prefill=True,
            ),
        ),
        (
            "scorer decode split medium fp8 8K",
            lambda: scorer_split("medium", ctx, ceil, kb),
        ),
        (
            "scorer decode split flash fp8 64K",
            lambda: scorer_split("flash", long_ctx, ceil, kb),
        ),
        (
            "attention decode sweep medium",
            lambda: attention_sweep(
                "medium",
                [
                    {},  # the default, in the same run
                    # resolved at three stages (the default since 6a8d119; untimed at medium
                    # widths): 86 KB of shared memory and 188 registers a thread, two programs
                    # a multiprocessor (sm_90 build); two stages 53 KB, 16-key blocks 53 KB
                    # and 168 registers (three a multiprocessor), and the form timed at 0.41
                    {"num_stages": 2},
                    {"BN": 16},
                    {"SPLITS": 2},
                    {"RESOLVE": False, "BALANCE": False, "num_stages": 2},
                    {"SPLITS": 1},
                    {"SPLITS": 4, "BN": 16},
                    {"SPLITS": 8, "BN": 16},
                    {"PREFETCH": 1},
                    {"PREFETCH": 2},
                    {"SPLITS": 4, "BN": 32},
                    {"SPLITS": 6, "BN": 16},
                    {"SPLITS": 4, "BN": 16, "num_warps": 8},
                    {"DV": 256},
                    {"DV": 256, "SPLITS": 4, "BN": 16},
                ],
                ceil,
                kb,
                ref,
            ),
        ),
    ]
    from v41plan.validation.provenance import provenance

    rows, skipped = [], []
    report = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(),
        "spec": "medium and V4.1-Flash attention widths (WIDTHS: H, index heads; D, W, top-k)",
        "provenance": provenance(),
        "ceilings": ceil,
        "rows": rows,
        "skipped": skipped,
    }
    for name, fn in plan:
        if args.only and not any(o in name for o in args.only.split("|")):
            continue
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(name)
            continue
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - report the row and keep going
            rows.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:400]})
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
        # the rows so far, so that a run stopped by its device call's limit still reports them
        report.update(fallbacks=sorted(kb.fallbacks), wall_s=time.perf_counter() - t0)
        write_report(report, args.out, "bench_kernels.json")
    report.update(fallbacks=sorted(kb.fallbacks), wall_s=time.perf_counter() - t0)
    print(
        f"{report['device']}  copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s  "
        f"bf16 {ceil['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s  commit {report['commit']}"
    )
    print(
        f"{'kernel':<18} {'ms':>9} {'floor':>9} {'of_floor':>8} {'peer':>16} {'peer_ms':>9}  shape"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<18} ERROR {r['error'][:120]}")
            continue
        pm = f"{r['peer_ms']:9.4f}" if r.get("peer_ms") is not None else f"{'-':>9}"
        print(
            f"{r['kernel']:<18} {r['ms']:9.4f} {r['floor_ms']:9.4f} {r['of_floor']:8.2f} "
            f"{r.get('peer')!s:>16} {pm}  {r['shape']}"
        )
    if skipped:
        print("skipped (budget):", ", ".join(skipped))
    write_report(report, args.out, "bench_kernels.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
