"""The asynchronous engine: one stepping thread around ``LLM``, requests entering and leaving
between steps.

``AsyncEngine(llm).start()`` runs the loop in a background thread. Callers on any thread
``submit`` a request (its prompt ids, one ``SamplingParams`` per choice, the stop strings and an
``emit`` callback) and may ``abort`` it; the loop never waits on them. Each loop iteration:

1. takes the pending commands (adds, aborts, including the aborts the previous iteration
   decided: a stop string seen, the shutdown deadline passed) and, under torchrun, broadcasts
   them from rank 0 so every rank applies the identical list before the identical step;
2. applies them (``LLM.add_request`` / ``LLM.abort``: a cancelled request frees its slot and
   pages at the next schedule, the start of the next step);
3. runs one ``LLM.step()`` when anything waits or runs (an exception fails the requests of the
   batch it was running, and the loop goes on);
4. on rank 0, hands every request its new tokens: incremental detokenization (text is emitted
   only once it can no longer change: no trailing U+FFFD of a partial character), stop strings
   (a host-side check over the text: the request finishes with ``finish_reason="stop"``, the
   stop string and what follows it are cut, and text that could begin a stop string is held
   back until it cannot), logprobs when the engine provides them (``Sequence.output_logprobs``),
   and the final event with the finish reason.

Finish reasons as the OpenAI API reports them: ``stop`` (end of sequence, a stop token or a
stop string), ``length``, ``abort`` (cancelled, or cut at shutdown) and ``error``.

The waiting queue is bounded (``max_waiting`` choices submitted but not yet running):
``submit`` raises ``QueueFull`` past it, and ``EngineClosed`` once draining has begun.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from v41plan.serving.sampling import SamplingParams
from v41plan.serving.sequence import SeqStatus, Sequence

__all__ = [
    "AsyncEngine",
    "EngineClosed",
    "QueueFull",
    "RequestEvent",
    "RequestHandle",
    "TextState",
]

FINISH_REASONS = {"stop": "stop", "length": "length", "aborted": "abort", "error": "error"}


class QueueFull(RuntimeError):
    """The bounded waiting queue is full (HTTP 503 with ``Retry-After``)."""


class EngineClosed(RuntimeError):
    """The engine is draining or stopped and takes no new requests."""


@dataclass
class RequestEvent:
    """What one step produced for one choice of a request (handed to its ``emit``)."""

    index: int
    """Choice index within the request."""
    text: str = ""
    """New text (the delta since the last event)."""
    token_ids: list[int] = field(default_factory=list)
    """New token ids."""
    logprobs: list | None = None
    """``(logprob, {token_id: logprob})`` per new token, when the engine provides them."""
    finish_reason: str | None = None
    """Set on the choice's last event."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that finished the choice."""
    error: str | None = None
    """Why the choice failed (``finish_reason == "error"``)."""


class TextState:
    """Incremental detokenization and stop strings of one choice.

    ``update(ids, final)`` takes every generated id so far and returns the new text to emit,
    and the number of tokens up to the end of a stop string when one was found (None
    otherwise). Text is emitted once it cannot change (no trailing U+FFFD of a partial
    character) and cannot begin a stop string; emitted text is always a prefix of the final
    text, so a stream's text equals the non-streamed text.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.emitted = ""
        self.stop_hit: str | None = None
        """The stop string that finished the choice."""

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def update(self, ids: list[int], final: bool) -> tuple[str, int | None]:
        """New text for ``ids`` (all generated ids); ``final`` flushes everything."""
        full = self.decode(ids)
        stable = full if final else full.rstrip("\ufffd")
        cut = None
        hits = [(stable.find(s), s) for s in self.stop if s in stable]
        if hits:
            pos, self.stop_hit = min(hits)
            stable = stable[:pos]
            cut = self._tokens_reaching(ids, pos + len(self.stop_hit))
            final = True
        end = len(stable) if final else len(stable) - self._holdback(stable)
        if stable.startswith(self.emitted) and end > len(self.emitted):
            delta = stable[len(self.emitted) : end]
        else:
            delta = ""  # nothing new, or a decoder whose text is not prefix-stable
        self.emitted += delta
        return delta, cut

    def _tokens_reaching(self, ids: list[int], char_end: int) -> int:
        """The fewest leading tokens whose stable text reaches ``char_end`` characters."""
        for n in range(1, len(ids) + 1):
            if len(self.decode(ids[:n]).rstrip("\ufffd")) >= char_end:
                return n
        return len(ids)


@dataclass
class _Choice:
    """Engine-side state of one choice."""

    index: int
    params: SamplingParams
    text: TextState
    seq: Sequence | None = None
    ntok: int = 0
    hits_seen: int = 0
    done: bool = False
    reason: str | None = None
    """A finish reason the loop decided (a stop string, a shutdown cut) before the engine's."""
    stop_reason: str | int | None = None


