"""Tensor parallelism of the V4.1 model: load-time weight sharding and the refusals.

Rank ``r`` of ``tp`` owns query heads ``[r*H/tp, (r+1)*H/tp)`` (``wq_b`` rows, ``attn_sink``)
with their output groups (``wo_a`` rows; ``wo_b`` input columns, then an all-reduce), index
heads ``[r*nih/tp, ...)`` (``indexer.wq_b`` and ``weights_proj`` rows; the partial index scores
are all-reduced before any top-k), and either whole routed experts ``[r*E/tp, ...)`` (expert
parallel) or every routed expert's intermediate slice ``[r*I/tp, ...)`` (``w1``/``w3`` rows,
``w2`` columns); the shared expert's intermediate dimension is always sliced. The MoE output is
one all-reduce per layer (routed and shared partials summed first). Everything else (embedding,
mHC, norms, window KV, compressor, index keys, gate, head) is replicated, and so is the cache:
every rank computes and stores the same KV rows and index keys.

Refusals (``check_tp``, before any weight loads): heads, index heads, output groups and
``moe_intermediate_size`` divisible by ``tp``; ``n_routed_experts`` too under expert parallelism;
and every rank's slice of a quantized linear's input (``wo_b``: ``o_groups/tp * o_lora_rank``,
routed and shared ``w2``: ``moe_intermediate_size/tp``) whole FP8 activation blocks of 32 lanes,
the per-rank form of the rule that every quantized linear's input is a multiple of 32. Then a TP
run rounds exactly the values one rank rounds, and differs from it only in the summation order
of the three reductions.
"""

from __future__ import annotations

from typing import Any

import torch

from v41plan.model.config import ConfigError
from v41plan.model.quant import WEIGHT_BLOCK, QuantWeight

ACT_BLOCK = 32
"""Lanes of one FP8 activation-quant block along a linear's input (``fake_fp8(x, 32)``)."""


class TPConfigError(ConfigError):
    """A tensor-parallel size the model cannot be split by (raised before weights load)."""


def _dims(cfg: Any) -> dict[str, int]:
    """The split dimensions of a ``ModelConfig`` or a spec's ``model_config`` dict."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, default=None: getattr(cfg, k, default)
    names = (
        "num_attention_heads",
        "index_n_heads",
        "o_groups",
        "o_lora_rank",
        "moe_intermediate_size",
        "n_routed_experts",
    )
    return {k: int(get(k, 0) or 0) for k in names}


def _refusal(cfg: Any, tp_size: int, expert_parallel: bool) -> str | None:
    """Why ``tp_size`` cannot split ``cfg`` (None when it can)."""
    if not isinstance(tp_size, int) or tp_size < 1:
        return "accepted: an integer >= 1"
    d = _dims(cfg)
    need = ["num_attention_heads", "index_n_heads", "o_groups", "moe_intermediate_size"]
    if expert_parallel:
        need.append("n_routed_experts")
    for name in need:
        if d[name] % tp_size:
            why = " under expert parallelism" if name == "n_routed_experts" else ""
            return f"{name}={d[name]} must be divisible by it{why}"
    wo_b_in = d["o_groups"] // tp_size * d["o_lora_rank"]
    w2_in = d["moe_intermediate_size"] // tp_size
    for what, lanes in (
        (f"o_groups/{tp_size} * o_lora_rank (each rank's wo_b input)", wo_b_in),
        (f"moe_intermediate_size/{tp_size} (each rank's shared and routed w2 input)", w2_in),
    ):
        if lanes % ACT_BLOCK:
            return (
                f"{what} = {lanes} is not a multiple of the {ACT_BLOCK}-lane FP8 activation block"
            )
    return None


def accepted_sizes(cfg: Any, expert_parallel: bool, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that ``check_tp`` accepts for ``cfg``."""
    return [n for n in range(1, limit + 1) if _refusal(cfg, n, expert_parallel) is None]


def check_tp(cfg: Any, tp_size: int, expert_parallel: bool) -> None:
    """Refuse a tensor-parallel size the model cannot be split by, naming the dimension.

    Heads, index heads, output groups and the expert intermediate size must divide by ``tp``
    (the shared expert is always sliced); under expert parallelism the routed experts must too;
    each rank's ``wo_b`` and ``w2`` input slices must be whole 32-lane activation blocks.
    ``cfg`` is a ``ModelConfig`` or a spec's ``model_config`` dict.
    """
    why = _refusal(cfg, tp_size, expert_parallel)
    if why is not None:
        ok = ", ".join(map(str, accepted_sizes(cfg, expert_parallel)))
        raise TPConfigError(
            f"tensor_parallel_size={tp_size!r} is refused: {why}; accepted with this model: {ok}"
        )


