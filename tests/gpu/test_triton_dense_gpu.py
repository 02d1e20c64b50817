"""The fused dense kernels compiled for the GPU: the FP8 activation quantizer bit-exact with the
reference at the MEDIUM widths, the mHC site and expand within their stated bounds, the custom
ops inside ``torch.compile`` (Inductor) and a CUDA graph.

Skipped without CUDA. Run on a GPU machine with ``python3 -m pytest tests/gpu -q``. The kernels
module is imported inside the tests only, so a CPU run never builds it compiled.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

U = 2.0**-24
HC_EPS, NORM_EPS = 1e-6, 1e-20
# the activation widths of specs/medium.yaml: hidden, q_lora, o_groups * o_lora, head_dim,
# moe_intermediate, the Engram key width; and the published hidden size
WIDTHS = (1024, 384, 512, 256, 6144, 5120)


@functools.cache
def _mods():
    from v41plan.model import quant as Q
    from v41plan.model.layers import HcParams
    from v41plan.runtime.kernels import dense_ref, triton_dense

    assert not triton_dense.INTERPRETED, "run tests/gpu without TRITON_INTERPRET"
    return Q, HcParams, dense_ref, triton_dense


@functools.cache
def _medium():
    """(hidden, hc, Sinkhorn iterations) of the MEDIUM spec."""
    from v41plan.model.config import config_from_cache_spec
    from v41plan.serving.engine import resolve_spec

    cfg = config_from_cache_spec(resolve_spec("medium"))
    return cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(view[t.element_size()])


def _activations(rows: int, K: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows over 1e-30..1e30 plus an all-zero row, a floored row and exact E4M3 ties."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, generator=g, device="cuda")
    x = x * torch.logspace(-30, 30, rows, device="cuda")[:, None]
    if rows >= 4:
        x[0] = 0.0
        x[1] *= 1e-8
        codes = torch.arange(0, 127, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        v = codes.float()
        mids = torch.cat([(v[1:] + v[:-1]) / 2, -(v[1:] + v[:-1]) / 2])
        ties = mids.repeat(-(-K // len(mids)))[:K].reshape(-1, 32)
        ties[:, 0] = 448.0  # scale 1 in every block
        x[2] = ties.reshape(K)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", WIDTHS)
def test_fp8_quantizer_is_bit_exact_at_medium_widths(K, dtype):
    Q, _, ref, td = _mods()
    for rows in (1, 7, 64, 2048):
        x = _activations(rows, K, dtype, seed=K + rows)
        xc = x.cpu()
        want = Q.fake_fp8(xc)
        got = td.fake_fp8(x)
        assert torch.equal(_bits(got.cpu()), _bits(want)), (K, rows)
        codes, scales = td.fp8_act_quant(x)
        want_codes, want_scales = ref.fp8_act_quant(xc)
        assert torch.equal(_bits(codes.cpu()), _bits(want_codes)), (K, rows)
        assert torch.equal(_bits(scales.cpu()), _bits(want_scales)), (K, rows)
        # the device reference agrees too (torch's CUDA division and rounding are IEEE)
        assert torch.equal(_bits(Q.fake_fp8(x)), _bits(got))


def _site_inputs(N: int, D: int, hc: int, dtype: torch.dtype, seed: int):
    _, HcParams, _, _ = _mods()
    g = torch.Generator(device="cuda").manual_seed(seed)
    X = torch.randn(N, hc, D, generator=g, device="cuda")
    X[0] = 0.0
    if N > 2:
        X[1] *= 1e-20
        X[2] *= 1e12
    pre_in = torch.rand(N, hc, generator=g, device="cuda") + HC_EPS
    mixes = (2 + hc) * hc
    p = HcParams(
        torch.randn(mixes, hc * D, generator=g, device="cuda") * 0.02,
        torch.randn(mixes, generator=g, device="cuda"),
        torch.tensor([0.7, 1.3, 4.0], device="cuda"),
    )
    w = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(dtype)
    y = torch.randn(N, D, generator=g, device="cuda").to(dtype)
    return X.to(dtype), pre_in, p, w, y


def _p64(p):
    _, HcParams, _, _ = _mods()
    return HcParams(p.fn.double(), p.base.double(), p.scale.double())


def _ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place of ``t`` (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t), torch.frexp(t)[1] - 8)


def _rowmax(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).amax(-1)


def _assert_site_within_bound(X, pre_in, p, w, out, dtype) -> None:
    """``out = (pre, post, C, x)`` of a site over ``X`` within the stated bounds of the float64
    reference (mix GEMM terms for the prediction; the collapse terms for ``x``)."""
    _, _, ref, td = _mods()
    D, hc, iters = _medium()
    N = X.shape[0]
    pre, post, C, x = out
    X64 = X.double()
    want = ref.mhc_site(X64, pre_in.double(), _p64(p), w.double(), hc, iters, HC_EPS, NORM_EPS)
    f = X64.reshape(N, -1)
    r = torch.rsqrt(f.pow(2).mean(-1) + NORM_EPS)
    c = td.mix_error_terms(N, f.shape[1])
    E = c * U * r * (f.abs() @ p.fn.double().abs().T).amax(-1)
    s = p.scale.double().abs()
    assert (_rowmax((pre - want[0]).abs()) <= s[0] * E / 4 + 16 * U).all()
    assert (_rowmax((post - want[1]).abs()) <= s[1] * E / 2 + 32 * U).all()
    assert (_rowmax((C - want[2]).abs()) <= 4 * s[2] * E + 64 * U * iters).all()
    terms = pre_in.double()[..., None] * X64
    rx = torch.rsqrt(terms.sum(1).pow(2).mean(-1, keepdim=True) + NORM_EPS)
    bound = 8 * U * rx * w.double().abs() * terms.abs().sum(1) + (D / 2 + 8) * U * want[3].abs()
    if dtype == torch.bfloat16:
        # as the model rounds (hc_collapse and rms_norm return the stream dtype), three bf16
        # roundings of relative size 2**-8 at most: the collapse (it scales x directly), the
        # collapse again inside the sum of squares (rsqrt halves its 2**-7), and the output
        bound = bound + 3.1 * 2.0**-8 * (want[3].abs() + bound)
    err = (x.double() - want[3]).abs()
    assert (err <= bound).all(), f"x: worst error / bound {float((err / bound).max()):.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 16, 64, 300, 2048])
def test_mhc_site_within_the_stated_bound(N, dtype):
    # up to 1024 tokens: one per program (per-lane products); more: the tf32x3 tl.dot form
    _, _, _, td = _mods()
    D, hc, iters = _medium()
    X, pre_in, p, w, _ = _site_inputs(N, D, hc, dtype, seed=N)
    out = td.mhc_site(X, pre_in, p, w, hc, iters, HC_EPS, NORM_EPS)
    _assert_site_within_bound(X, pre_in, p, w, out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 64, 2048])
def test_fused_epilogue_and_expand(N, dtype):
    _, _, ref, td = _mods()
    D, hc, iters = _medium()
    X, pre_in, p, w, y = _site_inputs(N, D, hc, dtype, seed=N + 1)
    pre, post, C, x, codes, scales = td.mhc_site_fp8(X, pre_in, p, w, hc, iters, HC_EPS, NORM_EPS)
    want_codes, want_scales = ref.fp8_act_quant(x.cpu())
    assert torch.equal(_bits(codes.cpu()), _bits(want_codes))
    assert torch.equal(_bits(scales.cpu()), _bits(want_scales))
    got = td.hc_expand(y, X, post, C)
    want = ref.hc_expand(y.double(), X.double(), post.double(), C.double())
    mag = torch.einsum("nij,nid->njd", C.double(), X.double().abs())
    mag = mag + post.double()[..., None] * y.double().abs()[:, None]
    bound = 8 * U * mag
    if dtype == torch.bfloat16:
        bound = bound + _ulp_bf16(want)  # fp32 arithmetic, one rounding to bf16
    assert ((got.double() - want).abs() <= bound).all()
    fused = td.mhc_expand_site(y, X, post, C, pre, p, w, hc, iters, HC_EPS, NORM_EPS)
    # the fused expand is the plain one (the same fp32 expression, one rounding) and its site
    # is within the site's bounds over the streams it produced
    assert ((fused[0].double() - want).abs() <= bound).all()
    _assert_site_within_bound(fused[0], pre, p, w, fused[1:], dtype)
    ffn = td.mhc_expand_site_fp8(y, X, post, C, pre, p, w, hc, iters, HC_EPS, NORM_EPS)
    for a, b in zip(ffn[:5], fused, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    want_codes, want_scales = ref.fp8_act_quant(ffn[4].cpu())
    assert torch.equal(_bits(ffn[5].cpu()), _bits(want_codes))
    assert torch.equal(_bits(ffn[6].cpu()), _bits(want_scales))
    # E8M0 scale bytes (what the W8A8 GEMM reads): act_quant_fp8's codes and scales
    from v41plan.runtime.kernels.triton_quant import act_quant_fp8

    args = (hc, iters, HC_EPS, NORM_EPS)
    site = td.mhc_site_fp8(X, pre_in, p, w, *args, e8m0=True)
    ffn = td.mhc_expand_site_fp8(y, X, post, C, pre, p, w, *args, e8m0=True)
    for got in (site[3:], ffn[4:]):
        want_q, want_s = act_quant_fp8(got[0])
        assert torch.equal(_bits(got[1]), _bits(want_q))
        assert torch.equal(got[2].view(torch.uint8), want_s.view(torch.uint8))


@pytest.mark.parametrize("N", [1, 5, 16])
def test_split_site_one_launch_equals_two_launches_in_a_graph(N, monkeypatch):
    """The split site finished by its last program (one launch) gives the two-launch form's
    bits, every time (50 eager calls and 50 graph replays: a missed ordering between the
    programs would show as a stale partial), and leaves its arrival counters zero."""
    _, _, _, td = _mods()
    D, hc, iters = _medium()
    assert td.site_config(N)[0] == "split"
    X, pre_in, p, w, y = _site_inputs(N, D, hc, torch.bfloat16, seed=N + 7)
    _, post, C, _ = td.mhc_site(X, pre_in, p, w, hc, iters, HC_EPS, NORM_EPS)

    def site():
        return td.mhc_expand_site_fp8(y, X, post, C, pre_in, p, w, hc, iters, HC_EPS, NORM_EPS)

    monkeypatch.setattr(td, "SPLIT_ONE_LAUNCH", False)
    want = [_bits(t).clone() for t in site()]
    monkeypatch.setattr(td, "SPLIT_ONE_LAUNCH", True)
    for _ in range(50):
        for a, b in zip(site(), want, strict=True):
            assert torch.equal(_bits(a), b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        site()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = site()
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, want, strict=True):
            assert torch.equal(_bits(a), b)
    assert int(td._COUNTERS[X.device][-1].abs().sum()) == 0


def test_custom_ops_compile_with_inductor_and_capture_in_a_graph():
    _, _, _, td = _mods()
    D, hc, iters = _medium()
    X, pre_in, p, w, y = _site_inputs(64, D, hc, torch.bfloat16, seed=5)

    def piece(X, pre_in, y):
        pre, post, C, x = td.mhc_site(X, pre_in, p, w, hc, iters, HC_EPS, NORM_EPS)
        X2, f_pre, f_post, f_C, xf = td.mhc_expand_site(
            y, X, post, C, pre, p, w, hc, iters, HC_EPS, NORM_EPS
        )
        codes, scales = td.fp8_act_quant(xf)
        return td.hc_expand(td.fake_fp8(x), X2, f_post, f_C), codes, scales, f_pre

    eager = piece(X, pre_in, y)
    torch._dynamo.reset()
    compiled = torch.compile(piece, fullgraph=True)
    for a, b in zip(compiled(X, pre_in, y), eager, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        piece(X, pre_in, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = piece(X, pre_in, y)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager, strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize(
    ("n", "e", "d", "k"),
    [(1, 48, 1024, 6), (64, 48, 1024, 6), (8, 384, 4096, 6), (1, 32, 5120, 6), (64, 32, 5120, 6)],
)
def test_router_kernel_matches_moe_route_on_cuda(n, e, d, k):
    """The one-kernel router against ``layers.moe_route`` (cuBLAS float32 GEMV, sort, gathers):
    the same ids wherever the top-k has no near tie, weights within a few float32 ulps (the
    scores' sum order differs). The last three shapes take the GEMV split over ``D``."""
    from types import SimpleNamespace

    from v41plan.model.layers import moe_route
    from v41plan.runtime.kernels.triton_router import moe_router

    g = torch.Generator(device="cuda").manual_seed(n + e)
    x = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(e, d, device="cuda", generator=g) * d**-0.5
    bias = torch.randn(e, device="cuda", generator=g) * 0.1
    cfg = SimpleNamespace(num_experts_per_tok=k, norm_topk_prob=True, routed_scaling_factor=2.5)
    rids, rwts = moe_route(x, w, bias, cfg)
    ids, wts = moe_router(x, w, bias, k, True, 2.5)
    s = torch.sqrt(torch.nn.functional.softplus(x.float() @ w.T)) + bias
    top = torch.sort(s, dim=1, descending=True).values
    clear = (top[:, : k - 1] - top[:, 1:k]).amin(1) > 1e-4  # rows without a near tie
    clear &= top[:, k - 1] - top[:, k] > 1e-4
    assert torch.equal(ids[clear], rids[clear]) and int(clear.sum()) >= n // 2
    torch.testing.assert_close(wts[clear], rwts[clear], rtol=2e-5, atol=0)
    # batch invariance, bit for bit: a row's scores alone as in the batch
    alone = moe_router(x[n - 1 :], w, bias, k, True, 2.5)
    assert torch.equal(alone[0], ids[n - 1 :]) and torch.equal(alone[1], wts[n - 1 :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_fp8_within_one_rounding_on_cuda(dtype):
    """The window-KV epilogue kernel at the medium head width (512 lanes, 64 RoPE lanes)
    against the composition: almost every lane equal, none more than one E4M3 step away."""
    _, _, dense_ref, td = _mods()
    n, d, rd = 64, 512, 64
    g = torch.Generator(device="cuda").manual_seed(11)
    y = (torch.randn(n, d, device="cuda", generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    ang = torch.rand(n, rd // 2, device="cuda", generator=g) * 6.3
    cos, sin = torch.cos(ang), torch.sin(ang)
    got = td.norm_rope_fp8(y, w, 1e-6, cos, sin)
    want = dense_ref.norm_rope_fp8(y, w, 1e-6, cos, sin)
    assert float((got == want).float().mean()) >= 0.98
    blocks = want.float().reshape(n, -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-4 / 448)
    step = 2.0 ** torch.floor(torch.log2(blocks.abs().clamp(min=1e-30))) / 8
    bound = torch.maximum(step, scale * 2.0**-6) * 1.01 + 2 * scale * 2.0**-9
    assert bool(((got.float().reshape(n, -1, 32) - blocks).abs() <= bound).all())


def test_compiled_engram_row_ids_equal_eager():
    """The Engram n-gram hashing under Inductor (integer products that wrap, xor, Python-style
    remainder) gives the eager row ids exactly."""
    import numpy as np

    from v41plan.model.checkpoint import LoadedCheckpoint, random_state
    from v41plan.model.config import config_from_cache_spec
    from v41plan.runtime import compiled
    from v41plan.runtime.engram_device import DeviceEngram
    from v41plan.serving.engine import resolve_spec

    cfg = config_from_cache_spec(resolve_spec("tiny"))
    dev = DeviceEngram(LoadedCheckpoint.from_state(cfg, random_state(cfg, 0)).engram_host(), "cuda")
    rng = np.random.default_rng(5)
    t, b = 37, 3
    tok = torch.as_tensor(rng.integers(0, cfg.vocab_size, t), device="cuda")
    bid = torch.as_tensor(np.sort(rng.integers(-1, b, t)), device="cuda")
    row0 = torch.as_tensor([0, 10, 20], device="cuda")
    hist = torch.as_tensor(rng.integers(0, 1 << 20, (b, dev.history_len)), device="cuda")
    want = dev.row_ids(tok, bid, row0, hist)
    got = compiled.DensePieces("inductor").engram_rows(dev, tok, bid, row0, hist)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 64])
def test_rope_wo_a_matches_the_composition_on_cuda(dtype, n):
    """The output projection's inverse RoPE and grouped ``wo_a`` at the medium widths (16 heads
    of 512, 4 groups of rank 256) against the composition (cuBLAS product)."""
    _, _, dense_ref, td = _mods()
    g = torch.Generator(device="cuda").manual_seed(n)
    o = torch.randn(n, 16, 512, device="cuda", generator=g).to(dtype)
    wo_a = (torch.randn(1024, 2048, device="cuda", generator=g) * 0.02).to(dtype)
    ang = torch.rand(n, 32, device="cuda", generator=g) * 6.3
    cos, sin = torch.cos(ang), torch.sin(ang)
    got = td.rope_wo_a(o, cos, sin, wo_a, 4).float()
    want = dense_ref.rope_wo_a(o, cos, sin, wo_a, 4).float()
    rel = float((got - want).norm() / want.norm())
    assert rel <= {torch.float32: 1e-5, torch.bfloat16: 4e-3}[dtype], rel


@pytest.mark.parametrize(
    ("dtype", "n"), [(torch.float32, 3), (torch.bfloat16, 1), (torch.bfloat16, 64)]
)
def test_inverse_rope_groups_is_the_composition_on_cuda(dtype, n):
    """At the MEDIUM widths (16 heads of 512, 64 rope lanes, 4 groups): the kernel's rotation
    rounds where ``apply_rope(inverse=True)``'s torch kernels round (no fused multiply-adds),
    bit for bit, eager and replayed in a CUDA graph."""
    _, _, ref, td = _mods()
    g = torch.Generator(device="cuda").manual_seed(n)
    h, d, rd, groups = 16, 512, 64, 4
    o = torch.randn(n, h, d, generator=g, device="cuda").to(dtype)
    ang = torch.rand(n, rd // 2, generator=g, device="cuda") * 1000.0
    cos, sin = torch.cos(ang), torch.sin(ang)
    want = ref.inverse_rope_groups(o, cos, sin, groups)
    got = td.inverse_rope_groups(o, cos, sin, groups)
    assert torch.equal(_bits(got), _bits(want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = td.inverse_rope_groups(o, cos, sin, groups)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(_bits(out), _bits(want))
