"""The shared arithmetic pieces against the published formulas, written out here independently.

Every expected value is computed in this file with numpy / ``math`` straight from the formulas
of ``model_arithmetic.md`` (mHC and its Sinkhorn schedule, the comb matrix's orientation,
RoPE/YaRN tables, the sink softmax, MoE routing weights and SwiGLU clamps, every quantizer's
scale rule and grid, the weight formats' layouts) and never by calling ``v41plan.model`` to
produce it. The pieces under test are ``v41plan.model.layers``/``quant`` and the pools' storage
codecs (``runtime.kernels.torch_ref``): for each storage format, ``decode(encode(x))`` is the
fake quantizer's value, for off-grid float32 and float64 inputs alike.

Conventions the formulas leave to the implementation and these checks pin: block scales are
float32 (the amax is rounded to float32, floored, divided in float32), a value is divided by a
non-power-of-two scale in its own precision, rounding is to nearest with ties to the even code,
and the sign of zero is kept.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from v41plan.model import layers, quant
from v41plan.runtime.kernels import torch_ref

RNG = np.random.default_rng(2026)


# --- the grids and rounding, from the format definitions --------------------------------------
def _e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """Non-negative E4M3 (fn) values ascending and whether each code is even (mantissa LSB 0):
    bias 7, 3 mantissa bits, subnormals at exponent field 0, S.1111.111 is NaN (max 448)."""
    vals, even = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            even.append(m % 2 == 0)
    return np.array(vals), np.array(even)


E4M3, E4M3_EVEN = _e4m3_grid()
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
)  # codes 0..7 (exponent 2 bits, 1 mantissa)
E2M1_EVEN = np.arange(8) % 2 == 0


def _round_grid(y: np.ndarray, grid: np.ndarray, even: np.ndarray) -> np.ndarray:
    """Nearest grid value (saturating at the largest), ties to the even code, sign kept."""
    a = np.minimum(np.abs(y), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi])
    return np.copysign(np.where(pick_hi, grid[hi], grid[lo]), y)


def e4m3(y):
    return _round_grid(np.asarray(y, dtype=np.float64), E4M3, E4M3_EVEN)


def e2m1(y):
    return _round_grid(np.asarray(y, dtype=np.float64), E2M1, E2M1_EVEN)


def pow2ceil(a: float) -> float:
    """``2**ceil(log2 a)`` exactly (frexp: ``a = m * 2**e`` with ``m`` in [0.5, 1))."""
    m, e = math.frexp(float(a))
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def _scale_input(amax: float, floor: float, div: float) -> np.float32:
    """``float32(max(float32(amax), floor)) / div`` in float32 (the scales' arithmetic)."""
    return np.float32(max(np.float32(amax), np.float32(floor))) / np.float32(div)


def _divide(x: np.ndarray, s: float, f32: bool) -> np.ndarray:
    return (np.float32(x) / np.float32(s)).astype(np.float64) if f32 else x / s


def ref_fake_fp8(x: np.ndarray, block: int = 32, f32: bool = False) -> np.ndarray:
    """E4M3 with one power-of-two scale ``pow2ceil(max(amax, 1e-4) / 448)`` per ``block``."""
    out = np.empty_like(x)
    for i, b in enumerate(x.reshape(-1, block)):
        s = pow2ceil(_scale_input(np.abs(b).max(), 1e-4, 448.0))
        out.reshape(-1, block)[i] = e4m3(b / s) * s
    return out


def ref_fake_fp4(x: np.ndarray, block: int = 32, f32: bool = False) -> np.ndarray:
    """E2M1 with one E8M0 scale ``pow2ceil(max(amax, 6 * 2**-126) / 6)`` per ``block``."""
    out = np.empty_like(x)
    for i, b in enumerate(x.reshape(-1, block)):
        s = pow2ceil(_scale_input(np.abs(b).max(), 6 * 2.0**-126, 6.0))
        out.reshape(-1, block)[i] = e2m1(b / s) * s
    return out


def ref_fake_fp4_e4m3(x: np.ndarray, block: int = 16, f32: bool = False) -> np.ndarray:
    """E2M1 with one E4M3 scale ``e4m3(max(amax, 6 * 2**-9) / 6)`` per ``block`` (not pow2)."""
    out = np.empty_like(x)
    for i, b in enumerate(x.reshape(-1, block)):
        s = float(e4m3(float(_scale_input(np.abs(b).max(), 6 * 2.0**-9, 6.0))))
        out.reshape(-1, block)[i] = e2m1(_divide(b, s, f32)) * s
    return out


def ref_fp8_rows(x: np.ndarray, f32: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The FP8 index plane: E4M3 codes of ``x / s``, ``s = max(amax, 1e-4) / 448`` per row
    (float32, not a power of two)."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scales = np.empty_like(rows), np.empty((rows.shape[0], 1))
    for i, r in enumerate(rows):
        s = float(_scale_input(np.abs(r).max(), 1e-4, 448.0))
        codes[i], scales[i] = e4m3(_divide(r, s, f32)), s
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], 1)


