"""Recurrent token mixers split by channels, as tensor parallelism splits an attention by heads:
the gated delta nets of Qwen3.5 and Qwen3-Next, and LFM2's short convolutions.

**Gated delta net.** ``nk`` key heads and ``nv`` value heads, each key head serving ``nv/nk``
consecutive value heads; no head reads another's state. Rank ``r`` of ``n`` keeps key heads
``[r * nk/n, (r + 1) * nk/n)`` and the value heads they serve:

- ``in_proj_qkv [2 Dk + Dv, H]`` (queries, keys, values stacked): its rows of each block;
  ``in_proj_z [Dv, H]``, ``in_proj_b``/``in_proj_a [nv, H]``: a span of rows. Qwen3-Next's
  ``in_proj_qkvz``/``in_proj_ba`` lay out each key head's group together, so a span of rows is the
  rank's groups;
- ``conv1d [2 Dk + Dv, 1, K]``: depthwise (each channel reads only its own input), so the same
  channels as ``in_proj_qkv``'s rows;
- ``A_log``, ``dt_bias [nv]``: the rank's value heads; the gated norm ``[dv]`` is one head's and
  stays whole.

**Short convolution** (LFM2): ``in_proj [3 H, H]`` stacks the ``B``, ``C`` and ``x`` gates of ``H``
channels, each multiplied channel by channel around a depthwise ``conv [H, 1, K]``: a rank keeps
its span of channels in each block, and of the convolution.

``out_proj`` is row-parallel in both. Each rank's recurrent states are then its channels' alone (a
window ``[B, C/n, K]``, a state ``[B, nv/n, dk, dv]``): the serving state pool takes whatever
shapes the layer writes. A variant that changes the mixer's own tensors (a full fine-tune moves
``A_log``) is cut the same way (:func:`shard_mixer_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltazip.formats.errors import InputError
from deltazip.runtime.cluster.tp_shards import kept_rows, span

Index = torch.Tensor | slice | None  # kept rows of a tensor's first dimension (int64, or a span); None: whole


@dataclass(frozen=True)
class MixerShard:
    """What rank ``rank`` keeps of one recurrent mixer.

    Attributes:
        columns: its linears split by rows (column-parallel): child name -> the rows kept (int64),
            or None for the rank's span.
        own: its own tensors by name (``A_log``, ``conv1d.weight``): the rows kept, None for whole.
        conv: its depthwise convolution (a child).
        counts: head counts and widths its forward reads, each divided by the degree.
    """

    columns: dict[str, torch.Tensor | None]
    own: dict[str, Index]
    conv: str
    counts: tuple[str, ...] = ()


def _is_depthwise(conv) -> bool:
    return isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels


def mixer_shard(mod: nn.Module, rank: int, world: int) -> MixerShard | None:
    """Rank ``rank``'s :class:`MixerShard` of ``mod`` when it is a gated delta net or a short
    convolution (module docstring), else None."""
    if _is_depthwise(getattr(mod, "conv1d", None)) and all(
            isinstance(getattr(mod, a, None), int) for a in ("num_k_heads", "num_v_heads", "key_dim", "value_dim")):
        channels = kept_rows([mod.key_dim, mod.key_dim, mod.value_dim], rank, world)
        heads = span(mod.num_v_heads, rank, world)
        columns = {"in_proj_qkv": channels, "in_proj_z": None, "in_proj_b": None, "in_proj_a": None,
                   "in_proj_qkvz": None, "in_proj_ba": None}
        return MixerShard({c: r for c, r in columns.items() if isinstance(getattr(mod, c, None), nn.Linear)},
                          {"A_log": heads, "dt_bias": heads, "conv1d.weight": channels, "conv1d.bias": channels,
                           "norm.weight": None}, "conv1d",
                          ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"))
    conv, proj = getattr(mod, "conv", None), getattr(mod, "in_proj", None)
    if _is_depthwise(conv) and isinstance(proj, nn.Linear) and proj.out_features == 3 * conv.out_channels:
        h = conv.out_channels
        return MixerShard({"in_proj": kept_rows([h, h, h], rank, world)},
                          {"conv.weight": span(h, rank, world), "conv.bias": span(h, rank, world)}, "conv")
    return None


def split_mixer(mod: nn.Module, name: str, rank: int, world: int) -> MixerShard | None:
    """Cut recurrent mixer ``name`` to rank ``rank``'s channels in place (its own tensors, and the
    counts its forward splits by; its linears are sharded as linears, by ``columns``), or None when
    ``mod`` is no mixer :func:`mixer_shard` knows.

    Raises:
        InputError: ``world`` does not divide its heads (or channels), or it holds a tensor other
            than those it splits (named).
    """
    shard = mixer_shard(mod, rank, world)
    if shard is None:
        return None
    conv = mod.get_submodule(shard.conv)
    sizes = {f"{a} ({getattr(mod, a)})": getattr(mod, a) for a in shard.counts if isinstance(getattr(mod, a, None), int)}
    sizes[f"{shard.conv} channels ({conv.out_channels})"] = conv.out_channels
    bad = [k for k, v in sizes.items() if v % world]
    if bad:
        raise InputError(f"--tensor-parallel {world} does not divide {name}'s {bad[0]}; use a degree that divides it")
    linears = (*shard.columns, "out_proj")
    for pname, p in list(mod.named_parameters()):
        if pname.rpartition(".")[0] in linears:
            continue
        if pname not in shard.own or (pname == "norm.weight" and tuple(p.shape) != (getattr(mod, "head_v_dim", -1),)):
            raise InputError(f"--tensor-parallel cannot split {name}.{pname} {list(p.shape)} with the "
                             "linear-attention heads or convolution channels; serve this base with --tensor-parallel 1")
        if shard.own[pname] is not None:
            owner, _, leaf = pname.rpartition(".")
            holder = mod.get_submodule(owner) if owner else mod
            setattr(holder, leaf, nn.Parameter(p.detach()[shard.own[pname]].clone(), requires_grad=False))
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for attr in shard.counts:
        if isinstance(getattr(mod, attr, None), int):
            setattr(mod, attr, getattr(mod, attr) // world)
    return shard


def shard_mixer_tensors(kw: dict[str, torch.Tensor], shard: MixerShard, name: str) -> dict[str, torch.Tensor]:
    """A variant's tensors of mixer ``name`` (``DeltaMixer.load_slot``'s, by name in the mixer), cut to
    the rank's channels as :func:`split_mixer` cut the base's.

    Raises:
        InputError: a tensor :func:`split_mixer` does not split (rows of one, say), named.
    """
    out = {}
    for key, t in kw.items():
        if key not in shard.own:
            raise InputError(f"--tensor-parallel cannot split a variant's {name}.{key} with the linear-attention "
                             "heads or convolution channels; serve this base with --tensor-parallel 1")
        idx = shard.own[key]
        t = t.as_subclass(torch.Tensor)
        out[key] = (t if idx is None else t[idx]).clone()
    return out
