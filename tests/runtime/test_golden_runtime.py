"""The paged runtime against the golden tiny40 values of an independent implementation.

Float64, quantizers on (the pools store values on the quantizers' grids, so quantizers on is
what the paged formats hold), the fp4 index plane (the published FP4 E8M0/32 index arithmetic)
under the bf16 and the fp4 main planes, replays off so that every row's logits are defined.
Two requests share the steps: one runs the whole prompt in one forward, the other a chunked
schedule whose chunks cross PAGE and ratio-2 group boundaries. Every row's logits reproduce the
golden ones to 1e-12 relative and every decision (index top-k per source, routed experts per
layer) is identical. The torch backend computes in the reference's operation order, so nothing is
forced; ``test_forced_decisions_are_honoured`` checks the teacher-forcing hook that a backend with
another operation order uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.golden_helpers import REL_TOL, golden, golden_checkpoint, golden_decisions, rel_err
from tests.runtime.paged_helpers import step
from v41plan.model.reference import ReferenceModel
from v41plan.runtime.paged_model import RuntimeModel

CHUNKS = (3, 1, 61, 7, 88)  # one row, an odd group split, a PAGE (32) crossed mid-chunk
TABLE_A = (9, 3, 7, 1, 5)
TABLE_B = (2, 8, 4, 10, 6)
PAIRS = [("bf16", "fp4"), ("fp4", "fp4")]


def _runtime(kv: str, ix: str) -> RuntimeModel:
    spec, ckpt = golden_checkpoint()
    return RuntimeModel(
        spec,
        ckpt.weights,
        ckpt.engram_host(),
        kv_cache_dtype=kv,
        index_cache_dtype=ix,
        num_pages=12,
        num_slots=3,
        max_tokens=168,
        max_bs=2,
        table_width=5,
        dtype=torch.float64,
        cfg=ckpt.config,
    )


def _check(m, out, row0: int, lo: int, n: int, topk, experts) -> None:
    g = golden()
    got = out.row_logits[row0 : row0 + n]
    want = g["logits_quant_on"][lo : lo + n]
    # relative to the largest golden logit of the prompt (the golden README's measure)
    assert (got - want).abs().max() <= REL_TOL * g["logits_quant_on"].abs().max(), (lo, n)
    for layer, ids in topk.items():
        assert torch.equal(m.selections[layer][row0 : row0 + n], ids[lo : lo + n]), (layer, lo)
    ex = m.experts
    assert sorted(ex) == list(range(40))
    for layer, ids in experts.items():
        assert torch.equal(ex[layer][row0 : row0 + n], ids[lo : lo + n]), (layer, lo)


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_paged_runtime_reproduces_the_golden_logits_and_decisions(pair):
    spec, _ = golden_checkpoint()
    g = golden()
    ids = g["token_ids"].numpy()
    n_tok = len(ids)
    topk, experts = golden_decisions("topk"), golden_decisions("experts")
    m = _runtime(*pair)
    m.pools.reset_slot(1)
    m.pools.reset_slot(2)
    done = 0
    for i, n in enumerate(CHUNKS):
        batch = [(2, TABLE_B, n_tok, done, n, "prefill")]
        if i == 0:  # request A: the whole prompt in one forward, beside B's first chunk
            batch.insert(0, (1, TABLE_A, n_tok, 0, n_tok, "prefill"))
        plan = step(spec, batch)
        flat = np.concatenate([ids] * (i == 0) + [ids[done : done + n]])
        out = m.forward(plan, flat, all_row_logits=True)
        if i == 0:
            _check(m, out, 0, 0, n_tok, topk, experts)
        _check(m, out, int(plan.cu_seqlens_q[len(batch) - 1]), done, n, topk, experts)
        done += n
    assert done == n_tok


def test_forced_decisions_are_honoured():
    """Forcing another expert choice on two layers and another top-k list on one index source
    moves the paged logits exactly as it moves the reference's."""
    spec, ckpt = golden_checkpoint()
    g = golden()
    ids = g["token_ids"].numpy()[:40]
    n = len(ids)
    experts = {L: golden_decisions("experts")[L][:n].clone() for L in (3, 25)}
    for e in experts.values():
        e[5:] = torch.flip(e[5:], dims=[1]) + 1  # other (still distinct) experts past row 5
        e[5:] %= ckpt.config.n_routed_experts
    sel = golden_decisions("topk")[8][:n].clone()
    sel[20:] = torch.where(sel[20:] >= 0, sel[20:] // 2, sel[20:])  # earlier compressed rows
    ref = ReferenceModel.from_checkpoint(ckpt, torch.float64)
    ref.forced_experts = experts
    ref.forced_selections = {8: sel}
    want = ref.prefill(ids)
    assert rel_err(want[-1], g["logits_quant_on"][n - 1]) > 1e-6  # the forcing changed something
    m = _runtime("bf16", "fp4")
    m.pools.reset_slot(1)
    m.forced_experts = experts
    m.forced_selections = {8: sel}
    out = m.forward(step(spec, [(1, TABLE_A, n, 0, n, "prefill")]), ids, all_row_logits=True)
    assert rel_err(out.row_logits[:n], want) <= REL_TOL
    assert torch.equal(m.experts[3][:n], experts[3]) and torch.equal(m.selections[8][:n], sel)
    # Reuse layers of owner 8 attend through the forced list as well
    assert torch.equal(m.selections[8][:n], ref.selections[8])
