"""Configuration of one compression run, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from deltazip.formats import codecs
from deltazip.formats.errors import InputError
from deltazip.kernels.packed import SUPPORTED_BITS
from deltazip.kernels.scheme import DeltaScheme, SchemeError
from deltazip.models.devices import check_device, check_dtype, resolve_device, resolve_dtype

METHODS = ("deltazip", "sparsegpt", "rtn")
CALIB_ACTIVATIONS = ("reconstructed", "base")


@dataclass
class CompressConfig:
    """Options of ``deltazip compress`` (see docs/compress.md).

    ``scheme``: what every compressed linear becomes (bits, group size, sparsity, symmetry and the
    manifest kind that stores it; validated when it is built, see :func:`scheme_from_options`).
    ``bits``, ``group_size``, ``sparsity``, ``sym`` and ``sparse24`` read it.

    ``embed_bits`` / ``embed_group_size``: code width and hidden columns per group of the row-wise
    embedding deltas (0 = the same as ``bits`` / ``group_size``, see :attr:`row_bits`; a group that
    does not divide the hidden size becomes the whole row).

    ``calib_activations``: "reconstructed" (ΔCompress: every layer is calibrated on the inputs that
    the base + compressed-delta model produces) or "base" (ablation: the base model's own
    activations, which the paper shows to be worse).
    """

    scheme: DeltaScheme = field(default_factory=DeltaScheme)
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
        if not isinstance(self.scheme, DeltaScheme):
            raise InputError(f"scheme must be a DeltaScheme, got {type(self.scheme).__name__}")
        if self.method not in METHODS:
            raise InputError(f"--method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        if self.nsamples < 1 or self.seqlen < 2:
            raise InputError("--nsamples must be >= 1 and --seqlen >= 2")
        if not 0 < self.damp < 1:
            raise InputError(f"--damp {self.damp} must lie in (0, 1)")
        check_device(self.device)
        check_dtype(self.dtype)
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
        """Code width of embedding rows: ``embed_bits``, else ``bits`` when rows take that width (a
        scheme of other widths, such as 1-bit signs, leaves embeddings at 4 bits)."""
        return self.embed_bits or (self.bits if self.bits in SUPPORTED_BITS else 4)

    @property
    def row_group(self) -> int:
        """Hidden columns per group of embedding rows (-1: whole row)."""
        return self.embed_group_size or self.group_size

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def sparsity(self) -> str:
        return self.scheme.sparsity

    @property
    def sym(self) -> bool:
        return self.scheme.sym

    @property
    def sparse24(self) -> bool:
        return self.scheme.sparse

    @property
    def additive(self) -> bool:
        """Whether stored linears are deltas on top of the base (False: SparseGPT's full weights)."""
        return self.method != "sparsegpt"

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def compute_dtype(self, device: torch.device, stored: torch.dtype) -> torch.dtype:
        """Dtype of layer forwards: fp32 on CPU; the checkpoint's half dtype on CUDA unless told
        (``deltazip.models.devices``)."""
        return resolve_dtype(self.dtype, device, stored, serving=False)

    def to_dict(self) -> dict:
        """The manifest's ``config``: the scheme's grid first, flat, as before the scheme existed
        (``scheme_kind`` only for a kind other than ``packed``), then every other option."""
        s = self.scheme
        out = {"bits": s.bits, "sparsity": s.sparsity, "group_size": s.group_size, "sym": s.sym}
        if s.kind != "packed":
            out["scheme_kind"] = s.kind
        return out | {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scheme"}

    @classmethod
    def from_dict(cls, d: dict) -> CompressConfig:
        """Inverse of :meth:`to_dict` (a manifest's ``config``, or a v1 one without the newer options)."""
        scheme = scheme_from_options(d["bits"], d["sparsity"], d["group_size"], d["sym"], d.get("scheme_kind", "packed"))
        rest = {f.name: d[f.name] for f in fields(cls) if f.name != "scheme" and f.name in d}
        return cls(scheme=scheme, **rest)


_FLAGS = {"bits": "--bits", "group_size": "--group-size", "sparsity": "--sparsity", "sym": "--sym",
          "kind": "--scheme"}


def scheme_from_options(bits: int, sparsity: str, group_size: int, sym: bool, kind: str = "packed") -> DeltaScheme:
    """The scheme ``deltazip compress`` options name.

    Raises:
        InputError: naming the option that is out of range (``--group-size 6 must be divisible by 4
            with 2:4 sparsity``).
    """
    # Looking the kinds up registers their rules (the codec modules of deltazip.formats.codecs).
    linear = [k for k in codecs.kinds() if isinstance(codecs.get(k), codecs.MatrixCodec)]
    if kind not in linear:
        raise InputError(f"--scheme {kind!r} is unknown; use one of {', '.join(linear)}")
    try:
        return DeltaScheme(bits=bits, group_size=group_size, sparsity=sparsity, sym=sym, kind=kind)
    except SchemeError as e:
        raise InputError(f"{_FLAGS.get(e.field, e.field)} {e.value} {e.reason}") from e
