"""Configuration of one compression run, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from deltazip.formats.errors import InputError
from deltazip.kernels.packed import SUPPORTED_BITS

METHODS = ("deltazip", "sparsegpt", "rtn")
SPARSITIES = ("2:4", "none")
DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CALIB_ACTIVATIONS = ("reconstructed", "base")


@dataclass
class CompressConfig:
    """Options of ``deltazip compress`` (see docs/compress.md).

    ``embed_bits`` / ``embed_group_size``: code width and hidden columns per group of the row-wise
    embedding deltas (0 = the same as ``bits`` / ``group_size``; a group that does not divide the
    hidden size becomes the whole row).

    ``calib_activations``: "reconstructed" (ΔCompress: every layer is calibrated on the inputs that
    the base + compressed-delta model produces) or "base" (ablation: the base model's own
    activations, which the paper shows to be worse).
    """

    bits: int = 4
    sparsity: str = "2:4"
    group_size: int = 128
    sym: bool = True
    nsamples: int = 256
    seqlen: int = 2048
    damp: float = 0.01
    method: str = "deltazip"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    calib_activations: str = "reconstructed"
    batch_size: int = 8
    embed_bits: int = 0
    embed_group_size: int = 0

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise InputError(f"--bits {self.bits} is not supported; use one of {', '.join(map(str, SUPPORTED_BITS))}")
        if self.sparsity not in SPARSITIES:
            raise InputError(f"--sparsity {self.sparsity!r} is not supported; use 2:4 or none")
        if self.group_size != -1 and self.group_size <= 0:
            raise InputError(f"--group-size {self.group_size} must be positive, or -1 for one group per row")
        if self.sparse24 and self.group_size != -1 and self.group_size % 4:
            raise InputError(f"--group-size {self.group_size} must be divisible by 4 with 2:4 sparsity")
        if self.method not in METHODS:
            raise InputError(f"--method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        if self.nsamples < 1 or self.seqlen < 2:
            raise InputError("--nsamples must be >= 1 and --seqlen >= 2")
        if not 0 < self.damp < 1:
            raise InputError(f"--damp {self.damp} must lie in (0, 1)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise InputError(f"--device {self.device!r} is unknown; use auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise InputError("--device cuda was asked for but no CUDA device is available; use --device cpu")
        if self.dtype not in DTYPES:
            raise InputError(f"--dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        if self.calib_activations not in CALIB_ACTIVATIONS:
            raise InputError(f"calib_activations must be one of {CALIB_ACTIVATIONS}")
        if self.batch_size < 1:
            raise InputError("batch size must be >= 1")
        if self.embed_bits and self.embed_bits not in SUPPORTED_BITS:
            raise InputError(f"--embed-bits {self.embed_bits} is not supported; use 0 (same as --bits) or one of "
                             f"{', '.join(map(str, SUPPORTED_BITS))}")
        if self.embed_group_size < -1:
            raise InputError(f"--embed-group-size {self.embed_group_size} must be positive, 0 (same as "
                             "--group-size) or -1 (one group per row)")

    @property
    def row_bits(self) -> int:
        """Code width of embedding rows."""
        return self.embed_bits or self.bits

    @property
    def row_group(self) -> int:
        """Hidden columns per group of embedding rows (-1: whole row)."""
        return self.embed_group_size or self.group_size

    @property
    def sparse24(self) -> bool:
        return self.sparsity == "2:4"

    @property
    def additive(self) -> bool:
        """Whether stored linears are deltas on top of the base (False: SparseGPT's full weights)."""
        return self.method != "sparsegpt"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def compute_dtype(self, device: torch.device, stored: torch.dtype) -> torch.dtype:
        """Dtype of layer forwards: fp32 on CPU; the checkpoint's half dtype on CUDA unless told."""
        if DTYPES[self.dtype] is not None:
            return DTYPES[self.dtype]
        if device.type == "cuda" and stored in (torch.float16, torch.bfloat16):
            return stored
        return torch.float32

    def to_dict(self) -> dict:
        return asdict(self)
