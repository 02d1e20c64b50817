"""Training: the batched training forward is the reference model, the export is what it
trained, the losses reach what they should, and the corpus holds no held-out document."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import zlib
from functools import cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.runtime.paged_helpers import SPECS
from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.checkpoint import LoadedCheckpoint, engram_token_map, load_checkpoint
from v41plan.model.config import config_from_cache_spec
from v41plan.model.engram import EngramHost
from v41plan.model.quant import fake_fp4, fake_fp8
from v41plan.model.reference import ReferenceModel
from v41plan.model.train import (
    Batch,
    CompiledOrEager,
    TrainModel,
    _cast_value,
    _fp4_value,
    _fp8_value,
    _hc_predict_flat,
    engram_rows,
)
from v41plan.validation.quality_tasks import GENERATORS, documents
from v41plan.validation.training import (
    ANSWER_KINDS,
    LOGGED_KINDS,
    SHORT_COPY_FILLER_CHARS,
    Corpus,
    TrainOptions,
    lr_at,
    recall_lead_mask,
    train,
    write_loss_png,
)

B, S = 2, 40  # S past tiny's 8-row window, even (ratio-2 pairs)


def _cfg(**changes):
    cfg = config_from_cache_spec(load_cache_spec_unchecked(str(SPECS / "tiny.yaml")))
    return dataclasses.replace(cfg, **changes) if changes else cfg


@cache
def _setup(every_row: bool = False):
    # every_row: a top-k and a candidate set that hold every compressed row
    cfg = _cfg(index_topk=S, candidate_topk_blocks=S) if every_row else _cfg()
    tm = TrainModel(cfg, seed=3, dtype=torch.float64)
    ids = np.random.default_rng(1).integers(0, 256, (B, S))
    rows = engram_rows(EngramHost(cfg, engram_token_map(cfg)), ids)
    batch = Batch(torch.as_tensor(ids), torch.as_tensor(ids), torch.as_tensor(rows))
    return cfg, tm, ids, batch


def test_training_forward_is_the_reference_prefill_of_the_export_in_float64():
    """Logits of every sequence of a batch equal ``ReferenceModel.prefill`` over the exported
    checkpoint (quantizers on: the straight-through forward rounds as inference does)."""
    cfg, tm, ids, batch = _setup()
    logits, aux = tm.forward(batch)
    assert logits.requires_grad and aux["expert_load"].shape == (cfg.num_hidden_layers, 8)
    ckpt = LoadedCheckpoint.from_state(cfg, tm.export_state())
    ref = ReferenceModel(cfg, ckpt.process(torch.float64), ckpt.engram_host(), torch.float64)
    for b in range(B):
        want = ref.prefill(ids[b])
        got = logits[b * S : (b + 1) * S]
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def test_dense_warm_up_attention_equals_the_sparse_one_when_the_top_k_holds_every_row():
    """With a top-k (and candidate set) as large as the compressed rows, the top-k selects
    every visible row:
    the dense warm-up's attention (no per-query gather) then gives the same logits."""
    _, tm, _ids, batch = _setup(every_row=True)
    with torch.no_grad():
        sparse, _ = tm.forward(batch, dense=False)
        dense, _ = tm.forward(batch, dense=True)
    assert torch.allclose(sparse, dense, rtol=0, atol=1e-12), (sparse - dense).abs().max()


def test_the_language_loss_never_reaches_the_indexer_and_its_kl_reaches_only_the_indexer():
    """The top-k has no gradient: the indexer learns from its KL loss alone, and that loss
    moves nothing but ``indexer.*`` (its inputs are detached)."""
    _, tm, _ids, batch = _setup()

    def grads(loss_of):
        for p in tm.parameters():
            p.grad = None
        logits, aux = tm.forward(batch)
        loss_of(logits, aux).backward()
        return {k: v.grad for k, v in tm.masters.items() if k not in tm.biases}

    ce = grads(lambda lg, aux: F.cross_entropy(lg, batch.targets.reshape(-1)))
    kl = grads(lambda lg, aux: aux["index_kl"])
    index = [k for k in ce if ".indexer." in k]
    assert index and all(ce[k] is None or not ce[k].any() for k in index)
    assert all(kl[k] is not None and kl[k].any() for k in index if ".indexer.wq_b" in k)
    moved = [k for k, g in kl.items() if g is not None and g.any()]
    assert moved and all(".indexer." in k for k in moved), moved


