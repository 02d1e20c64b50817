"""The runtime's fast paths compiled on a GPU: the engine's ``auto`` kernels (Triton backend,
fused dense kernels, grouped W4A8 MoE, resident W8A8 weights) against the torch reference path,
and FULL graphs of the fast path against its eager forward.

Skipped without CUDA. ``tests/runtime/test_fast_paths.py`` runs the same path under the Triton
interpreter on the CPU.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VARIANTS = {
    "reference": {"backend": "torch", "dense": "torch", "moe": "dense", "resident": False},
    "backend": {"backend": "triton", "dense": "torch", "moe": "dense", "resident": False},
    "dense": {"backend": "torch", "dense": "triton", "moe": "dense", "resident": False},
    "grouped": {"backend": "torch", "dense": "torch", "moe": "grouped", "resident": False},
    "fast": {"backend": "triton", "dense": "triton", "moe": "grouped", "resident": False},
    "resident": {"backend": "triton", "dense": "triton", "moe": "grouped", "resident": True},
}


@functools.cache
def _state(spec_name: str) -> dict:
    """The seeded random published state of ``spec_name``, made once (medium's takes tens of
    seconds on the host; every variant reads it, ``from_state`` copies the dict)."""
    from v41plan.model.checkpoint import random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec

    return random_state(config_from_cache_spec(resolve_spec(spec_name)), 0)


def _model(spec_name: str, variant: str, dtype=torch.float32):
    from v41plan.model.checkpoint import LoadedCheckpoint
    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend
    from v41plan.runtime.paged_model import RuntimeModel
    from v41plan.serving.engine import resolve_spec

    v = VARIANTS[variant]
    spec = resolve_spec(spec_name)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, _state(spec_name))
    kw = {"resident": True} if v["resident"] else {}
    w = ckpt.process(dtype, "cuda", **kw)
    m = RuntimeModel(
        spec, w, ckpt.engram_host(), num_pages=24, num_slots=4, max_tokens=96, max_bs=4,
        table_width=12, dtype=dtype, device="cuda", cfg=cfg,
        backend=TritonBackend() if v["backend"] == "triton" else TorchBackend(),
        dense=v["dense"], moe=v["moe"],
    )  # fmt: skip
    assert m.resident is v["resident"]
    return spec, m


def _run(spec, m, ids: np.ndarray, n: int, forced=None):
    """Prefill ``ids[:n]`` fresh, then one decode step of ``ids[n]``: both logits (float64)
    and each forward's decisions (index selections, routed experts); ``forced``: decisions to
    take instead of the model's own (the reference's, so that only arithmetic differs)."""
    from v41plan.planner.step import RequestInput, StepInput, plan_step

    table = tuple(range(8))
    m.reset_slot(0)
    first = RequestInput(
        slot=0, block_table=table, prompt_len=n, start=0, chunk_len=n, phase="prefill",
        fresh_slot=True,
    )  # fmt: skip
    pre = plan_step(StepInput((first,)), spec)
    decisions = []

    def forward(plan, tokens, k):
        if forced is not None:
            m.forced_selections, m.forced_experts = forced[k]
        out = m.forward(plan, tokens).logits.double().cpu()
        sel = {L: s.clone() for L, s in m.selections.items()}
        decisions.append((sel, {L: e.clone() for L, e in m.experts.items()}))
        return out

    a = forward(pre, ids[:n], 0)
    one = RequestInput(
        slot=0, block_table=table, prompt_len=n, start=n, chunk_len=1, phase="decode"
    )
    dec = plan_step(StepInput((one,)), spec)
    b = forward(dec, ids[n : n + 1], 1)
    return (a, b), decisions


def test_backend_ops_agree_inside_a_forward():
    """Parity of the Triton backend, op by op inside a real forward (tiny40, float32, 40-token
    prefill and a decode step): each op on the same inputs as ``TorchBackend``'s; scatters and
    top-k ids exact, attention within 1e-5 relative. The whole-forward figures are printed, not
    held: a random-weight model turns such differences into tens of percent of its logits
    (``tests/runtime/test_fast_paths.py::test_random_weights_amplify_op_differences``)."""
    from v41plan.validation.backend_crosscheck import crosscheck_forward

    r = crosscheck_forward("tiny40", 40, "cuda", tol=1e-5)
    print(r["whole_forward_rel_l2"])
    assert {"sparse_attention", "ring_write", "main_scatter", "score_topk"} <= set(r["ops"])
    for op, v in r["ops"].items():
        limit = 1e-5 if op == "sparse_attention" else 0.0
        assert v["worst"]["max_rel"] <= limit, (op, v["worst"])
    # the cross-checked forward goes on with Triton's results: it is the Triton forward
    cc, tr = r["whole_forward_rel_l2"]["crosscheck"], r["whole_forward_rel_l2"]["triton"]
    assert cc == tr


@pytest.mark.parametrize("spec_name", ["tiny40", "medium"])
def test_fast_paths_run_every_variant(spec_name):
    """Every variant runs a prefill and a decode step with finite logits and no backend op
    falling back to torch; the dense kernels alone (decisions forced to the reference's) stay
    within 1e-5 of the reference path, the figures of the others are printed (see above)."""
    ids = np.random.default_rng(4).integers(0, 256, 41)
    spec, ref_m = _model(spec_name, "reference")
    want, decisions = _run(spec, ref_m, ids, 40)
    forced = [
        ({L: s.to("cuda") for L, s in sel.items()}, {L: e.to("cuda") for L, e in ex.items()})
        for sel, ex in decisions
    ]
    del ref_m
    for variant in ("backend", "dense", "grouped", "fast", "resident"):
        spec, m = _model(spec_name, variant)
        got, _ = _run(spec, m, ids, 40, forced)
        for k, (w, g) in enumerate(zip(want, got)):
            assert torch.isfinite(g).all(), variant
            rel = float((g - w).norm() / w.norm())
            print(f"{spec_name} {variant} {('prefill', 'decode')[k]}: forced rel L2 {rel:.2e}")
            if variant == "dense" and spec_name == "tiny40":
                assert rel <= 1e-5, (variant, k, rel)  # measured 2.0e-7 / 2.6e-7
        if hasattr(m.backend, "fallbacks"):
            assert not m.backend.fallbacks, m.backend.fallbacks
        del m
        torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype, level", [("bfloat16", None), ("float32", 0)])
def test_engine_auto_kernels_graph_tokens_equal_eager(dtype, level):
    """The engine's defaults on CUDA pick the fast path (level 3 under graphs); its FULL-graph
    decode generates the tokens of an eager engine running the same kernels, every decode step
    a replay. The eager engine is given the graph engine's compilation level (eager's own
    default is 0, whose roundings differ from Inductor's fused kernels)."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (37, 12, 70)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    fast = {
        "kernel_backend": "triton", "dense_kernels": "triton", "moe_impl": "grouped",
        "resident_weights": True,
    }  # fmt: skip
    want_level = 3 if level is None else level
    out = {}
    for graph in (True, False):
        llm = LLM(
            "tiny40", None, device="cuda", dtype=dtype, max_num_seqs=8,
            enforce_eager=not graph, cudagraph_mode="FULL" if graph else "NONE",
            compilation_level=level if graph else want_level,
        )  # fmt: skip
        assert llm.runner.kernels == {
            **fast,
            "compilation_level": want_level,
            "compile_backend": "inductor" if want_level == 3 else None,
        }
        outs = llm.generate(prompts, sp)
        assert all(o.error is None for o in outs), [o.error for o in outs]
        out[graph] = [o.outputs[0].token_ids for o in outs]
        assert [len(t) for t in out[graph]] == [8, 8, 8]
        if graph:
            stats = llm.runner.graph_stats()["stats"]
            assert stats.get("graph_steps", 0) > 0 and not stats.get("eager_decode_steps"), stats
        del llm
        torch.cuda.empty_cache()
    assert out[True] == out[False]
