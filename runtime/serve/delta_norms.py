"""Decoupled norms: one forward over rows of many variants, each row scaled by its own variant's weights.

A variant that changes a norm (every full fine-tune does) gives each slot its own weight (and bias)
row; the module gathers one row per token and normalises once. Which norm a model's module computes
is found by running it on a probe (:func:`rms_norm_style`, :func:`layer_norm_offset`), not by class
name, so the decoupled forward is the model's own formula, bit for bit, in its dtype.

Shapes: activations ``[..., H]``; weight tables ``[N + 1, H]`` (row 0 the base's, row ``s + 1`` slot ``s``'s).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deltazip.runtime.serve.delta_linear import DeltaContext, slot_lookup


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` divided by its root mean square over the last dimension, in fp32 (every RMS style's first half)."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


# How each RMS style scales the fp32-normalised rows ``h`` by ``weight`` and casts to ``dtype``:
# Llama's casts, then scales (rounding twice in bf16); the fp32 form (OLMo 2/3, GPT-OSS, Gemma 3n/4,
# Helium, Nemotron-H) scales in fp32 and casts once; Gemma's scales by ``1 + w`` in fp32.
RMS_SCALES = {
    "llama": lambda h, w, dtype: w * h.to(dtype),
    "fp32": lambda h, w, dtype: (w.float() * h).to(dtype),
    "gemma": lambda h, w, dtype: (h * (1.0 + w.float())).to(dtype),
}


def rms_norm(style: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., H]`` in style ``style`` (a key of :data:`RMS_SCALES`) with a weight ``[H]``
    or broadcastable (one row per token)."""
    return RMS_SCALES[style](rms_normalise(x, eps), weight, x.dtype)


