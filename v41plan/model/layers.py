"""V4.1 building blocks shared by the dense reference and the paged runtime.

Every piece takes already-processed weights (``checkpoint.process_state``: FP8/FP4 weights
dequantized once into the compute dtype) and works on a flat token batch ``[N, ...]``; nothing
here syncs with the host or has a data-dependent shape, so the same code runs inside a CUDA
graph. Dtype policy: ``dtype`` is the compute dtype (bf16, float32 or float64) and ``acc`` the
accumulation dtype (float64 for float64 compute, else float32). Where the published model rounds
to bf16 (linear outputs, index scores, the pooled latent before the compressor norm) the
rounding happens only when the compute dtype is bf16; float32/float64 keep their precision.
The ratio-2 compressor projections are always rounded to float32 (the FP32 tails hold them).

Tensor parallelism (``v41plan.model.sharding``, ``v41plan.runtime.collectives``): the weights given
may be one rank's shard; local
sizes come from the sliced weights (heads of ``wq_b``/``attn_sink``, output groups of ``wo_a``,
index heads of ``indexer.wq_b``/``weights_proj``, whole experts or the intermediate slice of
``w1``/``w3``/``w2``). ``Attention.output`` all-reduces after ``wo_b`` and ``MoE`` its routed +
shared output; the index partial scores are all-reduced by the caller before any top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from v41plan.model.quant import QuantWeight, fake_fp4, fake_fp4_e4m3, fake_fp8, quant_fp8_rows

NEG_INF = float("-inf")


class OneRank:
    """The world-size-1 group: rank 0 of 1, every reduction the identity.

    The paged runtime passes its ``runtime.collectives.TPGroup`` instead; the model only needs
    ``rank``, ``size`` and ``all_reduce``.
    """

    rank = 0
    size = 1

    @staticmethod
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        """``x`` itself (nothing to reduce over one rank)."""
        return x


ONE_RANK = OneRank()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a compute dtype: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- norms, linears, RoPE ----------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in ``acc``, returned in ``x.dtype``."""
    a = acc_dtype(x.dtype)
    y = x.to(a)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(a)).to(x.dtype)