def test_straight_through_quantizers_keep_the_forward_and_pass_the_gradient():
    """Under autograd a fake quantizer returns exactly its inference value and its gradient
    is the identity."""
    x = torch.randn(4, 64, dtype=torch.float64)
    for q in (fake_fp8, fake_fp4):
        xg = x.clone().requires_grad_()
        y = q(xg)
        assert torch.equal(y.detach(), q(x))
        y.sum().backward()
        assert torch.equal(xg.grad, torch.ones_like(x))


def test_router_bias_update_raises_underloaded_experts_and_lowers_overloaded_ones():
    cfg, _tm, _ids, _batch = _setup()
    tm = TrainModel(cfg, seed=3, dtype=torch.float64)
    load = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.float64)
    load[:, 0] = 1.0  # expert 0 takes every pick
    before = tm.masters["layers.0.ffn.gate.bias"].clone()
    tm.update_router_bias(load, 0.01)
    step = tm.masters["layers.0.ffn.gate.bias"] - before
    assert step[0] == pytest.approx(-0.01) and torch.allclose(step[1:], torch.tensor(0.01).double())


def test_corpus_is_seeded_and_opens_each_sequence_with_a_document_at_position_0():
    """Each sequence opens with a recall or copy document or (about a quarter) a sum, as the
    tasks present theirs; about a third of the copies keep the code inside the window."""
    cfg = _cfg()
    x, marks = Corpus(cfg, 5, 640).batch(3)
    assert x.shape == marks.shape == (3, 641) and np.array_equal(x, Corpus(cfg, 5, 640).batch(3)[0])
    assert not np.array_equal(x, Corpus(cfg, 6, 640).batch(3)[0])
    x = Corpus(cfg, 5, 640).batch(200)[0]
    heads = [bytes(t for t in row[:40] if t < 256).decode() for row in x]
    sums = [h for h in heads if re.match(r"\d+\+\d+=\d+", h)]
    assert all(h.startswith("code: ") or h.split("=")[0].isalpha() for h in heads if h not in sums)
    assert 30 <= len(sums) <= 70, len(sums)
    text = b"\n".join(bytes(t if t < 256 else 10 for t in row) for row in x).decode()
    gaps = [len(m.group(1)) for m in re.finditer(r"code: [A-Z]{8}\n(.*)\nrepeat", text)]
    short = sum(g <= SHORT_COPY_FILLER_CHARS for g in gaps)
    # 30% of the copies drawn; short ones fit a sequence's remainder more often
    assert 0.25 < short / len(gaps) < 0.5, (short, len(gaps))


def test_corpus_skips_a_generated_document_equal_to_a_held_out_one(monkeypatch):
    cfg = _cfg()
    c = Corpus(cfg, 5, 640)
    draws = iter([documents("arith_gen", 1)[0], {"prompt": "1+1=", "answer": "2"}])
    monkeypatch.setitem(GENERATORS, "arith_gen", lambda rng, **size: next(draws))
    assert c._doc("arith_gen", "sum") == ([*b"1+1=2", cfg.eos_token_id], [0] * 4 + [1, 0])
    assert c.skipped == 1


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    o = TrainOptions(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(0, o) == pytest.approx(0.1) and lr_at(9, o) == pytest.approx(1.0)
    assert lr_at(99, o) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(i, o) >= lr_at(i + 1, o) for i in range(10, 99))


