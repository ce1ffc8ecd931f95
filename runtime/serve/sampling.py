"""Next-token sampling for a whole batch in one pass on the logits' device.

One engine step samples every row that reached the end of its prompt, in three stages, each a few
batched tensor operations whatever the batch (no Python loop over rows touches a tensor):

1. :func:`step_sampling` turns the rows' settings into a :class:`StepSampling`: device tensors, one
   entry per row. A setting no row of the step uses stays ``None`` and costs nothing.
2. :func:`process_logits` is **the one place where a step's logits are changed before sampling**:
   ``logit_bias``, tokens a row may not draw yet (EOS and ``stop_token_ids`` before ``min_tokens``),
   presence / frequency / repetition penalties, and last the token bitmasks of the rows under a
   grammar (``response_format``, forced tool calls: ``deltazip.runtime.serve.grammar``), one call
   over those rows.
3. :func:`sample` draws: greedy rows (``temperature == 0``) take the ``argmax`` (bit-identical to
   ``generate(do_sample=False)`` when nothing was changed); sampled rows divide by their temperature,
   keep the tokens that ``min_p``, ``top_k`` and ``top_p`` leave (in vLLM's order: min-p, then top-k,
   then the nucleus of what is left) and draw by inverting the cumulative distribution with one
   uniform number per row. The uniform comes from a counter-based hash of the row's seed and the
   index of the token being drawn, computed on the device: a request with a seed gets the same tokens
   whatever else shares its batch, and no per-request generator state lives on the host. Sample
   ``i`` of a request with ``n > 1`` draws with :func:`sample_seed` of (seed, i).

Log probabilities (:func:`token_logprobs`) are ``log_softmax`` of the logits as the model gave them,
before any of stage 2 (the grammar's mask included) and before temperature: what vLLM and OpenAI
report. Only the rows that ask for them are computed; when a row does, stage 2 changes a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's bound on top_logprobs / logprobs


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds) of int64 ``x`` in ``[0, 2^32)``.
    The multipliers stay below 2^31 so that products fit in int64 without wrapping."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x246CA68B) & _M32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float32 ``[B]`` in ``[0, 1)``, a function of (``seeds[b]``, ``counters[b]``) only (int64 ``[B]``)."""
    x = _mix32((counters + 0x632BE5AB) & _M32)
    x = _mix32(x ^ (seeds & _M32))
    x = _mix32(x ^ ((seeds >> 32) & _M32))
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` (``n``/``best_of`` > 1): sample 0
    keeps the request's seed, the others a splitmix64 hash of (seed, index) in ``[0, 2^62)``, so
    samples differ from each other and each is reproducible."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 2


# --------------------------------------------------------------------------------------------------
# A step's settings as tensors
# --------------------------------------------------------------------------------------------------


@dataclass
class Penalties:
    """Presence / frequency / repetition penalties of the rows ``rows`` ``[R]`` that use any.

    ``output_ids`` ``[R, L]`` (padded with ``V``, a column past the vocabulary that is dropped) are
    the tokens each row generated; ``seen_ids`` ``[R, L']`` (same padding, or None when no row uses a
    repetition penalty) its prompt and generated tokens. ``presence``, ``frequency``, ``repetition``
    are ``[R]`` fp32 (0, 0 and 1 mean off)."""

    rows: torch.Tensor
    output_ids: torch.Tensor
    seen_ids: torch.Tensor | None
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass
class StepSampling:
    """One step's sampling settings, one entry per sampled row, on the logits' device.

    Attributes:
        temperature, top_p, min_p: fp32 ``[B]`` (``min_p`` None when no row uses it).
        top_k: int64 ``[B]`` (``V`` where off), None when no row uses it.
        seeds, counters: int64 ``[B]``: the row's seed and the index of the token being drawn.
        greedy: every row is greedy (sampling is one ``argmax``).
        bias: ``(rows, token ids, values)`` int64/int64/fp32 ``[N]``: ``logit_bias`` entries, or None.
        banned: ``(rows, token ids)`` int64 ``[N]``: tokens set to ``-inf`` this step, or None.
        penalties: :class:`Penalties`, or None.
        grammar: the token masks of the rows under a grammar (``grammar.RowMasks``: ``apply(logits)``
            masks them in place), or None; set by the engine.
        logprob_rows: int64 ``[R]``, the rows whose log probabilities are wanted, or None.
        top_logprobs: how many alternatives those rows get (the largest any asked for).
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor
    greedy: bool
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    grammar: Any = None
    logprob_rows: torch.Tensor | None = None
    top_logprobs: int = 0

    @property
    def changes_logits(self) -> bool:
        return self.bias is not None or self.banned is not None or self.penalties is not None or self.grammar is not None


def step_sampling(params: list[Any], seeds: list[int], counters: list[int], vocab: int, device,
                  outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
                  banned: list[list[int]] | None = None, logprobs: list[int | None] | None = None) -> StepSampling:
    """A :class:`StepSampling` for rows with settings ``params`` (objects with the fields of the
    engine's ``SamplingParams``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``,
    ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``).

    Args:
        seeds, counters: per row, its seed and how many tokens it has drawn.
        vocab: ``V``, the logits' width (token ids outside it are dropped from biases and bans).
        outputs, prompts: per row, its generated and prompt tokens (read only for rows with penalties).
        banned: per row, the token ids it may not draw this step (None: none).
        logprobs: per row, how many top alternatives it wants with its token's log probability
            (None: no log probabilities).
    """
    temp = [p.temperature for p in params]
    floats = [temp, [p.top_p for p in params]]
    use_min_p = any(p.min_p > 0 for p in params)
    if use_min_p:
        floats.append([p.min_p for p in params])
    ints = [seeds, counters]
    use_top_k = any(p.top_k > 0 for p in params)
    if use_top_k:
        ints.append([p.top_k if p.top_k > 0 else vocab for p in params])
    f = torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True)
    i = torch.tensor(ints, dtype=torch.int64).to(device, non_blocking=True)
    out = StepSampling(temperature=f[0], top_p=f[1], seeds=i[0], counters=i[1], greedy=all(t == 0 for t in temp),
                       min_p=f[2] if use_min_p else None, top_k=i[2] if use_top_k else None)
    out.bias = _bias(params, vocab, device)
    if banned is not None and any(banned):
        pairs = [(r, t) for r, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
        if pairs:
            out.banned = tuple(torch.tensor(pairs, dtype=torch.int64).t().to(device).unbind(0))
    out.penalties = _penalties(params, vocab, device, outputs, prompts)
    if logprobs is not None and any(k is not None for k in logprobs):
        rows = [r for r, k in enumerate(logprobs) if k is not None]
        out.logprob_rows = torch.tensor(rows, dtype=torch.int64).to(device)
        out.top_logprobs = max(logprobs[r] for r in rows)
    return out


def _bias(params: list[Any], vocab: int, device) -> tuple[torch.Tensor, ...] | None:
    if not any(p.logit_bias for p in params):
        return None
    rows, cols, vals = [], [], []
    for r, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            if 0 <= t < vocab:
                rows.append(r)
                cols.append(t)
                vals.append(v)
    if not rows:
        return None
    idx = torch.tensor([rows, cols], dtype=torch.int64).to(device)
    return idx[0], idx[1], torch.tensor(vals, dtype=torch.float32).to(device)


def _penalties(params: list[Any], vocab: int, device, outputs, prompts) -> Penalties | None:
    rows = [r for r, p in enumerate(params)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0]
    if not rows:
        return None
    rep = any(params[r].repetition_penalty != 1.0 for r in rows)
    outs = [outputs[r] for r in rows]
    seen = [prompts[r] + outputs[r] for r in rows] if rep else None
    f = torch.tensor([[params[r].presence_penalty for r in rows], [params[r].frequency_penalty for r in rows],
                      [params[r].repetition_penalty for r in rows]], dtype=torch.float32).to(device)
    return Penalties(rows=torch.tensor(rows, dtype=torch.int64).to(device), output_ids=_padded(outs, vocab, device),
                     seen_ids=_padded(seen, vocab, device) if rep else None, presence=f[0], frequency=f[1],
                     repetition=f[2])


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    """int64 ``[R, max(1, longest)]``, each list padded on the right with ``pad``."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.int64).to(device)


# --------------------------------------------------------------------------------------------------
# Stage 2: the step's logits, changed in one place
# --------------------------------------------------------------------------------------------------


def process_logits(logits: torch.Tensor, s: StepSampling, inplace: bool = False) -> torch.Tensor:
    """The logits ``[B, V]`` fp32 the step samples from: ``logits`` itself when no row changes
    anything, else a changed copy (the model's logits stay as they were, for log probabilities), or
    ``logits`` changed in place with ``inplace`` (the caller reads nothing else from them).

    In order: ``logit_bias``, banned tokens (``-inf``), then presence / frequency / repetition
    penalties (vLLM's order), and last the grammar masks of the constrained rows."""
    if not s.changes_logits:
        return logits
    with torch.inference_mode():  # a forward's logits are inference tensors: changed in place only in this mode
        out = logits if inplace else logits.clone()
        if s.bias is not None:
            out.index_put_((s.bias[0], s.bias[1]), s.bias[2], accumulate=True)
        if s.banned is not None:
            out.index_put_(s.banned, torch.tensor(float("-inf"), device=out.device))
        if s.penalties is not None:
            _apply_penalties(out, s.penalties)
        if s.grammar is not None:
            s.grammar.apply(out)
    return out


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place on the rows ``p.rows`` of ``logits [B, V]`` (vLLM's definitions): frequency and
    presence subtract ``f · count`` and ``p · [count > 0]`` of the row's generated tokens; repetition
    divides positive logits and multiplies negative ones by ``r`` for tokens of the prompt or output."""
    b, v = len(p.rows), logits.shape[1]
    sub = logits.index_select(0, p.rows)
    counts = torch.zeros(b, v + 1, dtype=sub.dtype, device=sub.device)
    counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=sub.dtype))
    counts = counts[:, :v]
    sub -= p.frequency.unsqueeze(1) * counts + p.presence.unsqueeze(1) * (counts > 0).to(sub.dtype)
    if p.seen_ids is not None:
        seen = torch.zeros(b, v + 1, dtype=torch.bool, device=sub.device)
        seen.scatter_(1, p.seen_ids, True)
        r = p.repetition.unsqueeze(1)
        sub = torch.where(seen[:, :v], torch.where(sub > 0, sub / r, sub * r), sub)
    logits.index_copy_(0, p.rows, sub)


# --------------------------------------------------------------------------------------------------
# Stage 3: the draw
# --------------------------------------------------------------------------------------------------


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
           counters: torch.Tensor, nucleus: bool = True, top_k: torch.Tensor | None = None,
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids ``[B]`` (int64) for ``logits [B, V]`` (fp32); all other arguments are ``[B]`` on the
    same device. ``temperature == 0`` rows are greedy. ``nucleus=False`` (every ``top_p`` is 1, no
    ``top_k``/``min_p``) skips the sort. Nothing here waits for the device."""
    greedy = temperature == 0
    best = logits.argmax(dim=-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
    u = uniforms(seeds, counters).unsqueeze(1)
    if nucleus or top_k is not None or min_p is not None:
        sp, order = probs.sort(dim=-1, descending=True)
        sp = _truncate(sp, top_p, top_k, min_p)
        cdf = sp.cumsum(-1)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
        drawn = order.gather(1, pick).squeeze(1)
    else:
        cdf = probs.cumsum(-1)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)
    return torch.where(greedy, best, drawn)


def _truncate(sp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor | None,
              min_p: torch.Tensor | None) -> torch.Tensor:
    """Sorted probabilities ``sp [B, V]`` (descending) with the tokens ``min_p``, then ``top_k``, then
    ``top_p`` drop set to 0. Each keeps a prefix of the order, and the first token always stays."""
    keep = None
    if min_p is not None:
        keep = sp >= (min_p.unsqueeze(1) * sp[:, :1])
    if top_k is not None:
        rank = torch.arange(sp.shape[1], device=sp.device).unsqueeze(0)
        k_keep = rank < top_k.unsqueeze(1)
        keep = k_keep if keep is None else keep & k_keep
    cum = None
    if keep is not None:
        sp = sp.masked_fill(~keep, 0.0)
        cum = sp.cumsum(-1)
    # The nucleus of what is left: the smallest prefix whose renormalised mass reaches top_p (the
    # whole distribution sums to 1 already when nothing was dropped).
    mass = top_p.unsqueeze(1) if cum is None else top_p.unsqueeze(1) * cum[:, -1:]
    cum = sp.cumsum(-1) if cum is None else cum
    return sp.masked_fill((cum - sp) >= mass, 0.0)


def sample_step(logits: torch.Tensor, s: StepSampling) -> torch.Tensor:
    """Token ids ``[B]`` for processed ``logits [B, V]`` under the step's settings."""
    if s.greedy:
        return logits.argmax(dim=-1)
    nucleus = s.top_k is not None or s.min_p is not None or bool((s.top_p < 1).any())
    return sample(logits, s.temperature, s.top_p, s.seeds, s.counters, nucleus=nucleus, top_k=s.top_k,
                  min_p=s.min_p)


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], seeds: list[int],
                  counters: list[int]) -> list[int]:
    """:func:`sample` from per-row Python settings; one small upload and one read-back."""
    dev = logits.device
    if all(t == 0 for t in temperature):
        return logits.argmax(dim=-1).tolist()
    params = torch.tensor([temperature, top_p], dtype=torch.float32).to(dev, non_blocking=True)
    ints = torch.tensor([seeds, counters], dtype=torch.int64).to(dev, non_blocking=True)
    return sample(logits, params[0], params[1], ints[0], ints[1], nucleus=any(p < 1 for p in top_p)).tolist()


# --------------------------------------------------------------------------------------------------
# Log probabilities
# --------------------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log probabilities of ``tokens [R]`` under rows ``rows [R]`` of the model's ``logits [B, V]``,
    and each row's ``k`` most likely tokens: ``(logprob [R], top ids [R, k], top logprobs [R, k])``
    (``k`` may be 0). ``log_softmax`` in fp32 of the logits as given (before temperature and
    penalties)."""
    lsm = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
    chosen = lsm.gather(1, tokens.view(-1, 1)).squeeze(1)
    if k == 0:
        empty = lsm.new_empty(len(rows), 0)
        return chosen, empty.long(), empty
    top, ids = lsm.topk(k, dim=-1)
    return chosen, ids, top
