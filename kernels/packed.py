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

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from deltazip.kernels.scheme import DeltaScheme, SchemeShaped, kind_rules

# Code widths of the packed kind (the scheme's rules for kind "packed"), kept as a name for readers.
SUPPORTED_BITS = kind_rules("packed").bits


def codes_per_word(bits: int) -> int:
    """How many ``bits``-wide codes one int32 word holds (3-bit codes waste 2 bits per word)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"unsupported bit width {bits}; use one of {SUPPORTED_BITS}")
    return 32 // bits


def packed_words(n: int, bits: int) -> int:
    """Number of int32 words for ``n`` codes of ``bits`` bits."""
    per = codes_per_word(bits)
    return (n + per - 1) // per


@dataclass
class PackedDelta(SchemeShaped):
    """One compressed linear delta in canonical layout (shapes in the module docstring).

    ``scheme`` says what the parts hold (bits, group, sparsity, symmetry); :meth:`validate` checks the
    parts against it: ``positions`` present exactly under 2:4, ``zeros`` exactly when asymmetric.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    positions: torch.Tensor | None
    scheme: DeltaScheme
    in_features: int
    out_features: int

    def validate(self) -> None:
        """Check shapes and dtypes against the layout; raises ValueError naming what is off."""
        o = self.out_features
        problem = self.scheme.shape_problem(self.in_features)
        if problem:
            raise ValueError(problem)
        if self.sparse != (self.positions is not None):
            raise ValueError(f"sparsity {self.scheme.sparsity!r} but positions "
                             f"{'absent' if self.sparse else 'present'}")
        if self.scheme.sym != (self.zeros is None):
            raise ValueError(f"sym={self.scheme.sym} but zero points {'present' if self.scheme.sym else 'absent'}")
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

    def parts(self) -> dict[str, torch.Tensor]:
        """The stored tensors by part name (``qweight``, ``positions``, ``scales``, ``zeros``: the
        manifest's order), those the scheme stores only."""
        ts = {"qweight": self.qweight, "positions": self.positions, "scales": self.scales, "zeros": self.zeros}
        return {k: t for k, t in ts.items() if t is not None}

    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.parts().values())

    def map_parts(self, fn: Callable[[torch.Tensor], torch.Tensor], out_features: int | None = None,
                  in_features: int | None = None) -> PackedDelta:
        """A copy with ``fn`` applied to every stored tensor (a device move, pinning, a row slice...);
        ``out_features``/``in_features`` give the copy's shape when ``fn`` changes it."""

        def mv(t):
            return None if t is None else fn(t)

        return replace(self, qweight=mv(self.qweight), scales=mv(self.scales), zeros=mv(self.zeros),
                       positions=mv(self.positions), out_features=self.out_features if out_features is None
                       else out_features, in_features=self.in_features if in_features is None else in_features)

    def to(self, device: torch.device | str) -> PackedDelta:
        """A copy with every tensor on ``device``."""
        return self.map_parts(lambda t: t.to(device))
