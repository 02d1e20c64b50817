"""The same arithmetic on the GPU as on the CPU, in float64: the dense reference and the paged
runtime (every row's logits, every selection, every pool byte).

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.gpu,
]

REL_TOL = 1e-12


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@functools.cache
def _state(spec_name: str):
    from v41plan.model.checkpoint import random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec

    spec = resolve_spec(spec_name)
    cfg = config_from_cache_spec(spec)
    return spec, cfg, random_state(cfg, 0)


def test_reference_on_cuda_matches_cpu():
    """The dense reference: a 40-token prefill and one decode step, float64 CUDA vs CPU."""
    from v41plan.model.checkpoint import LoadedCheckpoint
    from v41plan.model.reference import ReferenceModel

    _spec, cfg, state = _state("tiny")
    ids = np.random.default_rng(9).integers(0, 256, 41)
    cpu = ReferenceModel.from_checkpoint(LoadedCheckpoint.from_state(cfg, state), torch.float64)
    want = cpu.prefill(ids[:40])
    want_step = cpu.decode(int(ids[40]))
    gpu = ReferenceModel.from_checkpoint(
        LoadedCheckpoint.from_state(cfg, state), torch.float64, device="cuda"
    )
    got = gpu.prefill(ids[:40])
    got_step = gpu.decode(int(ids[40]))
    assert got.device.type == "cuda"
    assert _rel(got.cpu(), want) < 1e-10 and _rel(got_step.cpu(), want_step) < 1e-10
    for layer, sel in cpu.selections.items():
        assert torch.equal(gpu.selections[layer].cpu(), sel)
    bf = ReferenceModel.from_checkpoint(
        LoadedCheckpoint.from_state(cfg, state), torch.bfloat16, "cuda"
    )
    assert torch.isfinite(bf.prefill(ids)).all()


def _runtime(spec_name: str, kv: str, ix: str, device: str):
    from v41plan.model.checkpoint import LoadedCheckpoint
    from v41plan.runtime.paged_model import RuntimeModel

    spec, cfg, state = _state(spec_name)
    ckpt = LoadedCheckpoint.from_state(cfg, state)
    return RuntimeModel(
        spec,
        ckpt.process(torch.float64, device),
        ckpt.engram_host(),
        kv_cache_dtype=kv,
        index_cache_dtype=ix,
        num_pages=24,
        num_slots=4,
        max_tokens=128,
        max_bs=4,
        table_width=12,
        dtype=torch.float64,
        device=device,
        cfg=cfg,
    )


@pytest.mark.parametrize("pair", [("bf16", "fp8"), ("fp4", "fp4")], ids=["bf16-fp8", "fp4-fp4"])
@pytest.mark.parametrize("decoder_replay", [False, True], ids=["replay-off", "replay-on"])
def test_paged_runtime_on_cuda_matches_cpu(pair, decoder_replay):
    """TINY-40 over the paged pools, float64: a ragged prefill step (one request finishing its
    prompt, one chunk that does not), the second's final chunk beside a decode row, then decode
    steps. Every row's logits (where defined: NaN positions must agree), every index selection
    and every pool byte must be equal on both devices to float64 summation order."""
    from tests.runtime.paged_helpers import step, token_ids

    spec = _state("tiny40")[0]
    cpu, gpu = (_runtime("tiny40", *pair, d) for d in ("cpu", "cuda"))
    ids = [token_ids(70, 5), token_ids(70, 6)]
    tables = ((9, 7, 5), (8, 6, 4))
    schedule = [
        [(0, tables[0], 40, 0, 40, "prefill"), (1, tables[1], 60, 0, 33, "prefill")],
        [(0, tables[0], 40, 40, 1, "decode"), (1, tables[1], 60, 33, 27, "prefill")],
        [(0, tables[0], 40, 41, 1, "decode"), (1, tables[1], 60, 60, 1, "decode")],
        [(0, tables[0], 40, 42, 1, "decode"), (1, tables[1], 60, 61, 1, "decode")],
    ]
    for m in (cpu, gpu):
        for slot in (0, 1):
            m.pools.reset_slot(slot)
    for k, reqs in enumerate(schedule):
        plan = step(spec, reqs, decoder_replay=decoder_replay)
        flat = np.concatenate([ids[r[0]][r[3] : r[3] + r[4]] for r in reqs])
        want = cpu.forward(plan, flat, all_row_logits=True)
        got = gpu.forward(plan, flat, all_row_logits=True)
        for a, b in ((got.logits, want.logits), (got.row_logits, want.row_logits)):
            a = a.cpu()
            assert torch.equal(torch.isnan(a), torch.isnan(b)), f"step {k}: NaN rows differ"
            ok = ~torch.isnan(b)
            if ok.any():  # under decoder replay a prefill step's row logits are all undefined
                assert _rel(a[ok], b[ok]) <= REL_TOL, f"step {k}: logits differ"
        assert cpu.selections.keys() == gpu.selections.keys()
        for layer, sel in cpu.selections.items():
            assert torch.equal(gpu.selections[layer].cpu(), sel), f"step {k} layer {layer}"
        assert torch.equal(gpu.pools.backing.cpu(), cpu.pools.backing), f"step {k}: pool bytes"
        assert (gpu.pools.cursor_host == cpu.pools.cursor_host).all()
