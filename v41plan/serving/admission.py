"""Engine options: defaults, and every refusal made before any weight loads.

``check_options`` returns a resolved ``EngineOptions`` or raises ``ConfigError`` naming the
option and the values it accepts. It reads only the compiled ``CacheSpec`` and the world size,
so a refused configuration costs no loading.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, CacheSpec
from v41plan.model.config import ConfigError
from v41plan.runtime.kv_connector import KV_CONNECTORS

__all__ = [
    "ConfigError",
    "EngineOptions",
    "check_options",
    "default_tensor_parallel_size",
    "resolve_kernels",
]


@dataclass(frozen=True)
class EngineOptions:
    """Resolved engine options (names as in the specification)."""

    kv_cache_dtype: str = "bf16"
    index_cache_dtype: str = "fp8"
    enforce_eager: bool = True
    cudagraph_mode: str = "NONE"
    compilation_level: int | None = None
    """The dense pieces between the kernel-backend ops: 0 eager, 3 compiled with
    ``torch.compile`` (``runtime.compiled``); None: 3 where CUDA graphs are on and the dtype is
    not float64 (the exact validation mode stays eager), else 0."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend of level 3: ``inductor`` (generated kernels), ``aot_eager``
    or ``eager`` (tracing only, no code generation: checks that the regions trace whole)."""
    enable_expert_parallel: bool = False
    tensor_parallel_size: int = 1
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    num_pages: int | None = None
    """PAGEs of the pool; None sizes it for ``max_num_seqs`` requests of ``max_model_len``."""
    encoder_swa_bounded_replay: bool | None = None
    """None takes the spec's default (on)."""
    decoder_swa_bounded_replay: bool | None = None
    enable_prefix_caching: bool = True
    device: str | None = None
    """``cpu`` or ``cuda``; None picks CUDA when available."""
    dtype: str = "float32"
    """Activation dtype of the executor (``float32``, ``float64``, ``bfloat16``)."""
    seed: int = 0
    """Engine seed: a sampled request without its own ``SamplingParams.seed`` draws from
    ``seed + request id`` (as vLLM's ``LLM(seed=...)``)."""
    random_weights_seed: int = 0
    """Seed of the spec's random weights, built in memory when no checkpoint is given (the
    same seed ``v41plan init-checkpoint --seed`` writes to disk)."""
    kv_transfer_config: dict | None = None
    """A KV connector under the device prefix cache: ``{"kv_connector": "local", "bytes": N,
    "path": DIR}`` or ``{"kv_connector": "lmcache_mp", "host": H, "port": P}`` (None: none)."""
    kernel_backend: str = "auto"
    """The pool-touching kernels: ``torch`` (the reference, and the only CPU path), ``triton``
    (CUDA; float64 steps fall back to the torch ops) or ``auto`` (``triton`` on CUDA unless the
    dtype is float64, else ``torch``)."""
    dense_kernels: str = "auto"
    """The mHC sites, the expand and the FP8 activation quantizer: ``torch`` (the reference
    compositions), ``triton`` (one fused launch each, CUDA) or ``auto`` (as ``kernel_backend``)."""
    moe_impl: str = "auto"
    """``dense`` (every expert on every row, the reference), ``grouped`` (the selected experts
    only) or ``auto`` (``grouped`` on CUDA unless the dtype is float64, else ``dense``)."""
    resident_weights: bool | None = None
    """Keep the FP8 linears and FP4 experts on the device as published (W8A8 / W4A8 Triton
    kernels; needs ``moe_impl`` grouped, CUDA, bf16 or float32); None: on where those hold."""
    speculative_config: dict | None = None
    """DSpark speculative decoding: ``{"method": "dspark", "num_speculative_tokens": 5}``
    (the count is the spec's ``dspark_block_size``; None: no speculation). BF16 caches only;
    each decode step verifies the anchor and the draft's block in one forward."""
    async_scheduling: bool | None = None
    """Schedule and launch decode step N+1 before reading step N's results (the sampled tokens
    stay on the device and feed the next step): the host's work hides behind the device's.
    Tokens are those of synchronous stepping. None: on for the paged runner on CUDA."""


