"""The offline quality tasks: seeded generators and the lm-eval task files over their output.

    python -m v41plan.validation.quality_tasks [--out v41plan/validation/tasks] [--docs 100]

Three tasks whose answers need more than the 128-row window (the texts are ASCII: one token a
byte under the byte tokenizer, so lengths in characters are lengths in tokens):

- ``v41plan_kv_recall_mc`` (multiple choice, ``acc`` by log-likelihood): 48 ``K=value;``
  pairs (one-letter keys, four-digit values) over 383 characters, then a question on a key
  from the first third, 280 to 410 rows back; the choices are the true value and three others
  from the same context. The answer is outside the window:
  only the compressed KV and the index top-k reach it.
- ``v41plan_copy_gen`` (generation, ``exact_match``): a code, filler text past the window, then
  a request to repeat the code.
- ``v41plan_arith_gen`` (generation, ``exact_match``): two- and three-digit sums.

The same generators with another seed give a training corpus (``corpus``); the shipped files
are drawn from ``EVAL_SEED``, held out from it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

EVAL_SEED = 1_000_003
"""Seed of the shipped (held-out) documents."""

RECALL_KEYS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""Keys of the recall lists: one character, one token under the byte tokenizer, as a word is
one token under a subword tokenizer. With five-letter word keys (the first version of the
task) the lookup must first compose each key from five tokens, which neither the quality
model nor a plain 2-layer transformer learned in thousands of steps; with one-token keys the
task measures what it is for, the lookup past the window (``checkpoints/quality40/README.md``)."""
_FILLER = "the river runs past the old mill and the fields beyond it turn gold in the autumn sun. "


def kv_recall_doc(rng: random.Random, pairs: int = 48) -> dict:
    """One multiple-choice recall item: ``{"context", "choices", "label"}``: ``pairs`` (at
    most 52) ``K=value;`` pairs of one-letter keys and four-digit values, then a question on
    a key from the first third (outside the window of the question); the choices are the
    true value and three other values of the list."""
    if not 4 <= pairs <= len(RECALL_KEYS):
        raise ValueError(f"pairs {pairs}: want 4 to {len(RECALL_KEYS)}")
    keys = rng.sample(RECALL_KEYS, k=pairs)
    values = [rng.randrange(1000, 10000) for _ in keys]
    lines = " ".join(f"{k}={v};" for k, v in zip(keys, values, strict=True))
    q = rng.randrange(0, max(1, pairs // 3))  # early in the context: outside the window
    others = [v for i, v in enumerate(values) if i != q and v != values[q]]
    choices = [values[q], *rng.sample(others, k=3)]
    rng.shuffle(choices)
    return {
        "context": f"{lines}\nquestion: what is {keys[q]}? answer:",
        "choices": [f" {c}" for c in choices],
        "label": choices.index(values[q]),
    }


COPY_CODE_LETTERS = 8
"""Letters of the shipped copy task's code."""


def copy_doc(
    rng: random.Random, filler_chars: int = 420, code_letters: int = COPY_CODE_LETTERS
) -> dict:
    """One generation item: ``{"prompt", "answer"}``; the code (``code_letters`` of 24
    capitals) lies before the filler."""
    code = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(code_letters))
    filler = (_FILLER * (filler_chars // len(_FILLER) + 1))[:filler_chars]
    return {"prompt": f"code: {code}\n{filler}\nrepeat the code: ", "answer": code}


def arith_doc(rng: random.Random) -> dict:
    """One generation item: ``{"prompt", "answer"}`` of a sum."""
    a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


GENERATORS = {
    "kv_recall_mc": kv_recall_doc,
    "copy_gen": copy_doc,
    "arith_gen": arith_doc,
}
"""Task file stem -> document generator."""


def documents(name: str, n: int, seed: int = EVAL_SEED) -> list[dict]:
    """``n`` documents of task ``name`` (a ``GENERATORS`` key) from ``seed``."""
    rng = random.Random(f"{name}:{seed}")
    return [GENERATORS[name](rng) for _ in range(n)]


def corpus(n_per_task: int, seed: int) -> list[str]:
    """Training texts from the same generators (answers filled in), seeded apart from the
    held-out documents."""
    if seed == EVAL_SEED:
        raise ValueError("the training seed must differ from the held-out one")
    texts = []
    for d in documents("kv_recall_mc", n_per_task, seed):
        texts.append(d["context"] + d["choices"][d["label"]])
    for name in ("copy_gen", "arith_gen"):
        texts += [d["prompt"] + d["answer"] for d in documents(name, n_per_task, seed)]
    return texts


_MC_FIELDS = (
    'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
)
_GEN_FIELDS = 'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'


def _generation(until: str, max_gen_toks: int) -> str:
    return (
        f"{_GEN_FIELDS}generation_kwargs:\n  until: {until}\n  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\n"
    )


GENERATION = {"copy_gen": (["\n"], 12), "arith_gen": (["\n", " "], 6)}
"""Generation task -> (its ``until`` strings, its ``max_gen_toks``)."""

_TASKS = {
    "kv_recall_mc": ("multiple_choice", _MC_FIELDS, "acc"),
    **{
        name: ("generate_until", _generation(json.dumps(until), n), "exact_match")
        for name, (until, n) in GENERATION.items()
    },
}
"""Task file stem -> (lm-eval output type, its document fields, its metric)."""

TASK_METRICS = {f"v41plan_{name}": metric for name, (_t, _f, metric) in _TASKS.items()}
"""lm-eval task name -> its metric."""


def task_yaml(name: str) -> str:
    """The lm-eval task file of ``name`` (a ``GENERATORS`` key): its documents come from the
    shipped loader ``tasks/v41plan_tasks.py`` (lm-eval resolves data paths against the working
    directory, a loader against its own file)."""
    output_type, fields, metric = _TASKS[name]
    return (
        f"task: v41plan_{name}\ndataset_path: json\n"
        f"custom_dataset: !function v41plan_tasks.{name}\n"
        f"output_type: {output_type}\ntest_split: test\n{fields}"
        'target_delimiter: ""\n'
        f"metric_list:\n  - metric: {metric}\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )


LOADER = Path(__file__).resolve().parent / "tasks" / "v41plan_tasks.py"
"""The tasks' shared loader (kept in the repository beside the files it reads)."""


def write_tasks(out: Path, docs: int) -> list[Path]:
    """Write every task's JSONL and YAML into ``out`` (and the shared loader, when ``out`` is
    another folder than the shipped one); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name in GENERATORS:
        jsonl = out / f"{name}.jsonl"
        jsonl.write_text("".join(json.dumps(d) + "\n" for d in documents(name, docs)))
        yaml = out / f"{name}.yaml"
        yaml.write_text(task_yaml(name))
        files += [jsonl, yaml]
    loader = out / LOADER.name
    if loader.resolve() != LOADER:
        shutil.copyfile(LOADER, loader)
    return [*files, loader]


def main(argv: list[str] | None = None) -> int:
    """Write the shipped task files."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "tasks"))
    ap.add_argument("--docs", type=int, default=100, help="documents per task")
    args = ap.parse_args(argv)
    for f in write_tasks(Path(args.out), args.docs):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
