"""Checkpoints in the published V4.1 layout: writer, random initializer and loader.

A checkpoint directory holds ``config.json`` (published field names, ``ModelConfig.to_hf``),
sharded safetensors ``model-XXXXX-of-YYYYY.safetensors`` and ``model.safetensors.index.json``.
``tensor_table(config)`` is the single list of published names, shapes and dtypes that both the
writer and the loader follow (documented in the README's model section). The loader checks the
config against the spec before any weight loads, checks every tensor's presence, shape and
dtype, and runs post-load processing (dequantizing FP8/FP4 weights into the compute dtype and
fusing experts) exactly once. Engram tables are never loaded whole: they stay memory-mapped.
DSpark (``mtp.*``) and vision tensors are not part of this table; the loader ignores them.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from v41plan.model.config import ModelConfig, check_against_spec
from v41plan.model.engram import EngramHost, EngramTable, synthetic_token_map
from v41plan.model.quant import (
    dequant_fp4_weight,
    dequant_fp8_weight,
    e8m0_encode,
    quantize_fp8_blocks,
    quantize_fp8_weight,
)

INDEX_FILE = "model.safetensors.index.json"
FP8, E8M0, BF16, F32, I8 = (
    torch.float8_e4m3fn,
    torch.float8_e8m0fnu,
    torch.bfloat16,
    torch.float32,
    torch.int8,
)
# dtypes the loader accepts for each published dtype (another tool may store packed FP4 as uint8)
_ACCEPT = {
    FP8: (FP8,),
    E8M0: (E8M0, torch.uint8),
    BF16: (BF16, F32),
    F32: (F32,),
    I8: (I8, torch.uint8),
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (clear message, no traceback needed)."""


