"""Kernel-ready layout: many compressed deltas of one linear stacked in one device tensor per part.

A stack is homogeneous in ``bits``, ``group_size``, sparsity and shape (those are compile-time constants
of the kernel); slot ``d`` of a part starts at element offset ``d * part[0].numel()`` of the single
contiguous tensor, so a kernel receives one base pointer per part plus integer strides, never a table of
pointers. A runtime cache can :meth:`StackedDeltas.allocate` a fixed number of slots and
:meth:`StackedDeltas.write` deltas into them as they are loaded.

Two layouts (``StackedDeltas.layout``):

- ``"canonical"``: each slot holds the canonical parts of its delta (``deltazip.kernels.packed``):
  ``qweight`` int32 ``[D, out, Kw]``, ``positions`` int32 ``[D, out, Kp]`` (2:4 only), ``scales`` fp16
  ``[D, out, G]``, ``zeros`` uint8 ``[D, out, G]`` or None (all slots symmetric, zero point
  ``2**(bits-1)``). When some deltas are asymmetric and others symmetric, the symmetric ones get their
  implicit zero point written out, so one stack serves both. Read by the torch reference
  (``deltazip.kernels.reference.sbmm``), a slot at a time, with no copy.
- ``"mma"``: read by the CUDA kernel (``deltazip.kernels.cuda_sbmm``); ``qweight`` is int32
  ``[D, slot_words]`` in the register order of the tensor-core fragment
  (``deltazip.kernels.mma_layout``), 2:4 deltas expanded to dense codes (``positions`` is None and
  ``sparse24`` True) or, in the compact layout, their kept codes and positions
  (``deltazip.kernels.mma_sparse``); ``scales`` fp16 ``[D, GP, OUTP]`` and ``zeros`` fp16
  ``[D, GP, OUTP]``, the groups' values interleaved across output rows (one group's scales for a tile of
  output rows are one contiguous load), the rows padded to ``OUTP``, a multiple of 64, and the groups to
  ``GP`` (``mma_layout.scale_groups``: those of a padded last K tile included, scale 0; a group the
  kernel does not read whole, 96 columns say, as sub-groups that repeat its scale,
  ``mma_layout.layout_group``).

Which one a stack gets is the dispatcher's decision (``deltazip.kernels.dispatch.layout_for``);
``"auto"`` here (:func:`choose_layout`) is ``"mma"`` on CUDA for configurations the layout holds.
Either way :meth:`write` takes canonical deltas and :meth:`unstack` gives them back (for ``"mma"``
an equivalent one: the same :meth:`delta_weight`; under 2:4 a kept value equal to the zero point may
come back at another position of its group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from deltazip.kernels import mma_layout, mma_sparse, preview
from deltazip.kernels.packed import PackedDelta, packed_words
from deltazip.kernels.reference import delta_weight as _reference_delta_weight
from deltazip.kernels.scheme import DeltaScheme, SchemeShaped

LAYOUTS = ("canonical", "mma")
_LAYOUT_ENV = "DELTAZIP_SBMM_LAYOUT"
_ROW_CHUNK = 1024  # rows repacked at a time (bounds the int64 temporaries of a 7B-sized linear)


def choose_layout(layout: str, *, bits: int, group_size: int, in_features: int,
                  device: torch.device | str) -> str:
    """Resolve ``"auto"``: ``"mma"`` for a stack on CUDA whose configuration the layout holds
    (:func:`deltazip.kernels.mma_layout.supported`), else ``"canonical"``. ``DELTAZIP_SBMM_LAYOUT``
    (read here, at allocation only) overrides ``"auto"``: ``canonical`` always, ``mma`` wherever the
    configuration has one (any device: the CPU tests of the layout). An explicit ``layout="mma"`` for
    a configuration without one raises."""
    if layout not in (*LAYOUTS, "auto"):
        raise ValueError(f"layout {layout!r}: use one of {LAYOUTS} or 'auto'")
    ok = mma_layout.supported(bits, group_size, in_features)
    if layout == "mma" and not ok:
        raise ValueError(f"no mma layout for bits={bits}, group_size={group_size}, in_features={in_features} "
                         f"(needs bits in {mma_layout.MMA_BITS}, in_features % 8 == 0, and groups of a multiple of 16 "
                         "columns that divides the row)")
    if layout != "auto":
        return layout
    env = os.environ.get(_LAYOUT_ENV, "auto").strip().lower() or "auto"
    if env not in (*LAYOUTS, "auto"):
        raise ValueError(f"{_LAYOUT_ENV}={env!r}: use one of {LAYOUTS} or 'auto'")
    if env != "auto":
        return "mma" if env == "mma" and ok else "canonical"
    # a configuration only a preview kernel path serves (a padded last K tile, narrow groups) keeps the
    # canonical layout the reference reads directly until that path passes parity on a GPU
    ok = ok and preview.allowed(bits, group_size, in_features)
    return "mma" if ok and torch.device(device).type == "cuda" else "canonical"


@dataclass
class StackedDeltas(SchemeShaped):
    """``D`` compressed deltas of one ``[out, in]`` linear in the kernel-ready layout (module docstring).

    Attributes:
        qweight: int32 ``[D, out, Kw]`` (``mma``: ``[D, slot_words]``).
        scales: fp16 ``[D, out, G]`` (``mma``: ``[D, GP, OUTP]``).
        zeros: uint8 ``[D, out, G]`` (``mma``: fp16 ``[D, GP, OUTP]``) or None (symmetric).
        positions: int32 ``[D, out, Kp]`` or None (dense, no 2:4, or the ``mma`` layout).
        scheme: shared by every slot; ``scheme.sym`` is False exactly when ``zeros`` is stored (a
            stack with zero points holds symmetric deltas too, their implicit zero point written out).
        in_features, out_features: of every slot.
        layout: ``"canonical"`` or ``"mma"`` (module docstring).
        compact: (``mma``, 2:4 only) the kept codes and their positions in the compact layout the
            kernel's sparse MMA reads (``deltazip.kernels.mma_sparse``), not expanded to every column.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    positions: torch.Tensor | None
    scheme: DeltaScheme
    in_features: int
    out_features: int
    layout: str = "canonical"
    compact: bool = False

    @property
    def num_deltas(self) -> int:
        return self.qweight.shape[0]

    @property
    def sparse24(self) -> bool:
        """The ``mma`` layout holds 2:4 deltas (expanded to dense codes, or :attr:`compact`; ``positions`` is
        None)."""
        return self.layout == "mma" and self.scheme.sparse

    @property
    def asymmetric(self) -> bool:
        return self.zeros is not None

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @classmethod
    def allocate(cls, num_slots: int, scheme: DeltaScheme | None = None, *, in_features: int, out_features: int,
                 device: torch.device | str = "cpu", layout: str = "auto", compact: bool | None = None,
                 **fields) -> StackedDeltas:
        """An all-zero stack of ``num_slots`` slots (a zero slot is a zero delta: scale 0).

        Args:
            scheme: what the slots hold; an asymmetric scheme allocates zero points.
            layout: ``"canonical"``, ``"mma"`` or ``"auto"`` (:func:`choose_layout`).
            compact: an ``mma`` stack of 2:4 deltas in the compact layout (:func:`compact_for`; None: where
                it has one and the ``sparse-mma`` preview is on).
            fields: instead of ``scheme``, its loose fields ``bits``, ``group_size``, ``sparse``,
                ``asymmetric`` (call sites that read them from a delta or a manifest).
        """
        if scheme is None:
            scheme = DeltaScheme(bits=fields["bits"], group_size=fields["group_size"],
                                 sparsity="2:4" if fields["sparse"] else "none", sym=not fields["asymmetric"])
        if num_slots < 1:
            raise ValueError(f"a stack needs at least one slot, got {num_slots}")
        problem = scheme.shape_problem(in_features)
        if problem:
            raise ValueError(problem)
        layout = choose_layout(layout, bits=scheme.bits, group_size=scheme.group_size, in_features=in_features,
                               device=device)
        g, asym = scheme.num_groups(in_features), not scheme.sym
        if layout == "mma":
            outp = mma_layout.padded_rows(out_features)
            compact = compact_for(scheme, in_features, compact)
            words = (mma_sparse.slot_words if compact else mma_layout.slot_words)(out_features, in_features, scheme.bits)
            gp = mma_layout.scale_groups(in_features, scheme.group_size)
            return cls(
                torch.zeros(num_slots, words, dtype=torch.int32, device=device),
                torch.zeros(num_slots, gp, outp, dtype=torch.float16, device=device),
                torch.zeros(num_slots, gp, outp, dtype=torch.float16, device=device) if asym else None,
                None, scheme, in_features, out_features, layout="mma", compact=compact,
            )
        kept, o = scheme.kept_per_row(in_features), out_features
        qweight = torch.zeros(num_slots, o, packed_words(kept, scheme.bits), dtype=torch.int32, device=device)
        positions = None
        if scheme.sparse:
            positions = torch.zeros(num_slots, o, packed_words(kept, 2), dtype=torch.int32, device=device)
        scales = torch.zeros(num_slots, o, g, dtype=torch.float16, device=device)
        zeros = torch.zeros(num_slots, o, g, dtype=torch.uint8, device=device) if asym else None
        return cls(qweight, scales, zeros, positions, scheme, in_features, out_features)

    def slots(self, start: int, stop: int) -> StackedDeltas:
        """A view of slots ``start .. stop - 1`` (no copy)."""

        def cut(t):
            return None if t is None else t[start:stop]

        return replace(self, qweight=cut(self.qweight), scales=cut(self.scales), zeros=cut(self.zeros),
                       positions=cut(self.positions))

    def _check_compatible(self, delta: PackedDelta, row0: int = 0) -> None:
        mine = (self.bits, self.effective_group, self.sparse, self.in_features)
        theirs = (delta.bits, delta.effective_group, delta.sparse, delta.in_features)
        if mine != theirs or not (0 <= row0 and row0 + delta.out_features <= self.out_features):
            raise ValueError(
                f"delta (bits, group, sparse, in, out) = {(*theirs, delta.out_features)} at row {row0} does not fit a "
                f"stack of {(*mine, self.out_features)}; stack deltas of one configuration together"
            )
        if not self._rows_fit(row0, delta):
            raise ValueError(f"rows {row0}..{row0 + delta.out_features} of an mma stack must start on a multiple "
                             f"of {mma_layout.ROW_BLOCK} and end on one or at the stack's last row")
        if delta.zeros is not None and self.zeros is None:
            raise ValueError("asymmetric delta written into a symmetric stack; allocate with asymmetric=True")

    def _rows_fit(self, row0: int, delta: PackedDelta) -> bool:
        """In the ``mma`` layout a 64-row tile belongs to one writer: a row range must cover whole tiles."""
        if self.layout != "mma" or (row0 == 0 and delta.out_features == self.out_features):
            return True
        end = row0 + delta.out_features
        return row0 % mma_layout.ROW_BLOCK == 0 and (end % mma_layout.ROW_BLOCK == 0 or end == self.out_features)

    def write(self, slot: int, delta: PackedDelta, row0: int = 0) -> None:
        """Repack one canonical delta into ``slot`` (in place, on the stack's device).

        ``row0``: put the delta's ``out`` rows at output rows ``row0 .. row0 + out - 1`` of the slot
        and leave the other rows as they are (one projection of a merged ``[q; k; v]`` stack); in the
        ``mma`` layout the range must cover whole 64-row tiles (start on a multiple of 64, end on one
        or at the last row)."""
        if not 0 <= slot < self.num_deltas:
            raise IndexError(f"slot {slot} outside [0, {self.num_deltas})")
        delta.validate()
        self._check_compatible(delta, row0)
        if self.layout == "mma":
            self._write_mma(slot, delta.to(self.device), row0)
            return
        rows = slice(row0, row0 + delta.out_features)
        self.qweight[slot, rows].copy_(delta.qweight)
        if self.positions is not None:
            self.positions[slot, rows].copy_(delta.positions)
        self.scales[slot, rows].copy_(delta.scales)
        if self.zeros is not None:
            if delta.zeros is None:
                self.zeros[slot, rows].fill_(2 ** (delta.bits - 1))
            else:
                self.zeros[slot, rows].copy_(delta.zeros)

    def clear_rows(self, slot: int, row0: int, rows: int) -> None:
        """Make output rows ``row0 .. row0 + rows - 1`` of ``slot`` a zero delta (scale 0; the codes
        stay, ``(code - zero) * 0`` is exactly 0)."""
        scales = self.scales[slot] if self.layout == "canonical" else self.scales[slot].T  # [out(p), G(p)]
        scales[row0:row0 + rows].zero_()

    def _write_mma(self, slot: int, delta: PackedDelta, row0: int = 0) -> None:
        out_f, bits = delta.out_features, self.bits
        zp = mma_layout.zero_points(delta)  # [out, G] int64
        words = self.qweight[slot]
        per_block = self._slot_words(mma_layout.ROW_BLOCK)
        for r0 in range(0, out_f, _ROW_CHUNK):
            r1 = min(out_f, r0 + _ROW_CHUNK)
            part = delta.map_parts(lambda t, r0=r0, r1=r1: t[r0:r1], out_features=r1 - r0)
            if self.compact:  # the kept codes at distinct ascending positions (the sparse MMA's metadata)
                kept, pos = mma_layout.resparsify(mma_layout.dense_codes(part), zp[r0:r1], self.effective_group)
                packed = mma_sparse.pack(kept, pos, bits)
            else:
                packed = mma_layout.pack_codes(mma_layout.dense_codes(part), bits)
            start = (row0 + r0) // mma_layout.ROW_BLOCK * per_block
            words[start:start + packed.numel()].copy_(packed)
        # the layout's groups (a group split into sub-groups repeats its scale); past them a padded tile's, scale 0
        scales = mma_layout.layout_scales(delta.scales, self.group_size, self.in_features)
        rows, g = slice(row0, row0 + out_f), scales.shape[1]
        if out_f == self.out_features:
            self.scales[slot].zero_()
        self.scales[slot, :g, rows].copy_(scales.T)
        if self.zeros is not None:
            if out_f == self.out_features:
                self.zeros[slot].zero_()
            self.zeros[slot, :g, rows].copy_(mma_layout.layout_scales(zp, self.group_size, self.in_features).T
                                             .to(torch.float16))

    def _slot_words(self, rows: int) -> int:
        """int32 words of ``rows`` output rows of one slot of an ``mma`` stack."""
        return (mma_sparse.slot_words if self.compact else mma_layout.slot_words)(rows, self.in_features, self.bits)

    def _unstack_mma(self, slot: int) -> PackedDelta:
        out_f, in_f, bits = self.out_features, self.in_features, self.bits
        group, rep = self.effective_group, mma_layout.split_groups(self.group_size, in_f)
        g = self.scheme.num_groups(in_f) * rep  # the delta's groups: the first sub-group of each
        scales = self.scales[slot, :g:rep, :out_f].T.contiguous()
        zeros = None if self.zeros is None else self.zeros[slot, :g:rep, :out_f].T.to(torch.uint8).contiguous()
        zp = zeros if zeros is not None else torch.full_like(scales, 1 << (bits - 1), dtype=torch.uint8)
        per_block = self._slot_words(mma_layout.ROW_BLOCK)
        qws, poss = [], []
        for r0 in range(0, out_f, _ROW_CHUNK):
            r1 = min(out_f, r0 + _ROW_CHUNK)
            start = r0 // mma_layout.ROW_BLOCK * per_block
            part = self.qweight[slot, start:start + self._slot_words(r1 - r0)]
            if self.compact:
                codes, pos = mma_sparse.unpack(part, bits, r1 - r0, in_f)
                poss.append(mma_layout.pack_int32(pos, 2))
                qws.append(mma_layout.pack_int32(codes, bits))
                continue
            codes = mma_layout.unpack_codes(part, bits, r1 - r0, in_f)
            if self.sparse24:
                codes, pos = mma_layout.resparsify(codes, zp[r0:r1], group)
                poss.append(mma_layout.pack_int32(pos, 2))
            qws.append(mma_layout.pack_int32(codes, bits))
        return PackedDelta(torch.cat(qws), scales, zeros, torch.cat(poss) if self.sparse24 else None,
                           self._slot_scheme(), in_f, out_f)

    def unstack(self, slot: int) -> PackedDelta:
        """Slot ``slot`` back in canonical layout (asymmetric stacks return explicit zero points).

        From the ``canonical`` layout its parts are views of the slot (a later write into the slot shows
        through); from the ``mma`` layout a new delta, equivalent rather than identical under 2:4 (module
        docstring)."""
        if not 0 <= slot < self.num_deltas:
            raise IndexError(f"slot {slot} outside [0, {self.num_deltas})")
        if self.layout == "mma":
            return self._unstack_mma(slot)

        def t(part):
            return None if part is None else part[slot]

        return PackedDelta(t(self.qweight), t(self.scales), t(self.zeros), t(self.positions),
                           self._slot_scheme(), self.in_features, self.out_features)

    def _slot_scheme(self) -> DeltaScheme:
        """The scheme of an unstacked slot: asymmetric stacks give explicit zero points back."""
        return self.scheme if self.scheme.sym == (self.zeros is None) else self.scheme.replace(sym=self.zeros is None)

    def delta_weight(self, slot: int) -> torch.Tensor:
        """Dense fp32 ``[out, in]`` delta of ``slot``, through the reference math."""
        return _reference_delta_weight(self.unstack(slot))

    def nbytes(self) -> int:
        """Bytes of all stacked tensors (every slot)."""
        ts = [self.qweight, self.scales, self.zeros, self.positions]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device: torch.device | str) -> StackedDeltas:
        """A copy with every part on ``device``."""

        def mv(t):
            return None if t is None else t.to(device)

        return replace(self, qweight=mv(self.qweight), scales=mv(self.scales), zeros=mv(self.zeros),
                       positions=mv(self.positions))


