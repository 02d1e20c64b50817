"""Run every kernel-backend op of a paged forward twice, Triton and torch, and say where they part.

    python3 scripts/crosscheck_backend.py [--spec tiny40] [--tokens 40] [--device cuda] [--out F]
    TRITON_INTERPRET=1 python3 scripts/crosscheck_backend.py --device cpu   # the interpreter

See ``v41plan.validation.backend_crosscheck``: a fresh prefill and one decode step (float32,
bf16 pools, fp8 index), each op compared with ``TorchBackend``'s on the same inputs. Prints one
line per op (calls, worst relative difference, first call over ``--tol``) and the whole-forward
logits of the cross-checked and the pure-Triton backend against the pure-torch one; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="tiny40")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tol", type=float, default=1e-5, help="relative difference reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("crosscheck_backend.py: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        from v41plan.runtime.kernels import triton_common

        triton_common.patch_interpreter()
    from v41plan.validation.backend_crosscheck import crosscheck_forward
    from v41plan.validation.provenance import provenance

    report = crosscheck_forward(args.spec, args.tokens, args.device, args.tol)
    report["provenance"] = provenance()
    for name, rel in report["whole_forward_rel_l2"].items():
        print(f"whole forward, {name} vs torch backend: logits rel L2 prefill {rel[0]:.2e}, "
              f"decode {rel[1]:.2e}")  # fmt: skip
    print(f"{'op':24s} {'calls':>5} {'max rel':>9} {'first call > tol':>16}  shapes")
    for op, r in report["ops"].items():
        bad = r["over_tol"]
        print(
            f"{op:24s} {r['calls']:>5} {r['worst']['max_rel']:>9.2e} "
            f"{(bad[0]['call'] if bad else '-')!s:>16}  {r['worst']['shapes']}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
