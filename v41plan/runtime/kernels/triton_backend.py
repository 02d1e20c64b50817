"""``TritonBackend``: the kernel backend's ops as Triton kernels reading the pools in place.

Same signatures and semantics as ``torch_ref.TorchBackend`` (the reference, and the CPU path),
which this class extends: an op falls back to the torch implementation where its kernel does
not apply (float64 inputs, the parity mode that the fp32-accumulating kernels do not
reproduce; tensors neither on CUDA nor under ``TRITON_INTERPRET=1``; a shape a kernel does not
take, named at each fallback). Under the interpreter the kernels run on CPU tensors, which is
how the CPU tests compare them with the reference.

What is exact and what is not:

- the scatters (ring, main plane, index keys, tails, cursor) write the reference's bytes, and
  never write the sink page or slot (the reference writes the sink's own bytes back);
- the scorer rounds the query as the reference does (``quant_fp8_rows`` / ``fake_fp4``) and
  computes the products exactly (every operand is on a grid bf16 holds) with fp32 sums in
  another order, so a score may differ from the reference's in its last bits; the top-k of a
  given score matrix is exact (ties to the smaller position, ids ascending, -1 padded);
- sparse attention accumulates in fp32 (bf16 operands for bf16 inputs, fp32 operands for
  fp32 inputs): against the reference ``|out - ref| <= 1e-5 + 1e-5 |ref|`` in float32 and
  ``<= 2e-2 + 2e-2 |ref|`` in bfloat16 (the probabilities are rounded to bf16 for the second
  product, as the published kernels do).

Everything is capturable: shapes are fixed by the arguments, every bound, length and id is
read on the device, and nothing syncs with the host. ``gather_window``, ``gather_selected`` and
``copy_image`` stay the torch ones (the fused ``sparse_attention`` replaces the two gathers).
Under the interpreter, ``triton_common.patch_interpreter()`` must be in place (tensor loop
bounds; see there). ``scripts/triton_compile_check.py`` compiles every launch for sm_90
without a GPU and reports registers, spills and shared memory.
"""

from __future__ import annotations

import torch

from v41plan.model import quant as Q
from v41plan.runtime.kernels import triton_attention as A
from v41plan.runtime.kernels import triton_scatter as S
from v41plan.runtime.kernels import triton_scorer as SC
from v41plan.runtime.kernels.torch_ref import TorchBackend, plane_format
from v41plan.runtime.kernels.triton_common import interpreted, next_pow2, pdl_launch

_FLOAT = (torch.float32, torch.bfloat16)
_INTERPRETED = interpreted(S.ring_write_kernel)
"""Whether this process decorated the kernels under ``TRITON_INTERPRET=1`` (they then take CPU
tensors, and only CPU tensors)."""

RESOLVE_SELECTED = True
"""Whether attention launches over a main plane resolve each selected id to its row's offset
in the plane before the block loop (the kernel's ``RESOLVE``), those with bf16 operands at three
stages where the device's shared memory holds them (``attention_stages``; fp32 ones keep one):
a block's key copy then waits on no load of the loop, and both loops keep the next block's keys
in flight through a block's products. sm_90 build of the 64-row flash form
(``scripts/check_dense_kernels_sm90.py --only "SPLITS=2" --mma-layouts``): no spills (without:
128 bytes) and one copy group in flight at each loop's wait (without: none). H100, flash widths,
8K context: decode attention at 64 rows 0.0651 -> 0.0458 ms, prefill 8K 5.52 -> 3.79 ms
(reports/gpu/bench_kernels_attn_scorer_h100_274a82b.json,
bench_kernels_prefill_sweep_h100_274a82b.json); the flash_slice decode step at batch 64 28.17
-> 27.66 ms (bench_decode_flash_slice_b64_resolve_h100_274a82b.json)."""


BALANCED_SPLITS = True
"""Whether an attention launch whose keys split (flash decoding) gives each split an equal
share of the row's own key blocks (the kernel's ``BALANCE``), not a fixed share of every block
the shapes allow: at 256 tokens of context a 64-row flash_slice decode step's rows hold 4
window blocks and 1-2 selected ones, which the fixed shares put all in the first of two splits.
H100, with ``RESOLVE_SELECTED``: that step 27.66 -> 27.29 ms; the 8K sweep row, where the fixed
shares are already even, 0.0458 -> 0.0467 ms."""


def resolves_selected(cfg: dict, plane: torch.Tensor | None) -> bool:
    """Whether an attention launch of ``cfg`` resolves its selected ids first (``RESOLVE``):
    asked for, over a main plane whose page and row strides are multiples of 16 elements (the
    kernel keeps offsets in 16-element units, so its key loads stay 16-byte copies)."""
    return (
        bool(cfg.get("RESOLVE"))
        and plane is not None
        and plane.stride(0) % 16 == 0
        and plane.stride(1) % 16 == 0
    )


