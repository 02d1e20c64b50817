"""``compilation_level=3``: the dense pieces of ``RuntimeModel.run`` under ``torch.compile``.

``DensePieces`` holds the functions ``run()`` calls for its dense work, outside the kernel
backend: the embedding, the window-KV rows, the query and index query, the compressor's
projections and its closed groups' rows (pooling, RoPE, the index-key and main-row quantizers),
the output projection, the router and the dense-over-experts MoE, the RoPE tables, the Engram
row ids (the n-gram hashing of the device lookup) and injection, and the head. Eager
(``backend=None``) they are the layers' own methods, so level 0 is the reference arithmetic.
Compiled, each is one ``torch.compile(fullgraph=True)`` region (a graph break is an error, not
a silent fallback), and every layer of the model shares it: the functions take the layer object
and read its weights as graph inputs, so guards match on shapes and dtypes, not on which layer
calls.

With the torch dense compositions (``dense="torch"``) the mHC sites and the expand compile too
(``compiled_dense``). What stays outside the regions: the kernel backend's pool ops (called
between them), the fused Triton mHC sites (one launch each already), the grouped MoE's expert
product and the tensor-parallel all-reduces. A Triton GEMM called inside a region (the W8A8
linear over resident weights) goes through the custom op ``v41plan::w8a8_linear``
(``kernels.ops``), opaque to the compiler and capturable.

Shapes: the token dimension is the only one that varies. The token arguments of a region are
marked dynamic along it (``TOKEN_ARGS``), so a region compiles once for any width and once for a
single row (dynamo specializes sizes 0 and 1); a new prompt length or capture bucket after that
reuses the dynamic graph. The compiled functions
and their caches are shared by every model of the process (guards match tensor properties, so
another model's weights of the same shapes reuse a graph); ``graphs`` counts the compiles,
``compile_s`` the time the backend spent in them.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from v41plan.model.layers import MoE, acc_dtype, apply_rope, hc_collapse, rms_norm
from v41plan.model.quant import dequant_fp8_blocks
from v41plan.runtime.kernels.backend import BACKEND_RANGE
from v41plan.runtime.kernels.ops import head_logits

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``torch.compile`` backends level 3 takes: ``inductor`` (generated Triton / C++ kernels, the
default), ``aot_eager`` and ``eager`` (tracing without code generation: what the CPU suite runs
to prove the regions trace whole)."""

RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while the pieces compile (its default, 8, is below
what the layer roles, forced decisions and single-row specializations can add up to)."""


def window_kv(att, x, cos, sin):
    """Window-KV rows ``[N, d]`` (``Attention.window_kv``)."""
    return att.window_kv(x, cos, sin)


def query(att, x, cos, sin, index: bool):
    """(q ``[N, H, d]``, index query ``[N, nih, ihd]`` or None, index head weights ``[N, nih]``
    or None): the query path and, on layers with an indexer, its query and head weights."""
    q, qr = att.q_path(x, cos, sin)
    return (q, *_index_query(att, x, qr, cos, sin, index))


def _index_query(att, x, qr, cos, sin, index: bool):
    """(index query, head weights), or (None, None) on a layer without an indexer."""
    if not index:
        return None, None
    qi = apply_rope(att.idx_wq_b(qr).reshape(x.shape[0], att.nih, att.ihd), cos, sin)
    return qi, F.linear(x, att.idx_weights_proj) * att.idx_scale


def attn_inputs(att, x, cos, sin, index: bool, xq=None, xs=None):
    """(window-KV rows, q, index query or None, head weights or None) of the same rows, from
    one ``wq_a``/``wkv`` product (``Attention.q_kv_inputs``; ``xq``/``xs``: ``x``'s FP8 codes
    and E8M0 scales, made by the site before it): ``window_kv`` and ``query`` in one region."""
    qa, y = att.q_kv_inputs(x, None if xq is None else (xq, xs))
    q, qr = att.q_path_from(qa, cos, sin)
    return (att.window_kv_from(y, cos, sin), q, *_index_query(att, x, qr, cos, sin, index))


def compress_project(att, x):
    """The compressor's per-token projections (``Attention.compress_project``)."""
    return att.compress_project(x)


