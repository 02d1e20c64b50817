"""Stage tables: the V4.1-Flash table as the specification states it, and how it follows the
spec."""

from __future__ import annotations

import pytest

from tests.planner.helpers import spec, variant
from v41plan.planner.stages import (
    PHASES,
    SUB_STEPS,
    derive_stage_table,
    layer_graph,
    stage_table,
)


def table_of(s, **kw):
    return derive_stage_table(s, **kw)


def expected_replay_table(num_layers: int, last_kv: int, owners: set[int]) -> dict:
    """The specification's row sets, written out layer by layer (decoder replay on)."""
    exp = {}
    last = num_layers - 1
    for layer in range(num_layers):
        comp = "all" if layer in owners else "none"
        if layer < last_kv:  # encoder: every row, every phase
            for p in PHASES:
                exp[p, layer] = ("all", comp, "all", "all")
            continue
        exp["decode", layer] = ("all", comp, "all", "all")
        exp["prefill_nonfinal", layer] = ("none", comp, "none", "none")
        if layer < last:
            exp["prefill_final", layer] = ("tail", comp, "tail", "tail")
        else:  # the last layer: KV on the tail, query/attention/FFN on the last row
            exp["prefill_final", layer] = ("tail", comp, "last", "last")
    return exp


def assert_table(table, exp):
    for (p, layer), rows in exp.items():
        got = tuple(table.row_set(p, layer, sub) for sub in SUB_STEPS)
        assert got == rows, (p, layer, got, rows)


def test_flash_table_reads_as_the_specification():
    s = spec("deepseek_v41_flash")
    t = table_of(s)
    assert t.last_kv_source == 20 and t.owners == (2, 8, 14, 20)
    assert_table(t, expected_replay_table(40, 20, {2, 8, 14, 20}))
    # Spot checks in the specification's words.
    assert (
        t.row_set("prefill_final", 20, "compress") == "all"
    )  # layer 20's compressed KV: every row
    assert t.row_set("prefill_final", 39, "ring_write") == "tail"  # layer 39's KV: the tail
    assert t.row_set("prefill_final", 39, "attention") == "last"
    assert all(t.row_set("prefill_nonfinal", 20, sub) == "none" for sub in ("attention", "ffn"))
    assert t.row_set("prefill_nonfinal", 20, "compress") == "all"
    assert all(
        t.row_set("decode", layer, sub) == "all"
        for layer in range(40)
        for sub in ("ring_write", "attention", "ffn")
    )
    # Windows: decoder layers floored at the tail in prefill; encoder layers at the forward
    # start on an encoder rebuild; decode never.
    assert t.floor("prefill_final", 25) == "tail" and t.floor("prefill_final", 5) == "forward_start"
    assert {t.floor("decode", layer) for layer in range(40)} == {"none"}


def test_flash_graph_stages():
    t = table_of(spec("deepseek_v41_flash"))
    assert [(g.name, g.first_layer, g.last_layer) for g in t.stages] == [
        ("early", 0, 19),
        ("layer20", 20, 20),
        ("late", 21, 38),
        ("layer39", 39, 39),
    ]
    off = table_of(spec("deepseek_v41_flash"), decoder_replay=False)
    assert [(g.name, g.first_layer, g.last_layer) for g in off.stages] == [("backbone", 0, 39)]


def test_flash_ranges_view():
    t = table_of(spec("deepseek_v41_flash"))
    final = t.ranges("prefill_final")
    assert {"layers": [20, 38], "sub_step": "attention", "rows": "tail"} in final
    assert {"layers": [39, 39], "sub_step": "ffn", "rows": "last"} in final
    assert {"layers": [20, 39], "sub_step": "ring_write", "rows": "tail"} in final
    nonfinal = t.ranges("prefill_nonfinal")
    assert all(e["layers"][1] < 20 or e["sub_step"] == "compress" for e in nonfinal)


