"""Resident (published-format) weights: bytes, values, slicing on the quantized tensors, the
flash_slice spec and its bounded-memory writer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import (
    LoadedCheckpoint,
    _plan_shards,
    checkpoint_nbytes,
    load_checkpoint,
    random_state,
    tensor_table,
    write_checkpoint,
)
from v41plan.model.config import config_from_cache_spec
from v41plan.model.quant import QuantWeight, quantize_fp4_weight, quantize_fp8_weight
from v41plan.model.sharding import TPConfigError, shard_weights, slice_quant
from v41plan.runtime.collectives import TPGroup


def _cfg(name: str):
    return config_from_cache_spec(load_cache_spec(name))


@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg("tiny")
    state = random_state(cfg, 0)
    deq = LoadedCheckpoint.from_state(cfg, state)
    res = LoadedCheckpoint.from_state(cfg, state)
    return cfg, deq.process(torch.float32), res.process(resident=True), deq, res


@pytest.mark.parametrize("name", ["tiny", "tiny40"])
def test_resident_bytes_are_the_published_bytes(name):
    cfg = _cfg(name)
    state = random_state(cfg, 1)
    ckpt = LoadedCheckpoint.from_state(cfg, state)
    ckpt.process(resident=True)
    published = sum(t.nbytes for t in tensor_table(cfg) if t.kind not in ("table", "table_scale"))
    assert ckpt.report["checkpoint_bytes"] == checkpoint_nbytes(cfg) == published
    assert ckpt.report["resident"] and ckpt.report["resident_bytes"] == published
    assert ckpt.report["ratio"] == 1.0  # the bound is 1.05
    deq = LoadedCheckpoint.from_state(cfg, state)
    deq.process(torch.bfloat16)
    assert not deq.report["resident"] and deq.report["ratio"] > 1.5  # dequantized: bf16 weights
    # wo_a on bf16 values (as the published model runs it): still within the 1.05
    mixed = LoadedCheckpoint.from_state(cfg, state)
    w = mixed.process(torch.bfloat16, resident=True, dequantize=("attn.wo_a.weight",))
    assert w["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16
    assert isinstance(w["layers.0.attn.wo_b.weight"], QuantWeight)
    assert 1.0 < mixed.report["ratio"] <= 1.05


def test_resident_values_equal_the_dequantized_weights(tiny):
    cfg, deq, res, *_ = tiny
    assert deq.keys() == res.keys()
    n_fp8 = n_fp4 = 0
    for name, want in deq.items():
        got = res[name]
        if isinstance(got, QuantWeight):
            if got.format == "fp8":
                n_fp8 += 1
                assert got.codes.dtype == torch.float8_e4m3fn and got.shape == tuple(want.shape)
            else:
                n_fp4 += 1
                assert name.endswith(("experts.w1", "experts.w2", "experts.w3"))
                E, o, i = want.shape
                assert got.codes.shape == (E, o, i // 2) and got.scales.shape == (E, o, i // 32)
            assert torch.equal(got.dequantize(torch.float32), want), name
        else:
            assert torch.equal(got, want) and got.dtype == want.dtype, name  # published dtype
    assert n_fp4 == 3 * cfg.num_hidden_layers and n_fp8 > 5 * cfg.num_hidden_layers


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("ep", [True, False], ids=["ep", "sliced"])
def test_slicing_cuts_the_quantized_tensors(tiny, size, ep):
    cfg, deq, res, *_ = tiny
    for r in range(size):
        qs = shard_weights(res, cfg, TPGroup(r, size), ep)
        ds = shard_weights(deq, cfg, TPGroup(r, size), ep)
        for name, q in qs.items():
            if q is res[name]:
                assert ds[name] is deq[name]  # replicated alike
                continue
            assert isinstance(q, QuantWeight) == isinstance(res[name], QuantWeight)
            if isinstance(q, QuantWeight):
                assert torch.equal(q.dequantize(torch.float32), ds[name]), name
                assert q.codes.is_contiguous() and q.scales.is_contiguous()
                assert q.nbytes * size == res[name].nbytes, name  # its share, never more


def test_a_share_that_splits_a_scale_block_is_refused():
    c, s = quantize_fp8_weight(torch.randn(64, 64))
    fp8 = QuantWeight(c, s, "fp8")
    assert slice_quant(fp8, 1, 2, 0).shape == (32, 64)
    with pytest.raises(TPConfigError, match="16 lanes per rank, not whole 32-lane scale blocks"):
        slice_quant(fp8, 0, 4, 1)
    c4, s4 = quantize_fp4_weight(torch.randn(48, 64))
    fp4 = QuantWeight(c4[None], s4[None], "fp4")
    assert slice_quant(fp4, 2, 4, 1).shape == (1, 12, 64)  # FP4 rows carry their own scales
    with pytest.raises(TPConfigError, match="along dim 2"):
        slice_quant(fp4, 0, 4, 2)
    with pytest.raises(ValueError, match="accepted: fp8, fp4"):
        QuantWeight(c, s, "int4")


def test_loading_from_disk_resident_and_parallel_writers_agree(tiny, tmp_path):
    cfg, _, res, *_ = tiny
    one = write_checkpoint(tmp_path / "one", cfg, 0, shard_bytes=1 << 20)
    two = write_checkpoint(tmp_path / "two", cfg, 0, shard_bytes=1 << 20, workers=2)
    files = sorted(p.name for p in one.iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in two.iterdir())
    for f in files:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
    ckpt = load_checkpoint(one, load_cache_spec("tiny"), dtype=torch.float32, resident=True)
    assert ckpt.report["ratio"] == 1.0
    for name, q in ckpt.weights.items():
        want = res[name]
        if isinstance(q, QuantWeight):
            assert torch.equal(q.codes.view(torch.uint8), want.codes.view(torch.uint8))
            assert torch.equal(q.scales.view(torch.uint8), want.scales.view(torch.uint8))
        else:
            assert torch.equal(q, want), name


def test_flash_slice_keeps_every_flash_width_and_cuts_only_the_experts():
    flash, sl = _cfg("deepseek_v41_flash"), _cfg("flash_slice")
    assert sl.n_routed_experts == 32 and sl.num_experts_per_tok == 6
    same = dataclasses.replace(
        sl,
        n_routed_experts=flash.n_routed_experts,
        engram_vocab_size=flash.engram_vocab_size,
        engram_num_embeddings=(),
    )
    assert same == flash  # every other field, the schedule included
    assert sl.layers == flash.layers
    # the arithmetic stated in the spec's header
    assert round(checkpoint_nbytes(sl) / 1e9, 2) == 33.77
    assert round(checkpoint_nbytes(flash) / 1e9, 1) == 298.6
    experts = sum(t.nbytes for t in tensor_table(sl) if ".ffn.experts." in t.name)
    assert round(experts / 1e9, 2) == 24.06
    tables = sum(t.nbytes for t in tensor_table(sl) if t.kind in ("table", "table_scale"))
    assert round(tables / 1e9, 2) == 1.27
    # bounded writer memory: a shard is at most 512 MiB or one tensor group (embed/head, 1.32 GB)
    shards = _plan_shards(tensor_table(sl), 512 << 20)
    biggest = max(sum(t.nbytes for t in s) for s in shards)
    assert biggest == sl.vocab_size * sl.hidden_size * 2
