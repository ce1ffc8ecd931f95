"""The CUDA kernel's preview launch options (``kernels/preview.py``: ``stream-k``, ``pdl``, ``evict-first``):
the stream-K work split and its reduction emulated on CPU, the tuner's handling of the options, the
offline builds, the driver-call layouts against ``cuda.h``, and parity on a GPU."""

from __future__ import annotations

import ctypes
import random
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from _sbmm import graph_case, make_delta, offline_tools

from deltazip.kernels import cuda_sbmm, dispatch_table, preview, reference
from deltazip.kernels.row_plan import plan_rows
from deltazip.kernels.stacked import StackedDeltas, repack
from deltazip.runtime.serve import kernel_tuning

# ------------------------------------------------------------------------------ the stream-K work split


def stream_k_parts(cta: int, ctas: int, units: int, stages: int) -> list[tuple[int, int, int, int, int]]:
    """The work of stream-K CTA ``cta`` of ``ctas``, in order: ``(unit, first stage, end stage, part, parts)``
    per unit it takes part in, by the kernel's own integer arithmetic (``dz_sbmm``'s ``STREAMK`` loop in
    ``kernels/cuda/sbmm.cu``, transcribed)."""
    total = units * stages
    s, e = cta * total // ctas, (cta + 1) * total // ctas
    out = []
    while s < e:
        u = s // stages
        k0 = s - u * stages
        k1 = min(stages, k0 + (e - s))
        first, last = ((u * stages + 1) * ctas - 1) // total, ((u + 1) * stages * ctas - 1) // total
        out.append((u, k0, k1, cta - first, last - first + 1))
        s += k1 - k0
    return out


@pytest.mark.parametrize("units,stages,wave", [(1, 32, 792), (64, 32, 792), (64, 32, 528), (130, 86, 264),
                                               (7, 10, 3), (5, 1, 9), (1, 1, 1), (344, 32, 264), (3, 5, 15)])
def test_stream_k_gives_every_stage_to_one_cta_in_runs_that_differ_by_at_most_one(units, stages, wave):
    """Every (unit, stage) is taken by exactly one CTA; a CTA's stages are contiguous and their number is
    the even share give or take one; a unit's parts are the CTAs that meet it, numbered 0.. in CTA order,
    each knowing the same part count, never more than the workspace slices ``stream_k_grid`` allots."""
    ctas, bound = cuda_sbmm.stream_k_grid(units, stages, wave)
    assert ctas == min(wave, units * stages)
    owner: dict[tuple[int, int], int] = {}
    parts: dict[int, list[tuple[int, int, int]]] = {}
    lengths = []
    for c in range(ctas):
        work = stream_k_parts(c, ctas, units, stages)
        assert work, f"CTA {c} has no stage"
        lengths.append(sum(k1 - k0 for _, k0, k1, _, _ in work))
        flat = [u * stages + k for u, k0, k1, _, _ in work for k in range(k0, k1)]
        assert flat == list(range(flat[0], flat[0] + len(flat)))  # one contiguous run
        for u, k0, k1, part, count in work:
            for k in range(k0, k1):
                assert (u, k) not in owner
                owner[(u, k)] = c
            parts.setdefault(u, []).append((c, part, count))
    assert len(owner) == units * stages
    assert max(lengths) - min(lengths) <= 1
    for u, ps in parts.items():
        assert [p for _, p, _ in ps] == list(range(len(ps))), (u, ps)
        assert {n for _, _, n in ps} == {len(ps)} and len(ps) <= bound
        assert [c for c, _, _ in ps] == sorted(c for c, _, _ in ps)


