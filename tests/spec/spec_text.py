# ruff: noqa: E501  (the spec text is data: tests assert its line and column positions)
"""A small valid spec written inline, and helpers to edit and write it (spec tests)."""

from __future__ import annotations

from pathlib import Path

# Line numbers in expected messages refer to this text (line 1 is `spec_version: 1`).
BASE = """\
spec_version: 1
name: spec
description: A TINY-like spec for error tests.
model:
  num_hidden_layers: 14
  num_nextn_predict_layers: 3
  head_dim: 64
  qk_rope_head_dim: 16
  num_attention_heads: 4
  o_groups: 2
  index_n_heads: 4
  index_head_dim: 32
  index_topk: 4
  sliding_window: 8
  compress_ratios: [0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0]
  kv_source_layer_ids: [2, 4, 6, 8]
  index_source_layer_ids: [2, 4, 6, 8, 10, 12]
  candidate_source_layer_id: 8
  candidate_topk_blocks: 4
  candidate_block_size: 2
  engram_layer_ids: [1, 6]
  engram_max_ngram_size: 4
  vocab_size: 260
  hidden_size: 64
  num_key_value_heads: 1
  q_lora_rank: 32
  o_lora_rank: 32
  n_routed_experts: 8
  num_experts_per_tok: 2
  n_shared_experts: 1
  moe_intermediate_size: 32
  scoring_func: sqrtsoftplus
  topk_method: noaux_tc
  norm_topk_prob: true
  routed_scaling_factor: 1.5
  swiglu_limit: 10.0
  hc_mult: 4
  hc_sinkhorn_iters: 20
  hc_eps: 1.0e-6
  rms_norm_eps: 1.0e-20
  rope_theta: 10000.0
  compress_rope_theta: 160000.0
  rope_scaling: {type: yarn, factor: 16.0, original_max_position_embeddings: 64, beta_fast: 32, beta_slow: 1}
  max_position_embeddings: 4096
  engram_n_heads: 2
  engram_head_dim: 32
  engram_vocab_size: 61
  engram_pad_token_id: 2
  engram_compressed_vocab_size: 200
  bos_token_id: 256
  eos_token_id: 257
pool:
  page_tokens: 32
  kv_cache_dtypes: [bf16, fp4]
  index_cache_dtypes: [fp8, fp4]
roles:
  full: [2, 4, 6, 8]
  reindex: [10, 12]
  window: [0, 1]
replay:
  encoder_swa_bounded_replay: true
  decoder_swa_bounded_replay: true
  hash_block_tokens: 32
  replay_history_tokens: 3
  min_final_prefill_rows: 8
checkpoint:
  image_fields: [swa_rings, cursor]
capture:
  batch_sizes: [1, 2, 4, 8]
  query_buckets: [1]
"""


def edit(*pairs: str, text: str = BASE) -> str:
    """Replace each ``old`` with ``new`` (pairs), each ``old`` occurring exactly once."""
    assert len(pairs) % 2 == 0
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
        text = text.replace(old, new)
    return text


def write_spec(tmp_path: Path, text: str, name: str = "spec") -> Path:
    """Write ``text`` to ``<tmp>/specs/<name>.yaml`` (shown as ``specs/<name>.yaml``)."""
    path = tmp_path / "specs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
