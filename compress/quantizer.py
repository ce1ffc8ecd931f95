"""Uniform group quantization (GPTQ's grid) with scales rounded to fp16 as they are stored.

Scales are rounded to fp16 *before* codes are chosen, so the artifact reproduces the solver's
values bit for bit.

``bits`` is one code width for every row (an ``int``) or one per row (an int64 tensor ``[R]``): the
sensitivity probe (compress/sensitivity.py) solves several candidate widths of one matrix at once as
stacked rows, and a row's grid depends on its own width only.
"""

from __future__ import annotations

import torch

from deltazip.formats.errors import CompressionError

# Smallest positive fp16 (subnormal): a scale below it would round to zero on disk.
_MIN_SCALE = 2.0**-24
_MAX_SCALE = 65504.0

Bits = int | torch.Tensor


def max_code(bits: Bits, like: torch.Tensor) -> int | torch.Tensor:
    """Largest code, ``2**bits - 1``: an int, or a float tensor shaped to broadcast against ``like``
    (``[R]`` for a column, ``[R, 1]`` for ``[R, C]``)."""
    if isinstance(bits, int):
        return 2**bits - 1
    m = (2**bits - 1).to(like.device, torch.float32)
    return m.unsqueeze(1) if like.dim() == 2 else m


def find_params(x: torch.Tensor, bits: Bits, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero point for the columns of ``x``.

    Args:
        x: fp32 ``[R, C]`` values of one group.
        bits: code width (int, or int64 ``[R]`` per row); codes lie in ``[0, 2**bits - 1]``.
        sym: symmetric grid (zero point fixed at ``2**(bits-1)``) or asymmetric (integer zero point).
    Returns:
        (scale fp32 ``[R]``, exactly representable in fp16; zero fp32 ``[R]`` holding integers).
    """
    maxq = max_code(bits, x[:, 0])
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    flat = (xmin == 0) & (xmax == 0)
    xmin = torch.where(flat, -torch.ones_like(xmin), xmin)
    xmax = torch.where(flat, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / maxq
    if bool((scale > _MAX_SCALE).any()):
        raise CompressionError(f"a weight group spans {float((scale * maxq).max()):.3g}, beyond what fp16 scales hold")
    scale = scale.clamp(min=_MIN_SCALE).half().float()
    if sym:
        zero = torch.full_like(scale, float((maxq + 1) // 2)) if isinstance(maxq, int) else (maxq + 1) // 2
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq) if isinstance(maxq, int) else \
            torch.minimum(torch.round(-xmin / scale).clamp(min=0), maxq)
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: Bits) -> torch.Tensor:
    """Codes ``clamp(round(x / scale) + zero, 0, maxq)``; x ``[R, ...]``, scale/zero ``[R]`` or broadcastable;
    ``bits`` an int or int64 ``[R]``."""
    if scale.dim() == 1 and x.dim() == 2:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    maxq = max_code(bits, x)
    if isinstance(maxq, int):
        return torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return torch.minimum((torch.round(x / scale) + zero).clamp(min=0), maxq)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``scale * (codes - zero)`` with the same broadcasting as ``quantize_codes``."""
    if scale.dim() == 1 and codes.dim() == 2:
        scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return scale * (codes - zero)
