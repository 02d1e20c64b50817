"""CUDA-graph execution of decode steps: ``cudagraph_mode`` FULL and PIECEWISE.

The graphs capture the runtime model's own forward, never a copy of it: a step is
``inputs = model.prepare(plan, token_ids)`` on the host, then ``model.run(inputs)`` on the
device (``v41plan.runtime.paged_model``). ``prepare`` writes a decode step's inputs at device
addresses fixed by its width ``(bs, bs * q)``, so a replay of a captured ``run`` reads the new
step's inputs; padding rows carry the planner's sentinels (batch id -1, slot -1, last row -1)
and every scatter redirects them to the pools' sink rows.

- FULL: ``CudaGraphs`` captures ``model.run`` once per capture bucket ``(bs, q)`` (the spec's
  ``capture`` lists, filtered by ``max_num_seqs`` and ``max_num_batched_tokens``); a decode
  step pads to the smallest bucket that holds it and is one replay. Larger batches run eager
  (logged and counted).
- PIECEWISE: the same forward split at attention: per bucket, a graph of the embedding and the
  step's addressing, per layer a graph of ``model.layer_pre`` (Engram, mHC, norms, q and
  window-KV projections) and of ``model.layer_post`` (output projection, mHC, MoE), and one of
  the head; ``model.layer_attention`` (ring writes, compression, index scoring, sparse
  attention) runs eager between them.

Capture binds the serving pools: synthetic requests in STATE slots ``[0, bs)`` naming PAGE 0 in
every block-table entry, starting behind a full window. Every page from ``ceil((W + q) /
page_tokens)`` on and every slot from the largest bucket on is checked byte-identical across
warm-up and capture, then the whole pool (and the host cursor mirror) is restored. A warm-up
runs every captured width eagerly first; capture runs under ``capture_guard``: a host sync
(``set_sync_debug_mode("error")``), a first Triton compile or a caching-allocator segment
created outside the graph pool fails the capture. A primer capture of the smallest width runs
first (checked for syncs and compiles) and takes the one-time allocations a process's first
capture makes outside the pool (on the H200 one 2 MiB default-pool segment); the capture report
lists them."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

log = logging.getLogger(__name__)


class CaptureGuardError(RuntimeError):
    """A capture saw what a replay would not repeat (a host sync, a first compile), or changed
    bytes it must leave alone."""


# ---------------------------------------------------------------------------------------------
# buckets
def capture_buckets(spec, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The ``(bs, q)`` buckets captured for ``spec``: its capture lists, keeping ``bs <=
    max_num_seqs`` and ``bs * q <= max_num_batched_tokens`` (the static buffers' width)."""
    cap = spec.capture
    out = sorted(
        {
            (bs, q)
            for bs in cap.batch_sizes
            for q in cap.query_buckets
            if bs <= max_num_seqs and bs * q <= max_num_batched_tokens
        }
    )
    dropped = [bs for bs in cap.batch_sizes if bs > max_num_seqs]
    if dropped:
        log.warning(
            "capture sizes %s exceed max_num_seqs=%d and are not captured", dropped, max_num_seqs
        )
    return out


def select_bucket(buckets, num_requests: int, rows_per_request: int) -> tuple[int, int] | None:
    """The smallest captured ``(bs, q)`` with ``bs >= num_requests`` and ``q >= rows_per_request``
    (fewest padded rows), or None when the step is larger than every bucket."""
    fits = [(bs * q, bs, q) for bs, q in buckets if bs >= num_requests and q >= rows_per_request]
    if not fits:
        return None
    _, bs, q = min(fits)
    return bs, q


def pad_decode_step(step, bucket: tuple[int, int], table_width: int):
    """A decode ``StepInput`` padded to ``bucket``: ``running_bs = bs``, ``running_tokens = bs * q``
    and the model's block-table width (so every replay reads one fixed shape)."""
    bs, q = bucket
    return replace(step, running_bs=bs, running_tokens=bs * q, block_table_width=table_width)


# ---------------------------------------------------------------------------------------------
# capture guard
def _segments() -> list[dict]:
    """The caching allocator's segments (address, pool id when reported, size, stream)."""
    return torch.cuda.memory_snapshot()


_JIT_FUNCTIONS: list = []


