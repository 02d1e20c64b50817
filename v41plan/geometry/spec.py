"""The YAML spec language: round-trip loading, frozen pydantic models and located checks.

``compile_spec(path)`` is the front end of the compiler. It loads a spec with ruamel.yaml's
round-trip loader (YAML 1.2, duplicate keys refused, every node positioned), validates it in
three tiers and returns the runtime ``CacheSpec``:

1. field tier: the pydantic models below (``extra="forbid"``, strict types, frozen);
2. entity tier: rules inside one section or between sections (``_check_*``);
3. cross-entity tier: the layer/plane graph of ``v41plan.geometry.topology`` (owners, top-k
   owners, candidates, segments, Engram), then the declared ``roles:`` against the resolved ones.

Every problem is one ``SpecError`` printed ``file:line:col: message (hint)``; the first problem
found stops the compile. Only the compiler imports this module: generated code and the executor
never load pydantic or ruamel.yaml.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from v41plan.geometry.derive import INDEX_BLOCK_ROWS, build_cache_spec, dims_from_model
from v41plan.geometry.errors import Location, Locator, SpecError
from v41plan.geometry.runtime import DSPARK_FIELDS, INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, CacheSpec

SPEC_VERSION = 1
IMAGE_FIELDS = ("swa_rings", "tail_values", "tail_scores", "cursor")
REQUIRED_IMAGE_FIELDS = ("swa_rings", "cursor")
RATIOS = (0, 1, 2)
PAGE_TOKENS_FLOOR = 32
HEAD_DIM_MULTIPLE = 32
README_HINT = "see specs/README.md"


class _Section(BaseModel):
    """Base of every spec section: unknown keys refused, no coercion, immutable."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )


class RopeScaling(_Section):
    """YaRN RoPE scaling (HF ``rope_scaling``)."""

    type: Literal["yarn"]
    """Scaling kind; only ``yarn`` is used by V4.1."""
    factor: float
    """Context extension factor."""
    original_max_position_embeddings: int = Field(gt=0)
    """Context length the base RoPE was trained at."""
    beta_fast: float
    """YaRN ramp upper bound (rotations)."""
    beta_slow: float
    """YaRN ramp lower bound (rotations)."""


