"""ALiBi position biases cut to a rank's attention heads: :func:`slice_alibi`.

BLOOM, MPT and Falcon-RW add to each head's attention scores a linear bias over key positions, with
a slope per head (ALiBi). The model builds the biases for all its heads once per forward, above the
decoder layers, and hands them to every attention module: BLOOM as ``alibi [B * H, 1, K]`` (added by
``baddbmm``), MPT as ``position_bias [H, Q, K]``, Falcon as ``alibi [B * H, 1, K]`` and, where it
runs SDPA, folded into ``attention_mask [B, H, Q, K]``. A rank keeps heads ``[r H/N, (r + 1) H/N)``
(its span of the fused query-key-value rows); a pre-hook on each attention module takes the same
span of those tensors before the module runs, so every head keeps the full model's slope.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from deltazip.runtime.cluster.tp_shards import span

ALIBI_ARGS = ("alibi", "position_bias", "attention_mask")


def uses_alibi(config) -> bool:
    """Whether a (text) config's attention adds per-head ALiBi biases: BLOOM, MPT with ``alibi``
    (its default), Falcon with ``alibi`` (Falcon-RW)."""
    mt = getattr(config, "model_type", None)
    if mt == "mpt":
        return bool(getattr(getattr(config, "attn_config", None), "alibi", False))
    return mt == "bloom" or (mt == "falcon" and bool(getattr(config, "alibi", False)))


def slice_alibi(attn: nn.Module, heads: int, rank: int, world: int) -> None:
    """Cut the ALiBi tensors ``attn``'s forward receives (module docstring) to rank ``rank``'s span of
    the model's ``heads`` heads, by a forward pre-hook; tensors of other shapes pass unchanged."""
    names = list(inspect.signature(attn.forward).parameters)
    keep = span(heads, rank, world)

    def cut(name: str, t, batch: int):
        if not isinstance(t, torch.Tensor):
            return t
        if name == "position_bias" and t.dim() == 3 and t.shape[0] == heads:
            return t[keep]
        if name == "alibi" and t.dim() >= 2 and t.shape[0] == batch * heads:
            return t.view(batch, heads, *t.shape[1:])[:, keep].reshape(-1, *t.shape[1:])
        if name == "attention_mask" and t.dim() == 4 and t.shape[1] == heads > 1:
            return t[:, keep]
        return t

    def hook(_mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        batch = hidden.shape[0]
        args = tuple(cut(n, a, batch) if n in ALIBI_ARGS else a for n, a in zip(names, args))
        return args, {k: cut(k, v, batch) if k in ALIBI_ARGS else v for k, v in kwargs.items()}

    attn.register_forward_pre_hook(hook, with_kwargs=True)
