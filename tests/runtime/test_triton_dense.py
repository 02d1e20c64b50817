"""The fused dense kernels under the Triton interpreter (CPU, fp32 operands) against the torch
references: the FP8 activation quantizer bit for bit, the mHC site and expand within their
stated bounds of the float64 evaluation, the custom ops opaque to ``torch.compile``.

``TRITON_INTERPRET=1`` is set for this module only: at its import, before triton is imported
(``triton.jit`` decides interpreted or compiled when a function is decorated, triton's own
library included), and restored after its tests. On a CUDA machine the module is skipped:
``tests/gpu/test_triton_dense_gpu.py`` runs the compiled kernels there.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "CUDA present: tests/gpu/test_triton_dense_gpu.py covers it", allow_module_level=True
    )
if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
    # triton's own library functions (tl.sum, tl.max, tl.sigmoid) were then built compiled,
    # and interpreted kernels cannot call them
    raise RuntimeError("triton was imported before this module could set TRITON_INTERPRET=1")
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
from v41plan.model import quant as Q
from v41plan.model.layers import HcParams
from v41plan.runtime.kernels import dense_ref as ref
from v41plan.runtime.kernels import triton_dense as td

from .interpreted import patched_interpreter  # noqa: F401 (an autouse fixture)

U = 2.0**-24
HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


@pytest.fixture(autouse=True, scope="module")
def _interpreter_for_this_module_only():
    """Keep the interpreter switch on while these tests run (triton reads it lazily too), and
    restore the previous setting after them."""
    yield
    if _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


SHIPPED_SITE_CONFIGS = list(td.SITE_CONFIGS)
# the interpreter is slow: a 16-token switch to the tl.dot form puts both forms within small test
# shapes (the shipped switch, at 1024 tokens, is checked on its own below)
# (the shipped split form for up to 4 tokens, products up to 16)
SMALL_SITE_CONFIGS = [
    (4, td.SITE_CONFIGS[0][1]),
    (16, td.SITE_CONFIGS[1][1]),
    (1 << 62, td.SITE_CONFIGS[-1][1]),
]


@pytest.fixture(autouse=True)
def _both_site_forms_in_small_shapes(monkeypatch):
    monkeypatch.setattr(td, "SITE_CONFIGS", SMALL_SITE_CONFIGS)


def test_shipped_site_configs():
    assert SHIPPED_SITE_CONFIGS[0] == (16, ("split", 1, 128, 4))
    assert SHIPPED_SITE_CONFIGS[1] == (1024, ("products", 1, 128, 4))
    assert SHIPPED_SITE_CONFIGS[-1][1][0] == "tf32x3" and SHIPPED_SITE_CONFIGS[-1][0] >= 1 << 40


def test_wide_sites_split_at_every_decode_batch():
    """From ``WIDE_SITE_D`` (V4.1-Flash's 5120 lanes) the split form runs up to 1024 tokens (a
    token's mix is read over ``D / 128`` programs), one token a program up to 16 and two from
    17, where the W8A8 decode tiles change rows too; narrower hidden sizes keep
    ``SITE_CONFIGS``."""
    from v41plan.runtime.kernels.triton_gemm import default_config

    assert td.WIDE_SITE_D <= 5120 < 4 * td.WIDE_SITE_D and td.WIDE_SITE_D > 1024  # medium: 1024
    for n in (1, 16):
        assert td.site_config(n, 5120) == ("split", 1, 128, 4), n
    for n in (17, 64, 1024):
        assert td.site_config(n, 5120) == ("split", 2, 128, 4), n
    assert td.site_config(1025, 5120)[0] == "tf32x3"
    assert default_config(16, 5120, 8192, "fp8").block_m == 16
    assert default_config(17, 5120, 8192, "fp8").block_m == 64
    assert td.mix_error_terms(64, 4 * 5120) == 4 * 5120
    assert td.site_config(64, 1024) == td.site_config(64) == SMALL_SITE_CONFIGS[-1][1]


def test_split_counters_are_allocated_once_for_the_widest_launch(monkeypatch):
    """The split site's arrival counters are sized on first use for the widest split launch of
    the tables (512 token blocks at wide widths: 1024 tokens two a program), so a graph
    captured at a small batch and an eager launch of many tokens after it share one tensor; a
    larger request still gets one, and the replaced tensor stays alive."""
    monkeypatch.setattr(td, "_COUNTERS", {})
    dev = torch.device("cpu")
    first = td._arrival_counters(dev, 1)
    assert first.numel() >= 512 and int(first.abs().sum()) == 0
    assert td._arrival_counters(dev, 512) is first
    bigger = td._arrival_counters(dev, 5000)
    assert bigger.numel() >= 5000 and [id(t) for t in td._COUNTERS[dev]] == [id(first), id(bigger)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 differs from 0.0)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(view[t.element_size()])


def _e4m3_values() -> torch.Tensor:
    """Every non-negative finite E4M3 (fn) value, ascending."""
    return torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _quant_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Random and adversarial activations: magnitudes 1e-30..1e30, an all-zero row, blocks
    floored at 1e-4, blocks at the top code, exact E4M3 ties, odd shapes."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 256, generator=g) * torch.logspace(-30, 30, 256)[None]
    wide[5] = 0.0
    wide[6, :32] = torch.randn(32, generator=g) * 1e-6  # amax below the 1e-4 floor
    wide[7, 32:64] = -0.0
    v = _e4m3_values()
    mids = (v[1:] + v[:-1]) / 2  # exactly halfway between neighbours: ties to the even code
    ties = torch.cat([mids, -mids, v, -v])
    ties = torch.cat([ties, torch.zeros(-len(ties) % 31)]).reshape(-1, 31)
    ties = torch.cat([ties, torch.full((ties.shape[0], 1), 448.0)], 1)  # scale 1 in every block
    ties = torch.cat([ties * 2.0**k for k in (-20, 0, 7)]).reshape(-1, 96)
    near_top = torch.linspace(400.0, 448.0, 96).reshape(1, 96)  # 432 rounds to 448 (even)
    odd = torch.randn(3, 5, 96, generator=g) * 10  # three leading dims, three blocks
    long = torch.randn(2, 1056, generator=g)  # 33 blocks: more than one program along K
    out = [wide, ties, near_top, odd, long, torch.randn(1, 32, generator=g)]
    return [t.to(dtype) for t in out]


def test_kernels_are_interpreted():
    assert td.INTERPRETED
    assert type(td._mhc_site_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_act_quant_is_bit_exact(dtype):
    for x in _quant_inputs(dtype):
        codes, scales = td.fp8_act_quant(x)
        want_codes, want_scales = ref.fp8_act_quant(x)
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        assert codes.shape == x.shape and scales.shape == (*x.shape[:-1], x.shape[-1] // 32)
        assert torch.equal(_bits(codes), _bits(want_codes))
        assert torch.equal(_bits(scales), _bits(want_scales))
        assert not ((_bits(codes) & 0x7F) == 0x7F).any()  # saturated, never NaN
        deq = codes.float().unflatten(-1, (-1, 32)) * scales.unsqueeze(-1)
        assert torch.equal(_bits(deq.flatten(-2).to(dtype)), _bits(Q.fake_fp8(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_fp8_is_bit_exact(dtype):
    for x in _quant_inputs(dtype):
        got = td.fake_fp8(x)
        assert got.dtype == dtype
        assert torch.equal(_bits(got), _bits(Q.fake_fp8(x)))


def test_quantizer_rounds_ties_to_even_and_tops_at_448():
    x = torch.tensor([[1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 440.0, 448.0] + [0.0] * 25])
    codes, scales = td.fp8_act_quant(x)
    assert scales.tolist() == [[1.0]]
    assert codes.float()[0, :7].tolist() == [1.0, 1.25, -1.0, 0.0, 2.0**-8, 448.0, 448.0]


def test_fake_fp8_follows_the_switch_and_other_dtypes_fall_back():
    x = torch.randn(4, 64)
    with Q.fake_quant(False):
        assert td.fake_fp8(x) is x
    x64 = torch.randn(4, 64, dtype=torch.float64) * 100
    assert torch.equal(td.fake_fp8(x64), Q.fake_fp8(x64))
    codes, scales = td.fp8_act_quant(x64)
    want = ref.fp8_act_quant(x64)
    assert torch.equal(_bits(codes), _bits(want[0])) and torch.equal(scales, want[1])


# --- mHC ----------------------------------------------------------------------------------


def _site_inputs(N: int, D: int, seed: int, dtype=torch.float32, peaked: bool = False):
    """Streams with an all-zero token, a tiny one and a huge one; mHC parameters (float32)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, HC, D, generator=g)
    X[0] = 0.0
    if N > 3:
        X[1] *= 1e-20
        X[2] *= 1e12
        X[3, 2] = 0.0  # one empty stream
    pre_in = torch.rand(N, HC, generator=g) + HC_EPS
    fn = torch.randn(24, HC * D, generator=g) * (0.5 if peaked else 0.05)
    base = torch.randn(24, generator=g)
    scale = torch.tensor([0.7, 1.3, 12.0 if peaked else 1.0])
    w = torch.randn(D, generator=g).to(dtype)
    y = torch.randn(N, D, generator=g).to(dtype)
    return X.to(dtype), pre_in, HcParams(fn, base, scale), w, y