class ModelSection(_Section):
    """The model's hyperparameters under their published HF ``config.json`` names.

    The first block are the dimensions the cache needs (``runtime.ModelDims``); the rest are
    model-only and are copied verbatim into the checkpoint's ``config.json``.
    """

    # Dimensions the cache needs (ModelDims).
    num_hidden_layers: int = Field(gt=0)
    """Backbone layers (40 in V4.1-Flash)."""
    num_nextn_predict_layers: int = Field(ge=0)
    """Draft (DSpark) layers after the backbone; their ``compress_ratios`` entries are 0."""
    head_dim: int = Field(gt=0)
    """Latent attention head width (NoPE + RoPE lanes); a multiple of 32."""
    qk_rope_head_dim: int = Field(gt=0)
    """RoPE lanes at the end of each head; even and at most min(head_dim, index_head_dim)."""
    num_attention_heads: int = Field(gt=0)
    """Query heads; divisible by ``o_groups``."""
    o_groups: int = Field(gt=0)
    """Output-projection groups."""
    index_n_heads: int = Field(gt=0)
    """Indexer query heads."""
    index_head_dim: int = Field(gt=0)
    """Indexer key/query width; a multiple of 32."""
    index_topk: int = Field(gt=0)
    """Compressed rows each query selects."""
    sliding_window: int = Field(gt=0)
    """Window W: rows of every layer's SWA ring."""
    compress_ratios: tuple[int, ...]
    """Per-layer compression ratio in {0, 1, 2}, backbone then draft layers."""
    kv_source_layer_ids: tuple[int, ...]
    """Full owners: layers whose compressor writes global main KV (sorted, unique)."""
    index_source_layer_ids: tuple[int, ...]
    """Layers that score and select top-k (a superset of the KV sources)."""
    candidate_source_layer_id: int = Field(ge=-1)
    """Index source whose selection later Reindex layers rescore inside; -1 for none."""
    candidate_topk_blocks: int = Field(gt=0)
    """Blocks the candidate source keeps."""
    candidate_block_size: int = Field(gt=0)
    """Compressed rows per candidate block."""
    engram_layer_ids: tuple[int, ...]
    """Layers with an Engram module before their block (sorted, unique)."""
    engram_max_ngram_size: int = Field(ge=2)
    """Longest Engram n-gram; the cursor keeps ``engram_max_ngram_size - 1`` history ids."""

    # Model-only hyperparameters (written to config.json; the cache does not read them).
    vocab_size: int = Field(gt=0)
    """Token vocabulary."""
    hidden_size: int = Field(gt=0)
    """Residual stream width."""
    num_key_value_heads: Literal[1]
    """KV heads; V4.1 has one latent KV head."""
    q_lora_rank: int = Field(gt=0)
    """Query low-rank width."""
    o_lora_rank: int = Field(gt=0)
    """Output low-rank width per group."""
    n_routed_experts: int = Field(gt=0)
    """Routed MoE experts."""
    num_experts_per_tok: int = Field(gt=0)
    """Experts each token routes to."""
    n_shared_experts: int = Field(ge=0)
    """Shared (always-on) experts."""
    moe_intermediate_size: int = Field(gt=0)
    """Expert FFN width."""
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"]
    """Router score function."""
    topk_method: str
    """Router top-k method name (HF field)."""
    norm_topk_prob: bool
    """Renormalize the selected experts' weights."""
    routed_scaling_factor: float
    """Scale of the routed experts' sum."""
    swiglu_limit: float
    """Clamp of the SwiGLU inputs."""
    hc_mult: int = Field(gt=0)
    """Hyper-connection streams (mHC)."""
    hc_sinkhorn_iters: int = Field(gt=0)
    """Sinkhorn iterations of the mHC mixing matrix."""
    hc_eps: float
    """Epsilon of the mHC normalization."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    rope_theta: float
    """RoPE base of the attention path."""
    compress_rope_theta: float
    """RoPE base of the compressed (global) path."""
    rope_scaling: RopeScaling
    """YaRN scaling."""
    max_position_embeddings: int = Field(gt=0)
    """Longest supported position."""
    engram_n_heads: int = Field(gt=0)
    """Engram hash heads per n-gram order."""
    engram_head_dim: int = Field(gt=0)
    """Engram table row width."""
    engram_vocab_size: int = Field(gt=0)
    """Engram hash-table base size (per-head primes are derived from it)."""
    engram_pad_token_id: int = Field(ge=0)
    """Compressed id used before the first token."""
    engram_compressed_vocab_size: int = Field(gt=0)
    """Size of the compressed (normalized) token vocabulary Engram hashes."""
    bos_token_id: int = Field(ge=0)
    """Beginning-of-sequence token."""
    eos_token_id: int = Field(ge=0)
    """End-of-sequence token."""
    dspark_block_size: int | None = None
    """Optional: DSpark draft block (tokens per draft). The ``dspark_*`` fields come all
    together or not at all (``_check_dspark``)."""
    dspark_target_layer_ids: tuple[int, ...] | None = None
    """Optional: backbone layers DSpark taps."""
    dspark_noise_token_id: int | None = None
    """Optional: DSpark noise token."""
    dspark_markov_rank: int | None = None
    """Optional: DSpark Markov head rank."""
    dspark_n_routed_experts: int | None = None
    """Optional: routed experts of the draft layers."""
    dspark_num_experts_per_tok: int | None = None
    """Optional: experts per token in the draft layers."""


class PoolSection(_Section):
    """PAGE geometry and the cache formats a runtime may choose between."""

    page_tokens: int
    """Tokens per PAGE (also the prefix-cache hash block): even, >= 32, a multiple of every
    ratio, ``page_tokens / ratio`` a multiple of 16, and >= W - 1 under encoder replay."""
    kv_cache_dtypes: tuple[str, ...] = Field(min_length=1)
    """Main KV formats compiled: ``bf16`` and/or ``fp4``."""
    index_cache_dtypes: tuple[str, ...] = Field(min_length=1)
    """Index plane formats compiled: ``fp8`` and/or ``fp4``."""


class RolesSection(_Section):
    """Declared layer roles; checked against the roles resolved from the sources."""

    full: tuple[int, ...]
    """Full layers (must equal the KV sources)."""
    reindex: tuple[int, ...]
    """Reindex layers (index sources that are not KV sources)."""
    window: tuple[int, ...]
    """Window layers (ratio 0 backbone layers)."""
    reuse: tuple[int, ...] | None = None
    """Reuse layers; omitted means every backbone layer not listed elsewhere."""
    decoder_start: int | None = None
    """Optional: the first decoder layer (the last KV source)."""


class ReplaySection(_Section):
    """Bounded-replay rules."""

    encoder_swa_bounded_replay: bool
    """Resume prefix hits by replaying one hash block (no STATE checkpoints)."""
    decoder_swa_bounded_replay: bool
    """A final prefill runs the decoder only on its last W rows."""
    hash_block_tokens: int
    """Prefix-cache hash block; must equal ``pool.page_tokens``."""
    replay_history_tokens: int
    """Compressed Engram ids a replay restores; ``engram_max_ngram_size - 1``."""
    min_final_prefill_rows: int
    """Fewest rows the forward finishing a prompt runs (it backs off a hash block otherwise);
    1..page_tokens, and >= W under decoder replay."""


class CheckpointSection(_Section):
    """What a checkpoint image carries."""

    image_fields: tuple[str, ...] = ("swa_rings", "cursor")
    """STATE fields copied into an image: ``swa_rings`` and ``cursor`` are required; the FP32
    compressor tails are left out (a resumed forward overwrites them before reading)."""


class CaptureSection(_Section):
    """CUDA-graph capture buckets (decode only)."""

    batch_sizes: tuple[int, ...] = Field(min_length=1)
    """Decode batch widths captured (sorted, unique, positive)."""
    query_buckets: tuple[int, ...] = Field(min_length=1)
    """Query rows per request captured (sorted, unique, positive)."""


class SpecModel(_Section):
    """A whole spec file."""

    spec_version: int
    """Spec language version; 1."""
    name: str
    """Spec name: the file's stem and the package name under ``v41plan/generated/``."""
    description: str
    """One line shown by ``explain``."""
    model: ModelSection
    """Model hyperparameters (HF names)."""
    pool: PoolSection
    """PAGE geometry and formats."""
    roles: RolesSection | None = None
    """Optional declared roles, checked against the resolved ones."""
    replay: ReplaySection
    """Bounded-replay rules."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Checkpoint image contents."""
    capture: CaptureSection
    """CUDA-graph capture buckets."""


