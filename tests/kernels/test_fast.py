"""The fast SBMM path (``mma`` layout, ``deltazip.kernels.triton_fast``) against the reference.

Layout tests are pure torch. Parity tests run the kernel in the Triton interpreter on a CPU (fp16;
the interpreter has no bf16) and natively on a GPU (``backend`` fixture); the ``gpu`` tests add bf16
and larger shapes. The interpreter runs the kernel's plain-arithmetic dequantization, the GPU its
inline-PTX ``fma.rn.{f16,bf16}x2`` (both exact: ``code - zero`` is an integer the 16-bit formats
hold), so the GPU tests are the ones that cover the PTX. Tolerance: ``assert_matches``
(tests/_sbmm.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

from _sbmm import assert_matches, magnitude, make_delta, random_index  # noqa: E402

from deltazip.kernels import dispatch, fast_layout, reference  # noqa: E402
from deltazip.kernels.stacked import StackedDeltas, choose_layout, repack  # noqa: E402
from deltazip.kernels.triton_fast import fast_config, sbmm_fast  # noqa: E402
from deltazip.kernels.triton_sbmm import group_rows, max_tiles, sbmm_triton  # noqa: E402

# ------------------------------------------------------------------------------------------------
# the layout (pure torch)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip_pads_rows(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (100, 256), generator=gen)
    words = fast_layout.pack_codes(codes, bits)
    assert words.dtype == torch.int32 and words.numel() == fast_layout.slot_words(100, 256, bits)
    assert words.numel() == 128 * 256 * bits // 32  # rows padded to 128
    assert torch.equal(fast_layout.unpack_codes(words, bits, 100, 256), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_code_lands_where_the_docstring_says(bits):
    """One non-zero code at (n, k) must sit at the word and bit of fast_layout's index map."""
    out_f, in_f = 192, 384
    for n, k in [(0, 0), (37, 77), (191, 383), (64 + 9, 128 + 50)]:
        codes = torch.zeros(out_f, in_f, dtype=torch.int64)
        codes[n, k] = 1
        words = fast_layout.pack_codes(codes, bits)
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


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("asym", [False, True])
def test_dense_codes_dequantize_to_the_reference(sparse, asym):
    gen = torch.Generator().manual_seed(3)
    d = make_delta(40, 256, 4, 64, sparse, asym, gen)
    codes = fast_layout.dense_codes(d)
    zp = fast_layout.zero_points(d).repeat_interleave(64, dim=1)
    scales = d.scales.float().repeat_interleave(64, dim=1)
    assert torch.equal(scales * (codes - zp).float(), reference.delta_weight(d))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sparse", [True, False])
def test_mma_stack_write_unstack(bits, sparse):
    gen = torch.Generator().manual_seed(10 * bits + sparse)
    deltas = [make_delta(70, 256, bits, 128, sparse, s == 1, gen) for s in range(3)]
    stack = repack(deltas, layout="mma")
    assert stack.layout == "mma" and stack.sparse == sparse and stack.asymmetric and stack.positions is None
    assert stack.qweight.shape == (3, fast_layout.slot_words(70, 256, bits))
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
    assert choose_layout("auto", device="cpu", **kw) == "transposed"  # the fast kernel needs CUDA
    assert choose_layout("mma", device="cpu", **kw) == "mma"
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "mma")
    assert choose_layout("auto", device="cpu", **kw) == "mma"
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "transposed")
    assert choose_layout("auto", device="cpu", **kw) == "transposed"
    for bad in (dict(bits=3, group_size=128, in_features=256), dict(bits=4, group_size=16, in_features=256),
                dict(bits=2, group_size=32, in_features=256), dict(bits=4, group_size=-1, in_features=96)):
        with pytest.raises(ValueError, match="no mma layout"):
            choose_layout("mma", device="cpu", **bad)
        for env in ("mma", "auto"):  # a preference, not an order
            monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", env)
            assert choose_layout("auto", device="cpu", **bad) == "transposed"
    with pytest.raises(ValueError, match="layout"):
        choose_layout("fancy", device="cpu", **kw)
    monkeypatch.setenv("DELTAZIP_SBMM_LAYOUT", "fancy")
    with pytest.raises(ValueError, match="DELTAZIP_SBMM_LAYOUT"):
        choose_layout("auto", device="cpu", **kw)


