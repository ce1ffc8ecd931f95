"""What runs one forward step of a served model, below the engine: the contiguous KV cache and the
step helpers.

- the contiguous KV pool (``KVPool``: per layer ``[rows, H_kv, capacity, D]``, a row per sequence;
  ``SeqKV`` per sequence; ``StepKV``, the step's cache object: one indexed store and one gather per
  layer) for model classes without the paged attention (ALiBi ones); the paged pool is
  ``deltazip.runtime.serve.kv_cache``;
- the step helpers (:func:`left_pad`, :func:`new_kv_pool`, :func:`step_args`, :func:`forward_step`,
  :func:`prefill_logits`...) that the engine, the start-up self-check, CUDA graphs, tensor-parallel
  ranks, benches and tests share, and :func:`run_model`, one forward of a transformers model.

It imports neither the engine nor the model (both import it).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

from deltazip.models.image_inputs import handing
from deltazip.models.loader import text_config
from deltazip.runtime.serve.attention import is_paged
from deltazip.runtime.serve.cross_attention import cross_step
from deltazip.runtime.serve.kv_cache import DEFAULT_BLOCK_SIZE, BlockPool, PagedStep, SeqBlocks
from deltazip.runtime.serve.prompt_media import PromptInputs, image_step, token_embeddings
from deltazip.runtime.serve.recurrent_state import (
    RecurrentStep,
    SeqState,
    StatePool,
    recurrent_layer_types,
    tokenwise,
)

# --------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------


class KVPool:
    """Keys and values of every sequence in the batch, in one tensor per layer.

    Per layer ``k`` and ``v`` are ``[R, H_kv, C, D]``: ``R`` rows (one per sequence holding a cache),
    ``C`` positions (the longest sequence so far, grown by doubling). With all sequences in one
    tensor a step gathers its rows' past with one ``index_select`` and writes its new tokens with one
    indexed store per layer, whatever the batch size — per-sequence buffers cost a copy per row per
    layer, which dominated decode steps of large batches. The price is padding: every row is ``C``
    long. When no sequence holds a row any more the tensors are dropped, so an idle server holds no
    KV memory. Layers are created on first write (their ``H_kv``, ``D`` and dtype come from the model).
    """

    def __init__(self):
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.rows = 0
        self.capacity = 0
        self._free: list[int] = []
        self.states = StatePool()  # recurrent layers' per-sequence states (hybrid models)

    def alloc(self) -> int:
        """A free row (the pool grows by doubling when none is left)."""
        if not self._free:
            grow = max(8, self.rows)
            self._resize(self.rows + grow, self.capacity)
            self._free = list(range(self.rows - 1, self.rows - grow - 1, -1))
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)
        if len(self._free) == self.rows:  # nothing cached: give the memory back
            self.k, self.v, self.rows, self.capacity, self._free = [], [], 0, 0, []

    def ensure_length(self, n: int) -> None:
        """Make every row hold at least ``n`` positions."""
        if n > self.capacity:
            self._resize(self.rows, max(16, n, 2 * self.capacity))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def _resize(self, rows: int, capacity: int) -> None:
        def grown(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            # Zeros, not empty: masked positions are multiplied by 0 in attention, and 0 * NaN is NaN.
            out = t.new_zeros(rows, t.shape[1], capacity, t.shape[3])
            out[: t.shape[0], :, : t.shape[2]] = t
            return out

        self.k = [grown(t) for t in self.k]
        self.v = [grown(t) for t in self.v]
        self.rows, self.capacity = rows, capacity

    def layer(self, idx: int, like: torch.Tensor, like_v: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``idx``'s ``(k, v)``, created shaped after ``like`` ``[B, H_kv, T, D]`` (the values after
        ``like_v``, default ``like``: multi-head latent attention caches latents of two widths) if new."""
        while len(self.k) <= idx:
            self.k.append(None)
            self.v.append(None)
        if self.k[idx] is None:
            like_v = like if like_v is None else like_v
            self.k[idx] = like.new_zeros(self.rows, like.shape[1], self.capacity, like.shape[3])
            self.v[idx] = like_v.new_zeros(self.rows, like_v.shape[1], self.capacity, like_v.shape[3])
        return self.k[idx], self.v[idx]