@pytest.mark.parametrize("name", ["deepseek_v41_flash", "tiny", "tiny40", "medium"])
@pytest.mark.parametrize("switch", ["decoder_replay", "both"])
def test_replay_off_runs_every_row_through_every_layer(name, switch):
    s = spec(name)
    kw = {"decoder_replay": False}
    if switch == "both":
        kw["encoder_replay"] = False
    t = table_of(s, **kw)
    owners = set(t.owners)
    for p in PHASES:
        for layer in range(t.num_layers):
            for sub in SUB_STEPS:
                want = "none" if sub == "compress" and layer not in owners else "all"
                assert t.row_set(p, layer, sub) == want
    assert len(t.stages) == 1 and t.stages[0].name == "backbone"


def test_encoder_replay_off_keeps_row_sets_and_drops_the_encoder_floor():
    s = spec("deepseek_v41_flash")
    on, off = table_of(s), table_of(s, encoder_replay=False)
    assert on.rows == off.rows and on.stages == off.stages
    assert off.floor("prefill_final", 5) == "none" and off.floor("prefill_final", 25) == "tail"


@pytest.mark.parametrize("name", ["tiny", "tiny40", "medium"])
def test_shipped_specs_follow_the_same_rule(name):
    s = spec(name)
    t = table_of(s)
    owners = {layer.index for layer in s.layers if layer.role == "full"}
    assert_table(t, expected_replay_table(len(s.layers), max(s.dims.kv_source_layer_ids), owners))


def test_moving_the_last_kv_source_moves_the_table():
    base = spec("tiny")  # kv sources [2, 4, 6, 8], 14 layers
    moved = variant(
        base,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layer_ids=(2, 4, 6),
        index_source_layer_ids=(2, 4, 6, 10, 12),
        candidate_source_layer_id=6,
        engram_layer_ids=(1, 4),
    )
    t = table_of(moved)
    assert t.last_kv_source == 6
    assert_table(t, expected_replay_table(14, 6, {2, 4, 6}))
    assert [(g.name, g.first_layer, g.last_layer) for g in t.stages] == [
        ("early", 0, 5),
        ("layer6", 6, 6),
        ("late", 7, 12),
        ("layer13", 13, 13),
    ]


def test_changing_the_window_leaves_the_symbolic_table():
    base = spec("tiny")
    wide = variant(base, sliding_window=16, replay={"min_final_prefill_rows": 16})
    assert table_of(wide).rows == table_of(base).rows


def test_last_layer_as_kv_source_has_no_late_stage():
    base = spec("tiny")
    s = variant(
        base,
        num_hidden_layers=9,
        compress_ratios=(0, 0, 2, 2, 2, 2, 2, 2, 1, 0, 0, 0),
        index_source_layer_ids=(2, 4, 6, 8),
        engram_layer_ids=(1,),
    )
    t = table_of(s)
    assert t.last_kv_source == 8
    # The last KV source is the last layer: compression on every row, KV on the tail, query on
    # the last row.
    assert tuple(t.row_set("prefill_final", 8, sub) for sub in SUB_STEPS) == (
        "tail",
        "all",
        "last",
        "last",
    )
    assert [(g.name, g.first_layer, g.last_layer) for g in t.stages] == [
        ("early", 0, 7),
        ("layer8", 8, 8),
    ]


def test_layer_graph_edges():
    s = spec("deepseek_v41_flash")
    g = layer_graph(s.layers, s.dims.candidate_source_layer_id)
    assert g.edges[(20, "compress"), (30, "attention")]["read"] == "global"
    assert g.edges[(36, "attention"), (39, "attention")]["read"] == "same"  # top-k reuse
    assert g.edges[(20, "attention"), (24, "attention")]["read"] == "same"  # candidates
    assert g.edges[(39, "ring_write"), (39, "attention")]["read"] == "window"
    assert (5, "compress") not in g


def test_stage_table_is_cached_and_follows_switches():
    s = spec("tiny")
    a = stage_table(s)
    assert stage_table(s) is a
    assert stage_table(s, decoder_replay=False).stages[0].name == "backbone"
