"""Plain runtime types of a compiled spec.

These frozen dataclasses are what the compiler emits into ``v41plan/generated/<spec>/`` and
what the planner and executor consume. They import nothing beyond the standard library, so
``generated/``, ``v41plan.model``, ``v41plan.runtime`` and ``v41plan.serving`` load on machines
without pydantic or ruamel.yaml.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Role = Literal["window", "full", "reuse", "reindex"]
Segment = Literal["encoder", "decoder"]
KvCacheDtype = Literal["bf16", "fp4"]
IndexCacheDtype = Literal["fp8", "fp4"]

KV_CACHE_DTYPES: tuple[str, ...] = ("bf16", "fp4")
INDEX_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp4")


@dataclass(frozen=True)
class LayerInfo:
    """One backbone layer's resolved attention role."""

    index: int
    """Layer id, 0-based."""
    segment: Segment
    """``encoder`` before the last KV source, ``decoder`` from it on."""
    role: Role
    """``window`` (ratio 0), ``full`` (KV source), ``reindex`` (index source only) or ``reuse``."""
    ratio: int
    """Compression ratio: 0 (window only), 1 or 2."""
    kv_owner: int | None
    """Layer whose compressed KV this layer reads; None for window layers."""
    topk_owner: int | None
    """Layer whose top-k selection this layer reads; None for window layers."""
    uses_candidates: bool
    """True when the layer scores inside the candidate source's blocks."""
    engram: bool
    """True when an Engram module runs before this layer's block."""


