"""Training the V4.1 model: the dense reference's arithmetic, batched, under autograd.

``TrainModel`` holds float master weights for every published tensor and runs a batch of
sequences from position 0 with the building blocks of ``layers`` (the same code the reference
and the paged runtime call). Each forward fake-quantizes the masters to their published formats
(FP8 E4M3 with 32x32 E8M0 blocks, FP4 E2M1 with E8M0 per 32, bf16) and the activations and
caches as inference does, all straight-through (``quant.straight_through``): the forward values
are exactly what a checkpoint written by ``export_state`` computes, so training optimizes the
model that is served. ``tests/model/test_train.py`` checks the logits against
``ReferenceModel.prefill`` of the exported checkpoint in float64.

Two things have no gradient in the published model and are trained apart:

- **The indexer's top-k** is discrete. Its scores are trained by an auxiliary KL divergence
  toward the layer's own attention over every visible compressed row (detached, heads
  averaged), with the indexer's inputs detached so that the loss reaches only the indexer
  (``indexer.*`` weights); ``dense=True`` forwards (the warm-up) attend to every visible
  compressed row instead of the top-k, so the attention learns what to look for before the
  selection has to find it.
- **Expert routing** uses the published auxiliary-loss-free balancing: each step
  ``gate.bias += rate * sign(mean load - load)`` per expert (``update_router_bias``), no
  balance loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.model.checkpoint import random_state, tensor_table
from v41plan.model.config import ModelConfig
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
from v41plan.model.quant import (
    dequant_fp4_weight,
    dequant_fp8_blocks,
    dequant_fp8_weight,
    quantize_fp4_weight,
    quantize_fp8_blocks,
    quantize_fp8_weight,
    straight_through,
    to_bf16,
    warm_tables,
)


def _fp8_value(w: torch.Tensor) -> torch.Tensor:
    """Dense weights ``[..., out, in]`` on their published FP8 grid (E4M3, 32x32 E8M0 blocks),
    in ``w.dtype``."""
    return dequant_fp8_weight(*quantize_fp8_weight(w), w.dtype)


def _fp4_value(w: torch.Tensor) -> torch.Tensor:
    """Fused experts ``[E, out, in]`` on the published FP4 grid (E2M1, E8M0 per 32)."""
    flat = w.reshape(-1, w.shape[-1])  # per-row blocks: fusing experts changes no block
    return dequant_fp4_weight(*quantize_fp4_weight(flat), w.dtype).reshape(w.shape)


def _cast_value(dtype: torch.dtype):
    """The rounding of a plain tensor to its published dtype, back in the master's dtype."""

    def value(w: torch.Tensor) -> torch.Tensor:
        return (to_bf16(w) if dtype == torch.bfloat16 else w.to(dtype)).to(w.dtype)

    return value


@dataclass
class Batch:
    """One training batch on the device."""

    ids: torch.Tensor
    """Token ids ``[B, S]`` (int64)."""
    targets: torch.Tensor
    """Next-token ids ``[B, S]`` (int64; -100 is not scored)."""
    engram_rows: torch.Tensor
    """Engram table rows ``[B, S, n_engram_layers, cols]`` (int64), as ``EngramHost.prepare``
    gives for each sequence from position 0."""


