"""One request's host-side record: tokens, cursor, pages, slot and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from v41plan.serving.block_manager import ROOT_HASH, block_hash
from v41plan.serving.sampling import SamplingParams


class SeqStatus(Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request: its prompt, generated tokens and everything it holds in the pools."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_cached_tokens: int = 0
    """The cursor: rows whose KV and state a forward has committed."""
    prefill_end: int = 0
    """Tokens this admission prefills: ``num_tokens`` at admission (preemption re-forwards
    output)."""
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    fresh_start: int | None = None
    """Set at admission when the first forward rebuilds a fresh slot from this position."""
    num_published_blocks: int = 0
    aborted: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_greedy: list[bool] = field(default_factory=list)
    """Per scored prompt position (beside ``prompt_logprobs``): the token is the row's argmax."""
    output_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    """Per generated token (when ``params.logprobs`` is set): its raw logprob and the
    ``params.logprobs`` most likely ``{token id: logprob}``."""
    # Counters for tests and the validator.
    hits: list[int] = field(default_factory=list)
    """Prefix hit (tokens) at each admission."""
    starts: list[int] = field(default_factory=list)
    """Forward start of each prefill chunk."""
    replay_rows: int = 0
    restores: int = 0
    preemptions: int = 0
    synced_tokens: int = 0
    """Token ids of this request the runner's slot tables hold (``batch.SlotDelta``)."""
    synced_blocks: int = 0
    """Block-table entries the runner's slot tables hold."""
    kv_prefetch: object | None = None
    """A KV connector retrieve this admission waits on (``kv_connector.Prefetch``)."""
    kv_loaded_blocks: int = 0
    """Blocks the last admission took from the KV connector (the rest came from the device)."""
    needs_reset: bool = False
    """The request took its slot since the last batch: the runner gets the slot's whole content."""
    stop_rule: tuple[frozenset[int], int] | None = None
    """The scheduler's stop check, built at the first sampled token: the ids that stop the
    request (EOS unless ignored, ``stop_token_ids``) and the token count that ends it."""
    _hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        """Generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated (without copying them, for per-step checks)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """Running and not yet through this admission's prefill."""
        return self.num_cached_tokens < self.prefill_end

    @property
    def is_finished(self) -> bool:
        """True once finished (including aborted and failed)."""
        return self.status == SeqStatus.FINISHED

    def hashes(self, page_tokens: int, num_blocks: int) -> list[bytes]:
        """Chained hashes of the first ``num_blocks`` full blocks (memoised; tokens only grow)."""
        if len(self._hashes) < num_blocks:
            parent = self._hashes[-1] if self._hashes else ROOT_HASH
            for b in range(len(self._hashes), num_blocks):
                parent = block_hash(parent, self.token_ids[b * page_tokens : (b + 1) * page_tokens])
                self._hashes.append(parent)
        return self._hashes[:num_blocks]
