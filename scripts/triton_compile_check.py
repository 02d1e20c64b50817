"""Compile every launch of ``TritonBackend`` for a GPU architecture on any machine (no GPU) and
print each kernel variant's registers, spill bytes and shared memory.

    python scripts/triton_compile_check.py [--arch 90] [--widths medium,flash] [--json FILE]

The backend's ops run on small CPU pools of the real widths (``specs/medium.yaml``; "flash":
the same spec with V4.1-Flash's 64 attention heads and 32 index heads) with every kernel's
launch intercepted: the captured arguments, constexprs and options are compiled with
``triton.compile`` for ``sm_<arch>`` down to the cubin (Triton ships ptxas), and
``cuobjdump`` reads its resource use. A kernel that does not compile, or spills, shows here
before it reaches a GPU. Exit status 1 if any variant fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_TY = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}


def _kernels():
    from triton.runtime.jit import JITFunction

    from v41plan.runtime.kernels import triton_attention, triton_scatter, triton_scorer

    out = []
    for mod in (triton_scatter, triton_scorer, triton_attention):
        out += [
            v for v in vars(mod).values() if isinstance(v, JITFunction) and "kernel" in v.__name__
        ]
    return out


class Capture:
    """Intercepts every launch of the backend's kernels (nothing runs)."""

    def __init__(self):
        self.launches: list[tuple] = []

    def __enter__(self):
        self.kernels = _kernels()
        for k in self.kernels:

            def run(*args, grid, warmup, _k=k, **kwargs):
                self.launches.append((_k, grid, args, kwargs))

            k.run = run
        return self

    def __exit__(self, *exc):
        for k in self.kernels:
            del k.run


