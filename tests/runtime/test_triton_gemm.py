"""The W8A8 linear and the FP8 activation quantizer in Triton, against the torch reference.

Without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here
before the kernel modules are imported) with float32 dot operands; with CUDA the same tests
run compiled on the device in every dot mode.

The bound under test (``triton_gemm``'s docstring): every product of the dequantized operands
is exact in float32, so ``|y - y*| <= K * 2**-24 * P + u_out * |y*|`` with ``y*`` the exact
(float64) product of ``fake_fp8(x, 32)`` and the dequantized weight, ``P = |x̂| @ |ŵ|^T``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import triton

from v41plan.model.quant import (
    dequant_fp8_weight,
    e8m0_decode,
    fake_fp8,
    quantize_fp8_blocks,
    quantize_fp8_weight,
)
from v41plan.runtime.kernels.triton_gemm import (
    GemmConfig,
    _fp8_dequant_kernel,
    dequant_fp8,
    w8a8_linear,
    w8a16_grouped,
)
from v41plan.runtime.kernels.triton_quant import act_quant_fp8

from .interpreted import patched_interpreter  # noqa: F401 (an autouse fixture)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DOTS = ("fp32", "bf16", "fp8") if DEV == "cuda" else ("fp32",)
U_ACC = {"fp32": 2.0**-24, "bf16": 2.0**-24, "fp8": 2.0**-13, "mm": 2.0**-24}
"""Unit roundoff of the accumulation by dot mode (FP8 tensor cores keep fewer bits)."""


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows spanning many binades, with the quantizer's edge cases planted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-5, 3, k)[torch.randperm(k, generator=g)]
    x[0, :32] = 0.0  # an all-zero block: the 1e-4 amax floor
    x[1, :32] = 448.0  # amax exactly 448: scale 1
    x[2, :4] = torch.tensor([-1e-8, -0.0, 3.5e-5, -1e4])  # negatives rounding to -0, a saturator
    return x


def _device_operands(x: torch.Tensor, w: torch.Tensor):
    """(``x``'s E4M3 codes and E8M0 scales, ``w``'s FP8 codes and block scales), on ``DEV``
    (``x`` already there)."""
    wc, ws = quantize_fp8_weight(w)
    return (*act_quant_fp8(x), wc.to(DEV), ws.to(DEV))


def _bound_check(y: torch.Tensor, x: torch.Tensor, wc, ws, dot: str, u_out: float) -> float:
    """Largest ``|y - y*|`` over its bound (must be <= 1)."""
    xd = fake_fp8(x.double(), 32)
    wd = dequant_fp8_weight(wc.cpu(), ws.cpu(), torch.float64)
    exact = xd @ wd.T
    P = xd.abs() @ wd.abs().T
    K = x.shape[1]
    bound = K * U_ACC[dot] * P + u_out * exact.abs() + 1e-300
    return float(((y.double().cpu() - exact).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_is_fake_fp8_bit_for_bit(dtype):
    x = _activations(37, 96, 0).to(dtype)
    q, s = act_quant_fp8(x.to(DEV))
    codes, scales = quantize_fp8_blocks(x)
    assert torch.equal(q.cpu().view(torch.uint8), codes.view(torch.uint8))  # -0 codes too
    assert torch.equal(s.cpu().view(torch.uint8), scales.view(torch.uint8))
    v = q.cpu().float().view(37, 3, 32) * e8m0_decode(s.cpu())[:, :, None]
    assert torch.equal(v.view(37, 96).to(dtype), fake_fp8(x, 32))


@pytest.mark.parametrize("dot", DOTS)
def test_w8a8_equals_the_dequantized_product_within_the_bound(dot):
    # N = 80 leaves a partial 32-row scale block; K = 160 a partial K tile at block_k 128
    M, N, K = 19, 80, 160
    x = _activations(M, K, 1)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:, 64:96] *= 300.0  # one K block with a much larger weight scale
    wc, ws = quantize_fp8_weight(w)
    dev_w = (wc.to(DEV), ws.to(DEV))
    y32 = w8a8_linear(x.to(DEV), *dev_w, torch.float32, dot=dot)
    assert _bound_check(y32, x, wc, ws, dot, 0.0) <= 1.0
    ybf = w8a8_linear(x.to(DEV), *dev_w, torch.bfloat16, dot=dot)
    assert ybf.dtype == torch.bfloat16
    assert _bound_check(ybf, x, wc, ws, dot, 2.0**-8) <= 1.0
    # a different tiling changes only the float32 summation order
    if DEV == "cpu":
        other = GemmConfig(16, 32, 32, num_warps=1, num_stages=1)
        y_tiled = w8a8_linear(x, wc, ws, torch.float32, dot=dot, config=other)
        assert _bound_check(y_tiled, x, wc, ws, dot, 0.0) <= 1.0


def test_prequantized_input_gives_the_fused_result():
    M, N, K = 9, 64, 96
    x = _activations(M, K, 3).to(DEV)
    wc, ws = quantize_fp8_weight(torch.randn(N, K) * 0.1)
    wc, ws = wc.to(DEV), ws.to(DEV)
    xq, xs = act_quant_fp8(x)
    fused = w8a8_linear(x, wc, ws, torch.float32)
    pre = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs)
    assert torch.equal(fused, pre)
    assert w8a8_linear(x[:0], wc, ws, torch.float32).shape == (0, N)


def test_shapes_are_checked():
    wc, ws = quantize_fp8_weight(torch.randn(32, 48))
    with pytest.raises(ValueError, match="w8a8_linear"):
        w8a8_linear(torch.randn(4, 48), wc, ws)
    with pytest.raises(ValueError, match="K % 32 == 0"):
        act_quant_fp8(torch.randn(4, 48))


def _rope_tables(n: int, rd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(n, rd // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return torch.cos(ang).to(DEV), torch.sin(ang).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_epilogue_is_the_linear_then_rope_bit_for_bit(dtype):
    """``rope=`` rotates every head of the output in the epilogue: the GEMM's output rounded to
    ``dtype``, then ``layers.rope_heads`` in float32 rounded again, with no fused multiply-add
    (the composition's roundings, so the bits are equal on the interpreter and the device)."""
    from v41plan.model.layers import rope_heads

    M, heads, d, rd, K = 7, 3, 64, 16, 96
    x = _activations(M, K, 5).to(DEV).to(dtype)
    wc, ws = quantize_fp8_weight(torch.randn(heads * d, K) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    cos, sin = _rope_tables(M, rd, 6)
    got = w8a8_linear(x, wc, ws, dtype, rope=(cos, sin, d))
    plain = w8a8_linear(x, wc, ws, dtype)
    want = rope_heads(plain, cos, sin, d)
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)  # the rotation ran
    # only the last rd lanes of each head move
    lanes = (got != plain).reshape(M, heads, d).any(0).any(0)
    assert not lanes[: d - rd].any() and lanes[d - rd :].any()


@pytest.mark.parametrize("dot", [d for d in DOTS if d != "bf16"])
def test_tma_tiles_give_the_pointer_kernels_sums_bit_for_bit(dot):
    """``GemmConfig.tma`` (operand tiles by TMA descriptors, scales a block ahead, the weight's
    broadcast from one byte per 32 rows): the pointer kernel's result at ``block_k = 32``, bit
    for bit, with partial row, lane and 32-row scale blocks, and with the RoPE epilogue."""
    M, heads, d, rd, K = 70, 3, 64, 16, 160
    N = heads * d - 16  # 176: a partial 32-row scale block and a partial lane tile
    x = _activations(M, K, 21).to(DEV)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(22)) * 0.05
    w[:, 64:96] *= 300.0
    xq, xs, wc, ws = _device_operands(x, w)
    warps = 1 if DEV == "cpu" else 4
    ptr = GemmConfig(64, 64, 32, num_warps=warps, num_stages=1)
    tma = GemmConfig(64, 64, 32, num_warps=warps, num_stages=3, tma=True)
    for out in (torch.float32, torch.bfloat16):
        want = w8a8_linear(xq, wc, ws, out, x_scales=xs, dot=dot, config=ptr)
        got = w8a8_linear(xq, wc, ws, out, x_scales=xs, dot=dot, config=tma)
        assert torch.equal(got, want)
    wr, wrs = quantize_fp8_weight(torch.randn(heads * d, K) * 0.05)
    wr, wrs = wr.to(DEV), wrs.to(DEV)
    cos, sin = _rope_tables(M, rd, 23)
    kw = {"x_scales": xs, "dot": dot, "rope": (cos, sin, d)}
    want = w8a8_linear(xq, wr, wrs, torch.bfloat16, config=ptr, **kw)
    assert torch.equal(w8a8_linear(xq, wr, wrs, torch.bfloat16, config=tma, **kw), want)
    assert _bound_check(got, x.cpu(), wc.cpu(), ws.cpu(), dot, 2.0**-8) <= 1.0


