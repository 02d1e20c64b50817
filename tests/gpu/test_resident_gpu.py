"""Resident quantized weights on a GPU: the W8A8 and grouped W4A8 kernels compiled, in every dot
mode, against the dequantized reference, per layer on tiny40 and medium, and under capture.

Skipped without CUDA. Run with ``python3 -m pytest tests/gpu/test_resident_gpu.py -q -s`` (the
``-s`` shows the measured errors; with ``$OUT`` set they also land in
``$OUT/resident_gpu.json``).

Bounds (stated in ``triton_gemm``): a W8A8 product is within ``K * u * P`` of the exact product
of the dequantized operands, ``u = 2**-24`` for float32 accumulation (the ``fp32``/``bf16`` dot
modes) and ``2**-13`` for the FP8 tensor cores' in-block accumulation. A whole layer in bf16
against the dense bf16 reference: relative Frobenius error <= 1e-2 (linear outputs, the SwiGLU
product and the intermediate's FP8 rounding may each land one step apart), expert choices
identical wherever the router's top-k margin is clear (> 1e-3).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DOTS = ("fp32", "bf16", "fp8")
U_ACC = {"fp32": 2.0**-24, "bf16": 2.0**-24, "fp8": 2.0**-13}
U_MOE_FP8 = 2.0**-11
"""The FP8 tensor cores' dot error relative to ``sum |a_i b_i|`` in the grouped MoE's
forced-decision check. Measured on the H200 at a02bfb2 (``reports/gpu/resident_gpu.json``): up
to ``1.59 * 2**-13`` in the ``w2`` GEMM (K = 256 over FP4 weights, whose many small products
leave a few large ones to set each block's alignment), so ``2**-13`` was not a bound; ``2**-11``
leaves 2.5x. The W8A8 test's ``K * 2**-13`` form is looser still."""
LAYER_REL = 1e-2
MARGIN = 1e-3
MEASURED: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for k, v in MEASURED.items():
        print(f"{k}: {v}")
    if os.environ.get("OUT"):
        from v41plan.validation.provenance import provenance

        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "provenance": provenance(), **MEASURED}  # fmt: skip
        with open(os.path.join(os.environ["OUT"], "resident_gpu.json"), "w") as f:
            json.dump(report, f, indent=1)


def _rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_act_quant_is_bit_exact_on_the_device():
    from v41plan.model.quant import quantize_fp8_blocks
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1024, 2048, generator=g) * torch.logspace(-6, 4, 2048)
        x[0, :32] = 0.0
        x[1, :32] = 448.0
        x = x.to(dtype)
        q, s = act_quant_fp8(x.cuda())
        c, sc = quantize_fp8_blocks(x)
        assert torch.equal(q.cpu().view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(s.cpu().view(torch.uint8), sc.view(torch.uint8))


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("M", [1, 17, 64, 512])
@pytest.mark.parametrize("N", [1056, 4160])
def test_w8a8_within_the_bound(dot, M, N):
    """Against the dequantized product in float64, within ``K * u * sum |x w|``: narrow (16-row
    decode tiles) and wide weights (64-row tiles from 17 rows, whose FP8 instruction keeps
    fewer bits of a 32-lane block's sum), each with a partial last output tile."""
    from v41plan.model.quant import dequant_fp8_weight, fake_fp8, quantize_fp8_weight
    from v41plan.runtime.kernels.triton_gemm import w8a8_linear

    g = torch.Generator().manual_seed(M)
    K = 2048
    x = torch.randn(M, K, generator=g) * 3
    wc, ws = quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.02)
    y = w8a8_linear(x.cuda(), wc.cuda(), ws.cuda(), torch.float32, dot=dot)
    xd, wd = fake_fp8(x.double(), 32), dequant_fp8_weight(wc, ws, torch.float64)
    exact, P = xd @ wd.T, xd.abs() @ wd.abs().T
    ratio = float(((y.cpu().double() - exact).abs() / (K * U_ACC[dot] * P + 1e-300)).max())
    MEASURED[f"w8a8 {dot} M={M} N={N} error/bound"] = ratio
    assert ratio <= 1.0


@pytest.mark.parametrize("rope", [False, True])
def test_w8a8_tma_prefill_tile_is_the_pointer_kernel_bit_for_bit(monkeypatch, rope):
    """The prefill dispatch to ``GemmConfig.tma`` (``PREFILL_TMA_TILE``) at a flash-width
    shape: the pointer kernel's sums at ``block_k = 32``, bit for bit, in the FP8 mode."""
    from v41plan.model.quant import quantize_fp8_weight
    from v41plan.runtime.kernels import triton_gemm as tg
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    g = torch.Generator().manual_seed(7)
    M, N, K, d = 1000, 2560, 1280, 512  # partial row and lane tiles
    xq, xs = act_quant_fp8((torch.randn(M, K, generator=g) * 3).cuda())
    wc, ws = (t.cuda() for t in quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.02))
    kw = {"x_scales": xs, "dot": "fp8"}
    if rope:
        ang = torch.rand(M, 32, generator=g).cuda() * 6.3
        kw["rope"] = (torch.cos(ang), torch.sin(ang), d)
    want = tg.w8a8_linear(
        xq, wc, ws, torch.bfloat16, config=tg.GemmConfig(128, 128, 32, 8, 4), **kw
    )
    for tile in (
        tg.GemmConfig(128, 128, 32, 8, 4, tma=True),
        tg.GemmConfig(128, 64, 32, 4, 4, tma=True),
    ):
        monkeypatch.setattr(tg, "PREFILL_TMA_TILE", tile)
        assert torch.equal(tg.w8a8_linear(xq, wc, ws, torch.bfloat16, **kw), want)


