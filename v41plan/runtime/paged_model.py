"""The paged runtime model: the reference's weights and arithmetic over PAGE/STATE pools.

A forward is two calls. ``prepare(plan, token_ids)`` is host work: it turns a ``StepPlan``
(``v41plan.planner.step``) into the step's inputs (token ids, positions, per-request bounds,
block tables, every sub-step's row set as an index tensor, the compressed groups, the Engram
rows gathered from the tables, the cursor values to commit), writes them into a pinned staging
workspace and moves them to the device in one non-blocking copy (``staging.Workspace``).
``run(inputs)`` is pure tensor work on those device views: no host sync, no host data, no
allocation that depends on data. The same ``run()`` executes eagerly, is captured whole for
FULL graphs, and is split at attention (``layer_pre`` / ``layer_attention`` / ``layer_post``)
for PIECEWISE (``v41plan.runtime.graphs``).

With decoder replay off (or in decode) every sub-step runs on every row of the flat batch; with
it on, the stage table narrows the decoder to each finishing request's tail and the last
layer's query to its last row. Layers run by the plan's graph stages, each stage's rows
gathered once. Model arithmetic comes from ``v41plan.model.layers`` (the pieces the dense
reference calls); pool reads and writes go through a kernel backend (``kernels.backend``).

Order of pool reads and writes per layer: window KV, then (Full owners) the compressed groups
closing in the forward, paired with the FP32 tails, written to the main and index planes; then
the query's index selection over the plane (each row its own bound and pages); then attention
over window rows (the ring below the forward's start, this forward's rows above) and the
selected compressed rows; a prefill writes its ring rows after attention (the old rows stay
until every query read its prefix), a decode forward writes first. Positions and Engram history
(the cursor) are committed after the forward; the host keeps a mirror of every slot's cursor
(``Pools.cursor_host``), so ``prepare`` never reads the device.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from v41plan.geometry.runtime import INDEX_CACHE_DTYPES, KV_CACHE_DTYPES, CacheSpec
from v41plan.model import quant
from v41plan.model.config import ModelConfig, config_from_cache_spec
from v41plan.model.layers import (
    Attention,
    EngramLayer,
    HcParams,
    LayerKernels,
    Linear,
    MoE,
    acc_dtype,
)
from v41plan.model.quant import QuantWeight, fake_fp8
from v41plan.runtime.collectives import SINGLE, TPGroup, tp_score_candidates_topk, tp_score_topk
from v41plan.runtime.compiled import DensePieces, compiled_dense
from v41plan.runtime.engram_device import DEVICE_TABLE_BYTES, DeviceEngram, table_bytes
from v41plan.runtime.kernels.backend import RangedBackend
from v41plan.runtime.kernels.torch_ref import TorchBackend
from v41plan.runtime.pools import Pools
from v41plan.runtime.sampler import SamplerInputs, SamplerOutput, sample_tokens
from v41plan.runtime.staging import Layout, Workspace, build_layout

ALL = None
"""A row set holding every row of the width (a sub-step or stage that runs every row)."""

SITE_CODES = True
"""Whether an mHC site whose output feeds a product that reads FP8 codes (the joint
``wq_a``/``wkv`` linear, the grouped MoE; ``reads_codes``) quantizes that output in its own
epilogue (``mhc_site_fp8``/``mhc_expand_site_fp8`` with E8M0 scales, the Triton dense kernels)
where that epilogue runs one token a program (``triton_dense.codes_in_parallel``: up to 16
rows), so the product takes the codes instead of a quantizer launch of its own: the same codes
(the same quantizer, bit for bit), two launches fewer a layer. False: the products quantize."""

_PER_REQUEST = (
    "forward_start",
    "forward_end",
    "cached_until",
    "swa_cached_until",
    "swa_replay_start",
    "encoder_window_floor",
    "tail_start",
    "last_rows",
)


def index_pages_needed(
    max_position: int, ratio: int, rows_per_page: int, block_rows: int, table_width: int
) -> int:
    """Block-table columns a step's scorer and selected-row gathers must read: enough pages for
    the largest visible bound ``(max_position + 1) // ratio`` of the step, rounded up to whole
    candidate blocks of ``block_rows`` compressed rows, at most ``table_width``. The scorer's
    work then follows the context, not ``max_model_len``."""
    rows = (max_position + 1) // ratio
    n = -(-rows // rows_per_page)
    unit = block_rows // math.gcd(block_rows, rows_per_page)  # pages per whole candidate block
    n = -(-n // unit) * unit
    return max(unit, min(n, table_width)) if table_width >= unit else table_width


def check_formats(kv_cache_dtype: str, index_cache_dtype: str) -> None:
    """Refuse an unsupported pool format pair (called before any weight loads)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; "
            f"accepted: {', '.join(KV_CACHE_DTYPES)}"
        )
    if index_cache_dtype not in INDEX_CACHE_DTYPES:
        raise ValueError(
            f"index_cache_dtype={index_cache_dtype!r} is not supported; "
            f"accepted: {', '.join(INDEX_CACHE_DTYPES)}"
        )


@dataclass(frozen=True)
class StepSampling:
    """How a step samples its requests' last rows on the device (host facts, staged by
    ``prepare``): per real request the ``SamplerInputs`` columns, and the static shape of the
    sampler (what a captured graph is specific to)."""

    temperature: np.ndarray
    """float32 ``[n]``; 0 is greedy."""
    top_k: np.ndarray
    """int64 ``[n]``; 0 keeps every token."""
    top_p: np.ndarray
    """float32 ``[n]``; 1 keeps every token."""
    min_p: np.ndarray
    """float32 ``[n]``; 0 is off."""
    seed: np.ndarray
    """int64 ``[n]`` (two's complement of the request's seed)."""
    output_index: np.ndarray
    """int64 ``[n]``: which output token each request samples."""
    sampled: bool = True
    """Some request samples (else every row is greedy: the noise is skipped)."""
    truncate: bool = True
    """Some request truncates (top-k, top-p or min-p; else the sort is skipped)."""
    top_n: int = 0
    """Top logprobs to return per request (0: only the sampled token's)."""

    @classmethod
    def neutral(cls, n: int, *, sampled: bool, truncate: bool, top_n: int = 0) -> StepSampling:
        """``n`` greedy requests under the given static shape (graph capture)."""
        f, i = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.int64)
        return cls(f, i, np.ones(n, dtype=np.float32), f, i, i, sampled, truncate, top_n)

    @property
    def shape_key(self) -> tuple[bool, bool, int]:
        """The static part (a graph captured for one shape replays only that shape)."""
        return (self.sampled, self.truncate, self.top_n)


@dataclass
class StepOutput:
    """What a forward returns (device tensors)."""

    logits: torch.Tensor
    """``[running_bs, vocab]`` at each request's last row (zeros for padding requests; NaN for a
    request whose forward does not finish its prompt under decoder replay)."""
    row_logits: torch.Tensor | None
    """``[running_tokens, vocab]`` at every row when asked for; under decoder replay the rows of
    requests that did not run every layer are NaN (never returned as numbers)."""
    sampled: SamplerOutput | None = None
    """The tokens sampled on the device from ``logits`` (when the step was prepared with a
    ``StepSampling``): ``[running_bs]`` ids, their logprobs and the top logprobs asked for."""
    spec: SpecOutput | None = None
    """A speculating model's verification and next drafts (``StepSpec`` given)."""


@dataclass(frozen=True)
class StepSpec:
    """Host facts of a speculating model's step (``RuntimeModel(speculative=True)``), per real
    request in batch order: which rows verify drafts, the drafts, the cursor each accepted
    length leaves. Every request whose last row samples also drafts the next block."""

    verify: np.ndarray
    """bool ``[n]``: a decode request whose rows are its anchor and ``block_size`` drafts."""
    drafts: np.ndarray
    """int64 ``[n, block_size]``: the drafts a verifying request's rows hold (0 elsewhere)."""
    cursors: np.ndarray
    """int64 ``[n, block_size + 1, 1 + history]``: a verifying request's cursor after ``a``
    accepted drafts (position ``start + a + 1`` and the Engram history through it)."""
    proposes: np.ndarray
    """bool ``[n]``: the request samples this step (a final chunk or a decode row), so its
    draft proposes the next block."""


@dataclass
class SpecInputs:
    """``StepSpec`` on the device, at the request width (fixed addresses per width)."""

    verify: torch.Tensor
    verify_rows: torch.Tensor
    """int64 ``[b, block_size + 1]`` flat rows of each verifying request (0 elsewhere)."""
    drafts: torch.Tensor
    cursors: torch.Tensor
    proposes: torch.Tensor


@dataclass
class SpecOutput:
    """A speculating step's results (device tensors, ``[running_bs]`` rows)."""

    accepted: torch.Tensor
    """int64 ``[b]`` drafts accepted (0 for a request that did not verify)."""
    tokens: torch.Tensor
    """int64 ``[b, block_size + 1]`` the tokens the step emits: the accepted drafts, then the
    target's token after them; -1 after. A request that did not verify emits its sampled token."""
    logprobs: torch.Tensor
    """float32 ``[b, block_size + 1]`` raw log-softmax of each emitted token."""
    drafts: torch.Tensor
    """int64 ``[b, block_size]`` the next block each proposing request drafted."""
    confidence: torch.Tensor
    """``[b, block_size]`` the draft's confidence logits for that block."""


