"""Pure derivations from a spec's values: layer roles and byte geometry.

Plain Python (no pydantic): the compiler calls these after validating a spec, and tests call
them directly. Nothing here re-validates input; ``v41plan.geometry.spec`` does that with
located errors before calling in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from v41plan.geometry.runtime import (
    INDEX_CACHE_DTYPES,
    KV_CACHE_DTYPES,
    CacheSpec,
    CaptureBuckets,
    LayerInfo,
    ModelDims,
    PlaneInfo,
    PoolGeometry,
    ReplayRules,
    StateField,
)

# A block id names this many index rows (one scorer tile).
INDEX_BLOCK_ROWS = 16
STATE_LAYOUT_VERSION = "state-tails-v1"


def align_up(n: int, a: int) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def resolve_layers(dims: ModelDims) -> tuple[LayerInfo, ...]:
    """Resolve every backbone layer's role by walking the layers in order.

    Raises ``ValueError`` for a topology the rules refuse; the spec front end checks the same
    rules earlier with located messages.
    """
    kv_sources = set(dims.kv_source_layer_ids)
    index_sources = set(dims.index_source_layer_ids)
    engram = set(dims.engram_layer_ids)
    decoder_start = max(dims.kv_source_layer_ids)
    cand = dims.candidate_source_layer_id
    kv_owner: int | None = None
    topk_owner: int | None = None
    out = []
    for i in range(dims.num_hidden_layers):
        r = dims.compress_ratios[i]
        segment = "decoder" if i >= decoder_start else "encoder"
        if r == 0:
            out.append(LayerInfo(i, segment, "window", 0, None, None, False, i in engram))
            continue
        if i in kv_sources:
            kv_owner = i
        if kv_owner is None or dims.compress_ratios[kv_owner] != r:
            raise ValueError(f"layer {i} has ratio {r} but no preceding KV owner of ratio {r}")
        if i in index_sources:
            topk_owner = i
        if topk_owner is None or topk_owner < kv_owner:
            raise ValueError(f"layer {i} has no index source at or after its KV owner {kv_owner}")
        role = "full" if i == kv_owner else "reindex" if i == topk_owner else "reuse"
        # Selections come from the candidates when scored inside them or inherited from a layer
        # that was.
        sel = i if role == "reindex" else topk_owner
        uses_candidates = cand >= 0 and sel > cand
        out.append(
            LayerInfo(i, segment, role, r, kv_owner, topk_owner, uses_candidates, i in engram)
        )
    return tuple(out)


def main_row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes of one compressed main-KV row: bf16, or fp4 E2M1 values + E4M3 group-16 scales."""
    return 2 * head_dim if kv_cache_dtype == "bf16" else head_dim // 2 + head_dim // 16


def index_row_bytes(index_cache_dtype: str, index_head_dim: int) -> int:
    """Bytes of one index-key row: fp8 E4M3 + fp32 scale, or fp4 E2M1 + E8M0 group-32 scales."""
    if index_cache_dtype == "fp8":
        return index_head_dim + 4
    return index_head_dim // 2 + index_head_dim // 32


def ring_row_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    """Bytes of one SWA ring row: bf16, or FP8 E4M3 + E8M0 group-32 scales under fp4 main."""
    return 2 * head_dim if kv_cache_dtype == "bf16" else head_dim + head_dim // 32


STATE_FIELD_ORDER = ("swa_rings", "tail_values", "tail_scores", "cursor")
DEFAULT_IMAGE_FIELDS = ("swa_rings", "cursor")


def layout_id(
    dims: ModelDims,
    page_tokens: int,
    kv: str,
    index: str,
    history: int,
    image_fields: tuple[str, ...] = DEFAULT_IMAGE_FIELDS,
    speculative_tokens: int = 0,
    draft_layers: int = 0,
) -> str:
    """Identity of every byte meaning of a pool: changes when formats, PAGE, layers, dims,
    window, history, the image's fields or the speculative slack and draft rings change (the
    default image and no speculation add no term)."""
    owners = ",".join(f"{o}:{dims.compress_ratios[o]}" for o in dims.kv_source_layer_ids)
    carried = tuple(f for f in STATE_FIELD_ORDER if f in image_fields)
    image = "" if carried == DEFAULT_IMAGE_FIELDS else ":image=" + "+".join(carried)
    return (
        f"v41plan-main-{kv}-index-{index}-{STATE_LAYOUT_VERSION}:layers={dims.num_hidden_layers}"
        f":owners={owners}:page={page_tokens}:window={dims.sliding_window}"
        f":dims={dims.head_dim},{dims.qk_rope_head_dim},{dims.index_head_dim}:history={history}"
        f"{image}"
        + (f":spec={speculative_tokens}:draft={draft_layers}" if speculative_tokens else "")
    )


