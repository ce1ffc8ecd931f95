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


def test_min_p_and_top_k_keep_what_vllm_keeps():
    p = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    n = 20000
    logits = p.log().expand(n, 5)
    seeds, counters = torch.full((n,), 99), torch.arange(n)
    ones = torch.ones(n)

    def freq(top_k=None, min_p=None, top_p=1.0):
        toks = sample(logits, ones, torch.full((n,), top_p), seeds, counters, nucleus=True,
                      top_k=None if top_k is None else torch.full((n,), top_k), min_p=None if min_p is None else
                      torch.full((n,), min_p))
        return torch.bincount(toks, minlength=5).double() / n

    torch.testing.assert_close(freq(top_k=2), torch.tensor([4, 3, 0, 0, 0]).double() / 7, atol=0.015, rtol=0)
    # min_p 0.45: tokens at least 0.45 times as likely as the most likely (0.4 -> 0.18): 0.4, 0.3, 0.2
    torch.testing.assert_close(freq(min_p=0.45), torch.tensor([4, 3, 2, 0, 0]).double() / 9, atol=0.015, rtol=0)
    # top_p after top_k, on the renormalised top 3: 0.4/0.9 + 0.3/0.9 = 0.78 < 0.8, so the third stays
    torch.testing.assert_close(freq(top_k=3, top_p=0.8), torch.tensor([4, 3, 2, 0, 0]).double() / 9, atol=0.015, rtol=0)
    torch.testing.assert_close(freq(top_k=3, top_p=0.75), torch.tensor([4, 3, 0, 0, 0]).double() / 7, atol=0.015,
                               rtol=0)


def test_process_logits_applies_bias_bans_and_penalties_per_row():
    from deltazip.runtime.serve.engine import SamplingParams
    from deltazip.runtime.serve.sampling import process_logits, step_sampling

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 10, generator=g)
    plain = SamplingParams()
    st = step_sampling([plain] * 3, [0, 1, 2], [0, 0, 0], 10, "cpu")
    assert process_logits(logits, st) is logits  # nothing asked: not even a copy
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
              plain, SamplingParams(logit_bias={3: 4.0, 99: 1.0})]
    outputs, prompts = [[1, 1, 4], [2], [5]], [[7, 8], [9], [6]]
    st = step_sampling(params, [0, 1, 2], [3, 1, 1], 10, "cpu", outputs=outputs, prompts=prompts,
                       banned=[[], [0, 2], []])
    got = process_logits(logits, st)
    want = logits.clone()
    row = want[0]
    for t, c in ((1, 2), (4, 1)):
        row[t] -= 0.25 * c + 0.5
    for t in {1, 4, 7, 8}:
        row[t] = row[t] / 2.0 if row[t] > 0 else row[t] * 2.0
    want[1, [0, 2]] = float("-inf")
    want[2, 3] += 4.0  # token 99 lies outside the vocabulary: dropped
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)  # the model's logits are untouched (log probabilities read them)


def test_token_logprobs_are_the_raw_log_softmax_and_samples_get_distinct_seeds():
    from deltazip.runtime.serve.sampling import sample_seed, token_logprobs

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    rows, toks = torch.tensor([0, 2]), torch.tensor([7, 11])
    chosen, ids, top = token_logprobs(logits, rows, toks, 3)
    ref = torch.log_softmax(logits[rows], -1)
    torch.testing.assert_close(chosen, ref[[0, 1], [7, 11]])
    torch.testing.assert_close(top, ref.topk(3).values)
    assert torch.equal(ids, ref.topk(3).indices)
    seeds = [sample_seed(1234, i) for i in range(64)]
    assert seeds[0] == 1234 and len(set(seeds)) == 64 and seeds == [sample_seed(1234, i) for i in range(64)]
    assert all(0 <= s < 2**62 for s in seeds[1:])
