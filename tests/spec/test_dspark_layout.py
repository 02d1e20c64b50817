"""The DSpark layout: a spec whose model declares a draft compiles a second geometry per
BF16-main pair, with rings of ``window + dspark_block_size`` rows, the draft stages' rings after
the backbone's in STATE, and its own layout id; images of one layout are refused by the
other."""

from __future__ import annotations

import numpy as np
import pytest

from v41plan.cli.main import main
from v41plan.geometry.runtime import load_cache_spec
from v41plan.planner.checkpoint import CopyError, CopyPlanner, ImageOp
from v41plan.runtime.kv_connector import LocalConnector


def test_flash_dspark_layout_bytes():
    """V4.1-Flash: rings 43 x 133 rows of 1024 B (the reference's ring of W + 5 = 133 rows
    over 40 + 3 layers); tails and cursor as without speculation."""
    cs = load_cache_spec("deepseek_v41_flash")
    plain, spec = cs.geometry("bf16", "fp8"), cs.geometry("bf16", "fp8", speculative=True)
    assert (spec.speculative_tokens, spec.draft_layers, spec.ring_rows) == (5, 3, 133)
    rings = spec.state_field("swa_rings")
    assert rings.shape == (43, 133, 512) and rings.nbytes == 43 * 133 * 1024 == 5_856_256
    for name in ("tail_values", "tail_scores", "cursor"):
        assert spec.state_field(name).nbytes == plain.state_field(name).nbytes
    assert spec.state_bytes == plain.state_bytes + 5_856_256 - 40 * 128 * 1024
    assert spec.image_bytes == 5_856_256 + 1024  # rings + cursor, each padded to 1024
    assert spec.units_per_image == -(-spec.image_bytes // spec.page_unit_bytes)
    # the PAGE is the same: speculation changes STATE only
    assert (spec.page_unit_bytes, spec.planes) == (plain.page_unit_bytes, plain.planes)
    assert spec.layout_id == plain.layout_id + ":spec=5:draft=3"


def test_dspark_layout_needs_a_draft_and_bf16_caches():
    with pytest.raises(ValueError, match="declares no DSpark draft"):
        load_cache_spec("tiny40").geometry("bf16", "fp8", speculative=True)
    cs = load_cache_spec("tiny40_dspark")
    assert sorted(cs.speculative_geometries) == [("bf16", "fp4"), ("bf16", "fp8")]
    with pytest.raises(ValueError, match="needs BF16 caches: kv_cache_dtype='fp4'"):
        cs.geometry("fp4", "fp8", speculative=True)
    # the plain layouts of a draft spec are the draft-less spec's
    base = load_cache_spec("tiny40")
    for key, g in base.geometries.items():
        assert cs.geometries[key].state_bytes == g.state_bytes
        if key[0] == "bf16":
            assert cs.geometry(*key, speculative=True).ring_rows == 8 + 5


def test_images_of_one_layout_are_refused_by_the_other(tmp_path):
    cs = load_cache_spec("tiny40_dspark")
    plain, spec = cs.geometry("bf16", "fp8"), cs.geometry("bf16", "fp8", speculative=True)
    planner = CopyPlanner(spec, num_pages=64, num_slots=2)
    units = tuple(range(plain.units_per_image))
    with pytest.raises(CopyError, match="image layout .* != pool layout"):
        planner.check(ImageOp(0, units, plain.layout_id, plain.image_bytes), "restore")
    # a store directory shared by both layouts: an image saved under one is not found by the other
    args = {"bytes": 1 << 24, "path": str(tmp_path)}
    a = LocalConnector(plain.layout_id, plain.page_unit_bytes, plain.units_per_image, **args)
    b = LocalConnector(spec.layout_id, spec.page_unit_bytes, spec.units_per_image, **args)
    data = np.zeros((plain.units_per_image, plain.page_unit_bytes), np.uint8)
    a.save_image(b"k" * 8, [1, 2, 3], data)
    assert a.has_image([1, 2, 3], b"k" * 8)
    assert not b.has_image([1, 2, 3], b"k" * 8)


def test_explain_shows_both_layouts(capsys):
    assert main(["explain", "tiny40_dspark"]) == 0
    out = capsys.readouterr().out
    assert "DSpark layout (5 speculative tokens, 3 draft rings): STATE 73,472 B (was 42,752)" in out
    assert "rings 43x13x64 (71,680 B)" in out
    assert main(["explain", "tiny40_dspark", "--json"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["speculative"]["ring_rows"] == 13
    assert d["speculative"]["layout_id"].endswith(":spec=5:draft=3")
    assert main(["explain", "tiny40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculative"] is None