def _fp4_experts(E: int, out: int, inp: int, seed: int):
    """Random FP4 experts drawn in their storage format: uniform codes, per-32 scales within
    two binades of the power of two that gives RMS ``inp**-0.5``."""
    from v41plan.model.quant import QuantWeight, e8m0_encode

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.int32)
    base = round(math.log2(inp**-0.5 / 2.93))
    field = torch.randint(-2, 3, (E, out, inp // 32), generator=g) + base
    scales = e8m0_encode(torch.pow(2.0, field.to(torch.float32)))
    return QuantWeight(codes.to(torch.uint8).view(torch.int8).cuda(), scales.cuda(), "fp4")


@pytest.mark.parametrize("dot,pairs", [(d, False) for d in DOTS] + [("fp32", True), ("bf16", True)])
def test_grouped_w4a8_equals_the_torch_grouped_moe(dot, pairs):
    """The float32 dot modes agree with the torch grouped MoE to summation order. The FP8 tensor
    cores' coarser in-block sums flip a few of the intermediate's E4M3 roundings (about 1e-3
    relative on the output, so no output tolerance separates that from a fault): there the
    forced-decision check of ``tests/runtime/moe_forced.py`` decides. ``MoEConfig.pairs`` in
    the bf16 mode decodes by inline PTX: its bits equal those of the same loop decoding by
    Triton's operations, and with the scales folded into the decode (``FOLDED_SCALES``)."""
    import dataclasses

    from tests.runtime.moe_forced import assert_forced_decisions, forced_decision_report
    from v41plan.model.quant import fake_fp8
    from v41plan.runtime.kernels import triton_moe
    from v41plan.runtime.kernels.moe_torch import grouped_moe_torch
    from v41plan.runtime.kernels.triton_moe import grouped_moe_w4a8_stages, moe_combine
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    E, D, I, k, N = 48, 1024, 256, 6, 200  # medium's expert widths
    w1, w3, w2 = _fp4_experts(E, I, D, 1), _fp4_experts(E, I, D, 2), _fp4_experts(E, D, I, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(N, D, generator=g).cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).cuda()
    wts = torch.rand(N, k, generator=g).cuda()
    xq, xs = act_quant_fp8(x)
    cfg = dataclasses.replace(triton_moe.default_moe_config(N * k, dot, D, I), pairs=pairs)
    args = (xq, xs, ids, wts, w1, w3, w2, 0, 10.0, torch.float32)
    st = grouped_moe_w4a8_stages(*args, dot=dot, config=cfg)
    got = moe_combine(st.y_rows, st.rows.pos, k)
    if pairs and dot == "bf16":
        triton_moe.PAIRS_ASM = False
        try:
            ops = grouped_moe_w4a8_stages(*args, dot=dot, config=cfg)
        finally:
            triton_moe.PAIRS_ASM = True
        live = st.rows.row_ids >= 0
        assert torch.equal(st.act[live], ops.act[live])
        assert torch.equal(st.y_rows[live], ops.y_rows[live])
        # the scales folded into the decode (E2M1_PAIRS_FOLDED_ASM): the same bits
        assert triton_moe.scales_fold(w1, w3, w2)
        was, triton_moe.FOLDED_SCALES = triton_moe.FOLDED_SCALES, True
        try:
            folded = grouped_moe_w4a8_stages(*args, dot=dot, config=cfg, folds=True)
        finally:
            triton_moe.FOLDED_SCALES = was
        assert torch.equal(st.act[live], folded.act[live])
        assert torch.equal(st.y_rows[live], folded.y_rows[live])
    deq = [w.dequantize(torch.float32) for w in (w1, w3, w2)]
    ref = grouped_moe_torch(fake_fp8(x, 32), ids, wts, *deq, 0, 10.0, impl="gather")
    err = _rel_fro(got, ref)
    tag = dot + (" pairs" if pairs else "")
    MEASURED[f"grouped w4a8 {tag} rel"] = err
    acc = U_MOE_FP8 if dot == "fp8" else D * U_ACC[dot]
    report = forced_decision_report(xq, xs, ids, wts, w1, w3, w2, 10.0, st, got, acc)
    MEASURED[f"grouped w4a8 {tag} forced"] = report
    assert_forced_decisions(report)
    if dot != "fp8":
        assert err <= 1e-5


def _layer_state(spec: str, lids: tuple[int, ...]):
    """(cfg, resident CUDA weights, bf16 dequantized CUDA weights) of a few layers."""
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.checkpoint import process_state, random_tensors, tensor_table
    from v41plan.model.config import config_from_cache_spec

    cfg = config_from_cache_spec(load_cache_spec(spec))
    sub = [t for t in tensor_table(cfg) if any(t.name.startswith(f"layers.{i}.") for i in lids)]
    sub = [t for t in sub if t.kind not in ("table", "table_scale")]
    raw = dict(random_tensors(cfg, 0, sub))
    res = process_state(cfg, dict(raw), device="cuda", resident=True, layer_ids=lids)
    deq = process_state(cfg, dict(raw), torch.bfloat16, "cuda", layer_ids=lids)
    return cfg, res, deq


@pytest.mark.parametrize("spec,lids", [("tiny40", (2, 3, 24, 39)), ("medium", (2, 3, 24))])
def test_resident_layers_match_the_dequantized_reference(spec, lids):
    from v41plan.model.layers import Linear, MoE
    from v41plan.runtime.resident import GroupedMoE, ResidentLinear

    cfg, res, deq = _layer_state(spec, lids)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()
    for lid in lids:
        p = f"layers.{lid}."
        for name in ("attn.wq_a", "attn.wkv", "ffn.shared_experts.w1"):
            w = p + name + ".weight"
            got = ResidentLinear(res[w], torch.bfloat16)(x)
            ref = Linear(deq[w])(x)
            err = _rel_fro(got, ref)
            MEASURED[f"{spec} {w} rel"] = err
            assert err <= LAYER_REL, w
        ref, ids = MoE(cfg, deq, p[:-1], torch.bfloat16)(x)
        moe = GroupedMoE(cfg, res, p[:-1], torch.bfloat16)
        assert moe.impl == "triton"
        got, gids = moe(x)
        s = torch.sqrt(torch.nn.functional.softplus(x.float() @ moe.gate_w.T)) + moe.gate_bias
        top = s.sort(-1, descending=True).values
        clear = (top[:, cfg.num_experts_per_tok - 1] - top[:, cfg.num_experts_per_tok]) > MARGIN
        assert torch.equal(gids[clear], ids[clear])
        err = _rel_fro(got, ref)
        MEASURED[f"{spec} layer {lid} moe rel"] = err
        assert err <= LAYER_REL


def test_resident_moe_and_linear_capture_and_replay():
    from v41plan.runtime.resident import GroupedMoE, ResidentLinear

    cfg, res, _ = _layer_state("medium", (3,))
    moe = GroupedMoE(cfg, res, "layers.3", torch.bfloat16)
    lin = ResidentLinear(res["layers.3.attn.wq_a.weight"], torch.bfloat16)
    g = torch.Generator().manual_seed(8)
    static = torch.randn(64, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda()

    def step():
        return moe(static)[0], lin(static)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (9, 10):
        static.copy_(torch.randn(64, cfg.hidden_size, generator=g).to(torch.bfloat16).cuda())
        graph.replay()
        want = step()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), seed


def test_resident_load_on_the_device():
    from v41plan.geometry.runtime import load_cache_spec
    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.model.quant import QuantWeight

    cfg = config_from_cache_spec(load_cache_spec("tiny40"))
    ckpt = LoadedCheckpoint.from_state(cfg, random_state(cfg, 0))
    w = ckpt.process(device="cuda", resident=True)
    assert ckpt.report["ratio"] == 1.0
    assert all(v.device.type == "cuda" for v in w.values())
    assert isinstance(w["layers.5.ffn.experts.w2"], QuantWeight)
    MEASURED["tiny40 resident bytes"] = ckpt.report


def test_bf16_head_is_the_float32_head_up_to_summation_order():
    """The LM head over the published bf16 weight and bf16 rows (``ops.head_logits``: ``mm``
    with a float32 result) against float64: every product is exact in float32, so the error is
    float32 summation's, within ``K * 2**-24 * sum |x_k w_k|`` of each logit, as the float32
    head (``F.linear`` over the widened weight) is."""
    from v41plan.runtime.kernels import ops

    g = torch.Generator(device="cuda").manual_seed(5)
    n, k, v = 33, 4096, 12288
    x = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    got = ops.head_logits(x, w)
    ref = x.double() @ w.double().t()
    bound = k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    err = (got.double() - ref).abs()
    f32 = (torch.nn.functional.linear(x.float(), w.float()).double() - ref).abs()
    MEASURED["head_bf16"] = {"max_err_over_bound": float((err / bound).max())}
    assert got.dtype == torch.float32 and got.shape == (n, v)
    assert bool((err <= bound).all()) and bool((f32 <= bound).all())
    one = (ops.head_logits(x[:1], w)[0].double() - ref[0]).abs()  # a lone row: its own path
    assert bool((one <= bound[0]).all())
