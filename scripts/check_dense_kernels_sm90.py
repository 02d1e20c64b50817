"""Compile the fused dense kernels for an H100/H200 (sm_90) without a GPU and report resources.

    python scripts/check_dense_kernels_sm90.py [--quick] [--hidden 1024] [--arch 90] [--only S]

Builds every variant the launchers of ``v41plan.runtime.kernels.triton_dense`` pick (both site
forms of ``SITE_CONFIGS`` with and without the fused expand and quantizer, the quantizer's codes
and dequantized forms, the expand), bf16 and float32 streams, at the given hidden size, through
Triton's whole pipeline down to a cubin (Triton's bundled ``ptxas``). Prints registers, spill
bytes and the layout conversions left inside each loop, flags ``wgmma-serialized`` (ptxas made
every wgmma wait for the one before), ``div64 n`` (64-bit integer divisions or remainders:
called routines) and ``loop-fchk n`` (IEEE float divisions inside loops: each a branch region
with its slow-path call, so they do not overlap), with ``--loop-histogram`` the SASS of each
kernel's longest loop, and exits 1 if any variant fails to compile: the interpreter runs the
kernels' arithmetic, not the GPU compiler, so this is the check that catches what only the
compiler refuses. ``--quick``: one variant of each kernel.
Must run without ``TRITON_INTERPRET`` (the kernels are then built compiled). Pointer arguments
are compiled as 16-byte aligned, as Triton specializes a launch's tensors; integer arguments
stay general (a launch whose strides are multiples of 16 gets wider loads than shown here),
except where a variant marks them so (the attention's strides) or with ``--strides16``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SITE_PTRS = [
    "X_ptr",
    "pre_in_ptr",
    "fn_ptr",
    "base_ptr",
    "scale_ptr",
    "w_ptr",
    "y_ptr",
    "post_prev_ptr",
    "C_prev_ptr",
    "X_out_ptr",
    "pre_ptr",
    "post_ptr",
    "C_ptr",
    "x_ptr",
    "codes_ptr",
    "scales_ptr",
]
STREAM_PTRS = {"X_ptr", "w_ptr", "y_ptr", "X_out_ptr", "x_ptr"}


def _variants(td, hidden: int, quick: bool) -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, signature, constexprs, warps) of every variant to build."""
    out = []
    dtypes = ("*bf16",) if quick else ("*bf16", "*fp32")
    for xdt in dtypes:
        for dequant in (False,) if quick else (False, True):
            sig = {
                "x_ptr": xdt,
                "out_ptr": xdt,
                "codes_ptr": xdt if dequant else "*u8",
                "scales_ptr": xdt if dequant else "*fp32",
                "M": "i32",
                "K": "i32",
            }
            cx = {"BLOCK_M": 2, "GROUPS": 32, "BLOCK": 32, "DEQUANT": dequant}
            sig.update(dict.fromkeys(cx, "constexpr"))
            out.append((f"fp8_quant {xdt} dequant={dequant}", td._fp8_quant_kernel, sig, cx, 4))
        sig = {"y_ptr": xdt, "X_ptr": xdt, "post_ptr": "*fp32", "C_ptr": "*fp32", "out_ptr": xdt}
        sig.update({"N": "i32", "D": "i32"})
        cx = {"BLOCK_N": 4, "BLOCK_D": 256, "X_BF16": xdt == "*bf16"}
        sig.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"hc_expand {xdt}", td._hc_expand_kernel, sig, cx, 4))
        sig = {"o_ptr": xdt, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": xdt}
        sig.update({"N": "i32", "so_n": "i32", "so_h": "i32"})
        cx = {"D": 512, "RD": 64, "HG": 4, "X_BF16": xdt == "*bf16"}
        sig.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"inverse_rope_groups {xdt}", td._inverse_rope_groups_kernel, sig, cx, 4))
        forms = [cfg for _, cfg in td.SITE_CONFIGS]
        if not any(f[0] == "split" for f in forms):
            forms.append(("split", 1, 128, 4))  # the decode form the tile sweep times
        for mix, block_n, block_d, warps in forms:
            flags = ((True, True),) if quick else ((False, False), (True, False), (True, True))
            for expand, quant in flags:
                sig = {n: (xdt if n in STREAM_PTRS else "*fp32") for n in SITE_PTRS}
                sig["codes_ptr"] = "*u8"
                sig.update({"N": "i32", "hc_eps": "fp32", "norm_eps": "fp32"})
                cx = {
                    "D": hidden,
                    "ITERS": 20,
                    "BLOCK_N": block_n,
                    "BLOCK_D": block_d,
                    "QBLOCK": 32,
                    "EXPAND": expand,
                    "QUANT": quant,
                    "X_BF16": xdt == "*bf16",
                    "NORM_CHUNK": block_d * td.NORM_UNROLL,
                }
                if mix == "split":
                    out += _split_variants(td, xdt, hidden, block_d, warps, expand, quant)
                    continue
                kernel = td._mhc_site_kernel
                if mix != "products":
                    kernel = td._mhc_site_dot_kernel
                    cx["PRECISION"] = mix
                sig.update(dict.fromkeys(cx, "constexpr"))
                name = f"mhc_site {mix} bn={block_n} {xdt} expand={expand} quant={quant}"
                out.append((name, kernel, sig, cx, warps))
    return out


