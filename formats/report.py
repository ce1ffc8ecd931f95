"""What ``inspect`` and ``compress`` report about an artifact: sizes, ratios, errors."""

from __future__ import annotations

import math

import torch

from deltazip.formats import codecs
from deltazip.formats.artifact import Artifact
from deltazip.formats.dtypes import parse_dtype
from deltazip.formats.units import human_bytes  # noqa: F401 - re-exported: callers import it from here
from deltazip.kernels.scheme import DeltaScheme


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def summarize(art: Artifact) -> dict:
    """Sizes by tensor kind, compression ratios and per-layer error of an artifact.

    ``ratio`` = bytes of the fine-tuned checkpoint in its stored dtype / bytes of the artifact
    directory (every file); ``finetuned_dtype`` names that dtype (the one holding most of the
    weights; ``finetuned_dtypes`` has the bytes of each when they are mixed). ``bits_per_weight`` =
    artifact bytes × 8 / weights of the fine-tune. ``linear_ratio`` = bytes of the compressed linears
    in the fine-tuned dtype / their stored bytes.

    ``by_kind[kind]`` (every kind the manifest holds, whatever it is): ``tensors``, ``weights``
    (elements), ``original_bytes`` (in the fine-tune's stored dtype), ``stored_bytes``,
    ``bits_per_weight`` (stored bytes × 8 / weights) and ``ratio`` (original / stored bytes; None
    when nothing is stored). ``side_files``: the config/tokenizer files, ``copied`` into the
    artifact (counted in ``artifact_bytes``) and ``referenced`` from the base (not stored), each
    ``{"files", "bytes"}``.
    """
    by_kind: dict[str, dict] = {}
    dtypes: dict[str, dict[str, int]] = {}
    lin_orig = lin_stored = 0
    linear_kinds = {k for k in codecs.kinds() if isinstance(codecs.get(k), codecs.MatrixCodec)}
    # Raw entries: the figures come from shape, dtype and stored_bytes, so a kind this version does
    # not know is summarized too.
    for e in art.tensors.values():
        k = by_kind.setdefault(e["kind"], {"tensors": 0, "weights": 0, "stored_bytes": 0, "original_bytes": 0})
        n = _numel(e["shape"])
        orig = n * torch.empty((), dtype=parse_dtype(e["dtype"])).element_size()
        k["tensors"] += 1
        k["weights"] += n
        k["stored_bytes"] += e.get("stored_bytes", 0)
        k["original_bytes"] += orig
        d = dtypes.setdefault(e["dtype"], {"weights": 0, "bytes": 0})
        d["weights"] += n
        d["bytes"] += orig
        if e["kind"] in linear_kinds:  # compressed linears, of any scheme
            lin_orig += orig
            lin_stored += e["stored_bytes"]
    for k in by_kind.values():
        k["bits_per_weight"] = k["stored_bytes"] * 8 / k["weights"] if k["weights"] else None
        k["ratio"] = k["original_bytes"] / k["stored_bytes"] if k["stored_bytes"] else None
    weights = sum(k["weights"] for k in by_kind.values())
    art_bytes = art.nbytes()
    ft_bytes = art.lineage.get("finetuned_bytes") or sum(k["original_bytes"] for k in by_kind.values())
    side: dict[str, dict[str, int]] = {"copied": {"files": 0, "bytes": 0}, "referenced": {"files": 0, "bytes": 0}}
    for info in art.side_files.values():
        bucket = side["referenced" if info["source"] == "base" else "copied"]
        bucket["files"] += 1
        bucket["bytes"] += info.get("bytes") or 0
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
        "finetuned_dtype": max(dtypes, key=lambda d: dtypes[d]["weights"]) if dtypes else None,
        "finetuned_dtypes": {d: v["bytes"] for d, v in sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])},
        "artifact_bytes": art_bytes,
        "ratio": ft_bytes / art_bytes if art_bytes else None,
        "bits_per_weight": art_bytes * 8 / weights if weights else None,
        "linear_ratio": lin_orig / lin_stored if lin_stored else None,
        "by_kind": by_kind,
        "side_files": side,
        "layers": per_layer,
        "stats": art.manifest.get("stats", {}),
        "groups": _groups(art),
        **_allocation(art),
        **({"sensitivity": art.manifest["sensitivity"]} if "sensitivity" in art.manifest else {}),
    }


def _linear_kinds() -> set[str]:
    return {k for k in codecs.kinds() if isinstance(codecs.get(k), codecs.MatrixCodec)}


