"""The fused dense kernels against the torch compositions they replace, per mHC site (CUDA).

    python benchmarks/bench_dense_kernels.py [--tokens 1,64,2048] [--budget-s 90] [--out F]

At the MEDIUM widths (hidden, hc, Sinkhorn iterations and eps from ``specs/medium.yaml``, or
``--spec``'s; streams in bf16, mHC parameters in float32, random values) each op runs three
ways: the eager torch composition (``v41plan.runtime.kernels.dense_ref``), ``torch.compile`` of that
composition (Inductor, ``fullgraph=True``) and the Triton kernel
(``v41plan.runtime.kernels.triton_dense``), at decode batch 1 and 64 and a 2048-token prefill:

- ``site``: mix prediction + Sinkhorn + collapse + RMSNorm; ``site_fp8``: plus the W8A8
  activation quant of ``x``; ``expand``: ``hc_expand``; ``expand_site``: the expand followed by
  the next site on the same rows; ``fake_fp8`` / ``fp8_act_quant``: the quantizer over
  ``[tokens, hidden]``.

The ``site`` op is also timed with the site kernel forced to each ``--site-configs`` form
(``triton[mix,tokens,lanes,warps]`` rows), to choose ``triton_dense.SITE_CONFIGS``.

Per row: ``kernels``, the GPU kernels one call launches (``torch.profiler``); ``ms``, device time
per call inside a CUDA graph of 20 calls (events around its replay); ``eager_ms``, device time
per call of 20 back-to-back eager calls (launch gaps included); ``floor_ms``, the op's bytes
(inputs read once, outputs written once, at their dtypes) over the copy bandwidth measured in
this run, and ``of_floor = floor_ms / ms`` (1 at the floor; the report of c3c745c recorded its
inverse, ``ms / floor_ms``, under the same name); ``max_abs_diff`` / ``bit_identical`` against the
eager composition (the parity the compiled and fused paths keep). A row that fails records its
error and the run goes on; ``--budget-s`` bounds the whole run (rows past it are recorded as
skipped, compiled rows first). Writes JSON to ``--out`` (default ``$OUT/bench_dense_kernels.json``
when ``$OUT`` is set).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import copy_bandwidth_bytes_per_s
from report_io import write_report

CALLS_PER_GRAPH = 20
REPLAYS = 10


def _commit(explicit: str | None) -> str:
    """The checkout's commit (``--commit``, else ``git rev-parse``, else ``unknown``)."""
    if explicit:
        return explicit
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            check=False,
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _compare(got, want) -> dict:
    """Largest absolute difference and bitwise identity of two outputs (tuples of tensors)."""
    diff, same = 0.0, True
    for a, b in zip(_flat(got), _flat(want), strict=True):
        if a.dtype == torch.float8_e4m3fn:
            same &= torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            a, b = a.float(), b.float()
        else:
            same &= a.dtype == b.dtype and torch.equal(a, b)
        if a.numel():
            diff = max(diff, (a.double() - b.double()).abs().max().item())
    return {"max_abs_diff": diff, "bit_identical": bool(same)}


def _count_kernels(fn, inputs) -> int:
    """GPU activities (kernels, memsets, copies) one call launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _events_ms(run, repeats: int) -> float:
    """Median device milliseconds of ``run()`` between two CUDA events."""
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _graph_ms(fn, inputs) -> float:
    """Device ms per call inside one CUDA graph of ``CALLS_PER_GRAPH`` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    ms = _events_ms(graph.replay, REPLAYS) / CALLS_PER_GRAPH
    del graph
    return ms


def _eager_ms(fn, inputs) -> float:
    """Device ms per call of back-to-back eager calls (launch gaps included)."""

    def run():
        for _ in range(CALLS_PER_GRAPH):
            fn(*inputs)

    run()
    return _events_ms(run, 5) / CALLS_PER_GRAPH


def _with_site_config(td, form, fn):
    """``fn`` with the site kernel forced to one form ``(mix, tokens, lanes, warps)``."""

    def run(*args):
        saved = list(td.SITE_CONFIGS), list(td.SITE_CONFIGS_WIDE)
        td.SITE_CONFIGS[:] = td.SITE_CONFIGS_WIDE[:] = [(1 << 62, form)]
        try:
            return fn(*args)
        finally:
            td.SITE_CONFIGS[:], td.SITE_CONFIGS_WIDE[:] = saved

    return run