SECTION_MODELS: tuple[type[BaseModel], ...] = (
    SpecModel,
    ModelSection,
    RopeScaling,
    PoolSection,
    RolesSection,
    ReplaySection,
    CheckpointSection,
    CaptureSection,
)


@dataclass(frozen=True)
class LoadedSpec:
    """A spec that passed every check, with what the code generator needs."""

    path: Path
    display_path: str
    """Path as written into generated headers: ``<folder>/<file>`` (``specs/tiny.yaml``)."""
    sha256: str
    """sha256 of the file's bytes."""
    model: SpecModel
    raw: dict
    """The spec as plain Python values (dicts, tuples, scalars)."""
    locator: Locator
    cache_spec: CacheSpec


def display_path(path: Path) -> str:
    """``<parent folder>/<file name>``: stable whatever the working directory (the absolute
    path decides the folder, so ``tiny.yaml`` typed inside ``specs/`` is ``specs/tiny.yaml``)."""
    a = Path(os.path.abspath(path))
    return f"{a.parent.name}/{a.name}" if a.parent.name else a.name


def compile_spec(path: str | Path) -> CacheSpec:
    """Load, validate and resolve a spec file into its runtime ``CacheSpec``."""
    return load_spec(path).cache_spec


def load_spec(path: str | Path) -> LoadedSpec:
    """Load and check a spec file; raises ``SpecError`` for the first problem."""
    p = Path(path)
    shown = display_path(p)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SpecError(
            Locator(shown).at(), f"cannot read the spec: {exc.strerror}", "check the path"
        ) from None
    tree = _parse_yaml(data, shown)
    loc = Locator(shown, tree)
    raw = _plain(tree)
    if not isinstance(raw, dict):
        raise loc.error((), "a spec must be a mapping of sections", "start with `spec_version: 1`")
    try:
        model = SpecModel.model_validate(raw)
    except ValidationError as exc:
        raise _from_pydantic(exc, loc, raw) from None
    _check_header(model, p, loc)
    _check_model(model.model, loc)
    _check_dspark(model.model, loc)
    _check_pool(model, loc)
    _check_replay(model, loc)
    _check_checkpoint(model.checkpoint, loc)
    _check_capture(model.capture, loc)

    from v41plan.geometry.topology import build_layer_graph, layers_from_graph

    dims = dims_from_model(raw["model"])
    graph = build_layer_graph(
        dims, locator=loc, decoder_replay=model.replay.decoder_swa_bounded_replay
    )
    layers = layers_from_graph(graph)
    if model.roles is not None:
        _check_roles(model.roles, layers, loc)
    cache_spec = build_cache_spec(raw, shown, hashlib.sha256(data).hexdigest())
    if cache_spec.layers != layers:  # the graph and derive.resolve_layers are one rule set
        raise loc.error(("model",), "internal: graph roles differ from derive", "report this")
    return LoadedSpec(p, shown, cache_spec.spec_sha256, model, raw, loc, cache_spec)