def _gemm_variants(hidden: int) -> list:
    """The W8A8 linear (decode tiles, split-K, the prefill tile by pointers and by TMA) and the
    shared expert's gate/up with their split sums, the grouped MoE's two GEMMs in the fp8 and
    bf16 modes at wide K steps (the fp8 mode's 32-lane blocks unrolled) and with the raw tiles
    loaded a step ahead and with even and odd lanes apart (the packed decode, also with its tiles
    by TMA descriptors and the permuted rows it reads), and the one-program permutation."""
    from v41plan.runtime.kernels import triton_gemm as tg
    from v41plan.runtime.kernels import triton_moe as tm

    i32 = "i32"
    out = []
    # plain, the grouped wo_b input (K/G = 256), the query's RoPE epilogue (heads of 512), a
    # 4-way K split, and the prefill tile
    forms = (
        ("", 0, 0, 0, 1, (16, 32, 128, 4)),
        (" grouped", 256, 0, 0, 1, (16, 32, 128, 4)),
        (" rope", 0, 512, 64, 1, (16, 32, 128, 4)),
        (" split 4", 0, 0, 0, 4, (16, 32, 128, 4)),
        (" prefill 128x128x64", 0, 0, 0, 1, (128, 128, 64, 8)),
        (" bf16 prefill 128x128x64", 0, 0, 0, 1, (128, 128, 64, 8)),
        (" bf16 prefill 128x128x128", 0, 0, 0, 1, (128, 128, 128, 8)),
        (" w8a16 grouped bf16", 0, 0, 0, 1, (16, 64, 128, 4)),
        (" w8a16 grouped bf16 split 2", 0, 0, 0, 2, (16, 64, 128, 4)),
        (" w8a16 grouped bf16 prefill 128x128x32", 0, 0, 0, 1, (128, 128, 32, 8)),
    )
    for name, kg, head_d, rope_d, split, (bm, bn, bk, warps) in forms:
        a16 = "w8a16" in name  # the weight-only grouped product (wo_a): bf16 activations
        quant_x = split == 1 and bm == 16 and not a16  # else E4M3 codes come in
        xdt = "*bf16" if quant_x or a16 else "*u8"
        sig = {"x_ptr": xdt, "xs_ptr": xdt, "w_ptr": "*u8", "ws_ptr": "*u8"}
        sig.update({"y_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "part_ptr": "*fp32"})
        sig["count_ptr"] = "*i32"
        sig.update(dict.fromkeys(("M", "N"), i32))
        sig["K"] = "constexpr"
        sig.update(dict.fromkeys(("sxm", "sxg", "sxo", "sxsm", "swn", "swsn", "sym", "scm"), i32))
        cx = {"K": hidden, "QUANT_X": quant_x, "DOT": 1 if "bf16" in name else 2}
        cx.update({"A16": a16, "XO": 1024 if a16 else 0})
        cx["ONE_LAUNCH"] = split > 1  # the split's last program sums the partials
        cx["OUT_BF16"] = True
        cx.update({"KG": kg, "HEAD_D": head_d, "ROPE_D": rope_d, "BM": bm, "BN": bn, "BK": bk})
        cx.update({"GROUP_M": 8, "SPLIT_K": split, "K_SPLIT": -(-(hidden // 32) // split) * 32})
        sig.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"w8a8 bk={bk}{name}", tg._w8a8_kernel, sig, cx, warps))
    # the prefill tile by TMA descriptors, plain and with RoPE, and the bf16 mode's 64 lanes;
    # a decode tile by TMA with K splits ending in the launch (DECODE_TMA)
    tma_forms = [(False, 2, 32, 128, 128, 1, 8), (True, 2, 32, 128, 128, 1, 8)]
    tma_forms += [(False, 1, 64, 128, 128, 1, 8), (False, 2, 32, 16, 64, 4, 4)]
    for rope, dot, bk, bm, bn, split, warps in tma_forms:
        sig = {"x_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "xs_ptr": "*u8"}
        sig.update({"w_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>", "ws_ptr": "*u8"})
        sig.update({"y_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"})
        sig.update({"part_ptr": "*fp32", "count_ptr": "*i32"})
        sig.update({"M": i32, "N": i32, "K": "constexpr"})
        sig.update(dict.fromkeys(("sxsm", "swsn", "sym", "scm"), i32))
        cx = {"K": hidden, "DOT": dot, "OUT_BF16": True, "HEAD_D": 512 if rope else 0}
        cx.update({"ROPE_D": 64 if rope else 0, "BM": bm, "BN": bn, "GROUP_M": 8, "BK": bk})
        k_split = -(-(hidden // 32) // split) * 32 if split > 1 else 0
        cx.update({"F32_DOT": False, "SPLIT_K": split, "K_SPLIT": k_split})
        cx["ONE_LAUNCH"] = split > 1
        sig.update(dict.fromkeys(cx, "constexpr"))
        name = f"w8a8 tma {bm}x{bn}x{bk}{' rope' if rope else ''}{' bf16' if dot == 1 else ''}"
        name += f" split {split}" if split > 1 else ""
        out.append((name, tg._w8a8_tma_kernel, sig, cx, warps))
    sig = {"part_ptr": "*fp32", "y_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    sig.update(dict.fromkeys(("M", "N", "sym", "scm"), i32))
    cx = {"S": 4, "OUT_BF16": True, "HEAD_D": 512, "ROPE_D": 64, "BM": 16, "BN": 128}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("w8a8 split sum rope", tg._split_sum_kernel, sig, cx, 4))
    for split in (1, 4):
        sig = {n: "*u8" for n in ("xq_ptr", "xs_ptr", "w1_ptr", "ws1_ptr", "w3_ptr", "ws3_ptr")}
        sig.update({"h_ptr": "*u8", "hs_ptr": "*u8", "part_ptr": "*fp32", "limit": "fp32"})
        sig["count_ptr"] = "*i32"
        sig.update({"M": i32, "N": i32, "K": "constexpr"})
        sig.update(dict.fromkeys(("sxm", "sxsm", "swn", "swsn", "shm", "shsm"), i32))
        cx = {"K": hidden, "DOT": 2, "ROUND_BF16": True, "BM": 16, "BN": 32, "BK": 64}
        cx.update({"GROUP_M": 8, "SPLIT_K": split, "K_SPLIT": -(-(hidden // 32) // split) * 32})
        cx["ONE_LAUNCH"] = split > 1  # the split's last program ends the product
        sig.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"w8a8 swiglu fp8 bk=64 split {split}", tg._w8a8_swiglu_kernel, sig, cx, 4))
    sig = {"part_ptr": "*fp32", "h_ptr": "*u8", "hs_ptr": "*u8", "limit": "fp32"}
    sig.update(dict.fromkeys(("M", "N", "shm", "shsm"), i32))
    cx = {"S": 4, "ROUND_BF16": True, "BM": 16, "BN": 64}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("w8a8 swiglu split sum", tg._swiglu_split_sum_kernel, sig, cx, 4))
    # the "mm" mode's pieces (MM_ROWS): the quantizer's values, codes back to values, the RoPE
    # on stored rows and the SwiGLU of stored sums
    from v41plan.runtime.kernels import triton_quant as tq

    sig = {"x_ptr": "*bf16", "q_ptr": "*bf16", "s_ptr": "*bf16"}
    sig.update(dict.fromkeys(("M", "K", "sxm", "sqm", "ssm"), i32))
    cx = {"BM": 16, "BKB": 4, "PDL": False, "VALUES": True}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("mm act values", tq._act_quant_kernel, sig, cx, 4))
    sig = {"q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16"}
    sig.update(dict.fromkeys(("M", "K", "sqm", "ssm", "som"), i32))
    cx = {"BM": 16, "BKB": 4}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("mm act dequant", tq._act_dequant_kernel, sig, cx, 4))
    sig = {"y_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    sig.update(dict.fromkeys(("M", "sym", "scm"), i32))
    cx = {"OUT_BF16": True, "HEAD_D": 512, "ROPE_D": 64, "BM": 32}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("mm rope rows", tg._rope_rows_kernel, sig, cx, 4))
    sig = {"g_ptr": "*bf16", "h_ptr": "*u8", "hs_ptr": "*u8", "limit": "fp32"}
    sig.update(dict.fromkeys(("M", "N", "sgm", "shm", "shsm"), i32))
    cx = {"ROUND_BF16": True, "BM": 16, "BN": 64}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("mm swiglu rows", tg._swiglu_rows_kernel, sig, cx, 4))
    moe_forms = [(2, 128, False, False, False), (1, 128, False, False, False)]
    moe_forms += [(1, 256, False, False, False), (1, 128, True, False, False)]
    moe_forms += [(1, 256, False, True, False), (1, 128, True, True, False)]
    moe_forms += [(1, 512, False, True, True), (1, 256, False, "folded", False)]
    for dot, bk, prefetch, pairs, tma in moe_forms:
        mode = ("fp8" if dot == 2 else "bf16") + (" prefetch" if prefetch else "")
        mode += (" pairs" if pairs else "") + (" tma" if tma else "")
        mode += " folded" if pairs == "folded" else ""
        asm = 2 if pairs == "folded" else int(bool(pairs))
        flags = {"PREFETCH": prefetch, "PAIRS": bool(pairs), "ASM": asm, "TMA": tma}
        ptrs = {"xq_ptr": "*u8", "xs_ptr": "*u8", "w1_ptr": "*u8", "s1_ptr": "*u8"}
        ptrs.update({"w3_ptr": "*u8", "s3_ptr": "*u8", "row_ptr": "*i64", "bexp_ptr": "*i32"})
        ptrs.update({"rw_ptr": "*fp32", "act_ptr": "*u8", "acts_ptr": "*u8"})
        ptrs.update({"xb_ptr": "*bf16", "actb_ptr": "*bf16"})
        codes = f"tensordesc<u8[32, {bk // 2}]>" if tma else "*u8"
        ptrs.update({"xd": f"tensordesc<bf16[16, {bk // 2}]>" if tma else "*u8"})
        ptrs.update({"w1d": codes, "w3d": codes, "limit": "fp32"})
        strides = ("sx", "sxs", "swe", "swn", "sse", "ssn", "sa", "sas", "sxb", "sab")
        ptrs.update(dict.fromkeys(strides, i32))
        cx = {"D": hidden, "I": 256, "TOPK": 6, "ROUND_BF16": True, "DOT": dot, "BM": 16}
        cx.update({"BN": 32, "BK": bk, **flags})
        ptrs.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"moe gate_up {mode} bk={bk}", tm._gate_up_kernel, ptrs, cx, 4))
        ptrs = {"act_ptr": "*u8", "acts_ptr": "*u8", "w2_ptr": "*u8", "s2_ptr": "*u8"}
        ptrs.update({"bexp_ptr": "*i32", "y_ptr": "*bf16", "actb_ptr": "*bf16"})
        ptrs.update({"ad": f"tensordesc<bf16[16, {bk // 2}]>" if tma else "*u8"})
        ptrs.update({"w2d": f"tensordesc<u8[64, {bk // 2}]>" if tma else "*u8"})
        ptrs.update(dict.fromkeys(("sa", "sas", "swe", "swn", "sse", "ssn", "sy", "sab"), i32))
        cx = {"D": hidden, "I": 256, "ROUND_BF16": True, "DOT": dot, "BM": 16, "BN": 64}
        cx.update({"BK": bk, **flags})
        ptrs.update(dict.fromkeys(cx, "constexpr"))
        out.append((f"moe down {mode} bk={bk}", tm._down_kernel, ptrs, cx, 4))
    sig = {"xq_ptr": "*u8", "xs_ptr": "*u8", "row_ptr": "*i64", "out_ptr": "*bf16"}
    sig.update({"sxm": i32, "sxsm": i32, "som": i32})
    cx = {"D": hidden, "TOPK": 6, "BLOCK": 512}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("moe deinterleave_rows", tm._deinterleave_rows_kernel, sig, cx, 4))
    sig = {"ids_ptr": "*i64", "row_ids_ptr": "*i64", "pos_ptr": "*i64", "ends_ptr": "*i32"}
    sig.update({"be_ptr": "*i32", "nk": i32, "R": i32, "expert_first": i32})
    # the loop over experts (medium's 48); the one-hot prefix sums (flash_slice's 32 experts,
    # 64 tokens x 6: 384 rows, 864 padded)
    for one_hot in (False, True):
        cx = {"E": 48, "BM": 16, "BLOCK": 512, "RBLOCK": 2048, "GBLOCKS": 32}
        if one_hot:
            cx = {"E": 32, "BM": 16, "BLOCK": 512, "RBLOCK": 1024, "GBLOCKS": 32}
            cx.update({"ONE_HOT": True, "EP": 32, "RB": 64})
        sig.update(dict.fromkeys(cx, "constexpr"))
        name = f"moe align_rows{' one-hot' if one_hot else ''}"
        out.append((name, tm._align_rows_kernel, dict(sig), cx, 8 if one_hot else 4))
    return (
        out + _router_variants() + _attention_variants() + _scorer_variants() + _select_variants()
    )


def _attention_variants(every: bool = False) -> list:
    """The sparse attention at V4.1-Flash widths (64 heads, 512 lanes, window 128, top-512,
    bf16 planes) as the launcher builds it (2 stages): one 64-head block of 32 keys (8 warps)
    and 32 heads; strides multiples of 16 as every pool's are. ``every``: also the decode forms
    the launcher picks, key splits 10 (one row) and 3 (64 rows) with their fp32 partials, 16
    warps at 64 heads and 8 at 32, two splits (the launcher's form at 64 rows) at two and three
    stages, and two splits with the selected ids resolved first (``RESOLVE``) at two and three
    stages (``RESOLVE_SELECTED``'s form: three), and each with its splits balanced over the row's
    own blocks (``BALANCED_SPLITS``); ``RESOLVE_SELECTED``'s one-split form (prefill); and
    medium's 16-head form at 64 rows (4 splits, resolved and balanced) at three stages, two,
    and 16-key blocks."""
    from v41plan.runtime.kernels import triton_attention as ta

    ptrs = {"q_ptr": "*bf16", "sink_ptr": "*fp32", "out_ptr": "*i16", "ring_ptr": "*bf16"}
    ptrs.update({"kv_ptr": "*bf16", "plane_ptr": "*bf16", "part_o_ptr": "*fp32"})
    ptrs.update({"part_ml_ptr": "*fp32"})
    ptrs.update({n: "*i64" for n in ("rows_ptr", "slot_ptr", "pos_ptr", "window_lo_ptr")})
    ptrs.update({n: "*i64" for n in ("ring_until_ptr", "ids_ptr", "pages_ptr")})
    forms = [(64, 8, 1, 32, 2), (32, 4, 1, 32, 2)]
    if every:
        forms += [(hb, w, s, 32, 2) for hb, w in ((64, 8), (64, 16), (32, 8)) for s in (1, 10, 3)]
        forms += [(64, 8, 2, 32, 2), (64, 8, 2, 32, 3)]  # 64 rows (8K): the launcher's; 3 stages
        forms += [(64, 8, 2, 32, 2, True), (64, 8, 2, 32, 3, True)]  # RESOLVE_SELECTED's: 3
        forms += [(64, 8, 2, 32, 2, False, True), (64, 8, 2, 32, 3, True, True)]  # BALANCED_SPLITS
        forms.append((64, 8, 1, 32, 3, True))  # RESOLVE_SELECTED's one-split form (prefill)
        # medium (16 heads, 4 warps) at 64 rows: the launcher's four splits, resolved and
        # balanced, at three stages (its default) and two, and 16-key blocks at three
        forms += [(16, 4, 4, bn, st, True, True) for bn, st in ((32, 3), (32, 2), (16, 3))]
    out = []
    for hb, warps, splits, bn, stages, *flags in forms:
        resolve, balance = (list(flags) + [False, False])[:2]
        sig = {}
        for n in ta.sparse_attention_kernel.arg_names:
            if n in ptrs:
                sig[n] = ptrs[n]
            elif n == "qk_scale":
                sig[n] = "fp32"
            elif n.startswith("s_") or n in ("H", "ring_rows", "RPP"):
                sig[n] = "i32:16"
            elif n in ("n_kv_rows", "P"):
                sig[n] = "i32"
        cx = {"KSEL": 512, "KSEL_P2": 512, "D": 512, "HB": hb, "BN": bn, "W": 128}
        cx.update({"RING_FP8": False, "PLANE_FP4": False, "HAS_PLANE": True, "SPLITS": splits})
        cx.update({"OUT_BF16": True, "DOT_BF16": True, "F32_DOT": "ieee", "PREFETCH": 0})
        cx["DV"] = 512
        cx["RESOLVE"], cx["BALANCE"] = bool(resolve), bool(balance)
        sig.update(dict.fromkeys(cx, "constexpr"))
        width = "medium" if hb == 16 else "flash"
        name = f"sparse attention {width} HB={hb} warps={warps} SPLITS={splits}"
        name += f" BN={bn}" if bn != 32 else ""
        name += f" stages={stages}" if stages != 2 else ""
        name += " resolve" if resolve else ""
        name += " balance" if balance else ""
        opts = {"num_warps": warps, "num_stages": stages}
        out.append((name, ta.sparse_attention_kernel, sig, cx, opts))
    return out


def _scorer_variants(every: bool = False) -> list:
    """The index scorer's decode form (one row a program, 64-key tiles, 4 warps as launched) on
    the fp8 plane at V4.1-Flash widths (32 heads x 128), fp16 dot operands (the hardware's exact
    E4M3 -> fp16); ``every``: also medium's widths (16 x 128), the prefetch
    (``score_prefetch``), the chunk's pages loaded first (``score_chunk_pages``), 32-key tiles
    and the fp4 plane at flash widths."""
    from v41plan.runtime.kernels import triton_scorer as sc

    out = []
    # (name, heads padded, fp4, prefetch, chunk pages, keys a tile, every column: FILL)
    forms = [("flash fp8", 32, False, 0, 0, 64, 0), ("medium fp8", 16, False, 0, 0, 64, 0)]
    forms += [("flash fp4", 32, True, 0, 0, 64, 0), ("flash fp8", 32, False, 1, 0, 64, 0)]
    forms.append(("flash fp8", 32, False, 0, 1024 // 64, 64, 0))  # score_chunk_pages
    forms.append(("flash fp8", 32, False, 0, 0, 32, 0))  # 32-key tiles (the old default)
    forms.append(("medium fp8", 16, False, 0, 0, 64, 1))  # scores(): to the table's end
    forms = forms if every else forms[:1]
    for name, hp, fp4, prefetch, chunk_pages, bn, fill in forms:
        sig = {}
        for n in sc.score_kernel.arg_names:
            if n.endswith("_ptr"):
                sig[n] = "*fp32" if n in ("q_ptr", "w_ptr", "out_ptr") else "*i64"
            elif n.startswith("s_") or n in ("T", "H", "P"):
                sig[n] = "i32"
        sig["key_ptr"] = "*u8"
        sig["ksc_ptr"] = "*u8"
        sig["q_ptr"] = sig["w_ptr"] = "*bf16"
        sig["cand_ptr"] = "*u8"
        sig["bound_ptr"] = "*i64"
        cx = {"RPP": 64, "ROWS": 1, "D": 128, "HP": hp, "BN": bn, "CHUNK": 1024, "FP4": fp4}
        cx.update({"HAS_CAND": False, "FILL": bool(fill), "QUANT": True, "ROUND_BF16": fp4})
        cx.update({"DOT_BF16": True, "PREFETCH": prefetch, "PDL": False})
        cx["CHUNK_PAGES"] = chunk_pages
        sig.update(dict.fromkeys(cx, "constexpr"))
        out.append(
            (
                f"scorer decode {name} H={hp}"
                + (" prefetch" if prefetch else "")
                + (" chunk-pages" if chunk_pages else "")
                + (f" BN={bn}" if bn != 64 else "")
                + (" fill" if fill else ""),
                sc.score_kernel,
                sig,
                cx,
                4,
            )
        )
    return out


def _select_variants(every: bool = False) -> list:
    """The resident top-k select (``select_resident_kernel``) at 4,096 elements a row, the
    launcher's warps and early exit (an 8K decode's compressed rows); ``every``: also 8,192
    and 16,384 (its longest rows), 32,768 (a 64K context's, past it), 4,096 with the 32-step
    search and with 8 and 32 keys a thread (``select_thread_elems``); the long-row select's
    two kernels at 32,768 elements (``every``: the segment bounds exact and loose by bits too,
    besides the default loose ternary ones)."""
    from v41plan.runtime.kernels import triton_scorer as sc
    from v41plan.runtime.kernels.triton_backend import TritonBackend

    kb = TritonBackend()
    out = []
    forms = [(4096, True, 16, True), (8192, True, 16, False), (16384, True, 16, False)]
    forms += [(32768, True, 16, False), (4096, False, 16, False), (4096, True, 8, False)]
    forms += [(4096, True, 32, False), (4096, True, 16, False), (8192, True, 16, True)]
    for np_, early, elems, ternary in forms if every else forms[:1]:
        sig = {"score_ptr": "*fp32", "s_score_row": "i32", "bound_ptr": "*i64"}
        sig.update({"out_ptr": "*i64", "s_out_row": "i32", "K": "i32", "N": "i32"})
        cx = {"HAS_BOUND": True, "NP": np_, "KP": 512, "PDL": False, "EARLY": early}
        cx.update({"TERNARY": ternary, "PACK_MAX": kb.select_packed_scan_max})
        sig.update(dict.fromkeys(cx, "constexpr"))
        kb.select_thread_elems = elems
        warps = kb.resident_select_warps(np_)
        name = f"select resident N={np_} warps={warps}" + ("" if early else " 32-step")
        name += " ternary" if ternary else ""
        out.append((name, sc.select_resident_kernel, sig, cx, warps))
    kb.select_thread_elems = TritonBackend.select_thread_elems
    # the long-row select at 32,768 elements: four segments of 8,192 (lists of 1,024: top-512),
    # a final list of 4,096
    bounds = ((True, True), (False, False), (True, False))  # the default first
    for loose, ternary in bounds if every else bounds[:1]:
        sig = {"score_ptr": "*fp32", "s_score_row": "i32", "bound_ptr": "*i64", "ws_ptr": "*i32"}
        sig.update({"s_ws_row": "i32", "seg_ptr": "*i32", "s_seg_row": "i32"})
        sig.update({"K": "i32", "N": "i32", "SEG": "i32"})
        cx = {"HAS_BOUND": True, "NP": 8192, "SP": 4, "LC": 1024, "EARLY": True, "LOOSE": loose}
        cx["TERNARY"] = ternary
        sig.update(dict.fromkeys(cx, "constexpr"))
        warps = kb.resident_select_warps(8192)
        name = f"select long bound N=8192 warps={warps}" + (" loose" if loose else "")
        name += " ternary" if ternary else ""
        out.append((name, sc.select_bound_kernel, sig, cx, warps))
    sig = {"score_ptr": "*fp32", "s_score_row": "i32", "bound_ptr": "*i64", "ws_ptr": "*i32"}
    sig.update({"s_ws_row": "i32", "seg_ptr": "*i32", "s_seg_row": "i32", "list_ptr": "*i32"})
    sig.update({"s_list_row": "i32", "out_ptr": "*i64"})
    sig.update({"s_out_row": "i32", "K": "i32", "N": "i32", "S": "i32"})
    cx = {"HAS_BOUND": True, "SP": 4, "LC": 1024, "CHUNK": 2048, "NPC": 4096, "KP": 512}
    cx.update({"EARLY": True, "TERNARY": True, "HELD": True, "PACK_MAX": 4096})
    sig.update(dict.fromkeys(cx, "constexpr"))
    warps = kb.resident_select_warps(4096)
    name = f"select long final NPC=4096 warps={warps}"
    out.append((name, sc.select_final_kernel, sig, cx, warps))
    return out


def _router_variants() -> list:
    """The router: one kernel (medium's gate) and the GEMV split over ``D`` with its select
    (V4.1-Flash widths: 32 x 5120)."""
    from v41plan.runtime.kernels import triton_router as tr

    out = []
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64"}
    sig.update({"wts_ptr": "*fp32", "scale": "fp32"})
    cx = {"E": 48, "D": 1024, "K": 6, "K_PAD": 8, "NORM": True, "BLOCK_E": 64, "BLOCK_D": 256}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("router one kernel 48x1024", tr._router_kernel, sig, cx, 8))
    splits, lanes, block_d = tr.gate_splits(32, 5120)
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32"}
    cx = {"E": 32, "D": 5120, "S": splits, "LANES": lanes, "BLOCK_E": 32, "BLOCK_D": block_d}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("router gate split 32x5120", tr._gate_part_kernel, sig, cx, 8))
    sig = {"part_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32"}
    sig["scale"] = "fp32"
    cx = {"E": 32, "S": splits, "S_PAD": 16, "K": 6, "K_PAD": 8, "NORM": True, "BLOCK_E": 32}
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(("router select of the split", tr._select_kernel, sig, cx, 4))
    return out


def _split_variants(td, xdt, hidden, block_d, warps, expand, quant) -> list:
    """The split site's two kernels (first pass, finish) at ``block_d`` lanes per chunk."""
    lanes, split = td.split_lanes(hidden, block_d)
    part_ptrs = ["X_ptr", "pre_in_ptr", "fn_ptr", "y_ptr", "post_prev_ptr", "C_prev_ptr"]
    part_ptrs += ["X_out_ptr", "x_ptr", "part_ptr"]
    sig = {n: (xdt if n in STREAM_PTRS else "*fp32") for n in part_ptrs}
    sig["N"] = "i32"
    for n in ("base_ptr", "scale_ptr", "w_ptr", "pre_ptr", "post_ptr", "C_ptr", "scales_ptr"):
        sig[n] = xdt if n in STREAM_PTRS else "*fp32"
    sig.update({"codes_ptr": "*u8", "count_ptr": "*i32", "hc_eps": "fp32", "norm_eps": "fp32"})
    # the shipped one-launch form: pass 1 and, in the last program, the finish (its registers
    # are the kernel's)
    cx = {"D": hidden, "LANES": lanes, "SPLIT": split, "BLOCK_N": 1, "BLOCK_D": block_d}
    cx.update({"EXPAND": expand, "X_BF16": xdt == "*bf16", "ITERS": 20, "QBLOCK": 32})
    cx.update({"QUANT": quant, "ONE_LAUNCH": True, "NORM_CHUNK": td.norm_chunk(hidden, block_d)})
    sig.update(dict.fromkeys(cx, "constexpr"))
    name = f"mhc_site split part {xdt} expand={expand} quant={quant}"
    out = [(name, td._mhc_site_part_kernel, sig, cx, warps)]
    fin_ptrs = ["part_ptr", "base_ptr", "scale_ptr", "w_ptr", "pre_ptr", "post_ptr", "C_ptr"]
    fin_ptrs += ["x_ptr", "codes_ptr", "scales_ptr"]
    sig = {n: (xdt if n in STREAM_PTRS else "*fp32") for n in fin_ptrs}
    sig["codes_ptr"] = "*u8"
    sig.update({"N": "i32", "hc_eps": "fp32", "norm_eps": "fp32"})
    cx = {"D": hidden, "ITERS": 20, "SPLIT": split, "BLOCK_N": 1}
    cx["NORM_CHUNK"] = td.norm_chunk(hidden, block_d)
    cx.update({"QBLOCK": 32, "QUANT": quant, "X_BF16": xdt == "*bf16"})
    sig.update(dict.fromkeys(cx, "constexpr"))
    out.append(
        (f"mhc_site split finish {xdt} quant={quant}", td._mhc_site_finish_kernel, sig, cx, warps)
    )
    return out + _gemm_variants(hidden)


def _wgmma_serialized(ptx: str, ptxas: str, arch: int) -> bool:
    """Whether ``ptxas`` serializes the kernel's wgmma (its C7515 note, which the compile does not
    surface: every wgmma then waits for the one before, at any register or spill count)."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o"]
        cmd.append(str(src.with_suffix(".o")))
        res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    return "C7515" in res.stderr


def _resources(cubin: bytes, cuobjdump: str) -> str:
    """``REG:n STACK:n`` of a cubin, from the bundled ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name],
            check=False,
            capture_output=True,
            text=True,
        )
    line = next((ln for ln in res.stdout.splitlines() if "REG:" in ln), "")
    return " ".join(w for w in line.split() if w.startswith(("REG:", "STACK:")))


