"""Index scorer + top-k time at a fixed context while ``max_model_len`` grows.

    python benchmarks/bench_scorer.py [--spec medium] [--context 8192] [--rows 64]
        [--max-model-lens 8192,262144] [--device cuda|cpu] [--out report.json]

``--rows`` query rows of one request (a prefill chunk's tail, say) at the end of a
``--context``-token context score the spec's first index source's plane through the kernel
backend's ``score_topk``, the way ``RuntimeModel`` calls it. The request's block table has
``ceil(max_model_len / page_tokens) + 1`` columns, holding pages for the context and -1 past
it. Two figures per ``max_model_len``: the runtime's eager step (the table cut to
``paged_model.index_pages_needed``, so the work follows the context) and the whole width (what a
captured decode graph reads with the torch backend). Prints the ratio of the widest
``max_model_len`` to the narrowest; the claim is that the narrowed time does not move (within
10%). Writes JSON with the provenance.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_io import write_report


def main(argv: list[str] | None = None) -> int:
    """Build the plane, time both widths per ``max_model_len``, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="medium")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-model-lens", default="8192,262144")
    ap.add_argument("--index-cache-dtype", default="fp8", choices=["fp8", "fp4"])
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.paged_model import index_pages_needed
    from v41plan.runtime.pools import Pools
    from v41plan.serving.engine import resolve_spec
    from v41plan.validation.provenance import provenance

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = resolve_spec(args.spec)
    cfg = config_from_cache_spec(spec)
    owner = next(info.index for info in cfg.layers if info.role == "full")
    ratio = cfg.layers[owner].ratio
    g = spec.geometry("bf16", args.index_cache_dtype)
    P = g.page_tokens
    ctx_pages = -(-args.context // P)
    pools = Pools(g, ctx_pages + 1, 1, device)
    planes = (
        (pools.index[owner],)
        if owner in pools.index
        else (pools.index_values[owner], pools.index_scales[owner])
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    for pl in planes:  # random key bytes (fp8 codes, or fp4 codes and scales) in every page
        pl.copy_(torch.randint(0, 120, pl.shape, generator=gen, dtype=torch.uint8).to(device))
    if owner in pools.index:  # the fp8 plane's row scale: a positive float
        pools.index_scale[owner].fill_(0.01)
    kb = TorchBackend()
    nih, ihd = cfg.index_n_heads, cfg.index_head_dim
    q = torch.randn(args.rows, nih, ihd, generator=gen).to(device)
    w = torch.randn(args.rows, nih, generator=gen).to(device)
    pos = torch.arange(args.context - args.rows, args.context, device=device)
    bound = (pos + 1) // ratio
    rpp = P // ratio

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e3

    rows = []
    for max_len in [int(x) for x in args.max_model_lens.split(",")]:
        width = -(-max_len // P) + 1
        table = torch.full((args.rows, width), -1, dtype=torch.long, device=device)
        table[:, :ctx_pages] = torch.arange(ctx_pages, device=device)
        n = index_pages_needed(args.context - 1, ratio, rpp, cfg.candidate_block_size, width)
        narrowed = timed(
            lambda t=table, n=n: kb.score_topk(planes, q, w, bound, t[:, :n], cfg.index_topk, None)
        )
        full = timed(lambda t=table: kb.score_topk(planes, q, w, bound, t, cfg.index_topk, None))
        same = torch.equal(
            kb.score_topk(planes, q, w, bound, table[:, :n], cfg.index_topk, None),
            kb.score_topk(planes, q, w, bound, table, cfg.index_topk, None),
        )
        rows.append({
            "max_model_len": max_len, "table_width": width, "pages_read": n,
            "narrowed_ms": narrowed, "full_width_ms": full, "ids_equal": bool(same),
        })  # fmt: skip
    ratio_narrowed = rows[-1]["narrowed_ms"] / rows[0]["narrowed_ms"]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "spec": spec.name,
        "context": args.context,
        "query_rows": args.rows,
        "index_cache_dtype": args.index_cache_dtype,
        "rows": rows,
        "narrowed_widest_over_narrowest": ratio_narrowed,
        "provenance": provenance(),
    }
    print(f"scorer + top-k, {spec.name}, {args.rows} rows at {args.context} context, {device}")
    print(f"{'max_model_len':>13} {'width':>6} {'pages':>6} {'narrowed ms':>12} {'full ms':>9} ids")
    for r in rows:
        print(f"{r['max_model_len']:>13} {r['table_width']:>6} {r['pages_read']:>6} "
              f"{r['narrowed_ms']:>12.3f} {r['full_width_ms']:>9.3f} "
              f"{'equal' if r['ids_equal'] else 'DIFFER'}")  # fmt: skip
    print(f"narrowed time, widest / narrowest max_model_len: {ratio_narrowed:.2f} "
          f"({'within' if abs(ratio_narrowed - 1) <= 0.10 else 'outside'} 10%)")  # fmt: skip
    write_report(report, args.out, "bench_scorer.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