def _p64(p: HcParams) -> HcParams:
    return HcParams(p.fn.double(), p.base.double(), p.scale.double())


def _mix_error(X: torch.Tensor, p: HcParams) -> torch.Tensor:
    """``E`` per token: the worst-case error of the mix dot the kernel ran, scaled like ``m``."""
    f = X.reshape(X.shape[0], -1).double()
    r = torch.rsqrt(f.pow(2).mean(-1) + NORM_EPS)
    c = td.mix_error_terms(X.shape[0], f.shape[1])
    return c * U * r * (f.abs() @ p.fn.double().abs().T).amax(-1)


def _rowmax(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).amax(-1)


def _check_prediction(pre, post, C, X, p, iters=ITERS):
    """pre/post/C within the module's stated bounds of the float64 evaluation."""
    ones = torch.ones(X.shape[0], HC, dtype=torch.float64)
    w = torch.ones(X.shape[-1], dtype=torch.float64)
    want = ref.mhc_site(X.double(), ones, _p64(p), w, HC, iters, HC_EPS, NORM_EPS)
    E = _mix_error(X, p)
    s = p.scale.double().abs()
    assert (_rowmax((pre - want[0]).abs()) <= s[0] * E / 4 + 16 * U).all()
    assert (_rowmax((post - want[1]).abs()) <= s[1] * E / 2 + 32 * U).all()
    assert (_rowmax((C - want[2]).abs()) <= 4 * s[2] * E + 64 * U * iters).all()


