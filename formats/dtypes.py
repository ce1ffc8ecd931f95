"""The one table of dtype names: torch dtypes, their manifest names (``"bfloat16"``) and their
safetensors names (``"BF16"``), with element sizes.

Every module that names a dtype reads it here (the review of 2026-11 counted 11 tables in 9 files).
"""

from __future__ import annotations

import torch

from deltazip.formats.errors import ArtifactError

# safetensors dtype string <-> torch dtype. The dedup registry fingerprints by the safetensors name
# so that its fingerprints equal the scan's.
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}
# Bytes per element of every safetensors dtype string (some have no torch dtype here).
ST_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
ST_FLOATS = ("F64", "F32", "F16", "BF16")
# The dtypes a model can be computed (served, calibrated) in, by the name the CLI takes.
COMPUTE: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> 'float16' (the manifest's name)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """'float16' -> torch.float16; an unknown name is a corrupt manifest."""
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in manifest")
    return dt


def st_name(dtype: torch.dtype | str) -> str:
    """The safetensors name (``F32``...) of a torch dtype or of a name like ``float32``."""
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
    return TORCH_TO_ST[dt]
