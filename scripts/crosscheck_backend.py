"""Run every kernel-backend op of a paged forward twice, Triton and torch, and say where they part.

    python3 scripts/crosscheck_backend.py [--spec tiny40] [--tokens 40] [--device cuda] [--out F]
    TRITON_INTERPRET=1 python3 scripts/crosscheck_backend.py --device cpu   # the interpreter

A fresh prefill of ``--tokens`` tokens and one decode step run on a ``RuntimeModel`` (float32,
bf16 pools, fp8 index) whose backend is ``CrossCheck``: each op call clones its tensor arguments,
runs ``TorchBackend``'s op on the clones and ``TritonBackend``'s on the originals, and compares
every tensor argument afterwards (the pools a scatter wrote) and every result. The forward goes
on with Triton's results, so a disagreement shows at the op and the call where it starts.
Prints one line per op (calls, worst difference, first call over ``--tol``) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="tiny40")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tol", type=float, default=1e-5, help="relative difference reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            print("crosscheck_backend.py: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        from v41plan.runtime.kernels import triton_common

        triton_common.patch_interpreter()
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.planner.step import RequestInput, StepInput, plan_step
    from v41plan.runtime.paged_model import RuntimeModel
    from v41plan.serving.engine import resolve_spec
    from v41plan.validation.provenance import provenance

    spec = resolve_spec(args.spec)
    cfg = config_from_cache_spec(spec)
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    w = ckpt.process(torch.float32, args.device)
    P = spec.replay.hash_block_tokens
    n = args.tokens
    pages = -(-(n + 2) // P) + 1
    ids = np.random.default_rng(4).integers(0, 256, n + 1)
    table = tuple(range(pages))
    kb = make_crosscheck(args.tol)
    from v41plan.runtime.kernels.torch_ref import TorchBackend
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    logits = {}
    for name, backend in (("crosscheck", kb), ("torch", TorchBackend()),
                          ("triton", TritonBackend())):  # fmt: skip
        m = RuntimeModel(
            spec, w, ckpt.engram_host(), num_pages=pages + 4, num_slots=2, max_tokens=n + 8,
            max_bs=2, table_width=pages, dtype=torch.float32, device=args.device, cfg=cfg,
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
    forwards = {}
    for name in ("crosscheck", "triton"):
        rel = [float((g - w_).norm() / w_.norm()) for g, w_ in zip(logits[name], logits["torch"])]
        forwards[name] = rel
        print(f"whole forward, {name} vs torch backend: logits rel L2 prefill {rel[0]:.2e}, "
              f"decode {rel[1]:.2e}")  # fmt: skip
    report = {"provenance": provenance(), "spec": spec.name, "device": args.device,
              "tokens": n, "whole_forward_rel_l2": forwards, "ops": {}}  # fmt: skip
    print(f"{'op':24s} {'calls':>5} {'max rel':>9} {'first call > tol':>16}  shapes")
    for op, calls in kb.log.items():
        bad = [c for c in calls if c["max_rel"] > args.tol]
        worst = max(calls, key=lambda c: c["max_rel"])
        report["ops"][op] = {"calls": len(calls), "worst": worst, "over_tol": bad[:8]}
        print(
            f"{op:24s} {len(calls):>5} {worst['max_rel']:>9.2e} "
            f"{(bad[0]['call'] if bad else '-')!s:>16}  {worst['shapes']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
