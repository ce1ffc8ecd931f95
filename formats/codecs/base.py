"""The codec contract, the registry keyed by manifest kind, and typed manifest entries.

A codec owns one manifest ``kind``: the parts it stores (names, dtypes, shapes), the manifest fields
of its entries, the checks ``verify`` runs on its decoded parts, and how the fine-tuned tensor is
rebuilt from them. ``verify``, ``merge``, ``inspect`` and ``serve`` reach a kind only through
:func:`get`; a new kind is one module in this package that calls :func:`register` on import (every
module here is imported on the registry's first use, so nothing else names it).

:class:`MatrixCodec` is the base of the compressed-linear kinds (``packed``, and any new scheme):
their entries carry a ``DeltaScheme``, an orientation (``transposed`` Conv1D, fused ``experts``) and
``additive``, and the codec gives the dense delta through its reference dequant.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from deltazip.formats.dtypes import dtype_name, parse_dtype
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.kernels.scheme import DeltaScheme, SchemeError

_REGISTRY: dict[str, Codec] = {}
_DISCOVERED = False
_DISCOVERING = False
# The first use may come from several threads at once (an artifact writer's or a server's loader pool):
# the others wait until every codec has registered instead of reading a half-filled registry.
_DISCOVER_LOCK = threading.RLock()


def register(codec: Codec) -> Codec:
    """Make ``codec`` the one for ``codec.kind`` (a codec module calls this once, on import)."""
    if codec.kind in _REGISTRY and type(_REGISTRY[codec.kind]) is not type(codec):
        raise ValueError(f"manifest kind {codec.kind!r} registered twice ({type(_REGISTRY[codec.kind]).__name__}, "
                         f"{type(codec).__name__})")
    _REGISTRY[codec.kind] = codec
    return codec


def _discover() -> None:
    """Import every module of this package: each registers its codec. Returns once all have, whichever
    thread imports them; a codec module that reaches the registry while being imported (the importing
    thread, re-entering) sees what has registered so far."""
    global _DISCOVERED, _DISCOVERING
    if _DISCOVERED:
        return
    with _DISCOVER_LOCK:
        if _DISCOVERED or _DISCOVERING:
            return
        _DISCOVERING = True
        try:
            pkg = __name__.rpartition(".")[0]
            for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
                if info.name not in ("base", "__init__"):
                    importlib.import_module(f"{pkg}.{info.name}")
            _DISCOVERED = True
        finally:
            _DISCOVERING = False


def get(kind: str) -> Codec:
    """The codec of manifest (or variant) kind ``kind``.

    Raises:
        ArtifactError: no codec of that kind (a newer deltazip wrote it).
    """
    _discover()
    if kind not in _REGISTRY:
        raise ArtifactError(f"unknown kind {kind!r}; this deltazip knows {', '.join(kinds())} (upgrade deltazip)")
    return _REGISTRY[kind]


def kinds(manifest_only: bool = True) -> tuple[str, ...]:
    """Registered kinds (those a manifest may hold; with ``manifest_only=False`` variant kinds too)."""
    _discover()
    return tuple(k for k, c in _REGISTRY.items() if not (manifest_only and c.variant_only))


def codec_file(kind: str) -> Path:
    """The module that defines ``kind``'s codec (the file a new scheme adds)."""
    import sys

    return Path(sys.modules[type(get(kind)).__module__].__file__)


def entries(tensors: Mapping[str, Mapping[str, Any]]) -> dict[str, Entry]:
    """Typed entries of a manifest's ``tensors``."""
    return {name: Entry(name, e) for name, e in tensors.items()}


