"""The paged runtime's replayed forwards against their dense references (``replay_reference``).

Decoder replay (the forward finishing a prompt runs the decoder on its tail, the last layer's
query on its last row, a short final chunk backing off a hash block in the same slot) and the
encoder-replay rebuild (a fresh slot resuming at a prefix hit a hash block below it) are
computed densely from the replay rules, independently of plans, pools and gathers. Ragged steps
of several requests mix them with plain chunks and decode rows; a pure decode step afterwards
reads the rings the replayed forwards wrote. Float64, quantizers on and off (the dense side then
rounds what it reads back from the pools' storage formats, as the pools hold it): every defined
row's logits to 1e-12 relative, every index top-k and routed-expert choice identical. The plans'
forward starts and tails are checked against the rules' arithmetic, not taken from the plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import DTYPE, model, runtime, step, token_ids
from v41plan.model import quant
from v41plan.model.reference import ReferenceModel
from v41plan.model.replay_reference import DenseRequest, Forward

REL_TOL = 1e-12
W, B = 8, 32  # tiny: window, hash block (min_final_prefill_rows 8)


def _ref(spec_name: str, ix: str) -> ReferenceModel:
    _spec, cfg, w, eng = model(spec_name)
    return ReferenceModel(cfg, w, eng, DTYPE, index_cache_dtype=ix)


def _history(eng, ids) -> tuple[int, ...]:
    """The request's Engram-compressed ids (a backed-off or rebuilt forward's history)."""
    return tuple(int(t) for t in eng.compress(np.asarray(ids)))


def _compare(m, out, plan, k: int, dense) -> None:
    """Request ``k`` of the paged step against its dense forward: defined rows, decisions."""
    r0, r1 = int(plan.cu_seqlens_q[k]), int(plan.cu_seqlens_q[k + 1])
    assert r1 - r0 == dense.positions.numel()
    assert torch.equal(torch.from_numpy(plan.positions[r0:r1]), dense.positions)
    scale = dense.logits[dense.defined].abs().max()
    last = dense.logits[-1]
    assert dense.defined[-1]
    assert (out.logits[k] - last).abs().max() <= REL_TOL * scale, k
    got = out.row_logits[r0:r1]
    if bool(dense.defined.all()):
        assert (got - dense.logits).abs().max() <= REL_TOL * scale, k
    assert torch.isnan(got[~dense.defined]).all()  # the runtime claims no row the rules leave out
    for layer, sel in dense.selections.items():
        assert torch.equal(m.selections[layer][r0:r1], sel), (k, layer)
    experts = m.experts
    for layer, ids in dense.experts.items():
        assert torch.equal(experts[layer][r0:r1], ids), (k, layer)
    assert sorted(experts) == sorted(dense.experts)


CASES = [
    ("bf16", "fp4", True),
    ("bf16", "fp4", False),
    ("fp4", "fp8", True),
    ("fp4", "fp4", False),
]
IDS = [f"{kv}-{ix}-quant-{'on' if on else 'off'}" for kv, ix, on in CASES]


@pytest.mark.parametrize(("kv", "ix", "quant_on"), CASES, ids=IDS)
def test_decoder_replay_equals_its_dense_reference_in_ragged_steps(kv, ix, quant_on):
    spec, _cfg, _w, eng = model("tiny")
    lens = (45, 70, 100, 50)  # prompt lengths of requests 0..3
    ids = [token_ids(n + 2, 50 + i) for i, n in enumerate(lens)]
    tables = ((1, 2), (3, 4, 5), (6, 7, 8, 9), (10, 11))
    with quant.fake_quant(quant_on):
        ref = _ref("tiny", ix)
        m = runtime("tiny", kv, ix, max_bs=5, num_slots=5)
        dense = [DenseRequest(ref, ids[i], kv_cache_dtype=kv) for i in range(4)]
        for s in range(4):
            m.pools.reset_slot(s)
        # step 1: non-final chunks of 1 and 2 (encoder and the last KV source's compression
        # only), request 3's whole prompt (its tail)
        p1 = step(
            spec,
            [
                (1, tables[1], 70, 0, 40, "prefill"),
                (2, tables[2], 100, 0, 97, "prefill"),
                (3, tables[3], 50, 0, 50, "prefill"),
            ],
            decoder_replay=True,
        )
        out = m.forward(
            p1, np.concatenate([ids[1][:40], ids[2][:97], ids[3][:50]]), all_row_logits=True
        )
        dense[1].forward(Forward(0, 40, 0, decoder="none"))
        dense[2].forward(Forward(0, 97, 0, decoder="none"))
        _compare(m, out, p1, 2, dense[3].forward(Forward(0, 50, 0, decoder="tail")))
        # step 2: request 0 cold to its end, 1 finishes from 40, 2 resumes 3 rows before its end
        # (fewer than min_final_prefill_rows: it backs off a whole hash block, in its slot), 3
        # decodes one row inside the prefill step; padded
        p2 = step(
            spec,
            [
                (0, tables[0], 45, 0, 45, "prefill"),
                (1, tables[1], 70, 40, 30, "prefill"),
                (2, tables[2], 100, 97, 3, "prefill", False, _history(eng, ids[2])),
                (3, tables[3], 50, 50, 1, "decode"),
            ],
            decoder_replay=True,
            pad_tokens=3,
            pad_bs=1,
        )
        back_off = max(0, (97 // B - 1) * B)
        assert back_off == 64 and p2.forward_start[:4].tolist() == [0, 40, back_off, 50]
        ends = np.array([45, 70, 100, 51])
        want_tail = np.maximum(p2.forward_start[:4], ends - W)
        assert p2.tail_start[:4].tolist() == [*want_tail[:3].tolist(), -1]
        flat = np.concatenate([ids[0][:45], ids[1][40:70], ids[2][64:100], ids[3][50:51]])
        out = m.forward(p2, flat, all_row_logits=True)
        forwards = [
            Forward(0, 45, 0, decoder="tail"),
            Forward(40, 70, 40, decoder="tail"),
            Forward(back_off, 100, 97, decoder="tail"),
            Forward(50, 51, 50),
        ]
        for k, fwd in enumerate(forwards):
            _compare(m, out, p2, k, dense[k].forward(fwd))
        assert not out.logits[4].any()
        # step 3: every request decodes, reading the rings the tails wrote (the captured shape)
        starts = (45, 70, 100, 51)
        p3 = step(spec, [(i, tables[i], lens[i], starts[i], 1, "decode") for i in range(4)])
        out = m.forward(p3, np.array([ids[i][starts[i]] for i in range(4)]), all_row_logits=True)
        for k in range(4):
            fwd = Forward(starts[k], starts[k] + 1, starts[k], decode=True)
            _compare(m, out, p3, k, dense[k].forward(fwd))


REBUILD_CASES = [
    ("bf16", "fp4", True, False),
    ("fp4", "fp4", False, False),
    ("bf16", "fp8", True, True),
    ("fp4", "fp4", False, True),
]
REBUILD_IDS = [
    f"{kv}-{ix}-quant-{'on' if on else 'off'}-decoder-replay-{'on' if dec else 'off'}"
    for kv, ix, on, dec in REBUILD_CASES
]


@pytest.mark.parametrize(("kv", "ix", "quant_on", "decoder_replay"), REBUILD_CASES, ids=REBUILD_IDS)
def test_encoder_rebuild_equals_its_dense_reference_in_ragged_steps(
    kv, ix, quant_on, decoder_replay
):
    spec, _cfg, _w, eng = model("tiny")
    shared = token_ids(64, 7)
    x_ids = np.concatenate([shared, token_ids(20, 8)])  # writes the prefix cache's pages
    y_ids = np.concatenate([shared, token_ids(13, 9)])  # hits 64: rebuilds from 32
    z_ids = np.concatenate([shared[:32], token_ids(30, 10)])  # hits 32: rebuilds from 0
    v_ids = token_ids(40, 11)  # a plain chunk beside them
    mode = "tail" if decoder_replay else "all"
    flags = {"encoder_replay": True, "decoder_replay": decoder_replay}
    with quant.fake_quant(quant_on):
        ref = _ref("tiny", ix)
        m = runtime("tiny", kv, ix, max_bs=5, num_slots=5)
        for s in range(5):
            m.pools.reset_slot(s)
        m.forward(step(spec, [(1, (9, 7, 4), 84, 0, 84, "prefill")], **flags), x_ids)
        m.forward(step(spec, [(4, (12, 13), 60, 0, 20, "prefill")], **flags), v_ids[:20])
        plan = step(
            spec,
            [
                (2, (9, 7, 5), 77, 64, 13, "prefill", True, _history(eng, y_ids)),
                (3, (9, 6), 62, 32, 30, "prefill", True, _history(eng, z_ids)),
                (4, (12, 13), 60, 20, 20, "prefill"),
            ],
            pad_tokens=3,
            pad_bs=1,
            **flags,
        )
        hits, ends = (64, 32, 20), (77, 62, 40)
        starts = [max(0, (h // B - 1) * B) for h in hits[:2]] + [20]
        assert plan.forward_start[:3].tolist() == starts == [32, 0, 20]
        assert plan.encoder_window_floor[:3].tolist() == [32, 0, 0]
        if decoder_replay:  # the rebuilds finish their prompts: tails; the plain chunk does not
            assert plan.tail_start[:3].tolist() == [ends[0] - W, ends[1] - W, -1]
        flat = np.concatenate([y_ids[32:77], z_ids[:62], v_ids[20:40]])
        out = m.forward(plan, flat, all_row_logits=True)
        for k, (ids, hit, fs, end) in enumerate([(y_ids, 64, 32, 77), (z_ids, 32, 0, 62)]):
            d = DenseRequest(ref, ids, kv_cache_dtype=kv)
            d.forward(Forward(0, hit, 0))  # the rows the prefix cache holds (x's forward wrote)
            _compare(
                m, out, plan, k, d.forward(Forward(fs, end, hit, fresh_slot=True, decoder=mode))
            )
        d = DenseRequest(ref, v_ids, kv_cache_dtype=kv)
        d.forward(Forward(0, 20, 0, decoder="none" if decoder_replay else "all"))
        v_out = d.forward(Forward(20, 40, 20, decoder="none" if decoder_replay else "all"))
        if not decoder_replay:
            _compare(m, out, plan, 2, v_out)
        else:  # a non-final chunk defines no row (its last-row logits are not sampled)
            r0, r1 = int(plan.cu_seqlens_q[2]), int(plan.cu_seqlens_q[3])
            assert not v_out.defined.any() and torch.isnan(out.row_logits[r0:r1]).all()


def test_tiny40_both_replays_equal_their_dense_reference():
    """The released 40-layer schedule (decoder 20..39, layer 39's query on the last row), the
    golden checkpoint, both replays in one ragged step: a tail-finishing chunk and a rebuild."""
    from tests.model.golden_helpers import golden, golden_checkpoint

    spec, ckpt = golden_checkpoint()
    cfg = ckpt.config
    ids = golden()["token_ids"].numpy()
    eng = ckpt.engram_host()
    ref = ReferenceModel(cfg, ckpt.weights, eng, DTYPE, index_cache_dtype="fp4")
    m = runtime_tiny40(spec, ckpt)
    for s in range(3):
        m.pools.reset_slot(s)
    flags = {"encoder_replay": True, "decoder_replay": True}
    m.forward(step(spec, [(0, (1, 2, 3, 4, 5), 160, 0, 100, "prefill")], **flags), ids[:100])
    other = np.concatenate([ids[:96], token_ids(40, 3) % cfg.vocab_size])  # hits 96 of the prompt
    plan = step(
        spec,
        [
            (0, (1, 2, 3, 4, 5), 160, 100, 60, "prefill"),
            (1, (1, 2, 3, 6, 7), 136, 96, 40, "prefill", True, _history(eng, other)),
        ],
        **flags,
    )
    assert plan.forward_start[:2].tolist() == [100, 64]
    out = m.forward(plan, np.concatenate([ids[100:160], other[64:136]]), all_row_logits=True)
    d = DenseRequest(ref, ids, kv_cache_dtype="fp4")
    d.forward(Forward(0, 100, 0, decoder="none"))
    _compare(m, out, plan, 0, d.forward(Forward(100, 160, 100, decoder="tail")))
    d = DenseRequest(ref, other, kv_cache_dtype="fp4")
    d.forward(Forward(0, 96, 0, decoder="none"))
    _compare(m, out, plan, 1, d.forward(Forward(64, 136, 96, fresh_slot=True, decoder="tail")))


def runtime_tiny40(spec, ckpt):
    """A float64 fp4/fp4 runtime over the golden tiny40 checkpoint."""
    from v41plan.runtime.paged_model import RuntimeModel

    return RuntimeModel(
        spec,
        ckpt.weights,
        ckpt.engram_host(),
        kv_cache_dtype="fp4",
        index_cache_dtype="fp4",
        num_pages=10,
        num_slots=3,
        max_tokens=140,
        max_bs=2,
        table_width=5,
        dtype=DTYPE,
        cfg=ckpt.config,
    )


def test_the_dense_request_without_replay_is_the_reference():
    """One forward from 0, then chunks and a decode, equal ``ReferenceModel.prefill``/``decode``."""
    ref = _ref("tiny", "fp4")
    ids = token_ids(61, 4)
    want = ref.prefill(ids[:60])
    selections, experts = dict(ref.selections), dict(ref.experts)
    want_next = ref.decode(int(ids[60]))
    one = DenseRequest(ref, ids).forward(Forward(0, 60, 0))
    assert torch.equal(one.logits, want) and one.defined.all()
    assert sorted(one.selections) == sorted(selections)
    assert all(torch.equal(one.selections[L], s) for L, s in selections.items())
    assert all(torch.equal(one.experts[L], e) for L, e in experts.items())
    d = DenseRequest(ref, ids, kv_cache_dtype="bf16")
    lo = 0
    for n in (3, 1, 29, 27):
        got = d.forward(Forward(lo, lo + n, lo)).logits
        assert (got - want[lo : lo + n]).abs().max() <= REL_TOL * want.abs().max()
        lo += n
    got = d.forward(Forward(60, 61, 60, decode=True)).logits[0]
    assert (got - want_next).abs().max() <= REL_TOL * want_next.abs().max()


def test_the_dense_request_refuses_reads_its_state_does_not_hold():
    ref = _ref("tiny", "fp4")
    d = DenseRequest(ref, token_ids(80, 4))
    d.forward(Forward(0, 40, 0))
    with pytest.raises(AssertionError, match="ring does not hold"):
        d.forward(Forward(50, 60, 50))  # rows 40..49 were never computed
    d = DenseRequest(ref, token_ids(80, 4))
    with pytest.raises(AssertionError, match="never written"):
        d.forward(Forward(32, 60, 32, fresh_slot=True))  # no prefix cache below 32
