"""``v41plan serve`` under torchrun at world size 2 (gloo, tensor parallel 2): rank 0 serves,
rank 1 steps the schedule rank 0 broadcasts; results equal the single-process engine and both
ranks exit 0 on SIGTERM to rank 0 (about 20 s on 2 cores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.serving.helpers import ROOT
from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_serve_under_torchrun_tp2_equals_one_process():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "v41plan", "serve", "--port", str(port), "--max-num-seqs", "4",
        "--grace-s", "0.5", "--log-level", "warning", "--dtype", "float64",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        assert proc.poll() is None, "".join(lines)[-3000:]
        prompts = ["The sky is", "hello world", "1, 2, 3,"]
        served = _post(
            url + "/v1/completions",
            {"prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        seeded = _post(
            url + "/v1/completions",
            {"prompt": prompts[0], "max_tokens": 6, "temperature": 0.9, "seed": 3, "n": 2},
        )
        # SIGTERM to rank 0 (the server): it drains, tells rank 1 to stop, and both exit 0.
        banner = next(line for line in lines if line.startswith("v41plan serve:"))
        rank0 = int(banner.split(" pid ")[1].split(")")[0])
        os.kill(rank0, signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "world size 2" in banner
    # float64: a TP=2 sum and a different batching change only summation order, far below any
    # greedy margin (in float32 the random tiny model can flip a near-tie)
    offline = LLM("tiny", world_size=1, max_num_seqs=4, dtype="float64")
    want = offline.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    got = sorted(served["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got] == [o.outputs[0].text for o in want]
    want_seeded = offline.generate(
        [prompts[0]] * 2,
        [SamplingParams(max_tokens=6, temperature=0.9, seed=3 + i) for i in range(2)],
    )
    got_seeded = sorted(seeded["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in got_seeded] == [o.outputs[0].text for o in want_seeded]
