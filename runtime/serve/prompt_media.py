"""Prompts with images, as the engine runs them.

An image-text model's forward turns a prompt with images into the inputs of its language model: the
token embeddings with each image's placeholder tokens replaced by the image's features, and for some
models (Qwen2-VL's multimodal RoPE) positions of their own. Which vision tower, projector, feature
layer, patch merging or position rule a model uses is its own forward's business, so the engine does
not reimplement any of it: :func:`read_prompt` runs the model's forward once on the whole prompt and
stops it where its language model starts, keeping what it was handed (:class:`PromptInputs`). Every
later step of the prompt (chunks of a long prompt, batched with other variants' rows) reads the token
embeddings as usual and puts the kept rows back in place (:func:`image_step`), so the decoder sees
exactly what the model's own forward gives it.

The forward runs with the request's variant bound, so a variant that changed the vision tower or the
projector reads its images with its own weights.

Gemma 3 lets an image's tokens see each other in both directions (its processor marks them; the
engine keeps each image's span in ``PromptInputs.blocks`` and the paged attention widens those
queries' view to the span's end). PaliGemma reads its whole prompt, images and text, that way (a
prefix language model; its processor's ``token_type_ids`` 0). A prompt chunk never ends inside such
a span.

Qwen3-VL also adds features of early vision layers to the hidden states of its first decoder layers
at the images' positions (DeepStack): those are kept per image token too, and each step hands the
language model the ones of its rows (:class:`StepEmbeds` ``deep``). Gemma 4's language model also
takes per-layer token embeddings, made by its forward from the ids with the pad id at image tokens:
the image rows are kept, and each step makes the others from its ids (``StepEmbeds.model_args``).
Mllama's language model reads its images in cross-attention layers: their keys and values are kept
per sequence for the whole of it (``cross_attention``). A language model that takes more from the
images than these is refused with :class:`ImagesUnsupported`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from deltazip.formats.errors import InputError, first_line
from deltazip.models.image_inputs import (
    cross_attention_layers,
    language_model_of,
    on_model,
    run_to_language_model,
)
from deltazip.runtime.serve.cross_attention import CROSS_ARGS, CrossInputs, read_cross

# Image tokens see each other both ways within one image (transformers' token_type_ids blocks):
# Gemma 3's always, Gemma 4's where its text config says so.
BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})


def images_seen_both_ways(config) -> bool:
    """Whether an image's tokens attend to each other in both directions in ``config``'s model."""
    text = getattr(config, "text_config", None)
    return (config.model_type in BIDIRECTIONAL_IMAGES
            or (config.model_type == "gemma4" and getattr(text, "use_bidirectional_attention", None) == "vision"))


# The prompt (images and text) sees itself both ways, generated tokens are causal: a prefix LM
# (PaliGemma; transformers' token_type_ids 0 for the prompt, 1 for what follows it).
PREFIX_LM = frozenset({"paligemma"})


def is_prefix_lm(config) -> bool:
    """Whether ``config``'s model reads its whole prompt with bidirectional attention."""
    return config.model_type in PREFIX_LM


# What a language model may be handed besides its input embeddings and positions, all of which the
# engine gives it itself (masks, cache, flags).
_OWN_ARGS = frozenset({"inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values", "use_cache",
                       "return_dict", "cache_position", "output_attentions", "output_hidden_states", "input_ids",
                       "logits_to_keep"})
# Gemma 3n's and Gemma 4's per-layer token embeddings [1, T, L, D]: the outer forward computes them
# from the ids with each image token's replaced by the pad id; kept at the image positions.
_PER_LAYER = "per_layer_inputs"
# Qwen3-VL's DeepStack: the image positions [1, T] bool and, per early decoder layer, a feature [n, H]
# for each of them, added to that layer's output there.
_DEEP_MASK, _DEEP = "visual_pos_masks", "deepstack_visual_embeds"


class ImagesUnsupported(ValueError):
    """The served model cannot read images through the engine (one line, for a 400)."""


@dataclass
class PromptMedia:
    """A prompt's images as its processor gives them: every tensor the model's forward takes beside
    ``input_ids`` (``pixel_values`` ``[N, 3, H, W]`` or flattened patches, ``image_grid_thw``,
    ``image_sizes``, ``token_type_ids``...), on the host."""

    tensors: dict[str, torch.Tensor]
    images: int