def _source(kernel, args, kwargs):
    """``(ASTSource, options)`` of one captured launch, specialised as the JIT would."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = bound[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i64" if abs(v) >= 2**31 else "i32"
            if v % 16 == 0 and v:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {p.name} of type {type(v)}")
    return ASTSource(kernel, signature, constexprs, attrs), options


def _resources(cubin: bytes) -> dict:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    res = {}
    for tok in text.split():
        if ":" in tok:
            key, _, val = tok.partition(":")
            if key in ("REG", "STACK", "SHARED", "LOCAL") and val.isdigit():
                res[key] = int(val)
    return res


def _scenarios(width: str):
    """The backend calls of one width: decode (64 rows) and prefill (2048 rows), every format."""
    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime.kernels.triton_backend import TritonBackend
    from v41plan.runtime.pools import Pools
    from v41plan.serving.engine import resolve_spec

    class Backend(TritonBackend):
        def _runs(self, op, *tensors):
            return True

    spec = resolve_spec("medium")
    cfg = config_from_cache_spec(spec)
    heads, index_heads = (64, 32) if width == "flash" else (cfg.num_attention_heads, 16)
    d, dih, W, K = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window, cfg.index_topk
    kb = Backend(num_sms=132)
    calls = []
    for kv_dtype, ix_dtype in (("bf16", "fp8"), ("fp4", "fp4")):
        p = Pools(spec.geometry(kv_dtype, ix_dtype), num_pages=8, num_slots=4)
        owner = min(p.main)
        rpp = p.rows_per_page[owner]
        planes = (
            (p.index[owner],)
            if owner in p.index
            else (p.index_values[owner], p.index_scales[owner])
        )
        for dtype in (torch.bfloat16, torch.float32):
            for t in (64, 2048):
                n_pages = 64
                pages = torch.zeros(t, n_pages, dtype=torch.long)
                vec = torch.zeros(t, dtype=torch.long)
                flag = torch.zeros(t, dtype=torch.bool)
                x = torch.zeros(t, d, dtype=dtype)
                tag = f"{width} {kv_dtype}/{ix_dtype} {str(dtype)[6:]} T={t}"

                def ops(
                    t=t,
                    pages=pages,
                    vec=vec,
                    flag=flag,
                    x=x,
                    dtype=dtype,
                    p=p,
                    planes=planes,
                    owner=owner,
                    rpp=rpp,
                    n_pages=n_pages,
                ):
                    kb.ring_write(p.ring(0), x, vec, vec, vec, p.sink_slot)
                    kb.main_scatter(p.main[owner], x, vec, vec, flag, p.sink_page)
                    key = torch.zeros(t, dih, dtype=dtype)
                    kb.index_key_store(planes, key, torch.ones(t, 1), vec, vec, flag, p.sink_page)
                    f32 = torch.zeros(t, d)
                    kb.compress_groups(
                        f32, f32, vec, vec, flag, flag, p.tail_values[:, 0], p.tail_scores[:, 0], 4
                    )
                    kb.cursor_write(
                        p.cursor, vec[:4], torch.zeros(4, p.cursor.shape[1], dtype=torch.long), 4
                    )
                    q = torch.zeros(t, index_heads, dih, dtype=dtype)
                    w = torch.zeros(t, index_heads, dtype=dtype)
                    kb.score_topk(planes, q, w, vec, pages, K, None)
                    kb.score_topk(
                        planes, q, w, vec, pages, K, torch.zeros(t, n_pages * rpp, dtype=torch.bool)
                    )
                    kb.score_candidates_topk(
                        planes,
                        q,
                        w,
                        vec,
                        pages,
                        K,
                        cfg.candidate_block_size,
                        cfg.candidate_topk_blocks,
                    )
                    qa = torch.zeros(t, heads, d, dtype=dtype)
                    out = torch.empty_like(qa)
                    sink = torch.zeros(heads)
                    ids = torch.zeros(t, K, dtype=torch.long)
                    common = (qa, sink, d**-0.5, p.ring(0), x, vec, vec, vec, vec, vec, W)
                    kb.sparse_attention(*common, p.main[owner], ids, pages, rpp, out)
                    kb.sparse_attention(*common, None, None, None, rpp, out)

                calls.append((tag, ops))
    return calls


def main(argv=None) -> int:
    """Compile every distinct captured launch; print one line each (exit 1 on a failure)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--widths", default="medium,flash")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernels", default=None, help="only kernels whose name contains this")
    ap.add_argument(
        "--max-shared", type=int, default=232448, help="shared memory per block (sm_90: 227 KiB)"
    )
    args = ap.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    seen: dict[str, dict] = {}
    failed = 0
    for width in args.widths.split(","):
        for tag, ops in _scenarios(width):
            with Capture() as cap:
                ops()
            for kernel, grid, a, kw in cap.launches:
                if args.kernels and args.kernels not in kernel.__name__:
                    continue
                src, options = _source(kernel, a, kw)
                const = {k: v for k, v in src.constants.items()}
                key = f"{kernel.__name__} {sorted(const.items())} {sorted(options.items())}"
                if key in seen:
                    continue
                row = {
                    "kernel": kernel.__name__,
                    "first_seen": tag,
                    "grid": list(grid) if isinstance(grid, tuple) else str(grid),
                    "constexprs": {kernel.arg_names[k[0]]: v for k, v in const.items()},
                    "options": options,
                }
                t0 = time.perf_counter()
                try:
                    ck = triton.compile(src, target=target, options=options)
                    row.update(_resources(ck.asm["cubin"]))
                    row["SHARED"] = ck.metadata.shared  # dynamic shared memory included
                    if row["SHARED"] > args.max_shared:
                        raise RuntimeError(
                            f"needs {row['SHARED']} B of shared memory, the device has "
                            f"{args.max_shared}"
                        )
                    row["compile_s"] = round(time.perf_counter() - t0, 2)
                except Exception as e:  # noqa: BLE001 - reported per variant, the others still run
                    failed += 1
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                seen[key] = row
                c = row["constexprs"]
                brief = " ".join(f"{k}={v}" for k, v in c.items())
                if "error" in row:
                    print(f"FAIL {row['kernel']:<26} {brief}\n     {row['error']}", flush=True)
                else:
                    print(
                        f"ok   {row['kernel']:<26} REG {row.get('REG', '?'):>3} "
                        f"STACK {row.get('STACK', 0):>5} SHARED {row.get('SHARED', 0):>6} "
                        f"warps {options.get('num_warps', 4)}  {brief}",
                        flush=True,
                    )
    if args.json:
        Path(args.json).write_text(json.dumps(list(seen.values()), indent=1, default=str))
    print(f"{len(seen)} variants, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
