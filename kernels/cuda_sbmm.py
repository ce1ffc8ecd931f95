"""SBMM on the CUDA kernel of ``kernels/cuda/sbmm.cu``, for stacks in the ``mma`` layout.

Same semantics as ``deltazip.kernels.reference.sbmm``; what runs it is decided by
``deltazip.kernels.dispatch`` (by measurement, ``deltazip.kernels.dispatch_table``). The kernel is compiled
at first use for the GPU at hand by NVRTC (``deltazip.kernels.cuda_rtc``); one launch per call, no
host synchronisation, nothing allocated per call when ``out`` is given (split-K partials go through a
per-device workspace whose counters every launch leaves at zero), so a CUDA graph can replay it.

Launch options (:class:`CudaConfig`): ``rb`` 64-row weight blocks per CTA (1 or 2: 4 or 8 warps),
``stages`` cp.async pipeline depth, ``split`` K splits reduced in the kernel, ``kt`` 128-column K tiles
per pipeline stage, ``mt`` 16-row weight tiles per warp (2: half the warps, each activation fragment
read from shared memory feeds two tiles); and three behind ``DELTAZIP_CUDA_PREVIEW`` (``kernels/preview.py``):
``stream_k`` a persistent grid of one wave sharing the work evenly (:func:`stream_k_grid`), ``pdl`` a
programmatic dependent launch (sm_90+), ``evict`` an L2 evict-first policy on the weight copies. None of
them changes the result beyond fp32 summation order.

Prefill-sized calls (many rows per slot) are better served by dequantizing each used slot once and
calling cuBLAS: :func:`dequant_mm`, the second candidate the dispatcher measures.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass, replace
from importlib import resources

import torch

from deltazip.kernels import mma_sparse, preview
from deltazip.kernels.mma_layout import divided_groups, k_tiles, layout_group, padded_rows
from deltazip.kernels.mma_layout import group_params as mma_group_params
from deltazip.kernels.mma_layout import supported as mma_supported
from deltazip.kernels.row_plan import RowPlan, group_rows
from deltazip.kernels.stacked import StackedDeltas

DTYPES = (torch.float16, torch.bfloat16)
BITS = (2, 3, 4, 8)
BM = 16


@dataclass(frozen=True)
class CudaConfig:
    """Launch options of the CUDA SBMM kernel (module docstring)."""

    rb: int = 2
    stages: int = 4
    split: int = 1
    kt: int = 1
    mt: int = 1
    stream_k: bool = False
    pdl: bool = False
    evict: bool = False

    def __post_init__(self):
        if (self.rb not in (1, 2) or not 2 <= self.stages <= 8 or self.split < 1 or self.kt not in (1, 2)
                or self.mt not in (1, 2)):
            raise ValueError(f"CudaConfig {self}: rb in (1, 2), 2 <= stages <= 8, split >= 1, kt in (1, 2), "
                             "mt in (1, 2)")
        if self.stream_k and self.split != 1:
            raise ValueError(f"CudaConfig {self}: a stream-K launch cuts K itself; give split 1")

    @property
    def threads(self) -> int:
        """Threads per CTA: 4 warps per 64-row block, halved when each warp covers two 16-row tiles."""
        return 128 * self.rb // self.mt


@functools.cache
def source() -> str:
    return resources.files("deltazip.kernels").joinpath("cuda/sbmm.cu").read_text()


def group_params(stack: StackedDeltas) -> tuple[int, int] | None:
    """``mma_layout.group_params`` of a stack: ``(GK16, group_shift)``."""
    return mma_group_params(stack.effective_group, stack.in_features)


def covers(scheme, in_features: int, dtype: torch.dtype) -> str | None:
    """None when the kernel serves deltas of ``scheme`` (a ``DeltaScheme``) over ``in_features`` columns
    with ``dtype`` activations (in the ``mma`` layout, on an sm_80+ GPU), else what it lacks, as the end
    of a sentence ("... runs on the torch reference: <reason>")."""
    g = scheme.effective_group(in_features)
    if dtype not in DTYPES:
        return f"{str(dtype).removeprefix('torch.')} activations (the kernel takes fp16 and bf16)"
    if scheme.bits not in BITS:
        return f"{scheme.bits}-bit codes (the kernel reads 2, 3, 4 and 8 bits)"
    if in_features % 8:
        return f"in_features {in_features} is not a multiple of 8 (the kernel copies activations in 16-byte pieces)"
    if not mma_supported(scheme.bits, scheme.group_size, in_features):
        return f"groups of {g} columns (the kernel takes groups of a multiple of 16 columns, or the row)"
    for name, what in preview.needed(scheme.bits, scheme.group_size, in_features).items():
        if not preview.enabled(name):
            return f"{what} (the kernel's {name} build awaits parity on a GPU: {preview.ENV}={name} serves it there)"
    return None


def supported(stack: StackedDeltas, dtype: torch.dtype) -> bool:
    """Whether the kernel has a variant for this stack and activation dtype (device checks aside)."""
    return stack.layout == "mma" and covers(stack.scheme, stack.in_features, dtype) is None


def weight_stage_bytes(stack: StackedDeltas, rb: int, kt: int = 1) -> int:
    """Bytes of one pipeline stage read from the stack (codes, scales, zero points): what a stage in
    flight brings from DRAM (the activations come from L2)."""
    gk16, _ = group_params(stack)
    sg = 8 // gk16 if gk16 < 8 else 1
    tile = 4 * mma_sparse.tile_words(stack.bits) if stack.compact else 1024 * stack.bits
    return rb * kt * tile + rb * kt * sg * 64 * 2 * (2 if stack.asymmetric else 1)


def stage_bytes(stack: StackedDeltas, rb: int, kt: int = 1) -> int:
    """Shared memory of one pipeline stage: its weight bytes (:func:`weight_stage_bytes`) and the tile's
    activations (``BM`` rows of ``128 kt`` halves, padded by 8)."""
    return weight_stage_bytes(stack, rb, kt) + BM * (128 * kt + 8) * 2


def macros(stack: StackedDeltas, dtype: torch.dtype, cfg: CudaConfig, device_index: int = 0) -> dict[str, int]:
    """Compile-time constants of one kernel build; ``SMEM_SM``, the device's shared memory per SM, lets
    the kernel's register budget (its launch bounds) assume the CTAs per SM of :func:`ctas_per_sm`;
    ``KCOLS`` (only where ``in_features`` is not a multiple of 128) the columns past which the padded
    last K tile's activations are zero-filled; ``GDIV`` (only for groups of whole tiles that are not a
    power of two of them) that ``group_shift`` is a tile count to divide by; ``SP24`` (only for a compact
    2:4 stack) the sparse MMA over kept codes and positions; ``STREAMK``, ``PDL``, ``EVICT`` the preview launch
    options of ``cfg``."""
    gk16, _ = group_params(stack)
    return {"BITS": stack.bits, "BF16": int(dtype == torch.bfloat16), "ASYM": int(stack.asymmetric),
            "GK16": gk16, "RB": cfg.rb, "STAGES": cfg.stages, "KT": cfg.kt, "MT": cfg.mt,
            "SMEM_SM": sm_limits(device_index)[1],
            **({"KCOLS": stack.in_features} if stack.in_features % 128 else {}),
            **({"GDIV": 1} if divided_groups(stack.scheme.group_size, stack.in_features) else {}),
            **({"SP24": 1} if stack.compact else {}),
            **({"STREAMK": 1} if cfg.stream_k else {}), **({"PDL": 1} if cfg.pdl else {}),
            **({"EVICT": 1} if cfg.evict else {})}


@functools.cache
def _smem_limit(device_index: int) -> int:
    """Shared memory a CTA may opt in to (Hopper's 227 KiB when no GPU is there to ask: offline planning)."""
    if not torch.cuda.is_available():
        return 232448
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)