class TrainModel:
    """Master weights of every published tensor and the batched training forward."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        init_state: dict[str, torch.Tensor] | None = None,
        compile_hc: bool = False,
    ):
        """Masters from ``init_state`` (published tensors: a checkpoint to go on training),
        else from the ``init-checkpoint`` weights of ``seed``. ``compile_hc`` runs the mHC
        prediction (its Sinkhorn loop is a third of a step's operations) through
        ``torch.compile``: a few fused kernels forward and backward, equal to the eager
        arithmetic up to float32 rounding order."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.compiled_hc = CompiledOrEager(_hc_predict_flat) if compile_hc else None
        """The compiled mHC prediction (None: eager); its ``error`` says why it fell back."""
        self.hc_predict = self.compiled_hc or _hc_predict_flat
        specs = tensor_table(cfg)
        state = random_state(cfg, seed) if init_state is None else init_state
        self.kinds: dict[str, tuple[str, torch.dtype]] = {}
        """Master name -> (``plain`` | ``fp8`` | ``fp4`` | ``table``, published dtype)."""
        self.masters: dict[str, torch.Tensor] = {}
        E = cfg.n_routed_experts
        for t in specs:
            if t.kind in ("fp8_scale", "fp4_scale", "table_scale"):
                continue
            if t.kind == "fp4":
                name = t.name.split(".experts.")[0] + ".experts." + t.name.split(".")[-2]
                if name in self.masters:
                    continue
                per = [
                    dequant_fp4_weight(
                        state[name.replace(".experts.", f".experts.{e}.") + ".weight"],
                        state[name.replace(".experts.", f".experts.{e}.") + ".scale"],
                        dtype,
                    )
                    for e in range(E)
                ]
                self.kinds[name] = ("fp4", t.dtype)
                self.masters[name] = torch.stack(per)
            elif t.kind == "fp8":
                scale = state[t.name[: -len(".weight")] + ".scale"]
                self.kinds[t.name] = ("fp8", t.dtype)
                self.masters[t.name] = dequant_fp8_weight(state[t.name], scale, dtype)
            elif t.kind == "table":
                scale = state[t.name[: -len(".weight")] + ".scale"]
                self.kinds[t.name] = ("table", t.dtype)
                self.masters[t.name] = dequant_fp8_blocks(state[t.name], scale, dtype)
            else:
                self.kinds[t.name] = ("plain", t.dtype)
                self.masters[t.name] = state[t.name].to(dtype)
        self.masters = {k: v.to(self.device).contiguous() for k, v in self.masters.items()}
        self.groups: dict[tuple, list[str]] = {}
        """(kind, published dtype, shape) -> the masters ``processed`` rounds together."""
        for name, (kind, pdtype) in self.kinds.items():
            if kind != "table":
                key = (kind, pdtype, tuple(self.masters[name].shape))
                self.groups.setdefault(key, []).append(name)
        self.biases = {k for k in self.masters if k.endswith(".ffn.gate.bias")}
        """Router biases: updated by the balancing rule, not by gradients."""
        for k, v in self.masters.items():
            v.requires_grad_(k not in self.biases)
        if self.device.type == "cuda":
            warm_tables(self.device)  # the E2M1/E8M0 tables exist before any graph capture
        with torch.no_grad():
            w = self.processed()
        self.attn = [Attention(cfg, i, w, f"layers.{i.index}", dtype) for i in cfg.layers]
        self.moe = [MoE(cfg, w, f"layers.{i.index}", dtype) for i in cfg.layers]
        self.engram_layers = {
            i.index: EngramLayer(cfg, w, f"layers.{i.index}", dtype) for i in cfg.layers if i.engram
        }

    def parameters(self) -> list[torch.Tensor]:
        """The master weights the optimizer updates (router biases excluded)."""
        return [v for k, v in self.masters.items() if k not in self.biases]

    def processed(self) -> dict[str, torch.Tensor]:
        """The weights the layers read: every master on its published grid (straight-through),
        Engram tables apart (their rows are quantized as they are gathered). Masters of one
        format and shape are rounded stacked, in one pass a group: the same values as one
        at a time (``tests/model/test_train.py``) in a few dozen operations instead of
        tens of thousands."""
        w = {}
        for (kind, dtype, _shape), names in self.groups.items():
            ms = [self.masters[n] for n in names]
            # a leading dim changes no block of either format
            value = {"fp8": _fp8_value, "fp4": _fp4_value}.get(kind) or _cast_value(dtype)
            if len(ms) == 1:
                w[names[0]] = straight_through(ms[0], value)
                continue
            w.update(zip(names, straight_through(torch.stack(ms), value).unbind(0), strict=True))
        return w

    @torch.no_grad()
    def export_state(self) -> dict[str, torch.Tensor]:
        """The published tensors of the current weights (``checkpoint.write_state`` writes
        them): quantized exactly as ``processed`` rounds them."""
        out: dict[str, torch.Tensor] = {}
        for name, (kind, dtype) in self.kinds.items():
            m = self.masters[name].detach().to(torch.float32).cpu()
            if kind == "fp8":
                out[name], out[name[: -len(".weight")] + ".scale"] = quantize_fp8_weight(m)
            elif kind == "table":
                out[name], out[name[: -len(".weight")] + ".scale"] = quantize_fp8_blocks(m)
            elif kind == "fp4":
                for e in range(m.shape[0]):
                    base = name.replace(".experts.", f".experts.{e}.")
                    out[base + ".weight"], out[base + ".scale"] = quantize_fp4_weight(m[e])
            else:
                v = self.masters[name].detach().cpu()
                out[name] = to_bf16(v) if dtype == torch.bfloat16 else v.to(dtype)
        return out

    # --- forward -------------------------------------------------------------------------

    def forward(self, batch: Batch, dense: bool = False) -> tuple[torch.Tensor, dict]:
        """Logits ``[B*S, vocab]`` (acc dtype) and ``aux``: ``index_kl`` (mean over index layers
        of the indexer's KL loss) and ``expert_load`` ``[layers, E]`` (fraction of routed
        picks per expert). ``dense`` attends to every visible compressed row (warm-up)."""
        cfg = self.cfg
        ids = batch.ids
        B, S = ids.shape
        N = B * S
        if 2 in cfg.compress_ratios and S % 2:
            raise ValueError(f"sequence length {S} must be even (ratio-2 pairs)")
        w = self.processed()
        for obj in (*self.attn, *self.moe, *self.engram_layers.values()):
            obj.bind(w)
        acc = acc_dtype(self.dtype)
        positions = torch.arange(S, device=self.device).repeat(B)
        seq = torch.arange(B, device=self.device).repeat_interleave(S)
        win = window_indices(torch.arange(S, device=self.device), cfg.sliding_window)
        win = win[None].expand(B, S, -1) + (torch.arange(B, device=self.device) * S)[:, None, None]
        win = torch.where(win >= (torch.arange(B, device=self.device) * S)[:, None, None], win, -1)
        ctx = _Context(B, S, positions, seq, win.reshape(N, -1), dense)
        h = w["embed.weight"][ids.reshape(-1)].to(self.dtype)
        X = h[:, None, :].expand(N, cfg.hc_mult, cfg.hidden_size).contiguous()
        pre_in = torch.zeros(N, cfg.hc_mult, dtype=acc, device=self.device)
        pre_in[:, 0] = 1
        loads = []
        eps = cfg.rms_norm_eps
        hc_args = (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        for info in cfg.layers:
            L = info.index
            p = f"layers.{L}"
            if info.engram:
                li = cfg.engram_layer_ids.index(L)
                rows = batch.engram_rows[:, :, li].reshape(N, -1)
                table = self.masters[f"{p}.engram.embed.weight"]
                emb = straight_through(
                    table[rows], lambda r: dequant_fp8_blocks(*quantize_fp8_blocks(r), r.dtype)
                )
                X = self.engram_layers[L](X, emb, None)
            hc_a = HcParams(*(w[f"{p}.hc_attn_{k}"].to(acc) for k in ("fn", "base", "scale")))
            hc_f = HcParams(*(w[f"{p}.hc_ffn_{k}"].to(acc) for k in ("fn", "base", "scale")))
            a_pre, a_post, a_C = self.hc_predict(X, hc_a.fn, hc_a.base, hc_a.scale, *hc_args)
            x = rms_norm(hc_collapse(X, pre_in), w[f"{p}.attn_norm.weight"], eps)
            y = self._attention(L, x, ctx)
            X = hc_expand(y, X, a_post, a_C)
            f_pre, f_post, f_C = self.hc_predict(X, hc_f.fn, hc_f.base, hc_f.scale, *hc_args)
            x = rms_norm(hc_collapse(X, a_pre), w[f"{p}.ffn_norm.weight"], eps)
            y, experts = self.moe[L](x)
            counts = torch.zeros(cfg.n_routed_experts, dtype=acc, device=self.device)
            loads.append(
                counts.index_add_(
                    0, experts.reshape(-1), torch.ones_like(experts.reshape(-1), dtype=acc)
                )
                / experts.numel()
            )
            X = hc_expand(y, X, f_post, f_C)
            pre_in = f_pre
        x = rms_norm(hc_collapse(X, pre_in), w["norm.weight"], eps)
        logits = F.linear(x.to(acc), w["head.weight"].to(acc))
        kl = torch.stack(ctx.kl).mean() if ctx.kl else torch.zeros((), device=self.device)
        return logits, {"index_kl": kl, "expert_load": torch.stack(loads)}

    def _attention(self, L: int, x: torch.Tensor, ctx: _Context) -> torch.Tensor:
        cfg = self.cfg
        att, info = self.attn[L], cfg.layers[L]
        B, S, N = ctx.B, ctx.S, ctx.B * ctx.S
        cos, sin = att.rope.cos_sin(ctx.positions, self.dtype)
        q, qr = att.q_path(x, cos, sin)
        kv = att.window_kv(x, cos, sin)
        if info.ratio == 0:
            return att.output(sparse_attention(q, kv, ctx.win, att.sink, att.scale), cos, sin)
        if info.role == "full":
            ctx.owners[L] = self._compress(att, x, ctx)
        comp, keys = ctx.owners[info.kv_owner]
        M = comp.shape[1]
        vis = visible_rows(ctx.positions, info.ratio)
        hidden = torch.arange(M, device=self.device)[None] >= vis[:, None]  # [N, M]
        if info.role in ("full", "reindex"):
            # the indexer's own inputs are detached: its KL loss trains the indexer alone
            qi, _, wts = att.index_queries(qr.detach(), x.detach(), cos, sin, None)
            scores = att.index_scores(
                qi.reshape(B, S, *qi.shape[1:]), None, wts.reshape(B, S, -1), keys, None
            ).reshape(N, M)
            scores = scores.masked_fill(hidden, NEG_INF)
            ctx.kl.append(self._index_kl(q, comp, scores, hidden, att.scale, ctx))
            if L == cfg.candidate_source_layer_id:
                ctx.cand = candidate_mask(
                    scores, vis, cfg.candidate_block_size, cfg.candidate_topk_blocks
                )
            if info.role == "reindex" and info.uses_candidates:
                scores = scores.masked_fill(~ctx.cand, NEG_INF)
            top = topk_ids(scores.detach(), cfg.index_topk)
            ctx.selections[L] = top
        else:
            top = ctx.selections[info.topk_owner]
        if ctx.dense:
            o = _dense_attention(q, kv, ctx.win, comp, hidden, att.sink, att.scale, B)
        else:
            rows = torch.where(top >= 0, top + N + (ctx.seq * M)[:, None], -1)
            kv_all = torch.cat([kv, comp.reshape(B * M, -1).to(kv.dtype)])
            idx = torch.cat([ctx.win, rows], dim=1)
            o = sparse_attention(q, kv_all, idx, att.sink, att.scale)
        return att.output(o, cos, sin)

    def _compress(
        self, att: Attention, x: torch.Tensor, ctx: _Context
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An owner's compressed rows ``[B, M, d]`` and index keys ``[B, M, ihd]`` (keys from
        the detached latent: only the indexer loss trains them)."""
        B, S = ctx.B, ctx.S
        v, g = att.compress_project(x)
        if att.ratio == 1:
            latent = att.ratio1_latent(v)
            first = ctx.positions
        else:
            v2, g2 = v.reshape(B * S // 2, 2, -1), g.reshape(B * S // 2, 2, -1)
            latent = att.pool(v2[:, 0], g2[:, 0], v2[:, 1], g2[:, 1])
            first = ctx.positions.reshape(-1, 2)[:, 0]
        cos, sin = att.rope.cos_sin(first, self.dtype)
        keys, _ = att.index_keys(latent.detach(), cos, sin, None)
        comp = att.compressed_kv(latent, cos, sin)
        return comp.reshape(B, -1, comp.shape[-1]), keys.reshape(B, -1, keys.shape[-1])

    @staticmethod
    def _index_kl(q, comp, scores, hidden, scale, ctx) -> torch.Tensor:
        """KL(attention over the visible compressed rows || softmax of the index scores), mean
        over query rows that see any row; the target is detached."""
        B, S = ctx.B, ctx.S
        N, H, d = q.shape
        a = acc_dtype(q.dtype)
        with torch.no_grad():
            logits = torch.einsum("bshd,bmd->bshm", q.reshape(B, S, H, d).to(a), comp.to(a))
            logits = (logits * scale).reshape(N, H, -1).masked_fill(hidden[:, None], NEG_INF)
            target = torch.softmax(logits, -1).nan_to_num(0.0).mean(1)  # [N, M]
        logq = torch.log_softmax(scores.to(a), -1)
        seen = ~hidden
        term = torch.where(seen, target * (torch.log(target.clamp_min(1e-30)) - logq), 0.0)
        rows = seen.any(-1)
        return (term.sum(-1) * rows).sum() / rows.sum().clamp_min(1)

    @torch.no_grad()
    def update_router_bias(self, expert_load: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the
        over-loaded ones', by ``rate`` each step (no host sync)."""
        mean = 1.0 / self.cfg.n_routed_experts
        for info in self.cfg.layers:
            b = self.masters[f"layers.{info.index}.ffn.gate.bias"]
            b.add_(torch.sign(mean - expert_load[info.index]).to(b.dtype), alpha=rate)


class CompiledOrEager:
    """``torch.compile(fn)``; if compiling fails (a backend missing on this machine), says so
    once and runs ``fn`` eagerly from then on."""

    def __init__(self, fn, backend: str = "inductor"):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)
        self.error: str | None = None

    def __call__(self, *args):
        if self.error is None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
                self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(f"torch.compile of {self.fn.__name__} failed ({self.error}); running eagerly")
        return self.fn(*args)


def _hc_predict_flat(X, fn, base, scale, hc, iters, hc_eps, norm_eps):
    """``hc_predict`` over plain tensor arguments (what ``torch.compile`` traces)."""
    return hc_predict(X, HcParams(fn, base, scale), hc, iters, hc_eps, norm_eps)


@dataclass
class _Context:
    """Per-forward state shared by the layers."""

    B: int
    S: int
    positions: torch.Tensor
    seq: torch.Tensor
    win: torch.Tensor
    dense: bool

    def __post_init__(self) -> None:
        self.owners: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.selections: dict[int, torch.Tensor] = {}
        self.cand: torch.Tensor | None = None
        self.kl: list[torch.Tensor] = []


def _dense_attention(q, kv, win, comp, hidden, sink, scale, B) -> torch.Tensor:
    """``sparse_attention`` over the window rows plus every visible compressed row, without
    gathering the compressed rows per query (the warm-up's attention)."""
    N, H, d = q.shape
    a = acc_dtype(q.dtype)
    S = N // B
    valid = win >= 0
    g = kv[win.clamp(min=0)].to(a)  # [N, W, d]
    lw = torch.einsum("nhd,nkd->nhk", q.to(a), g) * scale
    lw = lw.masked_fill(~valid[:, None, :], NEG_INF)
    ca = comp.to(a)
    lc = torch.einsum("bshd,bmd->bshm", q.reshape(B, S, H, d).to(a), ca) * scale
    lc = lc.reshape(N, H, -1).masked_fill(hidden[:, None], NEG_INF)
    s = sink.to(a)[None, :]
    m = torch.maximum(torch.maximum(lw.amax(-1), lc.amax(-1)), s)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    pw, pc = torch.exp(lw - m[..., None]), torch.exp(lc - m[..., None])
    den = pw.sum(-1) + pc.sum(-1) + torch.exp(s - m)
    o = torch.einsum("nhk,nkd->nhd", pw, g)
    o = o + torch.einsum("bshm,bmd->bshd", pc.reshape(B, S, H, -1), ca).reshape(N, H, d)
    o = o / den.clamp_min(torch.finfo(a).tiny)[..., None]
    return o.to(q.dtype)


def engram_rows(host: EngramHost, ids: np.ndarray) -> np.ndarray:
    """Engram rows ``[B, S, n_layers, cols]`` of each sequence of ``ids`` ``[B, S]`` from
    position 0 (what inference hashes for the same tokens)."""
    B, S = ids.shape
    cu = np.arange(B + 1, dtype=np.int64) * S
    hist = np.full((B, host.layout.history_len), -1, dtype=np.int64)
    rows, _ = host.prepare_batch(ids.reshape(-1), cu, hist)
    return rows.reshape(B, S, *rows.shape[1:])