def _rows(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1/size`` slice of ``t`` along ``dim`` (a compact copy)."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).contiguous()


def slice_quant(q: QuantWeight, rank: int, size: int, dim: int) -> QuantWeight:
    """Rank ``rank``'s ``1/size`` slice of a resident weight along logical ``dim``, cut on the
    quantized tensors: codes and the scales of exactly those lanes, never more.

    FP8 slices whole 32 x 32 scale blocks; FP4 slices whole rows (one scale row each) or, along
    the packed input, whole 32-lane scale blocks. Raises ``TPConfigError`` when a rank's share
    would split a scale block.
    """
    shape = q.shape
    dim %= len(shape)
    n = shape[dim] // size
    lo = rank * n
    along_k = dim == len(shape) - 1
    if q.format == "fp8" or along_k:
        if n % WEIGHT_BLOCK:
            raise TPConfigError(
                f"a {q.format} weight {list(shape)} split {size} ways along dim {dim} gives "
                f"{n} lanes per rank, not whole {WEIGHT_BLOCK}-lane scale blocks"
            )
        sb = WEIGHT_BLOCK
    else:
        sb = 1  # FP4 rows (and experts) carry their own scale rows
    pack = 2 if (q.format == "fp4" and along_k) else 1
    codes = q.codes.narrow(dim, lo // pack, n // pack)
    scales = q.scales.narrow(dim, lo // sb, n // sb)
    return QuantWeight(codes.contiguous(), scales.contiguous(), q.format)


def _shard(t: Any, rank: int, size: int, dim: int) -> Any:
    """``_rows`` for tensors, ``slice_quant`` for resident quantized weights."""
    if isinstance(t, QuantWeight):
        return slice_quant(t, rank, size, dim)
    return _rows(t, rank, size, dim)


def shard_weights(
    weights: dict[str, Any], cfg: Any, tp: Any, expert_parallel: bool
) -> dict[str, Any]:
    """This rank's weights: processed weights (``LoadedCheckpoint.process``) sliced per rank.

    Dequantized tensors and resident ``QuantWeight``s alike: a resident weight is cut on its
    codes and scales (``slice_quant``), so a rank holds only its share of the published bytes.

    Sharded names (per layer): ``attn.wq_b.weight`` and ``attn.attn_sink`` by heads,
    ``attn.wo_a.weight`` rows and ``attn.wo_b.weight`` columns by output groups,
    ``attn.indexer.wq_b.weight`` and ``attn.indexer.weights_proj.weight`` by index heads,
    ``ffn.experts.w{1,2,3}`` by expert (``expert_parallel``) or by intermediate lanes, and
    ``ffn.shared_experts.w{1,3}`` rows / ``w2`` columns by intermediate lanes. Every other
    tensor is passed through (replicated). Returns ``weights`` itself at size 1.
    """
    check_tp(cfg, tp.size, expert_parallel)  # ``tp``: a group with ``rank`` and ``size``
    if tp.size == 1:
        return weights
    r, n = tp.rank, tp.size
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if not name.startswith("layers."):
            out[name] = t
            continue
        site = name.split(".", 2)[2]  # after "layers.<i>."
        if site in (
            "attn.wq_b.weight",
            "attn.attn_sink",
            "attn.wo_a.weight",
            "attn.indexer.wq_b.weight",
            "attn.indexer.weights_proj.weight",
            "ffn.shared_experts.w1.weight",
            "ffn.shared_experts.w3.weight",
        ):
            out[name] = _shard(t, r, n, 0)
        elif site in ("attn.wo_b.weight", "ffn.shared_experts.w2.weight"):
            out[name] = _shard(t, r, n, 1)
        elif site in ("ffn.experts.w1", "ffn.experts.w3", "ffn.experts.w2"):
            if expert_parallel:
                out[name] = _shard(t, r, n, 0)  # whole experts
            else:  # fused [E, I, D] for w1/w3, [E, D, I] for w2
                out[name] = _shard(t, r, n, 2 if site == "ffn.experts.w2" else 1)
        else:
            out[name] = t
    return out
