"""Every kernel-backend op of a paged forward run twice, Triton and torch, compared call by call.

``CrossCheck`` (a ``TritonBackend``) runs, at each op call, ``TorchBackend``'s op on clones of
the tensor arguments and its own on the originals, and records the largest difference over
every tensor argument afterwards (the pools a scatter wrote) and every result; the forward goes
on with Triton's results, so a disagreement shows at the op and call where it starts.
``crosscheck_forward`` runs a fresh prefill and one decode step that way and also gives the
whole-forward logits of the cross-checked, pure-torch and pure-Triton backends.

This is the parity check the runtime's Triton backend is held to (per op, with forced inputs):
a random-weight model amplifies op-level differences of 1e-7 through its FP8 activation
roundings into whole-forward logit changes of tens of percent (``tests/runtime/
test_fast_paths.py`` measures it), so whole forwards are compared only between graph and eager
runs of one path. ``scripts/crosscheck_backend.py`` is the command line.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

OPS = (
    "ring_write", "compress_groups", "main_scatter", "index_key_store", "score_topk",
    "score_candidates_topk", "candidate_blocks", "sparse_attention", "cursor_write",
)  # fmt: skip


def _tensors(x):
    """Flat list of the tensors in ``x`` (tensors, tuples and lists of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for e in x for t in _tensors(e)]
    return []


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(_clone(e) for e in x)
    if isinstance(x, list):
        return [_clone(e) for e in x]
    return x


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """(max abs difference, relative to max |a|, differing elements), bytes for integer
    tensors."""
    if a.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool):
        n = int((a != b).sum())
        return float(n > 0), float(n > 0), n
    a64, b64 = a.double(), b.double()
    both_nan = torch.isnan(a64) & torch.isnan(b64)
    d = torch.where(both_nan, 0.0, (a64 - b64).abs())
    d = torch.nan_to_num(d, nan=float("inf"))
    scale = float(torch.nan_to_num(a64.abs(), nan=0.0).max()) or 1.0
    return (
        float(d.max()) if d.numel() else 0.0,
        (float(d.max()) / scale) if d.numel() else 0.0,
        int((d > 0).sum()),
    )


def make_crosscheck(tol: float):
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    class CrossCheck(TritonBackend):
        """``TritonBackend`` whose ops are each compared with ``TorchBackend``'s."""

        def __init__(self):
            super().__init__()
            self.ref = TorchBackend()
            self.log = defaultdict(list)

        def _check(self, name, args, kwargs):
            ref_args, ref_kwargs = _clone(args), _clone(kwargs)
            want = getattr(self.ref, name)(*ref_args, **ref_kwargs)
            got = getattr(TritonBackend, name)(self, *args, **kwargs)
            worst, first = (0.0, 0.0, 0), None
            pairs = list(zip(_tensors(args), _tensors(ref_args)))
            pairs += list(zip(_tensors(got), _tensors(want)))
            for i, (g, w) in enumerate(pairs):
                if g.dtype == torch.float8_e4m3fn or g.dtype == torch.float8_e8m0fnu:
                    g, w = g.view(torch.uint8), w.view(torch.uint8)
                d = _diff(w, g.to(w.device))
                if d[1] > worst[1]:
                    worst = d
                    first = i
            entry = {"call": len(self.log[name]), "max_abs": worst[0], "max_rel": worst[1],
                     "elements": worst[2], "tensor": first,
                     "shapes": [list(t.shape) for t in _tensors(args)][:6]}  # fmt: skip
            self.log[name].append(entry)
            return got

    for op in OPS:

        def method(self, *args, _op=op, **kwargs):
            return self._check(_op, args, kwargs)

        setattr(CrossCheck, op, method)
    CrossCheck.tol = tol
    return CrossCheck()


def crosscheck_forward(spec_name: str = "tiny40", tokens: int = 40, device: str = "cuda",
                       tol: float = 1e-5) -> dict:  # fmt: skip
    """Cross-check every backend op of a fresh ``tokens``-token prefill and one decode step
    (float32, bf16 pools, fp8 index, seeded random weights); returns ``{"ops": {op: {"calls",
    "worst", "over_tol"}}, "whole_forward_rel_l2": {...}}``."""
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend
    from v41plan.runtime.paged_model import RuntimeModel
    from v41plan.serving.engine import resolve_spec

    spec = resolve_spec(spec_name)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    w = ckpt.process(torch.float32, device)
    P = spec.replay.hash_block_tokens
    n = tokens
    pages = -(-(n + 2) // P) + 1
    ids = np.random.default_rng(4).integers(0, 256, n + 1)
    table = tuple(range(pages))
    kb = make_crosscheck(tol)
    logits = {}
    for name, backend in (("crosscheck", kb), ("torch", TorchBackend()),
                          ("triton", TritonBackend())):  # fmt: skip
        m = RuntimeModel(
            spec, w, ckpt.engram_host(), num_pages=pages + 4, num_slots=2, max_tokens=n + 8,
            max_bs=2, table_width=pages, dtype=torch.float32, device=device, cfg=cfg,
            backend=backend,
        )  # fmt: skip
        m.reset_slot(0)
        first = RequestInput(
            slot=0, block_table=table, prompt_len=n, start=0, chunk_len=n, phase="prefill",
            fresh_slot=True,
        )  # fmt: skip
        a = m.forward(plan_step(StepInput((first,)), spec), ids[:n]).logits.double().cpu()
        one = RequestInput(slot=0, block_table=table, prompt_len=n, start=n, chunk_len=1,
                           phase="decode")  # fmt: skip
        b = m.forward(plan_step(StepInput((one,)), spec), ids[n:]).logits.double().cpu()
        logits[name] = (a, b)
    forwards = {
        name: [float((g - r).norm() / r.norm()) for g, r in zip(logits[name], logits["torch"])]
        for name in ("crosscheck", "triton")
    }
    ops = {}
    for op, calls in kb.log.items():
        worst = max(calls, key=lambda c: c["max_rel"])
        bad = [c for c in calls if c["max_rel"] > tol]
        ops[op] = {"calls": len(calls), "worst": worst, "over_tol": bad[:8]}
    return {"spec": spec.name, "device": device, "tokens": n, "tol": tol,
            "whole_forward_rel_l2": forwards, "ops": ops}  # fmt: skip
