"""Replay arithmetic: replay_start and the scheduler's chunk choice, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from tests.planner.helpers import spec
from v41plan.planner.replay import (
    choose_prefill_chunk,
    grid_back_off,
    replay_arrays,
    replay_start,
    replay_start_for_spec,
)

B, W = 128, 128  # V4.1-Flash hash block and min_final_prefill_rows
KW = {"hash_block": B, "min_final_rows": W}


def test_grid_back_off():
    assert grid_back_off(0, B) == 0
    assert grid_back_off(100, B) == 0
    assert grid_back_off(128, B) == 0
    assert grid_back_off(256, B) == 128
    assert grid_back_off(300, B) == 128  # off the grid: whole block below, on the grid
    assert list(grid_back_off(np.array([640, 700, 767, 768]), B)) == [512, 512, 512, 640]


def test_long_final_forward_does_not_back_off():
    p = replay_start(512, 1000, **KW)
    assert (p.forward_start, p.write_from, p.cached_until, p.backed_off) == (512, 512, 512, False)


def test_short_final_chunk_backs_off_in_the_same_slot():
    p = replay_start(960, 1000, **KW)  # 40 rows before the end < 128
    assert p.forward_start == 768  # (960 // 128 - 1) * 128
    assert (p.write_from, p.cached_until, p.swa_cached_until) == (960, 960, 960)
    assert p.backed_off and not p.rebuild and p.encoder_window_floor == 0


def test_resume_far_from_the_end_does_not_back_off():
    p = replay_start(960, 2000, **KW)
    assert p.forward_start == 960 and not p.backed_off


def test_prompt_shorter_than_the_window():
    p = replay_start(0, 50, **KW)
    assert p.forward_start == 0 and not p.backed_off


def test_prefix_hit_with_short_suffix_copy_transfer():
    # Encoder replay off: the image restored the slot; the final forward still backs off.
    p = replay_start(1024, 1030, encoder_replay=False, **KW)
    assert (p.forward_start, p.write_from, p.cached_until) == (896, 1024, 1024)
    assert not p.rebuild


@pytest.mark.parametrize("hit", [128, 256, 1024, 4096])
def test_encoder_replay_rebuild_starts_a_block_below_the_hit(hit):
    p = replay_start(hit, hit + 1000, fresh_slot=True, **KW)
    assert p.forward_start == hit - B
    assert p.write_from == hit  # groups ending below the hit are not rewritten
    assert p.cached_until == p.swa_cached_until == hit - B  # rings rebuilt from the start
    assert p.encoder_window_floor == hit - B and p.rebuild


def test_rebuild_with_a_short_suffix_backs_off_once():
    p = replay_start(1024, 1030, fresh_slot=True, **KW)
    assert p.forward_start == 896 and p.rebuild


def test_decoder_replay_off_needs_no_back_off():
    p = replay_start(960, 1000, decoder_replay=False, **KW)
    assert p.forward_start == 960


def test_decode_never_backs_off():
    p = replay_start(1000, 50, is_decode=True, **KW)
    assert p.forward_start == 1000


def test_fresh_slot_at_zero_is_no_rebuild():
    p = replay_start(0, 300, fresh_slot=True, **KW)
    assert p.forward_start == 0 and not p.rebuild


def test_vectorized_matches_scalar():
    rng = np.random.default_rng(0)
    n = 400
    prompt = rng.integers(1, 3000, n)
    resume = rng.integers(0, prompt)
    fresh = rng.random(n) < 0.3
    a = replay_arrays(resume, prompt, np.zeros(n, bool), fresh, encoder_replay=True,
                      decoder_replay=True, **KW)  # fmt: skip
    for i in range(n):
        p = replay_start(int(resume[i]), int(prompt[i]), fresh_slot=bool(fresh[i]), **KW)
        assert p.forward_start == a["forward_start"][i]
        assert p.cached_until == a["cached_until"][i]
        # The forward reaching the end holds W rows whenever it can (B >= W - 1).
        assert prompt[i] - p.forward_start >= min(W, prompt[i])
        assert p.forward_start % B == 0 or p.forward_start == resume[i]


def test_replay_start_for_spec_uses_spec_rules():
    s = spec("tiny")  # hash block 32, min_final 8
    p = replay_start_for_spec(s, 40, 45)
    assert p.forward_start == 0 and p.write_from == 40
    p = replay_start_for_spec(s, 96, 100)
    assert p.forward_start == 64


class TestChooseChunk:
    def test_whole_prompt_fits(self):
        c = choose_prefill_chunk(0, 300, 1000, **KW)
        assert (c.forward_start, c.chunk_len, c.rows, c.is_final_chunk) == (0, 300, 300, True)

    def test_cap_counts_from_the_resume_point(self):
        c = choose_prefill_chunk(900, 1000, 1000, long_prefill_cap=100, **KW)
        # final chunk of 100 new tokens backs off to 768: 232 rows, the cap still allows it
        assert (c.forward_start, c.chunk_len, c.rows, c.is_final_chunk) == (768, 100, 232, True)

    def test_cap_cuts_a_non_final_chunk(self):
        c = choose_prefill_chunk(0, 1000, 1000, long_prefill_cap=256, **KW)
        assert (c.forward_start, c.chunk_len, c.is_final_chunk) == (0, 256, False)

    def test_budget_that_cannot_carry_past_the_resume_point_waits(self):
        # final chunk of 40 rows from 960 backs off to 768: 232 rows; a 192-row budget would
        # only recompute cached rows (960 - 768 = 192), so the request waits.
        assert choose_prefill_chunk(960, 1000, 192, **KW) is None

    def test_budget_short_of_the_end_still_starts_at_the_back_off(self):
        # 200 rows from 768 reach 968: 8 new tokens, not final; the next pass backs off again.
        c = choose_prefill_chunk(960, 1000, 200, **KW)
        assert (c.forward_start, c.chunk_len, c.rows, c.is_final_chunk) == (768, 8, 200, False)

    def test_rebuild_counts_recomputed_rows(self):
        c = choose_prefill_chunk(1024, 5000, 300, fresh_slot=True, **KW)
        assert (c.forward_start, c.chunk_len, c.rows, c.is_final_chunk) == (896, 172, 300, False)
        assert choose_prefill_chunk(1024, 5000, 128, fresh_slot=True, **KW) is None

    def test_zero_budget_waits(self):
        assert choose_prefill_chunk(0, 10, 0, **KW) is None

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="outside the prompt"):
            choose_prefill_chunk(10, 10, 100, **KW)
        with pytest.raises(ValueError):
            choose_prefill_chunk(0, 10, -1, **KW)