class SeqKV(SeqState):
    """One sequence's KV cache: a row of a :class:`KVPool` (or, while preempted, host copies), and its
    recurrent layers' states where the model has some."""

    def __init__(self):
        self.pool: KVPool | None = None
        self.row: int | None = None
        self.length = 0
        self.host: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def attach(self, pool: KVPool) -> None:
        """Take a row of ``pool``; a cache moved to the host comes back into it."""
        if self.row is not None:
            return
        self.pool, self.row = pool, pool.alloc()
        if self.host is not None:
            pool.ensure_length(self.length)
            for i, (k, v) in enumerate(self.host):
                if k is None:  # a layer without a cache (recurrent, or reusing another layer's keys)
                    continue
                pk, pv = pool.layer(i, k.unsqueeze(0), v.unsqueeze(0))
                pk[self.row, :, : self.length] = k.to(pk.device)
                pv[self.row, :, : self.length] = v.to(pv.device)
            self.host = None

    @torch.inference_mode()
    def fork(self) -> SeqKV:
        """A new sequence with a copy of this one's cached positions in a row of its own (a contiguous
        row cannot be shared)."""
        child = SeqKV()
        child.length = self.length
        if self.row is None:
            return child
        child.attach(self.pool)
        self.fork_state(child, self.pool.states)
        for k, v in zip(self.pool.k, self.pool.v):
            if k is not None:
                k[child.row, :, : self.length] = k[self.row, :, : self.length]
                v[child.row, :, : self.length] = v[self.row, :, : self.length]
        return child

    def offload(self) -> None:
        """Copy the cache to host memory and give the row back (a preempted sequence)."""
        if self.row is None:
            return
        self.offload_state(self.pool.states)
        n = self.length
        # copy=True: on a CPU server .to("cpu") would return a view of the row it is about to give away.
        self.host = [(None, None) if k is None else  # kept in place: each copy goes back to its layer
                     (k[self.row, :, :n].to("cpu", copy=True), v[self.row, :, :n].to("cpu", copy=True))
                     for k, v in zip(self.pool.k, self.pool.v)]
        self.free()

    def free(self) -> None:
        if self.row is not None:
            self.free_state(self.pool.states)
            self.pool.release(self.row)
        self.pool, self.row = None, None

    def nbytes(self) -> int:
        if self.host is not None:
            return sum((k.numel() + v.numel()) * k.element_size() for k, v in self.host if k is not None)
        if self.row is None:
            return 0
        return sum((k[0].numel() + v[0].numel()) * k.element_size() for k, v in zip(self.pool.k, self.pool.v)
                   if k is not None)


