"""The DSpark draft's configuration and its published tensors (``mtp.{k}.*``).

A V4.1 config enables DSpark with the six ``dspark_*`` fields (all or none) and
``num_nextn_predict_layers`` draft stages. ``draft_config`` reads and checks them from a
``ModelConfig`` (they travel in its ``extra``, as published); ``draft_tensor_table`` lists the
stages' tensors under their published names and formats (``../shared/reference``
model_arithmetic section 8): each stage the block of a window-only layer with its own
``dspark_n_routed_experts`` experts, stage 0 adds ``main_proj``/``main_norm``, the last stage
adds ``norm``, the Markov head and the confidence head.

The published index holds 2,401 ``mtp.*`` tensors; this table names 2,398 of them at the
published widths. The loader reads tensors by this table, so a published checkpoint's other
three load as nothing (they are not read).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from v41plan.geometry.runtime import DSPARK_FIELDS, LayerInfo


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark draft's hyperparameters (published ``dspark_*`` field meanings)."""

    stages: int
    """Draft stages ``mtp.0 .. mtp.{stages-1}`` (``num_nextn_predict_layers``)."""
    block_size: int
    """Tokens per draft block: the anchor plus ``block_size - 1`` noise tokens in, as many
    draft tokens out."""
    taps: tuple[int, ...]
    """Backbone layers whose entering residual (mean over streams) the draft reads."""
    noise_token_id: int
    """The token filling the draft block after the anchor."""
    markov_rank: int
    """Width of the Markov head's low-rank bigram."""
    n_routed_experts: int
    """Routed experts of each draft stage's MoE."""
    num_experts_per_tok: int
    """Experts each draft token is routed to."""

    def stage_model(self, cfg: Any) -> Any:
        """``cfg`` with the draft MoE's expert counts: what a stage's ``MoE`` reads."""
        return replace(
            cfg,
            n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
        )


