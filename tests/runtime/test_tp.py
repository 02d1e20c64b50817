"""Tensor parallelism: refusals, load-time sharding, and TP-vs-world-size-1 parity under torchrun.

The parity tests launch ``python -m torch.distributed.run --standalone --nproc_per_node=N
tests/runtime/tp_worker.py`` (gloo on CPU) on a checkpoint of ``specs/tiny.yaml`` (``o_groups`` 4
and ``moe_intermediate_size`` 128, so it splits at 1, 2 and 4). Float64 with the
quantizers on: every row's logits of a prefill + decode schedule must agree with the
world-size-1 run within ``REL_TOL * max|logits|`` (observed: exactly equal), every index
selection must be equal, and every rank must hold bit-identical logits and selections.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.config import config_from_cache_spec
from v41plan.model.sharding import TPConfigError, accepted_sizes, check_tp, shard_weights
from v41plan.runtime.collectives import SINGLE, TPGroup

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REL_TOL = 1e-12


def _spec(name: str):
    return load_cache_spec_unchecked(str(ROOT / "specs" / f"{name}.yaml"))


# --- refusals -------------------------------------------------------------------------------


def test_refusals_name_the_dimension_and_the_accepted_sizes():
    tiny = _spec("tiny").model_config
    with pytest.raises(
        TPConfigError, match=r"tensor_parallel_size=3 is refused: num_attention_heads=4"
    ):
        check_tp(tiny, 3, expert_parallel=True)
    # 32 expert lanes divide by 2, but each rank's shared-expert w2 input would be 16 lanes: half
    # an FP8 block
    half = dict(tiny, moe_intermediate_size=32, o_groups=2)
    with pytest.raises(
        TPConfigError,
        match=r"moe_intermediate_size/2 .* = 16 is not a multiple of the "
        r"32-lane FP8 activation block; accepted with this model: 1$",
    ):
        check_tp(half, 2, expert_parallel=False)
    mc = dict(_spec("tiny").model_config, n_routed_experts=6)
    with pytest.raises(
        TPConfigError, match=r"n_routed_experts=6 must be divisible by it under expert"
    ):
        check_tp(mc, 4, expert_parallel=True)
    check_tp(mc, 4, expert_parallel=False)  # sliced experts do not need whole experts per rank
    with pytest.raises(
        TPConfigError, match=r"tensor_parallel_size=0 is refused: accepted: an integer >= 1"
    ):
        check_tp(mc, 0, expert_parallel=False)
    assert accepted_sizes(_spec("tiny").model_config, True) == [1, 2, 4]
    assert accepted_sizes(_spec("deepseek_v41_flash").model_config, True) == [1, 2, 4, 8]
    assert accepted_sizes(_spec("medium").model_config, False) == [1, 2, 4]


def test_the_engine_refuses_a_split_before_any_weight_loads(tmp_path):
    from v41plan.serving.engine import LLM

    # 3 does not divide tiny's 4 heads; the split check runs before the (missing) checkpoint
    # is opened
    with pytest.raises(TPConfigError, match="num_attention_heads=4"):
        LLM(
            str(ROOT / "specs" / "tiny.yaml"),
            str(tmp_path / "no-checkpoint"),
            world_size=3,
            tensor_parallel_size=3,
            enable_expert_parallel=True,
        )


# --- sharding -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_weights():
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state

    cfg = config_from_cache_spec(_spec("tiny"))
    return cfg, LoadedCheckpoint.from_state(cfg, random_state(cfg, 0)).process(torch.float64)


@pytest.mark.parametrize("ep", [True, False], ids=["ep", "sliced"])
def test_shards_are_the_rank_slices_and_tile_the_whole(tiny_weights, ep):
    cfg, w = tiny_weights
    shards = [shard_weights(w, cfg, TPGroup(r, 4), ep) for r in range(4)]
    H, d, G, R = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    a, f = "layers.2.attn.", "layers.2.ffn."
    for r, s in enumerate(shards):
        assert s[a + "wq_b.weight"].shape[0] == H // 4 * d
        assert torch.equal(s[a + "attn_sink"], w[a + "attn_sink"][r * H // 4 : (r + 1) * H // 4])
        assert s[a + "wo_a.weight"].shape[0] == G // 4 * R
        assert s[a + "wo_b.weight"].shape == (cfg.hidden_size, G // 4 * R)
        assert s[a + "indexer.weights_proj.weight"].shape[0] == cfg.index_n_heads // 4
        assert s[f + "experts.w1"].shape[0] == (
            cfg.n_routed_experts // 4 if ep else cfg.n_routed_experts
        )
        for name in (
            "embed.weight",
            "head.weight",
            a + "wkv.weight",
            a + "compressor.wkv.weight",
            a + "indexer.wk.weight",
            f + "gate.weight",
            "layers.1.engram.wkv.weight",
        ):
            assert s[name] is w[name]  # replicated: the same tensor
    cat = {  # concatenating the four shards gives back every sharded tensor
        a + "wq_b.weight": 0,
        a + "attn_sink": 0,
        a + "wo_a.weight": 0,
        a + "wo_b.weight": 1,
        a + "indexer.wq_b.weight": 0,
        a + "indexer.weights_proj.weight": 0,
        f + "shared_experts.w1.weight": 0,
        f + "shared_experts.w3.weight": 0,
        f + "shared_experts.w2.weight": 1,
        f + "experts.w1": 0 if ep else 1,
        f + "experts.w3": 0 if ep else 1,
        f + "experts.w2": 0 if ep else 2,
    }
    for name, dim in cat.items():
        assert torch.equal(torch.cat([s[name] for s in shards], dim), w[name]), name
    assert shard_weights(w, cfg, SINGLE, ep) is w


def test_all_reduce_is_a_no_op_on_one_rank():
    x = torch.arange(4.0)
    assert SINGLE.all_reduce(x) is x
    assert torch.equal(SINGLE.all_gather(x), x[None])


# --- parity under torchrun ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from v41plan.model.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tiny_ckpt")
    return write_checkpoint(out, config_from_cache_spec(_spec("tiny")), seed=0)


def _launch(nproc: int, ckpt: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / "tp_worker.py"),
        "--spec",
        str(ROOT / "specs" / "tiny.yaml"),
        "--checkpoint",
        str(ckpt),
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(
        cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check(res: dict, nproc: int) -> None:
    assert res["world_size"] == nproc and res["quant"]
    for arr in ("ep", "tp"):
        r = res["arrangements"][arr]
        assert r["local_heads"] == 4 // nproc
        assert r["selected_ids"] > 0
        assert r["selections_equal"], arr
        assert r["ranks_identical"], arr
        assert r["max_abs_err"] <= REL_TOL * r["ref_max_abs"], (arr, r)
    # the comparison has teeth: one rank's shard without its reductions is far off
    assert res["control_max_abs_err"] > 1e-3 * res["arrangements"]["ep"]["ref_max_abs"]


def test_tp2_matches_world_size_1_in_both_expert_arrangements(tiny_checkpoint, tmp_path):
    # bf16 main pool, fp8 index plane (the defaults), and the engine's generations
    res = _launch(2, tiny_checkpoint, tmp_path / "tp2.json", "--engine")
    _check(res, 2)
    eng = res["engine"]
    assert eng["ep"] == eng["single"] and eng["tp"] == eng["single"]
    assert eng["ep_ranks_identical"] and eng["tp_ranks_identical"]


def test_tp2_matches_world_size_1_with_fp4_planes(tiny_checkpoint, tmp_path):
    res = _launch(
        2,
        tiny_checkpoint,
        tmp_path / "tp2_fp4.json",
        "--kv-cache-dtype",
        "fp4",
        "--index-cache-dtype",
        "fp4",
    )
    _check(res, 2)


def test_tp2_grouped_moe_matches_the_dense_world_size_1(tiny_checkpoint, tmp_path):
    """The grouped MoE (selected experts only) sharded over two ranks, whole experts and
    sliced intermediates, against the dense-over-experts model on one rank."""
    _check(_launch(2, tiny_checkpoint, tmp_path / "tp2_grouped.json", "--moe", "grouped"), 2)


@pytest.mark.slow
def test_tp4_matches_world_size_1_in_both_expert_arrangements(tiny_checkpoint, tmp_path):
    _check(_launch(4, tiny_checkpoint, tmp_path / "tp4.json"), 4)