# --- loading -------------------------------------------------------------------------------


def _parse_yaml(data: bytes, shown: str) -> Any:
    from ruamel.yaml import YAML
    from ruamel.yaml.constructor import DuplicateKeyError
    from ruamel.yaml.error import MarkedYAMLError

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            Locator(shown).at(), f"the spec is not UTF-8 ({exc.reason})", "save it as UTF-8"
        ) from None
    try:
        return YAML(typ="rt", pure=True).load(text)
    except DuplicateKeyError as exc:
        mark = exc.problem_mark
        key = re.search(r'duplicate key "([^"]*)"', exc.problem or "")
        first = exc.context_mark
        where = f"; the first is at line {first.line + 1}" if first is not None else ""
        raise SpecError(
            _mark(shown, mark),
            f"duplicate key {key.group(1) if key else '?'!r}",
            f"keep one of them{where}",
        ) from None
    except MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        hint = "fix the YAML here"
        if "'\\t'" in problem:
            hint = "indent with spaces, not tabs"
        elif exc.context and exc.problem and exc.context_mark is not None:
            hint = f"{exc.context} at line {exc.context_mark.line + 1}"
        raise SpecError(_mark(shown, mark), f"YAML syntax error: {problem}", hint) from None


def _mark(shown: str, mark: Any) -> Location:
    if mark is None:
        return Location(shown, 1, 1)
    return Location(shown, mark.line + 1, mark.column + 1)


