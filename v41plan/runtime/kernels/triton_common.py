"""Triton device helpers shared by the kernels: exact minifloat rounding and the storage codes.

Every rounding here is integer and compare arithmetic on fp32 bit patterns, never a hardware
conversion or a reciprocal: the results are the bits ``v41plan.model.quant`` and the codecs of
``torch_ref`` produce, on the GPU and under ``TRITON_INTERPRET=1`` alike (the interpreter
truncates fp32 -> bf16, and a fast fp32 division is not correctly rounded). Divisions that must
be correctly rounded go through ``tl.math.div_rn``.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
LOG2E = 1.4426950408889634


def interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU
    tensors through the interpreter)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def arrival_counters(pool: dict, dev, size: int):
    """Zeroed int32 arrival counters on ``dev`` from ``pool`` (a kernel's own dict of lists),
    at least ``size`` of them, for a launch whose programs count themselves in and leave them
    zero. Allocated at first use and only grown after; a replaced tensor stays in ``pool``, so
    a captured graph never reads a freed counter."""
    import torch

    have = pool.setdefault(dev, [])
    if not have or have[-1].numel() < size:
        have.append(torch.zeros(size, dtype=torch.int32, device=dev))
    return have[-1]


PDL_MODES = ("off", "on")
"""Programmatic dependent launch (``PDL``): ``"off"`` launches each kernel after the one
before it has ended; ``"on"`` launches it while the one before runs, its programs waiting in
``pdl_enter`` until that grid has ended and its stores are visible, so the launch and the
programs' start overlap the other's tail. Measured on a chain of 400 decode-shaped W8A8 and
quantizer launches (``benchmarks/probe_pdl.py``, H100): one row 3.38 -> 3.28 ms, 64 rows 5.59 ->
5.90 ms (slower), hence ``PDL_MAX_ROWS``. Asking L2 for each program's weight slice before the
wait lost at both (3.86 / 6.80 ms)."""

PDL = "off"
"""The mode launches use on CUDA devices that have it (sm_90+; see ``pdl_mode``;
``V41PLAN_PDL=on`` for a process). Off: the batch-1 flash_slice decode step ran slower with it
(12.79 against 12.44 ms, H100,
``reports/gpu/bench_decode_flash_slice_pdl_split2_h100_2af20f1.json``), though the W8A8
chain of ``probe_pdl.py`` alone ran faster at one row."""

PDL_MAX_ROWS = 16
"""Token rows up to which a launch is a dependent one (see ``PDL_MODES``)."""


def pdl_mode(device) -> str:
    """The ``PDL_MODES`` entry launches on ``device`` use: ``PDL`` on a CUDA device of compute
    capability 9.0 or later (``V41PLAN_PDL`` overrides ``PDL`` for a process), ``"off"``
    elsewhere (the CPU interpreter, older GPUs, ROCm)."""
    import os

    import torch

    mode = os.environ.get("V41PLAN_PDL", PDL)
    if mode not in PDL_MODES:
        raise ValueError(f"V41PLAN_PDL={mode!r}: one of {', '.join(PDL_MODES)}")
    if mode == "off" or getattr(device, "type", device) != "cuda" or torch.version.hip:
        return "off"
    return mode if torch.cuda.get_device_capability(device)[0] >= 9 else "off"


def pdl_launch(device, rows: int) -> dict:
    """Launch keywords of a kernel that takes ``PDL: tl.constexpr`` for ``rows`` token rows:
    ``PDL`` and ``launch_pdl`` where ``pdl_mode`` is on and ``rows <= PDL_MAX_ROWS``, else
    none (the CPU interpreter and other devices launch as before)."""
    if rows > PDL_MAX_ROWS or pdl_mode(device) == "off":
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A dependent launch's gate (``PDL``): wait until the stream's previous grid has ended and
    its memory is visible, then let the next grid launch. Every program of a kernel launched
    with ``launch_pdl`` passes here first, before it reads or writes anything: a program that
    skipped it could end before the grid it depends on, and a later kernel's wait would then
    not cover that grid."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (at least 1)."""
    return triton.next_power_of_2(max(int(n), 1))


def patch_interpreter():
    """Make the kernels run under ``TRITON_INTERPRET=1`` (the CPU tests, ``bench_kernels.py
    --smoke``); returns the interpreter function to put back (``interpreter._patch_lang``).

    Five changes to triton 3.6's interpreter:

    - A tensor used as an int (a loop bound read on the device) converts through
      ``int(ndarray)``, which numpy >= 2.3 refuses for its one-element arrays: take the element.
    - It re-patches every builtin (``inspect.getmembers`` over the language modules) at each
      call of a device function, ``tl.sum`` and ``tl.max`` included, which is most of the
      interpreted run time. Within a launch the modules stay patched, so a nested call only
      needs the language modules the launch has not patched yet (found once a module).
    - Its ``_get_np_dtype`` builds its 18-entry type table at every call (every operand of
      every interpreted operation, about 8% of a select's run): the same table, built once.
    - Every interpreted operation builds its result's ``block_type`` afresh (its shape as a
      ``tl.tuple`` of constexpr types, validated), a fifth of a select's run: a block type is a
      value (element type and shape), so one object per value serves them all
      (``_memo_block_types``).
    - Every integer ``+``, ``-`` and ``*`` evaluates its overflow check (both operands widened
      to int64, the operation again, two comparisons), whose ``device_assert`` then does nothing:
      it asserts only under ``options.debug``, which the interpreter's options never set. The
      check is skipped where its assert would be, about a third of an interpreted select's run.
    """
    import inspect

    from triton.runtime import interpreter

    real = interpreter._patch_lang
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None and not hasattr(np_dtype, "table"):
        interpreter._get_np_dtype = _np_dtype_once(np_dtype)
    _memo_block_types()
    _skip_unasserted_overflow_checks(interpreter.TritonSemantic, interpreter.InterpreterBuilder)
    patched: list[set[int]] = []

    class LaunchScope:
        def __init__(self, inner):
            self.inner = inner

        def restore(self):
            patched.clear()
            self.inner.restore()

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patch(fn):
        scope = real(fn)
        scope.set_attr(tl.core.tensor, "__index__", index)
        return scope

    # id(fn.__globals__) -> (those globals, the language modules in them); the globals are
    # held, so an id is never reused while its entry lives
    lang_mods: dict[int, tuple[dict, set[int]]] = {}

    def patch_lang(fn):
        g = fn.__globals__
        have = lang_mods.get(id(g))
        if have is None or have[0] is not g:
            mods = {id(v) for v in g.values() if inspect.ismodule(v) and v in (tl, tl.core)}
            have = lang_mods[id(g)] = (g, mods)
        mods = have[1]
        if patched and mods <= patched[0]:
            return interpreter._LangPatchScope()
        if patched:
            patched[0] |= mods
            return patch(fn)
        patched.append(set(mods))  # grown in place by nested calls: not the cached set
        return LaunchScope(patch(fn))

    interpreter._patch_lang = patch_lang
    return real


def _skip_unasserted_overflow_checks(semantic_cls, builder_cls) -> None:
    """``binary_op_sanitize_overflow_impl`` of ``semantic_cls`` returning at once for a builder
    of ``builder_cls`` (the interpreter's; every patched builtin holds its own semantic object)
    whose options ask for no debug asserts: its ``device_assert`` would return without
    asserting, and the check's operations have no other effect. Compiled kernels keep the
    method as it is. Idempotent."""
    real = semantic_cls.binary_op_sanitize_overflow_impl
    if getattr(real, "_v41plan", False):
        return

    def check(self, lhs, rhs, binary_op):
        if isinstance(self.builder, builder_cls) and not self.builder.options.debug:
            return None
        return real(self, lhs, rhs, binary_op)

    check._v41plan = True
    semantic_cls.binary_op_sanitize_overflow_impl = check


def _memo_block_types():
    """``tl.block_type(element_ty, shape)`` returns one object per (element type, shape of ints):
    the first one built, initialised once. Idempotent. Types are values (``block_type.__eq__``
    compares exactly those two), never changed after construction, so sharing them changes no
    result; a shape that is not all Python ints builds a fresh object (and meets the
    interpreter's own checks) as before."""
    bt = tl.core.block_type
    if getattr(bt, "_v41plan_memo", False):
        return
    init = bt.__init__
    cache: dict = {}

    def new(cls, element_ty, shape):
        if cls is not bt:
            return object.__new__(cls)
        dims = tuple(getattr(s, "value", s) for s in shape)
        if not all(type(d) is int for d in dims):  # built, and refused, as before
            return object.__new__(cls)
        try:
            key = (element_ty, *dims)
            hit = cache.get(key)
        except TypeError:  # an unhashable element type
            return object.__new__(cls)
        if hit is None:
            hit = object.__new__(cls)
            init(hit, element_ty, shape)
            hit.__dict__["_v41plan_built"] = True
            cache[key] = hit
        return hit

    def init_once(self, element_ty, shape):
        if not self.__dict__.get("_v41plan_built", False):
            init(self, element_ty, shape)

    bt.__new__ = new
    bt.__init__ = init_once
    bt._v41plan_memo = True


def _np_dtype_once(real):
    """``interpreter._get_np_dtype`` with its table built once (the interpreter's own for any
    type outside it)."""
    import numpy as np

    table = {}
    for name in (
        "int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
        "uint32", "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv",
        "float8e4b8", "float8e4b15",
    ):  # fmt: skip
        if hasattr(tl, name):
            table[getattr(tl, name)] = real(getattr(tl, name))
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        have = table.get(tt_dtype)
        return real(tt_dtype) if have is None else have

    get_np_dtype.table = table
    return get_np_dtype


@triton.jit
def bits_of(x):
    """The int32 bit pattern of fp32 ``x``."""
    return x.to(tl.int32, bitcast=True)


@triton.jit
def pow2(e):
    """``2**e`` as fp32 for int32 ``e`` in ``[-126, 127]`` (built from the exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exponent_of(a):
    """``floor(log2(a))`` of a normal non-negative fp32 ``a``; -127 for zero and subnormals."""
    return ((bits_of(a) >> 23) & 0xFF) - 127


@triton.jit
def rint(x):
    """Round to the nearest integer, ties to even (exact for ``|x| < 2**23``)."""
    f = tl.floor(x)
    r = x - f
    odd = (f.to(tl.int32) & 1) == 1
    up = (r > 0.5) | ((r == 0.5) & odd)
    return f + up.to(tl.float32)


@triton.jit
def round_minifloat(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr, MAXV: tl.constexpr):
    """``quant._round_minifloat`` in fp32: nearest, ties to even, saturating at ``MAXV``; the
    sign of ``y`` is kept (a negative value rounding to zero gives -0.0)."""
    neg = bits_of(y) < 0
    a = tl.minimum(tl.abs(y), MAXV)
    e = tl.maximum(exponent_of(a), MIN_EXP)
    step = e - MANT
    q = tl.minimum(rint(a * pow2(-step)) * pow2(step), MAXV)
    # a product, not ``-q``: triton negates as ``0 - q``, which loses the sign of zero
    return tl.where(neg, q * -1.0, q)


@triton.jit
def round_e4m3(y):
    """Round to the E4M3 (fn) grid (``quant.round_e4m3``)."""
    return round_minifloat(y, 3, -6, 448.0)


@triton.jit
def round_e2m1(y):
    """Round to the E2M1 grid (``quant.round_e2m1``)."""
    return round_minifloat(y, 1, 0, 6.0)


@triton.jit
def e4m3_code(q):
    """The E4M3 (fn) byte (int32 0..255) of a value already on the grid."""
    a = tl.abs(q)
    e = exponent_of(a)
    normal = ((e + 7) << 3) | ((bits_of(a) >> 20) & 7)
    sub = (a * 512.0).to(tl.int32)
    return tl.where(e >= -6, normal, sub) | ((bits_of(q) >> 24) & 0x80)


@triton.jit
def e2m1_code(q):
    """The E2M1 nibble (int32 0..15, bit 3 the sign) of a value already on the grid."""
    a = tl.abs(q)
    e = exponent_of(a)
    normal = ((e + 1) << 1) | ((bits_of(a) >> 22) & 1)
    sub = (a * 2.0).to(tl.int32)
    return tl.where(e >= 0, normal, sub) | ((bits_of(q) >> 28) & 0x8)


@triton.jit
def e2m1_value(code):
    """fp32 value of E2M1 nibbles ``code`` (int32 0..15)."""
    mag = code & 7
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    v = tl.where(mag >= 2, normal.to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
    return tl.where((code & 8) != 0, v * -1.0, v)


@triton.jit
def e4m3_value(byte):
    """fp32 value of E4M3 (fn) bytes (uint8), from their bit fields: exact, and never the
    hardware ``fp8e4nv`` conversion (its result fed to a bf16 dot disagreed with this decode on
    the H200)."""
    b = byte.to(tl.int32) & 0xFF
    mag = b & 0x7F
    e = mag >> 3
    normal = ((e + 120) << 23) | ((mag & 7) << 20)
    v = tl.where(e > 0, normal.to(tl.float32, bitcast=True), (mag & 7).to(tl.float32) * 2.0**-9)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return tl.where((b & 0x80) != 0, v * -1.0, v)


@triton.jit
def e8m0_value(byte):
    """fp32 power of two of E8M0 bytes (exponent field only)."""
    return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2ceil_exponent(a):
    """The fp32 exponent field of ``quant.pow2ceil(a)`` (positive normal ``a``)."""
    b = bits_of(a)
    return ((b >> 23) & 0xFF) + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def bf16_bits(x):
    """Round fp32 ``x`` to bf16, nearest even, as int16 bits (what ``x.to(torch.bfloat16)``
    stores for finite ``x``)."""
    b = bits_of(x)
    r = b + 0x7FFF + ((b >> 16) & 1)
    return (r >> 16).to(tl.int16)


@triton.jit
def bf16_round(x):
    """fp32 ``x`` rounded to the nearest bf16 value, kept in fp32."""
    return (bf16_bits(x).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def ordered_key(x):
    """int32 keys ordered as the fp32 values ``x``: the bit pattern, with the magnitude bits of
    a negative value flipped (-0.0 taken as +0.0; -inf maps to ``NEG_INF_KEY``, NaNs with the
    sign bit below it). Flipping the sign bit too gives the unsigned order of the radix digits."""
    b = bits_of(tl.where(x == 0.0, 0.0, x))
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


NEG_INF_KEY = tl.constexpr(-2139095041)
"""``ordered_key(-inf)``: a key at or below it is not a candidate."""


@triton.jit
def div_rn(a, b):
    """Correctly rounded fp32 ``a / b`` (the reference's IEEE division)."""
    return tl.math.div_rn(a, b)
