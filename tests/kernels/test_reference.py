"""Reference SBMM / LoRA math, the stacked layout and the dispatch fallback (pure torch).

The reference is checked against an explicit computation written here from the layout definition:
the dense delta ``W[o, c] = mask[o, c] * scale[o, c // group] * (code[o, c] - zero[o, c // group])``
built in float64 from the integer codes, and a per-row loop ``y[r] = x[r] @ W[idx[r]].T``.
"""

from __future__ import annotations

import pytest
import torch

from deltazip.formats.packing import pack_delta
from deltazip.kernels import dispatch, reference
from deltazip.kernels.stacked import StackedDeltas, config_key, repack

BITS = (2, 3, 4, 8)


def random_mask_24(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """bool ``[rows, cols]`` with exactly two True per group of four columns."""
    keep = torch.rand(rows, cols // 4, 4, generator=gen).argsort(-1)[..., :2]
    return torch.zeros(rows, cols // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(rows, cols)


def make_delta(out_f, in_f, bits, group, sparse, asym, gen):
    """A random PackedDelta plus the integer/fp16 parts it was packed from."""
    g = in_f if group == -1 else group
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen)
    scales = (torch.rand(out_f, in_f // g, generator=gen) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 2**bits, (out_f, in_f // g), generator=gen) if asym else None
    mask = random_mask_24(out_f, in_f, gen) if sparse else None
    return pack_delta(codes, scales, zeros, mask, bits, group), (codes, scales, zeros, mask)


def explicit_weight(parts, bits, group, in_f) -> torch.Tensor:
    """float64 ``[out, in]`` dense delta written straight from the layout definition."""
    codes, scales, zeros, mask = parts
    g = in_f if group == -1 else group
    col_group = torch.arange(in_f) // g
    s = scales.double()[:, col_group]
    z = zeros.double()[:, col_group] if zeros is not None else torch.full_like(s, 2 ** (bits - 1))
    w = s * (codes.double() - z)
    return w * mask if mask is not None else w


def explicit_sbmm(x, index, weights) -> torch.Tensor:
    """float64 per-row loop: ``y[r] = x[r] @ W[index[r]].T``, zeros where the index is -1."""
    y = torch.zeros(x.shape[0], weights[0].shape[0], dtype=torch.float64)
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            y[r] = x[r].double() @ weights[i].T
    return y


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [-1, 16])
def test_delta_weight_matches_layout_definition(bits, sparse, asym, group):
    gen = torch.Generator().manual_seed(bits * 100 + sparse * 10 + asym + group)
    delta, parts = make_delta(12, 48, bits, group, sparse, asym, gen)
    w = reference.delta_weight(delta)
    assert w.dtype == torch.float32 and w.shape == (12, 48)
    torch.testing.assert_close(w.double(), explicit_weight(parts, bits, group, 48), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [-1, 16])
def test_sbmm_matches_explicit_rowwise_product(bits, sparse, asym, group):
    gen = torch.Generator().manual_seed(7 + bits * 100 + sparse * 10 + asym + group)
    made = [make_delta(20, 64, bits, group, sparse, asym, gen) for _ in range(3)]
    deltas = [d for d, _ in made]
    weights = [explicit_weight(p, bits, group, 64) for _, p in made]
    x = torch.randn(9, 64, generator=gen)
    index = torch.tensor([0, 2, -1, 2, 2, 0, -1, 2, 0])  # delta 1 has no rows
    y = reference.sbmm(x, index, deltas)
    want = explicit_sbmm(x, index, weights)
    assert y.dtype == torch.float32 and y.shape == (9, 20)
    # fp32 accumulation vs float64: bounded by a few fp32 eps of sum_k |x_k w_k|.
    mag = explicit_sbmm(x.abs(), index, [w.abs() for w in weights])
    assert torch.all((y.double() - want).abs() <= 1e-6 * mag + 1e-12)
    assert torch.all(y[index == -1] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sbmm_returns_x_dtype_rounded_from_fp32(dtype):
    gen = torch.Generator().manual_seed(3)
    made = [make_delta(16, 32, 4, 16, True, False, gen) for _ in range(2)]
    x = torch.randn(5, 32, generator=gen).to(dtype)
    index = torch.tensor([1, 0, 1, -1, 0])
    y = reference.sbmm(x, index, [d for d, _ in made])
    assert y.dtype == dtype
    want = explicit_sbmm(x.double(), index, [explicit_weight(p, 4, 16, 32) for _, p in made])
    torch.testing.assert_close(y, want.to(dtype), rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_sbmm_all_rows_without_delta_and_empty_batch():
    gen = torch.Generator().manual_seed(4)
    delta, _ = make_delta(8, 16, 2, -1, True, True, gen)
    x = torch.randn(3, 16, generator=gen).half()
    y = reference.sbmm(x, torch.full((3,), -1), [delta])
    assert y.shape == (3, 8) and y.dtype == torch.float16 and not y.any()
    assert reference.sbmm(x[:0], torch.zeros(0, dtype=torch.long), [delta]).shape == (0, 8)


def test_sbmm_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    d8, _ = make_delta(8, 16, 4, -1, False, False, gen)
    other, _ = make_delta(8, 32, 4, -1, False, False, gen)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"\[-1, 1\)"):
        reference.sbmm(x, torch.tensor([0, 1]), [d8])
    with pytest.raises(ValueError, match=r"\[-1, 1\)"):
        reference.sbmm(x, torch.tensor([0, -2]), [d8])
    with pytest.raises(ValueError, match="one entry per row"):
        reference.sbmm(x, torch.tensor([0]), [d8])
    with pytest.raises(ValueError, match="integer"):
        reference.sbmm(x, torch.tensor([0.0, 0.0]), [d8])
    with pytest.raises(ValueError, match="x must be"):
        reference.sbmm(torch.randn(2, 15), torch.tensor([0, 0]), [d8])
    with pytest.raises(ValueError, match="delta 1"):
        reference.sbmm(x, torch.tensor([0, 0]), [d8, other])
    with pytest.raises(ValueError, match="at least one"):
        reference.sbmm(x, torch.tensor([-1, -1]), [])


@pytest.mark.parametrize("sparse", [False, True])
def test_repack_stacks_the_canonical_parts_and_unstacks_views_of_them(sparse):
    gen = torch.Generator().manual_seed(6)
    deltas = [make_delta(24, 64, 4, 32, sparse, False, gen)[0] for _ in range(3)]
    stack = repack(deltas)
    assert stack.num_deltas == 3 and not stack.asymmetric and stack.sparse == sparse
    assert stack.layout == "canonical" and stack.qweight.shape == (3, *deltas[0].qweight.shape)
    assert stack.qweight.is_contiguous()
    assert stack.scales.shape == (3, 24, 2)
    assert stack.nbytes() == sum(d.nbytes() for d in deltas)
    for i, d in enumerate(deltas):
        back = stack.unstack(i)
        assert torch.equal(back.qweight, d.qweight) and torch.equal(back.scales, d.scales)
        assert back.qweight.data_ptr() == stack.qweight[i].data_ptr()  # a view of the slot, no copy
        assert back.zeros is None
        if sparse:
            assert torch.equal(back.positions, d.positions)
        assert torch.equal(stack.delta_weight(i), reference.delta_weight(d))
        # Slot i starts at element offset i * slot size of the one flat tensor.
        flat = stack.qweight.reshape(-1)
        per = stack.qweight[0].numel()
        assert torch.equal(flat[i * per:(i + 1) * per].reshape(24, -1), d.qweight)


def test_stack_of_symmetric_and_asymmetric_deltas_writes_implicit_zero_points():
    gen = torch.Generator().manual_seed(8)
    sym, _ = make_delta(16, 32, 2, 16, True, False, gen)
    asym, _ = make_delta(16, 32, 2, 16, True, True, gen)
    stack = repack([sym, asym])
    assert stack.asymmetric
    assert torch.all(stack.zeros[0] == 2)  # 2 ** (bits - 1)
    assert torch.equal(stack.delta_weight(0), reference.delta_weight(sym))
    assert torch.equal(stack.delta_weight(1), reference.delta_weight(asym))


def test_reference_sbmm_reads_a_stack_like_the_list():
    gen = torch.Generator().manual_seed(9)
    deltas = [make_delta(24, 48, b, 16, True, a, gen)[0] for b, a in [(4, False), (4, True), (4, False)]]
    x = torch.randn(7, 48, generator=gen).half()
    index = torch.tensor([2, 0, -1, 2, 1, 1, 0])
    assert torch.equal(reference.sbmm(x, index, repack(deltas)), reference.sbmm(x, index, deltas))


def test_stack_slots_and_config_checks():
    gen = torch.Generator().manual_seed(10)
    d4, _ = make_delta(16, 32, 4, 16, True, False, gen)
    d2, _ = make_delta(16, 32, 2, 16, True, False, gen)
    da, _ = make_delta(16, 32, 4, 16, True, True, gen)
    assert config_key(d4) != config_key(d2)
    with pytest.raises(ValueError, match="configuration"):
        repack([d4, d2])
    stack = StackedDeltas.allocate(3, bits=4, group_size=16, in_features=32, out_features=16,
                                   sparse=True, asymmetric=False)
    with pytest.raises(ValueError, match="asymmetric=True"):
        stack.write(0, da)
    with pytest.raises(IndexError):
        stack.write(3, d4)
    stack.write(2, d4)
    x = torch.randn(4, 32, generator=gen)
    index = torch.tensor([2, 0, 1, 2])
    y = reference.sbmm(x, index, stack)
    assert not y[1:3].any()  # never-written slots hold a zero delta (all scales 0)
    torch.testing.assert_close(y[[0, 3]], reference.sbmm(x[[0, 3]], torch.tensor([0, 0]), [d4]))
    with pytest.raises(ValueError, match="at least one slot"):
        StackedDeltas.allocate(0, bits=4, group_size=16, in_features=32, out_features=16,
                               sparse=True, asymmetric=False)


def make_lora(num, rank, in_f, out_f, gen, dtype=torch.float32):
    a = (torch.randn(num, rank, in_f, generator=gen) / in_f**0.5).to(dtype)
    b = (torch.randn(num, out_f, rank, generator=gen) / rank**0.5).to(dtype)
    scale = torch.rand(num, generator=gen) + 0.5
    return a, b, scale


def test_lora_matches_explicit_rowwise_product():
    gen = torch.Generator().manual_seed(11)
    a, b, scale = make_lora(4, 8, 32, 24, gen)
    x = torch.randn(10, 32, generator=gen)
    index = torch.tensor([3, -1, 0, 0, 3, 1, -1, 3, 0, 1])  # adapter 2 unused
    y = reference.lora_shrink_expand(x, index, a, b, scale)
    want = torch.zeros(10, 24, dtype=torch.float64)
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            want[r] = (x[r].double() @ a[i].double().T) @ b[i].double().T * float(scale[i])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    x16 = x.half()
    y16 = reference.lora_shrink_expand(x16, index, a, b, scale)
    assert y16.dtype == torch.float16
    want16 = torch.zeros(10, 24, dtype=torch.float64)
    for r, i in enumerate(index.tolist()):
        if i >= 0:
            want16[r] = (x16[r].double() @ a[i].double().T) @ b[i].double().T * float(scale[i])
    torch.testing.assert_close(y16, want16.half(), rtol=torch.finfo(torch.float16).eps, atol=1e-6)


def test_lora_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(12)
    a, b, scale = make_lora(2, 4, 16, 8, gen)
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="rank"):
        reference.lora_shrink_expand(x, torch.tensor([0, 1, -1]), a, b[:, :, :3], scale)
    with pytest.raises(ValueError, match="scale"):
        reference.lora_shrink_expand(x, torch.tensor([0, 1, -1]), a, b, scale[:1])
    with pytest.raises(ValueError, match=r"\[-1, 2\)"):
        reference.lora_shrink_expand(x, torch.tensor([0, 2, -1]), a, b, scale)


def test_dispatch_takes_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(13)
    deltas = [make_delta(16, 32, 4, 16, True, False, gen)[0] for _ in range(2)]
    x = torch.randn(4, 32, generator=gen).half()
    index = torch.tensor([1, -1, 0, 1])
    assert torch.equal(dispatch.sbmm(x, index, deltas), reference.sbmm(x, index, deltas))
    assert torch.equal(dispatch.sbmm(x, index, repack(deltas)), reference.sbmm(x, index, deltas))
    a, b, scale = make_lora(2, 4, 32, 16, gen)
    assert torch.equal(dispatch.lora(x, index, a, b, scale), reference.lora_shrink_expand(x, index, a, b, scale))
