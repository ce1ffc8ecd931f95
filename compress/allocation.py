"""Per-tensor settings under a byte budget, from measured error-vs-bytes curves (``--target-ratio``).

The sensitivity probe (compress/sensitivity.py) gives every compressed tensor a :class:`Curve`: for
each candidate :class:`Setting` the bytes it would store and the output error it would cause on the
calibration data. :func:`allocate` picks one setting per tensor so that the sum of errors is as small
as it can make it while the bytes stay within a budget:

1. the budget must hold every tensor's smallest setting (else :class:`AllocationError`);
2. an exact dynamic program over the tensors with byte costs rounded up to ``budget / B`` units
   (``B`` = 200 per tensor, at most ``DP_UNITS``: the rounding costs at most 0.5% of the budget);
   above ``DP_CELLS`` cells (thousands of experts) greedy over each curve's lower convex hull instead
   (the Lagrangian solution for every multiplier on the way: the step with the largest error drop
   per byte that still fits is taken until none fits);
3. the slack left is filled by single moves (any setting of one tensor that fits and lowers the
   total error), repeated until none helps;
4. every uniform assignment (one setting for all linears, the matching row width for embeddings)
   that fits is compared, and the allocation is never worse than the best of them.

Nothing here needs torch: curves are plain numbers (and JSON in the manifest's ``allocation``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from deltazip.formats.errors import InputError


class AllocationError(InputError):
    """The budget is below what the smallest settings take (the message names the reachable ratio)."""


class Setting(NamedTuple):
    """One candidate: ``bits`` of the codes (0: the delta is dropped, the tensor stays the base's) and
    ``sparsity`` (``"2:4"``/``"none"`` for a linear, ``"rows"`` for an embedding's changed rows)."""

    bits: int
    sparsity: str

    @property
    def dropped(self) -> bool:
        return self.bits == 0

    @property
    def label(self) -> str:
        if self.dropped:
            return "drop"
        return f"{self.bits}-bit {'dense' if self.sparsity == 'none' else self.sparsity}"

    @classmethod
    def parse(cls, label: str) -> Setting:
        """Inverse of :attr:`label` with the curve's kind (``"4-bit 2:4"``, ``"2-bit rows"``, ``"drop"``)."""
        if label == "drop":
            return cls(0, "none")
        bits, what = label.split("-bit ")
        return cls(int(bits), "none" if what == "dense" else what)


LINEAR_BITS = (2, 3, 4, 8)
DROP = Setting(0, "none")
LINEAR_SETTINGS = (DROP, *(Setting(b, s) for b in LINEAR_BITS for s in ("2:4", "none")))
"""Candidates of a packed tensor (linears, lm_head, experts): dropped, or bits × {2:4, dense}."""
ROW_SETTINGS = (DROP, *(Setting(b, "rows") for b in LINEAR_BITS))
"""Candidates of an embedding: dropped, or the code width of its changed rows."""


@dataclass
class Curve:
    """Measured cost of each candidate setting of one tensor.

    Attributes:
        name: checkpoint tensor name.
        kind: ``"linear"`` (a packed entry) or ``"rows"`` (an embedding).
        settings: the candidates, in the order of ``bytes`` and ``err``.
        bytes: stored bytes of each (after the lossless stage, estimated from its parts).
        err: output error of each on the calibration data, ``tr(E H Eᵀ)`` summed over the tensor's
            matrices (``H = 2XᵀX/n``): the squared output error per token, times 2.
        weights: elements of the tensor.
        layer: decoder layer index, or None (embeddings, lm_head).
    """

    name: str
    kind: str
    settings: list[Setting]
    bytes: list[int]
    err: list[float]
    weights: int
    layer: int | None = None

    def index(self, label: str) -> int | None:
        return next((i for i, s in enumerate(self.settings) if s.label == label), None)

    def to_json(self) -> dict:
        return {"kind": self.kind, "layer": self.layer, "weights": self.weights, "bytes": self.bytes,
                "err": [float(f"{e:.5g}") for e in self.err]}


@dataclass
class Allocation:
    """One setting per tensor (``choice``: name -> index into its curve) and what it costs."""

    choice: dict[str, int]
    bytes: int
    err: float
    budget: int
    uniform_won: str | None = None

    def setting(self, curve: Curve) -> Setting:
        return curve.settings[self.choice[curve.name]]


def _hull(c: Curve) -> list[int]:
    """Indices of the lower convex hull of ``(bytes, err)``, by increasing bytes and decreasing error."""
    order = sorted(range(len(c.bytes)), key=lambda i: (c.bytes[i], c.err[i]))
    front: list[int] = []
    for i in order:  # Pareto front: strictly less error for more bytes
        if not front or c.err[i] < c.err[front[-1]]:
            if front and c.bytes[i] == c.bytes[front[-1]]:
                front.pop()
            front.append(i)
    hull: list[int] = []
    for i in front:
        while len(hull) >= 2 and _slope(c, hull[-2], hull[-1]) >= _slope(c, hull[-1], i):
            hull.pop()  # the middle point lies on or above the chord: never the best step
        hull.append(i)
    return hull


def _slope(c: Curve, a: int, b: int) -> float:
    """Error change per byte from setting ``a`` to ``b`` (negative: b is better)."""
    return (c.err[b] - c.err[a]) / max(c.bytes[b] - c.bytes[a], 1)


def _total(curves: list[Curve], choice: dict[str, int]) -> tuple[int, float]:
    return (sum(c.bytes[choice[c.name]] for c in curves), sum(c.err[choice[c.name]] for c in curves))


def _greedy(curves: list[Curve], budget: int) -> dict[str, int]:
    """Steps 1-2 of the module docstring: hull steps by error drop per byte while they fit."""
    hulls = {c.name: _hull(c) for c in curves}
    pos = {c.name: 0 for c in curves}
    choice = {c.name: hulls[c.name][0] for c in curves}
    used, _ = _total(curves, choice)
    by_name = {c.name: c for c in curves}
    heap = [(_slope(c, hulls[c.name][0], hulls[c.name][1]), c.name) for c in curves if len(hulls[c.name]) > 1]
    heapq.heapify(heap)
    while heap:
        slope, name = heapq.heappop(heap)
        c, h, k = by_name[name], hulls[name], pos[name]
        extra = c.bytes[h[k + 1]] - c.bytes[h[k]]
        if used + extra > budget:
            continue  # this tensor's next step does not fit; smaller steps of others may
        used += extra
        pos[name] = k + 1
        choice[name] = h[k + 1]
        if k + 2 < len(h):
            heapq.heappush(heap, (_slope(c, h[k + 1], h[k + 2]), name))
    return choice


DP_UNITS = 50_000
DP_CELLS = 50_000_000


def _dp(curves: list[Curve], budget: int) -> dict[str, int] | None:
    """Step 2: the least-error choice with costs rounded up to ``budget / units`` (so it fits the real
    budget); None when the table would exceed ``DP_CELLS``."""
    units = min(200 * len(curves), DP_UNITS)
    if units * len(curves) > DP_CELLS or budget <= 0:
        return None
    unit = budget / units
    best = np.zeros(units + 1)
    back = np.zeros((len(curves), units + 1), dtype=np.uint8)
    for t, c in enumerate(curves):
        cand = np.full((len(c.bytes), units + 1), np.inf)
        for i, (b, e) in enumerate(zip(c.bytes, c.err)):
            w = int(np.ceil(b / unit - 1e-9))
            if w <= units:
                cand[i, w:] = best[:units + 1 - w] + e
        back[t] = cand.argmin(axis=0)
        best = cand[back[t], np.arange(units + 1)]
    if not np.isfinite(best[units]):
        return None
    choice, rest = {}, units
    for t in range(len(curves) - 1, -1, -1):
        c, i = curves[t], int(back[t, rest])
        choice[c.name] = i
        rest -= int(np.ceil(c.bytes[i] / unit - 1e-9))
    return choice


def _fill(curves: list[Curve], choice: dict[str, int], budget: int) -> dict[str, int]:
    """Step 3: single moves (any setting of one tensor) that fit the slack and lower the error most."""
    used, _ = _total(curves, choice)
    while True:
        best = None
        for c in curves:
            cur = choice[c.name]
            for i in range(len(c.bytes)):
                gain = c.err[cur] - c.err[i]
                if gain > 0 and used - c.bytes[cur] + c.bytes[i] <= budget and (best is None or gain > best[0]):
                    best = (gain, c, i)
        if best is None:
            return choice
        _, c, i = best
        used += c.bytes[i] - c.bytes[choice[c.name]]
        choice[c.name] = i


def uniform_choice(curves: list[Curve], linear: Setting) -> dict[str, int] | None:
    """Every linear at ``linear``, every embedding at the same code width (rows); None when a curve
    lacks the setting."""
    choice = {}
    for c in curves:
        want = linear if c.kind == "linear" else (DROP if linear.dropped else Setting(linear.bits, "rows"))
        i = c.index(want.label)
        if i is None:
            return None
        choice[c.name] = i
    return choice


def allocate(curves: list[Curve], budget: int) -> Allocation:
    """Settings of least total measured error whose bytes sum to at most ``budget`` (module docstring).

    Args:
        curves: one per compressed tensor.
        budget: bytes the curves' settings may take together (the artifact's budget less what is
            stored regardless: exact tensors, side files, manifest).
    Raises:
        AllocationError: even the smallest setting of every tensor exceeds ``budget``.
    """
    smallest = sum(min(c.bytes) for c in curves)
    if smallest > budget:
        raise AllocationError(f"the smallest settings take {smallest:,} bytes, over the {budget:,} the budget leaves")
    choice = _fill(curves, _greedy(curves, budget), budget)
    exact = _dp(curves, budget)
    if exact is not None:
        exact = _fill(curves, exact, budget)
        if _total(curves, exact)[1] < _total(curves, choice)[1]:
            choice = exact
    used, err = _total(curves, choice)
    won = None
    for s in LINEAR_SETTINGS:
        u = uniform_choice(curves, s)
        if u is None:
            continue
        ub, ue = _total(curves, u)
        if ub <= budget and ue < err:
            choice, used, err, won = u, ub, ue, s.label
    return Allocation(choice, used, err, budget, uniform_won=won)
