"""Shared set-up for the paged runtime tests: random tiny models, reference runs, step plans."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.checkpoint import LoadedCheckpoint, random_state
from v41plan.model.config import config_from_cache_spec
from v41plan.model.reference import ReferenceModel
from v41plan.planner.step import RequestInput, StepInput, plan_step
from v41plan.runtime.paged_model import RuntimeModel

SPECS = Path(__file__).resolve().parents[2] / "specs"
PAIRS = [("bf16", "fp8"), ("bf16", "fp4"), ("fp4", "fp8"), ("fp4", "fp4")]
DTYPE = torch.float64


@cache
def model(spec_name: str, seed: int = 0):
    """(cache spec, config, processed float64 weights, Engram host) of a random checkpoint;
    ``spec_name`` names a shipped spec or is a spec file's path."""
    path = spec_name if spec_name.endswith(".yaml") else str(SPECS / f"{spec_name}.yaml")
    spec = load_cache_spec_unchecked(path)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, seed))
    return spec, cfg, ckpt.process(DTYPE), ckpt.engram_host()


def token_ids(n: int, seed: int) -> np.ndarray:
    """Deterministic token ids below 256 (the byte vocabulary)."""
    return np.random.default_rng(seed).integers(0, 256, n)


@cache
def reference(spec_name: str, index_fmt: str, seed: int, n: int):
    """Reference full-prefill logits ``[n, V]`` and selections of ``token_ids(n, seed)``."""
    _spec, cfg, w, eng = model(spec_name)
    ref = ReferenceModel(cfg, w, eng, DTYPE, index_cache_dtype=index_fmt)
    logits = ref.prefill(token_ids(n, seed))
    return logits, {k: v.clone() for k, v in ref.selections.items()}


def runtime(spec_name: str, kv: str, ix: str, **kw) -> RuntimeModel:
    """A runtime model over the shared random weights."""
    spec, cfg, w, eng = model(spec_name)
    args = {
        "num_pages": 24,
        "num_slots": 4,
        "max_tokens": 320,
        "max_bs": 4,
        "table_width": 12,
        "dtype": DTYPE,
    }
    args.update(kw)
    return RuntimeModel(spec, w, eng, kv_cache_dtype=kv, index_cache_dtype=ix, cfg=cfg, **args)


def step(spec, requests, *, decoder_replay=False, encoder_replay=False, pad_tokens=0, pad_bs=0):
    """Plan one step of ``(slot, table, prompt_len, start, chunk_len, phase[, fresh])`` requests."""
    reqs = tuple(
        RequestInput(
            slot=r[0],
            block_table=tuple(r[1]),
            prompt_len=r[2],
            start=r[3],
            chunk_len=r[4],
            phase=r[5],
            fresh_slot=r[6] if len(r) > 6 else False,
            token_ids=r[7] if len(r) > 7 else None,
        )
        for r in requests
    )
    flags = {"decoder_replay": decoder_replay, "encoder_replay": encoder_replay}
    # rows after any back-off, then the padded width
    rows = plan_step(StepInput(reqs), spec, **flags).scheduled_tokens if reqs else 0
    si = StepInput(
        reqs,
        running_bs=len(reqs) + pad_bs if pad_bs else None,
        running_tokens=rows + pad_tokens if pad_tokens else None,
    )
    return plan_step(si, spec, **flags)


def cursor_expected(engram, ids: np.ndarray, end: int) -> list[int]:
    """``[position, latest three compressed ids newest first]`` after positions ``[0, end)``."""
    c = engram.compress(ids[:end])
    hist = [int(c[end - 1 - k]) if end - 1 - k >= 0 else -1 for k in range(3)]
    return [end, *hist]