class StepKV(RecurrentStep):
    """The ``past_key_values`` object of one forward: a padded view over the rows' pooled caches.

    Row ``b`` has ``P_b`` cached tokens and ``T_b`` new ones (queries left-padded to ``Tm = max T``).
    Its keys are laid out right-aligned, ``[empty (L - P_b - T_b) | past (P_b) | new (T_b)]`` with
    ``L = max(P + T)``: every row's keys are contiguous and in position order, the slot of key
    position ``p`` is ``p + L - P_b - T_b`` (so ``query_offset = L - Tm``: the key of query ``t`` is
    slot ``L - Tm + t``), and padding tokens have no key at all. :meth:`positions` describes this
    layout, from which ``deltazip.runtime.serve.masks`` builds the masks of every attention variant
    (ALiBi models whose bias depends on the slot index see a per-row constant shift, which softmax
    ignores). The new keys/values are written into each sequence's pool row first (all rows of a
    layer in one store), then the step's keys are gathered from the pool in one indexed read.

    Besides ``update`` it answers what transformers' mask builders ask a cache
    (``get_seq_length``, ``get_query_offset``, ``get_mask_sizes``).

    Args:
        pool: the engine's :class:`KVPool`; caches without a row get one.
        caches: one :class:`SeqKV` per batch row.
        past, new: ``P_b`` and ``T_b`` per row.
    """

    is_compileable = False
    logits_to_keep = 1  # 0: the forward returns every position's logits (prompt log probabilities)

    def __init__(self, pool: KVPool, caches: list[SeqKV], past: list[int], new: list[int]):
        self.pool, self.past, self.new = pool, past, new
        self.caches = caches  # which sequence each row extends (tensor-parallel ranks mirror their caches)
        self.lp, self.tm = max(past), max(new)
        self.length = max(p + n for p, n in zip(past, new))  # L
        for c in caches:
            c.attach(pool)
        pool.ensure_length(self.length)
        self._rows = [c.row for c in caches]
        self._index: tuple[torch.Tensor, ...] | None = None
        self._positions: tuple[torch.Tensor, torch.Tensor] | None = None

    def positions(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_pos [B, L], query_pos [B, Tm])`` int64: each key slot's position in its row's
        sequence (``-1``: no key) and each query's (a padding query gets its row's first new
        position, so it sees at least that token and no softmax row is empty)."""
        if self._positions is None or self._positions[0].device != torch.device(device):
            p = torch.tensor(self.past, device=device).view(-1, 1)
            n = torch.tensor(self.new, device=device).view(-1, 1)
            key = p + n - self.length + torch.arange(self.length, device=device).view(1, -1)
            query = torch.maximum(p + n - self.tm + torch.arange(self.tm, device=device).view(1, -1), p)
            self._positions = (key.clamp(min=-1), query)
        return self._positions

    def _indices(self, device) -> tuple[torch.Tensor, ...]:
        """The step's pool rows, where every real new token goes (batch row, token index, pool row,
        position) and which pool position each key slot reads, on ``device``; built once per step,
        shared by every layer."""
        if self._index is None:
            b, t, row, pos = [], [], [], []
            for i, (r, p, n) in enumerate(zip(self._rows, self.past, self.new)):
                b += [i] * n
                t += range(self.tm - n, self.tm)
                row += [r] * n
                pos += range(p, p + n)
            self._index = tuple(torch.tensor(x, dtype=torch.int64, device=device)
                                for x in (self._rows, b, t, row, pos))
            self._index += (self.positions(device)[0].clamp(min=0),)
        return self._index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``[B, H_kv, Tm, D]`` new keys/values -> ``[B, H_kv, L, D]`` keys/values to attend."""
        pk, pv = self.pool.layer(layer_idx, key_states, value_states)
        rows, b, t, row, pos, src = self._indices(key_states.device)
        pk[row, :, pos] = key_states[b, :, t]
        pv[row, :, pos] = value_states[b, :, t]
        if not self.lp:  # a prefill: the new keys are already right-aligned (padding slots are masked)
            return key_states, value_states
        heads = torch.arange(pk.shape[1], device=pk.device).view(1, -1, 1)
        r, s = rows.view(-1, 1, 1), src.unsqueeze(1)
        return pk[r, heads, s], pv[r, heads, s]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Key slots before the first query's (what transformers adds to query indices)."""
        return self.length - self.tm

    def get_query_offset(self, layer_idx: int | None = None) -> int:
        return self.length - self.tm

    def get_mask_sizes(self, query_length: int, layer_idx: int | None = None) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the step's key tensor (every layer attends all ``L`` slots)."""
        return self.length, 0


