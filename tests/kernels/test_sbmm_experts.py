"""SBMM over routed (token, expert) pairs grouped by (slot, expert), against a loop over the pairs
(the CUDA kernel's case is tests/runtime/serve/test_moe_serving.py's GPU test)."""

from __future__ import annotations

import pytest
import torch
from _sbmm import make_delta, random_index

from deltazip.kernels import dispatch, reference
from deltazip.kernels.stacked import repack

SLOTS, EXPERTS, OUT, IN = 3, 4, 32, 64


def _case(seed, pairs=40, bits=4, sparse=False):
    gen = torch.Generator().manual_seed(seed)
    # entry s * E + e: expert e of the variant in slot s; asymmetric and symmetric mixed
    deltas = [make_delta(OUT, IN, bits, 32, sparse, i % 3 == 0, gen) for i in range(SLOTS * EXPERTS)]
    slot = random_index(pairs, SLOTS, gen, unused={1}, minus_one=0.25)
    expert = torch.randint(0, EXPERTS, (pairs,), generator=gen)
    x = torch.randn(pairs, IN, generator=gen)
    return deltas, slot, expert, x


def _loop(x, slot, expert, deltas):
    """One pair at a time: ``x[p] @ Δ(slot[p], expert[p]).T`` (fp32), zeros for base pairs."""
    y = torch.zeros(x.shape[0], OUT)
    for p, (s, e) in enumerate(zip(slot.tolist(), expert.tolist())):
        if s >= 0:
            y[p] = x[p] @ reference.delta_weight(deltas[s * EXPERTS + e]).T
    return y


def _magnitude(x, slot, expert, deltas):
    mag = torch.zeros(x.shape[0], OUT)
    for p, (s, e) in enumerate(zip(slot.tolist(), expert.tolist())):
        if s >= 0:
            mag[p] = x[p].abs() @ reference.delta_weight(deltas[s * EXPERTS + e]).abs().T
    return mag


def test_expert_groups_number_slot_major_and_mark_base_pairs():
    slot = torch.tensor([0, -1, 2, 1, 2])
    expert = torch.tensor([3, 1, 0, 2, 3])
    assert reference.expert_groups(slot, expert, 4).tolist() == [3, -1, 8, 6, 11]
    with pytest.raises(ValueError, match="same length"):
        reference.expert_groups(slot, expert[:3], 4)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "2:4"])
def test_grouped_product_equals_the_per_pair_loop(sparse):
    deltas, slot, expert, x = _case(1 + sparse, sparse=sparse)
    want = _loop(x, slot, expert, deltas)
    assert want[slot >= 0].abs().sum() > 0
    got_list = reference.sbmm_experts(x, slot, expert, deltas, EXPERTS)
    got_stack = dispatch.sbmm_experts(x, slot, expert, repack(deltas, layout="canonical"), EXPERTS)
    for got in (got_list, got_stack):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not got[slot == -1].any()
