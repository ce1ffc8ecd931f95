"""The CUDA SBMM kernel (kernels/cuda/sbmm.cu): host plans and offline compiles on any machine, parity
against the reference on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _sbmm import graph_case, make_delta, nvrtc_or_skip, random_index

from deltazip.kernels import cuda_sbmm, reference
from deltazip.kernels.row_plan import plan_rows
from deltazip.kernels.stacked import repack

# ------------------------------------------------------------------------------------ offline compiles

VARIANTS = [(bits, dt, asym, group, rb, kt)
            for bits in (2, 4, 8) for dt in (torch.float16, torch.bfloat16) for asym in (False, True)
            for group, rb, kt in ((128, 2, 1), (64, 1, 1), (64, 2, 1), (-1, 2, 1), (128, 2, 2), (-1, 1, 2))
            if kt == 1 or bits <= 4]


def _stack(bits, group, asym, sparse=True, out_f=128, in_f=256, n=2, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    deltas = [make_delta(out_f, in_f, bits, group, sparse, asym, gen) for _ in range(n)]
    return deltas, repack(deltas, device=device, layout="mma")


def _configs_over_budget(stacks, dtype=torch.bfloat16) -> tuple[int, list]:
    """Every launch config the tuner can time (``rb``, ``kt``, 4/6/8 stages, ``mt``) that fits each stack,
    compiled for sm_90: ``(builds checked, those with local memory or registers x threads x ctas_per_sm
    over the SM's register file)``."""
    import _sass as sass

    from deltazip.kernels import cuda_rtc as rtc

    over, checked = [], 0
    for stack in stacks:
        cfgs = [cuda_sbmm.CudaConfig(rb=rb, stages=st, kt=kt, mt=mt) for rb in (1, 2) for kt in (1, 2)
                for st in (4, 6, 8) for mt in (1, 2)]
        cfgs = [c for c in cfgs if cuda_sbmm.fits(stack, c, 0)]
        rtc.precompile(cuda_sbmm.source(), [cuda_sbmm.macros(stack, dtype, c) for c in cfgs], 90)
        for c in cfgs:
            info = sass.analyze(rtc.cubin_for(cuda_sbmm.source(), cuda_sbmm.macros(stack, dtype, c), 90),
                                function="dz_sbmm")
            checked += 1
            if (info["registers"] * c.threads * cuda_sbmm.ctas_per_sm(stack, c) > cuda_sbmm.sm_limits(0)[2]
                    or any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"])):
                over.append((stack.bits, stack.effective_group, stack.asymmetric, c, info["registers"]))
    return checked, over


@pytest.mark.parametrize("bits,dtype,asym,group,rb,kt", VARIANTS)
def test_every_variant_compiles_offline_to_a_streaming_loop(bits, dtype, asym, group, rb, kt):
    """NVRTC for sm_90 without a GPU; the SASS main loop is what the design needs on any compiler
    version: 16-byte global->shared copies only, no shared-memory store, one barrier per K tile, no
    local memory. The loop holds the stage's compute twice, one picked per stage: the two n8 MMAs of
    each of the 8 k16 steps after x4 ldmatrix (tiles of more than 8 rows), and one after x2 (8 rows or
    fewer, most decode tiles: half the activation reads)."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    _, stack = _stack(bits, group if group != -1 else -1, asym, in_f=512)
    cfg = cuda_sbmm.CudaConfig(rb=rb, stages=4, kt=kt)
    cubin = rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, dtype, cfg), 90)
    info = sass.analyze(cubin, function="dz_sbmm")
    full = info["loop_full_opcodes"]
    copies = {op: n for op, n in full.items() if op.startswith("LDGSTS")}
    assert copies and all(op.endswith(".128") for op in copies), copies
    assert info["loop_smem_stores"] == 0, full
    assert sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) == 1, full
    assert info["loop_mma"] == (16 + 8) * kt, full
    assert {op: n for op, n in full.items() if op.startswith("LDSM")} == {"LDSM.16.M88.4": 8 * kt,
                                                                         "LDSM.16.M88.2": 8 * kt}, full
    assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"]), "local memory (spills)"
    assert info["registers"] <= 128  # 2 CTAs of 8 warps (or 4 of 4) fit an SM's register file


@pytest.mark.parametrize("bits,rb,kt,stages", [(4, 1, 1, 8), (4, 2, 1, 8), (2, 2, 2, 6), (2, 1, 2, 8), (8, 1, 1, 8)])
def test_deep_pipelines_compile_to_the_same_loop_within_their_register_budget(bits, rb, kt, stages):
    """The tuner's deeper pipelines (``kernel_tuning._deeper``: 6 or 8 stages where 4 keep too few weight
    bytes in flight) keep the loop of the 4-stage build, spill nothing, and use few enough registers for
    the CTAs per SM that ``cuda_sbmm.ctas_per_sm`` counts on (their launch bounds ask for fewer CTAs, so
    the compiler may use more registers than at 4 stages). Register counts: the NVRTC constraints.txt
    pins (13.0.88)."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    _, stack = _stack(bits, 128, False, in_f=2048)
    cfg = cuda_sbmm.CudaConfig(rb=rb, stages=stages, kt=kt)
    info = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16, cfg), 90),
                        function="dz_sbmm")
    full = info["loop_full_opcodes"]
    assert all(op.endswith(".128") for op in full if op.startswith("LDGSTS")), full
    assert info["loop_smem_stores"] == 0 and info["loop_mma"] == (16 + 8) * kt, full
    assert sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) == 1, full
    assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"]), "local memory (spills)"
    regs_per_cta = info["registers"] * cfg.threads
    assert regs_per_cta * cuda_sbmm.ctas_per_sm(stack, cfg) <= cuda_sbmm.sm_limits(0)[2], info["registers"]