def test_fast_config_steps_and_group_shifts():
    def stack(bits, group, in_f=1024):
        return StackedDeltas.allocate(1, bits=bits, group_size=group, in_features=in_f, out_features=64,
                                      sparse=False, asymmetric=False, layout="mma")

    assert fast_config(stack(4, 128)) == (128, 0)
    assert fast_config(stack(4, 256)) == (128, 1)
    assert fast_config(stack(4, 64)) == (64, 0)
    assert fast_config(stack(8, 32)) == (32, 0)
    assert fast_config(stack(2, 64)) == (64, 0)
    assert fast_config(stack(4, -1)) == (128, 31)
    assert fast_config(stack(4, 384, in_f=1152)) == (128, -1)  # 3 steps per group: a division


# ------------------------------------------------------------------------------------------------
# parity with the reference: CPU interpreter, or natively when CUDA is present
# ------------------------------------------------------------------------------------------------


def check_fast(bits, group, sparse, asym, *, out_f, in_f, n, num_slots, dtype, gen, device, x=None, **kw):
    deltas = [make_delta(out_f, in_f, bits, group, sparse, asym and s % 2 == 0, gen) for s in range(num_slots)]
    unused = {1} if num_slots > 2 else set()  # a delta with zero rows in the batch
    index = random_index(n, num_slots, gen, unused=unused)
    if x is None:
        x = torch.randn(n, in_f, generator=gen).to(dtype)
    stack = repack(deltas, device=device, layout="mma")
    y = sbmm_fast(x.to(device) if x.device.type != device else x, index.to(device), stack, **kw)
    ref = reference.sbmm(x.cpu(), index, deltas)
    assert_matches(y.cpu(), ref, magnitude(x.cpu(), index, [reference.delta_weight(d) for d in deltas]))
    assert not y[index.to(device) == -1].any()
    return y


GROUPS = {2: [-1, 128, 64], 4: [-1, 128, 64, 32], 8: [-1, 64, 32]}


@pytest.mark.parametrize("bits,group", [(b, g) for b, gs in GROUPS.items() for g in gs])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("asym", [False, True])
def test_sbmm_fast_matches_reference(backend, bits, group, sparse, asym):
    gen = torch.Generator().manual_seed(1000 * bits + 100 * sparse + 10 * asym + group)
    out_f = int(torch.randint(17, 150, (1,), generator=gen))  # padded to a multiple of 64, stores masked
    n = int(torch.randint(1, 40, (1,), generator=gen))
    check_fast(bits, group, sparse, asym, out_f=out_f, in_f=256, n=n, num_slots=4, dtype=torch.float16,
               gen=gen, device=backend)


@pytest.mark.parametrize("bits,sparse,asym,group", [(4, True, False, 128), (2, False, True, 64), (8, True, True, -1)])
def test_sbmm_fast_fp32_activations(backend, bits, sparse, asym, group):
    """fp32 activations take the kernel's fp32 path (exact integer weights, fp32 dot)."""
    gen = torch.Generator().manual_seed(bits + 31)
    check_fast(bits, group, sparse, asym, out_f=70, in_f=256, n=13, num_slots=3, dtype=torch.float32, gen=gen,
               device=backend)


def test_sbmm_fast_split_k_odd_steps_and_prefill_tiles(backend):
    gen = torch.Generator().manual_seed(7)
    # 3 K steps of 128: the two-step unrolled loop plus its remainder; then split in two (2 + 1 steps,
    # fp32 atomics).
    for split_k in (1, 2):
        check_fast(4, 128, True, True, out_f=64, in_f=384, n=9, num_slots=3, dtype=torch.float16, gen=gen,
                   device=backend, split_k=split_k)
    # 300 rows: 64-row tiles (the prefill plan), several tiles for one slot.
    check_fast(4, 128, True, False, out_f=64, in_f=128, n=300, num_slots=2, dtype=torch.float16, gen=gen,
               device=backend)