@pytest.mark.parametrize("block_k", [64, 128])
def test_tma_bf16_mode_scales_the_operands_not_the_products(block_k):
    """``GemmConfig.tma`` in the ``"bf16"`` mode: each K step's codes times their block scales
    (exact in bf16), one dot a step. Its sums are those of the pointer kernel's exact operands
    at the same ``block_k`` (``"fp32"`` on the CPU, ``"bf16"`` on the device), bit for bit,
    with partial row, lane, 32-row scale and K-step tiles (K = 160 is not a multiple of
    ``block_k``), and within the bound of the exact product."""
    M, K = 70, 160
    N = 176
    x = _activations(M, K, 25).to(DEV)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(26)) * 0.05
    w[:, 64:96] *= 300.0
    w[96:128] *= 1e-3
    xq, xs, wc, ws = _device_operands(x, w)
    warps = 1 if DEV == "cpu" else 4
    ptr = GemmConfig(64, 64, block_k, num_warps=warps, num_stages=1)
    tma = GemmConfig(64, 64, block_k, num_warps=warps, num_stages=3, tma=True)
    ref_dot = "fp32" if DEV == "cpu" else "bf16"
    for out in (torch.float32, torch.bfloat16):
        want = w8a8_linear(xq, wc, ws, out, x_scales=xs, dot=ref_dot, config=ptr)
        got = w8a8_linear(xq, wc, ws, out, x_scales=xs, dot="bf16", config=tma)
        assert torch.equal(got, want), out
    assert _bound_check(got, x.cpu(), wc.cpu(), ws.cpu(), "bf16", 2.0**-8) <= 1.0


