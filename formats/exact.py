"""Exact deltas of non-linear tensors (artifact kind ``xor``, format version 2; docs/format.md).

``xor = bits(ft) ^ bits(base)``, the raw bits of two tensors of the same dtype and shape seen as
integers of the element's width (uint8, int16, int32, int64). It rebuilds the fine-tune bit for bit
in any dtype (bfloat16, float16, float32, ...). When fine-tune and base are close, sign, exponent and
high mantissa bits agree, so most high bytes of ``xor`` are zero and the lossless stage shrinks it;
stored raw it is exactly as large as the tensor itself.
"""

from __future__ import annotations

import torch

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
