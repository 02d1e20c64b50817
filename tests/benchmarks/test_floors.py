"""The benchmark floors: shipped-format and bf16 weight bytes, FP8-rate FLOPs, README tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import medium_model as mm

from tests.runtime.paged_helpers import model, step
from v41plan.model.checkpoint import LoadedCheckpoint, random_state, tensor_table

CEIL = {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 8e14, "fp8_flop_per_s": 1.6e15}


def _floor(plan, ix="fp8", ceilings=CEIL):
    spec, cfg, _w, _e = model("tiny")
    rows = mm.pool_row_bytes(spec.geometry("bf16", ix))
    return mm.step_floor(cfg, plan, ceilings, rows=rows, index_cache_dtype=ix)


def test_weight_bytes_in_shipped_formats_and_at_bf16():
    spec, cfg, _w, _e = model("tiny")
    n = 2000  # enough rows that every expert is touched (to 1e-12)
    plan = step(spec, [(1, tuple(range(64)), n, 0, n, "prefill")])
    f = _floor(plan)
    tables = {t.name for t in tensor_table(cfg) if t.kind.startswith("table")}
    shipped = sum(t.nbytes for t in tensor_table(cfg) if t.name not in tables)
    embed = next(t for t in tensor_table(cfg) if t.name == "embed.weight")
    shipped -= embed.nbytes - embed.nbytes * n // cfg.vocab_size  # only the batch's rows
    assert f["weight_bytes"] == pytest.approx(shipped, rel=1e-9)
    # the bf16 count is what the runtime holds: every processed weight at 2 bytes
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    held = ckpt.process(torch.bfloat16)
    bf16 = sum(2 * t.numel() for k, t in held.items() if k != "embed.weight")
    bf16 += 2 * held["embed.weight"].numel() * n // cfg.vocab_size
    assert f["bf16_weight_bytes"] == pytest.approx(bf16, rel=1e-9)
    assert f["weight_bytes"] < 0.6 * f["bf16_weight_bytes"]  # FP8 dense, FP4 experts


def test_fp8_work_runs_at_the_fp8_rate_and_replay_cuts_rows():
    spec, *_ = model("tiny")
    n = 300
    full = step(spec, [(1, tuple(range(12)), n, 0, n, "prefill")])
    f = _floor(full)
    assert 0 < f["fp8_flops"] < f["flops"]
    t = (f["flops"] - f["fp8_flops"]) / CEIL["bf16_flop_per_s"] + f["fp8_flops"] / 1.6e15
    assert f["floor_flops_s"] == pytest.approx(t)
    assert f["floor_bf16_flops_s"] == pytest.approx(f["flops"] / CEIL["bf16_flop_per_s"])
    unmeasured = _floor(full, ceilings=dict(CEIL, fp8_flop_per_s=None))
    assert not unmeasured["fp8_rate_measured"]
    assert unmeasured["floor_flops_s"] == pytest.approx(f["floor_bf16_flops_s"])
    tail = _floor(step(spec, [(1, tuple(range(12)), n, 0, n, "prefill")], decoder_replay=True))
    assert tail["flops"] < f["flops"] and tail["weight_bytes"] <= f["weight_bytes"]
    # a non-final chunk under decoder replay reads no decoder attention or FFN weights
    part = _floor(step(spec, [(1, tuple(range(12)), n, 0, 200, "prefill")], decoder_replay=True))
    assert part["weight_bytes"] < tail["weight_bytes"]
    # index scoring over the fp4 plane is not FP8 work
    assert _floor(full, ix="fp4")["fp8_flops"] < f["fp8_flops"]


def test_decode_reads_the_pool_rows_at_their_row_sizes():
    spec, *_ = model("tiny")
    plan = step(spec, [(1, (1, 2, 3, 4), 100, 100, 1, "decode")])
    rows = {"ring": 1, "main": 0, "index": 0}
    _spec, cfg, *_ = model("tiny")
    f = mm.step_floor(cfg, plan, CEIL, rows=rows, index_cache_dtype="fp8")
    assert f["pool_bytes"] == len(cfg.layers) * cfg.sliding_window  # one W-row window a layer


def test_the_readme_tables_are_the_committed_json_recomputed():
    import readme_floor_tables

    assert readme_floor_tables.main(["--check", str(ROOT / "README.md")]) == 0


def test_decode_benchmarks_setup_runs_a_real_step():
    """``decode_requests`` / ``prefill_to_context`` / ``decode_step`` (the decode benchmarks'
    setup) on tiny in float64: the batched decode step after the grouped prefills gives, request
    by request, the logits of that request prefilled (decoder replay on, as the benchmarks run
    it) and decoded alone."""
    from tests.runtime.paged_helpers import runtime
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    spec = model("tiny")[0]
    context, bs = 40, 3
    tables, ids = mm.decode_requests(spec, bs, context)
    m = runtime("tiny", "bf16", "fp8", num_pages=bs * len(tables[0]) + 8, table_width=4)
    mm.prefill_to_context(m, spec, tables, ids, context, chunk=2 * context)
    plan, tok = mm.decode_step(m, spec, tables, ids, context, bs)
    assert plan.scheduled_tokens == bs and list(tok) == [ids[i][context] for i in range(bs)]
    got = m.forward(plan, tok).logits
    for i in range(bs):
        one = runtime("tiny", "bf16", "fp8", num_pages=8, table_width=4)
        table = tuple(range(len(tables[i])))
        one.reset_slot(0)
        first = RequestInput(
            slot=0, block_table=table, prompt_len=context, start=0, chunk_len=context,
            phase="prefill", fresh_slot=True,
        )  # fmt: skip
        one.forward(plan_step(StepInput((first,)), spec, decoder_replay=True), ids[i][:context])
        dec = RequestInput(
            slot=0, block_table=table, prompt_len=context, start=context, chunk_len=1,
            phase="decode",
        )  # fmt: skip
        want = one.forward(plan_step(StepInput((dec,)), spec), ids[i][context : context + 1])
        assert torch.allclose(got[i], want.logits[0], rtol=1e-9, atol=1e-9), i


def test_flash_slice_floors_count_its_shipped_bytes():
    # the shapes the flash_slice benchmarks time (decode batch 1 and 64 at 256 tokens of
    # context, an 8K prefill): the floor reads the published formats, the experts the batch
    # touches, and holds for both replay settings without building the 34 GB of weights
    from v41plan.geometry.resolve import resolve_spec
    from v41plan.model.config import config_from_cache_spec

    spec = resolve_spec("flash_slice")
    cfg = config_from_cache_spec(spec)
    rows = mm.pool_row_bytes(spec.geometry("bf16", "fp8"))
    table = tensor_table(cfg)
    backbone = sum(t.nbytes for t in table if not t.kind.startswith("table"))
    assert 33.0e9 < backbone < 34.5e9  # the spec's stated 33.77 GB
    ctx, P = 256, spec.replay.hash_block_tokens
    pages = -(-(ctx + 8) // P)
    floors = {}
    for bs in (1, 64):
        reqs = [(s, tuple(range(s * pages, (s + 1) * pages)), ctx, ctx, 1, "decode")
                for s in range(bs)]  # fmt: skip
        floors[bs] = mm.step_floor(cfg, step(spec, reqs), CEIL, rows=rows, index_cache_dtype="fp8")
        assert floors[bs]["bound"] == "bytes"
    # batch 1 reads the six experts of each layer's one row; batch 64 nearly all 32
    experts = sum(t.nbytes for t in table if ".ffn.experts." in t.name)
    assert floors[1]["weight_bytes"] < backbone - 0.7 * experts
    assert floors[64]["weight_bytes"] > backbone - 0.05 * experts - 2 * 129280 * 5120
    assert floors[1]["floor_s"] < floors[64]["floor_s"]
    n = 8192
    pre = [(0, tuple(range(-(-n // P) + 1)), n, 0, n, "prefill", True)]
    off = mm.step_floor(cfg, step(spec, pre), CEIL, rows=rows, index_cache_dtype="fp8")
    on = mm.step_floor(
        cfg, step(spec, pre, decoder_replay=True), CEIL, rows=rows, index_cache_dtype="fp8"
    )
    assert off["bound"] == "flops" and 0 < on["flops"] < off["flops"]


def test_every_decode_variant_flag_names_a_runtime_module_attribute():
    """``bench_decode_paths.py``'s variants set ``module.NAME`` (or ``module.Class.NAME``) flags
    under ``v41plan.runtime``: each names an attribute that exists (a removed flag would
    otherwise be set as a new name and change nothing), and every flagged variant is a
    variant."""
    import bench_decode_paths as bdp

    assert set(bdp.GEMM_FLAGS) <= set(bdp.VARIANTS)
    for variant, flags in bdp.GEMM_FLAGS.items():
        for key in flags:
            owner, attr = bdp._flag_owner(key)
            assert hasattr(owner, attr), (variant, key)
    owner, attr = bdp._flag_owner("kernels.triton_backend.TritonBackend.score_block")
    assert owner.__name__ == "TritonBackend" and attr == "score_block"
