"""``scripts/recall_selection_probe.py``: the rows it reads and the report it writes."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import recall_selection_probe as rsp

from v41plan.validation.quality_tasks import kv_recall_doc


def test_answer_marks_point_at_the_asked_pair():
    rng = random.Random(5)
    for pairs in (4, 16, 48):
        d = kv_recall_doc(rng, pairs)
        query_row, key_byte, lead_byte = rsp.answer_marks(d)
        ctx = d["context"].encode()
        answer = d["choices"][d["label"]]
        assert query_row == len(ctx)  # the row of the answer's space predicts its lead digit
        assert chr(ctx[key_byte]) == d["context"].split("what is ")[1][0]
        assert chr(ctx[key_byte + 1]) == "=" and chr(ctx[lead_byte]) == answer[1]
        assert key_byte % 8 == 0  # pairs of 8 bytes: key and lead digit in different rows


def test_probe_reports_every_index_layer(tmp_path):
    out = tmp_path / "probe.json"
    args = ["--checkpoint", str(ROOT / "checkpoints" / "quality40_recall")]
    assert rsp.main([*args, "--pairs", "8", "--docs", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    layers = report["rows"][0]["layers"]
    # quality40: four full index layers at ratios 2 and 1, the ratio-1 reindex layers
    assert {int(L) for L in layers} == {2, 8, 14, 20, 24, 28, 32, 36}
    for r in layers.values():
        assert 0.0 <= r["value_hit"] <= 1.0 and 0.0 <= r["key_hit"] <= 1.0
        assert r["value_rank_median"] >= 0 and r["target_rank_median"] >= 0
        assert 0.0 <= r["target_mass_mean"] <= 1.0
    assert layers["24"]["role"] == "reindex" and layers["14"]["ratio"] == 2
    from v41plan.model import layers as model_layers
    from v41plan.model import train

    assert train.topk_ids is model_layers.topk_ids  # the recording hooks are gone
