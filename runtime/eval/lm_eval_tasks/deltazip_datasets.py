"""Datasets of the deltazip lm-eval tasks, generated on the spot (nothing is downloaded).

lm-eval loads this file by path (``custom_dataset: !function deltazip_datasets.NAME`` in the YAMLs
beside it) and calls ``NAME(**metadata)``; each returns a ``DatasetDict`` with one ``test`` split.
The demo tasks draw the demo pair's held-out prompts (the same seed as ``eval.jsonl`` of
``deltazip demo`` with seed 0); the study tasks draw ``deltazip.runtime.eval.text_tasks.EVAL_SEED``.
"""

from __future__ import annotations

from datasets import Dataset, DatasetDict

from deltazip.runtime.eval.generated_tasks import DEMO_DIGITS, get_task
from deltazip.runtime.eval.text_tasks import TEXT_TASKS

DEMO_HELDOUT_SEED = 10_000  # make_demo_pair: eval examples use seed 10_000 + seed


def _demo(task: str, n: int) -> DatasetDict:
    rows = [{"prompt": p, "answer": a} for p, a in get_task(task, DEMO_DIGITS).examples(int(n), DEMO_HELDOUT_SEED)]
    return DatasetDict({"test": Dataset.from_list(rows)})


def _text(task: str, n: int) -> DatasetDict:
    return DatasetDict({"test": Dataset.from_list([e.to_doc() for e in TEXT_TASKS[task].heldout(int(n))])})


def shift(n: int = 64, **_) -> DatasetDict:
    return _demo("shift", n)


def copy(n: int = 64, **_) -> DatasetDict:
    return _demo("copy", n)


def decrement(n: int = 64, **_) -> DatasetDict:
    return _demo("decrement", n)


def palindrome(n: int = 200, **_) -> DatasetDict:
    return _text("palindrome", n)


def ticket(n: int = 200, **_) -> DatasetDict:
    return _text("ticket", n)


def addition(n: int = 200, **_) -> DatasetDict:
    return _text("addition", n)
