"""TTFT of a request whose long prefix was evicted from the device: cold vs each KV tier.

    python benchmarks/bench_kv_offload.py --spec tiny --prefix-len 8192 \\
        --out reports/cpu/bench_kv_offload.json [--lmcache]

Per tier (``none`` = no connector: the evicted prefix is recomputed; ``local``; ``lmcache_mp``
with ``--lmcache``, a server this script starts on a free 127.0.0.1 port), one engine with a
device pool sized for one request: the prompt (``--prefix-len`` shared tokens + a short suffix)
runs once (its TTFT is the cold figure), a different prompt of the same length then turns the
device pool over, and the first prompt runs again with a new suffix: its TTFT is the evicted-
prefix figure, with the blocks the tier gave back. The ceiling beside them is the same
request's TTFT when the device still holds the prefix (a device prefix hit, same engine
settings). Every second run's tokens are compared with a fresh engine's cold run of the same
prompt under the copy transfer (exact); under ``replay`` they are reported only.
Prints a short table; writes JSON through ``report_io.write_report``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report_io import write_report


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(2)]


def measure(tier: str, args, connector_config: dict | None) -> dict:
    """One tier's cold / device-hit / evicted-prefix TTFT (seconds)."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    page_probe = LLM(args.spec, runner_factory=lambda *a: None)
    P = page_probe.page_tokens
    total = args.prefix_len + 2 * P
    opts = {
        "max_model_len": total + P,
        "max_num_seqs": 1,
        "max_num_batched_tokens": args.chunk,
        "num_pages": -(-(total + P) // P) + 4,  # one request: the next prompt evicts the last
        "dtype": args.dtype,
        "encoder_swa_bounded_replay": args.transfer == "replay",
    }
    if connector_config is not None:
        opts["kv_transfer_config"] = connector_config
    llm = LLM(args.spec, **opts)
    vocab = llm.vocab_size
    shared, other = _prompts(args.prefix_len, vocab, args.seed)
    one = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def ttft(prompt):
        t0 = time.perf_counter()
        out = llm.generate([prompt], one)[0]
        return out.stats.get("ttft_s") or (time.perf_counter() - t0), out

    cold_s, _ = ttft(shared + [1, 2, 3])
    hit_s, _ = ttft(shared + [4, 5, 6])  # the device still holds the prefix
    ttft(other + [1, 2, 3])  # turns the device pool over
    evicted_s, out = ttft(shared + [7, 8, 9])
    row = {
        "tier": tier,
        "prefix_len": args.prefix_len,
        "cold_ttft_s": round(cold_s, 4),
        "device_hit_ttft_s": round(hit_s, 4),
        "evicted_ttft_s": round(evicted_s, 4),
        "evicted_hit_tokens": out.stats.get("hits", [0])[-1],
        "speedup_vs_cold": round(cold_s / evicted_s, 2),
        "of_floor": round(hit_s / evicted_s, 3),
        "tokens": out.outputs[0].token_ids,
    }
    if llm.connector is not None:
        row["connector_stats"] = vars(llm.connector.stats)
        llm.connector.close()
    if args.transfer == "copy":
        ref = LLM(args.spec, **{k: v for k, v in opts.items() if k != "kv_transfer_config"})
        row["tokens_equal_cold"] = (
            ref.generate([shared + [7, 8, 9]], one)[0].outputs[0].token_ids == row["tokens"]
        )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="tiny")
    ap.add_argument("--prefix-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--transfer", choices=["copy", "replay"], default="copy")
    ap.add_argument("--lmcache", action="store_true", help="also an LMCache MP server tier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from v41plan.validation.provenance import provenance

    rows = [measure("none", args, None)]
    rows.append(measure("local", args, {"kv_connector": "local", "bytes": 8 << 30}))
    if args.lmcache:
        from v41plan.runtime.kv_lmcache import lmcache_server
        from v41plan.serving.engine import LLM

        page = LLM(args.spec, runner_factory=lambda *a: None).page_tokens
        with lmcache_server(page) as (host, port, _proc):
            cfg = {"kv_connector": "lmcache_mp", "host": host, "port": port}
            rows.append(measure("lmcache_mp", args, cfg))
    print(f"{'tier':<11} {'cold s':>8} {'device hit s':>13} {'evicted s':>10} {'x cold':>7} "
          f"{'of_floor':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['tier']:<11} {r['cold_ttft_s']:>8.3f} {r['device_hit_ttft_s']:>13.3f} "
            f"{r['evicted_ttft_s']:>10.3f} {r['speedup_vs_cold']:>7.2f} {r['of_floor']:>8.3f}"
        )
    import torch

    report = {
        "device": "cpu",
        "torch": torch.__version__,
        "spec": args.spec,
        "transfer": args.transfer,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "provenance": provenance(),
        "note": "of_floor = device-hit TTFT / evicted-prefix TTFT (the device hit is the ceiling)",
        "rows": rows,
    }
    write_report(report, args.out, "bench_kv_offload.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