# Options refused whatever their value, unless equal to the value shown (the "off" value).
_REFUSED: dict[str, tuple[object, str]] = {
    "pipeline_parallel_size": (1, "pipeline parallelism is not supported; accepted: 1"),
    "context_parallel_size": (1, "context parallelism is not supported; accepted: 1"),
    "prefill_context_parallel_size": (1, "context parallelism is not supported; accepted: 1"),
    "decode_context_parallel_size": (1, "context parallelism is not supported; accepted: 1"),
    "data_parallel_size": (1, "data parallelism is not supported; accepted: 1"),
    "enable_dp_attention": (False, "DP attention is not supported; accepted: False"),
    "enable_tbo": (None, "two-batch overlap (TBO) is not supported; accepted: None"),
    "enable_eplb": (False, "EPLB is not supported; accepted: False"),
    "enable_rapidserve": (False, "RapidServe is not supported; accepted: False"),
    "plugin": (None, "plugin execution is not supported; accepted: None"),
    "multimodal_speculation": (False, "multimodal speculation is not supported; accepted: False"),
}
CUDAGRAPH_MODES = ("NONE", "FULL", "PIECEWISE")
KERNEL_BACKENDS = ("auto", "torch", "triton")
DENSE_KERNELS = ("auto", "torch", "triton")
MOE_IMPLS = ("auto", "dense", "grouped")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``compile_backend``'s values (``runtime.compiled.COMPILE_BACKENDS``)."""
_KV_TRANSFER_KEYS = {
    "local": {"kv_connector": str, "bytes": int, "path": str},
    "lmcache_mp": {"kv_connector": str, "host": str, "port": int, "timeout_s": (int, float),
                   "required": bool, "staging_bytes": int},
}  # fmt: skip


def _fail(option: str, value: object, accepted: str) -> ConfigError:
    return ConfigError(f"{option}={value!r} is refused: {accepted}")


