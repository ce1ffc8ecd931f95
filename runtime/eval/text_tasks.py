"""Deterministic generated text tasks for the quality study (bench/quality.py) and their lm-eval tasks.

Tasks a small pretrained LM does poorly on before fine-tuning, in the spirit of the DeltaZip paper's
Pythia study (shared/seeds/001 §6.2), each a pure function of ``(n, seed)``:

- ``palindrome`` (multiple choice, 2): "Is 4721274 a palindrome number? Answer:" -> " yes" / " no".
  Half of the negatives are near misses (one digit of a palindrome changed), so surface cues fail.
- ``ticket`` (multiple choice, 4): a templated support ticket routed to a queue with an arbitrary
  colour name ("Queue: green" for billing), so the base cannot guess the mapping from semantics.
- ``addition`` (generation, exact match): "Q: What is 347 + 589?\\nA:" -> " 936".

Held-out evaluation uses :data:`EVAL_SEED`; training data (bench/quality.py) uses other seeds and
drops any prompt that appears in the held-out set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

EVAL_SEED = 1_000_003
"""Seed of every held-out set (the lm-eval tasks); training never uses it."""


@dataclass(frozen=True)
class Example:
    """One example: ``prompt``, gold ``answer`` (with its leading space), ``choices`` (MC tasks)."""

    prompt: str
    answer: str
    choices: tuple[str, ...] = ()

    @property
    def label(self) -> int:
        return self.choices.index(self.answer) if self.choices else -1

    def text(self) -> str:
        """The training text: prompt, answer, newline."""
        return f"{self.prompt}{self.answer}\n"

    def to_doc(self) -> dict:
        return {"prompt": self.prompt, "answer": self.answer, "answer_stripped": self.answer.strip(),
                "choices": list(self.choices), "label": self.label}


def _palindrome(rng: random.Random) -> Example:
    n = rng.randint(5, 8)
    half = [rng.choice("123456789")] + [rng.choice("0123456789") for _ in range((n + 1) // 2 - 1)]
    digits = half + half[: n // 2][::-1]
    kind = rng.random()
    if kind >= 0.5 and kind < 0.75:  # near miss: change one digit of the palindrome
        i = rng.randrange(n // 2)
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0")])
    elif kind >= 0.75:  # random number (almost never a palindrome)
        digits = [rng.choice("123456789")] + [rng.choice("0123456789") for _ in range(n - 1)]
    s = "".join(digits)
    answer = " yes" if s == s[::-1] else " no"
    return Example(f"Is {s} a palindrome number? Answer:", answer, (" yes", " no"))


_QUEUES = {"billing": " green", "shipping": " red", "technical": " blue", "account": " yellow"}
_TOPICS = {
    "billing": ["invoice", "refund", "credit card charge", "payment", "receipt", "bill"],
    "shipping": ["parcel", "delivery", "courier", "tracking number", "package", "shipment"],
    "technical": ["login page", "mobile app", "password reset link", "error code", "website", "download"],
    "account": ["username", "profile", "email address", "subscription plan", "membership", "account settings"],
}
_PROBLEMS = ["is wrong", "never arrived", "does not work", "looks strange", "was changed", "is missing"]
_TEMPLATES = [
    "My {kw} {problem}.",
    "Hello, the {kw} {problem}. Please help.",
    "I have a question: my {kw} {problem}.",
    "Why? The {kw} {problem} again.",
]


def _ticket(rng: random.Random) -> Example:
    dept = rng.choice(sorted(_QUEUES))
    kw = rng.choice(_TOPICS[dept])
    body = rng.choice(_TEMPLATES).format(kw=kw, problem=rng.choice(_PROBLEMS))
    order = rng.randint(1000, 9999)
    return Example(f"Ticket #{order}: {body}\nQueue:", _QUEUES[dept], tuple(_QUEUES[d] for d in sorted(_QUEUES)))


def _addition(rng: random.Random) -> Example:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return Example(f"Q: What is {a} + {b}?\nA:", f" {a + b}")


@dataclass(frozen=True)
class TextTask:
    """A generated text task; ``kind`` is ``multiple_choice`` or ``generate_until``."""

    name: str
    kind: str
    sample: Callable[[random.Random], Example]

    def examples(self, n: int, seed: int, exclude: set[str] | None = None) -> list[Example]:
        """``n`` examples with distinct prompts, a pure function of ``(n, seed, exclude)``."""
        rng = random.Random(f"{self.name}:{seed}")
        seen = set(exclude or ())
        out: list[Example] = []
        for _ in range(200 * n):
            ex = self.sample(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
                if len(out) == n:
                    return out
        raise ValueError(f"task {self.name}: could not draw {n} distinct examples")

    def heldout(self, n: int) -> list[Example]:
        return self.examples(n, EVAL_SEED)


TEXT_TASKS: dict[str, TextTask] = {
    "palindrome": TextTask("palindrome", "multiple_choice", _palindrome),
    "ticket": TextTask("ticket", "multiple_choice", _ticket),
    "addition": TextTask("addition", "generate_until", _addition),
}