@dataclass(frozen=True)
class TensorSpec:
    """One published tensor: name, shape, storage dtype, and how it is produced/processed."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    """``fp8`` (E4M3 weight, its ``.scale`` follows), ``fp8_scale``, ``fp4`` (packed expert weight),
    ``fp4_scale``, ``table`` / ``table_scale`` (Engram), or ``plain``."""
    std: float = 0.0
    """Standard deviation of the random initializer (``init``)."""
    init: str = "normal"
    """``normal``, ``ones`` or ``const`` (``std`` is then the value)."""

    @property
    def nbytes(self) -> int:
        """Bytes on disk."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tensor_table(cfg: ModelConfig) -> list[TensorSpec]:
    """Every published backbone tensor of ``cfg`` in checkpoint order."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hc, E, inter = cfg.hc_mult, cfg.n_routed_experts, cfg.moe_intermediate_size
    out: list[TensorSpec] = []

    def plain(name, shape, dtype, std=0.0, init="normal"):
        out.append(TensorSpec(name, tuple(shape), dtype, "plain", std, init))

    def fp8(name, o, i):
        out.append(TensorSpec(name + ".weight", (o, i), FP8, "fp8", i**-0.5))
        out.append(TensorSpec(name + ".scale", (_cdiv(o, 32), _cdiv(i, 32)), E8M0, "fp8_scale"))

    def fp4(name, o, i):
        out.append(TensorSpec(name + ".weight", (o, i // 2), I8, "fp4", i**-0.5))
        out.append(TensorSpec(name + ".scale", (o, i // 32), E8M0, "fp4_scale"))

    plain("embed.weight", (cfg.vocab_size, D), BF16, 1.0)
    ei = {lid: k for k, lid in enumerate(cfg.engram_layer_ids)}
    for info in cfg.layers:
        i = info.index
        p = f"layers.{i}."
        if info.engram:
            rows, hd = cfg.engram_num_embeddings[ei[i]], cfg.engram_head_dim
            out.append(TensorSpec(p + "engram.embed.weight", (rows, hd), FP8, "table", 1.0))
            out.append(TensorSpec(p + "engram.embed.scale", (rows, hd // 32), E8M0, "table_scale"))
            fp8(p + "engram.wkv", (hc + 1) * D, cfg.engram_cols * hd)
            plain(p + "engram.q_weight", (hc, D), BF16, 1.0)
            plain(p + "engram.k_weight", (hc, D), BF16, 1.0)
        for site in ("attn", "ffn"):
            plain(p + f"hc_{site}_fn", (cfg.hc_mixes, hc * D), F32, (hc * D) ** -0.5)
            plain(p + f"hc_{site}_base", (cfg.hc_mixes,), F32, 0.1)
            plain(p + f"hc_{site}_scale", (3,), F32, 0.5, "const")
        plain(p + "attn_norm.weight", (D,), BF16, init="ones")
        plain(p + "ffn_norm.weight", (D,), BF16, init="ones")
        a = p + "attn."
        fp8(a + "wq_a", cfg.q_lora_rank, D)
        plain(a + "q_norm.weight", (cfg.q_lora_rank,), BF16, init="ones")
        fp8(a + "wq_b", H * d, cfg.q_lora_rank)
        fp8(a + "wkv", d, D)
        plain(a + "kv_norm.weight", (d,), BF16, init="ones")
        fp8(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, (H // cfg.o_groups) * d)
        fp8(a + "wo_b", D, cfg.o_groups * cfg.o_lora_rank)
        plain(a + "attn_sink", (H,), F32, 0.5)
        if info.role == "full":
            plain(a + "compressor.wkv.weight", (d, D), BF16, D**-0.5)
            if info.ratio == 2:
                plain(a + "compressor.wgate.weight", (d, D), BF16, D**-0.5)
            plain(a + "compressor.norm.weight", (d,), BF16, init="ones")
            plain(a + "indexer.wk.weight", (cfg.index_head_dim, d), BF16, d**-0.5)
            plain(a + "indexer.k_norm.weight", (cfg.index_head_dim,), BF16, init="ones")
        if info.role in ("full", "reindex"):
            fp8(a + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
            plain(a + "indexer.weights_proj.weight", (cfg.index_n_heads, D), BF16, D**-0.5)
        f = p + "ffn."
        plain(f + "gate.weight", (E, D), BF16, D**-0.5)
        plain(f + "gate.bias", (E,), F32, 0.05)
        for e in range(E):
            fp4(f + f"experts.{e}.w1", inter, D)
            fp4(f + f"experts.{e}.w2", D, inter)
            fp4(f + f"experts.{e}.w3", inter, D)
        fp8(f + "shared_experts.w1", inter, D)
        fp8(f + "shared_experts.w2", D, inter)
        fp8(f + "shared_experts.w3", inter, D)
    plain("norm.weight", (D,), BF16, init="ones")
    plain("head.weight", (cfg.vocab_size, D), BF16, 1.5 * D**-0.5)
    return out


# --- random initialization ----------------------------------------------------------------


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))


def random_tensors(
    cfg: ModelConfig, seed: int, specs: list[TensorSpec] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Published-format random tensors, each deterministic in (seed, name), in table order."""
    specs = tensor_table(cfg) if specs is None else specs
    k = 0
    while k < len(specs):
        t = specs[k]
        if t.kind == "fp4":
            yield from _random_fp4(t, specs[k + 1], seed)
            k += 2
            continue
        if t.kind in ("fp8", "table"):
            g = _generator(seed, t.name)
            if t.kind == "fp8":
                codes, scale = quantize_fp8_weight(torch.randn(t.shape, generator=g) * t.std)
            else:  # large tables: generate and quantize in row chunks to bound memory
                step = max(1, (1 << 22) // t.shape[1])
                parts = [
                    quantize_fp8_blocks(
                        torch.randn(min(step, t.shape[0] - r), t.shape[1], generator=g) * t.std
                    )
                    for r in range(0, t.shape[0], step)
                ]
                codes = torch.cat([c for c, _ in parts])
                scale = torch.cat([sc for _, sc in parts])
            yield t.name, codes
            yield specs[k + 1].name, scale
            k += 2
            continue
        if t.init == "ones":
            v = torch.ones(t.shape)
        elif t.init == "const":
            v = torch.full(t.shape, t.std)
        else:
            v = torch.randn(t.shape, generator=_generator(seed, t.name)) * t.std
        yield t.name, v.to(t.dtype)
        k += 1


def _random_fp4(
    t: TensorSpec, scale_spec: TensorSpec, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A random routed-expert weight drawn directly in its storage format (fast at MEDIUM size).

    Codes are uniform over the 16 E2M1 codes (RMS about 2.93) and each row's per-32 scale is
    the power of two nearest ``std / 2.93``, so the dequantized RMS is about ``std``.
    """
    g = _generator(seed, t.name)
    packed = torch.randint(0, 256, t.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    scale = torch.full(scale_spec.shape, 2.0 ** round(math.log2(t.std / 2.93)))
    yield t.name, packed.view(torch.int8)
    yield scale_spec.name, e8m0_encode(scale)


def random_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All published tensors of a random checkpoint in memory (tiny models and tests)."""
    return dict(random_tensors(cfg, seed))


def _plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    k = 0
    while k < len(specs):
        group = specs[k : k + 2] if specs[k].kind in ("fp8", "fp4", "table") else specs[k : k + 1]
        nb = sum(t.nbytes for t in group)
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nb
        k += len(group)
    return shards


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int,
    shard_bytes: int = 512 << 20,
    progress: bool = False,
) -> Path:
    """Write a random checkpoint shard by shard (bounded memory); same bytes for the same seed."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_table(cfg)
    shards = _plan_shards(specs, shard_bytes)
    names = {f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)}
    for old in out.glob("model-*-of-*.safetensors"):  # shards of an earlier, different split
        if old.name not in names:
            old.unlink()
    weight_map: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = dict(random_tensors(cfg, seed, shard))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        if progress:
            print(f"  wrote {fname} ({sum(t.nbytes for t in shard) / 2**20:.1f} MiB)", flush=True)
        del tensors
    (out / INDEX_FILE).write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True
        )
        + "\n"
    )
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    return out


# --- loading ------------------------------------------------------------------------------


class LoadedCheckpoint:
    """A checkpoint's config, raw published tensors and memory-mapped Engram tables.

    ``process(dtype, device)`` turns the raw tensors into the compute-dtype weights the model
    uses; it runs exactly once (a second call raises).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        raw: dict[str, torch.Tensor],
        tables: list[EngramTable],
        path: Path | None = None,
    ):
        self.config = cfg
        self.raw = raw
        self.tables = tables
        self.path = path
        self.weights: dict[str, torch.Tensor] | None = None
        self.process_calls = 0

    @classmethod
    def from_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> LoadedCheckpoint:
        """From an in-memory published state (``random_state``)."""
        raw = dict(state)
        tables = []
        for lid in cfg.engram_layer_ids:
            p = f"layers.{lid}.engram.embed."
            tables.append(EngramTable.from_tensors(raw.pop(p + "weight"), raw.pop(p + "scale")))
        return cls(cfg, raw, tables)

    def process(
        self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Dequantize FP8/FP4 weights into ``dtype`` and fuse routed experts; exactly once."""
        if self.weights is not None:
            raise RuntimeError(
                "post-load processing already ran for this checkpoint; it runs exactly once"
            )
        self.process_calls += 1
        cfg, raw = self.config, self.raw
        w: dict[str, torch.Tensor] = {}
        for name, t in raw.items():
            if name.endswith(".scale"):
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if ".ffn.experts." in name:
                continue
            if base is not None and base + ".scale" in raw:
                w[name] = dequant_fp8_weight(t, raw[base + ".scale"], dtype).to(device)
            else:
                w[name] = t.to(device)
        for lid in range(cfg.num_hidden_layers):
            for proj in ("w1", "w2", "w3"):
                mats = []
                for e in range(cfg.n_routed_experts):
                    p = f"layers.{lid}.ffn.experts.{e}.{proj}"
                    mats.append(dequant_fp4_weight(raw[p + ".weight"], raw[p + ".scale"], dtype))
                w[f"layers.{lid}.ffn.experts.{proj}"] = torch.stack(mats).to(device)
        self.weights = w
        self.raw = {}  # the published tensors are no longer needed
        return w

    def engram_host(self) -> EngramHost:
        """Host Engram half: the real token map from the model's ``tokenizer.json`` (beside the
        checkpoint, or the packaged DeepSeek-V4 one for a V4.1-vocabulary config:
        ``v41plan.model.vocab``), else synthetic."""
        from v41plan.model.vocab import tokenizer_json_for

        cfg = self.config
        tok = tokenizer_json_for(self.path, cfg)
        if tok is not None:
            from tokenizers import Tokenizer

            from v41plan.model.engram import token_map_from_tokenizer

            tmap = token_map_from_tokenizer(Tokenizer.from_file(str(tok)), cfg.vocab_size)
        else:
            tmap = synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
        return EngramHost(cfg, np.asarray(tmap), self.tables)


def read_config(path: str | Path) -> ModelConfig:
    """Read and validate ``config.json`` of a checkpoint directory."""
    p = Path(path) / "config.json"
    if not p.exists():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)")
    try:
        return ModelConfig.from_hf(json.loads(p.read_text()))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{p}: {exc}") from exc


def load_checkpoint(
    path: str | Path,
    cache_spec: Any = None,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedCheckpoint:
    """Load a published-layout checkpoint directory.

    The config is checked against ``cache_spec`` (when given) before any weight is read; every
    tensor of ``tensor_table`` must be present with its shape and dtype. With ``dtype`` set, the
    post-load processing runs (once) before returning; ``dtype=None`` leaves it to the caller.
    """
    from safetensors import safe_open

    root = Path(path)
    cfg = read_config(root)
    if cache_spec is not None:
        try:
            check_against_spec(cfg, cache_spec)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    index = root / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (root / "model.safetensors").exists():
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    else:
        raise CheckpointError(f"{root}: neither {INDEX_FILE} nor model.safetensors")
    specs = tensor_table(cfg)
    handles: dict[str, Any] = {}

    def handle(fname: str) -> Any:
        if fname not in handles:
            if not (root / fname).exists():
                raise CheckpointError(f"{root}: shard {fname} listed in {INDEX_FILE} is missing")
            handles[fname] = safe_open(str(root / fname), framework="pt")
        return handles[fname]

    for t in specs:  # presence, shape and dtype, from headers only
        if t.name not in weight_map:
            raise CheckpointError(
                f"{root}: missing tensor {t.name} (expected shape {list(t.shape)})"
            )
        sl = handle(weight_map[t.name]).get_slice(t.name)
        shape = tuple(sl.get_shape())
        if shape != t.shape:
            raise CheckpointError(
                f"{root}: tensor {t.name} has shape {list(shape)}, expected {list(t.shape)}"
            )
        dt = sl[:0].dtype if shape and shape[0] else None
        if dt is not None and dt not in _ACCEPT[t.dtype]:
            raise CheckpointError(f"{root}: tensor {t.name} has dtype {dt}, expected {t.dtype}")
    raw: dict[str, torch.Tensor] = {}
    tables: list[EngramTable] = []
    for t in specs:
        if t.kind == "table":
            prefix = t.name[: -len(".embed.weight")]
            tables.append(
                EngramTable.open(root / weight_map[t.name], prefix, handle(weight_map[t.name]))
            )
        elif t.kind != "table_scale":
            x = handle(weight_map[t.name]).get_tensor(t.name)
            if t.dtype == BF16 and x.dtype == F32:
                x = x.to(BF16)
            if t.kind in ("fp8_scale", "fp4_scale") and x.dtype == torch.uint8:
                x = x.view(E8M0)
            raw[t.name] = x
    ckpt = LoadedCheckpoint(cfg, raw, tables, root)
    if dtype is not None:
        ckpt.process(dtype, device)
    return ckpt
