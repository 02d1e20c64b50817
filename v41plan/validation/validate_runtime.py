"""Runtime acceptance: drive the real engine through every scheduler route, under both transfers.

    torchrun --standalone --nproc_per_node=2 -m v41plan.validation.validate_runtime \\
        --spec specs/tiny.yaml --output report.json

Every case asserts that a route (chunked and reordered, forked, replayed from a missing image,
preempted, cancelled, recycled, backed off) finishes with the tokens an uninterrupted scheduled
run of the same route produced, and that the path it meant to exercise was taken (hits,
restores and replay rows counted from the engine). There is no separate oracle.

Which run a case compares with, never the same route again: with the ``copy`` transfer a
restore is exact, so every route is compared with the cold run of its prompt. With the
``replay`` transfer (encoder SWA bounded replay) a resumed request's logits differ from a cold
prefill's by design, so a route that resumes from a prefix hit ``h`` is compared with a
*rebuild reference* built without the scheduler: the runner is driven directly with a cold
prefill of the prompt's first ``h`` tokens (one forward, its own slot) and then a fresh-slot
forward of the request starting at the same ``forward_start`` over those pages, followed by the
route's own chunk and decode boundaries, sampled greedily here (``rebuild_reference``). Routes
that never resume from a hit are compared with the cold run in both. Which path a case expects
(restores or replay rows, decoder replay taken) follows from the engine's own options and the
runner's flags, not from the case's name.

Every rank builds the same engine and drives the same schedule; the token lists of all ranks
must agree. Only rank 0 prints and writes; it prints ``RUNTIME_ACCEPTANCE_PASSED`` on success.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from v41plan.runtime.dist import all_equal, init_distributed, shutdown
from v41plan.serving.admission import add_kernel_flags, kernel_options
from v41plan.serving.block_manager import chain_hashes
from v41plan.serving.engine import LLM, resolve_spec
from v41plan.serving.sampling import SamplingParams
from v41plan.validation.provenance import provenance

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
CANCEL_PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


class CaseFailed(AssertionError):
    """A scenario did not finish as required."""


def check(cond: bool, message: str) -> None:
    """Raise ``CaseFailed`` with ``message`` unless ``cond``."""
    if not cond:
        raise CaseFailed(message)


@dataclass
class Route:
    """One engine run: its requests' tokens and what the scheduler did."""

    tokens: list[list[int]]
    seqs: list
    events: list[dict] = field(default_factory=list)
    engine: LLM | None = None

    @property
    def restores(self) -> int:
        return sum(ev["restores"] for ev in self.events)

    @property
    def replay_rows(self) -> int:
        return sum(ev["replay_rows"] for ev in self.events)