def strided_inputs(n, in_f, gen):
    """The same ``[n, in]`` activations as a contiguous tensor and in awkward memory."""
    x = torch.randn(n, in_f, generator=gen).half()
    wide = torch.zeros(n, in_f + 24, dtype=torch.float16)
    wide[:, 3:3 + in_f] = x
    every_other = torch.zeros(2 * n, in_f, dtype=torch.float16)
    every_other[::2] = x
    flat = torch.zeros(n * in_f + 1, dtype=torch.float16)
    flat[1:] = x.reshape(-1)
    col_major = x.t().contiguous().t()
    return x, {
        "row_stride_and_offset": wide[:, 3:3 + in_f],  # storage offset 6 bytes, row stride in+24
        "every_other_row": every_other[::2],
        "misaligned_2_bytes": flat[1:].view(n, in_f),  # storage offset not a multiple of 16 bytes
        "column_major": col_major,  # stride(1) != 1: made contiguous by the wrapper
    }


@pytest.mark.parametrize("path", ["fast", "transposed"])
def test_non_contiguous_and_misaligned_x(backend, path):
    gen = torch.Generator().manual_seed(11)
    n, in_f = 21, 256
    deltas = [make_delta(80, in_f, 4, 128, True, s == 0, gen) for s in range(3)]
    index = random_index(n, 3, gen)
    x, variants = strided_inputs(n, in_f, gen)
    assert variants["misaligned_2_bytes"].storage_offset() * 2 % 16 != 0
    assert not variants["column_major"].is_contiguous()
    layout = "mma" if path == "fast" else "transposed"
    stack = repack(deltas, device=backend, layout=layout)
    run = sbmm_fast if path == "fast" else sbmm_triton
    ref = reference.sbmm(x, index, deltas)
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    base = run(x.to(backend), index.to(backend), stack).cpu()
    assert_matches(base, ref, mag)
    for name, xv in variants.items():
        if backend == "cuda":
            xv = _same_layout_on(xv, backend)
        assert torch.equal(xv.cpu(), x)
        y = run(xv, index.to(backend), stack).cpu()
        assert torch.equal(y, base), name  # same math, only the addressing differs


def _same_layout_on(xv: torch.Tensor, device: str) -> torch.Tensor:
    """``xv`` on ``device`` with the same strides and storage offset."""
    numel = xv.untyped_storage().nbytes() // xv.element_size()
    flat = xv.as_strided((numel,), (1,), 0).to(device)
    return flat.as_strided(xv.shape, xv.stride(), xv.storage_offset())


def test_sbmm_fast_edge_batches(backend):
    gen = torch.Generator().manual_seed(23)
    deltas = [make_delta(20, 128, 4, -1, True, False, gen) for _ in range(2)]
    stack = repack(deltas, device=backend, layout="mma")
    x = torch.randn(5, 128, generator=gen).half().to(backend)
    assert not sbmm_fast(x, torch.full((5,), -1, device=backend), stack).any()
    assert sbmm_fast(x[:0], torch.zeros(0, dtype=torch.long, device=backend), stack).shape == (0, 20)
    with pytest.raises(ValueError, match="mma"):
        sbmm_fast(x, torch.zeros(5, dtype=torch.long, device=backend), repack(deltas, device=backend,
                                                                               layout="transposed"))
    with pytest.raises(ValueError, match="transposed"):
        sbmm_triton(x, torch.zeros(5, dtype=torch.long, device=backend), stack)
    with pytest.raises(ValueError, match="16 rows"):
        sbmm_fast(x, torch.zeros(5, dtype=torch.long, device=backend), stack,
                  plan=group_rows(torch.zeros(5, dtype=torch.long, device=backend), 2, block_m=4))


