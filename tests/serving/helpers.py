"""Engines over the fake runner for scheduler tests."""

from __future__ import annotations

from pathlib import Path

from v41plan.serving.engine import LLM, resolve_spec
from v41plan.validation.fake_runner import FakeRunner

ROOT = Path(__file__).resolve().parents[2]
TINY = resolve_spec(str(ROOT / "specs" / "tiny.yaml"))


def fake_factory(spec, checkpoint, opts):
    """A FakeRunner sized like the engine's pools."""
    return FakeRunner(
        num_pages=opts.num_pages,
        page_tokens=spec.replay.hash_block_tokens,
        num_slots=opts.max_num_seqs,
        vocab_size=int(spec.model_config["vocab_size"]),
        window=spec.dims.sliding_window,
        plan_spec=spec,
        encoder_replay=opts.encoder_swa_bounded_replay,
        decoder_replay=opts.decoder_swa_bounded_replay,
    )


def failing_factory(fails):
    """A ``fake_factory`` whose runner raises "injected kernel failure" on every batch
    ``fails(batch)`` holds true for (the test's fault injection)."""

    def factory(spec, checkpoint, opts):
        runner = fake_factory(spec, checkpoint, opts)
        execute = runner.execute

        def failing(batch):
            if fails(batch):
                raise RuntimeError("injected kernel failure")
            return execute(batch)

        runner.execute = failing
        return runner

    return factory


def fake_llm(**options) -> LLM:
    """An LLM on the tiny spec with the fake runner."""
    options.setdefault("max_num_batched_tokens", 256)
    return LLM(TINY, runner_factory=fake_factory, world_size=1, **options)


def prompt(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ``n`` byte tokens."""
    return [(i * 7 + salt * 13 + (i // 5)) % 250 for i in range(n)]
