"""``v41plan explain``: the acceptance numbers of V4.1-Flash and the stable JSON names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from v41plan.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
FLASH = str(ROOT / "specs" / "deepseek_v41_flash.yaml")


def explain_json(capsys, *args: str) -> dict:
    assert main(["explain", FLASH, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_flash_roles_and_segments(capsys):
    """Full [2, 8, 14, 20], Reindex [24, 28, 32, 36], Window [0, 1], 30 Reuse; encoder 0-19."""
    d = explain_json(capsys)
    layers = d["layers"]
    by_role = {
        r: [x["index"] for x in layers if x["role"] == r]
        for r in ("full", "reindex", "window", "reuse")
    }
    assert by_role["full"] == [2, 8, 14, 20]
    assert by_role["reindex"] == [24, 28, 32, 36]
    assert by_role["window"] == [0, 1]
    assert len(by_role["reuse"]) == 30
    assert [x["index"] for x in layers if x["segment"] == "encoder"] == list(range(20))
    assert [x["index"] for x in layers if x["segment"] == "decoder"] == list(range(20, 40))
    assert layers[0] == {
        "index": 0,
        "segment": "encoder",
        "role": "window",
        "ratio": 0,
        "kv_owner": None,
        "topk_owner": None,
        "uses_candidates": False,
        "engram": False,
    }
    assert layers[39] == {
        "index": 39,
        "segment": "decoder",
        "role": "reuse",
        "ratio": 1,
        "kv_owner": 20,
        "topk_owner": 36,
        "uses_candidates": True,
        "engram": False,
    }
    assert [x["index"] for x in layers if x["engram"]] == [1, 14]


@pytest.mark.parametrize(
    ("kv", "index", "per_token"),
    [("bf16", "fp8", 2890), ("fp4", "fp4", 890), ("bf16", "fp4", 2730), ("fp4", "fp8", 1050)],
)
def test_global_kv_bytes_per_token(capsys, kv, index, per_token):
    """2890 B/token for bf16/fp8 and 890 for fp4/fp4 (integers in the JSON)."""
    d = explain_json(capsys, "--kv-cache-dtype", kv, "--index-cache-dtype", index)
    assert d["geometry"]["global_kv_bytes_per_token"] == per_token
    assert isinstance(d["geometry"]["global_kv_bytes_per_token"], int)
    assert (d["kv_cache_dtype"], d["index_cache_dtype"]) == (kv, index)


@pytest.mark.parametrize(
    ("kv", "index", "page_bytes", "unit", "state", "image", "units"),
    [
        ("bf16", "fp8", 327_680, 369_920, 5_256_192, 5_243_904, 15),
        ("bf16", "fp4", 327_680, 349_440, 5_256_192, 5_243_904, 16),
        ("fp4", "fp8", 92_160, 134_400, 2_715_904, 2_703_616, 21),
        ("fp4", "fp4", 92_160, 113_920, 2_715_904, 2_703_616, 24),
    ],
)
def test_flash_bytes(capsys, kv, index, page_bytes, unit, state, image, units):
    """PAGE, PAGE unit, STATE, image bytes and units per image for all four pairs."""
    g = explain_json(capsys, "--kv-cache-dtype", kv, "--index-cache-dtype", index)["geometry"]
    assert g["page_tokens"] == 128
    assert (g["page_bytes"], g["page_unit_bytes"]) == (page_bytes, unit)
    assert (g["state_bytes"], g["image_bytes"], g["units_per_image"]) == (state, image, units)
    assert g["image_bytes"] == sum(f["bytes"] for f in g["state_fields"] if f["in_checkpoint"])


def test_image_carries_rings_and_cursor_not_tails(capsys):
    """The checkpoint image carries the SWA rings and the cursor, not the FP32 tails."""
    fields = {f["name"]: f for f in explain_json(capsys)["geometry"]["state_fields"]}
    assert {n: f["in_checkpoint"] for n, f in fields.items()} == {
        "swa_rings": True,
        "tail_values": False,
        "tail_scores": False,
        "cursor": True,
    }
    assert fields["swa_rings"]["bytes"] == 40 * 128 * 1024
    assert fields["tail_values"]["shape"] == [3, 512]


def test_json_names_are_stable(capsys):
    """The names other tools read."""
    d = explain_json(capsys, "--index-cache-dtype", "fp4")
    assert {"layers", "geometry", "layout_id"} <= set(d)
    g = d["geometry"]
    assert {
        "page_tokens",
        "page_unit_bytes",
        "state_bytes",
        "image_bytes",
        "units_per_image",
        "global_kv_bytes_per_token",
        "planes",
        "state_fields",
    } <= set(g)
    assert {"name", "owner", "row_bytes", "rows_per_page", "offset"} <= set(g["planes"][0])
    assert {"name", "bytes", "in_checkpoint"} <= set(g["state_fields"][0])
    planes = {p["name"]: p for p in g["planes"]}
    assert planes["main.20"] == {
        "name": "main.20",
        "kind": "main",
        "owner": 20,
        "ratio": 1,
        "row_bytes": 1024,
        "rows_per_page": 128,
        "bytes_per_page": 131072,
        "offset": 196608,
    }
    assert (planes["index_values.2"]["row_bytes"], planes["index_scales.2"]["row_bytes"]) == (64, 4)
    assert planes["index_values.2"]["offset"] == g["page_bytes"]
    assert d["layout_id"].startswith("v41plan-main-bf16-index-fp4-")


def test_text_table(capsys):
    """The readable form lists every layer and the byte totals."""
    assert main(["explain", FLASH]) == 0
    out = capsys.readouterr().out
    assert "   24  decoder  reindex      1        20          24         yes       -" in out
    assert "checkpoint image 5,243,904 B = 15 PAGE units" in out
    assert "global KV 2890 B per token" in out


def test_undeclared_pair_is_refused(tmp_path, capsys):
    """A format pair the spec does not compile: exit 2 naming the declared pairs."""
    spec = tmp_path / "specs" / "tiny.yaml"
    spec.parent.mkdir()
    spec.write_text((ROOT / "specs" / "tiny.yaml").read_text().replace("[bf16, fp4]", "[bf16]"))
    assert main(["explain", str(spec), "--kv-cache-dtype", "fp4"]) == 2
    assert capsys.readouterr().err == (
        "v41plan explain: specs/tiny.yaml does not compile the pair fp4/fp8; declared: bf16/fp8, "
        "bf16/fp4\n"
    )
