"""One test per spec rule: a one-line edit of a valid inline spec and the exact located
message it fails with (``file:line:col: message (hint)``)."""

from __future__ import annotations

import pytest
from spec_text import edit

CASES = [
    pytest.param(
        ("  kv_cache_dtypes: [bf16, fp4]", "  kv_cache_dtypes: [bf16, fp4"),
        "specs/spec.yaml:55:21: YAML syntax error: expected ',' or ']', but got ':' (while "
        "parsing a flow sequence at line 54)",
        id="yaml_syntax",
    ),
    pytest.param(
        ("  hash_block_tokens: 32\n", "  hash_block_tokens: 32\n  hash_block_tokens: 32\n"),
        "specs/spec.yaml:64:3: duplicate key 'hash_block_tokens' (keep one of them; the first is "
        "at line 61)",
        id="duplicate_key",
    ),
    pytest.param(
        ("capture:\n", "captures:\n"),
        "specs/spec.yaml:68:1: unknown key 'captures' (remove it or fix its spelling; accepted "
        "keys: spec_version, name, description, model, pool, roles, replay, checkpoint, capture)",
        id="unknown_top_key",
    ),
    pytest.param(
        ("  page_tokens: 32", "  page_token: 32"),
        "specs/spec.yaml:53:3: unknown key 'page_token' in pool (remove it or fix its spelling; "
        "accepted keys: page_tokens, kv_cache_dtypes, index_cache_dtypes)",
        id="unknown_nested_key",
    ),
    pytest.param(
        ("beta_slow: 1}", "beta_slow: 1, beta: 2}"),
        "specs/spec.yaml:43:111: unknown key 'beta' in model.rope_scaling (remove it or fix its "
        "spelling; accepted keys: type, factor, original_max_position_embeddings, beta_fast, "
        "beta_slow)",
        id="unknown_flow_key",
    ),
    pytest.param(
        ("  page_tokens: 32", "  page_tokens: '32'"),
        "specs/spec.yaml:53:16: pool.page_tokens must be an integer, not '32' (write the value "
        "without quotes)",
        id="wrong_type_quoted",
    ),
    pytest.param(
        ("  head_dim: 64", "  head_dim: true"),
        "specs/spec.yaml:7:13: model.head_dim must be an integer, not true (write an integer)",
        id="wrong_type_bool",
    ),
    pytest.param(
        (
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 12]",
            "  index_source_layer_ids: [2, 4, 6, 8, x, 12]",
        ),
        "specs/spec.yaml:17:40: model.index_source_layer_ids[4] must be an integer, not 'x' "
        "(write the value without quotes)",
        id="wrong_type_list_item",
    ),
    pytest.param(
        ("  encoder_swa_bounded_replay: true", "  encoder_swa_bounded_replay: yes"),
        "specs/spec.yaml:61:31: replay.encoder_swa_bounded_replay must be true or false, not "
        "'yes' (write the value without quotes)",
        id="wrong_type_mapping",
    ),
    pytest.param(
        ("  sliding_window: 8\n", ""),
        "specs/spec.yaml:4:1: missing key 'sliding_window' in model (add `sliding_window: ...`; "
        "see specs/README.md)",
        id="missing_key",
    ),
    pytest.param(
        ("  num_key_value_heads: 1", "  num_key_value_heads: 2"),
        "specs/spec.yaml:25:24: model.num_key_value_heads: 2 is not accepted (use 1)",
        id="literal",
    ),
    pytest.param(
        ("  index_topk: 4", "  index_topk: 0"),
        "specs/spec.yaml:13:15: model.index_topk must be > 0, not 0 (see specs/README.md)",
        id="positive",
    ),
    pytest.param(
        ("capture:\n  batch_sizes: [1, 2, 4, 8]\n  query_buckets: [1]\n", "capture: [1, 2]\n"),
        "specs/spec.yaml:68:1: capture must be a mapping, not a list (write a mapping)",
        id="not_mapping_section",
    ),
    pytest.param(
        ("  kv_cache_dtypes: [bf16, fp4]", "  kv_cache_dtypes: []"),
        "specs/spec.yaml:54:3: pool.kv_cache_dtypes must not be empty (list at least one value)",
        id="empty_list",
    ),
    pytest.param(
        ("spec_version: 1", "spec_version: 2"),
        "specs/spec.yaml:1:15: spec_version 2 is not supported (this compiler reads spec_version: "
        "1)",
        id="spec_version",
    ),
    pytest.param(
        ("name: spec", "name: other"),
        "specs/spec.yaml:2:7: name 'other' differs from the file name 'spec.yaml' (rename the "
        "file to other.yaml or set `name: spec`)",
        id="name_mismatch",
    ),
    pytest.param(
        ("name: spec", "name: Spec-1"),
        "specs/spec.yaml:2:7: name 'Spec-1' is not a lowercase identifier (use lowercase letters, "
        "digits and underscores; it names a Python package)",
        id="name_identifier",
    ),
    pytest.param(
        ("  head_dim: 64", "  head_dim: 80"),
        "specs/spec.yaml:7:13: head_dim 80 is not a multiple of 32 (FP8/FP4 scale groups are 32 "
        "lanes; use e.g. 96)",
        id="head_dim_32",
    ),
    pytest.param(
        ("  index_head_dim: 32", "  index_head_dim: 48"),
        "specs/spec.yaml:12:19: index_head_dim 48 is not a multiple of 32 (FP8/FP4 scale groups "
        "are 32 lanes; use e.g. 64)",
        id="index_head_dim_32",
    ),
    pytest.param(
        ("  qk_rope_head_dim: 16", "  qk_rope_head_dim: 15"),
        "specs/spec.yaml:8:21: qk_rope_head_dim 15 is odd (RoPE rotates lane pairs; use an even "
        "width)",
        id="rope_odd",
    ),
    pytest.param(
        ("  qk_rope_head_dim: 16", "  qk_rope_head_dim: 40"),
        "specs/spec.yaml:8:21: qk_rope_head_dim 40 exceeds min(head_dim, index_head_dim) = 32 "
        "(RoPE covers the last lanes of both heads; lower it)",
        id="rope_too_wide",
    ),
    pytest.param(
        ("  o_groups: 2", "  o_groups: 3"),
        "specs/spec.yaml:10:13: num_attention_heads 4 is not divisible by o_groups 3 (choose "
        "o_groups dividing the head count)",
        id="o_groups",
    ),
    pytest.param(
        ("1, 1, 0, 0, 0]", "1, 1, 0, 0]"),
        "specs/spec.yaml:15:3: compress_ratios has 16 entries, expected 17 = num_hidden_layers 14 "
        "+ num_nextn_predict_layers 3 (give one ratio per backbone layer, then one per draft "
        "layer)",
        id="ratios_length",
    ),
    pytest.param(
        (
            "  compress_ratios: [0, 0, 2, 2, 2, 2, 2, 2, 1, 1, 1",
            "  compress_ratios: [0, 0, 2, 2, 2, 4, 2, 2, 1, 1, 1",
        ),
        "specs/spec.yaml:15:36: layer 5 has compress ratio 4 (ratios are 0 for window-only "
        "layers, 1 or 2)",
        id="ratio_value",
    ),
    pytest.param(
        ("1, 1, 0, 0, 0]", "1, 1, 0, 1, 0]"),
        "specs/spec.yaml:15:66: draft layer 15 has compress ratio 1 (draft layers are "
        "window-only; set it to 0)",
        id="draft_ratio",
    ),
    pytest.param(
        ("  engram_layer_ids: [1, 6]", "  engram_layer_ids: [6, 1]"),
        "specs/spec.yaml:21:25: Engram layer 1 comes after 6 (sort the list in layer order)",
        id="ids_unsorted",
    ),
    pytest.param(
        (
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 12]",
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 10]",
        ),
        "specs/spec.yaml:17:44: index source 10 is listed twice (list each layer once)",
        id="ids_duplicate",
    ),
    pytest.param(
        (
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 12]",
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 14]",
        ),
        "specs/spec.yaml:17:44: index source 14 is out of range (layer ids run from 0 to 13 for "
        "num_hidden_layers 14)",
        id="ids_range",
    ),
    pytest.param(
        ("  kv_source_layer_ids: [2, 4, 6, 8]", "  kv_source_layer_ids: []"),
        "specs/spec.yaml:16:3: kv_source_layer_ids is empty (list at least one Full owner)",
        id="kv_empty",
    ),
    pytest.param(
        ("  kv_source_layer_ids: [2, 4, 6, 8]", "  kv_source_layer_ids: [1, 2, 4, 6, 8]"),
        "specs/spec.yaml:16:25: KV source 1 has compress ratio 0 (a window-only layer owns no "
        "compressed rows; drop it or give layer 1 ratio 1 or 2)",
        id="kv_ratio0",
    ),
    pytest.param(
        (
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 12]",
            "  index_source_layer_ids: [0, 2, 4, 6, 8, 10, 12]",
        ),
        "specs/spec.yaml:17:28: index source 0 has compress ratio 0 (a window-only layer owns no "
        "compressed rows; drop it or give layer 0 ratio 1 or 2)",
        id="index_ratio0",
    ),
    pytest.param(
        (
            "  index_source_layer_ids: [2, 4, 6, 8, 10, 12]",
            "  index_source_layer_ids: [2, 4, 8, 10, 12]",
        ),
        "specs/spec.yaml:16:31: KV source 6 is not an index source (add 6 to "
        "index_source_layer_ids; a Full owner scores its own keys)",
        id="kv_not_index",
    ),
    pytest.param(
        ("  candidate_source_layer_id: 8", "  candidate_source_layer_id: 9"),
        "specs/spec.yaml:18:30: candidate source 9 is not an index source (pick one of "
        "index_source_layer_ids, or -1 for none)",
        id="candidate_not_index",
    ),
    pytest.param(
        ("  candidate_topk_blocks: 4", "  candidate_topk_blocks: 1"),
        "specs/spec.yaml:19:26: candidate capacity 1 x 2 = 2 rows is below index_topk 4 (raise "
        "candidate_topk_blocks or candidate_block_size so blocks x size >= index_topk)",
        id="candidate_capacity",
    ),
    pytest.param(
        ("  kv_cache_dtypes: [bf16, fp4]", "  kv_cache_dtypes: [bf16, fp8]"),
        "specs/spec.yaml:54:27: main KV format 'fp8' is not supported (use bf16 or fp4)",
        id="main_format",
    ),
    pytest.param(
        ("  index_cache_dtypes: [fp8, fp4]", "  index_cache_dtypes: [fp8, bf16]"),
        "specs/spec.yaml:55:29: index plane format 'bf16' is not supported (use fp8 or fp4)",
        id="index_format",
    ),
    pytest.param(
        ("  index_cache_dtypes: [fp8, fp4]", "  index_cache_dtypes: [fp8, fp8]"),
        "specs/spec.yaml:55:29: index plane format 'fp8' is listed twice (list each once)",
        id="format_twice",
    ),
    pytest.param(
        ("  page_tokens: 32", "  page_tokens: 33"),
        "specs/spec.yaml:53:16: page_tokens 33 is not a multiple of ratio 2 (a compressed group "
        "must not straddle a PAGE; use a multiple of every ratio)",
        id="page_ratio_multiple",
    ),
    pytest.param(
        (
            "  page_tokens: 32",
            "  page_tokens: 16",
            "  hash_block_tokens: 32",
            "  hash_block_tokens: 16",
        ),
        "specs/spec.yaml:53:16: page_tokens 16 is below 32 (a block id names 16 index rows and "
        "ratio 2 halves the PAGE; use at least 32)",
        id="page_floor",
    ),
    pytest.param(
        ("  page_tokens: 32", "  page_tokens: 48"),
        "specs/spec.yaml:53:16: page_tokens 48 gives 24 index rows per PAGE at ratio 2, not a "
        "multiple of 16 (use a multiple of 32; a block id names 16 index rows)",
        id="page_index_rows",
    ),
    pytest.param(
        ("  sliding_window: 8", "  sliding_window: 64"),
        "specs/spec.yaml:53:16: page_tokens 32 is below sliding_window - 1 = 63 under encoder "
        "replay (one PAGE of rebuild must cover the window; raise page_tokens or turn "
        "encoder_swa_bounded_replay off)",
        id="page_window",
    ),
    pytest.param(
        ("  hash_block_tokens: 32", "  hash_block_tokens: 64"),
        "specs/spec.yaml:63:22: hash_block_tokens 64 differs from pool.page_tokens 32 (the "
        "prefix-cache hash block is the PAGE; set it to 32)",
        id="hash_block",
    ),
    pytest.param(
        ("  replay_history_tokens: 3", "  replay_history_tokens: 2"),
        "specs/spec.yaml:64:26: replay_history_tokens 2 differs from engram_max_ngram_size - 1 = "
        "3 (the cursor keeps 3 Engram history ids; set it to 3)",
        id="history",
    ),
    pytest.param(
        ("  min_final_prefill_rows: 8", "  min_final_prefill_rows: 0"),
        "specs/spec.yaml:65:27: min_final_prefill_rows 0 is outside 1..page_tokens = 1..32 (a "
        "final forward backs off at most one hash block; pick a value in range)",
        id="min_rows_zero",
    ),
    pytest.param(
        ("  min_final_prefill_rows: 8", "  min_final_prefill_rows: 33"),
        "specs/spec.yaml:65:27: min_final_prefill_rows 33 is outside 1..page_tokens = 1..32 (a "
        "final forward backs off at most one hash block; pick a value in range)",
        id="min_rows_above_page",
    ),
    pytest.param(
        ("  min_final_prefill_rows: 8", "  min_final_prefill_rows: 4"),
        "specs/spec.yaml:65:27: min_final_prefill_rows 4 is below sliding_window 8 under decoder "
        "replay (the forward finishing a prompt must hold its last W rows; raise it to the window)",
        id="min_rows_window",
    ),
    pytest.param(
        ("  image_fields: [swa_rings, cursor]", "  image_fields: [swa_rings, cursor, rings]"),
        "specs/spec.yaml:67:37: image field 'rings' is not a STATE field (use swa_rings, "
        "tail_values, tail_scores, cursor)",
        id="image_unknown",
    ),
    pytest.param(
        ("  image_fields: [swa_rings, cursor]", "  image_fields: [swa_rings, cursor, cursor]"),
        "specs/spec.yaml:67:37: image field 'cursor' is listed twice (list each once)",
        id="image_twice",
    ),
    pytest.param(
        ("  image_fields: [swa_rings, cursor]", "  image_fields: [swa_rings, tail_values]"),
        "specs/spec.yaml:67:3: checkpoint images must carry 'cursor' (an image carries the SWA "
        "rings and the cursor; add it)",
        id="image_needs_cursor",
    ),
    pytest.param(
        ("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [1, 4, 2, 8]"),
        "specs/spec.yaml:69:23: capture.batch_sizes: 2 comes after 4 (sort the list ascending)",
        id="capture_unsorted",
    ),
    pytest.param(
        ("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [1, 2, 2, 8]"),
        "specs/spec.yaml:69:23: capture.batch_sizes lists 2 twice (list each width once)",
        id="capture_twice",
    ),
    pytest.param(
        ("  batch_sizes: [1, 2, 4, 8]", "  batch_sizes: [0, 1, 2]"),
        "specs/spec.yaml:69:17: capture.batch_sizes has 0 (capture widths are positive)",
        id="capture_positive",
    ),
    pytest.param(
        ("  query_buckets: [1]", "  query_buckets: [2, 1]"),
        "specs/spec.yaml:70:22: capture.query_buckets: 1 comes after 2 (sort the list ascending)",
        id="query_buckets",
    ),
    pytest.param(
        (
            "  compress_ratios: [0, 0, 2",
            "  compress_ratios: [0, 2, 2",
            "  window: [0, 1]",
            "  window: [0]",
        ),
        "specs/spec.yaml:15:24: layer 1 has ratio 2 but no preceding KV owner (make layer 1 or an "
        "earlier ratio-2 layer a KV source)",
        id="no_preceding_owner",
    ),
    pytest.param(
        ("  kv_source_layer_ids: [2, 4, 6, 8]", "  kv_source_layer_ids: [2, 4, 6]"),
        "specs/spec.yaml:15:45: layer 8 has ratio 1 but its preceding KV owner 6 has ratio 2 "
        "(make layer 8 or an earlier ratio-1 layer after 6 a KV source)",
        id="owner_ratio_differs",
    ),
    pytest.param(
        ("  candidate_source_layer_id: 8", "  candidate_source_layer_id: 6"),
        "specs/spec.yaml:16:34: layer 8 is at or after candidate source 6 but reads KV owner 8, "
        "not 6 (candidates index owner 6's rows; move the candidate source to 8 or later, or drop "
        "KV source 8)",
        id="candidate_shares_owner",
    ),
    pytest.param(
        ("  engram_layer_ids: [1, 6]", "  engram_layer_ids: [1, 8]"),
        "specs/spec.yaml:21:25: Engram layer 8 is in the decoder, which starts at layer 8 "
        "(decoder replay runs the decoder on the tail only; move it before layer 8 or turn "
        "decoder_swa_bounded_replay off)",
        id="engram_decoder",
    ),
    pytest.param(
        ("  reindex: [10, 12]", "  reindex: [10, 11]"),
        "specs/spec.yaml:58:17: layer 11 is declared reindex but resolves to reuse with kv_owner "
        "8, topk_owner 10 (fix roles: or the source layer ids)",
        id="roles_declared_wrong",
    ),
    pytest.param(
        ("  reindex: [10, 12]", "  reindex: [10]"),
        "specs/spec.yaml:56:1: layer 12 is not listed, so reuse, but resolves to reindex with "
        "kv_owner 8, topk_owner 12 (fix roles: or the source layer ids)",
        id="roles_undeclared",
    ),
    pytest.param(
        ("  window: [0, 1]", "  window: [0, 1, 2]"),
        "specs/spec.yaml:59:18: layer 2 is declared both full and window (give each layer one "
        "role)",
        id="roles_twice",
    ),
    pytest.param(
        ("  window: [0, 1]", "  window: [0, 1]\n  decoder_start: 9"),
        "specs/spec.yaml:60:18: decoder_start 9 differs from the last KV source 8 (the decoder "
        "starts at the last KV source; set it to 8)",
        id="roles_decoder_start",
    ),
    pytest.param(
        ("  window: [0, 1]", "  window: [0, 1]\n  reuse: [3, 5, 7, 9, 11]"),
        "specs/spec.yaml:56:1: layer 13 is not declared but resolves to reuse with kv_owner 8, "
        "topk_owner 12 (fix roles: or the source layer ids)",
        id="roles_reuse_listed",
    ),
]