def _inputs(n_blocks: int, block: int) -> np.ndarray:
    """Blocks over many magnitudes plus the edge cases: all zero, below every amax floor, an
    amax exactly on a power of two times the format's maximum, exact ties, negative zeros."""
    x = RNG.standard_normal((n_blocks, block)) * 10.0 ** RNG.uniform(-6, 3, (n_blocks, 1))
    x[0] = 0.0
    x[1] = RNG.standard_normal(block) * 1e-9
    x[2, 0], x[3, 0], x[4, 0] = 448.0 * 4, 6.0 * 2**-3, 6.0 * 2**5
    x[5] = np.linspace(-6, 6, block)  # with amax 6 (scale 1): E2M1 midpoints such as 1.25, 5.0
    x[6] = -0.0
    x[7, :4] = [300.0, 1.0625, -1.1875, 2.125]  # scale 1 in E4M3: all three are ties
    return x


DTYPES = [torch.float32, torch.float64]


def _t(x: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(x).to(dtype)


def _same(got: torch.Tensor, want: np.ndarray) -> None:
    g = got.to(torch.float64).numpy()
    np.testing.assert_array_equal(g, want)
    np.testing.assert_array_equal(np.signbit(g), np.signbit(want))


# --- quantizers --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_fake_quantizers_follow_their_scale_rules(dtype):
    f32 = dtype == torch.float32
    x32 = _inputs(64, 32)
    x = _t(x32, dtype).to(torch.float64).numpy()  # the values the quantizer sees
    _same(quant.fake_fp8(_t(x, dtype), 32), ref_fake_fp8(x, 32, f32))
    _same(quant.fake_fp4(_t(x, dtype), 32), ref_fake_fp4(x, 32, f32))
    _same(quant.fake_fp4_e4m3(_t(x, dtype), 16), ref_fake_fp4_e4m3(x, 16, f32))
    codes, scale = quant.quant_fp8_rows(_t(x, dtype))
    want_codes, want_scale = ref_fp8_rows(x, f32)
    _same(codes, want_codes)
    np.testing.assert_array_equal(scale.to(torch.float64).numpy(), want_scale)
    # a quantized value quantizes to itself (power-of-two scales), and bf16 holds every grid
    for fq in (quant.fake_fp8, quant.fake_fp4, quant.fake_fp4_e4m3):
        y = fq(_t(x, dtype))
        assert torch.equal(y.to(torch.bfloat16).to(dtype), y)
        if fq is not quant.fake_fp4_e4m3:
            assert torch.equal(fq(y), y)
    # the E4M3-scaled FP4 too, on blocks whose scale is an E4M3 normal (amax >= 6 * 2**-6)
    y = quant.fake_fp4_e4m3(_t(x, dtype), 16).reshape(-1, 16)
    normal = torch.from_numpy(np.abs(x).reshape(-1, 16).max(1) >= 6 * 2.0**-6)
    assert torch.equal(quant.fake_fp4_e4m3(y, 16)[normal], y[normal])


def test_ties_and_edges_of_the_grids():
    # E4M3 at scale 1 (block amax 300): ties at steps 1/8 (1.0625, 1.1875) and 1/4 (2.125)
    assert quant.fake_fp8(torch.tensor([300.0, 1.0625, -1.1875, 2.125] + [0.0] * 28))[
        :4
    ].tolist() == [
        float(e4m3(300.0)),
        1.0,
        -1.25,
        2.0,
    ]
    assert e4m3(300.0) == 288.0 and e4m3(1.0625) == 1.0 and e2m1(5.0) == 4.0
    assert E4M3[-1] == 448.0 and E4M3[1] == 2.0**-9 and len(E4M3) == 127
    # an all-zero block gives zeros with the floored scale; -0 keeps its sign
    z = quant.fake_fp4(torch.tensor([-0.0] * 32))
    assert not z.any() and torch.signbit(z).all()


def test_fp8_weights_use_32x32_blocks_with_a_ceil_grid():
    out_f, in_f = 45, 70
    w = RNG.standard_normal((out_f, in_f)) * 10.0 ** RNG.uniform(-3, 2, (out_f, 1))
    codes, scale = quant.quantize_fp8_weight(torch.from_numpy(w).float())
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert tuple(scale.shape) == (2, 3)
    w32 = np.float32(w).astype(np.float64)
    want = np.empty_like(w32)
    for bi in range(2):
        for bj in range(3):
            tile = w32[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32]
            s = pow2ceil(_scale_input(np.abs(tile).max(), 1e-4, 448.0))
            want[bi * 32 : (bi + 1) * 32, bj * 32 : (bj + 1) * 32] = e4m3(tile / s) * s
            # E8M0: the scale's biased exponent byte
            assert scale.view(torch.uint8)[bi, bj].item() == int(math.log2(s)) + 127
    _same(quant.dequant_fp8_weight(codes, scale, torch.float64), want)


def test_fp4_expert_weights_pack_two_codes_per_byte_with_row_scales():
    out_f, in_f = 6, 64
    w = RNG.standard_normal((out_f, in_f)) * 10.0 ** RNG.uniform(-2, 1, (out_f, 1))
    packed, scale = quant.quantize_fp4_weight(torch.from_numpy(w).float())
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (out_f, in_f // 2)
    assert tuple(scale.shape) == (out_f, in_f // 32)
    w32 = np.float32(w).astype(np.float64)
    want = ref_fake_fp4(w32, 32)
    _same(quant.dequant_fp4_weight(packed, scale, torch.float64), want)
    # byte k holds element 2k in its low nibble and 2k+1 in its high one: sign bit 3, then the
    # magnitude code (index into E2M1)
    blocks = w32.reshape(out_f, in_f // 32, 32)
    s = np.array(
        [[pow2ceil(_scale_input(np.abs(b).max(), 6 * 2.0**-126, 6.0)) for b in r] for r in blocks]
    )
    v = (want.reshape(out_f, in_f // 32, 32) / s[..., None]).reshape(out_f, in_f)
    code = np.searchsorted(E2M1, np.abs(v)) | (np.signbit(v).astype(np.int64) << 3)
    want_bytes = code[:, 0::2] | (code[:, 1::2] << 4)
    np.testing.assert_array_equal(packed.view(torch.uint8).numpy(), want_bytes)
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy(), np.log2(s).astype(int) + 127)


def test_engram_table_rows_are_e4m3_with_e8m0_per_32_lanes():
    x = _inputs(8, 32).reshape(2, 128)
    codes, scale = quant.quantize_fp8_blocks(torch.from_numpy(x).float())
    x32 = np.float32(x).astype(np.float64)
    _same(quant.dequant_fp8_blocks(codes, scale, torch.float64), ref_fake_fp8(x32, 32))


# --- storage codecs: decode(encode(x)) is the fake quantizer's value ---------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_every_storage_format_decodes_to_the_fake_quantizers_value(dtype):
    f32 = dtype == torch.float32
    rows = _inputs(32, 64)  # 32 rows of 64 lanes (head_dim) / 32 lanes (index_head_dim below)
    # a float64 value just above an E4M3 tie that float32 would round onto the tie (1.0625)
    rows[8, :2] = [300.0, 1.0625 + 2.0**-40]
    rows[9, :2] = [6.0, 1.25 + 2.0**-40]  # the same for E2M1 (tie 1.25 at scale 1)
    x = _t(rows, dtype)
    xv = x.to(torch.float64).numpy()
    ring = torch_ref.decode_fp8_e8m0(torch_ref.encode_fp8_e8m0(x, 32), 64, torch.float64)
    _same(ring, ref_fake_fp8(xv, 32, f32))
    main = torch_ref.decode_fp4_e4m3_scales(
        torch_ref.encode_fp4_e4m3_scales(x, 16), 64, torch.float64, 16
    )
    _same(main, ref_fake_fp4_e4m3(xv, 16, f32))
    vals, scales = torch_ref.encode_fp4_e8m0(x, 32)
    _same(torch_ref.decode_fp4_e8m0(vals, scales, torch.float64, 32), ref_fake_fp4(xv, 32, f32))
    codes, scale = ref_fp8_rows(xv, f32)
    _same(torch_ref.decode_fp8_row(torch_ref.encode_fp8_row(x), 64, torch.float64), codes * scale)
    # what the bytes hold equals the model's own fake quantizer, so values already on a grid
    # are stored losslessly (what the paged runtime relies on with the quantizers on)
    assert torch.equal(ring.to(dtype), quant.fake_fp8(x, 32))
    assert torch.equal(main.to(dtype), quant.fake_fp4_e4m3(x, 16))


# --- mHC -----------------------------------------------------------------------------------
def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def ref_hc_predict(X, fn, base, scale, hc, iters, hc_eps, rms_eps):
    """mHC mixes per token: one RMS statistic over all streams; ``C[i][j]`` row-major (i source,
    j destination); Sinkhorn: softmax over j (+eps), a column normalization (over i), then
    ``iters - 1`` (row, column) normalizations, ``+eps`` in every denominator."""
    n = X.shape[0]
    pre, post, comb = np.empty((n, hc)), np.empty((n, hc)), np.empty((n, hc, hc))
    for t in range(n):
        f = X[t].reshape(-1)
        r = 1 / math.sqrt(np.mean(f * f) + rms_eps)
        m = (fn @ f) * r
        pre[t] = _sigmoid(m[:hc] * scale[0] + base[:hc]) + hc_eps
        post[t] = 2 * _sigmoid(m[hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        C = np.empty((hc, hc))
        for i in range(hc):
            for j in range(hc):
                C[i, j] = m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j]
        for i in range(hc):
            e = np.exp(C[i] - C[i].max())
            C[i] = e / e.sum() + hc_eps
        C = C / (C.sum(axis=0, keepdims=True) + hc_eps)
        for _ in range(iters - 1):
            C = C / (C.sum(axis=1, keepdims=True) + hc_eps)
            C = C / (C.sum(axis=0, keepdims=True) + hc_eps)
        comb[t] = C
    return pre, post, comb


@pytest.mark.parametrize(
    "strength", [0.05, 0.3], ids=["near-uniform", "far-from-doubly-stochastic"]
)
def test_mhc_mixes_and_the_sinkhorn_schedule(strength):
    hc, D, n = 4, 16, 5
    X = RNG.standard_normal((n, hc, D))
    fn = RNG.standard_normal(((2 + hc) * hc, hc * D)) * strength
    base = RNG.standard_normal((2 + hc) * hc) * 10 * strength
    scale = np.array([0.7, 1.3, 8 * strength])
    want = ref_hc_predict(X, fn, base, scale, hc, 20, 1e-6, 1e-20)
    p = layers.HcParams(*(torch.from_numpy(a) for a in (fn, base, scale)))
    got = layers.hc_predict(torch.from_numpy(X), p, hc, 20, 1e-6, 1e-20)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-13, atol=1e-15)
    pre, post, C = want
    if strength > 0.1:
        # 20 iterations leave such a matrix visibly unbalanced: the schedule itself is observable
        # (one iteration more or less, or a row step first, moves C by more than 1e-6)
        assert np.abs(C.sum(2) - 1).max() > 1e-3
        other = ref_hc_predict(X, fn, base, scale, hc, 21, 1e-6, 1e-20)[2]
        assert np.abs(other - C).max() > 1e-6
        return
    assert (pre > 1e-6).all() and (pre < 1 + 1e-6).all() and (post > 0).all() and (post < 2).all()
    np.testing.assert_allclose(C.sum(1), 1, atol=1e-4)
    np.testing.assert_allclose(C.sum(2), 1, atol=1e-4)
    assert not np.allclose(C, C.transpose(0, 2, 1), atol=1e-3)  # the orientation is observable
    # zero parameters: pre = sigmoid(0) + eps, post = 2 sigmoid(0) = 1, C uniform
    z = layers.HcParams(torch.zeros_like(p.fn), torch.zeros_like(p.base), torch.zeros(3).double())
    pre0, post0, C0 = layers.hc_predict(torch.from_numpy(X), z, hc, 20, 1e-6, 1e-20)
    assert torch.allclose(pre0, torch.full_like(pre0, 0.5 + 1e-6), atol=1e-15)
    assert torch.allclose(post0, torch.ones_like(post0)) and torch.allclose(C0, 1 / hc + 0 * C0)


def test_collapse_and_expand_read_the_comb_matrix_source_to_destination():
    hc, D, n = 4, 8, 3
    X = RNG.standard_normal((n, hc, D))
    y = RNG.standard_normal((n, D))
    pre, post = RNG.uniform(0, 1, (n, hc)), RNG.uniform(0, 2, (n, hc))
    C = RNG.uniform(0, 1, (n, hc, hc))  # far from symmetric
    want_x = np.einsum("nk,nkd->nd", pre, X)
    want_X = np.empty_like(X)
    for t in range(n):
        for j in range(hc):
            want_X[t, j] = post[t, j] * y[t] + sum(C[t, i, j] * X[t, i] for i in range(hc))
    got_x = layers.hc_collapse(torch.from_numpy(X), torch.from_numpy(pre))
    got_X = layers.hc_expand(
        torch.from_numpy(y), torch.from_numpy(X), torch.from_numpy(post), torch.from_numpy(C)
    )
    np.testing.assert_allclose(got_x.numpy(), want_x, rtol=1e-13)
    np.testing.assert_allclose(got_X.numpy(), want_X, rtol=1e-13)


# --- RoPE / YaRN ---------------------------------------------------------------------------------
def ref_freqs(rd, base, factor=None, orig=0, beta_fast=32, beta_slow=1):
    """``f_i = base**(-2i/rd)``; YaRN ramps them between ``low`` and ``high`` to ``f_i/factor``."""
    f = np.array([base ** (-2 * i / rd) for i in range(rd // 2)])
    if not orig:
        return f, None
    corr = [
        rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
        for rot in (beta_fast, beta_slow)
    ]
    low, high = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), rd - 1)
    ramp = np.clip((np.arange(rd // 2) - low) / max(high - low, 1e-3), 0, 1)
    return f / factor * ramp + f * (1 - ramp), (low, high)


@pytest.mark.parametrize(
    ("rd", "base", "orig", "low_high"),
    [(64, 160000.0, 65536, (15, 25)), (16, 160000.0, 64, (0, 2)), (64, 10000.0, 0, None)],
    ids=["flash-compressed", "tiny-compressed", "window-no-yarn"],
)
def test_rope_tables(rd, base, orig, low_high):
    scaling = {
        "factor": 16.0,
        "original_max_position_embeddings": orig,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    want, lh = ref_freqs(rd, base, 16.0, orig)
    assert lh == low_high  # the published ramp bounds (Flash: 15, 25)
    got = layers.yarn_freqs(rd, base, scaling if orig else None)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=2e-6)
    if lh:
        low, high = lh
        np.testing.assert_allclose(
            (got.double().numpy() / ref_freqs(rd, base)[0])[: low + 1], 1, rtol=2e-6
        )
        np.testing.assert_allclose(
            (got.double().numpy() / ref_freqs(rd, base)[0])[high:], 1 / 16, rtol=2e-6
        )


def test_rope_rotates_interleaved_pairs_of_the_last_lanes_and_inverts():
    rd, d, H = 16, 64, 3
    rope = layers.Rope(
        rd,
        160000.0,
        {"factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    )
    pos = torch.tensor([0, 1, 7, 130, 4095])
    x = torch.from_numpy(RNG.standard_normal((5, H, d)))
    cos, sin = rope.cos_sin(pos, torch.float64)
    got = layers.apply_rope(x, cos, sin)
    f, _ = ref_freqs(rd, 160000.0, 16.0, 64)
    xn = x.numpy()
    want = xn.copy()
    for t, p in enumerate(pos.tolist()):
        for i in range(rd // 2):
            a = p * f[i]
            re, im = xn[t, :, d - rd + 2 * i], xn[t, :, d - rd + 2 * i + 1]
            want[t, :, d - rd + 2 * i] = re * math.cos(a) - im * math.sin(a)
            want[t, :, d - rd + 2 * i + 1] = re * math.sin(a) + im * math.cos(a)
    assert torch.equal(got[..., : d - rd], x[..., : d - rd])  # NoPE lanes untouched
    # angles are float32 products (position * frequency): 1e-6 relative at position 4095
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5 * np.abs(xn).max())
    back = layers.apply_rope(got, cos, sin, inverse=True)
    np.testing.assert_allclose(back.numpy(), xn, atol=1e-13)


# --- the sink softmax ------------------------------------------------------------------------
def test_sparse_attention_is_the_sink_softmax_over_the_listed_keys():
    n, H, d, K, rows = 4, 3, 8, 6, 10
    q = RNG.standard_normal((n, H, d))
    kv = RNG.standard_normal((rows, d))
    idx = RNG.integers(0, rows, (n, K))
    idx[1, 2:] = -1
    idx[3] = -1  # no valid key: the output is 0
    sink = np.array([0.3, -1.0, 2.0])
    scale = d**-0.5
    want = np.zeros((n, H, d))
    for t in range(n):
        keys = [kv[j] for j in idx[t] if j >= 0]
        if not keys:
            continue
        for h in range(H):
            logits = np.array([q[t, h] @ k for k in keys]) * scale
            m = max(logits.max(), sink[h])
            p = np.exp(logits - m)
            want[t, h] = (p[:, None] * np.array(keys)).sum(0) / (p.sum() + math.exp(sink[h] - m))
    got = layers.sparse_attention(*(torch.from_numpy(a) for a in (q, kv, idx, sink)), scale)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)
    # a sink of -inf is a plain softmax; a huge sink drives the output to 0
    plain = layers.sparse_attention(
        *(torch.from_numpy(a) for a in (q, kv, idx)),
        torch.full((H,), -math.inf, dtype=torch.float64),
        scale,
    )
    assert torch.allclose(plain[0].sum(-1), plain[0].sum(-1)) and torch.isfinite(plain).all()
    big = layers.sparse_attention(
        *(torch.from_numpy(a) for a in (q, kv, idx)),
        torch.full((H,), 1e4, dtype=torch.float64),
        scale,
    )
    assert big.abs().max() < 1e-300


# --- MoE -------------------------------------------------------------------------------------
def _moe(limit: float, E=6, k=2, D=32, inter=32):
    cfg = SimpleNamespace(
        n_routed_experts=E,
        num_experts_per_tok=k,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        swiglu_limit=limit,
    )
    w = {
        "l.ffn.gate.weight": RNG.standard_normal((E, D)) * 0.3,
        "l.ffn.gate.bias": RNG.standard_normal(E) * 0.1,
        "l.ffn.experts.w1": RNG.standard_normal((E, inter, D)) * 0.3,
        "l.ffn.experts.w3": RNG.standard_normal((E, inter, D)) * 0.3,
        "l.ffn.experts.w2": RNG.standard_normal((E, D, inter)) * 0.3,
        "l.ffn.shared_experts.w1.weight": RNG.standard_normal((inter, D)) * 0.3,
        "l.ffn.shared_experts.w3.weight": RNG.standard_normal((inter, D)) * 0.3,
        "l.ffn.shared_experts.w2.weight": RNG.standard_normal((D, inter)) * 0.3,
    }
    # experts 4 and 1 score alike on every token: the tie goes to the smaller id
    w["l.ffn.gate.weight"][4] = w["l.ffn.gate.weight"][1]
    w["l.ffn.gate.bias"][4] = w["l.ffn.gate.bias"][1] = 5.0
    return (
        cfg,
        w,
        layers.MoE(cfg, {a: torch.from_numpy(b) for a, b in w.items()}, "l", torch.float64),
    )


def ref_route(x, w, cfg):
    """``s = sqrt(softplus(x Wg^T))``; pick top-k of ``s + bias`` (ties: smaller id); weights
    from the unbiased ``s``, normalized over the picks (+1e-20), times the scaling factor."""
    z = x @ w["l.ffn.gate.weight"].T
    s = np.sqrt(np.log1p(np.exp(z)))
    sel = s + w["l.ffn.gate.bias"]
    ids = np.array(
        [
            sorted(range(sel.shape[1]), key=lambda e: (-sel[t, e], e))[: cfg.num_experts_per_tok]
            for t in range(len(x))
        ]
    )
    wts = np.take_along_axis(s, ids, 1)
    wts = wts / (wts.sum(1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return ids, wts


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("quant_on", [False, True], ids=["quant-off", "quant-on"])
def test_moe_routing_weights_and_swiglu_clamps(quant_on):
    L = 0.5  # small: both clamps act
    cfg, w, moe = _moe(L)
    x = RNG.standard_normal((7, 32))
    ids, wts = ref_route(x, w, cfg)
    assert (ids[:, 0] == 1).all()  # the bias ties experts 1 and 4 at the top: 1 wins
    q = ref_fake_fp8 if quant_on else (lambda a, block=32: a)
    xq = q(x)
    want = np.zeros_like(x)
    for t in range(len(x)):
        for e, wt in zip(ids[t], wts[t], strict=True):
            h1, h3 = w["l.ffn.experts.w1"][e] @ xq[t], w["l.ffn.experts.w3"][e] @ xq[t]
            act = wt * _silu(np.minimum(h1, L)) * np.clip(h3, -L, L)  # gate clamped above only
            want[t] += w["l.ffn.experts.w2"][e] @ q(act)  # the weight multiplies before W2
        h1 = w["l.ffn.shared_experts.w1.weight"] @ xq[t]
        h3 = w["l.ffn.shared_experts.w3.weight"] @ xq[t]
        want[t] += w["l.ffn.shared_experts.w2.weight"] @ q(
            _silu(np.minimum(h1, L)) * np.clip(h3, -L, L)
        )
    with quant.fake_quant(quant_on):
        got_w, got_ids = moe.route(torch.from_numpy(x))
        y, got_ids2 = moe(torch.from_numpy(x))
    np.testing.assert_array_equal(got_ids.numpy(), ids)
    np.testing.assert_array_equal(got_ids2.numpy(), ids)
    dense = np.zeros((len(x), cfg.n_routed_experts))
    np.put_along_axis(dense, ids, wts, 1)
    np.testing.assert_allclose(got_w.numpy(), dense, rtol=1e-14)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-14)
    assert np.abs(np.clip(x @ w["l.ffn.experts.w3"][0].T, -L, L)).max() == L  # the clamp was hit


@pytest.mark.xfail(
    strict=True,
    reason="known: a compressed row already on fake_fp4_e4m3's grid is re-rounded by the fp4 main "
    "plane's encoder when its block scale is an E4M3 subnormal (amax below about 0.03): the "
    "encoder re-derives the scale from the rounded values; the runtime stores rows it quantized",
)
def test_the_fp4_main_plane_stores_on_grid_rows_with_subnormal_scales_exactly():
    x = torch.zeros(1, 16, dtype=torch.float64)
    x[0, :3] = torch.tensor([0.0191, 0.012, -0.006])  # scale e4m3(0.0191 / 6) = 2 * 2**-9
    y = quant.fake_fp4_e4m3(x, 16)  # what the runtime hands the plane
    assert y[0, 0] == 4 * 2.0**-8  # the largest value took code 4, not 6
    stored = torch_ref.decode_fp4_e4m3_scales(
        torch_ref.encode_fp4_e4m3_scales(y, 16), 16, torch.float64, 16
    )
    assert torch.equal(stored, y)
