"""The Engram lookup on the device against the host half (the reference): row ids, gathered
table rows, and whole paged forwards with either path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.paged_helpers import model, runtime, step, token_ids
from v41plan.model.engram import DEAD, hash_ids_batch
from v41plan.runtime.engram_device import DeviceEngram


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_row_ids_and_rows_equal_the_host_half(seed):
    _spec, _cfg, _w, eng = model("tiny40")
    dev = DeviceEngram(eng, "cpu")
    rng = np.random.default_rng(seed)
    lens = np.array([1, 5, 2, 9, 1])  # single decode rows and chunks
    n, h = len(lens), eng.layout.history_len
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = rng.integers(0, eng.token_map.shape[0], int(cu[-1]))
    hist = eng.token_map[rng.integers(0, eng.token_map.shape[0], (n, h))]
    hist[1] = DEAD  # a fresh request
    hist[3, 1:] = DEAD  # a request one token in
    want, want_hist = hash_ids_batch(eng.layout, eng.token_map[ids], cu, hist)
    pad = 3  # padding rows (batch id -1) get row 0
    t = int(cu[-1]) + pad
    batch = torch.full((t,), -1, dtype=torch.long)
    batch[: cu[-1]] = torch.from_numpy(np.repeat(np.arange(n), lens))
    tok = torch.zeros(t, dtype=torch.long)
    tok[: cu[-1]] = torch.from_numpy(ids)
    got = dev.row_ids(tok, batch, torch.from_numpy(cu[:n]), torch.from_numpy(hist))
    assert torch.equal(got[: cu[-1]], torch.from_numpy(want))
    assert torch.equal(got[cu[-1] :], torch.zeros_like(got[cu[-1] :]))
    assert np.array_equal(eng.advance_batch(ids, cu, hist), want_hist)
    for li in range(len(eng.tables)):
        codes, scales = dev.gather(li, got[: cu[-1], li])
        hc, hs = eng.gather(li, want[:, li])
        assert torch.equal(codes, hc.view(torch.uint8))
        assert torch.equal(scales, hs.view(torch.uint8))


@pytest.mark.parametrize("pair", [("bf16", "fp8"), ("fp4", "fp4")])
def test_paged_forwards_are_the_same_with_the_lookup_on_either_side(pair):
    """Chunked prefill beside decode, with padding: logits, selections, cursors and pool bytes
    equal bit for bit whether the host stages the table rows or run() hashes and gathers."""
    spec = model("tiny40")[0]
    on, off = runtime("tiny40", *pair), runtime("tiny40", *pair, engram_on_device=False)
    assert on.engram_device is not None and off.engram_device is None
    ids = [token_ids(70, 3), token_ids(70, 4)]
    tables = ((9, 7, 5), (8, 6, 4))
    schedule = [
        [(0, tables[0], 40, 0, 40, "prefill"), (1, tables[1], 60, 0, 33, "prefill")],
        [(0, tables[0], 40, 40, 1, "decode"), (1, tables[1], 60, 33, 27, "prefill")],
        [(0, tables[0], 40, 41, 1, "decode"), (1, tables[1], 60, 60, 1, "decode")],
    ]
    for m in (on, off):
        for slot in (0, 1):
            m.pools.reset_slot(slot)
    for k, reqs in enumerate(schedule):
        plan = step(spec, reqs, pad_tokens=2, pad_bs=1)
        flat = np.concatenate([ids[r[0]][r[3] : r[3] + r[4]] for r in reqs])
        a = on.forward(plan, flat, all_row_logits=True)
        b = off.forward(plan, flat, all_row_logits=True)
        assert torch.equal(a.row_logits.isnan(), b.row_logits.isnan()), k
        ok = ~a.row_logits.isnan()
        assert torch.equal(a.row_logits[ok], b.row_logits[ok]), k
        for layer, sel in off.selections.items():
            assert torch.equal(on.selections[layer], sel), (k, layer)
        assert torch.equal(on.pools.backing, off.pools.backing), k
        assert (on.pools.cursor_host == off.pools.cursor_host).all(), k
