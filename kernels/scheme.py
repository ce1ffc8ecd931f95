"""What a compressed linear delta is: a versioned scheme, validated once, written into the manifest.

A ``DeltaScheme`` names the manifest kind that stores the delta (``kind``, a codec of
``deltazip.formats.codecs``) and the grid the codes live on:

- ``bits``: code width;
- ``group_size``: input columns per quantization group (``-1``: one group per row); groups are
  counted in columns of the dense ``[out, in]`` matrix, so under 2:4 a group of ``g`` columns holds
  ``g / 2`` stored values;
- ``sparsity``: ``"2:4"`` (two of every four input columns kept, their positions stored) or ``"none"``;
- ``sym``: symmetric grid (zero point ``2**(bits - 1)``, none stored) or asymmetric (one integer zero
  point per group stored).

Which values are allowed depends on the kind: :func:`register_kind` states them (the packed kind's
are below; a new scheme's codec module registers its own on import). A scheme is immutable and every
check runs in ``__post_init__``, so code that holds one (``CompressConfig``, ``PackedDelta``,
``StackedDeltas``) never checks bits or groups again. Checks that need a matrix shape
(:meth:`DeltaScheme.shape_problem`) run where the shape is known.

On disk each entry of a scheme's kind carries ``scheme.to_json()`` (``{"version": 1, "kind": ...,
"bits": ..., "group_size": ..., "sparsity": ..., "sym": ...}``); format v1/v2 entries, written
before the field existed, map their loose ``bits``/``group_size``/``sparsity``/``sym`` fields to a
version-1 scheme (:meth:`DeltaScheme.from_json` reads both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

SPARSITIES = ("2:4", "none")


class SchemeError(ValueError):
    """A scheme field out of its allowed set; ``field`` names it (``"group_size"``), ``value`` shows
    it and ``reason`` completes the sentence ``f"{field} {value} {reason}"``."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} {value} {reason}")


@dataclass(frozen=True)
class KindRules:
    """What a kind allows: code widths, sparsities, and whether groups are whole rows only."""

    bits: tuple[int, ...]
    sparsities: tuple[str, ...] = SPARSITIES
    whole_rows_only: bool = False
    symmetric_only: bool = False


# The packed kind (deltazip.kernels.packed): 3-bit codes waste 2 bits of each int32 word but are kept
# for the paper's 3-bit results.
_KINDS: dict[str, KindRules] = {"packed": KindRules(bits=(2, 3, 4, 8))}


def register_kind(kind: str, rules: KindRules) -> None:
    """Allow schemes of manifest kind ``kind`` (a codec module calls this once, on import)."""
    if kind in _KINDS and _KINDS[kind] != rules:
        raise ValueError(f"scheme kind {kind!r} registered twice with different rules")
    _KINDS[kind] = rules


def kind_rules(kind: str) -> KindRules:
    if kind not in _KINDS:
        raise SchemeError("kind", repr(kind), f"is unknown; use one of {', '.join(sorted(_KINDS))}")
    return _KINDS[kind]