def _stream_k_emulate(x, w, plan_slots, out_f, rb, stages, wave, acc, order_seed):
    """The stream-K launch in numpy, by the kernel's protocol: each CTA's partial products of its stages;
    a unit of one part written at once, else each part stored in its own workspace slice and the CTA
    that counts the unit's last arrival sums the slices in part order and writes (adds to ``acc``). CTAs
    finish in a random order. Returns ``(y, counters after)``."""
    rows_of_tile = plan_slots  # [(slot, [rows])] per row tile
    grid_x = -(-out_f // (64 * rb))
    units = grid_x * len(rows_of_tile)
    ctas, bound = cuda_sbmm.stream_k_grid(units, stages, wave)
    kcols = x.shape[1] // stages
    y = acc.copy()
    ws = np.full((bound,) + acc.shape, np.nan, dtype=np.float32)
    counters = np.zeros(units, dtype=np.int64)
    work = [(c, item) for c in range(ctas) for item in stream_k_parts(c, ctas, units, stages)]
    random.Random(order_seed).shuffle(work)  # any finish order
    for _, (u, k0, k1, part, count) in work:
        slot, rows = rows_of_tile[u // grid_x]
        m0, m1 = (u % grid_x) * 64 * rb, min(out_f, (u % grid_x + 1) * 64 * rb)
        k_lo, k_hi = k0 * kcols, k1 * kcols
        p = x[np.ix_(rows, range(k_lo, k_hi))] @ w[slot][m0:m1, k_lo:k_hi].T
        if count == 1:
            y[np.ix_(rows, range(m0, m1))] += p
            continue
        ws[part][np.ix_(rows, range(m0, m1))] = p
        counters[u] += 1
        if counters[u] == count:  # the last arrival sums every part, in part order
            total = np.zeros_like(p)
            for z in range(count):
                total += ws[z][np.ix_(rows, range(m0, m1))]
            y[np.ix_(rows, range(m0, m1))] += total
            counters[u] = 0
    return y, counters


@pytest.mark.parametrize("wave", [3, 7, 40, 1000])
def test_stream_k_sums_the_units_it_cuts_to_the_product_whatever_order_its_ctas_finish(wave):
    """The work split and the reduction together give ``y + x W^T`` over each row tile's slot, rows of no
    tile untouched, for a wave that cuts units into many parts (3 CTAs over 24 units) or into single
    stages (1000 CTAs), with the counters back at zero; the result is bit-identical for any finish
    order (the parts are summed in a fixed order)."""
    rng = np.random.default_rng(0)
    out_f, k, stages, rb = 300, 80, 10, 1
    w = rng.standard_normal((3, out_f, k)).astype(np.float32)
    x = rng.standard_normal((20, k)).astype(np.float32)
    tiles = [(0, [0, 4, 5]), (2, [1, 2, 3, 6, 7]), (1, list(range(8, 19)))]  # row 19: no tile
    acc = rng.standard_normal((20, out_f)).astype(np.float32)
    want = acc.copy()
    for slot, rows in tiles:
        want[rows] += x[rows] @ w[slot].T
    results = []
    for seed in range(3):
        y, counters = _stream_k_emulate(x, w, tiles, out_f, rb, stages, wave, acc, seed)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3)
        assert not counters.any()
        results.append(y)
    assert all(np.array_equal(results[0], r) for r in results[1:])
    assert np.array_equal(results[0][19], acc[19])


# --------------------------------------------------------------------- configs, candidates, the table


def _meta(bits=4, group=128, in_f=4096, out_f=4096, asym=False, n=64):
    return StackedDeltas.allocate(n, bits=bits, group_size=group, in_features=in_f, out_features=out_f,
                                  sparse=True, asymmetric=asym, layout="mma", device="meta")


def test_the_options_are_macros_of_their_own_builds_and_pdl_needs_sm_90(monkeypatch):
    """Each option compiles to its own build (its macro), and a config without options compiles to the
    validated kernel's macros exactly (the same cubins, the same tuned tables' builds); stream-K cuts K
    itself, and programmatic dependent launch needs sm_90."""
    stack = _meta()
    plain = cuda_sbmm.CudaConfig(rb=2, stages=4, kt=1)
    base = cuda_sbmm.macros(stack, torch.float16, plain)
    assert not {"STREAMK", "PDL", "EVICT"} & set(base)
    assert set(preview.LAUNCH_OPTIONS) == {"stream-k", "pdl", "evict-first"} <= set(preview.FEATURES)
    for field, macro in (("stream_k", "STREAMK"), ("pdl", "PDL"), ("evict", "EVICT")):
        got = cuda_sbmm.macros(stack, torch.float16, replace(plain, **{field: True}))
        assert got == {**base, macro: 1}
    with pytest.raises(ValueError, match="split 1"):
        cuda_sbmm.CudaConfig(split=2, stream_k=True)
    assert cuda_sbmm.fits(stack, replace(plain, pdl=True), 0)  # offline: an H100's sm_90
    monkeypatch.setattr(cuda_sbmm, "arch", lambda device_index=0: 80)
    assert not cuda_sbmm.fits(stack, replace(plain, pdl=True), 0) and cuda_sbmm.fits(stack, plain, 0)


def test_the_tuner_times_the_options_only_when_they_are_switched_on(monkeypatch):
    stack = _meta()
    monkeypatch.delenv(preview.ENV, raising=False)
    plain = kernel_tuning.candidates(stack, 4, 4, 132)
    assert plain and not any(preview.config_options(c.config) for c in plain if c.config is not None)
    sk = kernel_tuning.candidates(stack, 4, 4, 132, frozenset({"stream-k"}))
    streamed = [c.config for c in sk if c.config is not None and c.config.stream_k]
    assert {(c.rb, c.kt) for c in streamed} == {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert all(c.split == 1 and not (c.pdl or c.evict) for c in streamed)
    assert [c for c in sk if c.config is None or not c.config.stream_k] == plain
    both = kernel_tuning.candidates(stack, 64, 4, 132, frozenset({"pdl", "evict-first"}))
    assert all(c.config.pdl and c.config.evict for c in both if c.config is not None)
    assert [replace(c.config, pdl=False, evict=False) if c.config else None for c in both] == \
        [c.config for c in kernel_tuning.candidates(stack, 64, 4, 132)]
    assert any(c.path == "dequant_mm" for c in both)  # 16 rows per slot: the cuBLAS path stays a candidate
    monkeypatch.setenv(preview.ENV, "stream-k,pdl")
    assert kernel_tuning.candidates(stack, 4, 4, 132) == kernel_tuning.candidates(
        stack, 4, 4, 132, frozenset({"stream-k", "pdl"}))
    monkeypatch.setattr(cuda_sbmm, "arch", lambda device_index=0: 80)
    assert not any(c.config.pdl for c in kernel_tuning.candidates(stack, 4, 4, 132) if c.config is not None)


def test_a_tuned_choice_that_uses_an_option_switched_off_since_is_not_used(tmp_path, monkeypatch):
    """A table tuned with ``DELTAZIP_CUDA_PREVIEW=pdl`` keeps that choice on disk; a process without the
    preview reads the key as untuned (the default launch) instead of launching an unvalidated build."""
    monkeypatch.setenv("DELTAZIP_AUTOTUNE_DIR", str(tmp_path))
    monkeypatch.setenv(preview.ENV, "pdl")
    dispatch_table.forget_loaded()
    try:
        gen = torch.Generator().manual_seed(0)
        stack = repack([make_delta(128, 256, 4, 128, True, False, gen) for _ in range(2)], layout="mma")
        choice = dispatch_table.Choice("cuda", cuda_sbmm.CudaConfig(rb=1, kt=2, pdl=True, evict=True), 9.5)
        table = dispatch_table.table_for(stack.device)
        table.entries[dispatch_table.key(stack, torch.float16, 1, 1)] = choice
        table.save()
        dispatch_table.forget_loaded()
        assert dispatch_table.lookup(stack, torch.float16, 1, 1) is None  # evict-first is off
        monkeypatch.setenv(preview.ENV, "pdl,evict-first")
        assert dispatch_table.lookup(stack, torch.float16, 1, 1) == choice  # read back from disk
        monkeypatch.delenv(preview.ENV)
        assert dispatch_table.lookup(stack, torch.float16, 1, 1) is None
    finally:
        dispatch_table.forget_loaded()


def test_a_choice_keeps_its_options_through_json_and_older_tables_read_without_them():
    c = dispatch_table.Choice("cuda", cuda_sbmm.CudaConfig(rb=1, stages=4, split=1, kt=2, stream_k=True, pdl=True), 3.2)
    assert dispatch_table.Choice.from_json(c.to_json()) == c
    old = {"path": "cuda", "us": 4.0, "rb": 2, "stages": 4, "split": 2, "kt": 1}
    cfg = dispatch_table.Choice.from_json(old).config
    assert cfg == cuda_sbmm.CudaConfig(rb=2, stages=4, split=2, kt=1) and not preview.config_options(cfg)


def test_a_stream_k_grid_is_one_wave_of_the_ctas_the_model_counts_per_sm():
    stack = _meta(n=4)
    cfg = cuda_sbmm.CudaConfig(rb=1, kt=1, stream_k=True)
    wave = cuda_sbmm.stream_k_wave(stack, cfg)
    assert kernel_tuning.grid_ctas(stack, 1, cfg) == wave  # 64 blocks x 32 stages: more stages than CTAs
    assert kernel_tuning.waves(stack, 4, cfg) == pytest.approx(1.0)
    tiny = _meta(in_f=256, out_f=64, n=2)
    assert kernel_tuning.grid_ctas(tiny, 1, cfg) == 2  # one block of 2 stages: a CTA per stage


# ------------------------------------------------------------------------------------ offline builds


def _main_loop(info):
    return max(info["loops"], key=lambda lp: (lp["mma"], -lp["instructions"]))


def _structure(info) -> dict[str, int]:
    """The main loop's copies, ldmatrix, barriers and MMAs (what an option must leave as it is; the
    integer instructions between them move with register allocation)."""
    return {op: n for op, n in info["loop_full_opcodes"].items() if op.startswith(("LDGSTS", "LDSM", "BAR", "HMMA"))}


STREAM_K_BUILDS = [(bits, dt, asym, group, rb, kt, mt)
                   for bits, asym, group in ((2, False, 128), (4, False, 128), (4, True, 64), (8, False, 128),
                                             (8, True, 32), (4, False, -1))
                   for dt in ((torch.float16, torch.bfloat16) if (bits, group) == (4, 128) else (torch.bfloat16,))
                   for rb, kt, mt in ((1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2))
                   if (kt == 1 or (bits <= 4 and group in (128, -1))) and (mt == 1 or bits <= 4)]


@pytest.mark.parametrize("bits,dtype,asym,group,rb,kt,mt", STREAM_K_BUILDS)
def test_stream_k_builds_keep_the_streaming_loop_with_no_local_memory_in_it(bits, dtype, asym, group, rb, kt, mt):
    """The persistent loop around the unit keeps the validated main loop (16-byte copies, one barrier, the
    MMAs and ldmatrix of a full tile, no shared-memory store) with no local memory in it; the loop state
    around it (the CTA's run of stages) costs a few spill slots outside, touched once per unit (at most 28
    instructions over these builds with NVRTC 13.0: the bound is a guard against a spill creeping in);
    registers x threads x ``ctas_per_sm`` within the SM's file. sm_80 builds too."""
    rtc, sass = offline_tools()
    stack = _meta(bits, group, 1024, 192, asym, n=2)
    cfg = cuda_sbmm.CudaConfig(rb=rb, kt=kt, mt=mt, stream_k=True)
    assert cuda_sbmm.fits(stack, cfg, 0)
    macros = cuda_sbmm.macros(stack, dtype, cfg)
    cubin = rtc.compile_cubin(cuda_sbmm.source(), macros, 90)
    info = sass.analyze(cubin, function="dz_sbmm")
    classic = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, dtype, replace(cfg, stream_k=False)),
                                             90), function="dz_sbmm")
    assert _structure(info) == _structure(classic)
    assert info["loop_mma"] == (16 + 8) * kt * mt and info["loop_smem_stores"] == 0
    ins, _ = sass._disassemble(cubin, "dz_sbmm")
    main = _main_loop(info)
    local = [a for a, op, _ in ins if op.startswith(("LDL", "STL"))]
    assert not [a for a in local if main["start"] <= a <= main["end"]], "local memory in the main loop"
    assert len(local) <= 32, len(local)
    assert info["registers"] * cfg.threads * cuda_sbmm.ctas_per_sm(stack, cfg) <= cuda_sbmm.sm_limits(0)[2]
    assert sass.opcodes(rtc.compile_cubin(cuda_sbmm.source(), macros, 80), function="dz_sbmm")


