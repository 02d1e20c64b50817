"""Quantizers: grids, scales, ties to even, all-zero blocks, idempotence, packing."""

from __future__ import annotations

import math

import pytest
import torch

from v41plan.model import quant as q


def _is_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.float().clamp(-448, 448).to(torch.float8_e4m3fn).float() == v.float()


def _is_pow2(s: torch.Tensor) -> bool:
    m, _ = torch.frexp(s.double())
    return bool((m == 0.5).all())


def test_round_e4m3_matches_torch_rne_cast():
    x = torch.cat(
        [
            torch.randn(20000) * 30,
            torch.randn(2000) * 1e-3,
            torch.tensor([0.0, -0.0, 448.0, -448.0]),
        ]
    )
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(q.round_e4m3(x), want)
    assert torch.equal(q.round_e4m3(x.double()).float(), want)


def test_e4m3_and_e2m1_ties_go_to_even():
    # E4M3 near 1: step 1/8. 1 + 1/16 sits between 1 (even) and 1.125 (odd mantissa).
    assert q.round_e4m3(torch.tensor([1.0625, 1.1875, -1.0625])).tolist() == [1.0, 1.25, -1.0]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    # even codes are 0 (0), 2 (1.0), 4 (2.0), 6 (4.0)
    assert q.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0]
    assert torch.signbit(q.round_e2m1(torch.tensor([-0.1])))[0]