@pytest.mark.parametrize("bits,dtype,asym,group,rb,kt", [v for v in VARIANTS if v[0] <= 4 and v[1] == torch.bfloat16]
                         + [(4, torch.float16, False, 128, 1, 2), (2, torch.float16, True, 64, 2, 1)])
def test_two_tiles_per_warp_compile_to_a_loop_that_shares_each_activation_read(bits, dtype, asym, group, rb, kt):
    """``mt`` 2: half the warps, each covering two 16-row weight tiles, so every activation fragment read
    from shared memory feeds two tiles' MMAs: per K tile 32 MMAs after 8 x4 ldmatrix (16 after 8 x2 for
    tiles of 8 rows or fewer), the same copies and single barrier, no spills, and registers within
    what the CTAs per SM of ``cuda_sbmm.ctas_per_sm`` need."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    _, stack = _stack(bits, group, asym, in_f=512)
    cfg = cuda_sbmm.CudaConfig(rb=rb, stages=4, kt=kt, mt=2)
    assert cfg.threads == 64 * rb
    info = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, dtype, cfg), 90),
                        function="dz_sbmm")
    full = info["loop_full_opcodes"]
    assert info["loop_mma"] == (32 + 16) * kt
    assert {op: n for op, n in full.items() if op.startswith("LDSM")} == {"LDSM.16.M88.4": 8 * kt,
                                                                         "LDSM.16.M88.2": 8 * kt}, full
    assert all(op.endswith(".128") for op in full if op.startswith("LDGSTS")) and info["loop_smem_stores"] == 0
    assert sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) == 1, full
    assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"]), "local memory (spills)"
    assert info["registers"] * cfg.threads * cuda_sbmm.ctas_per_sm(stack, cfg) <= cuda_sbmm.sm_limits(0)[2]


def test_every_launch_config_the_tuner_times_fits_the_occupancy_the_model_assumes(tmp_path, monkeypatch):
    """For every bit width, groups of whole tiles, of 64 columns with zero points and of 32 columns,
    every launch config that fits (rb, kt, 4/6/8 stages, mt): no local memory, and its registers x
    threads x ``ctas_per_sm`` within the SM's register file, so the waves and bytes in flight the tuner
    plans with are the ones that run (the kernel's launch bounds are cut from the same shared-memory
    count, ``SMEM_SM``). The same sweep over both activation dtypes and every group kind (624 builds)
    passes too; CI runs these 102. Register counts are the compiler's: this holds for the NVRTC that
    constraints.txt pins (nvidia-cuda-nvrtc 13.0.88; the GPU runs had CUDA 13.0); another
    NVRTC version is checked by running this test with it."""
    nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    monkeypatch.setenv("DELTAZIP_CUDA_CACHE", str(tmp_path))
    checked, over = _configs_over_budget([_stack(bits, group, asym, in_f=1024)[1] for bits in (2, 4, 8)
                                          for asym, group in ((False, 128), (True, 64)) + (((False, 32),) if bits > 2
                                                                                             else ())])
    assert checked == 102 and not over, over


def test_two_tiles_per_warp_need_codes_of_at_most_4_bits():
    _, s8 = _stack(8, 128, False)
    _, s4 = _stack(4, 128, False)
    assert not cuda_sbmm.mt_ok(s8, 2) and cuda_sbmm.mt_ok(s4, 2) and cuda_sbmm.mt_ok(s8, 1)
    assert not cuda_sbmm.fits(s8, cuda_sbmm.CudaConfig(mt=2), 0)
    with pytest.raises(ValueError, match="mt in"):
        cuda_sbmm.CudaConfig(mt=4)


def test_the_prologue_reads_the_plan_in_two_rounds_and_streams_weights_before_its_barrier():
    """Each CTA's start: the tile's slot, first row and row count are read together, then whether the
    stack holds the slot and the tile's rows (two dependent rounds of global reads; the first H100 build
    chained four), and the first stages' weight copies go out before the barrier that shares the rows."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    _, stack = _stack(4, 128, False, in_f=512)
    cubin = rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16, cuda_sbmm.CudaConfig(1)), 90)
    ops = sass.opcodes(cubin, function="dz_sbmm")
    first_copy = next(i for i, op in enumerate(ops) if op.startswith("LDGSTS"))
    first_bar = next(i for i, op in enumerate(ops) if op.startswith("BAR.SYNC"))
    assert first_copy < first_bar
    rounds, pending = 0, False  # a round: global loads issued before a branch that waits on them
    for op in ops[:first_copy]:
        if op.startswith("LDG"):
            pending = True
        elif pending and "EXIT" in op:
            rounds, pending = rounds + 1, False
    assert rounds == 2, ops[:first_copy]


