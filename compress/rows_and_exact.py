"""Storing the tensors that are not compressed linears: embeddings row by row, everything else exactly.

- ``record_embedding``: an embedding matrix ``[rows, hidden]`` (token, position or scaled embedding)
  becomes a ``rows`` entry: unchanged rows cost a bit each, changed rows are group-quantized along
  the hidden dimension with the error bound of ``deltazip.formats.codecs.rows`` (scale / 2 per element).
- ``record_exact``: norms, biases and anything left are stored bit-exactly in their own dtype, in
  the smallest of: nothing (``same``), the XOR of their raw bits with the base's (``xor``), a float16
  delta that rebuilds them bit for bit (``dense_delta``), or the tensor itself (``full``). Sizes are
  measured after the lossless stage, so with ``--lossless gdeflate`` the mostly-zero XOR usually wins
  and without it ``full`` does (an XOR stored raw is as large as the tensor).
"""

from __future__ import annotations

import torch

from deltazip.formats import codecs
from deltazip.formats.artifact import ArtifactWriter
from deltazip.formats.codecs.rows import (
    MAX_ABS,
    changed_rows,
    dequantize_rows,
    effective_group,
    quantize_rows,
)
from deltazip.formats.codecs.xor import bitwise_equal, xor_delta

# Order breaks ties between equal sizes: prefer what needs no base, then the simpler rebuild.
_EXACT_ORDER = ("full", "dense_delta", "xor")


def new_stats() -> dict:
    """Counters of non-linear tensors by kind, kept in the manifest's ``stats.other_tensors``."""
    return {"same": 0, "xor": 0, "dense_delta": 0, "full": 0, "rows": 0, "alias": 0, "rows_changed": 0,
            "rows_total": 0, "rows_max_abs_err": 0.0}


def exact_candidates(b: torch.Tensor, f: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Every exact encoding of ``f`` relative to ``b`` that applies (kind -> parts)."""
    out = {"full": {"data": f}}
    if b.dtype == f.dtype and b.shape == f.shape:
        out["xor"] = {"xor": xor_delta(b, f)}
    if f.is_floating_point() and b.is_floating_point() and b.shape == f.shape:
        d16 = (f.float() - b.float()).half()
        if bool(torch.isfinite(d16).all()) and bitwise_equal((b.float() + d16.float()).to(f.dtype), f):
            out["dense_delta"] = {"delta": d16}
    return out


def _smallest(writer: ArtifactWriter, cands: dict[str, dict[str, torch.Tensor]]) -> tuple[str, int]:
    sizes = {k: writer.stored_size(p) for k, p in cands.items()}
    kind = min(sizes, key=lambda k: (sizes[k], _EXACT_ORDER.index(k)))
    return kind, sizes[kind]


def exact_stored_size(writer: ArtifactWriter, name: str, b: torch.Tensor, f: torch.Tensor) -> int:
    """Bytes ``record_exact`` would add to the artifact for ``f`` (its smallest exact form, manifest entry
    included; ``same`` costs its entry only)."""
    if bitwise_equal(b, f):
        return writer.entry_size(name, codecs.get("same").fields(tuple(f.shape), f.dtype), {})
    cands = exact_candidates(b, f)
    kind, _ = _smallest(writer, cands)
    fields = {"full": lambda: codecs.get("full").fields(f), "xor": lambda: codecs.get("xor").fields(f.shape, f.dtype),
              "dense_delta": lambda: codecs.get("dense_delta").fields(cands[kind].get("delta"), f.dtype)}[kind]()
    return writer.entry_size(name, fields, cands[kind])


def _write_exact(writer: ArtifactWriter, name: str, kind: str, parts: dict[str, torch.Tensor],
                 f: torch.Tensor) -> None:
    if kind == "full":
        writer.add_full(name, f)
    elif kind == "xor":
        writer.add_xor(name, parts["xor"], f.dtype)
    else:
        writer.add_dense_delta(name, parts["delta"], f.dtype)


def record_exact(writer: ArtifactWriter, name: str, b: torch.Tensor, f: torch.Tensor, stats: dict) -> torch.Tensor:
    """Store ``f`` exactly in its smallest form; returns its reconstruction (``f`` itself)."""
    if bitwise_equal(b, f):
        writer.add_same(name, tuple(f.shape), f.dtype)
        stats["same"] += 1
        return f
    cands = exact_candidates(b, f)
    kind, _ = _smallest(writer, cands)
    _write_exact(writer, name, kind, cands[kind], f)
    stats[kind] += 1
    return f


def record_embedding(writer: ArtifactWriter, name: str, b: torch.Tensor, f: torch.Tensor, bits: int, group: int,
                     stats: dict) -> torch.Tensor:
    """Store an embedding ``[rows, hidden]`` row by row; returns its reconstruction in ``f``'s dtype.

    Falls back to an exact kind when the XOR of the raw bits is no larger after the lossless stage
    (few or tiny changes, e.g. rounding flips from weight decay alone), or when the delta does not
    fit a float16 offset. Only the XOR is probed among the exact kinds: it is the one that wins for
    sparse changes, and probing every candidate of a vocabulary-sized matrix held several hundred MB
    more at the peak of a compression.
    """
    if bitwise_equal(b, f):
        return record_exact(writer, name, b, f, stats)
    if f.dim() != 2 or b.shape != f.shape or b.dtype != f.dtype:
        return record_exact(writer, name, b, f, stats)
    delta = f.float() - b.float()
    if not bool(torch.isfinite(delta).all()) or float(delta.abs().max()) > MAX_ABS:
        return record_exact(writer, name, b, f, stats)
    changed = changed_rows(b, f)
    g = effective_group(f.shape[1], group)
    parts = quantize_rows(delta, changed, bits, g)
    xor = {"xor": xor_delta(b, f)}
    if writer.stored_size(xor) <= writer.stored_size(parts):
        _write_exact(writer, name, "xor", xor, f)
        stats["xor"] += 1
        return f
    del xor
    dh = dequantize_rows(parts, tuple(f.shape), bits, g)
    err = float((dh - delta).abs().max())
    del delta
    writer.add_rows(name, parts, tuple(f.shape), f.dtype, bits, g, err)
    stats["rows"] += 1
    stats["rows_changed"] += int(changed.sum())
    stats["rows_total"] += f.shape[0]
    stats["rows_max_abs_err"] = max(stats["rows_max_abs_err"], err)
    return dh.add_(b.float()).to(f.dtype)


def embedding_weight_names(model: torch.nn.Module) -> set[str]:
    """Checkpoint-style names of every ``nn.Embedding`` weight (subclasses too: scaled or learned-position
    embeddings store the same kind of matrix)."""
    return {f"{n}.weight" if n else "weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
