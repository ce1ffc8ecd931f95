"""Attention over the paged KV cache, registered with transformers' ``AttentionInterface``.

A model loaded for serving gets ``attn_implementation = "deltazip_paged"`` (:func:`use_paged_attention`)
when its class takes attention functions from the interface (``_supports_attention_backend``);
other classes (ALiBi models such as BLOOM, MPT, Falcon) keep SDPA and the engine's contiguous
``StepKV`` path, and so do models with multi-head latent attention (DeepSeek-V2/V3 and their kin):
their cache holds latents that a projection (``kv_b_proj`` in ``expand_kv``) expands after the
cache read, and the paged cache's read is the whole pool, so the expansion would run over every
sequence's blocks in every layer, and a variant's delta on that projection could not tell them apart.

While a :class:`~deltazip.runtime.serve.kv_cache.PagedStep` is bound (the engine's forwards), the
keys and values transformers hands over are the layer's whole pool ``[num_blocks, H_kv,
block_size, D]``, read in place. Per span of the step (one span for a decode step, one per row for
a prefill), a range of blocks ``[lo, hi)``: every block meets only its owner's queries (gathered,
``[nb, H_kv, G·Tm, D]``), scores are one batched matmul against the blocks as they lie in the pool
(``[nb, H_kv, G·Tm, block_size]``), masked to positions up to the query's; the softmax runs across
a row's blocks with a scattered max and sum (``scatter_reduce_``/``index_add_``), and the
block-partial outputs ``probs · V_block`` are summed per row. A block several rows of a span hold
(the shared prompt of a request's samples) is read in place for its first holder and gathered once
per other holder. Work is proportional to the blocks
read, not to ``B ×`` the span. GQA: the ``G = H_q / H_kv`` query heads sharing a key/value head are
stacked on the query axis, so K and V are never repeated. The kwargs transformers passes
are honoured: ``scaling``, ``softcap`` (Gemma 2/3: ``tanh(s / c) · c``), ``sliding_window`` (a key
is seen while ``q - window < k <= q``; Llama 4's ``chunked_attention`` layers, which say so only in
the mask, see their chunk: :func:`~deltazip.runtime.serve.masks.attention_chunk`), ``s_aux`` (GPT-OSS's attention sinks: one more logit per head in
every softmax, with no value); ``dropout`` must be 0 (inference).

Why this kernel: it is plain torch (CPU and CUDA alike, about 25 ops per layer whatever the batch),
reads every needed key once per layer and copies none. Its costs: the queries are gathered per
block (``block_size`` times fewer rows than keys), and blocks inside a span that belong to no row
of it (other sequences' blocks) are computed and discarded. No GPU was available to measure
flex_attention or FlashInfer against it (see docs/serve.md).

Called without a bound step (``generate`` on the same model object, say) the function behaves as
SDPA, with transformers' SDPA masks (registered for the same name).
"""

from __future__ import annotations

import torch

from deltazip.runtime.serve.delta_sinks import per_row_sinks
from deltazip.runtime.serve.kv_cache import CURRENT_STEP, PagedStep
from deltazip.runtime.serve.masks import attention_chunk

