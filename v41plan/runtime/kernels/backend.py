"""The kernel backend interface: one small op per pool-touching operation.

Every op takes tensors and ints only (no Python objects that carry data, no callbacks), never
calls ``.item()``, never syncs with the host and never produces a data-dependent shape, so a
decode forward built from these ops can be captured. Every scatter bails on sentinels itself:
a row with batch id / slot -1, a negative plan row or a position below its write bound is
redirected to the pool's sink row and writes back what that row already holds.

``torch_ref.TorchBackend`` implements the interface with plain torch (CPU, and the GPU
baseline); any other backend (Triton on CUDA, a ROCm one) implements the same methods.

Shapes: ``T`` rows of the flat token batch (the graph key's ``running_tokens``), ``B``
requests (``running_bs``), ``P`` block-table columns, ``K`` top-k width, ``W`` window.
"""

from __future__ import annotations

from typing import Protocol

import torch


class RingWrite(Protocol):
    """Window-KV ring writes."""

    def ring_write(
        self,
        ring: torch.Tensor,
        kv: torch.Tensor,
        slot: torch.Tensor,
        position: torch.Tensor,
        write_from: torch.Tensor,
        sink_slot: int,
    ) -> None:
        """Write window-KV rows ``kv [T, head_dim]`` into one layer's rings ``ring [slots+1, R,
        width]``
        at ``(slot[T], position mod R)``; rows with ``slot < 0`` or ``position < write_from[T]``
        write nothing. Packs to the ring's format (bf16, or E4M3 + E8M0/32 bytes)."""