def draft_config(cfg: Any) -> DraftConfig | None:
    """The DSpark draft of ``cfg`` (a ``ModelConfig``), None when it sets no ``dspark_*``
    field; ``ValueError`` naming the field when the set is partial or a value is out of range
    (the rules the spec compiler applies to a ``model:`` section)."""
    extra = cfg.extra
    given = [f for f in DSPARK_FIELDS if f in extra]
    if not given:
        return None
    missing = [f for f in DSPARK_FIELDS if f not in extra]
    if missing:
        raise ValueError(
            f"{given[0]} is set but {', '.join(missing)} not: a DSpark draft needs every "
            "dspark_* field"
        )

    def count(name: str, lo: int = 1) -> int:
        v = extra[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        return v

    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("num_nextn_predict_layers 0 leaves the DSpark draft no stage")
    taps = extra["dspark_target_layer_ids"]
    if not isinstance(taps, list | tuple) or not taps:
        raise ValueError(f"dspark_target_layer_ids must be a non-empty list, got {taps!r}")
    for x in taps:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < cfg.num_hidden_layers:
            raise ValueError(
                f"dspark_target_layer_ids: {x!r} is not a backbone layer "
                f"[0, {cfg.num_hidden_layers})"
            )
        if x in cfg.engram_layer_ids:
            raise ValueError(f"dspark_target_layer_ids: DSpark tap {x} is an Engram layer")
    if list(taps) != sorted(set(taps)):
        raise ValueError(f"dspark_target_layer_ids {list(taps)} must be sorted and unique")
    noise = count("dspark_noise_token_id", 0)
    if noise >= cfg.vocab_size:
        raise ValueError(
            f"dspark_noise_token_id {noise} is outside the vocabulary [0, {cfg.vocab_size})"
        )
    experts = count("dspark_n_routed_experts")
    k = count("dspark_num_experts_per_tok")
    if k > experts:
        raise ValueError(
            f"dspark_num_experts_per_tok {k} is outside 1..dspark_n_routed_experts = 1..{experts}"
        )
    return DraftConfig(
        stages=cfg.num_nextn_predict_layers,
        block_size=count("dspark_block_size"),
        taps=tuple(taps),
        noise_token_id=noise,
        markov_rank=count("dspark_markov_rank"),
        n_routed_experts=experts,
        num_experts_per_tok=k,
    )


def draft_prefixes(cfg: Any) -> list[str]:
    """``mtp.0 .. mtp.{stages-1}``; empty without a DSpark draft."""
    d = draft_config(cfg)
    return [] if d is None else [f"mtp.{k}" for k in range(d.stages)]


# --- the dense reference draft --------------------------------------------------------------


@dataclass
class DraftOutput:
    """One draft block: the drafted tokens, the logits they were picked from (Markov bias
    included) and the confidence logit of each draft position."""

    tokens: list[int]
    logits: Any
    """``[block_size, vocab]`` in the acc dtype."""
    confidence: Any
    """``[block_size]`` in the acc dtype."""


class DraftReference:
    """The dense DSpark draft over processed weights (``LoadedCheckpoint.process`` of a
    ``speculative`` load), beside a ``ReferenceModel`` whose ``taps`` it reads.

    ``observe(main_hidden, positions)`` seeds every stage's window ring at target positions
    (``kv = FP8QAT(RoPE(kv_norm(wkv_k(main_x))))``, ``main_x = RMSNorm(main_proj(taps))``);
    nothing is drafted. ``propose(anchor, anchor_pos)`` drafts one block: the block
    ``[anchor, noise, ...]`` at positions ``anchor_pos ..`` runs through the stages, each block
    query seeing the ring rows of the ``sliding_window`` target positions before
    ``anchor_pos`` and every block row (bidirectional); the head of the last stage then gives one
    logits row per block position, and tokens are picked one position at a time after adding
    the Markov bias of the previous token (the anchor first).
    """

    def __init__(
        self,
        cfg: Any,
        weights: dict[str, Any],
        dtype: Any = None,
        device: Any = "cpu",
    ):
        import torch

        from v41plan.model.layers import REFERENCE_KERNELS, Attention, HcParams, MoE, acc_dtype

        dc = draft_config(cfg)
        if dc is None:
            raise ValueError("the model declares no DSpark draft (no dspark_* fields)")
        self.cfg, self.draft = cfg, dc
        self.dtype = torch.float32 if dtype is None else dtype
        self.acc = acc_dtype(self.dtype)
        self.device = torch.device(device)
        w = weights
        stage_cfg = dc.stage_model(cfg)
        self.embed = w["embed.weight"]
        self.head = w["head.weight"].to(self.acc)
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
            info = LayerInfo(
                index=cfg.num_hidden_layers + k,
                segment="decoder",
                role="window",
                ratio=0,
                kv_owner=None,
                topk_owner=None,
                uses_candidates=False,
                engram=False,
            )
            self.attn.append(Attention(cfg, info, w, p, self.dtype))
            self.moe.append(MoE(stage_cfg, w, p, self.dtype))
            for site, out in (("attn", self.hc_attn), ("ffn", self.hc_ffn)):
                parts = (w[f"{p}.hc_{site}_{x}"].to(self.acc) for x in ("fn", "base", "scale"))
                out.append(HcParams(*parts))
            self.attn_norm.append(w[f"{p}.attn_norm.weight"])
            self.ffn_norm.append(w[f"{p}.ffn_norm.weight"])
        self.reset()

    def reset(self) -> None:
        """Empty every stage's ring (a new sequence)."""
        import torch

        R, d = self.ring_rows, self.cfg.head_dim
        self.ring = [torch.zeros(R, d, dtype=self.dtype, device=self.device) for _ in self.attn]
        self.ring_pos = [
            torch.full((R,), -1, dtype=torch.long, device=self.device) for _ in self.attn
        ]

    @property
    def ring_rows(self) -> int:
        """Rows of each stage's ring: the window plus one block, so rows seeded ahead of an
        anchor (a verify's rejected rows) never overwrite the window it reads."""
        return self.cfg.sliding_window + self.draft.block_size

    def main_x(self, main_hidden: Any) -> Any:
        """``RMSNorm(main_proj(concat taps))`` ``[n, D]`` from taps ``[n, D * len(taps)]``."""
        from v41plan.model.layers import rms_norm

        x = self.main_proj(main_hidden.to(self.dtype))
        return rms_norm(x, self.main_norm, self.cfg.rms_norm_eps)

    def observe(self, main_hidden: Any, positions: Any) -> None:
        """Seed the rings with the target rows at ``positions`` (``[n]``; their taps
        ``main_hidden`` ``[n, D * len(taps)]``): prefill, or the accepted rows of a verify."""
        import torch

        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        x = self.main_x(main_hidden)
        R = self.ring_rows
        for k, att in enumerate(self.attn):
            cos, sin = att.rope.cos_sin(positions, self.dtype)
            kv = att.window_kv(x, cos, sin)
            slots = positions[-R:] % R
            self.ring[k][slots] = kv[-R:]
            self.ring_pos[k][slots] = positions[-R:]

    def propose(
        self, anchor: int, anchor_pos: int, temperature: float = 0.0, generator: Any = None
    ) -> DraftOutput:
        """Draft ``block_size`` tokens after ``anchor`` (at ``anchor_pos``); greedy at
        temperature 0, else Gumbel-max from ``generator`` at that temperature."""
        import torch
        import torch.nn.functional as F

        from v41plan.model.layers import (
            hc_collapse,
            hc_expand,
            hc_predict,
            rms_norm,
            sparse_attention,
        )

        cfg, dc = self.cfg, self.draft
        B, hc, eps = dc.block_size, cfg.hc_mult, cfg.rms_norm_eps
        ids = torch.tensor([int(anchor)] + [dc.noise_token_id] * (B - 1), device=self.device)
        positions = anchor_pos + torch.arange(B, device=self.device)
        X = self.embed[ids].to(self.dtype)[:, None, :].expand(B, hc, cfg.hidden_size).contiguous()
        pre_in = torch.zeros(B, hc, dtype=self.acc, device=self.device)
        pre_in[:, 0] = 1
        for k, att in enumerate(self.attn):
            a_pre, a_post, a_C = hc_predict(
                X, self.hc_attn[k], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, pre_in), self.attn_norm[k], eps)
            cos, sin = att.rope.cos_sin(positions, self.dtype)
            q, _ = att.q_path(x, cos, sin)
            held = self.ring_pos[k]
            ctx = (held >= max(0, anchor_pos - cfg.sliding_window)) & (held < anchor_pos)
            keys = torch.cat([self.ring[k][ctx], att.window_kv(x, cos, sin)])
            idx = torch.arange(keys.shape[0], device=self.device)[None].expand(B, -1)
            y = att.output(sparse_attention(q, keys, idx, att.sink, att.scale), cos, sin)
            X = hc_expand(y, X, a_post, a_C)
            f_pre, f_post, f_C = hc_predict(
                X, self.hc_ffn[k], hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps
            )
            x = rms_norm(hc_collapse(X, a_pre), self.ffn_norm[k], eps)
            y, _ = self.moe[k](x)
            X = hc_expand(y, X, f_post, f_C)
            pre_in = f_pre
        x = hc_collapse(X, pre_in)
        logits = F.linear(rms_norm(x, self.norm, eps).to(self.acc), self.head)
        tokens, conf, prev = [], [], int(anchor)
        for i in range(B):
            e = self.markov_embed[prev]
            logits[i] += self.markov_head @ e
            if temperature > 0:
                u = torch.rand(logits.shape[1], generator=generator, dtype=torch.float64)
                g = -torch.log(-torch.log(u.clamp_min(1e-300))).to(self.device, self.acc)
                prev = int(torch.argmax(logits[i] / temperature + g))
            else:
                prev = int(torch.argmax(logits[i]))
            tokens.append(prev)
            feat = torch.cat([x[i].to(self.acc), e])
            conf.append((self.confidence_proj @ feat)[0])
        return DraftOutput(tokens, logits, torch.stack(conf))