def test_group_params_cover_the_mma_layouts_group_sizes():
    _, s128 = _stack(4, 128, False)
    _, s64 = _stack(4, 64, False)
    _, srow = _stack(4, -1, False)
    assert cuda_sbmm.group_params(s128) == (8, 0)
    assert cuda_sbmm.group_params(s64) == (4, 0)
    assert cuda_sbmm.group_params(srow) == (8, 30)
    _, s256 = _stack(4, 256, False, in_f=1024)
    assert cuda_sbmm.group_params(s256) == (8, 1)
    _, s16 = _stack(2, 16, False)
    assert cuda_sbmm.group_params(s16) == (1, 0)
    from deltazip.kernels import mma_layout

    assert mma_layout.group_params(384, 1536) == (8, 3) and mma_layout.divided_groups(384, 1536)
    assert mma_layout.group_params(512, 1536) == (8, 2) and not mma_layout.divided_groups(512, 1536)
    assert not mma_layout.divided_groups(-1, 384)  # the whole row of 3 tiles: group_shift 30, no division
    # split into sub-groups (split-groups): 96 -> 32-column groups, 192 -> 64; 24 spans mma steps: none
    assert mma_layout.group_params(96, 384) == (2, 0) and mma_layout.group_params(192, 768) == (4, 0)
    assert mma_layout.group_params(24, 384) is None and not mma_layout.supported(4, 24, 384)


# ----------------------------------------------------------------------------------------- on a GPU


