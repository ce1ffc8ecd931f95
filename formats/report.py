"""What ``inspect`` and ``compress`` report about an artifact: sizes, ratios, errors."""

from __future__ import annotations

import math

import torch

from deltazip.formats.artifact import Artifact, parse_dtype


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def summarize(art: Artifact) -> dict:
    """Sizes by tensor kind, compression ratios and per-layer error of an artifact.

    ``ratio`` = bytes of the fine-tuned checkpoint in its stored dtype / bytes of the artifact
    directory (every file). ``linear_ratio`` = bytes of the compressed linears in the fine-tuned
    dtype / their stored bytes.
    """
    by_kind: dict[str, dict[str, int]] = {}
    lin_orig = lin_stored = 0
    for e in art.tensors.values():
        k = by_kind.setdefault(e["kind"], {"tensors": 0, "stored_bytes": 0, "original_bytes": 0})
        orig = _numel(e["shape"]) * torch.empty((), dtype=parse_dtype(e["dtype"])).element_size()
        k["tensors"] += 1
        k["stored_bytes"] += e.get("stored_bytes", 0)
        k["original_bytes"] += orig
        if e["kind"] == "packed":
            lin_orig += orig
            lin_stored += e["stored_bytes"]
    art_bytes = art.nbytes()
    ft_bytes = art.lineage.get("finetuned_bytes") or sum(k["original_bytes"] for k in by_kind.values())
    layers = art.manifest.get("layers") or []
    per_layer = []
    for L in layers:
        errs = [t.get("rel_out_err") for t in L.get("tensors", {}).values() if t.get("rel_out_err") is not None]
        werrs = [t["rel_weight_err"] for t in L.get("tensors", {}).values()]
        per_layer.append({"index": L["index"], "rel_out_err": L.get("rel_out_err"),
                          "rel_update_err": L.get("rel_update_err"),
                          "mean_linear_out_err": sum(errs) / len(errs) if errs else None,
                          "mean_linear_weight_err": sum(werrs) / len(werrs) if werrs else None})
    return {
        "artifact": str(art.path),
        "format_version": art.manifest["format_version"],
        "lineage": {k: art.lineage.get(k) for k in ("base", "finetuned", "base_fingerprint", "architectures")},
        "config": art.config,
        "calibration": art.manifest.get("calibration"),
        "finetuned_bytes": ft_bytes,
        "artifact_bytes": art_bytes,
        "ratio": ft_bytes / art_bytes if art_bytes else None,
        "linear_ratio": lin_orig / lin_stored if lin_stored else None,
        "by_kind": by_kind,
        "layers": per_layer,
        "stats": art.manifest.get("stats", {}),
    }


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
