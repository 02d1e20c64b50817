"""Loaders of the v41plan offline tasks (lm-eval ``custom_dataset``): each reads the JSONL
beside this file (``python -m v41plan.validation.quality_tasks`` writes the JSONL and YAML)."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(stem):
    import datasets

    rows = [json.loads(line) for line in (HERE / f"{stem}.jsonl").read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def kv_recall_mc(**_kwargs):
    return _load("kv_recall_mc")


def copy_gen(**_kwargs):
    return _load("copy_gen")


def arith_gen(**_kwargs):
    return _load("arith_gen")