@pytest.mark.parametrize("stream_k", [False, True])
def test_pdl_builds_wait_for_the_previous_kernel_before_any_global_read(stream_k):
    """``griddepcontrol.wait`` (SASS ``ACQBULK``) comes before the first global load, and the dependents are
    let go (``PREEXIT``) before the weights stream; the main loop streams as the non-PDL build's. PTX has no
    griddepcontrol before sm_90, so an sm_80 build is refused (``fits`` says so before it is tried)."""
    rtc, sass = offline_tools()
    from deltazip.kernels.cuda_rtc import CudaCompileError

    stack = _meta(4, 128, 1024, 192, n=2)
    cfg = cuda_sbmm.CudaConfig(rb=2, stream_k=stream_k, pdl=True)
    cubin = rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16, cfg), 90)
    ops = sass.opcodes(cubin, function="dz_sbmm")
    first_load = next(i for i, op in enumerate(ops) if op.startswith(("LDG", "LD.")))
    assert ops.index("ACQBULK") < first_load and ops.index("PREEXIT") < first_load
    plain = sass.analyze(rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16,
                                                                                replace(cfg, pdl=False)), 90),
                         function="dz_sbmm")
    assert _structure(sass.analyze(cubin, function="dz_sbmm")) == _structure(plain)
    assert not any(op.startswith(("LDL", "STL")) for op in sass.analyze(cubin, function="dz_sbmm")["all_opcodes"]) \
        or stream_k  # (stream-K builds' few spills outside the main loop: the test above)
    assert "ACQBULK" not in plain["all_opcodes"]
    with pytest.raises(CudaCompileError, match="sm_90"):
        rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16, cfg), 80)


