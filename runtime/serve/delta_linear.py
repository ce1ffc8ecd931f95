"""Decoupled base + delta modules: one batch, many variants, the base weights read once.

Paper §5.1: ``Y = X W_ftᵀ = X W_baseᵀ + X Δᵀ``. Every row of a batch belongs to one variant (a device
*slot* ``0..N-1``) or to the base model (slot ``-1``). A :class:`DeltaLinear` computes the base GEMM for
all rows together and adds each row's compressed delta with SBMM (``deltazip.kernels.dispatch.sbmm``:
the CUDA kernel where it covers the stack, the pure-torch reference elsewhere). Tensors a variant changes outside the
compressed linears (embeddings, lm_head, norms, biases) are handled per row by replacement: the row
reads its variant's own copy of the tensor, so the result is the fine-tuned model's, not an
approximation of it. A variant whose tensor is "same as base" maps its slot to the base copy: it
costs no memory and no work beyond the gather that the module does anyway.

The per-row slot index travels in one :class:`DeltaContext` that every decoupled module of a model
holds a reference to; the engine sets it once per forward (``DeltaContext.bind``). No module loops
over variants in Python: a linear makes one SBMM call per delta *configuration* (bits, group,
sparsity — usually one), added onto its base GEMM's output in the kernel's epilogue; embeddings and
norms one gather. Llama-family q/k/v and gate/up linears share one GEMM and one SBMM per group
(``deltazip.runtime.serve.projections``; their packed deltas live in one :class:`PackedStore`).

Shapes: activations ``[..., in]`` flatten to ``[M, in]``; ``ctx.row_slot`` is ``[B]`` (one slot per
sequence) and a module's input has leading dims ``[B, t]``, so the per-token index is ``row_slot``
repeated ``t`` times (``t`` is the step's token count, or 1 for ``lm_head`` on the last position).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deltazip.kernels import dispatch
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight
from deltazip.kernels.row_plan import group_rows, plan_rows
from deltazip.kernels.scheme import DeltaScheme
from deltazip.kernels.stacked import StackedDeltas


class DeltaContext:
    """Per-forward routing shared by all decoupled modules of one model.

    Args:
        num_slots: ``N``, device slots (``--max-deltas``): every stack in the model has ``N`` slots.
        dequantize: keep each resident packed delta dequantized (dense, model dtype) instead of
            stacked for SBMM. For devices without a fast low-bit kernel (CPU), where the reference
            SBMM would dequantize every delta in every forward; it trades memory (a dense delta per
            slot) for speed, with the same numbers as the reference.
    """

    def __init__(self, num_slots: int, dequantize: bool = False):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.dequantize = dequantize
        self.row_slot: torch.Tensor | None = None
        self.active: frozenset[int] = frozenset()
        self._token_index: dict[int, torch.Tensor] = {}
        self._plans: dict[int, object] = {}
        self._row_slot_host: torch.Tensor | None = None
        self._segments: dict[tuple[int, frozenset[int]], SlotSegments | None] = {}
        self._uniform = False  # every bound row in one slot
        self.generation = 0  # counts binds: a merged projection group's cached output is per forward
        # Grouped LoRA's unmeasured keys go here instead of being measured in a forward (a server's tuner
        # measures them off the engine thread; ``grouped_lora.lora(defer=...)``); None: measured at once.
        self.defer_lora: Callable | None = None

    def bind(self, row_slots: list[int], device: torch.device | str) -> None:
        """Set the batch's slots: one per sequence row, ``-1`` for base rows, else in ``[0, N)``.

        Taken as a host list so that modules can skip work for slots absent from the batch without
        ever synchronising with the device.
        """
        bad = [s for s in row_slots if not -1 <= s < self.num_slots]
        if bad:
            raise ValueError(f"slot {bad[0]} outside [-1, {self.num_slots})")
        self.row_slot = torch.tensor(row_slots, dtype=torch.int64, device=device)
        self._row_slot_host = torch.tensor(row_slots, dtype=torch.int64)
        self.active = frozenset(s for s in row_slots if s >= 0)
        self._uniform = len(set(row_slots)) == 1
        self.generation += 1
        self._token_index.clear()
        self._plans.clear()
        self._segments.clear()
        if self.row_slot.device.type == "cuda" and self.active:
            self.plan(self.row_slot)  # the decode step's plan, built here: outside any graph capture

    def unbind(self) -> None:
        self.row_slot = None
        self._row_slot_host = None
        self.active = frozenset()
        self._token_index.clear()
        self._plans.clear()
        self._segments.clear()

    def row_slot_host(self) -> torch.Tensor:
        """The batch's slots, host copy (int64 ``[B]``)."""
        return self._row_slot_host

    @contextmanager
    def narrowed(self, rows: list[int]):
        """Within: the batch is rows ``rows`` of the bound one (a module run per group of rows,
        ``deltazip.runtime.serve.delta_mixer``); the bound batch is back afterwards."""
        saved = (self.row_slot, self._row_slot_host, self.active, self._token_index, self._plans, self._segments)
        host = self._row_slot_host[rows]
        self.row_slot = self.row_slot[torch.tensor(rows, device=self.row_slot.device)]
        self._row_slot_host, self.active = host, frozenset(s for s in host.tolist() if s >= 0)
        uniform, self._uniform = self._uniform, len(set(host.tolist())) == 1
        self._token_index, self._plans, self._segments = {}, {}, {}
        self.generation += 1  # merged projections' cached outputs belong to one batch
        try:
            yield
        finally:
            (self.row_slot, self._row_slot_host, self.active, self._token_index, self._plans,
             self._segments) = saved
            self._uniform = uniform
            self.generation += 1

    def token_index(self, x: torch.Tensor) -> torch.Tensor:
        """Slot of every row of ``x.reshape(-1, x.shape[-1])``: int64 ``[B * t]`` for ``x`` of ``[B, t, ...]``, or
        of ``[B * t, in]`` (rows of a batch-first tensor flattened in order)."""
        if self.row_slot is None:
            raise RuntimeError("a decoupled module ran outside DeltaContext.bind(): the engine must bind "
                               "the batch's slots before every forward")
        b = self.row_slot.shape[0]
        if self._uniform:  # one slot for every row: every token is its, whatever the input's layout (a
            # prompt's images through the vision tower; Mllama's [B · images · tiles, P, H] in a batch)
            t = x.numel() // x.shape[-1]
            idx = self._token_index.get(t)
            if idx is None:
                idx = self._token_index[t] = self.row_slot[:1].expand(t).contiguous()
            return idx
        if x.dim() == 2 and x.shape[0] % b == 0:
            # [B * t, in]: batch-major rows flattened by the model (OPT's MLP reshapes to 2-D)
            t = x.shape[0] // b
        elif x.dim() > 2 and x.shape[0] == b:
            t = x[0].numel() // x.shape[-1]
        else:
            raise ValueError(f"decoupled module input {tuple(x.shape)} does not start with the batch size {b}")
        idx = self._token_index.get(t)
        if idx is None:
            idx = self.row_slot.repeat_interleave(t) if t > 1 else self.row_slot
            self._token_index[t] = idx
        return idx

    def segments(self, rows: int, slots: frozenset[int]) -> SlotSegments | None:
        """The padded per-slot layout of the ``rows`` token rows whose slot is in ``slots`` (built once
        per forward from the host copy of the slots, shared by every linear; see :class:`SlotSegments`).
        None when padding would more than double the work (a skewed batch)."""
        key = (rows, slots)
        if key not in self._segments:
            host = self._row_slot_host[:1] if self._uniform else self._row_slot_host
            self._segments[key] = SlotSegments.build(host, rows, slots, self.row_slot.device)
        return self._segments[key]

    def plan(self, idx: torch.Tensor):
        """The row plan for ``idx`` (built once per token count, shared by every linear): from the host
        copy of the slots (numpy, one host-to-device copy, no GPU sort), else on the device."""
        key = idx.shape[0]
        plan = self._plans.get(key)
        if plan is None:
            host = self._row_slot_host
            if host is not None and self._uniform:
                host = host[:1]
            if host is not None and key % max(1, host.shape[0]) == 0:
                plan = plan_rows(np.repeat(host.numpy(), key // max(1, host.shape[0])), self.num_slots, idx.device)
            else:
                plan = group_rows(idx, self.num_slots)
            self._plans[key] = plan
        return plan

    def device_tensors(self) -> list[torch.Tensor]:
        """What the bound routing keeps on the device (a captured graph must keep it alive)."""
        kept = [self.row_slot] if self.row_slot is not None else []
        return kept + [p.packed if p.packed is not None else p.perm for p in self._plans.values()]


@dataclass
class SlotSegments:
    """Rows of a batch regrouped by slot into a padded ``[S, R]`` block, for one batched GEMM.

    The slots in the set span the contiguous range ``lo .. lo + S - 1`` (slots of the range that have no
    row get only padding), so a ``[N, out, in]`` stack is read through the view ``[lo : lo + S]`` with no
    copy; ``R`` is the most rows any one slot has.

    Attributes:
        lo, span, width: ``lo``, ``S`` and ``R``.
        gather: int64 ``[S * R]``: the token row that fills each padded position (0 for padding).
        scatter: int64 ``[M]``: each token row's padded position (0 for rows outside the set).
        keep: bool ``[M, 1]``: the row's slot is in the set.
    """

    lo: int
    span: int
    width: int
    gather: torch.Tensor
    scatter: torch.Tensor
    keep: torch.Tensor

    # Padding may at most double the multiply-adds of the rows themselves; past that (one slot
    # holding most of the batch) a GEMM per slot does less work.
    MAX_PADDING = 2.0

    @classmethod
    def build(cls, row_slot: torch.Tensor, rows: int, slots: frozenset[int], device) -> SlotSegments | None:
        """Layout for ``rows`` token rows (``row_slot`` ``[B]`` host int64, each repeated ``rows / B``)."""
        t = rows // row_slot.shape[0]
        idx = row_slot.repeat_interleave(t) if t > 1 else row_slot
        lo, hi = min(slots), max(slots)
        span = hi - lo + 1
        inside = torch.zeros(span + 1, dtype=torch.bool)  # indexed by slot - lo (+ 1 out-of-range sentinel)
        inside[[s - lo for s in slots]] = True
        local = torch.where((idx >= lo) & (idx <= hi), idx - lo, torch.full_like(idx, span))
        keep = inside[local]
        members = keep.nonzero(as_tuple=True)[0]
        if not members.numel():
            return None
        which = local[members]
        order = torch.sort(which, stable=True).indices
        members, which = members[order], which[order]
        counts = torch.bincount(which, minlength=span)
        width = int(counts.max())
        if span * width > cls.MAX_PADDING * members.numel():
            return None
        starts = torch.cumsum(counts, 0) - counts
        flat = which * width + (torch.arange(members.numel()) - starts[which])
        gather = torch.zeros(span * width, dtype=torch.int64)
        gather[flat] = members
        scatter = torch.zeros(idx.shape[0], dtype=torch.int64)
        scatter[members] = flat
        return cls(lo, span, width, gather.to(device), scatter.to(device), keep.unsqueeze(1).to(device))

    def matmul(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``y[r] = x[r] @ weights[slot(r)].T`` for rows in the set, zeros elsewhere.

        Args:
            x: ``[M, in]``; weights: ``[N, out, in]`` (read through a view of ``S`` slots).
        Returns:
            ``[M, out]`` in ``weights.dtype``.
        """
        xs = x.index_select(0, self.gather).view(self.span, self.width, x.shape[1])
        w = weights[self.lo:self.lo + self.span]
        ys = torch.bmm(xs, w.transpose(1, 2)).view(self.span * self.width, w.shape[1])
        return torch.where(self.keep, ys.index_select(0, self.scatter), 0.0)


def _is_conv1d(module: nn.Module) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers without it
        return False
    return isinstance(module, Conv1D)


def is_linear(module: nn.Module) -> bool:
    """A module :class:`DeltaLinear` decouples: ``nn.Linear``, transformers' ``Conv1D``, or one already
    decoupled."""
    return isinstance(module, (nn.Linear, DeltaLinear)) or _is_conv1d(module)


def slot_lookup(num_slots: int, device) -> torch.Tensor:
    """An ``[N + 1]`` table indexed by ``slot + 1`` (entry 0 is the base rows' entry)."""
    return torch.zeros(num_slots + 1, dtype=torch.int64, device=device)


@dataclass
class _PackedGroup:
    """The slots of one stack: deltas sharing a configuration (one SBMM call, ``launch``: the dispatcher's
    prepared launch of the stack, ``deltazip.kernels.dispatch.prepare``)."""

    stack: StackedDeltas
    present: torch.Tensor  # bool [N + 1], indexed by slot + 1: slot holds a delta of this group
    launch: object = None
    slots: set[int] = field(default_factory=set)
    owners: dict[int, set[int]] = field(default_factory=dict)  # slot -> first rows of the deltas written


class PackedStore:
    """The packed deltas of one linear, or of a merged projection group (rows ``[q; k; v]``).

    One stack per delta configuration (bits, group, sparsity), each ``[N slots, out, in]`` with ``out``
    the rows of every member; a member's delta occupies its row range ``[row0, row0 + rows)``, the
    other rows of the slot hold a zero delta (scale 0). With ``ctx.dequantize`` the deltas are kept
    dense instead, ``[N, out, in]`` in the model's dtype.

    Args:
        ctx: the model's context; in_features, out_features: of the (merged) weight; device, dtype:
            where the stacks live and the dtype of dequantized deltas.
    """

    def __init__(self, ctx: DeltaContext, in_features: int, out_features: int, device, dtype: torch.dtype):
        self.ctx, self.in_features, self.out_features = ctx, in_features, out_features
        self.device, self.dtype = device, dtype
        # Replaced, never changed in place, when a configuration is added: the engine's add_into iterates
        # it without a lock while the start-up tuning's thread may allocate a stack (stack_for).
        self.groups: dict[tuple, _PackedGroup] = {}
        self._lock = threading.Lock()  # stack_for (start-up thread) against write and clear (engine thread)
        self.dq: torch.Tensor | None = None  # [N, out, in] dequantized deltas (ctx.dequantize)
        self.dq_owners: dict[int, set[int]] = {}  # slot -> first rows of the dequantized deltas written
        # Stack layout: a merged group whose member boundaries are not on 64-row tiles cannot use the
        # CUDA kernel's tiles (one writer per tile) and asks for the canonical layout.
        self.layout = "auto"

    @property
    def dq_slots(self) -> set[int]:
        return set(self.dq_owners)

    def stack_for(self, bits: int, group_size: int, sparse: bool, asymmetric: bool) -> StackedDeltas:
        """The stack for deltas of this configuration, allocated now if needed (the kernel warm-up
        allocates the stacks the served variants will use before the first request)."""
        scheme = DeltaScheme(bits=bits, group_size=group_size, sparsity="2:4" if sparse else "none", sym=not asymmetric)
        d = PackedDelta(torch.empty(0), torch.empty(0), None, None, scheme, self.in_features, 0)
        with self._lock:
            return self._group_for(d, asymmetric, sparse).stack

    def _group_for(self, delta: PackedDelta, asymmetric: bool, sparse: bool | None = None) -> _PackedGroup:
        """The group of ``delta``'s configuration, allocated (or rebuilt with zero points) now if needed;
        called with ``self._lock`` held."""
        sparse = delta.sparse if sparse is None else sparse
        key = (delta.bits, delta.effective_group, sparse, delta.in_features)  # members of any height share it
        g = self.groups.get(key)
        if g is not None and asymmetric and not g.stack.asymmetric:
            # A symmetric stack cannot hold explicit zero points: rebuild it asymmetric, keeping slots.
            old = g.stack
            new = StackedDeltas.allocate(self.ctx.num_slots, old.scheme.replace(sym=False), in_features=old.in_features,
                                         out_features=old.out_features, device=old.device, layout=old.layout,
                                         compact=old.compact)
            for s in g.slots:
                new.write(s, old.unstack(s))
            g.stack, g.launch = new, dispatch.prepare(new, self.dtype)
        if g is None:
            scheme = DeltaScheme(bits=delta.bits, group_size=delta.group_size, sparsity="2:4" if sparse else "none",
                                 sym=not asymmetric)
            layout = self.layout if self.layout != "auto" else dispatch.layout_for(scheme, delta.in_features, self.dtype,
                                                                                   self.device)
            stack = StackedDeltas.allocate(self.ctx.num_slots, scheme, in_features=delta.in_features,
                                           out_features=self.out_features, device=self.device, layout=layout)
            g = _PackedGroup(stack, torch.zeros(self.ctx.num_slots + 1, dtype=torch.bool, device=self.device),
                             dispatch.prepare(stack, self.dtype))
            self.groups = {**self.groups, key: g}
        return g

    def write(self, slot: int, row0: int, packed: PackedDelta) -> None:
        """Put a member's delta (rows ``row0 ..``) into ``slot``, replacing what that member had there."""
        if self.ctx.dequantize:
            self.write_dequantized(slot, row0, delta_weight(packed.to(self.device)))
            return
        rows = packed.out_features
        with self._lock:
            self._clear(slot, row0, rows)
            g = self._group_for(packed, packed.zeros is not None)
            if slot not in g.owners and rows != self.out_features:
                g.stack.clear_rows(slot, 0, self.out_features)  # likewise
            g.stack.write(slot, packed, row0)
            g.owners.setdefault(slot, set()).add(row0)
            g.present[slot + 1] = True
            g.slots.add(slot)

    def write_dequantized(self, slot: int, row0: int, delta: torch.Tensor) -> None:
        """Put a member's dense delta ``[rows, in]`` (rows ``row0 ..``, already dequantized: the delta
        loader does that off the engine thread) into ``slot`` of the dequantized stack."""
        rows = delta.shape[0]
        self.clear(slot, row0, rows)
        if self.dq is None:
            self.dq = torch.zeros(self.ctx.num_slots, self.out_features, self.in_features,
                                  dtype=self.dtype, device=self.device)
        if slot not in self.dq_owners and rows != self.out_features:
            self.dq[slot].zero_()  # rows of members cleared earlier may still hold their deltas
        self.dq[slot, row0:row0 + rows].copy_(delta)
        self.dq_owners.setdefault(slot, set()).add(row0)

    def clear(self, slot: int, row0: int, rows: int) -> None:
        """Forget the member delta at ``row0`` of ``slot``; rows still shared with others become zero."""
        with self._lock:
            self._clear(slot, row0, rows)

    def _clear(self, slot: int, row0: int, rows: int) -> None:
        for g in self.groups.values():
            own = g.owners.get(slot)
            if not own or row0 not in own:
                continue
            own.discard(row0)
            if own:
                g.stack.clear_rows(slot, row0, rows)
            else:
                del g.owners[slot]
                g.slots.discard(slot)
                g.present[slot + 1] = False
        own = self.dq_owners.get(slot)
        if own and row0 in own:
            own.discard(row0)
            if own:
                self.dq[slot, row0:row0 + rows].zero_()
            else:
                del self.dq_owners[slot]

    def resident_bytes(self, slot: int, row0: int, rows: int) -> int:
        """Device bytes of one member's delta in ``slot`` (its rows' share of the stacks)."""
        total = 0
        for g in self.groups.values():
            if row0 in g.owners.get(slot, ()):
                total += g.stack.nbytes() // g.stack.num_deltas * rows // self.out_features
        if row0 in self.dq_owners.get(slot, ()):
            total += rows * self.in_features * self.dq.element_size()
        return total

    def add_into(self, y: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``y[r] += x[r] @ Δ[idx[r]]ᵀ`` for the active slots, in place.

        Args:
            y: ``[M, out]`` (the base GEMM's output); x: ``[M, in]``; idx: int64 ``[M]`` slot per row.
        Returns:
            ``y`` (the same tensor).
        """
        ctx, active = self.ctx, self.ctx.active
        for g in self.groups.values():
            if g.slots & active:  # the prepared launch: the step's shared plan, the slots the stack holds
                y = g.launch(y, x, idx, ctx.plan, g.present, g.slots)
        dq = self.dq_slots & active
        if dq:
            y.add_(_dense_rows(x, idx, self.dq, dq, ctx))
        return y


class DeltaLinear(nn.Module):
    """``y = x W_baseᵀ (+ b) + SBMM(x, slot per row, deltas)``, with per-slot replacements.

    Per slot ``s`` the variant's version of this linear is one of:

    - a packed additive delta (ΔCompress, RTN): ``y = x W_baseᵀ + x Δ̂_sᵀ``;
    - a packed non-additive weight (SparseGPT on full weights): ``y = x Ŵ_sᵀ`` (base term dropped);
    - a dense replacement ``W_s`` (a tensor stored ``dense_delta``/``full``, e.g. a changed lm_head,
      or a changed linear of a full-checkpoint variant): ``y = x W_sᵀ``, exactly as the merged
      model computes it. The slot *references* the tensor it is given (no copy), so two slots
      holding the same deduplicated tensor share its memory;
    - a LoRA adapter ``(A_s [r, in], B_s [out, r], scale_s)``: ``y = x W_baseᵀ + scale_s (x A_sᵀ) B_sᵀ``,
      all LoRA rows of a forward in one grouped call (``dispatch.lora``); adapters of different
      ranks share one ``[N, R, in]`` / ``[N, out, R]`` stack zero-padded to the largest rank ``R``
      (zero rows/columns add exact zeros);
    - nothing (``same``): ``y = x W_baseᵀ``, no work.

    A changed bias is a per-slot bias row. The base ``weight``/``bias`` parameters are the original
    module's own (tied embeddings stay tied).

    transformers' ``Conv1D`` (GPT-2) is a linear whose weight is stored ``[in, out]`` and computes
    ``x W + b``: its base GEMM reads the weight transposed (a view, no copy); packed deltas and LoRA
    factors are ``[out, in]`` as for any linear, and a dense replacement is given in the parameter's
    own layout (``[in, out]``) and read transposed.

    Args:
        base: the base model's ``nn.Linear`` or ``Conv1D`` (see :func:`is_linear`).
        ctx: the model's :class:`DeltaContext`.
    """

    def __init__(self, base: nn.Module, ctx: DeltaContext):
        super().__init__()
        self.transposed = _is_conv1d(base)
        if self.transposed:
            self.in_features, self.out_features = base.weight.shape
        else:
            self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.ctx = ctx
        n = ctx.num_slots
        dev = base.weight.device
        # Packed deltas: its own store, or a merged projection group's (then its rows start at _row0).
        self._store = PackedStore(ctx, self.in_features, self.out_features, dev, base.weight.dtype)
        self._row0 = 0
        self.merged = None  # the ProjectionGroup (deltazip.runtime.serve.projections) computing this linear
        self._replace = torch.zeros(n + 1, dtype=torch.bool, device=dev)  # base term dropped for slot
        self._replace_slots: set[int] = set()
        self._dense: dict[int, torch.Tensor] = {}  # slot -> [out, in] replacement weight (a reference)
        self._lora_A: torch.Tensor | None = None  # [N, R, in], allocated when a LoRA slot first needs it
        self._lora_B: torch.Tensor | None = None  # [N, out, R]
        self._lora_scale = torch.zeros(n, dtype=torch.float32, device=dev)  # [N]
        self._lora_present = torch.zeros(n + 1, dtype=torch.bool, device=dev)  # indexed by slot + 1
        self._lora_rank: dict[int, int] = {}  # slot -> its adapter's own rank
        # With a base bias, decoupled forwards add the bias per row from this table (row 0 = base),
        # because rows whose base term is dropped (non-additive, dense) still need their bias.
        self._bias_table: torch.Tensor | None = None
        if base.bias is not None:
            self._bias_table = base.bias.detach().unsqueeze(0).repeat(n + 1, 1)
        self._bias_row = slot_lookup(n, dev)  # slot + 1 -> row of _bias_table (0 = base)
        self._bias_slots: set[int] = set()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, slots={self.ctx.num_slots}, "
                f"configs={len(self.groups)}")

    # -- slot management (engine thread, between forwards) ---------------------------------------
    @property
    def groups(self) -> dict[tuple, _PackedGroup]:
        """The stacks holding this linear's packed deltas (shared with its group when merged)."""
        return self._store.groups

    def _loaded_slots(self) -> bool:
        """Whether any slot holds something for this linear."""
        s = self._store
        mine = any(self._row0 in own for g in s.groups.values() for own in g.owners.values())
        mine = mine or any(self._row0 in own for own in s.dq_owners.values())
        return bool(mine or self._replace_slots or self._dense or self._lora_rank or self._bias_slots)

    def clear_slot(self, slot: int) -> None:
        """Forget slot ``slot`` (its rows fall back to the base weights until it is loaded again)."""
        self._store.clear(slot, self._row0, self.out_features)
        self._replace[slot + 1] = False
        self._replace_slots.discard(slot)
        self._dense.pop(slot, None)
        self._lora_present[slot + 1] = False
        self._lora_rank.pop(slot, None)
        self._bias_row[slot + 1] = 0
        self._bias_slots.discard(slot)

    def load_slot(self, slot: int, *, packed: PackedDelta | None = None, additive: bool = True,
                  dense: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
                  lora_scale: float = 1.0, dequantized: torch.Tensor | None = None) -> None:
        """Put one variant's version of this linear into ``slot``.

        Args:
            packed: compressed delta (``[out, in]`` canonical layout), or None.
            additive: ``packed`` is a delta on the base (True) or the whole weight (False).
            dense: a replacement weight in the base parameter's layout (``[out, in]``; ``[in, out]``
                for a Conv1D), mutually exclusive with ``packed``, kept by reference when it is
                already on this device in this dtype (it must not be written afterwards: the server
                hands in read-only deduplicated tensors).
            bias: the variant's bias ``[out]`` when it differs from the base's.
            lora_a, lora_b, lora_scale: a LoRA adapter, ``A [r, in]``, ``B [out, r]`` and its scale.
            dequantized: ``packed`` already dequantized (``delta_weight``, ``[out, in]``), for a
                context that keeps deltas dequantized: the delta loader does that work off the
                engine thread, so the slot write is a copy.
        """
        if sum(x is not None for x in (packed, dense, lora_a, dequantized)) > 1:
            raise ValueError("a slot holds one of a packed delta, a dense weight or a LoRA adapter")
        self.clear_slot(slot)
        if dequantized is not None:
            if not self.ctx.dequantize or tuple(dequantized.shape) != (self.out_features, self.in_features):
                raise ValueError(f"a dequantized delta {tuple(dequantized.shape)} needs a dequantizing context and "
                                 f"shape [{self.out_features}, {self.in_features}]")
            self._put_dequantized(slot, dequantized, additive)
        if packed is not None:
            if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
                raise ValueError(f"packed delta is [{packed.out_features}, {packed.in_features}], the linear is "
                                 f"[{self.out_features}, {self.in_features}]")
            self._store.write(slot, self._row0, packed)
            if not additive:
                self._replace[slot + 1] = True
                self._replace_slots.add(slot)
        if dense is not None:
            if tuple(dense.shape) != tuple(self.weight.shape):
                raise ValueError(f"dense weight {tuple(dense.shape)} != the base's {tuple(self.weight.shape)}")
            dense = dense.to(device=self.weight.device, dtype=self.weight.dtype)
            self._dense[slot] = dense.t() if self.transposed else dense
            self._replace[slot + 1] = True
            self._replace_slots.add(slot)
        if lora_a is not None:
            self._load_lora(slot, lora_a, lora_b, lora_scale)
        if bias is not None:
            if self._bias_table is None:
                raise ValueError("the base linear has no bias; a variant cannot add one per row")
            self._bias_table[slot + 1].copy_(bias)
            self._bias_row[slot + 1] = slot + 1
            self._bias_slots.add(slot)

    def _put_dequantized(self, slot: int, delta: torch.Tensor, additive: bool) -> None:
        """``delta [out, in]`` (dense, any float dtype) into the slot's rows of the dequantized stack."""
        self._store.write_dequantized(slot, self._row0, delta)
        if not additive:
            self._replace[slot + 1] = True
            self._replace_slots.add(slot)

    def _load_lora(self, slot: int, a: torch.Tensor, b: torch.Tensor | None, scale: float) -> None:
        r = a.shape[0]
        if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[1] != self.in_features \
                or b.shape != (self.out_features, r):
            raise ValueError(f"LoRA factors A {tuple(a.shape)} and B {None if b is None else tuple(b.shape)} do not "
                             f"fit [{self.out_features}, {self.in_features}] (A [r, in], B [out, r])")
        n, dev, dt = self.ctx.num_slots, self.weight.device, self.weight.dtype
        have = 0 if self._lora_A is None else self._lora_A.shape[1]
        if r > have:  # grow the stacks to the new largest rank, keeping what the other slots hold
            new_a = torch.zeros(n, r, self.in_features, dtype=dt, device=dev)
            new_b = torch.zeros(n, self.out_features, r, dtype=dt, device=dev)
            if self._lora_A is not None:
                new_a[:, :have].copy_(self._lora_A)
                new_b[:, :, :have].copy_(self._lora_B)
            self._lora_A, self._lora_B = new_a, new_b
        self._lora_A[slot].zero_()
        self._lora_B[slot].zero_()
        self._lora_A[slot, :r].copy_(a)
        self._lora_B[slot, :, :r].copy_(b)
        self._lora_scale[slot] = float(scale)
        self._lora_present[slot + 1] = True
        self._lora_rank[slot] = r

    def resident_bytes(self, slot: int) -> int:
        """Device bytes that slot ``slot`` of this linear occupies (its share of the stacks)."""
        total = self._store.resident_bytes(slot, self._row0, self.out_features)
        if slot in self._dense:
            total += self._dense[slot].numel() * self._dense[slot].element_size()
        if slot in self._lora_rank:  # its padded rows of the stacks
            total += (self._lora_A[slot].numel() + self._lora_B[slot].numel()) * self._lora_A.element_size()
        if slot in self._bias_slots:
            total += self._bias_table[0].numel() * self._bias_table.element_size()
        return total

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, t, in]`` -> ``[B, t, out]`` (any leading dims whose first is the batch)."""
        if self.merged is not None:  # computed with its sibling projections (one GEMM, one SBMM)
            return self.merged.output(self, x)
        ctx = self.ctx
        lead = x.shape[:-1]
        w = self.weight.t() if self.transposed else self.weight  # [out, in] (Conv1D stores [in, out])
        if not ctx.active:  # a batch of base rows only: the plain linear
            return F.linear(x, w, self.bias)
        idx = ctx.token_index(x)
        x2 = x.reshape(-1, self.in_features)
        y = F.linear(x2, w)
        self.drop_replaced(y, idx)
        y = self._store.add_into(y, x2, idx)
        self.add_extras(y, x2, idx)
        return y.reshape(*lead, self.out_features)

    def drop_replaced(self, y: torch.Tensor, idx: torch.Tensor) -> None:
        """Zero, in place, the base term of rows whose slot replaces this weight. ``y``: ``[M, out]``
        (may be a column slice of a merged output)."""
        if self._replace_slots & self.ctx.active:
            y.masked_fill_(self._replace[idx + 1].unsqueeze(1), 0)

    def add_extras(self, y: torch.Tensor, x2: torch.Tensor, idx: torch.Tensor) -> None:
        """Add, in place, what is not a packed delta: dense replacements, LoRA, per-slot biases.
        ``y``: ``[M, out]`` (may be a column slice of a merged output); ``x2``: ``[M, in]``."""
        active = self.ctx.active
        if self._dense.keys() & active:
            y.add_(_ref_rows(x2, idx, self._dense, self._dense.keys() & active))
        if self._lora_rank.keys() & active:
            local = torch.where(self._lora_present[idx + 1], idx, torch.full_like(idx, -1))
            y.add_(dispatch.lora(x2, local, self._lora_A, self._lora_B, self._lora_scale, self.ctx.defer_lora))
        if self._bias_table is not None:
            y.add_(self._bias_table[self._bias_row[idx + 1]])


# Below this many multiply-adds, one GEMM against every slot's weights at once beats a GEMM per
# slot: for small batches and models the per-slot launches (index, matmul, scatter; tens of µs)
# dominate. Above it the N-fold extra work of the stacked GEMM costs more than the launches.
_ALL_SLOTS_GEMM_MACS = 1 << 20


def _dense_rows(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, slots: set[int],
                ctx: DeltaContext | None = None) -> torch.Tensor:
    """``y[r] = x[r] @ weights[idx[r]].T`` for rows whose slot is in ``slots``, zeros elsewhere.

    The dense counterpart of SBMM (for dequantized deltas and dense replacements), computed in the
    weights' dtype. Which way it runs is about launches, not arithmetic: on CPU each extra op costs
    tens of µs, more than the multiply-adds of a small model.

    - one slot: one GEMM, masked;
    - small problems: one GEMM against all ``N`` slots stacked (``[N * out, in]``), each row keeps
      its own block;
    - rows spread over several slots: one batched GEMM over the rows regrouped per slot
      (:class:`SlotSegments`, layout shared by all linears of the forward through ``ctx``);
    - a skewed batch (padding would double the work): one GEMM per distinct slot.

    Args:
        x: ``[M, in]``; idx: int64 ``[M]`` slot per row (``-1`` base); weights: ``[N, out, in]``.
        ctx: the model's context (enables the batched-GEMM path).
    Returns:
        ``[M, out]`` in ``x.dtype``.
    """
    m, n, out_f, in_f = x.shape[0], weights.shape[0], weights.shape[1], weights.shape[2]
    if len(slots) == 1:
        (s,) = slots
        return torch.where((idx == s).unsqueeze(1), F.linear(x, weights[s]), 0.0).to(x.dtype)
    if m * n * out_f * in_f <= _ALL_SLOTS_GEMM_MACS:
        wanted = torch.zeros(n + 1, dtype=torch.bool, device=x.device)
        wanted[[s + 1 for s in slots]] = True
        keep = wanted[idx + 1].unsqueeze(1)
        y_all = F.linear(x, weights.view(n * out_f, in_f)).view(m, n, out_f)
        own = y_all.gather(1, idx.clamp(min=0).view(m, 1, 1).expand(m, 1, out_f)).squeeze(1)
        return torch.where(keep, own, 0.0).to(x.dtype)
    seg = ctx.segments(m, frozenset(slots)) if ctx is not None and ctx.row_slot is not None else None
    if seg is not None:
        return seg.matmul(x.to(weights.dtype), weights).to(x.dtype)
    y = torch.zeros(m, out_f, dtype=x.dtype, device=x.device)
    for s in sorted(slots):
        rows = (idx == s).nonzero(as_tuple=True)[0]
        if rows.numel():
            y[rows] = F.linear(x[rows], weights[s])
    return y


def _ref_rows(x: torch.Tensor, idx: torch.Tensor, weights: dict[int, torch.Tensor], slots) -> torch.Tensor:
    """``y[r] = x[r] @ weights[idx[r]].T`` for rows whose slot is in ``slots``, zeros elsewhere.

    Like :func:`_dense_rows`, for per-slot weights held as separate (possibly shared) tensors:
    one GEMM per distinct slot present.

    Args:
        x: ``[M, in]``; idx: int64 ``[M]``; weights: slot -> ``[out, in]``.
    Returns:
        ``[M, out]`` in ``x.dtype``.
    """
    slots = sorted(slots)
    if len(slots) == 1:
        (s,) = slots
        return torch.where((idx == s).unsqueeze(1), F.linear(x, weights[s]), 0.0).to(x.dtype)
    out_f = weights[slots[0]].shape[0]
    y = torch.zeros(x.shape[0], out_f, dtype=x.dtype, device=x.device)
    for s in slots:
        rows = (idx == s).nonzero(as_tuple=True)[0]
        if rows.numel():
            y[rows] = F.linear(x[rows], weights[s])
    return y
