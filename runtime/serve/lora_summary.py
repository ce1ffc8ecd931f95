"""What a PEFT adapter holds, for ``deltazip inspect``: its settings, what it trains, and whether the
server would serve it (on a given base, checked as the server checks it).

Without a base the summary comes from ``adapter_config.json`` and the safetensors header alone (no
tensor is read): the adapted modules by name, their ranks as stored, DoRA magnitudes, LoRA biases,
whole tensors (``modules_to_save`` copies, trained biases) and trained token rows. With a base, the
adapter is read as the server reads it (:func:`~deltazip.runtime.serve.lora_variant.read_lora_spec`
on the base's skeleton, no weights loaded): what each tensor lands on, the rows a tied weight takes,
and the one-line reason when the server would refuse it.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

from deltazip.formats.errors import InputError
from deltazip.runtime.serve.lora_tokens import token_module
from deltazip.runtime.serve.lora_variant import (
    _BASE_LAYER,
    _PREFIX,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    _factor,
    _refusal,
    check_lora_base,
    linear_shapes,
    lora_base,
    read_adapter_config,
    read_lora_spec,
)

_SETTINGS = ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "use_rslora", "use_dora", "lora_bias",
             "bias", "target_modules", "target_parameters", "modules_to_save", "trainable_token_indices",
             "token_indices", "layer_replication", "rank_pattern", "alpha_pattern")


def is_adapter(path: Path) -> bool:
    """Whether ``path`` is a PEFT adapter directory (it holds ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def summarize_adapter(path: Path, base: str | None = None) -> dict[str, Any]:
    """The summary of adapter directory ``path`` (JSON-ready); with ``base`` (a local model directory
    or hub id), also ``on_base``: how the server reads it on that base, or why it refuses it.

    Raises:
        InputError: an unreadable config or weights file, or a base that cannot be read.
    """
    from deltazip.formats.safetensors_raw import read_table

    path = Path(path)
    cfg = read_adapter_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"adapter {path}: {ADAPTER_WEIGHTS} is missing")
    entries, _ = read_table(weights)
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    tokens: dict[str, int] = {}
    whole: list[str] = []
    for key, e in entries.items():
        name = key.removeprefix(_PREFIX)
        if (m := token_module(name)) is not None:
            tokens[m] = int(e.shape[0])
        elif (f := _factor(name)) is not None:
            factors.setdefault(f[0], {})[f[1]] = tuple(e.shape)
        else:
            whole.append(_BASE_LAYER.sub("", name))
    leaf = collections.Counter(_BASE_LAYER.sub("", m).rsplit(".", 1)[-1] for m in factors)
    out: dict[str, Any] = {
        "path": str(path),
        "config": {k: cfg[k] for k in _SETTINGS if cfg.get(k) not in (None, [], {}, "")},
        "adapted_modules": len(factors),
        "adapted_by_name": dict(sorted(leaf.items())),
        "ranks_stored": sorted({s["A"][0] for s in factors.values() if "A" in s}),
        "dora_magnitudes": sum("M" in s for s in factors.values()),
        "lora_biases": sum("b" in s for s in factors.values()),
        "whole_tensors": sorted(whole),
        "token_rows": dict(sorted(tokens.items())),
        "factor_weights": sum(math.prod(s[p]) for s in factors.values() for p in ("A", "B") if p in s),
        "bytes_on_disk": sum(p.stat().st_size for p in (path / ADAPTER_CONFIG, weights)),
        "refused": _refusal(path, cfg),
    }
    if base is not None:
        out["on_base"] = _on_base(path, cfg, base)
    return out


def _on_base(path: Path, cfg: dict[str, Any], base: str) -> dict[str, Any]:
    """How the server reads the adapter on ``base`` (its skeleton, no weights), or why it refuses it."""
    import torch

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.models.model_walk import empty_model
    from deltazip.models.param_names import module_names

    ck = Checkpoint(base, "base")
    model = empty_model(ck.path, torch.float32)
    model.tie_weights()  # (as loading does: the server reads ties from the loaded model)
    got: dict[str, Any] = {"base": str(ck.path), "architecture": type(model).__name__}
    try:
        check_lora_base(path, cfg.get("base_model_name_or_path"), ck.path, ck.fingerprint)
        spec = read_lora_spec(path, linear_shapes(model), type(model).__name__,
                              lambda names: module_names(model, names), lora_base(model))
    except InputError as e:
        return {**got, "serves": False, "why": str(e)}
    return {**got, "serves": True, "why": None,
            "linears": len(spec.modules),
            "experts_params": {n: {"experts": x.experts, "rank": x.rank} for n, x in sorted(spec.params.items())},
            "saved": sorted(spec.saved),
            "token_rows": {m: {"rows": len(r.indices), "from": r.source} for m, r in sorted(spec.tokens.items())}}
