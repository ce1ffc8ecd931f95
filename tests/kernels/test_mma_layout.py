"""The ``mma`` layout (``deltazip.kernels.mma_layout``) the CUDA kernel reads: packing, the index map,
stack writes and reads back, all against the reference (pure torch, no GPU)."""

from __future__ import annotations

import pytest
import torch
from _sbmm import make_delta

from deltazip.kernels import mma_layout, reference
from deltazip.kernels.stacked import StackedDeltas, choose_layout, repack


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_roundtrip_pads_rows(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (100, 256), generator=gen)
    words = mma_layout.pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.numel() == mma_layout.slot_words(100, 256, bits)
    assert words.numel() == 128 * 256 * bits // 32  # rows padded to 128
    assert torch.equal(mma_layout.unpack_codes(words, bits, 100, 256), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_code_lands_where_the_docstring_says(bits):
    """One non-zero code at (n, k) must sit at the word and bit of mma_layout's index map."""
    out_f, in_f = 192, 384
    for n, k in [(0, 0), (37, 77), (191, 383), (64 + 9, 128 + 50)]:
        codes = torch.zeros(out_f, in_f, dtype=torch.int64)
        codes[n, k] = 1
        words = mma_layout.pack_codes(codes, bits)
        nb, r = divmod(n, 64)
        w, rr, lane = r // 16, (r // 8) % 2, r % 8
        kb, kk = divmod(k, 128)
        c, b, h, q, e = kk // 32, (kk // 16) % 2, (kk // 8) % 2, (kk // 2) % 4, kk % 2
        j = 4 * c + 2 * b + h
        ppw, run = 16 // bits, min(bits, 4)
        iw = j // ppw
        hv, v = divmod(iw, run)
        tile = (nb * (in_f // 128) + kb) * 64 * 128 * bits // 32
        word = tile + hv * 256 * run + (((rr * 4 + w) * 8 + lane) * 4 + q) * run + v
        bit = 16 * e + bits * (j % ppw)
        assert words.nonzero().flatten().tolist() == [word]
        assert int(words[word]) & 0xFFFFFFFF == 1 << bit


def test_a_3_bit_code_lands_in_both_bit_planes_where_the_docstring_says():
    """3-bit codes: the low two bits at the 2-bit layout's word and bit in the tile's first 512 words,
    the high bit at bit ``16 e + j`` of the thread-row's word in the 1-bit plane that follows (word
    ``512 + ((rr * 4 + w) * 8 + l) * 4 + q`` of the tile)."""
    out_f, in_f = 128, 256
    for n, k, code in [(0, 0, 7), (37, 77, 5), (127, 255, 6), (64 + 9, 128 + 50, 4), (3, 9, 3)]:
        codes = torch.zeros(out_f, in_f, dtype=torch.int64)
        codes[n, k] = code
        words = mma_layout.pack_codes(codes, 3)
        nb, r = divmod(n, 64)
        w, rr, lane = r // 16, (r // 8) % 2, r % 8
        kb, kk = divmod(k, 128)
        c, b, h, q, e = kk // 32, (kk // 16) % 2, (kk // 8) % 2, (kk // 2) % 4, kk % 2
        j = 4 * c + 2 * b + h
        tile = (nb * (in_f // 128) + kb) * 768
        lo_word = tile + (((rr * 4 + w) * 8 + lane) * 4 + q) * 2 + j // 8
        hi_word = tile + 512 + ((rr * 4 + w) * 8 + lane) * 4 + q
        want = {}
        if code & 3:
            want[lo_word] = (code & 3) << (16 * e + 2 * (j % 8))
        if code >> 2:
            want[hi_word] = 1 << (16 * e + j)
        got = {i: int(words[i]) & 0xFFFFFFFF for i in words.nonzero().flatten().tolist()}
        assert got == want, (n, k, code)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("asym", [False, True])
def test_dense_codes_dequantize_to_the_reference(sparse, asym):
    gen = torch.Generator().manual_seed(3)
    d = make_delta(40, 256, 4, 64, sparse, asym, gen)
    codes = mma_layout.dense_codes(d)
    zp = mma_layout.zero_points(d).repeat_interleave(64, dim=1)
    scales = d.scales.float().repeat_interleave(64, dim=1)
    assert torch.equal(scales * (codes - zp).float(), reference.delta_weight(d))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse", [True, False])
def test_mma_stack_write_unstack(bits, sparse):
    gen = torch.Generator().manual_seed(10 * bits + sparse)
    deltas = [make_delta(70, 256, bits, 128, sparse, s == 1, gen) for s in range(3)]
    stack = repack(deltas, layout="mma")
    assert stack.layout == "mma" and stack.sparse == sparse and stack.asymmetric and stack.positions is None
    assert stack.qweight.shape == (3, mma_layout.slot_words(70, 256, bits))
    assert stack.scales.shape == (3, 2, 128) and stack.zeros.dtype == torch.float16
    for s, d in enumerate(deltas):
        back = stack.unstack(s)
        back.validate()
        assert back.sparse == sparse
        assert torch.equal(reference.delta_weight(back), reference.delta_weight(d))
        if not sparse:  # dense codes come back exactly; 2:4 positions only up to equivalence
            assert torch.equal(back.qweight, d.qweight)
    moved = stack.to("cpu")
    assert moved.layout == "mma" and moved.sparse24 == stack.sparse24
    # nbytes: codes at `bits` bits per (dense) weight over padded rows, plus fp16 scales and zeros.
    assert stack.nbytes() == 3 * (128 * 256 * bits // 8 + 2 * 2 * 128 * 2)


def test_choose_layout(monkeypatch):
    kw = dict(bits=4, group_size=128, in_features=256)
    monkeypatch.delenv("DELTAZIP_SBMM_LAYOUT", raising=False)
    assert choose_layout("auto", device="cpu", **kw) == "canonical"  # the mma layout is for the CUDA kernel
    assert choose_layout("mma", device="cpu", **kw) == "mma"
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "mma")
    assert choose_layout("auto", device="cpu", **kw) == "mma"
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "canonical")
    assert choose_layout("auto", device="cpu", **kw) == "canonical"
    for bad in (dict(bits=6, group_size=128, in_features=256), dict(bits=4, group_size=24, in_features=384),
                dict(bits=2, group_size=200, in_features=1000), dict(bits=4, group_size=-1, in_features=100)):
        with pytest.raises(ValueError, match="no mma layout"):
            choose_layout("mma", device="cpu", **bad)
        for env in ("mma", "auto"):  # a preference, not an order
            monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", env)
            assert choose_layout("auto", device="cpu", **bad) == "canonical"
    with pytest.raises(ValueError, match="layout"):
        choose_layout("fancy", device="cpu", **kw)
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "fancy")
    with pytest.raises(ValueError, match="DELTAZIP_SBMM_LAYOUT"):
        choose_layout("auto", device="cpu", **kw)


@pytest.mark.parametrize("layout", ["mma", "canonical"])
def test_write_rows_builds_a_merged_stack_and_clear_rows_zeroes_a_member(layout):
    """Deltas of [64, in], [64, in] and [32, in] written at rows 0, 64, 128 of one [160, in] stack give
    the row-concatenated delta; clearing one member's rows leaves a zero delta there."""
    gen = torch.Generator().manual_seed(41)
    parts = [make_delta(o, 256, 4, 128, True, i == 1, gen) for i, o in enumerate((64, 64, 32))]
    stack = StackedDeltas.allocate(2, bits=4, group_size=128, in_features=256, out_features=160, sparse=True,
                                   asymmetric=True, layout=layout)
    for r0, d in zip((0, 64, 128), parts):
        stack.write(1, d, r0)
    want = torch.cat([reference.delta_weight(d) for d in parts])
    torch.testing.assert_close(stack.delta_weight(1), want, rtol=0, atol=0)
    stack.clear_rows(1, 64, 64)
    want[64:128] = 0
    torch.testing.assert_close(stack.delta_weight(1), want, rtol=0, atol=0)
    assert not stack.delta_weight(0).any()
    if layout == "mma":
        with pytest.raises(ValueError, match="multiple of 64"):
            stack.write(1, make_delta(32, 256, 4, 128, True, False, gen), 32)  # would share a 64-row tile
    with pytest.raises(ValueError, match="does not fit"):
        stack.write(1, parts[0], 128)  # past the last row


def test_7b_mlp_shapes_layout():
    """4096 x 11008 (down_proj) and 11008 x 4096 (gate/up): the layout's sizes."""
    for out_f, in_f in [(4096, 11008), (11008, 4096)]:
        if in_f % 128:
            assert not mma_layout.supported(4, 128, in_f)
            continue
        stack = StackedDeltas.allocate(2, bits=4, group_size=128, in_features=in_f, out_features=out_f,
                                       sparse=True, asymmetric=False, layout="mma")
        assert stack.qweight.shape == (2, out_f * in_f // 8)  # 4 bits per weight, rows already a multiple of 64
        assert stack.scales.shape == (2, in_f // 128, out_f)
        assert stack.nbytes() == 2 * out_f * in_f * (4 / 8 + 2 / 128)


# -------------------------------------------------- in_features not a multiple of 128: a padded last K tile

PADDED = [(bits, group, in_f) for bits in (2, 3, 4, 8) for group, in_f in ((64, 576), (32, 576), (-1, 576), (64, 320),
                                                                       (-1, 960), (32, 96), (16, 208))]


@pytest.mark.parametrize("bits,group,in_f", PADDED)
@pytest.mark.parametrize("sparse,asym", [(True, False), (False, True)])
def test_a_padded_last_k_tile_reads_back_exactly_and_adds_nothing(bits, group, in_f, sparse, asym):
    """576 columns (SmolLM2's hidden size) are 4.5 tiles: the layout holds 5, the padded columns code 0
    and, where a group is narrower than a tile, their groups scale 0 (what the kernel reads there, times
    the zero-filled activations, adds exactly 0); every slot reads back to its delta's reference weight,
    including a partial-row write into a merged stack."""
    gen = torch.Generator().manual_seed(bits * 31 + in_f)
    deltas = [make_delta(96, in_f, bits, group, sparse, asym, gen) for _ in range(2)]
    stack = repack(deltas, layout="mma")
    tiles, g = mma_layout.k_tiles(in_f), in_f if group == -1 else group
    assert tiles == -(-in_f // 128) and stack.qweight.shape == (2, 128 * tiles * 128 * bits // 32)
    groups = tiles * 128 // g if 128 % g == 0 else in_f // g
    assert stack.scales.shape == (2, groups, 128)
    for s, d in enumerate(deltas):
        assert torch.equal(stack.delta_weight(s), reference.delta_weight(d))
        full = mma_layout.unpack_codes(stack.qweight[s], bits, 96, tiles * 128)
        assert torch.equal(full[:, :in_f], mma_layout.dense_codes(d)) and not full[:, in_f:].any()
        assert not stack.scales[s, in_f // g:].any()  # the padded tile's own groups: scale 0
    top = make_delta(64, in_f, bits, group, sparse, asym, gen)
    stack.write(1, top, 0)  # rows 0..63 of slot 1 replaced, 64..95 kept
    want = torch.cat([reference.delta_weight(top), reference.delta_weight(deltas[1])[64:]])
    assert torch.equal(stack.delta_weight(1), want)


def test_a_padded_k_stack_takes_the_mma_layout_on_cuda_only_in_preview(monkeypatch):
    """Until the padded build passes parity on a GPU, a CUDA stack over 576 columns keeps the canonical
    layout (the reference reads it) unless DELTAZIP_CUDA_PREVIEW names padded-k; 4096 columns take the
    mma layout either way; a misspelt preview name is refused with the known ones."""
    from deltazip.kernels import preview

    monkeypatch.delenv(preview.ENV, raising=False)
    kw = dict(bits=4, group_size=64, device="cuda")
    assert choose_layout("auto", in_features=576, **kw) == "canonical"
    assert choose_layout("auto", in_features=4096, **kw) == "mma"
    monkeypatch.setenv(preview.ENV, "padded-k")
    assert choose_layout("auto", in_features=576, **kw) == "mma"
    monkeypatch.setenv(preview.ENV, "paded-k")
    with pytest.raises(ValueError, match="unknown preview path paded-k; use .*padded-k"):
        choose_layout("auto", in_features=576, **kw)
    monkeypatch.delenv(preview.ENV)
    assert not mma_layout.supported(4, -1, 580)  # not a multiple of 8: no 16-byte activation pieces
    gen = torch.Generator().manual_seed(0)
    padded = repack([make_delta(64, 576, 4, 64, True, False, gen)], layout="mma")
    whole = repack([make_delta(64, 512, 4, 64, True, False, gen)], layout="mma")
    flat = repack([make_delta(64, 576, 4, 64, True, False, gen)], layout="canonical")
    assert preview.used_by(padded) == ["padded-k"] and preview.used_by(whole) == preview.used_by(flat) == []


# ------------------------------- groups the kernel does not read whole: split into sub-groups (split-groups)

SPLIT = [(48, 960, 16), (96, 960, 32), (160, 960, 32), (192, 960, 64), (320, 960, 64), (96, 576, 32),
         (192, 1536, 64), (144, 1152, 16)]  # (group, in_features, the layout's sub-group)


def _kernel_view(stack: StackedDeltas, slot: int) -> torch.Tensor:
    """fp32 ``[out, in]`` weight as the kernel reads slot ``slot`` of an mma stack whose groups divide a
    tile: column ``k`` takes the codes at ``k`` and the scale and zero point of layout group ``k // lg``."""
    out_f, in_f, bits = stack.out_features, stack.in_features, stack.bits
    lg = mma_layout.layout_group(stack.group_size, in_f)
    codes = mma_layout.unpack_codes(stack.qweight[slot], bits, out_f, in_f).float()
    col_group = torch.arange(in_f) // lg
    scales = stack.scales[slot, col_group, :out_f].T.float()
    zeros = (torch.full_like(scales, 1 << (bits - 1)) if stack.zeros is None
             else stack.zeros[slot, col_group, :out_f].T.float())
    return scales * (codes - zeros)


@pytest.mark.parametrize("group,in_f,sub", SPLIT)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse,asym", [(True, False), (False, True)])
def test_a_group_the_kernel_does_not_read_whole_is_held_as_sub_groups_that_read_back_exactly(group, in_f, sub, bits,
                                                                                             sparse, asym):
    """Groups of 96 columns are 3 sub-groups of 32 in the layout (192: 3 of 64; 48: 3 of 16), each with its
    group's scale and zero point: what the kernel reads, column by column, is the reference weight bit
    for bit, a padded last tile's sub-groups scale 0, and the stack reads back to the canonical delta."""
    from deltazip.kernels import preview

    assert mma_layout.layout_group(group, in_f) == sub and mma_layout.split_groups(group, in_f) == group // sub
    assert mma_layout.group_params(group, in_f) == (sub // 16, 0)
    gen = torch.Generator().manual_seed(group * 7 + bits)
    deltas = [make_delta(80, in_f, bits, group, sparse, asym, gen) for _ in range(2)]
    stack = repack(deltas, layout="mma")
    assert stack.scales.shape == (2, mma_layout.padded_cols(in_f) // sub, 128)
    for s, d in enumerate(deltas):
        want = reference.delta_weight(d)
        assert torch.equal(_kernel_view(stack, s), want)
        assert torch.equal(stack.delta_weight(s), want)
        assert not stack.scales[s, in_f // sub:].any()  # the padded tile's sub-groups
        # each group's sub-groups hold one scale
        held = stack.scales[s, :in_f // sub, :80].T.reshape(80, in_f // group, group // sub)
        assert torch.equal(held, held[..., :1].expand_as(held))
    assert "split-groups" in preview.used_by(stack)


def test_groups_the_kernel_cannot_read_keep_the_reference_layout():
    """A 16-column mma step would span two groups of 24 (or 8, or 200): no mma layout, so the stack takes
    the canonical layout the reference reads, and an explicit mma layout is refused."""
    for group, in_f in ((24, 384), (8, 512), (200, 1000), (40, 960)):
        assert mma_layout.layout_group(group, in_f) is None and not mma_layout.supported(4, group, in_f)
        assert choose_layout("auto", bits=4, group_size=group, in_features=in_f, device="cuda") == "canonical"
    assert mma_layout.layout_group(-1, 1000) == 1000 and mma_layout.layout_group(384, 1536) == 384
