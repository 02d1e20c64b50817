"""Decode step time on the MEDIUM model (bf16): eager vs FULL CUDA graph, at batch 1, 8 and 64.

    python3 benchmarks/bench_decode.py [--checkpoint DIR] [--context 512] [--out report.json]

Each batch size runs ``bs`` requests prefilled to ``--context`` tokens, then times the same
decode step (every request one token) three ways: eager ``RuntimeModel.forward`` (host work
included), a FULL graph step (host preparation + one replay) and the replay alone on device
events. The ceilings (copy bandwidth, bf16 and FP8 matmul rates) are measured in this process;
each figure is given with its two floors (``medium_model.step_floor``: ``floor_ms`` with the
weights in their shipped formats and W8A8/W4A8 work at the FP8 rate, ``floor_bf16_ms`` with
bf16 weights and the bf16 rate, as the runtime holds them today) and as ``floor / measured``
(``of_floor``: of the replay). Writes JSON, with the tree's provenance, to ``--out``
(``$OUT/bench_decode.json`` on the device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import ceilings_line, measure_ceilings
from medium_model import (
    decode_requests,
    decode_step,
    load_spec,
    load_weights,
    medium_report,
    pool_row_bytes,
    prefill_to_context,
    step_floor,
    time_device,
    time_host,
)
from report_io import write_report


def _backend(name: str):
    from v41plan.runtime.kernels.torch_ref import TorchBackend

    if name == "triton":
        from v41plan.runtime.kernels.triton_backend import TritonBackend

        return TritonBackend()
    return TorchBackend()


def engine_llm(spec, checkpoint, max_bs: int, context: int, steps: int, backend: str):
    """One engine (FULL graphs, bf16) for every batch size ``engine_host_ms`` times."""
    from v41plan.serving.engine import LLM

    return LLM(
        spec, checkpoint, enforce_eager=False, cudagraph_mode="FULL", device="cuda",
        dtype="bfloat16", max_num_seqs=max_bs, max_num_batched_tokens=max(max_bs * context, 4096),
        max_model_len=context + 8 * steps + 64, kernel_backend=backend,
    )  # fmt: skip


def engine_host_ms(llm, bs: int, context: int, steps: int) -> dict:
    """Engine-driven FULL-graph decode steps at ``bs`` running requests, ``LLM.step()`` after
    ``LLM.step()``, with the engine's ``async_scheduling`` on (step N+1's host work runs while
    step N is on the device) and off: per mode the wall time per step (schedule, plan,
    prepare, one replay, readback, postprocess), the host's busy time per step (the wall time
    less the waits for results), the time of ``plan_step`` + ``prepare`` and of ``prepare``
    alone."""
    import statistics
    import time

    import v41plan.planner.step as planner
    from v41plan.serving.sampling import SamplingParams

    runner = llm.runner
    model = runner.model
    prep, plans = [], []
    real, real_plan = model.prepare, planner.plan_step

    def timed(fn, samples):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                samples.append(time.perf_counter() - t0)

        return call

    model.prepare = timed(real, prep)
    planner.plan_step = timed(real_plan, plans)  # (the runner imports it at each launch)
    keys = []
    real_run = runner.graphs.run

    def keyed_run(inputs):
        keys.append(inputs.key)
        return real_run(inputs)

    runner.graphs.run = keyed_run
    params = SamplingParams(max_tokens=8 * steps, ignore_eos=True)
    seqs = [
        llm.add_request([(13 * i + k) % 250 for k in range(context)], params) for i in range(bs)
    ]
    while llm.scheduler.waiting or any(s.is_prefilling for s in llm.scheduler.running):
        llm.step()
    out = {}
    for overlap in (True, False):
        llm.drain()
        llm.async_scheduling = overlap
        for _ in range(3):  # into the steady state (with overlap: a batch in flight)
            llm.step()
        torch.cuda.synchronize()
        prep.clear()
        plans.clear()
        walls, busy = [], []
        b0, o0 = llm.batches, llm.overlapped_steps
        for _ in range(steps):
            w0, t0 = runner.wait_s, time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t0
            walls.append(dt)
            busy.append(dt - (runner.wait_s - w0))
        if llm.batches - b0 != steps or any(s.is_finished for s in seqs):
            raise RuntimeError("the timed steps were not all decode steps of every request")
        out[overlap] = {
            "step_ms": statistics.median(walls) * 1e3,
            "host_busy_ms": statistics.median(busy) * 1e3,
            "prepare_us": statistics.median(prep) * 1e6,
            "plan_prepare_us": statistics.median([a + b for a, b in zip(plans, prep)]) * 1e6,
            "overlapped_steps": llm.overlapped_steps - o0,
        }
    model.prepare, planner.plan_step = real, real_plan
    runner.graphs.run = real_run
    # the engine's own graph of this batch, replayed alone (on the state the last step left)
    llm.drain()
    if len(set(keys[-steps:])) != 1:
        raise RuntimeError(f"the timed steps replayed {len(set(keys[-steps:]))} graphs, not one")
    out["replay_ms"] = time_device(runner.graphs.graphs[keys[-1]].replay, 10) * 1e3
    llm.async_scheduling = True
    for s in seqs:
        llm.abort(s)
    llm.run_until_done()
    stats = runner.graph_stats()["stats"]
    out["graph_steps"] = stats.get("graph_steps", 0)
    out["eager_decode_steps"] = stats.get("eager_decode_steps", 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkpoint", default=None, help="checkpoint directory (default: seeded random weights)"
    )
    ap.add_argument(
        "--context", type=int, default=256, help="tokens each request holds before the timed step"
    )
    ap.add_argument(
        "--spec",
        default="medium",
        help="spec name or YAML (bf16 weights here; the published formats, the CUDA default: "
        "bench_decode_paths.py --spec S --variants compiled)",
    )
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument("--kernel-backend", default="torch", choices=["torch", "triton"])
    ap.add_argument(
        "--engine-steps",
        type=int,
        default=10,
        help="engine-driven FULL-graph decode steps timed for host_ms, with and without "
        "async_scheduling (0: skip)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode.py: needs a CUDA device, and this machine has none", file=sys.stderr)
        return 2
    from v41plan.runtime.graphs import CudaGraphs, capture_buckets
    from v41plan.runtime.paged_model import RuntimeModel

    ceil = measure_ceilings()
    spec = load_spec(args.spec)
    cfg, weights, engram, load_report = load_weights(spec, args.checkpoint)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    max_bs = max(sizes)
    P = spec.replay.hash_block_tokens
    need = -(-(args.context + 8) // P)
    chunk = 8192
    m = RuntimeModel(
        spec,
        weights,
        engram,
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        num_pages=max_bs * need + 8,
        num_slots=max_bs,
        max_tokens=max(chunk, max_bs),
        max_bs=max_bs,
        table_width=need + 1,
        dtype=torch.bfloat16,
        device="cuda",
        cfg=cfg,
        backend=_backend(args.kernel_backend),
    )
    row_bytes = pool_row_bytes(m.geometry)
    runner = CudaGraphs(
        m, spec, [b for b in capture_buckets(spec, max_bs, max_bs) if b[0] in sizes], "FULL"
    )
    capture = runner.capture()

    reqs, ids = decode_requests(spec, max_bs, args.context)
    prefill_to_context(m, spec, reqs, ids, args.context, chunk)
    torch.cuda.synchronize()

    rows = []
    for bs in sizes:
        plan, tok = decode_step(m, spec, reqs, ids, args.context, bs)
        # both paths run the step from the same pool state: the device bytes and the host
        # mirror of the cursors, which prepare reads instead of the device
        snap, mirror = m.pools.backing.clone(), m.pools.cursor_host.copy()
        want = m.forward(plan, tok).logits.float()
        m.pools.backing.copy_(snap)
        m.pools.cursor_host[:] = mirror
        got = runner.run(m.prepare(plan, tok)).logits.float()
        m.pools.backing.copy_(snap)
        m.pools.cursor_host[:] = mirror
        del snap
        same = bool(torch.equal(want.argmax(-1), got.argmax(-1)))
        max_diff = (want - got).abs().max().item()
        eager_s = time_host(lambda plan=plan, tok=tok: m.forward(plan, tok), args.iters)
        graph_s = time_host(
            lambda plan=plan, tok=tok: runner.run(m.prepare(plan, tok)).logits, args.iters
        )
        g = runner.graphs[m.prepare(plan, tok).key]
        replay_s = time_device(g.replay, args.iters)
        fl = step_floor(cfg, plan, ceil, rows=row_bytes, index_cache_dtype=args.index_cache_dtype)
        rows.append(
            {
                "batch": bs,
                "context": args.context,
                "eager_ms": eager_s * 1e3,
                "graph_step_ms": graph_s * 1e3,
                "replay_ms": replay_s * 1e3,
                "speedup_step": eager_s / graph_s,
                "speedup_replay": eager_s / replay_s,
                "tokens_equal": same,
                "max_logit_diff": max_diff,
                **fl,
                "floor_ms": fl["floor_s"] * 1e3,
                "floor_bf16_ms": fl["floor_bf16_s"] * 1e3,
                "of_floor": fl["floor_s"] / replay_s,
                "of_floor_bf16": fl["floor_bf16_s"] / replay_s,
                "eager_of_floor": fl["floor_s"] / eager_s,
                "graph_step_of_floor": fl["floor_s"] / graph_s,
                "replay_of_floor": fl["floor_s"] / replay_s,
            }
        )

    if args.engine_steps:
        del runner, m
        torch.cuda.empty_cache()
        llm = engine_llm(
            spec, args.checkpoint, max_bs, args.context, args.engine_steps, args.kernel_backend
        )
        for r in rows:
            eng = engine_host_ms(llm, r["batch"], args.context, args.engine_steps)
            r["engine_replay_ms"] = eng["replay_ms"]
            r["engine_of_floor"] = r["floor_ms"] / eng["replay_ms"]
            for overlap, suffix in ((True, ""), (False, "_sync")):
                e = eng[overlap]
                r["engine_step_ms" + suffix] = e["step_ms"]
                r["host_ms" + suffix] = e["step_ms"] - eng["replay_ms"]
                r["host_busy_ms" + suffix] = e["host_busy_ms"]
                r["plan_prepare_us" + suffix] = e["plan_prepare_us"]
                r["prepare_us" + suffix] = e["prepare_us"]
                r["overlapped_steps" + suffix] = e["overlapped_steps"]
            r["engine_graph_steps"] = eng["graph_steps"]
            r["engine_eager_decode_steps"] = eng["eager_decode_steps"]
        del llm
        torch.cuda.empty_cache()
    report = medium_report(
        spec, args, ceil, rows, kernel_backend=args.kernel_backend, capture=capture,
        resident_bytes=load_report["resident_bytes"],
        checkpoint_bytes=load_report["checkpoint_bytes"],
    )  # fmt: skip
    print(ceilings_line(ceil))
    print(
        f"{'bs':>4} {'eager ms':>9} {'graph ms':>9} {'replay ms':>9} {'x step':>7} {'x replay':>8} "
        f"{'floor ms':>9} {'bf16 fl':>8} {'bound':>6} {'replay/fl':>9} {'/fl bf16':>8} tokens="
    )
    for r in rows:
        print(
            f"{r['batch']:>4} {r['eager_ms']:>9.2f} {r['graph_step_ms']:>9.2f} "
            f"{r['replay_ms']:>9.2f} "
            f"{r['speedup_step']:>7.1f} {r['speedup_replay']:>8.1f} {r['floor_ms']:>9.3f} "
            f"{r['floor_bf16_ms']:>8.3f} {r['bound']:>6} "
            f"{r['of_floor']:>9.4f} {r['of_floor_bf16']:>8.4f} {r['tokens_equal']}"
        )
    if args.engine_steps:
        print(
            f"{'bs':>4} {'replay ms':>9} {'step ms':>8} {'host ms':>8} {'busy ms':>8} "
            f"{'prepare us':>11} "
            f"{'sync step':>10} {'sync host':>10} {'sync busy':>10} overlapped graph/eager"
        )
        for r in rows:
            print(
                f"{r['batch']:>4} {r['engine_replay_ms']:>9.2f} {r['engine_step_ms']:>8.2f} "
                f"{r['host_ms']:>8.2f} "
                f"{r['host_busy_ms']:>8.2f} {r['plan_prepare_us']:>11.0f} "
                f"{r['engine_step_ms_sync']:>10.2f} {r['host_ms_sync']:>10.2f} "
                f"{r['host_busy_ms_sync']:>10.2f} {r['overlapped_steps']:>10} "
                f"{r['engine_graph_steps']}/{r['engine_eager_decode_steps']}"
            )
    write_report(report, args.out, "bench_decode.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