DSPARK_FIELDS = (
    "dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id",
    "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)  # fmt: skip
"""The model fields of a DSpark draft: a spec or config sets all of them or none."""


@dataclass(frozen=True)
class ModelDims:
    """The model dimensions the cache needs (HF config field names)."""

    num_hidden_layers: int
    num_nextn_predict_layers: int
    head_dim: int
    qk_rope_head_dim: int
    num_attention_heads: int
    o_groups: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_max_ngram_size: int


@dataclass(frozen=True)
class PlaneInfo:
    """One plane of a PAGE unit: an owner's main rows or one of its index planes."""

    name: str
    """``main.<owner>``, ``index.<owner>`` (fp8) or
    ``index_values.<owner>``/``index_scales.<owner>`` (fp4)."""
    kind: Literal["main", "index", "index_values", "index_scales"]
    owner: int
    """The Full owner layer."""
    ratio: int
    row_bytes: int
    """Bytes of one compressed row in this plane."""
    rows_per_page: int
    """Compressed rows one PAGE holds: ``page_tokens // ratio``."""
    bytes_per_page: int
    """Bytes of this plane's slice of one PAGE unit."""
    offset: int
    """Byte offset of this plane's slice inside one PAGE unit (main region first, then index
    planes)."""
    region_offset: int
    """Byte offset inside its region: within the main PAGE (main planes) or 0 (index planes)."""


@dataclass(frozen=True)
class StateField:
    """One field of a STATE entry."""

    name: str
    """``swa_rings``, ``tail_values``, ``tail_scores`` or ``cursor``."""
    dtype: str
    """Storage dtype: ``bfloat16``, ``uint8``, ``float32`` or ``int64``."""
    shape: tuple[int, ...]
    """Shape in elements of ``dtype``."""
    offset: int
    """Byte offset inside the STATE entry (aligned)."""
    nbytes: int
    """Payload bytes (unaligned)."""
    field_bytes: int
    """Bytes the field occupies, padded to the alignment."""
    in_checkpoint: bool
    """True when a checkpoint image carries the field."""


@dataclass(frozen=True)
class PoolGeometry:
    """Byte geometry of the pools for one (kv_cache_dtype, index_cache_dtype) pair."""

    kv_cache_dtype: str
    index_cache_dtype: str
    page_tokens: int
    alignment_bytes: int
    main_row_bytes: int
    index_row_bytes: int
    ring_row_bytes: int
    """Bytes of one SWA ring row: 1024 bf16 at head_dim 512, or FP8 values + E8M0 scales under fp4
    main."""
    ring_rows: int
    """Rows of one SWA ring (the window)."""
    page_bytes: int
    """Bytes of one PAGE's main region (every Full owner's main rows)."""
    page_unit_bytes: int
    """Bytes of one PAGE unit: the main region plus every index plane's slice."""
    planes: tuple[PlaneInfo, ...]
    state_fields: tuple[StateField, ...]
    state_bytes: int
    image_bytes: int
    """Bytes of a checkpoint image (the fields with ``in_checkpoint``, each padded)."""
    units_per_image: int
    global_kv_bytes_per_token: float
    layout_id: str
    speculative_tokens: int = 0
    """Draft tokens a verify forward writes past the committed position (0: no speculation).
    The SWA rings hold ``window + speculative_tokens`` rows, so a rejected draft's rows never
    overwrite the window the next forward reads."""
    draft_layers: int = 0
    """DSpark draft stages whose window rings follow the backbone's in ``swa_rings``."""

    def plane(self, name: str) -> PlaneInfo:
        """Return the plane called ``name``."""
        for p in self.planes:
            if p.name == name:
                return p
        raise KeyError(f"no plane {name!r} in layout {self.layout_id}")

    def state_field(self, name: str) -> StateField:
        """Return the STATE field called ``name``."""
        for f in self.state_fields:
            if f.name == name:
                return f
        raise KeyError(f"no STATE field {name!r} in layout {self.layout_id}")


@dataclass(frozen=True)
class ReplayRules:
    """Bounded-replay rules of a spec."""

    encoder_swa_bounded_replay: bool
    decoder_swa_bounded_replay: bool
    hash_block_tokens: int
    replay_history_tokens: int
    min_final_prefill_rows: int


@dataclass(frozen=True)
class CaptureBuckets:
    """CUDA-graph capture buckets (decode only)."""

    batch_sizes: tuple[int, ...]
    query_buckets: tuple[int, ...]


@dataclass(frozen=True)
class CacheSpec:
    """A whole compiled spec: dimensions, roles, geometries, rules and model hyperparameters."""

    name: str
    spec_path: str
    spec_sha256: str
    dims: ModelDims
    layers: tuple[LayerInfo, ...]
    geometries: dict[tuple[str, str], PoolGeometry] = field(hash=False, compare=False)
    replay: ReplayRules
    checkpoint_image_fields: tuple[str, ...]
    capture: CaptureBuckets
    model_config: dict = field(hash=False, compare=False)
    """HF ``config.json`` fields (published V4.1 names) for this spec's model."""
    speculative_geometries: dict[tuple[str, str], PoolGeometry] = field(
        default_factory=dict, hash=False, compare=False
    )
    """The second layout of a spec whose model declares a DSpark draft: per BF16-main format
    pair, rings of ``window + dspark_block_size`` rows and the draft stages' rings in STATE
    (its own layout id); empty without a draft."""

    def geometry(
        self,
        kv_cache_dtype: str = "bf16",
        index_cache_dtype: str = "fp8",
        speculative: bool = False,
    ) -> PoolGeometry:
        """Return the pool geometry of a format pair (the DSpark layout with ``speculative``),
        refusing unknown formats and pairs the spec does not declare."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported; "
                f"accepted: {', '.join(KV_CACHE_DTYPES)}"
            )
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise ValueError(
                f"index_cache_dtype={index_cache_dtype!r} is not supported; accepted: "
                f"{', '.join(INDEX_CACHE_DTYPES)}"
            )
        key = (kv_cache_dtype, index_cache_dtype)
        if key not in self.geometries:
            raise ValueError(f"spec {self.name} does not declare the pair {key}")
        if not speculative:
            return self.geometries[key]
        if not self.speculative_geometries:
            raise ValueError(
                f"spec {self.name} declares no DSpark draft (no dspark_* fields): "
                "speculative decoding needs one"
            )
        if key not in self.speculative_geometries:
            raise ValueError(
                f"speculative decoding needs BF16 caches: kv_cache_dtype={kv_cache_dtype!r} "
                "is refused; accepted: 'bf16'"
            )
        return self.speculative_geometries[key]

    @property
    def owners(self) -> tuple[LayerInfo, ...]:
        """The Full owners (KV sources), in layer order."""
        return tuple(layer for layer in self.layers if layer.role == "full")

    @property
    def last_kv_source(self) -> int:
        """The first decoder layer."""
        return max(self.dims.kv_source_layer_ids)


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes (the spec hash in generated headers)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def generated_package(spec_name: str) -> str:
    """Module path of a spec's generated package."""
    return f"v41plan.generated.{spec_name}"


def load_cache_spec(spec: str | Path, *, check_hash: bool = True) -> CacheSpec:
    """Load a compiled spec by path (``specs/tiny.yaml``) or name (``tiny``) from ``generated/``.

    Reads no YAML: the spec's generated module carries everything. With ``check_hash`` a spec
    file that changed since it was compiled is refused, naming the command that fixes it.
    """
    p = Path(spec)
    name = p.stem if p.suffix in (".yaml", ".yml") else str(spec)
    try:
        mod = importlib.import_module(generated_package(name) + ".geometry")
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"spec {name!r} has no generated code under v41plan/generated/{name}/; "
            f"run `v41plan compile specs/`"
        ) from exc
    cache_spec: CacheSpec = mod.CACHE_SPEC
    if check_hash and p.suffix in (".yaml", ".yml") and p.exists():
        digest = file_sha256(p)
        if digest != cache_spec.spec_sha256:
            raise ValueError(
                f"{p}: generated code is stale (spec sha256 {digest[:12]} != compiled "
                f"{cache_spec.spec_sha256[:12]}); run `v41plan compile specs/`"
            )
    return cache_spec
