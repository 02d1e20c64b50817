"""The V4.1 model configuration under the published ``config.json`` field names.

``ModelConfig`` is what the reference model, the checkpoint writer/loader and the paged
runtime read. It is built from a spec's ``model:`` section (``config_from_cache_spec``) or from
a checkpoint's ``config.json`` (``ModelConfig.from_hf``), and written back with ``to_hf``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from v41plan.geometry.derive import resolve_layers
from v41plan.geometry.runtime import CacheSpec, LayerInfo, ModelDims


class ConfigError(ValueError):
    """A runtime configuration the engine refuses (raised before loading weights)."""


ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
# Top-level keys of the published config.json that are not text-model fields.
_TOP_LEVEL_KEYS = (
    "architectures",
    "model_type",
    "quantization_config",
    "text_config",
    "vision_config",
    "transformers_version",
    "dtype",
    "torch_dtype",
)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the V4.1 text model (published ``config.json`` names)."""

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
    vocab_size: int
    hidden_size: int
    num_key_value_heads: int
    q_lora_rank: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict = field(hash=False)
    """YaRN parameters of the compressed RoPE table (``type``, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``)."""
    max_position_embeddings: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    bos_token_id: int
    eos_token_id: int
    engram_num_embeddings: tuple[int, ...] = ()
    """Rows of each Engram table; derived from the prime layout when empty (see ``engram``)."""
    extra: dict = field(default_factory=dict, hash=False, compare=False)
    """Published fields this model does not use (DSpark, vision ...), kept for round trips."""

    def __post_init__(self) -> None:
        from v41plan.model.engram import engram_row_counts

        derived = tuple(engram_row_counts(self))
        if not self.engram_num_embeddings:
            object.__setattr__(self, "engram_num_embeddings", derived)
        elif tuple(self.engram_num_embeddings) != derived:
            raise ValueError(
                f"engram_num_embeddings = {list(self.engram_num_embeddings)} disagrees with the "
                f"prime "
                f"layout derived from engram_vocab_size={self.engram_vocab_size}: {list(derived)}"
            )
        if self.num_key_value_heads != 1 or self.n_shared_experts != 1:
            raise ValueError("V4.1 needs num_key_value_heads == 1 and n_shared_experts == 1")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"o_groups={self.o_groups}"
            )
        if self.scoring_func != "sqrtsoftplus":
            raise ValueError(
                f"scoring_func={self.scoring_func!r} is not supported; accepted: sqrtsoftplus"
            )

    # --- construction -------------------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a ``config.json`` mapping: flat, or with the text fields under
        ``text_config``.

        Every field is checked against its type (no coercion: ``"260"`` is not an integer),
        sizes against their range, and a key that is one typo away from a field name
        (``hiden_size``) is refused; other unknown keys are published fields this model does
        not use and are kept in ``extra``. Raises ``ValueError`` naming the key (``TypeError``
        when ``cfg`` is not a mapping).
        """
        if not isinstance(cfg, dict):
            raise TypeError(f"config.json must be a JSON object, got {type(cfg).__name__}")
        text = cfg.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise TypeError(f"text_config must be an object, got {type(text).__name__}")
        flat = {k: v for k, v in cfg.items() if k not in _TOP_LEVEL_KEYS}
        flat.update(text or {})
        flat.pop("model_type", None)
        kinds = {f.name: str(f.type) for f in fields(cls) if f.name != "extra"}
        names = set(kinds)
        for key in flat:
            _check_unknown_key(key, names)
        missing = sorted(n for n in names if n not in flat and n != "engram_num_embeddings")
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        vals: dict[str, Any] = {}
        for n in sorted(names):
            if n not in flat:
                continue
            v = _checked(n, kinds[n], flat[n])
            vals[n] = (
                tuple(v) if isinstance(v, list | tuple) else (dict(v) if isinstance(v, dict) else v)
            )
        extra = {k: v for k, v in flat.items() if k not in names}
        return cls(**vals, extra=extra)

    def to_hf(self) -> dict[str, Any]:
        """The published ``config.json`` layout: top-level identity plus ``text_config``."""
        text: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
        for f in fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            text[f.name] = (
                list(v) if isinstance(v, tuple) else (dict(v) if isinstance(v, dict) else v)
            )
        text.update(self.extra)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "quantization_config": dict(QUANTIZATION_CONFIG),
            "text_config": text,
        }

    # --- derived values -----------------------------------------------------------------

    @property
    def dims(self) -> ModelDims:
        """The cache-relevant subset (``ModelDims``)."""
        return ModelDims(**{f: getattr(self, f) for f in ModelDims.__dataclass_fields__})

    @cached_property
    def layers(self) -> tuple[LayerInfo, ...]:
        """Every backbone layer's resolved role (``resolve_layers``)."""
        return resolve_layers(self.dims)

    @property
    def hc_mixes(self) -> int:
        """Rows of an mHC ``fn`` matrix: ``(2 + hc) * hc``."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_cols(self) -> int:
        """Hash columns per Engram layer: ``(max_ngram - 1) * engram_n_heads``."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads


