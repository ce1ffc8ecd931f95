"""Which expert a fused mixture-of-experts parameter's ``F.linear`` call runs: ``ExpertTap``.

transformers 5's eager experts forward runs ``F.linear(x_e, param[e])`` for every expert that got
tokens, with ``x_e`` the routed tokens' hidden states (gate/up) or the expert's own intermediate
activations (down); experts stored ``[E, in, out]`` (GPT-OSS) run ``x_e @ param[e]`` instead, and
Llama 4's run ``torch.bmm(x, param)`` on every token (``x [E, T, in]``; a token's rows are zero for the
experts it was not routed to, and are dropped: they add nothing to any product or Hessian).
``ExpertTap`` (a ``TorchFunctionMode``) sees those calls and tells the expert by where the weight view
starts in the parameter's storage. The model walk uses it to find the true-sequential groups of a
layer; ΔCompress to gather each expert's Hessian.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)  # `x @ w` arrives as Tensor.matmul
_BMMS = (torch.bmm, torch.Tensor.bmm, *_MATMULS)


class ExpertTap(TorchFunctionMode):
    """Calls ``fn(key, expert, x)`` for each ``F.linear(x, w)`` (or ``x @ w``) whose ``w`` is expert
    ``e``'s matrix (or rows of it) of a tracked fused parameter ``[E, out, in]`` (``[E, in, out]``), and
    for each expert's routed rows of ``torch.bmm(x, w)`` whose ``w`` is a whole tracked ``[E, in, out]``.

    Args:
        params: site key -> fused parameter (real tensors).
        fn: callback; ``x`` is the input as passed (``[..., in]``).
    """

    def __init__(self, params: dict[str, torch.Tensor], fn: Callable[[str, int, torch.Tensor], None]):
        super().__init__()
        self.fn = fn
        self._by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for key, p in params.items():
            self._by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((key, p))

    def which(self, w) -> tuple[str, int] | None:
        """``(key, expert)`` when ``w`` is a view of one expert's rows of a tracked parameter."""
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type == "meta":
            return None
        for key, p in self._by_storage.get(w.untyped_storage().data_ptr(), ()):
            e = (w.storage_offset() - p.storage_offset()) // p.stride(0)
            if 0 <= e < p.shape[0] and w.shape[-1] == p.shape[-1] and tuple(w.stride()) == tuple(p.stride()[1:]):
                return key, e
        return None

    def whole(self, w) -> str | None:
        """The key of the tracked parameter ``w`` is (all of it, as stored), else None."""
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.device.type == "meta":
            return None
        for key, p in self._by_storage.get(w.untyped_storage().data_ptr(), ()):
            if (w.storage_offset(), w.shape, w.stride()) == (p.storage_offset(), p.shape, p.stride()):
                return key
        return None

    def _batched(self, key: str, x: torch.Tensor) -> None:
        """Expert ``e``'s rows of ``x [E, T, in]``: those not all zero (the tokens routed to it)."""
        for e in range(x.shape[0]):
            rows = x[e][x[e].abs().amax(dim=-1) > 0]
            if rows.shape[0]:
                self.fn(key, e, rows)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            hit = self.which(args[1] if len(args) > 1 else kwargs.get("weight"))
            if hit is not None:
                self.fn(hit[0], hit[1], x)
        elif func in _BMMS and len(args) == 2:
            hit = self.which(args[1])
            if hit is not None:
                self.fn(hit[0], hit[1], args[0])
            elif (key := self.whole(args[1])) is not None and args[0].dim() == 3:
                self._batched(key, args[0])
        return func(*args, **kwargs)


def tap_experts(params: dict[str, torch.Tensor], fn) -> contextlib.AbstractContextManager:
    """``ExpertTap`` when there is a fused parameter to watch (else nothing: no per-op overhead)."""
    return ExpertTap(params, fn) if params else contextlib.nullcontext()
