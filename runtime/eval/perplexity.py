"""Perplexity on a text file, in non-overlapping windows of the model's context.

The protocol of the GPTQ / SparseGPT evaluation code (IST-DASLab): tokenize the whole text once,
cut it into ``n = len(tokens) // window`` consecutive windows (the tail shorter than a window is
dropped), score every window independently from its first token, and report
``exp(mean over windows of the window's mean next-token NLL)``. All windows have the same length, so
that equals ``exp(total NLL / predicted tokens)``. A text shorter than one window is scored as a
single window of all its tokens, so short test files still give a number (the window is reported).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deltazip.formats.errors import InputError


@dataclass
class PerplexityResult:
    """Attributes: perplexity, windows scored, window length in tokens, tokens predicted."""

    perplexity: float
    windows: int
    window: int
    tokens: int

    def to_dict(self) -> dict:
        return {"perplexity": self.perplexity, "windows": self.windows, "window": self.window,
                "tokens_predicted": self.tokens}


def read_text(path: str | Path) -> str:
    """The file's text (UTF-8); a one-line error when it is missing, unreadable or empty."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--perplexity {p}: no such file; pass a UTF-8 text file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--perplexity {p}: cannot be read as UTF-8 text ({e})") from e
    if not text.strip():
        raise InputError(f"--perplexity {p}: the file is empty; pass a file with text in it")
    return text


def windows_of(token_ids: torch.Tensor, window: int) -> torch.Tensor:
    """Non-overlapping windows: ``[N]`` ids -> ``[n, window]`` (or ``[1, N]`` when ``N < window``)."""
    n = token_ids.numel() // window
    if n == 0:
        return token_ids.view(1, -1)
    return token_ids[: n * window].view(n, window)


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer, text: str, window: int, batch_size: int = 1) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` (see the module docstring for the protocol).

    Args:
        model: a causal LM whose ``model(input_ids).logits`` is ``[B, T, V]``.
        tokenizer: its tokenizer; the text is encoded once with the tokenizer's default special tokens.
        window: tokens per window (the model's context, or less).
        batch_size: windows per forward.
    """
    if window < 2:
        raise InputError(f"perplexity window must be >= 2 tokens, got {window}")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if ids.numel() < 2:
        raise InputError("the perplexity text encodes to fewer than 2 tokens; pass a longer text")
    wins = windows_of(ids, window)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, wins.shape[0], batch_size):
        batch = wins[i: i + batch_size].to(device)
        logits = model(batch).logits.float()  # [b, T, V]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return PerplexityResult(math.exp(total / count), int(wins.shape[0]), int(wins.shape[1]), count)
