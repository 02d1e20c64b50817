"""Engram host half: prime layout, multipliers, hashing, token maps and table reads."""

from __future__ import annotations

import itertools
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from v41plan.model import engram as eg
from v41plan.model.quant import dequant_fp8_blocks, quantize_fp8_blocks

REAL = SimpleNamespace(
    engram_vocab_size=16_000_000,
    engram_layer_ids=[1, 14],
    engram_max_ngram_size=4,
    engram_n_heads=8,
    engram_compressed_vocab_size=99092,
    engram_pad_token_id=2,
)
TINY = SimpleNamespace(
    engram_vocab_size=61,
    engram_layer_ids=[1, 6],
    engram_max_ngram_size=4,
    engram_n_heads=2,
    engram_compressed_vocab_size=200,
    engram_pad_token_id=2,
)


def test_real_row_counts():
    assert eg.engram_row_counts(REAL) == [384006168, 384016682]


def test_tiny_and_medium_row_counts():
    assert eg.engram_row_counts(TINY) == [434, 606]
    medium = SimpleNamespace(**{**vars(REAL), "engram_vocab_size": 20011})
    assert eg.engram_row_counts(medium) == [482648, 488250]


def test_primes_distinct_prime_and_offsets_exclusive():
    p = eg.engram_primes(REAL)
    assert p.shape == (2, 24) and len(set(p.reshape(-1).tolist())) == 48
    assert all(eg._is_prime(int(v)) and v > REAL.engram_vocab_size - 1 for v in p.reshape(-1))
    off = eg.engram_offsets(REAL)
    assert (off[:, 0] == 0).all() and (off[:, 1:] == np.cumsum(p, 1)[:, :-1]).all()


def test_multipliers_odd_and_cannot_overflow():
    m = eg.engram_multipliers(REAL)
    assert m.shape == (2, 4) and (m % 2 == 1).all() and (m > 0).all()
    assert (
        m.astype(object) * (REAL.engram_compressed_vocab_size - 1) < np.iinfo(np.int64).max
    ).all()
    assert not np.array_equal(m[0], m[1])


def _layout(cfg=TINY):
    tmap = eg.synthetic_token_map(260, cfg.engram_compressed_vocab_size)
    return eg.EngramLayout.from_config(cfg, tmap)


def test_hash_pads_missing_history_and_matches_the_formula():
    lay = _layout()
    c = np.array([5, 9, 13, 7])
    ids = eg.hash_ids(lay, c)
    pad = lay.pad_id
    p = 1  # 2-gram at position 1 is (c0, c1); its 3-gram pads c[-1]
    m = lay.multipliers[0]
    roll2 = (c[1] * m[0]) ^ (c[0] * m[1])
    assert ids[p, 0, 0] == roll2 % lay.primes[0, 0] + lay.offsets[0, 0]
    roll3 = roll2 ^ (pad * m[2])
    assert ids[p, 0, 2] == roll3 % lay.primes[0, 2] + lay.offsets[0, 2]
    assert ((ids >= 0) & (ids < np.array(eg.engram_row_counts(TINY))[None, :, None])).all()


def test_incremental_hashing_equals_whole_sequence_across_dead_positions():
    lay = _layout()
    rng = np.random.default_rng(0)
    c = rng.integers(0, 200, size=97)
    c[[10, 11, 40, 41, 42, 90]] = eg.DEAD  # image spans break n-grams
    whole = eg.hash_ids(lay, c)
    hist = eg.empty_history(lay)
    parts = []
    cuts = [0, 1, 2, 3, 11, 12, 40, 43, 60, 61, 62, 97]
    for a, b in itertools.pairwise(cuts):
        parts.append(eg.hash_ids(lay, c[a:b], hist))
        hist = eg.advance_history(lay, hist, c[a:b])
    assert np.array_equal(np.concatenate(parts), whole)
    assert hist.tolist() == [c[96], c[95], c[94]]


def test_host_prepare_from_final_ids_and_restored_history():
    cfg = SimpleNamespace(**vars(TINY))
    tmap = eg.synthetic_token_map(260, 200)
    host = eg.EngramHost(cfg, tmap)
    ids = np.arange(30, 80)
    rows, hist = host.prepare(ids)
    r1, h1 = host.prepare(ids[:33])
    r2, h2 = host.prepare(ids[33:], h1)
    assert np.array_equal(np.concatenate([r1, r2]), rows) and np.array_equal(h2, hist)
    mask = np.ones(50, dtype=bool)
    mask[5] = False
    rows_m, _ = host.prepare(ids, text_mask=mask)
    assert not np.array_equal(rows_m[5:9], rows[5:9]) and np.array_equal(rows_m[9:], rows[9:])


