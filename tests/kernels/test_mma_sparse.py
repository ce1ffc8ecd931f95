"""The compact 2:4 ``mma`` layout (``deltazip.kernels.mma_sparse``) the kernel's sparse MMA reads: packing,
stack writes and reads back against the reference, and what the kernel's ``SP24`` code reads from it,
emulated on CPU from the instruction's documented fragments (pure torch, no GPU)."""

from __future__ import annotations

import pytest
import torch
from _sbmm import make_delta

from deltazip.kernels import mma_layout, mma_sparse, preview, reference
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


def _thread_pair(t: torch.Tensor, bits: int, warp: int, lane: int, rr: int, j: int) -> tuple[int, int]:
    """The two codes of pair ``j`` of row half ``rr`` of a thread, read from tile ``t``'s words at the
    addresses the kernel's SP24 code reads (3 bits: the low-bit plane's word of the row half and the
    high-bit plane's word; else the thread's run of ``bits`` words)."""
    if bits == 3:
        lo = int(t[(warp * 32 + lane) * 2 + rr]) >> (2 * j)
        hi = int(t[256 + warp * 32 + lane]) >> (8 * rr + j)
        return (lo & 3) | ((hi & 1) << 2), ((lo >> 16) & 3) | (((hi >> 16) & 1) << 2)
    ppw, nwa = 16 // bits, bits // 2
    iw = rr * nwa + j // ppw
    v = int(t[(((iw // 4) * 4 + warp) * 32 + lane) * 4 + iw % 4]) >> (bits * (j % ppw))
    return v & ((1 << bits) - 1), (v >> 16) & ((1 << bits) - 1)


def _sp_fragments(words: torch.Tensor, bits: int, out_f: int, in_f: int) -> torch.Tensor:
    """Dense ``[OUTP, INP]`` codes as the kernel's SP24 loop hands them to ``mma.sp``, 0 where nothing
    is kept: per tile, warp and lane the code words and metadata at the addresses the kernel reads, the
    A fragment of the compressed 16 x 16 matrix (a0: row l, compressed columns 2q, 2q + 1; a2: + 8
    columns; a1, a3: row l + 8), and per k32 step the metadata of lane 4l + 2F + j for compressed columns
    8j .. 8j + 7 (selector F = step % 2; PTX ISA, sparse mma metadata 16832 f16)."""
    outp, inp = mma_layout.padded_rows(out_f), mma_layout.padded_cols(in_f)
    tw = mma_sparse.tile_words(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    dense = torch.full((outp, inp), -1, dtype=torch.int64)
    for nb in range(outp // 64):
        for kb in range(inp // 128):
            t = w[(nb * (inp // 128) + kb) * tw:][:tw]
            for warp in range(4):
                for s in range(4):  # k32 step
                    a_rows = {}  # (lane) -> [row half][pair h] -> (code e0, code e1)
                    for lane in range(32):
                        a_rows[lane] = [[_thread_pair(t, bits, warp, lane, rr, 2 * s + h) for h in range(2)]
                                        for rr in range(2)]
                    for lane in range(32):
                        grp, q = lane // 4, lane % 4
                        for rr in range(2):
                            for h in range(2):  # compressed columns 8h + 2q, 8h + 2q + 1: group 4h + q
                                meta_lane = 4 * grp + 2 * (s % 2) + h
                                meta = int(t[128 * bits + (warp * 32 + meta_lane) * 2 + s // 2])
                                half = (meta >> (16 * rr)) & 0xFFFF
                                row = nb * 64 + 16 * warp + 8 * rr + grp
                                for e in range(2):
                                    c = 2 * q + e  # compressed column within the 8 of this half
                                    p = (half >> (2 * c)) & 3
                                    col = kb * 128 + 32 * s + 16 * h + 4 * q + p
                                    assert dense[row, col] == -1, "two kept values at one position"
                                    dense[row, col] = a_rows[lane][rr][h][e]
    return dense


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group,in_f,asym", [(128, 256, False), (64, 576, True), (-1, 384, False)])
def test_what_the_sparse_mma_reads_is_the_delta(bits, group, in_f, asym):
    """The kernel's SP24 addressing plus the instruction's fragment and metadata layout put every kept
    code at its column (emulated lane by lane); every other column of the row's group of four is a
    pruned one, whose value is the zero point: the delta, column for column."""
    gen = torch.Generator().manual_seed(bits * 3 + in_f)
    out_f = 70
    delta = make_delta(out_f, in_f, bits, group, True, asym, gen)
    stack = repack([delta], layout="mma", compact=True)
    got = _sp_fragments(stack.qweight[0], bits, out_f, in_f)[:out_f, :in_f]
    want = mma_layout.dense_codes(delta)
    zp = mma_layout.zero_points(delta).repeat_interleave(delta.effective_group, dim=1)
    kept = got >= 0
    assert torch.equal(kept.reshape(out_f, -1, 4).sum(-1), torch.full((out_f, in_f // 4), 2))
    assert torch.equal(torch.where(kept, got, zp), want)


def _dequant_view(stack: StackedDeltas, slot: int) -> torch.Tensor:
    """fp32 ``[out, in]`` as the SP24 ``dz_dequant`` writes it: per thread and group of four columns, the
    metadata word of lane ``(lane & ~3) + 2 (s % 2) + h`` (word ``s // 2``) shifted by ``16 rr + 4 q``."""
    bits, out_f, in_f = stack.bits, stack.out_features, stack.in_features
    tw = mma_sparse.tile_words(bits)
    lg = mma_layout.layout_group(stack.group_size, in_f)
    w = stack.qweight[slot].to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(out_f, in_f)
    kts = mma_layout.k_tiles(in_f)
    for nb in range(mma_layout.padded_rows(out_f) // 64):
        for kt in range(kts):
            t = w[(nb * kts + kt) * tw:][:tw]
            for wi in range(4):
                for lane in range(32):
                    q = lane % 4
                    for rr in range(2):
                        m = nb * 64 + 16 * wi + 8 * rr + lane // 4
                        if m >= out_f:
                            continue
                        for j in range(8):
                            sj, h = j >> 1, j & 1
                            col = kt * 128 + 32 * sj + 16 * h + 4 * q
                            if col >= in_f:
                                continue
                            meta = int(t[128 * bits + (wi * 32 + (lane & ~3) + 2 * (sj & 1) + h) * 2 + (sj >> 1)])
                            meta >>= 16 * rr + 4 * q
                            sc = float(stack.scales[slot, col // lg, m])
                            z = (1 << (bits - 1)) if stack.zeros is None else float(stack.zeros[slot, col // lg, m])
                            c0, c1 = _thread_pair(t, bits, wi, lane, rr, j)
                            out[m, col + (meta & 3)] = (c0 - z) * sc
                            out[m, col + ((meta >> 2) & 3)] = (c1 - z) * sc
    return out


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_what_the_dense_dequantize_kernel_writes_is_the_delta(bits):
    gen = torch.Generator().manual_seed(bits)
    delta = make_delta(80, 576, bits, 64, True, True, gen)
    stack = repack([delta], layout="mma", compact=True)
    assert torch.allclose(_dequant_view(stack, 0), reference.delta_weight(delta), rtol=0, atol=1e-6)


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