def reg_ctas(rb: int, bits: int, mt: int = 1, gk16: int = 8) -> int:
    """CTAs per SM the kernel's register budget is cut for (``REG_CTAS`` in ``cuda/sbmm.cu``, its
    ``__launch_bounds__``): the compiler keeps registers low enough for that many to fit. Fewer where
    more values stay live: groups narrower than a 128-column tile (``gk16`` < 8: a flush, and with zero
    points a load, every few k16 steps) with 8 warps, groups of 32 columns or fewer (``gk16`` < 4) with
    4 warps or two tiles per warp, groups of 16 (``gk16`` 1, a flush every step) fewer again (each
    spilled at the larger count)."""
    if gk16 == 1:  # groups of 16 columns: a flush every mma step
        return 2 if rb == 2 else 4
    if mt == 2:
        return (3 if gk16 < 4 else 4) if rb == 2 else (6 if gk16 < 4 else 8)
    return (3 if bits == 8 or gk16 < 8 else 4) if rb == 2 else (5 if bits == 8 or gk16 < 4 else 6)


@functools.cache
def sm_limits(device_index: int = 0) -> tuple[int, int, int]:
    """``(SMs, shared memory per SM, 32-bit registers per SM)``; an H100/H200's (132, 228 KiB, 64 Ki) when
    no GPU is there to ask (offline planning)."""
    if not torch.cuda.is_available():
        return 132, 233472, 65536
    p = torch.cuda.get_device_properties(device_index)
    return (p.multi_processor_count, int(getattr(p, "shared_memory_per_multiprocessor", 0) or 233472),
            int(getattr(p, "regs_per_multiprocessor", 0) or 65536))