def test_dispatch_routes_by_layout_and_dtype(backend, monkeypatch):
    gen = torch.Generator().manual_seed(24)
    deltas = [make_delta(48, 256, 4, 128, True, s == 1, gen) for s in range(3)]
    index = torch.tensor([0, 1, 2, -1, 2, 0, 1, 1])
    x = torch.randn(8, 256, generator=gen).half()
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    ref = reference.sbmm(x, index, deltas)
    calls = []
    import deltazip.kernels.dispatch as dmod

    real_fast, real_transposed = dmod.sbmm_fast, dmod.sbmm_triton
    monkeypatch.setattr(dmod, "sbmm_fast", lambda *a, **k: calls.append("fast") or real_fast(*a, **k))
    monkeypatch.setattr(dmod, "sbmm_triton", lambda *a, **k: calls.append("transposed") or real_transposed(*a, **k))
    xd, idd = x.to(backend), index.to(backend)
    mma = repack(deltas, device=backend, layout="mma")
    assert_matches(dispatch.sbmm(xd, idd, mma).cpu(), ref, mag)
    assert_matches(dispatch.sbmm(xd, idd, repack(deltas, device=backend, layout="transposed")).cpu(), ref, mag)
    assert_matches(dispatch.sbmm(xd, idd, [d.to(backend) for d in deltas]).cpu(), ref, mag)  # list: repacked
    assert calls == ["fast", "transposed", "fast"]
    # fp32 activations: the fast kernel's fp32 path (exact weights, fp32 FMA).
    calls.clear()
    x32 = x.float()
    y32 = dispatch.sbmm(x32.to(backend), idd, mma).cpu()
    assert_matches(y32, reference.sbmm(x32, index, deltas), mag)
    assert calls == ["fast"]
    calls.clear()
    # A configuration without a fast kernel (3-bit) takes the transposed kernel through the list path.
    three = [make_delta(48, 256, 3, 128, True, False, gen) for _ in range(2)]
    i3 = torch.tensor([0, 1, -1, 1])
    y3 = dispatch.sbmm(x[:4].to(backend), i3.to(backend), [d.to(backend) for d in three]).cpu()
    assert_matches(y3, reference.sbmm(x[:4], i3, three), magnitude(x[:4], i3, [reference.delta_weight(d) for d in three]))
    assert calls == ["transposed"]


# ------------------------------------------------------------------------------------------------
# 7B shapes
# ------------------------------------------------------------------------------------------------


def test_7b_mlp_shapes_layout_and_plan():
    """4096 x 11008 (down_proj) and 11008 x 4096 (gate/up): layout sizes, K steps, grid and plan, no
    kernel run."""
    for out_f, in_f in [(4096, 11008), (11008, 4096)]:
        stack = StackedDeltas.allocate(2, bits=4, group_size=128, in_features=in_f, out_features=out_f,
                                       sparse=True, asymmetric=False, layout="mma")
        assert stack.qweight.shape == (2, out_f * in_f // 8)  # 4 bits per weight, rows already a multiple of 64
        assert stack.scales.shape == (2, in_f // 128, out_f)
        assert stack.nbytes() == 2 * out_f * in_f * (4 / 8 + 2 / 128)
        assert fast_config(stack) == (128, 0)
        assert fast_layout.padded_rows(out_f) // 64 == out_f // 64 and in_f % 128 == 0
    index = torch.arange(64) % 16  # decode: 64 rows, 16 deltas, 4 rows each
    plan = group_rows(index, 16, block_m=16)
    assert plan.num_tiles == max_tiles(64, 16, 16) == 20
    assert int((plan.tile_slot >= 0).sum()) == 16  # one 16-row tile per delta


@pytest.mark.slow
def test_7b_down_proj_slice_matches_reference(backend):
    """The first 128 output rows of a 4096 x 11008 delta (all 86 K steps of the real shape) through
    the fast kernel (interpreter on a CPU), fp16 activations, 2:4 4-bit groups of 128."""
    gen = torch.Generator().manual_seed(77)
    check_fast(4, 128, True, False, out_f=128, in_f=11008, n=24, num_slots=2, dtype=torch.float16, gen=gen,
               device=backend)


# ------------------------------------------------------------------------------------------------
# GPU only: bf16, native sizes, cuda:N
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,sparse,asym,group", [
    (4, True, False, 128), (2, True, False, 128), (4, False, True, -1), (2, True, True, 64),
    (8, False, False, 128), (8, True, True, 32), (4, True, True, 64),
])
def test_sbmm_fast_gpu_matches_reference(backend, dtype, bits, sparse, asym, group):
    gen = torch.Generator().manual_seed(bits * 7 + group)
    for n, split_k in ((5, None), (40, None), (300, None), (24, 4)):
        check_fast(bits, group, sparse, asym, out_f=320, in_f=512, n=n, num_slots=6, dtype=dtype, gen=gen,
                   device="cuda", split_k=split_k)