def compressed_rows(att, vals, gates, rows, positions, index_fmt: str | None):
    """(index keys, their scales or None, main-plane rows) of the groups closing at ``rows``:
    the ratio-2 pooling of the closed pair (``gates`` given: ``vals``/``gates`` ``[N, 2, ...]``)
    or the ratio-1 latent, RoPE at each group's first position, the index-key and FP4 main-row
    quantizers."""
    if gates is None:
        latent = att.ratio1_latent(vals[rows])
    else:
        latent = att.pool(vals[rows, 0], gates[rows, 0], vals[rows, 1], gates[rows, 1])
    cos, sin = att.rope.cos_sin(positions, att.dtype)
    keys, key_scale = att.index_keys(latent, cos, sin, index_fmt)
    return keys, key_scale, att.compressed_kv(latent, cos, sin)


def output(att, o, cos, sin):
    """The output projection before its all-reduce (``Attention.output_local``)."""
    return att.output_local(o, cos, sin)


def moe_local(moe, x, forced):
    """A dense-over-experts MoE before its all-reduce (``MoE.local``): partial ``[N, D]`` in
    ``acc``, expert ids."""
    return moe.local(x, forced)


def route(moe, x, forced):
    """The router of a grouped MoE: (ids, weights)."""
    return moe.route(x, forced)


def cos_sin(rope, positions, dtype: torch.dtype):
    """A RoPE table ``(cos, sin)`` at ``positions`` (``Rope.cos_sin``)."""
    return rope.cos_sin(positions, dtype)


def engram(layer, X, codes, scales, dtype: torch.dtype):
    """Streams ``X`` with the Engram value of the gathered table rows (E4M3 codes and E8M0
    scales, as uint8) injected."""
    emb = dequant_fp8_blocks(
        codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), dtype
    )
    return layer(X, emb)


def engram_rows(engram_device, token_ids, batch_ids, row0, history):
    """Every row's Engram table row ids (``DeviceEngram.row_ids``: the n-gram hashing, integer
    arithmetic, exact under any kernel fusion)."""
    return engram_device.row_ids(token_ids, batch_ids, row0, history)


def embed(table, ids, hc: int, hidden: int, dtype: torch.dtype):
    """Initial residual streams ``[N, hc, D]`` (the embedding row in every stream) and mHC
    ``pre`` ``[N, hc]`` (one-hot on stream 0, in ``acc``)."""
    X = table[ids].to(dtype)[:, None, :].expand(ids.shape[0], hc, hidden).contiguous()
    pre = torch.zeros(ids.shape[0], hc, dtype=acc_dtype(dtype), device=ids.device)
    pre[:, 0] = 1
    return X, pre


def head(X, pre, norm, head_w, eps: float):
    """float32 logits of the rows' streams: mHC collapse, final RMSNorm, the LM head
    (``ops.head_logits``)."""
    return head_logits(rms_norm(hc_collapse(X, pre), norm, eps), head_w)


_PIECES = (
    window_kv, query, attn_inputs, compress_project, compressed_rows, output, moe_local, route,
    cos_sin, engram, engram_rows, embed, head,
)  # fmt: skip


class _Counted:
    """A ``torch.compile`` backend that counts its compiles and their time (one per backend
    name, shared by every model: dynamo keys its caches by the backend object, so models of one
    process share their compiled graphs)."""

    def __init__(self, name: str):
        from torch._dynamo import lookup_backend

        self.name = name
        self.inner = lookup_backend(name)
        self.graphs = 0
        self.compile_s = 0.0

    def __call__(self, gm, example_inputs):
        t0 = time.perf_counter()
        import torch._inductor.config as inductor_config

        if self.name == "inductor" and hasattr(inductor_config, "emulate_precision_casts"):
            # round where the arithmetic rounds (every cast to bf16), as eager does: fused
            # kernels otherwise keep the intermediates in float32
            with inductor_config.patch(emulate_precision_casts=True):
                out = self.inner(gm, example_inputs)
        else:
            out = self.inner(gm, example_inputs)
        self.graphs += 1
        self.compile_s += time.perf_counter() - t0
        return out


_BACKENDS: dict[str, _Counted] = {}
_COMPILED: dict[tuple[str, str, str], object] = {}