@pytest.mark.parametrize(
    ("N", "D", "peaked"), [(7, 96, False), (5, 64, True), (37, 96, False), (21, 64, True)]
)
def test_mhc_site_fp32_within_the_stated_bound(N, D, peaked):
    # up to 16 tokens: one per program, per-lane products; more: 16 per program, tl.dot
    assert (td.site_config(N)[0] == "tf32x3") == (N > 16)
    X, pre_in, p, w, _ = _site_inputs(N, D, seed=N, peaked=peaked)
    pre, post, C, x = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    assert pre.shape == post.shape == (N, HC) and C.shape == (N, HC, HC) and x.shape == (N, D)
    _check_prediction(pre, post, C, X, p)
    # the float32 torch composition: far inside the bound (both err like sqrt(K) ulps)
    want32 = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    for got, want in zip((pre, post, C), want32[:3], strict=True):
        assert (got - want).abs().max() <= 2e-5
    # x: collapse then the norm, against float64
    X64 = X.double()
    want = ref.mhc_site(X64, pre_in.double(), _p64(p), w.double(), HC, ITERS, HC_EPS, NORM_EPS)
    terms = pre_in.double()[..., None] * X64
    rx = torch.rsqrt(terms.sum(1).pow(2).mean(-1, keepdim=True) + NORM_EPS)
    coll = terms.abs().sum(1)
    bound = 8 * U * rx * w.double().abs() * coll + (D / 2 + 8) * U * want[3].abs()
    assert ((x.double() - want[3]).abs() <= bound).all()
    assert torch.equal(x[0], torch.zeros(D))  # the all-zero token: a zero input, finite mixes
    assert torch.allclose(C[0], want32[2][0], atol=1e-6)


@pytest.mark.parametrize("N", [6, 37])
def test_mhc_site_bf16_rounds_where_the_reference_rounds(N):
    X, pre_in, p, w, _ = _site_inputs(N, 96, seed=5, dtype=torch.bfloat16)
    pre, post, C, x = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    assert x.dtype == torch.bfloat16 and pre.dtype == torch.float32
    _check_prediction(pre, post, C, X, p)
    want = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    ulp = 2.0 ** (torch.frexp(want[3].float())[1] - 8).float()  # one bf16 ulp of each value
    assert ((x.float() - want[3].float()).abs() <= 2 * ulp).all()
    assert (x.float() == want[3].float()).float().mean() > 0.95  # mostly the same rounding


@pytest.mark.parametrize(("iters", "N"), [(1, 5), (2, 17), (5, 5)])
def test_mhc_site_runs_exactly_the_sinkhorn_iterations(iters, N):
    X, pre_in, p, w, _ = _site_inputs(N, 64, seed=iters, peaked=True)
    C = td.mhc_site(X, pre_in, p, w, HC, iters, HC_EPS, NORM_EPS)[2]
    runs = {
        k: ref.mhc_site(X, pre_in, p, w, HC, k, HC_EPS, NORM_EPS)[2] for k in (iters, iters + 1)
    }
    one_more = (runs[iters + 1] - runs[iters]).abs().max()
    assert one_more > 1e-3  # the inputs are far from the Sinkhorn fixed point
    assert (C - runs[iters]).abs().max() <= min(2e-5, one_more / 50)


def test_mhc_site_invariants_at_zero_parameters():
    X, pre_in, _, w, _ = _site_inputs(18, 64, seed=2)
    p = HcParams(torch.zeros(24, HC * 64), torch.zeros(24), torch.zeros(3))
    pre, post, C, _ = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    assert torch.allclose(pre, torch.full_like(pre, 0.5 + HC_EPS))
    assert torch.equal(post, torch.ones_like(post))
    assert torch.allclose(C, torch.full_like(C, 0.25), atol=1e-5)
    assert torch.allclose(C.sum(1), torch.ones(18, HC), atol=1e-5)