@pytest.mark.parametrize("bits,asym,group,rb,kt", [(4, False, 128, 2, 1), (4, True, 64, 2, 1), (2, False, 128, 1, 2),
                                                    (8, True, 128, 1, 1)])
def test_evict_first_builds_copy_the_weights_under_their_own_cache_policy(bits, asym, group, rb, kt):
    """In the main loop of an ``EVICT`` build the weights', scales' and zero points' copies carry the
    evict-first policy (their own memory descriptor in SASS) and the activations' copies the default one;
    without ``EVICT`` every copy has the default descriptor. The loop streams as before, with no spill."""
    rtc, sass = offline_tools()
    stack = _meta(bits, group, 1024, 192, asym, n=2)
    cfg = cuda_sbmm.CudaConfig(rb=rb, kt=kt, evict=True)
    threads = cfg.threads
    x_pieces = 16 * 16 * kt // threads  # the activation copies per thread and stage (XP in sbmm.cu)

    def descriptors(c):
        cubin = rtc.compile_cubin(cuda_sbmm.source(), cuda_sbmm.macros(stack, torch.float16, c), 90)
        info = sass.analyze(cubin, function="dz_sbmm")
        main = _main_loop(info)
        ins, _ = sass._disassemble(cubin, "dz_sbmm")
        used = [re.search(r"desc\[(\w+)\]", a).group(1) for ad, op, a in ins
                if op.startswith("LDGSTS") and main["start"] <= ad <= main["end"]]
        return sorted(used.count(d) for d in set(used)), info

    hinted, info = descriptors(cfg)
    plain, plain_info = descriptors(replace(cfg, evict=False))
    assert len(plain) == 1 and len(hinted) == 2 and sum(hinted) == plain[0]
    assert x_pieces in hinted  # one descriptor is the activations' alone
    assert _structure(info) == _structure(plain_info)
    assert not any(op.startswith(("LDL", "STL")) for op in info["all_opcodes"])


