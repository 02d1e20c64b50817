"""The shared expert on a side stream (``resident.SHARED_EXPERT_STREAM``) gives the bits of one
stream, eagerly and under CUDA graphs.

A tiny layer's grouped MoE (router, shared and routed experts, bf16, resident weights) runs
eagerly with the flag off for several inputs; then with it on, eagerly and as the replay of one
captured graph whose input changes before every replay. A branch that read its input before
the fork or wrote its output after the join would show as another input's values. Skipped
without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYER = "layers.3"


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_shared_expert_stream_gives_the_same_bits(rows, monkeypatch):
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime import resident

    cfg = config_from_cache_spec(load_cache_spec("tiny"))
    res = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0)).process(resident=True)
    w = {k: v.to("cuda") for k, v in res.items() if k.startswith(LAYER + ".ffn.")}
    moe = resident.GroupedMoE(cfg, w, LAYER, torch.bfloat16)
    assert moe.impl == "triton"
    inputs = [
        torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(40 + i))
        .to(torch.bfloat16)
        .cuda()
        for i in range(4)
    ]
    monkeypatch.setattr(resident, "SHARED_EXPERT_STREAM", False)
    want = [moe(x)[0].clone() for x in inputs]
    monkeypatch.setattr(resident, "SHARED_EXPERT_STREAM", True)
    assert resident.shared_expert_stream(inputs[0].device) is not None
    for x, y in zip(inputs, want, strict=True):
        assert torch.equal(moe(x)[0], y)  # eagerly
    x = inputs[0].clone()
    moe(x)  # every kernel built, the side stream made, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)[0]
    for _ in range(3):  # every input after every other one
        for xi, y in zip(inputs, want, strict=True):
            x.copy_(xi)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, y)