def derive_geometry(
    dims: ModelDims,
    page_tokens: int,
    kv_cache_dtype: str,
    index_cache_dtype: str,
    image_fields: tuple[str, ...] = ("swa_rings", "cursor"),
    speculative_tokens: int = 0,
    draft_layers: int = 0,
) -> PoolGeometry:
    """Byte geometry of the PAGE unit and the STATE entry for one format pair; with
    ``speculative_tokens`` the DSpark layout: rings of ``window + speculative_tokens`` rows,
    and ``draft_layers`` more rings (the draft stages') after the backbone's."""
    hd, ihd = dims.head_dim, dims.index_head_dim
    alignment = 2 * hd if kv_cache_dtype == "bf16" else 256
    field_align = max(256, alignment)
    mrow = main_row_bytes(kv_cache_dtype, hd)
    irow = index_row_bytes(index_cache_dtype, ihd)
    planes: list[PlaneInfo] = []
    main_off = 0
    owners = list(dims.kv_source_layer_ids)
    for o in owners:
        r = dims.compress_ratios[o]
        rows = page_tokens // r
        nbytes = rows * mrow
        planes.append(PlaneInfo(f"main.{o}", "main", o, r, mrow, rows, nbytes, main_off, main_off))
        main_off += align_up(nbytes, field_align)
    page_bytes = align_up(main_off, alignment)
    unit_off = page_bytes
    for o in owners:
        r = dims.compress_ratios[o]
        rows = page_tokens // r
        if index_cache_dtype == "fp8":
            parts = [("index", irow)]
        else:
            parts = [("index_values", ihd // 2), ("index_scales", ihd // 32)]
        for kind, rb in parts:
            nbytes = rows * rb
            planes.append(PlaneInfo(f"{kind}.{o}", kind, o, r, rb, rows, nbytes, unit_off, 0))
            unit_off += nbytes
    page_unit_bytes = unit_off

    ring_rows = dims.sliding_window + speculative_tokens
    ring_layers = dims.num_hidden_layers + draft_layers
    rrow = ring_row_bytes(kv_cache_dtype, hd)
    n_tail_owners = sum(1 for o in owners if dims.compress_ratios[o] == 2)
    history = dims.engram_max_ngram_size - 1
    specs = [
        (
            "swa_rings",
            "bfloat16" if kv_cache_dtype == "bf16" else "uint8",
            (ring_layers, ring_rows, hd if kv_cache_dtype == "bf16" else rrow),
            ring_layers * ring_rows * rrow,
        ),
        ("tail_values", "float32", (n_tail_owners, hd), n_tail_owners * hd * 4),
        ("tail_scores", "float32", (n_tail_owners, hd), n_tail_owners * hd * 4),
        ("cursor", "int64", (1 + history,), (1 + history) * 8),
    ]
    fields: list[StateField] = []
    off = 0
    image_bytes = 0
    for name, dtype, shape, nbytes in specs:
        fb = align_up(nbytes, field_align)
        carried = name in image_fields
        fields.append(StateField(name, dtype, shape, off, nbytes, fb, carried))
        off += fb
        if carried:
            image_bytes += fb
    state_bytes = align_up(off, alignment)
    per_token = sum((mrow + irow) / dims.compress_ratios[o] for o in owners)
    return PoolGeometry(
        kv_cache_dtype=kv_cache_dtype,
        index_cache_dtype=index_cache_dtype,
        page_tokens=page_tokens,
        alignment_bytes=alignment,
        main_row_bytes=mrow,
        index_row_bytes=irow,
        ring_row_bytes=rrow,
        ring_rows=ring_rows,
        page_bytes=page_bytes,
        page_unit_bytes=page_unit_bytes,
        planes=tuple(planes),
        state_fields=tuple(fields),
        state_bytes=state_bytes,
        image_bytes=image_bytes,
        units_per_image=math.ceil(image_bytes / page_unit_bytes),
        global_kv_bytes_per_token=per_token,
        layout_id=layout_id(
            dims,
            page_tokens,
            kv_cache_dtype,
            index_cache_dtype,
            history,
            tuple(image_fields),
            speculative_tokens,
            draft_layers,
        ),
        speculative_tokens=speculative_tokens,
        draft_layers=draft_layers,
    )


DIM_FIELDS = tuple(ModelDims.__dataclass_fields__)


def dims_from_model(model: Mapping[str, Any]) -> ModelDims:
    """Pick the cache dimensions out of a spec's ``model`` mapping (HF field names)."""
    vals = {}
    for k in DIM_FIELDS:
        v = model[k]
        vals[k] = tuple(v) if isinstance(v, list | tuple) else v
    return ModelDims(**vals)


def build_cache_spec(raw: Mapping[str, Any], spec_path: str, spec_sha256: str) -> CacheSpec:
    """Build the runtime ``CacheSpec`` from an already-validated spec mapping."""
    model = dict(raw["model"])
    dims = dims_from_model(model)
    pool = raw["pool"]
    ckpt = tuple(raw.get("checkpoint", {}).get("image_fields", ("swa_rings", "cursor")))
    geometries = {
        (kv, ix): derive_geometry(dims, pool["page_tokens"], kv, ix, ckpt)
        for kv in KV_CACHE_DTYPES
        if kv in pool.get("kv_cache_dtypes", KV_CACHE_DTYPES)
        for ix in INDEX_CACHE_DTYPES
        if ix in pool.get("index_cache_dtypes", INDEX_CACHE_DTYPES)
    }
    spec_geometries = {}
    if model.get("dspark_block_size") is not None:
        # DSpark admits BF16 caches only: its layout exists for the BF16-main pairs
        spec_geometries = {
            (kv, ix): derive_geometry(
                dims,
                pool["page_tokens"],
                kv,
                ix,
                ckpt,
                int(model["dspark_block_size"]),
                int(model["num_nextn_predict_layers"]),
            )
            for (kv, ix) in geometries
            if kv == "bf16"
        }
    rp = raw["replay"]
    cap = raw["capture"]
    return CacheSpec(
        name=raw["name"],
        spec_path=spec_path,
        spec_sha256=spec_sha256,
        dims=dims,
        layers=resolve_layers(dims),
        geometries=geometries,
        replay=ReplayRules(
            encoder_swa_bounded_replay=bool(rp["encoder_swa_bounded_replay"]),
            decoder_swa_bounded_replay=bool(rp["decoder_swa_bounded_replay"]),
            hash_block_tokens=int(rp["hash_block_tokens"]),
            replay_history_tokens=int(rp["replay_history_tokens"]),
            min_final_prefill_rows=int(rp["min_final_prefill_rows"]),
        ),
        checkpoint_image_fields=ckpt,
        capture=CaptureBuckets(tuple(cap["batch_sizes"]), tuple(cap["query_buckets"])),
        model_config=_plain(model),
        speculative_geometries=spec_geometries,
    )


def _plain(v: Any) -> Any:
    """Convert ruamel containers to plain dicts/lists for emitting."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def load_cache_spec_unchecked(path: str) -> CacheSpec:
    """Load a spec file straight into a ``CacheSpec`` without the located-error front end.

    For tests and tools that run before the compiler: YAML via ruamel (safe), no validation
    beyond what building the runtime types enforces. Without ruamel (the GPU image), PyYAML's
    safe loader: YAML 1.1, the same data for every shipped spec (a test compares them; its
    floats need a dot, ``1.0e-6``, as theirs have).
    """
    from pathlib import Path

    from v41plan.geometry.runtime import file_sha256

    text = Path(path).read_text()
    try:
        from ruamel.yaml import YAML
    except ImportError:
        import yaml

        raw = yaml.safe_load(text)
    else:
        raw = YAML(typ="safe", pure=True).load(text)
    return build_cache_spec(raw, str(path), file_sha256(path))