def _loops(cubin: bytes, cuobjdump: str) -> list[list[str]]:
    """The SASS of each of the kernel's loops (the span of each backward branch), the opcodes
    without their predicates."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [cuobjdump, "-sass", f.name], check=False, capture_output=True, text=True
        ).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:  # the opcode without its predicate
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append([t for a, t in ins if int(m.group(1), 16) <= a <= addr])
    return loops


def _loop_fchk(cubin: bytes, cuobjdump: str) -> int:
    """IEEE division checks (``FCHK``, each guarding a branch to the slow path) inside loops:
    every one is a branch region of its own, so the loop's divisions cannot overlap."""
    return sum(t.startswith("FCHK") for loop in _loops(cubin, cuobjdump) for t in loop)


def _loop_histogram(cubin: bytes, cuobjdump: str) -> str:
    """The SASS of the kernel's longest loop (the span of its longest backward branch), or with
    ``LOOP_ALL`` set in the environment of every loop, in code order: instructions, register
    moves (``MOV``, ``IMAD.MOV``) and the most frequent opcodes."""
    loops = _loops(cubin, cuobjdump)
    if not os.environ.get("LOOP_ALL"):
        loops = [max(loops, key=len)] if loops else []
    if not loops:
        return "loop none"
    lines = []
    for body in loops:
        ops = Counter(t.split()[0].split(".")[0] for t in body)
        moves = sum(1 for t in body if "MOV" in t.split()[0])
        n_top = int(os.environ.get("LOOP_TOP", "8"))
        top = " ".join(f"{op}:{n}" for op, n in ops.most_common(n_top))
        lines.append(f"loop {len(body)} instructions, {moves} moves; {top}")
    return "\n     ".join(lines)


