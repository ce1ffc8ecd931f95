"""Which fast SBMM kernels may run where: a leaf module (no other kernel module imported), so that the
stack layout choice (``deltazip.kernels.stacked``) can ask without importing the kernels themselves.

- :func:`cuda_kernel_available`: the CUDA kernel (``deltazip.kernels.cuda_sbmm``) needs a GPU of compute
  capability 8.0+ (mma.sync bf16, cp.async) and NVRTC (``deltazip.kernels.cuda_rtc``).
- :func:`triton_fast_enabled`: the Triton fast kernel runs on a GPU only where its Triton version was
  measured fast (:data:`VALIDATED_TRITON`).
"""

from __future__ import annotations

import functools
import os

import torch

# Triton versions on which the Triton fast kernel was measured fast on a GPU. The same source builds a
# bank-conflicted, shared-memory-bound loop under Triton 3.6 (442 us against the CUDA kernel's 53 us at
# D = 16 on an H200, docs/kernels.md) and 3.8; 3.9 builds the intended loop offline but has not been
# timed. Elsewhere the dispatcher uses the CUDA kernel (or the transposed layout's kernel), unless
# DELTAZIP_FORCE_TRITON=1 (the parity tests) or DELTAZIP_TRITON_FAST=1 asks for this one.
VALIDATED_TRITON: tuple[str, ...] = ()
# Versions whose offline build fails the version-independent screens (deltazip.kernels.sass.screens).
KNOWN_BAD_TRITON = {"3.6.0": "the dequantized tile round-trips through shared memory (128 scalar stores per loop "
                             "iteration) with extra barriers; copies are 16-byte since the alignment hint",
                    "3.8.0": "64 scalar shared-memory stores per loop iteration"}


def triton_fast_enabled() -> bool:
    """Whether the dispatcher may pick the Triton fast kernel on a GPU (see :data:`VALIDATED_TRITON`)."""
    if os.environ.get("DELTAZIP_TRITON_FAST", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        import triton
    except Exception:  # noqa: BLE001
        return False
    return triton.__version__ in VALIDATED_TRITON


@functools.cache
def cuda_kernel_available(device_index: int = 0) -> bool:
    """A CUDA device of compute capability 8.0+ and NVRTC that loads."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        from deltazip.kernels.cuda_rtc import nvrtc

        nvrtc()
    except Exception:  # noqa: BLE001 - no NVRTC: the dispatcher uses another path
        return False
    return True
