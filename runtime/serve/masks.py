"""Attention masks of one serving step, for every attention variant the engine serves.

The engine runs transformers' own model classes over a batch whose rows have different pasts; the
step's cache object lays every row's keys out in one padded ``[B, H, L, D]`` tensor and says where
each key sits in its sequence (``key_positions``: ``[B, L]`` int64, ``-1`` where a slot holds no key
of that row) and where each query sits (``query_positions``: ``[B, Tm]``; a padding query gets its
row's first new position, so that it sees at least that token and no softmax row is empty). From
these two tensors this module builds what the model's ``attention_mask`` argument must be:

- ``full_attention`` layers: a query sees every key of its row at a position ``<=`` its own;
- ``sliding_attention`` layers (Gemma 2/3, Mistral-style windows): additionally only keys with
  ``query - key < sliding_window`` (transformers' ``sliding_window_overlay``);
- ``chunked_attention`` layers (Llama 4's local layers): additionally only keys of the query's own
  chunk, ``key // attention_chunk_size == query // attention_chunk_size`` (transformers' ``chunked_overlay``);
- models with several layer types get a dict keyed by layer type, which Gemma 2/3 (and other
  hybrid models of transformers 5) take in place of building their own masks;
- ALiBi models whose bias is computed inside the model from a 2-D padding mask (Falcon with
  ``alibi=True``, BLOOM, MPT) get that 2-D mask (``[B, L]``, 1 where a key exists); transformers then
  builds the causal mask itself, asking the cache for ``get_query_offset`` / ``get_mask_sizes``.
  This needs a layout in which each row's keys are contiguous and in position order, ending at the
  last new token (the layout of ``deltazip.runtime.serve.engine.StepKV``); MPT's bias depends on the
  key's index in that tensor, which that layout makes a per-row constant shift of its position.

4-D masks are boolean (True = attend) for SDPA and custom attention functions, and additive float
(0 or the dtype's minimum) for eager attention, which adds the mask to the scores.
"""

from __future__ import annotations

import torch

from deltazip.models.loader import text_config
from deltazip.runtime.serve.recurrent_state import RECURRENT_LAYER_TYPES

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
MLP_LAYER_TYPES = ("moe", "mlp")  # Nemotron-H's layers that are an MLP alone: no attention, no state


def layer_types(config) -> list[str]:
    """The attention type of every layer: the config's ``layer_types`` when it has them, else all
    ``sliding_attention`` for a model with one global window (Mistral-style), else all full."""
    config = text_config(config)
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return [SLIDING] * n
    return [FULL] * n


def unsupported_layer_types(config) -> list[str]:
    """Layer types the engine serves no way (state-space and other hybrid layers, ...): attention ones
    get masks here, recurrent ones (linear attention, short convolutions) a per-sequence state
    (``deltazip.runtime.serve.recurrent_state``) and a 2-D padding mask, and hybrid ones both."""
    return sorted(set(layer_types(config)) - {FULL, SLIDING, CHUNKED, *RECURRENT_LAYER_TYPES, *MLP_LAYER_TYPES})


def attention_chunk(module) -> int | None:
    """``attention_chunk_size`` when ``module`` (an attention module with ``config`` and ``layer_idx``)
    is a ``chunked_attention`` layer, else None. transformers says so only through the mask it builds,
    which the paged attention does not read."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and types and isinstance(idx, int) and 0 <= idx < len(types) and types[idx] == CHUNKED:
        return int(chunk)
    return None


def allowed_keys(k: torch.Tensor, q: torch.Tensor, window: int | None = None,
                 chunk: int | None = None, see: torch.Tensor | None = None) -> torch.Tensor:
    """Bool, True where a query at position ``q`` sees the key at position ``k`` (broadcast; ``k < 0``:
    no key): causal (up to ``see`` where given: an image's tokens that see their whole image), within a
    sliding ``window``, within the query's ``chunk``."""
    ok = (k >= 0) & (k <= (q if see is None else see))
    if window:
        ok &= k > q - window
    if chunk:
        ok &= torch.div(k, chunk, rounding_mode="floor") == torch.div(q, chunk, rounding_mode="floor")
    return ok


def uses_padding_mask_bias(config) -> bool:
    """True for models that derive an ALiBi bias from the 2-D padding mask inside their forward."""
    config = text_config(config)
    kind = getattr(config, "model_type", "")
    return kind in ("bloom", "mpt") or (kind == "falcon" and bool(getattr(config, "alibi", False)))


def attention_implementation(model_class, config) -> str:
    """The attention implementation to load a model with: SDPA where the class supports it and the
    model does not soft-cap attention scores (SDPA cannot), else eager (transformers' reference
    code, which applies soft-capping)."""
    if getattr(text_config(config), "attn_logit_softcapping", None) is not None:
        return "eager"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def attention_masks_for(config, key_pos: torch.Tensor, query_pos: torch.Tensor, dtype: torch.dtype):
    """The ``attention_mask`` argument of one forward.

    Args:
        config: the model config (``_attn_implementation``, ``layer_types``, ``sliding_window``, ...).
        key_pos: int64 ``[B, L]``, the position of each key slot in its row's sequence, ``-1`` if empty.
        query_pos: int64 ``[B, Tm]``, the position of each query.
        dtype: the model's compute dtype (additive masks of eager attention are in it).

    Returns:
        ``[B, L]`` int64 for ALiBi-from-padding-mask models; else a ``[B, 1, Tm, L]`` mask, or for
        models with several layer types a dict ``{layer type: [B, 1, Tm, L] mask}``.
    """
    if uses_padding_mask_bias(config):
        return (key_pos >= 0).long()
    config = text_config(config)
    k = key_pos.unsqueeze(1)  # [B, 1, L]
    q = query_pos.unsqueeze(2)  # [B, Tm, 1]
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    masks = {}
    for kind in dict.fromkeys(layer_types(config)):
        allowed = allowed_keys(k, q, window if kind == SLIDING else None, chunk if kind == CHUNKED else None)
        masks[kind] = _as_mask(allowed.unsqueeze(1), config, dtype)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def _as_mask(allowed: torch.Tensor, config, dtype: torch.dtype) -> torch.Tensor:
    if getattr(config, "_attn_implementation", None) == "eager":
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)
    return allowed
