"""Exact deltas of non-linear tensors (artifact kind ``xor``, format version 2; docs/format.md).

``xor = bits(ft) ^ bits(base)``, the raw bits of two tensors of the same dtype and shape seen as
integers of the element's width (uint8, int16, int32, int64). It rebuilds the fine-tune bit for bit
in any dtype (bfloat16, float16, float32, ...). When fine-tune and base are close, sign, exponent and
high mantissa bits agree, so most high bytes of ``xor`` are zero and the lossless stage shrinks it;
stored raw it is exactly as large as the tensor itself.
"""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, register

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as the signed integer dtype of its element width (uint8 for 1 byte)."""
    return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])


def xor_delta(base: torch.Tensor, ft: torch.Tensor) -> torch.Tensor:
    """``bits(ft) ^ bits(base)`` (same shape; integer dtype of the element width)."""
    if base.dtype != ft.dtype or base.shape != ft.shape:
        raise ValueError(f"xor needs equal dtype and shape, got {base.dtype} {tuple(base.shape)} and "
                         f"{ft.dtype} {tuple(ft.shape)}")
    return int_view(base) ^ int_view(ft)


def apply_xor(base: torch.Tensor, xor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor whose bits are ``bits(base) ^ xor``, in ``dtype`` (``base`` must already be ``dtype``)."""
    if base.dtype != dtype:
        raise ValueError(f"xor entry of dtype {dtype} needs a base tensor of that dtype, got {base.dtype}")
    return (int_view(base) ^ xor.to(base.device)).view(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and raw bits."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(int_view(a), int_view(b))


class XorCodec(Codec):
    """Kind ``xor``: the raw bits of the fine-tune XOR the base's, one ``xor`` part of the element width."""

    kind = "xor"
    parts = ("xor",)
    relative_to_base = True

    def fields(self, shape, dtype: torch.dtype) -> dict:
        return {"kind": self.kind, "shape": list(shape), "dtype": dtype_name(dtype)}

    def layout_problems(self, entry: Entry, parts) -> list[str]:
        t = parts.get("xor")
        if t is None:
            return ["xor entry without an 'xor' part"]
        width = torch.empty((), dtype=entry.dtype).element_size()
        if list(t.shape) != list(entry.shape) or t.dtype != _INT_OF_WIDTH[width]:
            return [f"xor is {dtype_name(t.dtype)} {list(t.shape)}, want the {width}-byte integer type of "
                    f"{dtype_name(entry.dtype)} and shape {list(entry.shape)}"]
        return []

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        base = self.check_base(entry, base, entry.shape)
        return apply_xor(base.to(entry.dtype), src.parts(entry.name, device)["xor"], entry.dtype)


register(XorCodec())