@dataclass
class PromptInputs:
    """What a model's own forward hands its language model for a prompt of ``T`` tokens, beyond each
    token's embedding.

    Attributes:
        positions: int64 ``[n]``, ascending: the prompt positions whose input is not their token's
            embedding (the images' tokens).
        embeds: ``[n, H]``, the inputs at those positions (model dtype, on the model's device).
        rope: int64 ``[R, T]``, the prompt's rotary positions where the model computes its own
            (Qwen2-VL's three sections), else None (positions ``0..T-1``).
        rope_delta: a token at position ``p >= T`` (a generated one) takes rotary position
            ``p + rope_delta`` in every section.
        blocks: ``[(a, b)]``, spans of positions whose queries see the whole span (Gemma 3's images).
        deep: per early decoder layer ``[n, H]``, added to that layer's output at ``positions``
            (Qwen3-VL's DeepStack), else None.
        per_layer: ``[n, L, D]``, the per-layer token embeddings at ``positions`` (Gemma 3n and 4),
            else None.
        cross: the images' keys and values in the cross-attention layers (Mllama), else None.
    """

    positions: torch.Tensor
    embeds: torch.Tensor
    rope: torch.Tensor | None = None
    rope_delta: int = 0
    blocks: list[tuple[int, int]] = field(default_factory=list)
    deep: list[torch.Tensor] | None = None
    per_layer: torch.Tensor | None = None
    cross: CrossInputs | None = None

    def decoding(self) -> PromptInputs | None:
        """What a sequence keeps once its prompt is read: its rotary positions, which every later
        token's position follows, and its images' cross-attention keys and values (the image rows and
        spans are done with); None where it has neither."""
        if self.rope is None and self.cross is None:
            return None
        cross = None if self.cross is None else self.cross.decoding()
        return PromptInputs(self.positions[:0], self.embeds[:0], self.rope, self.rope_delta, cross=cross)

    def to(self, device) -> PromptInputs:
        """The same inputs with their device tensors on ``device`` (host memory while preempted)."""
        def move(t):
            return None if t is None else t.to(device)

        return PromptInputs(self.positions, self.embeds.to(device), self.rope, self.rope_delta, self.blocks,
                            None if self.deep is None else [d.to(device) for d in self.deep], move(self.per_layer),
                            None if self.cross is None else self.cross.to(device))

    def own_step(self) -> bool:
        """Whether a step of this row needs more than its tokens (so no captured decode graph runs it)."""
        return self.rope is not None or self.cross is not None

    @classmethod
    def prefix(cls, t: int) -> PromptInputs:
        """A text prompt of ``t`` tokens that a prefix language model reads seeing itself both ways."""
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, 0), blocks=[(0, t)])

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prompt chunk ``[start, end)`` may end: before a span it would cut, or after the span
        when the span starts the chunk (a chunk never splits a span whose tokens see each other)."""
        for a, b in self.blocks:
            if a < end < b:
                return a if a > start else b
        return end


def token_embeddings(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``ids [B, T]`` -> ``[B, T, H]`` through the model's input embeddings; ids past the table
    (an image placeholder some models keep out of the vocabulary) read row 0 and are replaced."""
    emb = model.get_input_embeddings()
    return emb(ids.masked_fill(ids >= emb.num_embeddings, 0))


