"""Replay scheduling arithmetic (pure; shared by the planner and the scheduler).

Two rules move a prefill forward's first row below where the scheduler resumed (``resume``):

- Encoder SWA bounded replay: a hit at a hash-block boundary ``H > 0`` resumed in a fresh slot
  starts a whole hash block below it, ``max(0, H - B)``, and rebuilds the rings from there.
- Decoder SWA bounded replay: the forward that finishes a prompt must hold
  ``min_final_prefill_rows`` rows; a prefill forward resuming closer than that to the prompt's
  end starts a whole hash block earlier, in the same slot. The decision is taken on the resume
  point, so a chunk the budget cuts short of the end still starts there (and the next pass
  backs off again; see ``choose_prefill_chunk``, which makes such a request wait instead when
  the budget cannot carry it past the resume point).

Both back-offs land on the hash-block grid: ``max(0, (resume // B - 1) * B)``. Recomputed rows
never rewrite what the cache holds: compressed groups ending below ``resume`` are not written
(``write_from``), ring writes skip rows below ``cached_until`` and rows from ``resume`` on read
the slot's ring rows below it (``swa_cached_until``). One back-off block suffices whenever
``B >= min_final_prefill_rows - 1`` (the runtime refuses smaller PAGEs).

Every function takes scalars or numpy arrays (elementwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def grid_back_off(resume, hash_block: int):
    """A whole hash block below ``resume``, on the grid: ``max(0, (resume // B - 1) * B)``."""
    r = np.asarray(resume, dtype=np.int64)
    out = np.maximum(0, (r // hash_block - 1) * hash_block)
    return out if out.ndim else int(out)


@dataclass(frozen=True)
class ReplayPoint:
    """Where one forward starts and what it must leave untouched (all positions)."""

    forward_start: int
    """First position the forward computes; the slot's cursor steps back to it."""
    write_from: int
    """Compressed groups ending below it are not written (the resume point)."""
    cached_until: int
    """Ring writes skip rows below it (``forward_start`` in a rebuilt fresh slot)."""
    swa_cached_until: int
    """Rows at or past it read the slot's ring rows below it."""
    encoder_window_floor: int
    """Encoder windows start here (the forward start on a rebuild, else 0)."""
    rebuild: bool
    """True for an encoder-replay rebuild (fresh slot, ``resume > 0``)."""
    backed_off: bool
    """True when the forward starts below ``resume``."""


def replay_arrays(
    resume,
    prompt_len,
    is_decode,
    fresh_slot,
    *,
    hash_block: int,
    min_final_rows: int,
    encoder_replay: bool,
    decoder_replay: bool | np.ndarray,
) -> dict[str, np.ndarray]:
    """Vectorized replay rules over requests; returns int64/bool arrays keyed like ``ReplayPoint``.

    ``decoder_replay`` is one switch or one per request (a request that needs every row's
    output runs without it)."""
    r = np.asarray(resume, dtype=np.int64)
    dec = np.asarray(is_decode, dtype=bool)
    fresh = np.asarray(fresh_slot, dtype=bool)
    prefill = ~dec
    rebuild = prefill & fresh & (r > 0) & bool(encoder_replay)
    short = prefill & ((np.asarray(prompt_len, dtype=np.int64) - r) < min_final_rows)
    short &= np.asarray(decoder_replay, dtype=bool)  # one switch, or one per request
    back = rebuild | short
    fs = np.where(back, grid_back_off(r, hash_block), r)
    cached = np.where(rebuild, fs, r)
    return {
        "forward_start": fs,
        "write_from": r.copy(),
        "cached_until": cached,
        "swa_cached_until": cached.copy(),
        "encoder_window_floor": np.where(rebuild, fs, 0),
        "rebuild": rebuild,
        "backed_off": fs < r,
    }


def replay_start(
    resume: int,
    prompt_len: int,
    *,
    hash_block: int,
    min_final_rows: int,
    fresh_slot: bool = False,
    is_decode: bool = False,
    encoder_replay: bool = True,
    decoder_replay: bool = True,
) -> ReplayPoint:
    """Where a forward resuming at ``resume`` of a ``prompt_len`` prompt starts, and its bounds."""
    a = replay_arrays(
        [resume],
        [prompt_len],
        [is_decode],
        [fresh_slot],
        hash_block=hash_block,
        min_final_rows=min_final_rows,
        encoder_replay=encoder_replay,
        decoder_replay=decoder_replay,
    )
    return ReplayPoint(**{k: (bool(v[0]) if v.dtype == bool else int(v[0])) for k, v in a.items()})


def replay_start_for_spec(spec, resume: int, prompt_len: int, **flags) -> ReplayPoint:
    """``replay_start`` with the spec's hash block, ``min_final_prefill_rows`` and switches
    (``encoder_replay``/``decoder_replay``/``fresh_slot``/``is_decode`` may be given)."""
    rules = spec.replay
    flags.setdefault("encoder_replay", rules.encoder_swa_bounded_replay)
    flags.setdefault("decoder_replay", rules.decoder_swa_bounded_replay)
    return replay_start(
        resume,
        prompt_len,
        hash_block=rules.hash_block_tokens,
        min_final_rows=rules.min_final_prefill_rows,
        **flags,
    )


@dataclass(frozen=True)
class ChunkChoice:
    """A prefill chunk the scheduler can run this step."""

    forward_start: int
    """First position computed (after back-off)."""
    chunk_len: int
    """New tokens past the resume point (what the step schedules: ``start + chunk_len`` = end)."""
    rows: int
    """Rows the forward computes, recomputed ones included: the token budget it uses."""
    is_final_chunk: bool
    """The chunk ends the prompt."""


def choose_prefill_chunk(
    resume: int,
    prompt_len: int,
    token_budget: int,
    *,
    hash_block: int,
    min_final_rows: int,
    long_prefill_cap: int | None = None,
    fresh_slot: bool = False,
    encoder_replay: bool = True,
    decoder_replay: bool = True,
) -> ChunkChoice | None:
    """The chunk a request resuming at ``resume`` runs under ``token_budget`` rows, or None: wait.

    The forward starts at ``replay_start`` (a hash block lower for a rebuild or a resume closer
    than ``min_final_rows`` to the end). The long-prefill cap counts new tokens from ``resume``,
    not from the backed-off start; the budget counts every row the forward computes. A forward
    the budget cannot carry past ``resume`` waits: a chunk ending there would recompute cached
    rows alone and hand the next pass the same back-off.
    """
    if not 0 <= resume < prompt_len:
        raise ValueError(f"resume {resume} is outside the prompt [0, {prompt_len})")
    if token_budget < 0 or (long_prefill_cap is not None and long_prefill_cap < 1):
        raise ValueError("token_budget must be >= 0 and long_prefill_cap >= 1")
    p = replay_start(
        resume,
        prompt_len,
        hash_block=hash_block,
        min_final_rows=min_final_rows,
        fresh_slot=fresh_slot,
        encoder_replay=encoder_replay,
        decoder_replay=decoder_replay,
    )
    remaining = prompt_len - resume
    new = min(remaining, token_budget - (resume - p.forward_start))
    if long_prefill_cap is not None:
        new = min(new, long_prefill_cap)
    if new < 1:
        return None
    return ChunkChoice(p.forward_start, new, resume + new - p.forward_start, new == remaining)
