"""Row-wise embedding deltas (artifact kind ``rows``, format version 2; docs/format.md).

An embedding delta ``Δ = E_ft - E_base`` of shape ``[R, C]`` (rows = vocabulary or positions,
columns = hidden) is stored row by row:

- ``changed`` uint8 ``[ceil(R / 8)]``: bit ``r % 8`` (least significant first) of byte ``r // 8`` is
  set when row ``r`` of the fine-tune is not bit-identical to the base's; unchanged rows cost nothing.
- for the ``n`` changed rows, in row order, the delta is quantized group-wise along the hidden
  dimension with ``bits``-bit codes and a float offset per group:
  ``qweight`` int32 ``[n, ceil(C / (32 // bits))]`` (codes packed like a packed linear's),
  ``scales`` float16 ``[n, G]`` and ``offsets`` float16 ``[n, G]``, ``G = C / group``.

Value of column ``c`` of a changed row: ``float32(offsets[g]) + float32(scales[g]) * code_c`` with
``g = c // group``. The encoder rounds the offset down and the scale up to float16, so that every
delta of the group lies in ``[offset, offset + scale * (2**bits - 1)]`` and no code is clamped: the
rounding error of every element is at most ``scale / 2`` of its group (``error_bound``), before the
final cast of ``base + Δ̂`` to the stored dtype.
"""

from __future__ import annotations

import torch

from deltazip.formats.codecs.base import Codec, Entry, dtype_name, register
from deltazip.formats.packing import pack_int32
from deltazip.kernels.packed import SUPPORTED_BITS
from deltazip.kernels.reference import unpack_int32

PARTS = ("changed", "qweight", "scales", "offsets")
# Deltas beyond float16's range cannot take a float16 offset; such a tensor is stored exactly instead.
MAX_ABS = 60000.0


def effective_group(cols: int, group: int) -> int:
    """The group size used for ``cols`` columns: ``group`` when it divides them, else the whole row."""
    return group if 0 < group <= cols and cols % group == 0 else cols


def changed_rows(base: torch.Tensor, ft: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]``: rows of ``ft`` whose raw bits differ from ``base``'s (both ``[R, C]``, same dtype)."""
    ib, jf = _as_int(base), _as_int(ft)
    return (ib != jf).any(dim=1)


