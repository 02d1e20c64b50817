"""Exact V4.1 quantizers, storage-format packing and weight dequantization.

Every fake quantizer returns values on its grid in the input's dtype (bf16, float32 or float64);
the grids are exactly representable in bf16, so caches may hold them in bf16 buffers. Block
scales are always computed in float32, as the published kernels do. Rounding is done by
explicit arithmetic (``frexp``/``ldexp`` and round-half-even), so float32 and float64 inputs
round identically and no dtype cast can round twice.

``set_fake_quant(False)`` / ``fake_quant(False)`` turn the activation and cache quantizers off
(for float64 parity tests); weight storage formats are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by code (bit 3 is the sign)."""

_ENABLED = True


def set_fake_quant(enabled: bool) -> None:
    """Turn the fake (activation/cache) quantizers on or off globally."""
    global _ENABLED
    _ENABLED = bool(enabled)


def fake_quant_enabled() -> bool:
    """True when the fake quantizers round (the default)."""
    return _ENABLED


@contextlib.contextmanager
def fake_quant(enabled: bool) -> Iterator[None]:
    """Context manager form of ``set_fake_quant``; restores the previous setting."""
    prev = _ENABLED
    set_fake_quant(enabled)
    try:
        yield
    finally:
        set_fake_quant(prev)


# --- primitives ----------------------------------------------------------------------------