@dataclass
class SpeculativeStats:
    """Acceptance counters of a speculative run."""

    drafted: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Draft tokens the target accepted."""
    histogram: list[int] | None = None
    """``histogram[a]``: draft blocks with ``a`` accepted tokens (``0 .. block_size``)."""


def speculative_greedy(
    target: Any, draft: DraftReference, prompt: list[int], max_tokens: int
) -> tuple[list[int], SpeculativeStats]:
    """Greedy decoding of ``max_tokens`` tokens with DSpark drafts, on the dense references:
    (tokens, counters). Each round drafts a block after the anchor and feeds the target the
    anchor and the drafts one row at a time (the dense reference decodes one row per call),
    accepting drafts while they equal the target's argmax; the token after them (a
    correction, or the bonus after a whole block) is the next anchor. The draft's rings see
    the target rows of accepted tokens only, so the tokens are the target's greedy tokens."""
    import torch

    B = draft.draft.block_size
    stats = SpeculativeStats(histogram=[0] * (B + 1))
    logits = target.prefill(prompt)
    draft.reset()
    draft.observe(target.taps, torch.arange(len(prompt)))
    out = [int(torch.argmax(logits[-1]))]
    pos = len(prompt)  # the anchor's position
    while len(out) < max_tokens:
        proposal = draft.propose(out[-1], pos).tokens
        stats.drafted += B
        accepted = 0
        for i in range(B + 1):  # the anchor, then each accepted draft
            lg = target.decode(out[-1])
            draft.observe(target.taps, [pos + i])
            tok = int(torch.argmax(lg))
            hit = i < B and tok == proposal[i]
            out.append(tok)
            accepted += hit
            if not hit or len(out) >= max_tokens:
                break
        stats.accepted += accepted
        stats.histogram[accepted] += 1
        pos += accepted + 1
    return out[:max_tokens], stats