def _check(y, ref, dtype):
    rel = ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert rel < (2e-3 if dtype == torch.float16 else 1e-2), rel


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym,group", [(False, 128), (True, 64), (False, -1), (True, 256)])
def test_cuda_sbmm_matches_the_reference(bits, dtype, asym, group):
    gen = torch.Generator().manual_seed(bits * 7 + int(asym))
    out_f, in_f, n_slots = 192, 512, 5  # 3 row blocks: an odd count leaves half of the last CTA idle
    deltas = [make_delta(out_f, in_f, bits, group, True, asym, gen) for _ in range(n_slots)]
    stack = repack(deltas, device="cuda", layout="mma")
    for rows in ([2, 0, 4, -1, 2, 2, 1], [3] * 21 + [0] * 9 + [-1] * 2, [1]):
        index = torch.tensor(rows)
        x = torch.randn(len(rows), in_f, generator=gen).to(dtype).cuda()
        ref = reference.sbmm(x, index.cuda(), deltas)
        plan = plan_rows(rows, n_slots, "cuda")
        cfgs = [cuda_sbmm.CudaConfig(2, 4, 1), cuda_sbmm.CudaConfig(1, 3, 2), cuda_sbmm.CudaConfig(2, 2, 4),
                cuda_sbmm.CudaConfig(2, 4, 2, kt=2), cuda_sbmm.CudaConfig(1, 4, 1, kt=2),
                cuda_sbmm.CudaConfig(1, 8, 1), cuda_sbmm.CudaConfig(2, 6, 1, kt=2),  # deeper than the 4 K tiles
                cuda_sbmm.CudaConfig(2, 4, 1, mt=2), cuda_sbmm.CudaConfig(1, 4, 2, mt=2),  # two tiles per warp
                cuda_sbmm.CudaConfig(2, 4, 2, kt=2, mt=2)]
        for cfg in [c for c in cfgs if cuda_sbmm.kt_ok(stack, c.kt) and cuda_sbmm.mt_ok(stack, c.mt)]:
            y = cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg)
            _check(y, ref, dtype)
            assert torch.equal(y[index.cuda() < 0], torch.zeros_like(y[index.cuda() < 0]))
            base = (0.01 * torch.randn(len(rows), out_f, generator=gen)).to(dtype).cuda()
            y2 = cuda_sbmm.sbmm_cuda(x, stack, plan, out=base.clone(), config=cfg)
            _check(y2 - base, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym,group", [(False, 128), (True, 256), (False, -1)])
def test_uneven_k_splits_match_the_reference(dtype, asym, group):
    """K splits that do not divide the 10 K tiles (the tuner times 3..7 where they fill the last wave
    better): a shorter last split (4 + 4 + 2, 3 + 3 + 3 + 1) and, with groups of two tiles, split
    boundaries inside a group."""
    gen = torch.Generator().manual_seed(17)
    out_f, in_f = 192, 1280
    deltas = [make_delta(out_f, in_f, 4, group, True, asym, gen) for _ in range(3)]
    stack = repack(deltas, device="cuda", layout="mma")
    rows = [0, 1, 2, 2, 1, -1, 0] + [2] * 17
    index = torch.tensor(rows)
    x = torch.randn(len(rows), in_f, generator=gen).to(dtype).cuda()
    ref = reference.sbmm(x, index.cuda(), deltas)
    plan = plan_rows(rows, 3, "cuda")
    ran = set()
    for split in (3, 4, 6, 7):
        for kt in (1, 2):
            cfg = cuda_sbmm.CudaConfig(2, 4, split, kt)
            if not cuda_sbmm.kt_ok(stack, kt):
                continue
            ran.add(cuda_sbmm.effective_split(10, cfg))
            _check(cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg), ref, dtype)
    assert (4, 3) in ran and (3, 4) in ran  # 4 + 4 + 2 and 3 + 3 + 3 + 1 tiles
    for cfg in (cuda_sbmm.CudaConfig(1, 8, 1), cuda_sbmm.CudaConfig(2, 6, 1), cuda_sbmm.CudaConfig(1, 8, 2),
                cuda_sbmm.CudaConfig(2, 4, 3, mt=2), cuda_sbmm.CudaConfig(1, 8, 1, mt=2)):
        _check(cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg), ref, dtype)  # deep pipelines: the ring wraps