@pytest.mark.parametrize("one_launch", [True, False])
def test_tma_tiles_split_k_as_the_pointer_kernel(monkeypatch, one_launch):
    """``GemmConfig.tma`` with ``split_k``: each split's partial over its own lanes, the splits
    summed in split order in the launch's last split (``SPLIT_ONE_LAUNCH``) or by the sum
    kernel: the pointer kernel's result at the same splits, bit for bit, in the ``"fp8"``
    (``"fp32"`` on the CPU) mode; in the ``"bf16"`` mode at 64-lane steps whose splits end
    inside a step (the next split's lanes take the scale 0) against the pointer kernel's exact
    operands at the same step and splits."""
    from v41plan.runtime.kernels import triton_gemm

    monkeypatch.setattr(triton_gemm, "SPLIT_ONE_LAUNCH", one_launch)
    M, K, N = 5, 480, 96  # 15 scale blocks: 3 splits of 5 blocks (160 lanes), 2 of 8 and 7
    x = _activations(M, K, 27).to(DEV)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(28)) * 0.05
    w[:, 200:232] *= 300.0
    xq, xs, wc, ws = _device_operands(x, w)
    warps = 1 if DEV == "cpu" else 4
    fp8 = "fp32" if DEV == "cpu" else "fp8"
    for split in (3, 2):
        ptr = GemmConfig(16, 32, 32, num_warps=warps, num_stages=1, split_k=split)
        tma = GemmConfig(16, 32, 32, num_warps=warps, num_stages=3, split_k=split, tma=True)
        want = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs, dot=fp8, config=ptr)
        got = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs, dot=fp8, config=tma)
        assert torch.equal(got, want), split
        assert _bound_check(got, x.cpu(), wc.cpu(), ws.cpu(), fp8, 2.0**-24) <= 1.0
    ref_dot = "fp32" if DEV == "cpu" else "bf16"
    ptr = GemmConfig(16, 32, 64, num_warps=warps, num_stages=1, split_k=3)
    tma = GemmConfig(16, 32, 64, num_warps=warps, num_stages=3, split_k=3, tma=True)
    want = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs, dot=ref_dot, config=ptr)
    got = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs, dot="bf16", config=tma)
    assert torch.equal(got, want)
    assert _bound_check(got, x.cpu(), wc.cpu(), ws.cpu(), "bf16", 2.0**-24) <= 1.0