def test_synthetic_token_map_is_surjective():
    assert eg.synthetic_multiplier(200) == 7 and eg.synthetic_multiplier(99092) == 9
    assert len(set(eg.synthetic_token_map(260, 200).tolist())) == 200
    assert len(set(eg.synthetic_token_map(129280, 99092).tolist())) == 99092
    with pytest.raises(ValueError, match="cannot cover"):
        eg.synthetic_token_map(100, 200)


def test_normalization_chain():
    assert eg.normalize_token_text("  Héllo\t\nWORLD ") == "hello world"
    assert eg.normalize_token_text(" ") == " "
    assert eg.normalize_token_text("\t\t") == " "
    assert eg.normalize_token_text("ＡＢ") == "ab"
    assert eg.normalize_token_text("ﬁ") == "fi"


def test_token_map_from_a_tokenizers_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"Hello": 0, "hello": 1, "HÉLLO": 2, "world": 3, "[UNK]": 4, "▁": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tmap = eg.token_map_from_tokenizer(tok)
    assert tmap[0] == tmap[1] == tmap[2] == 0 and tmap[3] == 1
    assert len(set(tmap.tolist())) == 4


def test_table_reads_through_the_memory_mapped_file(tmp_path):
    from safetensors.torch import save_file

    rows = torch.randn(434, 32)
    codes, scales = quantize_fp8_blocks(rows)
    path = tmp_path / "t.safetensors"
    save_file(
        {"layers.1.engram.embed.weight": codes, "layers.1.engram.embed.scale": scales}, str(path)
    )
    table = eg.EngramTable.open(path, "layers.1.engram")
    mem = eg.EngramTable.from_tensors(codes, scales)
    ids = np.array([[433, 0, 5], [6, 7, 5]])
    c1, s1 = table.read(ids)
    c2, s2 = mem.read(ids)
    assert c1.shape == (2, 3, 32) and s1.shape == (2, 3, 1)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(
        s1.view(torch.uint8), s2.view(torch.uint8)
    )
    want = dequant_fp8_blocks(
        codes[torch.from_numpy(ids)], scales[torch.from_numpy(ids)], torch.float32
    )
    assert torch.equal(dequant_fp8_blocks(c1, s1, torch.float32), want)
    with pytest.raises(IndexError):
        table.read(np.array([434]))
    # an empty request (no Engram rows in a step) keeps its shape
    c0, s0 = table.read(np.zeros((0, 24), dtype=np.int64))
    assert c0.shape == (0, 24, 32) and s0.shape == (0, 24, 1)


def test_host_half_imports_without_triton_or_cuda():
    code = (
        "import sys, v41plan.model.engram; "
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("seed", range(4))
def test_batched_hashing_equals_per_request_hashing(seed):
    """``prepare_batch`` over a ragged batch (empty, one-row and long requests, DEAD history
    entries) equals ``prepare`` request by request: row ids and advanced histories."""
    rng = np.random.default_rng(seed)
    tmap = eg.synthetic_token_map(260, TINY.engram_compressed_vocab_size)
    host = eg.EngramHost(TINY, tmap)
    lens = rng.choice([0, 1, 2, 3, 17], size=6)
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = rng.integers(0, 260, int(cu[-1]))
    hist = rng.integers(0, TINY.engram_compressed_vocab_size, (6, 3))
    hist[rng.random((6, 3)) < 0.3] = eg.DEAD
    rows, new_hist = host.prepare_batch(ids, cu, hist)
    for i in range(6):
        want_rows, want_hist = host.prepare(ids[cu[i] : cu[i + 1]], hist[i])
        assert np.array_equal(rows[cu[i] : cu[i + 1]], want_rows)
        assert np.array_equal(new_hist[i], want_hist)


@pytest.mark.parametrize(
    "lens", [[1] * 7, [1, 1, 0, 2, 1, 1, 1], [2, 0, 1, 1, 1, 1, 1], [3, 1, 1, 1]]
)
def test_advance_batch_equals_per_request_advance(lens):
    """``advance_batch`` (the device lookup's host half; one-row batches take a shortcut)
    equals ``advance_history`` request by request, also where lengths only sum to the count."""
    rng = np.random.default_rng(len(lens))
    tmap = eg.synthetic_token_map(260, TINY.engram_compressed_vocab_size)
    host = eg.EngramHost(TINY, tmap)
    n = len(lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = rng.integers(0, 260, int(cu[-1]))
    hist = rng.integers(0, TINY.engram_compressed_vocab_size, (n, 3))
    hist[rng.random((n, 3)) < 0.3] = eg.DEAD
    got = host.advance_batch(ids, cu, hist)
    for i in range(n):
        want = eg.advance_history(host.layout, hist[i], host.token_map[ids[cu[i] : cu[i + 1]]])
        assert np.array_equal(got[i], want), (i, got[i], want)