def _plain(v: Any) -> Any:
    """ruamel round-trip values -> plain dicts, tuples and scalars (strict pydantic input)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return tuple(_plain(x) for x in v)
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    if isinstance(v, str):
        return str(v)
    return v


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
}


def _from_pydantic(exc: ValidationError, loc: Locator, raw: dict) -> SpecError:
    """The first pydantic error as a located ``SpecError`` with a hint."""
    errors = exc.errors(include_url=False)
    # An unknown key is usually a misspelt one, which pydantic also reports as missing.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    path = _tree_path(err["loc"], raw)
    dotted = _dotted(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent = _model_at(path[:-1])
        accepted = ", ".join(parent.model_fields) if parent else ""
        where = f" in {_dotted(path[:-1])}" if len(path) > 1 else ""
        return SpecError(
            loc.key(*path),
            f"unknown key {path[-1]!r}{where}",
            f"remove it or fix its spelling; accepted keys: {accepted}",
        )
    if kind == "missing":
        where = _dotted(path[:-1]) or "the spec"
        return SpecError(
            loc.at(*path[:-1]),
            f"missing key {path[-1]!r} in {where}",
            f"add `{path[-1]}: ...`; {README_HINT}",
        )
    got = err.get("input")
    if kind in _TYPE_WORDS:
        return SpecError(
            loc.at(*path),
            f"{dotted} must be {_TYPE_WORDS[kind]}, not {_show(got)}",
            "write the value without quotes"
            if isinstance(got, str) and kind != "string_type"
            else f"write {_TYPE_WORDS[kind]}",
        )
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return SpecError(
            loc.at(*path), f"{dotted}: {_show(got)} is not accepted", f"use {expected}"
        )
    if kind in ("greater_than", "greater_than_equal"):
        bound = err["ctx"].get("gt", err["ctx"].get("ge"))
        op = ">" if kind == "greater_than" else ">="
        return SpecError(loc.at(*path), f"{dotted} must be {op} {bound}, not {got}", README_HINT)
    if kind == "too_short":
        return SpecError(loc.at(*path), f"{dotted} must not be empty", "list at least one value")
    return SpecError(loc.at(*path), f"{dotted}: {err['msg']}", README_HINT)


def _tree_path(err_loc: tuple, raw: Any) -> tuple:
    """Keep the loc segments that index the spec tree (drop union/validator tags)."""
    out: list = []
    node = raw
    for step in err_loc:
        in_map = isinstance(node, dict) and step in node
        in_seq = isinstance(node, tuple) and isinstance(step, int) and 0 <= step < len(node)
        if in_map or in_seq:
            out.append(step)
            node = node[step]
        elif (
            isinstance(node, dict)
            and step not in node
            and isinstance(step, str)
            and _is_field_name(step)
        ):
            out.append(step)  # a missing or unknown key: the last segment
            break
    return tuple(out)


def _is_field_name(step: str) -> bool:
    return not any(c in step for c in "[]() ,")


_SUBMODELS: dict[str, type[BaseModel]] = {
    "model": ModelSection,
    "pool": PoolSection,
    "roles": RolesSection,
    "replay": ReplaySection,
    "checkpoint": CheckpointSection,
    "capture": CaptureSection,
}


def _model_at(path: tuple) -> type[BaseModel] | None:
    if not path:
        return SpecModel
    if path == ("model", "rope_scaling"):
        return RopeScaling
    if len(path) == 1:
        return _SUBMODELS.get(str(path[0]))
    return None


def _dotted(path: tuple) -> str:
    s = ""
    for step in path:
        s += f"[{step}]" if isinstance(step, int) else (f".{step}" if s else str(step))
    return s


def _show(v: Any) -> str:
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, tuple):
        return "a list"
    if v is None:
        return "null"
    return str(v)


# --- entity tier ---------------------------------------------------------------------------


def _check_header(spec: SpecModel, path: Path, loc: Locator) -> None:
    if spec.spec_version != SPEC_VERSION:
        raise loc.error(
            ("spec_version",),
            f"spec_version {spec.spec_version} is not supported",
            f"this compiler reads spec_version: {SPEC_VERSION}",
        )
    if not re.fullmatch(r"[a-z][a-z0-9_]*", spec.name):
        raise loc.error(
            ("name",),
            f"name {spec.name!r} is not a lowercase identifier",
            "use lowercase letters, digits and underscores; it names a Python package",
        )
    if spec.name != path.stem:
        raise loc.error(
            ("name",),
            f"name {spec.name!r} differs from the file name {path.name!r}",
            f"rename the file to {spec.name}.yaml or set `name: {path.stem}`",
        )


def _check_id_list(ids: tuple[int, ...], path: tuple, limit: int, what: str, loc: Locator) -> None:
    """Sorted, unique, within ``[0, limit)``."""
    for i, x in enumerate(ids):
        if not 0 <= x < limit:
            raise loc.error(
                (*path, i),
                f"{what} {x} is out of range",
                f"layer ids run from 0 to {limit - 1} for num_hidden_layers {limit}",
            )
        if i and x == ids[i - 1]:
            raise loc.error((*path, i), f"{what} {x} is listed twice", "list each layer once")
        if i and x < ids[i - 1]:
            raise loc.error(
                (*path, i), f"{what} {x} comes after {ids[i - 1]}", "sort the list in layer order"
            )


def _check_model(m: ModelSection, loc: Locator) -> None:
    M = ("model",)
    for name in ("head_dim", "index_head_dim"):
        v = getattr(m, name)
        if v % HEAD_DIM_MULTIPLE:
            raise loc.error(
                (*M, name),
                f"{name} {v} is not a multiple of {HEAD_DIM_MULTIPLE}",
                f"FP8/FP4 scale groups are 32 lanes; use e.g. {_round_up(v, HEAD_DIM_MULTIPLE)}",
            )
    rope = m.qk_rope_head_dim
    if rope % 2:
        raise loc.error(
            (*M, "qk_rope_head_dim"),
            f"qk_rope_head_dim {rope} is odd",
            "RoPE rotates lane pairs; use an even width",
        )
    if rope > min(m.head_dim, m.index_head_dim):
        raise loc.error(
            (*M, "qk_rope_head_dim"),
            f"qk_rope_head_dim {rope} exceeds min(head_dim, index_head_dim) = "
            f"{min(m.head_dim, m.index_head_dim)}",
            "RoPE covers the last lanes of both heads; lower it",
        )
    if m.num_attention_heads % m.o_groups:
        raise loc.error(
            (*M, "o_groups"),
            f"num_attention_heads {m.num_attention_heads} is not divisible by o_groups "
            f"{m.o_groups}",
            "choose o_groups dividing the head count",
        )
    n, draft = m.num_hidden_layers, m.num_nextn_predict_layers
    ratios = m.compress_ratios
    if len(ratios) != n + draft:
        raise loc.error(
            (*M, "compress_ratios"),
            f"compress_ratios has {len(ratios)} entries, expected {n + draft} = "
            f"num_hidden_layers {n} + num_nextn_predict_layers {draft}",
            "give one ratio per backbone layer, then one per draft layer",
        )
    for i, r in enumerate(ratios):
        if r not in RATIOS:
            raise loc.error(
                (*M, "compress_ratios", i),
                f"layer {i} has compress ratio {r}",
                "ratios are 0 for window-only layers, 1 or 2",
            )
    for i in range(n, n + draft):
        if ratios[i]:
            raise loc.error(
                (*M, "compress_ratios", i),
                f"draft layer {i} has compress ratio {ratios[i]}",
                "draft layers are window-only; set it to 0",
            )
    _check_id_list(m.kv_source_layer_ids, (*M, "kv_source_layer_ids"), n, "KV source", loc)
    _check_id_list(m.index_source_layer_ids, (*M, "index_source_layer_ids"), n, "index source", loc)
    _check_id_list(m.engram_layer_ids, (*M, "engram_layer_ids"), n, "Engram layer", loc)
    if not m.kv_source_layer_ids:
        raise loc.error(
            (*M, "kv_source_layer_ids"),
            "kv_source_layer_ids is empty",
            "list at least one Full owner",
        )
    for key, what in (
        ("kv_source_layer_ids", "KV source"),
        ("index_source_layer_ids", "index source"),
    ):
        for i, x in enumerate(getattr(m, key)):
            if ratios[x] == 0:
                raise loc.error(
                    (*M, key, i),
                    f"{what} {x} has compress ratio 0",
                    f"a window-only layer owns no compressed rows; drop it or give layer {x} "
                    f"ratio 1 or 2",
                )
    index = set(m.index_source_layer_ids)
    for i, x in enumerate(m.kv_source_layer_ids):
        if x not in index:
            raise loc.error(
                (*M, "kv_source_layer_ids", i),
                f"KV source {x} is not an index source",
                f"add {x} to index_source_layer_ids; a Full owner scores its own keys",
            )
    cand = m.candidate_source_layer_id
    if cand >= 0:
        if cand not in index:
            raise loc.error(
                (*M, "candidate_source_layer_id"),
                f"candidate source {cand} is not an index source",
                "pick one of index_source_layer_ids, or -1 for none",
            )
        capacity = m.candidate_topk_blocks * m.candidate_block_size
        if capacity < m.index_topk:
            raise loc.error(
                (*M, "candidate_topk_blocks"),
                f"candidate capacity {m.candidate_topk_blocks} x {m.candidate_block_size} = "
                f"{capacity} rows is below index_topk {m.index_topk}",
                "raise candidate_topk_blocks or candidate_block_size so blocks x size >= "
                "index_topk",
            )


def _check_dspark(m: ModelSection, loc: Locator) -> None:
    """The DSpark fields: all or none; with them, draft layers to run, taps among the backbone
    layers that are not Engram layers, a noise token in the vocabulary, a positive Markov rank
    and a top-k within the draft's experts."""
    M = ("model",)
    given = [f for f in DSPARK_FIELDS if getattr(m, f) is not None]
    if not given:
        return
    missing = [f for f in DSPARK_FIELDS if getattr(m, f) is None]
    if missing:
        raise loc.error(
            (*M, given[0]),
            f"{given[0]} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not",
            "a DSpark draft needs every dspark_* field; set them all or remove them all",
        )
    if m.num_nextn_predict_layers < 1:
        raise loc.error(
            (*M, "num_nextn_predict_layers"),
            "num_nextn_predict_layers 0 leaves the DSpark draft no stage",
            "give the draft its stages; the published model has 3",
        )
    for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts"):
        v = getattr(m, name)
        if v < 1:
            raise loc.error((*M, name), f"{name} {v} is below 1", "use a positive count")
    taps = m.dspark_target_layer_ids
    if not taps:
        raise loc.error(
            (*M, "dspark_target_layer_ids"),
            "dspark_target_layer_ids is empty",
            "list the backbone layers whose entering residual the draft reads",
        )
    at = (*M, "dspark_target_layer_ids")
    _check_id_list(taps, at, m.num_hidden_layers, "DSpark tap", loc)
    engram = set(m.engram_layer_ids)
    for i, x in enumerate(taps):
        if x in engram:
            raise loc.error(
                (*at, i),
                f"DSpark tap {x} is an Engram layer",
                "the taps read the residual entering a layer with no Engram; pick another layer",
            )
    noise = m.dspark_noise_token_id
    if not 0 <= noise < m.vocab_size:
        raise loc.error(
            (*M, "dspark_noise_token_id"),
            f"dspark_noise_token_id {noise} is outside the vocabulary [0, {m.vocab_size})",
            "use a token id below vocab_size",
        )
    k, n = m.dspark_num_experts_per_tok, m.dspark_n_routed_experts
    if not 1 <= k <= n:
        raise loc.error(
            (*M, "dspark_num_experts_per_tok"),
            f"dspark_num_experts_per_tok {k} is outside 1..dspark_n_routed_experts = 1..{n}",
            "route each draft token to at least one and at most every draft expert",
        )


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _check_pool(spec: SpecModel, loc: Locator) -> None:
    P = ("pool",)
    pool, m = spec.pool, spec.model
    for key, accepted, what in (
        ("kv_cache_dtypes", KV_CACHE_DTYPES, "main KV format"),
        ("index_cache_dtypes", INDEX_CACHE_DTYPES, "index plane format"),
    ):
        values = getattr(pool, key)
        for i, v in enumerate(values):
            if v not in accepted:
                raise loc.error(
                    (*P, key, i), f"{what} {v!r} is not supported", f"use {' or '.join(accepted)}"
                )
            if v in values[:i]:
                raise loc.error((*P, key, i), f"{what} {v!r} is listed twice", "list each once")
    page = pool.page_tokens
    at = (*P, "page_tokens")
    owner_ratios = sorted({m.compress_ratios[o] for o in m.kv_source_layer_ids})
    for r in owner_ratios:
        if page % r:
            raise loc.error(
                at,
                f"page_tokens {page} is not a multiple of ratio {r}",
                "a compressed group must not straddle a PAGE; use a multiple of every ratio",
            )
    if page % 2:
        raise loc.error(at, f"page_tokens {page} is odd", f"use an even count, e.g. {page + 1}")
    if page < PAGE_TOKENS_FLOOR:
        raise loc.error(
            at,
            f"page_tokens {page} is below {PAGE_TOKENS_FLOOR}",
            "a block id names 16 index rows and ratio 2 halves the PAGE; use at least 32",
        )
    for r in owner_ratios:
        rows = page // r
        if rows % INDEX_BLOCK_ROWS:
            raise loc.error(
                at,
                f"page_tokens {page} gives {rows} index rows per PAGE at ratio {r}, "
                f"not a multiple of {INDEX_BLOCK_ROWS}",
                f"use a multiple of {INDEX_BLOCK_ROWS * r}; a block id names 16 index rows",
            )
    window = m.sliding_window
    if spec.replay.encoder_swa_bounded_replay and page < window - 1:
        raise loc.error(
            at,
            f"page_tokens {page} is below sliding_window - 1 = {window - 1} under encoder replay",
            "one PAGE of rebuild must cover the window; raise page_tokens or turn "
            "encoder_swa_bounded_replay off",
        )


