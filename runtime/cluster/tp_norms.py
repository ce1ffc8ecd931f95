"""Norms over a width that tensor parallelism splits, split with it.

OLMo 2/3, OLMoE, FlexOlmo and MiniMax-M2 normalise ``q_proj``'s whole output ``[T, H * d]`` (and
``k_proj``'s, ``[T, H_kv * d]``) before splitting it into heads; BitNet normalises the attention's
output before ``o_proj`` and the MLP's product before ``down_proj`` (its sub-layer norms). A rank
holds its share of those columns only, so its norm keeps the same columns of the weight, and the
root mean square over the full width is found from each rank's sum of squares, all-reduced: one
``[T, 1]`` fp32 all-reduce per norm and step. Gemma 3n's sparse MLP gates take the same kind of
statistics (mean and deviation) over the split intermediate width (:func:`split_activation_sparsity`).
"""

from __future__ import annotations

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.runtime.cluster.tp_shards import span
from deltazip.runtime.serve.delta_norms import RMS_SCALES, norm_eps, rms_norm_style

# a norm over a split width -> the projection beside it, and which of its widths (0: out, 1: in) it spans
SPLIT_NORMS = {"q_norm": ("q_proj", 0), "k_norm": ("k_proj", 0), "attn_sub_norm": ("o_proj", 1),
               "ffn_sub_norm": ("down_proj", 1)}


class ShardedRMSNorm(nn.Module):
    """Rank ``rank``'s columns of an RMSNorm over ``full`` columns.

    Args:
        base: the whole norm (its weight ``[full]``; a style of :data:`RMS_SCALES`).
        style: how it scales (``rms_norm_style(base)``).
        rank, world: this rank and the degree; the columns kept are ``span(full, rank, world)``.
        group: the tensor-parallel group (``all_reduce``).
    """

    def __init__(self, base: nn.Module, style: str, rank: int, world: int, group):
        super().__init__()
        self.full = base.weight.shape[0]
        w = base.weight.detach().as_subclass(torch.Tensor)  # (a read-only registry tensor: the columns are new memory)
        self.weight = nn.Parameter(w[span(self.full, rank, world)].clone(), requires_grad=False)
        self.variance_epsilon = norm_eps(base)
        self.style, self.group = style, group

    def norm_rows(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The norm of ``x`` ``[..., full / world]`` over the full width, scaled by ``weight`` (this
        rank's ``[full / world]`` columns, or one such row per token: a decoupled variant's)."""
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        self.group.all_reduce(squares)
        return RMS_SCALES[self.style](h * torch.rsqrt(squares / self.full + eps), weight, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_rows(x, self.weight, self.variance_epsilon)


def split_norms(mod: nn.Module, name: str, full_linears: dict[str, tuple[int, int]], rank: int, world: int,
                group) -> list[str]:
    """Replace the norms of module ``name`` that span a split width (the full ``out`` of the column-parallel
    projection beside them, or the full ``in`` of the row-parallel one: ``full_linears[name.proj]``,
    ``(out, in)``) with their :class:`ShardedRMSNorm`; the children replaced. One head's norm
    (``[head_dim]``) is no such width.

    Raises:
        InputError: such a norm is not an RMSNorm of :data:`RMS_SCALES` (a bias, a mean subtracted),
            whose statistics one sum of squares would not give.
    """
    split = []
    head_dim = getattr(mod, "head_dim", None)
    for child, (proj, axis) in SPLIT_NORMS.items():
        norm, shape = getattr(mod, child, None), full_linears.get(f"{name}.{proj}")
        w = getattr(norm, "weight", None)
        if shape is None or not isinstance(w, torch.Tensor) or w.dim() != 1 or w.shape[0] != shape[axis]:
            continue
        if w.shape[0] == head_dim:  # one head's norm over a single KV head's keys: per head all the same
            continue
        style = rms_norm_style(norm)
        if style not in RMS_SCALES:
            raise InputError(f"--tensor-parallel cannot split {name}.{child} ({type(norm).__name__} over the full "
                             f"width {shape[axis]}, not an RMSNorm); serve this base with --tensor-parallel 1")
        setattr(mod, child, ShardedRMSNorm(norm, style, rank, world, group))
        split.append(child)
    return split


def split_activation_sparsity(mlp: nn.Module, full: int, group) -> bool:
    """Make a Gemma 3n MLP whose gate is sparsified (``activation_sparsity > 0``: it keeps
    ``relu(g - (mean + z * std))``, mean and deviation over the gate's full ``full`` outputs, ``z`` the
    normal quantile of the sparsity) take them over every rank's columns: two ``[T, 1]`` fp32
    all-reduces (sum, then sum of squared deviations); whether it was one."""
    sparsity = getattr(mlp, "activation_sparsity", 0.0)
    if not callable(getattr(mlp, "_gaussian_topk", None)) or not sparsity > 0.0:
        return False
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity, dtype=torch.float32)))

    def gaussian_topk(g: torch.Tensor) -> torch.Tensor:
        """``g [..., full / world]`` (this rank's gate outputs) sparsified by the full width's statistics."""
        h = g.float()
        mean = group.all_reduce(h.sum(-1, keepdim=True)) / full
        var = group.all_reduce((h - mean).pow(2).sum(-1, keepdim=True)) / full
        return nn.functional.relu(g - (mean + var.sqrt() * z).to(g.dtype))

    mlp._gaussian_topk = gaussian_topk  # (the instance's, found before the class's by its forward)
    return True
