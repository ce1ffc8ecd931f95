"""Deterministic generated tasks for the demo model pair, and the two metrics used to score them.

Every task is a string transformation of a random digit string, written as one short line::

    c 3918=3918;      copy      (the base model's pretraining task)
    s 3918=4029;      shift     (each digit + 1 mod 10: the fine-tune's task)
    r 3918=8193;      reverse   (kept for experiments and benches)

The prompt is everything up to and including ``=``; the answer is what follows, up to the terminator
``;``. A model that only learned to copy scores 0 on ``shift`` (every digit differs from the input), so
a jump in exact-match accuracy is unambiguous evidence that fine-tuning taught something new.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TERMINATOR = ";"
"""Ends every answer; generation stops at it and exact match compares the text before it."""

DIGITS = "0123456789"


@dataclass(frozen=True)
class Task:
    """A generated task: ``prefix`` letter, digit-string lengths and the answer function.

    Attributes:
        name: registry key (``"copy"``, ``"shift"``, ...).
        prefix: the letter that opens every prompt; it is how the model tells tasks apart.
        transform: maps the input digit string to the answer string.
        min_len / max_len: inclusive bounds on the number of input digits.
    """

    name: str
    prefix: str
    transform: Callable[[str], str]
    min_len: int = 4
    max_len: int = 8

    def __post_init__(self) -> None:
        if len(self.prefix) != 1 or self.prefix in DIGITS + TERMINATOR + "= ":
            raise ValueError(f"task {self.name!r}: prefix must be one letter, got {self.prefix!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"task {self.name!r}: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}"
            )

    def prompt(self, digits: str) -> str:
        """The prompt for one input digit string, e.g. ``"s 3918="``."""
        return f"{self.prefix} {digits}="

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt, answer) pair drawn from ``rng``."""
        n = rng.randint(self.min_len, self.max_len)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return self.prompt(digits), self.transform(digits)

    def examples(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` distinct (prompt, answer) pairs, a pure function of ``(n, seed)``.

        Distinct prompts keep a held-out set honest: no example is counted twice.
        """
        space = sum(10**k for k in range(self.min_len, self.max_len + 1))
        if n > space // 2:
            raise ValueError(f"task {self.name!r}: {n} distinct examples requested, only {space} exist")
        rng = random.Random(f"{self.name}:{seed}")  # str seeds hash deterministically (not PYTHONHASHSEED)
        seen: set[str] = set()
        out: list[tuple[str, str]] = []
        while len(out) < n:
            prompt, answer = self.sample(rng)
            if prompt not in seen:
                seen.add(prompt)
                out.append((prompt, answer))
        return out

    def render(self, prompt: str, answer: str) -> str:
        """The training text of one example: ``prompt + answer + TERMINATOR``."""
        return f"{prompt}{answer}{TERMINATOR}"


def _shift_by(k: int) -> Callable[[str], str]:
    def shift(digits: str) -> str:
        return "".join(DIGITS[(int(d) + k) % 10] for d in digits)

    return shift


TASKS: dict[str, Task] = {
    "copy": Task("copy", "c", lambda d: d),
    "decrement": Task("decrement", "d", _shift_by(-1)),
    "shift": Task("shift", "s", _shift_by(1)),
    "reverse": Task("reverse", "r", lambda d: d[::-1]),
}


DEMO_DIGITS = 6
"""Digit-string length of the demo pair's tasks (``deltazip.demo.pair.ToyConfig`` defaults to it)."""


def get_task(name: str, digits: int | None = None) -> Task:
    """The registered task called ``name`` (with inputs of exactly ``digits`` digits when given); the
    error lists the known names."""
    try:
        task = TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
    return task if digits is None else dataclasses.replace(task, min_len=digits, max_len=digits)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def exact_match_accuracy(
    model: torch.nn.Module,
    tokenizer,
    examples: Sequence[tuple[str, str]],
    max_new_tokens: int | None = None,
    batch_size: int = 128,
) -> float:
    """Fraction of ``examples`` whose greedy continuation equals the answer exactly.

    Prompts are grouped by token length so a batch never needs padding: the only thing asked of
    ``model`` is ``model(input_ids=ids).logits`` of shape ``[batch, seq, vocab]``, so a runtime model
    with the same forward signature is scored by the very same code. No KV cache is used: sequences
    here are a few dozen tokens, and recomputing keeps the contract that small.

    Args:
        model: causal LM; put in eval mode for the call and restored afterwards.
        tokenizer: adds BOS itself (``add_special_tokens=True``), as at training time.
        examples: (prompt, answer) pairs.
        max_new_tokens: generation budget; default ``len(longest answer) + 1`` (room for ``;``).
        batch_size: prompts per forward pass.

    Returns:
        Accuracy in [0, 1]; a continuation is cut at the first ``;`` or EOS before comparing.
    """
    if not examples:
        raise ValueError("exact_match_accuracy needs at least one example")
    if max_new_tokens is None:
        max_new_tokens = (
            max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in examples) + 1
        )
    stop_ids = {tokenizer.convert_tokens_to_ids(TERMINATOR)}
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    stop = torch.tensor(sorted(stop_ids))
    device = _model_device(model)

    by_len: dict[int, list[tuple[list[int], str]]] = {}
    for prompt, answer in examples:
        ids = tokenizer(prompt)["input_ids"]
        by_len.setdefault(len(ids), []).append((ids, answer))

    was_training = model.training
    model.eval()
    correct = 0
    try:
        for group in by_len.values():
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                ids = torch.tensor([c[0] for c in chunk], device=device)  # [B, T]
                prompt_len = ids.shape[1]
                done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
                for _ in range(max_new_tokens):
                    nxt = model(input_ids=ids).logits[:, -1].argmax(-1)  # [B]
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    done |= torch.isin(nxt, stop.to(device))
                    if bool(done.all()):
                        break
                for row, (_, answer) in zip(ids[:, prompt_len:].tolist(), chunk):
                    text = tokenizer.decode(row, skip_special_tokens=False)
                    if tokenizer.eos_token:
                        text = text.split(tokenizer.eos_token, 1)[0]
                    # Exact match needs the terminator too: "4029" then running on is not an answer.
                    if TERMINATOR in text and text.split(TERMINATOR, 1)[0] == answer:
                        correct += 1
    finally:
        model.train(was_training)
    return correct / len(examples)


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, tokenizer, texts: Sequence[str], batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) over every predicted token of ``texts``.

    Texts are tokenized with BOS, right-padded; pad positions carry no loss. The mean is over tokens,
    not over texts, so long texts weigh more (the usual LM convention).

    Args:
        model: causal LM called as ``model(input_ids=[B, T], attention_mask=[B, T]).logits``.
        tokenizer: must have a pad token.
        texts: full training-format texts, e.g. ``Task.render(prompt, answer)``.
    """
    if not texts:
        raise ValueError("heldout_loss needs at least one text")
    return _token_loss(model, tokenizer, list(texts), [0] * len(texts), batch_size)


@torch.no_grad()
def answer_loss(model: torch.nn.Module, tokenizer, examples: Sequence[tuple[str, str]], batch_size: int = 64) -> float:
    """Mean cross-entropy (nats/token) of each answer and its terminator, given its prompt.

    What a fine-tune learned, measured without the prompt's digits (random, so their loss is a noise
    floor that no model can lower and that hides differences between models that all answer right).

    Args:
        model: causal LM called as ``model(input_ids=[B, T], attention_mask=[B, T]).logits``.
        tokenizer: must have a pad token; the prompt's tokens must be a prefix of the full text's
            (true of the demo's character tokenizer).
        examples: (prompt, answer) pairs.
    """
    if not examples:
        raise ValueError("answer_loss needs at least one example")
    texts = [f"{p}{a}{TERMINATOR}" for p, a in examples]
    skip = []
    for (p, _), t in zip(examples, texts):
        prompt_ids = tokenizer(p)["input_ids"]
        if tokenizer(t)["input_ids"][: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"the tokens of prompt {p!r} are not a prefix of those of its full text")
        skip.append(len(prompt_ids))
    return _token_loss(model, tokenizer, texts, skip, batch_size)


def _token_loss(model: torch.nn.Module, tokenizer, texts: list[str], skip: list[int], batch_size: int) -> float:
    """Mean next-token cross-entropy over the tokens of ``texts`` from index ``skip[i]`` on (the
    first ``skip[i]`` tokens of text ``i`` are context only)."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the loss needs a tokenizer with a pad token")
    device = _model_device(model)
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(
                texts[start : start + batch_size],
                padding=True,
                padding_side="right",
                return_tensors="pt",
            )
            ids = enc["input_ids"].to(device)  # [B, T]
            mask = enc["attention_mask"].to(device)  # [B, T]
            logits = model(input_ids=ids, attention_mask=mask).logits.float()  # [B, T, V]
            keep = mask[:, 1:].clone()  # [B, T-1]: the prediction of token t+1
            for row, k in enumerate(skip[start : start + batch_size]):
                keep[row, : max(k - 1, 0)] = 0  # predictions of context tokens 1..k-1
            targets = ids[:, 1:].masked_fill(keep == 0, -100)  # [B, T-1]
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            total += float(loss)
            count += int((targets != -100).sum())
    finally:
        model.train(was_training)
    return total / count
