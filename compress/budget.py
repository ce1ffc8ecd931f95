"""From measured curves to per-tensor settings: the byte budget of ``--target-ratio`` / ``--max-bytes``,
the allocation, what the manifest records of both, and the error-vs-size curve of ``--report``.

The budget is the whole artifact directory: ``finetuned_bytes / R`` (the ratio ``inspect`` reports,
against the fine-tune's stored dtype) or ``--max-bytes``. What every allocation stores anyway (exact
tensors, copied side files, the manifest's fixed fields and these records) is taken off first; the
curves share the rest (compress/allocation.py).
"""

from __future__ import annotations

import json

from deltazip.compress.allocation import (
    LINEAR_SETTINGS,
    AllocationError,
    Curve,
    Setting,
    allocate,
    uniform_choice,
)
from deltazip.compress.config import CompressConfig
from deltazip.compress.sensitivity import Sensitivity

CURVE_POINTS = 12
"""Budgets the error-vs-size curve is allocated at (spread evenly in ratio)."""


def budget_bytes(cfg: CompressConfig, finetuned_bytes: int) -> int:
    """The artifact's byte budget: ``--max-bytes``, or the fine-tuned checkpoint's bytes / ``--target-ratio``."""
    return cfg.max_bytes or int(finetuned_bytes / cfg.target_ratio)


def _json_len(obj) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def _drop_error(curves: list[Curve]) -> float:
    """Total error with every delta dropped: the scale ``relative_error`` divides by."""
    return sum(max(c.err) if c.index("drop") is None else c.err[c.index("drop")] for c in curves) or 1.0


def error_curve(sens: Sensitivity, points: int = CURVE_POINTS) -> dict:
    """The measured error-vs-size curve: allocations at ``points`` ratios, spaced geometrically from the
    largest artifact (every tensor at its least-error setting) to twice the smallest uniform setting's
    ratio (or the all-dropped artifact's, if smaller), and every uniform setting, each as
    ``{"ratio", "bytes", "relative_error"}`` (``relative_error``: total measured error / the error with
    every delta dropped; 0 = exact). Ratios count the fixed bytes (exact tensors, side files, manifest)
    as ``--target-ratio`` does."""
    curves, fixed, ft = sens.curves, sens.fixed_bytes, sens.finetuned_bytes
    scale = _drop_error(curves)
    uniform = []
    for s in LINEAR_SETTINGS:
        u = uniform_choice(curves, s)
        if u is not None:
            b = sum(c.bytes[u[c.name]] for c in curves) + fixed
            uniform.append({"setting": s.label, **_point(b, sum(c.err[u[c.name]] for c in curves), ft, scale)})
    lo = sum(min(c.bytes) for c in curves) + fixed
    hi = sum(c.bytes[min(range(len(c.err)), key=lambda i, c=c: (c.err[i], c.bytes[i]))] for c in curves) + fixed
    kept = [u["ratio"] for u in uniform if u["setting"] != "drop"]
    r0, r1 = ft / hi, min(ft / lo, 2 * max(kept, default=ft / lo))
    out = []
    for k in range(points):
        r = r0 * (r1 / r0) ** (k / max(points - 1, 1))
        a = allocate(curves, max(int(ft / r) - fixed, lo - fixed))
        out.append(_point(a.bytes + fixed, a.err, ft, scale))
    return {"probe_seconds": sens.seconds, "tokens": sens.tokens, "fixed_bytes": fixed, "points": out,
            "uniform": sorted(uniform, key=lambda p: p["bytes"])}


def _point(nbytes: int, err: float, ft: int, scale: float) -> dict:
    return {"ratio": round(ft / nbytes, 3), "bytes": int(nbytes), "relative_error": float(f"{err / scale:.4g}")}


def plan_settings(sens: Sensitivity, cfg: CompressConfig, extra_manifest: int) -> tuple[dict[str, Setting], dict]:
    """Allocate under the budget; returns ``(tensor name -> setting, the manifest's "allocation")``.

    Args:
        extra_manifest: bytes of other manifest fields written because of the probe (the curve).
    Raises:
        AllocationError: the budget is below the smallest settings (the message names the largest
            ratio reachable).
    """
    total = budget_bytes(cfg, sens.finetuned_bytes)
    record = {"target_ratio": cfg.target_ratio or None, "max_bytes": cfg.max_bytes or None, "budget_bytes": total,
              "fixed_bytes": sens.fixed_bytes, "settings": [s.label for s in LINEAR_SETTINGS],
              "tensors": {c.name: {**c.to_json(), "choice": "8-bit dense"} for c in sens.curves}}
    overhead = _json_len(record) + 100 + extra_manifest  # + planned bytes, errors and the key itself
    try:
        a = allocate(sens.curves, total - sens.fixed_bytes - overhead)
    except AllocationError:
        smallest = sum(min(c.bytes) for c in sens.curves) + sens.fixed_bytes + overhead
        what = f"--target-ratio {cfg.target_ratio:g}" if cfg.target_ratio else f"--max-bytes {cfg.max_bytes}"
        raise AllocationError(f"{what} asks for {total:,} bytes, but the smallest settings of every tensor take "
                              f"{smallest:,} ({sens.finetuned_bytes / smallest:.2f}x): ask for at most that ratio "
                              f"(or at least that many bytes)") from None
    plan = {c.name: a.setting(c) for c in sens.curves}
    for c in sens.curves:
        record["tensors"][c.name]["choice"] = plan[c.name].label
    record.update(planned_bytes=a.bytes + sens.fixed_bytes + overhead, measured_error=float(f"{a.err:.6g}"),
                  relative_error=float(f"{a.err / _drop_error(sens.curves):.4g}"), uniform_won=a.uniform_won)
    return plan, record
