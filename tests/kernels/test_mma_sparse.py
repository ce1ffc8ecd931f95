"""The compact 2:4 ``mma`` layout (``deltazip.kernels.mma_sparse``) the kernel's sparse MMA reads: packing,
stack writes and reads back against the reference (pure torch, no GPU). What the kernel's ``SP24`` code
reads from it is emulated in tests/kernels/test_mma_reads.py."""

from __future__ import annotations

import pytest
import torch
from _sbmm import make_delta

from deltazip.kernels import mma_sparse, preview, reference
from deltazip.kernels.scheme import DeltaScheme
from deltazip.kernels.stacked import StackedDeltas, compact_for, repack


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("out_f,in_f", [(64, 128), (100, 576), (130, 256), (64, 1000 - 1000 % 8)])
def test_pack_unpack_round_trip_with_padding(bits, out_f, in_f):
    gen = torch.Generator().manual_seed(bits + in_f)
    kept = torch.randint(0, 1 << bits, (out_f, in_f // 2), generator=gen)
    pos = mma_sparse.random_positions(out_f, in_f, gen)
    words = mma_sparse.pack(kept, pos, bits)
    assert words.dtype == torch.int32 and words.numel() == mma_sparse.slot_words(out_f, in_f, bits)
    k2, p2 = mma_sparse.unpack(words, bits, out_f, in_f)
    assert torch.equal(k2, kept) and torch.equal(p2, pos)
    with pytest.raises(ValueError, match="compact 2:4 layout holds"):
        mma_sparse.pack(kept, pos, 2)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_a_random_slot_holds_valid_metadata(bits):
    """What the launch checks and the bench fill compact stacks with: every group of four columns has two
    distinct ascending positions (equal ones are invalid metadata for the sparse MMA)."""
    words = mma_sparse.random_slot(bits, 96, 320, torch.Generator().manual_seed(bits))
    assert words.numel() == mma_sparse.slot_words(96, 320, bits)
    kept, pos = mma_sparse.unpack(words, bits, 96, 320)
    pairs = pos.reshape(96, -1, 2)
    assert bool((pairs[..., 0] < pairs[..., 1]).all()) and int(pos.max()) <= 3 and int(kept.max()) < 1 << bits


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group,in_f", [(32, 256), (64, 576), (128, 512), (-1, 640), (96, 576), (384, 1536)])
@pytest.mark.parametrize("asym", [False, True])
def test_a_compact_stack_reads_back_exactly_in_a_quarter_fewer_bytes(bits, group, in_f, asym):
    """Every slot reads back to its delta's reference weight, a partial-row write into a merged stack
    included; the code words take 3/4 (4 bits), 5/8 (8 bits) or 5/6 (3 bits) of the expanded layout's."""
    gen = torch.Generator().manual_seed(bits * 5 + in_f + asym)
    deltas = [make_delta(100, in_f, bits, group, True, asym, gen) for _ in range(2)]
    stack = repack(deltas, layout="mma", compact=True)
    expanded = repack(deltas, layout="mma", compact=False)
    assert stack.compact and not expanded.compact
    assert stack.qweight.numel() * {3: 6, 4: 8, 8: 16}[bits] == expanded.qweight.numel() * {3: 5, 4: 6, 8: 10}[bits]
    assert torch.equal(stack.scales, expanded.scales)
    for s, d in enumerate(deltas):
        assert torch.equal(stack.delta_weight(s), reference.delta_weight(d))
    top = make_delta(64, in_f, bits, group, True, asym, gen)
    stack.write(1, top, 0)
    want = torch.cat([reference.delta_weight(top), reference.delta_weight(deltas[1])[64:]])
    assert torch.equal(stack.delta_weight(1), want)
    assert torch.equal(stack.slots(1, 2).delta_weight(0), want)


def test_the_compact_layout_is_a_preview_for_the_configurations_that_have_one(monkeypatch):
    """Off unless ``DELTAZIP_CUDA_PREVIEW`` names ``sparse-mma`` (or ``all``); 2-bit, dense, and
    groups of 16 columns (a k32 step would span two groups) stay expanded; asking for it there fails."""
    monkeypatch.delenv(preview.ENV, raising=False)
    s4 = DeltaScheme(bits=4, group_size=128)
    assert not compact_for(s4, 4096)
    monkeypatch.setenv(preview.ENV, "sparse-mma")
    assert compact_for(s4, 4096) and compact_for(s4.replace(bits=8, group_size=32), 576)
    assert compact_for(s4.replace(bits=3), 4096)
    for s in (s4.replace(bits=2), s4.replace(sparsity="none"), s4.replace(group_size=16),
              s4.replace(group_size=48)):
        assert not compact_for(s, 4608)
        with pytest.raises(ValueError, match="no compact 2:4 layout"):
            compact_for(s, 4608, True)
    stack = StackedDeltas.allocate(2, s4, in_features=512, out_features=128, layout="mma")
    assert stack.compact and preview.used_by(stack) == ["sparse-mma"]
    assert stack.qweight.shape == (2, mma_sparse.slot_words(128, 512, 4))
    monkeypatch.setenv(preview.ENV, "padded-k")
    assert not StackedDeltas.allocate(2, s4, in_features=512, out_features=128, layout="mma").compact