def test_pow2ceil_uses_the_bit_pattern():
    a = torch.tensor([1.0, 2.0, 0.25, 2.0**-126, 3.0, 1.0000001, 0.7])
    assert q.pow2ceil(a).tolist() == [1.0, 2.0, 0.25, 2.0**-126, 4.0, 2.0, 1.0]
    r = torch.rand(1000) * 100 + 1e-3
    want = torch.tensor([2.0 ** math.ceil(math.log2(v)) for v in r.tolist()])
    assert torch.equal(q.pow2ceil(r), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fake_fp8_on_grid_idempotent_and_bf16_exact(dtype):
    x = (torch.randn(16, 128) * torch.logspace(-3, 2, 128)).to(dtype)
    y = q.fake_fp8(x, 32)
    assert y.dtype == dtype
    xb = x.float().reshape(16, 4, 32)
    s = q.pow2ceil(xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)
    assert _is_pow2(s)
    codes = y.float().reshape(16, 4, 32) / s
    assert _is_e4m3(codes).all()
    assert torch.equal(q.fake_fp8(y, 32), y)
    assert torch.equal(y.to(torch.bfloat16).to(dtype), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fake_fp4_grids(dtype):
    x = (torch.randn(8, 64) * 3).to(dtype)
    y = q.fake_fp4(x, 32)
    s = q.pow2ceil(
        x.float().reshape(8, 2, 32).abs().amax(-1, keepdim=True).clamp_min(q.FP4_E8M0_AMAX_FLOOR)
        / 6
    )
    codes = y.float().reshape(8, 2, 32) / s
    assert torch.equal(q.round_e2m1(codes), codes)
    assert torch.equal(q.fake_fp4(y, 32), y)
    z = q.fake_fp4_e4m3(x, 16)
    s16 = q.round_e4m3(
        x.float().reshape(8, 4, 16).abs().amax(-1, keepdim=True).clamp_min(q.FP4_E4M3_AMAX_FLOOR)
        / 6
    )
    assert _is_e4m3(s16).all()
    c16 = z.float().reshape(8, 4, 16) / s16
    assert torch.equal(q.round_e2m1(c16), c16)
    assert torch.equal(z.to(torch.bfloat16).to(dtype), z)


def test_all_zero_blocks_give_zeros():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.randn(32)
    for f in (q.fake_fp8, q.fake_fp4, q.fake_fp4_e4m3):
        y = f(x)
        assert torch.equal(y[0], torch.zeros(64)) and torch.equal(y[1, :16], torch.zeros(16))
    codes, scale = q.quantize_fp8_blocks(torch.zeros(3, 64))
    assert torch.equal(codes.float(), torch.zeros(3, 64))
    assert torch.equal(q.e8m0_decode(scale), q.pow2ceil(torch.full((3, 2), 1e-4 / 448)))


def test_switch_turns_fake_quant_off_and_restores():
    x = torch.randn(4, 32, dtype=torch.float64)
    with q.fake_quant(False):
        assert not q.fake_quant_enabled()
        assert torch.equal(q.fake_fp8(x), x) and torch.equal(q.fake_fp4(x), x)
        assert torch.equal(q.fake_fp4_e4m3(x), x)
    assert q.fake_quant_enabled() and not torch.equal(q.fake_fp8(x), x)


def test_e2m1_packing_low_nibble_is_even_index():
    v = torch.tensor([[1.0, 6.0, -0.5, 0.0, -6.0, -0.0]])
    p = q.pack_e2m1(v)
    assert p.tolist() == [[0x72, 0x09, 0x8F]]
    back = q.unpack_e2m1(p)
    assert torch.equal(back, v) and torch.equal(torch.signbit(back), torch.signbit(v))


def test_e8m0_roundtrip():
    s = torch.tensor([2.0**-20, 0.5, 1.0, 1024.0])
    assert torch.equal(q.e8m0_decode(q.e8m0_encode(s)), s)
    assert q.e8m0_encode(s).dtype == torch.float8_e8m0fnu


def test_fp8_weight_blocks_are_32x32_with_a_ceil_grid():
    w = torch.randn(70, 100)
    codes, scale = q.quantize_fp8_weight(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 4)
    deq = q.dequant_fp8_weight(codes, scale, torch.float32)
    for bo in range(3):
        for bi in range(4):
            blk = w[bo * 32 : (bo + 1) * 32, bi * 32 : (bi + 1) * 32]
            s = q.pow2ceil(blk.abs().amax().clamp_min(1e-4)[None] / 448)
            assert torch.equal(
                deq[bo * 32 : (bo + 1) * 32, bi * 32 : (bi + 1) * 32], q.round_e4m3(blk / s) * s
            )


def test_fp4_expert_weight_roundtrip_is_per_row_per_32():
    w = torch.randn(24, 96)
    packed, scale = q.quantize_fp4_weight(w)
    assert packed.shape == (24, 48) and packed.dtype == torch.int8 and scale.shape == (24, 3)
    assert torch.equal(q.dequant_fp4_weight(packed, scale, torch.float32), q.fake_fp4(w, 32))


def test_fp8_row_format_scale_is_amax_over_448():
    x = torch.randn(5, 128, dtype=torch.float64)
    codes, scale = q.quant_fp8_rows(x)
    assert scale.dtype == torch.float32 and scale.shape == (5, 1)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True).float().clamp_min(1e-4) / 448)
    assert _is_e4m3(codes).all()
    assert (codes.abs().amax(-1) == 448).all()
    zc, zs = q.quant_fp8_rows(torch.zeros(1, 128))
    assert torch.equal(zc, torch.zeros(1, 128)) and zs.item() == pytest.approx(1e-4 / 448)


def test_one_cast_rounds_every_e4m3_midpoint_as_round_e4m3():
    """``quant._cast_e4m3`` (the weight and table quantizers' fast path) against the explicit
    rounding: every value, every midpoint between neighbours and the floats either side of it,
    signed zeros, beyond-range values (saturated), byte for byte."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = torch.unique(vals[torch.isfinite(vals)])
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, float("-inf"))
    y = torch.cat(
        [vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)]
        + [torch.tensor([-0.0, -1e-9, 1e-9, 460.0, -1e4, 3e38])]
    )
    want = q.e4m3_encode(q.round_e4m3(y)).view(torch.uint8)
    assert torch.equal(q._cast_e4m3(y).view(torch.uint8), want)
    assert torch.equal(q._cast_e4m3(y.double()).view(torch.uint8), want)
