"""The one way a causal LM is built from a checkpoint directory (transformers' own loader, so its
checkpoint-key conventions apply), with one error: a directory transformers cannot load as a causal
LM is one line naming it, never a traceback.

Serving wraps it with the attention choice and its start-up self-check
(``deltazip.runtime.serve.model.load_base_model``); merging builds the fine-tune from a merged
checkpoint with it (``deltazip.compress.merge.load_merged_model``); eval loads plain HF targets with
it. ``deltazip.runtime.share.dedup_loader`` is not a third way of reading weights into the same
classes but a registry-backed one (weights shared by identity across models).
"""

from __future__ import annotations

from pathlib import Path

from deltazip.formats.errors import InputError


def load_causal_lm(path: str | Path, dtype, attn_implementation: str | None = None, what: str = "model"):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` (CPU, eval mode).

    Args:
        what: how messages name the directory (``"base"``, ``"checkpoint x"``).
    Raises:
        InputError: unknown architecture, missing or broken weights.
    """
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kw)
    except Exception as e:  # unknown architecture, broken weights
        raise InputError(f"{what} {path} cannot be loaded as a causal LM ({type(e).__name__}: {e})") from e
    return model.eval()