@dataclass(frozen=True)
class DeltaScheme:
    """Bits, groups, sparsity and symmetry of a compressed delta (module docstring); immutable.

    Raises:
        SchemeError: a field outside what ``kind`` allows.
    """

    VERSION: ClassVar[int] = 1

    bits: int = 4
    group_size: int = 128
    sparsity: str = "2:4"
    sym: bool = True
    kind: str = "packed"

    def __post_init__(self) -> None:
        rules = kind_rules(self.kind)
        if self.bits not in rules.bits:
            raise SchemeError("bits", self.bits, f"is not supported; use one of {', '.join(map(str, rules.bits))}")
        if self.sparsity not in rules.sparsities:
            raise SchemeError("sparsity", repr(self.sparsity), f"is not supported; use {' or '.join(rules.sparsities)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or \
                (self.group_size != -1 and self.group_size <= 0):
            raise SchemeError("group_size", self.group_size, "must be positive, or -1 for one group per row")
        if rules.whole_rows_only and self.group_size != -1:
            raise SchemeError("group_size", self.group_size, f"is not supported by {self.kind}; use -1 (one group per row)")
        if self.sparse and self.group_size != -1 and self.group_size % 4:
            raise SchemeError("group_size", self.group_size, "must be divisible by 4 with 2:4 sparsity")
        if not isinstance(self.sym, bool) or (rules.symmetric_only and not self.sym):
            raise SchemeError("sym", self.sym, f"is not supported by {self.kind}")

    # -- derived --------------------------------------------------------------------------------
    @property
    def sparse(self) -> bool:
        """True under 2:4 (kept values plus their positions are stored)."""
        return self.sparsity == "2:4"

    def effective_group(self, in_features: int) -> int:
        """Group size in input columns of a matrix with ``in_features`` columns (-1 resolved)."""
        return in_features if self.group_size == -1 else self.group_size

    def num_groups(self, in_features: int) -> int:
        return in_features // self.effective_group(in_features)

    def kept_per_row(self, in_features: int) -> int:
        """Stored values per row: ``in/2`` under 2:4, ``in`` when dense."""
        return in_features // 2 if self.sparse else in_features

    def shape_problem(self, in_features: int) -> str | None:
        """Why a matrix of ``in_features`` columns cannot take this scheme (None when it can)."""
        group = self.effective_group(in_features)
        if in_features % group:
            return f"in_features {in_features} not divisible by group size {group}"
        if self.sparse and in_features % 4:
            return f"2:4 needs in_features ({in_features}) and group size divisible by 4"
        return None

    def replace(self, **changes: Any) -> DeltaScheme:
        """A copy with ``changes`` (validated again)."""
        return DeltaScheme(**{**self.to_fields(), **changes})

    # -- manifest -------------------------------------------------------------------------------
    def to_fields(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "sparsity": self.sparsity, "sym": self.sym,
                "kind": self.kind}

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``scheme`` object of an entry."""
        return {"version": self.VERSION, **self.to_fields()}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> DeltaScheme:
        """The scheme of a manifest entry: its ``scheme`` object, or (format v1/v2, written before
        it) the entry's loose ``bits``, ``group_size``, ``sparsity`` and ``sym``.

        Raises:
            SchemeError: a newer scheme version, or fields outside what the kind allows.
        """
        s = entry.get("scheme")
        if s is None:
            return cls(bits=entry["bits"], group_size=entry["group_size"], sparsity=entry["sparsity"],
                       sym=bool(entry["sym"]), kind=entry["kind"])
        if not isinstance(s, dict) or s.get("version") != cls.VERSION:
            version = s.get("version") if isinstance(s, dict) else s
            raise SchemeError("scheme version", repr(version), f"is unknown to this deltazip (it reads {cls.VERSION}); "
                              "upgrade deltazip")
        return cls(**{k: s[k] for k in ("bits", "group_size", "sparsity", "sym", "kind")})


class SchemeFields:
    """The fields of the ``scheme: DeltaScheme`` a holder keeps (``CompressConfig``, ``PackedDelta``,
    ``StackedDeltas``), read through the holder: one definition instead of one per holder."""

    scheme: DeltaScheme

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
    def sparse(self) -> bool:
        """True when the delta is 2:4 sparse (kept values plus positions are stored)."""
        return self.scheme.sparse


class SchemeShaped(SchemeFields):
    """:class:`SchemeFields` plus the figures of a matrix of ``in_features`` columns under the scheme
    (``PackedDelta``, one delta; ``StackedDeltas``, many)."""

    in_features: int

    @property
    def kept_per_row(self) -> int:
        """Stored values per row: ``in/2`` under 2:4, ``in`` when dense."""
        return self.scheme.kept_per_row(self.in_features)

    @property
    def effective_group(self) -> int:
        """Group size in input columns (``-1`` resolved to the whole row)."""
        return self.scheme.effective_group(self.in_features)

    @property
    def num_groups(self) -> int:
        return self.scheme.num_groups(self.in_features)