@pytest.mark.parametrize(("dtype", "N"), [(torch.float32, 19), (torch.bfloat16, 5)])
def test_fused_fp8_epilogue_quantizes_the_site_output(dtype, N):
    X, pre_in, p, w, _ = _site_inputs(N, 96, seed=7, dtype=dtype)
    pre, post, C, x, codes, scales = td.mhc_site_fp8(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    plain = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    for a, b in zip((pre, post, C, x), plain, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    want = ref.fp8_act_quant(x)
    assert torch.equal(_bits(codes), _bits(want[0])) and torch.equal(_bits(scales), _bits(want[1]))
    # the FFN form: the expand in front, the quantizer behind
    y = torch.randn(N, 96).to(dtype)
    got = td.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    plain = td.mhc_expand_site(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    assert len(got) == 7
    for a, b in zip(got[:5], plain, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    want = ref.fp8_act_quant(got[4])
    assert torch.equal(_bits(got[5]), _bits(want[0])) and torch.equal(_bits(got[6]), _bits(want[1]))


def test_site_codes_only_where_a_program_holds_one_token(monkeypatch):
    """``codes_in_parallel`` (where ``paged_model.SITE_CODES`` quantizes in the site): the split
    form's one token a program, up to 16 tokens at every width (the shipped site forms), never
    beyond."""
    monkeypatch.setattr(td, "SITE_CONFIGS", SHIPPED_SITE_CONFIGS)
    for D in (96, 1024, 5120):
        assert all(td.codes_in_parallel(n, D) for n in (1, 2, 8, 16))
        assert not any(td.codes_in_parallel(n, D) for n in (17, 64, 2048))


@pytest.mark.parametrize("N", [1, 5, 19])
def test_site_codes_with_e8m0_scales_are_the_w8a8_quantizers(N):
    """``e8m0=True``: the site's codes and scales are ``act_quant_fp8(x)``'s (E4M3 codes, E8M0
    scale bytes: what the W8A8 GEMM reads), bit for bit, in both site forms and in the torch
    reference (which the op falls back to)."""
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    X, pre_in, p, w, _ = _site_inputs(N, 96, seed=11, dtype=torch.bfloat16)
    y = torch.randn(N, 96).to(torch.bfloat16)
    _, post, C, *_ = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    args = (HC, ITERS, HC_EPS, NORM_EPS)
    for mod in (td, ref):
        site = mod.mhc_site_fp8(X, pre_in, p, w, *args, e8m0=True)
        ffn = mod.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, *args, e8m0=True)
        for x, codes, scales in (site[3:], ffn[4:]):
            assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (N, 3)
            want_q, want_s = act_quant_fp8(x)
            assert torch.equal(_bits(codes), _bits(want_q))
            assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_expand_within_the_stated_bound(dtype):
    X, pre_in, p, w, y = _site_inputs(37, 96, seed=11, dtype=dtype)
    _, post, C, _ = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    got = td.hc_expand(y, X, post, C)
    assert got.dtype == dtype and got.shape == X.shape
    want = ref.hc_expand(y.double(), X.double(), post.double(), C.double())
    mag = torch.einsum("nij,nid->njd", C.double(), X.double().abs())
    mag = mag + post.double()[..., None] * y.double().abs()[:, None]
    if dtype == torch.float32:
        assert ((got.double() - want).abs() <= 8 * U * mag).all()
    else:
        want_bf16 = ref.hc_expand(y, X, post, C).float()
        ulp = 2.0 ** (torch.frexp(want_bf16)[1] - 8).float()
        assert ((got.float() - want_bf16).abs() <= ulp).all()


@pytest.mark.parametrize(("dtype", "N"), [(torch.float32, 21), (torch.bfloat16, 4)])
def test_mhc_expand_site_is_expand_then_site(dtype, N):
    X, pre_in, p, w, y = _site_inputs(N, 64, seed=13, dtype=dtype)
    _, post, C, _ = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    got = td.mhc_expand_site(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    X2 = td.hc_expand(y, X, post, C)
    want = (X2, *td.mhc_site(X2, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS))
    assert len(got) == 5
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.fixture
def split_form(monkeypatch):
    """The split decode form up to 16 tokens, 32 lanes per first-pass program (3 programs per
    token at D = 96, 2 at 64), finished by its last program (the shipped form; the two-launch
    form is held to its bits by the test after these)."""
    monkeypatch.setattr(td, "SITE_CONFIGS", [(16, ("split", 1, 32, 1)), SMALL_SITE_CONFIGS[-1]])
    monkeypatch.setattr(td, "SPLIT_LANES", 32)
    monkeypatch.setattr(td, "SPLIT_ONE_LAUNCH", True)


def test_split_site_lanes():
    assert td.split_lanes(1024, 128) == (128, 8)
    assert td.split_lanes(96, 32) == (128, 1)
    assert td.split_lanes(96, 256) == (256, 1)


@pytest.mark.parametrize(("N", "D", "peaked"), [(7, 96, False), (5, 64, True)])
def test_split_site_within_the_stated_bound(split_form, N, D, peaked):
    assert td.site_config(N)[0] == "split" and td.split_lanes(D, 32)[1] == D // 32
    test_mhc_site_fp32_within_the_stated_bound(N, D, peaked)


def test_split_site_bf16_sinkhorn_and_epilogues(split_form):
    test_mhc_site_bf16_rounds_where_the_reference_rounds(6)
    test_mhc_site_runs_exactly_the_sinkhorn_iterations(2, 5)
    test_fused_fp8_epilogue_quantizes_the_site_output(torch.bfloat16, 5)
    test_mhc_expand_site_is_expand_then_site(torch.float32, 4)


def test_split_site_one_launch_equals_two_and_leaves_the_counters_zero(monkeypatch):
    monkeypatch.setattr(td, "SITE_CONFIGS", [(16, ("split", 1, 32, 1)), SMALL_SITE_CONFIGS[-1]])
    monkeypatch.setattr(td, "SPLIT_LANES", 32)
    X, pre_in, p, w, y = _site_inputs(5, 96, seed=23)
    _, post, C, _ = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    outs = []
    for one in (True, False):
        monkeypatch.setattr(td, "SPLIT_ONE_LAUNCH", one)
        outs.append(
            td.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
        )
    for a, b in zip(*outs, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert int(td._COUNTERS[X.device][-1].abs().sum()) == 0


def test_split_site_norm_chunk_keeps_the_bits(split_form, monkeypatch):
    # the finishing program's norm pass in 32-lane round trips (3 at D = 96) or one 128-lane
    # trip (its last 32 lanes masked): the same values, codes and scales
    X, pre_in, p, w, y = _site_inputs(5, 96, seed=29)
    _, post, C, _ = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    outs = []
    for lanes in (32, 128):
        monkeypatch.setattr(td, "NORM_CHUNK_LANES", lanes)
        assert td.norm_chunk(96, 32) == lanes
        outs.append(
            td.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
        )
    for a, b in zip(*outs, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    monkeypatch.setattr(td, "NORM_CHUNK_LANES", 8192)
    assert td.norm_chunk(5120, 128) == 8192 and td.norm_chunk(1024, 128) == 1024
    assert td.norm_chunk(64, 32) == 64


def test_split_site_is_batch_invariant(split_form):
    # each token's sums run in the same order whatever the batch: one token alone equals its row
    X, pre_in, p, w, y = _site_inputs(9, 96, seed=21)
    _, post, C, _ = ref.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    full = td.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
    one = td.mhc_expand_site_fp8(
        y[4:5], X[4:5], post[4:5], C[4:5], pre_in[4:5], p, w, HC, ITERS, HC_EPS, NORM_EPS
    )
    for a, b in zip(full, one, strict=True):
        assert torch.equal(_bits(a[4:5]), _bits(b))


def test_split_site_two_tokens_a_program_is_batch_invariant(monkeypatch):
    # the wide widths' form from 17 tokens: a token shares its program with a neighbour, or
    # with a masked row when alone, and gets the same sums either way
    monkeypatch.setattr(td, "SITE_CONFIGS", [(16, ("split", 2, 32, 1)), SMALL_SITE_CONFIGS[-1]])
    monkeypatch.setattr(td, "SPLIT_LANES", 32)
    monkeypatch.setattr(td, "SPLIT_ONE_LAUNCH", True)
    test_split_site_is_batch_invariant(None)


def test_site_falls_back_to_the_reference_outside_the_kernel():
    X, pre_in, p, w, _ = _site_inputs(9, 64, seed=17)
    X64, p64 = X.double(), _p64(p)
    got = td.mhc_site(X64, pre_in.double(), p64, w.double(), HC, ITERS, HC_EPS, NORM_EPS)
    want = ref.mhc_site(X64, pre_in.double(), p64, w.double(), HC, ITERS, HC_EPS, NORM_EPS)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="hc 2"):
        td.mhc_site(X, pre_in, p, w, 2, ITERS, HC_EPS, NORM_EPS)
    y64, post, C = torch.randn(9, 64, dtype=torch.float64), got[1], got[2]
    assert torch.equal(td.hc_expand(y64, X64, post, C), ref.hc_expand(y64, X64, post, C))
    args = (pre_in.double(), p64, w.double(), HC, ITERS, HC_EPS, NORM_EPS)
    got = td.mhc_expand_site_fp8(y64, X64, post, C, *args)
    want = ref.mhc_expand_site_fp8(y64, X64, post, C, *args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))


# --- custom ops and torch.compile -------------------------------------------------------------


def test_custom_ops_pass_opcheck():
    g = torch.Generator().manual_seed(19)
    X, y = torch.randn(1, HC, 32, generator=g), torch.randn(1, 32, generator=g)
    pre_in, post, C = torch.rand(1, HC), torch.rand(1, HC), torch.rand(1, HC, HC)
    p = HcParams(torch.randn(24, HC * 32, generator=g) * 0.1, torch.randn(24), torch.rand(3))
    w = torch.randn(32)
    site = (pre_in, p.fn, p.base, p.scale, w, HC_EPS, NORM_EPS, ITERS)
    ops = torch.ops.v41plan
    torch.library.opcheck(ops.fp8_act_quant, (y, 32))
    torch.library.opcheck(ops.fake_fp8, (y.bfloat16(), 32))
    torch.library.opcheck(ops.hc_expand, (y, X, post, C))
    torch.library.opcheck(ops.mhc_site, (X, *site, 32))
    torch.library.opcheck(ops.mhc_expand_site, (y, X, post, C, *site, 0))


def test_a_layer_of_custom_ops_compiles_without_graph_breaks():
    X, pre_in, p, w, y = _site_inputs(2, 32, seed=23)

    def dense_piece(X, pre_in, w, y):
        pre, post, C, _ = td.mhc_site(X, pre_in, p, w, HC, ITERS, HC_EPS, NORM_EPS)
        X2, f_pre, f_post, f_C, xf = td.mhc_expand_site(
            y, X, post, C, pre, p, w, HC, ITERS, HC_EPS, NORM_EPS
        )
        codes, scales = td.fp8_act_quant(xf)
        return td.hc_expand(td.fake_fp8(xf), X2, f_post, f_C), codes, scales, f_pre

    torch._dynamo.reset()
    explained = torch._dynamo.explain(dense_piece)(X, pre_in, w, y)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    targets = {str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"}
    assert {f"v41plan.{op}" for op in ("mhc_site", "mhc_expand_site", "fp8_act_quant")} <= targets
    assert {"v41plan.hc_expand", "v41plan.fake_fp8"} <= targets
    compiled = torch.compile(dense_piece, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(X, pre_in, w, y), dense_piece(X, pre_in, w, y), strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_torch_and_triton_sets_have_the_same_call_shapes():
    import inspect

    names = [n for n in vars(ref.TorchDense) if not n.startswith("_") and n != "name"]
    assert sorted(names) == sorted(
        n for n in vars(td.TritonDense) if not n.startswith("_") and n != "name"
    )
    for n in names:
        a = inspect.signature(getattr(ref.TorchDense, n))
        b = inspect.signature(getattr(td.TritonDense, n))
        assert list(a.parameters) == list(b.parameters), n


# --- the router kernel ------------------------------------------------------------------------


def _router_case(n, e, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(dtype)
    w = torch.randn(e, d, generator=g) * d**-0.5
    bias = torch.randn(e, generator=g) * 0.1
    return x, w, bias


def _route_ref(x, w, bias, k, norm, scale):
    from types import SimpleNamespace

    from v41plan.model.layers import moe_route

    cfg = SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=scale)
    return moe_route(x, w, bias, cfg)


@pytest.mark.parametrize(
    ("n", "e", "d", "k", "norm", "dtype"),
    [(5, 48, 64, 6, True, torch.float32), (3, 20, 40, 1, True, torch.bfloat16),
     (4, 33, 96, 4, False, torch.float32)],
)  # fmt: skip
def test_router_kernel_matches_moe_route(n, e, d, k, norm, dtype):
    from v41plan.runtime.kernels.triton_router import moe_router

    x, w, bias = _router_case(n, e, d, dtype, seed=e + d)
    ids, wts = moe_router(x, w, bias, k, norm and k > 1, 2.5)
    rids, rwts = _route_ref(x, w, bias, k, norm, 2.5)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids, rids)
    # the scores' sum order is the kernel's: a few float32 ulps
    torch.testing.assert_close(wts, rwts, rtol=4e-6, atol=0)


@pytest.mark.parametrize("d", [64, 72])
def test_router_split_gemv_matches_the_one_kernel_form(monkeypatch, d):
    """The GEMV split over ``D`` slices (a partial last step at 72 lanes), its partials summed
    in split order by the select launch: moe_route's ids and weights, and each row's result
    the same alone as in a batch (the split count follows ``E`` and ``D`` only)."""
    from v41plan.runtime.kernels import triton_router as tr

    x, w, bias = _router_case(3, 40, d, torch.float32, seed=7)
    whole = tr.moe_router(x, w, bias, 6, True, 1.0)
    monkeypatch.setattr(tr, "SPLIT_GATE_ELEMS", 0)
    monkeypatch.setattr(tr, "ROUTER_TILE_ELEMS", 1024)  # 16 lanes a step: several splits
    assert tr.gate_splits(40, d)[0] == -(-d // 16)
    split = tr.moe_router(x, w, bias, 6, True, 1.0)
    rids, rwts = _route_ref(x, w, bias, 6, True, 1.0)
    assert torch.equal(split[0], rids) and torch.equal(whole[0], rids)
    torch.testing.assert_close(split[1], rwts, rtol=4e-6, atol=0)
    alone = tr.moe_router(x[1:2], w, bias, 6, True, 1.0)
    assert torch.equal(alone[0], split[0][1:2]) and torch.equal(alone[1], split[1][1:2])


def test_router_split_counts():
    """The shipped thresholds: medium's gate (48 x 1024) is one kernel, V4.1-Flash widths
    split (32 x 5120: ten 16K-element slices; 384 x 7168: at most ``MAX_GATE_SPLITS``)."""
    from v41plan.runtime.kernels import triton_router as tr

    assert 48 * 1024 <= tr.SPLIT_GATE_ELEMS < 32 * 5120
    assert tr.gate_splits(32, 5120) == (10, 512, 512)
    splits, lanes, block_d = tr.gate_splits(384, 7168)
    assert splits <= tr.MAX_GATE_SPLITS and splits * lanes >= 7168 and lanes % block_d == 0


def test_router_ties_go_to_the_smaller_expert_and_softplus_keeps_its_tails():
    from v41plan.runtime.kernels.triton_router import moe_router

    d = 16
    x = torch.ones(2, d)
    # scores -30 .. 30 by expert (softplus' log1p tail and its pass-through above 20), and
    # experts 3/4 and 9/10 tied
    s = torch.linspace(-30, 30, 12)
    s[4], s[10] = s[3], s[9]
    w = (s / d)[:, None].expand(12, d).contiguous()
    bias = torch.zeros(12)
    ids, wts = moe_router(x, w, bias, 12, False, 1.0)
    rids, rwts = _route_ref(x, w, bias, 12, False, 1.0)
    assert torch.equal(ids, rids)
    assert ids[0].tolist().index(3) < ids[0].tolist().index(4)
    torch.testing.assert_close(wts, rwts, rtol=4e-6, atol=0)
    assert float(wts[0, -1]) > 0  # sqrt(log1p(exp(-30))) ~ 3e-7, not 0


def test_router_refuses_what_it_cannot_route():
    from v41plan.runtime.kernels.triton_router import moe_router

    x, w, bias = _router_case(2, 8, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="float32"):
        moe_router(x, w.half(), bias, 2, True, 1.0)
    with pytest.raises(ValueError, match="k=9"):
        moe_router(x, w, bias, 9, True, 1.0)
    ids, wts = moe_router(x[:0], w, bias, 2, True, 1.0)
    assert ids.shape == (0, 2) and wts.shape == (0, 2)


def test_router_custom_op_passes_opcheck_and_compiles_whole():
    from v41plan.runtime.kernels import ops

    x, w, bias = _router_case(3, 16, 32, torch.float32, seed=3)
    ops.register()
    torch.library.opcheck(torch.ops.v41plan.moe_router, (x, w, bias, 4, True, 1.5))

    def route(x, w, bias):
        return ops.moe_router(x, w, bias, 4, True, 1.5)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(route)(x, w, bias)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    rids, rwts = _route_ref(x, w, bias, 4, True, 1.5)
    ids, wts = torch.compile(route, backend="aot_eager", fullgraph=True)(x, w, bias)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(wts, rwts, rtol=4e-6, atol=0)


# --- the window-KV epilogue -------------------------------------------------------------------


def _norm_rope_case(n, d, rd, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(n, d, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    ang = torch.rand(n, rd // 2, generator=g) * 6.3
    return y, w, torch.cos(ang), torch.sin(ang)


@pytest.mark.parametrize(("dtype", "n"), [(torch.float32, 5), (torch.bfloat16, 7)])
def test_norm_rope_fp8_within_one_rounding_of_the_composition(dtype, n):
    """The kernel's norm sum and rsqrt are its own: a lane may land one rounding of the stream
    dtype away, and the quantizer then one E4M3 step of its block (never more); nearly every
    lane is equal."""
    y, w, cos, sin = _norm_rope_case(n, 256, 64, dtype, seed=n)
    got = td.norm_rope_fp8(y, w, 1e-6, cos, sin)
    want = ref.norm_rope_fp8(y, w, 1e-6, cos, sin)
    assert got.dtype == dtype and got.shape == y.shape
    equal = (got == want).float().mean()
    assert equal >= 0.98, float(equal)
    blocks = want.float().reshape(n, -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-4 / 448)
    step = 2.0 ** torch.floor(torch.log2(blocks.abs().clamp(min=1e-30))) / 8  # one E4M3 step
    bound = torch.maximum(step, scale * 2.0**-6) * 1.01 + 2 * scale * 2.0**-9
    assert bool(((got.float().reshape(n, -1, 32) - blocks).abs() <= bound).all())


def test_norm_rope_fp8_without_the_quantizer_is_norm_then_rope():
    y, w, cos, sin = _norm_rope_case(4, 128, 32, torch.float32, seed=3)
    with Q.fake_quant(False):
        got = td.norm_rope_fp8(y, w, 1e-6, cos, sin)
        want = ref.norm_rope_fp8(y, w, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)
    # the lanes before the RoPE part are the normed row; the rotation keeps each pair's norm
    torch.testing.assert_close(got[:, :96], want[:, :96], rtol=3e-6, atol=1e-6)
    pairs = got[:, 96:].reshape(4, 16, 2).norm(dim=-1)
    torch.testing.assert_close(pairs, want[:, 96:].reshape(4, 16, 2).norm(dim=-1))


def test_norm_rope_fp8_custom_op_passes_opcheck():
    y, w, cos, sin = _norm_rope_case(3, 64, 16, torch.float32, seed=5)
    torch.library.opcheck(torch.ops.v41plan.norm_rope_fp8, (y, w, 1e-6, cos, sin, True))


# --- the output projection's inverse RoPE and grouped wo_a ------------------------------------


@pytest.mark.parametrize(("dtype", "n"), [(torch.float32, 3), (torch.bfloat16, 5)])
def test_rope_wo_a_matches_the_composition(dtype, n):
    """Inverse RoPE then the grouped product: the RoPE rounds where the composition rounds, the
    products sum in float32 in another order (a few ulps of the output dtype)."""
    g = torch.Generator().manual_seed(n)
    h, d, rd, groups, r = 4, 64, 16, 2, 16
    o = torch.randn(n, h, d, generator=g).to(dtype)
    wo_a = (torch.randn(groups * r, h * d // groups, generator=g) * 0.05).to(dtype)
    ang = torch.rand(n, rd // 2, generator=g) * 6.3
    cos, sin = torch.cos(ang), torch.sin(ang)
    got = td.rope_wo_a(o, cos, sin, wo_a, groups)
    want = ref.rope_wo_a(o, cos, sin, wo_a, groups)
    assert got.dtype == dtype and got.shape == (n, groups * r)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the inverse rotation is applied: without it the product differs at order one
    plain = torch.einsum("ngk,grk->ngr", o.reshape(n, groups, -1).float(),
                         wo_a.reshape(groups, r, -1).float()).reshape(n, -1)  # fmt: skip
    assert float((plain - want.float()).abs().max()) > 10 * tol


def test_rope_wo_a_custom_op_passes_opcheck():
    g = torch.Generator().manual_seed(2)
    o = torch.randn(2, 4, 64, generator=g)
    wo_a = torch.randn(32, 128, generator=g) * 0.05
    ang = torch.rand(2, 8, generator=g)
    torch.library.opcheck(torch.ops.v41plan.rope_wo_a, (o, torch.cos(ang), torch.sin(ang), wo_a, 2))


# --- the output projection's inverse RoPE, laid out for the grouped product -------------------


@pytest.mark.parametrize(("dtype", "n", "groups"), [(torch.float32, 3, 2), (torch.bfloat16, 5, 4)])
def test_inverse_rope_groups_is_the_composition_bit_for_bit(dtype, n, groups):
    """The kernel rounds the rotation where ``apply_rope(inverse=True)`` rounds it (no fused
    multiply-adds) and writes ``[groups, N, H * D / groups]``; a strided ``o`` (a row slice of a
    wider buffer) is read in place."""
    g = torch.Generator().manual_seed(n)
    h, d, rd = 4, 64, 16
    wide = torch.randn(n, h + 2, d, generator=g).to(dtype)
    o = wide[:, 1 : h + 1]
    assert not o.is_contiguous()
    ang = torch.rand(n, rd // 2, generator=g) * 6.3
    cos, sin = torch.cos(ang), torch.sin(ang)
    got = td.inverse_rope_groups(o, cos, sin, groups)
    want = ref.inverse_rope_groups(o, cos, sin, groups)
    assert got.shape == (groups, n, h * d // groups) and got.is_contiguous()
    assert torch.equal(got, want)
    # the rotation ran on the last rd lanes of every head, and only there
    moved = (got != o.reshape(n, groups, -1).transpose(0, 1)).reshape(groups, n, -1, d)
    assert moved[..., d - rd :].any() and not moved[..., : d - rd].any()


def test_inverse_rope_groups_custom_op_passes_opcheck():
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 4, 64, generator=g)
    ang = torch.rand(2, 8, generator=g)
    torch.library.opcheck(
        torch.ops.v41plan.inverse_rope_groups, (o, torch.cos(ang), torch.sin(ang), 2)
    )
