"""Next-token sampling for a whole batch in one pass on the logits' device.

Greedy rows take ``argmax`` of the logits as they come (bit-identical to ``generate(do_sample=False)``);
sampled rows divide by their temperature, keep their top-p nucleus and draw by inverting the
cumulative distribution with one uniform number per row. The uniform comes from a counter-based
hash of the request's seed and the index of the token being drawn, computed on the device: a
request with a seed gets the same tokens whatever else shares its batch, and no per-request
generator state has to live on the host.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
           counters: torch.Tensor, nucleus: bool = True) -> torch.Tensor:
    """Token ids ``[B]`` (int64) for ``logits [B, V]`` (fp32); all other arguments are ``[B]`` on the
    same device. ``temperature == 0`` rows are greedy. ``nucleus=False`` (every ``top_p`` is 1)
    skips the sort. Nothing here waits for the device."""
    greedy = temperature == 0
    best = logits.argmax(dim=-1)
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / t.unsqueeze(1), dim=-1)
    u = uniforms(seeds, counters).unsqueeze(1)
    if nucleus:
        sp, order = probs.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p.unsqueeze(1)  # the first token is always kept
        sp = sp.masked_fill(~keep, 0.0)
        cdf = sp.cumsum(-1)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
        drawn = order.gather(1, pick).squeeze(1)
    else:
        cdf = probs.cumsum(-1)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)
    return torch.where(greedy, best, drawn)


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float], seeds: list[int],
                  counters: list[int]) -> list[int]:
    """:func:`sample` from per-row Python settings; one small upload and one read-back."""
    dev = logits.device
    if all(t == 0 for t in temperature):
        return logits.argmax(dim=-1).tolist()
    params = torch.tensor([temperature, top_p], dtype=torch.float32).to(dev, non_blocking=True)
    ints = torch.tensor([seeds, counters], dtype=torch.int64).to(dev, non_blocking=True)
    return sample(logits, params[0], params[1], ints[0], ints[1], nucleus=any(p < 1 for p in top_p)).tolist()