@pytest.mark.gpu
def test_dispatch_on_cuda_picks_the_mma_layout_and_the_fast_kernel(backend, monkeypatch):
    monkeypatch.delenv("DELTAZIP_SBMM_LAYOUT", raising=False)
    stack = StackedDeltas.allocate(2, bits=4, group_size=128, in_features=512, out_features=256, sparse=True,
                                   asymmetric=False, device="cuda")
    assert stack.layout == "mma"


@pytest.mark.gpu
def test_cuda_n_launches_on_the_tensors_device():
    """With two visible GPUs, run on cuda:1 while cuda:0 is current (CUDA_VISIBLE_DEVICES selects
    which two): the result must match the reference. Skipped with fewer than two GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs (e.g. CUDA_VISIBLE_DEVICES=0,1)")
    gen = torch.Generator().manual_seed(5)
    deltas = [make_delta(128, 256, 4, 128, True, False, gen) for _ in range(2)]
    index = torch.tensor([0, 1, 1, -1, 0])
    x = torch.randn(5, 256, generator=gen)
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    torch.cuda.set_device(0)
    for dtype in (torch.float16, torch.bfloat16):
        for layout in ("mma", "transposed"):
            stack = repack(deltas, device="cuda:1", layout=layout)
            y = dispatch.sbmm(x.to(dtype).to("cuda:1"), index.to("cuda:1"), stack)
            assert y.device == torch.device("cuda:1")
            assert_matches(y.cpu(), reference.sbmm(x.to(dtype), index, deltas), mag)
    assert torch.cuda.current_device() == 0


# ------------------------------------------------------------------------------------------------
# split-K choice and warm-up
# ------------------------------------------------------------------------------------------------


def test_auto_split_k_is_a_power_of_two_within_the_k_steps(monkeypatch):
    import deltazip.kernels.triton_sbmm as ts

    monkeypatch.setattr(ts, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert ts.auto_split_k(10_000, 32, cuda) == 1  # the grid already fills the GPU
    assert ts.auto_split_k(64, 32, torch.device("cpu")) == 1
    for busy in range(1, 300):
        for k_tiles in (1, 3, 5, 32, 86):
            s = ts.auto_split_k(busy, k_tiles, cuda)
            assert s in ts.SPLIT_K_CHOICES and s <= max(1, k_tiles)


def test_warmup_runs_every_variant(backend):
    from deltazip.kernels.warmup import variants, warmup_stack

    gen = torch.Generator().manual_seed(4)
    deltas = [make_delta(64, 256, 4, 128, True, False, gen) for _ in range(2)]
    for layout in ("mma", "transposed"):
        stack = repack(deltas, device=backend, layout=layout)
        combos = variants(stack, (torch.float16, torch.float32, torch.bfloat16))
        expect = {(bm, sk) for bm in (16, 64) for sk in (1, 2)}  # 2 K steps of 128: split-K 1 or 2
        assert {(bm, sk) for dt, bm, sk in combos if dt == torch.float16} == expect
        assert {(bm, sk) for dt, bm, sk in combos if dt == torch.float32} == expect
        assert any(dt == torch.bfloat16 for dt, _, _ in combos) == (backend == "cuda")  # no bf16 interpreter
        assert warmup_stack(stack, (torch.float16,), force=True) == 4
        if backend == "cpu":
            assert warmup_stack(stack, (torch.float16,)) == 0  # nothing to compile off CUDA


# ------------------------------------------------------------------------------------------------
# every variant with awkward activations; the accumulate mode (out=)
# ------------------------------------------------------------------------------------------------


def awkward(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a slice view whose storage starts one element in (2 or 4 bytes: not 16-byte aligned)
    with an odd row stride."""
    n, in_f = x.shape
    wide = torch.zeros(n, in_f + 9, dtype=x.dtype)
    view = wide[:, 1:1 + in_f]
    view.copy_(x)
    return view


VARIANTS = ([("fast", b) for b in (2, 4, 8)] + [("transposed", b) for b in (2, 3, 4, 8)])


