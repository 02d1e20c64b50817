"""Checkpoints in the published V4.1 layout: writer, random initializer and loader.

A checkpoint directory holds ``config.json`` (published field names, ``ModelConfig.to_hf``),
sharded safetensors ``model-XXXXX-of-YYYYY.safetensors`` and ``model.safetensors.index.json``.
``tensor_table(config)`` is the single list of published names, shapes and dtypes that both the
writer and the loader follow (documented in the README's model section). The loader checks the
config against the spec before any weight loads, checks every tensor's presence, shape and
dtype, and runs post-load processing exactly once: FP8/FP4 weights dequantized into the compute
dtype (the CPU reference), or kept resident as published (``QuantWeight``), experts fused either
way. Engram tables are never loaded whole: they stay memory-mapped.
A config with a DSpark draft (``dspark.draft_config``) adds the draft stages' ``mtp.*``
tensors (``draft_tensor_table``): the writer writes them, the loader reads them only when
asked (``speculative=True``) and ignores them otherwise. Vision tensors are not in any table.
"""

from __future__ import annotations

import json
import math
import os
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
    QuantWeight,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e8m0_encode,
    quantize_fp8_blocks,
    quantize_fp8_weight,
    weight_nbytes,
)

INDEX_FILE = "model.safetensors.index.json"
RANDOM_SEED_KEY = "v41plan_random_weights_seed"
"""Key ``write_checkpoint`` sets in the index file's ``metadata``: the weights are random, drawn
from this seed (a shard's own metadata would not keep its key order, nor its bytes, stable)."""
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


