"""Mixture-of-experts layers in delta mode: per-row routers and per-(slot, expert) expert deltas.

transformers 5 keeps a MoE layer's experts fused (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``; Nemotron-H's ungated
``up_proj [E, I, H]`` (``has_gate`` false: the activation alone between the two); GPT-OSS's the other way
round, ``[E, H, 2I]`` and ``[E, I, H]`` applied as ``x @ W[e]``, with biases ``[E, out]``; Llama 4's
``[E, in, out]`` too, run by ``torch.bmm`` over every token, each scaled by its routing weight) beside a
router module (``*TopKRouter``, weight ``[E, H]`` and GPT-OSS's bias ``[E]``, not an ``nn.Linear``;
Phi-3.5-MoE's and Llama 4's are ``nn.Linear`` subclasses with a forward of their own:
:func:`is_own_forward_router`). Shared experts and their gate (Qwen2-MoE) are plain ``nn.Linear`` and
are decoupled like any other linear.

- :class:`DeltaRouter`: the router with a per-row weight (and bias). Rows of a slot whose variant changed the
  router go through transformers' own router forward with that slot's weight
  (``torch.func.functional_call``), so softmax, top-k and renormalisation are the model's code.
- :class:`DeltaExperts`: the experts module. A batch with no expert delta runs the original module
  (whatever ``experts_implementation`` the model uses). Otherwise every routed (token, expert) pair
  ``p`` is a row: ``gate_up = x W_gu[e]ᵀ + x Δ_gu(s, e)ᵀ``, the module's own ``_apply_gate``,
  ``y = h W_d[e]ᵀ + h Δ_d(s, e)ᵀ``, times the pair's routing weight, summed over the token's ``k``
  pairs (as transformers' grouped/batched forwards do). The base products are grouped by expert, the
  delta products by (slot, expert) in one SBMM call per configuration
  (``deltazip.kernels.dispatch.sbmm_experts``; a stack of ``N * E`` entries, entry ``s * E + e``).
- :class:`MoeLayout`: where an artifact's tensors land: the fused names themselves or the
  per-expert names ``save_pretrained`` writes (``block_sparse_moe.experts.3.w1.weight``), mapped
  through ``deltazip.models.layer_map`` (transformers' own save-side conversion).

A variant's expert tensor is held per piece: rows ``[row0, row1)`` of the parameter seen as
``[E * out, in]`` (always within one expert, or all experts of a fused tensor), keyed
``"param:row0:row1"`` in the host entry; a packed additive piece stays packed (or is dequantized in
``dequantized`` compute mode), anything else becomes a dense delta in the model dtype. A LoRA
adapter's factors of a parameter (PEFT's ``target_parameters``) are held as they are, keyed
``"lora:param"`` (:class:`ExpertLoraFactors`): each pair adds ``scale · (x A_eᵀ) B_eᵀ``, so a resident
adapter costs ``E · r · (in + out)`` values per parameter, not a copy of the experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from deltazip.kernels import dispatch
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight
from deltazip.kernels.stacked import StackedDeltas, config_key
from deltazip.models.model_walk import dense_routed, experts_transposed

EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")  # up_proj: ungated experts (has_gate false)
BIAS_OF = {f"{p}_bias": p for p in EXPERT_PARAMS}  # GPT-OSS's per-expert biases [E, out]


def expert_params(mod: nn.Module) -> tuple[str, str]:
    """``(first projection, down projection)`` of a fused-experts module: ``gate_up_proj`` when it is
    gated (transformers' ``has_gate``, the default), else ``up_proj``."""
    return ("gate_up_proj" if getattr(mod, "has_gate", True) else "up_proj"), "down_proj"


def is_fused_experts(mod: nn.Module) -> bool:
    """A transformers 5 fused-experts module this runtime can decouple: gated (or, ``has_gate`` false,
    an activation alone between ``up_proj`` and ``down_proj``), ``[E, out, in]`` or (``is_transposed``,
    GPT-OSS) ``[E, in, out]``, with ``[E, out]`` biases where ``has_bias``."""
    n = getattr(mod, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return False
    ps = dict(mod.named_parameters(recurse=False))
    params = expert_params(mod)
    if not all(p in ps and ps[p].dim() == 3 and ps[p].shape[0] == n for p in params):
        return False
    if dense_routed(mod):  # Llama 4: [E, in, out], gated by act_fn, no biases
        return callable(getattr(mod, "act_fn", None))
    out = {p: ps[p].shape[2 if experts_transposed(mod) else 1] for p in params}
    biases_ok = not getattr(mod, "has_bias", False) or all(
        f"{p}_bias" in ps and tuple(ps[f"{p}_bias"].shape) == (n, out[p]) for p in params)
    gated = getattr(mod, "has_gate", True)
    return biases_ok and (hasattr(mod, "_apply_gate") if gated else callable(getattr(mod, "act_fn", None)))


def apply_gate(mod: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The experts' gating of ``gate_up [P, 2I]`` -> ``[P, I]``: the module's own ``_apply_gate``, or for
    a :func:`~deltazip.models.model_walk.dense_routed` module (Llama 4) ``up · act_fn(gate)`` on the halves;
    ungated experts' ``up [P, I]`` -> ``act_fn(up)``."""
    if not getattr(mod, "has_gate", True):
        return mod.act_fn(gate_up)
    if hasattr(mod, "_apply_gate"):
        return mod._apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return up * mod.act_fn(gate)


def block_tensors(block: nn.Module, num_experts: int) -> dict[str, torch.Tensor]:
    """A MoE block's own ``[E]`` tensors (parameters and buffers), by ``"block.<name>"``: the per-expert
    biases some blocks pass to their router's forward."""
    own = {**dict(block.named_buffers(recurse=False)), **dict(block.named_parameters(recurse=False))}
    return {f"block.{n}": t for n, t in own.items() if tuple(t.shape) == (num_experts,)}


def _is_router_module(child: nn.Module, num_experts: int) -> bool:
    """A MoE block's router module (not an ``nn.Linear``): its one matrix is ``[E, H]``, its own
    ``weight`` (``*TopKRouter``) or a child linear's (Gemma 4's ``proj``, beside its scales)."""
    if isinstance(child, nn.Linear):
        return False
    w = getattr(child, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == num_experts:
        return True  # its own [E, H] weight, whatever else it holds (Ernie 4.5's statistics)
    mats = [p for p in child.parameters() if p.dim() >= 2]
    return len(mats) == 1 and mats[0].dim() == 2 and mats[0].shape[0] == num_experts


def is_own_forward_router(model: nn.Module, name: str, mod: nn.Module) -> bool:
    """An ``nn.Linear`` router whose class has its own forward (top-k inside, a tuple out: Phi-3.5-MoE's,
    Llama 4's): decoupled as a :class:`DeltaRouter`, which runs that forward with each slot's weight,
    not as a linear (which would return the logits alone)."""
    from deltazip.models.model_walk import is_router

    return (isinstance(mod, nn.Linear) and type(mod).forward is not nn.Linear.forward
            and is_router(model, name, mod))


def token_slots(ctx, hidden_states: torch.Tensor) -> torch.Tensor:
    """Slot of every row of a MoE block's flattened input ``[B * t, H]``: int64 ``[B * t]``."""
    b = ctx.row_slot.shape[0]
    return ctx.token_index(hidden_states.reshape(b, -1, hidden_states.shape[-1]))


def grouped_matmul(x: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y[p] = x[p] @ weights[groups[p]].T``; zeros where the group is -1. One GEMM per group present.

    Args:
        x: ``[P, in]``; groups: int64 ``[P]``; weights: ``[G, out, in]``.
    Returns:
        ``[P, out]`` in ``weights.dtype``.
    """
    y = torch.zeros(x.shape[0], weights.shape[1], dtype=weights.dtype, device=x.device)
    valid = (groups >= 0).nonzero(as_tuple=True)[0]
    if not valid.numel():
        return y
    order = valid[torch.argsort(groups[valid], stable=True)]
    ids, counts = torch.unique_consecutive(groups[order], return_counts=True)
    start = 0
    for g, c in zip(ids.tolist(), counts.tolist()):  # one host sync for the whole layout
        rows = order[start:start + c]
        y[rows] = F.linear(x[rows].to(weights.dtype), weights[g])
        start += c
    return y


# --------------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------------


def router_tensors(router: nn.Module) -> dict[str, torch.Tensor]:
    """A router's tensors a variant may change: its parameters (``weight``, GPT-OSS's ``bias``, Gemma 4's
    ``proj.weight``, ``scale`` and ``per_expert_scale``) and buffers (DeepSeek-V3's
    ``e_score_correction_bias``), by name relative to the router."""
    return {**dict(router.named_buffers()), **dict(router.named_parameters())}


class DeltaRouter(nn.Module):
    """A MoE router whose rows of a changed variant use that variant's router weight ``[E, H]`` (and
    its other tensors where it changes them: :func:`router_tensors`).

    The slot references the tensors it is given (no copy). Outputs are the router's own
    ``(logits, scores, indices)``, each row computed by transformers' forward with its slot's tensors.
    """

    def __init__(self, base: nn.Module, ctx):
        super().__init__()
        for name, p in base.named_parameters(recurse=False):  # the base's parameters keep their names
            self.register_parameter(name, p)
        for name, child in base.named_children():  # and its children (Gemma 4's router.proj)
            self.add_module(name, child)
        self._inner = [base]  # not a submodule: its parameters and children are ours already
        self.ctx = ctx
        self._tables: dict[int, dict[str, torch.Tensor]] = {}  # slot -> {attribute: the variant's tensor}
        # Tensors of the MoE block that the block passes to the router's forward (AFMoE's expert_bias,
        # MiniMax-M2's e_score_correction_bias), by "block.<name>": a variant's replace them per row.
        self.block_tensors: dict[str, torch.Tensor] = {}
        self._args: dict[int, dict[int, torch.Tensor]] = {}  # slot -> {id(block tensor): the variant's}

    def clear_slot(self, slot: int) -> None:
        self._tables.pop(slot, None)
        self._args.pop(slot, None)

    def load_slot(self, slot: int, **tensors: torch.Tensor) -> None:
        """The variant's router tensors by attribute (``weight`` ``[E, H]``, ...; whole tensors, not deltas)."""
        own = {**router_tensors(self._inner[0]), **self.block_tensors}
        table = {}
        for name, t in tensors.items():
            base = own.get(name)
            if base is None or tuple(t.shape) != tuple(base.shape):
                raise ValueError(f"router {name} {tuple(t.shape)} != base "
                                 f"{None if base is None else tuple(base.shape)}")
            table[name] = t.to(device=base.device, dtype=base.dtype)
        # the block's tensors are swapped in the forward's arguments, the router's own by functional_call
        self._args[slot] = {id(self.block_tensors[k]): v for k, v in table.items() if k in self.block_tensors}
        self._tables[slot] = {k: v for k, v in table.items() if k not in self.block_tensors}

    def resident_bytes(self, slot: int) -> int:
        held = [*self._tables.get(slot, {}).values(), *self._args.get(slot, {}).values()]
        return sum(t.numel() * t.element_size() for t in held)

    def forward(self, hidden_states: torch.Tensor, *args):
        """``args``: the router's other inputs, the same for every row (MiniMax-M2's block passes its
        ``e_score_correction_bias``)."""
        inner = self._inner[0]
        changed = self._tables.keys() & self.ctx.active
        if not changed:
            return inner(hidden_states, *args)
        h = hidden_states.reshape(-1, hidden_states.shape[-1])
        idx = token_slots(self.ctx, h)
        base = inner(hidden_states, *args)
        single = isinstance(base, torch.Tensor)  # an nn.Linear router of plain logits
        outs = [t.clone(memory_format=torch.contiguous_format) for t in ((base,) if single else base)]
        for s in sorted(changed):
            rows = (idx == s).nonzero(as_tuple=True)[0]
            if not rows.numel():
                continue
            # the rows in the rank the module was given ([B, T, H] routers unpack three sizes: AFMoE's)
            x = h[rows] if hidden_states.dim() == 2 else h[rows].unsqueeze(0)
            swap = self._args.get(s, {})
            given = [swap.get(id(a), a) for a in args]  # the block's tensors the variant changed
            mine = torch.func.functional_call(inner, self._tables[s], (x, *given))
            for o, m in zip(outs, (mine,) if single else mine):
                o.view(-1, o.shape[-1])[rows] = m.reshape(-1, m.shape[-1]).to(o.dtype)
        return outs[0] if single else tuple(outs)


# --------------------------------------------------------------------------------------------------
# Experts
# --------------------------------------------------------------------------------------------------


class ExpertLoraFactors(NamedTuple):
    """A LoRA adapter's factors of one experts parameter, in the ``[E, out, in]`` view:
    ``a [E, r, in]``, ``b [E, out, r]``; expert ``e`` adds ``scale · b[e] @ a[e]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


_LORA = "lora:"


def lora_key(param: str) -> str:
    """Host-entry key of an adapter's factors of expert parameter ``param``."""
    return f"{_LORA}{param}"


def piece_key(param: str, row0: int, row1: int) -> str:
    """Host-entry key of a piece of an expert parameter (rows of its ``[E * out, in]`` view)."""
    return f"{param}:{row0}:{row1}"


def parse_piece_key(key: str) -> tuple[str, int, int]:
    param, r0, r1 = key.rsplit(":", 2)
    return param, int(r0), int(r1)


def _rows(d: PackedDelta, r0: int, r1: int) -> PackedDelta:
    return d.map_parts(lambda t: t[r0:r1], out_features=r1 - r0)


def _zero_packed(like: PackedDelta, rows: int) -> PackedDelta:
    """An all-zero delta of ``rows`` rows in ``like``'s configuration (scale 0: every value is 0)."""
    return like.map_parts(lambda t: torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=t.device),
                          out_features=rows)


def _cat_rows(parts: list[PackedDelta]) -> PackedDelta | None:
    """Rows of deltas of one configuration stacked into one delta (None when configurations differ)."""
    first = parts[0]
    if any(config_key(p)[:3] != config_key(first)[:3] for p in parts):
        return None
    asym = any(p.zeros is not None for p in parts)

    def zeros(p):
        if p.zeros is not None:
            return p.zeros
        return torch.full(tuple(p.scales.shape), 2 ** (p.bits - 1), dtype=torch.uint8, device=p.scales.device)

    return PackedDelta(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([zeros(p) for p in parts]) if asym else None,
                       None if first.positions is None else torch.cat([p.positions for p in parts]),
                       first.scheme.replace(sym=not asym), first.in_features, sum(p.out_features for p in parts))


@dataclass
class _ParamDeltas:
    """The deltas of one expert parameter ``[E, out, in]`` across slots: packed stacks of ``N * E``
    entries (one per configuration) and a dense ``[N * E, out, in]`` table, entry ``s * E + e``."""

    stacks: dict[tuple, StackedDeltas] = field(default_factory=dict)
    present: dict[tuple, torch.Tensor] = field(default_factory=dict)  # bool [N * E + 1] by entry + 1
    packed_at: dict[int, tuple] = field(default_factory=dict)  # entry -> its stack's configuration
    dense: torch.Tensor | None = None
    dense_at: set[int] = field(default_factory=set)
    # [N * E, out] each entry's bias (GPT-OSS): its variant's, else the base's (written on clear)
    bias: torch.Tensor | None = None
    # LoRA factors per entry, zero-padded to the largest rank held: A [N * E, R, in], B [N * E, out, R]
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: torch.Tensor | None = None  # [N * E] fp32
    lora_at: dict[int, int] = field(default_factory=dict)  # entry -> its rank


class DeltaExperts(nn.Module):
    """Fused experts with per-(slot, expert) deltas (module docstring).

    Args:
        base: the model's fused experts module (``gate_up_proj`` or ``up_proj``, ``down_proj``, ``_apply_gate``).
        ctx: the model's ``DeltaContext`` (``ctx.dequantize``: packed pieces are held dense).
    """

    def __init__(self, base: nn.Module, ctx):
        super().__init__()
        self.first, _ = expert_params(base)  # gate_up_proj, or up_proj (ungated)
        setattr(self, self.first, getattr(base, self.first))
        self.down_proj = base.down_proj
        self.transposed = experts_transposed(base)  # [E, in, out], applied x @ W[e]
        self.dense_routed = dense_routed(base)  # forward(hidden_states [E * T, H]) (Llama 4)
        self.has_bias = bool(getattr(base, "has_bias", False))
        if self.has_bias:
            setattr(self, f"{self.first}_bias", getattr(base, f"{self.first}_bias"))
            self.down_proj_bias = base.down_proj_bias
        self.num_experts = base.num_experts
        self._inner = [base]
        self.ctx = ctx
        self._deltas = {p: _ParamDeltas() for p in EXPERT_PARAMS}
        # slot -> {(param, entry)}; a bias entry is named by its bias parameter (``down_proj_bias``)
        self._slot_entries: dict[int, set[tuple[str, int]]] = {}

    @property
    def _slots(self) -> set[int]:
        return set(self._slot_entries)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, slots={self.ctx.num_slots}"

    def weight_of(self, param: str) -> torch.Tensor:
        """The base's fused parameter as ``[E, out, in]`` (a transposed view of GPT-OSS's ``[E, in, out]``)."""
        w = getattr(self, param)
        return w.transpose(1, 2) if self.transposed else w

    # -- host side ------------------------------------------------------------------------------
    def host_dense(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A piece given as the variant's full tensor (checkpoint shape): its delta to the base,
        ``[row1 - row0, in]`` in the model dtype (computed in fp32); a bias ``[E, out]`` is kept whole
        (it replaces the base's: no rounding of a difference)."""
        param, r0, r1 = parse_piece_key(key)
        if param in BIAS_OF:
            return tensor.to(getattr(self, param).dtype)
        return self.rows_delta(key, self.piece_rows(key, tensor))

    def piece_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A piece's checkpoint tensor as its rows ``[row1 - row0, in]`` of the ``[E * out, in]`` view."""
        _, r0, r1 = parse_piece_key(key)
        rows = tensor.transpose(-1, -2) if self.transposed else tensor  # transposed pieces are whole tensors
        return rows.reshape(r1 - r0, -1)

    def host_weight(self, key: str, delta: PackedDelta) -> torch.Tensor:
        """A packed non-additive piece (a full compressed weight, ``[rows, in]``): its delta to the base, dense."""
        return self.rows_delta(key, delta_weight(delta))

    def rows_delta(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[row1 - row0, in]`` of a variant's expert parameter (piece ``key``) minus the base's,
        computed in fp32, in the model dtype."""
        param, r0, r1 = parse_piece_key(key)
        base = self.weight_of(param)
        ref = base.detach().reshape(-1, base.shape[-1])[r0:r1].to(device=rows.device, dtype=torch.float32)
        return (rows.float() - ref).to(base.dtype)

    # -- slot management (engine thread, between forwards) ---------------------------------------
    def clear_slot(self, slot: int) -> None:
        for param, entry in self._slot_entries.pop(slot, set()):
            if param in BIAS_OF:  # back to the base's bias
                self._deltas[BIAS_OF[param]].bias[entry].copy_(getattr(self, param)[entry % self.num_experts])
                continue
            d = self._deltas[param]
            cfg = d.packed_at.pop(entry, None)
            if cfg is not None:
                d.present[cfg][entry + 1] = False
            d.dense_at.discard(entry)
            d.lora_at.pop(entry, None)

    def load_slot(self, slot: int, **pieces) -> None:
        """Put a variant's expert pieces (keys ``"param:row0:row1"``; values an additive
        ``PackedDelta`` or a dense delta ``[rows, in]``) into ``slot``; experts without a piece stay base."""
        self.clear_slot(slot)
        by_expert: dict[tuple[str, int], list[tuple[int, object]]] = {}
        entries = set()
        for key, value in pieces.items():
            if key.startswith(_LORA):  # an adapter's factors of every expert
                param = key.removeprefix(_LORA)
                self._write_lora(param, slot, value)
                entries.update((param, slot * self.num_experts + e) for e in range(self.num_experts))
                continue
            param, r0, r1 = parse_piece_key(key)
            if param in BIAS_OF:  # the variant's [E, out] bias
                self._write_bias(BIAS_OF[param], slot, value)
                entries.update((param, slot * self.num_experts + e) for e in range(self.num_experts))
                continue
            out = self.weight_of(param).shape[1]
            for e in range(r0 // out, (r1 - 1) // out + 1):  # a fused piece covers every expert
                lo, hi = max(r0, e * out), min(r1, (e + 1) * out)
                part = value[lo - r0:hi - r0] if isinstance(value, torch.Tensor) else _rows(value, lo - r0, hi - r0)
                by_expert.setdefault((param, e), []).append((lo - e * out, part))
        for (param, e), parts in by_expert.items():
            self._write(param, slot * self.num_experts + e, sorted(parts, key=lambda p: p[0]))
            entries.add((param, slot * self.num_experts + e))
        if entries:
            self._slot_entries[slot] = entries

    def _write_bias(self, param: str, slot: int, value: torch.Tensor) -> None:
        d, base = self._deltas[param], getattr(self, f"{param}_bias")
        if d.bias is None:
            d.bias = base.detach().repeat(self.ctx.num_slots, 1)
        e0 = slot * self.num_experts
        d.bias[e0:e0 + self.num_experts].copy_(value.to(device=base.device, dtype=base.dtype))

    def _write_lora(self, param: str, slot: int, f: ExpertLoraFactors) -> None:
        """Every expert's factors of ``f`` into ``slot``'s entries; the tables grow to a larger rank when
        one comes."""
        base = self.weight_of(param)
        _, out, in_f = base.shape
        r = f.a.shape[1]
        if tuple(f.a.shape) != (self.num_experts, r, in_f) or tuple(f.b.shape) != (self.num_experts, out, r):
            raise ValueError(f"experts LoRA factors {tuple(f.a.shape)}, {tuple(f.b.shape)} do not fit {param} "
                             f"[{self.num_experts}, {out}, {in_f}]")
        d = self._deltas[param]
        if d.lora_a is None or d.lora_a.shape[1] < r:
            n = self.ctx.num_slots * self.num_experts
            a = torch.zeros(n, r, in_f, dtype=base.dtype, device=base.device)
            b = torch.zeros(n, out, r, dtype=base.dtype, device=base.device)
            if d.lora_a is not None:  # (the zero columns added to B, rows to A, add nothing)
                a[:, :d.lora_a.shape[1]] = d.lora_a
                b[:, :, :d.lora_b.shape[2]] = d.lora_b
            else:
                d.lora_scale = torch.zeros(n, dtype=torch.float32, device=base.device)
            d.lora_a, d.lora_b = a, b
        at = slice(slot * self.num_experts, (slot + 1) * self.num_experts)
        d.lora_a[at].zero_()
        d.lora_b[at].zero_()
        d.lora_a[at, :r].copy_(f.a)
        d.lora_b[at, :, :r].copy_(f.b)
        d.lora_scale[at] = f.scale
        d.lora_at.update(dict.fromkeys(range(at.start, at.stop), r))

    def _write(self, param: str, entry: int, parts: list[tuple[int, object]]) -> None:
        base = self.weight_of(param)
        out, in_f = base.shape[1], base.shape[2]
        d = self._deltas[param]
        packed = [p for _, p in parts if isinstance(p, PackedDelta)]
        whole = None
        if len(packed) == len(parts) and not self.ctx.dequantize:
            filled, pos = [], 0
            for r0, p in parts + [(out, None)]:
                if r0 > pos:
                    filled.append(_zero_packed(packed[0], r0 - pos))
                if p is not None:
                    filled.append(p)
                    pos = r0 + p.out_features
            whole = _cat_rows(filled)
        if whole is not None:
            cfg = config_key(whole)
            stack = d.stacks.get(cfg)
            if stack is not None and whole.zeros is not None and not stack.asymmetric:
                stack = self._regrow(d, cfg, asymmetric=True)
            if stack is None:
                n = self.ctx.num_slots * self.num_experts
                stack = d.stacks[cfg] = StackedDeltas.allocate(n, whole.scheme, in_features=in_f, out_features=out,
                                                               device=base.device)
                d.present[cfg] = torch.zeros(n + 1, dtype=torch.bool, device=base.device)
            stack.write(entry, whole)
            d.present[cfg][entry + 1] = True
            d.packed_at[entry] = cfg
            return
        if d.dense is None:
            d.dense = torch.zeros(self.ctx.num_slots * self.num_experts, out, in_f, dtype=base.dtype,
                                  device=base.device)
        rows = d.dense[entry]
        rows.zero_()
        for r0, p in parts:
            w = delta_weight(p) if isinstance(p, PackedDelta) else p
            rows[r0:r0 + w.shape[0]].copy_(w.to(device=rows.device, dtype=rows.dtype))
        d.dense_at.add(entry)

    def _regrow(self, d: _ParamDeltas, cfg: tuple, asymmetric: bool) -> StackedDeltas:
        """A symmetric stack rebuilt asymmetric (explicit zero points), keeping its entries."""
        old = d.stacks[cfg]
        new = StackedDeltas.allocate(old.num_deltas, old.scheme.replace(sym=not asymmetric),
                                     in_features=old.in_features, out_features=old.out_features, device=old.device)
        for entry, c in d.packed_at.items():
            if c == cfg:
                new.write(entry, old.unstack(entry))
        d.stacks[cfg] = new
        return new

    def resident_bytes(self, slot: int) -> int:
        """Device bytes of slot ``slot``'s expert deltas (its entries of the stacks and dense tables)."""
        total = 0
        for param, entry in self._slot_entries.get(slot, ()):
            if param in BIAS_OF:
                b = self._deltas[BIAS_OF[param]].bias
                total += b.shape[1] * b.element_size()
                continue
            d = self._deltas[param]
            if entry in d.packed_at:
                stack = d.stacks[d.packed_at[entry]]
                total += stack.nbytes() // stack.num_deltas
            elif entry in d.dense_at:
                total += d.dense[entry].numel() * d.dense.element_size()
            if entry in d.lora_at:
                total += d.lora_at[entry] * (d.lora_a.shape[2] + d.lora_b.shape[1]) * d.lora_a.element_size()
        return total

    # -- forward --------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [T, H]``, ``top_k_index``/``top_k_weights [T, k]`` -> ``[T, H]``; a
        dense-routed module's (Llama 4) ``hidden_states [E * T, H]`` alone -> ``[E * T, H]``."""
        inner = self._inner[0]
        if not (self._slots & self.ctx.active):
            return inner(hidden_states) if self.dense_routed else inner(hidden_states, top_k_index, top_k_weights)
        if self.dense_routed:
            return self._dense_routed(hidden_states)
        t, k = top_k_index.shape
        expert = top_k_index.reshape(-1).to(torch.int64)  # [P], P = T * k, token-major
        slot = token_slots(self.ctx, hidden_states).repeat_interleave(k)  # [P]
        x = hidden_states.repeat_interleave(k, dim=0)  # [P, H]
        h = apply_gate(inner, self._project(self.first, x, slot, expert))
        y = self._project("down_proj", h, slot, expert)
        y = y * top_k_weights.reshape(-1, 1)
        return y.view(t, k, -1).sum(dim=1).to(hidden_states.dtype)

    def _dense_routed(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Block ``e`` of ``hidden_states [E * T, H]`` is every token scaled by its routing weight for
        expert ``e``. Only the nonzero rows (the routed pairs) are computed: a zero row gives a zero
        row (no biases; ``act(0) · 0 = 0``), which is what the module's ``bmm`` over all of them gives."""
        e_all = self.num_experts
        x = hidden_states.view(e_all, -1, hidden_states.shape[-1])  # [E, T, H]
        expert, token = (x.abs().amax(dim=-1) > 0).nonzero(as_tuple=True)  # the pairs, [P] each
        slot = token_slots(self.ctx, x[0])[token]
        h = apply_gate(self._inner[0], self._project(self.first, x[expert, token], slot, expert))
        out = torch.zeros(x.shape[0], x.shape[1], self.weight_of("down_proj").shape[1],
                          dtype=hidden_states.dtype, device=hidden_states.device)
        out[expert, token] = self._project("down_proj", h, slot, expert).to(out.dtype)
        return out.view(-1, out.shape[-1])

    def _project(self, param: str, x: torch.Tensor, slot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """``x[p] @ (W[e] + Δ(s, e)).T`` (``+ b(s, e)``, the variant's bias or the base's) for every pair
        ``p = (s, e)``: ``[P, in]`` -> ``[P, out]``."""
        y = grouped_matmul(x, expert, self.weight_of(param))
        d = self._deltas[param]
        entry = torch.where(slot >= 0, slot * self.num_experts + expert, torch.full_like(slot, -1))
        if self.has_bias:  # each pair's bias: its entry's (a variant's or the base's), the base's for base rows
            bias = getattr(self, f"{param}_bias")[expert]
            if d.bias is not None:
                bias = torch.where((entry >= 0).unsqueeze(1), d.bias[entry.clamp(min=0)], bias)
            y = y + bias
        for cfg, stack in d.stacks.items():
            has = d.present[cfg][entry + 1]
            local = torch.where(has, slot, torch.full_like(slot, -1))
            y = y + dispatch.sbmm_experts(x, local, expert, stack, self.num_experts).to(y.dtype)
        if d.dense_at:
            dense = torch.zeros(d.dense.shape[0] + 1, dtype=torch.bool, device=x.device)
            dense[[e + 1 for e in d.dense_at]] = True
            y = y + grouped_matmul(x, torch.where(dense[entry + 1], entry, torch.full_like(entry, -1)), d.dense)
        if d.lora_at:  # scale · (x A_eᵀ) B_eᵀ per pair of an adapter's entry: grouped LoRA over N * E entries
            on = torch.zeros(d.lora_a.shape[0] + 1, dtype=torch.bool, device=x.device)
            on[[e + 1 for e in d.lora_at]] = True
            lora = torch.where(on[entry + 1], entry, torch.full_like(entry, -1))
            y = y + dispatch.lora(x.to(d.lora_a.dtype), lora, d.lora_a, d.lora_b, d.lora_scale,
                                  self.ctx.defer_lora).to(y.dtype)
        return y


# --------------------------------------------------------------------------------------------------
# Where an artifact's tensors land
# --------------------------------------------------------------------------------------------------


class MoeLayout:
    """The fused-experts modules and routers of a model, and the checkpoint names that land on them.

    Args:
        model: the base causal LM (transformers 5).
        full: the same architecture with every parameter at its full shape (meta tensors will do),
            where ``model`` holds shards of the experts (tensor parallel): checkpoint names are
            mapped to the full parameters' rows, and the routers' block tensors are ``model``'s.
    """

    def __init__(self, model: nn.Module, full: nn.Module | None = None):
        from deltazip.models.model_walk import decoder_layers

        own = dict(model.named_modules())
        self.model = full if full is not None else model
        self.experts: dict[str, nn.Module] = {}  # qualified module name -> fused experts module
        self.routers: dict[str, nn.Module] = {}
        self.blocks: dict[str, dict[str, torch.Tensor]] = {}  # router -> its block's tensors (block_tensors)
        self.layers: dict[str, nn.Module] = {}  # layer prefix ("model.layers.3.") -> layer
        self._maps: dict[tuple[str, frozenset], dict[str, object]] = {}
        self._ckpt_prefix: dict[str, str] = {}  # layer prefix -> its checkpoint names' prefix
        modules = own if full is None else dict(full.named_modules())
        if not any(is_fused_experts(m) for m in modules.values()):
            return
        lname, layers = decoder_layers(self.model)
        for i, layer in enumerate(layers):
            for name, m in layer.named_modules():
                if not is_fused_experts(m):
                    continue
                qual = f"{lname}.{i}.{name}"
                self.experts[qual] = m
                self.layers[f"{lname}.{i}."] = layer
                parent = qual.rpartition(".")[0]
                for cname, child in modules[parent].named_children():
                    if child is not m and _is_router_module(child, m.num_experts):
                        self.routers[f"{parent}.{cname}"] = child
                        self.blocks[f"{parent}.{cname}"] = block_tensors(own[parent], m.num_experts)

    def _router_of(self, param: str) -> tuple[str, str] | None:
        """``(router module, name in it)`` of a qualified parameter name under a router, else None."""
        for rname in self.routers:
            if param.startswith(rname + "."):
                return rname, param[len(rname) + 1:]
        return None

    def targets(self, shapes: dict[str, list[int]]) -> dict[str, tuple[str, str, str]]:
        """Where a variant's tensors on experts modules and routers land: checkpoint name ->
        ``(module, kind, attr)``, kind ``"experts"`` (attr a piece key: rows of a weight seen as
        ``[E * out, in]``, or a whole ``[E, out]`` bias) or ``"router"`` (attr one of
        :func:`router_tensors`). Other tensors are not in the answer.

        Args:
            shapes: every tensor name of the variant -> its shape (checkpoint layout).
        """
        if not self.layers:
            return {}
        from deltazip.models.layer_map import checkpoint_prefix, map_layer

        out: dict[str, tuple[str, str, str]] = {}
        for prefix, layer in self.layers.items():
            if prefix not in self._ckpt_prefix:
                self._ckpt_prefix[prefix] = checkpoint_prefix(self.model, prefix)
            ck = self._ckpt_prefix[prefix]
            key = (prefix, frozenset(n for n in shapes if n.startswith(ck)))
            pieces = self._maps.get(key)
            if pieces is None:
                m = map_layer(self.model, prefix, layer, key[1], lambda n: tuple(shapes[n]))
                pieces = self._maps[key] = m.pieces
            for name, pc in pieces.items():
                mname, _, attr = (prefix + pc.param).rpartition(".")
                experts = self.experts.get(mname)
                if experts is not None and attr in EXPERT_PARAMS:
                    p = getattr(experts, attr)
                    if not experts_transposed(experts):
                        out[name] = (mname, "experts", piece_key(attr, pc.row0, pc.row1))
                    elif (pc.row0, pc.row1) == (0, p.shape[0] * p.shape[1]):  # [E, in, out]: whole tensors only
                        out[name] = (mname, "experts", piece_key(attr, 0, p.shape[0] * p.shape[2]))
                elif experts is not None and attr in BIAS_OF and getattr(experts, "has_bias", False) \
                        and (pc.row0, pc.row1) == (0, experts.num_experts):
                    out[name] = (mname, "experts", piece_key(attr, 0, experts.num_experts))
                elif (router := self._router_of(prefix + pc.param)) is not None:
                    rname, rattr = router
                    t = router_tensors(self.routers[rname]).get(rattr)
                    if t is not None and (pc.row0, pc.row1) == (0, t.shape[0] if t.dim() else 1):
                        out[name] = (rname, "router", rattr)
        for mname, router in self.routers.items():  # buffers (no piece: the layer map reads parameters)
            for attr, b in router.named_buffers():
                name = self._checkpoint_name(f"{mname}.{attr}")
                if name not in out and list(shapes.get(name, ())) == list(b.shape):
                    out[name] = (mname, "router", attr)
            block = mname.rpartition(".")[0]
            for key, t in self.blocks[mname].items():  # the block's tensors its router is given
                name = self._checkpoint_name(f"{block}.{key.removeprefix('block.')}")
                if list(shapes.get(name, ())) == list(t.shape):
                    out[name] = (mname, "router", key)
        return out

    def _checkpoint_name(self, qualified: str) -> str:
        """A module tensor's name as the checkpoint writes it: its layer's prefix renamed (Nemotron-H's
        ``backbone.``); the rest of the name is the module's, as for the buffers and block tensors here."""
        for prefix, ck in self._ckpt_prefix.items():
            if qualified.startswith(prefix):
                return ck + qualified[len(prefix):]
        return qualified
