"""Per-variant values of vision-side parameters that no decoupled module applies per row.

An image-text fine-tune that trained its vision tower also changes tensors such as CLIP's class
embedding and the patch convolution. The batched steps never run the vision tower: it runs only when
a prompt's images are read (``prompt_media``), once per request, with that request's variant alone.
So a changed vision tensor needs no per-row form: :class:`VisionParams` keeps each slot's values of a
module's parameters and puts them in place for that forward only (:meth:`applied`), the base's back
after it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class VisionParams:
    """Slot values of some parameters of ``module`` (attached to it; the module stays in the model)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._slots: dict[int, dict[str, torch.Tensor]] = {}

    def load_slot(self, slot: int, **values: torch.Tensor) -> None:
        """Slot ``slot``'s values, by parameter name (in the model's dtype)."""
        device = next(iter(self.module.parameters())).device
        self._slots[slot] = {a: t.to(device) for a, t in values.items()}

    def clear_slot(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def resident_bytes(self, slot: int) -> int:
        return sum(t.numel() * t.element_size() for t in self._slots.get(slot, {}).values())

    @contextmanager
    def applied(self, slot: int):
        """Within: the module's parameters hold slot ``slot``'s values (the base's where it has none)."""
        values = self._slots.get(slot, {})
        params = {a: getattr(self.module, a) for a in values}
        saved = {a: p.data for a, p in params.items()}
        try:
            for a, p in params.items():
                p.data = values[a]
            yield
        finally:
            for a, p in params.items():
                p.data = saved[a]
