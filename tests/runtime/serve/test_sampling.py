"""Batched on-device sampling: greedy is argmax, seeded draws are reproducible per request whatever
the batch, and the draws follow the temperature / top-p distribution."""

from __future__ import annotations

import torch

from deltazip.runtime.serve.sampling import sample, sample_tokens, uniforms


def test_greedy_rows_are_the_argmax_bit_for_bit_in_a_mixed_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1).tolist()
    assert sample_tokens(logits, [0.0] * 6, [1.0] * 6, list(range(6)), [0] * 6) == best
    mixed = sample_tokens(logits, [0.0, 1.0, 0.0, 0.7, 0.0, 2.0], [1.0, 0.5, 0.3, 1.0, 1.0, 0.9], list(range(6)),
                          [3] * 6)
    assert [mixed[i] for i in (0, 2, 4)] == [best[i] for i in (0, 2, 4)]


def test_seeded_draws_depend_on_seed_and_token_index_only():
    g = torch.Generator().manual_seed(1)
    row = torch.randn(1, 50, generator=g)
    alone = [sample_tokens(row, [1.0], [0.9], [7], [i])[0] for i in range(30)]
    batch = torch.cat([torch.randn(2, 50, generator=g), row, torch.randn(1, 50, generator=g)])
    in_batch = [sample_tokens(batch, [0.0, 1.3, 1.0, 0.5], [1.0, 0.5, 0.9, 1.0], [3, 7, 7, 9], [i, 5, i, 0])[2]
                for i in range(30)]
    assert alone == in_batch
    other = [sample_tokens(row, [1.0], [0.9], [8], [i])[0] for i in range(30)]
    assert other != alone and len(set(alone)) > 3  # a different seed draws differently; draws vary per token
    big = torch.tensor([2**40 + 5, -3])  # 64-bit and negative seeds hash fine
    u = uniforms(big, torch.tensor([0, 0]))
    assert bool(((u >= 0) & (u < 1)).all())


def test_draws_follow_temperature_and_top_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = p.log().expand(n, 4)
    seeds, counters = torch.full((n,), 1234), torch.arange(n)

    def freq(temperature, top_p):
        toks = sample(logits, torch.full((n,), temperature), torch.full((n,), top_p), seeds, counters,
                      nucleus=top_p < 1)
        return torch.bincount(toks, minlength=4).double() / n

    torch.testing.assert_close(freq(1.0, 1.0), p.double(), atol=0.015, rtol=0)
    torch.testing.assert_close(freq(1.0, 0.7), torch.tensor([0.5, 0.3, 0, 0]).double() / 0.8, atol=0.015, rtol=0)
    sharp = p.double() ** 2 / (p.double() ** 2).sum()  # temperature 0.5: p^(1/T), renormalised
    torch.testing.assert_close(freq(0.5, 1.0), sharp, atol=0.015, rtol=0)
    assert freq(1.0, 0.3)[0] == 1.0  # the nucleus always keeps the most likely token
