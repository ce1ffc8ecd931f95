"""Checkpoint tensor names -> module parameter names, by transformers' own loading rules.

Artifacts name tensors as the checkpoint does; the decoupled model needs module parameter names.
They differ where transformers renames keys at load time: GPT-NeoX checkpoints store the output
projection as ``embed_out.weight`` and the module is ``lm_head``; checkpoints saved from a base
model (no ``model.`` prefix) load into a ``…ForCausalLM``. The rules are transformers': the
architecture's weight conversion mapping (``conversion_mapping.get_model_conversion_mapping``,
transformers 5) with its ``base_model_prefix`` handling, or the class's
``_checkpoint_conversion_mapping`` regex table (transformers 4.x). No per-architecture table here.

Only one-to-one renames are mapped. A key transformers loads through a converter (several tensors
fused into one parameter, one split into several) has no single parameter; it is left out and the
caller decides (the decoupled runtime refuses it by name).
"""

from __future__ import annotations

import re

from torch import nn


def module_names(model: nn.Module, names: list[str], buffers: bool = False) -> dict[str, str]:
    """``checkpoint name -> parameter name`` for every name of ``names`` that transformers would load
    into exactly one parameter of ``model`` by renaming (identity included).

    Args:
        model: the loaded transformers model (its classes pick the conversion rules).
        names: checkpoint tensor names.
        buffers: buffers count as parameters (a router's ``e_score_correction_bias``, which some
            checkpoints hold under another name).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    if buffers:
        params.update(model.named_buffers(remove_duplicate=False))
    out = {n: n for n in names if n in params}
    rest = [n for n in names if n not in out]
    if not rest:
        return out
    try:
        renamed = _renamed_v5(model, rest, params)
    except ImportError:  # transformers 4.x: a regex table on the class
        renamed = _renamed_v4(model, rest, params)
    out.update({k: v for k, v in renamed.items() if v in params})
    return out


def _renamed_v5(model: nn.Module, names: list[str], params: dict) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", "") or None
    state = model.state_dict()
    out = {}
    for n in names:
        key, via = rename_source_key(n, renamings, converters, prefix, state)
        if via is None:  # a plain rename, not a converter's many-to-one / one-to-many op
            out[n] = key
    return out


def _renamed_v4(model: nn.Module, names: list[str], params: dict) -> dict[str, str]:
    table = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    out = {}
    for n in names:
        key = n
        for pattern, repl in table.items():
            key, hits = re.subn(pattern, repl, key)
            if hits:
                break
        if key not in params and prefix and f"{prefix}.{key}" in params:
            key = f"{prefix}.{key}"
        elif key not in params and prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in params:
            key = key[len(prefix) + 1:]
        out[n] = key
    return out


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that hold one tensor (tied embeddings, Zamba2's shared blocks)."""
    by_obj: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_obj.setdefault(id(p), []).append(n)
    return [v for v in by_obj.values() if len(v) > 1]