@dataclass(frozen=True)
class Entry:
    """One manifest tensor entry, read through its codec (the runtime never indexes the dict).

    Attributes:
        name: the tensor's checkpoint name.
        raw: the manifest entry as stored.
    """

    name: str
    raw: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return self.raw["kind"]

    @property
    def codec(self) -> Codec:
        return get(self.kind)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw["shape"])

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.raw["dtype"])

    @property
    def scheme(self) -> DeltaScheme | None:
        """The entry's delta scheme (a compressed linear), None for kinds without one."""
        return self.codec.scheme(self)

    @property
    def additive(self) -> bool:
        """The stored data is a delta added to the base tensor of the same name."""
        return self.codec.additive(self)

    @property
    def needs_base(self) -> bool:
        """Rebuilding the tensor reads the base tensor of its name (``alias``: of ``of``, which the
        writer only emits when the base's two tensors are bit-identical too)."""
        return self.codec.needs_base(self)

    @property
    def stores_bytes(self) -> bool:
        return self.codec.stores_bytes

    @property
    def equals_base(self) -> bool:
        """The tensor is rebuilt as the base's (``same``: exactly; ``drop``: its delta left out)."""
        return self.codec.equals_base

    @property
    def kernel_ready(self) -> bool:
        """A compressed linear whose parts the SBMM kernels read as they are (kind ``packed``)."""
        return bool(self.codec.layouts)

    @property
    def is_matrix(self) -> bool:
        """A compressed linear of any scheme (its rows are a linear weight's or its delta's)."""
        return isinstance(self.codec, MatrixCodec)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the checkpoint tensor the entry rebuilds."""
        return tuple(self.codec.stored_shape(self))

    @property
    def transposed(self) -> bool:
        return bool(self.raw.get("transposed"))

    @property
    def experts(self) -> int:
        return int(self.raw.get("experts") or 0)

    @property
    def of(self) -> str | None:
        return self.raw.get("of")

    @property
    def stored_bytes(self) -> int:
        return int(self.raw.get("stored_bytes", 0))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)


def part_problem(entry: Entry, parts: Mapping[str, torch.Tensor], part: str, shape, dtype: torch.dtype) -> str | None:
    """Why part ``part`` of ``entry`` is missing or not ``dtype`` ``shape`` (None when it is)."""
    t = parts.get(part)
    if t is None:
        return f"{entry.kind} entry without a {part!r} part"
    if list(t.shape) != list(shape) or t.dtype != dtype:
        return f"{part} is {dtype_name(t.dtype)} {list(t.shape)}, the entry says {dtype_name(dtype)} {list(shape)}"
    return None


class Codec(ABC):
    """How one manifest kind is stored, checked and rebuilt (module docstring).

    Class attributes:
        kind: the manifest's ``kind`` string.
        parts: the part names an entry may store, in the order they are written.
        stores_bytes: False for kinds that store nothing (``same``, ``alias``).
        relative_to_base: rebuilding reads the base tensor of the entry's name.
        variant_only: a kind of served variant, never a manifest entry (LoRA adapters).
        layouts: the stack layouts the kind offers to ``deltazip.kernels.dispatch`` (``packed``);
            empty for kinds no kernel reads (served as dense tensors).
        equals_base: the rebuilt tensor is the base tensor itself (``same``, ``drop``): a served
            variant adds nothing for it.
    """

    kind: ClassVar[str]
    parts: ClassVar[tuple[str, ...]] = ()
    stores_bytes: ClassVar[bool] = True
    relative_to_base: ClassVar[bool] = False
    variant_only: ClassVar[bool] = False
    layouts: ClassVar[tuple[str, ...]] = ()
    equals_base: ClassVar[bool] = False

    def scheme(self, entry: Entry) -> DeltaScheme | None:
        return None

    def additive(self, entry: Entry) -> bool:
        return False

    def needs_base(self, entry: Entry) -> bool:
        return self.relative_to_base

    def stored_shape(self, entry: Entry) -> list[int]:
        return list(entry.shape)

    def field_problems(self, name: str, raw: Mapping[str, Any]) -> list[str]:
        """Problems of the kind's own manifest fields (common fields are checked by the reader)."""
        return []

    def manifest_problems(self, entry: Entry, tensors: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Problems that need the other entries (an alias's target)."""
        return []

    def layout_problems(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> list[str]:
        """Shape/dtype/packing problems of an entry's decoded parts (empty when sound)."""
        return []

    @abstractmethod
    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        """The fine-tuned tensor as the compressor produced it, in its stored dtype.

        Args:
            src: the artifact reader (``parts(name, device)``, ``reconstruct(name, base)``).
            entry: this kind's entry.
            base: the base tensor of the entry's name when :meth:`needs_base`, else None.
            device: where the result goes.
        """

    @staticmethod
    def check_base(entry: Entry, base: torch.Tensor | None, shape) -> torch.Tensor:
        """``base``, checked to be there and of the checkpoint shape ``shape``."""
        if base is None:
            raise ArtifactError(f"tensor {entry.name!r} is stored relative to the base, but no base tensor was given")
        if list(base.shape) != list(shape):
            raise InputError(f"base tensor {entry.name} has shape {list(base.shape)}, the artifact expects "
                             f"{list(shape)}: wrong base model?")
        return base


class MatrixCodec(Codec):
    """A compressed linear delta (``[out, in]``, a Conv1D's ``[in, out]``, or fused ``[E, out, in]``).

    Entries carry ``scheme`` (a ``DeltaScheme`` of this kind), ``additive`` (``base + delta``; False:
    the stored matrix is the weight itself, SparseGPT on full weights), ``transposed`` (the checkpoint
    stores ``[in, out]``; ``shape`` stays ``[out, in]``) and ``experts`` (E; ``shape`` ``[E, out, in]``,
    the experts' rows stacked ``[E*out, in]`` in the parts).

    Subclasses give :meth:`dense` (the reference dequant of the parts to ``[rows, in]`` fp32) and, for
    a scheme that needs no solver, :meth:`encode`.
    """

    def scheme(self, entry: Entry) -> DeltaScheme:
        try:
            return DeltaScheme.from_json(entry.raw)
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"tensor {entry.name!r}: {self.kind} entry without its scheme fields ({e})") from e
        except SchemeError as e:
            raise ArtifactError(f"tensor {entry.name!r}: {e}") from e

    def additive(self, entry: Entry) -> bool:
        return bool(entry.raw.get("additive"))

    def needs_base(self, entry: Entry) -> bool:
        return self.additive(entry)

    @staticmethod
    def rows(entry: Entry) -> tuple[int, int]:
        """``(rows, in_features)`` of the parts: ``[out, in]``, or fused experts' rows stacked ``[E*out, in]``."""
        shape = entry.shape
        return math.prod(shape[:-1]), shape[-1]

    def stored_shape(self, entry: Entry) -> list[int]:
        shape = list(entry.shape)
        if entry.transposed:
            shape[-2], shape[-1] = shape[-1], shape[-2]
        return shape

    @staticmethod
    def to_stored(entry: Entry, dense: torch.Tensor) -> torch.Tensor:
        """A dense ``[rows, in]`` matrix in the checkpoint's layout: reshaped to ``shape`` (``[E, out, in]``
        for experts), then transposed when ``transposed``."""
        t = dense.reshape(entry.shape)
        return t.transpose(-1, -2).contiguous() if entry.transposed else t

    def fields(self, scheme: DeltaScheme, shape: list[int], dtype: torch.dtype, additive: bool,
               transposed: bool = False, experts: int = 0) -> dict[str, Any]:
        """The manifest fields of a new entry (before its storage fields)."""
        entry: dict[str, Any] = {"kind": self.kind, "shape": shape, "dtype": dtype_name(dtype), "additive": additive}
        if transposed:
            entry["transposed"] = True
        if experts:
            entry["experts"] = experts
        entry["scheme"] = scheme.to_json()
        return entry

    def field_problems(self, name: str, raw: Mapping[str, Any]) -> list[str]:
        out = [] if "additive" in raw else [f"tensor {name!r}: {self.kind} entry lacks 'additive'"]
        try:
            s = DeltaScheme.from_json(raw)
            if s.kind != self.kind:
                out.append(f"tensor {name!r}: a {self.kind} entry with a scheme of kind {s.kind!r}")
        except KeyError as e:
            out.append(f"tensor {name!r}: {self.kind} entry lacks {e.args[0]!r}")
        except (SchemeError, TypeError) as e:
            out.append(f"tensor {name!r}: {e}")
        return out + self._orientation_problems(name, raw)

    @staticmethod
    def _orientation_problems(name: str, raw: Mapping[str, Any]) -> list[str]:
        """``transposed`` (bool) and ``experts`` (E, with ``shape`` ``[E, out, in]``; without it ``[out, in]``)."""
        if "transposed" in raw and not isinstance(raw["transposed"], bool):
            return [f"tensor {name!r}: 'transposed' must be true or false"]
        shape, experts = raw.get("shape"), raw.get("experts")
        if not isinstance(shape, list):
            return []  # reported with the common fields
        if experts is None:
            return [] if len(shape) == 2 else [f"tensor {name!r}: {raw['kind']} entry with shape {shape}, expected "
                                               "[out, in] (or [E, out, in] with 'experts')"]
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1 or len(shape) != 3 \
                or shape[0] != experts:
            return [f"tensor {name!r}: 'experts' {experts!r} does not match shape {shape} (expected [E, out, in])"]
        return []

    @abstractmethod
    def dense(self, entry: Entry, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The dense fp32 ``[rows, in]`` matrix the parts stand for (the kind's reference dequant)."""

    encode = None
    """Optional: ``encode(rows [R, in] fp32, scheme) -> (parts, values)`` compresses a matrix without a
    solver (``values``: the fp32 matrix the parts stand for). Kinds solved by ``deltazip.compress``
    (``packed``: OBS/RTN) leave it None."""

    @property
    def solver_free(self) -> bool:
        return self.encode is not None

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        delta = self.to_stored(entry, self.dense(entry, src.parts(entry.name, device)))
        if not self.additive(entry):
            return delta.to(entry.dtype)
        base = self.check_base(entry, base, self.stored_shape(entry))
        return (base.float() + delta.to(base.device)).to(entry.dtype)