def _as_int(t: torch.Tensor) -> torch.Tensor:
    dt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(dt)


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]`` -> uint8 ``[ceil(R / 8)]``, bit ``r % 8`` of byte ``r // 8``."""
    r = mask.numel()
    pad = torch.zeros((r + 7) // 8 * 8, dtype=torch.uint8)
    pad[:r] = mask.to(torch.uint8)
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (pad.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, rows: int) -> torch.Tensor:
    """uint8 ``[ceil(R / 8)]`` -> bool ``[R]``."""
    bits = (bitmap.to(torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32, device=bitmap.device)) & 1
    return bits.reshape(-1)[:rows].bool()


def _round_fp16(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> float16 rounded toward +inf (``up``) or -inf, so the float16 value bounds ``x``.

    Round-to-nearest is at most one float16 step off the directed rounding, so one ``nextafter``
    fixes the elements that landed on the wrong side.
    """
    h = x.to(torch.float16)
    wrong = h.float() < x if up else h.float() > x
    toward = torch.full_like(h, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(h, toward), h)


def quantize_rows(delta: torch.Tensor, changed: torch.Tensor, bits: int, group: int) -> dict[str, torch.Tensor]:
    """Encode the changed rows of an embedding delta.

    Args:
        delta: float32 ``[R, C]``, the exact ``E_ft - E_base`` (in float32).
        changed: bool ``[R]``, rows that are not bit-identical.
        bits: code width (2, 3, 4, 8).
        group: columns per group (must divide ``C``; see ``effective_group``).
    Returns:
        parts ``changed``, ``qweight``, ``scales``, ``offsets`` (shapes in the module docstring).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} not in {SUPPORTED_BITS}")
    r, c = delta.shape
    if c % group:
        raise ValueError(f"group {group} does not divide {c} columns")
    x = delta[changed].float()
    n, g = x.shape[0], c // group
    xg = x.reshape(n, g, group)
    lo, hi = xg.amin(dim=2), xg.amax(dim=2)
    qmax = 2**bits - 1
    off = _round_fp16(lo, up=False)
    # the smallest positive float16 keeps the scale usable for a constant group
    span = torch.clamp((hi - off.float()) / qmax, min=float(torch.finfo(torch.float16).tiny))
    scale = _round_fp16(span, up=True)
    codes = torch.round((xg - off.float().unsqueeze(2)) / scale.float().unsqueeze(2)).clamp_(0, qmax)
    return {"changed": pack_bitmap(changed), "qweight": pack_int32(codes.reshape(n, c).to(torch.int32), bits),
            "scales": scale, "offsets": off}


def dequantize_rows(parts: dict[str, torch.Tensor], shape: tuple[int, int], bits: int, group: int) -> torch.Tensor:
    """The float32 delta ``[R, C]`` an entry encodes (zero rows where unchanged)."""
    r, c = shape
    changed = unpack_bitmap(parts["changed"], r)
    n = int(changed.sum())
    dev = parts["qweight"].device
    out = torch.zeros(r, c, dtype=torch.float32, device=dev)
    if n:
        codes = unpack_int32(parts["qweight"], bits, c).float().reshape(n, c // group, group)
        vals = parts["offsets"].float().unsqueeze(2) + parts["scales"].float().unsqueeze(2) * codes
        out[changed.to(dev)] = vals.reshape(n, c)
    return out


def error_bound(parts: dict[str, torch.Tensor], shape: tuple[int, int], group: int) -> torch.Tensor:
    """float32 ``[R, C]``: the stated bound on ``|Δ̂ - Δ|`` per element (``scale / 2``; 0 on unchanged rows)."""
    r, c = shape
    changed = unpack_bitmap(parts["changed"], r)
    out = torch.zeros(r, c, dtype=torch.float32)
    if int(changed.sum()):
        half = (parts["scales"].float() / 2).repeat_interleave(group, dim=1)
        out[changed] = half
    return out


def layout_problems(entry: dict, parts: dict[str, torch.Tensor]) -> list[str]:
    """Shape/dtype problems of a ``rows`` entry's decoded parts (empty when sound)."""
    shape, bits, group = entry.get("shape"), entry.get("bits"), entry.get("group_size")
    if not (isinstance(shape, list) and len(shape) == 2 and bits in SUPPORTED_BITS and isinstance(group, int)
            and group > 0 and shape[1] % group == 0):
        return [f"rows entry with shape {shape}, bits {bits}, group_size {group}: expected [rows, cols], bits in "
                f"{SUPPORTED_BITS} and a group size dividing cols"]
    missing = [p for p in PARTS if p not in parts]
    if missing:
        return [f"rows entry without part {missing[0]!r}"]
    r, c = shape
    bm = parts["changed"]
    if bm.dtype != torch.uint8 or tuple(bm.shape) != ((r + 7) // 8,):
        return [f"changed is {bm.dtype} {list(bm.shape)}, want uint8 [{(r + 7) // 8}]"]
    if r % 8 and int(bm[-1]) >> (r % 8):
        return ["changed: bits set past the last row"]
    n = int(unpack_bitmap(bm, r).sum())
    per = 32 // bits
    want = {"qweight": ((n, (c + per - 1) // per), torch.int32), "scales": ((n, c // group), torch.float16),
            "offsets": ((n, c // group), torch.float16)}
    for p, (shp, dt) in want.items():
        t = parts[p]
        if tuple(t.shape) != shp or t.dtype != dt:
            return [f"{p} is {t.dtype} {list(t.shape)}, want {dt} {list(shp)} ({n} changed rows)"]
    for p in ("scales", "offsets"):
        if not bool(torch.isfinite(parts[p].float()).all()):
            return [f"{p}: not all finite"]
    return []


class RowsCodec(Codec):
    """Kind ``rows``: ``base + Δ̂`` with the embedding delta stored row by row (module docstring)."""

    kind = "rows"
    parts = PARTS
    relative_to_base = True

    def additive(self, entry: Entry) -> bool:
        return True

    def fields(self, shape: tuple[int, int], dtype: torch.dtype, bits: int, group_size: int, changed: int,
               max_abs_err: float) -> dict:
        """A new entry's fields; ``max_abs_err`` is the largest element error the encoder measured
        against the exact float32 delta."""
        return {"kind": self.kind, "shape": list(shape), "dtype": dtype_name(dtype), "bits": bits,
                "group_size": group_size, "changed_rows": changed, "max_abs_err": max_abs_err}

    def field_problems(self, name: str, raw) -> list[str]:
        return [f"tensor {name!r}: rows entry lacks integer {key!r}" for key in ("bits", "group_size")
                if not isinstance(raw.get(key), int)]

    def layout_problems(self, entry: Entry, parts) -> list[str]:
        return layout_problems(dict(entry.raw), parts)

    def reconstruct(self, src, entry: Entry, base: torch.Tensor | None, device) -> torch.Tensor:
        base = self.check_base(entry, base, entry.shape)
        delta = dequantize_rows(src.parts(entry.name, device), entry.shape, entry.raw["bits"], entry.raw["group_size"])
        return (base.float() + delta.to(base.device)).to(entry.dtype)


register(RowsCodec())