def test_train_writes_a_checkpoint_the_loader_reads_and_a_log_whose_loss_falls(tmp_path):
    """Eight CPU steps on tiny: the published-layout checkpoint loads (config and every tensor
    checked), equals the trained weights, and the loss goes down."""
    cfg = _cfg()
    opts = TrainOptions(
        steps=8, batch_seqs=2, seq_tokens=64, warmup_steps=2, dense_steps=4, log_every=4
    )
    lines = []
    log = train(cfg, "tiny", tmp_path, opts, "cpu", progress=lines.append)
    assert len(lines) == 4 and "step 8/8" in lines[2]
    saved = json.loads((tmp_path / "train_log.json").read_text())
    assert saved["steps_done"] == 8 and len(saved["loss"]) == 8 == len(saved["step_end_s"])
    assert saved["peak_memory_gib"] is None  # measured on CUDA only
    assert np.mean(log["loss"][-2:]) < np.mean(log["loss"][:2])
    # the answer accuracies count the corpus's own marks, kind by kind (it is seeded)
    corpus = Corpus(cfg, opts.seed, 64)
    marks = [corpus.batch(2)[1][:, 1:] for _ in range(8)]
    want = [
        [int((m == k + 1).sum()) for k in range(len(ANSWER_KINDS))]
        + [int(recall_lead_mask(torch.from_numpy(m).long()).sum())]
        for m in marks
    ]
    assert saved["answer_kinds"] == [*ANSWER_KINDS, "recall_lead"] == list(LOGGED_KINDS)
    assert saved["answer_tokens"] == want
    hits = np.asarray(saved["answer_hits"])
    assert hits.shape == (8, len(LOGGED_KINDS)) and (hits >= 0).all() and (hits <= want).all()
    assert "sum " in lines[1]  # the progress line's accuracy of the sums
    ckpt = load_checkpoint(tmp_path, load_cache_spec_unchecked(str(SPECS / "tiny.yaml")))
    assert ckpt.config == cfg
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_loss_png_is_a_valid_image(tmp_path):
    p = tmp_path / "l.png"
    write_loss_png(p, [5.0, 4.0, 3.0, 2.5], [0.3, 0.2, 0.2, 0.1], w=40, h=20)
    data = p.read_bytes()
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (40, 20)
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    assert len(raw) == h * (1 + w * 3) and b"\x00\x00\x00" in raw  # a black loss pixel


def test_training_goes_on_from_a_checkpoint_with_its_weights(tmp_path):
    """``init_checkpoint``: the masters start from the checkpoint's published tensors, so the
    export before any step is the checkpoint itself."""
    from v41plan.model.checkpoint import read_state, write_state

    cfg = _cfg()
    first = TrainModel(cfg, seed=7)
    write_state(tmp_path, cfg, first.export_state())
    again = TrainModel(cfg, seed=0, init_state=read_state(tmp_path))
    a, b = first.export_state(), again.export_state()
    assert a.keys() == b.keys()
    assert all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
        if a[k].dtype.itemsize == 1
    )
    assert all(torch.equal(a[k], b[k]) for k in a if a[k].dtype.itemsize > 1)


def test_answer_marks_cover_exactly_each_documents_answer():
    """The loss weights' marks: the value after ``answer:``, the repeated code and the sum."""
    cfg = _cfg()
    c = Corpus(cfg, 9, 640)
    ids, marks = c.sequence_marked()
    text = bytes(t if t < 256 else 10 for t in ids)
    answers = [text[i : i + 1] for i in range(len(ids)) if marks[i]]
    docs = text.split(b"\n")
    assert sum(1 for m in marks if m) >= 8 and b"".join(answers).strip()
    for i, m in enumerate(marks):  # sums are digits, codes letters, recalled values digits
        if m:
            kind = ANSWER_KINDS[m - 1]
            assert chr(ids[i]).isalpha() == kind.startswith("copy"), (kind, chr(ids[i]))
    for line in docs:  # every complete arithmetic line's sum is marked
        if b"+" in line and b"=" in line and line.split(b"=")[1]:
            start = text.index(line) + line.index(b"=") + 1
            if start + len(line.split(b"=")[1]) < len(ids):
                assert all(marks[start : start + len(line.split(b"=")[1])])
                assert not marks[start - 1]


def test_stacked_fp8_rounding_equals_one_weight_at_a_time():
    """``processed`` rounds the masters of one shape stacked: bit for bit what each weight's
    own rounding (the checkpoint's FP8 export) gives, padded blocks included."""
    g = torch.Generator().manual_seed(3)
    for shape, dtype in (((3, 64, 96), torch.float32), ((2, 40, 72), torch.float64)):
        w = torch.randn(*shape, generator=g, dtype=dtype) * torch.logspace(-3, 1, shape[-1])
        got = _fp8_value(w)
        assert got.dtype == dtype
        for i in range(shape[0]):
            assert torch.equal(got[i], _fp8_value(w[i]))


def test_processed_weights_equal_each_masters_own_rounding_and_pass_gradients():
    cfg = _cfg()
    tm = TrainModel(cfg, seed=2)
    w = tm.processed()
    assert max(len(v) for v in tm.groups.values()) > 1
    for name, (kind, dtype) in tm.kinds.items():
        if kind == "table":
            continue
        m = tm.masters[name].detach()
        want = {"fp8": _fp8_value, "fp4": _fp4_value}.get(kind) or _cast_value(dtype)
        assert torch.equal(w[name].detach(), want(m)), name
    name = "layers.3.attn.wq_a.weight"
    w[name].sum().backward()  # straight-through: the identity's gradient reaches the master
    assert torch.equal(tm.masters[name].grad, torch.ones_like(tm.masters[name]))


