"""Row plans (``deltazip.kernels.row_plan``): the device builder and the host builder group rows alike."""

from __future__ import annotations

import pytest
import torch
from _sbmm import random_index

from deltazip.kernels.row_plan import group_rows, max_tiles, plan_rows


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_rows_covers_every_row_once_in_slot_order(block_m):
    gen = torch.Generator().manual_seed(block_m)
    num_slots = 6
    index = random_index(50, num_slots, gen, unused={2, 5}, minus_one=0.3)
    plan = group_rows(index, num_slots, block_m)
    assert plan.num_tiles == max_tiles(50, num_slots, block_m)
    assert torch.equal(plan.packed, torch.cat([plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end]))
    # Stable sort: slot order, then original row order; -1 rows last.
    key = torch.where(index < 0, num_slots, index)
    expect = sorted(range(50), key=lambda r: (int(key[r]), r))
    assert plan.perm.tolist() == expect
    assert plan.counts.tolist() == [int((index == s).sum()) for s in range(num_slots)]
    seen = []
    for t in range(plan.num_tiles):
        s, lo, hi = int(plan.tile_slot[t]), int(plan.tile_start[t]), int(plan.tile_end[t])
        if s < 0:
            continue
        rows = plan.perm[lo:min(hi, lo + block_m)].tolist()
        assert rows and all(int(index[r]) == s for r in rows)
        seen += rows
    assert sorted(seen) == sorted(r for r in range(50) if index[r] >= 0)


def test_group_rows_rejects_out_of_range_index():
    with pytest.raises((RuntimeError, IndexError)):
        group_rows(torch.tensor([0, 3]), 3)
    with pytest.raises((RuntimeError, IndexError)):
        group_rows(torch.tensor([0, -2]), 3)
    with pytest.raises(ValueError, match="integer"):
        group_rows(torch.tensor([0.0]), 3)


@pytest.mark.parametrize("slots", [[0, 0, 1, -1, 1, 2, 0], [-1, -1], [3] * 40 + [0] * 3 + [-1], []])
def test_host_plan_groups_rows_like_the_device_plan(slots):
    host = plan_rows(slots, 4, "cpu")
    dev = group_rows(torch.tensor(slots, dtype=torch.int64), 4, 16)
    assert torch.equal(host.perm, dev.perm)
    used = dev.tile_slot >= 0
    assert torch.equal(host.tile_slot, dev.tile_slot[used])
    assert torch.equal(host.tile_start, dev.tile_start[used])
    assert torch.equal(host.tile_end, dev.tile_end[used])
    assert torch.equal(host.packed, torch.cat([host.perm, host.tile_slot, host.tile_start, host.tile_end]))
    for s, rows in host.slot_rows.items():
        assert rows.tolist() == [i for i, v in enumerate(slots) if v == s]


def test_host_plan_refuses_slots_out_of_range():
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        plan_rows([0, 2], 2, "cpu")


def test_a_7b_decode_plan_has_one_tile_per_delta():
    index = torch.arange(64) % 16  # decode: 64 rows, 16 deltas, 4 rows each
    plan = group_rows(index, 16, block_m=16)
    assert plan.num_tiles == max_tiles(64, 16, 16) == 20
    assert int((plan.tile_slot >= 0).sum()) == 16
    assert plan_rows(index.tolist(), 16, "cpu").num_tiles == 16


def test_a_plans_bucket_and_counts_are_attributes_read_without_a_call():
    """A launch reads ``key``, ``num_tiles`` and ``slots_used`` on the hot path: plain attributes set when
    the plan is built, so a decode step's launch enters no function of this module."""
    import sys

    host, dev = plan_rows([0, 0, 1, -1, 1, 2, 0], 4, "cpu"), group_rows(torch.tensor([0, 3, 3]), 8, 16)
    assert (host.key, host.num_tiles, host.slots_used) == ((8, 4), 3, 3)
    assert (dev.key, dev.num_tiles, dev.slots_used) == ((4, 4), max_tiles(3, 8, 16), 3)  # the bound min(N, D)
    calls = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__") == "deltazip.kernels.row_plan":
            calls.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        read = [(p.key, p.num_tiles, p.slots_used) for p in (host, dev)]
    finally:
        sys.setprofile(None)
    assert calls == [] and len(read) == 2, calls
