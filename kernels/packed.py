"""The canonical packed form of one compressed linear delta (see docs/format.md).

A linear weight has shape ``[out_features, in_features]``; the delta is compressed along the input
dimension (columns), the dimension that GPTQ walks and that 2:4 sparsity groups in fours.

- ``qweight`` int32 ``[out, ceil(K / (32 // bits))]``: quantization codes, ``32 // bits`` codes per
  word, code ``k`` of a row at word ``k // per_word``, bit offset ``(k % per_word) * bits``. ``K`` is
  ``in / 2`` with 2:4 sparsity (only kept values are stored), ``in`` without.
- ``positions`` int32 ``[out, ceil(K / 16)]`` (2:4 only): the 2-bit index (0..3) inside its group of
  four input columns of each kept value, packed like ``qweight`` with 2 bits; the two kept values of a
  group come in ascending position order.
- ``scales`` fp16 ``[out, G]``, ``G = in / group_size`` (one group per row when ``group_size == -1``).
  Groups are counted in input columns of the dense matrix, so a group of ``g`` columns holds ``g / 2``
  kept values under 2:4.
- ``zeros`` uint8 ``[out, G]`` (asymmetric only): integer zero points; symmetric uses ``2**(bits-1)``.

Value of a kept entry: ``scale * (code - zero)``; pruned entries are exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def codes_per_word(bits: int) -> int:
    """How many ``bits``-wide codes one int32 word holds (3-bit codes waste 2 bits per word)."""
    if bits not in SUPPORTED_BITS and bits != 2:
        raise ValueError(f"unsupported bit width {bits}; use one of {SUPPORTED_BITS}")
    return 32 // bits


def packed_words(n: int, bits: int) -> int:
    """Number of int32 words for ``n`` codes of ``bits`` bits."""
    per = codes_per_word(bits)
    return (n + per - 1) // per


@dataclass
class PackedDelta:
    """One compressed linear delta in canonical layout (shapes in the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    positions: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int
    out_features: int

    @property
    def sparse(self) -> bool:
        """True when the delta is 2:4 sparse (kept values plus positions are stored)."""
        return self.positions is not None

    @property
    def kept_per_row(self) -> int:
        """Stored values per row: ``in/2`` under 2:4, ``in`` when dense."""
        return self.in_features // 2 if self.sparse else self.in_features

    @property
    def effective_group(self) -> int:
        """Group size in input columns (``-1`` resolved to the whole row)."""
        return self.in_features if self.group_size == -1 else self.group_size

    @property
    def num_groups(self) -> int:
        return self.in_features // self.effective_group

    def validate(self) -> None:
        """Check shapes and dtypes against the layout; raises ValueError naming what is off."""
        o, i = self.out_features, self.in_features
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} not in {SUPPORTED_BITS}")
        if i % self.effective_group:
            raise ValueError(f"in_features {i} not divisible by group size {self.effective_group}")
        if self.sparse and (i % 4 or self.effective_group % 4):
            raise ValueError(f"2:4 needs in_features ({i}) and group size divisible by 4")
        want_q = (o, packed_words(self.kept_per_row, self.bits))
        if tuple(self.qweight.shape) != want_q or self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight {tuple(self.qweight.shape)} {self.qweight.dtype}, want {want_q} int32")
        if self.sparse:
            want_p = (o, packed_words(self.kept_per_row, 2))
            if tuple(self.positions.shape) != want_p or self.positions.dtype != torch.int32:
                raise ValueError(f"positions {tuple(self.positions.shape)}, want {want_p} int32")
        want_s = (o, self.num_groups)
        if tuple(self.scales.shape) != want_s or self.scales.dtype != torch.float16:
            raise ValueError(f"scales {tuple(self.scales.shape)} {self.scales.dtype}, want {want_s} float16")
        if self.zeros is not None and (tuple(self.zeros.shape) != want_s or self.zeros.dtype != torch.uint8):
            raise ValueError(f"zeros {tuple(self.zeros.shape)} {self.zeros.dtype}, want {want_s} uint8")

    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        ts = [self.qweight, self.scales, self.zeros, self.positions]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device: torch.device | str) -> PackedDelta:
        """A copy with every tensor on ``device``."""

        def mv(t):
            return None if t is None else t.to(device)

        return PackedDelta(mv(self.qweight), mv(self.scales), mv(self.zeros), mv(self.positions),
                           self.bits, self.group_size, self.in_features, self.out_features)
