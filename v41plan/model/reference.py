"""The dense V4.1 reference model: full-sequence prefill and one-token decode, unpaged.

Embedding, Engram, single-pass mHC, CSA2 attention (per-layer window + the Full owners'
compressor + the two-level indexer with candidates at the candidate source, Reindex inside the
candidates, Reuse taking the owner's selection), MoE, final norm and head. One sequence per
model instance; its private cache holds, per layer, a ring of ``sliding_window`` window-KV rows
and, per Full owner, the compressed rows, the index keys and (ratio 2) the FP32 tail of an open
pair, plus the Engram history (the latest 3 compressed ids). Cached values are exactly the
values the paged formats hold (see ``layers`` for the dtype policy).

``index_cache_dtype``: ``None``/``"fp4"`` is the published arithmetic (FP4 E8M0/32 index q and
k); ``"fp8"`` is the paged FP8 index plane's (E4M3 with one fp32 scale per key row and per
(token, head) query row). Vision is out of scope; for a DSpark draft (``dspark.DraftReference``)
every call leaves the draft's taps in ``taps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.model.config import ModelConfig
from v41plan.model.dspark import draft_config
from v41plan.model.engram import EngramHost
from v41plan.model.layers import (
    NEG_INF,
    Attention,
    EngramLayer,
    HcParams,
    MoE,
    acc_dtype,
    candidate_mask,
    hc_collapse,
    hc_expand,
    hc_predict,
    rms_norm,
    sparse_attention,
    topk_ids,
    visible_rows,
    window_indices,
)
from v41plan.model.quant import dequant_fp8_blocks


@dataclass
class OwnerCache:
    """A Full owner's global state: compressed rows, index keys, and the ratio-2 FP32 tail."""

    ratio: int
    comp: torch.Tensor
    """Compressed KV rows ``[M, d]`` (RoPE'd, FP4/E4M3-16 grid) in the compute dtype."""
    keys: torch.Tensor
    """Index keys ``[M, ihd]`` (FP4 grid, or E4M3 codes under ``"fp8"``)."""
    key_scale: torch.Tensor | None
    """Per-row fp32 key scales ``[M, 1]`` under ``"fp8"``; None for FP4."""
    tail_v: torch.Tensor | None = None
    """FP32 projection of an open pair's first token ``[d]`` (ratio 2), or None."""
    tail_g: torch.Tensor | None = None


@dataclass
class DecodeCache:
    """The private, unpaged cache of one sequence."""

    next_pos: int
    ring: list[torch.Tensor]
    """Per layer ``[W, d]`` window-KV rows at slot ``pos % W``."""
    ring_pos: list[torch.Tensor]
    """Per layer ``[W]`` position held by each slot (-1 empty)."""
    owners: dict[int, OwnerCache] = field(default_factory=dict)
    engram_history: np.ndarray | None = None