# Sizes that must be at least 1 (every other integer field must be at least 0).
_POSITIVE = frozenset({
    "num_hidden_layers", "head_dim", "qk_rope_head_dim", "num_attention_heads", "o_groups",
    "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "candidate_topk_blocks",
    "candidate_block_size", "engram_max_ngram_size", "vocab_size", "hidden_size",
    "num_key_value_heads", "q_lora_rank", "o_lora_rank", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "hc_mult",
    "hc_sinkhorn_iters", "max_position_embeddings", "engram_n_heads", "engram_head_dim",
    "engram_vocab_size", "engram_compressed_vocab_size",
})  # fmt: skip
# Published or Hugging Face fields that a typo check would take for one of ours; kept as extra.
_KNOWN_EXTRA = frozenset({
    "intermediate_size", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "n_group",
    "topk_group", "num_experts", "rope_type", "pad_token_id", "image_token_id",
    "dspark_num_experts_per_tok", "dspark_n_routed_experts", "max_window_layers",
})  # fmt: skip
# Upper bounds where a larger value is no model but a very long wait (the Engram prime search).
_AT_MOST = {"engram_vocab_size": 2**31 - 1}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def _check_unknown_key(key: str, names: set[str]) -> None:
    """Refuse a key that is not a field but one typo away from one (``hiden_size``)."""
    import difflib

    if key in names or key in _KNOWN_EXTRA:
        return
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.85)
    if close:
        raise ValueError(f"unknown key {key!r} (did you mean {close[0]!r}?)")


def _checked(name: str, kind: str, v: Any) -> Any:
    """``v`` when it has the field's type and range; ``ValueError`` naming the field otherwise."""
    import math

    def fail(want: str) -> ValueError:
        return ValueError(f"{name} must be {want}, got {v!r}")

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if kind == "int":
        if not is_int(v):
            raise fail("an integer")
        if v < (1 if name in _POSITIVE else 0):
            raise fail("an integer >= 1" if name in _POSITIVE else "an integer >= 0")
        if v > _AT_MOST.get(name, v):
            raise fail(f"an integer <= {_AT_MOST[name]}")
    elif kind == "float":
        if not (is_int(v) or isinstance(v, float)) or not math.isfinite(v):
            raise fail("a finite number")
    elif kind == "bool":
        if not isinstance(v, bool):
            raise fail("true or false")
    elif kind == "str":
        if not isinstance(v, str):
            raise fail("a string")
    elif kind.startswith("tuple[int"):
        if not isinstance(v, list | tuple) or not all(is_int(x) and x >= 0 for x in v):
            raise fail("a list of integers >= 0")
    elif kind == "dict":
        if not isinstance(v, dict):
            raise fail("an object")
        if name == "rope_scaling" and v.get("original_max_position_embeddings", 0):
            for k in _YARN_KEYS:
                x = v.get(k)
                if not (is_int(x) or isinstance(x, float)) or not math.isfinite(x) or x <= 0:
                    raise ValueError(f"rope_scaling.{k} must be a number > 0, got {x!r}")
    return v


def config_from_cache_spec(cache_spec: CacheSpec) -> ModelConfig:
    """Build the model configuration from a compiled spec's ``model:`` section."""
    return ModelConfig.from_hf(dict(cache_spec.model_config))


def check_against_spec(config: ModelConfig, cache_spec: CacheSpec) -> None:
    """Refuse a config whose cache-relevant fields disagree with the spec, naming the field."""
    for name in ModelDims.__dataclass_fields__:
        have = getattr(config, name)
        want = getattr(cache_spec.dims, name)
        if (tuple(have) if isinstance(have, list | tuple) else have) != (
            tuple(want) if isinstance(want, list | tuple) else want
        ):
            raise ValueError(
                f"checkpoint config.json disagrees with spec {cache_spec.name!r}: {name} is "
                f"{_show(have)} in the checkpoint but {_show(want)} in the spec"
            )


def _show(v: Any) -> str:
    return str(list(v)) if isinstance(v, tuple) else repr(v)