def _bits16(t: torch.Tensor) -> torch.Tensor:
    """An int16 view of a bf16 tensor (stores write rounded bit patterns)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _vec(t: torch.Tensor) -> torch.Tensor:
    """A per-row vector as a contiguous tensor (a no-op for the runtime's own vectors)."""
    return t.contiguous()


class TritonBackend(TorchBackend):
    """Triton kernels over the pools' typed views (see ``backend.KernelBackend``)."""

    name = "triton"

    def __init__(self, num_sms: int | None = None):
        self._num_sms = num_sms
        self.fallbacks: set[str] = set()
        """Names of the ops that fell back to the torch implementation at least once."""

    # -- dispatch -----------------------------------------------------------------------------
    def _runs(self, op: str, *tensors: torch.Tensor | None) -> bool:
        """Whether ``op``'s kernel runs on these tensors; records a fallback otherwise."""
        ts = [t for t in tensors if t is not None]
        if _INTERPRETED:
            ok = all(t.device.type == "cpu" for t in ts)
        else:
            ok = all(t.is_cuda for t in ts)
        ok = ok and not any(t.dtype == torch.float64 for t in ts)
        if not ok:
            self.fallbacks.add(op)
        return ok

    def num_sms(self, device: torch.device) -> int:
        """Streaming multiprocessors of ``device`` (132 on the H200; 4 under the interpreter,
        which keeps the test grids small)."""
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 4
        return self._num_sms

    def shared_bytes(self, device) -> int | None:
        """Shared memory a program may take on ``device`` (the multiprocessor's less the 1 KB
        the driver keeps: 227 KB on sm_90, 163 KB on sm_80); ``None`` (no limit) off CUDA."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor - 1024

    def attention_stages(self, hb: int, bn: int, d: int, device) -> int:
        """Stages of a resolved bf16 attention launch: three where the query tile, three key
        blocks and the 4 KB of the rest fit the device's shared memory (sm_90 builds of the
        flash form: 168 KB at three, 135 KB at two), else two."""
        limit = self.shared_bytes(device)
        need = 2 * hb * d + 3 * 2 * bn * d + 4096
        return 3 if limit is None or need <= limit else 2

    # -- rings ----------------------------------------------------------------------------
    def ring_write(self, ring, kv, slot, position, write_from, sink_slot):
        t, d = kv.shape
        if not self._runs("ring_write", ring, kv) or t == 0:
            if t:
                super().ring_write(ring, kv, slot, position, write_from, sink_slot)
            return
        fp8 = ring.dtype == torch.uint8
        dst = ring if fp8 else _bits16(ring)
        assert ring.stride(2) == 1 and kv.stride(1) == 1
        S.ring_write_kernel[(t,)](
            dst,
            ring.stride(0),
            ring.stride(1),
            kv,
            kv.stride(0),
            _vec(slot),
            _vec(position),
            _vec(write_from),
            sink_slot,
            ring.shape[1],
            D=d,
            BLOCK_D=next_pow2(d),
            FP8=fp8,
        )

    # -- compressor ---------------------------------------------------------------------------
    def compress_groups(
        self,
        values,
        scores,
        position,
        slot,
        first_row,
        last_row,
        tail_values,
        tail_scores,
        sink_slot,
    ):
        t, d = values.shape
        same = values.dtype == scores.dtype == tail_values.dtype == torch.float32
        if not (self._runs("compress_groups", values, tail_values) and same) or t == 0:
            return super().compress_groups(
                values,
                scores,
                position,
                slot,
                first_row,
                last_row,
                tail_values,
                tail_scores,
                sink_slot,
            )
        values, scores = values.contiguous(), scores.contiguous()
        assert tail_values.stride() == tail_scores.stride() and tail_values.stride(1) == 1
        pair_v = torch.empty(t, 2, d, dtype=torch.float32, device=values.device)
        pair_s = torch.empty_like(pair_v)
        slot = _vec(slot)
        common = {"D": d, "BLOCK_D": next_pow2(d)}
        S.compress_pairs_kernel[(t,)](
            values,
            scores,
            values.stride(0),
            slot,
            _vec(first_row),
            tail_values,
            tail_scores,
            tail_values.stride(0),
            pair_v,
            pair_s,
            pair_v.stride(0),
            sink_slot,
            **common,
        )
        S.tail_store_kernel[(t,)](
            values,
            scores,
            values.stride(0),
            slot,
            _vec(position),
            _vec(last_row),
            tail_values,
            tail_scores,
            tail_values.stride(0),
            sink_slot,
            **common,
        )
        return pair_v, pair_s

    def main_scatter(self, plane, latent, page, row, keep, sink_page):
        t, d = latent.shape
        if not self._runs("main_scatter", plane, latent) or t == 0:
            if t:
                super().main_scatter(plane, latent, page, row, keep, sink_page)
            return
        fp4 = plane.dtype == torch.uint8
        assert plane.stride(2) == 1 and latent.stride(1) == 1
        S.main_scatter_kernel[(t,)](
            plane if fp4 else _bits16(plane),
            plane.stride(0),
            plane.stride(1),
            latent,
            latent.stride(0),
            _vec(page),
            _vec(row),
            _vec(keep),
            sink_page,
            D=d,
            BLOCK_D=next_pow2(d),
            FP4=fp4,
        )

    # -- index plane --------------------------------------------------------------------------
    def index_key_store(self, planes, key, key_scale, page, row, keep, sink_page):
        t, d = key.shape
        fp4 = plane_format(planes) == "fp4"
        scale = None if fp4 else key_scale
        if not self._runs("index_key_store", *planes, key, scale) or t == 0:
            if t:
                super().index_key_store(planes, key, key_scale, page, row, keep, sink_page)
            return
        plane = planes[0]
        sp = planes[1] if fp4 else planes[0]
        assert plane.stride(2) == 1 and sp.stride(2) == 1 and key.stride(1) == 1
        if not fp4:
            scale = key_scale.reshape(t, -1)
            # the fp32 row scale sits in each row's last 4 bytes
            assert (plane.data_ptr() + d) % 4 == 0 and plane.stride(0) % 4 == 0
            assert plane.stride(1) % 4 == 0
        S.index_key_store_kernel[(t,)](
            plane,
            plane.stride(0),
            plane.stride(1),
            sp,
            sp.stride(0),
            sp.stride(1),
            key,
            key.stride(0),
            key if fp4 else scale,
            0 if fp4 else scale.stride(0),
            _vec(page),
            _vec(row),
            _vec(keep),
            sink_page,
            D=d,
            BLOCK_D=next_pow2(d),
            FP4=fp4,
        )

    # -- cursor -------------------------------------------------------------------------------
    def cursor_write(self, cursor, slot, values, sink_slot):
        b, width = values.shape
        if not self._runs("cursor_write", cursor, values) or b == 0 or cursor.dtype != torch.int64:
            if b:
                super().cursor_write(cursor, slot, values, sink_slot)
            return
        assert cursor.stride(1) == 1 and values.stride(1) == 1
        S.cursor_write_kernel[(b,)](
            cursor,
            cursor.stride(0),
            values,
            values.stride(0),
            _vec(slot),
            sink_slot,
            WIDTH=width,
            BLOCK=next_pow2(width),
        )

    # -- scorer -------------------------------------------------------------------------------
    score_chunk = 512
    """Keys one scorer program covers at least (more where a row would take more than
    ``score_row_programs`` programs); a row's programs past its bound return at once."""
    score_row_programs = 16
    """Most programs a row's scorer takes before the device is full: longer rows take longer
    chunks (H100, 64 decode rows, flash fp8 64K: 32,768 keys in 2,048-key chunks 149 us against
    162 in 512-key ones; medium 8K: 4,096 keys best at 512, 17.2 us against 20.1 at 2,048;
    reports/gpu/bench_kernels_fused_select_h100_abf3e65.json). 0: ``score_chunk`` alone."""
    score_block = 64
    """Keys per scorer tile (the dot's N). 64 against 32: H100, 64 decode rows, fp8 plane,
    medium 8K 17.1 us against 20.8, flash 64K 163 us against 196
    (reports/gpu/bench_kernels_scorer_select_h100_5a10653.json); the sm_90 build copies a
    tile's codes whole and converts them in hardware, so the wider tile does not spill."""
    score_fill_sms = True
    """Halve a program's keys (down to ``score_block``) while the scorer's programs are fewer
    than the device's multiprocessors. A decode over a short context is otherwise one program
    a row walking its tiles in turn: at batch 1 and 256 tokens one program on 132 SMs, 28 us a
    call in the flash_slice decode step (reports/gpu/bench_decode_flash_slice_h100_eded2c3.json;
    the split alone is untimed: ``bench_kernels.py --only "scorer short"``)."""
    select_chunk = 2048
    """Elements the select kernel holds per step of a pass."""
    select_warps = 8
    """Warps of a one-program-a-row select. A decode batch's rows are fewer programs than the
    GPU has multiprocessors, so each pass's histogram (about 90 sm_90 instructions an element)
    runs on one program's warps alone; more warps share a chunk's elements (H100, 64 rows of
    4,096 keys: 4 warps 22.9 us, 8 20.7, 16 20.6, 32 at 32,768 slower;
    reports/gpu/bench_kernels_select_h100_6e6039c.json)."""
    select_warps_from = 2048
    """Shortest row that takes ``select_warps``; shorter rows (a decode over a short context:
    128 keys at 256 tokens) keep 4 warps, the form the decode step was measured with."""
    select_programs = 0
    """Programs a row's top-k select takes: 0 by the row's length and the device
    (``select_segments_for``); n >= 1 that many (1: one program a row)."""
    select_resident_max = 8192
    """Longest row (elements, rounded up to a power of two) whose ids one program selects with
    the row held in registers (``select_resident_kernel``: one read, a compare and a sum a
    bit); longer rows, with ``select_programs`` 0, take the long-row select over segments of
    this many (``_select_long``). 0: the digit select (``select_kernel``) or its segments for
    every row, as block mode always. 8,192 (16,384 spills in the sm_90 build): H100, 64 rows,
    4,096 keys 12.5 us against 20.5 for the digit select, 32,768 keys 65 us against 105 for
    its segments (reports/gpu/bench_kernels_scorer_select_h100_5a10653.json)."""
    select_early_exit = True
    """The resident and long-row selects stop their bit-at-a-time search at the first threshold
    with exactly k keys at or above it (``_kth_key``'s ``EARLY``: a loop of up to 32 steps in
    place of 32 unrolled ones). H100, 64 rows: 4,096 keys 11.5 us against 12.4, 32,768 keys
    54.7 against 61.3; score + top-k flash 64K 197 against 211 us
    (reports/gpu/bench_kernels_select_early_h100_52d304f.json)."""
    select_loose_bounds = True
    """With ``select_early_exit``, the long-row select's segment programs stop at a bound with
    ``k`` to ``2k`` (their list's room) keys at or above it instead of their exact k-th key
    (``select_bound_kernel``'s ``LOOSE``). H100, 64 rows of 32,768 keys: 45.5 us against 54.6
    (reports/gpu/bench_kernels_select_ternary_h100_bf39bbe.json)."""
    select_ternary = True
    """With ``select_early_exit``, the resident and long-row selects count two thresholds a
    step (``_kth_key``'s ``TERNARY``: 16 steps where the bit search took 24 at 4,096 keys, each
    a second compare an element). H100, 64 rows: 4,096 keys 10.1 us against 11.5; with loose
    bounds 32,768 keys 43.7 against 45.5; score + top-k flash 64K 187 against 197 us
    (reports/gpu/bench_kernels_select_ternary_h100_bf39bbe.json)."""
    select_lists_held = True
    """The long-row select's final program selects from its segments' lists loaded at once and
    held in registers (up to 16,384 entries, where none overflowed), not from a list it writes,
    reads back and gathers the scores of (``select_final_kernel``'s ``HELD``). H100, 64 rows of
    32,768 keys: 35.9 us against 40.5; the final launch 9.9 us eager, 23.2 before the packed
    counts and the held lists (reports/gpu/bench_kernels_select_held_h100_c911cef.json)."""
    select_packed_scan_max = 4096
    """Longest row (padded keys) whose select places its ids by one cumulative sum of the keys
    above its threshold and the ties at it packed in one int32 (else two scans). 4,096: at
    8,192 keys the packed form holds 128 registers and spills 16 bytes in the sm_90 build (110
    and none without it); H100, 64 rows of 4,096 keys: 8.9 us with the packed counts, the
    ternary search's 10.1 before them (reports/gpu/bench_kernels_select_held_h100_c911cef.json)."""
    select_thread_elems = 16
    """Keys a thread of a resident select holds (its warps: the padded row over this many a
    thread, 4 to 16 warps). H100, 64 rows of 4,096 keys: 8 a thread 9.7 us, 16 8.9, 32 9.9;
    of 32,768 keys (the segment bounds' warps) 36.0, 35.9, 34.8
    (reports/gpu/bench_kernels_select_held_h100_c911cef.json)."""
    select_segment_min = 1024
    """Fewest elements of a segment when ``select_programs`` is 0."""
    select_segment_from = 16384
    """Shortest row that splits into segments when ``select_programs`` is 0; shorter rows take
    one program. H100, 64 rows: at 4,096 keys one program 20.7 us (8 warps) against 41.6 for
    four segments; at 32,768 eight segments 105.5 us against 135 for one program (8 warps)
    (reports/gpu/bench_kernels_select_h100_6e6039c.json; the one program's digit passes end
    early, the segments' do not)."""
    score_rows: int | None = None
    """Query rows a scorer program holds (None: by the batch, ``score_tile_rows``)."""
    score_prefetch = 0
    """1: the scorer loads pages two tiles ahead and keys one, so a tile's keys arrive while
    the one before it multiplies (H200: faster at 64K keys, slower at 8K; off until a rule by
    context is measured, reports/gpu/bench_kernels_sweep*.json)."""

    score_chunk_pages = False
    """Load every scorer program's page ids before its tile loop (``chunk_pages_for``), so the
    pipeline keeps the next tile's keys in flight (sm_90 build of the flash fp8 decode form: one
    copy group in flight at the loop's wait, none without; 426 instructions a tile against 415).
    Off: chunks from ``score_chunk_pages_from`` keys only. H100, 64 decode rows, 64-key tiles:
    medium 8K (512-key chunks) 20.7 us with it against 17.0 without; flash 64K (2,048-key
    chunks) 128 against 147 (reports/gpu/bench_kernels_select_lists_h100_af67f27.json)."""
    score_chunk_pages_from = 2048
    """Shortest chunk (keys) whose page ids a program loads before its tile loop where
    ``score_chunk_pages`` is off (0: none)."""

    def score_tile_rows(self, t: int, padded_heads: int) -> int:
        """Rows a scorer program takes: one in a small batch (decode rows are of different
        requests), else enough for a 64-row dot (a prefill chunk's rows share their keys)."""
        if self.score_rows is not None:
            return self.score_rows
        return 1 if t < 256 else max(1, 64 // padded_heads)

    def score_chunk_for(self, t: int, n: int, rows: int, device) -> int:
        """Keys one scorer program covers for ``t`` query rows of ``n`` keys, ``rows`` rows a
        program: ``score_chunk`` (or the row, if shorter), doubled while a row takes more than
        ``score_row_programs``, halved while the programs are fewer than the multiprocessors
        (``score_fill_sms``). Shapes only: a capture replays it."""
        chunk = min(self.score_chunk, max(self.score_block, next_pow2(n)))
        while self.score_row_programs and triton_cdiv(n, chunk) > self.score_row_programs:
            chunk *= 2
        if self.score_fill_sms:
            row_programs = triton_cdiv(t, rows)
            sms = self.num_sms(device)
            while chunk > self.score_block and row_programs * triton_cdiv(n, chunk) < sms:
                chunk //= 2
        return chunk

    def chunk_pages_for(self, chunk: int, rpp: int) -> int:
        """Page ids a scorer program loads before its tile loop (the ``CHUNK_PAGES`` of its
        chunk of ``chunk`` keys, a power of two): with ``score_chunk_pages`` or a chunk of at
        least ``score_chunk_pages_from`` keys, where every tile lies in one page and the
        prefetch is off; else 0 (a tile's pages loaded in the loop)."""
        block = self.score_block
        from_ = self.score_chunk_pages_from
        wanted = self.score_chunk_pages or (from_ > 0 and chunk >= from_)
        if not wanted or self.score_prefetch or rpp % block or chunk % block:
            return 0
        aligned = chunk % rpp == 0 or rpp % chunk == 0  # chunks start on a page or within one
        return next_pow2(triton_cdiv(chunk, rpp) + (0 if aligned else 1))

    def _dot_bf16(self, exact_operands: bool) -> bool:
        """bf16 dot operands on the GPU when they are exact; fp32 under the interpreter (its bf16
        dot is not reliable)."""
        return exact_operands and not _INTERPRETED

    def _score(self, planes, q, weights, bound, pages, candidates, out, fill: bool) -> None:
        """Launch the scorer: ``out [T, P*rows]`` fp32 up to each row's bound (every column with
        ``fill``)."""
        t, h, d = q.shape
        fp4 = plane_format(planes) == "fp4"
        key = planes[0]
        ksc = planes[1] if fp4 else planes[0]
        rpp, n_pages = key.shape[1], pages.shape[1]
        n = rpp * n_pages
        if t == 0 or n == 0:
            return
        q, weights, pages = q.contiguous(), weights.contiguous(), pages.contiguous()
        if candidates is not None:
            candidates = candidates.contiguous()
        assert key.stride(2) == 1 and ksc.stride(2) == 1 and out.stride(1) == 1
        if not fp4:
            assert key.data_ptr() % 4 == 0 and key.stride(0) % 4 == 0 and key.stride(1) % 4 == 0
        quant = Q.fake_quant_enabled()
        cand = candidates if candidates is not None else out
        hp = max(16, next_pow2(h))
        rows = self.score_tile_rows(t, hp)
        chunk = self.score_chunk_for(t, n, rows, q.device)
        SC.score_kernel[(triton_cdiv(t, rows), triton_cdiv(n, chunk))](
            q,
            q.stride(0),
            q.stride(1),
            weights,
            weights.stride(0),
            _vec(bound),
            pages,
            pages.stride(0),
            cand,
            cand.stride(0),
            key,
            key.stride(0),
            key.stride(1),
            ksc,
            ksc.stride(0),
            ksc.stride(1),
            out,
            out.stride(0),
            t,
            h,
            n_pages,
            RPP=rpp,
            ROWS=rows,
            D=d,
            HP=hp,
            BN=self.score_block,
            CHUNK=chunk,
            FP4=fp4,
            HAS_CAND=candidates is not None,
            FILL=fill,
            QUANT=quant,
            ROUND_BF16=fp4 and q.dtype == torch.bfloat16,
            DOT_BF16=self._dot_bf16(quant or q.dtype == torch.bfloat16),
            PREFETCH=self.score_prefetch,
            CHUNK_PAGES=self.chunk_pages_for(chunk, rpp),
            **pdl_launch(q.device, t),
        )

    def _select(self, score, bound, k: int, out, block_rows: int = 0) -> None:
        """Launch the radix select over ``score [T, N]``: ids into ``out [T, k]``, or with
        ``block_rows`` the chosen blocks' row mask into ``out [T, N]``."""
        t, n = score.shape
        if t == 0 or (k == 0 and not block_rows):  # no ids asked: ``out`` has no columns
            return
        assert score.stride(1) == 1 and out.stride(1) == 1
        if not block_rows and self.select_programs == 0 and n > self.select_resident_max > 0:
            self._select_long(score, bound, k, out)
            return
        segments = 0 if block_rows else self.select_segments_for(t, n, score.device)
        if segments > 1:
            self._select_segments(score, bound, k, out, segments)
            return
        head = (score, score.stride(0), _vec(bound) if bound is not None else score)
        head += (out, out.stride(0), k, n)
        if segments == 1 and next_pow2(n) <= self.select_resident_max:
            np_ = max(16, next_pow2(n))
            SC.select_resident_kernel[(t,)](
                *head,
                HAS_BOUND=bound is not None,
                NP=np_,
                KP=next_pow2(k),
                EARLY=self.select_early_exit,
                TERNARY=self.select_ternary and np_ <= 16384,
                PACK_MAX=min(self.select_packed_scan_max, 16384),
                num_warps=self.resident_select_warps(np_),
                **pdl_launch(score.device, t),
            )
            return
        g = max(block_rows, 1)
        elems = n // g
        SC.select_kernel[(t,)](
            *head,
            HAS_BOUND=bound is not None,
            G=g,
            BLOCK_MODE=block_rows > 0,
            CHUNK=min(self.select_chunk, next_pow2(elems)),
            KP=next_pow2(k),
            num_warps=self.select_warps if elems >= self.select_warps_from else 4,
            **pdl_launch(score.device, t),
        )

    def _select_long(self, score, bound, k: int, out) -> None:
        """The top-k ids of rows longer than ``select_resident_max``: each segment of that many
        elements finds its own k-th key (held in registers), then one program a row selects
        from the keys at or above the largest of them (``triton_scorer``'s long-row select)."""
        t, n = score.shape
        seg_elems = self.select_resident_max
        segments = triton_cdiv(n, seg_elems)
        np_seg = next_pow2(seg_elems)
        # room for k candidates a segment and as many again of ties, up to what a program holds
        npc = max(16, min(np_seg, next_pow2(2 * segments * max(k, 1))))
        lc = max(16, min(np_seg, next_pow2(2 * max(k, 1))))  # a segment's list: k and ties
        sp = next_pow2(segments)
        ws = torch.empty(t, 2 * sp, dtype=torch.int32, device=score.device)
        seg = torch.empty(t, segments * 2 * lc, dtype=torch.int32, device=score.device)
        lists = torch.empty(t, npc, dtype=torch.int32, device=score.device)
        b = _vec(bound) if bound is not None else score
        has = bound is not None
        held = self.select_lists_held and sp * lc <= 16384
        SC.select_bound_kernel[(t, segments)](
            score, score.stride(0), b, ws, ws.stride(0), seg, seg.stride(0), k, n, seg_elems,
            HAS_BOUND=has, NP=np_seg, SP=sp, LC=lc, EARLY=self.select_early_exit,
            TERNARY=self.select_ternary and np_seg <= 16384, LOOSE=self.select_loose_bounds,
            num_warps=self.resident_select_warps(np_seg),
        )  # fmt: skip
        SC.select_final_kernel[(t,)](
            score, score.stride(0), b, ws, ws.stride(0), seg, seg.stride(0), lists,
            lists.stride(0), out, out.stride(0), k, n, segments, HAS_BOUND=has, SP=sp, LC=lc,
            CHUNK=min(self.select_chunk, next_pow2(n)), NPC=npc, KP=next_pow2(k),
            EARLY=self.select_early_exit, TERNARY=self.select_ternary and npc <= 16384,
            HELD=held, PACK_MAX=min(self.select_packed_scan_max, 16384),
            num_warps=self.resident_select_warps(max(npc, sp * lc) if held else npc),
        )  # fmt: skip

    def resident_select_warps(self, padded_elems: int) -> int:
        """Warps of a resident select over ``padded_elems`` (a power of two):
        ``select_thread_elems`` elements a thread, 4 to 16 warps."""
        return max(4, min(16, padded_elems // (self.select_thread_elems * 32)))

    def select_segments_for(self, t: int, n: int, device) -> int:
        """Programs a row's top-k select takes (1: one, the whole row in up to five passes). With
        ``select_programs`` 0, a row of at least ``select_segment_from`` elements splits into
        segments of at least ``select_segment_min`` elements until the programs fill the device
        twice over; a fixed count otherwise (shapes only, so a capture replays the same
        launches)."""
        if self.select_programs != 0:
            return max(1, min(self.select_programs, triton_cdiv(n, 16)))
        if n < self.select_segment_from:
            return 1
        want = triton_cdiv(2 * self.num_sms(device), t)
        return max(1, min(next_pow2(want), n // self.select_segment_min, 64))

    def _select_segments(self, score, bound, k: int, out, segments: int) -> None:
        """The top-k ids over ``segments`` programs a row (``triton_scorer``'s segment
        select: histogram, gather of the k-th key's bin, refine, write)."""
        t, n = score.shape
        seg = triton_cdiv(triton_cdiv(n, segments), 16) * 16
        segments = triton_cdiv(n, seg)
        sp = next_pow2(segments)
        ws = torch.zeros(t, 2052 + 3 * sp, dtype=torch.int32, device=score.device)
        lists = torch.empty(2, t, n, dtype=torch.int32, device=score.device)
        chunk = min(self.select_chunk, next_pow2(seg))
        b = _vec(bound) if bound is not None else score
        has = bound is not None
        SC.select_hist_kernel[(t, segments)](
            score, score.stride(0), b, ws, ws.stride(0), n, seg, HAS_BOUND=has, CHUNK=chunk
        )
        SC.select_gather_kernel[(t, segments)](
            score, score.stride(0), b, ws, ws.stride(0), lists[0], lists[1], n, k, n, seg,
            SP=sp, HAS_BOUND=has, CHUNK=chunk,
        )  # fmt: skip
        SC.select_refine_kernel[(t,)](
            ws, ws.stride(0), lists[0], lists[1], n, out, out.stride(0), k, seg, segments,
            SP=sp, CHUNK=min(self.select_chunk, next_pow2(n)), KP=next_pow2(k),
        )  # fmt: skip
        SC.select_write_kernel[(t, segments)](
            score, score.stride(0), b, ws, ws.stride(0), out, out.stride(0), n, seg,
            SP=sp, HAS_BOUND=has, CHUNK=chunk,
        )  # fmt: skip

    def _scorer_runs(self, op: str, planes, q, pages) -> bool:
        d = q.shape[-1]
        ok = q.dtype in _FLOAT and d == next_pow2(d) and d >= 32
        ok = ok and pages.shape[1] * planes[0].shape[1] > 0
        key = planes[0]
        if plane_format(planes) == "fp8":  # the kernel copies a key row's codes 4 bytes at a time
            ok = ok and key.data_ptr() % 4 == 0 and key.stride(0) % 4 == 0
            ok = ok and key.stride(1) % 4 == 0
        if not ok:
            self.fallbacks.add(op)
        return ok and self._runs(op, *planes, q, pages)

    def scores(self, planes, q, weights, bound, pages):
        if not self._scorer_runs("scores", planes, q, pages):
            return super().scores(planes, q, weights, bound, pages)
        n = pages.shape[1] * planes[0].shape[1]
        out = torch.empty(q.shape[0], n, dtype=torch.float32, device=q.device)
        self._score(planes, q, weights, bound, pages, None, out, fill=True)
        # the reference returns fp4 scores in the query's dtype (already rounded to it here)
        return out if plane_format(planes) == "fp8" else out.to(q.dtype)

    def topk_ids(self, score, topk):
        if score.dtype not in _FLOAT or not self._runs("topk_ids", score):
            return super().topk_ids(score, topk)
        out = torch.empty(score.shape[0], topk, dtype=torch.long, device=score.device)
        self._select(score, None, topk, out)
        return out

    def score_topk(self, planes, q, weights, bound, pages, topk, candidates):
        if not self._scorer_runs("score_topk", planes, q, pages):
            return super().score_topk(planes, q, weights, bound, pages, topk, candidates)
        t = q.shape[0]
        n = pages.shape[1] * planes[0].shape[1]
        work = torch.empty(t, n, dtype=torch.float32, device=q.device)
        self._score(planes, q, weights, bound, pages, candidates, work, fill=False)
        ids = torch.empty(t, topk, dtype=torch.long, device=q.device)
        self._select(work, bound, topk, ids)
        return ids

    def score_candidates_topk(
        self, planes, q, weights, bound, pages, topk, block_rows, topk_blocks
    ):
        if not (
            self._scorer_runs("score_candidates_topk", planes, q, pages)
            and self._blocks_ok(pages.shape[1] * planes[0].shape[1], block_rows)
        ):
            return super().score_candidates_topk(
                planes, q, weights, bound, pages, topk, block_rows, topk_blocks
            )
        t = q.shape[0]
        n = pages.shape[1] * planes[0].shape[1]
        work = torch.empty(t, n, dtype=torch.float32, device=q.device)
        self._score(planes, q, weights, bound, pages, None, work, fill=True)
        ids = torch.empty(t, topk, dtype=torch.long, device=q.device)
        self._select(work, bound, topk, ids)
        mask = torch.empty(t, n, dtype=torch.bool, device=q.device)
        self._select(work, bound, topk_blocks, mask, block_rows)
        return ids, mask

    def _blocks_ok(self, n: int, block_rows: int) -> bool:
        ok = block_rows == next_pow2(block_rows) and n % block_rows == 0
        if not ok:
            self.fallbacks.add("candidate_blocks")
        return ok

    def candidate_blocks(self, scores, bound, block_rows, topk_blocks):
        t, n = scores.shape
        if not (
            scores.dtype in _FLOAT
            and self._blocks_ok(n, block_rows)
            and self._runs("candidate_blocks", scores)
        ):
            return super().candidate_blocks(scores, bound, block_rows, topk_blocks)
        mask = torch.empty(t, n, dtype=torch.bool, device=scores.device)
        self._select(scores, bound, topk_blocks, mask, block_rows)
        return mask

    # -- attention ----------------------------------------------------------------------------
    attention_block = 32
    """Keys per attention tile (16 below head_dim 256)."""
    head_block_max = 64
    """Most heads one attention program holds (more heads: more programs, the keys read again
    from L2)."""
    max_splits = 16
    """Most key splits of one query row (flash decoding)."""
    few_rows = 2
    """Query rows up to which a bf16 launch at V4.1-Flash widths (64 heads of 512 lanes or more)
    takes 16-head blocks and one key block a split: batch 1 and 2 at 8K context 19.4 -> 14.0 and
    20.9 -> 16.4 us on the H100; at 4 rows that form loses to a 32-head one, at 8 and 16 rows to
    the default (reports/gpu/bench_kernels_attn_small_t_h100_*.json)."""
    combine_columns = 64
    """Latent columns per program of the splits' merge (with at most 16 heads: one query row's
    merge is then dozens of programs, not one or two)."""
    attention_override: dict | None = None
    """Launch settings that replace the computed ones (``BN``, ``HB``, ``SPLITS``, ``num_warps``,
    ``num_stages``, ``PREFETCH``, ``DV``: output columns a program accumulates, 0 all of them;
    ``RESOLVE``, ``BALANCE``): the benchmark's sweep."""
    f32_dot = "ieee"
    """fp32 attention's dot precision on the GPU: ``ieee`` (fp32 FMAs, the validation mode's
    arithmetic) or ``tf32x3`` (three tensor-core passes, about fp32 accuracy, faster)."""

    def attention_config(
        self,
        tq: int,
        h: int,
        d: int,
        window: int,
        k: int,
        device,
        dtype=torch.bfloat16,
        packed: bool = False,
    ) -> dict:
        """Tile sizes, head blocks, key splits and launch options for ``tq`` query rows (shapes
        and formats only: the same shapes always give the same launch, so a capture replays it).
        ``packed``: FP4 main rows or FP8 ring rows, decoded in registers (smaller key tiles)."""
        # bf16 dot operands for bf16 queries (every key, packed ones decoded, is on a grid bf16
        # holds exactly); fp32 ones for fp32 queries
        dot_bf16 = dtype == torch.bfloat16
        f32 = not dot_bf16  # fp32 dot operands
        bn = self.attention_block if d >= 256 and not (f32 or packed) else 16
        # fp32 operands take twice the registers and shared memory: smaller head blocks
        hb = max(16, min(next_pow2(h), 16 if f32 else self.head_block_max))
        n_hb = triton_cdiv(h, hb)
        n_blocks = triton_cdiv(window, bn) + triton_cdiv(k, bn)
        programs = tq * n_hb
        # few rows: split the keys while the programs fit one wave (each split adds an fp32
        # partial output, as large as H keys, so no more than that). A wave is one program an
        # SM at 64 heads of 512 lanes (its accumulator takes the register file), two below:
        # a second wave costs more than the splits save (64 rows at flash widths, H100: 2
        # splits 65 us against 3 splits 87 in a one-off A/B without a report, README; the
        # decode reports of 0b8c6b7 hold the step with it)
        sms = self.num_sms(device) * (1 if hb * d >= 64 * 512 else 2)
        splits = 1
        if programs < sms:
            splits = max(1, min(self.max_splits, n_blocks, sms // programs))
            # each split takes cdiv(n_blocks, splits) key blocks: as many splits as that fills
            # (20 blocks over 16 splits is 10 of two blocks, not 6 empty partials to write and
            # merge; the merge's sums are the same, an empty split adding exact zeros)
            splits = triton_cdiv(n_blocks, triton_cdiv(n_blocks, splits))
        flash_bf16 = dot_bf16 and not packed and h * d >= 64 * 512  # 64 heads of 512 lanes
        if flash_bf16 and tq <= self.few_rows:
            # a row's heads over four times the programs, every key block its own split: the
            # launch is latency-bound, not bytes-bound, at one or two rows
            hb, n_hb, splits = 16, triton_cdiv(h, 16), n_blocks
        cfg = {
            "BN": bn,
            "HB": hb,
            "n_hb": n_hb,
            "SPLITS": splits,
            "num_warps": 8 if hb * d >= 32 * 512 else 4,
            "num_stages": 1 if f32 else 2,
            "F32_DOT": self.f32_dot,
            "DOT_BF16": dot_bf16,
            "PREFETCH": 0,  # 1 and 2 lost in both sweeps (reports/gpu/bench_kernels_sweep*.json)
            "RESOLVE": RESOLVE_SELECTED,
            "BALANCE": BALANCED_SPLITS,
        }
        if RESOLVE_SELECTED and not f32:
            cfg["num_stages"] = self.attention_stages(hb, bn, d, device)
        override = self.attention_override or {}
        cfg.update(override)
        cfg["n_hb"] = triton_cdiv(h, cfg["HB"])
        dv = cfg.setdefault("DV", 0)
        if "RESOLVE" not in override and (dv or cfg["PREFETCH"]):
            # a column share or the manual prefetch asked for: the unresolved form, which
            # takes them (and its two stages, unless asked otherwise)
            cfg["RESOLVE"] = False
            if "num_stages" not in override and not f32:
                cfg["num_stages"] = 2
        if dv and (dv >= d or d % dv or dv != next_pow2(dv) or cfg["PREFETCH"]):
            raise ValueError(f"DV {dv}: a power of two below head_dim {d}, with PREFETCH 0")
        if cfg["RESOLVE"] and (dv or cfg["PREFETCH"]):
            raise ValueError("RESOLVE takes PREFETCH 0 and every output column (DV 0)")
        return cfg

    def sparse_attention(
        self,
        q,
        sink,
        scale,
        ring,
        kv,
        rows,
        slot,
        position,
        window_lo,
        ring_until,
        window,
        plane,
        ids,
        pages,
        rows_per_page,
        out,
    ):
        tq, h, d = q.shape
        ok = q.dtype in _FLOAT and kv.dtype == q.dtype == out.dtype and d == next_pow2(d)
        ok = ok and d >= 16 and ring.stride(2) == 1 and kv.stride(1) == 1 and q.stride(2) == 1
        ok = ok and out.stride(2) == 1 and (plane is None or plane.stride(2) == 1)
        if not ok:
            self.fallbacks.add("sparse_attention")
        if not (ok and self._runs("sparse_attention", q, kv, ring, plane, out)) or tq == 0:
            if tq:
                super().sparse_attention(
                    q,
                    sink,
                    scale,
                    ring,
                    kv,
                    rows,
                    slot,
                    position,
                    window_lo,
                    ring_until,
                    window,
                    plane,
                    ids,
                    pages,
                    rows_per_page,
                    out,
                )
            return
        has_plane = plane is not None
        ksel = ids.shape[1] if has_plane else 0
        packed = ring.dtype == torch.uint8 or (has_plane and plane.dtype == torch.uint8)
        cfg = self.attention_config(tq, h, d, window, ksel, q.device, q.dtype, packed)
        splits = cfg["SPLITS"]
        n_dv = d // cfg["DV"] if cfg["DV"] else 1
        grid = (tq, cfg["n_hb"] * n_dv, splits)
        part_o = part_ml = out
        if splits > 1:
            part_o = torch.empty(tq, splits, h, d, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(tq, splits, h, 2, dtype=torch.float32, device=q.device)
        resolve = resolves_selected(cfg, plane)
        out_bf16 = out.dtype == torch.bfloat16
        dst = _bits16(out)
        rows = _vec(rows)
        pl = plane if has_plane else ring
        idt = ids.contiguous() if has_plane else rows
        pgt = pages.contiguous() if has_plane else rows.view(-1, 1)
        A.sparse_attention_kernel[grid](
            q,
            q.stride(0),
            q.stride(1),
            sink,
            dst,
            out.stride(0),
            out.stride(1),
            ring,
            ring.stride(0),
            ring.stride(1),
            kv,
            kv.stride(0),
            rows,
            _vec(slot),
            _vec(position),
            _vec(window_lo),
            _vec(ring_until),
            pl,
            pl.stride(0),
            pl.stride(1),
            idt,
            idt.stride(0),
            pgt,
            pgt.stride(0),
            part_o,
            part_ml,
            float(scale) * A.LOG2E,
            h,
            ring.shape[1],
            kv.shape[0],
            pgt.shape[1],
            rows_per_page,
            ksel,
            KSEL_P2=next_pow2(max(ksel, 1)),
            D=d,
            HB=cfg["HB"],
            BN=cfg["BN"],
            W=window,
            RING_FP8=ring.dtype == torch.uint8,
            PLANE_FP4=has_plane and plane.dtype == torch.uint8,
            HAS_PLANE=has_plane,
            SPLITS=splits,
            OUT_BF16=out_bf16,
            DOT_BF16=cfg["DOT_BF16"] and not _INTERPRETED,
            F32_DOT=cfg["F32_DOT"],
            PREFETCH=cfg["PREFETCH"],
            DV=cfg["DV"] or d,
            RESOLVE=resolve,
            BALANCE=bool(cfg["BALANCE"]) and splits > 1,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_launch(q.device, tq),
        )
        if splits > 1:
            chb, dc = min(16, next_pow2(h)), min(d, self.combine_columns)
            A.combine_kernel[(tq, triton_cdiv(h, chb), triton_cdiv(d, dc))](
                part_o,
                part_ml,
                dst,
                out.stride(0),
                out.stride(1),
                h,
                D=d,
                DC=dc,
                HB=chb,
                SPLITS=splits,
                OUT_BF16=out_bf16,
                num_warps=4,
                **pdl_launch(q.device, tq),
            )


def triton_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of two non-negative ints."""
    return -(-a // b)
