"""Localise GPU-only disagreements the GPU tests report, in one device call.

Run from the repository root on a CUDA machine: ``python3 scripts/gpu_diagnose.py --out DIR``.
Prints a short table per probe and writes ``DIR/gpu_diagnose.json``:

- ``e4m3``: every E4M3 byte decoded in a Triton kernel (to fp32, and on to bf16) against
  torch's decode.
- ``scorer``: the fp8 index scorer of the GPU test case with the same query values held in
  bf16 and in fp32, Triton and torch: which of the four disagree, and where.
- ``attention``: the packed-key sparse attention test with bf16 dot operands forced.
- ``pools``: the TINY-40 paged runtime in float64 (bf16 pools, fp8 index) one ragged prefill
  step on the CPU and the GPU: which pool views hold different bytes, with sample values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.getcwd())


def probe_e4m3() -> dict:
    import triton
    import triton.language as tl

    from v41plan.runtime.kernels.triton_common import e4m3_value

    @triton.jit
    def _decode(src, sw32, sw16, hw32, hw16, hwd16):
        i = tl.arange(0, 256)
        b = tl.load(src + i)
        v = e4m3_value(b)  # the bit-field decode the kernels use
        tl.store(sw32 + i, v)
        tl.store(sw16 + i, v.to(tl.bfloat16))
        h = b.to(tl.float8e4nv, bitcast=True)  # the hardware conversions
        tl.store(hw32 + i, h.to(tl.float32))
        tl.store(hw16 + i, h.to(tl.float32).to(tl.bfloat16))
        tl.store(hwd16 + i, h.to(tl.bfloat16))

    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    outs = {
        "sw_fp32": torch.empty(256, device="cuda"),
        "sw_bf16": torch.empty(256, dtype=torch.bfloat16, device="cuda"),
        "hw_fp32": torch.empty(256, device="cuda"),
        "hw_fp32_bf16": torch.empty(256, dtype=torch.bfloat16, device="cuda"),
        "hw_bf16": torch.empty(256, dtype=torch.bfloat16, device="cuda"),
    }
    _decode[(1,)](codes, *outs.values())
    want = codes.cpu().view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(want)
    res = {}
    for name, got in outs.items():
        got = got.float().cpu()
        bad = (~torch.eq(got, want) & finite).nonzero().flatten().tolist()
        res[name] = {
            "wrong": len(bad),
            "samples": [(c, float(want[c]), float(got[c])) for c in bad[:6]],
        }
        print(
            f"e4m3 decode {name:13s}: {len(bad)} of 254 finite codes wrong {res[name]['samples']}"
        )
    return res


def probe_scorer() -> dict:
    from tests.gpu.test_triton_backend_gpu import _backends, _score_case

    ref, tri = _backends()
    out = {}
    for name in ("tiny40", "medium"):
        _cfg, planes, q, w, bound, pages = _score_case(name, "fp8", exact=False, seed=1)
        qb, wb = q.to(torch.bfloat16), w.to(torch.bfloat16)
        qf, wf = qb.float(), wb.float()  # the same values, in fp32
        s = {
            "ref_bf16": ref.scores(planes, qb, wb, bound, pages).float(),
            "ref_f32": ref.scores(planes, qf, wf, bound, pages).float(),
            "tri_bf16": tri.scores(planes, qb, wb, bound, pages).float(),
            "tri_f32": tri.scores(planes, qf, wf, bound, pages).float(),
        }
        fin = torch.isfinite(s["ref_f32"])
        res = {}
        keys = list(s)
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                d = (s[a] - s[b]).abs()[fin]
                rel = d / s[b].abs()[fin].clamp_min(1e-6)
                bad = (rel > 1e-4).nonzero()
                res[f"{a} vs {b}"] = {
                    "max_abs": float(d.max()),
                    "n_rel_gt_1e-4": int(bad.numel()),
                }
        # where tri_bf16 and ref_f32 differ: which query rows, which key columns
        d = (s["tri_bf16"] - s["ref_f32"]).abs() > 1e-4 * s["ref_f32"].abs().clamp_min(1e-6)
        d = d & fin
        res["rows_differing"] = d.any(1).nonzero().flatten().tolist()[:32]
        res["cols_differing"] = d.any(0).nonzero().flatten().tolist()[:32]
        res["n_rows"] = int(d.shape[0])
        out[name] = res
        print(f"scorer fp8 {name}:")
        for k, v in res.items():
            print(f"  {k}: {v}")
    return out


def probe_attention() -> dict:
    """The GPU test's sparse attention over packed keys (FP8 ring, FP4 main) with bf16 dot
    operands forced, against the torch reference: the window alone (ring), then with the
    selected rows (plane)."""
    from tests.gpu import test_triton_backend_gpu as T
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    out = {}
    ref, tri = T._backends()
    for name in T.SPECS:
        for rows in (4, 40):
            args, sel = T._attention_case(name, "fp4", torch.bfloat16, t=rows)
            for part, s in (("window", (None, None, None, sel[3])), ("window+plane", sel)):
                res = {}
                for dots in (False, True):
                    tri.attention_override = {"DOT_BF16": dots}
                    want = torch.full_like(args[0], float("nan"))
                    got = torch.full_like(args[0], float("nan"))
                    ref.sparse_attention(*args, *s, want)
                    tri.sparse_attention(*args, *s, got)
                    err = (got.float() - want.float()).abs()
                    res["bf16 dots" if dots else "fp32 dots"] = float(err.nan_to_num(1e9).max())
                key = f"{name} rows={rows} {part}"
                out[key] = res
                print(f"attention packed keys {key}: max abs err {res}")
    TritonBackend.attention_override = None
    return out


def probe_pools() -> dict:
    from tests.gpu.test_parity_gpu import _runtime, _state
    from tests.runtime.paged_helpers import step, token_ids

    spec = _state("tiny40")[0]
    cpu, gpu = (_runtime("tiny40", "bf16", "fp8", d) for d in ("cpu", "cuda"))
    ids = [token_ids(70, 5), token_ids(70, 6)]
    tables = ((9, 7, 5), (8, 6, 4))
    reqs = [(0, tables[0], 40, 0, 40, "prefill"), (1, tables[1], 60, 0, 33, "prefill")]
    for m in (cpu, gpu):
        for slot in (0, 1):
            m.pools.reset_slot(slot)
    plan = step(spec, reqs, decoder_replay=False)
    flat = np.concatenate([ids[r[0]][r[3] : r[3] + r[4]] for r in reqs])
    cpu.forward(plan, flat, all_row_logits=True)
    gpu.forward(plan, flat, all_row_logits=True)
    views = {
        "rings": (cpu.pools.rings, gpu.pools.rings),
        "tail_values": (cpu.pools.tail_values, gpu.pools.tail_values),
        "tail_scores": (cpu.pools.tail_scores, gpu.pools.tail_scores),
        "cursor": (cpu.pools.cursor, gpu.pools.cursor),
    }
    for o in cpu.pools.main:
        views[f"main[{o}]"] = (cpu.pools.main[o], gpu.pools.main[o])
    for o in cpu.pools.index_values:
        views[f"index_values[{o}]"] = (cpu.pools.index_values[o], gpu.pools.index_values[o])
    for o in cpu.pools.index_scale:
        views[f"index_scale[{o}]"] = (cpu.pools.index_scale[o], gpu.pools.index_scale[o])
    out = {}
    total = int((cpu.pools.backing != gpu.pools.backing.cpu()).sum())
    print(f"pools bf16-fp8 step 0: {total} bytes differ")
    for name, (a, b) in views.items():
        b = b.cpu()
        if a.dtype in (torch.uint8, torch.int64):
            ne = a != b
        else:
            ne = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
        n = int(ne.sum())
        if not n:
            continue
        where = ne.nonzero()[:4]
        samples = [
            (tuple(int(i) for i in ix), a[tuple(ix)].item(), b[tuple(ix)].item()) for ix in where
        ]
        out[name] = {"n": n, "of": a.numel(), "samples": samples}
        print(f"  {name}: {n} of {a.numel()} differ; (index, cpu, gpu) {samples}")
    out["bytes_differ"] = total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/gpu")
    ap.add_argument("--probes", default="e4m3,scorer,attention,pools")
    args = ap.parse_args()
    from v41plan.validation.provenance import provenance

    report = {"provenance": provenance(), "device": torch.cuda.get_device_name()}
    for p in args.probes.split(","):
        try:
            report[p] = globals()[f"probe_{p}"]()
        except Exception as e:  # noqa: BLE001 (a probe that breaks must not hide the others)
            print(f"{p}: {type(e).__name__}: {e}")
            report[p] = {"error": f"{type(e).__name__}: {e}"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_diagnose.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
