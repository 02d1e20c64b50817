"""Census of the operations one decode layer launches outside the fused kernels, by source.

    python scripts/decode_op_census.py [--spec tiny40] [--moe dense] [--out reports/cpu/F.json]

Runs a decode step of the paged model on the CPU (float32) under ``torch.profiler`` and counts
the top-level compute operations (views and no-op casts left out) per layer, grouped by the
piece of code that issued them: the fused ops (``TritonDense`` functions and backend ops, one
launch each on CUDA) are counted as calls, everything else by the model function it ran in
(RoPE, norms, linears, router, the MoE, the output projection) or as the runtime's own
bookkeeping. On CUDA each counted operation is at least one kernel launch: this is the map of
the launches the fast path still makes (``bench_decode_paths``' ``kernels_per_layer``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VIEWS = {
    "aten::reshape", "aten::view", "aten::unsqueeze", "aten::slice", "aten::select",
    "aten::expand", "aten::as_strided", "aten::t", "aten::transpose", "aten::permute",
    "aten::squeeze", "aten::alias", "aten::detach", "aten::lift_fresh", "aten::_unsafe_view",
    "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::empty",
    "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
}  # fmt: skip
REGION = "Torch-Compiled Region"
"""The profiler range of a compiled region's call."""
FUSED_DENSE = ("mhc_site", "mhc_expand_site", "hc_expand", "fake_fp8")
FUSED_BACKEND = (
    "ring_write", "compress_groups", "main_scatter", "index_key_store", "score_topk",
    "score_candidates_topk", "sparse_attention", "cursor_write",
)  # fmt: skip


def _labelled(fn, label):
    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    return wrapped


