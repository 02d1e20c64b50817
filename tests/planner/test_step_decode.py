"""The one-row decode plan (``_plan_decode``, its arrays shared between steps) equals the general
path's plan of the same step, field by field, and its shared arrays cannot be written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import v41plan.planner.step as step_mod
from tests.planner.helpers import spec
from v41plan.planner.step import CompressPlan, StepArrays, plan_step


def decode_arrays(s, n: int, seed: int, **kw) -> StepArrays:
    rng = np.random.default_rng(seed)
    P = s.replay.hash_block_tokens
    prompt = rng.integers(1, 300, n)
    start = prompt + rng.integers(0, 200, n)
    pages = int(start.max()) // P + 1
    tables = np.full((n, pages + 1), -1, dtype=np.int64)
    for i in range(n):
        k = int(start[i]) // P + 1
        tables[i, :k] = rng.permutation(10 * n * pages)[:k]
    return StepArrays(
        slots=rng.permutation(2 * n)[:n],
        block_tables=tables,
        prompt_lens=prompt,
        starts=start,
        chunk_lens=np.ones(n, dtype=np.int64),
        is_decode=np.ones(n, dtype=bool),
        prefix_hits=(prompt // P) * P * rng.integers(0, 2, n),
        fresh_slot=np.zeros(n, dtype=bool),
        **kw,
    )


def same(a, b, path="plan"):
    """Equal values and dtypes, recursively over plans, mappings and arrays."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, path
        assert a.shape == b.shape and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            if f.name != "table":
                same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (dict, step_mod.LayerRows)):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("name", ["tiny", "deepseek_v41_flash"])
@pytest.mark.parametrize("n", [1, 7, 256])
def test_decode_plan_equals_the_general_path(name, n, monkeypatch):
    s = spec(name)
    for seed, kw in ((0, {}), (1, {"running_bs": n, "running_tokens": n}), (2, {})):
        a = decode_arrays(s, n, seed, **kw)
        fast = plan_step(a, s)
        again = plan_step(decode_arrays(s, n, seed + 10), s)  # shares the constant arrays
        assert again.cu_seqlens_q is fast.cu_seqlens_q
        monkeypatch.setattr(step_mod, "_DECODE_FAST", False)
        general = plan_step(a, s)
        monkeypatch.setattr(step_mod, "_DECODE_FAST", True)
        same(fast, general)
        assert all(isinstance(c, CompressPlan) for c in fast.compress.values())


def test_shared_decode_arrays_are_write_protected():
    s = spec("tiny")
    p = plan_step(decode_arrays(s, 5, 3), s)
    with pytest.raises(ValueError):
        p.cu_seqlens_q[0] = 7
    with pytest.raises(ValueError):
        p.layer_rows[(0, "attention")][0] = 3
    p.positions[0] = 1  # the step's own arrays stay the plan's to hand out
