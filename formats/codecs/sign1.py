"""Kind ``sign1``: a 1-bit sign delta with one scale per row (the worked example of a new scheme).

A linear delta ``Δ [rows, in]`` is stored as its signs and one scale per row:

- ``signs`` int32 ``[rows, ceil(in / 32)]``: bit ``c % 32`` of word ``c // 32`` is 1 where
  ``Δ[r, c] >= 0`` (packed like a packed delta's 1-bit codes; padding bits zero);
- ``scales`` float16 ``[rows, 1]``: ``mean(|Δ[r]|)``, the scale that minimises ``||Δ[r] - s·sign(Δ[r])||²``.

Value: ``scale[r] * (+1 if bit else -1)`` (:func:`sign_delta_weight`, the reference). No solver: the
codec encodes the matrix itself, so ``deltazip compress`` with ``DeltaScheme(kind="sign1", bits=1,
group_size=-1, sparsity="none")`` writes these entries; ``verify``, ``merge``, ``inspect`` and
``serve`` (as a dense delta: no kernel reads the parts) reach it through the codec registry.
This module is the whole scheme: ``tests/formats/codecs/test_sign1.py`` checks that nothing else
names it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deltazip.formats.codecs.base import Entry, MatrixCodec, register
from deltazip.formats.packing import pack_int32
from deltazip.kernels.packed import packed_words
from deltazip.kernels.reference import unpack_int32
from deltazip.kernels.scheme import DeltaScheme, KindRules, register_kind

KIND = "sign1"


def sign_delta_weight(signs: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """The reference dequant: fp32 ``[rows, in]`` = ``scales[r] * (2 * bit[r, c] - 1)``.

    Args:
        signs: int32 ``[rows, ceil(in / 32)]`` packed sign bits.
        scales: float16 ``[rows, 1]``.
        in_features: ``in``.
    """
    bits = unpack_int32(signs, 1, in_features).float()
    return scales.float() * (2 * bits - 1)


class Sign1Codec(MatrixCodec):
    kind = KIND
    parts = ("signs", "scales")

    def encode(self, rows: torch.Tensor, scheme: DeltaScheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``rows`` fp32 ``[rows, in]`` -> parts and the fp32 ``[rows, in]`` matrix they stand for."""
        scales = rows.abs().mean(dim=1, keepdim=True).to(torch.float16)
        parts = {"signs": pack_int32((rows >= 0).to(torch.int32), 1), "scales": scales}
        return parts, sign_delta_weight(parts["signs"], scales, rows.shape[1])

    def dense(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sign_delta_weight(parts["signs"], parts["scales"], self.rows(entry)[1])

    def layout_problems(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> list[str]:
        rows, in_f = self.rows(entry)
        want = {"signs": ((rows, packed_words(in_f, 1)), torch.int32), "scales": ((rows, 1), torch.float16)}
        for part, (shape, dtype) in want.items():
            t = parts.get(part)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                return [f"{part} is {None if t is None else (t.dtype, list(t.shape))}, want {dtype} {list(shape)}"]
        pad = (-in_f) % 32
        if pad and bool((parts["signs"][:, -1] >> (32 - pad) != 0).any()):
            return ["signs: padding bits not zero"]
        if not bool(torch.isfinite(parts["scales"].float()).all()):
            return ["scales: not all finite"]
        return []


register_kind(KIND, KindRules(bits=(1,), sparsities=("none",), whole_rows_only=True, symmetric_only=True))
register(Sign1Codec())