def pow2ceil(a: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(a))`` for positive normal float32 ``a``, from the fp32 bit pattern."""
    bits = a.to(torch.float32).contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantizer arithmetic runs in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_minifloat(y: torch.Tensor, mant_bits: int, min_exp: int, max_val: float) -> torch.Tensor:
    """Round to a sign-magnitude minifloat grid, nearest, ties to even; saturates at ``max_val``.

    Runs in float32 (float64 for float64 input) and returns that dtype.
    """
    y = y.to(_acc(y.dtype)).clamp(-max_val, max_val)
    _, e = torch.frexp(y)  # |y| = m * 2**e with m in [0.5, 1): floor(log2|y|) = e - 1
    e = torch.clamp(e - 1, min=min_exp)
    step_exp = (e - mant_bits).to(torch.int32)
    q = torch.round(torch.ldexp(y, -step_exp))  # exact scaling by a power of two
    return torch.ldexp(q, step_exp).clamp(-max_val, max_val)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 the same way on every device: float64 through float32 first.

    The CPU's float64 -> bf16 cast rounds through float32; CUDA's rounds once. Fixing the
    path keeps bf16 pool bytes identical across devices."""
    return (x.to(torch.float32) if x.dtype == torch.float64 else x).to(torch.bfloat16)


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to the E4M3 (fn) grid: round-to-nearest-even, saturating at +-448."""
    return _round_minifloat(y, 3, -6, E4M3_MAX)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}: nearest, ties to the even code."""
    return _round_minifloat(y, 1, 0, E2M1_MAX)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def div_rn(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` correctly rounded on every device. A Python number (a CPU scalar) as divisor
    makes torch's CUDA kernel multiply by its rounded reciprocal instead, one ulp off at times
    (measured on the H200: FP8 index scales one ulp apart from the CPU's)."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


def _amax(xb: torch.Tensor, floor: float) -> torch.Tensor:
    return xb.abs().amax(-1, keepdim=True).to(torch.float32).clamp_min(floor)


# --- fake quantizers (activations and caches) ---------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized value exactly; backward: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, quantize) -> torch.Tensor:
    """``quantize(x)``, differentiable as the identity when ``x`` needs a gradient (training's
    straight-through estimator); plain ``quantize(x)`` otherwise."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return quantize(x)
    return _StraightThrough.apply(x, quantize(x.detach()))


def _ste(fn):
    """Make a fake quantizer straight-through under autograd (same forward values)."""

    def wrapped(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return straight_through(x, lambda v: fn(v, *args, **kwargs))

    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    wrapped.__wrapped__ = fn
    return wrapped


@_ste
def fake_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 with one pow2 (ue8m0) scale per ``block`` lanes, dequantized (``act_quant``)."""
    if not _ENABLED:
        return x
    xb = _blocks(x, block).to(_acc(x.dtype))
    s = pow2ceil(div_rn(_amax(xb, FP8_AMAX_FLOOR), E4M3_MAX)).to(xb.dtype)
    y = xb / s
    # one cast rounds float32 exactly as round_e4m3 (about 4x faster); float64 would round
    # through float32 first, so it keeps the explicit rounding
    q = round_e4m3(y) if y.dtype == torch.float64 else _cast_e4m3(y).to(y.dtype)
    return (q * s).reshape(x.shape).to(x.dtype)


@_ste
def fake_fp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 E2M1 with one E8M0 (pow2) scale per ``block`` lanes (index q and k), dequantized."""
    if not _ENABLED:
        return x
    xb = _blocks(x, block).to(_acc(x.dtype))
    s = pow2ceil(div_rn(_amax(xb, FP4_E8M0_AMAX_FLOOR), E2M1_MAX)).to(xb.dtype)
    return (round_e2m1(xb / s) * s).reshape(x.shape).to(x.dtype)


@_ste
def fake_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 E2M1 with one E4M3 scale per ``block`` lanes (compressed main KV), dequantized."""
    if not _ENABLED:
        return x
    xb = _blocks(x, block)
    s = round_e4m3(div_rn(_amax(xb, FP4_E4M3_AMAX_FLOOR), E2M1_MAX))  # float32 E4M3 value
    q = round_e2m1(xb.to(_acc(x.dtype)) / s)
    return (q * s).to(x.dtype).reshape(x.shape)


def quant_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 index plane's row format: E4M3 codes with one fp32 scale per last-dim row.

    ``scale = max(amax, 1e-4) / 448`` in float32 (not rounded to a power of two). Returns the
    code values (on the E4M3 grid, in ``x``'s dtype) and the scale ``[..., 1]`` (float32).
    With the fake quantizers off the values are ``x`` and the scale is 1.
    """
    if not _ENABLED:
        return x, torch.ones(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    scale = div_rn(_amax(x, FP8_AMAX_FLOOR), E4M3_MAX)
    return round_e4m3(x.to(_acc(x.dtype)) / scale).to(x.dtype), scale


# --- storage formats ----------------------------------------------------------------------


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float scales -> E8M0 bytes (``torch.float8_e8m0fnu``)."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``float8_e8m0fnu`` or uint8) -> float32 powers of two."""
    b = scale.contiguous().view(torch.uint8).to(torch.int32)
    return (b << 23).view(torch.float32)


def e4m3_encode(values: torch.Tensor) -> torch.Tensor:
    """Values already on the E4M3 grid -> ``torch.float8_e4m3fn`` bytes (exact)."""
    return values.to(torch.float32).to(torch.float8_e4m3fn)


def _cast_e4m3(y: torch.Tensor) -> torch.Tensor:
    """``e4m3_encode(round_e4m3(y))`` in one cast: torch's float32 -> E4M3 conversion rounds to
    nearest even (subnormals included) exactly as ``round_e4m3`` does once saturated at +-448
    (``tests/model/test_quant.py`` checks every tie), at a fraction of the passes."""
    return y.to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


_TABLES: dict = {}


def _lookup_table(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant table on ``device``, made once: building it per call would copy from the host
    (a sync), which a CUDA-graph capture refuses."""
    key = (values, dtype, device)
    t = _TABLES.get(key)
    if t is None:
        t = _TABLES[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


_PACK_TABLE = (0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7)
"""E2M1 magnitude code of ``2 * |v|`` (0, 1, 2, 3, 4, 6, 8, 12 -> codes 0..7)."""


def warm_tables(device: torch.device) -> None:
    """Build the constant tables on ``device`` now, so no later call copies one from the host."""
    dev = torch.empty(0, device=device).device  # "cuda" resolves to the current index
    _lookup_table(_PACK_TABLE, torch.uint8, dev)
    _lookup_table(E2M1_VALUES + tuple(-m for m in E2M1_VALUES), torch.float32, dev)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Values on the E2M1 grid ``[..., K]`` -> uint8 ``[..., K/2]``, even index in the low
    nibble."""
    v = values.to(torch.float32)
    # 2*|v| is one of 0,1,2,3,4,6,8,12: a 13-entry table gives the magnitude code
    table = _lookup_table(_PACK_TABLE, torch.uint8, v.device)
    code = table[(v.abs() * 2).to(torch.long)] | (torch.signbit(v).to(torch.uint8) << 3)
    code = code.reshape(*code.shape[:-1], code.shape[-1] // 2, 2)
    return code[..., 0] | (code[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8/int8 ``[..., K/2]`` -> float32 E2M1 values ``[..., K]`` (even index = low nibble)."""
    p = packed.contiguous().view(torch.uint8)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    table = _lookup_table(E2M1_VALUES + tuple(-m for m in E2M1_VALUES), torch.float32, p.device)
    return table[codes.to(torch.long)]


def quantize_fp8_blocks(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows quantized to E4M3 with one E8M0 scale per ``block`` lanes (Engram tables).

    Returns (``float8_e4m3fn`` ``[..., K]``, ``float8_e8m0fnu`` ``[..., K/block]``).
    """
    xb = _blocks(x.to(torch.float32), block)
    s = pow2ceil(div_rn(_amax(xb, FP8_AMAX_FLOOR), E4M3_MAX))
    return _cast_e4m3(xb / s).reshape(x.shape), e8m0_encode(s.squeeze(-1))


def dequant_fp8_blocks(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of ``quantize_fp8_blocks``."""
    k = codes.shape[-1]
    block = k // scale.shape[-1]
    s = e8m0_decode(scale).repeat_interleave(block, dim=-1)
    return (codes.to(torch.float32) * s).to(dtype)


def quantize_fp8_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight ``[out, in]`` -> E4M3 + E8M0 scales ``[ceil(out/32), ceil(in/32)]``
    (ue8m0). Leading dims stack independent weights (blocks never span two)."""
    *lead, out_f, in_f = w.shape
    ro, ri = -(-out_f // block), -(-in_f // block)
    pad = w.to(torch.float32)
    if (ro * block, ri * block) != (out_f, in_f):  # zero lanes never raise a block's amax
        pad = torch.zeros(*lead, ro * block, ri * block, dtype=torch.float32, device=w.device)
        pad[..., :out_f, :in_f] = w
    tiles = pad.view(*lead, ro, block, ri, block)
    s = pow2ceil(div_rn(tiles.abs().amax(dim=(-3, -1)).clamp_min(FP8_AMAX_FLOOR), E4M3_MAX))
    q = _cast_e4m3(tiles / s[..., :, None, :, None]).view(*lead, ro * block, ri * block)
    return q[..., :out_f, :in_f].contiguous(), e8m0_encode(s)


def dequant_fp8_weight(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 32
) -> torch.Tensor:
    """E4M3 weight ``[..., out, in]`` with ``block`` x ``block`` E8M0 scales -> ``dtype``."""
    out_f, in_f = w.shape[-2:]
    s = e8m0_decode(scale).repeat_interleave(block, -2).repeat_interleave(block, -1)
    return (w.to(torch.float32) * s[..., :out_f, :in_f]).to(dtype)


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed-expert weight ``[out, in]`` -> packed E2M1 int8 ``[out, in/2]`` + E8M0 ``[out,
    in/32]``."""
    wb = _blocks(w.to(torch.float32), block)
    s = pow2ceil(div_rn(_amax(wb, FP4_E8M0_AMAX_FLOOR), E2M1_MAX))
    q = round_e2m1(wb / s).reshape(w.shape)
    return pack_e2m1(q).view(torch.int8), e8m0_encode(s.squeeze(-1))


def dequant_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Packed E2M1 ``[out, in/2]`` with E8M0 per-32 scales ``[out, in/32]`` -> ``dtype`` ``[out,
    in]``."""
    v = unpack_e2m1(packed)
    block = v.shape[-1] // scale.shape[-1]
    s = e8m0_decode(scale).repeat_interleave(block, dim=-1)
    return (v * s).to(dtype)


# --- resident quantized weights -----------------------------------------------------------

WEIGHT_BLOCK = 32
"""Lanes of one weight scale block: FP8 weights 32 x 32, FP4 expert weights 1 x 32 along K."""


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight kept in its published quantized format (``[..., out, in]`` logical).

    ``fp8``: ``codes`` E4M3 ``[out, in]``, ``scales`` E8M0 ``[ceil(out/32), ceil(in/32)]``.
    ``fp4``: ``codes`` packed E2M1 int8 ``[..., out, in/2]`` (even lane in the low nibble),
    ``scales`` E8M0 ``[..., out, in/32]``; the fused routed experts carry a leading ``E``.
    """

    codes: torch.Tensor
    """The weight codes in their storage dtype (``float8_e4m3fn`` or int8/uint8 packed pairs)."""
    scales: torch.Tensor
    """E8M0 power-of-two scales (``float8_e8m0fnu``, or uint8 bytes of the same encoding)."""
    format: str
    """``"fp8"`` (dense linears, 32 x 32 blocks) or ``"fp4"`` (routed experts, 1 x 32)."""

    def __post_init__(self) -> None:
        if self.format not in ("fp8", "fp4"):
            raise ValueError(f"QuantWeight format {self.format!r}; accepted: fp8, fp4")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape ``[..., out, in]``."""
        s = tuple(self.codes.shape)
        return s if self.format == "fp8" else s[:-1] + (s[-1] * 2,)

    @property
    def device(self) -> torch.device:
        """Where the codes live."""
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def to(self, device: str | torch.device) -> QuantWeight:
        """The same weight on ``device`` (bytes unchanged)."""
        return QuantWeight(self.codes.to(device), self.scales.to(device), self.format)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values in ``dtype`` (exact in bf16 and wider: code times a power of 2)."""
        if self.format == "fp8":
            return dequant_fp8_weight(self.codes, self.scales, dtype, WEIGHT_BLOCK)
        return dequant_fp4_weight(self.codes, self.scales, dtype)


def weight_nbytes(weights: dict) -> int:
    """Bytes of a weight dict whose values are tensors or ``QuantWeight``s."""
    total = 0
    for t in weights.values():
        total += t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()
    return total
