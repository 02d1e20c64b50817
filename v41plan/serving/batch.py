"""What the scheduler hands a model runner, and what the runner gives back.

A ``ScheduledBatch`` is a ragged batch: decode rows of running requests (one each) and prefill
chunks under one token budget (``phase`` is ``decode`` when every request decodes, the shape
CUDA graphs capture, else ``prefill``). Each ``ScheduledRequest`` names the rows its forward
runs, ``[start, end)``, and where its cached rows end (``resume``): rows below ``resume`` are
recomputed without writing what the cache holds (``write_from``), and under the same slot they
read the rings below ``resume`` (``swa_cached_until``). ``fresh_slot`` says the slot's state is
rebuilt from ``start`` (a position-0 reset at ``start == 0``, an encoder replay with windows
starting at ``start`` otherwise). The runner performs ``stores`` then ``restores`` before the
forward.

Token ids and block tables are not carried per step: the runner keeps them per slot in
``SlotTables`` and the batch carries only what changed (``SlotDelta``: the tokens and block ids
appended since the runner last saw the slot, or a slot's whole content when a request takes
it), and the slots freed since the last batch, as vLLM v1 hands its workers per-step deltas.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from v41plan.serving.block_manager import RestoreOp, StoreOp


@dataclass(slots=True)
class ScheduledRequest:
    """One request's span in a batch (read-only by contract; not frozen, because a frozen
    dataclass costs six times as much to build and a decode step builds one per request)."""

    seq_id: int
    slot: int
    start: int
    """First position the forward runs (after any back-off)."""
    resume: int
    """Where the cached rows end: rows ``[start, resume)`` are recomputed, not rewritten."""
    end: int
    """One past the last position the forward runs."""
    prompt_len: int
    """Tokens this admission prefills (prompt plus re-forwarded output after a preemption)."""
    prefix_hit: int
    """Reported prefix hit (tokens, on the hash-block grid) of this admission; 0 if none."""
    fresh_slot: bool
    """The slot's state is rebuilt from ``start`` rather than continued."""
    is_final_chunk: bool
    """The forward finishes the prefill (or is a decode): its last row is sampled."""
    all_logits: bool = False
    """Return logits of every row (prompt scoring; decoder replay off)."""

    @property
    def chunk_len(self) -> int:
        """Rows the forward runs."""
        return self.end - self.start

    @property
    def replay_rows(self) -> int:
        """Rows recomputed below the resume point."""
        return self.resume - self.start

    @property
    def is_decode(self) -> bool:
        """One sampled row past the prompt."""
        return self.start >= self.prompt_len


_INT_COLUMNS = ("seq_id", "slot", "start", "resume", "end", "prompt_len", "prefix_hit")
_BOOL_COLUMNS = ("fresh_slot", "is_final_chunk", "all_logits")


