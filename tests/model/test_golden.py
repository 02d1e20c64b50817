"""The dense reference against the golden tiny40 values of an independent implementation.

Float64, the published index arithmetic (``index_cache_dtype=None``), a full causal prefill of the
golden prompt. Quantizers on: every row's logits to 1e-12 relative and every decision (index
top-k of each source, routed experts of each layer) identical. Quantizers off: the logits to
1e-12. The Engram row ids are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.golden_helpers import (
    REL_TOL,
    golden,
    golden_checkpoint,
    golden_decisions,
    golden_dir,
    rel_err,
)
from v41plan.model import quant
from v41plan.model.reference import ReferenceModel


def _reference() -> ReferenceModel:
    _spec, ckpt = golden_checkpoint()
    return ReferenceModel.from_checkpoint(ckpt, torch.float64)


def test_golden_folder_is_present():
    assert (golden_dir() / "README.md").is_file()


def test_reference_reproduces_the_golden_logits_and_decisions_with_quantizers_on():
    g = golden()
    ref = _reference()
    logits = ref.prefill(g["token_ids"])
    assert rel_err(logits, g["logits_quant_on"]) <= REL_TOL
    topk = golden_decisions("topk")
    assert sorted(ref.selections) == sorted(topk)
    for layer, want in topk.items():
        assert torch.equal(ref.selections[layer], want), layer
    experts = golden_decisions("experts")
    assert sorted(ref.experts) == sorted(experts) == list(range(40))
    for layer, want in experts.items():
        assert torch.equal(ref.experts[layer], want), layer


def test_reference_reproduces_the_golden_logits_with_quantizers_off():
    g = golden()
    ref = _reference()
    with quant.fake_quant(False):
        logits = ref.prefill(g["token_ids"])
    assert rel_err(logits, g["logits_quant_off"]) <= REL_TOL
    # the two golden runs differ by far more than the tolerance: each one tests its switch
    assert rel_err(g["logits_quant_off"], g["logits_quant_on"]) > 1e-3


def test_engram_row_ids_equal_the_golden_ids():
    g = golden()
    _spec, ckpt = golden_checkpoint()
    rows, _history = ckpt.engram_host().prepare(g["token_ids"].numpy(), None)
    assert np.array_equal(rows, g["engram_hash_ids"].numpy())


def test_a_missing_golden_folder_fails_with_a_message(monkeypatch, tmp_path):
    from tests.model import golden_helpers

    monkeypatch.setattr(golden_helpers, "TINY40", tmp_path / "tiny40")
    with pytest.raises(pytest.fail.Exception, match="golden values missing: .*golden.safetensors"):
        golden_helpers.golden_dir()