class Validator:
    """Builds engines sharing one runner and runs the scenarios for one state transfer."""

    def __init__(self, spec, checkpoint, transfer: str, base_options: dict, runner) -> None:
        self.spec = spec
        self.checkpoint = checkpoint
        self.transfer = transfer
        self.base = dict(base_options, encoder_swa_bounded_replay=(transfer == "replay"))
        self.runner = runner
        self.P = spec.replay.hash_block_tokens
        self.W = spec.dims.sliding_window
        self.events: list[dict] = []
        self._memo: dict = {}

    def engine(self, **overrides) -> LLM:
        """A fresh scheduler and block manager over the shared runner."""
        opts = dict(self.base, **overrides)
        return LLM(self.spec, self.checkpoint, runner_factory=lambda *a: self.runner, **opts)

    def drive(
        self,
        llm: LLM,
        prompts,
        params=PARAMS,
        hook=None,
        case: str = "",
        max_steps: int = 400,
        before=None,
    ) -> Route:
        """Add ``prompts``, then schedule/execute/postprocess until drained.

        ``before(step, llm, seqs)`` runs before each schedule (preemption happens there);
        ``hook(step, llm, seqs, batch)`` runs after scheduling and before executing each batch, so
        it can cancel a request while its chunk is in flight.
        """
        seqs = [llm.add_request(p, params) for p in prompts]
        for s in seqs:
            check(s.error is None, f"{case}: request refused: {s.error}")
        sched = llm.scheduler
        first = len(sched.events)
        for step in range(max_steps):
            if before is not None:
                before(step, llm, seqs)
            if llm.async_scheduling:  # the engine's own stepping: decode steps overlap
                if sched.is_finished():
                    llm.drain()
                    break
                on_batch = None if hook is None else (lambda b, k=step: hook(k, llm, seqs, b))
                llm.step(on_batch)
                continue
            if sched.is_finished():
                break
            batch = sched.schedule()
            if batch is None:
                raise CaseFailed(f"{case}: nothing schedulable with requests queued")
            if hook is not None:
                hook(step, llm, seqs, batch)
            sched.postprocess(batch, llm.runner.execute(batch))
        else:
            raise CaseFailed(f"{case}: scheduler did not drain in {max_steps} steps")
        events = [dict(ev, case=case) for ev in sched.events[first:]]
        self.events.extend(events)
        return Route([list(s.output_ids) for s in seqs], seqs, events, llm)

    def cold(self, prompt, params=PARAMS, **overrides) -> list[int]:
        """The prompt alone in a fresh engine: the uninterrupted run of a route without a hit."""
        key = ("cold", tuple(prompt), params, tuple(sorted(overrides.items())))
        if key not in self._memo:
            self._memo[key] = self.drive(
                self.engine(**overrides), [prompt], params, case="reference_cold"
            ).tokens[0]
        return self._memo[key]

    def resumed_reference(self, prompt, route: Route, index: int, **overrides) -> list[int]:
        """What request ``index`` of ``route``, resumed from a prefix hit, must produce: the cold
        run under ``copy`` (a restore is exact), the rebuild reference under ``replay``."""
        llm = route.engine
        if not llm.options.encoder_swa_bounded_replay:
            return self.cold(prompt, **overrides)
        return self.rebuild_reference(prompt, route, index)

    def rebuild_reference(self, prompt, route: Route, index: int) -> list[int]:
        """The replay transfer's resume, rebuilt without the scheduler, block manager or prefix
        cache: a cold prefill of ``prompt[:hit]`` in one forward (slot 0, its own pages), then
        request ``index``'s forwards from the route's events (the rebuild at the same
        ``forward_start`` in a fresh slot 1 over the same prefix pages, its later chunks and
        decode steps), each final row sampled greedily."""
        from v41plan.serving.batch import ScheduledBatch, ScheduledRequest, SlotDelta

        seq = route.seqs[index]
        hit = seq.hits[-1]
        check(hit > 0, f"rebuild reference of a request with no hit ({seq.hits})")
        spans = [
            (ev["starts"][k], ev["resumes"][k], ev["ends"][k], ev["phase"])
            for ev in route.events
            for k, sid in enumerate(ev["ids"])
            if sid == seq.seq_id
        ]
        # the request's spans from its last admission (the one that resumed at ``hit``)
        first = max(i for i, (st, res, _e, ph) in enumerate(spans) if res == hit and ph != "decode")
        spans = spans[first:]
        P = self.P
        spec_block = getattr(self.runner, "spec_block", 0)  # a decode span's drafted rows
        n_pages = -(-(len(prompt) + PARAMS.max_tokens + 2 + spec_block) // P)
        prefix_pages = tuple(range(hit // P))
        own = tuple(range(hit // P, hit // P + n_pages))  # pages only this request writes
        cold_pages = prefix_pages + tuple(range(hit // P + n_pages, hit // P + n_pages + 2))
        runner, steps = self.runner, [0]

        def delta(slot, tokens, blocks, t0=0, b0=0, reset=True):
            return SlotDelta(slot, reset, t0, np.asarray(tokens, dtype=np.int64), b0,
                             np.asarray(blocks, dtype=np.int32))  # fmt: skip

        def run(req: ScheduledRequest, phase: str, deltas=()):
            steps[0] += 1
            # counted like a scheduler step: the graph accounting sees every forward it ran
            self.events.append({
                "step": 10_000 + steps[0], "phase": phase, "ids": [req.seq_id],
                "slots": [req.slot], "starts": [req.start], "resumes": [req.resume],
                "ends": [req.end], "replay_rows": req.replay_rows, "stores": 0, "restores": 0,
                "case": "reference_rebuild",
            })  # fmt: skip
            batch = ScheduledBatch(10_000 + steps[0], phase, (req,), deltas=tuple(deltas))
            return runner.execute(batch)

        for st in range(0, hit, runner.model.max_tokens):  # the prefix, cold, in its own slot
            end = min(hit, st + runner.model.max_tokens)
            req = ScheduledRequest(-1, 0, st, st, end, hit, 0, st == 0, end == hit)
            run(req, "prefill", [delta(0, prompt[:hit], cold_pages)] if st == 0 else ())
        tokens = list(prompt)
        table = prefix_pages + own
        synced = len(tokens)
        for k, (start, resume, end, phase) in enumerate(spans):
            req = ScheduledRequest(
                -2, 1, start, resume, end, len(prompt), hit, k == 0, end >= len(prompt)
            )
            if k == 0:
                deltas = [delta(1, tokens, table)]
            else:
                deltas = [delta(1, tokens[synced:], (), synced, len(table), False)]
            synced = len(tokens)
            out = run(req, "decode" if phase == "decode" else "prefill", deltas)
            if end >= len(prompt) and len(tokens) - len(prompt) < PARAMS.max_tokens:
                check(
                    end - (spec_block if start >= len(prompt) else 0) == len(tokens),
                    f"reference span {start}..{end} past {len(tokens)} tokens",
                )
                if out.spec_tokens is not None:  # the accepted drafts and the next token
                    emitted = [t for t in out.spec_tokens[0].tolist() if t >= 0]
                    tokens += emitted[: PARAMS.max_tokens - (len(tokens) - len(prompt))]
                else:
                    tokens.append(out.tokens[-2])  # greedy: the slot was given no parameters
        return tokens[len(prompt) :]


def byte_prompt(llm_or_tok, text: str) -> list[int]:
    """Token ids of ``text``."""
    return list(llm_or_tok.encode(text))


def repeat_to(ids: list[int], n: int) -> list[int]:
    """``ids`` repeated until it holds ``n`` tokens, cut there (prompt lengths scale with PAGE)."""
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def scenarios(v: Validator, tok, only: frozenset[str] | None = None) -> dict[str, dict]:
    """Run every scenario (or those named in ``only``; cases comparing against the baseline's
    tokens need ``baseline`` too); returns ``{name: {"passed": bool, ...}}``."""
    P, W = v.P, v.W
    # Two routes compared token for token either back off alike (the same final forward) or end
    # in a final chunk of at least W rows. A final chunk shorter than W starts a hash block
    # earlier, and the rows it recomputes see encoder windows truncated at that start (by
    # design), so a one-forward and a backed-off chunked prefill may legitimately differ.
    base = repeat_to(
        byte_prompt(tok, "Facts about water, clouds, sunlight and the atmosphere. "), 4 * P + 10
    )
    other = repeat_to(
        byte_prompt(tok, "A Python function can return a list of prime numbers. "), 2 * P + 12
    )
    unique = byte_prompt(tok, "Discuss a different topic: binary search. ") + base
    cancelled = byte_prompt(tok, "A cancelled request: ") + other
    long_prompt = (base * 3)[: 9 * P + max(20, W)]  # its 3P-chunked route ends in >= W rows
    short_suffix = base[: 3 * P] + byte_prompt(tok, "ok")
    chunked = {"long_prefill_token_threshold": P, "max_num_batched_tokens": 4 * P}
    results: dict[str, dict] = {}
    gold: dict[str, list[int]] = {}

    def case(name):
        def wrap(fn):
            if only is not None and name not in only:
                return fn
            t0 = time.perf_counter()
            try:
                info = fn() or {}
                results[name] = {"passed": True, **info}
            except CaseFailed as exc:
                results[name] = {"passed": False, "error": str(exc)}
            except Exception as exc:  # noqa: BLE001 - reported per case, the others still run
                results[name] = {
                    "passed": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=6),
                }
            results[name]["seconds"] = round(time.perf_counter() - t0, 3)
            return fn

        return wrap

    @case("baseline")
    def _():
        r = v.drive(v.engine(**chunked), [base, other], case="baseline")
        gold["base"], gold["other"] = r.tokens
        check(
            all(len(t) == PARAMS.max_tokens for t in r.tokens),
            "baseline did not generate max_tokens",
        )
        for name, p in (("base", base), ("other", other)):
            check(v.cold(p, **chunked) == gold[name], f"batched {name} differs from its run alone")
        return {"tokens": r.tokens}

    @case("chunked_batched_reorder")
    def _():
        def reverse(step, llm, seqs, batch):
            llm.scheduler.running.reverse()

        r = v.drive(
            v.engine(long_prefill_token_threshold=P // 2, max_num_batched_tokens=4 * (P // 2)),
            [base, other],
            hook=reverse,
            case="chunked_batched_reorder",
        )
        ragged = sum(1 for ev in r.events if ev["phase"] == "prefill" and len(ev["ids"]) > 1)
        check(ragged > 0, "no ragged multi-request prefill batch")
        check(r.tokens == [gold["base"], gold["other"]], f"tokens {r.tokens} != baseline")
        return {"ragged_prefill_batches": ragged, "batches": len(r.events), "tokens": r.tokens}

    @case("prefix_fork")
    def _():
        # Submitted together; the budget admits the second after the first has published blocks.
        opts = {"long_prefill_token_threshold": 0, "max_num_batched_tokens": 2 * P}
        r = v.drive(v.engine(**opts), [base, base], case="prefix_fork")
        hit = r.seqs[1].hits[0]
        check(len(base) > 2 * P, "fork prompt must be longer than two PAGEs")
        check(hit > 0, "the second request did not hit the first's prefix")
        check(r.tokens[0] == v.cold(base, **opts), "first fork request differs from its cold run")
        if not r.engine.options.encoder_swa_bounded_replay:
            check(r.restores >= 1, "no checkpoint restore in the copy fork")
        else:
            check(r.replay_rows >= P, "no encoder replay rows in the replay fork")
        ref = v.resumed_reference(base, r, 1, **opts)
        check(r.tokens[1] == ref, f"forked request {r.tokens[1]} != its reference {ref}")
        return {
            "hit": hit,
            "restores": r.restores,
            "replay_rows": r.replay_rows,
            "tokens": r.tokens,
        }

    @case("missing_image_replay")
    def _():
        llm = v.engine(**chunked)
        v.drive(llm, [base], case="missing_image_warmup")
        dropped = llm.block_manager.drop_images()
        r = v.drive(llm, [base], case="missing_image_replay")
        s = r.seqs[0]
        if not llm.options.encoder_swa_bounded_replay:
            check(dropped >= 1, "no image to drop after a chunked run")
            check(s.hits == [0], f"hit {s.hits} was not rewound to the recoverable boundary 0")
            check(r.tokens[0] == gold["base"], "replay from 0 differs from the baseline")
        else:
            # The replay transfer keeps no image: the hit needs none and rebuilds its windows.
            check(
                dropped == 0 and not llm.block_manager.images, "the replay transfer kept an image"
            )
            check(s.hits[0] > 0 and s.replay_rows >= P, "no imageless hit with encoder replay")
            ref = v.resumed_reference(base, r, 0, **chunked)
            check(r.tokens[0] == ref, "imageless replay differs from its rebuild reference")
        return {
            "dropped_images": dropped,
            "hits": s.hits,
            "replay_rows": s.replay_rows,
            "tokens": r.tokens,
        }

    @case("kv_offload")
    def _():
        # A device pool small enough that other prompts evict the prefix; the local KV tier
        # gives it back, and the request resumes as from a device hit.
        tier = {"kv_connector": "local", "bytes": 1 << 30}
        pages = (len(unique) + PARAMS.max_tokens) // P + 3  # one request of the turnover fits
        if v.transfer == "copy":  # and base's images (a store is skipped where none fits)
            o = v.base
            geom = v.spec.geometry(
                o.get("kv_cache_dtype", "bf16"), o.get("index_cache_dtype", "fp8")
            )
            pages += (len(base) // P) * geom.units_per_image
        llm = v.engine(**chunked, num_pages=pages, kv_transfer_config=tier)
        v.drive(llm, [base], case="kv_offload_warmup")
        for p in (other, unique, cancelled):  # none shares the prefix
            v.drive(llm, [p], case="kv_offload_turnover")
        hashes = chain_hashes(base, P, (len(base) - 1) // P)
        on_device = len(llm.block_manager.lookup(hashes))
        check(on_device < len(hashes), "the turnover left the whole prefix on the device")
        r = v.drive(llm, [base], case="kv_offload")
        s = r.seqs[0]
        check(s.kv_loaded_blocks > 0, f"nothing came back from the KV tier ({llm.connector.stats})")
        check(s.hits[-1] > on_device * P, f"hit {s.hits} not past the device's {on_device} blocks")
        ref = v.resumed_reference(base, r, 0, **chunked)
        check(r.tokens[0] == ref, f"offloaded resume {r.tokens[0]} != its reference {ref}")
        return {
            "device_blocks": on_device,
            "loaded_blocks": s.kv_loaded_blocks,
            "hits": s.hits,
            "tokens": r.tokens,
        }

    @case("preempt_resume")
    def _():
        max_hit = (len(unique) - 1) // P * P
        state = {}

        def preempt(step, llm, seqs):
            s = seqs[0]
            if (
                not state
                and s.slot is not None
                and s.is_prefilling
                and s.num_cached_tokens >= max_hit
            ):
                state["cursor"] = s.num_cached_tokens
                llm.preempt(s)  # mid-prefill, at a cursor on the hash-block grid

        llm = v.engine(**chunked)
        r = v.drive(llm, [unique], before=preempt, case="preempt_resume")
        s = r.seqs[0]
        check(bool(state) and s.preemptions == 1, "the request was not preempted mid-prefill")
        check(s.hits[-1] > 0, f"resume did not go through the prefix cache (hits {s.hits})")
        if not llm.options.encoder_swa_bounded_replay:
            check(s.restores >= 1, "no restore on resume")
        else:
            check(s.replay_rows >= P, "no encoder replay on resume")
        ref = v.resumed_reference(unique, r, 0, **chunked)
        check(r.tokens[0] == ref, f"resumed {r.tokens[0]} != uninterrupted {ref}")
        return {
            "preempted_at": state["cursor"],
            "hits": s.hits,
            "restores": s.restores,
            "replay_rows": s.replay_rows,
            "tokens": r.tokens,
        }

    @case("cancel_middle_chunk")
    def _():
        llm = v.engine(**chunked)
        state = {}

        def cancel(step, llm, seqs, batch):
            req = next((q for q in batch.requests if q.seq_id == seqs[0].seq_id), None)
            if not state and req is not None and not req.is_final_chunk and req.resume >= P:
                llm.abort(seqs[0])  # while this middle chunk is in flight
                state["slot"] = req.slot

        r = v.drive(llm, [cancelled], CANCEL_PARAMS, hook=cancel, case="cancel_middle_chunk")
        s = r.seqs[0]
        check(bool(state), "no middle chunk to cancel")
        check(
            s.finish_reason == "aborted" and s.output_ids == [],
            "cancelled request did not finish empty",
        )
        check(len(llm.block_manager.free_slots) == llm.block_manager.num_slots, "slot not freed")
        # Slot recycling: the next request gets the freed slot and resets it at position 0.
        r2 = v.drive(llm, [other], case="slot_recycle")
        check(r2.events[0]["ids"] == [r2.seqs[0].seq_id], "recycle request not scheduled alone")
        check(
            r2.events[0]["slots"] == [state["slot"]], "the new request did not get the freed slot"
        )
        check(r2.tokens[0] == gold["other"], "recycled slot leaked state into a new request")
        results["slot_recycle"] = {"passed": True, "slot": state["slot"], "tokens": r2.tokens[0]}
        return {"slot": state["slot"], "tokens": r.tokens}

    @case("cancel_first_deferred_step")
    def _():
        llm = v.engine(**chunked)
        state = {}

        def cancel(step, llm, seqs, batch):
            req = next((q for q in batch.requests if q.seq_id == seqs[1].seq_id), None)
            if not state and req is not None and req.is_final_chunk and batch.phase == "prefill":
                llm.abort(seqs[1])  # its first token is not delivered yet
                state["step"] = batch.step

        r = v.drive(
            llm, [other, cancelled], CANCEL_PARAMS, hook=cancel, case="cancel_first_deferred_step"
        )
        check(bool(state), "no final chunk to cancel")
        check(
            r.seqs[1].finish_reason == "aborted" and r.seqs[1].output_ids == [],
            "request cancelled before its first token produced output",
        )
        check(r.seqs[0].finish_reason == "length", "the surviving request did not finish")
        survivor = v.cold(other, CANCEL_PARAMS, **chunked)
        check(r.tokens[0] == survivor, f"the survivor {r.tokens[0]} != its run alone {survivor}")
        check(len(llm.block_manager.free_slots) == llm.block_manager.num_slots, "slot not freed")
        return {"step": state["step"], "tokens": r.tokens}

    @case("decoder_replay_long_prompt")
    def _():
        stats = getattr(v.runner, "stats", None)
        before = dict(stats) if stats is not None else {}
        whole = {
            "long_prefill_token_threshold": 0,
            "max_num_batched_tokens": max(10 * P, len(long_prompt)),
        }
        one = v.drive(v.engine(**whole), [long_prompt], case="decoder_replay_long_prompt")
        final = [ev for ev in one.events if ev["phase"] == "prefill"][-1]
        rows = final["ends"][0] - final["starts"][0]
        check(rows > W, f"final forward of {rows} rows does not exceed W={W}")
        plan = plan_of_final(v, one)
        expected = bool(one.engine.options.decoder_swa_bounded_replay)
        check(
            plan["decoder_replay"] == expected, f"decoder replay {plan} with the option {expected}"
        )
        # The same prompt in chunks ends with a final forward that also holds more than W rows.
        two = v.drive(
            v.engine(long_prefill_token_threshold=3 * P, max_num_batched_tokens=4 * P),
            [long_prompt],
            case="decoder_replay_long_prompt_chunked",
        )
        last = [ev for ev in two.events if ev["phase"] == "prefill"][-1]
        check(last["starts"] == last["resumes"], "the chunked route's final forward backed off")
        check(one.tokens == two.tokens, f"one forward {one.tokens} != chunked {two.tokens}")
        taken = {}
        if stats is not None:
            taken = {
                k: stats.get(k, 0) - before.get(k, 0) for k in ("decoder_replay_steps", "tail_rows")
            }
            ran = taken["decoder_replay_steps"] >= 1
            check(
                ran == expected, f"runner decoder-replay steps {taken} with the option {expected}"
            )
        return {
            "final_rows": rows,
            "plan": plan,
            "runner": taken,
            "tokens": one.tokens + two.tokens,
        }

    @case("decoder_replay_off")
    def _():
        # --no-decoder-swa-bounded-replay: every row runs every layer and nothing backs off, so a
        # prompt whose last chunk is short runs the same tokens chunked or whole.
        from v41plan.serving.runner import build_runner

        opts = dict(v.base, decoder_swa_bounded_replay=False)
        probe = LLM(v.spec, v.checkpoint, runner_factory=lambda *a: None, **opts)
        runner = build_runner(v.spec, v.checkpoint, probe.options)
        off = Validator(v.spec, v.checkpoint, v.transfer, opts, runner)
        prompt = long_prompt[: 5 * P + 3]
        one = off.drive(
            off.engine(long_prefill_token_threshold=0), [prompt], case="decoder_replay_off"
        )
        two = off.drive(off.engine(**chunked), [prompt], case="decoder_replay_off_chunked")
        v.events.extend(
            dict(ev, runner="replay_off") for ev in off.events
        )  # not the graph runner's
        check(
            all(s == r for ev in two.events for s, r in zip(ev["starts"], ev["resumes"])),
            "a forward backed off with decoder replay off",
        )
        stats = getattr(runner, "stats", {})
        check(stats.get("decoder_replay_steps", 0) == 0, "decoder replay ran with the switch off")
        check(
            one.tokens == two.tokens, f"whole {one.tokens} != chunked {two.tokens} with replay off"
        )
        return {"tokens": one.tokens + two.tokens}

    @case("mixed_decode_and_prefill")
    def _():
        # A long prompt arrives while two requests decode: they ride in the same forwards as its
        # prefill chunks and advance one token every step, with the tokens they make alone.
        llm = v.engine(**chunked)
        state = {"steps": 0}

        def arrive(step, llm, seqs):
            decoding = [s for s in seqs[:2] if s.output_ids and not s.is_finished]
            if len(seqs) == 2 and len(decoding) == 2:
                seqs.append(llm.add_request(long_prompt, PARAMS))

        r = v.drive(llm, [other, unique], CANCEL_PARAMS, before=arrive, case="mixed")
        check(len(r.seqs) == 3, "the long prompt never arrived while both requests decoded")
        long_id = r.seqs[2].seq_id
        last = {s.seq_id: max(ev["step"] for ev in r.events if s.seq_id in ev["ids"])
                for s in r.seqs[:2]}  # fmt: skip
        for ev in r.events:
            if long_id not in ev["ids"] or ev["phase"] != "prefill":
                continue
            state["steps"] += 1
            ends = dict(zip(ev["ids"], zip(ev["starts"], ev["ends"], strict=True), strict=True))
            for s in r.seqs[:2]:  # decoding from before the arrival until its last step
                if ev["step"] > last[s.seq_id]:
                    continue
                check(s.seq_id in ends, f"step {ev['step']}: request {s.seq_id} did not decode")
                st, en = ends[s.seq_id]
                rows = 1 + getattr(v.runner, "spec_block", 0)  # (DSpark: the anchor and drafts)
                check(en - st == rows, f"request {s.seq_id} ran {en - st} rows beside the prefill")
        check(state["steps"] >= 2, "the long prompt's prefill took fewer than two mixed steps")
        for i, prompt in enumerate((other, unique)):
            alone = v.cold(prompt, CANCEL_PARAMS, **chunked)
            check(r.tokens[i] == alone, f"request {i} decoded {r.tokens[i]} mixed, {alone} alone")
        check(r.seqs[2].finish_reason == "length", "the long prompt did not finish")
        return {"mixed_steps": state["steps"], "tokens": r.tokens}

    @case("prefix_hit_short_suffix")
    def _():
        llm = v.engine(**chunked)
        v.drive(llm, [base], case="short_suffix_warmup")
        r = v.drive(llm, [short_suffix], case="prefix_hit_short_suffix")
        s = r.seqs[0]
        suffix = len(short_suffix) - s.hits[0]
        check(s.hits[0] > 0 and suffix < W, f"hit {s.hits} leaves a suffix of {suffix}, not < W")
        check(
            s.starts[0] == s.hits[0] - P,
            f"forward did not back off a hash block: starts {s.starts}",
        )
        check(s.replay_rows >= P, "no back-off rows counted")
        if not llm.options.encoder_swa_bounded_replay:
            check(s.restores == 1, "no restore for the short suffix")
        ref = v.resumed_reference(short_suffix, r, 0, **chunked)
        check(r.tokens[0] == ref, f"short-suffix hit {r.tokens[0]} != uninterrupted {ref}")
        return {
            "hits": s.hits,
            "starts": s.starts,
            "replay_rows": s.replay_rows,
            "tokens": r.tokens,
        }

    return results


def plan_of_final(v: Validator, route: Route) -> dict:
    """The planner's view of a route's last prefill batch, under the runner's own flags."""
    from v41plan.planner.step import plan_step
    from v41plan.serving.batch import (
        ScheduledBatch,
        ScheduledRequest,
        SlotDelta,
        SlotTables,
        to_step_input,
    )

    ev = [e for e in route.events if e["phase"] == "prefill"][-1]
    s = route.seqs[0]
    n = ev["ends"][0]
    pages = np.arange(-(-n // v.P), dtype=np.int32)
    req = ScheduledRequest(
        s.seq_id, 0, ev["starts"][0], ev["resumes"][0], n, n, 0, ev["starts"][0] == 0, True
    )
    delta = SlotDelta(0, True, 0, np.asarray(s.token_ids[:n], dtype=np.int64), 0, pages)
    batch = ScheduledBatch(ev["step"], "prefill", (req,), deltas=(delta,))
    tables = SlotTables(1, len(pages))
    tables.apply(batch)
    plan = plan_step(to_step_input(batch, tables), v.spec, **v.runner.flags)
    tail = [int(x) for x in plan.tail_rows]
    return {
        "decoder_replay": bool(plan.decoder_replay),
        "tail_rows": len(tail),
        "rows": int(plan.scheduled_tokens),
    }


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line on stderr (exit 2), like the ``v41plan`` commands."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Help(argparse.HelpFormatter):
    """Adds ``(default: X)`` to an option's help unless it states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False  # 0 is a default to show
        if "default" in text.lower() or unset or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class Refused(Exception):
    """An option or input refused before any scenario runs (one line on stderr, exit 2)."""


def _parser() -> argparse.ArgumentParser:
    from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES

    ap = _Parser(
        prog="validate_runtime",
        description=__doc__.splitlines()[0],
        formatter_class=_Help,
    )
    ap.add_argument("--spec", default="specs/tiny.yaml", help="compiled spec name or spec file")
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint directory (default: the spec's seeded random weights, in memory)",
    )
    ap.add_argument(
        "--output", default=None, help="JSON report path, rank 0 writes it (default: none)"
    )
    ap.add_argument(
        "--graph",
        action="store_true",
        help="decode graphs (enforce_eager=False), their tokens checked against an eager "
        "runner's; needs CUDA",
    )
    ap.add_argument(
        "--cudagraph-mode",
        choices=["FULL", "PIECEWISE"],
        default="FULL",
        help="with --graph: FULL (one replay a decode step) or PIECEWISE (the dense pieces "
        "captured, attention eager between them)",
    )
    ap.add_argument(
        "--cases",
        default=None,
        help="comma-separated scenario names to run (default: all); a debugging run: it prints "
        "RUNTIME_CASES_PASSED, never the acceptance line",
    )
    ap.add_argument(
        "--transfer",
        choices=["replay", "copy", "both"],
        default="both",
        help="state transfer(s) to validate",
    )
    ap.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="bf16", help="main pool format"
    )
    ap.add_argument(
        "--index-cache-dtype", choices=INDEX_CACHE_DTYPES, default="fp8", help="index format"
    )
    ap.add_argument(
        "--dtype",
        default="float64",
        choices=["float32", "float64", "bfloat16"],
        help="executor dtype (float64 keeps greedy ties away on CPU)",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda when available, else cpu",
    )
    add_kernel_flags(ap)
    ap.add_argument(
        "--speculative",
        action="store_true",
        help="DSpark speculative decoding (the spec's draft): every scenario runs with it, and "
        "its tokens are compared with the same scenarios run without it",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="default: the world size when the model splits over it, else 1 (replicas)",
    )
    ap.add_argument(
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="routed experts whole per rank, or intermediate-sharded",
    )
    return ap


def _check_inputs(args: argparse.Namespace):
    """The spec, checked before anything runs; ``Refused`` naming the option otherwise."""
    from v41plan.geometry.errors import SpecError
    from v41plan.geometry.resolve import SpecArgumentError

    try:
        spec = resolve_spec(args.spec)
    except SpecArgumentError as exc:
        raise Refused(f"--spec {exc}") from None
    except SpecError as exc:
        raise Refused(str(exc)) from None
    if args.graph:
        import torch

        if args.device == "cpu" or not torch.cuda.is_available():
            raise Refused(
                f"--graph: {args.cudagraph_mode} decode graphs need CUDA, and this run is on "
                "the CPU (omit --graph, or run on a GPU)"
            )
    elif args.cudagraph_mode != "FULL":
        raise Refused(f"--cudagraph-mode {args.cudagraph_mode} needs --graph")
    if args.checkpoint is not None:
        from v41plan.model.checkpoint import CheckpointError, check_checkpoint

        try:
            check_checkpoint(args.checkpoint, spec)
        except CheckpointError as exc:
            raise Refused(f"--checkpoint {exc}") from None
    return spec


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m v41plan.validation.validate_runtime``, also under torchrun).

    Exit codes: 0 passed, 1 a scenario failed (or the run stopped), 2 an option or input
    refused before any scenario ran (one line on stderr).
    """
    from v41plan.runtime.dist import world_info

    args = _parser().parse_args(argv)
    try:
        spec = _check_inputs(args)
    except Refused as exc:
        if world_info().is_main:
            print(f"validate_runtime: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # tiny tensors: more threads only contend on a shared CPU
    info = init_distributed(args.device)
    t0 = time.perf_counter()
    only = frozenset(c.strip() for c in args.cases.split(",") if c.strip()) if args.cases else None
    P = spec.replay.hash_block_tokens
    tp = args.tensor_parallel_size
    if tp is None:  # auto: shard when the model splits over the world, else every rank a replica
        from v41plan.serving.admission import default_tensor_parallel_size

        tp = default_tensor_parallel_size(spec, info.world_size, args.enable_expert_parallel)
        if info.is_main and tp != info.world_size:
            print(
                f"note: {spec.name} does not split over {info.world_size} ranks; every rank runs "
                f"a full "
                f"replica (tensor_parallel_size=1) on the identical schedule"
            )
    base_options = {
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "tensor_parallel_size": tp,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enforce_eager": not args.graph,
        "cudagraph_mode": args.cudagraph_mode if args.graph else "NONE",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 10 * P,
        "max_model_len": 24 * P,
        "num_pages": 4 * 24 + 64,
        "dtype": args.dtype,
        "device": args.device,
        **kernel_options(args),
    }
    if args.speculative:
        base_options["speculative_config"] = {"method": "dspark"}
    from v41plan.serving.admission import ConfigError, check_options

    try:
        for transfer in ["replay", "copy"] if args.transfer == "both" else [args.transfer]:
            check_options(
                dict(base_options, encoder_swa_bounded_replay=(transfer == "replay")),
                spec,
                info.world_size,
            )
    except ConfigError as exc:
        if info.is_main:
            print(f"validate_runtime: {_one_line(str(exc))}", file=sys.stderr)
        shutdown()
        return 2
    report: dict = {
        "provenance": provenance(),
        "spec": spec.name,
        "world_size": info.world_size,
        "tensor_parallel_size": tp,
        "enable_expert_parallel": args.enable_expert_parallel,
        "graph": args.graph,
        "cudagraph_mode": args.cudagraph_mode if args.graph else "NONE",
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
        "dtype": args.dtype,
        "speculative": args.speculative,
        **kernel_options(args),
        "transfers": {},
    }
    passed = True
    try:
        from v41plan.serving.runner import build_runner

        transfers = ["replay", "copy"] if args.transfer == "both" else [args.transfer]
        for transfer in transfers:
            probe = LLM(
                spec,
                args.checkpoint,
                runner_factory=lambda *a: None,
                encoder_swa_bounded_replay=(transfer == "replay"),
                world_size=info.world_size,
                **base_options,
            )  # refuses a bad configuration before building the runner
            t_build = time.perf_counter()
            runner = build_runner(spec, args.checkpoint, probe.options)
            timing = {"build_s": time.perf_counter() - t_build}
            v = Validator(
                spec,
                args.checkpoint,
                transfer,
                dict(base_options, world_size=info.world_size),
                runner,
            )
            t0 = time.perf_counter()
            results = scenarios(v, probe, only)
            unknown = sorted(only - set(results)) if only else []
            if unknown:
                raise ValueError(f"--cases names no scenario {unknown}")
            timing["scenarios_s"] = time.perf_counter() - t0
            tokens = {k: r.get("tokens") for k, r in results.items()}
            ranks_agree = all_equal(tokens)
            results["ranks_agree"] = {"passed": ranks_agree}
            if args.graph:  # the same scenarios on an eager runner: tokens must be equal
                from dataclasses import replace as _replace

                from v41plan.runtime.graphs import graph_validation

                # the eager runner runs the graph runner's dense pieces: the same compilation
                # level (level 3 is the default under graphs only), so only capture differs
                level = runner.kernels["compilation_level"]
                eager_base = dict(
                    base_options, enforce_eager=True, cudagraph_mode="NONE", compilation_level=level
                )
                t0 = time.perf_counter()
                eager_runner = build_runner(
                    spec,
                    args.checkpoint,
                    _replace(
                        probe.options,
                        enforce_eager=True,
                        cudagraph_mode="NONE",
                        compilation_level=level,
                    ),
                )
                ve = Validator(
                    spec,
                    args.checkpoint,
                    transfer,
                    dict(eager_base, world_size=info.world_size),
                    eager_runner,
                )
                timing["eager_build_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                eager_results = scenarios(ve, probe, only)
                timing["eager_scenarios_s"] = time.perf_counter() - t0
                g = runner.graph_stats() if hasattr(runner, "graph_stats") else {}
                results["graph_replays"] = graph_validation(results, eager_results, g, v.events)
                del eager_runner, ve
            if args.speculative:  # the same scenarios without speculation: equal tokens
                t0 = time.perf_counter()
                plain_base = {k: x for k, x in base_options.items() if k != "speculative_config"}
                plain_probe = LLM(spec, args.checkpoint, runner_factory=lambda *a: None,
                                  encoder_swa_bounded_replay=(transfer == "replay"),
                                  world_size=info.world_size, **plain_base)  # fmt: skip
                plain_runner = build_runner(spec, args.checkpoint, plain_probe.options)
                plain_opts = dict(plain_base, world_size=info.world_size)
                vp = Validator(spec, args.checkpoint, transfer, plain_opts, plain_runner)
                plain = scenarios(vp, plain_probe, only)
                timing["plain_scenarios_s"] = time.perf_counter() - t0
                differ = sorted(
                    k for k, r in plain.items()
                    if "tokens" in r and r.get("tokens") != results.get(k, {}).get("tokens")
                )  # fmt: skip
                stats = runner.stats
                failed = sorted(k for k, r in plain.items() if not r["passed"])
                why = f"tokens differ in {differ}, plain cases failed: {failed}"
                results["speculative_matches_plain"] = {
                    "passed": not differ and not failed,
                    **({"error": why} if differ or failed else {}),
                    "differ": differ,
                    "cases": len(plain),
                    "drafted": stats.get("spec_drafted", 0),
                    "accepted": stats.get("spec_accepted", 0),
                }
                del plain_runner, vp
            ok = all(r["passed"] for r in results.values())
            passed &= ok
            report["transfers"][transfer] = {
                "passed": ok,
                "runner": type(runner).__name__,
                "paged": bool(getattr(runner, "paged", True)),
                "runner_stats": dict(getattr(runner, "stats", {})),
                "graphs": runner.graph_stats() if hasattr(runner, "graph_stats") else {},
                "cases": results,
                "events": v.events,
                "timing_s": {k: round(t, 1) for k, t in timing.items()},
            }
            if info.is_main:
                print(f"[{transfer}] time: " + ", ".join(f"{k} {t:.1f}" for k, t in timing.items()))
                for name, r in results.items():
                    status = "ok  " if r["passed"] else "FAIL"
                    print(
                        f"[{transfer}] {status} {name}"
                        + ("" if r["passed"] else f": {r.get('error')}")
                    )
                if (
                    args.output
                ):  # each finished transfer is on disk even if a later one is cut short
                    with open(args.output, "w") as f:
                        json.dump(
                            dict(report, passed=False, partial=True), f, indent=1, default=str
                        )
    except Exception as exc:  # noqa: BLE001 - the report records why the run stopped
        passed = False
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        if info.is_main:
            if os.environ.get("V41PLAN_TRACEBACK"):
                traceback.print_exc()
            where = f"; traceback in {args.output}" if args.output else ""
            print(
                f"validate_runtime: the run stopped: {_one_line(report['error'])}{where} "
                f"(V41PLAN_TRACEBACK=1 prints it)",
                file=sys.stderr,
            )
    report["passed"] = passed
    report["elapsed_s"] = round(time.perf_counter() - t0, 2)
    if only:  # a subset is a debugging run, never the acceptance
        report["partial"], report["cases_only"] = True, sorted(only)
    if info.is_main:
        if args.output:
            with open(args.output, "w") as f:
                json.dump(report, f, indent=1, default=str)
        word = "CASES" if only else "ACCEPTANCE"
        print(f"RUNTIME_{word}_PASSED" if passed else f"RUNTIME_{word}_FAILED")
    shutdown()
    return 0 if passed else 1


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


if __name__ == "__main__":
    sys.exit(main())