def _ops(cfg, ref, td, Q, HcParams, dev: str = "cuda"):
    """name -> (inputs(N), torch composition, fused kernel, bytes(N)), operands on ``dev``."""
    D, hc, iters = cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters
    hc_eps, eps = cfg.hc_eps, cfg.rms_norm_eps
    mixes = (2 + hc) * hc
    bf16 = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    p = HcParams(
        torch.randn(mixes, hc * D, generator=g, device=dev) * 0.02,
        torch.randn(mixes, generator=g, device=dev),
        torch.rand(3, generator=g, device=dev) + 0.5,
    )
    w = (1 + 0.1 * torch.randn(D, generator=g, device=dev)).to(bf16)
    param_bytes = (mixes * hc * D + mixes + 3) * 4 + D * 2

    def streams(N):
        X = torch.randn(N, hc, D, generator=g, device=dev).to(bf16)
        pre = torch.rand(N, hc, generator=g, device=dev) + hc_eps
        return X, pre

    def mixes_out(N):
        post = 2 * torch.rand(N, hc, generator=g, device=dev)
        C = torch.softmax(torch.randn(N, hc, hc, generator=g, device=dev), -1)
        return post, C

    def site_io(N):  # X, pre_in, parameters in; x, pre, post, C out
        return N * hc * D * 2 + N * hc * 4 + param_bytes + N * D * 2 + N * mixes * 4

    def quant_out(N):  # E4M3 codes and float32 scales
        return N * D + N * (D // 32) * 4

    def expand_io(N):  # y, post, C, X in; X' out
        return N * D * 2 + N * (hc + hc * hc) * 4 + 2 * N * hc * D * 2

    site_args = (p, w, hc, iters, hc_eps, eps)

    def site_inputs(N):
        return streams(N)

    def expand_inputs(N):
        X, _ = streams(N)
        post, C = mixes_out(N)
        return torch.randn(N, D, generator=g, device=dev).to(bf16), X, post, C

    def expand_site_inputs(N):
        y, X, post, C = expand_inputs(N)
        return y, X, post, C, torch.rand(N, hc, generator=g, device=dev) + hc_eps

    def act_inputs(N):
        return (torch.randn(N, D, generator=g, device=dev).to(bf16) * 3,)

    return {
        "site": (
            site_inputs,
            lambda X, pre: ref.mhc_site(X, pre, *site_args),
            lambda X, pre: td.mhc_site(X, pre, *site_args),
            site_io,
        ),
        "site_fp8": (
            site_inputs,
            lambda X, pre: ref.mhc_site_fp8(X, pre, *site_args),
            lambda X, pre: td.mhc_site_fp8(X, pre, *site_args),
            lambda N: site_io(N) + quant_out(N),
        ),
        "expand": (expand_inputs, ref.hc_expand, td.hc_expand, expand_io),
        "expand_site": (
            expand_site_inputs,
            lambda y, X, post, C, pre: ref.mhc_expand_site(y, X, post, C, pre, *site_args),
            lambda y, X, post, C, pre: td.mhc_expand_site(y, X, post, C, pre, *site_args),
            lambda N: expand_io(N) + site_io(N) - N * hc * D * 2,  # X2 is read from registers
        ),
        "fake_fp8": (act_inputs, Q.fake_fp8, td.fake_fp8, lambda N: 2 * N * D * 2),
        "fp8_act_quant": (
            act_inputs,
            ref.fp8_act_quant,
            td.fp8_act_quant,
            lambda N: N * D * 2 + quant_out(N),
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="medium", help="the widths: medium, flash_slice or a YAML")
    ap.add_argument("--tokens", default="1,64,2048", help="token counts (decode batches, prefill)")
    ap.add_argument("--ops", default=None, help="comma list of ops (default: all)")
    ap.add_argument("--budget-s", type=float, default=90.0, help="wall-clock bound of the run")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument(
        "--site-configs",
        default="products,1,128,4;tf32x3,16,32,4;tf32x3,32,32,4;ieee,16,32,4",
        help="site kernel forms also timed on every site row (mix,tokens,lanes,warps;...); '' none",
    )
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dense_kernels.py needs a CUDA device")
        return 2
    t0 = time.monotonic()
    import triton
    from medium_model import load_spec

    from v41plan.model import quant as Q
    from v41plan.model.config import config_from_cache_spec
    from v41plan.model.layers import HcParams
    from v41plan.runtime.kernels import dense_ref as ref
    from v41plan.runtime.kernels import triton_dense as td

    torch._dynamo.config.cache_size_limit = 64
    cfg = config_from_cache_spec(load_spec(args.spec))
    bw = copy_bandwidth_bytes_per_s()
    ops = _ops(cfg, ref, td, Q, HcParams)
    names = args.ops.split(",") if args.ops else list(ops)
    sizes = [int(t) for t in args.tokens.split(",")]
    variants = ["eager", "triton"] + ([] if args.no_compile else ["compiled"])
    sweep = [c.split(",") for c in args.site_configs.split(";") if c.strip()]
    sweep = [(m, int(bn), int(bd), int(w)) for m, bn, bd, w in sweep]
    rows = []
    for name in names:
        make, eager_fn, fused_fn, nbytes = ops[name]
        compiled_fn = None
        for N in sizes:
            inputs = make(N)
            want = eager_fn(*inputs)
            torch.cuda.synchronize()
            forms = [(v, None) for v in variants]
            if name == "site":
                forms += [(f"triton[{','.join(map(str, c))}]", c) for c in sweep]
            for variant, form in forms:
                row = {"op": name, "variant": variant, "tokens": N, "hidden": cfg.hidden_size}
                rows.append(row)
                elapsed = time.monotonic() - t0
                if elapsed > args.budget_s or (
                    variant == "compiled" and elapsed > 0.7 * args.budget_s
                ):
                    row["error"] = f"skipped: time budget ({elapsed:.0f} s)"
                    continue
                try:
                    if variant == "compiled":
                        if compiled_fn is None:
                            compiled_fn = torch.compile(eager_fn, fullgraph=True)
                        fn = compiled_fn
                    elif form is not None:
                        fn = _with_site_config(td, form, fused_fn)
                    else:
                        fn = eager_fn if variant == "eager" else fused_fn
                    got = fn(*inputs)
                    torch.cuda.synchronize()
                    row.update(_compare(got, want))
                    try:
                        row["kernels"] = _count_kernels(fn, inputs)
                    except Exception as exc:  # noqa: BLE001 - no profiler: the timing still counts
                        row["kernels"] = None
                        row["kernels_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    row["ms"] = _graph_ms(fn, inputs)
                    row["eager_ms"] = _eager_ms(fn, inputs)
                    row["bytes"] = int(nbytes(N))
                    row["floor_ms"] = row["bytes"] / bw * 1e3
                    row["of_floor"] = row["floor_ms"] / row["ms"]
                except Exception as exc:  # noqa: BLE001 - a failing row is reported, the run goes on
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    torch.cuda.synchronize()

    from v41plan.validation.provenance import provenance

    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": _commit(args.commit),
        "provenance": provenance(),
        "spec": args.spec,
        "copy_bytes_per_s": bw,
        "dtype": "bfloat16 streams, float32 mHC parameters",
        "hidden": cfg.hidden_size,
        "hc": cfg.hc_mult,
        "sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "wall_s": time.monotonic() - t0,
        "rows": rows,
    }
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; hidden {cfg.hidden_size}, hc {cfg.hc_mult}")
    print(
        f"{'op':>13} {'tokens':>6} {'variant':>24} {'kernels':>7} {'ms':>8} {'eager ms':>8} "
        f"{'floor ms':>8} {'x floor':>8} parity"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['op']:>13} {r['tokens']:>6} {r['variant']:>24}  {r['error'][:90]}")
            continue
        parity = "identical" if r["bit_identical"] else f"max diff {r['max_abs_diff']:.2e}"
        print(
            f"{r['op']:>13} {r['tokens']:>6} {r['variant']:>24} {r['kernels']!s:>7} "
            f"{r['ms']:>8.4f} {r['eager_ms']:>8.4f} {r['floor_ms']:>8.4f} {r['of_floor']:>8.4f} "
            f"{parity}"
        )
    print(f"wall {report['wall_s']:.0f} s")
    write_report(report, args.out, "bench_dense_kernels.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
