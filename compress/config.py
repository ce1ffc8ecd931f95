"""Configuration of one compression run, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from deltazip.formats import codecs
from deltazip.formats.errors import InputError
from deltazip.kernels.packed import SUPPORTED_BITS
from deltazip.kernels.scheme import DeltaScheme, SchemeError, SchemeFields
from deltazip.models.devices import check_device, check_dtype, resolve_device, resolve_dtype

METHODS = ("deltazip", "sparsegpt", "rtn")
_NEWER = ("group_auto", "target_ratio", "max_bytes", "report")
CALIB_ACTIVATIONS = ("reconstructed", "base")


@dataclass
class CompressConfig(SchemeFields):
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

    ``group_auto`` (``--group-size auto``): ``scheme.group_size`` is resolved per model, to the largest
    of :data:`AUTO_GROUPS` that divides every compressed input dimension, or per tensor when none
    does (:func:`auto_group`); the manifest records the group each entry got.

    ``target_ratio`` / ``max_bytes`` (``--target-ratio R`` / ``--max-bytes B``): instead of one
    scheme for every linear, each compressed tensor gets the setting (bits, 2:4 or dense, or its delta
    dropped; row bits for embeddings) that keeps the total measured error lowest within the byte
    budget (the fine-tuned checkpoint's bytes / R, or B): compress/sensitivity.py measures,
    compress/allocation.py chooses. ``report``: measure the error-vs-size curve (and return it) even
    for a uniform run.
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
    group_auto: bool = False
    target_ratio: float = 0.0
    max_bytes: int = 0
    report: bool = False

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
        self._check_budget()

    def _check_budget(self) -> None:
        if self.target_ratio and self.max_bytes:
            raise InputError("--target-ratio and --max-bytes both set a budget; pass one of them")
        if self.target_ratio and not self.target_ratio > 1:
            raise InputError(f"--target-ratio {self.target_ratio} must be above 1 (fine-tuned bytes / artifact bytes)")
        if self.max_bytes < 0:
            raise InputError(f"--max-bytes {self.max_bytes} must be positive")
        if self.measures and (self.method != "deltazip" or self.scheme.kind != "packed"):
            what = "--target-ratio/--max-bytes" if self.allocates else "--report"
            raise InputError(f"{what} measures the OBS solver's error per setting: use it with --method deltazip "
                             "and --scheme packed")

    @property
    def allocates(self) -> bool:
        """Settings are chosen per tensor under a byte budget (``--target-ratio`` or ``--max-bytes``)."""
        return bool(self.target_ratio or self.max_bytes)

    @property
    def measures(self) -> bool:
        """The sensitivity probe runs before compressing (an allocation, or ``--report``)."""
        return self.allocates or self.report

    @property
    def row_bits(self) -> int:
        """Code width of embedding rows: ``embed_bits``, else ``bits`` when rows take that width (a
        scheme of other widths, such as 1-bit signs, leaves embeddings at 4 bits)."""
        return self.embed_bits or (self.bits if self.bits in SUPPORTED_BITS else 4)

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
        (``scheme_kind`` only for a kind other than ``packed``), then every other option (those of
        --group-size auto and --target-ratio only when set)."""
        s = self.scheme
        out = {"bits": s.bits, "sparsity": s.sparsity, "group_size": s.group_size, "sym": s.sym}
        if s.kind != "packed":
            out["scheme_kind"] = s.kind
        # Options newer than format v2 are written only when set, so that a run that does not use them
        # writes the manifest it wrote before them.
        return out | {f.name: getattr(self, f.name) for f in fields(self)
                      if f.name != "scheme" and not (f.name in _NEWER and not getattr(self, f.name))}

    @classmethod
    def from_dict(cls, d: dict) -> CompressConfig:
        """Inverse of :meth:`to_dict` (a manifest's ``config``, or a v1 one without the newer options)."""
        scheme = scheme_from_options(d["bits"], d["sparsity"], d["group_size"], d["sym"], d.get("scheme_kind", "packed"))
        rest = {f.name: d[f.name] for f in fields(cls) if f.name != "scheme" and f.name in d}
        return cls(scheme=scheme, **rest)


_FLAGS = {"bits": "--bits", "group_size": "--group-size", "sparsity": "--sparsity", "sym": "--sym",
          "kind": "--scheme"}


AUTO_GROUPS = (128, 64, 32)
"""``--group-size auto`` picks the largest of these that divides the input dimensions."""


def auto_group(dims) -> int:
    """The largest of :data:`AUTO_GROUPS` dividing every one of ``dims`` (input dimensions), or -1 (one
    group per row) when none divides them all."""
    return next((g for g in AUTO_GROUPS if all(d % g == 0 for d in dims)), -1)


def parse_group_size(value: str | int) -> tuple[int, bool]:
    """``--group-size`` as ``(group, auto)``: ``"auto"`` -> ``(128, True)`` (resolved per model later),
    an integer -> ``(it, False)``.

    Raises:
        InputError: neither an integer nor ``auto``.
    """
    if str(value).strip().lower() == "auto":
        return 128, True
    try:
        return int(value), False
    except ValueError:
        raise InputError(f"--group-size {value!r} is not a number: pass auto, a positive size or -1") from None


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