def _groups(art: Artifact) -> dict[str, int]:
    """Compressed linears by group size (``"64": 120``; ``"-1"`` = one group per row)."""
    out: dict[str, int] = {}
    linear = _linear_kinds()
    for e in art.tensors.values():  # raw entries: a kind this version does not know is skipped
        if e.get("kind") in linear:
            try:
                key = str(DeltaScheme.from_json(e).group_size)
            except (KeyError, TypeError, ValueError):
                continue
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def tensor_setting(e: dict, linear: set[str] | None = None) -> tuple[str, int] | None:
    """``(label, code bits)`` of a compressed tensor's raw manifest entry (``"4-bit 2:4"``, ``"2-bit rows"``,
    ``"drop"`` with 0 bits); None for tensors stored exactly."""
    kind = e.get("kind")
    if kind in (_linear_kinds() if linear is None else linear):
        try:
            s = DeltaScheme.from_json(e)
        except (KeyError, TypeError, ValueError):  # a malformed entry: verify names it
            return None
        return f"{s.bits}-bit {'2:4' if s.sparse else 'dense'}", s.bits
    if kind == "rows" and isinstance(e.get("bits"), int):
        return f"{e['bits']}-bit rows", e["bits"]
    if kind == "drop":
        return "drop", 0
    return None


def _tensor_kind(name: str, layers_path: str | None) -> tuple[str, int | None]:
    """``("self_attn.q_proj", 3)`` for ``model.layers.3.self_attn.q_proj.weight``; outside the layers
    the name's last module (``("embed_tokens", None)``)."""
    stem = name.removesuffix(".weight")
    if layers_path and stem.startswith(layers_path + "."):
        idx, _, rest = stem[len(layers_path) + 1:].partition(".")
        if idx.isdigit():
            return rest, int(idx)
    return stem.rsplit(".", 1)[-1], None


def allocation_by_layer(art: Artifact) -> dict[str, dict[int, float]]:
    """``{tensor kind: {layer: code bits}}`` of an artifact whose tensors got different settings (empty
    otherwise): what ``inspect --plot`` draws."""
    if "allocation" not in _allocation(art):
        return {}
    out: dict[str, dict[int, float]] = {}
    linear = _linear_kinds()
    for name, e in art.tensors.items():
        got = tensor_setting(e, linear)
        kind, layer = _tensor_kind(name, art.lineage.get("layers_path"))
        if got is not None and layer is not None:
            out.setdefault(kind, {})[layer] = got[1]
    return out


def _allocation(art: Artifact) -> dict:
    """``{"allocation": ...}`` when tensors have different settings (``--target-ratio``), else ``{}``:
    ``by_kind`` (tensor kind -> tensors, weights, weight-averaged code bits ``mean_bits`` and the count of
    each setting), ``by_layer`` (layer -> ``mean_bits`` and each kind's setting) and the manifest's
    record (budget, planned bytes, measured error)."""
    layers_path = art.lineage.get("layers_path")
    by_kind: dict[str, dict] = {}
    by_layer: dict[int, dict] = {}
    labels = set()
    linear = _linear_kinds()
    for name, e in art.tensors.items():
        got = tensor_setting(e, linear)
        if got is None:
            continue
        label, bits = got
        labels.add(label)
        kind, layer = _tensor_kind(name, layers_path)
        for bucket in [by_kind.setdefault(kind, {"tensors": 0, "weights": 0, "bit_weights": 0, "settings": {}})] + \
                ([by_layer.setdefault(layer, {"weights": 0, "bit_weights": 0, "settings": {}})] if layer is not None
                 else []):
            bucket["weights"] += _numel(e["shape"])
            bucket["bit_weights"] += _numel(e["shape"]) * bits
        k = by_kind[kind]
        k["tensors"] += 1
        k["settings"][label] = k["settings"].get(label, 0) + 1
        if layer is not None:
            by_layer[layer]["settings"][kind] = label
    record = art.manifest.get("allocation")
    if record is None and len({lab for lab in labels if not lab.endswith(" rows")}) <= 1 and "drop" not in labels:
        return {}  # one setting for every linear (the embeddings' row width is an option of its own)
    for b in [*by_kind.values(), *by_layer.values()]:
        b["mean_bits"] = round(b.pop("bit_weights") / b["weights"], 3) if b["weights"] else None
    out = {"by_kind": by_kind, "by_layer": [{"index": i, **by_layer[i]} for i in sorted(by_layer)]}
    if record is not None:
        out["record"] = {k: v for k, v in record.items() if k != "tensors"}
    return {"allocation": out}


