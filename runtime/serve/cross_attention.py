"""Images read by cross-attention layers (Mllama, Llama 3.2 Vision), as the engine serves them.

Mllama's language model does not take image features in place of tokens: a few of its decoder
layers (``cross_attention_layers``) attend from the text to the projected vision states of the
prompt's images, through their own key and value projections. transformers' ``generate`` computes
those keys and values once, in the prompt's forward, and keeps them in its cache for every later
step; each text token sees the tiles of the images that came before it, as the processor's
``cross_attention_mask`` says, and the tokens generated see what the prompt's last token sees.

The engine does the same per sequence:

- :func:`read_cross` (from ``prompt_media.read_prompt``, with the request's variant bound, so a
  variant that changed the vision tower, projector or cross-attention projections reads the images
  with its own weights) runs each cross-attention module's own forward once on the vision states
  and keeps the keys and values it computes (:class:`CrossInputs`), ``[H_kv, N, D]`` per layer for
  ``N`` vision tokens, with each prompt token's view of them.
- :func:`cross_step` makes a step's view of its rows' keys and values: per cross-attention layer
  ``[B, H_kv, N_max, D]`` (zeros past a row's ``N`` and for rows without images), handed to the
  model as its cache's ``layers`` (where transformers reads cached cross-attention states), and the
  masks the model's own forward would make, ``cross_attention_mask`` ``[B, 1, Tm, N_max]`` and
  ``full_text_row_masked_out_mask`` ``[B, 1, Tm, 1]``, handed to the language model.

A row without images in a step with image rows passes the cross-attention layers unchanged, as when
the model skips them: its values are zeros, so its attention output is zero, and its MLP output is
masked out.

The cost: every step that holds image rows copies their keys and values into the step's padded
tensors, about twice the bytes the attention reads (at 11B, about 210 MB per image and sequence in
bf16: 8 layers, 4 tiles of 1,601 tokens, 8 key-value heads of 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltazip.models.image_inputs import cross_attention_layers, language_model_of

# What a language model with cross-attention layers is handed from the images (MllamaTextModel).
CROSS_ARGS = frozenset({"cross_attention_states", "cross_attention_mask", "full_text_row_masked_out_mask"})


@dataclass
class CrossInputs:
    """One sequence's images as its cross-attention layers read them.

    Attributes:
        layers: the cross-attention layers' indices.
        keys, values: per layer ``[H_kv, N, D]`` (model dtype, on its device).
        views: bool ``[U, N + 1]``: the distinct views of prompt tokens, the vision tokens a token sees
            and, last, whether its row is kept (False before the first image, where the model masks
            the layer's MLP output out and its attention sees every vision token).
        view_of: int64 ``[T]``: each prompt token's view; a token past the prompt takes the last one.
        states: the vision states ``[N, H]`` the keys and values were made from, kept only for
            ``--tensor-parallel`` (each rank makes its own heads' keys from them), else None.
    """

    layers: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    views: torch.Tensor
    view_of: torch.Tensor
    states: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.keys[0].shape[1]

    def decoding(self) -> CrossInputs:
        """What the generated tokens need: the last prompt token's view."""
        last = int(self.view_of[-1])
        return CrossInputs(self.layers, self.keys, self.values, self.views[last:last + 1],
                           torch.zeros(1, dtype=torch.long), self.states)

    def to(self, device) -> CrossInputs:
        """The same keys and values on ``device``."""
        return CrossInputs(self.layers, [k.to(device) for k in self.keys], [v.to(device) for v in self.values],
                           self.views, self.view_of, self.states)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class _KeysMade(Exception):
    """Raised by :class:`_Capture` once the module has made its keys and values."""


class _Capture:
    """The cache a cross-attention module's forward writes its keys and values to. It stops the
    forward there: the rest (the attention, ``o_proj``, whose tensor-parallel all-reduce every rank
    would have to join) is not needed."""

    def __init__(self):
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        self.kv = (keys, values)
        raise _KeysMade


def cross_keys(model: nn.Module, states: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per cross-attention layer, the keys and values ``[H_kv, N, D]`` of vision states ``[1, N, H]``
    (or their rows ``[B·images·tiles, P, H]``), made by each layer's own projections and norms (the
    request's variant bound by the caller; under tensor parallelism, this rank's heads)."""
    lm = language_model_of(model)
    keys, values = [], []
    with torch.inference_mode():
        for i in cross_attention_layers(model.config):
            attn = lm.layers[i].cross_attn
            cap = _Capture()
            # The module's own projections and norms make the keys and values; one query is enough.
            try:
                attn(hidden_states=states.new_zeros(1, 1, states.shape[-1]), cross_attention_states=states,
                     cache=cap, attention_mask=None)
            except _KeysMade:
                pass
            if cap.kv is None:
                raise ValueError(f"{type(attn).__name__} did not hand its keys and values to the cache")
            keys.append(cap.kv[0][0].clone())
            values.append(cap.kv[1][0].clone())
    return keys, values


def read_cross(model: nn.Module, seen: dict, keep_states: bool = False) -> CrossInputs:
    """The keys and values of a prompt's images in every cross-attention layer, and each prompt
    token's view of them, from what ``model``'s forward handed its language model (``seen``:
    ``cross_attention_states [1, N, H]``, ``cross_attention_mask [1, 1, T, N]`` additive,
    ``full_text_row_masked_out_mask [1, 1, T, 1]``); ``keep_states``: keep the vision states too."""
    states = seen["cross_attention_states"]
    layers = cross_attention_layers(model.config)
    keys, values = cross_keys(model, states)
    with torch.inference_mode():
        mask, kept = seen["cross_attention_mask"], seen["full_text_row_masked_out_mask"]
        n = keys[0].shape[1]
        if mask is None or kept is None or mask.shape[-1] != n:
            raise ValueError("the model's cross-attention mask does not cover its vision tokens")
        per_token = torch.cat([mask[0, 0] == 0, kept[0, 0] > 0], dim=-1).cpu()  # [T, N + 1]
        views, view_of = torch.unique(per_token, dim=0, return_inverse=True)
        flat = states.reshape(1, -1, states.shape[-1]).clone() if keep_states else None
    return CrossInputs(layers, keys, values, views, view_of, flat)


class CrossLayer:
    """A cross-attention layer's cached keys and values as transformers reads them from a cache
    (``cache.layers[i].keys``), for a step's rows: ``[B, H_kv, N_max, D]``."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.keys, self.values = keys, values
        self.is_initialized = keys is not None


@dataclass
class CrossStep:
    """A step's cross-attention inputs (module docstring): ``layers`` for the cache, the masks for
    the language model (:meth:`language_model_args`)."""

    layers: list[CrossLayer]
    mask: torch.Tensor  # [B, 1, Tm, N_max], additive, model dtype
    kept: torch.Tensor  # [B, 1, Tm, 1], model dtype
    rows: list[CrossInputs | None]  # per batch row (the tensor-parallel leader ships their states)

    @property
    def layer_ids(self) -> frozenset[int]:
        """The layers whose attention reads these keys (the paged attention leaves them dense)."""
        return frozenset(i for i, layer in enumerate(self.layers) if layer.is_initialized)

    def language_model_args(self) -> dict:
        return {"cross_attention_mask": self.mask, "full_text_row_masked_out_mask": self.kept}


def cross_step(inputs: list, past: list[int], new: list[int], tm: int) -> CrossStep | None:
    """The :class:`CrossStep` of a step whose row ``b`` has ``past[b]`` cached tokens and ``new[b]``
    new ones (right-aligned in ``tm``); ``inputs``: per row its ``PromptInputs`` or None. None when no
    row has images read by cross-attention."""
    rows = [(b, x.cross) for b, x in enumerate(inputs) if x is not None and x.cross is not None]
    if not rows:
        return None
    first = rows[0][1]
    n_max = max(c.tokens for _, c in rows)
    k0 = first.keys[0]
    big = len(inputs)
    mask = torch.zeros(big, 1, tm, n_max, dtype=k0.dtype)
    kept = torch.zeros(big, 1, tm, 1, dtype=k0.dtype)
    neg = torch.finfo(k0.dtype).min
    for b, c in rows:
        at = torch.arange(past[b], past[b] + new[b]).clamp(max=len(c.view_of) - 1)
        view = c.views[c.view_of[at]]  # [n, N + 1]
        cols = slice(tm - new[b], tm)
        mask[b, 0, cols, :c.tokens] = torch.where(view[:, :-1], 0.0, neg).to(k0.dtype)
        mask[b, 0, cols, c.tokens:] = neg
        kept[b, 0, cols, 0] = view[:, -1].to(k0.dtype)
    layers = [CrossLayer() for _ in range(max(first.layers) + 1)]
    for j, i in enumerate(first.layers):
        if len(rows) == 1 and big == 1:  # one row: its own tensors, no copy
            k, v = first.keys[j].unsqueeze(0), first.values[j].unsqueeze(0)
        else:
            k = k0.new_zeros(big, *first.keys[j].shape[:1], n_max, first.keys[j].shape[-1])
            v = k0.new_zeros(big, *first.values[j].shape[:1], n_max, first.values[j].shape[-1])
            for b, c in rows:
                k[b, :, :c.tokens] = c.keys[j]
                v[b, :, :c.tokens] = c.values[j]
        layers[i] = CrossLayer(k, v)
    per_row = [None if x is None else x.cross for x in inputs]
    return CrossStep(layers, mask.to(k0.device), kept.to(k0.device), per_row)
