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

ATTR = "_deltazip_sinks"  # where the attention module holds its DeltaSinks (not a submodule)


class DeltaSinks(nn.Module):
    """Per-row attention sinks of one attention module (module docstring).

    Args:
        attn: the attention module (its ``sinks`` parameter ``[H]``).
        ctx: the model's ``DeltaContext``.
    """

    def __init__(self, attn: nn.Module, ctx):
        super().__init__()
        sinks = attn.sinks
        self.ctx = ctx
        self._table = sinks.detach().unsqueeze(0).repeat(ctx.num_slots + 1, 1)  # [N + 1, H]
        self._row = torch.zeros(ctx.num_slots + 1, dtype=torch.int64, device=sinks.device)  # slot + 1 -> row
        self._slots: set[int] = set()
        attn.__dict__[ATTR] = self  # a plain attribute: no second registration of the model's parameters

    def clear_slot(self, slot: int) -> None:
        self._row[slot + 1] = 0
        self._slots.discard(slot)

    def load_slot(self, slot: int, sinks: torch.Tensor) -> None:
        """The variant's whole sinks ``[H]``."""
        if tuple(sinks.shape) != tuple(self._table.shape[1:]):
            raise ValueError(f"attention sinks {tuple(sinks.shape)} != base {tuple(self._table.shape[1:])}")
        self._table[slot + 1].copy_(sinks)
        self._row[slot + 1] = slot + 1
        self._slots.add(slot)

    def resident_bytes(self, slot: int) -> int:
        return self._table[0].numel() * self._table.element_size() if slot in self._slots else 0

    def rows(self, base: torch.Tensor) -> torch.Tensor:
        """The sinks the attention uses: ``base`` ``[H]`` when no row's variant changed them, else
        ``[B, H]``, row ``b`` its slot's (the base's for base rows)."""
        if not (self._slots & self.ctx.active):
            return base
        return self._table[self._row[self.ctx.row_slot + 1]]


def per_row_sinks(module: nn.Module, s_aux: torch.Tensor) -> torch.Tensor:
    """``s_aux`` as the attention function should apply it to this batch (per row when decoupled)."""
    delta = module.__dict__.get(ATTR)
    return s_aux if delta is None else delta.rows(s_aux)
