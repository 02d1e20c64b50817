"""DSpark checkpoints: the draft's config fields, its published tensors (``mtp.{k}.*``), the
writer writing them, the loader reading them only under speculation."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import (
    BF16,
    FP8,
    CheckpointError,
    LoadedCheckpoint,
    checkpoint_nbytes,
    draft_tensor_table,
    load_checkpoint,
    random_state,
    tensor_table,
    write_checkpoint,
    write_state,
)
from v41plan.model.config import config_from_cache_spec
from v41plan.model.dspark import DSPARK_FIELDS, draft_config
from v41plan.model.quant import dequant_fp4_weight, dequant_fp8_weight

# the TINY draft of the model reference (section 11.2), on the tiny spec's vocabulary
TINY_DRAFT = {
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [11, 12, 13],
    "dspark_noise_token_id": 255,
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


@pytest.fixture(scope="module")
def tiny_cfg(specs_dir):
    return config_from_cache_spec(load_cache_spec("tiny"))


@pytest.fixture(scope="module")
def draft_cfg(tiny_cfg):
    return replace(tiny_cfg, extra={**tiny_cfg.extra, **TINY_DRAFT})


def test_the_published_draft_table(specs_dir):
    cfg = config_from_cache_spec(load_cache_spec("deepseek_v41_flash"))
    dc = draft_config(cfg)
    assert (dc.stages, dc.block_size, dc.taps, dc.noise_token_id) == (3, 5, (37, 38, 39), 128799)
    assert (dc.markov_rank, dc.n_routed_experts, dc.num_experts_per_tok) == (256, 128, 3)
    table = {t.name: t for t in draft_tensor_table(cfg)}
    assert len(table) == 2398  # of the published index's 2,401 mtp.* tensors
    assert all(n.startswith(("mtp.0.", "mtp.1.", "mtp.2.")) for n in table)
    mp = table["mtp.0.main_proj.weight"]
    assert (mp.shape, mp.dtype) == ((5120, 3 * 5120), FP8)
    assert table["mtp.0.main_norm.weight"].shape == (5120,)
    assert "mtp.1.main_proj.weight" not in table
    for name in ("markov_head.embed.weight", "markov_head.head.weight"):
        assert (table[f"mtp.2.{name}"].shape, table[f"mtp.2.{name}"].dtype) == (
            (129280, 256),
            BF16,
        )
    assert table["mtp.2.confidence_head.proj.weight"].shape == (1, 5120 + 256)
    assert "mtp.0.norm.weight" not in table and "mtp.2.norm.weight" in table
    for k in range(3):  # a window-only block: no compressor, indexer or Engram
        assert f"mtp.{k}.ffn.experts.127.w2.weight" in table
        assert f"mtp.{k}.ffn.experts.128.w2.weight" not in table
        assert table[f"mtp.{k}.ffn.gate.weight"].shape == (128, 5120)
        assert table[f"mtp.{k}.attn.wkv.weight"].shape == (512, 5120)
        assert not any(f"mtp.{k}.attn.{x}" in n for n in table for x in ("compressor", "indexer"))
    backbone = {t.name for t in tensor_table(cfg)}
    assert not backbone & set(table)
    assert checkpoint_nbytes(cfg, draft=True) > checkpoint_nbytes(cfg)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dspark_markov_rank": None}, "dspark_markov_rank not"),
        ({"dspark_target_layer_ids": [6, 12]}, "DSpark tap 6 is an Engram layer"),
        ({"dspark_target_layer_ids": [14]}, "is not a backbone layer"),
        ({"dspark_target_layer_ids": [12, 12]}, "must be sorted and unique"),
        ({"dspark_target_layer_ids": [13, 12]}, "must be sorted and unique"),
        ({"dspark_noise_token_id": 260}, "outside the vocabulary [0, 260)"),
        ({"dspark_num_experts_per_tok": 5}, "outside 1..dspark_n_routed_experts = 1..4"),
        ({"dspark_block_size": 0}, "dspark_block_size must be an integer >= 1"),
        ({"dspark_markov_rank": True}, "dspark_markov_rank must be an integer"),
    ],
)
def test_draft_config_refusals(tiny_cfg, change, message):
    extra = {**TINY_DRAFT, **change}
    extra = {k: v for k, v in extra.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        draft_config(replace(tiny_cfg, extra=extra))


def test_no_draft_fields_no_draft(tiny_cfg):
    assert draft_config(tiny_cfg) is None and draft_tensor_table(tiny_cfg) == []
    with pytest.raises(ValueError, match="no stage"):
        draft_config(replace(tiny_cfg, num_nextn_predict_layers=0, extra=dict(TINY_DRAFT)))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, draft_cfg):
    return write_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", draft_cfg, 11, 1 << 20)


def test_writer_writes_the_draft_and_the_loader_reads_it_only_under_speculation(
    draft_dir, draft_cfg
):
    index = json.loads((draft_dir / "model.safetensors.index.json").read_text())
    names = {t.name for t in draft_tensor_table(draft_cfg)}
    assert names <= set(index["weight_map"])
    cfg_json = json.loads((draft_dir / "config.json").read_text())["text_config"]
    assert all(cfg_json[f] == TINY_DRAFT[f] for f in DSPARK_FIELDS)

    plain = load_checkpoint(draft_dir, dtype=None)
    assert not any(n.startswith("mtp.") for n in plain.raw)

    spec = load_checkpoint(draft_dir, dtype=None, speculative=True)
    assert names <= set(spec.raw)
    want = random_state(draft_cfg, 11, draft=True)
    for n in names:
        assert torch.equal(spec.raw[n].view(torch.uint8), want[n].view(torch.uint8)), n
    w = spec.process(torch.float64)
    E, inter, D = 4, draft_cfg.moe_intermediate_size, draft_cfg.hidden_size
    for k in range(3):
        fused = w[f"mtp.{k}.ffn.experts.w1"]
        assert fused.shape == (E, inter, D)
        p = f"mtp.{k}.ffn.experts.3.w1."
        assert torch.equal(
            fused[3], dequant_fp4_weight(want[p + "weight"], want[p + "scale"], torch.float64)
        )
    mp = dequant_fp8_weight(
        want["mtp.0.main_proj.weight"], want["mtp.0.main_proj.scale"], torch.float64
    )
    assert torch.equal(w["mtp.0.main_proj.weight"], mp)
    assert spec.report["checkpoint_bytes"] == checkpoint_nbytes(draft_cfg, draft=True)


def test_speculation_needs_a_draft_in_config_and_shards(tmp_path, draft_dir, draft_cfg, tiny_cfg):
    bare = write_checkpoint(tmp_path / "bare", tiny_cfg, 11, 1 << 20)
    with pytest.raises(CheckpointError, match="declares no DSpark draft"):
        load_checkpoint(bare, dtype=None, speculative=True)
    load_checkpoint(bare, dtype=None)  # without speculation it loads

    # a draft-config checkpoint exported without its draft tensors
    state = random_state(draft_cfg, 3)
    out = write_state(tmp_path / "nodraft", draft_cfg, state)
    load_checkpoint(out, dtype=None)
    with pytest.raises(CheckpointError, match=r"missing tensor mtp\.0\."):
        load_checkpoint(out, dtype=None, speculative=True)

    full = random_state(draft_cfg, 3, draft=True)
    partial = dict(full)
    del partial["mtp.2.markov_head.head.weight"]
    with pytest.raises(CheckpointError, match="lacks mtp.2.markov_head.head.weight"):
        write_state(tmp_path / "partial", draft_cfg, partial)
    out = write_state(tmp_path / "full", draft_cfg, full)
    got = load_checkpoint(out, dtype=None, speculative=True).raw
    assert torch.equal(got["mtp.2.markov_head.head.weight"], full["mtp.2.markov_head.head.weight"])


def test_in_memory_state_keeps_the_draft_for_processing(draft_cfg):
    ckpt = LoadedCheckpoint.from_state(draft_cfg, random_state(draft_cfg, 5, draft=True))
    w = ckpt.process(torch.float32, resident=True)
    assert w["mtp.1.ffn.experts.w2"].codes.shape[0] == 4
    assert ckpt.report["checkpoint_bytes"] == checkpoint_nbytes(draft_cfg, draft=True)
