"""Merged projections: sibling linears that read the same input computed as one.

A Llama-family attention block calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden
states, its MLP ``gate_proj`` and ``up_proj``. Decoupled one by one (``DeltaLinear``), a decode step
spends per layer seven base GEMMs and seven SBMM launches on them. A :class:`ProjectionGroup` owns the
concatenated base weight ``[W_q; W_k; W_v]`` (the members' parameters become row views of it; where
they already lie back to back, as in the shared buffer of ``serve --workers``, it is a view of them:
no extra memory either way) and one packed store whose stacks hold each slot's deltas of all members stacked along
the output rows (``deltazip.runtime.serve.delta_linear.PackedStore``). The first member called
computes every member's output: one base GEMM, one SBMM per delta configuration that adds its
product onto the GEMM's output in the kernel's epilogue (``dispatch.sbmm(..., out=y)``: no
zero-filled buffer, no separate add), and the members' own extras (dense replacements, LoRA, biases)
in place on their column slices. The outputs are column views of that one ``[M, q + k + v]``
tensor; the other members' calls return theirs without computing.

The cache is keyed by the input tensor's identity and version and by the forward
(``DeltaContext.generation``); it holds the input until every member has taken its output, then
drops both. Nothing in it reads a tensor value on the host, so a step stays graph-capturable: under
capture the Python runs once and records one GEMM and one SBMM launch per group. A member called
with another input (an architecture that projects different tensors) still gets the right answer
(the group recomputes), only without the saving; :func:`merge_projections` forms groups only for the
sibling names of the Llama family (:data:`PROJECTION_GROUPS`), other architectures keep one
``DeltaLinear`` per projection. ``DELTAZIP_MERGE_PROJECTIONS=0`` turns merging off.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from deltazip.kernels.mma_layout import ROW_BLOCK
from deltazip.models.projection_groups import PROJECTION_GROUPS  # siblings that read one input (Llama family)
from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear, PackedStore

_ENV = "DELTAZIP_MERGE_PROJECTIONS"


def merging_enabled() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class ProjectionGroup:
    """Sibling ``DeltaLinear`` projections computed together (module docstring).

    Args:
        members: the ``DeltaLinear`` modules, in output order; same input size, dtype and device,
            all with a bias or none, no slot loaded yet. When a member boundary is not a multiple of
            64 rows the stacks take the canonical layout (a 64-row tile of the CUDA kernel's layout
            belongs to one member; on CUDA such projections are not merged, :func:`why_not_mergeable`).
        ctx: the model's context.
    """

    def __init__(self, members: list[DeltaLinear], ctx: DeltaContext):
        why = why_not_mergeable(members)
        if why:
            raise ValueError(f"cannot merge projections: {why}")
        self.members, self.ctx = list(members), ctx
        self.in_features = members[0].in_features
        self.rows: list[tuple[int, int]] = []
        o = 0
        for m in members:
            self.rows.append((o, m.out_features))
            o += m.out_features
        self.out_features = o
        w0 = members[0].weight
        with torch.no_grad():
            self.weight = _stacked([m.weight for m in members], self.rows)  # [out, in]
            self.bias = None if members[0].bias is None else _stacked([m.bias for m in members], self.rows)
        self.store = PackedStore(ctx, self.in_features, o, w0.device, w0.dtype)
        if any(r0 % ROW_BLOCK for r0, _ in self.rows):
            self.store.layout = "canonical"  # a 64-row tile of the mma layout would span two members
        for m, (r0, _) in zip(members, self.rows):
            m._store, m._row0, m.merged = self.store, r0, self
        self._key: tuple | None = None
        self._x: torch.Tensor | None = None  # held while outputs are pending (keeps its id unique)
        self._outs: list[torch.Tensor] | None = None
        self._pending: set[int] = set()

    def output(self, member: DeltaLinear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s output for input ``x`` ``[B, t, in]``: a column view of the merged output."""
        i = next(j for j, m in enumerate(self.members) if m is member)
        # Inference tensors have no version counter; between sibling calls nothing writes x anyway.
        key = (id(x), -1 if x.is_inference() else x._version, self.ctx.generation)
        if key != self._key or i not in self._pending:
            self._outs = self._compute(x)
            self._key, self._x, self._pending = key, x, set(range(len(self.members)))
        out = self._outs[i]
        self._pending.discard(i)
        if not self._pending:  # every member has its output: drop the input and the outputs
            self._key = self._x = self._outs = None
        return out

    def _compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        ctx = self.ctx
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not ctx.active:
            y = F.linear(x2, self.weight, self.bias)
        else:
            idx = ctx.token_index(x)
            y = F.linear(x2, self.weight)
            for m, (r0, n) in zip(self.members, self.rows):
                m.drop_replaced(y[:, r0:r0 + n], idx)
            y = self.store.add_into(y, x2, idx)
            for m, (r0, n) in zip(self.members, self.rows):
                m.add_extras(y[:, r0:r0 + n], x2, idx)
        return [y[:, r0:r0 + n].reshape(*lead, n) for r0, n in self.rows]