def _check_kv_transfer(config: object, world_size: int) -> dict:
    """A ``kv_transfer_config`` dict checked key by key (``ConfigError`` otherwise)."""
    connector = config.get("kv_connector") if isinstance(config, dict) else config
    if connector not in KV_CONNECTORS:
        raise _fail(
            "kv_transfer_config",
            connector,
            f"accepted kv_connector: {', '.join(KV_CONNECTORS)} (a dict, e.g. "
            "{'kv_connector': 'local', 'bytes': 1 << 30})",
        )
    if not isinstance(config, dict):
        config = {"kv_connector": connector}
    allowed = _KV_TRANSFER_KEYS[connector]
    for key, value in config.items():
        if key not in allowed:
            raise _fail(
                f"kv_transfer_config[{key!r}]", value, f"{connector} takes {', '.join(allowed)}"
            )
        want = allowed[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise _fail(f"kv_transfer_config[{key!r}]", value, f"expects {_type_name(want)}")
    if connector == "local" and config.get("bytes", 1) <= 0:
        raise _fail("kv_transfer_config['bytes']", config["bytes"], "must be positive")
    if connector == "lmcache_mp" and world_size > 1:
        raise _fail(
            "kv_transfer_config",
            connector,
            "lmcache_mp serves world size 1 (tensor-parallel ranks would need one shared lookup "
            "decision); the local connector runs at any world size",
        )
    return dict(config)


SPECULATIVE_METHODS = ("dspark",)


def _check_speculative(config: object, spec: CacheSpec, o: EngineOptions) -> dict:
    """A ``speculative_config`` checked against the spec and the other options (before any
    load): DSpark with the spec's block size, BF16 caches, eager steps."""
    if not isinstance(config, dict):
        raise _fail(
            "speculative_config",
            config,
            "a dict, e.g. {'method': 'dspark', 'num_speculative_tokens': 5}",
        )
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise _fail(
            f"speculative_config[{unknown[0]!r}]",
            config[unknown[0]],
            "accepted keys: method, num_speculative_tokens",
        )
    method = config.get("method", "dspark")
    if method not in SPECULATIVE_METHODS:
        raise _fail(
            "speculative_config['method']", method, f"accepted: {', '.join(SPECULATIVE_METHODS)}"
        )
    block = spec.model_config.get("dspark_block_size")
    if block is None:
        raise _fail(
            "speculative_config",
            config,
            f"spec {spec.name} declares no DSpark draft (no dspark_* fields); accepted: None",
        )
    n = config.get("num_speculative_tokens", block)
    if not isinstance(n, int) or isinstance(n, bool) or n != block:
        raise _fail(
            "speculative_config['num_speculative_tokens']",
            n,
            f"DSpark drafts the spec's dspark_block_size; accepted: {block}",
        )
    if o.kv_cache_dtype != "bf16":
        raise _fail(
            "kv_cache_dtype",
            o.kv_cache_dtype,
            "packed (kv_cache_dtype='fp4') speculative caches are refused; accepted with "
            "speculative_config: 'bf16'",
        )
    mode = str(o.cudagraph_mode).split(".")[-1].upper()
    if mode == "PIECEWISE":
        raise _fail(
            "cudagraph_mode",
            o.cudagraph_mode,
            "a verify step's draft and acceptance run after the layers, inside the FULL "
            "graph; accepted with speculative_config: FULL, NONE",
        )
    return {"method": method, "num_speculative_tokens": n}


def _type_name(t) -> str:
    return " or ".join(x.__name__ for x in t) if isinstance(t, tuple) else t.__name__


def check_options(options: dict, spec: CacheSpec, world_size: int = 1) -> EngineOptions:
    """Resolve ``options`` against ``spec`` or raise ``ConfigError`` (before any load)."""
    opts = dict(options)
    for name, (off, why) in _REFUSED.items():
        if name in opts:
            value = opts.pop(name)
            if value != off and not (off is None and value in (False, 0, "")):
                raise _fail(name, value, why)
    kv_transfer = opts.pop("kv_transfer_config", None)
    if kv_transfer is not None:
        kv_transfer = _check_kv_transfer(kv_transfer, world_size)
    speculative = opts.pop("speculative_config", None)
    block_size = opts.pop("block_size", None)
    known = {f.name for f in fields(EngineOptions)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; accepted: {', '.join(sorted(known))}")
    o = EngineOptions(**opts, kv_transfer_config=kv_transfer)
    if speculative is not None:
        o = replace(o, speculative_config=_check_speculative(speculative, spec, o))
    if o.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise _fail("kv_cache_dtype", o.kv_cache_dtype, f"accepted: {', '.join(KV_CACHE_DTYPES)}")
    if o.index_cache_dtype not in INDEX_CACHE_DTYPES:
        raise _fail(
            "index_cache_dtype", o.index_cache_dtype, f"accepted: {', '.join(INDEX_CACHE_DTYPES)}"
        )
    if (o.kv_cache_dtype, o.index_cache_dtype) not in spec.geometries:
        pairs = ", ".join(f"{k}/{i}" for k, i in sorted(spec.geometries))
        raise _fail(
            "kv_cache_dtype/index_cache_dtype",
            (o.kv_cache_dtype, o.index_cache_dtype),
            f"spec {spec.name} declares: {pairs}",
        )
    page = spec.replay.hash_block_tokens
    if block_size is not None and block_size != page:
        raise _fail(
            "block_size", block_size, f"the PAGE is the spec's page_tokens; accepted: {page}"
        )
    if page % 2:
        raise _fail("page_tokens", page, "the cache block size must be even")
    mode = str(o.cudagraph_mode).split(".")[-1].upper()
    if mode not in CUDAGRAPH_MODES:
        raise _fail("cudagraph_mode", o.cudagraph_mode, f"accepted: {', '.join(CUDAGRAPH_MODES)}")
    if mode != "NONE" and o.enforce_eager:
        raise _fail("cudagraph_mode", o.cudagraph_mode, "graph modes need enforce_eager=False")
    if o.compilation_level not in (None, 0, 3):
        raise _fail("compilation_level", o.compilation_level, "accepted: 0, 3, None (auto)")
    if o.compile_backend not in COMPILE_BACKENDS:
        raise _fail(
            "compile_backend", o.compile_backend, f"accepted: {', '.join(COMPILE_BACKENDS)}"
        )
    d = spec.dims
    tp = o.tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or (tp != world_size and tp != 1):
        raise _fail(
            "tensor_parallel_size",
            tp,
            f"accepted: the launched world size ({world_size}), or 1 (every rank a full replica)",
        )
    if tp > 1:
        from v41plan.model.sharding import (
            check_tp,  # names the dimension and the sizes this model admits
        )

        check_tp(spec.model_config, tp, o.enable_expert_parallel)
    if o.max_num_seqs < 1:
        raise _fail("max_num_seqs", o.max_num_seqs, "accepted: an integer >= 1")
    if o.max_num_batched_tokens < 2 * page:
        raise _fail(
            "max_num_batched_tokens",
            o.max_num_batched_tokens,
            f"accepted: >= 2 * page_tokens = {2 * page} (a backed-off forward must fit)",
        )
    if o.long_prefill_token_threshold < 0:
        raise _fail(
            "long_prefill_token_threshold",
            o.long_prefill_token_threshold,
            "accepted: 0 (off) or >= 1",
        )
    max_pos = int(spec.model_config.get("max_position_embeddings", 4096))
    spec_block = o.speculative_config["num_speculative_tokens"] if o.speculative_config else 0
    max_len = o.max_model_len or max_pos - spec_block
    enc = (
        spec.replay.encoder_swa_bounded_replay
        if o.encoder_swa_bounded_replay is None
        else o.encoder_swa_bounded_replay
    )
    dec = (
        spec.replay.decoder_swa_bounded_replay
        if o.decoder_swa_bounded_replay is None
        else o.decoder_swa_bounded_replay
    )
    late_engram = [e for e in d.engram_layer_ids if e >= max(d.kv_source_layer_ids)]
    if dec and late_engram:
        raise _fail(
            "decoder_swa_bounded_replay",
            True,
            f"needs every Engram layer before the decoder (layer {max(d.kv_source_layer_ids)}); "
            f"Engram layers {late_engram} read every row; accepted with this spec: False",
        )
    if dec and spec.replay.min_final_prefill_rows < d.sliding_window:
        raise _fail(
            "decoder_swa_bounded_replay",
            True,
            f"needs min_final_prefill_rows >= window = {d.sliding_window} (the spec has "
            f"{spec.replay.min_final_prefill_rows}); accepted with this spec: False",
        )
    if enc and page < d.sliding_window - 1:
        raise _fail(
            "encoder_swa_bounded_replay",
            True,
            f"needs page_tokens >= window - 1 = {d.sliding_window - 1}; accepted with this spec: "
            f"False",
        )
    if o.device not in (None, "cpu", "cuda"):
        raise _fail("device", o.device, "accepted: cpu, cuda")
    if mode != "NONE" and o.device == "cpu":
        raise _fail("cudagraph_mode", o.cudagraph_mode, "graph modes need CUDA, not device='cpu'")
    for name in ("seed", "random_weights_seed"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(name, value, "accepted: an integer >= 0")
    if o.num_pages is not None and (
        isinstance(o.num_pages, bool) or not isinstance(o.num_pages, int) or o.num_pages < 1
    ):
        raise _fail("num_pages", o.num_pages, "accepted: an integer >= 1, or None (sized)")
    if o.dtype not in ("float32", "float64", "bfloat16"):
        raise _fail("dtype", o.dtype, "accepted: float32, float64, bfloat16")
    if o.kernel_backend not in KERNEL_BACKENDS:
        raise _fail("kernel_backend", o.kernel_backend, f"accepted: {', '.join(KERNEL_BACKENDS)}")
    if o.kernel_backend == "triton" and o.device == "cpu":
        raise _fail(
            "kernel_backend", "triton", "the Triton kernels need CUDA; accepted on cpu: torch"
        )
    if o.dense_kernels not in DENSE_KERNELS:
        raise _fail("dense_kernels", o.dense_kernels, f"accepted: {', '.join(DENSE_KERNELS)}")
    if o.dense_kernels == "triton" and o.device == "cpu":
        raise _fail(
            "dense_kernels", "triton", "the Triton kernels need CUDA; accepted on cpu: torch"
        )
    if o.moe_impl not in MOE_IMPLS:
        raise _fail("moe_impl", o.moe_impl, f"accepted: {', '.join(MOE_IMPLS)}")
    if o.async_scheduling not in (None, True, False):
        raise _fail("async_scheduling", o.async_scheduling, "accepted: True, False, None (auto)")
    if o.resident_weights not in (None, True, False):
        raise _fail("resident_weights", o.resident_weights, "accepted: True, False, None (auto)")
    if o.resident_weights:
        if o.device == "cpu":
            raise _fail(
                "resident_weights", True, "the W8A8/W4A8 kernels need CUDA; accepted on cpu: False"
            )
        if o.dtype == "float64":
            raise _fail(
                "resident_weights", True, "float64 runs dequantised weights; accepted: False"
            )
        if o.moe_impl == "dense":
            raise _fail(
                "resident_weights", True, "resident FP4 experts run grouped; with moe_impl='dense' "
                "accepted: False",
            )  # fmt: skip
    if o.speculative_config is not None:
        if max_len + spec_block > max_pos:
            raise _fail(
                "max_model_len",
                max_len,
                f"a verify forward runs {spec_block} positions past the last token; accepted "
                f"with speculative_config: <= max_position_embeddings - {spec_block} = "
                f"{max_pos - spec_block}",
            )
        if o.resident_weights:
            raise _fail(
                "resident_weights",
                True,
                "the DSpark draft runs on dequantised weights; accepted with speculative_config: "
                "False or None",
            )
    num_pages = o.num_pages or o.max_num_seqs * (-(-max_len // page) + 1) + 16
    return EngineOptions(
        **{
            **o.__dict__,
            "cudagraph_mode": mode,
            "max_model_len": max_len,
            "encoder_swa_bounded_replay": enc,
            "decoder_swa_bounded_replay": dec,
            "num_pages": num_pages,
        }
    )


def default_tensor_parallel_size(spec: CacheSpec, world_size: int, expert_parallel: bool) -> int:
    """The world size when the model splits over it, else 1 (every rank a full replica)."""
    if world_size == 1:
        return 1
    from v41plan.model.sharding import accepted_sizes

    return (
        world_size
        if world_size in accepted_sizes(spec.model_config, expert_parallel, world_size)
        else 1
    )


def resolve_kernels(o: EngineOptions, device_type: str) -> dict:
    """The kernel choices ``o``'s ``auto`` values take on ``device_type`` (``cpu``/``cuda``):
    ``{"kernel_backend", "dense_kernels", "moe_impl", "resident_weights", "compilation_level",
    "compile_backend"}`` (the backend None at level 0). The fast kernels run on CUDA in bf16 or
    float32; float64 (the exact validation mode) and the CPU keep the torch reference; level 3
    is the default under CUDA graphs."""
    fast = device_type == "cuda" and o.dtype != "float64"
    backend = o.kernel_backend if o.kernel_backend != "auto" else ("triton" if fast else "torch")
    dense = o.dense_kernels if o.dense_kernels != "auto" else ("triton" if fast else "torch")
    moe = o.moe_impl if o.moe_impl != "auto" else ("grouped" if fast else "dense")
    resident = o.resident_weights
    if resident is None:  # (the DSpark draft runs on dequantised weights)
        resident = fast and moe == "grouped" and o.speculative_config is None
    level = o.compilation_level
    if level is None:
        graphs = not o.enforce_eager and str(o.cudagraph_mode).split(".")[-1].upper() != "NONE"
        level = 3 if graphs and device_type == "cuda" and o.dtype != "float64" else 0
    return {
        "kernel_backend": backend,
        "dense_kernels": dense,
        "moe_impl": moe,
        "resident_weights": bool(resident),
        "compilation_level": level,
        "compile_backend": o.compile_backend if level == 3 else None,
    }


def add_kernel_flags(parser) -> None:
    """The kernel-choice flags every engine command shares (``--kernel-backend``,
    ``--dense-kernels``, ``--moe-impl``, ``--resident-weights``, ``--compilation-level``,
    ``--compile-backend``) and how it steps (``--async-scheduling``)."""
    import argparse

    parser.add_argument(
        "--kernel-backend",
        choices=KERNEL_BACKENDS,
        default="auto",
        help="pool-touching kernels: torch (the reference), triton (CUDA) or auto (triton on "
        "CUDA unless --dtype float64)",
    )
    parser.add_argument(
        "--dense-kernels",
        choices=DENSE_KERNELS,
        default="auto",
        help="mHC sites, expand and FP8 activation quantizer: torch, triton (CUDA) or auto",
    )
    parser.add_argument(
        "--moe-impl",
        choices=MOE_IMPLS,
        default="auto",
        help="dense (every expert on every row), grouped (selected experts only) or auto "
        "(grouped on CUDA unless float64)",
    )
    parser.add_argument(
        "--resident-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep FP8/FP4 weights as published on the device (W8A8/W4A8 kernels; default: on "
        "where CUDA, bf16/float32 and a grouped MoE allow it)",
    )
    parser.add_argument(
        "--compilation-level",
        type=int,
        choices=(0, 3),
        default=None,
        help="dense pieces eager (0) or under torch.compile (3); default: 3 with CUDA graphs "
        "unless --dtype float64, else 0",
    )
    parser.add_argument(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default="inductor",
        help="torch.compile backend of level 3 (aot_eager/eager: tracing only)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch decode step N+1 before reading step N's tokens (they stay on the device); "
        "default: on for CUDA",
    )


def kernel_options(args) -> dict:
    """The engine options of ``add_kernel_flags``' flags."""
    return {
        "kernel_backend": args.kernel_backend,
        "dense_kernels": args.dense_kernels,
        "moe_impl": args.moe_impl,
        "resident_weights": args.resident_weights,
        "compilation_level": args.compilation_level,
        "compile_backend": args.compile_backend,
        "async_scheduling": args.async_scheduling,
    }