class RowSets:
    """``(layer, sub_step)`` -> the flat rows a sub-step runs: ``ALL`` (every row), a device
    index tensor, or ``NO_ROWS``; the key index is the planner's (static per stage table), the
    tensors are this step's staged row sets."""

    __slots__ = ("_index", "_lens", "_staged")

    def __init__(self, key_index: dict, staged: list, lens: tuple[int, ...]) -> None:
        self._index, self._staged, self._lens = key_index, staged, lens

    def get(self, key):
        """The rows of ``key`` (``NO_ROWS`` when it runs none)."""
        i = self._index.get(key)
        if i is None or self._lens[i] == 0:
            return NO_ROWS
        return self._staged[i]


NO_ROWS = object()
"""A sub-step that runs on no row of the step."""


@dataclass
class CompressInputs:
    """The compressed groups of one ratio closing in the step, padded to the width."""

    rows: torch.Tensor
    """``[t]`` flat row of each group's last member (0 on padding entries)."""
    batch_ids: torch.Tensor
    """``[t]`` request row of each group; -1 on padding entries (written to no page)."""
    compressed_rows: torch.Tensor
    """``[t]`` compressed row id ``pos // ratio`` of each group."""
    first_from_tail: torch.Tensor
    """``[t]`` bool by flat row: the closing row whose group's first member is the slot's FP32
    tail (ratio 2)."""
    tail_store: torch.Tensor
    """``[t]`` bool by flat row: rows whose projection goes into the slot's FP32 tail."""


@dataclass
class StageInputs:
    """One graph stage: its layers and the flat rows it runs (``ALL``: every row)."""

    name: str
    first_layer: int
    last_layer: int
    rows: torch.Tensor | None


@dataclass
class StepInputs:
    """A prepared step: device views of the staging workspace, plus the host facts (widths,
    row-set presence) that fix every shape ``run()`` sees."""

    t: int
    """Token width (``running_tokens``)."""
    b: int
    """Request width (``running_bs``)."""
    decode: bool
    """Every request decodes one step: the captured shape (ring written before it is read)."""
    layout: Layout
    token_ids: torch.Tensor
    positions: torch.Tensor
    batch_ids: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    per_request: dict[str, torch.Tensor]
    """``forward_start``, ``forward_end``, ``cached_until``, ``swa_cached_until``,
    ``swa_replay_start``, ``encoder_window_floor``, ``tail_start``, ``last_rows`` ``[b]``."""
    cursors: torch.Tensor
    """``[b, 1 + history]`` each request's cursor after the step."""
    last_undefined: torch.Tensor
    """``[b]`` bool: the request's last row ran no decoder layer (a non-final chunk under
    decoder replay): its logits are NaN."""
    rows: RowSets
    """``(layer, sub_step)`` -> flat rows (``ALL``: every row; ``NO_ROWS``: none)."""
    stages: tuple[StageInputs, ...]
    compress: dict[int, CompressInputs]
    engram_codes: tuple[torch.Tensor, ...]
    """Per Engram layer ``[t, cols, width]`` E4M3 bytes of every row's table rows."""
    engram_scales: tuple[torch.Tensor, ...]
    engram_row0: torch.Tensor | None = None
    """With the Engram lookup on the device: ``[b]`` each request's first row."""
    engram_history: torch.Tensor | None = None
    """With the Engram lookup on the device: ``[b, max_ngram - 1]`` each request's compressed
    ids before its first row, newest first."""
    all_row_logits: bool = False
    undefined_rows: torch.Tensor | None = None
    """``[t]`` bool: rows whose logits are undefined under decoder replay (NaN)."""
    sampler: SamplerInputs | None = None
    """Device sampling of the last rows (None: the step returns logits only)."""
    index_pages: dict[int, int] | None = None
    """Per compress ratio, the block-table columns the scorer reads (``index_pages_needed``);
    None: the whole width (a decode step: its graph replays whatever the context)."""
    sampling_shape: tuple | None = None
    """``StepSampling.shape_key`` of the staged sampler (None without one)."""
    spec: SpecInputs | None = None
    """A speculating model's verification inputs (None: the model does not speculate)."""

    @property
    def key(self) -> tuple:
        """What a captured graph is specific to: equal keys read equal device addresses."""
        return (
            self.t, self.b, self.decode, self.all_row_logits, self.sampling_shape,
            self.layout.key, self.spec is not None,
        )  # fmt: skip


@dataclass
class Frame:
    """The rows one graph stage runs, gathered once (or every row of the width, in place)."""

    full: bool
    """Every row of the width (tensors alias the step's; row sets are ``ALL``)."""
    rows: torch.Tensor | None
    """Flat row of each frame row ``[n]`` (None for a full frame)."""
    loc: torch.Tensor | None
    """Frame row of each flat row ``[t]`` (-1 outside the frame; None for a full frame)."""
    X: torch.Tensor
    pre: torch.Tensor
    pos: torch.Tensor
    bid: torch.Tensor
    b: torch.Tensor
    slot: torch.Tensor
    pages: torch.Tensor
    kv: torch.Tensor
    """This stage's window-KV rows of the current layer ``[n, d]``."""
    memo: dict = field(default_factory=dict)
    """What every layer of the stage would compute alike from the step's inputs (frame rows
    of a row set, RoPE tables, per-row window bounds), computed by the first layer that asks:
    a layer then launches only its own work. Keys name the inputs (tensors by ``id``: each is
    held by the step's inputs or by this dict for the frame's life)."""

    def local(self, flat: torch.Tensor | None) -> torch.Tensor | None:
        """Frame rows of flat rows (``ALL`` stays ``ALL``)."""
        if flat is None or self.full:
            return flat
        return self.once(("local", id(flat)), lambda: self.loc[flat])

    def once(self, key, fn):
        """``fn()``, computed once per frame for ``key``."""
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = fn()
        return value


@dataclass
class Pieces:
    """What a layer's dense piece before attention hands the attention and the piece after it
    (fixed tensors: PIECEWISE graphs pass them from one capture to the next)."""

    need: torch.Tensor | None
    """Frame rows the layer computes (the largest of its row sets)."""
    at: torch.Tensor | None
    rw: torch.Tensor | None
    cp: torch.Tensor | None
    ff: torch.Tensor | None
    a_pre: torch.Tensor
    a_post: torch.Tensor
    a_C: torch.Tensor
    xin: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q: torch.Tensor | None = None
    qi: torch.Tensor | None = None
    wts: torch.Tensor | None = None
    v: torch.Tensor | None = None
    g: torch.Tensor | None = None
    o: torch.Tensor | None = None
    """Attention output ``[n_at, H, d]``, written by ``layer_attention``."""
    extra: dict = field(default_factory=dict)


DENSE_IMPLS = ("torch", "triton")
"""``RuntimeModel(dense=...)``: the dense pieces' kernels (the torch compositions, the
reference; or the fused Triton kernels of ``kernels.triton_dense``)."""
MOE_IMPLS = ("dense", "grouped")
"""``RuntimeModel(moe=...)``: every expert on every row (``layers.MoE``, the reference) or the
selected experts only (``resident.GroupedMoE``: W4A8 Triton over resident FP4 experts on CUDA,
else the torch grouped product)."""


def dense_ops(name: str):
    """The dense-piece functions ``dense`` names (``DENSE_IMPLS``)."""
    if name == "triton":
        from v41plan.runtime.kernels.triton_dense import TritonDense

        return TritonDense
    from v41plan.runtime.kernels.dense_ref import TorchDense

    return TorchDense


def _linear_factory(quantizer):
    """``LayerKernels.linear``: a ``ResidentLinear`` over a weight kept as published (the W8A8
    Triton GEMM on CUDA), else ``Linear`` with ``quantizer``."""

    def make(weight, dtype: torch.dtype, act_quant: bool = True):
        if isinstance(weight, QuantWeight):
            from v41plan.runtime.resident import ResidentLinear

            return ResidentLinear(weight, dtype, act_quant, quantizer=quantizer)
        return Linear(weight.to(dtype), act_quant, quantizer)

    return make


def _take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x if idx is None else x[idx]


def _count(idx: torch.Tensor | None, n: int) -> int:
    return n if idx is None else idx.shape[0]