def census(
    spec_name: str = "tiny40", moe: str = "dense", compile_backend: str | None = None
) -> dict:
    """Per-layer counts of one decode step (see the module doc); with ``compile_backend`` the
    dense pieces run compiled (level 3) and what runs inside their regions counts apart."""
    import numpy as np

    from v41plan.model import layers as ML
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime import compiled as CP
    from v41plan.runtime import paged_model as PM
    from v41plan.runtime import resident as RS
    from v41plan.serving.engine import resolve_spec

    spec = resolve_spec(spec_name)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    # model functions, labelled where the layers and the runtime look them up
    patches = {
        "rope": ("apply_rope",),
        "norm": ("rms_norm",),
        "router": ("moe_route",),
    }
    saved = []
    if compile_backend is not None:  # the regions are traced whole: no labels inside them
        patches = {}
    for label, names in patches.items():
        for name in names:
            for mod in (ML, PM, RS, CP):
                if hasattr(mod, name):
                    saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, _labelled(getattr(mod, name), "MODEL::" + label))
    methods = [
        (ML.Linear, "__call__", "linear"), (ML.Attention, "output_local", "output"),
        (ML.Rope, "cos_sin", "rope"), (ML.MoE, "local", "moe"),
    ] if compile_backend is None else []  # fmt: skip
    # eager at either level: what needs no routing (before the router), then the experts
    methods += [(RS.GroupedMoE, "begin", "moe"), (RS.GroupedMoE, "finish", "moe")]
    for obj, name, label in methods:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, _labelled(getattr(obj, name), "MODEL::" + label))
    try:
        P = spec.replay.hash_block_tokens
        n = 40
        pages = -(-(n + 2) // P) + 1
        m = PM.RuntimeModel(
            spec, ckpt.process(torch.float32), ckpt.engram_host(), num_pages=pages + 4,
            num_slots=2, max_tokens=n + 8, max_bs=2, table_width=pages, dtype=torch.float32,
            cfg=cfg, moe=moe, compile_backend=compile_backend,
        )  # fmt: skip

        class Dense:
            name = m.dense.name

        for k in FUSED_DENSE:
            setattr(Dense, k, staticmethod(_labelled(getattr(m.dense, k), "FUSED::" + k)))
        m.dense = Dense
        q8 = Dense.fake_fp8
        for att in m.attn:
            att.kernels = ML.LayerKernels(q8, att.kernels.linear)
            for name in ("wq_a", "wq_b", "wkv", "wo_b", "idx_wq_b"):
                if hasattr(att, name):
                    getattr(att, name).quantizer = q8
        for mo in m.moe if compile_backend is None else ():
            for name in ("s1", "s2", "s3"):
                getattr(mo, name).quantizer = q8
            if hasattr(mo, "kernels"):
                mo.kernels = ML.LayerKernels(q8, None)
            else:
                mo.quantizer = q8
        for k in FUSED_BACKEND:
            setattr(m.backend, k, _labelled(getattr(m.backend, k), "FUSED::" + k))
        ids = np.random.default_rng(4).integers(0, 256, n + 1)
        table = tuple(range(pages))
        m.reset_slot(0)
        first = RequestInput(slot=0, block_table=table, prompt_len=n, start=0, chunk_len=n,
                             phase="prefill", fresh_slot=True)  # fmt: skip
        m.forward(plan_step(StepInput((first,)), spec), ids[:n])
        one = RequestInput(slot=0, block_table=table, prompt_len=n, start=n, chunk_len=1,
                           phase="decode")  # fmt: skip
        si = m.prepare(plan_step(StepInput((one,)), spec), ids[n:])
        if compile_backend is not None:  # compile the decode shapes first (pools restored)
            snap, mirror = m.pools.backing.clone(), m.pools.cursor_host.copy()
            m.run(si)
            m.pools.backing.copy_(snap)
            m.pools.cursor_host[:] = mirror
            si = m.prepare(plan_step(StepInput((one,)), spec), ids[n:])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m.run(si)
    finally:
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)
    fused: Counter = Counter()
    ops: dict[str, Counter] = defaultdict(Counter)
    regions = 0
    for e in prof.events():
        if e.name.startswith("FUSED::"):
            fused[e.name[7:]] += 1
            continue
        if e.name.startswith(REGION):
            p = e.cpu_parent
            while p is not None and not p.name.startswith(("FUSED::", REGION)):
                p = p.cpu_parent
            regions += p is None  # a region called from a fused call counts with that call
            continue
        if not e.name.startswith("aten::") or e.name in VIEWS:
            continue
        label, par, nested = "runtime", e.cpu_parent, False
        while par is not None:
            if par.name.startswith(("FUSED::", REGION)):
                nested = True
                break
            if par.name.startswith("aten::"):
                nested = True
                break
            if par.name.startswith("MODEL::") and label == "runtime":
                label = par.name[7:]
            par = par.cpu_parent
        if nested or (e.name == "aten::to" and not e.cpu_children):
            continue
        ops[label][e.name] += 1
    layers = cfg.num_hidden_layers
    groups = {
        g: {"per_layer": sum(c.values()) / layers, "top": dict(c.most_common(6))}
        for g, c in sorted(ops.items(), key=lambda kv: -sum(kv[1].values()))
    }
    return {
        "spec": spec.name,
        "moe": moe,
        "layers": layers,
        "compile_backend": compile_backend,
        "compiled_regions_per_layer": regions / layers,
        "fused_calls_per_layer": {k: v / layers for k, v in fused.items()},
        "other_ops_per_layer": sum(sum(c.values()) for c in ops.values()) / layers,
        "groups": groups,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="tiny40")
    ap.add_argument("--moe", default="dense", choices=["dense", "grouped"])
    ap.add_argument(
        "--compile",
        default=None,
        choices=["eager", "aot_eager", "inductor"],
        help="run the dense pieces compiled with this backend (level 3); their regions count "
        "as one call each",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from v41plan.validation.provenance import provenance

    torch.set_num_threads(1)
    r = census(args.spec, args.moe, args.compile)
    r["provenance"] = provenance()
    fused = sum(r["fused_calls_per_layer"].values())
    level = (
        f", level 3 ({args.compile}): {r['compiled_regions_per_layer']:.1f} compiled regions,"
        if args.compile
        else ":"
    )
    print(f"{r['spec']}, moe={r['moe']}{level} per decode layer {fused:.1f} fused calls and "
          f"{r['other_ops_per_layer']:.1f} other operations")  # fmt: skip
    for g, v in r["groups"].items():
        top = ", ".join(
            f"{k.removeprefix('aten::')} {c / r['layers']:.1f}" for k, c in v["top"].items()
        )
        print(f"  {g:10s} {v['per_layer']:6.1f}   {top}")
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
