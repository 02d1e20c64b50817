"""``v41plan plan``: the documented JSON and clear errors (exit 2, no traceback)."""

from __future__ import annotations

import json

import pytest

from v41plan.cli.main import main


def run_plan(tmp_path, capsys, batch, *extra, spec="tiny"):
    f = tmp_path / "batch.json"
    f.write_text(batch if isinstance(batch, str) else json.dumps(batch))
    rc = main(["plan", spec, "--batch", str(f), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output_for_a_mixed_batch(tmp_path, capsys):
    batch = {
        "phase": "prefill",
        "requests": [
            {"prompt_len": 100, "start": 95, "chunk_len": 5},  # short final: backs off to 32
            {"prompt_len": 200, "start": 64, "chunk_len": 40, "prefix_hit": 64},  # rebuild
            {"prompt_len": 10, "start": 12, "chunk_len": 1, "phase": "decode"},
        ],
    }
    rc, out, err = run_plan(tmp_path, capsys, batch, "--json")
    assert rc == 0 and err == ""
    d = json.loads(out)
    assert d["graph_key"] == ["prefill_replay", 3, 68 + 72 + 1]
    assert [g["name"] for g in d["graph_stages"]] == ["early", "layer8", "late", "layer13"]
    a, b, c = d["requests"]
    assert (a["forward_start"], a["forward_end"], a["is_final_chunk"]) == (32, 100, True)
    assert (a["tail"], a["swa_replay_start"], a["write_from"], a["last_row"]) == (
        [92, 99],
        92,
        95,
        99,
    )
    assert {"layers": [13, 13], "sub_step": "attention", "rows": [99, 99]} in a["stages"]
    assert {"layers": [8, 12], "sub_step": "attention", "rows": [92, 99]} in a["stages"]
    assert {"layers": [0, 7], "sub_step": "ffn", "rows": [32, 99]} in a["stages"]
    assert {"layers": [8, 8], "sub_step": "compress", "rows": [32, 99]} in a["stages"]
    assert (b["forward_start"], b["write_from"], b["cached_until"], b["tail"]) == (32, 64, 32, None)
    assert b["encoder_window_floor"] == 32 and b["prefix_hit"] == 64 and not b["is_final_chunk"]
    assert {"layers": [8, 13], "sub_step": "attention", "rows": None} in b["stages"]
    assert c["phase"] == "decode" and c["swa_replay_start"] == 0
    assert {"layers": [0, 13], "sub_step": "attention", "rows": [12, 12]} in c["stages"]
    ratio2 = next(g for g in a["compress"] if g["ratio"] == 2)
    assert ratio2["compressed_rows"] == [47, 49] and ratio2["count"] == 3


def test_text_output_and_replay_switches(tmp_path, capsys):
    batch = {"phase": "prefill", "requests": [{"prompt_len": 100, "start": 95, "chunk_len": 5}]}
    rc, out, _ = run_plan(tmp_path, capsys, batch)
    assert rc == 0 and "forward [32, 100)" in out and "tail [92, 99]" in out
    rc, out, _ = run_plan(tmp_path, capsys, batch, "--no-decoder-swa-bounded-replay", "--json")
    d = json.loads(out)
    assert rc == 0 and d["graph_key"][0] == "prefill" and d["requests"][0]["forward_start"] == 95
    assert [g["name"] for g in d["graph_stages"]] == ["backbone"]


def test_copy_transfer_does_not_rebuild(tmp_path, capsys):
    batch = {"requests": [{"prompt_len": 70, "start": 64, "chunk_len": 6, "prefix_hit": 64}]}
    rc, out, _ = run_plan(tmp_path, capsys, batch, "--no-encoder-swa-bounded-replay", "--json")
    r = json.loads(out)["requests"][0]
    assert rc == 0 and (r["forward_start"], r["cached_until"], r["encoder_window_floor"]) == (
        32,
        64,
        0,
    )


def test_spec_by_path(tmp_path, capsys, specs_dir):
    batch = {"phase": "decode", "requests": [{"prompt_len": 5, "start": 9, "chunk_len": 1}]}
    rc, out, _ = run_plan(tmp_path, capsys, batch, "--json", spec=str(specs_dir / "tiny.yaml"))
    assert rc == 0 and json.loads(out)["graph_key"] == ["decode", 1, 1]


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"requests": [{"prompt_len": 10, "start": 11, "chunk_len": 1}]}, "start 11 is not inside"),
        (
            {"requests": [{"prompt_len": 10, "start": 5, "chunk_len": 9}]},
            "runs past the prompt end",
        ),
        ({"requests": [{"prompt_len": 10, "start": -2, "chunk_len": 1}]}, "'start' must be >= 0"),
        ({"requests": [{"prompt_len": 10, "chunk_len": 1}]}, "missing 'start'"),
        ({"requests": [{"prompt_len": "10", "start": 0, "chunk_len": 1}]}, "must be an integer"),
        ({"requests": [{"prompt_len": 10, "start": 0, "chunk_len": 1, "x": 1}]}, "unknown keys: x"),
        ({"requests": []}, "non-empty list"),
        (
            {"phase": "verify", "requests": [{"prompt_len": 1, "start": 0, "chunk_len": 1}]},
            "'phase'",
        ),
        ({"requests": [{"prompt_len": 40, "start": 8, "chunk_len": 2, "prefix_hit": 5}]}, "grid"),
        (
            {"requests": [{"prompt_len": 10, "start": 0, "chunk_len": 10}], "running_tokens": 4},
            "running_tokens 4",
        ),
        ([1, 2], "JSON object"),
        ("{not json", "not valid JSON"),
    ],
)
def test_invalid_batches_get_one_clear_line(tmp_path, capsys, batch, message):
    rc, out, err = run_plan(tmp_path, capsys, batch)
    assert rc == 2 and out == ""
    assert err.startswith("v41plan plan: --batch ") and message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_unknown_spec_and_missing_file(tmp_path, capsys):
    rc, _, err = run_plan(tmp_path, capsys, {"requests": []}, spec="no_such_spec")
    assert rc == 2 and "no_such_spec" in err
    rc = main(["plan", "tiny", "--batch", str(tmp_path / "missing.json")])
    assert rc == 2 and "missing.json" in capsys.readouterr().err


def test_full_rows_request(tmp_path, capsys):
    batch = {"requests": [{"prompt_len": 100, "start": 95, "chunk_len": 5, "full_rows": True}]}
    rc, out, _ = run_plan(tmp_path, capsys, batch, "--json")
    r = json.loads(out)["requests"][0]
    assert rc == 0 and r["full_rows"] and r["forward_start"] == 95 and r["tail"] is None
    assert {"layers": [0, 13], "sub_step": "attention", "rows": [95, 99]} in r["stages"]