class RuntimeModel:
    """The paged V4.1 model over ``Pools`` for one (kv_cache_dtype, index_cache_dtype) pair."""

    def __init__(
        self,
        cache_spec: CacheSpec,
        weights: dict[str, torch.Tensor],
        engram,
        *,
        kv_cache_dtype: str = "bf16",
        index_cache_dtype: str = "fp8",
        num_pages: int = 64,
        num_slots: int = 4,
        max_tokens: int = 512,
        max_bs: int = 8,
        table_width: int = 32,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        cfg: ModelConfig | None = None,
        backend=None,
        tp: TPGroup = SINGLE,
        engram_on_device: bool | None = None,
        dense: str = "torch",
        moe: str = "dense",
        compile_backend: str | None = None,
        speculative: bool = False,
    ):
        check_formats(kv_cache_dtype, index_cache_dtype)
        if dense not in DENSE_IMPLS:
            raise ValueError(f"dense={dense!r}; accepted: {', '.join(DENSE_IMPLS)}")
        if moe not in MOE_IMPLS:
            raise ValueError(f"moe={moe!r}; accepted: {', '.join(MOE_IMPLS)}")
        resident = any(isinstance(t, QuantWeight) for t in weights.values())
        if resident and moe != "grouped":
            raise ValueError("weights kept as published (resident) run with moe='grouped'")
        self.spec = cache_spec
        self.cfg = cfg = cfg or config_from_cache_spec(cache_spec)
        self.geometry = cache_spec.geometry(kv_cache_dtype, index_cache_dtype, speculative)
        self.index_fmt = "fp8" if index_cache_dtype == "fp8" else None
        self.dtype, self.acc, self.device = dtype, acc_dtype(dtype), torch.device(device)
        self.backend = backend or TorchBackend()
        self.tp = tp
        """Tensor-parallel group; ``weights`` are then this rank's shard (``shard_weights``)."""
        self.pools = Pools(self.geometry, num_pages, num_slots, device)
        self.max_tokens, self.max_bs, self.table_width = max_tokens, max_bs, table_width
        """The widest step the model runs: ``max_tokens`` rows, ``max_bs`` requests, block
        tables of ``table_width`` PAGEs (every step's tables are padded to it)."""
        self.engram = engram
        self.dense = compiled_dense(dense_ops(dense), compile_backend)
        """The mHC sites, the expand and the FP8 activation quantizer (``TorchDense``, the
        reference compositions, or ``TritonDense``: one launch each, same call shapes)."""
        self.moe_impl = moe
        self.resident = resident
        """Whether the FP8 linears and FP4 experts are kept as published (``QuantWeight``)."""
        self.pieces = DensePieces(compile_backend)
        """The dense pieces between the backend ops: the layers' methods (eager), or the same
        under ``torch.compile`` (``compile_backend``: ``compilation_level=3``)."""
        if os.environ.get("V41PLAN_PROFILE_RANGES", "0") not in ("", "0"):
            self.label_backend_ops()
        # inside a compiled region the reference quantizer compiles into the kernels around it
        q8 = fake_fp8 if compile_backend is not None else self.dense.fake_fp8
        # the window-KV epilogue stays one fused launch (opaque to the compiler, which splits
        # its norm, pair-lane RoPE and block quantizer into four kernels); the fused output
        # projection (``rope_wo_a``) measured slower than its composition and is not used
        nrq = self.dense.norm_rope_fp8 if dense == "triton" else None
        # the output projection's inverse RoPE as one kernel writing the grouped product's
        # operand (Inductor makes two to four kernels of it and a transposing copy)
        orope = self.dense.inverse_rope_groups if dense == "triton" else None
        from v41plan.runtime.resident import grouped_linear, linear_pair

        kernels = LayerKernels(q8, _linear_factory(q8), nrq, orope, grouped_linear, linear_pair(q8))
        w = weights
        self.embed = w["embed.weight"]
        self.norm = w["norm.weight"]
        head = w["head.weight"]
        # bf16 rows against the published bf16 head: float32 products are exact, so it stays
        # bf16 (half the bytes; ``ops.head_logits`` accumulates in float32)
        keep = dtype == torch.bfloat16 and head.dtype == torch.bfloat16
        self.head = head if keep else head.to(self.acc)
        """The LM head ``[V, D]``: published bf16 under bf16 compute, else in ``acc``."""
        self.attn: list[Attention] = []
        self.moe: list = []
        """Per layer ``MoE`` (dense over experts, the reference) or ``GroupedMoE`` (the
        selected experts only)."""
        self.hc_attn: list[HcParams] = []
        self.hc_ffn: list[HcParams] = []
        self.attn_norm: list[torch.Tensor] = []
        self.ffn_norm: list[torch.Tensor] = []
        self.engram_layers: dict[int, EngramLayer] = {}
        for info in cfg.layers:
            p = f"layers.{info.index}"
            self.attn.append(Attention(cfg, info, w, p, dtype, tp=tp, kernels=kernels))
            if moe == "grouped":
                from v41plan.runtime.resident import GroupedMoE

                q8g = self.dense.fake_fp8  # its permutation stays eager
                self.moe.append(GroupedMoE(cfg, w, p, dtype, tp=tp, quantizer=q8g))
            else:
                self.moe.append(MoE(cfg, w, p, dtype, tp=tp, kernels=kernels))
            self.hc_attn.append(
                HcParams(*(w[f"{p}.hc_attn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.hc_ffn.append(
                HcParams(*(w[f"{p}.hc_ffn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.attn_norm.append(w[f"{p}.attn_norm.weight"])
            self.ffn_norm.append(w[f"{p}.ffn_norm.weight"])
            if info.engram:
                self.engram_layers[info.index] = EngramLayer(cfg, w, p, dtype, kernels)
        self._engram_shapes = self._engram_table_shapes()
        if engram_on_device is None:  # tables that fit go to the device
            engram_on_device = bool(self._engram_shapes) and (
                table_bytes(engram) <= DEVICE_TABLE_BYTES
            )
        self.engram_device = (
            DeviceEngram(engram, self.device) if engram_on_device and self._engram_shapes else None
        )
        """The Engram lookup on the device (row ids hashed and table rows gathered inside
        ``run()``); None: the host half stages every row's table rows in ``prepare``."""
        self._engram_ids: torch.Tensor | None = None
        self._step_memo: dict = {}
        """The memo every full frame of the current step shares (``frame``): what the layers
        compute alike from the step's inputs is computed once a step, not once a stage; reset
        by ``embed_rows``, which every forward (and a PIECEWISE capture) calls first."""
        self._arange = torch.arange(max(max_tokens, max_bs), device=self.device)
        self._no_rows = self._arange[:0]
        """The empty row set (one tensor: frame memo keys name row sets by ``id``)."""
        self.workspace = {
            "decode": Workspace(self.device, self._decode_capacity(), growable=False),
            "step": Workspace(self.device, 0, growable=True),
        }
        """Staging per step family: ``decode`` (fixed addresses, read by captured graphs) and
        ``step`` (prefill and mixed steps, grown as needed)."""
        quant.warm_tables(self.device)  # constant tables built before any step (no H2D later)
        self._row_counts: Counter = Counter()
        self._row_count_log: list[tuple[dict, tuple[int, ...]]] = []
        self._layouts: dict = {}
        self._sub_view_cache: dict = {}
        self.selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[running_tokens, index_topk]`` per index source in the last forward
        (-1 on rows that did not select)."""
        self._routed: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._width = 0
        self.forced_selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[running_tokens, index_topk]`` by flat row to use instead of the
        scorer's, per index source (teacher forcing, as ``ReferenceModel.forced_selections``);
        Reuse layers inherit it. The candidate mask still comes from the scores."""
        self.forced_experts: dict[int, torch.Tensor] = {}
        """Routed expert ids ``[running_tokens, num_experts_per_tok]`` by flat row to use instead
        of the router's, per layer."""
        self.draft = None
        """The DSpark draft (``dspark_paged.PagedDraft``) when ``speculative``: the pools are
        then in the DSpark layout (rings of ``window + block_size`` rows, the draft's rings
        in STATE)."""
        self._taps: dict[int, int] = {}
        if speculative:
            from v41plan.runtime.dspark_paged import PagedDraft

            self.draft = PagedDraft(self, weights)
            taps = self.draft.draft.taps
            self._taps = {L: j for j, L in enumerate(taps)}
            t_max = self._arange.shape[0]
            self._tap_rows = torch.zeros(t_max, len(taps), cfg.hidden_size, dtype=dtype,
                                         device=self.device)  # fmt: skip
            self._tapped = torch.zeros(t_max, dtype=torch.bool, device=self.device)
            self._tail_stage: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            B = self.draft.block_size
            self._spec_ws: dict[int, SpecInputs] = {}
            self._spec_offsets = torch.arange(B + 1, device=self.device)
            self.draft_probs = None
            """``[slots + 1, block_size, V]`` per slot, the distributions its pending block was
            sampled from (allocated at the first sampled proposal)."""

    row_count_fold_steps = 4096
    """Per-step row-count entries kept before they are folded into ``row_counts`` (a server
    that never reads them stays bounded)."""

    def label_backend_ops(self) -> None:
        """Run every kernel-backend op and the grouped expert product inside a
        ``record_function`` range ``backend.<op>`` from now on (``RangedBackend``), so a
        ``torch.profiler`` trace of a step tells their kernels from the dense pieces' (what
        ``benchmarks/bench_decode_paths.py`` counts). Also on at construction under
        ``V41PLAN_PROFILE_RANGES=1``. Graph replays are unaffected; eager steps pay a
        dispatcher call per range."""
        if not isinstance(self.backend, RangedBackend):
            self.backend = RangedBackend(self.backend)
        self.pieces.ranged = True

    @property
    def row_counts(self) -> Counter:
        """Rows each ``(layer, sub_step)`` ran, summed over prepared steps (the replay row-count
        check; folded from a per-step log when read, so a step pays nothing per layer)."""
        for key_index, lens in self._row_count_log:
            for key, i in key_index.items():
                self._row_counts[key] += lens[i]
        self._row_count_log.clear()
        return self._row_counts

    @property
    def experts(self) -> dict[int, torch.Tensor]:
        """Routed expert ids ``[running_tokens, num_experts_per_tok]`` per layer in the last
        forward (-1 on rows that did not run the layer's FFN); built when read, so a forward
        (or a captured graph) launches nothing for it."""
        out = {}
        for L, (rows, ids) in self._routed.items():
            if rows is None:
                out[L] = ids
                continue
            ex = torch.full((self._width, ids.shape[1]), -1, dtype=torch.long, device=ids.device)
            ex[rows] = ids
            out[L] = ex
        return out

    @classmethod
    def from_checkpoint(
        cls,
        path,
        cache_spec: CacheSpec,
        *,
        kv_cache_dtype: str = "bf16",
        index_cache_dtype: str = "fp8",
        dtype: torch.dtype = torch.float32,
        **kw,
    ) -> RuntimeModel:
        """Load a checkpoint directory; the format pair is refused before any weight is read."""
        check_formats(kv_cache_dtype, index_cache_dtype)
        from v41plan.model.checkpoint import load_checkpoint

        ckpt = load_checkpoint(path, cache_spec, dtype=dtype, device=kw.get("device", "cpu"))
        return cls(
            cache_spec,
            ckpt.weights,
            ckpt.engram_host(),
            kv_cache_dtype=kv_cache_dtype,
            index_cache_dtype=index_cache_dtype,
            dtype=dtype,
            cfg=ckpt.config,
            **kw,
        )

    # -- slot state (host bookkeeping beside the device bytes) -------------------------------
    def reset_slot(self, slot: int) -> None:
        """Zero a fresh request's STATE entry and mark its Engram history DEAD."""
        self.pools.reset_slot(slot)

    def copy_image(self, slot: int, units: tuple[int, ...], *, store: bool) -> None:
        """Store slot ``slot``'s checkpoint image into PAGE units ``units`` (``store``) or restore
        it from them, through the generated span table (checked against the pool's layout id and
        byte totals) and the backend's span copy."""
        from v41plan.planner.checkpoint import CopyPlanner, ImageOp, load_image_layout

        pools = self.pools
        planner = getattr(self, "_copy_planner", None)
        if planner is None:
            g = pools.geometry
            layout = load_image_layout(g, self.spec.name)
            planner = self._copy_planner = CopyPlanner(g, pools.num_pages, pools.num_slots, layout)
        g = planner.geometry
        op = ImageOp(slot, tuple(units), g.layout_id, g.image_bytes)
        spans = planner.store(op) if store else planner.restore(op)
        pools.copy_spans(planner.regions, spans, self.backend)

    # -- host: prepare ------------------------------------------------------------------------
    def _engram_table_shapes(self) -> tuple[tuple[int, int], ...]:
        """``(cols, width)`` of each Engram layer's table rows (empty without tables)."""
        if not self.cfg.engram_layer_ids or not getattr(self.engram, "tables", None):
            return ()
        cols = int(self.engram.layout.primes.shape[1])
        return tuple((cols, int(tab.width)) for tab in self.engram.tables)

    def _decode_capacity(self) -> int:
        """Bytes of the widest decode step's layout (its workspace never grows)."""
        t, b = self.max_tokens, self.max_bs
        return self._build_layout(t, b, (), (), (1, 2), False, True).nbytes

    def _layout(self, t, b, row_sets, stage_sets, ratios, undefined, sampling=False) -> Layout:
        key = (t, b, tuple(sorted(row_sets.items())), tuple(stage_sets), tuple(sorted(ratios)),
               undefined, sampling)  # fmt: skip
        got = self._layouts.get(key)
        if got is None:
            if len(self._layouts) > 256:
                self._layouts.clear()
            got = self._layouts[key] = self._build_layout(*key)
        return got

    def _build_layout(self, t, b, row_sets, stage_sets, ratios, undefined, sampling) -> Layout:
        h = self.cfg.engram_max_ngram_size - 1
        i64, u8, bl = torch.int64, torch.uint8, torch.bool
        items = [
            ("token_ids", i64, (t,)),
            ("positions", i64, (t,)),
            ("batch_ids", i64, (t,)),
            ("slots", i64, (b,)),
            ("block_tables", i64, (b, self.table_width)),
            ("per_request", i64, (len(_PER_REQUEST), b)),
            ("cursors", i64, (b, 1 + h)),
            ("last_undefined", bl, (b,)),
        ]
        items += [(f"rows{i}", i64, (n,)) for i, n in row_sets]
        items += [(f"stage{i}", i64, (n,)) for i, n in enumerate(stage_sets)]
        for r in sorted(ratios):
            items += [(f"c{r}_idx", i64, (3, t)), (f"c{r}_flags", bl, (2, t))]
        if self.engram_device is not None:
            items += [("eg_row0", i64, (b,)), ("eg_history", i64, (b, h))]
        else:
            for li, (cols, width) in enumerate(self._engram_shapes):
                items += [(f"eg{li}_codes", u8, (t, cols, width))]
                items += [(f"eg{li}_scales", u8, (t, cols, width // 32))]
        if undefined:
            items.append(("undefined", bl, (t,)))
        if sampling:
            items += [("s_f32", torch.float32, (3, b)), ("s_i64", i64, (3, b))]
        return build_layout(items)

    def prepare(
        self,
        plan,
        token_ids,
        *,
        all_row_logits: bool = False,
        sampling: StepSampling | None = None,
        spec: StepSpec | None = None,
    ) -> StepInputs:
        """Host work of one planned forward over ``token_ids`` (``[scheduled_tokens]`` or the
        width): every input ``run()`` reads, staged and moved to the device in one copy. Also
        commits the step's cursor values to the host mirror. With ``sampling`` the forward
        also samples each request's last row on the device (``StepOutput.sampled``); a
        speculating model needs ``spec`` and ``sampling`` (``StepOutput.spec``), and the host
        mirror of a verifying request's cursor is the whole block's (its ``a = block_size``
        candidate) until ``commit_accepted``."""
        if (spec is None) != (self.draft is None):
            raise ValueError(
                "a speculating model's step needs its StepSpec, and only such a model takes one"
            )
        if spec is not None and sampling is None:
            raise ValueError("a speculating step samples: give it a StepSampling")
        ids_np = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        t, b = plan.running_tokens, plan.running_bs
        if ids_np.shape[0] > t:
            raise ValueError(f"forward given {ids_np.shape[0]} rows but its step declares {t}")
        if ids_np.shape[0] < plan.scheduled_tokens:
            raise ValueError(
                f"forward given {ids_np.shape[0]} rows but its step schedules "
                f"{plan.scheduled_tokens}"
            )
        if t > self.max_tokens or b > self.max_bs:
            raise ValueError(
                f"step width ({b} requests, {t} rows) exceeds the model's "
                f"({self.max_bs}, {self.max_tokens})"
            )
        w = plan.block_tables.shape[1]
        if w > self.table_width and (plan.block_tables[:, self.table_width :] >= 0).any():
            raise ValueError(f"block table width {w} exceeds the model's {self.table_width}")
        decode = plan.graph_key[0] == "decode"
        n_sched = plan.scheduled_tokens

        # Row sets: layers share a handful of arrays (the planner's distinct ones); a set of
        # every scheduled row runs every row of the width (padding rows carry sentinels and
        # write only the sinks).
        key_index, distinct = plan.layer_rows.distinct
        lens = tuple(len(a) for a in distinct)
        self._row_count_log.append((key_index, lens))
        if len(self._row_count_log) >= self.row_count_fold_steps:
            _ = self.row_counts
        arrays: list[np.ndarray] = []
        slot_of: list[int | None] = []  # distinct array -> staged row set (None: every row)
        for a, n in zip(distinct, lens, strict=True):
            if n == n_sched:
                slot_of.append(None)
            else:
                slot_of.append(len(arrays))
                arrays.append(a)
        stage_rows: list[np.ndarray | None] = []
        for st in plan.stages:  # a stage's rows: the union of its sub-steps' (the planner's)
            sets = [a for a in st.rows.values() if len(a)]
            if any(len(a) == n_sched for a in sets):
                stage_rows.append(None)
            else:
                stage_rows.append(
                    np.unique(np.concatenate(sets)) if sets else np.zeros(0, dtype=np.int64)
                )
        for L in self.spec.dims.kv_source_layer_ids:  # groups each owner closes
            i = key_index.get((L, "compress"))
            if i is not None and lens[i]:
                r = self.cfg.layers[L].ratio
                self._row_counts[(L, "compress_groups")] += len(plan.compress[r].rows)
        staged_stages = [s for s in stage_rows if s is not None]
        ratios = {r: True for r in plan.compress}
        undefined = bool(all_row_logits and plan.decoder_replay)
        layout = self._layout(
            t,
            b,
            {i: len(a) for i, a in enumerate(arrays)},
            [len(s) for s in staged_stages],
            ratios,
            undefined,
            sampling is not None,
        )
        ws = self.workspace["decode" if decode else "step"]
        hv = ws.host_views(layout)

        # Per token, per request.
        hv["token_ids"][: ids_np.shape[0]] = ids_np
        hv["positions"][:] = plan.positions
        hv["batch_ids"][:] = plan.batch_ids
        hv["slots"][:] = plan.slots
        bt = hv["block_tables"]
        bt[:] = -1
        k = min(w, self.table_width)
        bt[:, :k] = plan.block_tables[:, :k]
        pr = hv["per_request"]
        for j, name in enumerate(_PER_REQUEST):
            pr[j] = getattr(plan, name)
        for i, arr in enumerate(arrays):
            hv[f"rows{i}"][:] = arr
        for i, s in enumerate(staged_stages):
            hv[f"stage{i}"][:] = s
        for r, cpl in plan.compress.items():
            n = len(cpl.rows)
            idx = hv[f"c{r}_idx"]
            idx[0, :n] = cpl.rows
            idx[1, :] = -1
            idx[1, :n] = cpl.batch_ids
            idx[2, :n] = cpl.compressed_rows
            flags = hv[f"c{r}_flags"]
            fft = cpl.first_from_tail
            flags[0, cpl.rows if fft.all() else cpl.rows[fft]] = True
            flags[1, cpl.tail_store_rows] = True
        # under decoder replay a forward that does not finish its prompt runs no decoder row
        if plan.decoder_replay:  # else every entry stays False (the views come zeroed)
            hv["last_undefined"][:] = plan.row_phase == 0
        if undefined:
            bids = plan.batch_ids
            full = (plan.row_phase == 2)[np.maximum(bids, 0)] & (bids >= 0)
            hv["undefined"][:] = ~full
        self._prepare_engram(plan, hv, ids_np)
        if sampling is not None:
            n = len(sampling.temperature)
            f, i = hv["s_f32"], hv["s_i64"]
            f[1] = 1.0  # padding rows: greedy, nothing truncated
            f[0, :n], f[1, :n], f[2, :n] = sampling.temperature, sampling.top_p, sampling.min_p
            i[0, :n], i[1, :n], i[2, :n] = sampling.top_k, sampling.seed, sampling.output_index

        dv = ws.commit(layout)
        sub = self._sub_views(layout, dv)
        staged = [None if i is None else dv[f"rows{i}"] for i in slot_of]
        rows = RowSets(key_index, staged, lens)
        stages, si = [], 0
        for st, s in zip(plan.stages, stage_rows, strict=True):
            if s is None:
                stages.append(StageInputs(st.name, st.first_layer, st.last_layer, ALL))
            else:
                stages.append(StageInputs(st.name, st.first_layer, st.last_layer, dv[f"stage{si}"]))
                si += 1
        compress = {r: sub["compress"][r] for r in plan.compress}
        index_pages = None
        if not decode and plan.scheduled_tokens:  # eager steps read only their context's pages
            top = int(plan.positions[: plan.scheduled_tokens].max())
            index_pages = {
                r: index_pages_needed(
                    top, r, self.pools.geometry.page_tokens // r, self.cfg.candidate_block_size,
                    self.table_width,
                )
                for r in {info.ratio for info in self.cfg.layers if info.ratio > 0}
            }  # fmt: skip
        on_dev = self.engram_device is not None
        sampler = sub["sampler"] if sampling is not None else None
        return StepInputs(
            t=t,
            b=b,
            decode=decode,
            layout=layout,
            token_ids=dv["token_ids"],
            positions=dv["positions"],
            batch_ids=dv["batch_ids"],
            slots=dv["slots"],
            block_tables=dv["block_tables"],
            per_request=sub["per_request"],
            cursors=dv["cursors"],
            last_undefined=dv["last_undefined"],
            rows=rows,
            stages=tuple(stages),
            compress=compress,
            engram_codes=sub["engram_codes"],
            engram_scales=sub["engram_scales"],
            engram_row0=dv["eg_row0"] if on_dev else None,
            engram_history=dv["eg_history"] if on_dev else None,
            all_row_logits=all_row_logits,
            undefined_rows=dv["undefined"] if undefined else None,
            sampler=sampler,
            sampling_shape=None if sampling is None else sampling.shape_key,
            index_pages=index_pages,
            spec=None if spec is None else self._stage_spec(plan, spec),
        )

    def _stage_spec(self, plan, spec: StepSpec) -> SpecInputs:
        """``spec`` into this width's device buffers (fixed addresses: a graph of the width
        reads them)."""
        b, n, B = plan.running_bs, plan.scheduled_bs, self.draft.block_size
        if spec.drafts.shape != (n, B) or spec.cursors.shape[:2] != (n, B + 1):
            raise ValueError(
                f"StepSpec for {spec.drafts.shape[0]} requests of {spec.drafts.shape[1:]} drafts; "
                f"the step has {n} requests and the draft {B}"
            )
        lens = np.diff(plan.cu_seqlens_q[: n + 1])
        if (lens[spec.verify] != B + 1).any():
            raise ValueError(f"a verifying request runs its anchor and {B} drafts: {B + 1} rows")
        rows = np.zeros((b, B + 1), dtype=np.int64)
        rows[:n][spec.verify] = plan.cu_seqlens_q[:n][spec.verify, None] + np.arange(B + 1)
        h = spec.cursors.shape[2]
        host = {
            "verify": np.zeros(b, dtype=bool),
            "verify_rows": rows,
            "drafts": np.zeros((b, B), dtype=np.int64),
            "cursors": np.zeros((b, B + 1, h), dtype=np.int64),
            "proposes": np.zeros(b, dtype=bool),
        }
        host["verify"][:n] = spec.verify
        host["drafts"][:n] = spec.drafts
        host["cursors"][:n] = spec.cursors
        host["proposes"][:n] = spec.proposes
        ws = self._spec_ws.get(b)
        if ws is None:
            ws = self._spec_ws[b] = SpecInputs(
                **{k: torch.from_numpy(v).to(self.device) for k, v in host.items()}
            )
        else:
            for k, v in host.items():
                getattr(ws, k).copy_(torch.from_numpy(v), non_blocking=True)
        return ws

    def commit_accepted(self, slots: np.ndarray, cursors: np.ndarray) -> None:
        """The host mirror of verifying requests' cursors, once their accepted lengths are read
        (the device committed the same in ``run``)."""
        self.pools.cursor_host[np.asarray(slots, dtype=np.int64)] = cursors

    def _sub_views(self, layout: Layout, dv: dict[str, torch.Tensor]) -> dict:
        """Views into ``dv`` that ``StepInputs`` hands out (per-request rows, compress groups,
        sampler fields, Engram rows), made once per layout: creating tensor views costs a few
        microseconds each, and ``dv`` itself is cached per layout (equal addresses)."""
        got = self._sub_view_cache.get(layout.key)
        if got is not None and got[0] is dv:
            return got[1]
        sub: dict = {"compress": {}, "sampler": None}
        pr = dv["per_request"]
        sub["per_request"] = {name: pr[j] for j, name in enumerate(_PER_REQUEST)}
        for name, idx in dv.items():
            if name.endswith("_idx") and name.startswith("c"):
                r = int(name[1:-4])
                flags = dv[f"c{r}_flags"]
                sub["compress"][r] = CompressInputs(idx[0], idx[1], idx[2], flags[0], flags[1])
        if "s_f32" in dv:
            f, i = dv["s_f32"], dv["s_i64"]
            sub["sampler"] = SamplerInputs(f[0], i[0], f[1], f[2], i[1], i[2])
        n_e = len(self._engram_shapes)
        sub["engram_codes"] = tuple(
            dv[f"eg{li}_codes"] for li in range(n_e) if f"eg{li}_codes" in dv
        )
        sub["engram_scales"] = tuple(
            dv[f"eg{li}_scales"] for li in range(n_e) if f"eg{li}_scales" in dv
        )
        if len(self._sub_view_cache) > 256:
            self._sub_view_cache.clear()
        self._sub_view_cache[layout.key] = (dv, sub)
        return sub

    def _prepare_engram(self, plan, hv: dict, ids: np.ndarray) -> None:
        """Engram row ids from the final token ids and each request's history (the host mirror of
        its cursor, or the plan's history on a back-off or a fresh slot), the table rows of every
        row gathered into the staging views, and the cursor values to commit."""
        t = plan.running_tokens
        ids_full = np.zeros(t, dtype=np.int64)
        ids_full[: ids.shape[0]] = ids
        cursors = hv["cursors"]
        mirror = self.pools.cursor_host
        n = plan.scheduled_bs
        if n == 0:
            return
        cu = plan.cu_seqlens_q[: n + 1].astype(np.int64)
        slots = plan.slots[:n].astype(np.int64)
        hist = mirror[slots, 1:]  # a gather: already a copy
        own = plan.history_from_plan[:n]
        if own.any():  # plan: oldest first; cursor: newest first
            hist[own] = plan.history_ids[:n][own][:, ::-1]
        if self.engram_device is not None:  # run() hashes and gathers; the cursor only here
            new_hist = self.engram.advance_batch(ids_full[: cu[n]], cu, hist)
            hv["eg_row0"][:n] = cu[:n]
            hv["eg_history"][:n] = hist
        else:
            rows_real, new_hist = self.engram.prepare_batch(ids_full[: cu[n]], cu, hist)
        cursors[:n, 0] = plan.forward_end[:n]
        cursors[:n, 1:] = new_hist
        mirror[slots] = cursors[:n]  # what run() commits to the device
        if self.engram_device is not None:
            return
        rows = np.zeros((t,) + rows_real.shape[1:], dtype=np.int64)
        rows[: cu[n]] = rows_real
        if not self._engram_shapes:
            return
        for li in range(len(self._engram_shapes)):
            codes, scales = self.engram.gather(li, rows[:, li])
            hv[f"eg{li}_codes"][:] = codes.view(torch.uint8).numpy()
            hv[f"eg{li}_scales"][:] = scales.view(torch.uint8).numpy()

    # -- device: run --------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, si: StepInputs) -> StepOutput:
        """The forward on prepared inputs: pure tensor work (what FULL graphs capture)."""
        X, pre = self.embed_rows(si)
        self._routed, self._width = {}, si.t
        cand: torch.Tensor | None = None
        sel: dict[int, torch.Tensor] = {}
        if self.draft is not None:
            self._tapped[: si.t] = False
            self._tail_stage = {}
        for st in si.stages:
            if st.rows is not None and st.rows.shape[0] == 0:
                continue  # a stage the plan runs on no row (the decoder of a non-final chunk)
            fr = self.frame(si, st, X, pre)
            for L in range(st.first_layer, st.last_layer + 1):
                if L in self._taps:
                    self._record_tap(L, si, fr)
                p = self.layer_pre(L, si, fr)
                if p is None:
                    continue
                cand = self.layer_attention(L, si, fr, p, cand, sel)
                self.layer_post(L, si, fr, p)
            if fr.full:
                X, pre = fr.X, fr.pre
            else:
                X[st.rows] = fr.X
                pre[st.rows] = fr.pre
        self.selections = sel
        if self.draft is not None:
            self._observe(si)
        out = self.head_rows(si, X, pre)
        if si.spec is not None:
            out.spec = self._speculate(si, X, pre, out)
        return out

    # -- DSpark ---------------------------------------------------------------------------
    def _record_tap(self, L: int, si: StepInputs, fr: Frame) -> None:
        """Keep the stream mean entering tap layer ``L`` of the frame's rows, by flat row."""
        j = self._taps[L]
        mean = fr.X.mean(dim=1)
        if fr.full:
            self._tap_rows[: si.t, j] = mean
            if j == 0:
                self._tapped[: si.t] = True
        else:
            self._tap_rows[fr.rows, j] = mean
            if j == 0:
                self._tapped[fr.rows] = True

    def _observe(self, si: StepInputs) -> None:
        """The draft's rings take the rows this forward ran its tap layers on (each request's
        last ``ring_rows`` of them)."""
        t = si.t
        bid = si.batch_ids
        b = bid.clamp(min=0)
        ok = self._tapped[:t] & (bid >= 0)
        slot = torch.where(ok, si.slots[b], -1)
        write_from = si.per_request["forward_end"][b] - self.geometry.ring_rows
        self.draft.observe(self._tap_rows[:t].flatten(1), slot, si.positions, write_from)

    def _speculate(self, si: StepInputs, X, pre, out: StepOutput) -> SpecOutput:
        """Verify the drafts (strict acceptance: greedy rows the longest prefix equal to the
        target's argmax, sampled rows the rejection rule), commit each verifying request's
        cursor and FP32 tails at its accepted length, then draft the next block of every
        request that sampled."""
        from v41plan.runtime.sampler import (
            SamplerInputs,
            _keep_threshold,
            processed_logits,
            scaled_logits,
        )
        from v41plan.runtime.speculative import accept_greedy, accept_sampled

        sp, sm, draft = si.spec, si.sampler, self.draft
        B = draft.block_size
        b = si.b
        eps = self.cfg.rms_norm_eps
        rows = sp.verify_rows.reshape(-1)
        lg = self.pieces.head(X[rows], pre[rows], self.norm, self.head, eps)  # [b * (B+1), V]
        V = lg.shape[1]
        per_row = (sm.temperature, sm.top_k, sm.top_p, sm.min_p, sm.seed)
        rep = SamplerInputs(
            *(x.repeat_interleave(B + 1) for x in per_row),
            output_index=(sm.output_index[:, None] + self._spec_offsets[None, :]).reshape(-1),
        )
        x = processed_logits(lg, rep)
        target = torch.argmax(x, dim=1).reshape(b, B + 1)
        accepted, nxt = accept_greedy(sp.drafts, target)
        shape_sampled, truncate, _ = si.sampling_shape
        if shape_sampled and self.draft_probs is not None:
            z, hot = scaled_logits(x, rep)
            if truncate:
                z = torch.where(z >= _keep_threshold(z, rep), z, float("-inf"))
            p = torch.softmax(z, dim=1).reshape(b, B + 1, V)
            q = self.draft_probs[torch.where(si.slots >= 0, si.slots, self.pools.sink_slot)]
            a_s, n_s = accept_sampled(sp.drafts, q.to(p.dtype), p, sm.seed, sm.output_index)
            hot_req = hot.reshape(b, B + 1)[:, 0]
            accepted = torch.where(hot_req, a_s, accepted)
            nxt = torch.where(hot_req, n_s, nxt)
        accepted = torch.where(sp.verify, accepted, 0)
        nxt = torch.where(sp.verify, nxt, out.sampled.token_ids)
        col = self._spec_offsets[None, :]
        drafts_ext = torch.cat([sp.drafts, sp.drafts[:, :1]], dim=1)
        tokens = torch.where(col < accepted[:, None], drafts_ext, -1)
        tokens = torch.where(col == accepted[:, None], nxt[:, None], tokens)
        lp = torch.log_softmax(lg.to(torch.float32), dim=1).reshape(b, B + 1, V)
        lp_tok = lp.gather(2, tokens.clamp(min=0)[..., None]).squeeze(-1)
        lp_tok = torch.where(sp.verify[:, None], lp_tok, out.sampled.logprobs[:, None])
        lp_tok = torch.where(tokens >= 0, lp_tok, 0.0)
        self._commit_accepted(si, accepted)
        # the next block, from the token just emitted, at its position
        fe = si.per_request["forward_end"]
        anchor_pos = torch.where(sp.verify, fe - B + accepted, fe)
        slot = torch.where(sp.proposes, si.slots, -1)
        block = draft.propose(
            nxt, anchor_pos, slot, sm.temperature, sm.seed, sm.output_index + accepted + 1,
            sampled=shape_sampled,
        )  # fmt: skip
        if block.probs is not None:
            if self.draft_probs is None:
                self.draft_probs = torch.zeros(
                    self.pools.num_slots + 1, B, V, dtype=torch.float32, device=self.device
                )
            s = torch.where(sp.proposes & (si.slots >= 0), si.slots, self.pools.sink_slot)
            self.draft_probs[s] = block.probs.to(torch.float32)
        return SpecOutput(accepted, tokens, lp_tok, block.tokens, block.confidence)

    def _commit_accepted(self, si: StepInputs, accepted: torch.Tensor) -> None:
        """A verifying request's cursor and ratio-2 tails as they stand after its accepted
        rows: the cursor candidate of its accepted length, and (when the last accepted
        position opens a group) that row's projection in the tail. Rows written for rejected
        positions stay: no window, selection or group reads them before they are rewritten."""
        sp, pools = si.spec, self.pools
        b = si.b
        ar = self._arange[:b]
        ok = sp.verify & (si.slots >= 0)
        slot = torch.where(ok, si.slots, pools.sink_slot)
        self.backend.cursor_write(pools.cursor, torch.where(ok, si.slots, -1),
                                  sp.cursors[ar, accepted], pools.sink_slot)  # fmt: skip
        row = sp.verify_rows[ar, accepted]
        last = si.per_request["forward_end"] - self.draft.block_size - 1 + accepted
        opens = (ok & (last % 2 == 0))[:, None]
        for L, (v, g) in self._tail_stage.items():
            ti = pools.tail_index[L]
            # a verifying row rewrites its own tail (kept where no group opens): no sink write
            for tails, new in ((pools.tail_values, v), (pools.tail_scores, g)):
                tails[slot, ti] = torch.where(opens, new[row].to(tails.dtype), tails[slot, ti])

    def forward(
        self, plan, token_ids, *, all_row_logits: bool = False, sampling=None
    ) -> StepOutput:
        """``run(prepare(plan, token_ids))``: one planned forward, eagerly."""
        inputs = self.prepare(plan, token_ids, all_row_logits=all_row_logits, sampling=sampling)
        return self.run(inputs)

    def embed_rows(self, si: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial residual streams ``[t, hc, D]`` and mHC ``pre`` ``[t, hc]``."""
        cfg = self.cfg
        self._step_memo = {}
        X, pre = self.pieces.embed(
            self.embed, si.token_ids, cfg.hc_mult, cfg.hidden_size, self.dtype
        )
        if self.engram_device is not None and si.engram_row0 is not None:
            # kept for the layers (a PIECEWISE replay of this piece writes the same tensor)
            self._engram_ids = self.pieces.engram_rows(
                self.engram_device, si.token_ids, si.batch_ids, si.engram_row0, si.engram_history
            )
        return X, pre

    def frame(self, si: StepInputs, st: StageInputs, X, pre) -> Frame:
        """The stage's rows gathered once (``ALL``: the step's tensors themselves; every full
        frame of a step shares its row tables and its memo, ``_step_memo``)."""
        pos, bid = si.positions, si.batch_ids
        memo = self._step_memo
        b, slot, pages = memo.get("rows") or memo.setdefault(
            "rows", self._row_tables(bid, si.slots, si.block_tables)
        )
        d = self.cfg.head_dim
        if st.rows is None:
            kv = torch.zeros(si.t, d, dtype=self.dtype, device=self.device)
            return Frame(True, None, None, X, pre, pos, bid, b, slot, pages, kv, memo)
        S = st.rows
        loc = torch.full((si.t,), -1, dtype=torch.long, device=self.device)
        loc[S] = self._arange[: S.shape[0]]
        fb = bid[S]
        kv = torch.zeros(S.shape[0], d, dtype=self.dtype, device=self.device)
        return Frame(
            False, S, loc, X[S], pre[S], pos[S], fb, fb.clamp(min=0), slot[S], pages[S], kv
        )

    @staticmethod
    def _row_tables(bid, slots, block_tables) -> tuple:
        """Per flat row: (batch id clamped to a real request, slot, block-table row), -1 on a
        padding row."""
        b = bid.clamp(min=0)
        slot = torch.where(bid >= 0, slots[b], -1)
        pages = torch.where((bid >= 0).unsqueeze(1), block_tables[b], -1)
        return b, slot, pages

    def _row_set(self, si: StepInputs, fr: Frame, L: int, sub: str):
        """Frame rows of a sub-step: ``ALL``, an index tensor, or an empty index tensor."""
        rows = si.rows.get((L, sub))
        if rows is NO_ROWS:
            return self._no_rows
        return fr.local(rows)

    def layer_pre(self, L: int, si: StepInputs, fr: Frame) -> Pieces | None:
        """Dense piece before attention: Engram injection, attention-site mHC, norm, RoPE, the
        window-KV rows, the query (and index query), the compressor projections."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        info = cfg.layers[L]
        n = fr.X.shape[0]
        at = self._row_set(si, fr, L, "attention")
        rw = self._row_set(si, fr, L, "ring_write")
        cp = self._row_set(si, fr, L, "compress") if info.role == "full" else self._no_rows
        ff = self._row_set(si, fr, L, "ffn")
        n_rw, n_cp = _count(rw, n), _count(cp, n)
        need = cp if n_cp >= n_rw else rw
        n_need = _count(need, n)
        if n_need == 0:
            return None
        if need is None:  # local rows of each set within ``need``: the identity
            l_rw, l_cp, l_at, l_ff = rw, cp, at, ff
        else:
            l_rw, l_cp, l_at, l_ff = fr.once(
                ("within", *(None if x is None else id(x) for x in (need, rw, cp, at, ff))),
                lambda: self._within(n, need, n_need, (rw, cp, at, ff)),
            )
        if info.engram and (si.engram_codes or si.engram_row0 is not None):
            li = cfg.engram_layer_ids.index(L)
            flat = need if fr.full else _take(fr.rows, need)
            if si.engram_row0 is not None:
                codes, scales = self.engram_device.gather(li, _take(self._engram_ids[:, li], flat))
            else:
                codes, scales = _take(si.engram_codes[li], flat), _take(si.engram_scales[li], flat)
            new = self.pieces.engram(
                self.engram_layers[L], _take(fr.X, need), codes, scales, self.dtype
            )
            if need is None:
                fr.X = new
            else:
                fr.X[need] = new
        att = self.attn[L]
        Xn = _take(fr.X, need)
        # every row both writes the ring and attends (decode, a whole chunk): one wq_a/wkv
        # product where the kernels joined them
        joint = att.wqkv_a is not None and l_rw is None and l_at is None
        site = (
            Xn, _take(fr.pre, need), self.hc_attn[L], self.attn_norm[L],
            cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps,
        )  # fmt: skip
        codes = None
        if joint and self._site_codes(att.wqkv_a, Xn.shape[0], Xn.shape[-1]):
            a_pre, a_post, a_C, xin, *codes = self.dense.mhc_site_fp8(*site, e8m0=True)
        else:
            a_pre, a_post, a_C, xin = self.dense.mhc_site(*site)
        cos, sin = fr.once(
            ("rope", info.ratio > 0, None if need is None else id(need)),
            lambda: self.pieces.cos_sin(att.rope, _take(fr.pos, need), self.dtype),
        )  # every layer of a RoPE kind has the same table
        index = info.ratio > 0 and info.role in ("full", "reindex")
        p = Pieces(need, at, rw, cp, ff, a_pre, a_post, a_C, xin, cos, sin)
        p.extra = {"l_at": l_at, "l_cp": l_cp, "l_ff": l_ff}
        if joint:
            kv, p.q, p.qi, p.wts = self.pieces.attn_inputs(
                att, xin, cos, sin, index, *(codes or (None, None))
            )
        else:
            kv = self.pieces.window_kv(att, _take(xin, l_rw), _take(cos, l_rw), _take(sin, l_rw))
        if rw is None:
            fr.kv = kv
        else:
            fr.kv[rw] = kv
        if _count(at, n):
            if not joint:
                x = _take(xin, l_at)
                c, s = _take(cos, l_at), _take(sin, l_at)
                p.q, p.qi, p.wts = self.pieces.query(att, x, c, s, index)
            p.o = torch.empty_like(p.q)
        if info.role == "full" and _count(cp, n):
            p.v, p.g = self.pieces.compress_project(att, _take(xin, l_cp))
        return p

    def layer_attention(self, L, si: StepInputs, fr: Frame, p: Pieces, cand, sel) -> torch.Tensor:
        """Pool work of one layer: ring writes, the compressor's groups and stores, the index
        selection, sparse attention into ``p.o``. Returns the candidate mask (flat rows)."""
        cfg, pools, kb = self.cfg, self.pools, self.backend
        info = cfg.layers[L]
        n = fr.X.shape[0]
        ring = pools.ring(L)
        rw = p.rw
        ring_from = fr.once(
            ("ring_from", info.segment == "decoder"),
            lambda: self._ring_write_from(info, si, fr.b, fr.bid),
        )
        if si.decode:  # decode: write the ring row first, then read the window from the ring
            kb.ring_write(
                ring,
                _take(fr.kv, rw),
                _take(fr.slot, rw),
                _take(fr.pos, rw),
                _take(ring_from, rw),
                pools.sink_slot,
            )
        if info.role == "full" and _count(p.cp, n):
            self._compress(L, si, fr, p)
        if p.o is not None:
            cand = self._attention(L, si, fr, p, cand, sel)
        if not si.decode:  # prefill: the old ring rows stay until every query has read them
            kb.ring_write(
                ring,
                _take(fr.kv, rw),
                _take(fr.slot, rw),
                _take(fr.pos, rw),
                _take(ring_from, rw),
                pools.sink_slot,
            )
        return cand

    def _site_codes(self, consumer, rows: int, width: int) -> bool:
        """Whether a site over ``rows`` tokens of ``width`` lanes feeding ``consumer`` quantizes
        its output in its epilogue (``SITE_CODES``: the Triton dense kernels, a consumer that
        reads FP8 codes, one token a finishing program)."""
        if not (SITE_CODES and self.dense.name == "triton"):
            return False
        reads = getattr(consumer, "reads_codes", False)
        return reads and self.dense.codes_in_parallel(rows, width)

    def layer_post(self, L: int, si: StepInputs, fr: Frame, p: Pieces) -> None:
        """Dense piece after attention: output projection, mHC expand, the FFN site (mHC, norm,
        MoE, expand); updates the frame's streams and ``pre``."""
        if p.o is None:
            return
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        at, ff = p.at, p.ff
        l_at, l_ff = p.extra["l_at"], p.extra["l_ff"]
        att = self.attn[L]
        y = att.tp.all_reduce(self.pieces.output(att, p.o, _take(p.cos, l_at), _take(p.sin, l_at)))
        site = (self.hc_ffn[L], self.ffn_norm[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps)
        moe = self.moe[L]
        quantize = self._site_codes(moe, _count(ff, fr.X.shape[0]), fr.X.shape[-1])
        codes = None
        if at is None and ff is None and p.need is None:
            # every row runs both sublayers (decode, replay off): the expand and the FFN site in
            # one call
            expand = (y, fr.X, p.a_post, p.a_C, p.a_pre, *site, eps)
            if quantize:
                Xf, f_pre, f_post, f_C, xf, *codes = self.dense.mhc_expand_site_fp8(
                    *expand, e8m0=True
                )
            else:
                Xf, f_pre, f_post, f_C, xf = self.dense.mhc_expand_site(*expand)
            fr.X = Xf
        else:
            new = self.dense.hc_expand(
                y, _take(fr.X, at), _take(p.a_post, l_at), _take(p.a_C, l_at)
            )
            if at is None:
                fr.X = new
            else:
                fr.X[at] = new
            if _count(ff, fr.X.shape[0]) == 0:
                return
            Xf = _take(fr.X, ff)
            ffn_site = (Xf, _take(p.a_pre, l_ff), *site, eps)
            if quantize:
                f_pre, f_post, f_C, xf, *codes = self.dense.mhc_site_fp8(*ffn_site, e8m0=True)
            else:
                f_pre, f_post, f_C, xf = self.dense.mhc_site(*ffn_site)
        flat_ff = ff if fr.full else fr.rows[_take(self._arange[: fr.X.shape[0]], ff)]
        forced = self.forced_experts.get(L)
        if forced is not None:
            forced = _take(forced.to(self.device), flat_ff)
        yf, ids = self.pieces.moe(moe, xf, forced, codes)
        self._routed[L] = (flat_ff, ids)
        new = self.dense.hc_expand(yf, Xf, f_post, f_C)
        if ff is None:
            fr.X, fr.pre = new, f_pre
        else:
            fr.X[ff] = new
            fr.pre[ff] = f_pre

    def head_rows(self, si: StepInputs, X, pre) -> StepOutput:
        """Logits at each request's last row (and every row when asked), then the cursor
        commit."""
        eps = self.cfg.rms_norm_eps
        last = si.per_request["last_rows"]
        lr = last.clamp(min=0)
        logits = self.pieces.head(X[lr], pre[lr], self.norm, self.head, eps)
        logits = logits * (last >= 0).unsqueeze(1)
        logits = logits.masked_fill(si.last_undefined.unsqueeze(1), float("nan"))
        row_logits = None
        if si.all_row_logits:
            row_logits = self.pieces.head(X, pre, self.norm, self.head, eps)
            if si.undefined_rows is not None:
                # Under decoder replay only the rows of requests that ran every layer (decode or
                # a full-rows scoring request) are defined; the rest read as NaN.
                row_logits = row_logits.masked_fill(si.undefined_rows.unsqueeze(1), float("nan"))
        # positions and Engram history advance after the forward
        self.backend.cursor_write(self.pools.cursor, si.slots, si.cursors, self.pools.sink_slot)
        sampled = None
        if si.sampler is not None:
            shape_sampled, truncate, top_n = si.sampling_shape
            sampled = sample_tokens(
                logits, si.sampler, top_n=top_n, sampled=shape_sampled, truncate=truncate
            )
        return StepOutput(logits, row_logits, sampled)

    # ------------------------------------------------------------------------------------
    def index_planes(self, owner: int) -> tuple[torch.Tensor, ...]:
        """Owner ``owner``'s index plane(s): the fp8 plane, or the fp4 values and scales."""
        p = self.pools
        return (
            (p.index[owner],)
            if owner in p.index
            else (p.index_values[owner], p.index_scales[owner])
        )

    def _ring_write_from(self, info, si: StepInputs, b: torch.Tensor, bid: torch.Tensor):
        """Per row, the lowest position whose window KV a ring keeps: the request's last ``W``
        rows, at or past ``cached_until`` (the rows a backed-off forward recomputes stay as the
        rings hold them); a decoder layer replayed on a tail writes the whole tail."""
        pr, W = si.per_request, self.cfg.sliding_window
        lo = pr["forward_end"][b] - W
        keep_from = pr["cached_until"][b]
        if info.segment == "decoder":
            keep_from = torch.where(pr["tail_start"][b] >= 0, pr["forward_start"][b], keep_from)
        return torch.where(bid >= 0, torch.maximum(lo, keep_from), torch.iinfo(torch.long).max)

    def _compress(self, L: int, si: StepInputs, fr: Frame, p: Pieces) -> None:
        """Close every group of this owner's ratio in the batch in one call and store it."""
        pools, kb = self.pools, self.backend
        att = self.attn[L]
        n = fr.X.shape[0]
        r = att.ratio
        ci = si.compress[r]
        g_rows = (
            ci.rows if fr.full else fr.once(("g_rows", r), lambda: fr.local(ci.rows).clamp(min=0))
        )
        g_b, g_c = ci.batch_ids, ci.compressed_rows
        if p.cp is None:
            v_full, g_full = p.v, p.g
        else:
            v_full = torch.zeros(n, p.v.shape[1], dtype=p.v.dtype, device=self.device)
            v_full[p.cp] = p.v
            g_full = None
            if r == 2:
                g_full = torch.zeros_like(v_full)
                g_full[p.cp] = p.g
        if r == 2 and self.draft is not None:  # the tails a verifying request may commit
            if fr.full:
                self._tail_stage[L] = (v_full, g_full)
            else:
                tv = torch.zeros(si.t, v_full.shape[1], dtype=v_full.dtype, device=self.device)
                tg = torch.zeros_like(tv)
                tv[fr.rows], tg[fr.rows] = v_full, g_full
                self._tail_stage[L] = (tv, tg)
        if r == 2:
            first = _take(ci.first_from_tail, None if fr.full else fr.rows)
            store = _take(ci.tail_store, None if fr.full else fr.rows)
            ti = pools.tail_index[L]
            pv, ps = kb.compress_groups(
                v_full,
                g_full,
                fr.pos,
                fr.slot,
                first,
                store,
                pools.tail_values[:, ti],
                pools.tail_scores[:, ti],
                pools.sink_slot,
            )
            vals, gates = pv, ps
        else:
            vals, gates = v_full, None
        keys, key_scale, comp = self.pieces.compressed_rows(
            att, vals, gates, g_rows, g_c * r, self.index_fmt
        )
        # the groups' addresses are alike for every owner of a ratio and page geometry
        addr, keep = fr.once(
            ("group_address", r, pools.rows_per_page[L]),
            lambda: (pools.row_address(L, si.block_tables, g_b, g_c), g_b >= 0),
        )
        kb.main_scatter(pools.main[L], comp, addr.page, addr.row, keep, pools.sink_page)
        kb.index_key_store(
            self.index_planes(L), keys, key_scale, addr.page, addr.row, keep, pools.sink_page
        )

    def _within(self, n: int, need: torch.Tensor, n_need: int, sets) -> tuple:
        """Each row set's rows within ``need`` (frame rows -> rows of ``need``)."""
        loc = torch.full((n,), -1, dtype=torch.long, device=self.device)
        loc[need] = self._arange[:n_need]
        return tuple(None if s is None else loc[s] for s in sets)

    def _window_bounds(self, si: StepInputs, fr: Frame, at, decoder: bool) -> tuple:
        """Per query row ``at`` (frame rows): ``(position, batch id, flat row, window_lo,
        ring_until)``: the window ``[max(window_lo, pos - W + 1), pos]``, read from the ring
        below ``ring_until`` and from this forward's rows above."""
        pa, ba, bida = _take(fr.pos, at), _take(fr.b, at), _take(fr.bid, at)
        flat = at if fr.full else _take(fr.rows, at)
        pr = si.per_request
        if si.decode:
            return pa, bida, flat, torch.zeros_like(pa), pa + 1
        fs = pr["forward_start"][ba]
        scu = pr["swa_cached_until"][ba]
        floor = pr["swa_replay_start"][ba] if decoder else pr["encoder_window_floor"][ba]
        above = pa >= scu
        ring_until = torch.where(above, scu, fs)
        window_lo = torch.where(above, floor, torch.maximum(floor, fs))
        if decoder:  # a replayed tail reads only its own rows
            ring_until = torch.where(pr["tail_start"][ba] >= 0, fs, ring_until)
        return pa, bida, flat, window_lo, ring_until

    def _attention(self, L, si: StepInputs, fr: Frame, p: Pieces, cand, sel):
        """Index selection and sparse attention of the query rows ``p.at`` (frame rows) into
        ``p.o``; selections and the candidate mask are kept by flat row."""
        cfg, pools, kb = self.cfg, self.pools, self.backend
        info = cfg.layers[L]
        W = cfg.sliding_window
        t = si.t
        at = p.at
        key = None if at is None else id(at)
        pa, bida, flat, window_lo, ring_until = fr.once(
            ("window", key, info.segment == "decoder"),
            lambda: self._window_bounds(si, fr, at, info.segment == "decoder"),
        )
        plane = ids = pages = None
        rows_per_page = 0
        if info.ratio > 0:
            owner = info.kv_owner
            pages = _take(fr.pages, at)
            if si.index_pages is not None:
                pages = pages[:, : si.index_pages[info.ratio]]
            if info.role in ("full", "reindex"):
                # a padding row sees no compressed row: the scorer selects none for it
                bound = fr.once(
                    ("bound", key, info.ratio),
                    lambda: torch.where(bida >= 0, (pa + 1) // info.ratio, 0),
                )
                planes = self.index_planes(owner)
                if L == cfg.candidate_source_layer_id:
                    ids, cmask = tp_score_candidates_topk(
                        kb,
                        self.tp,
                        planes,
                        p.qi,
                        p.wts,
                        bound,
                        pages,
                        cfg.index_topk,
                        cfg.candidate_block_size,
                        cfg.candidate_topk_blocks,
                    )
                    if flat is None:
                        cand = cmask
                    else:
                        cand = torch.zeros(t, cmask.shape[1], dtype=torch.bool, device=self.device)
                        cand[flat] = cmask
                else:
                    use = (
                        _take(cand, flat)
                        if (info.role == "reindex" and info.uses_candidates)
                        else None
                    )
                    ids = tp_score_topk(
                        kb, self.tp, planes, p.qi, p.wts, bound, pages, cfg.index_topk, use
                    )
                if L in self.forced_selections:
                    ids = _take(self.forced_selections[L].to(self.device), flat)
                    ids = torch.where((bida >= 0).unsqueeze(1), ids, -1)
                if flat is None:
                    sel[L] = ids
                else:
                    s = torch.full((t, cfg.index_topk), -1, dtype=torch.long, device=self.device)
                    s[flat] = ids
                    sel[L] = s
            else:  # the owner's selection (-1 on padding rows)
                ids = _take(sel[info.topk_owner], flat)
            plane, rows_per_page = pools.main[owner], pools.rows_per_page[owner]
        rows = self._arange[:t] if at is None else at
        kb.sparse_attention(
            p.q,
            self.attn[L].sink,
            self.attn[L].scale,
            pools.ring(L),
            fr.kv,
            rows,
            _take(fr.slot, at),
            pa,
            window_lo,
            ring_until,
            W,
            plane,
            ids,
            pages,
            rows_per_page,
            p.o,
        )
        return cand