def find_triton_kernels() -> int:
    """Record this process's Triton JIT functions (one heap walk; call after imports and
    warm-up). Returns how many there are (0 without Triton or with only torch kernels)."""
    import sys

    _JIT_FUNCTIONS.clear()
    if "triton" not in sys.modules:
        return 0
    import gc

    from triton.runtime.jit import JITFunction

    _JIT_FUNCTIONS.extend(o for o in gc.get_objects() if _is_jit(o, JITFunction))
    return len(_JIT_FUNCTIONS)


def _is_jit(o, jit_type) -> bool:
    """``isinstance(o, jit_type)``, False for a dead weak proxy on the heap (compilers leave
    some behind; ``isinstance`` on one raises ``ReferenceError``)."""
    try:
        return isinstance(o, jit_type)
    except ReferenceError:
        return False


def _triton_cache_size() -> int:
    """Compiled variants held by the recorded Triton JIT functions."""
    total = 0
    for fn in _JIT_FUNCTIONS:
        caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", None) or {}
        for v in caches.values():
            v = v[0] if isinstance(v, tuple) else v
            total += len(v) if hasattr(v, "__len__") else 1
    return total


@contextmanager
def capture_guard(what: str, pool=None, record: list | None = None, refuse_outside: bool = True):
    """Fail loudly on a host sync, a first compile or (with ``pool`` given and ``refuse_outside``)
    a caching-allocator segment created outside the graph pool ``pool`` inside the block (a
    capture): each would be frozen into, missing from, or leaked past every replay. Segments the
    block creates are appended to ``record``."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # as the capture's own entry does, so the comparison below is stable
    before = {seg["address"] for seg in _segments()}
    compiled = _triton_cache_size()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        raise CaptureGuardError(
            f"capture of {what} failed (a host sync or a non-capturable op "
            f"inside the decode forward): {exc}"
        ) from exc
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if _triton_cache_size() != compiled:
        raise CaptureGuardError(
            f"capture of {what} compiled a kernel for the first time (warm-up missed it)"
        )
    if record is not None or pool is not None:
        record = record if record is not None else []
        new = [seg for seg in _segments() if seg["address"] not in before]
        ids = [tuple(seg["segment_pool_id"]) if "segment_pool_id" in seg else None for seg in new]
        outside = [
            (i, seg["total_size"])
            for i, seg in zip(ids, new, strict=True)
            if pool is not None and i is not None and i != tuple(pool)
        ]
        record.append(
            {
                "what": what,
                "new_segments": len(new),
                "pool_ids_reported": all(i is not None for i in ids),
                "outside_pool": outside,
            }
        )
        if outside and refuse_outside:
            raise CaptureGuardError(
                f"capture of {what} allocated outside the graph pool {tuple(pool)}: "
                f"{outside} (pool id, bytes)"
            )


# ---------------------------------------------------------------------------------------------
def synthetic_plan(model, spec, bs: int, q: int):
    """The capture step: ``bs`` decode requests in slots ``[0, bs)``, every block-table entry
    PAGE 0, each starting behind a full window (``position = W``)."""
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    W = spec.dims.sliding_window
    width = model.table_width
    reqs = tuple(
        RequestInput(
            slot=i, block_table=(0,) * width, prompt_len=W, start=W, chunk_len=q, phase="decode"
        )
        for i in range(bs)
    )
    step = StepInput(reqs, running_bs=bs, running_tokens=bs * q, block_table_width=width)
    return plan_step(step, spec)


class CudaGraphAPI:
    """What ``CudaGraphs`` asks of the device: a graph, its capture context, a pool, the guard.

    The CUDA implementation. Captures take a callable, so a test on the CPU can substitute an
    API that records it and re-runs it on replay, refreshing the captured output tensors in
    place (``tests/runtime/test_graphs_cpu.py``): FULL then runs exactly the code a CUDA
    capture records."""

    def new_graph(self):
        """A fresh graph object."""
        return torch.cuda.CUDAGraph()

    def pool(self):
        """The memory pool every capture of a runner shares."""
        return torch.cuda.graph_pool_handle()

    def capture(self, graph, pool, fn):
        """Capture ``fn()`` into ``graph``; returns what ``fn`` returned (the tensors every
        replay of ``graph`` refreshes)."""
        with torch.cuda.graph(graph, pool=pool):
            return fn()

    def guard(self, what: str, pool, record: list, refuse_outside: bool = True):
        """``capture_guard`` around one capture."""
        return capture_guard(what, pool, record, refuse_outside)

    def synchronize(self) -> None:
        """Wait for the device."""
        torch.cuda.synchronize()


class CudaGraphs:
    """Captured decode graphs of one runtime model (FULL or PIECEWISE) and their replay.

    Every capture records ``model.run`` (FULL) or its pieces (PIECEWISE) on the inputs
    ``model.prepare`` laid out for the bucket; ``run(inputs)`` replays the bucket the inputs
    were prepared for, or returns None when no graph fits them.
    """

    def __init__(
        self,
        model,
        spec,
        buckets,
        mode: str = "FULL",
        api: CudaGraphAPI | None = None,
        samplings: tuple = (None,),
    ):
        if mode not in ("FULL", "PIECEWISE"):
            raise ValueError(
                f"cudagraph_mode={mode!r} has no graphs to capture; accepted: FULL, PIECEWISE"
            )
        if api is None and model.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.model, self.spec, self.mode = model, spec, mode
        self.api = api or CudaGraphAPI()
        self.buckets = list(buckets)
        self.samplings = tuple(samplings)
        """Sampler shapes captured per bucket: None (logits only) or ``(sampled, truncate)``
        (the step's ``StepSampling`` shape, with no top logprobs)."""
        self.graphs: dict[tuple, object] = {}
        """Inputs key -> the FULL graph of that bucket."""
        self.outputs: dict[tuple, object] = {}
        """Inputs key -> the captured ``StepOutput`` (its tensors are what a replay refreshes)."""
        self.pieces: dict[tuple, dict] = {}
        """Inputs key -> the PIECEWISE graphs and the tensors they hand each other."""
        self.stats: Counter = Counter()
        self.report: dict = {}
        self.pool = None
        self.allocations: list[dict] = []
        """Per capture: segments it created and those outside the graph pool (``capture_guard``)."""
        self.primer_allocations: list[dict] = []
        """The same for the primer capture (see ``_prime``)."""
        self._primer = None

    # -- capture ------------------------------------------------------------------------------
    def capture(self) -> dict:
        """Warm up every width, capture every bucket under the guard, check the untouched pages
        and slots, restore the pools; returns the capture report."""
        m, spec, api = self.model, self.spec, self.api
        pools = m.pools
        before = pools.backing.clone()
        mirror = pools.cursor_host.copy()
        W = spec.dims.sliding_window
        P = pools.geometry.page_tokens
        max_q = max(q for _, q in self.buckets)
        max_bs = max(bs for bs, _ in self.buckets)
        n = len(self.buckets)
        what = "compiles the dense pieces, " if m.pieces.compiled else ""
        log.info("warm-up (%severy kernel at every width): %d buckets", what, n)
        t0 = time.perf_counter()
        graphs0 = m.pieces.graphs
        for i, (bs, q) in enumerate(self.buckets):  # warm-up: every kernel at every width once
            for sampling in self.samplings:
                m.run(self._synthetic(bs, q, sampling))
            log.info("warm-up %d/%d: bucket (%d, %d) in %.1f s", i + 1, n, bs, q,
                     time.perf_counter() - t0)  # fmt: skip
        api.synchronize()
        find_triton_kernels()
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.pool = api.pool()
        self._prime()
        for i, (bs, q) in enumerate(sorted(self.buckets, reverse=True)):  # largest first
            for sampling in self.samplings:
                inputs = self._synthetic(bs, q, sampling)
                if self.mode == "FULL":
                    self._capture_full(bs, q, inputs)
                else:
                    self._capture_pieces(bs, q, inputs)
            log.info("captured %d/%d: bucket (%d, %d)", i + 1, n, bs, q)
        api.synchronize()
        capture_s = time.perf_counter() - t0
        first_page = math.ceil((W + max_q) / P)
        after = pools.backing
        untouched_pages = self._pages_equal(before, after, first_page)
        s0, _ = pools.state_region
        sb = pools.geometry.state_bytes
        untouched_slots = bool(torch.equal(before[s0 + max_bs * sb :], after[s0 + max_bs * sb :]))
        pools.backing.copy_(before)
        pools.cursor_host[:] = mirror
        del before
        self.report = {
            "mode": self.mode,
            "graph_shapes": [[bs, q, bs * q] for bs, q in self.buckets],
            "samplings": [list(x) if x is not None else None for x in self.samplings],
            "graphs": len(self.graphs) + sum(len(p["graphs"]) for p in self.pieces.values()),
            "untouched_from_page": first_page,
            "pages_untouched": untouched_pages,
            "slots_untouched_from": max_bs,
            "slots_untouched": untouched_slots,
            "primer_segments_outside_graph_pool": [
                o for a in self.primer_allocations for o in a["outside_pool"]
            ],
            "new_segments_in_capture": sum(a["new_segments"] for a in self.allocations),
            "segments_outside_graph_pool": [o for a in self.allocations for o in a["outside_pool"]],
            "pool_ids_reported": all(a["pool_ids_reported"] for a in self.allocations),
            "warmup_s": warmup_s,
            "capture_s": capture_s,
            "compiled_graphs": m.pieces.graphs - graphs0,
        }
        if not (untouched_pages and untouched_slots):
            raise CaptureGuardError(f"capture changed bytes it must not touch: {self.report}")
        return self.report

    def _pages_equal(self, before: torch.Tensor, after: torch.Tensor, first_page: int) -> bool:
        """Every PAGE unit from ``first_page`` on (main page and its index-plane slices) is
        unchanged."""
        pools = self.model.pools
        g = pools.geometry
        lo, n = pools.page_region
        if not torch.equal(
            before[lo + first_page * g.page_bytes : lo + n],
            after[lo + first_page * g.page_bytes : lo + n],
        ):
            return False
        bases = pools.region_bases()
        for pl in g.planes:
            if pl.kind == "main":
                continue
            base = bases[pl.name]
            end = base + (pools.num_pages + 1) * pl.bytes_per_page
            start = base + first_page * pl.bytes_per_page
            if not torch.equal(before[start:end], after[start:end]):
                return False
        return True

    def _prime(self) -> None:
        """Capture the smallest width once, unreplayed and kept alive, before the guarded
        captures.

        The first capture of a process (or after every graph was freed) makes one-time
        allocations outside the graph pool: torch's graph-safe RNG state
        (``CUDAGeneratorState::register_graph`` in ``capture_begin``, one 2 MiB default-pool
        segment on the H200, found with ``scripts/gpu_capture_probe.py``). The primer takes
        them, still checked for host syncs and first compiles, and reports them as
        ``primer_segments_outside_graph_pool``; every serving graph captured after it must
        allocate inside the pool or fail."""
        m, api = self.model, self.api
        bs, q = min(self.buckets)
        inputs = self._synthetic(bs, q, self.samplings[0])
        self._primer = api.new_graph()
        guard = api.guard(
            f"primer[bs={bs}, q={q}]", self.pool, self.primer_allocations, refuse_outside=False
        )
        fn = (lambda: m.run(inputs)) if self.mode == "FULL" else (lambda: m.embed_rows(inputs))
        with torch.no_grad(), guard:
            api.capture(self._primer, self.pool, fn)

    def _synthetic(self, bs: int, q: int, sampling):
        """The capture step's prepared inputs under one sampler shape."""
        from v41plan.runtime.paged_model import StepSampling

        m = self.model
        plan = synthetic_plan(m, self.spec, bs, q)
        st = None
        if sampling is not None:
            st = StepSampling.neutral(bs, sampled=sampling[0], truncate=sampling[1])
        spec = None
        if m.draft is not None:  # every row verifies a block, and drafts the next
            from v41plan.runtime.paged_model import StepSpec

            B = m.draft.block_size
            cursors = np.zeros((bs, B + 1, m.pools.cursor_host.shape[1]), dtype=np.int64)
            cursors[:, :, 0] = plan.forward_start[:bs, None] + np.arange(1, B + 2)
            ones = np.ones(bs, dtype=bool)
            spec = StepSpec(ones, np.zeros((bs, B), dtype=np.int64), cursors, ones)
        return m.prepare(plan, np.zeros(bs * q, dtype=np.int64), sampling=st, spec=spec)

    def _capture_full(self, bs: int, q: int, inputs) -> None:
        api = self.api
        g = api.new_graph()
        guard = api.guard(f"decode[bs={bs}, q={q}]", self.pool, self.allocations)
        with torch.no_grad(), guard:
            out = api.capture(g, self.pool, lambda: self.model.run(inputs))
        self.graphs[inputs.key] = g
        self.outputs[inputs.key] = out

    def _capture_pieces(self, bs: int, q: int, inputs) -> None:
        """PIECEWISE: the embedding and addressing, each layer's dense pieces and the head as
        graphs; the attention between them stays eager (``run`` calls it on the captured
        tensors). A decode step's stages all run every row, so one frame carries the layers."""
        m, api = self.model, self.api
        if any(st.rows is not None for st in inputs.stages):
            raise CaptureGuardError("a decode step's stages run every row")
        graphs, frames, pieces = [], {}, {}
        t = inputs.t

        def captured(what: str, fn):
            g = api.new_graph()
            with torch.no_grad(), api.guard(what, self.pool, self.allocations):
                out = api.capture(g, self.pool, fn)
            graphs.append(g)
            return out

        def enter():
            X, pre = m.embed_rows(inputs)
            return m.frame(inputs, inputs.stages[0], X, pre)

        fr = captured(f"embed[t={t}]", enter)
        layers = [L for st in inputs.stages for L in range(st.first_layer, st.last_layer + 1)]
        for L in layers:
            p = captured(f"layer {L} pre[t={t}]", lambda L=L: m.layer_pre(L, inputs, fr))
            frames[L], pieces[L] = copy.copy(fr), p  # the tensors this layer's attention reads
            if p is not None:
                captured(f"layer {L} post[t={t}]", lambda L=L, p=p: m.layer_post(L, inputs, fr, p))
        out = captured(f"head[t={t}]", lambda: m.head_rows(inputs, fr.X, fr.pre))
        self.pieces[inputs.key] = {
            "frame": fr,
            "captured_memo": frozenset(fr.memo),
            "graphs": graphs,
            "frames": frames,
            "pieces": pieces,
            "inputs": inputs,
            "output": out,
            "layers": layers,
        }

    # -- replay --------------------------------------------------------------------------------
    def has(self, inputs) -> bool:
        """A graph was captured for these prepared inputs' bucket."""
        return inputs.key in (self.graphs if self.mode == "FULL" else self.pieces)

    @torch.no_grad()
    def run(self, inputs):
        """Replay the bucket ``inputs`` were prepared for (FULL: one replay; PIECEWISE: its
        pieces with eager attention between them). Returns the ``StepOutput``, or None (counted
        as an eager decode step when ``inputs`` is a decode) when no graph was captured for it.
        The output's tensors are the graph's: read them before the next replay."""
        if not self.has(inputs):
            if inputs.decode:
                self.stats["eager_decode_steps"] += 1
                log.info(
                    "decode step (bs=%d, t=%d) has no captured graph; running eager",
                    inputs.b,
                    inputs.t,
                )
            return None
        if self.mode == "FULL":
            self.graphs[inputs.key].replay()
            self.stats["replays"] += 1
            self.stats["graph_steps"] += 1
            return self.outputs[inputs.key]
        m = self.model
        c = self.pieces[inputs.key]
        graphs = iter(c["graphs"])
        # the frame's memo entries the eager attention made last step are of last step's inputs
        memo = c["frame"].memo  # (the layers' frame copies share it)
        for k in [k for k in memo if k not in c["captured_memo"]]:
            del memo[k]
        next(graphs).replay()  # embedding and addressing
        self.stats["replays"] += 1
        cand, sel = None, {}
        for L in c["layers"]:
            next(graphs).replay()
            self.stats["replays"] += 1
            p = c["pieces"][L]
            if p is None:
                continue
            cand = m.layer_attention(L, c["inputs"], c["frames"][L], p, cand, sel)
            next(graphs).replay()
            self.stats["replays"] += 1
        next(graphs).replay()  # head and cursor commit
        self.stats["replays"] += 1
        self.stats["graph_steps"] += 1
        m.selections = sel
        return c["output"]

    def replays_per_step(self) -> int:
        """Replays one decode step makes: 1 (FULL), or the PIECEWISE pieces of a bucket."""
        if self.mode == "FULL":
            return 1
        c = next(iter(self.pieces.values()))
        return len(c["graphs"])


GREEDY = (False, False)
"""The sampler shape of a step whose every request is greedy."""
FULL_SAMPLER = (True, True)
"""The sampler shape that serves any request (noise and truncation on; top logprobs off)."""


def build_cuda_graphs(model, spec, options) -> CudaGraphs | None:
    """The graphs an engine's options ask for (None under eager execution), captured."""
    mode = str(options.cudagraph_mode).upper()
    if options.enforce_eager or mode == "NONE":
        return None
    if model.device.type != "cuda":
        log.warning("cudagraph_mode=%s needs CUDA; running eager on %s", mode, model.device)
        return None
    width = max(options.max_num_batched_tokens, options.max_num_seqs)
    buckets = capture_buckets(spec, options.max_num_seqs, width)
    if model.draft is not None:  # every decode row verifies: the anchor and the block
        q = 1 + model.draft.block_size
        buckets = sorted({(bs, q) for bs, _ in buckets if bs * q <= width})
    graphs = CudaGraphs(model, spec, buckets, mode, samplings=(GREEDY, FULL_SAMPLER))
    graphs.capture()
    return graphs


def pad_for_graphs(graphs: CudaGraphs | None, step, is_decode: bool):
    """A decode ``StepInput`` padded to its capture bucket when graphs exist (others unchanged)."""
    if graphs is None or not is_decode or not step.requests:
        return step
    q = max(r.chunk_len for r in step.requests)
    bucket = select_bucket(graphs.buckets, len(step.requests), q)
    if bucket is None:
        return step
    return pad_decode_step(step, bucket, graphs.model.table_width)


def graph_validation(
    graph_results: dict, eager_results: dict, graph_stats: dict, events: list[dict]
) -> dict:
    """The ``--graph`` acceptance case: every scenario's tokens match eager's; every decode step
    of the graph runner was a graph step and none ran eager; FULL made exactly one replay per
    decode step, PIECEWISE exactly its stated count (``replays_per_step``); the capture's
    untouched-page check passed. ``events`` tagged with a ``runner`` ran on another runner and
    are not counted."""
    compared = sorted(k for k, r in graph_results.items() if "tokens" in r)
    mismatched = [
        k for k in compared if graph_results[k]["tokens"] != eager_results.get(k, {}).get("tokens")
    ]
    stats = graph_stats.get("stats", {})
    capture = graph_stats.get("capture", {})
    decode_steps = sum(1 for ev in events if ev.get("phase") == "decode" and "runner" not in ev)
    graph_steps = stats.get("graph_steps", 0)
    eager_steps = stats.get("eager_decode_steps", 0)
    replays = stats.get("replays", 0)
    want_per_step = graph_stats.get("replays_per_step", 1)
    out = {
        "scenarios_compared": compared,
        "tokens_equal_eager": not mismatched,
        "mismatched": mismatched,
        "graph_shapes": capture.get("graph_shapes", []),
        "decode_steps": decode_steps,
        "graph_steps": graph_steps,
        "eager_decode_steps": eager_steps,
        "replays": replays,
        "replays_per_decode_step": replays / graph_steps if graph_steps else 0.0,
        "replays_per_step_stated": want_per_step,
        "untouched_from_page": capture.get("untouched_from_page"),
        "pages_untouched": capture.get("pages_untouched", False),
        "slots_untouched": capture.get("slots_untouched", False),
    }
    errors = []
    if mismatched:
        errors.append(f"tokens differ from eager in {mismatched}")
    if not graph_steps:
        errors.append("no decode step replayed a graph (CUDA graphs need --device cuda)")
    if eager_steps:
        errors.append(f"{eager_steps} decode steps ran eager (no captured graph fitted them)")
    if graph_steps != decode_steps:
        errors.append(f"{decode_steps} decode steps, but {graph_steps} were graph steps")
    if replays != want_per_step * graph_steps:
        errors.append(
            f"{replays} replays for {graph_steps} graph steps; {graph_stats.get('mode')} makes "
            f"exactly {want_per_step} per step"
        )
    if not (out["pages_untouched"] and out["slots_untouched"]):
        errors.append("capture changed pages or slots it must not touch")
    out["passed"] = not errors
    if errors:
        out["error"] = "; ".join(errors)
    return out