class ReferenceModel:
    """Dense V4.1 text model over processed weights (``LoadedCheckpoint.process``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        engram: EngramHost,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        index_cache_dtype: str | None = None,
    ):
        if index_cache_dtype not in (None, "fp4", "fp8"):
            raise ValueError(
                f"index_cache_dtype={index_cache_dtype!r} is not supported; accepted: fp4, fp8"
            )
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.acc = acc_dtype(dtype)
        self.index_fmt = None if index_cache_dtype == "fp4" else index_cache_dtype
        self.engram = engram
        w = weights
        self.embed = w["embed.weight"]
        self.norm = w["norm.weight"]
        self.head = w["head.weight"].to(self.acc)
        self.attn: list[Attention] = []
        self.moe: list[MoE] = []
        self.hc_attn: list[HcParams] = []
        self.hc_ffn: list[HcParams] = []
        self.attn_norm, self.ffn_norm = [], []
        self.engram_layers: dict[int, EngramLayer] = {}
        for info in cfg.layers:
            p = f"layers.{info.index}"
            self.attn.append(Attention(cfg, info, w, p, dtype))
            self.moe.append(MoE(cfg, w, p, dtype))
            self.hc_attn.append(
                HcParams(*(w[f"{p}.hc_attn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.hc_ffn.append(
                HcParams(*(w[f"{p}.hc_ffn_{k}"].to(self.acc) for k in ("fn", "base", "scale")))
            )
            self.attn_norm.append(w[f"{p}.attn_norm.weight"])
            self.ffn_norm.append(w[f"{p}.ffn_norm.weight"])
            if info.engram:
                self.engram_layers[info.index] = EngramLayer(cfg, w, p, dtype)
        self.cache: DecodeCache | None = None
        self.selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[N, index_topk]`` of every index source in the last call."""
        self.candidates: torch.Tensor | None = None
        """Candidate mask ``[N, M]`` of the last call (candidate source)."""
        self.experts: dict[int, torch.Tensor] = {}
        """Expert ids ``[N, k]`` per layer in the last call."""
        self.layer_inputs: list[torch.Tensor] = []
        """Streams entering each layer in the last call (after any Engram), when ``trace`` is
        set."""
        self.trace = False
        dc = draft_config(cfg)
        self.tap_layers: tuple[int, ...] = () if dc is None else dc.taps
        """Backbone layers the DSpark draft taps (empty without a draft)."""
        self.taps: torch.Tensor | None = None
        """The last call's DSpark taps ``[N, D * len(tap_layers)]``: per row, the mean over
        streams of the residual entering each tap layer (after any Engram), concatenated in
        ``tap_layers`` order; None without a draft."""
        self.forced_selections: dict[int, torch.Tensor] = {}
        """Index top-k ``[N, index_topk]`` to use instead of the computed one, per index source
        (teacher forcing for layer-by-layer comparisons); Reuse layers inherit it."""
        self.forced_experts: dict[int, torch.Tensor] = {}
        """Expert ids ``[N, k]`` to use instead of the routed ones, per layer."""

    @classmethod
    def from_checkpoint(
        cls,
        ckpt,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        index_cache_dtype: str | None = None,
    ) -> ReferenceModel:
        """Build from a ``LoadedCheckpoint`` (runs its post-load processing if not done yet)."""
        weights = ckpt.weights if ckpt.weights is not None else ckpt.process(dtype, device)
        weights = {k: v.to(device) for k, v in weights.items()}  # no-op when already there
        return cls(ckpt.config, weights, ckpt.engram_host(), dtype, device, index_cache_dtype)

    # --- public API -----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(
        self, token_ids: list[int] | torch.Tensor, text_mask: np.ndarray | None = None
    ) -> torch.Tensor:
        """Run a whole prompt from position 0; returns logits ``[S, vocab]`` (acc dtype)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        self._check_ids(ids)
        cfg = self.cfg
        W = cfg.sliding_window
        self.cache = DecodeCache(
            next_pos=0,
            ring=[
                torch.zeros(W, cfg.head_dim, dtype=self.dtype, device=self.device)
                for _ in cfg.layers
            ],
            ring_pos=[
                torch.full((W,), -1, dtype=torch.long, device=self.device) for _ in cfg.layers
            ],
        )
        return self._forward(ids, text_mask, decode=False)

    @torch.no_grad()
    def decode(self, token_id: int, text_mask: np.ndarray | None = None) -> torch.Tensor:
        """Append one token after a prefill; returns its logits ``[vocab]``."""
        if self.cache is None:
            raise RuntimeError("decode needs a prefill first")
        ids = torch.tensor([int(token_id)], dtype=torch.long)
        self._check_ids(ids)
        return self._forward(ids, text_mask, decode=True)[0]

    def _check_ids(self, ids: torch.Tensor) -> None:
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.numel():
            raise ValueError(
                f"token id {int(bad[0])} is outside the vocabulary [0, {self.cfg.vocab_size})"
            )

    # --- forward --------------------------------------------------------------------------

    def _forward(
        self, ids: torch.Tensor, text_mask: np.ndarray | None, decode: bool
    ) -> torch.Tensor:
        cfg, cache = self.cfg, self.cache
        start = cache.next_pos
        n = ids.numel()
        positions = torch.arange(start, start + n, device=self.device)
        rows, cache.engram_history = self.engram.prepare(
            ids.numpy(), cache.engram_history, text_mask
        )
        tmask = (
            None
            if text_mask is None
            else torch.as_tensor(np.asarray(text_mask, dtype=bool), device=self.device)
        )
        h = self.embed[ids.to(self.device)].to(self.dtype)
        X = h[:, None, :].expand(n, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre_in = torch.zeros(n, cfg.hc_mult, dtype=self.acc, device=self.device)
        pre_in[:, 0] = 1
        self.selections, self.experts, self.candidates = {}, {}, None
        self.layer_inputs = []
        taps: list[torch.Tensor] = []
        self._cand: torch.Tensor | None = None
        for info in cfg.layers:
            L = info.index
            if info.engram:
                li = cfg.engram_layer_ids.index(L)
                codes, scales = self.engram.gather(li, rows[:, li])
                emb = dequant_fp8_blocks(codes, scales, self.dtype).to(self.device)
                X = self.engram_layers[L](X, emb, tmask)
            if self.trace:
                self.layer_inputs.append(X.clone())
            if L in self.tap_layers:
                taps.append(X.mean(1))
            eps = cfg.rms_norm_eps
            a_pre, a_post, a_C = hc_predict(
                X, self.hc_attn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, pre_in), self.attn_norm[L], eps)
            y = self._attention(L, x, positions, decode)
            X = hc_expand(y, X, a_post, a_C)
            f_pre, f_post, f_C = hc_predict(
                X, self.hc_ffn[L], cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, a_pre), self.ffn_norm[L], eps)
            y, self.experts[L] = self.moe[L](x, self.forced_experts.get(L))
            X = hc_expand(y, X, f_post, f_C)
            pre_in = f_pre
        cache.next_pos = start + n
        self.taps = torch.cat(taps, dim=1) if taps else None
        x = rms_norm(hc_collapse(X, pre_in), self.norm, cfg.rms_norm_eps)
        return F.linear(x.to(self.acc), self.head)

    def _attention(
        self, L: int, x: torch.Tensor, positions: torch.Tensor, decode: bool
    ) -> torch.Tensor:
        cfg, cache = self.cfg, self.cache
        att = self.attn[L]
        info = cfg.layers[L]
        n = x.shape[0]
        W = cfg.sliding_window
        cos, sin = att.rope.cos_sin(positions, self.dtype)
        q, qr = att.q_path(x, cos, sin)
        kv = att.window_kv(x, cos, sin)
        # window rows: the chunk itself (prefill) or the ring after writing this token (decode)
        slots = positions[-W:] % W
        cache.ring[L][slots] = kv[-W:]
        cache.ring_pos[L][slots] = positions[-W:]
        if decode:
            win_kv = cache.ring[L]
            win_idx = torch.where(
                cache.ring_pos[L] >= 0,
                torch.arange(W, device=self.device),
                torch.full((W,), -1, device=self.device),
            )[None].expand(n, W)
        else:
            win_kv = kv
            win_idx = window_indices(positions, W)
        if info.ratio == 0:
            return att.output(sparse_attention(q, win_kv, win_idx, att.sink, att.scale), cos, sin)
        if info.role == "full":
            self._compress(L, att, x, positions, decode)
        oc = cache.owners[info.kv_owner]
        m = oc.comp.shape[0]
        if info.role in ("full", "reindex"):
            qi, qs, wts = att.index_queries(qr, x, cos, sin, self.index_fmt)
            scores = att.index_scores(qi, qs, wts, oc.keys, oc.key_scale)
            vis = visible_rows(positions, info.ratio)
            scores = scores.masked_fill(
                torch.arange(m, device=self.device)[None] >= vis[:, None], NEG_INF
            )
            if L == cfg.candidate_source_layer_id:
                self._cand = candidate_mask(
                    scores, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks
                )
                self.candidates = self._cand
            if info.role == "reindex" and info.uses_candidates:
                scores = scores.masked_fill(~self._cand, NEG_INF)
            top = topk_ids(scores, cfg.index_topk)
            if L in self.forced_selections:
                top = self.forced_selections[L].to(top.device)
            self.selections[L] = top
        else:
            top = self.selections[info.topk_owner]
        off = win_kv.shape[0]
        kv_all = torch.cat([win_kv, oc.comp.to(win_kv.dtype)])
        idx = torch.cat([win_idx, torch.where(top >= 0, top + off, top)], dim=1)
        return att.output(sparse_attention(q, kv_all, idx, att.sink, att.scale), cos, sin)

    def _compress(
        self, L: int, att: Attention, x: torch.Tensor, positions: torch.Tensor, decode: bool
    ) -> None:
        """Owner step: project every token, close groups, then keys, RoPE'd rows, cache append."""
        cache = self.cache
        r = att.ratio
        v, g = att.compress_project(x)
        oc = cache.owners.get(L) if decode else None
        if oc is None:
            ihd = self.cfg.index_head_dim
            oc = OwnerCache(
                r,
                torch.zeros(0, self.cfg.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(0, ihd, dtype=self.dtype, device=self.device),
                torch.zeros(0, 1, dtype=torch.float32, device=self.device)
                if self.index_fmt == "fp8"
                else None,
            )
            cache.owners[L] = oc
        if r == 1:
            latent = att.ratio1_latent(v)
            first = positions
        else:
            # prepend an open pair's first token carried from the previous call
            if oc.tail_v is not None:
                v = torch.cat([oc.tail_v[None], v])
                g = torch.cat([oc.tail_g[None], g])
                p0 = positions[0] - 1
            else:
                p0 = positions[0]
            full = v.shape[0] // 2 * 2
            if full:
                latent = att.pool(v[0:full:2], g[0:full:2], v[1:full:2], g[1:full:2])
            else:
                latent = torch.zeros(0, self.cfg.head_dim, dtype=self.dtype, device=self.device)
            first = p0 + torch.arange(0, full, 2, device=self.device)
            oc.tail_v, oc.tail_g = (v[full], g[full]) if v.shape[0] > full else (None, None)
        if latent.shape[0] == 0:
            return
        cos, sin = att.rope.cos_sin(first, self.dtype)
        keys, kscale = att.index_keys(latent, cos, sin, self.index_fmt)
        oc.keys = torch.cat([oc.keys, keys.to(oc.keys.dtype)])
        if kscale is not None:
            oc.key_scale = torch.cat([oc.key_scale, kscale])
        oc.comp = torch.cat([oc.comp, att.compressed_kv(latent, cos, sin)])
