"""``compilation_level=3`` on the CPU: the dense pieces under ``torch.compile`` trace whole
(``fullgraph=True``: a graph break raises), give the eager pieces' logits bit for bit with a
backend that generates no code, and compile a bounded number of graphs however many prompt
lengths follow. ``tests/gpu/test_compiled_gpu.py`` runs them through Inductor."""

from __future__ import annotations

import pytest
import torch

from v41plan.runtime import compiled
from v41plan.serving import admission

from .paged_helpers import model, runtime, token_ids
from .test_fast_paths import _prefill_decode


@pytest.mark.parametrize("moe", ["dense", "grouped"])
def test_compiled_pieces_equal_eager_without_recompiles(moe):
    """float64, ``aot_eager`` (dynamo + AOTAutograd, the graphs Inductor would receive): every
    prefill and decode logit equals the eager model's; after the first prompt length (its
    prefill compiles each region for any width, its decode step for one row) a new length
    compiles nothing."""
    spec = model("tiny")[0]
    ref = runtime("tiny", "bf16", "fp8", moe=moe)
    fast = runtime("tiny", "bf16", "fp8", moe=moe, compile_backend="aot_eager")
    assert fast.pieces.compiled and not ref.pieces.compiled
    counts = [fast.pieces.graphs]
    for n in (21, 13, 30):
        ids = token_ids(n + 1, 3)
        ra, rb, rex = _prefill_decode(ref, spec, ids)
        fa, fb, fex = _prefill_decode(fast, spec, ids)
        assert torch.equal(ra, fa) and torch.equal(rb, fb), n
        assert all(torch.equal(rex[L], fex[L]) for L in rex)
        counts.append(fast.pieces.graphs)
    assert counts[1] > counts[0] or moe == "grouped"  # the first test compiles the shared ones
    assert counts[1] == counts[2] == counts[3], counts  # lengths 13 and 30: no new graph


def test_compile_backends_agree_with_admission():
    assert admission.COMPILE_BACKENDS == compiled.COMPILE_BACKENDS
    with pytest.raises(ValueError, match="compile backend 'tvm'"):
        compiled.DensePieces("tvm")


def test_w8a8_custom_op_has_a_shape_function():
    """The resident W8A8 GEMM is opaque to the compiler: its fake implementation gives the
    output's shape and dtype without running the kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from v41plan.runtime.kernels import ops

    ops.register()
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        codes = torch.empty(96, 64, dtype=torch.float8_e4m3fn)
        scales = torch.empty(3, 2, dtype=torch.uint8)
        y = torch.ops.v41plan.w8a8_linear(x, codes, scales, torch.bfloat16)
    assert tuple(y.shape) == (5, 96) and y.dtype == torch.bfloat16


def test_engine_level_3_generates_level_0_tokens():
    """The engine with ``compilation_level=3`` (``aot_eager`` on the CPU: no code generation)
    generates the level-0 tokens, and reports what it compiled."""
    from v41plan.serving.engine import LLM
    from v41plan.serving.sampling import SamplingParams

    spec = model("tiny")[0]
    prompts = [list(token_ids(37, 7)), list(token_ids(19, 8))]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    toks = []
    for level in (0, 3):
        llm = LLM(
            spec, None, device="cpu", dtype="float64", max_num_seqs=2,
            compilation_level=level, compile_backend="aot_eager",
        )  # fmt: skip
        assert llm.runner.kernels["compilation_level"] == level
        assert llm.runner.model.pieces.compiled == (level == 3)
        toks.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        if level == 3:
            assert llm.runner.model.pieces.graphs > 0
    assert [len(t) for t in toks[0]] == [5, 5]
    assert toks[0] == toks[1]


def test_fused_dense_custom_ops_fake_layouts_match_on_strided_inputs():
    """The fused dense kernels' custom ops (called inside compiled regions when a layer holds
    them) declare the layout they return: contiguous, whatever the input's strides (Inductor
    asserts the declared strides; a permuted MoE intermediate once tripped it on the GPU)."""
    from v41plan.runtime.kernels import triton_dense  # noqa: F401 - registers the ops

    x = torch.randn(40, 8, 128, dtype=torch.float32).permute(1, 0, 2)
    checks = ("test_faketensor",)  # the layout check; the others recompile for minutes
    torch.library.opcheck(torch.ops.v41plan.fake_fp8.default, (x, 32), test_utils=checks)
    y = torch.randn(6, 64)
    X = torch.randn(4, 6, 64).transpose(0, 1)
    post, C = torch.rand(6, 4), torch.rand(6, 4, 4)
    torch.library.opcheck(torch.ops.v41plan.hc_expand.default, (y, X, post, C), test_utils=checks)


def test_inductor_rounds_where_the_arithmetic_rounds():
    """Inductor (its CPU code generation here) keeps every cast to bf16 the published arithmetic
    makes (``emulate_precision_casts``): the bf16 window-KV piece equals the eager piece bit for
    bit. Fused kernels would otherwise keep the intermediates in float32, and about one lane in
    250 then lands on another FP8 value."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("Inductor's CPU code generation needs a C++ compiler")
    from tests.gpu.test_compiled_gpu import _Recorder

    from .paged_helpers import step

    spec = model("tiny")[0]
    m = runtime("tiny", "bf16", "fp8", dtype=torch.bfloat16)
    rec = _Recorder(m.pieces)
    m.pieces = rec
    ids = token_ids(21, 3)
    m.reset_slot(0)
    m.forward(step(spec, [(0, range(8), 20, 0, 20, "prefill", True)]), ids[:20])
    _, args, want = next(c for c in rec.calls if c[0] == "window_kv")
    got = compiled.DensePieces("inductor").window_kv(*args)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want[0])


def test_head_keeps_the_published_bf16_weight_in_float32_arithmetic():
    """Under bf16 compute the LM head stays as published (bf16, half the bytes): bf16 rows times
    bf16 weights are exact float32 products, so the logits are the float32 head's. On the CPU
    they equal ``F.linear`` over the float32 head bit for bit, eagerly and through the compiled
    region (the custom op's fake gives ``[N, V]`` float32); other compute dtypes keep the
    head in theirs."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from v41plan.runtime.kernels import ops

    m = runtime("tiny", "bf16", "fp8", dtype=torch.bfloat16)
    assert m.head.dtype == torch.bfloat16
    assert runtime("tiny", "bf16", "fp8").head.dtype == torch.float64  # float64 compute
    D, V = m.head.shape[1], m.head.shape[0]
    g = torch.Generator().manual_seed(3)
    X = torch.randn(5, m.cfg.hc_mult, D, generator=g).to(torch.bfloat16)
    pre = torch.rand(5, m.cfg.hc_mult, generator=g)
    eps = m.cfg.rms_norm_eps
    x = compiled.rms_norm(compiled.hc_collapse(X, pre), m.norm, eps)
    want = F.linear(x.float(), m.head.float())
    got = compiled.head(X, pre, m.norm, m.head, eps)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(ops.head_logits(x[None], m.head)[0], want)  # leading dims kept
    traced = compiled.DensePieces("aot_eager").head(X, pre, m.norm, m.head, eps)
    assert torch.equal(traced, want)
    with FakeTensorMode():
        w = torch.empty(V, D, dtype=torch.bfloat16)
        y = torch.ops.v41plan.head_logits(torch.empty(7, D, dtype=torch.bfloat16), w)
    assert tuple(y.shape) == (7, V) and y.dtype == torch.float32
