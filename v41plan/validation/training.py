"""``v41plan train``: train a small V4.1 on the quality tasks' synthetic corpus.

The corpus is generated on the fly with a fixed seed from the generators of
``quality_tasks`` (key-value recall and copying past the window, arithmetic), never repeating a
held-out document; each sequence holds recall and copy documents of random lengths up to the
tasks' own (the first from position 0, as the tasks present them) while they fit, then
arithmetic ones, ``eos`` between documents. The model is
``model.train.TrainModel``: the published arithmetic with straight-through quantizers, an
indexer KL loss, auxiliary-loss-free router balancing, and a dense warm-up in which attention
reads every visible compressed row. AdamW with a linear warm-up and cosine decay, gradient
clipping at 1.

On CUDA the whole step (forward, backward, clipping, AdamW, router-bias update) is captured
as a CUDA graph (one per attention mode) and replayed: the eager step is launch-bound. Writes
into ``--out`` a published-layout checkpoint (``checkpoint.write_state``; the loader and the
engine read it like any other), ``train_log.json`` (options, per-step losses, timings) and
``loss.png``.
"""

from __future__ import annotations

import json
import math
import random
import struct
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from v41plan.model.checkpoint import engram_token_map, write_state
from v41plan.model.config import ModelConfig
from v41plan.model.engram import EngramHost
from v41plan.model.train import Batch, TrainModel, engram_rows
from v41plan.validation.quality_tasks import (
    COPY_CODE_LETTERS,
    EVAL_SEED,
    GENERATORS,
    RECALL_KEYS,
    documents,
)

SHORT_COPY_FILLER_CHARS = 4
"""Filler of a short copy document: each code letter then sits 26 + filler rows behind the
row that copies it, inside quality40's 32-row window."""

ANSWER_KINDS = ("sum", "copy_in_window", "copy_past_window", "recall", "recall_more")
"""What an answer token answers; a mark ``k > 0`` is ``ANSWER_KINDS[k - 1]``, 0 no answer.
Training logs the argmax accuracy of each kind apart. ``recall`` is the task's own question (a
key from the list's first third); ``recall_more`` the further questions of a multi-query list
(``recall_questions``)."""

LOGGED_KINDS = (*ANSWER_KINDS, "recall_lead")
"""The accuracies training logs: each answer kind, then ``recall_lead``, the first digit of
every recall answer (``recall`` and ``recall_more``). A recall answer's other tokens are the
leading space and digits that follow once the first is forced, so a lookup that lands on the
wrong pair of the list still scores most of them; the first digit is the lookup."""