def _check_replay(spec: SpecModel, loc: Locator) -> None:
    R = ("replay",)
    rp, page, m = spec.replay, spec.pool.page_tokens, spec.model
    if rp.hash_block_tokens != page:
        raise loc.error(
            (*R, "hash_block_tokens"),
            f"hash_block_tokens {rp.hash_block_tokens} differs from pool.page_tokens {page}",
            f"the prefix-cache hash block is the PAGE; set it to {page}",
        )
    history = m.engram_max_ngram_size - 1
    if rp.replay_history_tokens != history:
        raise loc.error(
            (*R, "replay_history_tokens"),
            f"replay_history_tokens {rp.replay_history_tokens} differs from "
            f"engram_max_ngram_size - 1 = {history}",
            f"the cursor keeps {history} Engram history ids; set it to {history}",
        )
    rows = rp.min_final_prefill_rows
    if not 1 <= rows <= page:
        raise loc.error(
            (*R, "min_final_prefill_rows"),
            f"min_final_prefill_rows {rows} is outside 1..page_tokens = 1..{page}",
            "a final forward backs off at most one hash block; pick a value in range",
        )
    if rp.decoder_swa_bounded_replay and rows < m.sliding_window:
        raise loc.error(
            (*R, "min_final_prefill_rows"),
            f"min_final_prefill_rows {rows} is below sliding_window {m.sliding_window} "
            "under decoder replay",
            "the forward finishing a prompt must hold its last W rows; raise it to the window",
        )


