"""One vector parameter with a value per slot: :class:`SlotVectors`.

What :class:`deltazip.runtime.serve.delta_sinks.DeltaSinks` (GPT-OSS's attention sinks) and
:class:`deltazip.runtime.serve.delta_scale.DeltaScale` (Gemma 3n's output scale) hold: a variant's
whole vector per slot, read per batch row.
"""

from __future__ import annotations

import torch
from torch import nn


class SlotVectors(nn.Module):
    """A ``[N + 1, H]`` table of parameter ``name`` (row 0 the base's, row ``s + 1`` slot ``s``'s).

    Args:
        base: the base's vector ``[H]``.
        name: the parameter's name (the key ``load_slot`` takes it by, and in messages).
        ctx: the model's ``DeltaContext`` (slots active in the batch, each row's slot).
    """

    def __init__(self, base: torch.Tensor, name: str, ctx):
        super().__init__()
        self.ctx, self.name = ctx, name
        self._table = base.detach().unsqueeze(0).repeat(ctx.num_slots + 1, 1)  # [N + 1, H]
        self._row = torch.zeros(ctx.num_slots + 1, dtype=torch.int64, device=base.device)  # slot + 1 -> row
        self._slots: set[int] = set()

    def clear_slot(self, slot: int) -> None:
        self._row[slot + 1] = 0
        self._slots.discard(slot)

    def load_slot(self, slot: int, **tensors: torch.Tensor) -> None:
        """The variant's whole vector ``[H]``, by the parameter's name."""
        t = tensors[self.name]
        if tuple(t.shape) != tuple(self._table.shape[1:]):
            raise ValueError(f"{self.name} {tuple(t.shape)} != base {tuple(self._table.shape[1:])}")
        self._table[slot + 1].copy_(t)
        self._row[slot + 1] = slot + 1
        self._slots.add(slot)

    def resident_bytes(self, slot: int) -> int:
        return self._table[0].numel() * self._table.element_size() if slot in self._slots else 0

    def changed(self) -> bool:
        """Whether a row of this batch belongs to a slot holding its own vector."""
        return bool(self._slots & self.ctx.active)

    def per_row(self) -> torch.Tensor:
        """``[B, H]``: row ``b`` its slot's vector (the base's for base rows)."""
        return self._table[self._row[self.ctx.row_slot + 1]]