def compact_for(scheme: DeltaScheme, in_features: int, want: bool | None = None) -> bool:
    """Whether an ``mma`` stack of ``scheme`` holds its deltas in the compact 2:4 layout: ``want`` where
    given (raises when the configuration has none), else where it has one and the ``sparse-mma``
    preview is on (``DELTAZIP_CUDA_PREVIEW``)."""
    ok = mma_sparse.supported(scheme.bits, scheme.sparse, mma_layout.layout_group(scheme.group_size, in_features))
    if want is None:
        return ok and preview.enabled("sparse-mma")
    if want and not ok:
        raise ValueError(f"no compact 2:4 layout for {scheme.bits}-bit {scheme.sparsity} groups of "
                         f"{scheme.effective_group(in_features)} columns (needs 2:4, {mma_sparse.SPARSE_BITS} bits "
                         "and groups of 32 columns or more)")
    return want


def repack(deltas: list[PackedDelta], device: torch.device | str | None = None, layout: str = "auto",
           compact: bool | None = None) -> StackedDeltas:
    """Stack canonical deltas into the kernel-ready layout (slot ``i`` holds ``deltas[i]``).

    Args:
        deltas: ``D >= 1`` deltas sharing bits, group size, sparsity and shape; any mix of symmetric
            and asymmetric quantization.
        device: where the stack lives (default: the device of ``deltas[0]``).
        layout: ``"canonical"``, ``"mma"`` or ``"auto"`` (:func:`choose_layout`).
        compact: as :meth:`StackedDeltas.allocate`.
    Returns:
        A ``StackedDeltas`` with ``num_deltas == D``.
    """
    if not deltas:
        raise ValueError("repack needs at least one delta")
    first = deltas[0]
    stack = StackedDeltas.allocate(
        len(deltas),
        first.scheme.replace(sym=all(d.zeros is None for d in deltas)),
        in_features=first.in_features,
        out_features=first.out_features,
        device=first.qweight.device if device is None else device,
        layout=layout,
        compact=compact,
    )
    for i, d in enumerate(deltas):
        stack.write(i, d)
    return stack


def config_key(delta: PackedDelta) -> tuple[int, int, bool, int, int]:
    """What must agree for two deltas to share a stack: ``(bits, group, sparse, in, out)``."""
    return (delta.bits, delta.effective_group, delta.sparse, delta.in_features, delta.out_features)