class CompressGroups(Protocol):
    """Ratio-2 group pairing with the FP32 compressor tails."""

    def compress_groups(
        self,
        values: torch.Tensor,
        scores: torch.Tensor,
        position: torch.Tensor,
        slot: torch.Tensor,
        first_row: torch.Tensor,
        last_row: torch.Tensor,
        tail_values: torch.Tensor,
        tail_scores: torch.Tensor,
        sink_slot: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio-2 compressor tails: every row's fp32 projections ``values/scores [T, d]`` are
        paired with the group's first token, taken from the forward (row - 1) or, where
        ``first_row`` is set, from the slot's tail. Returns ``(pair_values, pair_scores)
        [T, 2, d]`` (meaningful on rows whose position is odd), then stores the rows flagged by
        ``last_row`` into their slot's tail. ``first_row [T]`` flags the closing rows whose first
        member lies below the point the forward reads the slot's state from (the forward's start,
        or the resume point of a backed-off forward); ``last_row [T]`` flags the first members
        of groups still open at the forward's end (the planner's tail-store rows)."""


class MainScatter(Protocol):
    """Compressed main-KV row stores."""

    def main_scatter(
        self,
        plane: torch.Tensor,
        latent: torch.Tensor,
        page: torch.Tensor,
        row: torch.Tensor,
        keep: torch.Tensor,
        sink_page: int,
    ) -> None:
        """Store compressed latents ``latent [T, d]`` (already on the model's grid) at
        ``(page, row)`` of a main plane; rows with ``keep`` false (not a group boundary, a group
        ending below ``write_from``, a sentinel) write nothing. bf16 or FP4 E2M1 + E4M3/16."""


class IndexKeyStore(Protocol):
    """Index-key stores into the index plane(s)."""

    def index_key_store(
        self,
        planes: tuple[torch.Tensor, ...],
        key: torch.Tensor,
        key_scale: torch.Tensor | None,
        page: torch.Tensor,
        row: torch.Tensor,
        keep: torch.Tensor,
        sink_page: int,
    ) -> None:
        """Store index keys ``key [T, d_ih]`` produced by the shared key chain (norm, RoPE) and
        its plane rounding: fp8 E4M3 code values with the fp32 row scale ``key_scale [T, 1]``
        (one plane), fp4 values on the E2M1/E8M0-32 grid (values and scales planes)."""


class Scorer(Protocol):
    """The paged index scorer (one per plane format) and candidate blocks."""

    def score_topk(
        self,
        planes: tuple[torch.Tensor, ...],
        q: torch.Tensor,
        weights: torch.Tensor,
        bound: torch.Tensor,
        pages: torch.Tensor,
        topk: int,
        candidates: torch.Tensor | None,
    ) -> torch.Tensor:
        """Score every query row ``q [T, H, d_ih]`` (rotated, not rounded: the scorer quantizes
        it to the plane's grid) against the index rows of its own page list ``pages [T, P]``
        read in place, with its own visibility bound ``bound [T]`` (``(pos+1)//ratio``) and an
        optional candidate mask ``[T, P*rows_per_page]``. Returns top-``topk`` ids ``[T, K]``:
        ties to the smaller position, ascending, -1 padded."""

    def score_candidates_topk(
        self,
        planes: tuple[torch.Tensor, ...],
        q: torch.Tensor,
        weights: torch.Tensor,
        bound: torch.Tensor,
        pages: torch.Tensor,
        topk: int,
        block_rows: int,
        topk_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The candidate source: its own (unrestricted) top-k and the candidate mask, one
        scoring."""

    def candidate_blocks(
        self, scores: torch.Tensor, bound: torch.Tensor, block_rows: int, topk_blocks: int
    ) -> torch.Tensor:
        """Candidate mask ``[T, N]`` from scores ``[T, N]``: top ``topk_blocks`` blocks by their max
        score, the block of the newest visible row forced in, ties to the smaller block."""


class AttentionGather(Protocol):
    """Sparse-attention key gathers: window rows and selected compressed rows."""

    def gather_window(
        self,
        ring: torch.Tensor,
        kv: torch.Tensor,
        rows: torch.Tensor,
        slot: torch.Tensor,
        position: torch.Tensor,
        window_lo: torch.Tensor,
        ring_until: torch.Tensor,
        window: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys of query rows ``rows [Tq]`` (flat rows): positions ``[max(window_lo,
        pos-W+1), pos]``, those below ``ring_until`` read from the ring, the rest from this
        forward's rows ``kv [T, d]`` (a request's rows are contiguous). Returns ``(keys
        [Tq, W, d], valid [Tq, W])``."""

    def gather_selected(
        self,
        plane: torch.Tensor,
        ids: torch.Tensor,
        pages: torch.Tensor,
        rows_per_page: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected compressed rows ``ids [T, K]`` (-1 = none) of each row's page list
        ``pages [T, P]``, dequantized: ``(rows [T, K, d], valid [T, K])``. Reads only the
        selected rows, never the whole history."""


class SparseAttention(Protocol):
    """Sparse attention of query rows over their window and selected compressed rows, reading
    the ring and the main plane in place (the fused form of the two gathers and the softmax)."""

    def sparse_attention(
        self,
        q: torch.Tensor,
        sink: torch.Tensor,
        scale: float,
        ring: torch.Tensor,
        kv: torch.Tensor,
        rows: torch.Tensor,
        slot: torch.Tensor,
        position: torch.Tensor,
        window_lo: torch.Tensor,
        ring_until: torch.Tensor,
        window: int,
        plane: torch.Tensor | None,
        ids: torch.Tensor | None,
        pages: torch.Tensor | None,
        rows_per_page: int,
        out: torch.Tensor,
    ) -> None:
        """Write ``out [Tq, H, d]`` (``q``'s dtype): attention of ``q [Tq, H, d]`` (RoPE applied)
        over each row's keys, which are also its values (MQA over one latent):

        - its window, positions ``[max(window_lo, pos - W + 1), pos]`` (``W = window``): those
          below ``ring_until [Tq]`` from ``ring [slots+1, R, width]`` at ``(slot, p mod R)``
          (bf16, or E4M3 + E8M0/32 bytes), the others from this forward's rows ``kv [T, d]``,
          position ``p`` at flat row ``rows[i] - (pos - p)``; a row with ``slot < 0`` has none;
        - its selected compressed rows ``ids [Tq, K]`` (-1: none; ``plane`` None for a
          window-only layer): row ``c`` at ``(pages[i, c // rows_per_page], c % rows_per_page)``
          of ``plane [pages+1, rows_per_page, width]`` (bf16, or FP4 E2M1 + E4M3/16 bytes); a
          missing page (-1) is no key.

        Logits ``q . k * scale``; the per-head sink ``sink [H]`` adds ``exp(sink)`` to the
        denominator only; a row with no key gets 0. Accumulates in float32 (float64 for float64
        inputs); probabilities are not rounded."""


class CursorWrite(Protocol):
    """The cursor commit after a forward."""

    def cursor_write(
        self, cursor: torch.Tensor, slot: torch.Tensor, values: torch.Tensor, sink_slot: int
    ) -> None:
        """Commit ``[position, Engram history...]`` per request after the forward; slot -1
        skipped."""


class CheckpointCopy(Protocol):
    """Checkpoint image byte copies."""

    def copy_spans(
        self, backing: torch.Tensor, src: list[int], dst: list[int], nbytes: list[int]
    ) -> None:
        """Copy ``backing[src[i] : src[i] + nbytes[i]]`` to ``dst[i]`` for each span, in order,
        on the device (no host sync): a checkpoint schedule's spans between STATE fields and
        PAGE units (no span's destination overlaps a later span's source)."""


class KernelBackend(
    RingWrite,
    CompressGroups,
    MainScatter,
    IndexKeyStore,
    Scorer,
    AttentionGather,
    SparseAttention,
    CursorWrite,
    CheckpointCopy,
    Protocol,
):
    """Everything the runtime model asks of a kernel backend."""

    name: str


BACKEND_RANGE = "backend."
"""Prefix of the ``record_function`` range around each backend op (``RangedBackend``) and the
grouped expert product, so a ``torch.profiler`` trace tells their kernels from the dense
pieces'."""


class RangedBackend:
    """``backend`` with each op run inside a ``record_function`` range ``backend.<op>``.

    The ranges cost a dispatcher call each in eager steps and nothing inside a graph replay, so
    they are opt-in (``RuntimeModel.label_backend_ops``, ``V41PLAN_PROFILE_RANGES=1``)."""

    def __init__(self, backend):
        self.inner = backend
        self.name = backend.name

    def __getattr__(self, op: str):
        attr = getattr(self.inner, op)
        if not callable(attr):
            return attr

        def ranged(*args, **kwargs):
            with torch.profiler.record_function(BACKEND_RANGE + op):
                return attr(*args, **kwargs)

        return ranged
