"""ModelConfig: published field names, round trips, spec agreement, the real topology."""

from __future__ import annotations

import dataclasses

import pytest

from v41plan.geometry.runtime import load_cache_spec
from v41plan.model.config import ModelConfig, check_against_spec, config_from_cache_spec

SPECS = ("tiny", "tiny40", "medium", "deepseek_v41_flash")


@pytest.fixture(scope="module")
def spec():
    return {n: load_cache_spec(n) for n in SPECS}


@pytest.mark.parametrize("name", SPECS)
def test_config_from_spec_round_trips_through_config_json(spec, name):
    cfg = config_from_cache_spec(spec[name])
    check_against_spec(cfg, spec[name])
    hf = cfg.to_hf()
    assert hf["architectures"] == ["DeepseekV41ForCausalLM"] and hf["model_type"] == "deepseek_v41"
    assert hf["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    assert hf["text_config"]["compress_ratios"] == list(cfg.compress_ratios)
    assert ModelConfig.from_hf(hf) == cfg
    flat = {**hf["text_config"], "architectures": hf["architectures"]}
    assert ModelConfig.from_hf(flat) == cfg


def test_real_config_derives_the_published_engram_rows(spec):
    cfg = config_from_cache_spec(spec["deepseek_v41_flash"])
    assert cfg.engram_num_embeddings == (384006168, 384016682)
    assert cfg.hc_mixes == 24 and cfg.engram_cols == 24


def test_real_topology(spec):
    layers = config_from_cache_spec(spec["deepseek_v41_flash"]).layers
    roles = {i.index: i.role for i in layers}
    assert [i for i, r in roles.items() if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r == "reindex"] == [24, 28, 32, 36]
    assert [i for i, r in roles.items() if r == "window"] == [0, 1]
    owner = {i.index: (i.kv_owner, i.topk_owner) for i in layers}
    assert owner[3] == (2, 2) and owner[13] == (8, 8) and owner[19] == (14, 14)
    assert owner[21] == (20, 20) and owner[25] == (20, 24) and owner[39] == (20, 36)
    assert [i.index for i in layers if i.engram] == [1, 14]
    assert [i.ratio for i in layers] == [0, 0] + [2] * 18 + [1] * 20
    # layer 20's own top-k and its Reuse layers are not candidate-restricted; 24 on are
    assert [i.index for i in layers if i.uses_candidates] == list(range(24, 40))
    assert all(i.segment == ("decoder" if i.index >= 20 else "encoder") for i in layers)


def test_spec_disagreement_is_refused_naming_field_and_values(spec):
    cfg = config_from_cache_spec(spec["tiny"])
    bad = dataclasses.replace(cfg, sliding_window=16)
    with pytest.raises(
        ValueError, match=r"sliding_window is 16 in the checkpoint but 8 in the spec"
    ):
        check_against_spec(bad, spec["tiny"])
    with pytest.raises(ValueError, match=r"num_hidden_layers is 14 in the checkpoint but 40"):
        check_against_spec(cfg, spec["tiny40"])


def test_missing_field_and_wrong_engram_rows_are_refused(spec):
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    del hf["text_config"]["head_dim"]
    with pytest.raises(ValueError, match="lacks required field.*head_dim"):
        ModelConfig.from_hf(hf)
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    hf["text_config"]["engram_num_embeddings"] = [434, 607]
    with pytest.raises(ValueError, match=r"engram_num_embeddings = \[434, 607\] disagrees"):
        ModelConfig.from_hf(hf)


def test_unknown_published_fields_survive_a_round_trip(spec):
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    hf["text_config"]["dspark_block_size"] = 5
    cfg = ModelConfig.from_hf(hf)
    assert cfg.extra["dspark_block_size"] == 5
    assert cfg.to_hf()["text_config"]["dspark_block_size"] == 5


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("vocab_size", "260", "vocab_size must be an integer, got '260'"),
        ("vocab_size", 260.0, "vocab_size must be an integer, got 260.0"),
        ("hidden_size", True, "hidden_size must be an integer, got True"),
        ("hidden_size", 0, "hidden_size must be an integer >= 1, got 0"),
        ("rms_norm_eps", "1e-6", "rms_norm_eps must be a finite number, got '1e-6'"),
        ("norm_topk_prob", 1, "norm_topk_prob must be true or false, got 1"),
        ("compress_ratios", "0,0,2", "compress_ratios must be a list of integers >= 0"),
        ("rope_scaling", {"original_max_position_embeddings": 64}, "rope_scaling.factor"),
    ],
)
def test_values_of_the_wrong_type_are_refused_naming_the_key(spec, key, value, message):
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    hf["text_config"][key] = value
    with pytest.raises(ValueError) as exc:
        ModelConfig.from_hf(hf)
    assert message in str(exc.value)


def test_a_key_one_typo_from_a_field_is_refused(spec):
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    hf["text_config"]["hiden_size"] = 64  # next to the real hidden_size: still a typo
    with pytest.raises(ValueError, match=r"unknown key 'hiden_size' \(did you mean 'hidden_size'"):
        ModelConfig.from_hf(hf)
    hf = config_from_cache_spec(spec["tiny"]).to_hf()
    hf["text_config"]["qk_nope_head_dim"] = 48  # a published field of the family, not a typo
    assert ModelConfig.from_hf(hf).extra["qk_nope_head_dim"] == 48


def test_a_config_that_is_not_an_object_is_refused():
    with pytest.raises(TypeError, match="config.json must be a JSON object, got list"):
        ModelConfig.from_hf([])
