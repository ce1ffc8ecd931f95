"""Learned elementwise output scales with a per-row value: :class:`DeltaScale`.

Gemma 3n's AltUp module scales each layer's corrected prediction by its own ``correct_output_scale``
``[H]``: its ``forward(x)`` is ``x * scale``, and the decoder layer reaches it through
``altup.scale_corrected_output(x)``, which calls ``self.forward`` directly (no ``__call__``, so no
forward hook sees it). A full fine-tune moves the scale. The module stays where it is: a
:class:`DeltaScale` keeps a ``[N + 1, H]`` table (row 0 the base's) and sets the module's ``forward``
on the instance, which both a call and a direct ``self.forward`` reach; there each batch row is
multiplied by its own slot's scale.

Which parameters qualify is measured, not named (:func:`output_scale_param`): a one-dimensional
parameter ``p`` of a module whose forward of a random input ``x`` gives ``x * p``.
"""

from __future__ import annotations

import torch
from torch import nn

from deltazip.runtime.serve.slot_vectors import SlotVectors

ATTR = "_deltazip_scale"  # where the module holds its DeltaScale (a plain attribute, not a submodule)


def output_scale_param(mod: nn.Module) -> str | None:
    """The name of ``mod``'s own one-dimensional parameter ``p`` when ``mod``'s forward is ``x * p``
    (checked on a random ``[2, 3, len(p)]`` input), else None."""
    own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.dim() == 1 and not p.is_meta]
    if len(own) != 1:
        return None
    name, p = own[0]
    x = torch.randn(2, 3, p.numel(), generator=torch.Generator().manual_seed(0)).to(p.device, p.dtype)
    try:
        with torch.no_grad():
            out = type(mod).forward(mod, x)  # the class's own forward, also once decoupled
    except Exception:  # a forward that takes other inputs: not an output scale
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return name if torch.equal(out, (x * p).to(out.dtype)) else None


class DeltaScale(SlotVectors):
    """Per-row values of an output-scale parameter (module docstring).

    Args:
        mod: the module (its forward is ``x * getattr(mod, attr)``).
        attr: the parameter's name (:func:`output_scale_param`).
        ctx: the model's ``DeltaContext``.
    """

    def __init__(self, mod: nn.Module, attr: str, ctx):
        super().__init__(getattr(mod, attr), attr, ctx)
        self._plain = type(mod).forward.__get__(mod)
        mod.__dict__[ATTR] = self
        mod.__dict__["forward"] = self.scaled  # on the instance: a call and ``self.forward`` both reach it

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, ..., H]`` times each row's scale (the base's for base rows)."""
        if not self.changed():
            return self._plain(x)
        scale = self.per_row()  # [B, H]
        scale = scale.view(scale.shape[0], *([1] * (x.dim() - 2)), scale.shape[-1])
        return (x.to(scale.dtype) * scale).to(x.dtype)
