"""Shared fixtures of the CLI tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_engine(monkeypatch):
    """``run`` builds its engine on the fake runner (no weights), and writes no checkpoint."""
    from v41plan.model import checkpoint
    from v41plan.serving import runner
    from v41plan.validation.fake_runner import FakeRunner

    def fake_factory(spec, _checkpoint, opts):
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

    monkeypatch.setattr(runner, "build_runner", fake_factory)
    monkeypatch.setattr(checkpoint, "write_checkpoint", lambda out, *a, **k: Path(out))