def _check_checkpoint(ck: CheckpointSection, loc: Locator) -> None:
    C = ("checkpoint", "image_fields")
    for i, f in enumerate(ck.image_fields):
        if f not in IMAGE_FIELDS:
            raise loc.error(
                (*C, i), f"image field {f!r} is not a STATE field", f"use {', '.join(IMAGE_FIELDS)}"
            )
        if f in ck.image_fields[:i]:
            raise loc.error((*C, i), f"image field {f!r} is listed twice", "list each once")
    for f in REQUIRED_IMAGE_FIELDS:
        if f not in ck.image_fields:
            raise loc.error(
                C,
                f"checkpoint images must carry {f!r}",
                "an image carries the SWA rings and the cursor; add it",
            )


def _check_capture(cap: CaptureSection, loc: Locator) -> None:
    for key in ("batch_sizes", "query_buckets"):
        values = getattr(cap, key)
        for i, v in enumerate(values):
            at = ("capture", key, i)
            if v <= 0:
                raise loc.error(at, f"capture.{key} has {v}", "capture widths are positive")
            if i and v == values[i - 1]:
                raise loc.error(at, f"capture.{key} lists {v} twice", "list each width once")
            if i and v < values[i - 1]:
                raise loc.error(
                    at, f"capture.{key}: {v} comes after {values[i - 1]}", "sort the list ascending"
                )


