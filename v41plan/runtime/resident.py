"""Layers over resident (published-format) weights: the W8A8 linear and the grouped MoE.

``ResidentLinear`` and ``GroupedMoE`` take the weights ``LoadedCheckpoint.process`` returns,
either arrangement: dequantized tensors (the CPU reference) or ``QuantWeight``s kept as published
(``resident=True``), sliced per rank by ``model.sharding.shard_weights``. Their arithmetic is
``model.layers.Linear`` / ``model.layers.MoE``'s; only the kernels differ:

- ``ResidentLinear``: an FP8 ``QuantWeight`` on CUDA runs ``triton_gemm.w8a8_linear`` (the
  activation quantizer fused into the GEMM); elsewhere the weight is dequantized once and the
  product is ``F.linear(fake_fp8(x, 32), W)``.
- ``GroupedMoE``: routing (``layers.moe_route``), then the routed experts over the selected
  rows only: ``impl="triton"`` W4A8 on the FP4 codes (``triton_moe.grouped_moe_w4a8``, the
  shared expert through ``w8a8_linear`` on the same FP8 input), ``impl="torch"`` the same
  permutation with torch ops on dequantized experts (``moe_torch.grouped_moe_torch``,
  ``torch._grouped_mm`` for bf16 on CUDA). One all-reduce of routed + shared at the end.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from v41plan.model.layers import ONE_RANK, acc_dtype, moe_route, rope_heads
from v41plan.model.quant import QuantWeight, fake_fp8
from v41plan.runtime.kernels.moe_torch import grouped_moe_torch, swiglu


def _dense(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight's values in ``dtype`` (a resident weight dequantized)."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)


def triton_ready(w: Any, device: torch.device, dtype: torch.dtype) -> bool:
    """True where the Triton kernels serve ``w``: a resident weight on CUDA, bf16/fp32 compute."""
    return (
        isinstance(w, QuantWeight)
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float32)
    )


class ResidentGroupedLinear:
    """The output projection's grouped ``wo_a`` on its FP8 weight as published (half the bytes
    of the bf16 values it replaces): ``x [G, N, in/G]`` (each group's rows) -> ``[N, G * r]``
    by ``triton_gemm.w8a16_grouped``, no activation quantizer. ``grouped_linear`` picks it
    where the Triton kernels serve the weight; elsewhere ``wo_a`` is dequantized once."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype):
        if not (triton_ready(weight, weight.device, dtype) and weight.format == "fp8"):
            raise ValueError("ResidentGroupedLinear takes an FP8 QuantWeight on CUDA")
        self.weight, self.dtype = weight, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight shape ``[G * r, in/G]`` (this rank's groups)."""
        return tuple(self.weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, G * r]`` in ``dtype`` (its ``[N, G, r]`` view is what ``wo_b`` reads)."""
        if torch.compiler.is_compiling():  # inside a compiled region: the opaque custom op
            from v41plan.runtime.kernels.ops import w8a16_grouped
        else:
            from v41plan.runtime.kernels.triton_gemm import w8a16_grouped
        return w8a16_grouped(x, self.weight.codes, self.weight.scales, self.dtype)


def grouped_linear(weight: QuantWeight, dtype: torch.dtype):
    """``LayerKernels.grouped_linear``: ``ResidentGroupedLinear`` where the Triton kernels serve
    the FP8 ``wo_a``, else its values in ``dtype`` (the reference's ``bmm`` / einsum)."""
    if triton_ready(weight, weight.device, dtype) and weight.format == "fp8":
        return ResidentGroupedLinear(weight, dtype)
    return _dense(weight, dtype)


class ResidentLinear:
    """``y = fake_fp8(x, 32) @ W^T`` (``act_quant``) or ``x @ W^T``, output in ``dtype``."""

    def __init__(
        self,
        weight: torch.Tensor | QuantWeight,
        dtype: torch.dtype,
        act_quant: bool = True,
        impl: str = "auto",
        quantizer=fake_fp8,
    ):
        self.dtype, self.act_quant = dtype, act_quant
        self.quantizer = quantizer
        """The torch path's activation quantizer (bit-exact with ``quant.fake_fp8``)."""
        dev = weight.device
        if impl == "auto":
            impl = "triton" if triton_ready(weight, dev, dtype) and act_quant else "torch"
        self.impl = impl
        if impl == "triton":
            if not isinstance(weight, QuantWeight) or weight.format != "fp8":
                raise ValueError("ResidentLinear impl='triton' takes an FP8 QuantWeight")
            self.weight: Any = weight
        else:
            self.weight = _dense(weight, dtype)

    @property
    def out_features(self) -> int:
        """Rows of the weight (this rank's share)."""
        return self.weight.shape[0]

    @property
    def reads_codes(self) -> bool:
        """Whether ``quantized`` serves this linear: its input's FP8 codes and E8M0 scales made
        by the producer (the Triton path, with the activation quantizer)."""
        return self.impl == "triton" and self.act_quant

    @property
    def reads_groups(self) -> bool:
        """Whether ``x`` may be ``[N, G, in/G]`` with any row and group strides (the Triton
        GEMM reads it in place; else the caller flattens it)."""
        return self.impl == "triton"

    def __call__(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """``[N, out]`` in ``dtype``; ``rope = (cos, sin, head_dim)`` rotates every head of the
        output (``layers.rope_heads``; in the GEMM's epilogue on the Triton path)."""
        if self.impl == "triton":
            cos, sin, head_dim = rope if rope is not None else (None, None, 0)
            if torch.compiler.is_compiling():  # inside a compiled region: the opaque custom op
                from v41plan.runtime.kernels.ops import w8a8_linear

                return w8a8_linear(
                    x, self.weight.codes, self.weight.scales, self.dtype, cos, sin, head_dim
                )
            from v41plan.runtime.kernels.triton_gemm import w8a8_linear

            return w8a8_linear(x, self.weight.codes, self.weight.scales, self.dtype, rope=rope)
        if self.act_quant:
            x = self.quantizer(x, 32)
        y = F.linear(x.to(self.dtype), self.weight)
        return y if rope is None else rope_heads(y, *rope)

    def quantized(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """The product of an already-quantized input (``act_quant_fp8``: E4M3 ``[N, in]``,
        E8M0 ``[N, in/32]``) on the Triton path: no second quantization."""
        if torch.compiler.is_compiling():  # inside a compiled region: the opaque custom op
            from v41plan.runtime.kernels.ops import w8a8_linear as op

            return op(xq, self.weight.codes, self.weight.scales, self.dtype, x_scales=xs)
        from v41plan.runtime.kernels.triton_gemm import w8a8_linear

        return w8a8_linear(xq, self.weight.codes, self.weight.scales, self.dtype, x_scales=xs)


def stack_fp8(w1: QuantWeight, w2: QuantWeight) -> QuantWeight | None:
    """``w1`` over ``w2`` as one FP8 weight ``[out1 + out2, in]`` (their codes and their 32-row
    scale blocks stacked; ``out1`` a multiple of 32, so no block straddles the two), or None
    where the two do not stack."""
    ok = (
        isinstance(w1, QuantWeight)
        and isinstance(w2, QuantWeight)
        and w1.format == w2.format == "fp8"
        and w1.codes.dim() == w2.codes.dim() == 2
        and w1.shape[1] == w2.shape[1]
        and w1.shape[0] % 32 == 0
        and w1.device == w2.device
    )
    if not ok:
        return None

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # through bytes: not every float8 dtype has a cat kernel
        return torch.cat([a.view(torch.uint8), b.view(torch.uint8)]).view(a.dtype)

    return QuantWeight(cat(w1.codes, w2.codes), cat(w1.scales, w2.scales), "fp8")


JOINT_LINEARS = True
"""Whether ``linear_pair`` joins two linears of one input where it can (off: two products, as
before; ``bench_decode_paths.py``'s ``compiled_separate_linears`` variant times the two)."""


def linear_pair(quantizer=fake_fp8, impl: str = "auto"):
    """``LayerKernels.linear_pair``: where the Triton GEMM serves two FP8 linears of one input
    (``wq_a`` and ``wkv``), one ``ResidentLinear`` over them stacked (``stack_fp8``: one
    quantizer and one GEMM launch instead of two each) and the two linears over its halves;
    elsewhere None (two linears as before). ``impl`` is ``ResidentLinear``'s; forced
    (``"triton"`` under the interpreter, ``"torch"``) the pair is joined there too (tests)."""

    def make(w1, w2, dtype: torch.dtype):
        served = all(triton_ready(w, w.device, dtype) for w in (w1, w2))
        if not JOINT_LINEARS or (impl == "auto" and not served):
            return None  # (checked before stacking: the torch path would dequantize it)
        both = stack_fp8(w1, w2)
        if both is None:
            return None
        joint = ResidentLinear(both, dtype, quantizer=quantizer, impl=impl)
        n1, b1 = w1.shape[0], w1.shape[0] // 32
        halves = (
            QuantWeight(both.codes[:n1], both.scales[:b1], "fp8"),
            QuantWeight(both.codes[n1:], both.scales[b1:], "fp8"),
        )
        lin1, lin2 = (ResidentLinear(h, dtype, quantizer=quantizer, impl=impl) for h in halves)
        return lin1, lin2, joint

    return make


SHARED_EXPERT_STREAM = True
"""Whether the Triton path runs the shared expert (its gate/up and ``w2``) on a side stream of
the device (``SideStream``) while the router and the routed experts' permutation, gate/up and
down run on the current one, joining before the combine that adds it: the same kernels on the
same inputs, so the same bits; in a CUDA graph the two branches become parallel nodes. The
flash_slice decode step on an H100: 11.71 -> 11.39 ms at batch 1, 30.66 -> 30.12 at 64
(``bench_decode_paths.py``'s ``compiled_one_stream`` variant against ``compiled``,
reports/gpu/bench_decode_flash_slice_b*_streams_tma_h100_965b9c7.json). False: one stream."""


class SideStream:
    """A second stream of one CUDA device for work that may overlap the current stream's:
    ``fork()`` runs its block there, after everything queued so far on the current stream;
    ``join()`` makes the current stream wait for it. Each fork starts behind the current
    stream, so a tensor the side stream allocated and the current stream read after a join is
    free for the side stream's next fork to reuse (no ``record_stream``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the side stream, behind the current stream's queued work."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the current stream wait for the side stream's queued work."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


_SIDE_STREAMS: dict[torch.device, SideStream] = {}


def shared_expert_stream(device: torch.device) -> SideStream | None:
    """The side stream the shared expert runs on (``SHARED_EXPERT_STREAM``, CUDA), else None.
    One per device, made at its first use (the warm-up before any capture)."""
    if not SHARED_EXPERT_STREAM or device.type != "cuda":
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = SideStream(device)
    return _SIDE_STREAMS[device]


class GroupedMoE:
    """``model.layers.MoE``'s arithmetic over the selected experts only (see the module doc).

    ``impl``: ``"triton"`` (FP4 ``QuantWeight`` experts: W4A8), ``"torch"`` (dequantized experts,
    any dtype; resident experts are dequantized once here) or ``"auto"`` (Triton where the
    experts are resident on CUDA and the compute dtype is bf16/fp32, else torch). ``mm_impl`` is
    the torch path's grouped product (``moe_torch.grouped_mm``).
    """

    def __init__(
        self,
        cfg: Any,
        w: dict[str, Any],
        prefix: str,
        dtype: torch.dtype,
        tp: Any = ONE_RANK,
        impl: str = "auto",
        mm_impl: str = "auto",
        dot: str | None = None,
        quantizer=fake_fp8,
    ):
        a = acc_dtype(dtype)
        self.quantizer = quantizer
        """The torch path's FP8 activation quantizer (bit-exact with ``quant.fake_fp8``)."""
        p = prefix + ".ffn."
        self.cfg, self.dtype, self.tp, self.dot, self.mm_impl = cfg, dtype, tp, dot, mm_impl
        self.gate_w = w[p + "gate.weight"].to(a)
        self.gate_bias = w[p + "gate.bias"].to(a)
        e1, e3, e2 = (w[p + f"experts.{n}"] for n in ("w1", "w3", "w2"))
        if impl == "auto":
            impl = "triton" if triton_ready(e1, e1.device, dtype) else "torch"
        self.impl = impl
        if impl == "triton":
            if not all(isinstance(e, QuantWeight) and e.format == "fp4" for e in (e1, e3, e2)):
                raise ValueError("GroupedMoE impl='triton' takes FP4 QuantWeight experts")
            self.w1, self.w3, self.w2 = e1, e3, e2
            from v41plan.runtime.kernels.triton_moe import scales_fold

            self.folds = scales_fold(e1, e3, e2)
            """Whether the experts' scales may be folded into the asm decode (``scales_fold``)."""
        else:
            self.w1, self.w3, self.w2 = (_dense(e, dtype) for e in (e1, e3, e2))
        lin = "triton" if impl == "triton" else "torch"
        sw = (w[p + f"shared_experts.w{n}.weight"] for n in (1, 3, 2))
        self.s1, self.s3, self.s2 = (
            ResidentLinear(t, dtype, aq, lin, quantizer) for t, aq in zip(sw, (False, False, True))
        )
        self.limit = cfg.swiglu_limit
        # expert parallel: this rank holds the router's experts [first, first + count)
        self.expert_count = self.w1.shape[0]
        whole = self.expert_count == cfg.n_routed_experts
        self.expert_first = 0 if whole else tp.rank * self.expert_count

    def route(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ``[N, k]``, weights ``[N, k]`` in ``acc``): ``layers.moe_route``; on the Triton
        path without forced ids, one router kernel (``triton_router``; the scores' sum order is
        the kernel's)."""
        if forced_ids is None and self.impl == "triton" and self.gate_w.dtype == torch.float32:
            cfg = self.cfg
            k = cfg.num_experts_per_tok
            args = (x, self.gate_w, self.gate_bias, k, bool(cfg.norm_topk_prob and k > 1),
                    float(cfg.routed_scaling_factor))  # fmt: skip
            if torch.compiler.is_compiling():  # inside a compiled region: the opaque custom op
                from v41plan.runtime.kernels.ops import moe_router
            else:
                from v41plan.runtime.kernels.triton_router import moe_router
            return moe_router(*args)
        return moe_route(x, self.gate_w, self.gate_bias, self.cfg, forced_ids)

    def __call__(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output ``[N, D]`` in dtype, selected expert ids ``[N, k]``)."""
        begun = self.begin(x)
        ids, wts = self.route(x, forced_ids)
        return self.finish(begun, ids, wts), ids

    def shared_expert(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """The Triton path's shared expert on the FP8 input (``act_quant_fp8``'s codes and
        scales): gate/up, SwiGLU and the FP8 codes of ``h`` in one GEMM, then ``w2``."""
        from v41plan.runtime.kernels.triton_gemm import w8a8_swiglu

        w1, w3 = ((s.weight.codes, s.weight.scales) for s in (self.s1, self.s3))
        hq, hs = w8a8_swiglu(xq, xs, w1, w3, self.limit, self.dtype)
        return self.s2.quantized(hq, hs)

    @property
    def reads_codes(self) -> bool:
        """Whether ``begin`` takes ``x``'s FP8 codes and E8M0 scales made before it (the
        Triton path: an mHC site's epilogue quantizes its output as ``act_quant_fp8`` does)."""
        return self.impl == "triton"

    def begin(self, x: torch.Tensor, quantized: tuple | None = None) -> Any:
        """What needs no routing, started before it (``finish`` takes the result): on the
        Triton path the input quantized once (routed and shared experts read it; ``quantized``:
        ``x``'s codes and E8M0 scales, made by its producer, where ``x`` is in ``dtype``) and
        the shared expert launched, on the side stream with ``SHARED_EXPERT_STREAM`` (so it
        overlaps the router too); elsewhere ``x`` itself."""
        if self.impl != "triton":
            return x
        from v41plan.runtime.kernels.triton_quant import act_quant_fp8

        if quantized is not None and x.dtype == self.dtype:
            xq, xs = quantized
        else:
            xq, xs = act_quant_fp8(x.to(self.dtype))
        side = shared_expert_stream(x.device)
        with side.fork() if side is not None else contextlib.nullcontext():
            shared = self.shared_expert(xq, xs)
        return xq, xs, shared, side

    def finish(self, begun: Any, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """Routed + shared experts of a routing (``route``'s ids and weights) from ``begin``'s
        result, the shared expert joined (after the side stream's work, where it ran there),
        all-reduced, ``[N, D]`` in dtype."""
        a = acc_dtype(self.dtype)
        if self.impl == "triton":
            from v41plan.runtime.kernels.triton_moe import grouped_moe_w4a8_stages, moe_combine

            xq, xs, shared, side = begun
            st = grouped_moe_w4a8_stages(
                xq, xs, ids, wts, self.w1, self.w3, self.w2, self.expert_first, self.limit,
                self.dtype, self.dot, folds=self.folds,
            )  # fmt: skip
            if side is not None:
                side.join()
            y = moe_combine(st.y_rows, st.rows.pos, ids.shape[1], shared)
            return self.tp.all_reduce(y).to(self.dtype)
        xq = self.quantizer(begun, 32).to(self.dtype)
        y = grouped_moe_torch(
            xq, ids, wts, self.w1, self.w3, self.w2, self.expert_first, self.limit, self.mm_impl,
            quantizer=self.quantizer,
        )  # fmt: skip
        shared = self.s2(swiglu(self.s1(xq), self.s3(xq), self.limit, a).to(self.dtype))
        # one reduction per layer: routed + shared partials, in acc, rounded after the sum
        return self.tp.all_reduce(y + shared.to(a)).to(self.dtype)
