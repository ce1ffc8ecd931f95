"""PEFT trainable tokens: the rows of a token table (and of the weights tied to it) an adapter replaces.

PEFT's ``trainable_token_indices`` (a LoRA setting) and its ``TRAINABLE_TOKENS`` adapters train a few
rows of a token table, such as the new special tokens of a chat template, and save only those rows:
``<module>.token_adapter.trainable_tokens_delta`` (``<module>.trainable_tokens_delta`` for a
``TRAINABLE_TOKENS`` adapter), ``[n, H]``, the rows' new values (not a difference) for token ids
``indices``. A list of indices names the input embeddings; a dict maps module names (or name
suffixes) to indices. Where the base ties weights to the input embeddings (``lm_head``), PEFT
replaces the same rows of those, unless the adapter gives such a module rows of its own.

Per request, an embedding reads the slot's rows in place of the base's
(``DeltaEmbedding.load_slot(token_ids=..., token_rows=...)``), and a linear (a tied ``lm_head``)
adds the rank-``n`` term ``onehot(indices) · (rows - W[indices])`` through the LoRA path
(:func:`lora_form`), which changes exactly those output rows. Swap mode copies the rows into the
merged weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltazip.formats.errors import InputError

_TOKENS = re.compile(r"^(?P<module>.+?)(\.token_adapter)?\.trainable_tokens_delta$")


@dataclass(frozen=True)
class TokenRows:
    """The rows an adapter replaces in one module's weight: ``key`` in the adapter file (``[n, H]``),
    the token ids ``indices`` (``n`` of them), and ``source``: the module they were saved for (another
    one where a tied weight takes the input embeddings' rows)."""

    key: str
    indices: tuple[int, ...]
    source: str


def token_module(key: str) -> str | None:
    """The module whose trainable-token rows adapter tensor ``key`` (PEFT's prefix removed) holds, or None."""
    m = _TOKENS.match(key)
    return None if m is None else m["module"]


def _indices_for(path: Path, cfg: dict[str, Any], module: str) -> list:
    """The config's token ids for ``module``'s saved rows."""
    given = cfg.get("token_indices") if str(cfg.get("peft_type", "")).upper() == "TRAINABLE_TOKENS" \
        else cfg.get("trainable_token_indices")
    if isinstance(given, dict):
        named = [ids for k, ids in given.items() if module == k or module.endswith(f".{k}")]
        if len(named) != 1:
            raise InputError(f"adapter {path}: it saves token rows of {module}, but its token indices "
                             f"{sorted(given)} name {'no' if not named else 'more than one'} entry for it; the "
                             "adapter files do not belong together")
        given = named[0]
    if not isinstance(given, list) or not given:
        raise InputError(f"adapter {path}: it saves token rows of {module} but no list of token indices; the "
                         "adapter files do not belong together")
    return given


def read_token_rows(path: Path, cfg: dict[str, Any], keys: dict[str, str], shapes: dict[str, tuple[int, ...]],
                    params: dict[str, tuple[int, ...]], aliases: dict[str, list[str]],
                    linears: dict[str, tuple[int, int]]) -> dict[str, TokenRows]:
    """``module -> TokenRows`` of every module whose rows the adapter replaces, tied weights included.

    Args:
        keys: module -> the key of its saved rows in the adapter file.
        shapes: adapter file key -> shape.
        params: the base's parameter shapes; aliases: parameter -> the parameters tied to it.
        linears: the base's linears (rows saved for a token table carry over to the linears tied to it).

    Raises:
        InputError: rows of a module the base lacks, a shape or index list that does not fit the
            base's table, or repeated token ids.
    """
    out: dict[str, TokenRows] = {}
    for module, key in sorted(keys.items()):
        shape = params.get(f"{module}.weight")
        if shape is None or len(shape) != 2:
            raise InputError(f"adapter {path}: it saves token rows of {module}, which is no token table or linear "
                             "of the served base; the adapter was trained on another architecture")
        ids = _indices_for(path, cfg, module)
        if not all(isinstance(i, int) and 0 <= i < shape[0] for i in ids) or len(set(ids)) != len(ids):
            raise InputError(f"adapter {path}: its token indices for {module} must be distinct ids below {shape[0]} "
                             f"(the base's vocabulary), got {ids[:8]}{'…' if len(ids) > 8 else ''}")
        if tuple(shapes[key]) != (len(ids), shape[1]):
            raise InputError(f"adapter {path}: {key} is {list(shapes[key])}, but {len(ids)} token indices of rows of "
                             f"{shape[1]} fit [{len(ids)}, {shape[1]}]; the adapter belongs to another base model")
        out[module] = TokenRows(key, tuple(ids), module)
    for module, rows in list(out.items()):
        if module in linears:  # (PEFT ties only the input embeddings' rows to the weights tied to them)
            continue
        for alias in aliases.get(f"{module}.weight", []):
            out.setdefault(alias.rsplit(".", 1)[0], TokenRows(rows.key, rows.indices, module))
    return out


def load_token_rows(path: Path, tokens: dict[str, TokenRows]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (ids [n] int64, rows [n, H])`` (CPU, rows as stored) of every module in ``tokens``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {m: (torch.tensor(r.indices, dtype=torch.long), f.get_tensor(r.key)) for m, r in tokens.items()}


def lora_form(ids: torch.Tensor, rows: torch.Tensor, base_rows: torch.Tensor, out_features: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's row replacement as LoRA factors ``A [n, in] = rows - W[ids]`` and a one-hot
    ``B [out, n]`` (``B[ids[j], j] = 1``): ``W + B A`` is ``W`` with rows ``ids`` replaced.
    ``base_rows = W[ids] [n, in]``; the factors in its dtype (the difference taken in fp32)."""
    a = (rows.float() - base_rows.float()).to(base_rows.dtype)
    b = torch.zeros(out_features, ids.shape[0], dtype=base_rows.dtype)
    b[ids, torch.arange(ids.shape[0])] = 1
    return a, b