def _cuda_header() -> Path | None:
    import glob
    import sys

    for site in sys.path:
        for hit in glob.glob(f"{site}/triton/backends/nvidia/include/cuda.h") + glob.glob(f"{site}/nvidia/cu1*/include/cuda.h"):
            return Path(hit)
    for hit in sorted(glob.glob("/usr/local/cuda*/include/cuda.h")):
        return Path(hit)
    return None


def test_the_launch_structs_match_cuda_h(tmp_path):
    """``cuLaunchKernelEx``'s ``CUlaunchConfig`` and ``CUlaunchAttribute`` as ctypes lays them out, and the
    attribute number of programmatic stream serialization, against a C program built on ``cuda.h``
    (from Triton's or a CUDA toolkit's headers; no GPU needed)."""
    from deltazip.kernels import cuda_rtc as r

    header, cc = _cuda_header(), shutil.which("cc") or shutil.which("gcc")
    if header is None or cc is None:
        pytest.skip("cuda.h or a C compiler is not installed")
    src = tmp_path / "layout.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\nint main(void) {\n"
                   ' printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),'
                   " sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),"
                   " offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),"
                   " (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(header.parent), str(src), "-o", str(exe)], check=True, capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    ours = [ctypes.sizeof(r.LaunchAttribute), r.LaunchAttribute.value.offset, ctypes.sizeof(r.LaunchConfig),
            r.LaunchConfig.sharedMemBytes.offset, r.LaunchConfig.hStream.offset, r.LaunchConfig.attrs.offset,
            r.LaunchConfig.numAttrs.offset, r.LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert got == ours
    attr = r._PDL_ATTR[0]
    assert attr.id == 6 and ctypes.c_int.from_buffer_copy(bytes(attr.value)[:4]).value == 1


# ----------------------------------------------------------------------------------------- on a GPU

OPTION_SETS = [{"stream_k": True}, {"pdl": True}, {"evict": True}, {"stream_k": True, "pdl": True, "evict": True}]


