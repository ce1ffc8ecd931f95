"""Attention sinks with a per-row value: :class:`DeltaSinks`.

GPT-OSS's attention modules hold ``sinks`` ``[H]``, one logit per head that joins every softmax's
denominator; a full fine-tune changes them. The attention module is not replaced: a
:class:`DeltaSinks` keeps a ``[N + 1, H]`` table (row 0 the base's) and is attached to the module, and
the paged attention function (``deltazip.runtime.serve.attention``), which transformers hands the
module, takes each batch row's sinks from it (:meth:`DeltaSinks.rows`). Only the paged attention reads
it, so a variant's sinks are decoupled only on a model that runs it (``DeltaModel`` checks).
"""

from __future__ import annotations

import torch
from torch import nn

from deltazip.runtime.serve.slot_vectors import SlotVectors

ATTR = "_deltazip_sinks"  # where the attention module holds its DeltaSinks (not a submodule)


class DeltaSinks(SlotVectors):
    """Per-row attention sinks of one attention module (module docstring).

    Args:
        attn: the attention module (its ``sinks`` parameter ``[H]``).
        ctx: the model's ``DeltaContext``.
    """

    def __init__(self, attn: nn.Module, ctx):
        super().__init__(attn.sinks, "sinks", ctx)
        attn.__dict__[ATTR] = self  # a plain attribute: no second registration of the model's parameters

    def rows(self, base: torch.Tensor) -> torch.Tensor:
        """The sinks the attention uses: ``base`` ``[H]`` when no row's variant changed them, else
        ``[B, H]``, row ``b`` its slot's (the base's for base rows)."""
        return self.per_row() if self.changed() else base


def per_row_sinks(module: nn.Module, s_aux: torch.Tensor) -> torch.Tensor:
    """``s_aux`` as the attention function should apply it to this batch (per row when decoupled)."""
    delta = module.__dict__.get(ATTR)
    return s_aux if delta is None else delta.rows(s_aux)
