"""Tensor-parallel parity worker, launched by ``tests/runtime/test_tp.py`` under torchrun (gloo,
CPU):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/runtime/tp_worker.py \\
        --spec SPEC.yaml --checkpoint DIR --out result.json [--arrangements ep,tp] [--no-quant] \\
        [--moe grouped] [--compile aot_eager]

Every rank loads the checkpoint, keeps its shard (``tp.shard_weights``) and runs the paged
runtime model through a fixed teacher-forced schedule: two requests, chunked prefills mixed
with decode rows, then decode steps, every row's logits kept (replays off). Rank 0 also runs
the unsharded model (world size 1) on the same schedule and writes, per expert arrangement,
the largest logit difference, whether every index selection is equal, and whether every rank
produced bit-identical logits and selections. A control run on rank 0 skips the reductions
(its shard alone) and must differ. With ``--engine``, the engine (``LLM`` with
``tensor_parallel_size`` = world size, each arrangement) generates greedily and its tokens are
compared with a world-size-1 engine's on rank 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run by path under torchrun: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from v41plan.geometry.derive import load_cache_spec_unchecked
from v41plan.model.checkpoint import load_checkpoint
from v41plan.model.quant import set_fake_quant
from v41plan.model.sharding import shard_weights
from v41plan.planner.step import RequestInput, StepInput, plan_step
from v41plan.runtime.collectives import SINGLE, TPGroup, tp_group
from v41plan.runtime.dist import world_info
from v41plan.runtime.paged_model import RuntimeModel

DTYPE = torch.float64
ENGINE_PROMPTS = (
    [
        7,
        100,
        3,
        42,
        9,
        250,
        17,
        64,
        128,
        5,
        33,
        71,
        200,
        11,
        90,
        45,
        2,
        160,
        99,
        31,
        8,
        77,
        140,
        55,
        6,
        230,
        19,
        88,
        123,
        4,
        61,
        170,
        27,
        210,
        13,
    ],
    [65, 66, 67],
)


class NoReduce(TPGroup):
    """A rank's shard with its reductions skipped (the control: its logits must differ)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Leave ``x`` as this rank's partial."""
        return x


# (slot, block table, prompt length, prefill chunks, decode steps, token seed)
REQUESTS = (
    (1, (5, 3), 41, (17, 24), 3, 11),
    (0, (2, 6), 30, (30,), 4, 12),
)


def schedule() -> list[list[tuple]]:
    """Per step, the ``(request, slot, table, prompt_len, start, n, phase)`` it runs."""
    steps: list[list[tuple]] = []
    for j, (slot, table, prompt, chunks, decodes, _) in enumerate(REQUESTS):
        start = 0
        for i, n in enumerate(list(chunks) + [1] * decodes):
            while len(steps) <= i:
                steps.append([])
            steps[i].append(
                (j, slot, table, prompt, start, n, "prefill" if start < prompt else "decode")
            )
            start += n
    return steps


def run(model: RuntimeModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(every row's logits ``[rows, V]``, every row's selections ``[rows, sources*topk]``)."""
    ids = [np.random.default_rng(r[5]).integers(0, 256, r[2] + r[4]) for r in REQUESTS]
    for r in REQUESTS:
        model.pools.reset_slot(r[0])
    logits, sels = [], []
    for batch in schedule():
        reqs = tuple(
            RequestInput(slot=s, block_table=t, prompt_len=p, start=st, chunk_len=n, phase=ph)
            for _, s, t, p, st, n, ph in batch
        )
        plan = plan_step(StepInput(reqs), model.spec, decoder_replay=False, encoder_replay=False)
        flat = np.concatenate([ids[j][st : st + n] for j, _, _, _, st, n, _ in batch])
        out = model.forward(plan, flat, all_row_logits=True)
        logits.append(out.row_logits.clone())
        sels.append(torch.cat([model.selections[k] for k in sorted(model.selections)], 1))
    return torch.cat(logits), torch.cat(sels)


