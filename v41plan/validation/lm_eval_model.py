"""An lm-evaluation-harness model over the v41plan engine.

    python -m v41plan.validation.lm_eval_model --model v41plan \\
        --model_args spec=tiny,dtype=float64 --tasks v41plan_kv_recall_mc --limit 5

runs lm-eval's own command line with the model registered and this package's offline tasks
(``v41plan/validation/tasks``) on its task path. The package also declares the model under the
``lm_eval.models`` entry-point group; lm-eval 0.4.13 itself does not read that group, which is
why the module above exists. From Python: ``lm_eval.simple_evaluate(model=V41PlanLM(...))``.

``--model_args`` are ``spec`` (a compiled spec name or file), ``checkpoint`` (a directory; the
spec's seeded random weights without it), ``max_gen_toks``, ``progress`` (a bar per call),
``prefix_hit`` (each generation prompt runs once for one token first, so the scored generation
resumes from the prefix cache: the encoder replay or the copy transfer) and any engine option
(``kv_cache_dtype``, ``decoder_swa_bounded_replay``, ``dtype``, ``max_model_len``, ...).

- ``loglikelihood``: context and continuation as one prompt scored through every layer (the
  engine's ``prompt_logprobs`` path: all-row logits, decoder replay off for the request); the
  continuation's summed log-probability and whether every continuation token is its row's
  argmax.
- ``loglikelihood_rolling``: the text in disjoint windows of at most ``max_model_len`` tokens,
  each scored as above (the first window conditioned on the end-of-text token).
- ``generate_until``: generation up to ``max_gen_toks`` tokens (``temperature`` when
  ``do_sample``), the text cut before the first ``until`` string.

Every request of a call goes to the engine at once; the engine batches and chunks them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from v41plan.serving.engine import LLM
from v41plan.serving.sampling import SamplingParams

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
"""The shipped offline tasks: lm-eval YAMLs over JSONL next to them."""

try:  # lm-eval is an optional extra: without it the class still scores (tests, scripts)
    from lm_eval.api.model import LM as _LMBase
    from lm_eval.api.registry import register_model as _register
except ImportError:  # pragma: no cover - exercised where lm-eval is missing
    _LMBase = object

    def _register(*_names):
        return lambda cls: cls


_IGNORED_HARNESS_ARGS = ("batch_size", "max_batch_size")
"""Arguments lm-eval passes every model that the engine has no use for (it batches itself).
lm-eval's ``device`` is taken only when it is ``cpu``, or ``cuda`` on a machine that has it
(lm-eval's default is ``cuda`` everywhere)."""


@_register("v41plan")
class V41PlanLM(_LMBase):
    """lm-eval's ``LM`` interface over one ``LLM`` engine."""

    def __init__(
        self,
        spec: str = "tiny",
        checkpoint: str | None = None,
        max_gen_toks: int = 256,
        llm: LLM | None = None,
        progress: bool = True,
        prefix_hit: bool = False,
        **options,
    ) -> None:
        if _LMBase is not object:
            super().__init__()
        device = options.pop("device", None)
        for name in _IGNORED_HARNESS_ARGS:
            options.pop(name, None)
        kind = str(device).split(":")[0] if device is not None else None
        if kind == "cpu" or (kind == "cuda" and _cuda_available()):  # lm-eval says cuda always
            options.setdefault("device", kind)
        self.llm = llm if llm is not None else LLM(spec, checkpoint, **options)
        self.max_gen_toks = int(max_gen_toks)
        self.prefix_hit = str(prefix_hit).lower() in ("1", "true", "yes")
        """Generations resume through a prefix hit (each prompt runs for one token first)."""
        self.resumed = {"requests": 0, "hits": 0, "restores": 0, "replay_rows": 0}
        """Summed scheduler stats of the scored generations under ``prefix_hit``: requests,
        prefix-hit tokens, checkpoint-image restores and replayed rows."""
        self.progress = bool(progress)
        """A progress bar over each call's tokens (``TQDM_DISABLE=1`` silences it)."""
        eos = self.llm.eos_token_id
        self.eot_token_id = int(eos) if eos is not None else 0
        """The token a context-free continuation is conditioned on."""
        self.max_length = int(self.llm.options.max_model_len)
        """Tokens one scored prompt may hold (the engine's ``max_model_len``)."""

    # -- lm-eval's interface ------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), every continuation token greedy)`` per
        request (``requests``: lm-eval instances or ``(context, continuation)`` pairs)."""
        pairs = [self._args(r) for r in requests]
        encoded = [self._encode_pair(ctx, cont) for ctx, cont in pairs]
        return self.score_tokens(encoded)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """The summed log-probability of each text, over disjoint windows of the context."""
        texts = [self._args(r)[0] for r in requests]
        windows: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for i, text in enumerate(texts):
            for ctx, pred in self._rolling_windows(self.llm.encode(text)):
                windows.append((ctx, pred))
                owner.append(i)
        scores = self.score_tokens(windows)
        total = [0.0] * len(texts)
        for i, (lp, _greedy) in zip(owner, scores, strict=True):
            total[i] += lp
        return total

    def generate_until(self, requests) -> list[str]:
        """Each context's continuation, cut before the first of its ``until`` strings."""
        prompts, params, untils = [], [], []
        for r in requests:
            context, kwargs = self._args(r)
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None)
            if isinstance(until, str):
                until = [until]
            until = [u for u in (until or []) if u]
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
            ids = self.llm.encode(context) or [self.eot_token_id]
            max_new = max(1, min(max_new, self.max_length - 1))
            ids = ids[-(self.max_length - max_new) :]  # the newest context that fits
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=max_new, temperature=temperature))
            untils.append(until)
        outs = self._generate(prompts, params)
        texts = []
        for out, until in zip(outs, untils, strict=True):
            if out.error is not None:
                raise RuntimeError(f"generation failed: {out.error}")
            texts.append(cut_at_until(out.outputs[0].text, until))
        return texts

    def _generate(self, prompts: list[dict], params: list[SamplingParams]) -> list:
        """The engine's generations; under ``prefix_hit`` each group of ``max_num_seqs``
        prompts runs once for one token first, so the scored run resumes from the prefix
        cache (``resumed`` counts what that did)."""
        if not prompts:
            return []
        if not self.prefix_hit:
            return self.llm.generate(prompts, params, use_tqdm=self.progress)
        group = max(1, int(self.llm.options.max_num_seqs))
        outs = []
        for i in range(0, len(prompts), group):
            warm = SamplingParams(max_tokens=1, temperature=0.0)
            self.llm.generate(prompts[i : i + group], warm)
            part = self.llm.generate(prompts[i : i + group], params[i : i + group])
            for out in part:
                self.resumed["requests"] += 1
                self.resumed["hits"] += sum(out.stats.get("hits", []))
                for key in ("restores", "replay_rows"):
                    self.resumed[key] += int(out.stats.get(key, 0))
            outs += part
        return outs

    # -- scoring ------------------------------------------------------------------------------
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(summed log p, all greedy)`` of each continuation after its context (token ids),
        context cut from the left where both exceed ``max_length``."""
        prompts, lens = [], []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("an empty continuation has no log-likelihood")
            if len(cont) >= self.max_length:
                raise ValueError(
                    f"a continuation of {len(cont)} tokens does not fit max_model_len "
                    f"{self.max_length} with a token of context"
                )
            ids = (list(ctx) or [self.eot_token_id]) + list(cont)
            prompts.append({"prompt_token_ids": ids[-self.max_length :]})
            lens.append(len(cont))
        if not prompts:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
        outs = self.llm.generate(prompts, params, use_tqdm=self.progress)
        result = []
        for out, n in zip(outs, lens, strict=True):
            if out.error is not None or out.prompt_logprobs is None:
                raise RuntimeError(f"scoring failed: {out.error}")
            lps, greedy = out.prompt_logprobs[-n:], out.prompt_greedy[-n:]
            result.append((float(sum(lps)), all(greedy)))
        return result

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # a context's trailing spaces belong to the continuation (as lm-eval's own models do)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.llm.encode(context + continuation)
        ctx = self.llm.encode(context)
        return whole[: len(ctx)], whole[len(ctx) :]

    def _rolling_windows(self, ids: list[int]):
        """Disjoint prediction windows of at most ``max_length - 1`` tokens, each with the
        tokens before it as context (as much as fits)."""
        width = self.max_length - 1
        for lo in range(0, len(ids), width):
            pred = ids[lo : lo + width]
            ctx = ids[max(0, lo - (self.max_length - len(pred))) : lo]
            yield (ctx or [self.eot_token_id]), pred

    @staticmethod
    def _args(request):
        return tuple(getattr(request, "args", request))

    # -- what lm-eval reads besides the three calls -------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        """The name lm-eval caches chat templates under."""
        return f"v41plan-{self.llm.spec.name}"

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """Plain ``role: content`` lines (the engine has no chat template of its own)."""
        lines = [f"{m['role']}: {m['content']}" for m in chat_history]
        return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cut_at_until(text: str, until: list[str]) -> str:
    """``text`` before the earliest occurrence of any ``until`` string (all of it if none)."""
    cut = len(text)
    for u in until:
        at = text.find(u)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``v41plan`` model registered and the shipped tasks on
    its ``--include_path``."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print(
            "lm_eval_model: lm-eval is not installed (pip install 'v41plan[eval]')",
            file=sys.stderr,
        )
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args:
        args += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["lm_eval", *args]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