PAGED_ATTENTION = "deltazip_paged"
_NEG = torch.finfo(torch.float32).min  # masked scores: exp() gives 0, and no inf - inf NaN


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query [B, H_q, Tm, D]`` -> ``([B, Tm, H_q, Dv], None)``.

    With a bound step, ``key``/``value`` are the layer's pool ``[num_blocks, block_size, H_kv, D]``.
    ``s_aux``: attention sinks (GPT-OSS), one logit per head ``[H_q]`` (or per row, ``[B, H_q]``) that
    joins every softmax's denominator and adds no value.
    """
    if dropout:
        raise ValueError("deltazip_paged attention is for inference: dropout must be 0")
    step = CURRENT_STEP.get()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if s_aux is not None:  # a variant's own sinks per row (deltazip.runtime.serve.delta_sinks)
        s_aux = per_row_sinks(module, s_aux)
    if step is None or (step.cross is not None and getattr(module, "layer_idx", None) in step.cross.layer_ids):
        # unbound, or a cross-attention layer: dense keys and values [B, H_kv, N, D] with the model's mask
        return _unbound(module, query, key, value, attention_mask, scale, sliding_window, softcap, s_aux, **kwargs)
    query = _per_row_temperature(module, query, step)
    return _paged(step, query, key, value, scale, sliding_window, softcap, s_aux, attention_chunk(module)), None


def _per_row_temperature(module: torch.nn.Module, query: torch.Tensor, step: PagedStep) -> torch.Tensor:
    """Llama 4's layers without rope scale a query at position ``p`` by
    ``1 + attn_scale · log1p(floor((p + 1) / floor_scale))``, taking ``p`` from ``arange(Tm)`` plus
    the cache's one ``get_seq_length()``, which is right for one sequence only. Rescale each row's
    queries ``[B, H, Tm, D]`` to its own positions (``step.q_pos``); other modules pass unchanged."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query

    def scale(pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    tm = query.shape[2]
    used = scale(torch.arange(tm, device=query.device) + step.get_seq_length(module.layer_idx))  # [Tm]
    return (query * (scale(step.q_pos[:, -tm:]) / used)[:, None, :, None]).to(query.dtype)


def _paged(step: PagedStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
           chunk: int | None = None) -> torch.Tensor:
    """Attention over each span's blocks, block by block (shapes in the module docstring)."""
    b_all, hq, tm, d = query.shape
    hkv, dv = key.shape[1], value.shape[3]
    g = hq // hkv
    if sinks is not None:  # [1 or B, H_kv, G, 1] in fp32, beside the scores' [., H_kv, G, Tm]
        sinks = sinks.float().reshape(-1, hkv, g, 1)
    out = None if len(step.spans) == 1 else query.new_empty(b_all, tm, hq, dv)
    for i, (rows, lo, hi, meta, extra) in enumerate(step.spans):
        q = query if out is None else query[rows]
        n, nb, nr = q.shape[0], meta.shape[1], hi - lo
        owner, owner_q = meta[0], meta[1]
        # Each block meets only its owner's queries: [nb, H_kv, G·Tm, D], the G heads of a key/value
        # head stacked on the query axis (K and V are never repeated).
        qb = q.reshape(n, hkv, g * tm, d).index_select(0, owner_q)
        scores = torch.matmul(qb[:nr], key[lo:hi].transpose(-1, -2))  # [nb, H_kv, G·Tm, bs]
        if extra is not None:  # blocks shared by several rows: once more per other holder
            scores = torch.cat([scores, torch.matmul(qb[nr:], key.index_select(0, extra).transpose(-1, -2))])
        scores.mul_(scale)
        if softcap:
            scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
        scores = _as(scores, torch.float32).view(nb, hkv, g, tm, -1)
        # A model may pass only the last queries (Gemma 4's KV-shared layers keep the logits' positions):
        # they are each row's last (left padding), so they take the last rows of the step's mask.
        blocked = step.blocked(i, window, chunk)
        scores.masked_fill_(blocked if blocked.shape[-2] == tm else blocked[..., -tm:, :], _NEG)
        # Softmax across the blocks of a row: the row's max, then its sum (one scatter each).
        top = scores.amax(-1)  # [nb, H_kv, G, Tm]
        row_max = top.new_full((n + 1, hkv, g, tm), _NEG).scatter_reduce_(
            0, owner.view(-1, 1, 1, 1).expand_as(top), top, "amax")
        sink = None
        if sinks is not None:  # one more logit per row and head, in the max and the sum
            sink = sinks if sinks.shape[0] == 1 else torch.cat([sinks[rows], sinks.new_full(sinks[:1].shape, _NEG)])
            row_max = torch.maximum(row_max, sink)
        e = torch.exp(scores - row_max.index_select(0, owner).unsqueeze(-1))
        den = top.new_zeros(n + 1, hkv, g, tm).index_add_(0, owner, e.sum(-1))
        if sink is not None:
            den += torch.exp(sink - row_max)
        e = _as(e.view(nb, hkv, g * tm, -1), value.dtype)
        part = torch.matmul(e[:nr], value[lo:hi])  # [nb, H_kv, G·Tm, Dv]
        if extra is not None:
            part = torch.cat([part, torch.matmul(e[nr:], value.index_select(0, extra))])
        num = part.new_zeros(n + 1, hkv, g * tm, dv, dtype=torch.float32).index_add_(0, owner, _as(part, torch.float32))
        # A real row's sum is >= 1 (its max term is exp(0)); the clamp only keeps rows that see no
        # key at all (CUDA-graph padding) at 0 instead of NaN.
        o = _as(num[:n] / den[:n].clamp_min(1e-30).view(n, hkv, g * tm, 1), query.dtype)
        # contiguous: models view the output as [B, Tm, H·Dv] (AFMoE), which a permuted view cannot give
        o = o.view(n, hkv, g, tm, dv).permute(0, 3, 1, 2, 4).reshape(n, tm, hq, dv).contiguous()
        if out is None:
            return o
        out[rows] = o
    return out


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _unbound(module, query, key, value, attention_mask, scale, window, softcap, sinks=None, **kwargs):
    """Dense ``key``/``value`` ``[B, H_kv, S, D]`` with a transformers mask: SDPA, or the same math
    as the paged path when soft-capping or with attention sinks (which SDPA lacks)."""
    if softcap is None and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scale,
                                      sliding_window=window, **kwargs)
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    # reshape, not view: the model hands over a transposed (non-contiguous) query outside a paged step
    scores = torch.matmul(query.reshape(b, hkv, g * t, d), key.transpose(-1, -2)).mul_(scale)
    if softcap:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores = scores.view(b, hkv, g, t, s)
    if attention_mask is None:  # transformers left the mask to SDPA's is_causal: bottom-right causal
        attention_mask = torch.ones(1, 1, t, s, dtype=torch.bool, device=query.device).tril(s - t)
    mask = attention_mask.reshape(attention_mask.shape[0], 1, 1, t, s)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:  # a last column per head, dropped after the softmax
        sink = sinks.to(scores.dtype).reshape(-1, hkv, g, 1, 1).expand(b, hkv, g, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :s].to(query.dtype).reshape(b, hkv, g * t, s)
    return torch.matmul(probs, value).view(b, hq, t, -1).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``deltazip_paged`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


def use_paged_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` to the paged attention when its class supports attention functions; returns
    whether it did (the engine then uses the paged KV cache, else the contiguous one)."""
    if not getattr(model, "_supports_attention_backend", False) or expands_cached_latents(model):
        return False
    register()
    model.set_attn_implementation(PAGED_ATTENTION)
    return True


def expands_cached_latents(model: torch.nn.Module) -> bool:
    """Multi-head latent attention: an attention module expands what the cache returns (``expand_kv``)."""
    return any(callable(getattr(m, "expand_kv", None)) for m in model.modules())


def is_paged(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == PAGED_ATTENTION
