"""Per-step row plans: ``plan_step(StepInput) -> StepPlan``.

Pure host code (numpy only; no torch, no pydantic): it runs once per scheduler step on the
GPU image, and everything the executor does in that step follows from the frozen
``StepPlan`` it returns. The executor only copies these arrays into fixed-address buffers.

Conventions used by every array below:

- *Flat rows* index the step's token batch ``[0, running_tokens)``; requests' rows are
  contiguous, in request order (``cu_seqlens_q``), followed by padding rows.
- *Request rows* index ``[0, running_bs)``: the real requests first, in input order, then
  padding requests (zero length in ``cu_seqlens_q``, slot -1, batch id never used).
- Padding tokens have batch id -1 and position 0; every writer must skip them.
- Positions are absolute token positions of the request's sequence.
- Plan arrays are read-only by contract: layers with equal row sets share one array, and a few
  fields may share memory (ratio-1 compressed rows are the positions of a one-row decode).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from v41plan.planner.replay import replay_arrays
from v41plan.planner.stages import stage_table

Phase = Literal["prefill", "decode"]
"""A request's phase in a step: a prefill chunk (prompt rows) or decode (sampled rows)."""

SUB_STEPS: tuple[str, ...] = ("ring_write", "compress", "attention", "ffn")
"""Sub-steps of one layer, in execution order of the stage table."""


@dataclass(frozen=True)
class RequestInput:
    """One scheduled request of a step, as the scheduler describes it."""

    slot: int
    """STATE slot (Active Slot index) the request runs in."""
    block_table: tuple[int, ...] | np.ndarray
    """PAGE ids of the request's sequence, in order (page ``k`` holds tokens ``[k*P, (k+1)*P)``)."""
    prompt_len: int
    """Prompt length in tokens."""
    start: int
    """Resume point: the first position the scheduler scheduled, before any replay back-off."""
    chunk_len: int
    """New tokens scheduled from ``start``: the forward ends at ``start + chunk_len``."""
    phase: Phase = "prefill"
    """``prefill`` for prompt chunks, ``decode`` for sampled tokens (``start >= prompt_len``)."""
    prefix_hit: int = 0
    """Prefix-cache hit in tokens (on the hash-block grid), 0 if none; reported, never changed."""
    fresh_slot: bool = False
    """True when the slot holds no state for this request (zeroed). With ``start > 0`` this is an
    encoder-replay rebuild: the forward starts a hash block below ``start`` and rebuilds the
    rings."""
    token_ids: tuple[int, ...] | np.ndarray | None = None
    """The request's Engram-compressed token ids by position (-1 for DEAD/unknown), at least the
    ``replay_history_tokens`` positions before the forward start; only read when the forward
    starts below the slot's cursor (back-off) or in a fresh slot. None: history ids are -1."""
    full_rows: bool = False
    """Run every layer on every row of this request (no decoder replay for it, e.g. prompt
    logprobs); keep it for all of the request's chunks."""


@dataclass(frozen=True)
class StepInput:
    """A whole step: its requests and the width it runs at."""

    requests: tuple[RequestInput, ...]
    """Scheduled requests, in batch order (batch id = index)."""
    running_bs: int | None = None
    """Request width of the forward (graph bucket); None: the number of requests."""
    running_tokens: int | None = None
    """Token width of the forward (graph bucket); None: the scheduled rows (after back-off)."""
    block_table_width: int | None = None
    """Columns of ``StepPlan.block_tables``; None: the longest request's table."""


@dataclass(frozen=True)
class StepArrays:
    """A step in columnar form (what a scheduler keeping numpy state passes; the fast input).

    Every per-request array has one entry per scheduled request, in batch order.
    """

    slots: np.ndarray
    """int STATE slot per request."""
    block_tables: np.ndarray
    """int [n, pages] PAGE ids per request, -1 past each request's table."""
    prompt_lens: np.ndarray
    """int prompt length per request."""
    starts: np.ndarray
    """int resume point per request (before back-off)."""
    chunk_lens: np.ndarray
    """int new tokens per request."""
    is_decode: np.ndarray
    """bool decode phase per request."""
    prefix_hits: np.ndarray
    """int reported prefix hit per request (0 if none)."""
    fresh_slot: np.ndarray
    """bool fresh (zeroed) slot per request."""
    token_ids: tuple | None = None
    """Per request an id sequence (or None) for Engram history, as ``RequestInput.token_ids``."""
    full_rows: np.ndarray | None = None
    """bool per request, as ``RequestInput.full_rows``; None: all False."""
    running_bs: int | None = None
    """Request width; None: the number of requests."""
    running_tokens: int | None = None
    """Token width; None: the scheduled rows."""
    block_table_width: int | None = None
    """Columns of the planned block tables; None: ``block_tables.shape[1]``."""


