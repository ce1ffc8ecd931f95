"""Kernel-ready layout: many compressed deltas of one linear stacked in one device tensor per part.

The canonical layout (``deltazip.kernels.packed``) stores one delta row-major along the output
dimension: ``qweight[out, words]``. A kernel tile covers ``BLOCK_N`` consecutive output features and
walks the input dimension, so neighbouring threads of a warp own neighbouring *output* features; in
the canonical layout they would read words ``words * 4`` bytes apart. The stacked layout therefore
transposes every part so that the output dimension is the contiguous one, and stacks the deltas
along a leading slot dimension:

- ``qweight``   int32 ``[D, Kw, out]``: word ``w`` of output row ``o`` of slot ``d`` is
  ``canonical.qweight[o, w]`` (same code order inside a word: code ``k`` at word ``k // per``,
  bit ``(k % per) * bits``; ``per = 32 // bits``; ``Kw = ceil(K / per)``).
- ``positions`` int32 ``[D, Kp, out]`` (2:4 only), ``Kp = ceil(K / 16)``, transposed the same way.
- ``scales``    fp16 ``[D, G, out]``: the group scales interleaved across output rows, so one
  group's scales for a tile of ``BLOCK_N`` outputs are one contiguous ``2 * BLOCK_N``-byte load.
- ``zeros``     uint8 ``[D, G, out]`` or None (all slots symmetric, zero point ``2**(bits-1)``).
  When some deltas are asymmetric and others symmetric, the symmetric ones get their implicit
  zero point written out, so one stack serves both.

Slot ``d`` of a part starts at element offset ``d * part[0].numel()`` of the single contiguous
tensor: the kernel receives one base pointer per part plus integer strides, never a table of
pointers. A stack is homogeneous in ``bits``, ``group_size``, sparsity and shape (those are
compile-time constants of the kernel); a runtime cache can :meth:`StackedDeltas.allocate` a fixed
number of slots and :meth:`StackedDeltas.write` deltas into them as they are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltazip.kernels.packed import SUPPORTED_BITS, PackedDelta, packed_words
from deltazip.kernels.reference import delta_weight as _reference_delta_weight


@dataclass
class StackedDeltas:
    """``D`` compressed deltas of one ``[out, in]`` linear in the kernel-ready layout (module docstring).

    Attributes:
        qweight: int32 ``[D, Kw, out]``.
        scales: fp16 ``[D, G, out]``.
        zeros: uint8 ``[D, G, out]`` or None (symmetric).
        positions: int32 ``[D, Kp, out]`` or None (dense, no 2:4).
        bits, group_size, in_features, out_features: shared by every slot.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    positions: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int

    @property
    def num_deltas(self) -> int:
        return self.qweight.shape[0]

    @property
    def sparse(self) -> bool:
        return self.positions is not None

    @property
    def asymmetric(self) -> bool:
        return self.zeros is not None

    @property
    def kept_per_row(self) -> int:
        return self.in_features // 2 if self.sparse else self.in_features

    @property
    def effective_group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def num_groups(self) -> int:
        return self.in_features // self.effective_group

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        *,
        bits: int,
        group_size: int,
        in_features: int,
        out_features: int,
        sparse: bool,
        asymmetric: bool,
        device: torch.device | str = "cpu",
    ) -> StackedDeltas:
        """An all-zero stack of ``num_slots`` slots (a zero slot is a zero delta: scale 0)."""
        if num_slots < 1:
            raise ValueError(f"a stack needs at least one slot, got {num_slots}")
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={bits} not in {SUPPORTED_BITS}")
        group = in_features if group_size == -1 else group_size
        if group <= 0 or in_features % group:
            raise ValueError(f"in_features {in_features} not divisible by group size {group}")
        if sparse and (in_features % 4 or group % 4):
            raise ValueError(f"2:4 needs in_features ({in_features}) and group size divisible by 4")
        kept = in_features // 2 if sparse else in_features
        g = in_features // group
        qweight = torch.zeros(num_slots, packed_words(kept, bits), out_features, dtype=torch.int32, device=device)
        positions = None
        if sparse:
            positions = torch.zeros(num_slots, packed_words(kept, 2), out_features, dtype=torch.int32, device=device)
        scales = torch.zeros(num_slots, g, out_features, dtype=torch.float16, device=device)
        zeros = torch.zeros(num_slots, g, out_features, dtype=torch.uint8, device=device) if asymmetric else None
        return cls(qweight, scales, zeros, positions, bits, group_size, in_features, out_features)

    def _check_compatible(self, delta: PackedDelta) -> None:
        mine = (self.bits, self.effective_group, self.sparse, self.in_features, self.out_features)
        theirs = (delta.bits, delta.effective_group, delta.sparse, delta.in_features, delta.out_features)
        if mine != theirs:
            raise ValueError(
                f"delta (bits, group, sparse, in, out) = {theirs} does not fit a stack of {mine}; "
                "stack deltas of one configuration together"
            )
        if delta.zeros is not None and self.zeros is None:
            raise ValueError("asymmetric delta written into a symmetric stack; allocate with asymmetric=True")

    def write(self, slot: int, delta: PackedDelta) -> None:
        """Repack one canonical delta into ``slot`` (in place, on the stack's device)."""
        if not 0 <= slot < self.num_deltas:
            raise IndexError(f"slot {slot} outside [0, {self.num_deltas})")
        delta.validate()
        self._check_compatible(delta)
        dev = self.device
        self.qweight[slot].copy_(delta.qweight.to(dev).T)
        if self.positions is not None:
            self.positions[slot].copy_(delta.positions.to(dev).T)
        self.scales[slot].copy_(delta.scales.to(dev).T)
        if self.zeros is not None:
            if delta.zeros is None:
                self.zeros[slot].fill_(2 ** (delta.bits - 1))
            else:
                self.zeros[slot].copy_(delta.zeros.to(dev).T)

    def unstack(self, slot: int) -> PackedDelta:
        """Slot ``slot`` back in canonical layout (asymmetric stacks return explicit zero points)."""
        if not 0 <= slot < self.num_deltas:
            raise IndexError(f"slot {slot} outside [0, {self.num_deltas})")

        def t(part):
            return None if part is None else part[slot].T.contiguous()

        return PackedDelta(t(self.qweight), t(self.scales), t(self.zeros), t(self.positions),
                           self.bits, self.group_size, self.in_features, self.out_features)

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

        return StackedDeltas(mv(self.qweight), mv(self.scales), mv(self.zeros), mv(self.positions),
                             self.bits, self.group_size, self.in_features, self.out_features)