@pytest.mark.gpu
def test_split_k_resets_its_counters_is_deterministic_and_replays_in_a_graph():
    _, stack, x, plan, ref = graph_case()
    cfg = cuda_sbmm.CudaConfig(2, 4, 4)
    y = torch.zeros(x.shape[0], 256, dtype=torch.float16, device="cuda")
    cuda_sbmm.sbmm_cuda(x, stack, plan, out=y, config=cfg)  # compile and warm up outside the capture
    counters = cuda_sbmm._WORKSPACE.counters[0]
    torch.cuda.synchronize()
    assert int(counters.count_nonzero()) == 0
    first = y.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y.zero_()
        cuda_sbmm.sbmm_cuda(x, stack, plan, out=y, config=cfg)
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(y, ref, torch.float16)
        assert torch.equal(y, first)  # splits summed in a fixed order: identical on every run
    assert int(counters.count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_mm_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    deltas = [make_delta(128, 256, 4, 64, True, True, gen) for _ in range(3)]
    stack = repack(deltas, device="cuda", layout="mma")
    for s in range(3):
        w = cuda_sbmm.dequantize_slot(stack, s, dtype)
        _check(w, reference.delta_weight(deltas[s]).to(dtype).cuda(), dtype)
    rows = random_index(300, 3, gen).tolist()
    x = torch.randn(300, 256, generator=gen).to(dtype).cuda()
    plan = plan_rows(rows, 3, "cuda")
    y = cuda_sbmm.dequant_mm(x, stack, plan)
    _check(y, reference.sbmm(x, torch.tensor(rows).cuda(), deltas), dtype)
    assert np.array_equal(sorted(plan.slot_rows), sorted({r for r in rows if r >= 0}))


# ------------------------------------- in_features not a multiple of 128 (preview: DELTAZIP_CUDA_PREVIEW)

PREVIEW_VARIANTS = ([(bits, dt, asym, group, in_f, rb, kt, 1)  # padded-k
                     for bits in (2, 4, 8) for dt in (torch.float16, torch.bfloat16) for asym in (False, True)
                     for group, in_f, rb, kt in ((64, 576, 2, 1), (64, 320, 1, 1), (-1, 576, 2, 1), (-1, 960, 2, 2))
                     if kt == 1 or bits <= 4]
                    + [(bits, dt, asym, group, 512, rb, 1, mt)  # narrow-groups
                       for bits, group in ((2, 32), (2, 16), (4, 16), (8, 16)) for dt in (torch.float16, torch.bfloat16)
                       for asym in (False, True) for rb in (1, 2) for mt in (1, 2) if mt == 1 or bits <= 4]
                    + [(3, dt, asym, group, 512, rb, kt, mt)  # three-bit
                       for dt in (torch.float16, torch.bfloat16) for asym in (False, True)
                       for group, rb, kt, mt in ((128, 2, 1, 1), (128, 1, 2, 1), (64, 2, 1, 1), (32, 1, 1, 2),
                                                 (-1, 2, 2, 1), (128, 2, 1, 2))]
                    + [(4, torch.bfloat16, True, 16, 208, 2, 1, 1), (2, torch.float16, True, 32, 576, 1, 1, 2),
                       (3, torch.bfloat16, True, 64, 576, 2, 1, 1), (3, torch.float16, False, 16, 512, 1, 1, 1)]
                    + [(bits, dt, asym, group, in_f, rb, kt, mt)  # wide-groups
                       for bits in (2, 4, 8) for dt in (torch.float16, torch.bfloat16) for asym in (False, True)
                       for group, in_f, rb, kt, mt in ((384, 1536, 2, 1, 1), (384, 1536, 1, 2, 1), (640, 1280, 2, 2, 1),
                                                       (384, 1536, 2, 1, 2))
                       if (kt == 1 and mt == 1) or bits <= 4]
                    + [(4, torch.float16, True, 96, 576, 2, 1, 1), (2, torch.bfloat16, False, 96, 1536, 1, 1, 2),  # split
                       (8, torch.bfloat16, True, 192, 1536, 2, 1, 1), (4, torch.float16, False, 48, 960, 1, 1, 1)])


@pytest.fixture
def preview_on(monkeypatch):
    """Every preview path but the compact 2:4 layout (whose builds have tests of their own below), so that
    4- and 8-bit 2:4 stacks here stay expanded."""
    from deltazip.kernels import preview

    monkeypatch.setenv(preview.ENV, ",".join(n for n in preview.FEATURES if n != "sparse-mma"))


@pytest.mark.parametrize("bits,dtype,asym,group,in_f,rb,kt,mt", PREVIEW_VARIANTS)
def test_preview_builds_compile_offline_to_the_same_streaming_loop(preview_on, bits, dtype, asym, group, in_f, rb,
                                                                   kt, mt):
    """The preview builds (``kernels/preview.py``): a padded last K tile (``KCOLS``: the activations past
    the row zero-filled), narrow groups (a scale flush every one or two mma steps) and 3-bit codes (two
    bit planes; a stage's 16-byte pieces do not divide evenly over the threads) keep the main loop of
    every other build: 16-byte copies only, no shared-memory store, one barrier, the MMAs and
    ldmatrix of a full tile, no local memory, registers within what ``ctas_per_sm`` counts on; the
    dense-dequantize kernel builds too."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    _, stack = _stack(bits, group, asym, in_f=in_f)
    cfg = cuda_sbmm.CudaConfig(rb=rb, stages=4, kt=kt, mt=mt)
    assert cuda_sbmm.supported(stack, dtype) and cuda_sbmm.fits(stack, cfg, 0)
    macros = cuda_sbmm.macros(stack, dtype, cfg)
    assert macros.get("KCOLS", 0) == (in_f if in_f % 128 else 0)
    assert macros.get("GDIV", 0) == int(group in (384, 640))
    info = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), macros, 90), function="dz_sbmm")
    full = info["loop_full_opcodes"]
    copies = {op: n for op, n in full.items() if op.startswith("LDGSTS")}
    assert copies and all(op.endswith(".128") for op in copies), copies
    assert info["loop_smem_stores"] == 0, full
    assert sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) == 1, full
    assert info["loop_mma"] == (16 + 8) * kt * mt, full
    assert {op: n for op, n in full.items() if op.startswith("LDSM")} == {"LDSM.16.M88.4": 8 * kt,
                                                                         "LDSM.16.M88.2": 8 * kt}, full
    assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"]), "local memory (spills)"
    assert info["registers"] * cfg.threads * cuda_sbmm.ctas_per_sm(stack, cfg) <= cuda_sbmm.sm_limits(0)[2]
    deq = sass.opcodes(rtc.compile_cubin(cuda_sbmm.source(), macros, 80), function="dz_dequant")
    assert deq and not any(op.startswith(("LDL", "STL")) for op in deq)


def test_every_launch_config_of_the_preview_builds_fits_the_occupancy_the_model_assumes(preview_on, tmp_path,
                                                                                       monkeypatch):
    """As the sweep above, for the narrow-groups preview (groups of 16, 2-bit groups of 32; symmetric,
    which spilled where zero points did not) and 3-bit codes: every config the tuner can time compiles
    with no local memory and within the register file at ``ctas_per_sm``."""
    nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    monkeypatch.setenv("DELTAZIP_CUDA_CACHE", str(tmp_path))
    checked, over = _configs_over_budget([_stack(bits, group, False, in_f=1536 if group == 384 else 1024)[1]
                                          for bits, group in ((2, 32), (2, 16), (4, 16), (8, 16), (3, 128), (3, 32),
                                                              (3, 16), (4, 384))])
    assert checked >= 60 and not over, (checked, over)


def test_a_multiple_of_128_builds_without_kcols():
    """The validated builds are unchanged: no ``KCOLS`` where in_features is a multiple of 128."""
    _, stack = _stack(4, 128, False, in_f=512)
    assert "KCOLS" not in cuda_sbmm.macros(stack, torch.float16, cuda_sbmm.CudaConfig())


def _parity_past_the_row(bits, dtype, asym, group, in_f, compact, seed):
    """Four 2:4 slots of ``[192, in_f]`` against the reference over several launch shapes (row blocks,
    stages, K splits, two tiles per warp, two K tiles per stage), rows of no slot adding exactly 0, and the
    dense-dequantize path. The activations are a view of a wider tensor whose columns past the row are
    NaN: one read past ``in_features`` would poison its row."""
    gen = torch.Generator().manual_seed(seed)
    out_f, n_slots = 192, 4
    deltas = [make_delta(out_f, in_f, bits, group, True, asym, gen) for _ in range(n_slots)]
    stack = repack(deltas, device="cuda", layout="mma", compact=compact)
    assert stack.compact == compact
    for rows in ([2, 0, 3, -1, 2, 2, 1], [3] * 21 + [0] * 9 + [-1] * 2, [1]):
        index = torch.tensor(rows)
        wide = torch.full((len(rows), in_f + 64), float("nan"), dtype=dtype)
        wide[:, :in_f] = torch.randn(len(rows), in_f, generator=gen).to(dtype)
        x = wide.cuda()[:, :in_f]
        ref = reference.sbmm(x.contiguous(), index.cuda(), deltas)
        plan = plan_rows(rows, n_slots, "cuda")
        cfgs = [cuda_sbmm.CudaConfig(2, 4, 1), cuda_sbmm.CudaConfig(1, 3, 2), cuda_sbmm.CudaConfig(2, 2, 3),
                cuda_sbmm.CudaConfig(2, 4, 2, kt=2), cuda_sbmm.CudaConfig(1, 8, 1),
                cuda_sbmm.CudaConfig(2, 4, 1, mt=2), cuda_sbmm.CudaConfig(1, 4, 2, mt=2)]
        for cfg in [c for c in cfgs if cuda_sbmm.kt_ok(stack, c.kt) and cuda_sbmm.mt_ok(stack, c.mt)]:
            y = cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg)
            assert torch.isfinite(y).all(), cfg
            _check(y, ref, dtype)
            assert torch.equal(y[index.cuda() < 0], torch.zeros_like(y[index.cuda() < 0]))
    for s in range(n_slots):
        _check(cuda_sbmm.dequantize_slot(stack, s, dtype), reference.delta_weight(deltas[s]).to(dtype).cuda(), dtype)
    rows = random_index(300, n_slots, gen).tolist()
    x = torch.randn(300, in_f, generator=gen).to(dtype).cuda()
    _check(cuda_sbmm.dequant_mm(x, stack, plan_rows(rows, n_slots, "cuda")),
           reference.sbmm(x, torch.tensor(rows).cuda(), deltas), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym,group,in_f", [(False, 64, 576), (True, 32, 576), (False, -1, 576), (True, 64, 320),
                                             (False, -1, 960), (True, 16, 512), (False, 32, 512), (True, 16, 208),
                                             (True, 128, 512), (False, 384, 1536), (True, 640, 1280),
                                             (True, 96, 576), (False, 192, 1536)])
def test_preview_paths_match_the_reference_and_never_read_past_the_row(preview_on, bits, dtype, asym, group, in_f):
    """The preview paths, a padded last K tile, narrow groups, 3-bit codes, groups of 3 or 5 tiles (K
    splits and two-tile stages inside a group) and groups split into sub-groups (96, 192 columns), over every launch shape (row blocks,
    stages, K splits through the padded tile, two tiles per warp, two K tiles per stage) and the
    dense-dequantize path. The activations are a view of a wider tensor whose columns past the row are
    NaN: one read past ``in_features`` would poison its row."""
    if not cuda_sbmm.available():
        pytest.skip("sm_80+ and NVRTC needed")
    _parity_past_the_row(bits, dtype, asym, group, in_f, compact=False, seed=bits * 11 + in_f)


# ------------------------------------ the compact 2:4 layout on the sparse MMA (preview: sparse-mma, SP24)

@pytest.fixture
def all_previews(monkeypatch):
    """Every preview path: a compact stack over 576 columns also needs padded-k, over groups of 384 wide-groups."""
    from deltazip.kernels import preview

    monkeypatch.setenv(preview.ENV, "all")


SPARSE_VARIANTS = [(bits, dt, asym, group, in_f, rb, kt, mt)
                   for bits in (3, 4, 8) for dt in (torch.float16, torch.bfloat16) for asym in (False, True)
                   for group, in_f, rb, kt, mt in ((128, 512, 2, 1, 1), (64, 512, 1, 1, 2), (32, 576, 2, 1, 1),
                                                   (-1, 1024, 2, 2, 1), (384, 1536, 1, 1, 1))
                   if (kt == 1 and mt == 1) or bits <= 4]


@pytest.mark.parametrize("bits,dtype,asym,group,in_f,rb,kt,mt", SPARSE_VARIANTS)
def test_sparse_mma_preview_builds_compile_offline_to_the_streaming_loop(all_previews, bits, dtype, asym, group, in_f,
                                                                        rb, kt, mt):
    """The SP24 builds keep the main loop of the dense ones (16-byte copies only, no shared-memory store,
    one barrier, no local memory, registers within what ``ctas_per_sm`` counts on) with a sparse MMA
    (HMMA.SP, m16n8k32) per 32 columns where the dense build has two: 8 + 4 per tile for the two compute
    copies (tiles of more than 8 rows, and of 8 or fewer), and one x4 ldmatrix per k32 step and n8 tile."""
    rtc = nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    gen = torch.Generator().manual_seed(bits)
    stack = repack([make_delta(128, in_f, bits, group, True, asym, gen) for _ in range(2)], layout="mma",
                   compact=True)
    cfg = cuda_sbmm.CudaConfig(rb=rb, stages=4, kt=kt, mt=mt)
    assert cuda_sbmm.supported(stack, dtype) and cuda_sbmm.fits(stack, cfg, 0)
    macros = cuda_sbmm.macros(stack, dtype, cfg)
    assert macros["SP24"] == 1
    for arch in (80, 90):
        info = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), macros, arch), function="dz_sbmm")
        full = info["loop_full_opcodes"]
        copies = {op: n for op, n in full.items() if op.startswith("LDGSTS")}
        assert copies and all(op.endswith(".128") for op in copies), copies
        assert info["loop_smem_stores"] == 0, full
        assert sum(n for op, n in full.items() if op.startswith("BAR.SYNC")) == 1, full
        assert {op: n for op, n in full.items() if op.startswith("HMMA")} == {
            "HMMA.SP.16832.F32" + (".BF16" if dtype == torch.bfloat16 else ""): (8 + 4) * kt * mt}, full
        assert {op: n for op, n in full.items() if op.startswith("LDSM")} == {"LDSM.16.M88.4": 12 * kt}, full
        assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"]), "local memory (spills)"
        assert info["registers"] * cfg.threads * cuda_sbmm.ctas_per_sm(stack, cfg) <= cuda_sbmm.sm_limits(0)[2]
        deq = sass.opcodes(rtc.compile_cubin(cuda_sbmm.source(), macros, arch), function="dz_dequant")
        assert deq and not any(op.startswith(("LDL", "STL")) for op in deq)


def test_every_launch_config_of_the_sparse_mma_builds_fits_the_occupancy_the_model_assumes(tmp_path, monkeypatch):
    """Every config the tuner can time of the SP24 builds compiles for sm_90 with no local memory and
    within the register file at ``ctas_per_sm``."""
    nvrtc_or_skip()
    import _sass as sass

    if sass.tools_available():
        pytest.skip(sass.tools_available())
    monkeypatch.setenv("DELTAZIP_CUDA_CACHE", str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    checked, over = _configs_over_budget([repack([make_delta(128, 1024, bits, group, True, False, gen)], layout="mma",
                                                 compact=True)
                                          for bits, group in ((4, 128), (4, 32), (8, 64), (3, 128), (3, 32))],
                                         torch.float16)
    assert checked >= 50 and not over, (checked, over)


def test_a_compact_stack_stages_fewer_bytes_and_keys_its_own_tuning():
    """A stage of a compact 4-bit stack holds 768 code words per tile (1024 expanded), and its measured
    launch choices are kept apart from the expanded layout's."""
    from deltazip.kernels import dispatch_table

    gen = torch.Generator().manual_seed(0)
    d = make_delta(128, 512, 4, 128, True, False, gen)
    compact, expanded = repack([d], layout="mma", compact=True), repack([d], layout="mma", compact=False)
    assert cuda_sbmm.stage_bytes(expanded, 2) - cuda_sbmm.stage_bytes(compact, 2) == 2 * 256 * 4
    assert "SP24" not in cuda_sbmm.macros(expanded, torch.float16, cuda_sbmm.CudaConfig())
    assert dispatch_table.key(compact, torch.float16, 4, 2) != dispatch_table.key(expanded, torch.float16, 4, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym,group,in_f", [(False, 128, 512), (True, 64, 512), (False, 32, 576), (True, -1, 1024),
                                             (False, 384, 1536), (True, 96, 576)])
def test_sparse_mma_preview_matches_the_reference(all_previews, bits, dtype, asym, group, in_f):
    """The compact 2:4 layout on the sparse MMA over every launch shape, and the dense-dequantize path,
    against the reference (the activations past the row NaN, as above)."""
    if not cuda_sbmm.available():
        pytest.skip("sm_80+ and NVRTC needed")
    _parity_past_the_row(bits, dtype, asym, group, in_f, compact=True, seed=bits * 13 + in_f)