def test_decode_tma_keeps_the_pointer_kernels_bits(monkeypatch):
    """``DECODE_TMA``: pre-quantized decode rows (1 to 64) take ``default_config``'s tiles and
    splits by TMA descriptors, with the pointer kernel's result bit for bit; float input (its
    own quantizer launch first) too; more than 64 rows stay as they were. On the CPU the
    interpreter's tiles are replaced by decode-like ones at 32-lane steps (its ``"fp32"``
    mode sums per step) with K splits."""
    from v41plan.runtime.kernels import triton_gemm

    if DEV == "cpu":
        monkeypatch.setattr(
            triton_gemm,
            "default_config",
            lambda M, N, K, dot: GemmConfig(16 if M <= 16 else 64, 32, 32, 1, 1, split_k=3),
        )

    launched = []
    real = triton_gemm._w8a8_tma_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    K, N = 1280, 96
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(29)) * 0.05
    wc, ws = quantize_fp8_weight(w)
    wc, ws = wc.to(DEV), ws.to(DEV)
    for M in (1, 5, 64):
        x = _activations(max(M, 3), K, 30 + M)[-M:].contiguous().to(DEV)
        xq, xs = act_quant_fp8(x)
        monkeypatch.setattr(triton_gemm, "DECODE_TMA", False)
        want = w8a8_linear(xq, wc, ws, torch.bfloat16, x_scales=xs)
        monkeypatch.setattr(triton_gemm, "DECODE_TMA", True)
        monkeypatch.setattr(triton_gemm, "_w8a8_tma_kernel", Spy())
        launched.clear()
        assert torch.equal(w8a8_linear(xq, wc, ws, torch.bfloat16, x_scales=xs), want), M
        assert torch.equal(w8a8_linear(x, wc, ws, torch.bfloat16), want), M
        assert len(launched) == 2, M
        monkeypatch.setattr(triton_gemm, "_w8a8_tma_kernel", real)
    launched.clear()
    monkeypatch.setattr(triton_gemm, "_w8a8_tma_kernel", Spy())
    monkeypatch.setattr(triton_gemm, "PREFILL_TMA_TILE", None)
    xq, xs = act_quant_fp8(_activations(65, K, 99).to(DEV))
    w8a8_linear(xq, wc, ws, torch.bfloat16, x_scales=xs)  # prefill rows: the pointer kernel
    assert launched == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_values_are_fake_fp8_bit_for_bit(dtype):
    """``act_values_fp8``: the quantizer's values from float rows and from their codes, in
    bf16 and float32 (exact either way), equal ``fake_fp8``'s, the edge cases included."""
    from v41plan.runtime.kernels.triton_quant import act_values_fp8

    x = _activations(37, 96, 0).to(dtype).to(DEV)
    want = fake_fp8(x.cpu().float(), 32)
    q, s = act_quant_fp8(x)
    for out in (torch.float32, torch.bfloat16):
        for got in (act_values_fp8(x, dtype=out), act_values_fp8(q, s, out)):
            assert got.dtype == out
            assert torch.equal(got.cpu().float(), want)
    assert act_values_fp8(x[:0]).shape == (0, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mm_mode_is_the_linear_within_the_bound(dtype):
    """The ``"mm"`` mode (the operands' exact values through ``torch.mm``): within the bound of
    float32 sums, from float rows, from codes and from grouped rows alike; ``rope=`` the
    output then ``layers.rope_heads`` in float32, rounded again, bit for bit."""
    from v41plan.model.layers import rope_heads

    M, heads, d, rd, K = 19, 3, 64, 16, 160
    x = _activations(M, K, 1)
    w = torch.randn(heads * d, K, generator=torch.Generator().manual_seed(2)) * 0.05
    w[:, 64:96] *= 300.0
    wc, ws = quantize_fp8_weight(w)
    dev_w = (wc.to(DEV), ws.to(DEV))
    xd = x.to(DEV).to(dtype)
    y = w8a8_linear(xd, *dev_w, dtype, dot="mm")
    assert y.dtype == dtype
    u_out = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert _bound_check(y, x.to(dtype).float(), wc, ws, "mm", u_out) <= 1.0
    xq, xs = act_quant_fp8(xd)
    assert torch.equal(w8a8_linear(xq, *dev_w, dtype, x_scales=xs, dot="mm"), y)
    z = xd.reshape(M, 5, 32).transpose(0, 1).contiguous().transpose(0, 1)  # [M, G, K/G] strided
    assert torch.equal(w8a8_linear(z, *dev_w, dtype, dot="mm"), y)
    cos, sin = _rope_tables(M, rd, 6)
    got = w8a8_linear(xd, *dev_w, dtype, rope=(cos, sin, d), dot="mm")
    assert torch.equal(got, rope_heads(y, cos, sin, d))
    lanes = (got != y).reshape(M, heads, d).any(0).any(0)
    assert not lanes[: d - rd].any() and lanes[d - rd :].all()
    empty = w8a8_linear(xd[:0], *dev_w, dtype, rope=(cos[:0], sin[:0], d), dot="mm")
    assert empty.shape == (0, heads * d)


def test_mm_mode_sums_in_float32(monkeypatch):
    """The ``"mm"`` mode's product runs with cuBLAS's bf16 split-K reduction off (float32
    sums, the stated bound), and the flag is restored after it."""
    from v41plan.runtime.kernels import triton_gemm as tg

    flags = torch.backends.cuda.matmul
    monkeypatch.setattr(flags, "allow_bf16_reduced_precision_reduction", True)
    seen, mm = [], torch.mm

    def spy(a, b):
        seen.append(flags.allow_bf16_reduced_precision_reduction)
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    wc, ws = quantize_fp8_weight(torch.randn(64, 96) * 0.1)
    x = _activations(5, 96, 3).to(DEV)
    w8a8_linear(x, wc.to(DEV), ws.to(DEV), torch.bfloat16, dot="mm")
    tg.w8a8_swiglu(*act_quant_fp8(x), (wc.to(DEV), ws.to(DEV)), (wc.to(DEV), ws.to(DEV)), 1.0,
                   torch.bfloat16, dot="mm")  # fmt: skip
    assert seen == [False, False]
    assert flags.allow_bf16_reduced_precision_reduction


def test_prefill_rows_take_the_mm_mode_on_cuda(monkeypatch):
    """``decode_dot``: ``MM_ROWS`` rows and more on CUDA run the ``"mm"`` mode (``mm_rows``,
    which ``w8a8_swiglu`` asks too); the CPU and ``MM_ROWS = None`` keep the kernel's modes."""
    from v41plan.runtime.kernels import triton_gemm as tg

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(tg, "MM_ROWS", 1024)
    assert [tg.decode_dot(m, cuda) for m in (1, 1023, 1024, 8192)] == ["fp8", "fp8", "mm", "mm"]
    assert [tg.mm_rows(m, cuda) for m in (1023, 1024)] == [False, True]
    assert not tg.mm_rows(8192, cpu)
    assert tg.decode_dot(8192, cpu) == tg.default_dot(cpu)
    monkeypatch.setattr(tg, "MM_ROWS", None)
    assert tg.decode_dot(8192, cuda) == "fp8"


def test_decode_bf16_rows_picks_the_mode_and_the_tiles(monkeypatch):
    """``DECODE_BF16_ROWS``: 17 to 64 rows on CUDA take the bf16 mode (``decode_dot``), in
    64-row tiles at every width (the fp8 mode keeps 16-row tiles for narrow weights); one to 16
    rows, prefill rows and the CPU keep ``default_dot``'s mode. The tiles and splits do not
    depend on the rows within 17-64, so a row's sums do not either."""
    from v41plan.runtime.kernels import triton_gemm as tg

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(tg, "DECODE_BF16_ROWS", False)
    assert tg.decode_dot(32, cuda) == "fp8"
    monkeypatch.setattr(tg, "DECODE_BF16_ROWS", True)
    assert [tg.decode_dot(m, cuda) for m in (1, 16, 17, 64, 65)] == [
        "fp8", "fp8", "bf16", "bf16", "fp8",
    ]  # fmt: skip
    assert tg.decode_dot(32, cpu) == tg.default_dot(cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the device's tiles
    monkeypatch.setattr(tg, "_programs_wanted", lambda: 264)  # two programs an SM of an H100
    for N in (1792, 32768):
        cfgs = {tg.default_config(m, N, 5120, "bf16") for m in (17, 33, 64)}
        assert len(cfgs) == 1 and next(iter(cfgs)).block_m == 64, N
    assert tg.default_config(64, 1792, 5120, "fp8").block_m == 16
    assert tg.default_config(16, 1792, 5120, "bf16").block_m == 16


def test_tma_tiles_refuse_what_they_do_not_read(monkeypatch):
    from v41plan.runtime.kernels import triton_gemm

    x = _activations(8, 64, 24).to(DEV)
    wc, ws = quantize_fp8_weight(torch.randn(64, 64) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    xq, xs = act_quant_fp8(x)
    tma = GemmConfig(64, 64, 32, num_warps=1, num_stages=1, tma=True)
    # float input is quantized by its own launch first (PREQUANT_ROWS), then read by TMA
    want = w8a8_linear(xq, wc, ws, torch.float32, x_scales=xs, config=tma)
    assert torch.equal(w8a8_linear(x, wc, ws, torch.float32, config=tma), want)
    monkeypatch.setattr(triton_gemm, "PREQUANT_ROWS", 1 << 30)
    with pytest.raises(ValueError, match="pre-quantized"):
        w8a8_linear(x, wc, ws, config=tma)  # quantized in the prologue
    with pytest.raises(ValueError, match="block_k"):
        w8a8_linear(xq, wc, ws, x_scales=xs, config=GemmConfig(64, 64, 64, tma=True))
    with pytest.raises(ValueError, match="block_n"):
        w8a8_linear(xq, wc, ws, x_scales=xs, config=GemmConfig(64, 48, 32, tma=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_input_is_read_in_place(dtype):
    """``x [M, G, K/G]`` with any row and group strides (the transposed ``[G, M, K/G]`` product
    of the grouped ``wo_a``) gives the flattened input's result, bit for bit, with no copy."""
    G, M, KG, N = 3, 6, 64, 80
    z = _activations(G * M, KG, 7).reshape(G, M, KG).to(DEV).to(dtype)
    wc, ws = quantize_fp8_weight(torch.randn(N, G * KG) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    zt = z.transpose(0, 1)
    assert not zt.is_contiguous()
    got = w8a8_linear(zt, wc, ws, dtype)
    assert torch.equal(got, w8a8_linear(zt.reshape(M, -1), wc, ws, dtype))
    with pytest.raises(ValueError, match="K/G"):
        w8a8_linear(torch.randn(M, 2, 48).to(DEV), *quantize_fp8_weight(torch.randn(N, 96)))


@pytest.mark.parametrize("dot", [None, "mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_swiglu_is_the_shared_expert_composition(dtype, dot):
    """Gate/up GEMMs, clamped SwiGLU and the FP8 quantization of its result in one kernel (or,
    in the ``"mm"`` mode, one ``torch.mm`` over both weights' values and one kernel after): the
    codes and scales of ``act_quant_fp8(swiglu(h1, h3).to(dtype))``. The interpreter's sigmoid
    is numpy's, equal to torch's here; on the device Triton's ``sigmoid`` may differ from
    torch's ``silu`` by a float32 rounding, so a code may move by one E4M3 step (at most 1% of
    them)."""
    from v41plan.runtime.kernels.moe_torch import swiglu
    from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

    M, N, K, limit = 9, 96, 128, 1.5
    x = (_activations(M, K, 8) * 1e-2).to(DEV).to(dtype)
    g = torch.Generator().manual_seed(9)
    w1, w3 = (quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.2) for _ in range(2))
    w1, w3 = tuple(t.to(DEV) for t in w1), tuple(t.to(DEV) for t in w3)
    xq, xs = act_quant_fp8(x)
    hq, hs = w8a8_swiglu(xq, xs, w1, w3, limit, dtype, dot=dot)
    h1 = w8a8_linear(xq, *w1, dtype, x_scales=xs, dot=dot)
    h3 = w8a8_linear(xq, *w3, dtype, x_scales=xs, dot=dot)
    h = swiglu(h1, h3, limit, torch.float32).to(dtype)
    assert float(h.abs().max()) > limit / 4  # the clamp and the curve's both sides are reached
    rq, rs = act_quant_fp8(h)
    got = hq.float() * e8m0_decode(hs).repeat_interleave(32, 1)
    want = rq.float() * e8m0_decode(rs).repeat_interleave(32, 1)
    if DEV == "cpu":
        assert torch.equal(hq.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(hs.view(torch.uint8), rs.view(torch.uint8))
    else:
        # one E4M3 step: 2**-3 of the value's binade, 2**-9 of the block scale when subnormal
        scale = e8m0_decode(rs).repeat_interleave(32, 1)
        step = 2.0**-3 * torch.maximum(got.abs(), want.abs()) + scale * 2.0**-9
        assert bool(((got - want).abs() <= step).all())
        assert float((hq.view(torch.uint8) != rq.view(torch.uint8)).float().mean()) <= 0.01
    with pytest.raises(ValueError, match="w8a8_swiglu"):
        w8a8_swiglu(xq[:, :96], xs[:, :3], w1, w3, limit, dtype)


def test_split_k_heuristic_and_rounding():
    """Decode launches with few output tiles split K (two programs an SM, 264 off the device),
    each split over whole 32-lane scale blocks and at least 512 lanes; neither the count nor the
    boundaries depend on the rows or the K step, so a row's splits are the same at every decode
    batch size."""
    from v41plan.runtime.kernels.triton_gemm import _splits, default_config, split_k_for

    assert split_k_for(5120, 8192, GemmConfig(16, 64, 128)) == 4  # wo_b: 80 tiles
    assert split_k_for(32768, 1024, GemmConfig(16, 64, 128)) == 1  # wq_b: 512 tiles
    assert split_k_for(512, 5120, GemmConfig(16, 32, 64)) == 10  # wkv: 512-lane splits
    assert split_k_for(5120, 1024, GemmConfig(64, 64, 32)) == 2
    shapes = ((1280, 5120), (512, 5120), (5120, 8192), (5120, 2304), (32768, 1024), (8192, 4096))
    for N, K in shapes:
        cfgs = [default_config(M, N, K, "fp8") for M in (1, 7, 16, 17, 64)]
        splits = {_splits(K, c) for c in cfgs}  # the count and the lanes a split covers
        assert len(splits) == 1, (N, K, splits)
    # split boundaries are whole scale blocks whatever the K step: 72 blocks in 4 splits of 18
    assert _splits(2304, GemmConfig(16, 64, 128, split_k=4)) == (4, 576)
    assert _splits(2304, GemmConfig(64, 64, 32, split_k=4)) == (4, 576)
    assert default_config(65, 5120, 8192, "fp8").split_k == 1  # prefill tiles: no split
    assert _splits(352, GemmConfig(16, 32, 32, split_k=3)) == (3, 128)  # 11 steps: 4 + 4 + 3
    assert _splits(352, GemmConfig(16, 32, 32, split_k=40)) == (11, 32)  # never an empty split
    assert _splits(352, GemmConfig(16, 32, 32)) == (1, 352)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_is_the_linear_within_the_bound(dtype):
    """A split-K launch (float32 partials summed in split order by a second launch) keeps the
    bound, the same bits on every run, and the epilogue: RoPE and the grouped input."""
    from v41plan.model.layers import rope_heads

    M, heads, d, rd, K = 5, 3, 32, 16, 352  # 11 K steps of 32 in 3 splits: 4 + 4 + 3
    split = GemmConfig(16, 32, 32, num_warps=1, num_stages=1, split_k=3)
    x = _activations(M, K, 11).to(DEV)
    w = torch.randn(heads * d, K, generator=torch.Generator().manual_seed(12)) * 0.05
    wc, ws = quantize_fp8_weight(w)
    dwc, dws = wc.to(DEV), ws.to(DEV)
    y = w8a8_linear(x.to(dtype), dwc, dws, torch.float32, config=split)
    xr = x.to(dtype).float().cpu()  # the input as the kernel reads it
    mode = DOTS[-1]  # the default dot mode: fp8 on the device, fp32 on the interpreter
    assert _bound_check(y, xr, wc, ws, mode, 0.0) <= 1.0
    assert torch.equal(y, w8a8_linear(x.to(dtype), dwc, dws, torch.float32, config=split))
    plain = w8a8_linear(x.to(dtype), dwc, dws, dtype, config=split)
    u_out = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert _bound_check(plain, xr, wc, ws, mode, u_out) <= 1.0
    cos, sin = _rope_tables(M, rd, 13)
    got = w8a8_linear(x.to(dtype), dwc, dws, dtype, rope=(cos, sin, d), config=split)
    assert torch.equal(got, rope_heads(plain, cos, sin, d))
    xq, xs = act_quant_fp8(x.to(dtype))
    assert torch.equal(w8a8_linear(xq, dwc, dws, dtype, x_scales=xs, config=split), plain)
    zt = x.to(dtype).reshape(M, 11, 32)  # grouped input, 11 groups of 32 lanes
    assert torch.equal(w8a8_linear(zt, dwc, dws, dtype, config=split), plain)


def test_a_split_ending_inside_a_k_step_masks_the_rest():
    """Split boundaries fall on scale blocks, not K steps: 9 blocks in 2 splits of 5 and 4, so
    a 64-lane step straddles the boundary and reads only its own half. The linear keeps the
    bound (plain and the shared expert's SwiGLU launch), and in the ``"fp8"`` mode (32-lane
    blocks in order at any K step) it has the bits of 32-lane steps."""
    from v41plan.runtime.kernels.triton_gemm import _splits, w8a8_swiglu

    M, N, K = 5, 64, 288
    warps = 1 if DEV == "cpu" else 4
    wide, narrow = (GemmConfig(16, 32, bk, warps, 1, split_k=2) for bk in (64, 32))
    assert _splits(K, wide) == _splits(K, narrow) == (2, 160)
    x = _activations(M, K, 18).to(DEV)
    wc, ws = quantize_fp8_weight(torch.randn(N, K, generator=torch.Generator().manual_seed(19)))
    dwc, dws = wc.to(DEV), ws.to(DEV)
    y = w8a8_linear(x, dwc, dws, torch.float32, config=wide)
    mode = DOTS[-1]
    assert _bound_check(y, x.float().cpu(), wc, ws, mode, 0.0) <= 1.0
    xq, xs = act_quant_fp8(x.to(torch.bfloat16))
    w13 = (dwc, dws)
    hq, _ = w8a8_swiglu(xq, xs, w13, w13, 4.0, torch.bfloat16, config=wide)
    rq, _ = w8a8_swiglu(xq, xs, w13, w13, 4.0, torch.bfloat16, config=narrow)
    if mode == "fp8":
        assert torch.equal(y, w8a8_linear(x, dwc, dws, torch.float32, config=narrow))
        assert torch.equal(hq.view(torch.uint8), rq.view(torch.uint8))
    else:  # float32 dots of 64 lanes against 32: a near-tie's code may move one step
        assert float((hq.view(torch.uint8) != rq.view(torch.uint8)).float().mean()) <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_ends_in_its_own_launch_with_the_second_launchs_bits(dtype, monkeypatch):
    """``SPLIT_ONE_LAUNCH``: a tile's last split to arrive sums the partials in split order
    and writes the epilogue (plain, RoPE, several row tiles), the bits of the second launch
    (``_split_sum_kernel``), and leaves every arrival counter at zero for the next launch."""
    from v41plan.runtime.kernels import triton_gemm

    M, heads, d, rd, K = 21, 3, 32, 16, 352  # two row tiles of 16; 3 splits: 4 + 4 + 3 steps
    split = GemmConfig(16, 32, 32, num_warps=1 if DEV == "cpu" else 4, num_stages=1, split_k=3)
    x = _activations(M, K, 14).to(DEV).to(dtype)
    wc, ws = quantize_fp8_weight(torch.randn(heads * d, K) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    cos, sin = _rope_tables(M, rd, 15)
    outs = {}
    for one in (False, True):
        monkeypatch.setattr(triton_gemm, "SPLIT_ONE_LAUNCH", one)
        outs[one] = [
            w8a8_linear(x, wc, ws, dtype, config=split),
            w8a8_linear(x, wc, ws, torch.float32, rope=(cos, sin, d), config=split),
        ]
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)
    counters = triton_gemm._SPLIT_COUNTERS[x.device][-1]
    assert counters.numel() >= triton_gemm.SPLIT_COUNTERS_MIN and int(counters.abs().sum()) == 0


def test_split_k_swiglu_ends_in_its_own_launch_with_the_second_launchs_bits(monkeypatch):
    """The shared expert's split-K launch under ``SPLIT_ONE_LAUNCH``: the tile's last split sums
    both products' partials in split order and writes the codes and scales of the second launch
    (``_swiglu_split_sum_kernel``), over two row tiles, leaving the counters zero."""
    from v41plan.runtime.kernels import triton_gemm
    from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

    M, N, K, limit, dtype = 21, 64, 352, 1.5, torch.bfloat16
    split = GemmConfig(16, 32, 32, num_warps=1 if DEV == "cpu" else 4, num_stages=1, split_k=3)
    x = (_activations(M, K, 20) * 1e-2).to(DEV).to(dtype)
    g = torch.Generator().manual_seed(21)
    w1, w3 = (quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.2) for _ in range(2))
    w1, w3 = tuple(t.to(DEV) for t in w1), tuple(t.to(DEV) for t in w3)
    xq, xs = act_quant_fp8(x)
    outs = {}
    for one in (False, True):
        monkeypatch.setattr(triton_gemm, "SPLIT_ONE_LAUNCH", one)
        hq, hs = w8a8_swiglu(xq, xs, w1, w3, limit, dtype, config=split)
        outs[one] = (hq.view(torch.uint8), hs.view(torch.uint8))
    assert torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1])
    assert int(outs[True][0].ne(0).sum()) > 0
    counters = triton_gemm._SPLIT_COUNTERS[x.device][-1]
    assert int(counters.abs().sum()) == 0


def test_split_k_swiglu_is_the_composition_of_split_linears():
    """The shared expert's split-K launch: each product's partials summed in split order, then
    the SwiGLU and its quantization: the codes of the same composition over split-K linears."""
    from v41plan.runtime.kernels.moe_torch import swiglu
    from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

    M, N, K, limit, dtype = 5, 64, 352, 1.5, torch.bfloat16
    split = GemmConfig(16, 32, 32, num_warps=1, num_stages=1, split_k=3)
    x = (_activations(M, K, 14) * 1e-2).to(DEV).to(dtype)
    g = torch.Generator().manual_seed(15)
    w1, w3 = (quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.2) for _ in range(2))
    w1, w3 = tuple(t.to(DEV) for t in w1), tuple(t.to(DEV) for t in w3)
    xq, xs = act_quant_fp8(x)
    hq, hs = w8a8_swiglu(xq, xs, w1, w3, limit, dtype, config=split)
    h1 = w8a8_linear(xq, *w1, dtype, x_scales=xs, config=split)
    h3 = w8a8_linear(xq, *w3, dtype, x_scales=xs, config=split)
    rq, rs = act_quant_fp8(swiglu(h1, h3, limit, torch.float32).to(dtype))
    if DEV == "cpu":
        assert torch.equal(hq.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(hs.view(torch.uint8), rs.view(torch.uint8))
    else:  # Triton's sigmoid against torch's silu: a code may move by one step (see above)
        assert float((hq.view(torch.uint8) != rq.view(torch.uint8)).float().mean()) <= 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_quantize_once_with_the_same_bits(dtype, monkeypatch):
    """From ``PREQUANT_ROWS`` rows the input is quantized by its own launch: the result is the
    prologue's bit for bit (plain, RoPE, and the grouped input)."""
    from v41plan.runtime.kernels import triton_gemm

    M, heads, d, rd, G = 6, 2, 64, 16, 3
    K = G * 32
    x = _activations(M, K, 16).to(DEV).to(dtype)
    wc, ws = quantize_fp8_weight(torch.randn(heads * d, K) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    cos, sin = _rope_tables(M, rd, 17)
    zt = x.reshape(M, G, 32).transpose(0, 1).contiguous().transpose(0, 1)  # strided groups
    calls = [
        lambda: w8a8_linear(x, wc, ws),
        lambda: w8a8_linear(x, wc, ws, torch.float32, rope=(cos, sin, d)),
        lambda: w8a8_linear(zt, wc, ws),
    ]
    monkeypatch.setattr(triton_gemm, "PREQUANT_ROWS", 1 << 30)
    prologue = [f() for f in calls]
    quantized = []
    monkeypatch.setattr(
        triton_gemm, "act_quant_fp8", lambda t: quantized.append(t) or act_quant_fp8(t)
    )
    monkeypatch.setattr(triton_gemm, "PREQUANT_ROWS", M)
    for f, want in zip(calls, prologue):
        got = f()
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert len(quantized) == len(calls)  # every call took the separate quantizer


def test_bf16_mode_weight_tiles_are_the_dequantized_weight():
    """The bf16 dot mode's weight operand (a tile's block scales loaded once, codes through the
    E4M3 conversion): the dequantized weight exactly, partial row blocks and K tiles included
    (on the device the whole bf16 GEMM is checked against its bound)."""
    N, K, BN, BK = 80, 160, 64, 128
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(18)) * 0.05
    w[:, 64:96] *= 300.0  # one K block with a much larger scale
    wc, ws = quantize_fp8_weight(w)
    c8, s8 = wc.view(torch.uint8).to(DEV), ws.view(torch.uint8).to(DEV)
    out = torch.full((N, K), float("nan"), device=DEV)
    grid = (triton.cdiv(N, BN), triton.cdiv(K, BK))
    _fp8_dequant_kernel[grid](c8, s8, out, N, c8.stride(0), s8.stride(0), K=K, BN=BN, BK=BK)
    assert torch.equal(out.cpu(), dequant_fp8_weight(wc, ws, torch.float32))
    for dtype in (torch.bfloat16, torch.float32):  # the wrapper's own tiles
        got = dequant_fp8(wc.to(DEV), ws.to(DEV), dtype)
        assert torch.equal(got.cpu(), dequant_fp8_weight(wc, ws, dtype))


def _grouped_bound(y, x, wc, ws, u_out: float) -> float:
    """Largest ``|y - y*|`` of ``w8a16_grouped`` over its bound (must be <= 1): ``y*`` the
    float64 grouped product of ``x [G, M, K]`` and the dequantized weight."""
    G, M, K = x.shape
    wd = dequant_fp8_weight(wc.cpu(), ws.cpu(), torch.float64).view(G, -1, K)
    xd = x.double().cpu()
    exact = torch.bmm(xd, wd.transpose(1, 2)).transpose(0, 1).reshape(M, -1)
    P = torch.bmm(xd.abs(), wd.abs().transpose(1, 2)).transpose(0, 1).reshape(M, -1)
    bound = K * 2.0**-24 * P + u_out * exact.abs() + 1e-300
    return float(((y.double().cpu() - exact).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_grouped_is_the_grouped_product_within_the_bound(dtype):
    """The output projection's ``wo_a`` on its FP8 weight: each group's lanes read only its own
    input (strided groups read in place), unquantized activations, the bound of exact products
    summed in float32; a K split gives the same bits in one launch or two; a group narrower
    than the default tile narrows the tile; prefill rows on CUDA are the bf16 ``bmm``'s bits;
    shapes are checked."""
    from v41plan.runtime.kernels import triton_gemm

    G, M, R, K = 3, 5, 64, 192
    g = torch.Generator().manual_seed(21)
    wc, ws = quantize_fp8_weight(torch.randn(G * R, K, generator=g) * 0.05)
    wc, ws = wc.to(DEV), ws.to(DEV)
    x = (torch.randn(M, G, K, generator=g) * 3).to(DEV).to(dtype).transpose(0, 1)  # strided
    u_out = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    y = w8a16_grouped(x, wc, ws)
    assert y.shape == (M, G * R) and y.dtype == dtype
    assert _grouped_bound(y, x, wc, ws, u_out) <= 1.0
    assert _grouped_bound(w8a16_grouped(x, wc, ws, torch.float32), x, wc, ws, 0.0) <= 1.0
    assert torch.equal(w8a16_grouped(x.contiguous(), wc, ws), y)
    split = GemmConfig(16, 32, 32, num_warps=1 if DEV == "cpu" else 4, num_stages=1, split_k=2)
    outs = []
    for one in (False, True):
        triton_gemm.SPLIT_ONE_LAUNCH, shipped = one, triton_gemm.SPLIT_ONE_LAUNCH
        try:
            outs.append(w8a16_grouped(x, wc, ws, torch.float32, config=split))
        finally:
            triton_gemm.SPLIT_ONE_LAUNCH = shipped
    assert torch.equal(outs[0], outs[1]) and _grouped_bound(outs[0], x, wc, ws, 0.0) <= 1.0
    wide = GemmConfig(16, 128, 64, num_warps=1 if DEV == "cpu" else 4, num_stages=1)
    assert _grouped_bound(w8a16_grouped(x, wc, ws, config=wide), x, wc, ws, u_out) <= 1.0
    assert w8a16_grouped(x[:, :0], wc, ws).shape == (0, G * R)
    if DEV == "cuda" and dtype == torch.bfloat16:  # prefill rows: cuBLAS on the bf16 values
        triton_gemm.A16_BMM_ROWS, shipped = 1, triton_gemm.A16_BMM_ROWS
        try:
            got = w8a16_grouped(x, wc, ws)
        finally:
            triton_gemm.A16_BMM_ROWS = shipped
        wd = dequant_fp8_weight(wc, ws, torch.bfloat16).view(G, R, K)
        assert torch.equal(got, torch.bmm(x, wd.transpose(1, 2)).transpose(0, 1).reshape(M, -1))
    with pytest.raises(ValueError, match="w8a16_grouped"):
        w8a16_grouped(x[:, :, :160], wc, ws)
    with pytest.raises(ValueError, match="w8a16_grouped"):
        w8a16_grouped(x, wc, ws, dot="fp8")
