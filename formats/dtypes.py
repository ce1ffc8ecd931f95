"""The one table of dtype names: safetensors names (``"BF16"``), their manifest/torch names
(``"bfloat16"``) and element sizes, and the dtypes a model computes in.

Every module that names a dtype reads it here (the review of 2026-11 counted 11 tables in 9 files).
Importing this module does not import torch (the CPU weight owner of ``--workers`` must not pay for
it): the torch dtypes come from functions, and ``ST_TO_TORCH`` / ``TORCH_TO_ST`` are built on first
access.
"""

from __future__ import annotations

import functools
from typing import Any

from deltazip.formats.errors import ArtifactError, InputError

# safetensors name -> (torch / manifest name, bytes per element); None: no torch dtype for it here.
ST: dict[str, tuple[str | None, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8), "F8_E8M0": (None, 1), "F4": (None, 1),
}
ST_SIZES: dict[str, int] = {k: size for k, (_, size) in ST.items()}
ST_FLOATS = ("F64", "F32", "F16", "BF16")
ST_OF_NAME: dict[str, str] = {name: k for k, (name, _) in ST.items() if name}
# The dtypes a model can be computed (calibrated, served) in, by the name the CLI takes ("auto" apart).
COMPUTE = ("float32", "float16", "bfloat16")


def dtype_name(dtype) -> str:
    """torch.float16 -> 'float16' (the manifest's name)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str):
    """'float16' -> torch.float16; an unknown name is a corrupt manifest."""
    import torch

    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in manifest")
    return dt


def compute_dtype(name: str, option: str = "--dtype"):
    """The torch dtype of a compute-dtype option value, None for ``auto``.

    Raises:
        InputError: a name outside ``auto`` and :data:`COMPUTE`.
    """
    if name == "auto":
        return None
    if name not in COMPUTE:
        raise InputError(f"{option} {name!r} is unknown; use auto, {', '.join(COMPUTE[:-1])} or {COMPUTE[-1]}")
    return parse_dtype(name)


@functools.cache
def _tables() -> tuple[dict, dict]:
    to_torch = {k: parse_dtype(name) for k, (name, _) in ST.items() if name}
    return to_torch, {v: k for k, v in to_torch.items()}


def __getattr__(name: str) -> Any:
    """``ST_TO_TORCH`` (safetensors name -> torch dtype) and ``TORCH_TO_ST``, built on first use."""
    if name == "ST_TO_TORCH":
        return _tables()[0]
    if name == "TORCH_TO_ST":
        return _tables()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
