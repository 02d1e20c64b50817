"""Published-layout checkpoints: init-checkpoint, loading, refusals, exactly-once processing,
tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from v41plan.cli.main import main
from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    random_state,
    tensor_table,
)
from v41plan.model.config import config_from_cache_spec
from v41plan.model.reference import ReferenceModel
from v41plan.serving.tokenizer import ByteTokenizer, load_tokenizer

IDS = list(range(40, 56))


@pytest.fixture(scope="module")
def specs(specs_dir):
    return {n: load_cache_spec(n) for n in ("tiny", "tiny40")}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, specs_dir):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    assert (
        main(
            [
                "init-checkpoint",
                "--spec",
                str(specs_dir / "tiny.yaml"),
                "--out",
                str(out),
                "--seed",
                "7",
                "--shard-mib",
                "1",
            ]
        )
        == 0
    )
    return out


def _logits(path, spec, dtype=torch.float32):
    ckpt = load_checkpoint(path, spec, dtype)
    return ReferenceModel.from_checkpoint(ckpt, dtype).prefill(IDS)


def test_layout_is_sharded_with_an_index(tiny_dir):
    shards = sorted(p.name for p in tiny_dir.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert (
        cfg["architectures"] == ["DeepseekV41ForCausalLM"]
        and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    )
    wm = index["weight_map"]
    with safe_open(str(tiny_dir / wm["layers.3.ffn.experts.5.w2.weight"]), "pt") as f:
        assert f.get_slice("layers.3.ffn.experts.5.w2.weight").get_shape() == [
            64,
            64,
        ]  # [hidden, moe_intermediate / 2]: E2M1 pairs
        assert f.get_slice("layers.3.ffn.experts.5.w2.weight").get_dtype() == "I8"
        assert f.get_slice("layers.3.ffn.experts.5.w2.scale").get_shape() == [
            64,
            4,
        ]  # one E8M0 per 32 along K
        assert f.get_slice("layers.3.ffn.experts.5.w2.scale").get_dtype() == "F8_E8M0"
    with safe_open(str(tiny_dir / wm["layers.2.attn.wq_b.weight"]), "pt") as f:
        assert f.get_slice("layers.2.attn.wq_b.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.2.attn.wq_b.scale").get_shape() == [8, 1]
    # ratio-2 owners have a gate; the ratio-1 owner does not; Reuse layers own nothing global
    assert (
        "layers.2.attn.compressor.wgate.weight" in wm
        and "layers.8.attn.compressor.wgate.weight" not in wm
    )
    assert (
        "layers.8.attn.compressor.wkv.weight" in wm
        and "layers.3.attn.indexer.wq_b.weight" not in wm
    )
    assert (
        "layers.10.attn.indexer.wq_b.weight" in wm and "layers.10.attn.indexer.wk.weight" not in wm
    )
    assert "layers.1.engram.embed.weight" in wm and "layers.6.engram.embed.scale" in wm


def test_shards_have_ordinary_file_modes_and_say_their_weights_are_random(tiny_dir, tmp_path):
    import os

    from v41plan.model.checkpoint import random_weights_seed

    assert random_weights_seed(tiny_dir) == 7
    assert random_weights_seed(tmp_path) is None  # no shard: nothing says so

    umask = os.umask(0)
    os.umask(umask)
    for f in tiny_dir.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name  # 0644 under umask 022


def test_truncated_and_corrupt_shards_are_named(tiny_dir, tmp_path, specs):
    from v41plan.model.checkpoint import CheckpointError

    bad = _copy(tiny_dir, tmp_path / "trunc")
    shard = max(bad.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated or corrupt"):
        load_checkpoint(bad, specs["tiny"])
    bad = _copy(tiny_dir, tmp_path / "corrupt")
    shard = min(bad.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[8:12] = b"[[[["
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated or corrupt"):
        load_checkpoint(bad, specs["tiny"])
    bad = _copy(tiny_dir, tmp_path / "index")
    (bad / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="index.json: not valid JSON"):
        load_checkpoint(bad, specs["tiny"])
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "nowhere", specs["tiny"])


def test_init_checkpoint_is_deterministic_per_seed(tiny_dir, tmp_path, specs_dir):
    again = tmp_path / "again"
    other = tmp_path / "other"
    spec = str(specs_dir / "tiny.yaml")
    assert (
        main(
            [
                "init-checkpoint",
                "--spec",
                spec,
                "--out",
                str(again),
                "--seed",
                "7",
                "--shard-mib",
                "1",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "init-checkpoint",
                "--spec",
                spec,
                "--out",
                str(other),
                "--seed",
                "8",
                "--shard-mib",
                "1",
            ]
        )
        == 0
    )
    for f in tiny_dir.iterdir():
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    first = min(tiny_dir.glob("*.safetensors")).name
    assert (other / first).read_bytes() != (tiny_dir / first).read_bytes()


def test_reload_gives_identical_logits_and_matches_memory(tiny_dir, specs):
    a = _logits(tiny_dir, specs["tiny"])
    b = _logits(tiny_dir, specs["tiny"])
    assert torch.equal(a, b) and torch.isfinite(a).all()
    cfg = config_from_cache_spec(specs["tiny"])
    mem = ReferenceModel.from_checkpoint(
        LoadedCheckpoint.from_state(cfg, random_state(cfg, 7))
    ).prefill(IDS)
    assert torch.equal(a, mem)


def test_tiny40_checkpoint_round_trip(tmp_path, specs, specs_dir):
    out = tmp_path / "t40"
    assert (
        main(
            [
                "init-checkpoint",
                "--spec",
                str(specs_dir / "tiny40.yaml"),
                "--out",
                str(out),
                "--seed",
                "1",
            ]
        )
        == 0
    )
    a = _logits(out, specs["tiny40"])
    assert torch.equal(a, _logits(out, specs["tiny40"]))
    p = torch.softmax(a.double(), -1).max(-1).values
    assert torch.isfinite(a).all() and float(a.std(-1).min()) > 0.3 and float(p.max()) < 0.99


def test_config_disagreeing_with_spec_is_refused_before_weights(tiny_dir, specs, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dir / "config.json").read_text())  # no weights at all
    with pytest.raises(
        CheckpointError, match="num_hidden_layers is 14 in the checkpoint but 40 in the spec"
    ):
        load_checkpoint(bare, specs["tiny40"])


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_tensor_is_named(tiny_dir, tmp_path, specs):
    d = _copy(tiny_dir, tmp_path / "missing")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.4.attn.indexer.wk.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"missing tensor layers\.4\.attn\.indexer\.wk\.weight"
    ):
        load_checkpoint(d, specs["tiny"])


def test_misshapen_tensor_is_named(tiny_dir, tmp_path, specs):
    d = _copy(tiny_dir, tmp_path / "misshapen")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "layers.0.attn.kv_norm.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = torch.ones(32, dtype=torch.bfloat16)
    save_file(tensors, str(shard))
    with pytest.raises(
        CheckpointError,
        match=r"tensor layers\.0\.attn\.kv_norm\.weight has shape \[32\], expected \[64\]",
    ):
        load_checkpoint(d, specs["tiny"])


def test_post_load_processing_runs_exactly_once(tiny_dir, specs):
    ckpt = load_checkpoint(tiny_dir, specs["tiny"], dtype=None)
    assert ckpt.process_calls == 0 and ckpt.weights is None
    # Engram tables stay memory-mapped: never in the loaded tensors
    assert not any(".engram.embed." in k for k in ckpt.raw)
    assert [t.rows for t in ckpt.tables] == [434, 606]
    model = ReferenceModel.from_checkpoint(ckpt)
    assert ckpt.process_calls == 1
    ReferenceModel.from_checkpoint(ckpt)  # reuses the processed weights
    assert ckpt.process_calls == 1
    with pytest.raises(RuntimeError, match="exactly once"):
        ckpt.process(torch.float32)
    w = ckpt.weights
    assert w["layers.2.ffn.experts.w1"].shape == (8, 128, 64)  # fused [E, I, D]
    assert w["layers.2.attn.wq_a.weight"].dtype == torch.float32
    assert model.prefill(IDS[:5]).shape == (5, 260)


def test_single_file_checkpoint_from_another_tool_loads(tiny_dir, tmp_path, specs):
    """Another tool's layout: one model.safetensors, no index, FP4 packed as uint8."""
    d = tmp_path / "single"
    d.mkdir()
    (d / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = {}
    for shard in tiny_dir.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    for k, v in tensors.items():
        if v.dtype == torch.int8:
            tensors[k] = v.view(torch.uint8)
    save_file(tensors, str(d / "model.safetensors"))
    assert torch.equal(_logits(d, specs["tiny"]), _logits(tiny_dir, specs["tiny"]))


def test_table_covers_every_written_tensor(tiny_dir, specs):
    cfg = config_from_cache_spec(specs["tiny"])
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert {t.name for t in tensor_table(cfg)} == set(index["weight_map"])


def test_byte_tokenizer_default_and_tokenizer_json_when_present(tiny_dir, tmp_path, specs):
    cfg = config_from_cache_spec(specs["tiny"])
    tok = load_tokenizer(tiny_dir, cfg)
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode("héllo", add_bos=True)
    assert ids == [256, 104, 195, 169, 108, 108, 111] and tok.decode(ids + [257]) == "héllo"
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]")
    )
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    d = tmp_path / "with_tok"
    d.mkdir()
    hf.save(str(d / "tokenizer.json"))
    t2 = load_tokenizer(d, cfg)
    assert t2.encode("hello world") == [1, 2] and t2.encode("hello", add_bos=True) == [256, 1]