def recall_lead_mask(answer: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` marks (``ANSWER_KINDS``) -> bool: the first digit of each recall answer, the
    second token of a ``recall`` answer (the task's ``" 1234"``) and the first of a
    ``recall_more`` one (``"answer: "`` ends in the space)."""

    def after(x: torch.Tensor, k: int) -> torch.Tensor:  # x shifted k tokens later
        return torch.cat((torch.zeros_like(x[:, :k]), x[:, : x.shape[1] - k]), 1)[:, : x.shape[1]]

    first = answer == ANSWER_KINDS.index("recall") + 1
    more = answer == ANSWER_KINDS.index("recall_more") + 1
    return (first & after(first, 1) & ~after(first, 2)) | (more & ~after(more, 1))


@dataclass
class TrainOptions:
    """What ``train`` does; the defaults are the first of the two runs behind the committed
    checkpoint (``checkpoints/quality40/README.md``)."""

    steps: int = 540
    """Optimizer steps."""
    batch_seqs: int = 16
    """Sequences per step."""
    seq_tokens: int = 640
    """Tokens per sequence (even: ratio-2 pairs close inside it)."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 60
    """Linear learning-rate warm-up."""
    dense_steps: int = 135
    """Steps whose attention reads every visible compressed row (then the index top-k)."""
    copy_share: float = 0.5
    """Copy documents among the recall and copy ones (``Corpus``)."""
    short_copy_share: float = 0.3
    """Copies whose code lies inside the window of its repeat (``Corpus``). A head at a fixed
    offset copies those, which is all the 40-layer runs behind the committed checkpoint
    learned; copies past the window need a lookup by content (0 leaves them out)."""
    max_filler_chars: int = 420
    """Longest copy filler drawn (the task's own: 420). With 5 to 40 or 5 to 100 characters, a
    4-layer model learns the lookup by content from scratch in about 250 steps
    (``scripts/copy_learning_probe.py``): a first stage can cap it."""
    max_recall_pairs: int = 48
    """Longest recall list drawn (the task's own: 48 pairs; at most 52, its keys)."""
    recall_questions: int = 1
    """Questions a recall list asks (the task: 1). Above 1, the task's question is followed
    by questions on other keys of the whole list, each with its answer: more answers a list
    for the lookup to learn from (the multi-query form)."""
    min_code_letters: int = 8
    """Shortest code of a copy past the window (the task's: 8 letters). With a range, a
    lookup for each place of an 8-letter code (what the committed checkpoint learned) no
    longer covers the corpus; in-window copies keep 8 letters."""
    max_code_letters: int = 8
    """Longest code of a copy past the window."""
    fill_long: bool = False
    """Fill each sequence with recall and copy documents to its end (the last one cut there)
    instead of sums after the long documents that fit. A 640-token sequence holds one
    multi-query recall list, so by default sums are most of its answer tokens; the 4-layer
    probe that learns recall sees no sums."""
    index_loss_weight: float = 1.0
    """Weight of the indexer KL loss."""
    answer_weight: float = 5.0
    """Loss weight of answer tokens (the recalled value, the repeated code, the sum) against
    1 for every other token: the answers are a few percent of the text and carry the tasks."""
    router_bias_rate: float = 1e-3
    """Router bias step of the balancing rule."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    seed: int = 0
    """Seed of the initial weights (``init-checkpoint``'s) and of the corpus."""
    graphs: bool = True
    """Capture the step as a CUDA graph (on CUDA; the CPU runs eagerly)."""
    compile: bool = True
    """``torch.compile`` the mHC prediction (on CUDA): its 20 Sinkhorn iterations are a third
    of the step's operations, forward and backward."""
    log_every: int = 25
    """Steps between progress lines (each one reads the losses back)."""
    time_limit_s: float = 0.0
    """Stop early (and still write everything) once training took this long; 0: no limit."""
    init_checkpoint: str | None = None
    """A checkpoint to go on training from (its weights; the optimizer starts afresh)."""


class Corpus:
    """The training token stream: deterministic in the seed, held-out documents skipped."""

    def __init__(
        self,
        cfg: ModelConfig,
        seed: int,
        seq_tokens: int,
        copy_share: float = 0.5,
        short_copy_share: float = 0.3,
        arith_first_share: float = 0.25,
        max_filler_chars: int = 420,
        max_recall_pairs: int = 48,
        code_letters: tuple[int, int] = (COPY_CODE_LETTERS, COPY_CODE_LETTERS),
        recall_questions: int = 1,
        fill_long: bool = False,
    ):
        """``copy_share``: copy documents among the recall and copy ones;
        ``short_copy_share``: copies whose code lies inside the window of its repeat;
        ``arith_first_share``: sequences that open with a sum (``arith_gen`` asks at
        position 0); ``max_filler_chars`` and ``max_recall_pairs``: the longest copy filler
        and recall list drawn; ``code_letters``: the shortest and longest code of a copy past
        the window; ``recall_questions``: questions a recall list asks; ``fill_long``: long
        documents to the sequence's end instead of sums (``TrainOptions``)."""
        if recall_questions < 1:
            raise ValueError(f"recall_questions {recall_questions}: must be at least 1")
        self.recall_questions = recall_questions
        self.fill_long = fill_long
        if max_filler_chars <= SHORT_COPY_FILLER_CHARS or not 6 <= max_recall_pairs <= len(
            RECALL_KEYS
        ):
            raise ValueError(
                f"max_filler_chars {max_filler_chars} must exceed {SHORT_COPY_FILLER_CHARS} "
                f"and max_recall_pairs {max_recall_pairs} be 6 to {len(RECALL_KEYS)}"
            )
        if not 1 <= code_letters[0] <= code_letters[1]:
            raise ValueError(f"code_letters {code_letters}: want 1 <= shortest <= longest")
        self.max_filler_chars, self.max_recall_pairs = max_filler_chars, max_recall_pairs
        self.code_letters = code_letters
        self.copy_share, self.short_copy_share = copy_share, short_copy_share
        self.arith_first_share = arith_first_share
        if seed == EVAL_SEED:
            raise ValueError("the training seed must differ from the held-out one")
        self.rng = random.Random(f"v41plan-train:{seed}")
        self.eos = cfg.eos_token_id
        self.seq_tokens = seq_tokens
        self.held_out = {self._text(n, d) for n in GENERATORS for d in documents(n, 100)}
        self.skipped = 0
        """Generated documents dropped because a held-out document is the same text."""

    @staticmethod
    def _text(name: str, doc: dict) -> str:
        if "choices" in doc:
            return doc["context"] + doc["choices"][doc["label"]]
        return doc["prompt"] + doc["answer"]

    @staticmethod
    def _answer(doc: dict) -> str:
        return doc["choices"][doc["label"]] if "choices" in doc else doc["answer"]

    def _doc(self, name: str, kind: str, **size) -> tuple[list[int], list[int]]:
        """A document's tokens (``eos`` last) and their marks: ``kind``'s code on its answer,
        0 elsewhere (``ANSWER_KINDS``)."""
        while True:
            try:
                doc = GENERATORS[name](self.rng, **size)
            except ValueError:  # a short recall list without three other distinct values
                continue
            text = self._text(name, doc)
            if text not in self.held_out:
                ids = [*text.encode("utf-8"), self.eos]
                n = len(self._answer(doc).encode("utf-8"))
                code = ANSWER_KINDS.index(kind) + 1
                return ids, [0] * (len(ids) - 1 - n) + [code] * n + [0]
            self.skipped += 1

    def _long_doc(self) -> tuple[list[int], list[int]]:
        """A recall or copy document of a random length up to ``max_recall_pairs`` pairs or
        ``max_filler_chars`` of filler (the tasks' own: 40 and 420). A share of the copies
        keep the code inside the window of its repeat (``SHORT_COPY_FILLER_CHARS``), where a
        head at a fixed offset copies it; past the window copying needs a lookup by content,
        which forms sooner over short distances (a first stage with a low
        ``max_filler_chars``)."""
        if self.rng.random() >= self.copy_share:
            pairs = self.rng.randint(6, self.max_recall_pairs)
            ids, marks = self._doc("kv_recall_mc", "recall", pairs=pairs)
            if self.recall_questions > 1:
                ids, marks = self._more_questions(ids, marks)
            return ids, marks
        if self.rng.random() < self.short_copy_share:
            filler = self.rng.randint(0, SHORT_COPY_FILLER_CHARS)
            return self._doc("copy_gen", "copy_in_window", filler_chars=filler)
        if self.code_letters == (COPY_CODE_LETTERS, COPY_CODE_LETTERS):
            letters = COPY_CODE_LETTERS  # no draw: the default stream stays what it was
        else:
            letters = self.rng.randint(*self.code_letters)
        # a shorter code brings its letters nearer their repeat: a longer filler keeps them
        # as far back as an 8-letter code's with the shortest past-window filler
        shortest = SHORT_COPY_FILLER_CHARS + 1 + max(0, COPY_CODE_LETTERS - letters)
        filler = self.rng.randint(shortest, max(shortest, self.max_filler_chars))
        return self._doc("copy_gen", "copy_past_window", filler_chars=filler, code_letters=letters)

    def _more_questions(self, ids: list[int], marks: list[int]) -> tuple[list[int], list[int]]:
        """A recall document with ``recall_questions - 1`` further questions on other keys of
        its list, each answered (``recall_more``), before its ``eos``."""
        text = bytes(ids[:-1]).decode("utf-8")
        lines, question = text.split("\n")
        asked = question.removeprefix("question: what is ").split("?")[0]
        pairs = [p.strip().split("=") for p in lines.split(";") if p.strip()]
        others = [(k, v) for k, v in pairs if k != asked]
        code = ANSWER_KINDS.index("recall_more") + 1
        for k, v in self.rng.sample(others, k=min(self.recall_questions - 1, len(others))):
            ask = f"\nquestion: what is {k}? answer: ".encode()
            ids = ids[:-1] + [*ask, *v.encode(), self.eos]
            marks = marks[:-1] + [0] * len(ask) + [code] * len(v) + [0]
        return ids, marks

    def sequence_marked(self) -> tuple[list[int], list[int]]:
        """``seq_tokens + 1`` tokens and their answer marks (``ANSWER_KINDS``): long
        documents while they fit, then arithmetic ones (with ``fill_long``, long documents to
        the end, the last one cut). The first document starts at
        position 0, as the tasks present theirs: a recall or copy document, or
        (``arith_first_share`` of the sequences) a sum."""
        if self.rng.random() < self.arith_first_share:
            ids, ans = self._doc("arith_gen", "sum")
        else:
            ids, ans = self._long_doc()
        while not (self.fill_long and len(ids) > self.seq_tokens):
            nxt, nxt_ans = self._long_doc()
            if len(ids) + len(nxt) > self.seq_tokens and not self.fill_long:
                break
            ids, ans = ids + nxt, ans + nxt_ans
        while len(ids) <= self.seq_tokens:
            nxt, nxt_ans = self._doc("arith_gen", "sum")
            ids, ans = ids + nxt, ans + nxt_ans
        return ids[: self.seq_tokens + 1], ans[: self.seq_tokens + 1]

    def batch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[n, seq_tokens + 1]`` (int64) and their answer marks (int8,
        ``ANSWER_KINDS``)."""
        rows = [self.sequence_marked() for _ in range(n)]
        ids = np.asarray([r[0] for r in rows], dtype=np.int64)
        return ids, np.asarray([r[1] for r in rows], dtype=np.int8)


def lr_at(step: int, opts: TrainOptions) -> float:
    """Linear warm-up to ``lr``, then cosine decay to a tenth of it."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    t = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class _Stepper:
    """One training step over static device buffers, eager or replayed from a CUDA graph."""

    def __init__(self, model: TrainModel, opts: TrainOptions, B: int, S: int, n_rows: tuple):
        dev = model.device
        self.model, self.opts = model, opts
        self.ids = torch.zeros(B, S, dtype=torch.long, device=dev)
        self.targets = torch.zeros(B, S, dtype=torch.long, device=dev)
        self.answer = torch.zeros(B, S, dtype=torch.long, device=dev)
        """Each target's answer mark (``ANSWER_KINDS``): its loss weight (``answer_weight``
        on answer tokens, 1 elsewhere) and the logged accuracies' rows."""
        self.rows = torch.zeros(B, S, *n_rows, dtype=torch.long, device=dev)
        self.graphs_on = opts.graphs and dev.type == "cuda"
        lr = torch.tensor(opts.lr, device=dev) if self.graphs_on else opts.lr
        self.opt = torch.optim.AdamW(
            model.parameters(),
            lr=lr,
            betas=(0.9, 0.95),
            weight_decay=opts.weight_decay,
            capturable=self.graphs_on,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_dense: bool | None = None
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.capture_s = 0.0
        self.capture_error: str | None = None

    def set_lr(self, lr: float) -> None:
        """The next step's learning rate (a device fill under graphs: no sync)."""
        g = self.opt.param_groups[0]
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr

    def _eager(self, dense: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, o = self.model, self.opts
        batch = Batch(self.ids, self.targets, self.rows)
        logits, aux = m.forward(batch, dense=dense)
        w = torch.where(self.answer.reshape(-1) > 0, o.answer_weight, 1.0)
        per = F.cross_entropy(logits, self.targets.reshape(-1), reduction="none")
        ce = (per * w).sum() / w.sum()
        kind = F.one_hot(self.answer.reshape(-1), len(ANSWER_KINDS) + 1)[:, 1:].float()
        hit = (logits.detach().argmax(-1) == self.targets.reshape(-1)).float()
        lead = recall_lead_mask(self.answer).reshape(-1).float()
        kind = torch.cat((kind, lead[:, None]), 1)
        acc = torch.stack((hit @ kind, kind.sum(0)))  # [hits, answer tokens], LOGGED_KINDS
        loss = ce + o.index_loss_weight * aux["index_kl"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # gradients keep their buffers (graph-static)
        m.update_router_bias(aux["expert_load"].detach(), o.router_bias_rate)
        return ce.detach(), aux["index_kl"].detach(), acc

    def step(self, dense: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run one step on the current buffers; returns (cross-entropy, index KL, ``[2, K]``
        argmax hits and answer tokens of each of ``LOGGED_KINDS``) on device."""
        if not self.graphs_on:
            return self._eager(dense)
        if self.graph is None or self.graph_dense != dense:
            try:
                return self._capture(dense)
            except RuntimeError as exc:  # an op that cannot be captured: train eagerly
                self.graph, self.graphs_on = None, False
                self.capture_error = str(exc).splitlines()[0]
                print(f"CUDA graph capture failed ({self.capture_error}); training eagerly")
                torch.cuda.synchronize()
                return self._eager(dense)
        self.graph.replay()
        return self.out

    def _capture(self, dense: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Warm up on a side stream (three real optimizer steps on the current batch: the
        optimizer state and the kernels' workspaces exist before capture), then capture."""
        t0 = time.perf_counter()
        self.graph = None  # free the other mode's graph and its memory pool
        torch.cuda.empty_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                out = self._eager(dense)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph gets its own pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._eager(dense)
        self.graph, self.graph_dense = graph, dense
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        # the warm-up steps trained on this batch; replaying it once more would repeat it
        return out


def _accuracies(hits_tokens: list[list[float]]) -> dict[str, float | None]:
    """Argmax accuracy of each answer kind from summed ``[hits, tokens]`` (None: no tokens)."""
    hits, tokens = hits_tokens
    return {k: h / n if n else None for k, h, n in zip(LOGGED_KINDS, hits, tokens)}


def train(
    cfg: ModelConfig,
    spec_name: str,
    out_dir: str | Path,
    opts: TrainOptions,
    device: str = "cpu",
    progress=print,
) -> dict:
    """Train, write the checkpoint, ``train_log.json`` and ``loss.png``; returns the log."""
    if opts.seq_tokens % 2:
        raise ValueError(f"seq_tokens {opts.seq_tokens} must be even")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device)
    torch.manual_seed(opts.seed)
    t_start = time.perf_counter()
    init = None
    if opts.init_checkpoint:
        from v41plan.model.checkpoint import check_checkpoint, read_state

        if check_checkpoint(opts.init_checkpoint)[0] != cfg:
            raise ValueError(
                f"{opts.init_checkpoint}: its config.json is another model than the spec's"
            )
        init = read_state(opts.init_checkpoint)
    model = TrainModel(
        cfg, opts.seed, dev, init_state=init, compile_hc=opts.compile and dev.type == "cuda"
    )
    host = EngramHost(cfg, engram_token_map(cfg))
    corpus = Corpus(
        cfg,
        opts.seed,
        opts.seq_tokens,
        opts.copy_share,
        opts.short_copy_share,
        max_filler_chars=opts.max_filler_chars,
        max_recall_pairs=opts.max_recall_pairs,
        code_letters=(opts.min_code_letters, opts.max_code_letters),
        recall_questions=opts.recall_questions,
        fill_long=opts.fill_long,
    )
    B, S = opts.batch_seqs, opts.seq_tokens
    n_rows = (len(cfg.engram_layer_ids), cfg.engram_cols)
    stepper = _Stepper(model, opts, B, S, n_rows)
    pinned = dev.type == "cuda"
    staging = [  # (ids, targets, Engram rows, answer marks) twice: one fills while the
        tuple(  # other copies
            torch.empty(shape, dtype=torch.long, pin_memory=pinned)
            for shape in ((B, S), (B, S), (B, S, *n_rows), (B, S))
        )
        for _ in range(2)
    ]
    copied = [None, None]  # event after each staging buffer's last copy
    ce_log = torch.zeros(opts.steps, device=dev)
    kl_log = torch.zeros(opts.steps, device=dev)
    acc_log = torch.zeros(opts.steps, 2, len(LOGGED_KINDS), device=dev)
    params = sum(p.numel() for p in model.parameters())
    progress(
        f"training {cfg.num_hidden_layers} layers, {params / 1e6:.2f}M parameters on {dev}: "
        f"{opts.steps} steps x {B} x {S} tokens (dense attention for {opts.dense_steps}), "
        f"{'CUDA graphs' if stepper.graphs_on else 'eager'}"
        f"{', compiled mHC prediction' if model.compiled_hc is not None else ''}"
    )
    t_train = time.perf_counter()
    setup_s = t_train - t_start
    done = 0
    step_end_s: list[float] = []  # host time at each step's end (the staging syncs pace it)
    for step in range(opts.steps):
        k = step % 2
        if copied[k] is not None:
            copied[k].synchronize()  # the buffer's previous copy has left it
        tok, answer = corpus.batch(B)
        ids_h, tg_h, rows_h, ans_h = staging[k]
        ids_h.copy_(torch.from_numpy(tok[:, :S]))
        tg_h.copy_(torch.from_numpy(tok[:, 1:]))
        rows_h.copy_(torch.from_numpy(engram_rows(host, tok[:, :S])))
        ans_h.copy_(torch.from_numpy(answer[:, 1:]))
        stepper.ids.copy_(ids_h, non_blocking=True)
        stepper.targets.copy_(tg_h, non_blocking=True)
        stepper.rows.copy_(rows_h, non_blocking=True)
        stepper.answer.copy_(ans_h, non_blocking=True)
        if pinned:
            copied[k] = torch.cuda.Event()
            copied[k].record()
        stepper.set_lr(lr_at(step, opts))
        ce, kl, acc = stepper.step(dense=step < opts.dense_steps)
        ce_log[step].copy_(ce)
        kl_log[step].copy_(kl)
        acc_log[step].copy_(acc)
        done = step + 1
        step_end_s.append(time.perf_counter() - t_train)
        last = done == opts.steps
        over = opts.time_limit_s and time.perf_counter() - t_train > opts.time_limit_s
        if done % opts.log_every == 0 or last or over:
            c = ce_log[max(0, done - opts.log_every) : done].mean().item()
            q = kl_log[max(0, done - opts.log_every) : done].mean().item()
            r = _accuracies(acc_log[max(0, done - opts.log_every) : done].sum(0).tolist())
            el = time.perf_counter() - t_train
            progress(
                f"step {done}/{opts.steps}  loss {c:.4f}  index_kl {q:.4f}  "
                + "".join(f"{k} {v:.2f}  " for k, v in r.items() if v is not None)
                + f"{el / done:.3f} s/step  {done * B * S / el:,.0f} tok/s  "
                f"eta {el / done * (opts.steps - done):.0f} s"
            )
        if over:
            progress(f"stopping at step {done}: --time-limit {opts.time_limit_s:.0f} s reached")
            break
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_train
    losses = ce_log[:done].tolist()
    log = {
        "options": asdict(opts),
        "spec": spec_name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": params,
        "steps_done": done,
        "tokens": done * B * S,
        "setup_s": setup_s,
        "train_s": train_s,
        "capture_s": stepper.capture_s,
        "graphs": stepper.graphs_on,
        "compiled_hc": model.compiled_hc is not None and model.compiled_hc.error is None,
        "capture_error": stepper.capture_error,
        "s_per_step": train_s / max(1, done),
        # the headroom a larger --batch-seqs has (one step's activations dominate it)
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
        ),
        "corpus_skipped_held_out": corpus.skipped,
        "step_end_s": step_end_s,
        "loss": losses,
        "index_kl": kl_log[:done].tolist(),
        "answer_kinds": list(LOGGED_KINDS),
        "answer_hits": acc_log[:done, 0].tolist(),
        "answer_tokens": acc_log[:done, 1].tolist(),
        "final_loss": float(np.mean(losses[-max(1, opts.log_every) :])),
    }
    write_state(
        out, cfg, model.export_state(), {"v41plan_trained": {"steps": done, "seed": opts.seed}}
    )
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_loss_png(out / "loss.png", losses, log["index_kl"])
    progress(
        f"wrote {out}: checkpoint, train_log.json, loss.png "
        f"({train_s:.0f} s training, final loss {log['final_loss']:.4f}"
        + (f", peak {log['peak_memory_gib']:.1f} GiB" if log["peak_memory_gib"] else "")
        + ")"
    )
    return log


# --- a loss curve without a plotting library ----------------------------------------------


def write_loss_png(
    path: Path, loss: list[float], index_kl: list[float], w: int = 640, h: int = 360
):
    """A line plot of the per-step losses (black: cross-entropy, blue: index KL), smoothed
    over 1% of the steps, y from 0 to the largest smoothed value; a grid line per unit."""
    img = bytearray(b"\xff" * (w * h * 3))
    series = [(s, c) for s, c in ((loss, (0, 0, 0)), (index_kl, (30, 90, 220))) if s]
    if not series:
        return

    def smooth(v: list[float]) -> list[float]:
        k = max(1, len(v) // 100)
        c = np.convolve(np.asarray(v, dtype=float), np.ones(k) / k, mode="valid")
        return c.tolist()

    curves = [(smooth(s), c) for s, c in series]
    top = max(max(v) for v, _ in curves) or 1.0
    pad = 20

    def put(x: int, y: int, c: tuple) -> None:
        if 0 <= x < w and 0 <= y < h:
            img[(y * w + x) * 3 : (y * w + x) * 3 + 3] = bytes(c)

    for unit in range(int(top) + 1):  # grid lines at each whole loss value
        y = h - pad - round(unit / top * (h - 2 * pad))
        for x in range(pad, w - pad):
            put(x, y, (225, 225, 225))
    for v, c in curves:
        n = len(v)
        pts = [
            (pad + i / max(1, n - 1) * (w - 2 * pad), h - pad - val / top * (h - 2 * pad))
            for i, val in enumerate(v)
        ]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:] or pts, strict=False):
            k = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
            for j in range(k + 1):  # a 2-pixel line through both points
                x, y = round(x0 + (x1 - x0) * j / k), round(y0 + (y1 - y0) * j / k)
                for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
                    put(x + dx, y + dy, c)
    raw = b"".join(b"\x00" + bytes(img[r * w * 3 : (r + 1) * w * 3]) for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)