def _table_writers(out: list[TensorSpec]):
    """Appenders of one plain tensor, one FP8 linear (weight + scale) and one FP4 expert
    weight (packed codes + scales) to ``out``."""

    def plain(name, shape, dtype, std=0.0, init="normal"):
        out.append(TensorSpec(name, tuple(shape), dtype, "plain", std, init))

    def fp8(name, o, i):
        out.append(TensorSpec(name + ".weight", (o, i), FP8, "fp8", i**-0.5))
        out.append(TensorSpec(name + ".scale", (_cdiv(o, 32), _cdiv(i, 32)), E8M0, "fp8_scale"))

    def fp4(name, o, i):
        out.append(TensorSpec(name + ".weight", (o, i // 2), I8, "fp4", i**-0.5))
        out.append(TensorSpec(name + ".scale", (o, i // 32), E8M0, "fp4_scale"))

    return plain, fp8, fp4


def _window_block(out: list[TensorSpec], cfg: ModelConfig, p: str) -> None:
    """The tensors before the MoE that every block has (mHC, norms, window attention),
    under prefix ``p`` (ends with a dot)."""
    plain, fp8, _ = _table_writers(out)
    D, H, d, hc = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
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


def _moe_block(out: list[TensorSpec], cfg: ModelConfig, p: str, experts: int) -> None:
    """A block's MoE tensors under prefix ``p``: router, ``experts`` FP4 routed experts and
    the FP8 shared expert."""
    plain, fp8, fp4 = _table_writers(out)
    D, inter = cfg.hidden_size, cfg.moe_intermediate_size
    f = p + "ffn."
    plain(f + "gate.weight", (experts, D), BF16, D**-0.5)
    plain(f + "gate.bias", (experts,), F32, 0.05)
    for e in range(experts):
        fp4(f + f"experts.{e}.w1", inter, D)
        fp4(f + f"experts.{e}.w2", D, inter)
        fp4(f + f"experts.{e}.w3", inter, D)
    fp8(f + "shared_experts.w1", inter, D)
    fp8(f + "shared_experts.w2", D, inter)
    fp8(f + "shared_experts.w3", inter, D)


def draft_tensor_table(cfg: ModelConfig) -> list[TensorSpec]:
    """The DSpark draft stages' published tensors (``mtp.{k}.*``) in checkpoint order; empty
    when ``cfg`` has no draft. Each stage: a window-only block with the draft's own experts;
    stage 0 adds ``main_proj`` (FP8 ``[D, D * taps]``) and ``main_norm``; the last stage adds
    ``norm``, the Markov head (``embed``/``head`` ``[vocab, markov_rank]``) and the
    confidence head (``proj`` ``[1, D + markov_rank]``)."""
    from v41plan.model.dspark import draft_config

    dc = draft_config(cfg)
    if dc is None:
        return []
    out: list[TensorSpec] = []
    plain, fp8, _ = _table_writers(out)
    D, V, r = cfg.hidden_size, cfg.vocab_size, dc.markov_rank
    for k in range(dc.stages):
        p = f"mtp.{k}."
        if k == 0:
            fp8(p + "main_proj", D, D * len(dc.taps))
            plain(p + "main_norm.weight", (D,), BF16, init="ones")
        _window_block(out, cfg, p)
        _moe_block(out, cfg, p, dc.n_routed_experts)
        if k == dc.stages - 1:
            plain(p + "norm.weight", (D,), BF16, init="ones")
            plain(p + "markov_head.embed.weight", (V, r), BF16, 1.0)
            plain(p + "markov_head.head.weight", (V, r), BF16, r**-0.5)
            plain(p + "confidence_head.proj.weight", (1, D + r), BF16, (D + r) ** -0.5)
    return out


def checkpoint_tensor_table(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` holds: the backbone's, then the draft's."""
    return tensor_table(cfg) + draft_tensor_table(cfg)


def tensor_table(cfg: ModelConfig) -> list[TensorSpec]:
    """Every published backbone tensor of ``cfg`` in checkpoint order."""
    D, d, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    out: list[TensorSpec] = []
    plain, fp8, _ = _table_writers(out)
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
        _window_block(out, cfg, p)
        a = p + "attn."
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
        _moe_block(out, cfg, p, cfg.n_routed_experts)
    plain("norm.weight", (D,), BF16, init="ones")
    plain("head.weight", (cfg.vocab_size, D), BF16, 1.5 * D**-0.5)
    return out


def checkpoint_nbytes(cfg: ModelConfig, draft: bool = False) -> int:
    """Bytes of the published backbone tensors of ``cfg`` (``tensor_table``), Engram tables
    apart, and with ``draft`` the DSpark stages' too: what a resident load is compared with."""
    specs = checkpoint_tensor_table(cfg) if draft else tensor_table(cfg)
    return sum(t.nbytes for t in specs if t.kind not in ("table", "table_scale"))


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
                codes, scale = quantize_fp8_weight(torch.randn(t.shape, generator=g).mul_(t.std))
            else:  # large tables: generate and quantize in row chunks to bound memory
                step = max(1, (1 << 22) // t.shape[1])
                codes = torch.empty(t.shape, dtype=FP8)
                scale = torch.empty(specs[k + 1].shape, dtype=E8M0)
                for r in range(0, t.shape[0], step):
                    rows = min(step, t.shape[0] - r)
                    draft = torch.randn(rows, t.shape[1], generator=g).mul_(t.std)
                    c, sc = quantize_fp8_blocks(draft)
                    codes[r : r + rows] = c
                    scale[r : r + rows] = sc
            yield t.name, codes
            yield specs[k + 1].name, scale
            k += 2
            continue
        if t.init == "ones":
            v = torch.ones(t.shape)
        elif t.init == "const":
            v = torch.full(t.shape, t.std)
        else:
            # in place: the float32 draft of embed/head alone is 2.6 GB at V4.1-Flash widths
            v = torch.randn(t.shape, generator=_generator(seed, t.name)).mul_(t.std)
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


def random_state(cfg: ModelConfig, seed: int, draft: bool = False) -> dict[str, torch.Tensor]:
    """All published backbone tensors of a random checkpoint in memory (tiny models and
    tests); with ``draft`` the DSpark stages' too (the same values a written checkpoint
    holds: each tensor is a function of (seed, name))."""
    specs = checkpoint_tensor_table(cfg) if draft else None
    return dict(random_tensors(cfg, seed, specs))


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


def _write_shard(
    out: Path, cfg: ModelConfig, seed: int, shard: list[TensorSpec], fname: str
) -> dict[str, int]:
    """Generate and save one shard; returns each tensor's byte count (a worker's task)."""
    from safetensors.torch import save_file

    tensors = dict(random_tensors(cfg, seed, shard))
    save_file(tensors, str(out / fname), metadata={"format": "pt"})
    os.chmod(out / fname, 0o666 & ~_umask())  # safetensors creates 0600; a checkpoint is shared
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def _worker_init() -> None:
    """One intra-op thread per worker process: the parallelism is across shards."""
    torch.set_num_threads(1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int,
    shard_bytes: int = 512 << 20,
    progress: bool = False,
    workers: int = 1,
) -> Path:
    """Write a random checkpoint shard by shard; same bytes for the same seed.

    Memory is bounded by ``workers`` shards in flight (each about its bytes plus the float32
    draft of its largest tensor); ``workers > 1`` writes shards in parallel processes (every
    tensor is a function of (seed, name) alone, so the bytes do not depend on it).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = checkpoint_tensor_table(cfg)
    shards = _plan_shards(specs, shard_bytes)
    fnames = [f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    for old in out.glob("model-*-of-*.safetensors"):  # shards of an earlier, different split
        if old.name not in fnames:
            old.unlink()
    weight_map: dict[str, str] = {}
    total = 0

    def done(fname: str, shard: list[TensorSpec], sizes: dict[str, int]) -> None:
        nonlocal total
        for name, nb in sizes.items():
            weight_map[name] = fname
            total += nb
        if progress:
            print(f"  wrote {fname} ({sum(t.nbytes for t in shard) / 2**20:.1f} MiB)", flush=True)

    if workers <= 1:
        for fname, shard in zip(fnames, shards, strict=True):
            done(fname, shard, _write_shard(out, cfg, seed, shard, fname))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")  # no forked copy of torch's thread pools
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            futs = [
                pool.submit(_write_shard, out, cfg, seed, shard, fname)
                for fname, shard in zip(fnames, shards, strict=True)
            ]
            for fname, shard, fut in zip(fnames, shards, futs, strict=True):
                done(fname, shard, fut.result())
    _write_index(out, cfg, weight_map, {"total_size": total, RANDOM_SEED_KEY: seed})
    return out


def _write_index(out: Path, cfg: ModelConfig, weight_map: dict[str, str], metadata: dict) -> None:
    """The index file and ``config.json`` beside the shards."""
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True)
        + "\n"
    )
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")


def write_state(
    out_dir: str | Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    metadata: dict | None = None,
    shard_bytes: int = 512 << 20,
) -> Path:
    """Write published tensors ``state`` (every ``tensor_table`` name, in its published shape
    and dtype: a trained model's export) as a checkpoint directory; ``metadata`` joins the
    index file's. The DSpark stages' tensors are written when ``state`` holds them (all of
    them, or none: a checkpoint without them serves without speculation)."""
    from safetensors.torch import save_file

    specs = tensor_table(cfg)
    draft = draft_tensor_table(cfg)
    held = [t.name for t in draft if t.name in state]
    if held and len(held) < len(draft):
        lacking = [t.name for t in draft if t.name not in state]
        raise CheckpointError(
            f"state holds {len(held)} of the {len(draft)} DSpark tensors; lacks "
            f"{', '.join(lacking[:5])}"
        )
    if held:
        specs = specs + draft
    bad = [t.name for t in specs if t.name not in state]
    bad += [
        t.name for t in specs if t.name in state and tuple(state[t.name].shape) != tuple(t.shape)
    ]
    bad += [t.name for t in specs if t.name in state and state[t.name].dtype != t.dtype]
    if bad:
        raise CheckpointError(f"state does not follow the tensor table at: {', '.join(bad[:5])}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(specs, shard_bytes)
    fnames = [f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    for old in out.glob("model-*-of-*.safetensors"):
        if old.name not in fnames:
            old.unlink()
    weight_map: dict[str, str] = {}
    for fname, shard in zip(fnames, shards, strict=True):
        tensors = {t.name: state[t.name].detach().cpu().contiguous() for t in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o666 & ~_umask())
        weight_map.update(dict.fromkeys(tensors, fname))
    total = sum(t.nbytes for t in specs)
    _write_index(out, cfg, weight_map, {"total_size": total, **(metadata or {})})
    return out


# --- loading ------------------------------------------------------------------------------


def process_state(
    cfg: ModelConfig,
    raw: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    resident: bool = False,
    layer_ids: Any = None,
    dequantize: tuple[str, ...] = (),
) -> dict[str, torch.Tensor | QuantWeight]:
    """The post-load processing of published tensors ``raw`` (consumed: each entry is popped as
    it is processed, so host memory falls while the device fills); see
    ``LoadedCheckpoint.process``. ``layer_ids`` limits the expert fusion to those layers (a
    partial state: one layer's tensors for a kernel test); default every layer."""
    w: dict[str, torch.Tensor | QuantWeight] = {}
    for name in [n for n in raw if ".ffn.experts." not in n and not n.endswith(".scale")]:
        t = raw.pop(name)
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        if base is not None and base + ".scale" in raw:
            scale = raw.pop(base + ".scale")
            if resident and not name.endswith(dequantize):
                w[name] = QuantWeight(t.to(device), scale.to(device), "fp8")
            else:
                w[name] = dequant_fp8_weight(t, scale, dtype).to(device)
        else:
            w[name] = t.to(device)
    blocks = [
        (f"layers.{lid}", cfg.n_routed_experts)
        for lid in (range(cfg.num_hidden_layers) if layer_ids is None else layer_ids)
    ]
    from v41plan.model.dspark import draft_config

    dc = draft_config(cfg)
    if dc is not None and layer_ids is None:  # the draft's experts when they were loaded
        blocks += [
            (f"mtp.{k}", dc.n_routed_experts)
            for k in range(dc.stages)
            if f"mtp.{k}.ffn.experts.0.w1.weight" in raw
        ]
    for prefix, E in blocks:
        for proj in ("w1", "w2", "w3"):
            p = f"{prefix}.ffn.experts.{{}}.{proj}."
            first_w, first_s = raw[p.format(0) + "weight"], raw[p.format(0) + "scale"]
            if resident:
                codes = torch.empty((E, *first_w.shape), dtype=first_w.dtype, device=device)
                scales = torch.empty((E, *first_s.shape), dtype=first_s.dtype, device=device)
            else:
                shape = (E, first_w.shape[0], first_w.shape[1] * 2)
                fused = torch.empty(shape, dtype=dtype, device=device)
            for e in range(E):
                we, se = raw.pop(p.format(e) + "weight"), raw.pop(p.format(e) + "scale")
                if resident:
                    codes[e].copy_(we)
                    scales[e].copy_(se)
                else:
                    fused[e].copy_(dequant_fp4_weight(we, se, dtype))
            key = f"{prefix}.ffn.experts.{proj}"
            w[key] = QuantWeight(codes, scales, "fp4") if resident else fused
    return w


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
        self.weights: dict[str, torch.Tensor | QuantWeight] | None = None
        self.process_calls = 0
        self.report: dict[str, Any] = {}
        """After ``process``: ``checkpoint_bytes`` (published backbone tensors, Engram tables
        apart), ``resident_bytes`` (what ``weights`` holds), their ``ratio``, ``resident``."""

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
        self,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        resident: bool = False,
        dequantize: tuple[str, ...] = (),
    ) -> dict[str, torch.Tensor | QuantWeight]:
        """Post-load processing, exactly once: the weights the model reads, on ``device``.

        Default (the CPU reference's arithmetic): FP8/FP4 weights dequantized into ``dtype``
        and the routed experts fused into ``layers.<i>.ffn.experts.w{1,2,3}`` ``[E, out, in]``.
        ``resident=True`` keeps them as published: every FP8 linear a ``QuantWeight("fp8")``
        and the fused experts a ``QuantWeight("fp4")`` with codes ``[E, out, in/2]`` and
        scales ``[E, out, in/32]``; FP8 names ending with one of ``dequantize`` are dequantized
        into ``dtype`` all the same (``("attn.wo_a.weight",)``: the grouped ``wo_a`` as bf16
        values, +3.5 to 4.8% of the bytes on the shipped specs; by default it stays FP8 and the
        runtime's ``ResidentGroupedLinear`` reads it).
        bf16/fp32 tensors stay in their published dtype either way. ``report`` then holds the
        device weight bytes next to the checkpoint's (Engram tables apart).
        """
        if self.weights is not None:
            raise RuntimeError(
                "post-load processing already ran for this checkpoint; it runs exactly once"
            )
        self.process_calls += 1
        cfg = self.config
        draft = any(name.startswith("mtp.") for name in self.raw)
        w = process_state(cfg, self.raw, dtype, device, resident, dequantize=dequantize)
        self.weights = w
        self.raw = {}  # the published tensors are no longer needed
        self.report = {
            "checkpoint_bytes": checkpoint_nbytes(cfg, draft),
            "resident_bytes": weight_nbytes(w),
            "resident": resident,
        }
        self.report["ratio"] = self.report["resident_bytes"] / self.report["checkpoint_bytes"]
        return w

    def engram_host(self) -> EngramHost:
        """Host Engram half over this checkpoint's tables (token map: ``engram_token_map``)."""
        return EngramHost(self.config, engram_token_map(self.config, self.path), self.tables)


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's shards, Engram tables included, in memory (a
    small model to go on training; the loader never does this)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(path).glob("model-*-of-*.safetensors")):
        state.update(load_file(str(shard)))
    return state


def engram_token_map(cfg: ModelConfig, path: str | Path | None = None) -> np.ndarray:
    """The Engram token map of a model: from its ``tokenizer.json`` (beside the checkpoint at
    ``path``, or the packaged DeepSeek-V4 one for a V4.1-vocabulary config:
    ``v41plan.model.vocab``), else synthetic."""
    from v41plan.model.vocab import tokenizer_json_for

    tok = tokenizer_json_for(path, cfg)
    if tok is not None:
        from tokenizers import Tokenizer

        from v41plan.model.engram import token_map_from_tokenizer

        tmap = token_map_from_tokenizer(Tokenizer.from_file(str(tok)), cfg.vocab_size)
    else:
        tmap = synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    return np.asarray(tmap)


def read_config(path: str | Path) -> ModelConfig:
    """Read and validate ``config.json`` of a checkpoint directory."""
    root = Path(path)
    if not _exists(root):
        raise CheckpointError(f"{path}: no such directory")
    if not root.is_dir():
        raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory)")
    p = root / "config.json"
    if not p.exists():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)")
    doc = _read_json(p)
    try:
        return ModelConfig.from_hf(doc)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{p}: {exc}") from exc


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # a name the OS cannot look up (too long, a NUL byte)
        return False


def _read_json(p: Path) -> Any:
    """A JSON file's value; ``CheckpointError`` naming the file when it is not readable JSON."""
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{p}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise CheckpointError(f"{p}: JSON nested too deeply") from None


class _Shards:
    """Open safetensors shards of one checkpoint, each opened once; every failure to read a
    shard's header or tensor is a ``CheckpointError`` naming the shard."""

    def __init__(self, root: Path) -> None:
        from safetensors import SafetensorError

        self.root = root
        self.handles: dict[str, Any] = {}
        self.errors = (SafetensorError, OSError, RuntimeError, ValueError)

    def handle(self, fname: str, listed: bool = True) -> Any:
        """The open shard ``fname`` (``listed``: named by the index file)."""
        from safetensors import safe_open

        if fname not in self.handles:
            path = self.root / fname
            if not path.is_file():
                where = f" listed in {INDEX_FILE}" if listed else ""
                raise CheckpointError(f"{self.root}: shard {fname}{where} is missing")
            try:
                self.handles[fname] = safe_open(str(path), framework="pt")
            except self.errors as exc:
                raise CheckpointError(
                    f"{self.root}: {fname} is truncated or corrupt ({exc})"
                ) from None
        return self.handles[fname]

    def header(self, fname: str, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        """Shape and dtype of tensor ``name`` from the shard's header (no data read)."""
        f = self.handle(fname)
        if name not in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            raise CheckpointError(
                f"{self.root}: {INDEX_FILE} puts tensor {name} in {fname}, which lacks it"
            )
        try:
            sl = f.get_slice(name)
            shape = tuple(sl.get_shape())
            return shape, (sl[:0].dtype if shape and shape[0] else None)
        except self.errors as exc:
            raise CheckpointError(f"{self.root}: {fname}: tensor {name}: {exc}") from None

    def tensor(self, fname: str, name: str) -> torch.Tensor:
        """Tensor ``name`` of shard ``fname``."""
        try:
            return self.handle(fname).get_tensor(name)
        except self.errors as exc:
            raise CheckpointError(
                f"{self.root}: {fname} is truncated or corrupt at tensor {name} ({exc})"
            ) from None


def _weight_map(root: Path, shards: _Shards) -> dict[str, str]:
    """Tensor name -> shard file, from the index file or the single ``model.safetensors``."""
    index = root / INDEX_FILE
    if index.exists():
        doc = _read_json(index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(
                f'{index}: needs a "weight_map" object of tensor name -> shard file name'
            )
        return wm
    if (root / "model.safetensors").exists():
        f = shards.handle("model.safetensors", listed=False)
        return {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (not iterable)
    raise CheckpointError(f"{root}: neither {INDEX_FILE} nor model.safetensors")


def random_weights_seed(path: str | Path) -> int | None:
    """The seed of a checkpoint ``write_checkpoint`` filled with random weights, else None
    (read from its index file; None too when that cannot be read)."""
    try:
        doc = json.loads((Path(path) / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    meta = doc.get("metadata") if isinstance(doc, dict) else None
    seed = meta.get(RANDOM_SEED_KEY) if isinstance(meta, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def check_checkpoint(
    path: str | Path, cache_spec: Any = None, speculative: bool = False
) -> tuple[ModelConfig, list[TensorSpec], dict[str, str], _Shards]:
    """Check a checkpoint without reading any weight: its ``config.json`` (against
    ``cache_spec`` when given), and every tensor's presence, shape and dtype from the shard
    headers; with ``speculative`` the DSpark stages' tensors too (the config must declare the
    draft). Returns the config, tensor table, weight map and open shards; raises
    ``CheckpointError`` with one line naming the file and what is wrong."""
    root = Path(path)
    cfg = read_config(root)
    if cache_spec is not None:
        try:
            check_against_spec(cfg, cache_spec)
        except ValueError as exc:
            raise CheckpointError(f"{root}: {exc}") from exc
    specs = tensor_table(cfg)
    if speculative:
        from v41plan.model.dspark import draft_config

        try:
            dc = draft_config(cfg)
        except ValueError as exc:
            raise CheckpointError(f"{root / 'config.json'}: {exc}") from None
        if dc is None:
            raise CheckpointError(
                f"{root / 'config.json'}: declares no DSpark draft (no dspark_* fields), so "
                "speculative decoding cannot load one"
            )
        specs = specs + draft_tensor_table(cfg)
    shards = _Shards(root)
    weight_map = _weight_map(root, shards)
    for t in specs:  # presence, shape and dtype, from headers only
        if t.name not in weight_map:
            raise CheckpointError(
                f"{root}: missing tensor {t.name} (expected shape {list(t.shape)})"
            )
        shape, dt = shards.header(weight_map[t.name], t.name)
        if shape != t.shape:
            raise CheckpointError(
                f"{root}: tensor {t.name} has shape {list(shape)}, expected {list(t.shape)}"
            )
        if dt is not None and dt not in _ACCEPT[t.dtype]:
            raise CheckpointError(f"{root}: tensor {t.name} has dtype {dt}, expected {t.dtype}")
    return cfg, specs, weight_map, shards


def load_checkpoint(
    path: str | Path,
    cache_spec: Any = None,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    resident: bool = False,
    speculative: bool = False,
) -> LoadedCheckpoint:
    """Load a published-layout checkpoint directory.

    The config is checked against ``cache_spec`` (when given) before any weight is read; every
    tensor of ``tensor_table`` must be present with its shape and dtype (``check_checkpoint``).
    ``speculative`` loads the DSpark stages' ``mtp.*`` tensors too (``draft_tensor_table``);
    without it they are not read.
    With ``dtype`` set, the post-load processing runs (once, ``resident`` as in
    ``LoadedCheckpoint.process``) before returning; ``dtype=None`` leaves it to the caller. Every
    problem is a ``CheckpointError`` naming the file.
    """
    root = Path(path)
    cfg, specs, weight_map, shards = check_checkpoint(root, cache_spec, speculative)
    raw: dict[str, torch.Tensor] = {}
    tables: list[EngramTable] = []
    for t in specs:
        fname = weight_map[t.name]
        if t.kind == "table":
            prefix = t.name[: -len(".embed.weight")]
            try:
                tables.append(EngramTable.open(root / fname, prefix, shards.handle(fname)))
            except (OSError, ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{root}: {fname}: Engram table {prefix} cannot be mapped ({exc})"
                ) from None
        elif t.kind != "table_scale":
            x = shards.tensor(fname, t.name)
            if t.dtype == BF16 and x.dtype == F32:
                x = x.to(BF16)
            if t.kind in ("fp8_scale", "fp4_scale") and x.dtype == torch.uint8:
                x = x.view(E8M0)
            raw[t.name] = x
    ckpt = LoadedCheckpoint(cfg, raw, tables, root)
    if dtype is not None:
        ckpt.process(dtype, device, resident=resident)
    return ckpt
