"""Activation modules with learned parameters, per row: :class:`DeltaActivation`.

Apertus's xIELU (``transformers.activations.XIELUActivation``) learns two scalars per layer,
``alpha_p`` and ``alpha_n`` ``[1]``, which a full fine-tune moves. An activation is elementwise, so
the rows of a slot whose variant changed them can run the module's own forward with that slot's
tensors, as :class:`~deltazip.runtime.serve.delta_experts.DeltaRouter` does for routers; rows of
other slots and of the base run it with the base's.
"""

from __future__ import annotations

import torch
from torch import nn

from deltazip.runtime.serve.delta_experts import DeltaRouter, router_tensors


def is_learned_activation(mod: nn.Module, attr: str) -> bool:
    """``mod`` is one of transformers' activation modules and ``attr`` one of its own tensors."""
    return type(mod).__module__ == "transformers.activations" and attr in router_tensors(mod)


class DeltaActivation(DeltaRouter):
    """An activation ``[..., I] -> [..., I]`` whose rows of a changed variant use that variant's
    parameters (``load_slot(slot, alpha_p=..., alpha_n=...)``: whole tensors, not deltas)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).view(x.shape)