def ctas_per_sm(stack: StackedDeltas, cfg: CudaConfig, device_index: int = 0) -> int:
    """CTAs of ``cfg`` that one SM holds at once: its pipeline's shared memory (plus the 1 KiB the driver
    reserves per CTA) and the register budget the kernel is compiled for (:func:`reg_ctas`; the sm_90
    builds use 62-95 registers per thread, within it) bound it."""
    _, smem_sm, _ = sm_limits(device_index)
    smem = cfg.stages * stage_bytes(stack, cfg.rb, cfg.kt) + 1024
    gk16, _ = group_params(stack)
    return max(1, min(smem_sm // smem, reg_ctas(cfg.rb, stack.bits, cfg.mt, gk16)))


def effective_split(k_tiles: int, cfg: CudaConfig) -> tuple[int, int]:
    """``(K tiles per split, splits)`` that a launch with ``cfg`` runs: whole stages per split, no empty
    split (every CTA of a row tile reaches its counter), so ``split`` 3 over 32 tiles in stages of 2
    runs 12 + 12 + 8 tiles."""
    per_split = -(-k_tiles // (cfg.split * cfg.kt)) * cfg.kt
    return per_split, -(-k_tiles // per_split)


@functools.cache
def available(device_index: int = 0) -> bool:
    """A CUDA device of compute capability 8.0+ (mma.sync bf16, cp.async) and NVRTC that loads."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index) < (8, 0):
        return False
    try:
        from deltazip.kernels.cuda_rtc import nvrtc

        nvrtc()
    except Exception:  # noqa: BLE001 - no NVRTC: the dispatcher takes the reference path
        return False
    return True


@functools.cache
def arch(device_index: int = 0) -> int:
    """The GPU's compute capability as ``10 major + minor`` (90 when no GPU is there to ask: offline planning)."""
    if not torch.cuda.is_available():
        return 90
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def fits(stack: StackedDeltas, cfg: CudaConfig, device_index: int) -> bool:
    """Whether the pipeline's shared memory fits the device and its options the GPU (programmatic
    dependent launch: sm_90+), checked before any launch."""
    return (cfg.stages * stage_bytes(stack, cfg.rb, cfg.kt) + 1024 <= _smem_limit(device_index)
            and kt_ok(stack, cfg.kt) and mt_ok(stack, cfg.mt) and (not cfg.pdl or arch(device_index) >= 90))


def stream_k_wave(stack: StackedDeltas, cfg: CudaConfig, device_index: int = 0) -> int:
    """CTAs a stream-K launch of ``cfg`` runs: every SM's resident CTAs (:func:`ctas_per_sm`)."""
    return sm_limits(device_index)[0] * ctas_per_sm(stack, cfg, device_index)


def stream_k_grid(units: int, stages: int, wave: int) -> tuple[int, int]:
    """``(CTAs, parts)`` of a stream-K launch over ``units`` (row tile, block) units of ``stages`` K stages
    each, on a device that runs ``wave`` CTAs at once: one CTA per resident slot (fewer when there are fewer
    stages), each taking a contiguous run of ``units * stages // CTAs`` or one more stages (the kernel's
    ``STREAMK`` loop); ``parts`` bounds the CTAs that share one unit (the workspace slices its partials
    need): a unit's first stage may be the last of one CTA, and each further CTA brings at least the
    shortest run."""
    total = units * stages
    ctas = max(1, min(wave, total))
    shortest = max(1, total // ctas)
    return ctas, min(ctas, stages, 1 + -(-(stages - 1) // shortest))


def kt_ok(stack: StackedDeltas, kt: int) -> bool:
    """Two K tiles per stage: at 2 and 4 bits, groups of whole tiles, an even number of tiles (8-bit
    codes and narrower groups would spill registers)."""
    gk16, _ = group_params(stack)
    return kt == 1 or (stack.bits <= 4 and gk16 == 8 and k_tiles(stack.in_features) % kt == 0)


def mt_ok(stack: StackedDeltas, mt: int) -> bool:
    """Two 16-row tiles per warp: at 2 and 4 bits (8-bit codes of two tiles would spill registers)."""
    return mt == 1 or stack.bits <= 4


MAX_WORKSPACE = 1 << 25  # fp32 partials of one split-K launch (128 MiB)


class _Workspace:
    """fp32 partials (one slice per split) and per-tile counters of split-K launches; counters are zero
    between launches (each launch resets them); grown by replacement, never freed (a captured graph may
    hold the old ones)."""

    def __init__(self):
        self.ws: dict[int, torch.Tensor] = {}
        self.counters: dict[int, torch.Tensor] = {}
        self.kept: list[torch.Tensor] = []

    def get(self, device: torch.device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = device.index
        ws, cn = self.ws.get(i), self.counters.get(i)
        if ws is None or ws.numel() < floats:
            if ws is not None:
                self.kept.append(ws)
            ws = self.ws[i] = torch.zeros(max(floats, 1 << 20), dtype=torch.float32, device=device)
        if cn is None or cn.numel() < counters:
            if cn is not None:
                self.kept.append(cn)
            cn = self.counters[i] = torch.zeros(max(counters, 1 << 14), dtype=torch.int32, device=device)
        return ws, cn


_WORKSPACE = _Workspace()


def default_config(stack: StackedDeltas, plan: RowPlan, device: torch.device) -> CudaConfig:
    """Untuned launch options: 2 blocks per CTA, 4 stages, K split until the grid fills the SMs twice
    (at least 4 K tiles per split), two K tiles per stage at 2 and 4 bits."""
    rb = 2 if padded_rows(stack.out_features) >= 128 else 1
    ctas = -(-padded_rows(stack.out_features) // (64 * rb)) * max(plan.num_tiles, 1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles, split = k_tiles(stack.in_features), 1
    kt = 2 if kt_ok(stack, 2) else 1
    while ctas * split < 2 * sms and tiles // (split * 2) >= 4:
        split *= 2
    stages = 4 if fits(stack, CudaConfig(rb, 4, 1, kt), device.index or 0) else 3
    return CudaConfig(rb=rb, stages=stages, split=split, kt=kt)


class Build:
    """One compiled launch of ``dz_sbmm`` over one stack, activation dtype and launch config: the kernel,
    its shared memory, grid width and the stack's pointers, resolved once; :meth:`launch` only adds the
    call's own tensors (``x``, ``y``, the plan, ``present``)."""

    def __init__(self, stack: StackedDeltas, dtype: torch.dtype, cfg: CudaConfig):
        if not supported(stack, dtype):
            raise ValueError(f"no CUDA SBMM variant for {dtype} and this stack (layout {stack.layout}, "
                             f"bits {stack.bits}, group {stack.effective_group})")
        if not mt_ok(stack, cfg.mt):  # before compiling a build that could not run
            raise ValueError(f"mt={cfg.mt} needs codes of 2 or 4 bits, not {stack.bits}")
        self.k_tiles = k_tiles(stack.in_features)
        if self.k_tiles % cfg.kt:
            raise ValueError(f"kt={cfg.kt} does not divide the {self.k_tiles} K tiles of in_features {stack.in_features}")
        from deltazip.kernels.cuda_rtc import load

        dev = stack.device.index if stack.device.index is not None else torch.cuda.current_device()
        self.stack, self.dtype, self.cfg, self.device = stack, dtype, cfg, stack.device
        self.kernel = load(source(), macros(stack, dtype, cfg, dev), "dz_sbmm", dev)
        self.smem = cfg.stages * stage_bytes(stack, cfg.rb, cfg.kt)
        self.kernel.allow_smem(self.smem)
        self.per_split, self.split = effective_split(self.k_tiles, cfg)
        self.grid_x = -(-padded_rows(stack.out_features) // (64 * cfg.rb))
        self.wave = stream_k_wave(stack, cfg, dev) if cfg.stream_k else 0
        self._stream_k: dict[tuple[int, int], tuple[int, int]] = {}  # (row tiles, wave) -> stream_k_grid
        zr = stack.zeros if stack.asymmetric else stack.scales
        c_int, c_ll, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
        self.weights = [ptr(stack.qweight.data_ptr()), c_ll(stack.qweight[0].numel()), ptr(stack.scales.data_ptr()),
                        ptr(zr.data_ptr()), c_ll(stack.scales[0].numel()), c_int(stack.out_features),
                        c_int(padded_rows(stack.out_features)), c_int(self.k_tiles),
                        c_int(group_params(stack)[1])]
        self.all_present = torch.ones(stack.num_deltas + 1, dtype=torch.uint8, device=stack.device)

    def launch(self, x: torch.Tensor, y: torch.Tensor, plan: RowPlan, present: torch.Tensor | None,
               add: bool) -> torch.Tensor:
        """``y[r] (+)= x[r] @ W[slot(r)]^T``, one launch (arguments as :func:`sbmm_cuda`; ``add``: ``y``
        holds what the product is added onto, else zeros)."""
        n, out_f = x.shape[0], self.stack.out_features
        if plan.num_tiles == 0:
            return y
        if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
            x = x.contiguous()  # 16-byte copies of each row
        per_split, split = self.per_split, self.split
        if self.wave:  # stream-K: one wave of CTAs; `split` is the most CTAs that share one unit
            units = self.grid_x * plan.num_tiles
            sk = self._stream_k.get((plan.num_tiles, self.wave))
            if sk is None:
                sk = self._stream_k[(plan.num_tiles, self.wave)] = stream_k_grid(units, self.k_tiles // self.cfg.kt,
                                                                               self.wave)
            ctas, split = sk
            if units * self.k_tiles >= 1 << 31 or split * n * out_f > MAX_WORKSPACE:  # prefill-sized
                return build_for(self.stack, self.dtype, replace(self.cfg, stream_k=False)).launch(x, y, plan, present, add)
            grid = (ctas, 1, 1)
        else:
            if split > 1 and split * n * out_f > MAX_WORKSPACE:  # a prefill-sized call has CTAs enough without
                per_split, split = self.k_tiles, 1
            grid = (self.grid_x, plan.num_tiles, split)
        ws, counters = _WORKSPACE.get(self.device, split * n * out_f if split > 1 else 0, plan.num_tiles * self.grid_x)
        present = self.all_present if present is None else present
        c_int, ptr = ctypes.c_int, ctypes.c_void_p
        args = [ptr(x.data_ptr()), c_int(x.stride(0)), ptr(y.data_ptr()), c_int(y.stride(0)), ptr(plan.packed.data_ptr()),
                c_int(n), c_int(plan.num_tiles), ptr(present.data_ptr()), *self.weights, c_int(per_split), c_int(int(add)), ptr(ws.data_ptr()), ptr(counters.data_ptr())]
        self.kernel(grid, self.cfg.threads, self.smem, torch.cuda.current_stream(self.device).cuda_stream, args,
                    pdl=self.cfg.pdl)
        return y


def build_for(stack: StackedDeltas, dtype: torch.dtype, cfg: CudaConfig) -> Build:
    """The :class:`Build` of a stack, dtype and config, made once and kept on the stack."""
    builds = stack.__dict__.setdefault("_cuda_builds", {})
    b = builds.get((dtype, cfg))
    if b is None:
        b = builds[(dtype, cfg)] = Build(stack, dtype, cfg)
    return b


def sbmm_cuda(x: torch.Tensor, stack: StackedDeltas, plan: RowPlan, *, out: torch.Tensor | None = None,
              present: torch.Tensor | None = None, config: CudaConfig | None = None) -> torch.Tensor:
    """``y[r] (+)= x[r] @ W[slot(r)]^T`` over the rows of a plan, one launch (checked; the tuner's, the
    tests' and the benches' entry: a server's steps call a prepared :class:`Build` directly).

    Args:
        x: ``[N, in]`` fp16 or bf16 on the stack's device.
        stack: ``D`` deltas in the ``mma`` layout.
        plan: a row plan of the rows' slots with its ``packed`` tensor (``deltazip.kernels.row_plan``).
        out: ``[N, out]`` in ``x.dtype``, unit column stride: the product is added onto it (rows without
            a slot untouched); when None a zero-filled one is returned.
        present: bool/uint8 ``[D + 1]`` indexed by ``slot + 1``: tiles of slots this stack does not hold
            are skipped (they would add zeros). None: every slot.
        config: launch options (default: :func:`default_config`).
    Returns:
        ``[N, out]`` in ``x.dtype`` (``out`` itself when given).
    """
    if plan.packed is None:
        raise ValueError("sbmm_cuda needs a plan with its packed tensor (deltazip.kernels.row_plan)")
    if not supported(stack, x.dtype):
        raise ValueError(f"no CUDA SBMM variant for {x.dtype} and this stack (layout {stack.layout}, "
                         f"bits {stack.bits}, group {stack.effective_group})")
    n, out_f, in_f = x.shape[0], stack.out_features, stack.in_features
    if x.dim() != 2 or x.shape[1] != in_f or plan.num_rows != n:
        raise ValueError(f"x must be [{plan.num_rows}, {in_f}], got {tuple(x.shape)}")
    y = out if out is not None else torch.zeros(n, out_f, dtype=x.dtype, device=x.device)
    if out is not None and (out.shape != (n, out_f) or out.dtype != x.dtype or (out_f > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be [{n}, {out_f}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if plan.num_tiles == 0:
        return y
    cfg = config or default_config(stack, plan, x.device)
    return build_for(stack, x.dtype, cfg).launch(x, y, plan, present, out is not None)


class Launch:
    """One stack's SBMM on the CUDA kernel, prepared when the stack is written to its slot
    (``deltazip.kernels.dispatch.prepare``). A call resolves the launch of its (rows, deltas) bucket once
    (``choose``: the dispatcher's measured choice) and then only launches it.

    Args:
        stack, dtype: what it serves; choose: ``(rows, deltas) -> (path, CudaConfig | None)``, the path
        ``"cuda"``, ``"dequant_mm"`` or ``"reference"`` (the configuration was distrusted while tuning:
        ``fallback`` serves it).
    """

    path, reason = "cuda", None

    def __init__(self, stack: StackedDeltas, dtype: torch.dtype, choose, fallback):
        self.stack, self.dtype, self.choose, self.fallback = stack, dtype, choose, fallback
        self._by_key: dict[tuple[int, int], tuple[str, Build | None]] = {}
        self._epoch = 0  # counts forget() calls

    def forget(self) -> None:
        """Drop the resolved choices (the dispatch table changed): the next call of a bucket resolves again."""
        self._epoch += 1
        self._by_key.clear()

    def _resolve(self, plan: RowPlan) -> tuple[str, Build | None]:
        epoch = self._epoch
        path, cfg = self.choose(plan.num_rows, plan.slots_used)
        if path == "cuda" and cfg is None:
            cfg = default_config(self.stack, plan, self.stack.device)
        r = (path, build_for(self.stack, self.dtype, cfg) if path == "cuda" else None)
        # kept unless the table changed meanwhile (forget() on the tuner's thread, which counts before it
        # clears): then this call uses it and the next one resolves again
        if self._epoch == epoch:
            self._by_key[plan.key] = r
            if self._epoch != epoch:
                self._by_key.pop(plan.key, None)
        return r

    def __call__(self, y: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, plan_of=None,
                 present: torch.Tensor | None = None, held: set[int] | None = None) -> torch.Tensor:
        """``y[r] += x[r] @ W[idx[r]]^T`` (``y`` None: a new zero-filled one). ``plan_of(idx)`` gives the step's
        shared row plan (default: one built on the device); ``present``/``held``: the slots the stack holds,
        as a device ``[D + 1]`` mask and a host set (None: all)."""
        plan = plan_of(idx) if plan_of is not None else group_rows(idx, self.stack.num_deltas)
        path, build = self._by_key.get(plan.key) or self._resolve(plan)
        if path == "reference":
            return self.fallback(y, x, idx, plan_of, present, held)
        if path == "dequant_mm" and plan.slot_rows is not None and not torch.cuda.is_current_stream_capturing():
            return dequant_mm(x, self.stack, plan, out=y, slots=held)
        if build is None:  # dequant_mm chosen for a device plan or inside a graph: the kernel's default
            build = build_for(self.stack, self.dtype, default_config(self.stack, plan, self.stack.device))
        add = y is not None
        y = y if add else torch.zeros(x.shape[0], self.stack.out_features, dtype=x.dtype, device=x.device)
        return build.launch(x, y, plan, present, add)


def dequantize_slot(stack: StackedDeltas, slot: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ``[out, in]`` delta of one slot in ``dtype`` (one launch): ``scale * (code - zero)``."""
    out_f, in_f = stack.out_features, stack.in_features
    w = out if out is not None else torch.empty(out_f, in_f, dtype=dtype, device=stack.device)
    dev = stack.device.index if stack.device.index is not None else torch.cuda.current_device()
    from deltazip.kernels.cuda_rtc import load

    kernel = load(source(), macros(stack, dtype, CudaConfig(rb=1, stages=2, kt=1), dev), "dz_dequant", dev)
    zr = stack.zeros if stack.asymmetric else stack.scales
    c_int, c_ll, ptr = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    args = [ptr(stack.qweight.data_ptr()), ptr(stack.scales.data_ptr()), ptr(zr.data_ptr()), c_int(slot),
            c_ll(stack.qweight[0].numel()), c_ll(stack.scales[0].numel()), c_int(out_f),
            c_int(padded_rows(out_f)), c_int(k_tiles(in_f)), c_int(layout_group(stack.group_size, in_f)), ptr(w.data_ptr()),
            c_int(w.stride(0))]
    kernel((padded_rows(out_f) // 64, k_tiles(in_f), 1), 128, 0, torch.cuda.current_stream(stack.device).cuda_stream,
           args)
    return w


def dequant_mm(x: torch.Tensor, stack: StackedDeltas, plan: RowPlan, *, out: torch.Tensor | None = None,
               slots: set[int] | None = None) -> torch.Tensor:
    """The prefill path: per used slot, dequantize once (:func:`dequantize_slot`) and multiply with
    cuBLAS; ``y[rows] (+)= x[rows] @ W^T``. Arguments as :func:`sbmm_cuda`, with a host plan
    (``plan.slot_rows``); ``slots``: the slots this stack holds (others are skipped), None for all."""
    n, out_f = x.shape[0], stack.out_features
    y = out if out is not None else torch.zeros(n, out_f, dtype=x.dtype, device=x.device)
    scratch = _scratch(x.device, out_f * stack.in_features, x.dtype).view(out_f, stack.in_features)
    for slot, rows in plan.slot_rows.items():
        if slots is not None and slot not in slots:
            continue
        w = dequantize_slot(stack, slot, x.dtype, out=scratch)
        if rows.shape[0] == rows[-1] - rows[0] + 1 and (rows[1:] > rows[:-1]).all():  # one contiguous run
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            y[r0:r1].addmm_(x[r0:r1], w.T)
        else:
            idx = torch.from_numpy(rows).to(x.device, non_blocking=True)
            y.index_add_(0, idx, x.index_select(0, idx) @ w.T)
    return y


# One dequantize buffer per thread: the engine's prefill and the tuner's timing (agrees, a dequant_mm
# candidate) may both run dequant_mm, each "dequantize into the buffer, then multiply from it" on the
# same stream; a shared buffer would let one thread's dequantize land between the other's two launches.
_SCRATCH = threading.local()


def _scratch(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of at least ``numel`` elements on ``device`` in ``dtype`` (grown by replacement)."""
    bufs = _SCRATCH.__dict__.setdefault("bufs", {})
    t = bufs.get((device, dtype))
    if t is None or t.numel() < numel:
        t = bufs[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return t[:numel]
