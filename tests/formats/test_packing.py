"""Bit packing and the 2:4 layout round-trip exactly."""

import pytest
import torch

from deltazip.formats.packing import compact_24, pack_delta, pack_int32
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight, expand_24, unpack_int32
from deltazip.kernels.scheme import DeltaScheme


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 128])
def test_pack_unpack_roundtrip(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 2**bits, (5, n), generator=g)
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (5, -(-n // (32 // bits)))
    assert torch.equal(unpack_int32(packed, bits, n), codes.int())


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_int32(torch.tensor([[16]]), 4)


def test_compact_expand_24_roundtrip():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(6, 32, generator=g)
    top = torch.topk(dense.abs().reshape(6, 8, 4), 2, dim=-1).indices
    mask = torch.zeros(6, 8, 4, dtype=torch.bool).scatter_(-1, top, True).reshape(6, 32)
    values, pos = compact_24(dense, mask)
    assert values.shape == (6, 16)
    p = pos.reshape(6, 8, 2)
    assert bool((p[..., 0] < p[..., 1]).all()), "kept positions ascend within a group"
    assert torch.equal(expand_24(values, pos, 32), torch.where(mask, dense, torch.zeros_like(dense)))


def test_compact_24_every_keep_pattern():
    """All sixteen patterns of a group of four: the six that keep two give their positions ascending
    and their values; the other ten (0, 1, 3 or 4 kept) are refused, alone among valid groups."""
    import itertools

    patterns = list(itertools.product([False, True], repeat=4))
    valid = [p for p in patterns if sum(p) == 2]
    dense = torch.arange(4 * len(valid), dtype=torch.float32).reshape(1, -1)
    values, pos = compact_24(dense, torch.tensor([x for p in valid for x in p]).reshape(1, -1))
    want = [i for p in valid for i in range(4) if p[i]]
    assert pos.reshape(-1).tolist() == want
    assert values.reshape(-1).tolist() == [4 * k + i for k, p in enumerate(valid) for i in range(4) if p[i]]
    for p in patterns:
        if sum(p) != 2:
            mask = torch.tensor([*valid[0], *p, *valid[5]]).reshape(1, 12)
            with pytest.raises(ValueError, match="not 2:4"):
                compact_24(torch.zeros(1, 12), mask)


def test_compact_rejects_non_24_mask():
    mask = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="not 2:4"):
        compact_24(torch.zeros(2, 8), mask)


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_pack_delta_dequantizes_to_grid(sparse, sym):
    g = torch.Generator().manual_seed(1)
    out_f, in_f, gs, bits = 8, 64, 16, 4
    codes = torch.randint(0, 16, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // gs, generator=g) + 0.01).half().float()
    zeros = None if sym else torch.randint(0, 16, (out_f, in_f // gs), generator=g).float()
    mask = None
    if sparse:
        top = torch.topk(torch.rand(out_f, in_f // 4, 4, generator=g), 2, dim=-1).indices
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, top, True).reshape(out_f, in_f)
    d = pack_delta(codes, scales, zeros, mask, bits, gs)
    z = torch.full_like(scales, 8.0) if sym else zeros
    want = scales.repeat_interleave(gs, 1) * (codes.float() - z.repeat_interleave(gs, 1))
    if sparse:
        want = torch.where(mask, want, torch.zeros_like(want))
        assert d.qweight.shape[1] * 8 == in_f // 2, "only kept values are stored under 2:4"
    assert torch.equal(delta_weight(d), want)


def test_validate_names_wrong_shape():
    d = PackedDelta(torch.zeros(4, 3, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.float16), None, None,
                    DeltaScheme(bits=4, group_size=-1, sparsity="none"), 32, 4)
    with pytest.raises(ValueError, match="qweight"):
        d.validate()