def _check_roles(roles: RolesSection, layers: tuple, loc: Locator) -> None:
    """Declared roles must equal the resolved ones; names the first disagreeing layer."""
    n = len(layers)
    declared: dict[int, tuple[str, tuple]] = {}
    for role in ("full", "reindex", "window", "reuse"):
        ids = getattr(roles, role)
        if ids is None:
            continue
        _check_id_list(ids, ("roles", role), n, f"{role} layer", loc)
        for i, x in enumerate(ids):
            if x in declared:
                raise loc.error(
                    ("roles", role, i),
                    f"layer {x} is declared both {declared[x][0]} and {role}",
                    "give each layer one role",
                )
            declared[x] = (role, ("roles", role, i))
    for layer in layers:
        implicit = "reuse" if roles.reuse is None else None
        role, at = declared.get(layer.index, (implicit, ("roles",)))
        if role != layer.role:
            if layer.index in declared:
                what = f"declared {role}"
            else:
                what = "not listed, so reuse," if implicit else "not declared"
            raise loc.error(
                at,
                f"layer {layer.index} is {what} but resolves to {layer.role} with "
                f"kv_owner {layer.kv_owner}, topk_owner {layer.topk_owner}",
                "fix roles: or the source layer ids",
            )
    if roles.decoder_start is not None:
        start = next(layer.index for layer in layers if layer.segment == "decoder")
        if roles.decoder_start != start:
            raise loc.error(
                ("roles", "decoder_start"),
                f"decoder_start {roles.decoder_start} differs from the last KV source {start}",
                f"the decoder starts at the last KV source; set it to {start}",
            )
