"""Kind ``packed``: a compressed linear delta in the canonical packed layout (``deltazip.kernels.packed``).

Parts ``qweight``, ``positions`` (2:4 only), ``scales`` and ``zeros`` (asymmetric only), in that
order; their shapes follow from the entry's scheme and ``shape`` (``PackedDelta.validate``). The
reference dequant is ``deltazip.kernels.reference.delta_weight``; the kernels read stacks of these
deltas in the layouts of :data:`PackedCodec.layouts` (``deltazip.kernels.stacked``).

Entries carry their ``scheme`` and, for readers older than it, the same grid in the loose fields
``bits``, ``group_size``, ``sym`` and ``sparsity`` (format v1/v2 entries have only those).

Invariants ``verify`` checks beyond shapes (:func:`packed_problems`): padding codes and unused bits
zero; under 2:4 the two kept positions of every group distinct and ascending; zero points within
``[0, 2**bits)``; finite scales.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from deltazip.formats.codecs.base import Entry, MatrixCodec, register
from deltazip.formats.errors import ArtifactError
from deltazip.kernels.packed import PackedDelta, codes_per_word, packed_words
from deltazip.kernels.reference import delta_weight, unpack_int32
from deltazip.kernels.scheme import DeltaScheme
from deltazip.kernels.stacked import LAYOUTS

# The grid fields format v1/v2 wrote loose (and this version writes beside ``scheme`` for older readers).
_LOOSE = ("bits", "group_size", "sparsity", "sym")


class PackedCodec(MatrixCodec):
    kind = "packed"
    parts = ("qweight", "positions", "scales", "zeros")
    layouts = LAYOUTS
    # The reference dequant every fast path matches.
    dequant = staticmethod(delta_weight)

    def fields(self, scheme: DeltaScheme, shape: list[int], dtype: torch.dtype, additive: bool,
               transposed: bool = False, experts: int = 0) -> dict[str, Any]:
        """The loose grid fields first (the order format v2 wrote them in), then the scheme."""
        entry = {"kind": self.kind, "shape": shape, "dtype": "", "bits": scheme.bits, "group_size": scheme.group_size,
                 "sym": scheme.sym, "sparsity": scheme.sparsity}
        return entry | super().fields(scheme, shape, dtype, additive, transposed, experts)

    def encode_delta(self, delta: PackedDelta, dtype: torch.dtype, additive: bool, transposed: bool = False,
                     experts: int = 0, name: str = "") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """A new entry's fields and parts for ``delta`` (``[E*out, in]`` rows for E fused experts)."""
        delta.validate()
        shape = [delta.out_features, delta.in_features]
        if experts:
            if delta.out_features % experts:
                raise ValueError(f"{name}: {delta.out_features} rows do not split into {experts} experts")
            shape = [experts, delta.out_features // experts, delta.in_features]
        return self.fields(delta.scheme, shape, dtype, additive, transposed, experts), delta.parts()

    def field_problems(self, name: str, raw: Mapping[str, Any]) -> list[str]:
        missing = [f"tensor {name!r}: packed entry lacks {key!r}" for key in _LOOSE if key not in raw and "scheme" not in raw]
        out = missing or super().field_problems(name, raw)
        scheme = raw.get("scheme")
        if not out and isinstance(scheme, dict):
            differ = [k for k in _LOOSE if k in raw and raw[k] != scheme.get(k)]
            if differ:
                out.append(f"tensor {name!r}: its {differ[0]!r} ({raw[differ[0]]!r}) differs from its scheme's "
                           f"({scheme.get(differ[0])!r})")
        return out

    def to_packed(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> PackedDelta:
        """The entry's parts as a PackedDelta (``[E*out, in]`` for fused experts), unvalidated."""
        rows, in_f = self.rows(entry)
        return PackedDelta(qweight=parts["qweight"], scales=parts["scales"], zeros=parts.get("zeros"),
                           positions=parts.get("positions"), scheme=self.scheme(entry), in_features=in_f,
                           out_features=rows)

    def read(self, src, entry: Entry, device=None) -> PackedDelta:
        """The validated PackedDelta of an entry of artifact ``src`` (on ``device``)."""
        d = self.to_packed(entry, src.parts(entry.name, device))
        try:
            d.validate()
        except ValueError as err:
            raise ArtifactError(f"{src.path}: tensor {entry.name!r} has an invalid packed layout: {err}") from err
        return d

    def dense(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        d = self.to_packed(entry, parts)
        d.validate()
        return self.dequant(d)

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        delta = self.to_stored(entry, self.dequant(self.read(src, entry, device)))
        if not self.additive(entry):
            return delta.to(entry.dtype)
        base = self.check_base(entry, base, self.stored_shape(entry))
        return (base.float() + delta.to(base.device)).to(entry.dtype)

    def layout_problems(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> list[str]:
        shape = list(entry.shape)
        if len(shape) != (3 if entry.experts else 2):
            return [f"packed entry with shape {shape}, expected [out, in] (or [E, out, in] with 'experts')"]
        scheme = self.scheme(entry)
        if scheme.sparse != ("positions" in parts):
            return [f"sparsity {scheme.sparsity!r} but positions {'absent' if scheme.sparse else 'present'}"]
        if scheme.sym == ("zeros" in parts):
            return [f"sym={scheme.sym} but zero points {'present' if scheme.sym else 'absent'}"]
        try:
            d = self.to_packed(entry, parts)  # fused experts: the E experts' rows stacked, [E*out, in]
            d.validate()
        except (KeyError, ValueError, ZeroDivisionError) as err:
            return [f"invalid packed layout ({err})"]
        return packed_problems(d)


def _unused_bits(words: torch.Tensor, bits: int, n: int) -> int:
    """Rows of int32 ``words`` (codes of ``bits`` bits, ``n`` per row) with a set bit outside any code."""
    per = codes_per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    full = (1 << (per * bits)) - 1
    last = (1 << ((n - (packed_words(n, bits) - 1) * per) * bits)) - 1
    allowed = torch.full((w.shape[1],), full, dtype=torch.int64)
    if w.shape[1]:
        allowed[-1] = last
    return int(((w & ~allowed) != 0).any(dim=1).sum())


def packed_problems(d: PackedDelta) -> list[str]:
    """Invariants of a packed delta beyond its shapes (see docs/format.md, packed layout)."""
    out = []
    k = d.kept_per_row
    rows = _unused_bits(d.qweight, d.bits, k)
    if rows:
        out.append(f"qweight: {rows} rows with padding codes or unused bits not zero")
    if d.sparse:
        rows = _unused_bits(d.positions, 2, k)
        if rows:
            out.append(f"positions: {rows} rows with padding codes not zero")
        pos = unpack_int32(d.positions, 2, k).reshape(d.out_features, k // 2, 2)
        bad = pos[..., 0] >= pos[..., 1]
        if bool(bad.any()):
            r, g = (int(x) for x in bad.nonzero()[0])
            out.append(f"positions: {int(bad.sum())} groups of 4 whose two kept positions are not distinct and "
                       f"ascending (first: row {r}, group {g})")
    if d.zeros is not None:
        over = int((d.zeros.int() >= 2 ** d.bits).sum())
        if over:
            out.append(f"zeros: {over} zero points outside [0, {2 ** d.bits})")
    finite = torch.isfinite(d.scales.float())
    if not bool(finite.all()):
        out.append(f"scales: {int((~finite).sum())} of {math.prod(d.scales.shape)} are not finite")
    return out


register(PackedCodec())