def step_arrays(step: StepInput) -> StepArrays:
    """Columnar form of a ``StepInput``: one pass over the requests for the scalars, one flat
    copy of the block tables (objects in, so this is the one loop numpy cannot replace)."""
    reqs = step.requests
    n = len(reqs)
    cols = np.array(
        [(r.slot, r.prompt_len, r.start, r.chunk_len, r.prefix_hit) for r in reqs], dtype=np.int64
    ).reshape(n, 5)
    phases = [r.phase for r in reqs]
    bad = next((ph for ph in phases if ph not in ("prefill", "decode")), None)
    if bad is not None:
        raise PlanError(f"phase {bad!r} is not prefill or decode")
    tables = [r.block_table for r in reqs]
    lens = np.fromiter(map(len, tables), np.int64, n)
    width = int(lens.max()) if n else 0
    total = int(lens.sum())
    if n and all(isinstance(t, np.ndarray) for t in tables):
        flat = np.concatenate(tables).astype(np.int64, copy=False)
    else:  # tuples of ints: one iterator pass beats converting each tuple
        flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, total)
    if n and (lens == width).all():
        bt = flat.reshape(n, width)
    else:
        bt = np.full((n, width), -1, dtype=np.int64)
        rows = np.repeat(np.arange(n), lens)
        bt[rows, np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
    return StepArrays(
        slots=cols[:, 0].copy(),
        block_tables=bt,
        prompt_lens=cols[:, 1].copy(),
        starts=cols[:, 2].copy(),
        chunk_lens=cols[:, 3].copy(),
        is_decode=np.array([ph == "decode" for ph in phases], dtype=bool).reshape(n),
        prefix_hits=cols[:, 4].copy(),
        fresh_slot=np.array([r.fresh_slot for r in reqs], dtype=bool).reshape(n),
        token_ids=tuple(r.token_ids for r in reqs),
        full_rows=np.array([r.full_rows for r in reqs], dtype=bool).reshape(n),
        running_bs=step.running_bs,
        running_tokens=step.running_tokens,
        block_table_width=step.block_table_width,
    )


@dataclass(frozen=True)
class CompressPlan:
    """The compressed groups of one ratio that close in this forward and are written.

    A group ``j`` of ratio ``r`` covers positions ``[j*r, j*r + r)`` and closes at its last member
    (``(pos + 1) % r == 0``). Groups ending below the request's ``write_from`` are dropped: the
    prefix cache already holds them. Arrays are indexed by plan entry, in flat-row order.
    """

    ratio: int
    """Compression ratio (1 or 2)."""
    rows: np.ndarray
    """int32 flat row of each group's last member (where the group's latent is emitted)."""
    batch_ids: np.ndarray
    """int32 request row of each group."""
    compressed_rows: np.ndarray
    """int64 compressed row id ``pos // r`` (main/index row inside the owner's pages)."""
    rope_positions: np.ndarray
    """int64 first position of the group ``compressed_row * r``: RoPE of the latent and index
    key."""
    first_from_tail: np.ndarray
    """bool: the group's first member is the slot's FP32 tail: the group began below
    ``swa_cached_until`` (before the forward, or before the resume point of a backed-off one)."""
    tail_store_rows: np.ndarray
    """int32 flat rows whose group is still open at the forward's end: their projection is stored
    into the slot's FP32 tail (empty for ratio 1)."""
    tail_store_batch_ids: np.ndarray
    """int32 request row of each ``tail_store_rows`` entry."""


class LayerRows(Mapping):
    """Read-only mapping ``(layer, sub_step) -> int32 flat rows``; layers with the same row sets
    share one array (built once per step, looked up by key)."""

    __slots__ = ("_arrays", "_index")

    def __init__(self, index: dict, arrays: tuple):
        self._index = index
        self._arrays = arrays

    def __getitem__(self, key):
        return self._arrays[self._index[key]]

    def __iter__(self):
        return iter(self._index)

    def __len__(self):
        return len(self._index)

    @property
    def distinct(self) -> tuple[dict, tuple]:
        """``(key -> array index, the distinct arrays)``: what consumers staging each row set
        once iterate (the index is static per stage table and shared between steps)."""
        return self._index, self._arrays


@dataclass(frozen=True)
class StageRows:
    """The flat rows one graph stage runs, per sub-step (layers in a stage share them)."""

    name: str
    """``backbone``, ``early``, ``late`` or ``layer<N>`` (a layer run between graphs)."""
    first_layer: int
    """First layer of the stage."""
    last_layer: int
    """Last layer of the stage (inclusive)."""
    rows: dict[str, np.ndarray] = field(hash=False, compare=False)
    """Sub-step (``ring_write``, ``attention``, ``ffn``) -> int32 sorted flat rows; ``compress``
    maps to the rows of the stage's Full owners (empty without one)."""


@dataclass(frozen=True)
class StepPlan:
    """Everything one forward computes, as numpy arrays at the declared width."""

    running_bs: int
    """Request width (rows of every per-request array)."""
    running_tokens: int
    """Token width (rows of every per-token array)."""
    scheduled_bs: int
    """Real requests in the step."""
    scheduled_tokens: int
    """Real rows in the step (after back-off): ``cu_seqlens_q[scheduled_bs]``."""
    graph_key: tuple[str, int, int]
    """``(kind, running_bs, running_tokens)``; kind ``decode`` (every request decoding; one captured
    graph), ``prefill`` (eager, one backbone) or ``prefill_replay`` (eager, staged by the table)."""
    decoder_replay: bool
    """True when decoder SWA bounded replay cuts rows in this step (the spec's rule is on and the
    step holds a prefill request)."""

    # --- per token [running_tokens] ---
    positions: np.ndarray
    """int64 absolute position of each row; 0 for padding."""
    batch_ids: np.ndarray
    """int32 request row of each row; -1 for padding."""
    visible: dict[int, np.ndarray] = field(hash=False, compare=False)
    """ratio -> int64 compressed rows visible to each row, ``(pos + 1) // ratio``; 0 for padding."""

    # --- per request [running_bs] ---
    cu_seqlens_q: np.ndarray = field(compare=False)
    """int32 [running_bs + 1] row offsets; padding requests are zero length."""
    slots: np.ndarray = field(compare=False)
    """int32 STATE slot of each request; -1 for padding."""
    block_tables: np.ndarray = field(compare=False)
    """int32 [running_bs, block_table_width] PAGE ids; -1 past a request's table and for padding."""
    is_final_chunk: np.ndarray = field(compare=False)
    """bool: the forward ends the prompt (prefill) or is a decode step; the request samples."""
    is_decode: np.ndarray = field(compare=False)
    """bool: the request is in its decode phase."""
    row_phase: np.ndarray = field(compare=False)
    """int8 the stage-table column whose row sets the request follows: 0 ``prefill_nonfinal``,
    1 ``prefill_final``, 2 ``decode`` (also a ``full_rows`` prefill request: every row, every
    layer, no tail); -1 for padding."""
    prompt_lens: np.ndarray = field(compare=False)
    """int64 prompt length; 0 for padding."""
    resume_points: np.ndarray = field(compare=False)
    """int64 where the scheduler resumed (input ``start``); 0 for padding."""
    prefix_hits: np.ndarray = field(compare=False)
    """int64 reported prefix hit (unchanged by replay); 0 for padding."""
    forward_start: np.ndarray = field(compare=False)
    """int64 first position the forward computes (after ``replay_start``); the cursor steps back
    to it. 0 for padding."""
    forward_end: np.ndarray = field(compare=False)
    """int64 one past the forward's last position (``start + chunk_len``); 0 for padding."""
    write_from: np.ndarray = field(compare=False)
    """int64 compressed groups ending below it are not written (the resume point / hit)."""
    cached_until: np.ndarray = field(compare=False)
    """int64 ring writes skip rows below it (the slot's rings keep the rows they hold). Applies to
    layers whose window floor is not ``tail``: a layer floored at the tail writes its whole tail
    (decode reads it, and no earlier forward wrote that ring)."""
    swa_cached_until: np.ndarray = field(compare=False)
    """int64 rows at or past it read the slot's ring rows below it; rows below it read only this
    forward's rows from ``forward_start`` on. Applies to layers whose window floor is not
    ``tail`` (``StageTable.floors``): a layer floored at the tail reads only this forward's rows
    (its ring was never written by a forward that ran no decoder)."""
    swa_replay_start: np.ndarray = field(compare=False)
    """int64 decoder window floor: a decoder row at ``i`` reads ``[max(s, i - W + 1), i]``. The tail
    start on a replayed final forward, ``encoder_window_floor`` otherwise; 0 in decode."""
    encoder_window_floor: np.ndarray = field(compare=False)
    """int64 encoder window floor: ``forward_start`` on an encoder-replay rebuild, else 0."""
    tail_start: np.ndarray = field(compare=False)
    """int64 first position of the tail ``max(forward_start, forward_end - W)`` on a replayed final
    forward; -1 when the request has no tail (non-final, decode, replay off, padding)."""
    last_rows: np.ndarray = field(compare=False)
    """int32 flat row of each request's last row (LM head / last layer's query); -1 for padding."""
    history_ids: np.ndarray = field(compare=False)
    """int64 [running_bs, replay_history_tokens] Engram history before ``forward_start``, oldest
    first (newest last); -1 for DEAD/missing positions."""
    history_from_plan: np.ndarray = field(compare=False)
    """bool: the forward starts below the slot's cursor or in a fresh slot, so the Engram history
    comes from ``history_ids`` instead of the cursor."""

    # --- gathers and row sets ---
    tail_rows: np.ndarray = field(compare=False)
    """int32 flat rows of every tail (the QueryRows: one gather for all requests), in request
    order, plus every decode request's rows (decode runs every row)."""
    tail_batch_ids: np.ndarray = field(compare=False)
    """int32 request row of each ``tail_rows`` entry."""
    layer_rows: Mapping[tuple[int, str], np.ndarray] = field(compare=False)
    """(layer, sub_step) -> int32 sorted flat rows running it (empty arrays for none; ``compress``
    keys only for Full owners). Layers with equal row sets share one array."""
    stages: tuple[StageRows, ...]
    """Graph stages in layer order, with their rows."""
    compress: dict[int, CompressPlan] = field(compare=False)
    """ratio -> the groups of that ratio closing (and written) in this forward."""
    table: object = field(compare=False)
    """The ``StageTable`` the row sets came from."""

    def ring_limits(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cached_until, swa_cached_until)`` per request for ``layer``'s ring writes and reads.

        A layer floored at the tail in a request's phase neither keeps nor reads ring rows from
        earlier forwards, so both limits are ``forward_start`` there; other layers use the
        request's ``cached_until``/``swa_cached_until``.
        """
        from v41plan.planner.stages import PHASES

        tail = np.array([self.table.floor(p, layer) == "tail" for p in PHASES] + [False])
        tail = tail[self.row_phase]  # padding (-1) picks the trailing False
        return (
            np.where(tail, self.forward_start, self.cached_until),
            np.where(tail, self.forward_start, self.swa_cached_until),
        )


class PlanError(ValueError):
    """An invalid step description (bad numbers, widths too small); the message says which."""


_PHASE_NONFINAL, _PHASE_FINAL, _PHASE_DECODE = 0, 1, 2
_EMPTY = np.zeros(0, dtype=np.int32)


def _check(arrs: StepArrays, spec, encoder_replay: bool) -> None:
    """Refuse an invalid step with a message naming the first bad request.

    One combined vectorized test on the common path; the messages are built only on failure.
    """
    n = len(arrs.slots)
    B = spec.replay.hash_block_tokens
    P = _page_tokens(spec)
    pl, st, cl, hit = arrs.prompt_lens, arrs.starts, arrs.chunk_lens, arrs.prefix_hits
    dec, fresh = arrs.is_decode, arrs.fresh_slot
    end = st + cl
    bt = arrs.block_tables
    need = _div(end + (P - 1), P)  # pages the forward's positions live in
    width = bt.shape[1] if bt.ndim == 2 else 0
    if n and width and int(need.max()) <= width:  # width 0: no page to look at (empty chunks)
        short = bt[np.arange(n), np.maximum(need - 1, 0)] < 0
    else:
        short = need > width
    prefill = ~dec
    any_prefill = bool(prefill.any()) if n else False
    # Cheap whole-batch reductions first; per-request masks only when one fails. A decode-only
    # step skips the prefill terms (they are false on every decode row).
    ok = (
        min(pl.min(), cl.min()) >= 1
        and min(st.min(), arrs.slots.min()) >= 0
        and not short.any()
        and (not hit.any() or (hit.min() >= 0 and not (hit > st).any() and not _mod(hit, B).any()))
        and not (np.where(prefill, end > pl, st < pl) if any_prefill else st < pl).any()
        and (not any_prefill or encoder_replay or not (prefill & fresh & (st > 0)).any())
        and (not any_prefill or not (prefill & fresh & (_mod(st, B) != 0)).any())
    ) if n else True  # fmt: skip
    bad = not ok
    if bad:
        pages = (bt >= 0).sum(axis=1) if bt.size else np.zeros(n, dtype=np.int64)
        checks = (
            (pl < 1, "prompt_len {pl} must be >= 1"),
            (st < 0, "start {st} must be >= 0"),
            (cl < 1, "chunk_len {cl} must be >= 1"),
            (hit < 0, "prefix_hit {hit} must be >= 0"),
            (arrs.slots < 0, "slot {slot} must be >= 0"),
            (prefill & (st >= pl), "start {st} is not inside the prompt [0, {pl})"),
            (prefill & (end > pl), "chunk [{st}, {end}) runs past the prompt end {pl}"),
            (dec & (st < pl), "decode start {st} is inside the prompt (prompt_len {pl})"),
            (hit > st, "prefix_hit {hit} is past the resume point {st}"),
            (hit % B != 0, "prefix_hit {hit} is not on the hash-block grid ({B} tokens)"),
            (
                prefill & fresh & (st > 0) & (not encoder_replay),
                "a fresh slot resuming at {st} needs a restored image (encoder replay is off)",
            ),
            (
                prefill & fresh & (st % B != 0),
                (
                    "a fresh-slot rebuild resumes at {st}, off the hash-block grid ({B} tokens): "
                    "a rebuild starts from a prefix hit"
                ),
            ),
            (short, "block table holds {pages} pages ({P} tokens each), short of position {end}"),
        )
        for mask, msg in checks:
            if mask.any():
                i = int(np.flatnonzero(mask)[0])
                vals = {
                    "pl": int(pl[i]),
                    "st": int(st[i]),
                    "cl": int(cl[i]),
                    "hit": int(hit[i]),
                    "end": int(end[i]),
                    "slot": int(arrs.slots[i]),
                    "pages": int(pages[i]),
                    "P": P,
                    "B": B,
                }
                raise PlanError(f"request {i}: " + msg.format(**vals))
    if n and np.bincount(arrs.slots).max() > 1:
        dup = int(np.argmax(np.bincount(arrs.slots)))
        raise PlanError(f"two requests share STATE slot {dup}")


def _page_tokens(spec) -> int:
    """Tokens of one PAGE (every geometry of a spec shares it)."""
    for g in spec.geometries.values():
        return g.page_tokens
    return spec.replay.hash_block_tokens


@dataclass(frozen=True)
class _Static:
    """What plan_step needs from a (spec, table) pair that does not change between steps."""

    ratios: tuple[int, ...]
    key_index: dict
    sigs: tuple[tuple[str, str, str], ...]
    stages: tuple
    owner_ratios: tuple


_STATIC: dict = {}


def _static(spec, table) -> _Static:
    key = (id(spec), id(table))
    got = _STATIC.get(key)
    if got is not None and got[0] is spec and got[1] is table:
        return got[2]
    rows = table.rows

    def sig(layer: int, sub: str) -> tuple[str, str, str]:
        s = SUB_STEPS.index(sub)
        return (rows[0][layer][s], rows[1][layer][s], rows[2][layer][s])

    keys = tuple(
        (layer, sub)
        for layer in range(table.num_layers)
        for sub in SUB_STEPS
        if sub != "compress" or layer in table.owners
    )
    key_sigs = tuple(sig(*k) for k in keys)
    sigs = tuple(dict.fromkeys(key_sigs))
    stages = tuple(
        (
            g.name,
            g.first_layer,
            g.last_layer,
            tuple((sub, sig(g.first_layer, sub)) for sub in ("ring_write", "attention", "ffn")),
            tuple(sig(o, "compress") for o in table.owners if g.first_layer <= o <= g.last_layer),
        )
        for g in table.stages
    )
    owner_ratios = tuple(
        (r, tuple(sig(o, "compress") for o in table.owners if spec.layers[o].ratio == r))
        for r in sorted({spec.layers[o].ratio for o in table.owners})
    )
    st = _Static(
        ratios=tuple(sorted({layer.ratio for layer in spec.layers if layer.ratio > 0})),
        key_index={k: sigs.index(g) for k, g in zip(keys, key_sigs, strict=True)},
        sigs=sigs,
        stages=stages,
        owner_ratios=owner_ratios,
    )
    _STATIC[key] = (spec, table, st)
    return st


def _div(x: np.ndarray, r: int) -> np.ndarray:
    """``x // r`` (a shift for powers of two: integer division is slow in numpy)."""
    if r == 1:
        return x
    return x >> (r.bit_length() - 1) if r & (r - 1) == 0 else x // r


def _mod(x: np.ndarray, r: int) -> np.ndarray:
    """``x % r`` (a mask for powers of two)."""
    return x & (r - 1) if r & (r - 1) == 0 else x % r


def _ragged_ranges(starts: np.ndarray, counts: np.ndarray, dtype=np.int32) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, loop-free."""
    total = int(counts.sum())
    before = np.cumsum(counts) - counts
    return (np.repeat(starts - before, counts) + np.arange(total)).astype(dtype, copy=False)


def _compress_one_row(pos: np.ndarray, r: int) -> CompressPlan:
    """The compress plan of a step where request ``i`` is flat row ``i`` (one-row decode): a
    group closes on its last member; otherwise the row opens or continues a group and goes to
    the FP32 tail. Decode never backs off, so nothing is below ``write_from``."""
    if r == 1:  # every row is a group of its own
        rows = np.arange(len(pos), dtype=np.int32)
        return CompressPlan(1, rows, rows, pos, pos, np.zeros(len(pos), dtype=bool), _EMPTY, _EMPTY)
    closes = _mod(pos + 1, r) == 0
    at = np.flatnonzero(closes)  # int64 indices: int32 ones make numpy's gather slower
    rows = at.astype(np.int32)
    crow = _div(pos[at], r)
    first = crow * r
    store = np.flatnonzero(~closes).astype(np.int32)
    return CompressPlan(
        ratio=r,
        rows=rows,
        batch_ids=rows,
        compressed_rows=crow,
        rope_positions=first,
        # the closing member is the group's last (r > 1), so its first is an earlier position:
        # one written before this forward, whose projection the slot's FP32 tail holds
        first_from_tail=np.ones(len(at), dtype=bool),
        tail_store_rows=store,
        tail_store_batch_ids=store,
    )


def _union(arrays: list[np.ndarray]) -> np.ndarray:
    """Sorted union of sorted row arrays (the first one itself when they are all one array)."""
    if not arrays:
        return _EMPTY
    if all(x is arrays[0] for x in arrays):
        return arrays[0]
    return np.unique(np.concatenate(arrays)).astype(np.int32)


_DECODE_FAST = True
"""Plan a one-row-each decode step at its own width by ``_plan_decode`` (off: the general path,
which tests compare it with)."""
_DECODE: dict = {}


def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False  # shared between steps: a write would change later plans
    return x


def _decode_constants(st: _Static, n: int, h: int) -> dict | None:
    """The arrays of a decode step of ``n`` requests, one row each at its own width, that
    depend on ``n`` alone, built once and shared by every such plan (plan arrays are read-only
    by contract; these are write-protected). None when a ratio's compress rows are not every
    row (the general path plans those)."""
    key = (id(st), n, h)
    got = _DECODE.get(key)
    if got is not None and got[0] is st:
        return got[1]
    rows = _frozen(np.arange(n, dtype=np.int32))
    sig_arrays = {sig: _EMPTY if sig[_PHASE_DECODE] == "none" else rows for sig in st.sigs}
    for _r, comp_sigs in st.owner_ratios:
        if n and len(_union([sig_arrays[sig] for sig in comp_sigs])) != n:
            return None
    stages = []
    for name, first, last, sub_sigs, comp_sigs in st.stages:
        stage_rows = {sub: sig_arrays[sig] for sub, sig in sub_sigs}
        stage_rows["compress"] = _union([sig_arrays[sig] for sig in comp_sigs])
        stages.append(StageRows(name, first, last, stage_rows))
    zeros = _frozen(np.zeros(n, dtype=np.int64))
    const = {
        "cu": _frozen(np.arange(n + 1, dtype=np.int32)),
        "rows": rows,
        "layer_rows": LayerRows(st.key_index, tuple(sig_arrays[sig] for sig in st.sigs)),
        "stages": tuple(stages),
        "true": _frozen(np.ones(n, dtype=bool)),
        "false": _frozen(np.zeros(n, dtype=bool)),
        "phase": _frozen(np.full(n, _PHASE_DECODE, dtype=np.int8)),
        "zeros": zeros,
        "minus1": _frozen(np.full(n, -1, dtype=np.int64)),
        "history": _frozen(np.full((n, h), -1, dtype=np.int64)),
    }
    if len(_DECODE) > 64:
        _DECODE.clear()
    _DECODE[key] = (st, const)
    return const


def _plan_decode(a: StepArrays, spec, table, st: _Static, c: dict) -> StepPlan:
    """``plan_step`` of a checked step whose ``n`` requests all decode one row at the step's
    own width: request ``i`` is flat row ``i``, nothing backs off, no tail, every row runs
    every layer. Equal to the general path's plan (a test compares them); the arrays that
    depend on ``n`` alone come from ``c`` (``_decode_constants``)."""
    n = len(a.slots)
    pos = a.starts.astype(np.int64)  # one copy: every per-request position field shares it
    if a.block_table_width is not None and int(a.block_table_width) != a.block_tables.shape[1]:
        bt_width = int(a.block_table_width)
        if bt_width < a.block_tables.shape[1] and (a.block_tables[:, bt_width:] >= 0).any():
            raise PlanError(
                f"block_table_width {bt_width} is narrower than a request's block table"
            )
        block_tables = np.full((n, bt_width), -1, dtype=np.int32)
        k = min(bt_width, a.block_tables.shape[1])
        block_tables[:, :k] = a.block_tables[:, :k]
    else:
        block_tables = a.block_tables.astype(np.int32)
    rows = c["rows"]
    return StepPlan(
        running_bs=n,
        running_tokens=n,
        scheduled_bs=n,
        scheduled_tokens=n,
        graph_key=("decode", n, n),
        decoder_replay=False,
        positions=pos,
        batch_ids=rows,
        visible={r: _div(pos + 1, r) for r in st.ratios},
        cu_seqlens_q=c["cu"],
        slots=a.slots.astype(np.int32),
        block_tables=block_tables,
        is_final_chunk=c["true"],
        is_decode=c["true"],
        row_phase=c["phase"],
        prompt_lens=a.prompt_lens.astype(np.int64),
        resume_points=pos,
        prefix_hits=a.prefix_hits.astype(np.int64),
        forward_start=pos,
        forward_end=pos + 1,
        write_from=pos,
        cached_until=pos,
        swa_cached_until=pos,
        swa_replay_start=c["zeros"],
        encoder_window_floor=c["zeros"],
        tail_start=c["minus1"],
        last_rows=rows,
        history_ids=c["history"],
        history_from_plan=c["false"],
        tail_rows=rows,
        tail_batch_ids=rows,
        layer_rows=c["layer_rows"],
        stages=c["stages"],
        compress={r: _compress_one_row(pos, r) for r, _sigs in st.owner_ratios},
        table=table,
    )


def plan_step(
    step: StepInput | StepArrays,
    spec,
    *,
    decoder_replay: bool | None = None,
    encoder_replay: bool | None = None,
    table=None,
) -> StepPlan:
    """Plan one forward of ``step`` under ``spec`` (a ``CacheSpec``).

    ``decoder_replay``/``encoder_replay`` override the spec's replay rules (the runtime flags);
    ``table`` is a ``StageTable`` to use instead of the generated (or derived) one. Raises
    ``PlanError`` for an invalid step.
    """
    rules = spec.replay
    dec_on = rules.decoder_swa_bounded_replay if decoder_replay is None else decoder_replay
    enc_on = rules.encoder_swa_bounded_replay if encoder_replay is None else encoder_replay
    if table is None:  # cached per spec object and switches by stage_table itself
        table = stage_table(spec, decoder_replay=dec_on, encoder_replay=enc_on)
    st = _static(spec, table)
    a = step if isinstance(step, StepArrays) else step_arrays(step)
    n = len(a.slots)
    _check(a, spec, enc_on)
    if (
        _DECODE_FAST
        and n
        and a.running_bs in (None, n)
        and a.running_tokens in (None, n)
        and bool(a.is_decode.all())
        and bool((a.chunk_lens == 1).all())
    ):
        c = _decode_constants(st, n, rules.replay_history_tokens)
        if c is not None:
            return _plan_decode(a, spec, table, st, c)
    W = spec.dims.sliding_window

    end = a.starts + a.chunk_lens
    all_decode = bool(a.is_decode.all())
    full = a.full_rows
    full_any = full is not None and bool(full.any())
    dec_req = dec_on & ~full if full_any else dec_on  # decoder replay, per request when it differs
    if all_decode:  # decode never backs off: skip the replay arithmetic on the hot path
        zeros = np.zeros(n, dtype=np.int64)
        no = np.zeros(n, dtype=bool)
        rp = {"forward_start": a.starts, "write_from": a.starts, "cached_until": a.starts,
              "swa_cached_until": a.starts, "encoder_window_floor": zeros, "rebuild": no,
              "backed_off": no}  # fmt: skip
    else:
        rp = replay_arrays(
            a.starts, a.prompt_lens, a.is_decode, a.fresh_slot,
            hash_block=rules.hash_block_tokens, min_final_rows=rules.min_final_prefill_rows,
            encoder_replay=enc_on, decoder_replay=dec_req,
        )  # fmt: skip
    fs = rp["forward_start"]
    lens = end - fs
    total = int(lens.sum())
    bs = n if a.running_bs is None else int(a.running_bs)
    width = total if a.running_tokens is None else int(a.running_tokens)
    if bs < n:
        raise PlanError(f"running_bs {bs} is smaller than the {n} scheduled requests")
    if width < total:
        raise PlanError(f"running_tokens {width} is smaller than the {total} scheduled rows")

    one_row = all_decode and total == n  # every request decodes one row: row i is request i
    if all_decode:
        final = np.zeros(n, dtype=bool)
        phase = np.full(n, _PHASE_DECODE, dtype=np.int64)
    else:
        final = ~a.is_decode & (end == a.prompt_lens)
        every_row = a.is_decode | full if full_any else a.is_decode
        phase = np.where(every_row, _PHASE_DECODE, np.where(final, _PHASE_FINAL, _PHASE_NONFINAL))
    has_tail = final & dec_req
    tail_lo = np.maximum(fs, end - W)

    # Per token.
    cu = np.empty(bs + 1, dtype=np.int32)
    cu[0] = 0
    if one_row:
        cu[: n + 1] = np.arange(n + 1)
        req = cu[:n].copy()
        pos = fs.astype(np.int64)
    else:
        np.cumsum(lens, out=cu[1 : n + 1])
        req = np.repeat(np.arange(n, dtype=np.int32), lens)
        pos = np.arange(total, dtype=np.int64) + np.repeat(fs - cu[:n], lens)
    cu[n + 1 :] = total
    batch_ids = np.full(width, -1, dtype=np.int32)
    batch_ids[:total] = req
    if width == total:
        positions = pos
    else:
        positions = np.zeros(width, dtype=np.int64)
        positions[:total] = pos
    visible = {}
    for r in st.ratios:
        if width == total:
            visible[r] = _div(pos + 1, r)
        else:
            v = np.zeros(width, dtype=np.int64)
            v[:total] = _div(pos + 1, r)
            visible[r] = v

    # Row sets, per request a suffix of its rows: every set of a request starts at an offset
    # into its rows (all 0, tail tail_lo - fs, last lens - 1, none lens), so the rows of a
    # table signature (one set per phase) are one ragged range build over requests.
    last_rows_real = cu[1 : n + 1] - 1
    offsets = {
        "all": np.zeros(n, dtype=np.int64),
        "tail": tail_lo - fs,
        "last": lens - 1,
        "none": lens,
    }
    everything = np.arange(total, dtype=np.int32)

    def rows_of(sig: tuple) -> np.ndarray:
        used = {name for name, here in zip(sig, present, strict=True) if here}
        if used <= {"all"}:
            return everything if used else _EMPTY
        if len(used) == 1:
            off = offsets[used.pop()]
        else:
            off = np.choose(phase, [offsets[name] for name in sig])
        return _ragged_ranges(cu[:n] + off, lens - off)

    if one_row:  # a decode row is its request's last row, its tail and all of it
        sig_arrays = {
            sig: _EMPTY if sig[_PHASE_DECODE] == "none" else everything for sig in st.sigs
        }
    else:
        present = tuple(c > 0 for c in np.bincount(phase, minlength=3).tolist())
        sig_arrays = {sig: rows_of(sig) for sig in st.sigs}
    layer_rows = LayerRows(st.key_index, tuple(sig_arrays[sig] for sig in st.sigs))
    stages = []
    for name, first, last, sub_sigs, comp_sigs in st.stages:
        stage_rows = {sub: sig_arrays[sig] for sub, sig in sub_sigs}
        stage_rows["compress"] = _union([sig_arrays[sig] for sig in comp_sigs])
        stages.append(StageRows(name, first, last, stage_rows))

    # Tail gather (QueryRows): tails of finishing requests plus decode rows.
    if all_decode:
        tail_rows, tail_batch_ids = everything, batch_ids[:total]
    else:
        tail_off = np.where(has_tail, tail_lo - fs, np.where(phase == _PHASE_DECODE, 0, lens))
        tail_rows = _ragged_ranges(cu[:n] + tail_off, lens - tail_off)
        tail_batch_ids = np.repeat(np.arange(n, dtype=np.int32), lens - tail_off)

    # Compress plans per ratio: per request the closing groups j in [lo // r, end // r) with
    # lo = max(forward_start, write_from), built from counts without a per-token scan.
    compress = {}
    lo = np.maximum(fs, rp["write_from"])
    row0 = cu[:n] - fs  # flat row of position p of request i is row0[i] + p
    # A group straddling the point where rows start reading the slot's state takes its first
    # member from the slot's tail (exact), not from a recomputed row of a backed-off forward.
    scu = np.asarray(rp["swa_cached_until"], dtype=np.int64)
    for r, comp_sigs in st.owner_ratios:
        if one_row and len(_union([sig_arrays[sig] for sig in comp_sigs])) == total:
            compress[r] = _compress_one_row(pos, r)
            continue
        j_lo = _div(lo, r)
        count = np.maximum(_div(end, r) - j_lo, 0)
        crow = _ragged_ranges(j_lo, count, np.int64)
        rows_r = (np.repeat(row0, count) + crow * r + (r - 1)).astype(np.int32)
        bids = np.repeat(np.arange(n, dtype=np.int32), count)
        first = crow * r
        allowed = _union([sig_arrays[sig] for sig in comp_sigs])
        if len(allowed) != total:  # a table that compresses only some rows
            keep = np.zeros(total, dtype=bool)
            keep[allowed] = True
            k = keep[rows_r]
            rows_r, bids, crow, first = rows_r[k], bids[k], crow[k], first[k]
        # Members of the group still open at the forward's end go to the FP32 tail.
        if r > 1:
            open_n = np.minimum(_mod(end, r), lens)
            store = _ragged_ranges(last_rows_real + 1 - open_n, open_n)
            store_bids = np.repeat(np.arange(n, dtype=np.int32), open_n)
        else:
            store, store_bids = _EMPTY, _EMPTY
        compress[r] = CompressPlan(
            ratio=r,
            rows=rows_r,
            batch_ids=bids,
            compressed_rows=crow,
            rope_positions=first,
            first_from_tail=first < np.repeat(scu, count)
            if len(allowed) == total
            else first < scu[bids],
            tail_store_rows=store,
            tail_store_batch_ids=store_bids,
        )

    # Per request, padded to running_bs (inputs are copied; arrays made here are not).
    def per_req(x, fill, dtype, copy=True):
        if bs == n:
            return np.array(x, dtype=dtype) if copy else np.asarray(x, dtype=dtype)
        out = np.full(bs, fill, dtype=dtype)
        out[:n] = x
        return out

    bt_width = a.block_tables.shape[1] if a.block_table_width is None else int(a.block_table_width)
    if bt_width < a.block_tables.shape[1] and (a.block_tables[:, bt_width:] >= 0).any():
        raise PlanError(f"block_table_width {bt_width} is narrower than a request's block table")
    if bs == n and bt_width == a.block_tables.shape[1]:
        block_tables = a.block_tables.astype(np.int32)
    else:
        block_tables = np.full((bs, bt_width), -1, dtype=np.int32)
        k = min(bt_width, a.block_tables.shape[1])
        block_tables[:n, :k] = a.block_tables[:, :k]

    h = rules.replay_history_tokens
    history = np.full((bs, h), -1, dtype=np.int64)
    if all_decode:  # decode reads its history from the cursor and never floors windows
        from_plan = np.zeros(n, dtype=bool)
        swa_replay_start = enc_floor = np.zeros(n, dtype=np.int64)
        tail_start = np.full(n, -1, dtype=np.int64)
    else:
        from_plan = ~a.is_decode & (a.fresh_slot | rp["backed_off"])
        enc_floor = np.where(a.is_decode, 0, rp["encoder_window_floor"])
        swa_replay_start = np.where(has_tail, tail_lo, enc_floor)
        tail_start = np.where(has_tail, tail_lo, -1)
    if a.token_ids is not None and h > 0 and not all_decode:
        for i in np.flatnonzero(from_plan & (fs > 0)):
            ids = a.token_ids[i]
            if ids is None:
                continue
            ids = np.asarray(ids, dtype=np.int64)
            want = np.arange(int(fs[i]) - h, int(fs[i]))
            ok = (want >= 0) & (want < len(ids))
            history[i, ok] = ids[want[ok]]

    kind = (
        "decode" if all_decode else ("prefill_replay" if len(table.stage_bounds) > 1 else "prefill")
    )
    return StepPlan(
        running_bs=bs,
        running_tokens=width,
        scheduled_bs=n,
        scheduled_tokens=total,
        graph_key=(kind, bs, width),
        decoder_replay=bool(dec_on and (phase != _PHASE_DECODE).any()),
        positions=positions,
        batch_ids=batch_ids,
        visible=visible,
        cu_seqlens_q=cu,
        slots=per_req(a.slots, -1, np.int32),
        block_tables=block_tables,
        is_final_chunk=per_req(final | a.is_decode, False, bool, False),
        is_decode=per_req(a.is_decode, False, bool),
        row_phase=per_req(phase, -1, np.int8),
        prompt_lens=per_req(a.prompt_lens, 0, np.int64),
        resume_points=per_req(a.starts, 0, np.int64),
        prefix_hits=per_req(a.prefix_hits, 0, np.int64),
        forward_start=per_req(fs, 0, np.int64),
        forward_end=per_req(end, 0, np.int64, False),
        write_from=per_req(rp["write_from"], 0, np.int64),
        cached_until=per_req(rp["cached_until"], 0, np.int64),
        swa_cached_until=per_req(rp["swa_cached_until"], 0, np.int64),
        swa_replay_start=per_req(swa_replay_start, 0, np.int64, False),
        encoder_window_floor=per_req(enc_floor, 0, np.int64, False),
        tail_start=per_req(tail_start, -1, np.int64, False),
        last_rows=per_req(last_rows_real, -1, np.int32),
        history_ids=history,
        history_from_plan=per_req(from_plan, False, bool, False),
        tail_rows=tail_rows,
        tail_batch_ids=tail_batch_ids,
        layer_rows=layer_rows,
        stages=tuple(stages),
        compress=compress,
        table=table,
    )