class Linear:
    """``y = x @ W^T`` with an optional FP8 activation fake-quant per 32 along K (W8A8 / W4A8)."""

    def __init__(self, weight: torch.Tensor, act_quant: bool = True, quantizer=fake_fp8):
        self.weight = weight
        self.act_quant = act_quant
        self.quantizer = quantizer

    def __call__(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        """``[N, out]``; ``rope = (cos, sin, head_dim)`` then rotates every head of the output
        (``rope_heads``)."""
        if self.act_quant:
            x = self.quantizer(x, 32)
        y = F.linear(x.to(self.weight.dtype), self.weight)
        return y if rope is None else rope_heads(y, *rope)


@dataclass(frozen=True)
class LayerKernels:
    """What the layers call for their FP8 activation quantizer and their linears: the
    reference's by default; the paged runtime passes fused ones (a one-launch quantizer, W8A8
    GEMMs over weights kept as published) with the same arithmetic."""

    fake_fp8: Any = fake_fp8
    """``fake_fp8(x, block)``, bit-exact with ``quant.fake_fp8``."""
    linear: Any = None
    """``linear(weight, dtype, act_quant) -> callable [N, in] -> [N, out]``; None: ``Linear``
    over ``weight.to(dtype)`` with this ``fake_fp8``."""

    norm_rope_fp8: Any = None
    """``norm_rope_fp8(y, weight, eps, cos, sin)``: the window-KV epilogue (RMSNorm, RoPE,
    ``fake_fp8`` per 32) as one call; None: the composition with this ``fake_fp8``."""

    output_rope: Any = None
    """``output_rope(o, cos, sin, groups)``: the output projection's inverse RoPE of ``o [N, H,
    d]`` laid out ``[groups, N, H * d / groups]`` for a ``torch.bmm`` with the grouped ``wo_a``
    (``dense_ref.inverse_rope_groups``); None: ``apply_rope`` and an einsum."""

    grouped_linear: Any = None
    """``grouped_linear(weight, dtype) -> callable [G, N, in/G] -> [N, G * r]`` for a
    ``wo_a`` kept as published (``QuantWeight``); None: its values in ``dtype``."""

    linear_pair: Any = None
    """``linear_pair(w1, w2, dtype) -> (lin1, lin2, both) or None`` for two linears of one
    input (``wq_a`` and ``wkv``): ``both(x) -> [N, out1 + out2]`` one product over the two
    weights stacked, ``lin1``/``lin2`` over its halves (one copy of the bytes); None (or a None
    result): two ``make_linear`` and no joint product."""

    def make_pair(self, w1: Any, w2: Any, dtype: torch.dtype):
        """``(lin1, lin2, both or None)``: see ``linear_pair``."""
        pair = self.linear_pair(w1, w2, dtype) if self.linear_pair is not None else None
        return pair or (self.make_linear(w1, dtype), self.make_linear(w2, dtype), None)

    def make_grouped(self, weight: Any, dtype: torch.dtype):
        """The grouped ``wo_a``: a tensor in ``dtype`` (the einsum / ``bmm`` reference), or the
        runtime's product over a weight kept as published."""
        if isinstance(weight, QuantWeight):
            if self.grouped_linear is not None:
                return self.grouped_linear(weight, dtype)
            return weight.dequantize(dtype)
        return weight.to(dtype)

    def make_linear(self, weight: Any, dtype: torch.dtype, act_quant: bool = True):
        """A linear over ``weight`` computing in ``dtype``."""
        if self.linear is not None:
            return self.linear(weight, dtype, act_quant)
        return Linear(weight.to(dtype), act_quant, self.fake_fp8)


REFERENCE_KERNELS = LayerKernels()


def yarn_freqs(rd: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """RoPE frequencies (float32) for the last ``rd`` lanes, YaRN-ramped when configured."""
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if rope_scaling and rope_scaling.get("original_max_position_embeddings", 0) > 0:
        orig = rope_scaling["original_max_position_embeddings"]
        factor = rope_scaling["factor"]

        def corr(rot: float) -> float:
            return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(rope_scaling["beta_fast"])), 0)
        high = min(math.ceil(corr(rope_scaling["beta_slow"])), rd - 1)
        i = torch.arange(rd // 2, dtype=torch.float32)
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


class Rope:
    """One RoPE table: interleaved pairs on the last ``rd`` lanes."""

    def __init__(self, rd: int, base: float, rope_scaling: dict | None = None):
        self.rd = rd
        self.freqs = yarn_freqs(rd, base, rope_scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[N, rd/2]`` in ``acc_dtype(dtype)``; angles are float32 ``pos * freq``."""
        ang = positions.to(torch.float32)[:, None] * self.freqs.to(positions.device)[None, :]
        a = acc_dtype(dtype)
        ang = ang.to(a)
        return torch.cos(ang), torch.sin(ang)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``2*cos.shape[-1]`` lanes of ``x`` (``[N, d]`` or ``[N, H, d]``) by position.

    ``inverse`` rotates by the conjugate (the output's inverse RoPE). Computed in ``acc``.
    """
    rd = cos.shape[-1] * 2
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    a = acc_dtype(x.dtype)
    r = x[..., -rd:].to(a).reshape(*x.shape[:-1], rd // 2, 2)
    re, im = r[..., 0], r[..., 1]
    if inverse:
        sin = -sin
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).reshape(*x.shape[:-1], rd)
    return torch.cat([x[..., :-rd], out.to(x.dtype)], dim=-1)


def rope_heads(
    y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """``apply_rope`` on every ``head_dim``-lane head of rows ``y [N, heads * head_dim]``."""
    return apply_rope(y.reshape(y.shape[0], -1, head_dim), cos, sin).reshape(y.shape)


# --- mHC ----------------------------------------------------------------------------------


@dataclass
class HcParams:
    """One mHC coefficient set (``hc_attn_*`` or ``hc_ffn_*``), in ``acc``."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


def hc_predict(
    X: torch.Tensor, p: HcParams, hc: int, iters: int, hc_eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predict (pre ``[N,hc]``, post ``[N,hc]``, C ``[N,hc,hc]``) from streams ``X`` ``[N,hc,D]``.

    ``C[i][j]``: i source stream, j destination. Sinkhorn: a softmax over j, then a column
    normalization, then ``iters - 1`` (row, column) pairs, ``+hc_eps`` in every denominator.
    """
    a = p.fn.dtype
    f = X.reshape(X.shape[0], -1).to(a)
    r = torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm_eps)
    m = (f @ p.fn.T) * r
    pre = torch.sigmoid(m[:, :hc] * p.scale[0] + p.base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * p.scale[1] + p.base[hc : 2 * hc])
    C = (m[:, 2 * hc :] * p.scale[2] + p.base[2 * hc :]).reshape(-1, hc, hc)
    C = torch.softmax(C, dim=-1) + hc_eps
    C = C / (C.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + hc_eps)
        C = C / (C.sum(-2, keepdim=True) + hc_eps)
    return pre, post, C


def hc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Sublayer input ``sum_k pre[k] * X[k]`` (in ``acc``), returned in ``X.dtype``."""
    return (pre[..., None] * X.to(pre.dtype)).sum(-2).to(X.dtype)


def hc_expand(
    y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """``X'[j] = post[j] * y + sum_i C[i][j] * X[i]`` (in ``acc``), returned in ``X.dtype``."""
    a = post.dtype
    out = torch.einsum("nij,nid->njd", C, X.to(a)) + post[..., None] * y.to(a)[:, None, :]
    return out.to(X.dtype)


# --- attention pieces ---------------------------------------------------------------------


def window_indices(positions_in_chunk: torch.Tensor, window: int) -> torch.Tensor:
    """Prefill window rows ``[N, W]``: keys ``i-W+1 .. i`` of the chunk itself, -1 before 0."""
    idx = (
        positions_in_chunk[:, None]
        - window
        + 1
        + torch.arange(window, device=positions_in_chunk.device)[None]
    )
    return torch.where(idx >= 0, idx, torch.full_like(idx, -1))


def visible_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed rows a query at absolute position ``p`` may see: ``(p + 1) // ratio``."""
    return (positions + 1) // ratio


def stable_topk_desc(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest along the last dim; ties go to the smaller index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Index top-k ``[N, k]``: the ``min(k, M)`` best rows (ties: smaller position), ascending,
    -1 for picks whose score is -inf (not visible or not a candidate), -1 padded to ``k``."""
    n, m = scores.shape
    out = torch.full((n, k), -1, dtype=torch.long, device=scores.device)
    kk = min(k, m)
    if kk == 0:
        return out
    pick = stable_topk_desc(scores, kk)
    ok = torch.gather(scores, 1, pick) > NEG_INF
    big = torch.full_like(pick, m)
    ids = torch.sort(torch.where(ok, pick, big), dim=-1).values
    out[:, :kk] = torch.where(ids < m, ids, torch.full_like(ids, -1))
    return out


def candidate_mask(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """Level-1 candidate positions ``[N, M]`` (bool) from masked index scores ``[N, M]``.

    A block's score is its max; the block holding the newest visible row is forced in; the top
    ``topk_blocks`` blocks with a score above -inf are kept (ties: smaller block).
    """
    n, m = scores.shape
    nb = -(-m // block_size)
    pad = torch.full((n, nb * block_size), NEG_INF, dtype=scores.dtype, device=scores.device)
    pad[:, :m] = scores
    bscore = pad.reshape(n, nb, block_size).amax(-1)
    newest = ((visible - 1) // block_size).clamp(min=0)
    force = (torch.arange(nb, device=scores.device)[None] == newest[:, None]) & (
        visible[:, None] > 0
    )
    bscore = torch.where(force, torch.full_like(bscore, float("inf")), bscore)
    kb = min(topk_blocks, nb)
    pick = stable_topk_desc(bscore, kb)
    keep = torch.gather(bscore, 1, pick) > NEG_INF
    chosen = torch.zeros(n, nb, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, pick, keep)
    return chosen.repeat_interleave(block_size, dim=1)[:, :m]


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q`` ``[N,H,d]`` over rows ``kv[idx]`` (``idx`` ``[N,K]``, -1 skipped), K = V.

    A per-head sink (``[H]``) adds ``exp(sink)`` to the denominator only; a row with no valid
    key returns 0. Computed in ``acc`` (no bf16 rounding of probabilities).
    """
    a = acc_dtype(q.dtype)
    valid = idx >= 0
    g = kv[idx.clamp(min=0)].to(a)  # [N, K, d]
    logits = torch.einsum("nhd,nkd->nhk", q.to(a), g) * scale
    logits = logits.masked_fill(~valid[:, None, :], NEG_INF)
    s = sink.to(a)[None, :]
    m = torch.maximum(logits.amax(-1), s)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m[..., None])
    den = p.sum(-1) + torch.exp(s - m)
    o = torch.einsum("nhk,nkd->nhd", p, g)
    o = torch.where(
        den[..., None] > 0, o / den.clamp_min(torch.finfo(a).tiny)[..., None], torch.zeros_like(o)
    )
    return o.to(q.dtype)


class Attention:
    """One layer's CSA2 attention weights and the arithmetic pieces, called in the published order.

    ``role``/``ratio`` come from the layer's ``LayerInfo``; owner pieces (compressor, index keys)
    exist on Full layers, indexer queries on Full and Reindex layers.
    """

    def __init__(
        self,
        cfg: Any,
        info: Any,
        w: dict[str, torch.Tensor],
        prefix: str,
        dtype: torch.dtype,
        tp: Any = ONE_RANK,
        kernels: LayerKernels = REFERENCE_KERNELS,
    ):
        self.cfg, self.info, self.dtype, self.tp = cfg, info, dtype, tp
        self.kernels = kernels
        self.prefix = prefix
        self.ratio, self.role = info.ratio, info.role
        self.d, self.rd = cfg.head_dim, cfg.qk_rope_head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        if info.ratio > 0:
            self.rope = Rope(self.rd, cfg.compress_rope_theta, cfg.rope_scaling)
        else:
            self.rope = Rope(self.rd, cfg.rope_theta, None)
        self.bind(w)
        # the RoPE table lives beside the weights: no host-to-device copy per call
        self.rope.freqs = self.rope.freqs.to(self.q_norm.device)

    def bind(self, w: dict[str, torch.Tensor]) -> None:
        """Point the layer at the weights in ``w`` (the constructor's dict; training rebinds
        its fake-quantized weights every step, so autograd reaches the master weights)."""
        cfg, info, dtype = self.cfg, self.info, self.dtype
        a = acc_dtype(dtype)
        p = self.prefix + ".attn."
        lin = self.kernels.make_linear
        qa, kv = p + "wq_a.weight", p + "wkv.weight"
        self.wq_a, self.wkv, self.wqkv_a = self.kernels.make_pair(w[qa], w[kv], dtype)
        """``wq_a`` and ``wkv``; ``wqkv_a`` both as one product (``q_kv_inputs``) or None."""
        if self.wqkv_a is not None:  # one copy of the bytes: the halves of the joint weight
            w[qa], w[kv] = self.wq_a.weight, self.wkv.weight
        self.q_norm = w[p + "q_norm.weight"]
        self.wq_b = lin(w[p + "wq_b.weight"], dtype)
        self.H = self.wq_b.weight.shape[0] // self.d  # this rank's heads
        self.kv_norm = w[p + "kv_norm.weight"]
        self.wo_a = self.kernels.make_grouped(w[p + "wo_a.weight"], dtype)
        self.wo_b = lin(w[p + "wo_b.weight"], dtype)
        self.sink = w[p + "attn_sink"].to(a)
        if info.role == "full":
            # Ratio 2 projects in fp32 (float64 here when computing in float64, then rounded).
            wdt = a if info.ratio == 2 else dtype
            self.comp_wkv = w[p + "compressor.wkv.weight"].to(wdt)
            self.comp_wgate = w[p + "compressor.wgate.weight"].to(wdt) if info.ratio == 2 else None
            self.comp_norm = w[p + "compressor.norm.weight"]
            self.idx_wk = w[p + "indexer.wk.weight"].to(dtype)
            self.idx_k_norm = w[p + "indexer.k_norm.weight"]
        if info.role in ("full", "reindex"):
            self.idx_wq_b = lin(w[p + "indexer.wq_b.weight"], dtype)
            self.idx_weights_proj = w[p + "indexer.weights_proj.weight"].to(dtype)
            self.ihd = cfg.index_head_dim
            self.nih = self.idx_weights_proj.shape[0]  # this rank's index heads
            # the head-weight scale counts every index head, whichever rank holds them
            self.idx_scale = self.ihd**-0.5 * cfg.index_n_heads**-0.5

    # q and window KV
    def q_path(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q ``[N,H,d]`` with RoPE, qr ``[N,q_lora]`` the normed latent shared with the
        indexer)."""
        return self.q_path_from(self.wq_a(x), cos, sin)

    def q_path_from(
        self, qa: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_path`` from ``wq_a``'s output ``qa [N, q_lora]``."""
        qr = rms_norm(qa, self.q_norm, self.eps)
        return self.wq_b(qr, rope=(cos, sin, self.d)).reshape(qa.shape[0], self.H, self.d), qr

    def q_kv_inputs(
        self, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(wq_a(x), wkv(x))``: one product where the kernels joined them (``wqkv_a``; the
        same products, the sums split over K by the joint weight's shape). ``quantized``: ``x``'s
        FP8 codes and E8M0 scales, which a joint product that reads them takes instead of
        quantizing ``x`` again (``wqkv_a.quantized``)."""
        if self.wqkv_a is None:
            return self.wq_a(x), self.wkv(x)
        if quantized is not None and getattr(self.wqkv_a, "reads_codes", False):
            y = self.wqkv_a.quantized(*quantized)
        else:
            y = self.wqkv_a(x)
        n = self.wq_a.out_features
        return y[:, :n], y[:, n:]

    def window_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Window KV ``[N,d]``: wkv, kv_norm, RoPE, FP8 QAT over all lanes (block 32)."""
        return self.window_kv_from(self.wkv(x), cos, sin)

    def window_kv_from(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``window_kv`` from ``wkv``'s output ``y [N, d]``."""
        if self.kernels.norm_rope_fp8 is not None:
            return self.kernels.norm_rope_fp8(y, self.kv_norm, self.eps, cos, sin)
        kv = rms_norm(y, self.kv_norm, self.eps)
        return self.kernels.fake_fp8(apply_rope(kv, cos, sin), 32)

    # compressor
    def compress_project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token compressor projections: ratio 2 (v, g) in float32; ratio 1 (v, None) in
        dtype."""
        if self.ratio == 2:
            xa = x.to(self.comp_wkv.dtype)
            v = F.linear(xa, self.comp_wkv).to(torch.float32)
            g = F.linear(xa, self.comp_wgate).to(torch.float32)
            return v, g
        return F.linear(x.to(self.comp_wkv.dtype), self.comp_wkv), None

    def pool(
        self,
        v_first: torch.Tensor,
        g_first: torch.Tensor,
        v_second: torch.Tensor,
        g_second: torch.Tensor,
    ) -> torch.Tensor:
        """Ratio 2: softmax-gated pooling of a closed pair, then the compressor norm (pre-RoPE
        latent)."""
        a = acc_dtype(self.dtype)
        g = torch.stack([g_first, g_second]).to(a)
        v = torch.stack([v_first, v_second]).to(a)
        lat = (torch.softmax(g, dim=0) * v).sum(0)
        return rms_norm(lat.to(self.dtype), self.comp_norm, self.eps)

    def ratio1_latent(self, v: torch.Tensor) -> torch.Tensor:
        """Ratio 1: the per-token latent is the normed projection (pre-RoPE)."""
        return rms_norm(v.to(self.dtype), self.comp_norm, self.eps)

    def compressed_kv(
        self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Cache rows: RoPE at the group's first position, then FP4 with E4M3 group-16 scales."""
        return fake_fp4_e4m3(apply_rope(latent, cos, sin), 16)

    # indexer
    def index_keys(
        self,
        latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache_dtype: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Index keys from the pre-RoPE latent: wk, k_norm, RoPE, then FP4 E8M0/32 (scale None)
        or, for ``"fp8"``, E4M3 codes with one fp32 scale per row ``[M, 1]``."""
        k = rms_norm(F.linear(latent, self.idx_wk), self.idx_k_norm, self.eps)
        k = apply_rope(k, cos, sin)
        if index_cache_dtype == "fp8":
            return quant_fp8_rows(k)
        return fake_fp4(k, 32), None

    def index_queries(
        self,
        qr: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index_cache_dtype: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(qi ``[N,nih,ihd]``, its per-(token, head) fp32 scale ``[N,nih,1]`` for ``"fp8"`` else
        None,
        head weights ``[N,nih]`` scaled by ``ihd^-0.5 * nih^-0.5``)."""
        qi = self.idx_wq_b(qr, rope=(cos, sin, self.ihd)).reshape(x.shape[0], self.nih, self.ihd)
        wts = F.linear(x, self.idx_weights_proj) * self.idx_scale
        if index_cache_dtype == "fp8":
            codes, qs = quant_fp8_rows(qi)
            return codes, qs, wts
        return fake_fp4(qi, 32), None, wts

    @staticmethod
    def index_scores(
        qi: torch.Tensor,
        q_scale: torch.Tensor | None,
        wts: torch.Tensor,
        k: torch.Tensor,
        k_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Scores ``[N, M]`` = sum_h relu(qi_h . k) * w_h (unmasked).

        FP4 (scales None): computed in the compute dtype (bf16 in bf16 mode, as published).
        FP8: ``relu(codes_q . codes_k * k_scale) * (w * q_scale)`` in ``acc``.
        """
        if q_scale is None:
            if k.dim() == 3:  # one key set per sequence: qi [B, S, h, c], k [B, M, c] -> [B, S, M]
                logits = torch.einsum("bshc,bmc->bshm", qi, k.to(qi.dtype))
                return (torch.relu(logits) * wts[..., None].to(qi.dtype)).sum(-2)
            logits = torch.einsum("nhc,mc->nhm", qi, k.to(qi.dtype))
            return (torch.relu(logits) * wts[:, :, None].to(qi.dtype)).sum(1)
        a = acc_dtype(qi.dtype)
        logits = torch.einsum("nhc,mc->nhm", qi.to(a), k.to(a)) * k_scale[:, 0].to(a)[None, None, :]
        return (torch.relu(logits) * (wts.to(a) * q_scale[..., 0].to(a))[:, :, None]).sum(1)

    # output
    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE at the query positions, grouped ``wo_a`` (no activation quant), ``wo_b``."""
        return self.tp.all_reduce(self.output_local(o, cos, sin))

    def output_local(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``output`` before its all-reduce: this rank's partial sum (all of it on one rank)."""
        n, G = o.shape[0], self.wo_a.shape[0] // self.cfg.o_lora_rank  # this rank's groups
        if not isinstance(self.wo_a, torch.Tensor):  # kept as published: the runtime's product
            if self.kernels.output_rope is not None:
                xg = self.kernels.output_rope(o, cos, sin, G)
            else:
                xg = apply_rope(o, cos, sin, inverse=True).reshape(n, G, -1).transpose(0, 1)
            return self.wo_b(self.wo_a(xg))
        wo_a = self.wo_a.reshape(G, self.cfg.o_lora_rank, -1)
        if self.kernels.output_rope is not None:
            # [G, n, K] @ [G, K, r]: the product's [n, G, r] view is what wo_b reads
            z = torch.bmm(self.kernels.output_rope(o, cos, sin, G), wo_a.transpose(1, 2))
            z = z.transpose(0, 1)
            return self.wo_b(z if getattr(self.wo_b, "reads_groups", False) else z.reshape(n, -1))
        o = apply_rope(o, cos, sin, inverse=True).reshape(n, G, -1)
        z = torch.einsum("ngk,grk->ngr", o, wo_a)
        return self.wo_b(z.reshape(n, -1))


# --- MoE ----------------------------------------------------------------------------------


def moe_route(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    gate_bias: torch.Tensor,
    cfg: Any,
    forced_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: (ids ``[N, k]``, weights ``[N, k]`` in ``gate_w``'s dtype).

    sqrtsoftplus scores ``sqrt(softplus(x @ gate_w^T))``; selection by the biased scores (ties:
    smaller expert id; ``forced_ids`` replaces it); weights from the unbiased ones, normalised
    (``norm_topk_prob``, k > 1) and scaled by ``routed_scaling_factor``. Ids are whole-router
    ids, whichever experts a rank holds.
    """
    s = F.linear(x.to(gate_w.dtype), gate_w)
    s = torch.sqrt(F.softplus(s))
    k = cfg.num_experts_per_tok
    ids = stable_topk_desc(s + gate_bias, k) if forced_ids is None else forced_ids
    wts = torch.gather(s, 1, ids)
    if cfg.norm_topk_prob and k > 1:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return ids, wts * cfg.routed_scaling_factor


class MoE:
    """sqrtsoftplus-routed MoE with a shared expert and clamped SwiGLU, dense over experts.

    Routing produces a ``[N, E]`` weight matrix that is zero for unselected experts, so every
    expert runs on every token: no data-dependent shapes and no host sync (fine at these sizes).
    """

    def __init__(
        self,
        cfg: Any,
        w: dict[str, torch.Tensor],
        prefix: str,
        dtype: torch.dtype,
        tp: Any = ONE_RANK,
        kernels: LayerKernels = REFERENCE_KERNELS,
    ):
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        self.kernels = kernels
        self.prefix = prefix
        self.limit = cfg.swiglu_limit
        self.bind(w)

    def bind(self, w: dict[str, torch.Tensor]) -> None:
        """Point the layer at the weights in ``w`` (see ``Attention.bind``)."""
        cfg, dtype, tp = self.cfg, self.dtype, self.tp
        a = acc_dtype(dtype)
        p = self.prefix + ".ffn."
        self.gate_w = w[p + "gate.weight"].to(a)
        self.gate_bias = w[p + "gate.bias"].to(a)
        self.w1 = w[p + "experts.w1"].to(dtype)  # fused [E, I, D]
        self.w3 = w[p + "experts.w3"].to(dtype)
        self.w2 = w[p + "experts.w2"].to(dtype)  # [E, D, I]
        # the shared expert reads the routed experts' quantized input (quantized once)
        lin = self.kernels.make_linear
        self.s1 = lin(w[p + "shared_experts.w1.weight"], dtype, act_quant=False)
        self.s3 = lin(w[p + "shared_experts.w3.weight"], dtype, act_quant=False)
        self.s2 = lin(w[p + "shared_experts.w2.weight"], dtype)
        # expert parallel: this rank holds the router's experts [first, first + count)
        self.expert_count = self.w1.shape[0]
        whole = self.expert_count == cfg.n_routed_experts
        self.expert_first = 0 if whole else tp.rank * self.expert_count

    def route_topk(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ``[N, k]``, weights ``[N, k]`` in ``acc``): ``moe_route`` with this layer's
        gate."""
        return moe_route(x, self.gate_w, self.gate_bias, self.cfg, forced_ids)

    def route(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[N, E]`` zero off the selection, ids ``[N, k]``). Ties: smaller expert id."""
        ids, wts = self.route_topk(x, forced_ids)
        zeros = torch.zeros(x.shape[0], self.gate_w.shape[0], dtype=wts.dtype, device=x.device)
        return zeros.scatter(1, ids, wts), ids

    def _swiglu(self, h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
        a = acc_dtype(self.dtype)
        L = self.limit
        return F.silu(h1.to(a).clamp(max=L)) * h3.to(a).clamp(-L, L)

    def __call__(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output ``[N, D]`` in dtype, selected expert ids ``[N, k]``)."""
        y, ids = self.local(x, forced_ids)
        # one reduction per layer: routed + shared partials, in acc, rounded after the sum
        return self.tp.all_reduce(y).to(self.dtype), ids

    def local(
        self, x: torch.Tensor, forced_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's routed + shared partial ``[N, D]`` in ``acc``, expert ids ``[N, k]``):
        ``__call__`` before its all-reduce."""
        a = acc_dtype(self.dtype)
        weights, ids = self.route(x, forced_ids)
        if self.expert_count != weights.shape[1]:
            weights = weights[:, self.expert_first : self.expert_first + self.expert_count]
        q8 = self.kernels.fake_fp8
        xq = q8(x, 32).to(self.dtype)
        h1 = torch.einsum("nd,eid->eni", xq, self.w1)
        h3 = torch.einsum("nd,eid->eni", xq, self.w3)
        act = (self._swiglu(h1, h3) * weights.T[:, :, None].to(a)).to(self.dtype)
        y = torch.einsum("eni,edi->end", q8(act, 32), self.w2).to(a).sum(0)
        shared = self.s2(self._swiglu(self.s1(xq), self.s3(xq)).to(self.dtype))
        return y + shared.to(a), ids


# --- Engram (device half of the arithmetic) -----------------------------------------------


class EngramLayer:
    """Gated Engram injection: one fused ``wkv`` to hc keys + one value, per-stream sigmoid gate."""

    def __init__(
        self,
        cfg: Any,
        w: dict[str, torch.Tensor],
        prefix: str,
        dtype: torch.dtype,
        kernels: LayerKernels = REFERENCE_KERNELS,
    ):
        self.cfg, self.dtype, self.prefix = cfg, dtype, prefix
        self.kernels = kernels
        self.bind(w)

    def bind(self, w: dict[str, torch.Tensor]) -> None:
        """Point the layer at the weights in ``w`` (see ``Attention.bind``)."""
        a = acc_dtype(self.dtype)
        p = self.prefix + ".engram."
        self.wkv = self.kernels.make_linear(w[p + "wkv.weight"], self.dtype)
        self.wqk = w[p + "q_weight"].to(a) * w[p + "k_weight"].to(a)

    def __call__(
        self, X: torch.Tensor, emb: torch.Tensor, text_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Streams ``X`` ``[N,hc,D]`` plus the gated value of the dequantized rows ``emb``
        ``[N,cols,hd]``."""
        a = acc_dtype(self.dtype)
        n, hc, D = X.shape
        eps = self.cfg.rms_norm_eps
        kv = self.wkv(emb.reshape(n, -1).to(self.dtype))
        key = kv[:, : hc * D].reshape(n, hc, D).to(a)
        value = kv[:, hc * D :].to(a)
        Xa = X.to(a)
        dot = (Xa * self.wqk * key).sum(-1)
        dot = (
            dot
            * torch.rsqrt(Xa.pow(2).mean(-1) + eps)
            * torch.rsqrt(key.pow(2).mean(-1) + eps)
            * D**-0.5
        )
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        if text_mask is not None:
            gate = gate * text_mask.to(a)[:, None]
        return (Xa + gate[..., None] * value[:, None, :]).to(X.dtype)