EOS = "  eos_token_id: 257\n"
DSPARK = (
    EOS + "  dspark_block_size: 5\n  dspark_target_layer_ids: [11, 12, 13]\n"
    "  dspark_noise_token_id: 258\n  dspark_markov_rank: 16\n  dspark_n_routed_experts: 8\n"
    "  dspark_num_experts_per_tok: 2\n"
)
"""A valid DSpark block after the model's last field (lines 52-57)."""


def dspark(old: str = "", new: str = "") -> tuple[str, str]:
    """The edit adding ``DSPARK`` with ``old`` replaced by ``new`` in it."""
    return (EOS, DSPARK.replace(old, new) if old else DSPARK)


CASES += [
    pytest.param(
        dspark("  dspark_markov_rank: 16\n", ""),
        "specs/spec.yaml:52:22: dspark_block_size is set but dspark_markov_rank is not (a DSpark "
        "draft needs every dspark_* field; set them all or remove them all)",
        id="dspark_all_or_none",
    ),
    pytest.param(
        dspark("[11, 12, 13]", "[6, 12, 13]"),
        "specs/spec.yaml:53:29: DSpark tap 6 is an Engram layer (the taps read the residual "
        "entering a layer with no Engram; pick another layer)",
        id="dspark_tap_engram",
    ),
    pytest.param(
        dspark("[11, 12, 13]", "[11, 12, 14]"),
        "specs/spec.yaml:53:37: DSpark tap 14 is out of range (layer ids run from 0 to 13 for "
        "num_hidden_layers 14)",
        id="dspark_tap_range",
    ),
    pytest.param(
        dspark("[11, 12, 13]", "[]"),
        "specs/spec.yaml:53:3: dspark_target_layer_ids is empty (list the backbone layers whose "
        "entering residual the draft reads)",
        id="dspark_no_taps",
    ),
    pytest.param(
        dspark("dspark_noise_token_id: 258", "dspark_noise_token_id: 260"),
        "specs/spec.yaml:54:26: dspark_noise_token_id 260 is outside the vocabulary [0, 260) (use "
        "a token id below vocab_size)",
        id="dspark_noise_id",
    ),
    pytest.param(
        dspark("dspark_num_experts_per_tok: 2", "dspark_num_experts_per_tok: 9"),
        "specs/spec.yaml:57:31: dspark_num_experts_per_tok 9 is outside "
        "1..dspark_n_routed_experts = 1..8 (route each draft token to at least one and at most "
        "every draft expert)",
        id="dspark_topk",
    ),
    pytest.param(
        dspark("dspark_block_size: 5", "dspark_block_size: 0"),
        "specs/spec.yaml:52:22: dspark_block_size 0 is below 1 (use a positive count)",
        id="dspark_block_size",
    ),
    pytest.param(
        (
            *dspark(),
            "  num_nextn_predict_layers: 3",
            "  num_nextn_predict_layers: 0",
            "1, 1, 1, 1, 1, 1, 0, 0, 0]",
            "1, 1, 1, 1, 1, 1]",
        ),
        "specs/spec.yaml:6:29: num_nextn_predict_layers 0 leaves the DSpark draft no stage (give "
        "the draft its stages; the published model has 3)",
        id="dspark_no_stage",
    ),
]


@pytest.mark.parametrize(("edits", "expected"), CASES)
def test_rule_message(spec_error, edits, expected):
    """Each broken spec fails with exactly one located message naming the fix."""
    assert spec_error(edit(*edits)) == expected


def test_a_complete_dspark_block_compiles(tmp_path):
    """The valid DSpark block of the rule cases compiles (the rules above are its only
    refusals)."""
    from spec_text import write_spec

    from v41plan.geometry.spec import compile_spec

    compile_spec(write_spec(tmp_path, edit(*dspark())))
