"""``v41plan bench``: dispatches to the checkout's benchmark scripts."""

from __future__ import annotations

import pytest
import torch

from v41plan.cli.bench import BENCH_DIR, BENCHMARKS
from v41plan.cli.main import main


def test_every_listed_benchmark_exists():
    for script, _ in BENCHMARKS.values():
        assert (BENCH_DIR / script).is_file(), script


def test_unknown_benchmark_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_a_cuda_benchmark_refuses_cleanly_on_cpu(capsys):
    assert main(["bench", "ceilings"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("v41plan bench: ceilings: needs a CUDA device") and err.count("\n") == 1


def test_a_benchmark_help_runs_without_cuda(capsys):
    assert main(["bench", "ceilings", "--help"]) == 0
    assert "--out" in capsys.readouterr().out
