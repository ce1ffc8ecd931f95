"""How the delta matmul's dispatch table (``deltazip.kernels.dispatch_table``) is filled: for one key, every
candidate is checked and timed the way a decode step runs it, and the fastest is written to the table that
the prepared launches read.

- **Candidates** (:func:`candidates`): the CUDA kernel's launch configurations worth timing, chosen with a
  model of its occupancy and memory pipeline (:func:`waves`, :func:`in_flight_bytes`: wave tails, weight
  bytes in flight per SM), and ``dequant_mm`` (dequantize each used slot once, then cuBLAS) for batches of
  many rows per slot.
- **Checks** (:func:`agrees`): a launch configuration is timed only after it gave the result of
  ``dequant_mm`` on random weights on this GPU; a stack configuration whose every launch is wrong is
  distrusted (``dispatch_table.distrust``) and served by the reference.
- **Timing** (:func:`graph_timer`): launches replayed in a CUDA graph with the L2 flushed between them.

It runs when a server starts (``kernel_warmup``), on the background tuner (``kernel_tuner``), from
``deltazip tune`` and the benches, never on the request path; a candidate that does not fit (shared
memory, ``OutOfResources``) or fails to compile is skipped and recorded, never raised.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import astuple, replace

import torch

from deltazip.kernels import cuda_sbmm, dispatch_table, mma_sparse, preview
from deltazip.kernels.cuda_sbmm import weight_stage_bytes
from deltazip.kernels.dispatch_table import Choice
from deltazip.kernels.row_plan import plan_rows, rows_bucket
from deltazip.kernels.stacked import StackedDeltas
from deltazip.runtime.serve import graph_capture

log = logging.getLogger("deltazip.kernels")

# --------------------------------------------------------------------------------------------------
# A model of the kernel's launches: waves, and weight bytes in flight per SM
# --------------------------------------------------------------------------------------------------

H100_DRAM_BYTES_PER_S = 2 * 2619e6 * 5120 / 8  # an H100 SXM's HBM3: 2619 MHz, 5120 bits, double data rate


@functools.cache
def dram_bandwidth(device_index: int = 0) -> float:
    """Peak DRAM bytes per second of the GPU: memory clock x bus width x 2, from the driver
    (``cuDeviceGetAttribute``; torch does not expose them); an H100 SXM's when no GPU is there to ask
    (offline planning) or the driver does not answer."""
    if not torch.cuda.is_available():
        return H100_DRAM_BYTES_PER_S
    try:
        from deltazip.kernels.cuda_rtc import driver

        lib = driver()
        torch.cuda.init()
        dev, clk_khz, bus_bits = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if (lib.cuDeviceGet(ctypes.byref(dev), device_index)
                or lib.cuDeviceGetAttribute(ctypes.byref(clk_khz), 36, dev)  # MEMORY_CLOCK_RATE (kHz)
                or lib.cuDeviceGetAttribute(ctypes.byref(bus_bits), 37, dev)):  # GLOBAL_MEMORY_BUS_WIDTH
            return H100_DRAM_BYTES_PER_S
    except OSError:
        return H100_DRAM_BYTES_PER_S
    if clk_khz.value <= 0 or bus_bits.value <= 0:
        return H100_DRAM_BYTES_PER_S
    return 2 * clk_khz.value * 1e3 * bus_bits.value / 8


def grid_ctas(stack: StackedDeltas, num_tiles: int, cfg: cuda_sbmm.CudaConfig, device_index: int = 0) -> int:
    """CTAs of a launch over ``num_tiles`` row tiles: 64-row blocks / ``rb`` x tiles x the splits it runs
    (stream-K: one wave, ``cuda_sbmm.stream_k_grid``)."""
    blocks = -(-cuda_sbmm.padded_rows(stack.out_features) // (64 * cfg.rb)) * num_tiles
    if cfg.stream_k:
        return cuda_sbmm.stream_k_grid(blocks, cuda_sbmm.k_tiles(stack.in_features) // cfg.kt, cuda_sbmm.stream_k_wave(stack, cfg, device_index))[0]
    return blocks * cuda_sbmm.effective_split(cuda_sbmm.k_tiles(stack.in_features), cfg)[1]


def waves(stack: StackedDeltas, num_tiles: int, cfg: cuda_sbmm.CudaConfig, device_index: int = 0) -> float:
    """The grid of a launch over the CTAs the device runs at once (``cuda_sbmm.sm_limits``, ``ctas_per_sm``): a wave
    count, whose fractional tail leaves SMs idle while the last wave runs."""
    return grid_ctas(stack, num_tiles, cfg, device_index) / (cuda_sbmm.sm_limits(device_index)[0]
                                                            * cuda_sbmm.ctas_per_sm(stack, cfg, device_index))


def in_flight_bytes(stack: StackedDeltas, num_tiles: int, cfg: cuda_sbmm.CudaConfig, device_index: int = 0) -> int:
    """Weight bytes one SM has requested and not yet received while a launch streams: its resident CTAs
    (those the grid gives it, at most ``cuda_sbmm.ctas_per_sm``) times the ``stages - 1`` stages each keeps in
    flight. By Little's law an SM streams at most this over the memory latency."""
    given = -(-grid_ctas(stack, num_tiles, cfg, device_index) // cuda_sbmm.sm_limits(device_index)[0])  # CTAs given an SM
    resident = min(cuda_sbmm.ctas_per_sm(stack, cfg, device_index), given)
    return resident * (cfg.stages - 1) * weight_stage_bytes(stack, cfg.rb, cfg.kt)


def wave_efficiency(w: float) -> float:
    """Share of the SM time of a launch of ``w`` waves that does work (1 for whole waves; ``w`` below one
    wave, which leaves SMs idle throughout)."""
    return w / math.ceil(w) if w > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# Candidates of a key
# --------------------------------------------------------------------------------------------------

SPLIT_WAVES = 8  # a K split is timed only while the split grid stays within this many CTAs per SM


def candidates(stack: StackedDeltas, rows: int, deltas: int, sms: int | None = None,
               options: frozenset[str] | None = None) -> list[Choice]:
    """Every CUDA launch config worth timing for this key, and ``dequant_mm`` for batches of at least
    16 rows per slot.

    ``options``: the preview launch options to time (``kernels/preview.py``; default: those switched on in
    ``DELTAZIP_CUDA_PREVIEW``): ``stream-k`` adds a stream-K launch per ``rb`` and ``kt``; ``pdl`` (sm_90+)
    and ``evict-first`` turn their option on in every CUDA candidate.

    For each ``rb`` and ``kt``: K splits 1, 2, 4 and 8; with ``sms`` (the device's SM count) those above 1
    only while the split grid has at most ``SPLIT_WAVES`` CTAs per SM (splitting exists to fill an
    underfilled grid; beyond that it only adds the partials' traffic), plus the fewest other splits in
    2..8 that fill the last wave 5 points better than those (``_better_split``,
    ``wave_efficiency``: an 11008-row output over 4 row tiles is 344 CTAs of 256 threads, two
    per SM; split 3 fills 3.9 waves of 132 x 2, split 2 only 2.6). On the two Hopper runs
    (H100, H200; 192 tuned keys) 7 keys chose a split beyond this bound, each within 3.5% of the same key
    in the other activation dtype, which mostly chose split 1 (``docs/kernels.md``, "Start-up tuning")."""
    k_tiles = cuda_sbmm.k_tiles(stack.in_features)
    n = rows_bucket(rows)
    d = min(dispatch_table.deltas_bucket(deltas), stack.num_deltas, n)
    tiles = d * -(-(n // d) // 16)  # the probe spreads n rows evenly over d slots, 16-row tiles
    dev = (stack.device.index or 0) if stack.device.type == "cuda" else 0
    options = preview.launch_options() if options is None else options
    out = []
    for kt in (1, 2):
        if not cuda_sbmm.kt_ok(stack, kt):
            continue
        for rb in (1, 2):
            ctas = -(-cuda_sbmm.padded_rows(stack.out_features) // (64 * rb)) * tiles
            k_ok = [sp for sp in range(1, 9) if sp == 1 or k_tiles // (sp * kt) >= 2]
            splits = [sp for sp in k_ok
                      if sp == 1 or (sp in (2, 4, 8) and (sms is None or ctas * sp <= SPLIT_WAVES * sms))]
            if sms is not None:
                splits += _better_split(stack, tiles, rb, kt, splits, k_ok, dev)
            out += [Choice("cuda", _config(rb, kt, sp)) for sp in splits]
            if sms is not None:
                out += [Choice("cuda", c) for sp in splits if (c := _deeper(stack, tiles, rb, kt, sp, dev))]
            if "stream-k" in options:
                out.append(Choice("cuda", cuda_sbmm.CudaConfig(rb=rb, kt=kt, stream_k=True)))
    if n // d > 8 and cuda_sbmm.mt_ok(stack, 2):  # tiles of two n8 halves: their activation reads halve too
        out += [Choice("cuda", replace(c.config, mt=2)) for c in list(out) if c.config is not None]
    flags = {"pdl": "pdl" in options and cuda_sbmm.arch(dev) >= 90, "evict": "evict-first" in options}
    if any(flags.values()):
        out = [Choice("cuda", replace(c.config, **flags)) if c.config is not None else c for c in out]
    if rows // max(1, min(deltas, rows)) >= 16:
        out.append(Choice("dequant_mm"))
    return out


def _config(rb: int, kt: int, split: int, stages: int = 4) -> cuda_sbmm.CudaConfig:
    return cuda_sbmm.CudaConfig(rb=rb, stages=stages, split=split, kt=kt)


# A loaded DRAM round trip on Hopper, about 1.5 us: an SM streams at its share of the DRAM bandwidth only
# while it keeps that share x this latency requested (Little's law; an H100's 3.35 TB/s over 132 SMs
# makes 38 KB, an H200's 4.8 TB/s 55 KB). Small grids (few deltas, a 4096-row output: two CTAs per SM)
# keep 25 KB in flight at 4 stages of 4-bit 64x128 tiles, and the H100 table's D = 4 points stream at
# half the copy bandwidth where D = 64 ones reach 85%.
LOADED_LATENCY_S = 1.5e-6
DEEP_STAGES = (8, 6)


def in_flight_target(dev: int = 0) -> int:
    """Weight bytes an SM keeps requested to stream at its share of the GPU's DRAM bandwidth
    (``dram_bandwidth``; an H100's offline)."""
    return int(dram_bandwidth(dev) / cuda_sbmm.sm_limits(dev)[0] * LOADED_LATENCY_S)


def _deeper(stack: StackedDeltas, tiles: int, rb: int, kt: int, split: int, dev: int) -> cuda_sbmm.CudaConfig | None:
    """The same launch with a deeper pipeline, when at 4 stages its SMs keep fewer weight bytes in flight
    than :func:`in_flight_target` (``in_flight_bytes``): the deepest of :data:`DEEP_STAGES`
    that fits the shared memory and keeps every CTA the grid gives an SM resident at once (deeper stages
    that cost resident CTAs trade one kind of parallelism for the other). None when 4 stages suffice."""
    base = _config(rb, kt, split)
    if in_flight_bytes(stack, tiles, base, dev) >= in_flight_target(dev):
        return None
    need = -(-grid_ctas(stack, tiles, base) // cuda_sbmm.sm_limits(dev)[0])  # CTAs the grid gives an SM
    for st in DEEP_STAGES:
        c = _config(rb, kt, split, st)
        k_per_split, _ = cuda_sbmm.effective_split(cuda_sbmm.k_tiles(stack.in_features), c)
        if (k_per_split // kt > st and cuda_sbmm.fits(stack, c, dev)
                and cuda_sbmm.ctas_per_sm(stack, c, dev) >= min(need, cuda_sbmm.ctas_per_sm(stack, base, dev))):
            return c
    return None


def _better_split(stack: StackedDeltas, tiles: int, rb: int, kt: int, kept: list[int], k_ok: list[int],
                  dev: int) -> list[int]:
    """``[split]``: the fewest splits of ``k_ok`` (beyond ``SPLIT_WAVES`` too) whose launch fills its last
    wave at least 5 points better than every ``kept`` one does; else ``[]``. Fewest, because each split
    adds fp32 partials of the whole output; one more candidate is cheap, and the tuner measures whether
    the fuller wave pays for them. Splits are compared by the split count a launch actually runs (3 over 8
    tiles in stages of 2 runs 2 splits of 4, the launch of split 2)."""
    k_tiles = cuda_sbmm.k_tiles(stack.in_features)
    runs = {sp: cuda_sbmm.effective_split(k_tiles, _config(rb, kt, sp))[1] for sp in k_ok}
    eff = {sp: wave_efficiency(waves(stack, tiles, _config(rb, kt, sp), dev)) for sp in k_ok}
    taken = {runs[sp] for sp in kept}
    floor = max(eff[sp] for sp in kept) + 0.05
    better = [sp for sp in k_ok if runs[sp] not in taken and eff[sp] >= floor]
    return [min(better, key=lambda sp: (runs[sp], -eff[sp]))] if better else []


def _probe(stack: StackedDeltas, dtype: torch.dtype, rows: int, deltas: int):
    """Random activations of ``rows`` rows spread over ``deltas`` slots, and their host plan."""
    n, d = rows_bucket(rows), min(dispatch_table.deltas_bucket(deltas), stack.num_deltas, rows_bucket(rows))
    x = torch.randn(n, stack.in_features, device=stack.device).to(dtype)
    plan = plan_rows([i % d for i in range(n)], stack.num_deltas, stack.device)
    return x, plan


def run_choice(choice: Choice, x: torch.Tensor, stack: StackedDeltas, plan, out: torch.Tensor | None = None,
               present: torch.Tensor | None = None) -> torch.Tensor:
    if choice.path == "dequant_mm":
        return cuda_sbmm.dequant_mm(x, stack, plan, out=out)
    return cuda_sbmm.sbmm_cuda(x, stack, plan, out=out, present=present, config=choice.config)


_AGREES: dict[tuple, bool] = {}


def agrees(stack: StackedDeltas, dtype: torch.dtype, config: cuda_sbmm.CudaConfig) -> bool:
    """Whether the CUDA kernel under ``config`` gives the result of ``dequant_mm`` (dequantize, then cuBLAS:
    another code path) on random weights of ``stack``'s configuration: 2 slots, 40 rows over both, within
    2% of the largest output (summation order and one rounding to ``dtype`` differ; a wrong launch is off
    by the output's own size). Once per configuration, dtype and launch config in a process: the tuner
    never chooses a launch config that no test has run on this GPU (the uneven K splits, say) unchecked."""
    k = (dispatch_table.key(stack, dtype, 1, 1).rsplit("/", 2)[0], str(stack.device), config)
    if k not in _AGREES:
        dev, gen = stack.device, torch.Generator(device=stack.device).manual_seed(0)
        s = StackedDeltas.allocate(2, stack.scheme, in_features=stack.in_features, out_features=stack.out_features,
                                   device=dev, layout="mma", compact=stack.compact)
        if s.compact:  # random codes at valid positions (two distinct, ascending, per four columns)
            for slot in range(2):
                s.qweight[slot].copy_(mma_sparse.random_slot(s.bits, s.out_features, s.in_features, gen))
        else:
            s.qweight.copy_(torch.randint(-2**31, 2**31 - 1, s.qweight.shape, dtype=torch.int32, device=dev,
                                          generator=gen))
        s.scales.copy_(torch.rand(s.scales.shape, device=dev, generator=gen) * 0.02 + 0.002)
        if s.zeros is not None:
            s.zeros.copy_(torch.randint(0, 1 << s.bits, s.zeros.shape, device=dev, generator=gen))
        x = torch.randn(40, s.in_features, device=dev, generator=gen).to(dtype)
        plan = plan_rows([i % 2 for i in range(40)], 2, dev)
        ref = cuda_sbmm.dequant_mm(x, s, plan).float()
        got = cuda_sbmm.sbmm_cuda(x, s, plan, config=config).float()
        _AGREES[k] = bool((got - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3)
    return _AGREES[k]


def graph_timer(fn: Callable[[], object], launches: int = 8, replays: int = 5) -> float:
    """Median milliseconds per launch of ``fn`` replayed in a CUDA graph, each launch after a write over
    twice the L2 (minus a graph of the writes alone): what a decode step pays, whose layers' weights
    are never L2-resident, without the host's launch overhead. (The first H200 run's tuner timed single
    launches with events, measuring mostly that overhead; its second timed repeated launches of one
    small probe, which the L2 held.)"""
    fn()  # compile and allocate outside the capture
    dev = torch.cuda.current_device()
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (64 << 20))
    scratch = torch.empty(2 * l2 // 4, dtype=torch.float32, device="cuda")
    # this thread's stream, not the device: the engine may be capturing a decode graph on another stream,
    # and a device-wide synchronisation during a capture is invalid (it would break the engine's capture)
    torch.cuda.current_stream(dev).synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with graph_capture.capture(g):  # beside the engine and the loader threads: one capture at a time, errors its own
            for _ in range(launches):
                scratch.zero_()
                if with_fn:
                    fn()
        g.replay()
        return g

    both, flush = capture(True), capture(False)
    times = []
    for _ in range(replays):
        pair = []
        for g in (both, flush):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            pair.append(s.elapsed_time(e))
        times.append(max(pair[0] - pair[1], 0.0) / launches)
    return sorted(times)[len(times) // 2]


def _default_timer(choice: Choice) -> Callable[[Callable[[], object]], float]:
    # dequant_mm gathers rows with a host-to-device copy, which a graph cannot capture
    return graph_timer if choice.path == "cuda" else (lambda fn: cuda_timer(fn, repeats=7))


def cuda_timer(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (after one untimed call: the compile)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# --------------------------------------------------------------------------------------------------
# Tuning a key, a stack
# --------------------------------------------------------------------------------------------------

def tune(stack: StackedDeltas, dtype: torch.dtype, rows: int, deltas: int, *, table: dispatch_table.Table | None = None,
         timer: Callable[[Callable[[], object]], float] | None = None, cands: list[Choice] | None = None,
         save: bool = True, check: Callable[[StackedDeltas, torch.dtype, cuda_sbmm.CudaConfig], bool] | None = None
         ) -> Choice:
    """Time every candidate of a key (skipping and recording the ones that fail); cache the fastest.

    ``timer`` (default: :func:`graph_timer` for the kernel, CUDA events for ``dequant_mm``) takes a
    zero-argument launch and returns milliseconds; ``check`` (default: :func:`agrees` on a GPU) tells
    whether a launch config computes the right thing; tests inject both.

    When every CUDA launch config that fits computes something else, the stack configuration is
    :func:`distrusted` (served by the reference path from then on, with one warning) and the
    key is not cached: a later process checks again rather than reading a choice that serves wrong
    numbers.
    """
    table = dispatch_table.table_for(stack.device) if table is None else table
    k = dispatch_table.key(stack, dtype, rows, deltas)
    have = table.entries.get(k)
    if have is not None:
        return have
    if check is None and stack.device.type == "cuda":
        check = agrees
    x, plan = _probe(stack, dtype, rows, deltas)
    y = torch.zeros(x.shape[0], stack.out_features, dtype=dtype, device=stack.device)
    best, skipped, checked, wrong = None, [], 0, 0
    sms = torch.cuda.get_device_properties(stack.device).multi_processor_count if stack.device.type == "cuda" else None
    for c in candidates(stack, rows, deltas, sms) if cands is None else cands:
        if c.config is not None and not cuda_sbmm.fits(stack, c.config, stack.device.index or 0):
            skipped.append(f"{c.to_json()}: shared memory does not fit")
            continue
        try:
            if c.path == "cuda" and check is not None:
                checked += 1
                if not check(stack, dtype, c.config):
                    wrong += 1
                    skipped.append(f"{c.to_json()}: its result differs from dequantize + cuBLAS on random weights")
                    continue
            t = (timer or _default_timer(c))(lambda c=c: run_choice(c, x, stack, plan, out=y))
        except Exception as e:  # noqa: BLE001 - OutOfResources, a compile error: skip this candidate
            skipped.append(f"{c.to_json()}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            continue
        if best is None or t < best.us / 1e3:
            best = Choice(c.path, c.config, round(t * 1e3, 2))
    if skipped:
        table.skipped[k] = skipped
    if checked and wrong == checked:
        dispatch_table.distrust(stack, dtype)
        warnings.warn(f"the CUDA delta matmul computed a wrong result under every launch config of {k} on this GPU; "
                      "that configuration is served by the reference path instead", stacklevel=2)
        return best or Choice("dequant_mm")
    if best is None:
        best = dispatch_table.default_choice(stack, rows, deltas)
        warnings.warn(f"no dispatch candidate ran for {k}; using the default ({skipped[:2]})", stacklevel=2)
    table.entries[k] = best
    dispatch_table.changed()
    if save:
        table.save()
    return best


DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_ROWS = (512, 2048)


def buckets(num_slots: int, rows: tuple[int, ...] = DECODE_ROWS + PREFILL_ROWS) -> list[tuple[int, int]]:
    """(rows, deltas) pairs tuned at start: every decode row bucket with every slot bucket it can hold,
    prefill chunks with one or two variants."""
    out = []
    for r in rows:
        ds = [1, 2] if r in PREFILL_ROWS else [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= min(r, num_slots)]
        out += [(r, d) for d in ds]
    return out


def precompile(stack: StackedDeltas, dtype: torch.dtype, pairs: list[tuple[int, int]], sms: int | None = None,
               arch: int | None = None, options: frozenset[str] | None = None) -> int:
    """Compile, in parallel, every kernel build the candidates of these (rows, deltas) keys launch (and
    the dequantize kernel of ``dequant_mm``) before any is timed; returns how many were compiled now.
    ``sms`` and ``arch`` default to the stack's GPU; ``options`` as in :func:`candidates`."""
    if stack.device.type == "cuda":
        props = torch.cuda.get_device_properties(stack.device)
        sms, arch = sms or props.multi_processor_count, arch or 10 * props.major + props.minor
    if arch is None:
        raise ValueError("precompile needs a CUDA stack or an explicit arch")
    from deltazip.kernels.cuda_rtc import precompile as compile_all

    configs = {c.config for r, d in pairs for c in candidates(stack, r, d, sms, options) if c.config is not None}
    configs.add(cuda_sbmm.CudaConfig(rb=1, stages=2, kt=1))  # dz_dequant's build (dequant_mm, agrees)
    dev = (stack.device.index or 0) if stack.device.type == "cuda" else 0
    sets = [cuda_sbmm.macros(stack, dtype, c, dev) for c in sorted(configs, key=lambda c: astuple(c))
            if cuda_sbmm.kt_ok(stack, c.kt) and cuda_sbmm.mt_ok(stack, c.mt)]
    return compile_all(cuda_sbmm.source(), sets, arch)