def build(spec, ckpt, weights, tp: TPGroup, args, moe: str | None = None) -> RuntimeModel:
    """A runtime model over ``weights`` (the full set or this rank's shard); ``moe`` defaults
    to ``--moe``."""
    return RuntimeModel(
        spec,
        weights,
        ckpt.engram_host(),
        kv_cache_dtype=args.kv_cache_dtype,
        index_cache_dtype=args.index_cache_dtype,
        num_pages=8,
        num_slots=2,
        max_tokens=64,
        max_bs=2,
        table_width=4,
        dtype=DTYPE,
        cfg=ckpt.config,
        tp=tp,
        moe=moe or args.moe,
        compile_backend=args.compile if tp is not SINGLE else None,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the parity schedule; rank 0 writes the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--arrangements", default="ep,tp", help="ep (whole experts), tp (sliced experts)"
    )
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument("--no-quant", action="store_true", help="activation/cache quantizers off")
    ap.add_argument("--engine", action="store_true", help="also compare engine generations")
    ap.add_argument(
        "--moe", default="dense", choices=["dense", "grouped"],
        help="the sharded models' MoE (the world-size-1 base is always the dense reference)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", default=None, choices=["eager", "aot_eager", "inductor"],
        help="the sharded models' dense pieces under torch.compile with this backend (level 3)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    set_fake_quant(not args.no_quant)
    tp = tp_group(world_info().world_size, "cpu")
    spec = load_cache_spec_unchecked(args.spec)
    ckpt = load_checkpoint(args.checkpoint, spec, dtype=DTYPE)
    result: dict = {"world_size": tp.size, "quant": not args.no_quant, "arrangements": {}}
    base = run(build(spec, ckpt, ckpt.weights, SINGLE, args, "dense")) if tp.rank == 0 else None
    for arr in args.arrangements.split(","):
        shard = shard_weights(ckpt.weights, ckpt.config, tp, expert_parallel=(arr == "ep"))
        logits, sels = run(build(spec, ckpt, shard, tp, args))
        all_logits, all_sels = tp.all_gather(logits), tp.all_gather(sels)
        if tp.rank == 0:
            ref_logits, ref_sels = base
            result["arrangements"][arr] = {
                "rows": int(logits.shape[0]),
                "max_abs_err": float((logits - ref_logits).abs().max()),
                "ref_max_abs": float(ref_logits.abs().max()),
                "selections_equal": bool(torch.equal(sels, ref_sels)),
                "selected_ids": int((sels >= 0).sum()),
                "ranks_identical": bool(
                    (all_logits == all_logits[0]).all() and (all_sels == all_sels[0]).all()
                ),
                "local_heads": shard[
                    next(k for k in shard if k.endswith("attn.attn_sink"))
                ].numel(),
            }
    if args.engine:
        result["engine"] = engine_check(args, tp)
    if tp.rank == 0:
        shard = shard_weights(ckpt.weights, ckpt.config, tp, expert_parallel=True)
        logits, _ = run(build(spec, ckpt, shard, NoReduce(tp.rank, tp.size), args))
        result["control_max_abs_err"] = float((logits - base[0]).abs().max())
        Path(args.out).write_text(json.dumps(result, indent=1))
    if tp.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def engine_check(args, tp: TPGroup) -> dict:
    """Greedy tokens of the engine at this world size per arrangement (and at size 1 on rank 0)."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    opts = {
        "dtype": "float64",
        "device": "cpu",
        "max_num_seqs": 2,
        "max_model_len": 128,
        "kv_cache_dtype": args.kv_cache_dtype,
        "index_cache_dtype": args.index_cache_dtype,
    }

    def tokens(**kw) -> list[list[int]]:
        llm = LLM(args.spec, args.checkpoint, **opts, **kw)
        return [
            o.outputs[0].token_ids for o in llm.generate([list(p) for p in ENGINE_PROMPTS], params)
        ]

    out: dict = {}
    if tp.rank == 0:
        out["single"] = tokens(world_size=1, tensor_parallel_size=1)
    for arr in args.arrangements.split(","):
        got = tokens(
            world_size=tp.size, tensor_parallel_size=tp.size, enable_expert_parallel=(arr == "ep")
        )
        out[arr] = got
        out[arr + "_ranks_identical"] = bool(
            (tp.all_gather(torch.tensor(got)) == torch.tensor(got)).all()
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