def layer_norm_cohere(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm (``CohereLayerNorm``: the mean subtracted, a weight and no bias), all in fp32,
    then cast back. ``weight`` is ``[H]`` or broadcastable."""
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


# (in fp32 "llama" and "fp32" are the same formula; the first that matches is taken)
_NORM_STYLES = {**{k: functools.partial(rms_norm, k) for k in RMS_SCALES}, "cohere": layer_norm_cohere}


def norm_function(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None:
    """``f(x, weight, eps)``: what ``module`` computes with a weight of its shape, or None when it is not a
    norm this package reproduces. A norm that declares its own (``norm_rows``: one split across
    tensor-parallel ranks) is taken at its word; any other is probed (:func:`rms_norm_style`)."""
    own = getattr(module, "norm_rows", None)
    if callable(own):
        return own
    style = rms_norm_style(module)
    return None if style is None else _NORM_STYLES[style]


def norm_eps(module: nn.Module) -> float | None:
    """Epsilon of an RMSNorm module, or None when it is not one."""
    for attr in ("variance_epsilon", "eps"):
        v = getattr(module, attr, None)
        if isinstance(v, float):
            return v
    return None


def rms_norm_style(module: nn.Module) -> str | None:
    """``"llama"``, ``"fp32"``, ``"gemma"`` (:func:`rms_norm`'s styles) or ``"cohere"``
    (:func:`layer_norm_cohere`) when ``module`` computes exactly that norm with its weight, else None.

    Checked by running a copy of it on a probe, not by class name: norms that look alike but differ
    (LayerNorm's mean subtraction, a norm with a bias, where the weight multiply is rounded) fail the
    probe and are not decoupled. The copy's weight is random: a base's weight of ones (a fresh model's)
    would make the llama and fp32 forms agree, and a fine-tune's own weights would then not be
    applied as the model does.
    """
    w = getattr(module, "weight", None)
    eps = norm_eps(module)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or getattr(module, "bias", None) is not None:
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
    probe = copy.deepcopy(module)
    with torch.no_grad():
        w = probe.weight
        w.copy_(1 + 0.5 * torch.randn(w.shape, generator=g))
        try:
            got = probe(x)
        except Exception:  # an unexpected signature is as good as "not this kind of norm"
            return None
        if not isinstance(got, torch.Tensor):
            return None
        return next((k for k, f in _NORM_STYLES.items() if torch.equal(got, f(x, w, eps))), None)


def is_llama_rmsnorm(module: nn.Module) -> bool:
    """True when ``module`` computes exactly Llama's RMSNorm (:func:`rms_norm` ``"llama"``)."""
    return rms_norm_style(module) == "llama"


class DeltaRMSNorm(nn.Module):
    """A weight-only norm (Llama's or Gemma's RMSNorm, Cohere's LayerNorm: :func:`rms_norm_style`) with
    a per-row weight: row ``r`` is scaled by its slot's weight.

    The weight table is ``[N + 1, H]`` with row 0 the base weight; a slot whose variant keeps the
    norm "same" points at row 0.
    """

    def __init__(self, base: nn.Module, ctx: DeltaContext):
        super().__init__()
        norm = norm_function(base)
        if norm is None:
            raise ValueError(f"{type(base).__name__} is not an RMSNorm this module reproduces")
        self._norm = norm
        self.weight = base.weight
        self.eps = norm_eps(base)
        self.ctx = ctx
        self._table = base.weight.detach().unsqueeze(0).repeat(ctx.num_slots + 1, 1)
        self._row = slot_lookup(ctx.num_slots, base.weight.device)
        self._slots: set[int] = set()

    def clear_slot(self, slot: int) -> None:
        self._row[slot + 1] = 0
        self._slots.discard(slot)

    def load_slot(self, slot: int, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"norm weight {tuple(weight.shape)} != base {tuple(self.weight.shape)}")
        self._table[slot + 1].copy_(weight)
        self._row[slot + 1] = slot + 1
        self._slots.add(slot)

    def resident_bytes(self, slot: int) -> int:
        return 0 if slot not in self._slots else self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._slots & self.ctx.active):
            return self._norm(x, self.weight, self.eps)
        idx = self.ctx.token_index(x)
        w = self._table[self._row[idx + 1]].reshape(*x.shape[:-1], x.shape[-1])
        return self._norm(x, w, self.eps)


def layer_norm_offset(module: nn.Module) -> float | None:
    """What a LayerNorm adds to its weight before scaling: 0 for ``nn.LayerNorm`` (and subclasses that
    compute it), 1 for Nemotron's ``LayerNorm1P`` (``1 + w``), None for anything else (checked by running
    a subclass on a probe, as :func:`rms_norm_style` does)."""
    if (not isinstance(module, nn.LayerNorm) or module.weight is None or len(module.normalized_shape) != 1
            or isinstance(module, DeltaLayerNorm)):
        return None
    if type(module) is nn.LayerNorm:
        return 0.0
    w, b = module.weight, module.bias
    x = torch.randn(2, 3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            got = module(x)
        except Exception:  # an unexpected signature is as good as "not this kind of norm"
            return None
        return next((off for off in (0.0, 1.0) if isinstance(got, torch.Tensor) and torch.equal(
            got, F.layer_norm(x, module.normalized_shape, w + off if off else w, b, module.eps))), None)


class DeltaLayerNorm(nn.Module):
    """``nn.LayerNorm`` (GPT-NeoX, OPT, Phi, Falcon, ...; Nemotron's ``1 + w`` form) with a per-row weight
    and bias.

    Tables ``[N + 1, H]`` with row 0 the base's; a slot whose variant keeps the norm "same" points at
    row 0. A batch with no changed norm runs the original ``F.layer_norm``; otherwise every row is
    normalised once and scaled and shifted by its own row of the tables (one gather, whatever the
    number of variants).
    """

    def __init__(self, base: nn.LayerNorm, ctx: DeltaContext):
        super().__init__()
        offset = layer_norm_offset(base)
        if offset is None:
            raise ValueError("only LayerNorm over the last dimension with a weight can be decoupled")
        self.offset = offset  # the weight the norm scales by is weight + offset
        self.weight, self.bias = base.weight, base.bias
        self.normalized_shape, self.eps = tuple(base.normalized_shape), base.eps
        self.ctx = ctx
        n = ctx.num_slots
        self._w_table = base.weight.detach().unsqueeze(0).repeat(n + 1, 1)
        self._b_table = None if base.bias is None else base.bias.detach().unsqueeze(0).repeat(n + 1, 1)
        self._row = slot_lookup(n, base.weight.device)
        self._slots: set[int] = set()

    def clear_slot(self, slot: int) -> None:
        self._row[slot + 1] = 0
        self._slots.discard(slot)

    def load_slot(self, slot: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        """The variant's ``weight`` and/or ``bias`` ``[H]`` (the one not given stays the base's)."""
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and tuple(t.shape) != self.normalized_shape:
                raise ValueError(f"layer norm {name} {tuple(t.shape)} != base {self.normalized_shape}")
        if bias is not None and self._b_table is None:
            raise ValueError("the base layer norm has no bias; a variant cannot add one per row")
        self._w_table[slot + 1].copy_(self.weight if weight is None else weight)
        if self._b_table is not None:
            self._b_table[slot + 1].copy_(self.bias if bias is None else bias)
        self._row[slot + 1] = slot + 1
        self._slots.add(slot)

    def resident_bytes(self, slot: int) -> int:
        if slot not in self._slots:
            return 0
        per = self.weight.numel() * self.weight.element_size()
        return per * (1 if self._b_table is None else 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self._slots & self.ctx.active):
            w = self.weight + self.offset if self.offset else self.weight
            return F.layer_norm(x, self.normalized_shape, w, self.bias, self.eps)
        rows = self._row[self.ctx.token_index(x) + 1]
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        w = self._w_table[rows].reshape(x.shape)
        y = y * (w + self.offset if self.offset else w)
        if self._b_table is not None:
            y = y + self._b_table[rows].reshape(x.shape)
        return y