def left_pad(tokens: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token lists as one int64 ``[B, max len]`` batch, each row right-aligned (the layout of
    :class:`StepKV` and :func:`step_inputs`)."""
    tm = max(len(t) for t in tokens)
    ids = torch.full((len(tokens), tm), pad_id, dtype=torch.long)
    for i, toks in enumerate(tokens):
        ids[i, tm - len(toks):] = torch.tensor(toks, dtype=torch.long)
    return ids


def new_kv_pool(backend, block_size: int = DEFAULT_BLOCK_SIZE) -> KVPool | BlockPool:
    """The KV pool for ``backend``: paged when its model runs the paged attention, else contiguous."""
    return BlockPool(block_size) if is_paged(backend) else KVPool()


def new_seq_kv(pool: KVPool | BlockPool) -> SeqKV | SeqBlocks:
    return SeqBlocks() if isinstance(pool, BlockPool) else SeqKV()


def step_args(pool: KVPool | BlockPool, caches: list, past: list[int], new: list[int], config, dtype: torch.dtype,
              device) -> tuple[Any, torch.Tensor, Any]:
    """``(cache object, position ids [B, Tm], attention mask argument)`` of one forward of a model
    with ``config`` computing in ``dtype`` on ``device``: row ``b`` has ``past[b]`` cached tokens and
    ``new[b]`` new ones. On the paged pool the step's layout travels in the :class:`PagedStep` and
    the 4-D tensor passed as ``attention_mask`` is a placeholder, so that transformers builds no mask
    of its own (the paged attention masks per layer, sliding windows included, from the layout); on
    the contiguous pool the masks come from :func:`step_inputs`."""
    kv = step_cache(pool, caches, past, new, device)
    if isinstance(kv, PagedStep):
        pos, mask = kv.q_pos, torch.ones(len(new), 1, max(new), 1, dtype=torch.bool, device=device)
    else:
        mask, pos = step_inputs(kv, config, dtype, device)
    recurrent = recurrent_layer_types(config)
    if recurrent:  # hybrid models: a mask per layer type, the recurrent ones a 2-D padding mask [B, Tm]
        tm = max(new)
        real = (torch.arange(tm).view(1, -1) >= tm - torch.tensor(new).view(-1, 1)).to(device=device, dtype=dtype)
        text = text_config(config)
        attn = {t: (mask[t] if isinstance(mask, dict) else mask) for t in set(text.layer_types) - set(recurrent)}
        if not attn and "hybrid" not in recurrent:  # recurrent layers only (Mamba-2): the model passes
            return kv, pos, real  # the mask to its layers as it is (Falcon-H1's hybrid layers attend too)
        full = next(iter(attn.values()), None)
        if full is None:  # attention only inside hybrid layers (Falcon-H1, Zamba2): their mask
            full = mask.get("hybrid", next(iter(mask.values()))) if isinstance(mask, dict) else mask
        mask = {"full_attention": full, **attn, **dict.fromkeys(("linear_attention", "conv"), real)}
    return kv, pos, mask


def step_cache(pool: KVPool | BlockPool, caches: list, past: list[int], new: list[int], device) -> PagedStep | StepKV:
    """The ``past_key_values`` object of one forward over ``pool`` (row ``b``: ``past[b]`` cached
    tokens in ``caches[b]``, ``new[b]`` new ones)."""
    if isinstance(pool, BlockPool):
        return PagedStep(pool, caches, past, new, device)
    return StepKV(pool, caches, past, new)


def forward_step(backend, pool: KVPool | BlockPool, caches: list, row_slots: list[int], tokens: list[list[int]],
                 past: list[int], pad_id: int = 0, every_position: bool = False,
                 inputs: list[PromptInputs | None] | None = None) -> torch.Tensor:
    """One forward of ``backend`` over ``tokens`` (row ``b``: new tokens after ``past[b]`` cached
    ones, in slot ``row_slots[b]``); the caches receive them and their ``length`` grows. Returns the
    last-position logits ``[B, V]`` fp32 (layout and masks: :func:`step_args`), or with
    ``every_position`` the logits of every position ``[B, Tm, V]`` (rows left-padded). ``inputs``:
    per row what its prompt's images make of it (``prompt_media``), None for rows without images."""
    dev = backend.device
    new = [len(t) for t in tokens]
    if inputs is not None and all(x is None for x in inputs):
        inputs = None
    if tokenwise(backend.config) and any(p > 0 and n > 1 for p, n in zip(past, new)):
        if inputs is not None:
            raise ValueError("images are not read by models whose recurrent layers continue a state token by token")
        return _tokenwise_step(backend, pool, caches, row_slots, tokens, past, pad_id, every_position)
    groups = _unpadded_groups(backend.config, past, new)
    if len(groups) > 1:  # recurrent layers: rows continuing a state are never left-padded
        outs = [(g, forward_step(backend, pool, [caches[i] for i in g], [row_slots[i] for i in g],
                                 [tokens[i] for i in g], [past[i] for i in g], pad_id, every_position,
                                 None if inputs is None else [inputs[i] for i in g]))
                for g in groups]
        first = outs[0][1]
        logits = first.new_zeros(len(tokens), *([max(new)] if every_position else []), first.shape[-1])
        for g, out in outs:  # rows are left-padded: a group's positions are the last ones
            rows = torch.tensor(g, device=logits.device)
            if every_position:
                logits[rows, max(new) - out.shape[1]:] = out
            else:
                logits[rows] = out
        return logits
    with torch.inference_mode():
        ids = left_pad(tokens, pad_id).to(dev)
        kv, pos, mask = step_args(pool, caches, past, new, backend.config, backend.dtype, dev)
        kv.logits_to_keep = 0 if every_position else 1  # read by run_model
        if inputs is not None:  # images: their rows' inputs (read by run_model), positions, views
            kv.prompt_embeds, pos, see = image_step(inputs, past, new, ids, pos, getattr(kv, "q_pos", None))
            if see is not None:
                kv.see = see
            kv.cross = cross_step(inputs, past, new, ids.shape[1])
            if kv.cross is not None:  # where transformers reads cached cross-attention keys (Mllama)
                kv.layers = kv.cross.layers
        logits = backend.forward(row_slots, ids, pos, mask, kv)
    for c, n in zip(caches, new):
        c.length += n
    return logits


def _tokenwise_step(backend, pool: KVPool | BlockPool, caches: list, row_slots: list[int], tokens: list[list[int]],
                    past: list[int], pad_id: int, every_position: bool) -> torch.Tensor:
    """:func:`forward_step` for a model whose recurrent layers continue a state one token at a time
    (``recurrent_state.tokenwise``): rows that have a past and several new tokens take one token per
    forward, together; the other rows run as one forward. Same result layout as ``forward_step``."""
    new = [len(t) for t in tokens]
    split = [i for i, (p, n) in enumerate(zip(past, new)) if p > 0 and n > 1]
    whole = [i for i in range(len(new)) if i not in split]
    runs = []  # (rows, index of the token each row's output is for: None for a whole row)
    if whole:
        runs.append((whole, None))
    runs += [([i for i in split if new[i] > j], j) for j in range(max(new[i] for i in split))]
    tm, logits = max(new), None
    for rows, j in runs:
        out = forward_step(backend, pool, [caches[i] for i in rows], [row_slots[i] for i in rows],
                           [tokens[i] if j is None else [tokens[i][j]] for i in rows],
                           [past[i] + (j or 0) for i in rows], pad_id, every_position)
        if logits is None:
            logits = out.new_zeros(len(new), *([tm] if every_position else []), out.shape[-1])
        for k, i in enumerate(rows):
            if every_position:  # left-padded: row i's tokens are its last new[i] positions
                at = tm - out.shape[1] if j is None else tm - new[i] + j
                logits[i, at:at + out.shape[1]] = out[k]
            elif j is None or j == new[i] - 1:
                logits[i] = out[k]
    return logits


def _unpadded_groups(config, past: list[int], new: list[int]) -> list[list[int]]:
    """The rows of one forward, split so that no row continuing a recurrent state is left-padded (a
    padding token would decay its state): one group, unless the model has recurrent layers and some
    row with a past has fewer new tokens than the longest; then the rows of each such length apart."""
    tm = max(new)
    if all(p == 0 or n == tm for p, n in zip(past, new)) or not recurrent_layer_types(config):
        return [list(range(len(new)))]
    groups: dict[int, list[int]] = {}  # by length; new rows (and the longest) in the longest's group
    for i, (p, n) in enumerate(zip(past, new)):
        groups.setdefault(tm if p == 0 else n, []).append(i)
    return [groups.pop(tm), *groups.values()]


def prefill_logits(backend, row_slots: list[int], tokens: list[list[int]], caches: list | None = None,
                   pool: KVPool | BlockPool | None = None, pad_id: int = 0) -> torch.Tensor:
    """One prefill forward of ``tokens`` (a prompt per row, row ``b`` in slot ``row_slots[b]``) through
    ``backend`` (``DeltaModel`` or ``SwapModels``), as the engine runs it; last-position logits ``[B, V]``.

    ``caches`` (empty ``SeqKV``/``SeqBlocks``, one per row) and their ``pool`` receive the prompts'
    keys and values and come back with ``length`` set; fresh ones are used when not given.
    """
    pool = pool if pool is not None else new_kv_pool(backend)
    caches = caches if caches is not None else [new_seq_kv(pool) for _ in tokens]
    return forward_step(backend, pool, caches, row_slots, tokens, [0] * len(tokens), pad_id)


def step_inputs(kv: StepKV, config, dtype: torch.dtype, device) -> tuple[Any, torch.Tensor]:
    """Attention mask argument and position ids ``[B, Tm]`` of a step of a model with ``config``
    computing in ``dtype`` on ``device`` (layout in :class:`StepKV`; the mask of each attention
    variant from ``deltazip.runtime.serve.masks``)."""
    from deltazip.runtime.serve.masks import attention_masks_for

    key_pos, query_pos = kv.positions(device)
    return attention_masks_for(config, key_pos, query_pos, dtype), query_pos


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache object: ``cache`` from transformers
    5.24 on (where ``past_key_values`` still works but warns on every call), ``past_key_values``
    before, and in any architecture that has not been renamed yet."""
    cls = type(model)
    name = _CACHE_KWARG.get(cls)
    if name is None:
        params = inspect.signature(cls.forward).parameters
        name = _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_KWARG: dict[type, str] = {}


def run_model(model: nn.Module, input_ids, position_ids, attention_mask, kv) -> torch.Tensor:
    """One forward of a transformers causal LM over a prepared batch; last-position logits ``[B, V]``,
    fp32, or every position's ``[B, T, V]`` when the step asks (``kv.logits_to_keep == 0``: prompt log
    probabilities). A paged step (``kv_cache.PagedStep``) is bound for the attention function while it runs."""
    keep = getattr(kv, "logits_to_keep", 1)
    embeds = getattr(kv, "prompt_embeds", None)  # a prompt's images in this step (prompt_media.image_step)
    images = {}
    if embeds is not None:
        x = token_embeddings(model, input_ids)
        x[embeds.rows, embeds.cols] = embeds.values.to(x.dtype)
        tokens = {"inputs_embeds": x, **embeds.model_args(model, input_ids)}
        images = embeds.language_model_args(tuple(input_ids.shape))
    else:
        tokens = {"input_ids": input_ids}
    cross = getattr(kv, "cross", None)  # images read by cross-attention layers (cross_attention.cross_step)
    if cross is not None:
        images = {**images, **cross.language_model_args()}
    with kv.bound() if hasattr(kv, "bound") else contextlib.nullcontext(), handing(model, images):
        out = model(**tokens, position_ids=position_ids, attention_mask=attention_mask,
                    use_cache=True, logits_to_keep=keep, **{cache_kwarg(model): kv})
    if isinstance(kv, RecurrentStep):
        kv.commit_states()  # recurrent layers' states back into the pool
    return out.logits.float() if keep == 0 else out.logits[:, -1, :].float()
