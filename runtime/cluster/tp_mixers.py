"""Recurrent token mixers split by channels, as tensor parallelism splits an attention by heads:
the gated delta nets of Qwen3.5, Qwen3-Next and OLMo Hybrid, Kimi Linear's delta attention, Mamba-2
mixers (Granite 4, Nemotron-H, Bamba, Mamba-2, Falcon-H1), Mamba-1 mixers (Mamba, Falcon-Mamba,
Jamba) and LFM2's (and LFM3's) short convolutions.

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
  stays whole. OLMo Hybrid's separate ``q_proj``/``k_proj``/``v_proj``/``a_proj``/``b_proj``/``g_proj``
  are spans of rows (heads).

**Kimi delta attention.** ``h`` heads of ``d`` channels, a decay per channel: ``q_proj``, ``k_proj``,
``v_proj`` and ``g_b_proj``, ``forget_gate.f_b_proj`` (``[h d, d]``) keep the rank's rows, ``b_proj``
its heads, ``dt_bias`` its channels, ``A_log [1, 1, h, 1]`` its heads; the convolution its channels
of each of q, k and v; the low-rank ``f_a_proj`` and ``g_a_proj`` (``[d, H]``) stay whole.

A variant's rows of a parameter (the checkpoint stores OLMo Hybrid's and Kimi's convolution as
``q_conv1d``, ``k_conv1d`` and ``v_conv1d``, which transformers concatenates) land on the rank's
kept rows among them (:func:`shard_mixer_tensors`).

**Mamba-2 mixer.** ``nh`` heads of ``p`` channels (``I = nh * p``) read ``G`` groups of ``B`` and
``C`` (``N`` states each). A rank keeps its span of heads, and of the groups when ``n`` divides
``G``; when ``G`` divides ``n`` it keeps whole the group its heads read (every rank holds a copy):

- ``in_proj [2 I + 2 G N + nh, H]`` stacks the gate ``z``, ``x``, ``B``, ``C`` and ``dt``: its rows of
  each; ``conv1d [I + 2 G N, 1, K]`` the same channels of ``x``, ``B`` and ``C``;
- ``A_log``, ``D``, ``dt_bias [nh]``: its heads'; the gated norm's weight ``[I]``: its channels. The
  norm normalises each group's ``I / G`` channels: whole on a rank when ``n`` divides ``G``; with
  one group over every rank (Granite 4, Bamba, Falcon-H1), each rank's sum of squares is all-reduced
  (:class:`ShardedGatedNorm`). Falcon-H1 scales each row of ``in_proj``'s output (``mup_vector``):
  the rank keeps its rows' scales.

**Mamba-1 mixer.** ``I`` channels, each with its own ``N`` states; every channel's step size and
``B``, ``C`` come from one projection of all the channels. A rank keeps its span of channels:

- ``in_proj [2 I, H]`` stacks ``x`` and the gate ``z``: its rows of each; ``conv1d [I, 1, K]``,
  ``A_log [I, N]``, ``D [I]`` and ``dt_proj [I, R]`` (weight and bias, which the mixer reads itself):
  its channels;
- ``x_proj [R + 2 N, I]`` reads every channel: row-parallel, its output (``R + 2 N`` values a
  token) all-reduced inside the mixer, so each rank then holds the whole ``dt``, ``B`` and ``C``;
  Jamba's norms of them (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) stay whole.

**Short convolution** (LFM2): ``in_proj [3 H, H]`` stacks the ``B``, ``C`` and ``x`` gates of ``H``
channels, each multiplied channel by channel around a depthwise ``conv [H, 1, K]``: a rank keeps
its span of channels in each block, and of the convolution.

``out_proj`` (``o_proj``) is row-parallel in all of them. Each rank's recurrent states are then its channels'
alone (a window ``[B, C/n, K]``, a state ``[B, nv/n, dk, dv]``): the serving state pool takes
whatever shapes the layer writes. A variant that changes the mixer's own tensors (a full
fine-tune moves ``A_log`` and the convolution) is cut the same way (:func:`shard_mixer_tensors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from deltazip.formats.errors import InputError
from deltazip.runtime.cluster.tp_shards import kept_rows, span

# kept rows of a tensor's first dimension (int64, or a span), or an index over its leading dimensions
# (Kimi's A_log [1, 1, heads, 1]); None: whole
Index = torch.Tensor | slice | tuple | None


@dataclass(frozen=True)
class MixerShard:
    """What rank ``rank`` keeps of one recurrent mixer.

    Attributes:
        columns: its linears split by rows (column-parallel): child name -> the rows kept (int64),
            or None for the rank's span.
        rows: its linears split by input columns (row-parallel, their output all-reduced) other than
            those every layer names so (``out_proj``): Mamba-1's ``x_proj``.
        own: its own tensors by name (``A_log``, ``conv1d.weight``): the rows kept, None for whole.
        conv: its depthwise convolution (a child).
        counts: head counts and widths its forward reads (``norm.n_groups``: a child's) -> the rank's;
            those the module does not have are skipped.
        divides: what the degree must divide, by name (refused otherwise).
        norm_width: the full width of a gated norm whose one group spans every rank (its sum of
            squares all-reduced), else 0.
        buffers: buffers cut along their last dimension (Falcon-H1's ``mup_vector``, one scale per row
            of ``in_proj``) -> the entries kept.
        whole: its linears every rank keeps whole (Kimi's low-rank ``g_a_proj``, whose output every
            head's gate reads).
    """

    columns: dict[str, torch.Tensor | None]
    own: dict[str, Index]
    conv: str
    counts: dict[str, int] = field(default_factory=dict)
    divides: dict[str, int] = field(default_factory=dict)
    norm_width: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()


def _is_depthwise(conv) -> bool:
    return isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels


def _ints(mod: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(mod, a, None), int) for a in names)


def _delta_net(mod: nn.Module, rank: int, world: int) -> MixerShard:
    channels = kept_rows([mod.key_dim, mod.key_dim, mod.value_dim], rank, world)
    heads = span(mod.num_v_heads, rank, world)
    columns = {"in_proj_qkv": channels, "in_proj_z": None, "in_proj_b": None, "in_proj_a": None,
               "in_proj_qkvz": None, "in_proj_ba": None, "a_proj": None, "b_proj": None}  # (OLMo Hybrid's a, b)
    own = {"A_log": heads, "dt_bias": heads, "conv1d.weight": channels, "conv1d.bias": channels}
    for norm in ("norm", "o_norm"):  # one head's, whole (any other width is refused as a tensor no rule cuts)
        if tuple(getattr(getattr(mod, norm, None), "weight", torch.empty(0)).shape) == (mod.head_v_dim,):
            own[f"{norm}.weight"] = None
    counts = {a: getattr(mod, a, 0) // world for a in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")}
    return MixerShard({c: r for c, r in columns.items() if isinstance(getattr(mod, c, None), nn.Linear)}, own,
                      "conv1d", counts, {"linear-attention key heads": mod.num_k_heads})


def _mamba2(mod: nn.Module, rank: int, world: int) -> MixerShard:
    i, g, n, nh = mod.intermediate_size, mod.n_groups, mod.ssm_state_size, mod.num_heads
    groups = range(g)[span(g, rank, world)] if g % world == 0 else [0]  # (else one group, which every rank reads)
    bc = torch.cat([torch.arange(k * n, (k + 1) * n) for k in groups])  # the kept groups' rows of B (or C)
    x = torch.arange(i)[span(i, rank, world)]
    heads = span(nh, rank, world)
    conv = torch.cat([x, i + bc, i + g * n + bc])
    proj = torch.cat([x, i + conv, 2 * i + 2 * g * n + torch.arange(nh)[heads]])
    local = len(groups)
    counts = {"num_heads": nh // world, "intermediate_size": i // world, "n_groups": local,
              "conv_dim": i // world + 2 * local * n, "groups_time_state_size": local * n, "norm.n_groups": local}
    normed = isinstance(getattr(mod.norm, "weight", None), nn.Parameter)  # (Falcon-H1's may be an Identity)
    return MixerShard(
        columns={"in_proj": proj},
        own={"A_log": heads, "D": heads, "dt_bias": heads, "conv1d.weight": conv, "conv1d.bias": conv,
             "norm.weight": span(i, rank, world)},
        conv="conv1d",
        counts=counts,
        # several groups split by ranks (a norm group each); one group is kept by every rank
        divides={"Mamba heads": nh, **({"Mamba groups": g} if g > 1 else {})},
        norm_width=i if g == 1 and normed else 0,
        buffers={"mup_vector": proj} if isinstance(getattr(mod, "mup_vector", None), torch.Tensor) else {})


def _mamba1(mod: nn.Module, rank: int, world: int) -> MixerShard:
    i = mod.intermediate_size
    x = span(i, rank, world)
    own = {"A_log": x, "D": x, "conv1d.weight": x, "conv1d.bias": x, "dt_proj.weight": x, "dt_proj.bias": x}
    own |= {f"{n}.weight": None for n in ("dt_layernorm", "b_layernorm", "c_layernorm")  # Jamba's, over x_proj's
            if isinstance(getattr(getattr(mod, n, None), "weight", None), nn.Parameter)}  # all-reduced output
    return MixerShard(columns={"in_proj": kept_rows([i, i], rank, world), "dt_proj": None}, own=own, conv="conv1d",
                      counts={"intermediate_size": i // world}, divides={"Mamba channels": i}, rows=("x_proj",))


def _kimi_delta(mod: nn.Module, rank: int, world: int) -> MixerShard:
    h, qkv = mod.num_heads, mod.qkv_dim
    channels = span(qkv, rank, world)
    heads = span(h, rank, world)
    conv = kept_rows([qkv, qkv, qkv], rank, world)
    own = {"conv1d.weight": conv, "conv1d.bias": conv, "forget_gate.dt_bias": channels,
           "forget_gate.A_log": (slice(None), slice(None), heads), "o_norm.weight": None}
    counts = {"num_heads": h // world, "qkv_dim": qkv // world, "conv_dim": 3 * qkv // world,
              "forget_gate.num_heads": h // world, "forget_gate.qkv_dim": qkv // world}
    return MixerShard(
        columns={"q_proj": None, "k_proj": None, "v_proj": None, "b_proj": None, "g_b_proj": None,
                 "forget_gate.f_b_proj": None},
        own=own, conv="conv1d", counts=counts, divides={"linear-attention heads": h},
        whole=("g_a_proj", "forget_gate.f_a_proj"))


def mixer_shard(mod: nn.Module, rank: int, world: int) -> MixerShard | None:
    """Rank ``rank``'s :class:`MixerShard` of ``mod`` when it is a gated delta net, Kimi's delta
    attention, a Mamba-2 or Mamba-1 mixer or a short convolution (module docstring), else None."""
    if _is_depthwise(getattr(mod, "conv1d", None)):
        if _ints(mod, "num_k_heads", "num_v_heads", "key_dim", "value_dim", "head_v_dim"):
            return _delta_net(mod, rank, world)
        norm = getattr(mod, "norm", None)
        if (_ints(mod, "num_heads", "intermediate_size", "n_groups", "ssm_state_size")
                and isinstance(getattr(mod, "in_proj", None), nn.Linear)
                and (isinstance(norm, nn.Identity) or _ints(norm, "group_size") or _ints(norm, "n_groups"))):
            return _mamba2(mod, rank, world)
        if _ints(mod, "num_heads", "head_dim", "qkv_dim") and isinstance(getattr(mod, "forget_gate", None), nn.Module):
            return _kimi_delta(mod, rank, world)
        if (_ints(mod, "intermediate_size", "ssm_state_size", "time_step_rank")
                and all(isinstance(getattr(mod, c, None), nn.Linear) for c in ("in_proj", "x_proj", "dt_proj"))):
            return _mamba1(mod, rank, world)
    conv, proj = getattr(mod, "conv", None), getattr(mod, "in_proj", None)
    if _is_depthwise(conv) and isinstance(proj, nn.Linear) and proj.out_features == 3 * conv.out_channels:
        h = conv.out_channels
        return MixerShard({"in_proj": kept_rows([h, h, h], rank, world)},
                          {"conv.weight": span(h, rank, world), "conv.bias": span(h, rank, world)}, "conv",
                          divides={"convolution channels": h})
    return None


class ShardedGatedNorm(nn.Module):
    """A Mamba-2 gated RMSNorm of one group over ``full`` channels, of which this rank holds a span
    (``base``, its weight already cut to the span), the mean square over the full width from each
    rank's sum of squares, all-reduced (one ``[tokens, 1]`` fp32 tensor per layer and step). As the
    base computes it: Mamba-2's ``weight * norm(x * silu(gate)).to(dtype)``, or Falcon-H1's (its
    ``norm_before_gate``) ``(weight * norm(x))`` in fp32, gated before or after, cast last."""

    def __init__(self, base: nn.Module, full: int, group):
        super().__init__()
        self.weight = base.weight
        self.variance_epsilon, self.full, self.group = base.variance_epsilon, full, group
        self.before_gate = getattr(base, "norm_before_gate", None)  # None: Mamba-2's formula

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        dtype = hidden_states.dtype
        h = hidden_states.float()
        if gate is not None and not self.before_gate:
            h = h * F.silu(gate.float())
        squares = h.pow(2).sum(-1, keepdim=True)
        self.group.all_reduce(squares)
        h = h * torch.rsqrt(squares / self.full + self.variance_epsilon)
        if self.before_gate is None:
            return self.weight * h.to(dtype)
        h = self.weight * h
        if self.before_gate and gate is not None:
            h = h * F.silu(gate.float())
        return h.to(dtype)


def split_mixer(mod: nn.Module, name: str, rank: int, world: int, group=None) -> MixerShard | None:
    """Cut recurrent mixer ``name`` to rank ``rank``'s channels in place (its own tensors, and the
    counts its forward splits by; its linears are sharded as linears, by ``columns``), or None when
    ``mod`` is no mixer :func:`mixer_shard` knows. ``group``: the all-reduce of a gated norm whose
    one group spans every rank.

    Raises:
        InputError: the degree does not divide its heads (or channels, or groups), or it holds a
            tensor other than those it splits (named).
    """
    shard = mixer_shard(mod, rank, world)
    if shard is None:
        return None
    bad = [f"{v} {k}" for k, v in shard.divides.items() if v % world]
    if bad:
        raise InputError(f"--tensor-parallel {world} does not divide {name}'s {bad[0]}; use a degree that divides them")
    for pname, p in list(mod.named_parameters()):
        if isinstance(mod.get_submodule(pname.rpartition(".")[0]), nn.Linear):
            continue  # (cut as linears; the caller checks that each one is)
        if pname not in shard.own:
            raise InputError(f"--tensor-parallel cannot split {name}.{pname} {list(p.shape)} with the mixer's heads "
                             "or channels; serve this base with --tensor-parallel 1")
        if shard.own[pname] is not None:
            owner, _, leaf = pname.rpartition(".")
            holder = mod.get_submodule(owner) if owner else mod
            kept = p.detach().as_subclass(torch.Tensor)[shard.own[pname]]  # (a read-only registry tensor's rows)
            setattr(holder, leaf, nn.Parameter(kept.clone(), requires_grad=False))
    conv = mod.get_submodule(shard.conv)
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]
    for attr, value in shard.counts.items():
        owner, _, leaf = attr.rpartition(".")
        holder = mod.get_submodule(owner)
        if _ints(holder, leaf):  # (Mamba-2's groups_time_state_size is Falcon-H1's alone, say)
            setattr(holder, leaf, value)
    for buf, idx in shard.buffers.items():
        setattr(mod, buf, getattr(mod, buf)[..., idx].clone())
    if shard.norm_width:
        mod.norm = ShardedGatedNorm(mod.norm, shard.norm_width, group)
    return shard


def shard_mixer_tensors(kw: dict[str, torch.Tensor], shard: MixerShard, name: str) -> dict[str, torch.Tensor]:
    """A variant's tensors of mixer ``name`` (``DeltaMixer.load_slot``'s, by name in the mixer), cut to
    the rank's channels as :func:`split_mixer` cut the base's.

    Raises:
        InputError: a tensor :func:`split_mixer` does not split (rows of one, say), named.
    """
    out = {}
    for key, t in kw.items():
        param, sep, rows = key.partition(":")
        idx = shard.own.get(param, False)
        if idx is False or (sep and isinstance(idx, tuple)):
            raise InputError(f"--tensor-parallel cannot split a variant's {name}.{key} with the mixer's heads or "
                             "channels; serve this base with --tensor-parallel 1")
        t = t.as_subclass(torch.Tensor)
        if not sep or idx is None:
            out[key] = (t if idx is None else t[idx]).clone()
            continue
        # rows [r0, r1) of the parameter (a checkpoint piece Kimi's conversion concatenates): the
        # rank's kept rows among them, at their places in the rank's shard (kept rows are ascending,
        # so those of one piece are consecutive in the shard)
        r0, r1 = (int(r) for r in rows.split(":"))
        kept = torch.arange(idx.start, idx.stop) if isinstance(idx, slice) else idx
        local = ((kept >= r0) & (kept < r1)).nonzero().flatten()
        if len(local):
            out[f"{param}:{int(local[0])}:{int(local[-1]) + 1}"] = t[kept[local] - r0].clone()
    return out