@pytest.mark.parametrize("kernel,bits", VARIANTS)
@pytest.mark.parametrize("sparse", [True, False], ids=["24", "dense"])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_every_variant_matches_the_reference_on_misaligned_strided_x(backend, kernel, bits, sparse, asym, dtype):
    """Both kernels, every bit width they take, 2:4 and dense, symmetric and asymmetric, fp16 and fp32,
    with ``x`` a misaligned slice view. (bf16 runs only on a GPU: the interpreter has no bf16, see
    ``test_sbmm_fast_gpu_matches_reference``.)"""
    gen = torch.Generator().manual_seed(hash((kernel, bits, sparse, asym, str(dtype))) % 2**31)
    n, in_f, out_f = 19, 256, 80
    deltas = [make_delta(out_f, in_f, bits, 64, sparse, asym and s != 1, gen) for s in range(3)]
    index = random_index(n, 3, gen)
    x = awkward(torch.randn(n, in_f, generator=gen).to(dtype))
    assert x.storage_offset() == 1 and not x.is_contiguous()
    stack = repack(deltas, device=backend, layout="mma" if kernel == "fast" else "transposed")
    run = sbmm_fast if kernel == "fast" else sbmm_triton
    xd = x if backend == "cpu" else _same_layout_on(x, backend)
    y = run(xd, index.to(backend), stack).cpu()
    assert_matches(y, reference.sbmm(x, index, deltas), magnitude(x, index, [reference.delta_weight(d) for d in deltas]))


def _check_added(out, y0, ref, mag, index):
    """``out == y0 + ref`` up to the kernels' tolerance plus one rounding of the sum; rows with index
    -1 keep ``y0`` exactly."""
    eps = torch.finfo(out.dtype).eps
    want = y0.float() + ref.float()
    bound = 2 * eps * (mag + want.abs() + y0.float().abs()) + 1e-5 * mag + 1e-6
    assert ((out.float() - want).abs() <= bound).all()
    assert torch.equal(out[index == -1], y0[index == -1])


@pytest.mark.parametrize("path,split_k", [("fast", 1), ("fast", 2), ("transposed", None), ("reference", None)])
def test_sbmm_out_adds_onto_the_base_output(backend, monkeypatch, path, split_k):
    gen = torch.Generator().manual_seed(31)
    deltas = [make_delta(96, 256, 4, 128, True, s == 0, gen) for s in range(3)]
    index = random_index(12, 3, gen)
    x = torch.randn(12, 256, generator=gen).half()
    y0 = torch.randn(12, 96, generator=gen).half()
    ref = reference.sbmm(x, index, deltas)
    mag = magnitude(x, index, [reference.delta_weight(d) for d in deltas])
    stack = repack(deltas, device=backend, layout="transposed" if path == "transposed" else "mma")
    out = y0.clone().to(backend)  # .to() on the CPU would alias y0
    if path == "fast":
        got = sbmm_fast(x.to(backend), index.to(backend), stack, out=out, split_k=split_k)
    else:
        if path == "reference":
            monkeypatch.setenv("DELTAZIP_FORCE_TRITON", "0")
        before = dict(dispatch.CALLS)
        got = dispatch.sbmm(x.to(backend), index.to(backend), stack, out=out)
        assert dispatch.CALLS[path] == before.get(path, 0) + 1
    assert got is out  # in place
    _check_added(out.cpu(), y0, ref, mag, index)


def test_sbmm_out_is_checked(backend):
    gen = torch.Generator().manual_seed(32)
    stack = repack([make_delta(64, 128, 4, 128, False, False, gen)], device=backend, layout="mma")
    x = torch.randn(4, 128, generator=gen).half().to(backend)
    idx = torch.zeros(4, dtype=torch.long, device=backend)
    for bad in (torch.zeros(4, 65, dtype=torch.float16), torch.zeros(4, 64), torch.zeros(64, 4).half().t()):
        with pytest.raises(ValueError, match="out must be"):
            sbmm_fast(x, idx, stack, out=bad.to(backend))
    with pytest.raises(ValueError, match="StackedDeltas"):
        dispatch.sbmm(x, idx, [make_delta(64, 128, 4, 128, False, False, gen)], out=torch.zeros(4, 64).half())


@pytest.mark.parametrize("layout", ["mma", "transposed"])
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