@dataclass
class RequestHandle:
    """A submitted request: its choices, callback and timings (all times ``perf_counter``)."""

    key: int
    prompt_ids: list[int]
    emit: Callable[[RequestEvent], None]
    choices: list[_Choice]
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def done(self) -> bool:
        """Every choice has sent its final event."""
        return all(c.done for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        """Generated tokens over all choices."""
        return sum(c.ntok for c in self.choices)


class NullMetrics:
    """The metrics sink interface (every call a no-op)."""

    def observe_request(self, handle: RequestHandle, reasons: list[str]) -> None:
        """A request finished (every choice's reason)."""

    def observe_tokens(self, handle: RequestHandle, new_tokens: int, now: float) -> None:
        """A request received ``new_tokens`` tokens at ``now``."""

    def observe_prefix(self, queried_tokens: int, hit_tokens: int) -> None:
        """One admission's prefix-cache lookup."""

    def observe_queue(self, handle: RequestHandle) -> None:
        """A request left the waiting queue."""


def _step_counters(llm) -> dict[str, int]:
    """The runner's step counters and its graph counters (replays, eager decode steps)."""
    runner = llm.runner
    out = {str(k): int(v) for k, v in dict(getattr(runner, "stats", {}) or {}).items()}
    graph = getattr(runner, "graph_stats", None)
    if callable(graph):
        for k, v in dict(graph().get("stats", {}) or {}).items():
            out[f"graph_{k}"] = int(v)
    out["batches"] = int(getattr(llm, "batches", 0))
    return out


class _Broadcast:
    """Rank 0's command lists to every rank (gloo ``broadcast_object_list``)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        # A gloo group of its own: the commands travel on the CPU whatever the model's backend.
        self.group = dist.new_group(backend="gloo")

    def __call__(self, cmds: list | None) -> list:
        box = [cmds if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class AsyncEngine:
    """One stepping loop over an ``LLM`` in a background thread."""

    def __init__(
        self,
        llm,
        *,
        max_waiting: int = 256,
        metrics=None,
        distributed: bool | None = None,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = metrics if metrics is not None else NullMetrics()
        if distributed is None:
            import torch.distributed as dist

            distributed = dist.is_available() and dist.is_initialized()
            distributed = distributed and dist.get_world_size() > 1
        self._bcast = _Broadcast() if distributed else None
        self.is_main = self._bcast is None or self._bcast.rank == 0
        self.heartbeat_s = heartbeat_s
        self._keys = itertools.count()
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._inbox_choices = 0
        self._loop_aborts: list = []
        self._active: dict[int, RequestHandle] = {}
        self._seqs: dict[int, list[Sequence]] = {}  # followers: key -> seqs
        self._draining = False
        self._drain_deadline: float | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        """The exception that ended the loop (None while healthy)."""
        self.snapshot: dict = {}
        """Gauges and counters after the latest iteration (read by ``/metrics``)."""
        self._queued: tuple[int, int] = (0, 0)
        """(running, waiting) requests, refreshed after each step before any client hears of
        it: a client answered by that step and retrying at once sees its own request gone."""
        self.steps = 0
        self.submitted = 0
        """Requests ``submit`` accepted."""
        self._count_queues()
        self._take_snapshot()

    # ---- public API (any thread) ----------------------------------------------------------
    def start(self) -> AsyncEngine:
        """Start the stepping thread (rank 0 of a torchrun launch, or a single process)."""
        self._thread = threading.Thread(target=self._run_guarded, name="v41plan-engine")
        self._thread.daemon = True
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The stepping thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self,
        prompt_ids: list[int],
        params: list[SamplingParams],
        emit: Callable[[RequestEvent], None],
        stop: tuple[str, ...] = (),
    ) -> RequestHandle:
        """Queue a request with one choice per ``params``; events go to ``emit`` (called on the
        engine thread, once per step with news and once at each choice's end)."""
        choices = [
            _Choice(i, p, TextState(self.llm.decode, tuple(stop))) for i, p in enumerate(params)
        ]
        with self._cv:
            if self._draining or self._stop or not self.alive:
                raise EngineClosed("the server is shutting down")
            running, waiting = self._queued
            # Choices that would wait: queued ones beyond the running capacity left.
            room = self.llm.options.max_num_seqs - running
            queued = waiting + self._inbox_choices
            if queued + len(choices) - max(0, room) > self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            handle = RequestHandle(next(self._keys), list(prompt_ids), emit, choices)
            self.submitted += 1
            self._inbox.append(("add", handle))
            self._inbox_choices += len(choices)
            self._cv.notify()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (a disconnected client): it frees its slot and pages at the next
        step; no further events are sent."""
        with self._cv:
            self._inbox.append(("abort", handle.key, None))
            self._cv.notify()

    def drain(self, grace_s: float) -> None:
        """Take no new requests; requests still running after ``grace_s`` seconds are cut
        (final events with ``finish_reason="abort"``)."""
        with self._cv:
            self._draining = True
            self._drain_deadline = time.perf_counter() + grace_s
            self._cv.notify()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cut what still runs, stop the loop and join the thread (bounded by ``timeout_s``)."""
        with self._cv:
            self._draining = True
            self._drain_deadline = time.perf_counter()
            self._cv.notify()
        deadline = time.perf_counter() + timeout_s
        while self.alive and self._active and time.perf_counter() < deadline:
            time.sleep(0.01)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.perf_counter()) + 1.0)
        close = getattr(self.llm, "close", None)  # the KV connector's pending stores
        if close is not None:
            close()

    def num_active(self) -> int:
        """Requests submitted and not finished."""
        return len(self._active) + sum(1 for c in list(self._inbox) if c[0] == "add")

    # ---- the loop ---------------------------------------------------------------------------
    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the server reports it on /health
            self.error = exc
            for handle in list(self._active.values()):
                self._fail(handle, f"engine loop stopped: {exc!r}")
            raise

    def _take_commands(self) -> tuple[list, bool]:
        """Pending commands (adds become picklable records) and whether to stop."""
        busy = self.llm.has_unfinished() or bool(self._loop_aborts)
        with self._cv:
            timeout = self.heartbeat_s  # idle, rank 0 still broadcasts (the followers wait)
            if self._drain_deadline is not None and self._active:
                timeout = min(timeout, self._drain_deadline - time.perf_counter())
            if not self._inbox and not busy and not self._stop and timeout > 0:
                self._cv.wait(timeout=timeout)
            items = list(self._inbox)
            self._inbox.clear()
            stop = self._stop
        cmds = list(self._loop_aborts)
        self._loop_aborts.clear()
        if self._drain_deadline is not None and time.perf_counter() >= self._drain_deadline:
            cut = [k for k, h in self._active.items() if any(c.reason is None for c in h.choices)]
            cmds += [("abort", k, "abort") for k in cut]
        for item in items:
            if item[0] == "add":
                handle = item[1]
                self._active[handle.key] = handle
                params = [c.params for c in handle.choices]
                cmds.append(("add", handle.key, handle.prompt_ids, params))
            else:
                cmds.append(item)
        return cmds, stop

    def _run(self) -> None:
        while True:
            if self.is_main:
                cmds, stop = self._take_commands()
                if self._bcast is not None:
                    self._bcast({"cmds": cmds, "stop": stop})
            else:
                msg = self._bcast(None)
                cmds, stop = msg["cmds"], msg["stop"]
            self._apply(cmds)
            if stop:
                return
            if not self.llm.has_unfinished():
                self._count_queues()
                self._collect()  # errors at admission, finished aborts
                self._take_snapshot()
                continue
            t0 = time.perf_counter()
            try:
                self.llm.step()
            except Exception as exc:  # noqa: BLE001 - fails the batch's requests, not the server
                self._fail_batch(exc)
            self.steps += 1
            self._count_queues()
            self._collect(t0)
            self._take_snapshot()
            # A server runs for days: keep the scheduler's per-step records bounded.
            sched = self.llm.scheduler
            sched.finished.clear()
            del sched.events[:-1]

    def run_follower(self) -> None:
        """The loop of a rank other than 0 under torchrun: apply rank 0's commands, step."""
        if self.is_main:
            raise RuntimeError("run_follower is for ranks other than 0")
        self._run()

    def _apply(self, cmds: list) -> None:
        for cmd in cmds:
            if cmd[0] == "add":
                _, key, ids, params = cmd
                seqs = [self.llm.add_request(ids, p) for p in params]
                self._seqs[key] = seqs
                if self.is_main:
                    handle = self._active[key]
                    for c, s in zip(handle.choices, seqs):
                        c.seq = s
                    with self._cv:
                        self._inbox_choices -= len(seqs)
            else:
                _, key, reason = cmd
                for s in self._seqs.get(key, ()):
                    if not s.is_finished:
                        self.llm.abort(s)
                if self.is_main and key in self._active:
                    handle = self._active[key]
                    if reason is None:
                        handle.emit = _ignore  # the client is gone
                    for c in handle.choices:
                        if c.reason is None and not c.done:
                            c.reason = reason or "abort"
        for key in [k for k, seqs in self._seqs.items() if all(s.is_finished for s in seqs)]:
            if not self.is_main or key not in self._active:
                del self._seqs[key]
        if self.is_main and cmds:
            self._count_queues()  # the added requests moved from the inbox to the queue

    def _fail_batch(self, exc: Exception) -> None:
        """A step raised: fail the requests of the batch it ran (the scheduler's last batch);
        every rank raises alike, so each aborts the same requests at its next iteration."""
        events = getattr(self.llm.scheduler, "events", [])
        ids = set(events[-1]["ids"]) if events else set()
        for key, seqs in self._seqs.items():
            hit = [s for s in seqs if s.seq_id in ids and not s.is_finished]
            for s in hit:
                s.error = f"engine error: {exc!r}"
                self.llm.abort(s)
            if hit and self.is_main and key in self._active:
                for c in self._active[key].choices:
                    if not c.done and c.reason is None:
                        c.reason = "error"

    def _fail(self, handle: RequestHandle, message: str) -> None:
        for c in handle.choices:
            if not c.done:
                c.done = True
                _safe_emit(handle, RequestEvent(c.index, finish_reason="error", error=message))

    def _collect(self, step_start: float | None = None) -> None:
        """Rank 0: hand each request what the step gave it; finish the finished ones."""
        if not self.is_main:
            return
        now = time.perf_counter()
        for key, handle in list(self._active.items()):
            if handle.admitted is None and any(
                c.seq is not None and (c.seq.status != SeqStatus.WAITING or c.seq.is_finished)
                for c in handle.choices
            ):
                handle.admitted = step_start if step_start is not None else now
                self.metrics.observe_queue(handle)
            new_total = 0
            for c in handle.choices:
                if c.done or c.seq is None:
                    continue
                new_total += self._collect_choice(handle, c)
            if new_total:
                self.metrics.observe_tokens(handle, new_total, now)
                if handle.first_token is None:
                    handle.first_token = now
                handle.last_token = now
            if handle.done:
                handle.finished = now
                del self._active[key]
                self._seqs.pop(key, None)
                self.metrics.observe_request(handle, [c.reason or "abort" for c in handle.choices])

    def _collect_choice(self, handle: RequestHandle, c: _Choice) -> int:
        """Send one choice its news; returns how many new tokens it got."""
        seq = c.seq
        while c.hits_seen < len(seq.hits):
            self.metrics.observe_prefix(seq.prefill_end, seq.hits[c.hits_seen])
            c.hits_seen += 1
        out = list(seq.output_ids)
        before = c.ntok
        if c.reason is not None:
            # Cut by the loop (shutdown, a failed batch): flush what was generated so far.
            delta, _ = c.text.update(out, final=True)
            reason = c.reason
        else:
            if len(out) == before and not seq.is_finished:
                return 0
            reason = (
                FINISH_REASONS.get(seq.finish_reason or "", "abort") if seq.is_finished else None
            )
            text_ids = out
            if reason == "stop" and out and out[-1] in c.params.stop_token_ids:
                c.stop_reason = out[-1]
                text_ids = out[:-1]  # a stop token's text is not part of the completion
            delta, cut = c.text.update(text_ids, final=reason is not None)
            if cut is not None:
                out = out[: max(cut, before)]
                reason, c.stop_reason = "stop", c.text.stop_hit
                if not seq.is_finished:
                    self._loop_aborts.append(("abort", handle.key, "stop"))
        new_ids = out[before:]
        c.ntok = max(before, len(out))
        logprobs = None
        lp = getattr(seq, "output_logprobs", None)
        if lp is not None and getattr(c.params, "logprobs", None) is not None:
            logprobs = list(lp[before : before + len(new_ids)])
        event = RequestEvent(c.index, delta, new_ids, logprobs)
        if reason is not None:
            c.done, c.reason = True, reason
            event.finish_reason, event.stop_reason = reason, c.stop_reason
            if reason == "error":
                event.error = seq.error or "the request failed in the engine"
        if event.text or event.token_ids or event.finish_reason:
            _safe_emit(handle, event)
        return len(new_ids)

    def _count_queues(self) -> None:
        """Refresh the admission counts. A cancelled or failed request leaves the queues at
        the next step, but its client has its answer already: it is not counted."""
        sched = self.llm.scheduler
        running = sum(1 for s in list(sched.running) if not s.aborted)
        waiting = sum(1 for s in list(sched.waiting) if not s.aborted)
        with self._cv:
            self._queued = (running, waiting)

    def _take_snapshot(self) -> None:
        llm = self.llm
        bm = llm.block_manager
        image_units = sum(len(im.units) for im in list(bm.images.values()))
        in_use = sum(1 for r in bm.ref if r > 0)
        slots_free = len(bm.free_slots)
        running, waiting = self._queued
        self.snapshot = {
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "num_pages_total": bm.num_pages,
            "num_pages_in_use": in_use - image_units,
            "num_pages_images": image_units,
            "num_slots_total": bm.num_slots,
            "num_slots_in_use": bm.num_slots - slots_free,
            "page_cache_usage_perc": in_use / max(1, bm.num_pages),
            "state_cache_usage_perc": (bm.num_slots - slots_free) / max(1, bm.num_slots),
            "active_requests": len(self._active),
            "engine_steps": self.steps,
            "step_counters": _step_counters(llm),
        }


def _ignore(event: RequestEvent) -> None:
    """The sink of a request whose client has gone."""


def _safe_emit(handle: RequestHandle, event: RequestEvent) -> None:
    try:
        handle.emit(event)
    except Exception:  # noqa: BLE001 - a consumer that went away must not stop the loop
        handle.emit = _ignore
