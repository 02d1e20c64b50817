"""The scheduler's persistent decode batch: running requests past their prefill as rows per STATE
slot (vLLM v1's persistent batch), so a decode step's columns, its slot deltas and its stop
checks are array operations over the rows instead of a pass of Python per request.

A request's row is loaded when its prefill ends (the scheduler's postprocess) and unloaded
when it frees its slot (finish, cancellation, preemption). While loaded, the row holds the
request's cursor, lengths and newest token, which the scheduler keeps equal to the
``Sequence``'s (the ``Sequence`` stays the record callers read), and it owns what the runner
has been sent of the slot (``synced_tokens``, ``synced_blocks``): the ``Sequence`` fields of
those names are not kept while the row is loaded.
"""

from __future__ import annotations

import numpy as np

from v41plan.serving.sequence import Sequence


class DecodeRows:
    """Per-slot columns of the decoding requests (``seq_id`` -1 where a slot has none)."""

    def __init__(self, num_slots: int) -> None:
        self.seq: list[Sequence | None] = [None] * num_slots
        """The decoding request of each slot (None: no row)."""
        self.seq_id = np.full(num_slots, -1, dtype=np.int64)

        def z() -> np.ndarray:
            return np.zeros(num_slots, dtype=np.int64)

        self.pos = z()
        """The cursor (``num_cached_tokens``): the next decode row's position."""
        self.prompt_len = z()
        """``prefill_end`` of the request's admission."""
        self.prefix_hit = z()
        self.num_tokens = z()
        self.num_blocks = z()
        self.synced_tokens = z()
        """Token ids the runner's slot tables hold."""
        self.synced_blocks = z()
        self.published = z()
        """``num_published_blocks``."""
        self.last_token = z()
        self.limit = z()
        """Token count at which the request ends with ``length``."""
        self.stops = np.full((num_slots, 1), -1, dtype=np.int64)
        """Token ids that end the request with ``stop``, -1 padded (token ids are >= 0)."""
        self.logprobs = np.zeros(num_slots, dtype=bool)
        """The request asks for per-token logprobs (appended one request at a time)."""
        self.version = 0
        """Bumped at every load and unload (the scheduler's cached row order follows it)."""

    def load(self, seq: Sequence, rule: tuple[frozenset[int], int]) -> None:
        """Give ``seq`` (running, past its prefill, holding a slot) its row; ``rule`` is its
        stop rule ``(stop ids, length limit)``."""
        s = seq.slot
        self.seq[s] = seq
        self.seq_id[s] = seq.seq_id
        self.pos[s] = seq.num_cached_tokens
        self.prompt_len[s] = seq.prefill_end
        self.prefix_hit[s] = seq.hits[-1] if seq.hits else 0
        self.num_tokens[s] = len(seq.token_ids)
        self.num_blocks[s] = len(seq.block_table)
        self.synced_tokens[s] = seq.synced_tokens
        self.synced_blocks[s] = seq.synced_blocks
        self.published[s] = seq.num_published_blocks
        self.last_token[s] = seq.token_ids[-1]
        self.limit[s] = rule[1]
        stops = sorted(rule[0])
        if len(stops) > self.stops.shape[1]:
            grown = np.full((len(self.stops), len(stops)), -1, dtype=np.int64)
            grown[:, : self.stops.shape[1]] = self.stops
            self.stops = grown
        self.stops[s] = -1
        self.stops[s, : len(stops)] = stops
        self.logprobs[s] = seq.params.logprobs is not None
        self.version += 1

    def unload(self, seq: Sequence) -> None:
        """Drop ``seq``'s row, if it has one."""
        s = seq.slot
        if s is not None and self.seq[s] is seq:
            self.seq[s] = None
            self.seq_id[s] = -1
            self.version += 1

    def stop_reasons(self, slots: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(stop, length)`` masks of rows ``slots`` after appending ``tokens`` (the counts
        already include them): a stop id matches, or the count reached the limit. ``stop``
        wins where both hold, as in ``Scheduler._stop_reason``."""
        stop = self.stops[slots, 0] == tokens
        for c in range(1, self.stops.shape[1]):  # (one column unless a request has more ids)
            stop |= self.stops[slots, c] == tokens
        return stop, ~stop & (self.num_tokens[slots] >= self.limit[slots])
