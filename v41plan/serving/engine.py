"""Offline engine API: ``LLM(spec=..., checkpoint=..., **options).generate(prompts, params)``.

Options are checked before anything loads (``admission.check_options``). A bad request (too
long, bad sampling values, token ids out of range) gets an output with ``error`` set and
finish reason ``error``; the other requests run on. The step-level methods (``add_request``,
``step``, ``abort``, ``preempt``) drive the same scheduler one batch at a time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as SeqT
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path

from v41plan.geometry.resolve import resolve_spec
from v41plan.geometry.runtime import CacheSpec
from v41plan.serving.admission import ConfigError, EngineOptions, check_options
from v41plan.serving.batch import ModelRunner, ScheduledBatch
from v41plan.serving.block_manager import BlockManager
from v41plan.serving.sampling import SamplingParams
from v41plan.serving.scheduler import Scheduler, SchedulerConfig
from v41plan.serving.sequence import SeqStatus, Sequence

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "RequestOutput",
    "SamplingParams",
    "resolve_spec",
]


@dataclass
class CompletionOutput:
    """The generated continuation of one request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    """One request's result, in the order the prompts were given."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    """Why this request failed alone (None when it ran)."""
    prompt_logprobs: list[float | None] | None = None
    """Per prompt position, as vLLM: ``None`` for the first token (nothing precedes it), then
    the log-probability of each later prompt token (``SamplingParams.prompt_logprobs``)."""
    prompt_greedy: list[bool | None] | None = None
    """Beside ``prompt_logprobs``: whether each prompt token is its row's argmax (the first
    maximum) under the preceding tokens; ``None`` for the first token."""
    stats: dict = field(default_factory=dict)
    """What the scheduler did (``hits``, ``starts``, ``replay_rows``, ``restores``,
    ``preemptions``) and, from ``generate``, the timing: ``ttft_s`` (submission to first token),
    ``e2e_s`` (submission to finish) and ``decode_tokens_per_s`` (tokens after the first over
    the time after the first; None with fewer than two tokens)."""


RunnerFactory = Callable[[CacheSpec, str | None, EngineOptions], ModelRunner]


class LLM:
    """The engine: scheduler, block manager and a model runner for one spec."""

    def __init__(
        self,
        spec: str | Path | CacheSpec = "tiny",
        checkpoint: str | None = None,
        *,
        runner_factory: RunnerFactory | None = None,
        tokenizer=None,
        world_size: int | None = None,
        **options,
    ) -> None:
        self.spec = resolve_spec(spec)
        if world_size is None:
            from v41plan.runtime.dist import world_info

            world_size = world_info().world_size
        self.options = check_options(options, self.spec, world_size)  # refuses before any load
        o = self.options
        mc = self.spec.model_config
        self.vocab_size = int(mc.get("vocab_size", 0))
        self.eos_token_id = mc.get("eos_token_id")
        speculative = o.speculative_config is not None
        geom = self.spec.geometry(o.kv_cache_dtype, o.index_cache_dtype, speculative)
        self.page_tokens = geom.page_tokens
        # the KV connector before any weight loads: a server down at start refuses cheaply
        self.connector = _build_connector(o, geom)
        if runner_factory is None:
            from v41plan.serving.runner import build_runner

            runner_factory = build_runner
        self.runner = runner_factory(self.spec, checkpoint, o)
        if hasattr(self.runner, "transfer_kv"):
            self.runner.connector = self.connector  # a shared runner serves this engine now
        elif self.connector is not None:
            raise ConfigError("kv_transfer_config needs the paged runner (it moves PAGE units)")
        self.tokenizer = (
            tokenizer if tokenizer is not None else _default_tokenizer(self.spec, checkpoint)
        )
        self.block_manager = BlockManager(
            num_pages=o.num_pages,
            page_tokens=self.page_tokens,
            num_slots=o.max_num_seqs,
            transfer="replay" if o.encoder_swa_bounded_replay else "copy",
            units_per_image=geom.units_per_image,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                page_tokens=self.page_tokens,
                max_num_seqs=o.max_num_seqs,
                max_num_batched_tokens=o.max_num_batched_tokens,
                long_prefill_token_threshold=o.long_prefill_token_threshold,
                max_model_len=o.max_model_len,
                encoder_swa_bounded_replay=o.encoder_swa_bounded_replay,
                decoder_swa_bounded_replay=o.decoder_swa_bounded_replay,
                min_final_prefill_rows=self.spec.replay.min_final_prefill_rows,
                eos_token_id=self.eos_token_id,
                enable_prefix_caching=o.enable_prefix_caching,
                speculative_tokens=(
                    o.speculative_config["num_speculative_tokens"] if speculative else 0
                ),
            ),
            self.block_manager,
            self.connector,
        )
        self._ids = itertools.count()
        self.batches = 0
        """Batches launched."""
        self.async_scheduling = bool(
            o.async_scheduling
            if o.async_scheduling is not None
            else getattr(self.runner, "paged", False) and o.device != "cpu"
            and getattr(self.runner, "device_type", "cpu") == "cuda"
        )  # fmt: skip
        """Overlap each decode step's host work with the previous step's device work (the
        option ``async_scheduling``; None: on for the paged runner on CUDA)."""
        if self.async_scheduling and not hasattr(self.runner, "launch"):
            if self.runner is not None:  # (None: an engine built only to resolve options)
                raise ConfigError("async_scheduling needs the paged runner (it launches "
                                  "without waiting); accepted with this runner: False")  # fmt: skip
            self.async_scheduling = False
        self._inflight = None  # the launched decode batch not yet postprocessed
        self._progress = 0  # batches postprocessed
        self.overlapped_steps = 0
        """Batches launched while the previous one was still in flight."""

    # ---- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead")
        return list(self.tokenizer.encode(prompt))

    def decode(self, token_ids: list[int]) -> str:
        """Text of token ids ('' without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming what is wrong with a request (the admission check)."""
        if not ids:
            raise ValueError("empty prompt")
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is not an integer")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside [0, {self.vocab_size})")
        params.validate(self.vocab_size)
        # The paged runner keeps no per-slot token counts for the penalty stage yet: refuse
        # these requests rather than crash a step or drop the field.
        if params.has_penalties:
            raise ValueError("presence/frequency/repetition penalties are not served yet")
        if len(ids) >= self.options.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit "
                f"max_model_len={self.options.max_model_len}"
            )

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> Sequence:
        """Validate and queue one request; a bad one comes back finished with ``error`` set."""
        params = params or SamplingParams()
        ids = list(prompt_token_ids)
        seq_id = next(self._ids)
        seq = Sequence(
            seq_id,
            ids,
            len(ids),
            params,
            seed=params.seed if params.seed is not None else self.options.seed + seq_id,
        )
        try:
            self.check_request(ids, params)
        except ValueError as exc:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = "error"
            seq.error = str(exc)
            return seq
        ids[:] = map(int, ids)  # numpy integers are admitted; the sequence holds Python ints
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Cancel a request; it finishes with reason ``aborted`` and frees what it holds."""
        self.scheduler.abort(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running request (it is re-admitted first and resumes via the prefix cache)."""
        self.drain()
        if seq in self.scheduler.running:
            self.scheduler.preempt(seq)

    def step(self, on_batch: Callable[[ScheduledBatch], None] | None = None) -> list[Sequence]:
        """Schedule and run one batch; returns the requests it finished. ``on_batch`` sees
        each batch after it is scheduled and before it runs (a test cancels requests there).

        With ``async_scheduling`` a decode batch stays in flight after its step returns: the
        next step schedules and launches the following decode batch first, then reads the
        in-flight results and postprocesses them (so the host's work for step N+1 runs while
        the device computes step N). A step that cannot overlap (see
        ``Scheduler.schedule_overlap``) first finishes the batch in flight."""
        inflight = self._inflight
        if inflight is not None:
            batch = (
                self.scheduler.schedule_overlap(inflight.batch)
                if self.runner.can_overlap(inflight)
                else None
            )
            if batch is None:
                return self.drain()
            if on_batch is not None:
                on_batch(batch)
            launched = self.runner.launch(batch)
            self.batches += 1
            self._inflight = launched
            self.overlapped_steps += 1
            return self._finish_batch(inflight)
        batch = self.scheduler.schedule()
        if batch is None:
            if self.scheduler.kv_waiting():
                time.sleep(0.0005)  # a KV connector retrieve runs: poll it again soon
            return []
        if on_batch is not None:
            on_batch(batch)
        self.batches += 1
        if not self.async_scheduling:
            output = self.runner.execute(batch)
            return self.scheduler.postprocess(batch, output)
        launched = self.runner.launch(batch)
        if self.runner.can_overlap(launched):
            self._inflight = launched
            return []
        return self._finish_batch(launched)

    def drain(self) -> list[Sequence]:
        """Read and postprocess the batch in flight, if any (``async_scheduling``); returns the
        requests it finished. ``preempt`` and ``close`` drain first; so must a caller that
        drives the scheduler itself."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        return self._finish_batch(inflight)

    def _finish_batch(self, launched) -> list[Sequence]:
        self._progress += 1
        return self.scheduler.postprocess(launched.batch, self.runner.collect(launched))

    def speculative_stats(self) -> dict | None:
        """DSpark acceptance counters since the runner started (None without speculation):
        ``drafts`` (blocks verified), ``draft_tokens``, ``accepted_tokens``,
        ``acceptance_rate`` (accepted / drafted), ``mean_accepted_length`` (tokens a verify
        step emits: accepted drafts plus the target's own), ``accepted_length_histogram``
        (``[a]``: blocks with ``a`` drafts accepted, ``a = 0 .. block_size``), ``proposals``
        (blocks drafted) and ``mean_confidence`` (the draft's confidence-head logit per draft
        position, averaged over the proposals)."""
        block = getattr(self.runner, "spec_block", 0)
        if not block:
            return None
        st = self.runner.stats
        drafts = st.get("spec_verify_rows", 0)
        drafted, accepted = st.get("spec_drafted", 0), st.get("spec_accepted", 0)
        return {
            "drafts": drafts,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
            "accepted_length_histogram": [
                st.get(f"spec_accepted_len_{a}", 0) for a in range(block + 1)
            ],
            "proposals": st.get("spec_proposals", 0),
            "mean_confidence": (
                self.runner.spec_confidence_sum / max(st.get("spec_proposals", 0), 1)
            ).tolist(),
        }

    def close(self) -> None:
        """Release the KV connector (pending stores confirmed, bounded by its timeout); the
        engine itself holds nothing else to release."""
        if self.connector is not None:
            self.connector.close()

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a batch still in flight."""
        return self._inflight is not None or not self.scheduler.is_finished()

    def run_until_done(self, max_steps: int = 100_000, on_step=None) -> None:
        """Step until nothing waits or runs (raises if the scheduler cannot make progress)."""
        for _ in range(max_steps):
            if not self.has_unfinished():
                return
            before = (self.scheduler.step_count, self._progress)
            self.step()
            if on_step is not None:
                on_step()
            stalled = (self.scheduler.step_count, self._progress) == before
            if stalled and not self.scheduler.kv_waiting():
                raise RuntimeError("scheduler made no progress with requests still queued")
        raise RuntimeError(f"scheduler did not drain in {max_steps} steps")

    # ---- offline API ------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | SeqT[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token id list, or ``{"prompt_token_ids": [...]}``)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, (list, tuple))
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        seqs, texts = [], []
        for prompt, params in zip(prompts, params_list):
            text = prompt if isinstance(prompt, str) else None
            try:
                if isinstance(prompt, str):
                    ids = self.encode(prompt)
                elif isinstance(prompt, dict):
                    ids = list(prompt["prompt_token_ids"])
                else:
                    ids = list(prompt)
            except (ValueError, KeyError, TypeError) as exc:
                ids = []
                seq = Sequence(
                    next(self._ids),
                    [],
                    0,
                    params or SamplingParams(),
                    status=SeqStatus.FINISHED,
                    finish_reason="error",
                    error=f"bad prompt: {exc}",
                )
                seqs.append(seq)
                texts.append(text)
                continue
            seqs.append(self.add_request(ids, params))
            texts.append(text)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            total = sum(s.params.max_tokens for s in seqs if s.error is None)
            bar = tqdm(total=total, desc="generate", unit="tok")
        done_before = 0
        t0 = time.perf_counter()
        first: dict[int, float] = {}  # seq id -> time of its first generated token
        last: dict[int, float] = {}  # seq id -> time it finished

        def _on_step() -> None:
            nonlocal done_before
            now = time.perf_counter()
            for s in seqs:
                if s.num_output_tokens and s.seq_id not in first:
                    first[s.seq_id] = now
                if s.is_finished and s.seq_id not in last:
                    last[s.seq_id] = now
            if bar is None:
                return
            done = sum(
                s.num_output_tokens if not s.is_finished else s.params.max_tokens
                for s in seqs
                if s.error is None
            )
            if done != done_before:
                bar.update(done - done_before)
                done_before = done

        self.run_until_done(on_step=_on_step)
        _on_step()
        if bar is not None:
            bar.close()
        return [
            self._output(s, t, _timing(s, t0, first.get(s.seq_id), last.get(s.seq_id)))
            for s, t in zip(seqs, texts)
        ]

    def _output(self, seq: Sequence, text: str | None, timing: dict | None = None) -> RequestOutput:
        out = seq.output_ids
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=text,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[
                CompletionOutput(
                    0, self.decode(out) if seq.error is None else "", list(out), seq.finish_reason
                )
            ],
            error=seq.error,
            prompt_logprobs=(
                [None, *seq.prompt_logprobs]
                if seq.params.prompt_logprobs and not seq.error
                else None
            ),
            prompt_greedy=(
                [None, *seq.prompt_greedy] if seq.params.prompt_logprobs and not seq.error else None
            ),
            stats={
                "hits": list(seq.hits),
                "starts": list(seq.starts),
                "replay_rows": seq.replay_rows,
                "restores": seq.restores,
                "preemptions": seq.preemptions,
                **(timing or {}),
            },
        )


def _build_connector(o: EngineOptions, geometry):
    """The KV connector of ``o.kv_transfer_config`` (None without one). A connector that cannot
    start refuses with ``ConfigError``, or, with ``"required": False``, the engine runs without
    offload and says so on stderr."""
    if o.kv_transfer_config is None:
        return None
    import sys

    from v41plan.runtime.kv_connector import ConnectorError
    from v41plan.runtime.kv_transfer import build_connector

    config = o.kv_transfer_config
    try:
        conn = build_connector(config, geometry)
    except ConnectorError as exc:
        if config.get("required", True):
            raise ConfigError(f"kv_transfer_config: {exc}") from None
        print(f"v41plan: {exc}; running without KV offload", file=sys.stderr)
        return None
    print(f"v41plan: {conn.describe()}", file=sys.stderr)
    return conn


def _timing(seq: Sequence, t0: float, first: float | None, last: float | None) -> dict:
    """``ttft_s``, ``e2e_s`` and ``decode_tokens_per_s`` of one request of ``generate``."""
    n = seq.num_output_tokens
    decode = None
    if first is not None and last is not None and n > 1 and last > first:
        decode = (n - 1) / (last - first)
    return {
        "ttft_s": None if first is None else first - t0,
        "e2e_s": None if last is None else last - t0,
        "decode_tokens_per_s": decode,
    }


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the tiny specs' vocabulary), specials dropped on decode."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (ids above 255 are specials and are skipped)."""
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


def _default_tokenizer(spec: CacheSpec, checkpoint: str | None):
    """``tokenizer.json`` beside the checkpoint, else byte-level ids (the tiny specs'
    vocabulary)."""
    try:
        from v41plan.model.config import config_from_cache_spec
        from v41plan.serving.tokenizer import load_tokenizer
    except ImportError:
        load_tokenizer = None
    if load_tokenizer is not None:
        return load_tokenizer(checkpoint, config_from_cache_spec(spec))
    if int(spec.model_config.get("vocab_size", 0)) >= 256:
        return ByteTokenizer()
    return None