class RequestColumns(SequenceABC):
    """A batch's requests as columns (one numpy array per ``ScheduledRequest`` field, in batch
    order), so a step of hundreds of decode rows is built and read by array operations.

    It is also a sequence of ``ScheduledRequest``: indexing or iterating builds the objects
    once (for code that wants one request at a time: fake runners, validators, tests)."""

    __slots__ = (*_INT_COLUMNS, *_BOOL_COLUMNS, "_objects")

    def __init__(self, seq_id, slot, start, resume, end, prompt_len, prefix_hit,
                 fresh_slot, is_final_chunk, all_logits, objects=None) -> None:  # fmt: skip
        for name, col in zip(_INT_COLUMNS, (seq_id, slot, start, resume, end, prompt_len,
                                            prefix_hit), strict=True):  # fmt: skip
            setattr(self, name, np.asarray(col, dtype=np.int64))
        for name, col in zip(_BOOL_COLUMNS, (fresh_slot, is_final_chunk, all_logits), strict=True):
            setattr(self, name, np.asarray(col, dtype=bool))
        self._objects = objects

    @classmethod
    def decode(cls, seq_id, slot, pos, prompt_len, prefix_hit) -> RequestColumns:
        """Decode rows: one row each at ``pos`` (a continued slot, sampled, no row logits);
        the columns are int64 arrays, taken as they are (once per step: no conversions)."""
        self = cls.__new__(cls)
        self.seq_id, self.slot, self.prompt_len, self.prefix_hit = (
            seq_id,
            slot,
            prompt_len,
            prefix_hit,
        )
        self.start = self.resume = pos
        self.end = pos + 1
        self.fresh_slot = self.all_logits = np.zeros(len(pos), dtype=bool)
        self.is_final_chunk = np.ones(len(pos), dtype=bool)
        self._objects = None
        return self

    @classmethod
    def from_requests(cls, reqs) -> RequestColumns:
        """Columns of ``ScheduledRequest`` objects (kept as the sequence's items)."""
        reqs = tuple(reqs)
        n = len(reqs)
        ints = np.array(
            [(r.seq_id, r.slot, r.start, r.resume, r.end, r.prompt_len, r.prefix_hit)
             for r in reqs], dtype=np.int64,
        ).reshape(n, 7)  # fmt: skip
        flags = np.array(
            [(r.fresh_slot, r.is_final_chunk, r.all_logits) for r in reqs], dtype=bool
        ).reshape(n, 3)
        return cls(*ints.T, *flags.T, objects=reqs)

    @classmethod
    def concat(cls, parts) -> RequestColumns:
        """The rows of ``parts`` (``RequestColumns``), in order."""
        parts = [p for p in parts if len(p)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.from_requests(())
        cols = [np.concatenate([getattr(p, name) for p in parts]) for name in _INT_COLUMNS]
        flags = [np.concatenate([getattr(p, name) for p in parts]) for name in _BOOL_COLUMNS]
        return cls(*cols, *flags)

    @property
    def chunk_len(self) -> np.ndarray:
        """Rows each request's forward runs."""
        return self.end - self.start

    def __len__(self) -> int:
        return len(self.seq_id)

    def _items(self) -> tuple[ScheduledRequest, ...]:
        if self._objects is None:
            cols = [getattr(self, name).tolist() for name in (*_INT_COLUMNS, *_BOOL_COLUMNS)]
            self._objects = tuple(ScheduledRequest(*row) for row in zip(*cols))
        return self._objects

    def __getitem__(self, i):
        return self._items()[i]

    def row(self, i: int) -> ScheduledRequest:
        """Request ``i`` as an object (built alone: a mixed batch reads its few prefill rows
        without building one object per decode row)."""
        if self._objects is not None:
            return self._objects[i]
        return ScheduledRequest(*(getattr(self, name)[i].item()
                                  for name in (*_INT_COLUMNS, *_BOOL_COLUMNS)))  # fmt: skip

    def __iter__(self):
        return iter(self._items())

    def __repr__(self) -> str:
        return f"RequestColumns({list(self._items())!r})"


def as_columns(requests) -> RequestColumns:
    """``requests`` (``RequestColumns`` or ``ScheduledRequest`` objects) as columns."""
    if isinstance(requests, RequestColumns):
        return requests
    return RequestColumns.from_requests(requests)


@dataclass(frozen=True)
class SlotDelta:
    """What changed in one slot's token ids and block table since the runner last saw it."""

    slot: int
    reset: bool
    """A request takes the slot: what the runner held for it is discarded first."""
    tokens_from: int
    """Position of ``new_tokens[0]`` (the runner held ``tokens_from`` tokens before)."""
    new_tokens: np.ndarray
    """int64 token ids appended at ``tokens_from``."""
    blocks_from: int
    """Index of ``new_blocks[0]`` in the block table."""
    new_blocks: np.ndarray
    """int32 PAGE ids appended at ``blocks_from``."""
    params: object | None = None
    """On a reset: the request's ``SamplingParams`` (fixed for its life)."""
    seed: int = 0
    """On a reset: the request's sampling seed."""
    num_prompt_tokens: int = 0
    """On a reset: the request's prompt length (output ``k`` is token ``num_prompt_tokens + k``)."""


class SlotTables:
    """Each slot's token ids and block table, kept between steps by a runner and updated only by
    the batches' deltas (never rebuilt from a request's whole history).

    ``blocks`` is one ``[slots, max_pages]`` int32 array (-1 past a table), so a step's block
    tables are one fancy-index; token ids are a growable array per slot, and ``last_token``
    holds each slot's newest token (what a decode row reads)."""

    def __init__(self, num_slots: int, max_pages: int) -> None:
        self.blocks = np.full((num_slots, max_pages), -1, dtype=np.int32)
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)
        self.num_tokens = np.zeros(num_slots, dtype=np.int64)
        self.last_token = np.zeros(num_slots, dtype=np.int64)
        self._tokens = np.zeros((num_slots, 256), dtype=np.int32)
        """Token ids ``[slots, capacity]``; the capacity doubles as sequences grow."""
        # each slot's sampling parameters (set when a request takes the slot)
        self.num_prompt = np.zeros(num_slots, dtype=np.int64)
        self.temperature = np.zeros(num_slots, dtype=np.float32)
        self.top_k = np.zeros(num_slots, dtype=np.int64)
        self.top_p = np.ones(num_slots, dtype=np.float32)
        self.min_p = np.zeros(num_slots, dtype=np.float32)
        self.seed = np.zeros(num_slots, dtype=np.int64)
        self.top_n = np.zeros(num_slots, dtype=np.int64)
        """Top logprobs each slot's request asks for (-1: none at all)."""

    def apply(self, batch: ScheduledBatch) -> None:
        """Free the batch's freed slots, then apply its deltas in order."""
        for slot in batch.freed_slots:
            self.blocks[slot] = -1
            self.num_blocks[slot] = 0
            self.num_tokens[slot] = 0
        for d in batch.deltas:
            s = d.slot
            if d.reset:
                self.blocks[s] = -1
                self.num_blocks[s] = 0
                self.num_tokens[s] = 0
                self._set_params(s, d)
            if d.tokens_from != self.num_tokens[s] or d.blocks_from != self.num_blocks[s]:
                raise RuntimeError(
                    f"slot {s}: delta at token {d.tokens_from} / block {d.blocks_from}, but the "
                    f"runner holds {self.num_tokens[s]} tokens / {self.num_blocks[s]} blocks"
                )
            n = len(d.new_tokens)
            if n:
                end = d.tokens_from + n
                self._reserve(end)
                self._tokens[s, d.tokens_from : end] = d.new_tokens
                self.num_tokens[s] = end
                self.last_token[s] = d.new_tokens[-1]
            k = len(d.new_blocks)
            if k:
                if d.blocks_from + k > self.blocks.shape[1]:
                    raise RuntimeError(f"slot {s}: block table longer than {self.blocks.shape[1]}")
                self.blocks[s, d.blocks_from : d.blocks_from + k] = d.new_blocks
                self.num_blocks[s] = d.blocks_from + k
        if batch.append_slots is not None and len(batch.append_slots):
            slots, toks = batch.append_slots, batch.append_tokens
            at = self.num_tokens[slots]
            self._reserve(int(at.max()) + 1)
            self._tokens[slots, at] = toks
            self.num_tokens[slots] = at + 1
            self.last_token[slots] = toks

    def _reserve(self, n: int) -> None:
        """Room for ``n`` tokens in every slot (doubling: appends stay amortised O(1))."""
        cap = self._tokens.shape[1]
        if n > cap:
            grown = np.zeros((self._tokens.shape[0], max(n, 2 * cap)), dtype=np.int32)
            grown[:, :cap] = self._tokens
            self._tokens = grown

    def _set_params(self, s: int, d: SlotDelta) -> None:
        from v41plan.runtime.sampler import to_int64

        p = d.params
        self.num_prompt[s] = d.num_prompt_tokens
        self.seed[s] = to_int64(d.seed)
        if p is None:  # a slot driven without parameters samples greedily
            self.temperature[s], self.top_k[s], self.top_p[s], self.min_p[s] = 0, 0, 1, 0
            self.top_n[s] = -1
            return
        self.temperature[s], self.top_k[s] = p.temperature, p.top_k
        self.top_p[s], self.min_p[s] = p.top_p, p.min_p
        self.top_n[s] = -1 if p.logprobs is None else p.logprobs

    def sampling(self, slots: np.ndarray):
        """The device sampler's columns for requests in ``slots`` (each samples its next
        output token), with the static shape a graph is captured for: greedy when every request
        is, else noise and truncation on; top logprobs only when one asks (no graph has them)."""
        from v41plan.runtime.paged_model import StepSampling

        temp = self.temperature[slots]
        top_n = int(self.top_n[slots].max(initial=0))
        sampled = bool((temp > 0).any())
        return StepSampling(
            temperature=temp,
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            seed=self.seed[slots],
            output_index=self.num_tokens[slots] - self.num_prompt[slots],
            sampled=sampled,
            truncate=sampled,
            top_n=top_n,
        )

    def tokens(self, slot: int, lo: int, hi: int) -> np.ndarray:
        """Token ids ``[lo, hi)`` of a slot (a view)."""
        if hi > self.num_tokens[slot]:
            raise RuntimeError(f"slot {slot} holds {self.num_tokens[slot]} tokens, not {hi}")
        return self._tokens[slot, lo:hi].astype(np.int64)


