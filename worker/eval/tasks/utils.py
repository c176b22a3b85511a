"""Loaders of the shipped tasks' data: the JSONL files next to this module, read without any
dataset hub, so ``--include-path`` works from any directory and offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    path = HERE / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# lm-eval calls a task's custom_dataset with the task's metadata (version, the model's arguments)
# as keyword arguments; the loaders need none of them.
def load_mc(**_: Any) -> datasets.DatasetDict:
    return _load("tokenmill_mc")


def load_ppl(**_: Any) -> datasets.DatasetDict:
    return _load("tokenmill_ppl")


def load_gen(**_: Any) -> datasets.DatasetDict:
    return _load("tokenmill_gen")