TOKEN_ARGS = {
    "window_kv": (1, 2, 3), "query": (1, 2, 3), "attn_inputs": (1, 2, 3, 5, 6),
    "compress_project": (1,),
    "compressed_rows": (1, 2, 3, 4), "output": (1, 2, 3), "moe_local": (1, 2), "route": (1, 2),
    "cos_sin": (1,), "engram": (1, 2, 3), "engram_rows": (1, 2), "embed": (1,), "head": (0, 1),
    "hc_expand": (0, 1, 2, 3), "mhc_site": (0, 1), "mhc_expand_site": (0, 1, 2, 3, 4),
}  # fmt: skip
"""Per compiled function, the positions of its arguments whose first dimension is the token
(or group) count: marked dynamic before the first compile, so the second width reuses it."""


def _compiled(fn, backend: str):
    """``fn`` under ``torch.compile`` with the counting backend ``backend`` (made once), its
    token arguments (``TOKEN_ARGS``) dynamic along their first dimension."""
    key = (fn.__module__, fn.__qualname__, backend)
    if key not in _COMPILED:
        from torch._dynamo import maybe_mark_dynamic

        from v41plan.runtime.kernels import ops

        ops.register()
        _raise_recompile_limit()
        counted = _BACKENDS.setdefault(backend, _Counted(backend))
        c = torch.compile(fn, backend=counted, fullgraph=True, dynamic=None)
        token_args = TOKEN_ARGS[fn.__name__]

        def call(*args):
            for i in token_args:
                a = args[i]
                if isinstance(a, torch.Tensor) and a.dim():
                    maybe_mark_dynamic(a, 0)  # a single row still specializes (size 1)
            return c(*args)

        call.__name__ = fn.__name__
        _COMPILED[key] = call
    return _COMPILED[key]


class DensePieces:
    """The dense pieces ``RuntimeModel.run`` calls, eager (``backend=None``) or compiled with
    the ``torch.compile`` backend named (``COMPILE_BACKENDS``)."""

    def __init__(self, backend: str | None = None):
        if backend is not None and backend not in COMPILE_BACKENDS:
            raise ValueError(
                f"compile backend {backend!r}; accepted: {', '.join(COMPILE_BACKENDS)}"
            )
        self.backend = backend
        self.ranged = False
        """Whether the grouped expert product runs inside a ``backend.moe`` profiler range
        (``RuntimeModel.label_backend_ops``)."""
        for fn in _PIECES:
            setattr(self, fn.__name__, fn if backend is None else _compiled(fn, backend))

    @property
    def compiled(self) -> bool:
        """Whether the pieces run compiled."""
        return self.backend is not None

    @property
    def graphs(self) -> int:
        """Graphs this process compiled with this backend so far (every region, every shape;
        shared with the other models of the process)."""
        return _BACKENDS[self.backend].graphs if self.backend in _BACKENDS else 0

    @property
    def compile_s(self) -> float:
        """Seconds the compile backend spent in them (dynamo's tracing and the kernels'
        first-launch autotuning not included)."""
        return _BACKENDS[self.backend].compile_s if self.backend in _BACKENDS else 0.0

    def moe(self, moe, x, forced, quantized=None):
        """(MoE output ``[N, D]`` in its dtype, expert ids): the dense MoE compiled whole, a
        grouped MoE's router compiled and its experts (the grouped product) eager, what needs
        no routing begun before the router (``GroupedMoE.begin``, with ``quantized``: ``x``'s
        FP8 codes and E8M0 scales where its site made them)."""
        if isinstance(moe, MoE):
            y, ids = self.moe_local(moe, x, forced)
            return moe.tp.all_reduce(y).to(moe.dtype), ids
        if not self.ranged:
            begun = moe.begin(x, quantized)
            ids, wts = self.route(moe, x, forced)
            return moe.finish(begun, ids, wts), ids
        with torch.profiler.record_function(BACKEND_RANGE + "moe"):  # profiles as a backend op
            begun = moe.begin(x, quantized)
        ids, wts = self.route(moe, x, forced)
        with torch.profiler.record_function(BACKEND_RANGE + "moe"):
            return moe.finish(begun, ids, wts), ids


def compiled_dense(dense, backend: str | None):
    """The mHC functions of ``dense`` (``RuntimeModel.dense``) for level 3: the torch
    compositions compiled (the Sinkhorn loop unrolled into Inductor's kernels), the fused Triton
    ones as they are (one launch each already)."""
    if backend is None or dense.name != "torch":
        return dense
    names = ("hc_expand", "mhc_site", "mhc_expand_site")
    fns = {n: staticmethod(_compiled(getattr(dense, n), backend)) for n in names}
    return type("CompiledTorchDense", (dense,), fns)


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)