def test_compiled_hc_prediction_matches_the_eager_one_forward_and_backward():
    """The mHC prediction ``v41plan train`` compiles on CUDA, traced here as there (one
    graph, forward and backward) and run through ``aot_eager`` (Inductor's CPU code
    generation is slow and is not what the GPU runs; ``tests/gpu/test_compiled_gpu.py``
    runs Inductor): outputs and gradients within float32 rounding of the eager arithmetic."""
    g = torch.Generator().manual_seed(0)
    N, hc, D = 16, 4, 32
    inputs = [
        torch.randn(N, hc, D, generator=g),
        torch.randn(hc * (2 + hc), hc * D, generator=g) * 0.05,
        torch.randn(hc * (2 + hc), generator=g),
        torch.randn(3, generator=g),
    ]
    weights = [torch.randn(N, hc, generator=g), torch.randn(N, hc, generator=g)]
    weights.append(torch.randn(N, hc, hc, generator=g))
    runs = []
    for fn in (_hc_predict_flat, CompiledOrEager(_hc_predict_flat, backend="aot_eager")):
        xs = [t.clone().requires_grad_() for t in inputs]
        outs = fn(*xs, hc, 20, 1e-6, 1e-20)
        sum((o * v).sum() for o, v in zip(outs, weights, strict=True)).backward()
        runs.append([o.detach() for o in outs] + [x.grad for x in xs])
        if isinstance(fn, CompiledOrEager):
            assert fn.error is None
    for a, b in zip(*runs, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * a.abs().max().item())


def test_a_failing_compile_falls_back_to_eager_once(capsys):
    def plain(x):
        return x + 1

    c = CompiledOrEager(plain)
    c.compiled = lambda *a: (_ for _ in ()).throw(RuntimeError("no backend\nmore"))
    assert torch.equal(c(torch.zeros(2)), torch.ones(2)) and c(torch.ones(1)).item() == 2
    assert c.error == "RuntimeError: no backend"
    assert capsys.readouterr().out.count("failed") == 1


def test_corpus_caps_copy_filler_and_recall_lists_for_a_first_stage():
    """``max_filler_chars`` / ``max_recall_pairs``: the longest copy filler and recall list a
    short-distance first stage draws; out-of-range caps are refused."""
    cfg = _cfg()
    x = Corpus(cfg, 5, 640, copy_share=0.5, max_filler_chars=40, max_recall_pairs=8).batch(40)[0]
    text = b"\n".join(bytes(t if t < 256 else 10 for t in row) for row in x).decode()
    gaps = [len(m.group(1)) for m in re.finditer(r"code: [A-Z]{8}\n(.*)\nrepeat", text)]
    lists = [m.group(0).count("=") for m in re.finditer(r"(?:[A-Za-z]=\d+; ?)+\nquestion", text)]
    assert gaps and max(gaps) <= 40 and max(gaps) > SHORT_COPY_FILLER_CHARS
    assert lists and max(lists) <= 8
    with pytest.raises(ValueError, match="max_filler_chars"):
        Corpus(cfg, 5, 640, max_filler_chars=SHORT_COPY_FILLER_CHARS)


def test_corpus_multi_query_lists_and_long_fill():
    """``recall_questions``: each list asks the task's question, then others on keys of the
    same list, each answered with that key's value and marked ``recall_more``;
    ``fill_long``: long documents run to the sequence's end (no sums after the first
    position), where by default sums fill it."""
    cfg = _cfg()
    more = ANSWER_KINDS.index("recall_more") + 1
    for fill_long in (False, True):
        c = Corpus(cfg, 5, 640, copy_share=0.0, max_recall_pairs=12, recall_questions=4,
                   fill_long=fill_long)  # fmt: skip
        x, marks = c.batch(8)
        sums = 0
        for row, mk in zip(x, marks, strict=True):
            text = bytes(t if t < 256 else 10 for t in row).decode()
            for block in re.finditer(r"((?:[A-Za-z]=\d{4}; ?)+)((?:\nquestion: [^\n]*)+)", text):
                values = dict(p.split("=") for p in block.group(1).replace(" ", "").split(";") if p)
                for k, v in re.findall(r"what is ([A-Za-z])\? answer: ?(\d{4})\b", block.group(2)):
                    assert values[k] == v
            n_more = int((mk == more).sum())
            assert n_more % 4 == 0 or fill_long  # whole values (fill_long cuts the last)
            sums += len(re.findall(r"\d+\+\d+=", text[30:]))
        assert (marks == more).any()
        assert (sums == 0) == fill_long, (fill_long, sums)