def _div64(ptx: str) -> int:
    """64-bit integer divisions and remainders in a kernel's PTX: each a called routine in
    SASS (about a hundred instructions), where 32-bit operands take a few."""
    return len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one variant of each kernel")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (MEDIUM: 1024)")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability")
    ap.add_argument("--only", default=None, help="build the variants whose name contains this")
    ap.add_argument(
        "--loop-histogram",
        action="store_true",
        help="also print the SASS of each kernel's longest loop: instructions, register moves, "
        "the most frequent opcodes (LOOP_TOP in the environment: how many, default 8; "
        "LOOP_ALL: every loop, not the longest)",
    )
    ap.add_argument(
        "--mma-layouts",
        action="store_true",
        help="also print each kernel's shared memory bytes, each loop's plain and asynchronous "
        "global loads, the copy groups each loop leaves in flight at its wait (0: none overlaps "
        "the loop's work) and the MMA layouts of its TTGIR (warps per CTA and instruction shape "
        "of each tensor-core product)",
    )
    ap.add_argument(
        "--strides16",
        action="store_true",
        help="build integer stride arguments (names starting with 's') as multiples of 16, as "
        "a launch specializes them when they are: the code such a launch runs",
    )
    ap.add_argument(
        "--pdl",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="build the kernels that take PDL with this value (1: the dependent-launch gate, "
        "2: also the weight prefetch before it)",
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: the kernels must be built compiled")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from v41plan.runtime.kernels import triton_dense as td

    target = GPUTarget("cuda", args.arch, 32)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cuobjdump, ptxas = str(bin_dir / "cuobjdump"), str(bin_dir / "ptxas")
    variants = _variants(td, args.hidden, args.quick)
    if not args.quick:
        variants += _attention_variants(every=True) + _scorer_variants(every=True)
        variants += _select_variants(every=True)
    # the GEMM, router and attention forms come once per split-site form: build each once
    names = set()
    variants = [v for v in variants if not (v[0] in names or names.add(v[0]))]
    if args.only:
        variants = [v for v in variants if args.only in v[0]]
    failed = 0
    for name, kernel, sig, cx, warps in variants:
        try:
            # a launch's tensors are 16-byte aligned (Triton specializes that, as it does
            # integers divisible by 16, which are left general here: strides vary by shape)
            # (an integer typed "i32:16" is one a variant knows to be: the attention's strides)
            attrs = {
                (kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                for n, t in sig.items()
                if isinstance(t, str)
                and (
                    t.startswith("*")
                    or t == "i32:16"
                    or (args.strides16 and t == "i32" and n.startswith("s"))
                )
            }
            sig = {n: "i32" if t == "i32:16" else t for n, t in sig.items()}
            if "PDL" in kernel.arg_names and "PDL" not in cx:  # the launch's default is 0
                cx, sig = {**cx, "PDL": args.pdl}, {**sig, "PDL": "constexpr"}
            src = ASTSource(fn=kernel, signature=sig, constexprs=cx, attrs=attrs)
            opts = warps if isinstance(warps, dict) else {"num_warps": warps}
            k = triton.compile(src, target=target, options=opts)
        except Exception as exc:  # noqa: BLE001 - every variant is reported, the others still build
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-1500:]}")
            continue
        # each loop's conversions (up to its first yield: an inner loop's, where nested)
        loops = k.asm["ttgir"].split("scf.for")[1:]
        conv = "+".join(str(lp[: lp.find("scf.yield")].count("convert_layout")) for lp in loops)
        ptx = k.asm["ptx"]
        serial = "wgmma.mma_async" in ptx and _wgmma_serialized(ptx, ptxas, args.arch)
        div64 = _div64(ptx)
        fchk = _loop_fchk(k.asm["cubin"], cuobjdump)
        print(
            f"ok   {name}: {_resources(k.asm['cubin'], cuobjdump)} "
            f"loop-layout-conversions {conv or 0}{' wgmma-serialized' if serial else ''}"
            f"{f' div64 {div64}' if div64 else ''}{f' loop-fchk {fchk}' if fchk else ''}"
        )
        if args.loop_histogram:
            print(f"     {_loop_histogram(k.asm['cubin'], cuobjdump)}")
        if args.mma_layouts:
            mma = re.findall(r"^#mma\d* = (.*)$", k.asm["ttgir"], re.MULTILINE)
            body = [lp[: lp.find("scf.yield")] for lp in loops]
            loads = "+".join(f"{b.count('tt.load ')}/{b.count('async_copy_global')}" for b in body)
            # the copy groups a loop leaves in flight at its wait (0: it waits on every copy)
            waits = "+".join(
                ",".join(re.findall(r"async_wait .*\{num = (\d+)", b)) or "-" for b in body
            )
            print(f"     shared {k.metadata.shared} B; loop loads plain/async {loads or 0}; "
                  f"copies in flight at the loop's wait {waits or 0}; "
                  + ("; ".join(mma) or "no MMA layout"))  # fmt: skip
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
