"""Triton SBMM / grouped LoRA against the reference, plus the device-side row grouping.

Without CUDA the parity tests run the kernels in the Triton interpreter at small sizes. Triton's own
``@jit`` library functions (``tl.zeros``, ...) are only interpretable when ``TRITON_INTERPRET=1`` is
set before ``triton`` is first imported, so this module sets it at import time on machines without
CUDA (``import torch`` does not import triton); the ``backend`` fixture skips with that reason if
triton was imported earlier by something else. With CUDA the same parity tests run natively on the
GPU, and the ``gpu`` tests add larger shapes and bf16 (skipped without a CUDA device).

Tolerance: ``assert_matches`` in tests/_sbmm.py. These tests drive the transposed kernel
(``triton_sbmm``, the ``transposed`` layout); tests/kernels/test_fast.py the fast one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see docstring)

from _sbmm import assert_matches, lora_magnitude, magnitude, make_delta, random_index  # noqa: E402

from deltazip.kernels import dispatch, reference
from deltazip.kernels.stacked import repack
from deltazip.kernels.triton_sbmm import (
    group_rows,
    lora_triton,
    max_tiles,
    sbmm_triton,
)


def check_sbmm(bits, group, sparse, asym, *, out_f, in_f, n, num_slots, dtype, gen, device="cpu", **kw):
    deltas = [make_delta(out_f, in_f, bits, group, sparse, asym and s % 2 == 0, gen) for s in range(num_slots)]
    unused = {1} if num_slots > 2 else set()  # a delta with zero rows in the batch
    index = random_index(n, num_slots, gen, unused=unused)
    x = torch.randn(n, in_f, generator=gen).to(dtype)
    stack = repack(deltas, device=device, layout="transposed")
    y = sbmm_triton(x.to(device), index.to(device), stack, **kw)
    ref = reference.sbmm(x, index, deltas)
    assert_matches(y.cpu(), ref, magnitude(x, index, [reference.delta_weight(d) for d in deltas]))
    assert not y[index.to(device) == -1].any()
    return y


# ------------------------------------------------------------------------------------------------
# row grouping (pure torch)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_rows_covers_every_row_once_in_slot_order(block_m):
    gen = torch.Generator().manual_seed(block_m)
    num_slots = 6
    index = random_index(50, num_slots, gen, unused={2, 5}, minus_one=0.3)
    plan = group_rows(index, num_slots, block_m)
    assert plan.num_tiles == max_tiles(50, num_slots, block_m)
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


# ------------------------------------------------------------------------------------------------
# parity with the reference: CPU interpreter, or natively when CUDA is present
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [-1, 32, 16, 8])
def test_sbmm_triton_matches_reference(backend, bits, sparse, asym, group):
    """Groups: -1 and 32 keep K tiles inside a group (scale per tile); 16 does too when dense (K tile
    16) but not under 2:4 (K tile >= 32); 8 always takes the per-element scale path."""
    gen = torch.Generator().manual_seed(1000 * bits + 100 * sparse + 10 * asym + group)
    out_f = int(torch.randint(17, 90, (1,), generator=gen))
    in_f = {-1: 96, 32: 160, 16: 80, 8: 40}[group]  # not multiples of the K tile: masked tails
    n = int(torch.randint(1, 40, (1,), generator=gen))
    check_sbmm(bits, group, sparse, asym, out_f=out_f, in_f=in_f, n=n, num_slots=4, dtype=torch.float16,
               gen=gen, device=backend)


@pytest.mark.parametrize("bits,sparse", [(4, True), (2, False), (3, True)])
def test_sbmm_triton_fp32(backend, bits, sparse):
    gen = torch.Generator().manual_seed(bits)
    check_sbmm(bits, 32, sparse, True, out_f=40, in_f=128, n=12, num_slots=3, dtype=torch.float32, gen=gen,
               device=backend)


def test_sbmm_triton_many_tiles_per_slot_and_shared_plan(backend):
    gen = torch.Generator().manual_seed(21)
    d4 = [make_delta(48, 64, 4, 32, True, False, gen) for _ in range(3)]
    d2 = [make_delta(24, 64, 2, -1, False, True, gen) for _ in range(3)]
    index = torch.tensor([0] * 37 + [2] * 5 + [-1] * 3)[torch.randperm(45, generator=gen)]
    x = torch.randn(45, 64, generator=gen).half()
    plan = group_rows(index.to(backend), 3, block_m=16)  # slot 0 spans three row tiles
    for deltas in (d4, d2):  # one plan serves every linear of a layer
        y = sbmm_triton(x.to(backend), index.to(backend), repack(deltas, device=backend, layout="transposed"), plan=plan)
        mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
        assert_matches(y.cpu(), reference.sbmm(x, index, deltas), mag)
    with pytest.raises(ValueError, match="plan was built"):
        sbmm_triton(x[:10].to(backend), index[:10].to(backend), repack(d4, device=backend, layout="transposed"), plan=plan)


def test_sbmm_triton_split_k_and_per_element_scales(backend):
    gen = torch.Generator().manual_seed(22)
    # split_k=3 accumulates partial K ranges with fp32 atomics.
    check_sbmm(4, 32, True, True, out_f=33, in_f=256, n=9, num_slots=3, dtype=torch.float16, gen=gen,
               device=backend, split_k=3, block_k=32)
    # block_k=64 over groups of 32: scales applied per element instead of per tile.
    check_sbmm(4, 32, False, False, out_f=33, in_f=256, n=9, num_slots=3, dtype=torch.float16, gen=gen,
               device=backend, block_k=64, block_n=16)


def test_sbmm_triton_edge_batches(backend):
    gen = torch.Generator().manual_seed(23)
    deltas = [make_delta(20, 32, 4, -1, True, False, gen) for _ in range(2)]
    stack = repack(deltas, device=backend, layout="transposed")
    x = torch.randn(5, 32, generator=gen).half()
    xd = x.to(backend)
    assert not sbmm_triton(xd, torch.full((5,), -1, device=backend), stack).any()
    assert sbmm_triton(xd[:0], torch.zeros(0, dtype=torch.long, device=backend), stack).shape == (0, 20)
    one = sbmm_triton(xd[:1], torch.tensor([1], device=backend), stack)
    assert_matches(one.cpu(), reference.sbmm(x[:1], torch.tensor([1]), deltas),
                   magnitude(x[:1], torch.tensor([1]), [reference.delta_weight(d) for d in deltas]))


def test_dispatch_forced_matches_reference_for_mixed_configs(backend):
    gen = torch.Generator().manual_seed(24)
    deltas = [make_delta(24, 64, 4, 32, True, False, gen), make_delta(24, 64, 2, -1, True, True, gen),
              make_delta(24, 64, 4, 32, True, True, gen), make_delta(24, 64, 8, 16, False, False, gen)]
    index = torch.tensor([0, 1, 2, 3, -1, 3, 1, 0, 2, 2])
    x = torch.randn(10, 64, generator=gen).half()
    xd, idd = x.to(backend), index.to(backend)
    assert dispatch.use_triton(xd)
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    dev_deltas = [d.to(backend) for d in deltas]
    assert_matches(dispatch.sbmm(xd, idd, dev_deltas).cpu(), reference.sbmm(x, index, deltas), mag)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        dispatch.sbmm(xd, torch.tensor([0, 4] + [0] * 8, device=backend), dev_deltas)
    if backend == "cpu":
        # bf16 has no interpreter support: dispatch takes the reference, bit-identical to it.
        xb = x.bfloat16()
        assert not dispatch.use_triton(xb)
        assert torch.equal(dispatch.sbmm(xb, index, deltas), reference.sbmm(xb, index, deltas))


@pytest.mark.parametrize("rank", [4, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_lora_triton_matches_reference(backend, rank, dtype):
    gen = torch.Generator().manual_seed(rank)
    num, in_f, out_f = 4, 72, 40
    a = (torch.randn(num, rank, in_f, generator=gen) / in_f**0.5).to(dtype)
    b = (torch.randn(num, out_f, rank, generator=gen) / rank**0.5).to(dtype)
    scale = torch.rand(num, generator=gen) + 0.5
    index = random_index(23, num, gen, unused={2})
    x = torch.randn(23, in_f, generator=gen).to(dtype)
    ref = reference.lora_shrink_expand(x, index, a, b, scale)
    dev = [t.to(backend) for t in (x, index, a, b, scale)]
    assert dispatch.use_triton(*dev)
    y = dispatch.lora(*dev).cpu()
    assert_matches(y, ref, lora_magnitude(x, index, a, b, scale))
    assert not y[index == -1].any()


# ------------------------------------------------------------------------------------------------
# native GPU parity (skipped without CUDA; fail under --require-gpu)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,sparse,asym,group", [
    (4, True, False, 128), (2, True, False, 128), (4, False, True, -1), (2, True, True, 64),
    (3, True, False, 128), (8, False, False, 128), (4, True, True, 8),
])
def test_sbmm_gpu_matches_reference(native, dtype, bits, sparse, asym, group):
    gen = torch.Generator().manual_seed(bits * 7 + group)
    for n, split_k in ((5, None), (40, None), (300, None), (24, 4)):
        check_sbmm(bits, group, sparse, asym, out_f=320, in_f=512, n=n, num_slots=6, dtype=dtype, gen=gen,
                   device="cuda", split_k=split_k)


@pytest.mark.gpu
def test_dispatch_gpu_takes_triton_and_matches(native):
    gen = torch.Generator().manual_seed(31)
    deltas = [make_delta(256, 512, 4, 128, True, False, gen) for _ in range(5)]
    stack = repack(deltas, device="cuda")
    index = random_index(33, 5, gen)
    x = torch.randn(33, 512, generator=gen).half()
    assert dispatch.use_triton(x.cuda())
    y = dispatch.sbmm(x.cuda(), index.cuda(), stack)
    assert_matches(y.cpu(), reference.sbmm(x, index, deltas),
                   magnitude(x, index, [reference.delta_weight(d) for d in deltas]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lora_gpu_matches_reference(native, dtype):
    gen = torch.Generator().manual_seed(32)
    num, rank, in_f, out_f = 5, 16, 512, 384
    a = (torch.randn(num, rank, in_f, generator=gen) / in_f**0.5).to(dtype)
    b = (torch.randn(num, out_f, rank, generator=gen) / rank**0.5).to(dtype)
    scale = torch.rand(num, generator=gen) + 0.5
    index = random_index(70, num, gen)
    x = torch.randn(70, in_f, generator=gen).to(dtype)
    y = lora_triton(x.cuda(), index.cuda(), a.cuda(), b.cuda(), scale.cuda()).cpu()
    ref = reference.lora_shrink_expand(x, index, a, b, scale)
    assert_matches(y, ref, lora_magnitude(x, index, a, b, scale))