def read_prompt(model: nn.Module, prompt_ids: list[int], media: PromptMedia, device: torch.device,
                dtype: torch.dtype, keep_states: bool = False) -> PromptInputs:
    """Run ``model``'s forward on the prompt with its images up to its language model and keep what
    that is handed (module docstring). The caller binds the request's variant. ``keep_states``: keep
    the vision states of images read by cross-attention (each tensor-parallel rank makes its own
    heads' keys from them)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    try:
        seen = run_to_language_model(model, ids, on_model(media.tensors, device, dtype))
    except InputError as e:
        raise ImagesUnsupported(str(e)) from e
    except Exception as e:  # the processor's tensors do not fit the model (e.g. tokens and features disagree)
        raise ImagesUnsupported(f"the model could not read the images: {type(e).__name__}: {first_line(e)}") from e
    kind = model.config.model_type
    if seen.get("inputs_embeds") is None and seen.get("cross_attention_states") is not None:
        with torch.inference_mode():  # the images enter by cross-attention alone: the tokens are text (Mllama)
            seen["inputs_embeds"] = token_embeddings(model, ids)
    if seen.get("inputs_embeds") is None:
        raise ImagesUnsupported(f"{kind}: the model's forward did not reach its language model with input embeddings")
    read = _OWN_ARGS | {_DEEP_MASK, _DEEP, _PER_LAYER, "_args"} | (CROSS_ARGS if cross_attention_layers(model.config) else set())
    more = sorted(k for k, v in seen.items() if k not in read and v is not None and v is not False)
    if more or seen["_args"]:
        raise ImagesUnsupported(f"images are not served for {kind}: its language model takes {', '.join(more) or 'more'}"
                                " from the images beside their embeddings (text prompts are served)")
    deep = seen.get(_DEEP)
    with torch.inference_mode():
        got = seen["inputs_embeds"][0]
        if deep is not None:  # the model says where its images are: its features follow that order
            positions = seen[_DEEP_MASK][0].nonzero().flatten()
            deep = [d.detach().clone() for d in deep]
        else:
            positions = (got != token_embeddings(model, ids)[0]).any(-1).nonzero().flatten()
        embeds = got.index_select(0, positions).clone()
        per_layer = seen.get(_PER_LAYER)
        per_layer = None if per_layer is None else per_layer[0].index_select(0, positions).clone()
    rope, delta = _rope(seen.get("position_ids"), len(prompt_ids))
    blocks = _spans(positions.tolist()) if images_seen_both_ways(model.config) else []
    if is_prefix_lm(model.config):  # a served prompt has no suffix: all of it is the prefix
        blocks = [(0, len(prompt_ids))]
    cross = None
    if seen.get("cross_attention_states") is not None:
        try:
            cross = read_cross(model, seen, keep_states)
        except Exception as e:
            raise ImagesUnsupported(f"{kind}: its cross-attention layers could not read the images: "
                                    f"{type(e).__name__}: {first_line(e)}") from e
    return PromptInputs(positions.cpu(), embeds, rope, delta, blocks, deep, per_layer, cross)


def _rope(pos: torch.Tensor | None, t: int) -> tuple[torch.Tensor | None, int]:
    """A prompt's own rotary positions ``[R, T]`` and the offset of the tokens after it, from what the
    model handed its language model (``[R, 1, T]``, ``[1, T]`` or None)."""
    if pos is None:
        return None, 0
    pos = pos.detach().to("cpu", torch.long)
    pos = pos[:, 0] if pos.dim() == 3 else pos.reshape(1, -1)
    # plain positions, or all shifted alike (PaliGemma counts from 1), which rotary attention ignores
    if pos.shape[-1] != t or (torch.equal(pos - pos[:, :1], torch.arange(t).expand_as(pos))
                              and bool((pos[:, 0] == pos[0, 0]).all())):
        return None, 0
    return pos.clone(), int(pos.max()) + 1 - t


def _spans(positions: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive positions as ``[(start, end)]``."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


@dataclass
class StepEmbeds:
    """A step's rows whose inputs are not their tokens' embeddings: batch row ``rows``, token index
    ``cols`` (int64 ``[n]`` each, in batch-row-major order) take ``values [n, H]``; ``deep``: per
    early decoder layer ``[n, H]`` added to its output there (Qwen3-VL), else None. Read by
    ``model_runner.run_model``. ``per_layer``: the rows' per-layer token embeddings ``[n, L, D]``
    (Gemma 3n and 4), else None."""

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    deep: list[torch.Tensor] | None = None
    per_layer: torch.Tensor | None = None

    def to(self, device) -> StepEmbeds:
        """The same rows on ``device`` (another tensor-parallel rank's)."""
        deep = None if self.deep is None else [d.to(device) for d in self.deep]
        per_layer = None if self.per_layer is None else self.per_layer.to(device)
        return StepEmbeds(self.rows.to(device), self.cols.to(device), self.values.to(device), deep, per_layer)

    def model_args(self, model: nn.Module, input_ids: torch.Tensor) -> dict:
        """What the image-text model's forward takes besides the step's input embeddings: Gemma 3n's
        and 4's per-layer token embeddings ``[B, Tm, L, D]`` (every token's from its id through the
        language model's own table, the image rows' as kept), which it cannot recover from
        embeddings that are not a token's; else nothing."""
        if self.per_layer is None:
            return {}
        per_layer = language_model_of(model).get_per_layer_inputs
        # Gemma 4's takes the embeddings too (None: from the ids); Gemma 3n's the ids alone
        table = per_layer(input_ids, None) if len(inspect.signature(per_layer).parameters) > 1 else per_layer(input_ids)
        table[self.rows, self.cols] = self.per_layer.to(table.dtype)
        return {_PER_LAYER: table}

    def language_model_args(self, shape: tuple[int, int]) -> dict:
        """What the language model takes besides its input embeddings for a step of ``shape`` ``(B,
        Tm)``: Qwen3-VL's image positions ``[B, Tm]`` and their DeepStack features; else nothing."""
        if self.deep is None:
            return {}
        mask = torch.zeros(shape, dtype=torch.bool, device=self.rows.device)
        mask[self.rows, self.cols] = True
        return {_DEEP_MASK: mask, _DEEP: self.deep}


def image_step(inputs: list[PromptInputs | None], past: list[int], new: list[int], ids: torch.Tensor,
                pos: torch.Tensor, q_pos: torch.Tensor | None) -> tuple[StepEmbeds | None, torch.Tensor, torch.Tensor | None]:
    """What a step of rows with images changes: ``(embeds, position ids, query view)``.

    Args:
        inputs: per batch row its prompt's :class:`PromptInputs`, or None.
        past, new: per row the cached positions and new tokens (rows right-aligned in ``Tm``).
        ids: the step's token ids ``[B, Tm]``; image positions are set to 0 in place (their
            embedding is replaced, and a placeholder id may lie outside the table).
        pos: the position ids ``[B, Tm]`` the model would get.
        q_pos: the paged step's query positions ``[B, Tm]`` (None on the contiguous cache).
    Returns:
        the :class:`StepEmbeds` (None if no image token is in this step); the position ids, ``[R, B,
        Tm]`` where a row has rotary positions of its own; and the last key position each query sees
        ``[B, Tm]`` where a row has spans seen both ways (else None).
    """
    tm = ids.shape[1]
    rows, cols, values, deep, per_layer = [], [], [], [], []
    rope_rows = max((x.rope.shape[0] for x in inputs if x is not None and x.rope is not None), default=0)
    out_pos = pos.unsqueeze(0).expand(rope_rows, *pos.shape).clone() if rope_rows else pos
    see = None
    for b, (x, p, n) in enumerate(zip(inputs, past, new)):
        if x is None:
            continue
        at = x.positions
        sel = ((at >= p) & (at < p + n)).nonzero().flatten()
        if sel.numel():
            rows.append(torch.full((sel.numel(),), b, dtype=torch.long))
            cols.append(at[sel] - p + (tm - n))
            values.append(x.embeds.index_select(0, sel.to(x.embeds.device)))
            if x.deep is not None:
                deep.append([d.index_select(0, sel.to(d.device)) for d in x.deep])
            if x.per_layer is not None:
                per_layer.append(x.per_layer.index_select(0, sel.to(x.per_layer.device)))
        if x.rope is not None:
            span = torch.arange(p, p + n)
            t = x.rope.shape[1]
            own = x.rope[:, span.clamp(max=t - 1)]
            after = (span + x.rope_delta).expand_as(own)
            out_pos[:, b, tm - n:] = torch.where(span < t, own, after).to(out_pos.device)
        if x.blocks and q_pos is not None:
            if see is None:
                see = q_pos.clone()
            for a, e in x.blocks:
                lo, hi = max(a, p), min(e, p + n)
                if lo < hi:
                    see[b, lo - p + tm - n:hi - p + tm - n] = e - 1
    embeds = None
    if rows:
        r, c = torch.cat(rows).to(ids.device), torch.cat(cols).to(ids.device)
        ids[r, c] = 0
        if any(0 < len(x) != len(values) for x in (deep, per_layer)):  # one model: every image row has them, or none
            raise ValueError("a step mixes prompts with and without DeepStack features or per-layer embeddings")
        embeds = StepEmbeds(r, c, torch.cat(values), [torch.cat(f) for f in zip(*deep)] if deep else None,
                            torch.cat(per_layer) if per_layer else None)
    return embeds, out_pos, see