def test_corpus_draws_codes_of_a_range_as_far_back_as_eight_letter_ones():
    """``code_letters``: copies past the window draw their code's length from the range, and
    a shorter code gets a longer filler, so every letter still sits at least 31 rows behind
    the row that copies it; in-window copies keep 8 letters."""
    cfg = _cfg()
    c = Corpus(cfg, 5, 640, copy_share=1, short_copy_share=0.3, code_letters=(3, 12))
    text = b"\n".join(bytes(t if t < 256 else 10 for t in row) for row in c.batch(40)[0]).decode()
    found = re.findall(r"code: ([A-Z]+)\n(.*)\nrepeat the code: ([A-Z]+)", text)
    lengths = {len(code) for code, _, _ in found}
    assert lengths <= set(range(3, 13)) and len(lengths) >= 6
    for code, filler, repeat in found:
        assert repeat == code  # the answer is the whole code
        rows_back = len(code) + len(filler) + len("\nrepeat the code: ")  # letter j to row j
        assert rows_back >= 31 or (len(code) == 8 and len(filler) <= SHORT_COPY_FILLER_CHARS)
    with pytest.raises(ValueError, match="code_letters"):
        Corpus(cfg, 5, 640, code_letters=(5, 4))


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--copy-share", "1.5", "between 0 and 1"),
        ("--max-filler-chars", "3", "at least 5"),
        ("--max-recall-pairs", "2", "must be 6 to 52"),
        ("--max-recall-pairs", "53", "must be 6 to 52"),
        ("--recall-questions", "0", "at least 1"),
        ("--min-code-letters", "9", "1 <= min <= max"),
        ("--max-code-letters", "0", "1 <= min <= max"),
    ],
)
def test_train_refuses_a_corpus_option_out_of_range(tmp_path, capsys, flag, value, says):
    from v41plan.cli.main import main

    code = main(["train", "--spec", "quality40", "--out", str(tmp_path / "o"), flag, value])
    assert code != 0 and says in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_recall_lead_marks_the_first_digit_of_every_recall_answer():
    # multi-query lists to each sequence's end: every recall answer (the task's " dddd" and
    # the further questions' "dddd") has exactly one lead, its first digit; no other has one
    cfg = _cfg()
    corpus = Corpus(cfg, 7, 640, 0.0, 0.3, recall_questions=8, fill_long=True)
    ids, marks = corpus.batch(3)
    tgt, ans = torch.from_numpy(ids[:, 1:]), torch.from_numpy(marks[:, 1:]).long()
    lead = recall_lead_mask(ans)
    want = 0
    for k in ("recall", "recall_more"):
        m = ans == ANSWER_KINDS.index(k) + 1
        starts = m & ~torch.cat((torch.zeros_like(m[:, :1]), m[:, :-1]), 1)
        if k == "recall":
            assert (tgt[starts] == ord(" ")).all()  # the task's answer: " dddd"
            # its lead follows the space (unless the sequence ends on the space)
            starts = starts & torch.cat((m[:, 1:], torch.zeros_like(m[:, :1])), 1)
        want += int(starts.sum())
    assert want > 20 and int(lead.sum()) == want
    assert all(chr(int(t)).isdigit() for t in tgt[lead])
    rec = (ans == ANSWER_KINDS.index("recall") + 1) | (ans == ANSWER_KINDS.index("recall_more") + 1)
    assert (lead <= rec).all()
    # one lead a run: never two digits of one answer
    assert not (lead & torch.cat((torch.zeros_like(lead[:, :1]), lead[:, :-1]), 1)).any()
    assert not recall_lead_mask(torch.tensor([[0, 1, 1, 2, 2, 3, 3, 0]])).any()
    assert recall_lead_mask(torch.tensor([[0, 4, 4, 4, 0, 5, 5, 0]])).tolist() == [
        [False, False, True, False, False, True, False, False]
    ]