def repack(deltas: list[PackedDelta], device: torch.device | str | None = None) -> StackedDeltas:
    """Stack canonical deltas into the kernel-ready layout (slot ``i`` holds ``deltas[i]``).

    Args:
        deltas: ``D >= 1`` deltas sharing bits, group size, sparsity and shape; any mix of symmetric
            and asymmetric quantization.
        device: where the stack lives (default: the device of ``deltas[0]``).
    Returns:
        A ``StackedDeltas`` with ``num_deltas == D``.
    """
    if not deltas:
        raise ValueError("repack needs at least one delta")
    first = deltas[0]
    stack = StackedDeltas.allocate(
        len(deltas),
        bits=first.bits,
        group_size=first.group_size,
        in_features=first.in_features,
        out_features=first.out_features,
        sparse=first.sparse,
        asymmetric=any(d.zeros is not None for d in deltas),
        device=first.qweight.device if device is None else device,
    )
    for i, d in enumerate(deltas):
        stack.write(i, d)
    return stack


def config_key(delta: PackedDelta) -> tuple[int, int, bool, int, int]:
    """What must agree for two deltas to share a stack: ``(bits, group, sparse, in, out)``."""
    return (delta.bits, delta.effective_group, delta.sparse, delta.in_features, delta.out_features)
