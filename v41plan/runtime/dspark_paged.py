"""The DSpark draft over the paged pools, and the verification step it feeds.

The draft stages' window rings are STATE rings: in the DSpark layout (``PoolGeometry``
``speculative_tokens`` and ``draft_layers``) ``swa_rings`` holds ``num_hidden_layers +
stages`` rings of ``window + speculative_tokens`` rows, stage ``k`` at ring
``num_hidden_layers + k``. So images, relocations and forks carry the draft's context with the
slot's, and nothing else holds per-request draft state.

- ``observe`` writes, for the rows a forward ran its tap layers on, every stage's window key at
  the row's position (``kv = FP8QAT(RoPE(kv_norm(wkv(RMSNorm(main_proj(taps))))))``). A
  forward that ran no decoder row (a non-final chunk under decoder replay) writes nothing.
  Verify rows are observed whole: a rejected row's key lands at most ``speculative_tokens``
  positions past the accepted ones, in a ring slot no window reads before the row at that
  position is observed again.
- ``propose`` drafts ``block_size`` tokens per request from its anchor (the token just
  sampled or accepted) at its position: the block ``[anchor, noise, ...]`` runs through the
  stages, each block query seeing the ring rows of the ``window`` positions before the anchor
  and every block row, then the Markov bias is added position by position while picking
  (greedy, or Gumbel-max at the request's temperature with noise of its own stream). It reads
  the rings and writes nothing.

The arithmetic is ``v41plan.model.dspark.DraftReference``'s (the tests hold the two to each
other in float64); here it is batched over requests, with fixed shapes and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from v41plan.geometry.runtime import LayerInfo
from v41plan.model.dspark import draft_config
from v41plan.model.layers import (
    REFERENCE_KERNELS,
    Attention,
    HcParams,
    MoE,
    acc_dtype,
    hc_collapse,
    hc_expand,
    hc_predict,
    rms_norm,
    sparse_attention,
)
from v41plan.runtime.kernels.ops import head_logits
from v41plan.runtime.sampler import counter_gumbel

DRAFT_SALT = 0x0D5A_12C0_FFEE_D00D
"""Folded into a request's seed for the draft's sampling noise: a stream apart from the
sampler's and the acceptance uniforms' (the rejection rule needs the draft's draws independent
of both)."""


@dataclass
class DraftBlock:
    """One proposal per request."""

    tokens: torch.Tensor
    """int64 ``[b, block_size]`` drafted tokens."""
    probs: torch.Tensor | None
    """``[b, block_size, V]`` the distributions the sampled rows drew from (after the Markov
    bias, at the request's temperature); None when every row is greedy."""
    confidence: torch.Tensor
    """``[b, block_size]`` the confidence head's logit per draft position."""


class PagedDraft:
    """The DSpark draft of a ``RuntimeModel`` in the DSpark layout."""

    def __init__(self, model: Any, weights: dict[str, torch.Tensor]):
        cfg = model.cfg
        dc = draft_config(cfg)
        if dc is None:
            raise ValueError("the model declares no DSpark draft (no dspark_* fields)")
        g = model.pools.geometry
        if g.draft_layers != dc.stages or g.speculative_tokens != dc.block_size:
            raise ValueError(
                f"pool layout {g.layout_id} holds {g.draft_layers} draft rings and "
                f"{g.speculative_tokens} speculative rows; the draft needs {dc.stages} and "
                f"{dc.block_size}"
            )
        self.model, self.cfg, self.draft = model, cfg, dc
        self.dtype, self.device = model.dtype, model.device
        self.acc = acc_dtype(self.dtype)
        self.first_ring = cfg.num_hidden_layers
        w = weights
        stage_cfg = dc.stage_model(cfg)
        self.embed = model.embed
        self.head = model.head
        self.main_proj = REFERENCE_KERNELS.make_linear(w["mtp.0.main_proj.weight"], self.dtype)
        self.main_norm = w["mtp.0.main_norm.weight"]
        last = f"mtp.{dc.stages - 1}."
        self.norm = w[last + "norm.weight"]
        self.markov_embed = w[last + "markov_head.embed.weight"].to(self.acc)
        self.markov_head = w[last + "markov_head.head.weight"].to(self.acc)
        self.confidence_proj = w[last + "confidence_head.proj.weight"].to(self.acc)
        self.attn, self.moe, self.hc_attn, self.hc_ffn = [], [], [], []
        self.attn_norm, self.ffn_norm = [], []
        for k in range(dc.stages):
            p = f"mtp.{k}"
            info = LayerInfo(cfg.num_hidden_layers + k, "decoder", "window", 0, None, None,
                             False, False)  # fmt: skip
            self.attn.append(Attention(cfg, info, w, p, self.dtype))
            self.moe.append(MoE(stage_cfg, w, p, self.dtype))
            for site, out in (("attn", self.hc_attn), ("ffn", self.hc_ffn)):
                parts = (w[f"{p}.hc_{site}_{x}"].to(self.acc) for x in ("fn", "base", "scale"))
                out.append(HcParams(*parts))
            self.attn_norm.append(w[f"{p}.attn_norm.weight"])
            self.ffn_norm.append(w[f"{p}.ffn_norm.weight"])
        W, B = cfg.sliding_window, dc.block_size
        self._ctx = torch.arange(W, device=self.device) - W  # offsets before the anchor
        self._blk = torch.arange(B, device=self.device)

    @property
    def block_size(self) -> int:
        """Tokens a proposal drafts (the verify forward runs one more: the anchor)."""
        return self.draft.block_size

    def ring(self, k: int) -> torch.Tensor:
        """Stage ``k``'s rings across slots ``[slots+1, ring_rows, width]``."""
        return self.model.pools.ring(self.first_ring + k)

    def observe(self, taps: torch.Tensor, slot: torch.Tensor, position: torch.Tensor,
                write_from: torch.Tensor) -> None:  # fmt: skip
        """Seed every stage's ring from target rows: ``taps`` ``[n, len(taps) * D]`` (the stream
        means entering the tap layers), their slots and positions ``[n]``; rows below
        ``write_from`` ``[n]`` (or with slot -1) write nothing."""
        m = self.model
        x = rms_norm(self.main_proj(taps.to(self.dtype)), self.main_norm, self.cfg.rms_norm_eps)
        for k, att in enumerate(self.attn):
            cos, sin = att.rope.cos_sin(position, self.dtype)
            kv = att.window_kv(x, cos, sin)
            m.backend.ring_write(self.ring(k), kv, slot, position, write_from, m.pools.sink_slot)

    def propose(
        self,
        anchor: torch.Tensor,
        anchor_pos: torch.Tensor,
        slot: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        output_index: torch.Tensor,
        sampled: bool = True,
    ) -> DraftBlock:
        """Draft a block after each request's ``anchor`` at ``anchor_pos`` (``[b]`` each; slot
        -1: a row nobody reads). A row with a positive finite ``temperature`` samples with the
        noise of ``(seed ^ DRAFT_SALT, output_index + i)`` (``output_index``: the output index
        of the anchor's successor); ``sampled=False`` (every row greedy) skips that work."""
        cfg, dc, m = self.cfg, self.draft, self.model
        b, B, W = anchor.shape[0], dc.block_size, cfg.sliding_window
        hc, eps, D = cfg.hc_mult, cfg.rms_norm_eps, cfg.hidden_size
        noise = torch.full((b, B - 1), dc.noise_token_id, dtype=torch.long, device=self.device)
        ids = torch.cat([anchor[:, None].to(torch.long), noise], dim=1).reshape(-1)
        pos = (anchor_pos[:, None] + self._blk[None, :]).reshape(-1)
        X = self.embed[ids].to(self.dtype)[:, None, :].expand(b * B, hc, D).contiguous()
        pre_in = torch.zeros(b * B, hc, dtype=self.acc, device=self.device)
        pre_in[:, 0] = 1
        ctx_pos = anchor_pos[:, None] + self._ctx[None, :]  # [b, W], oldest first
        ctx_ok = (ctx_pos >= 0) & (slot >= 0)[:, None]
        rs = torch.where(slot >= 0, slot, m.pools.sink_slot)[:, None].expand(b, W)
        n_keys = W + B
        base = (torch.arange(b, device=self.device) * n_keys)[:, None]
        idx = base + torch.arange(n_keys, device=self.device)[None, :]
        idx = torch.where(torch.cat([ctx_ok, ctx_ok.new_ones(b, B)], dim=1), idx, -1)
        idx = idx.repeat_interleave(B, dim=0)  # [b * B, W + B]: each block row, its request's
        for k, att in enumerate(self.attn):
            a_pre, a_post, a_C = hc_predict(
                X, self.hc_attn[k], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, pre_in), self.attn_norm[k], eps)
            cos, sin = att.rope.cos_sin(pos, self.dtype)
            q, _ = att.q_path(x, cos, sin)
            blk = att.window_kv(x, cos, sin).reshape(b, B, -1)
            ring = self.ring(k)
            held = m.backend.ring_values(
                ring[rs, ctx_pos.clamp(min=0) % ring.shape[1]], cfg.head_dim, blk.dtype
            )
            keys = torch.cat([held, blk], dim=1).reshape(b * n_keys, -1)
            o = sparse_attention(q, keys, idx, att.sink, att.scale)
            X = hc_expand(att.output(o, cos, sin), X, a_post, a_C)
            f_pre, f_post, f_C = hc_predict(
                X, self.hc_ffn[k], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, a_pre), self.ffn_norm[k], eps)
            y, _ = self.moe[k](x)
            X = hc_expand(y, X, f_post, f_C)
            pre_in = f_pre
        x = hc_collapse(X, pre_in).reshape(b, B, D)
        logits = head_logits(rms_norm(x, self.norm, eps), self.head)  # [b, B, V]
        V = logits.shape[-1]
        temp = temperature.to(torch.float32)
        hot = (temp > 0) & torch.isfinite(temp)
        t_div = torch.where(hot, temp, 1.0).to(self.acc)[:, None]
        salted = seed.to(torch.int64) ^ DRAFT_SALT
        tokens, conf, probs = [], [], []
        prev = anchor.to(torch.long)
        for i in range(B):
            e = self.markov_embed[prev]  # [b, r]
            lg = logits[:, i] + e @ self.markov_head.T
            tok = torch.argmax(lg, dim=1)
            if sampled:
                z = lg / t_div
                g = counter_gumbel(salted, output_index + i, V).to(z.dtype)
                tok = torch.where(hot, torch.argmax(z + g, dim=1), tok)
                probs.append(torch.softmax(z, dim=1))
            tokens.append(tok)
            feat = torch.cat([x[:, i].to(self.acc), e], dim=1)
            conf.append(feat @ self.confidence_proj[0])
            prev = tok
        return DraftBlock(
            torch.stack(tokens, dim=1),
            torch.stack(probs, dim=1) if sampled else None,
            torch.stack(conf, dim=1),
        )