def _check(y, ref, dtype):
    rel = ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert rel < (2e-3 if dtype == torch.float16 else 1e-2), rel


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "+".join(o))
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("asym,group", [(False, 128), (True, 64)])
def test_launch_option_previews_match_the_reference(options, bits, dtype, asym, group):
    """Each option alone and all three together, over launch configs that cut units between CTAs (10 K
    tiles), an odd block count, rows of no slot, tiles of slots the stack does not hold (``present``), and
    both a fresh output and one added onto."""
    gen = torch.Generator().manual_seed(bits * 11 + int(asym))
    out_f, in_f, n_slots = 192, 1280, 5
    deltas = [make_delta(out_f, in_f, bits, group, True, asym, gen) for _ in range(n_slots)]
    stack = repack(deltas, device="cuda", layout="mma")
    cfgs = [cuda_sbmm.CudaConfig(rb=rb, kt=kt, mt=mt, **options)
            for rb, kt, mt in ((2, 1, 1), (1, 2, 1), (2, 1, 2))]
    cfgs = [c for c in cfgs if cuda_sbmm.fits(stack, c, 0)]
    assert cfgs
    for rows in ([2, 0, 4, -1, 2, 2, 1], [3] * 21 + [0] * 9 + [-1] * 2, [1]):
        index = torch.tensor(rows)
        x = torch.randn(len(rows), in_f, generator=gen).to(dtype).cuda()
        ref = reference.sbmm(x, index.cuda(), deltas)
        plan = plan_rows(rows, n_slots, "cuda")
        present = torch.ones(n_slots + 1, dtype=torch.uint8, device="cuda")
        present[3] = 0  # slot 2 is not held: its rows get nothing
        ref_held = ref.clone()
        ref_held[index.cuda() == 2] = 0
        for cfg in cfgs:
            y = cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg)
            _check(y, ref, dtype)
            assert torch.equal(y[index.cuda() < 0], torch.zeros_like(y[index.cuda() < 0]))
            base = (0.01 * torch.randn(len(rows), out_f, generator=gen)).to(dtype).cuda()
            y2 = cuda_sbmm.sbmm_cuda(x, stack, plan, out=base.clone(), present=present, config=cfg)
            _check(y2 - base, ref_held, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("wave", [1, 3, 17, 10_000])
def test_launch_option_preview_stream_k_cuts_units_into_many_parts_and_still_matches(wave):
    """A wave forced small (one CTA doing everything; 3 or 17 CTAs cutting units at odd stages) or larger
    than the work (a CTA per stage: every unit cut into 10 parts)."""
    gen = torch.Generator().manual_seed(wave)
    deltas = [make_delta(320, 1280, 4, 128, True, True, gen) for _ in range(3)]
    stack = repack(deltas, device="cuda", layout="mma")
    rows = [0, 1, 2, 2, 1, -1, 0] + [2] * 17
    x = torch.randn(len(rows), 1280, generator=gen).half().cuda()
    ref = reference.sbmm(x, torch.tensor(rows).cuda(), deltas)
    plan = plan_rows(rows, 3, "cuda")
    for cfg in (cuda_sbmm.CudaConfig(rb=1, stream_k=True), cuda_sbmm.CudaConfig(rb=2, kt=2, stream_k=True, pdl=True)):
        build = cuda_sbmm.build_for(stack, torch.float16, cfg)
        build.wave = wave
        try:
            _check(cuda_sbmm.sbmm_cuda(x, stack, plan, config=cfg), ref, torch.float16)
        finally:
            build.wave = cuda_sbmm.stream_k_wave(stack, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "+".join(o))
def test_launch_option_previews_are_deterministic_reset_their_counters_and_replay_in_a_graph(options):
    """Captured in a CUDA graph between other kernels (programmatic dependent launches become graph edges):
    every replay gives the same bits as the eager call, and every counter is zero after it."""
    _, stack, x, plan, ref = graph_case()
    cfg = cuda_sbmm.CudaConfig(rb=1, **options)
    y = torch.zeros(x.shape[0], 256, dtype=torch.float16, device="cuda")

    def step():
        y.zero_()
        cuda_sbmm.sbmm_cuda(x, stack, plan, out=y, config=cfg)
        y.mul_(2)  # the kernel after it reads its output
        cuda_sbmm.sbmm_cuda(x, stack, plan, out=y, config=cfg)  # and one of its own right behind that

    step()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    want = y.clone()
    _check(want, 3 * ref, torch.float16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)
    assert int(cuda_sbmm._WORKSPACE.counters[0].count_nonzero()) == 0