def _stacked(parts: list[torch.Tensor], rows: list[tuple[int, int]]) -> torch.Tensor:
    """``parts`` (``[n_i, ...]``) stacked along dim 0, and each part made a row view of the result.

    Parts that already lie back to back in one storage (the shared buffer of ``serve --workers``
    lays groups out so) are stacked by a view of that storage: no copy, and the parts stay as they
    are. Otherwise the stack is a new tensor and each part's ``.data`` becomes its rows, so the
    old memory is freed once nothing else holds it (the model's own load: no second copy)."""
    first = parts[0]
    step = math.prod(first.shape[1:])  # elements per row
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.storage_offset() == first.storage_offset() + r0 * step for p, (r0, _) in zip(parts, rows)):
        total = rows[-1][0] + rows[-1][1]
        return first.as_strided((total, *first.shape[1:]), first.stride())
    out = torch.cat([p.detach() for p in parts])
    for p, (r0, n) in zip(parts, rows):
        p.data = out[r0:r0 + n]
    return out


def why_not_mergeable(members: list[nn.Module]) -> str | None:
    """Why these modules cannot form a :class:`ProjectionGroup`, or None when they can."""
    if len(members) < 2:
        return "a group needs at least two projections"
    first = members[0]
    for m in members:
        if not isinstance(m, (nn.Linear, DeltaLinear)):
            return f"{type(m).__name__} is not a linear"
        if m.in_features != first.in_features:
            return f"input sizes differ ({m.in_features} != {first.in_features})"
        if m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device:
            return "weights differ in dtype or device"
        if (m.bias is None) != (first.bias is None):
            return "some projections have a bias and others not"
        if isinstance(m, DeltaLinear) and (m.merged is not None or m._loaded_slots()):
            return "a projection is already merged or holds variants"
    ends = [sum(m.out_features for m in members[:i + 1]) for i in range(len(members) - 1)]
    if first.weight.device.type == "cuda" and any(e % ROW_BLOCK for e in ends):
        # one stack's 64-row tile of the CUDA kernel belongs to one member: apart, each projection's
        # stack is served by the kernel; merged, the group's would fall to the reference
        return f"a member boundary (rows {ends}) is not on the CUDA kernel's {ROW_BLOCK}-row tiles"
    return None


def merge_projections(model: nn.Module, modules: dict[str, nn.Module], ctx: DeltaContext,
                      held: list[torch.Tensor] | None = None, share=None) -> dict[str, DeltaLinear]:
    """Form a :class:`ProjectionGroup` for every set of Llama-family siblings with a decoupled member.

    Siblings not decoupled yet are decoupled (a ``DeltaLinear`` with no slot costs nothing beyond the
    plain linear), so the group never changes once formed. Called after modules are decoupled
    (``DeltaModel`` build and ``commit_variant``); idempotent.

    Args:
        model: the base model (modules replaced in place).
        modules: decoupled modules by name (not modified).
        ctx: the model's context.
        held: the list that keeps the base's registry tensors alive (``DeltaModel._base_held``): the
            members' old weights are replaced in it by the concatenated ones, so the old memory is
            freed and the dedup registry answers with the new views.
        share: ``share(tensor) -> tensor`` routing a new base view through the dedup registry.
    Returns:
        The newly decoupled siblings, by module name (to add to ``modules``).
    """
    if not merging_enabled():
        return {}
    new: dict[str, DeltaLinear] = {}
    for pname, parent in model.named_modules():
        for names in PROJECTION_GROUPS:
            kids = [getattr(parent, n, None) for n in names]
            if not any(isinstance(k, DeltaLinear) for k in kids) or why_not_mergeable(kids):
                continue
            full = [f"{pname}.{n}" if pname else n for n in names]
            members = []
            for n, fname, k in zip(names, full, kids):
                if not isinstance(k, DeltaLinear):
                    k = DeltaLinear(k, ctx)
                    setattr(parent, n, k)
                    new[fname] = k
                members.append(k)
            old = {t.data_ptr() for m in members for t in (m.weight, m.bias) if t is not None}
            group = ProjectionGroup(members, ctx)
            if held is not None:
                _rebind_held(held, old, group, share)
    return new


def _rebind_held(held: list[torch.Tensor], old: set[int], group: ProjectionGroup, share) -> None:
    """Replace the members' old base tensors in ``held`` (found by data pointer) by views of the
    group's concatenation: dropping the last references frees the old memory, and the registry, whose
    entries for them die with it, learns the views instead."""
    held[:] = [t for t in held if t.data_ptr() not in old]
    for m in group.members:
        for t in (m.weight, m.bias):
            if t is not None:
                held.append(share(t.data) if share is not None else t.data)