@dataclass(frozen=True)
class KVSave:
    """Offer the KV connector what PAGE units ``pages`` hold: one unit per block (``keys[i]``
    the hash of the block in ``pages[i]``), or one checkpoint image (``image``: its units, key
    the block it ends at)."""

    keys: tuple[bytes, ...]
    pages: tuple[int, ...]
    token_ids: tuple[int, ...]
    """The request's token ids up to the last block saved (token-keyed connectors)."""
    image: bool = False


@dataclass(frozen=True)
class KVLoad:
    """Write connector bytes ``data [len(pages), page_unit_bytes]`` into PAGE units ``pages``
    (``image``: one checkpoint image, restored by a ``RestoreOp`` of the same batch)."""

    pages: tuple[int, ...]
    data: np.ndarray
    image: bool = False


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: a ragged batch of requests plus the state copies and slot deltas before it."""

    step: int
    phase: str
    """``decode`` (every request decodes one row) or ``prefill`` (at least one prefill chunk,
    with any decode rows of running requests beside it)."""
    requests: RequestColumns
    """The requests, in batch order (``ScheduledRequest`` objects given here become columns)."""
    stores: tuple[StoreOp, ...] = ()
    restores: tuple[RestoreOp, ...] = ()
    deltas: tuple[SlotDelta, ...] = ()
    """Token ids and block ids the runner has not seen yet, per slot."""
    freed_slots: tuple[int, ...] = ()
    """Slots freed since the previous batch (finished, cancelled or preempted requests)."""
    append_slots: np.ndarray | None = None
    """Slots that gained exactly one token and nothing else (the common decode delta), in
    columnar form: ``append_tokens[i]`` is appended to slot ``append_slots[i]``."""
    append_tokens: np.ndarray | None = None
    kv_saves: tuple[KVSave, ...] = ()
    """PAGE units and images to hand the KV connector, read from the pools before anything of
    this batch writes them."""
    kv_loads: tuple[KVLoad, ...] = ()
    """Connector bytes to write into fresh PAGE units before the stores, restores and forward."""

    def __post_init__(self) -> None:
        if not isinstance(self.requests, RequestColumns):
            object.__setattr__(self, "requests", RequestColumns.from_requests(self.requests))

    @property
    def num_tokens(self) -> int:
        """Rows of the whole batch."""
        return int(self.requests.chunk_len.sum())


class RunnerOutput:
    """What a step gives back: each sampled request's token (sampled on the device), or the
    logits of its last row for the scheduler to sample (runners without a device sampler), and
    every row's logits where asked.

    A runner with a device sampler gives the tokens as columns (``set_rows``); the per-request
    ``tokens``/``logprobs`` maps are then built from them only when read."""

    def __init__(self) -> None:
        self._tokens: dict[int, int] | None = {}
        self._logprobs: dict[int, float] | None = {}
        self.top_logprobs: dict[int, list[tuple[int, float]]] = {}
        """seq_id -> the ``logprobs`` most likely ``(token id, logprob)``, for requests asking."""
        self.last_logits: dict[int, torch.Tensor] = {}
        """seq_id -> ``[vocab]`` float logits of the last row, where no token was sampled."""
        self.row_logits: dict[int, torch.Tensor] = {}
        """seq_id -> ``[rows, vocab]`` logits of every row (``all_logits`` requests)."""
        self.row_tokens: np.ndarray | None = None
        """The sampled tokens per batch row (int64, -1 where a row sampled none): what the
        scheduler's columnar postprocess reads."""
        self.row_logprobs: np.ndarray | None = None
        """The sampled tokens' raw logprobs per batch row (beside ``row_tokens``)."""
        self.spec_tokens: np.ndarray | None = None
        """Speculative decoding: int64 ``[rows, block_size + 1]`` the tokens each batch row
        emits, in order (accepted drafts, then the target's next token), -1 after; None
        without speculation."""
        self.spec_logprobs: np.ndarray | None = None
        """Their raw logprobs, beside ``spec_tokens``."""
        self._row_ids: np.ndarray | None = None

    def set_rows(self, seq_ids: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """The sampled tokens and logprobs per batch row (``seq_ids``: the rows' requests)."""
        self._row_ids, self.row_tokens, self.row_logprobs = seq_ids, tokens, logprobs
        self._tokens = self._logprobs = None

    def _maps(self) -> None:
        got = self.row_tokens >= 0
        ids = self._row_ids[got].tolist()
        self._tokens = dict(zip(ids, self.row_tokens[got].tolist(), strict=True))
        self._logprobs = dict(zip(ids, self.row_logprobs[got].tolist(), strict=True))

    @property
    def tokens(self) -> dict[int, int]:
        """seq_id -> the token sampled from its last row (final chunks and decodes)."""
        if self._tokens is None:
            self._maps()
        return self._tokens

    @property
    def logprobs(self) -> dict[int, float]:
        """seq_id -> the sampled token's raw logprob."""
        if self._logprobs is None:
            self._maps()
        return self._logprobs


def history_window(replay_history_tokens: int, hash_block: int) -> int:
    """Positions before a request's resume point whose Engram ids a plan may need: a forward
    starts at most one hash block below its resume point, and reads the history before that."""
    return hash_block + replay_history_tokens


def to_step_input(batch: ScheduledBatch, tables: SlotTables, compress=None, *, history: int = 0,
                  running_bs: int | None = None, running_tokens: int | None = None,
                  block_table_width: int | None = None):  # fmt: skip
    """The planner's columnar ``StepArrays`` for ``batch``, from the runner's ``tables``.

    ``compress`` maps raw token ids to Engram-compressed ids (``EngramHost.compress``); without
    it the raw ids are passed. Only a prefill request can back off below its cursor and read
    the plan's history, and only the ``history`` positions before its resume point can be
    read: just those are compressed. ``start`` is the resume point: ``plan_step`` applies the
    same back-off the scheduler counted (``choose_prefill_chunk``), which ``check_plan``
    asserts.
    """
    from v41plan.planner.step import StepArrays

    rows = batch.requests
    n = len(rows)
    slots = rows.slot
    width = int(tables.num_blocks[slots].max()) if n else 0
    decode = batch.phase == "decode"  # one row each past the prompt: no history to read
    ids = None
    if not decode:  # decode rows (None) read their history from the cursor
        ids = [None] * n
        for i in np.flatnonzero(rows.start < rows.prompt_len).tolist():
            resume = int(rows.resume[i])
            lo = max(0, resume - history)
            win = np.full(resume, -1, dtype=np.int64)
            raw = tables.tokens(int(slots[i]), lo, resume)
            win[lo:] = compress(raw) if compress is not None else raw
            ids[i] = win
        ids = tuple(ids)
    return StepArrays(
        slots=slots,
        block_tables=tables.blocks[slots, :width],
        prompt_lens=rows.prompt_len,
        starts=rows.resume,
        chunk_lens=rows.end - rows.resume,
        is_decode=rows.start >= rows.prompt_len,
        prefix_hits=rows.prefix_hit,
        fresh_slot=rows.fresh_slot,
        token_ids=ids,
        full_rows=rows.all_logits,
        running_bs=running_bs,
        running_tokens=running_tokens,
        block_table_width=block_table_width,
    )


def step_token_ids(
    batch: ScheduledBatch, tables: SlotTables, slots: np.ndarray | None = None
) -> np.ndarray:
    """The flat token ids the batch's forward reads, in request order (``slots``: the batch's
    slots, in request order, when the caller has them)."""
    if batch.phase == "decode":
        return tables.last_token[batch.requests.slot if slots is None else slots]
    rows = batch.requests
    parts = [tables.tokens(*span) for span in zip(rows.slot.tolist(), rows.start.tolist(),
                                                  rows.end.tolist())]  # fmt: skip
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def check_plan(batch: ScheduledBatch, plan) -> None:
    """Raise if the planner's forward starts differ from the scheduler's (a contract check)."""
    got = plan.forward_start[: plan.scheduled_bs]
    want = batch.requests.start
    if not np.array_equal(got, want):
        starts = [int(x) for x in got]
        raise RuntimeError(
            f"step {batch.step}: planner starts {starts} != scheduler starts {want.tolist()}"
        )


class ModelRunner(Protocol):
    """Executes one scheduled batch: stores, restores, then the forward."""

    vocab_size: int

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run ``batch`` and return the logits the scheduler samples from."""
        ...
