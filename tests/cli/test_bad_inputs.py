"""Every bad input through the real entry points: exit code, one stderr line naming the input,
no traceback (``python -m v41plan ...`` and ``python -m v41plan.validation.validate_runtime``).

Each case is one the issue lists; the fuzzers in ``test_fuzz_inputs.py`` cover the rest
in-process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "specs" / "tiny.yaml"
needs_cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks a refusal made on a machine without CUDA"
)


def _env() -> dict[str, str]:
    env = dict(os.environ, TQDM_DISABLE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("V41PLAN_TRACEBACK", None)
    return env


def v41plan(*args: str, module: str = "v41plan") -> subprocess.CompletedProcess:
    """Run ``python -m MODULE ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=300,
        check=False,
    )


def validate_runtime(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m v41plan.validation.validate_runtime ARGS``."""
    return v41plan(*args, module="v41plan.validation.validate_runtime")


def refused(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """Assert the exit code, exactly one stderr line holding every needle, no traceback."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A valid tiny checkpoint written once for the module."""
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.checkpoint import write_checkpoint
    from v41plan.model.config import config_from_cache_spec

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_checkpoint(out, config_from_cache_spec(load_cache_spec("tiny")), seed=0)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(ckpt: Path, edit) -> None:
    p = ckpt / "config.json"
    cfg = json.loads(p.read_text())
    edit(cfg["text_config"])
    p.write_text(json.dumps(cfg))


# --- checkpoints ---------------------------------------------------------------------------


def test_truncated_shard(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "ckpt")
    shard = next(bad.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    line = refused(v41plan("run", "--checkpoint", str(bad), "--max-tokens", "1"))
    assert line.startswith(f"v41plan run: --checkpoint {bad}: {shard.name} is truncated")


def test_config_value_of_the_wrong_type(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "ckpt")
    _edit_config(bad, lambda t: t.update(vocab_size="260"))
    refused(
        v41plan("run", "--checkpoint", str(bad)),
        "--checkpoint",
        "config.json: vocab_size must be an integer, got '260'",
    )


def test_config_key_with_a_typo(checkpoint, tmp_path):
    bad = _copy(checkpoint, tmp_path / "ckpt")
    _edit_config(bad, lambda t: t.update(hiden_size=t.pop("hidden_size")))
    refused(
        v41plan("run", "--checkpoint", str(bad)),
        "config.json: unknown key 'hiden_size' (did you mean 'hidden_size'?)",
    )


# --- specs ---------------------------------------------------------------------------------


def test_uncompiled_spec_with_a_typo_key_is_located(tmp_path):
    spec = tmp_path / "specs" / "tiny.yaml"
    spec.parent.mkdir()
    spec.write_text(TINY.read_text().replace("  hidden_size:", "  hiden_size:"))
    line = refused(v41plan("run", "--spec", str(spec)), "unknown key 'hiden_size'")
    assert line.startswith("v41plan run: specs/tiny.yaml:") and ":3: unknown key" in line


def test_uncompiled_spec_with_a_yaml_syntax_error_is_located(tmp_path):
    spec = tmp_path / "mine.yaml"
    spec.write_text("spec_version: 1\nname: [mine\n")
    refused(v41plan("run", "--spec", str(spec)), f"{tmp_path.name}/mine.yaml:3:1: YAML syntax")


def test_spec_path_that_does_not_exist():
    line = refused(v41plan("run", "--spec", "specs/no_such.yaml"))
    assert line == "v41plan run: --spec specs/no_such.yaml: no such file"


def test_edited_spec_outside_specs_sharing_a_shipped_name_is_not_called_stale(tmp_path):
    spec = tmp_path / "elsewhere" / "tiny.yaml"
    spec.parent.mkdir()
    spec.write_text(TINY.read_text().replace("description: Every", "description: My every"))
    proc = v41plan("explain", str(spec), "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    got = json.loads(proc.stdout)["spec_sha256"]  # the edited file, compiled, not "stale"
    assert got == hashlib.sha256(spec.read_bytes()).hexdigest()


# --- validate_runtime ----------------------------------------------------------------------


def test_validate_runtime_bad_spec(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY.read_text().replace("  hidden_size:", "  hiden_size:"))
    line = refused(validate_runtime("--spec", str(spec)), "unknown key 'hiden_size'")
    assert line.startswith("validate_runtime: ") and "RUNTIME_ACCEPTANCE" not in line


def test_validate_runtime_missing_checkpoint(tmp_path):
    proc = validate_runtime("--checkpoint", str(tmp_path / "nope"))
    refused(proc, f"--checkpoint {tmp_path / 'nope'}: no such directory")
    assert "RUNTIME_ACCEPTANCE" not in proc.stdout


def test_validate_runtime_unknown_kv_cache_dtype():
    refused(validate_runtime("--kv-cache-dtype", "fp8"), "--kv-cache-dtype", "'fp8'", "bf16")


@needs_cpu_only
def test_validate_runtime_graph_without_cuda():
    proc = validate_runtime("--graph")
    refused(proc, "--graph", "CUDA")
    assert proc.stdout == ""  # refused up front: no scenario ran
    proc = validate_runtime("--graph", "--cudagraph-mode", "PIECEWISE")
    refused(proc, "--graph", "PIECEWISE", "CUDA")
    assert proc.stdout == ""


def test_validate_runtime_cudagraph_mode_without_graph():
    proc = validate_runtime("--cudagraph-mode", "PIECEWISE")
    refused(proc, "--cudagraph-mode PIECEWISE needs --graph")
    assert proc.stdout == ""


# --- bench and the run's length cap ----------------------------------------------------------


@needs_cpu_only
def test_bench_ceilings_without_cuda_says_why():
    refused(v41plan("bench", "ceilings"), "ceilings: needs a CUDA device")


def test_bench_ceilings_help():
    proc = v41plan("bench", "ceilings", "--help")
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--out" in proc.stdout


def test_max_tokens_beyond_max_model_len_is_said_at_admission():
    proc = v41plan(
        "run", "--prompt-token-ids", "1,2,3,4,5,6,7,8,9,10", "--max-model-len", "12",
        "--max-tokens", "40", "--json",
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "--max-tokens 40" in ln]
    want = (
        "v41plan run: note: request 0: --max-tokens 40 does not fit max_model_len 12 after its "
        "10-token prompt; it stops after 2 tokens (finish: length)"
    )
    assert notes == [want]
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 2 and out["finish_reason"] == "length"
