"""Triton SBMM and grouped LoRA: every row of ``x`` times its own delta (or adapter), one launch.

Semantics are those of ``deltazip.kernels.reference.sbmm`` / ``lora_shrink_expand``; this module is
the fast path beside them. Triton is imported lazily (inside functions) so that importing this
module works on machines without Triton or CUDA; the kernel module
(``deltazip.kernels._triton_sbmm_kernels``) is imported on the first call. To run the kernels on the
CPU, set ``TRITON_INTERPRET=1`` before ``triton`` is first imported (Triton decides between compiled
and interpreted functions, its own library included, at decoration time).

How a call runs (no host synchronisation anywhere, buffer sizes depend only on ``N`` and ``D``):

1. :func:`group_rows` builds a :class:`RowPlan` on the device: a stable sort of the rows by slot
   (rows with index -1 sort last and are never touched), per-slot counts and offsets, and a flat
   list of row tiles, each naming its slot and its ``[start, end)`` range in the sorted order. The
   tile list has a static upper bound ``N // BLOCK_M + min(D, N)`` entries; unused entries carry
   slot -1 and their programs exit at once. One plan serves every linear of a layer step.
2. One kernel launch over (row tiles x output tiles x K splits). A program gathers its rows of
   ``x`` through the permutation, loads the packed codes, 2:4 positions, scales (and zero points)
   of its slot from the stacked layout (``deltazip.kernels.stacked``), unpacks, expands and
   dequantizes in registers, runs ``tl.dot`` and scatters its output rows back to their original
   positions. The stacked weights are read once per row tile, so the bytes moved per weight are
   those of the compressed delta.

Precision: when a ``BLOCK_K`` tile lies inside one quantization group, the integer codes
``code - zero`` (exact in fp16/bf16) go into ``tl.dot`` and the fp32 partial product is multiplied
by the fp32 scale afterwards, so the kernel differs from the fp32 reference only by summation
order (plus the final cast). For group sizes that do not allow that (not a multiple of the smallest
K tile: 16, or 32 under 2:4), each weight is dequantized to the activation dtype before the dot (one
extra rounding per weight).

Codes are unpacked by loading each int32 word once (a ``[BLOCK_K / per_word, BLOCK_N]`` tile of
words, coalesced along the output dimension) and splitting it in registers; under 2:4 the two kept
codes of a group of four columns are adjacent in a word, and so are their two 2-bit positions, so a
group is expanded from one ``2 * bits`` field and one 4-bit field. 3-bit codes (10 per word, not a
power of two) fall back to one cached word load per code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from deltazip.kernels.stacked import StackedDeltas

# Activation dtypes the kernels accept. The interpreter (CPU) has no bf16 (numpy lacks it).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_importable() -> bool:
    """True when ``import triton`` works (nothing is compiled)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def interpreter_ready() -> bool:
    """True when Triton's own ``@jit`` library functions are interpretable, i.e. ``TRITON_INTERPRET=1``
    was set before ``triton`` was first imported (the interpreter cannot call them otherwise)."""
    if not (interpret_mode() and triton_importable()):
        return False
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def supported_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """Activation dtypes the Triton path handles on ``device``."""
    if device.type == "cuda" and not interpret_mode():
        return KERNEL_DTYPES
    return (torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------------
# Row grouping (pure torch, runs on the device of the index, never syncs with the host)
# --------------------------------------------------------------------------------------------------


@dataclass
class RowPlan:
    """Rows of a batch grouped by slot, on the device (see :func:`group_rows`).

    Attributes:
        perm: int32 ``[N]``: row ids sorted by slot (stable); rows with index -1 come last.
        counts: int32 ``[D]``: rows per slot.
        offsets: int32 ``[D]``: start of each slot's rows in ``perm``.
        tile_slot: int32 ``[T]``: slot of each row tile, -1 for unused tiles.
        tile_start, tile_end: int32 ``[T]``: ``[start, end)`` of each tile in ``perm``.
        block_m: rows per tile (the kernels' ``BLOCK_M``).
        num_rows, num_slots: ``N`` and ``D``.
    """

    perm: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    block_m: int
    num_rows: int
    num_slots: int
    packed: torch.Tensor | None = None  # host-built plans: int32 [N + 3T], perm ++ tile_slot ++ start ++ end
    slot_rows: dict | None = None  # host-built plans: {slot: numpy row ids}

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def max_tiles(num_rows: int, num_slots: int, block_m: int) -> int:
    """Static bound on row tiles: ``sum_d ceil(c_d / BM) <= N // BM + min(D, N)``."""
    return num_rows // block_m + min(num_slots, num_rows)


def group_rows(index: torch.Tensor, num_slots: int, block_m: int = 16) -> RowPlan:
    """Group the rows of a batch by slot, entirely on ``index.device`` (no host sync).

    Args:
        index: integer ``[N]``, values in ``[-1, num_slots)``; -1 means "no delta". Other negative
            or too large values raise (on CUDA as a device-side assert, since checking them on the
            host would need a sync).
        num_slots: ``D``, the number of slots of the stack (not the number in use).
        block_m: rows per tile.
    Returns:
        A :class:`RowPlan`; its tensor sizes depend only on ``N``, ``D`` and ``block_m``.
    """
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got {tuple(index.shape)}")
    if index.dtype.is_floating_point or index.dtype == torch.bool:
        raise ValueError(f"index must be an integer tensor, got {index.dtype}")
    if num_slots < 1 or block_m < 1:
        raise ValueError(f"num_slots ({num_slots}) and block_m ({block_m}) must be positive")
    dev = index.device
    n = index.shape[0]
    idx = index.to(torch.int64)
    # Sort key: slot, with -1 as slot D (sorts last). Out-of-range values get keys outside [0, D]
    # so that the scatter below rejects them (too large ones are shifted past the -1 bucket).
    key = torch.where(idx == -1, torch.full_like(idx, num_slots), torch.where(idx >= num_slots, idx + 1, idx))
    perm = torch.argsort(key, stable=True)
    counts_all = torch.zeros(num_slots + 1, dtype=torch.int64, device=dev)
    counts_all.scatter_add_(0, key, torch.ones_like(key))  # out-of-range index raises here
    counts = counts_all[:num_slots]
    offsets = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tile_hi = torch.cumsum(tiles, 0)
    tile_lo = tile_hi - tiles
    t = torch.arange(max_tiles(n, num_slots, block_m), device=dev, dtype=torch.int64)
    slot = torch.searchsorted(tile_hi, t, right=True)  # first slot whose tiles end after t
    valid = slot < num_slots
    s = slot.clamp(max=num_slots - 1)
    start = offsets[s] + (t - tile_lo[s]) * block_m
    end = offsets[s] + counts[s]
    i32 = torch.int32
    return RowPlan(
        perm=perm.to(i32),
        counts=counts.to(i32),
        offsets=offsets.to(i32),
        tile_slot=torch.where(valid, slot, torch.full_like(slot, -1)).to(i32),
        tile_start=torch.where(valid, start, torch.zeros_like(start)).to(i32),
        tile_end=torch.where(valid, end, torch.zeros_like(end)).to(i32),
        block_m=block_m,
        num_rows=n,
        num_slots=num_slots,
    )


# --------------------------------------------------------------------------------------------------
# Kernels (kernel module imported lazily, on first use)
# --------------------------------------------------------------------------------------------------

_KERNELS: dict[str, object] = {}


def _kernels() -> SimpleNamespace:
    """The kernel modules (this one's and ``triton_fast``'s), imported on first use; re-imported if
    ``TRITON_INTERPRET`` changed since."""
    import importlib

    import triton

    mode = interpret_mode()
    if mode and not interpreter_ready():
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is first imported "
                           "(triton's library functions were already compiled for the GPU)")
    mod, fast = _KERNELS.get("module"), _KERNELS.get("fast")
    if mod is None:
        mod = importlib.import_module("deltazip.kernels._triton_sbmm_kernels")
        fast = importlib.import_module("deltazip.kernels._triton_fast_kernels")
    elif _KERNELS.get("mode") != mode:
        mod, fast = importlib.reload(mod), importlib.reload(fast)
    _KERNELS.update(module=mod, fast=fast, mode=mode)
    return SimpleNamespace(sbmm=mod.sbmm_kernel, lora_shrink=mod.lora_shrink_kernel, fast=fast.sbmm_fast_kernel,
                           lora_expand=mod.lora_expand_kernel, cdiv=triton.cdiv)


# --------------------------------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------------------------------


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _pow2_ceil(v: int) -> int:
    return 1 << (max(v, 1) - 1).bit_length()


def default_block_m(num_rows: int) -> int:
    """Rows per tile: 16 for decode-sized batches (``tl.dot`` needs >= 16), 64 for prefill."""
    return 16 if num_rows <= 256 else 64


def min_block_k(bits: int, sparse: bool) -> int:
    """Smallest ``BLOCK_K`` the kernel takes: 16 for ``tl.dot``; 32 under 2:4, where a tile must
    cover whole words of the positions part (8 groups of four columns per word) and, at 2 bits,
    of the codes (8 pairs of kept codes per word)."""
    return 32 if sparse else 16


def choose_block_k(in_features: int, group: int, bits: int, sparse: bool, cap: int = 128) -> tuple[int, bool]:
    """``(BLOCK_K, tile_scale)``: the largest power of two in ``[min_block_k, cap]`` that keeps every
    K tile inside one quantization group, with ``tile_scale=True``; if none does (group not a
    multiple of the minimum), ``(64, False)`` and the scales are applied per element. 3-bit 2:4 caps
    the tile at 32 columns (shared memory)."""
    lo = min_block_k(bits, sparse)
    if bits == 3 and sparse:
        # 3-bit 2:4 gathers four [BLOCK_K, BLOCK_N] word tiles per step; pipelined 3 deep at BLOCK_K=128
        # that is 280 KiB of shared memory (more than any GPU has: offline compile, bench/kernels_sass.py).
        cap = min(cap, 32)
    if group == in_features:  # one group per row: any tile is inside it
        return max(lo, min(cap, _pow2_ceil(in_features))), True
    bk = min(cap, _pow2_floor(group))
    while bk >= lo and group % bk:
        bk //= 2
    if bk >= lo:
        return bk, True
    return max(lo, min(cap, 64)), False


def device_context(x: torch.Tensor):
    """``torch.cuda.device(x.device)`` for CUDA tensors, a no-op otherwise: Triton launches on the
    *current* device (and its current stream), so every launch for tensors on ``cuda:N`` runs inside
    this context; without it a server on ``--device cuda:1`` would launch on GPU 0."""
    import contextlib

    if x.device.type == "cuda":
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def auto_split_k(busy: int, k_tiles: int, device: torch.device) -> int:
    """K splits for a grid of ``busy`` programs: 1 off CUDA or when the grid fills twice the SMs,
    else the power of two (<= 8, <= ``k_tiles``) that comes closest to filling them. Powers of two
    only, so that a warm-up (``deltazip.kernels.warmup``) can compile every value a forward can pick."""
    target = 2 * _sm_count(device)
    if device.type != "cuda" or busy >= target:
        return 1
    split = min(8, _pow2_ceil(-(-target // busy)))
    while split > 1 and split > k_tiles:
        split //= 2
    return split


SPLIT_K_CHOICES = (1, 2, 4, 8)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _check_x(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [N, {in_features}], got {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported by the Triton path; use one of {KERNEL_DTYPES}")
    return x if x.stride(1) == 1 else x.contiguous()


def _plan_for(index: torch.Tensor, num_rows: int, num_slots: int, plan: RowPlan | None) -> RowPlan:
    if plan is None:
        return group_rows(index, num_slots, default_block_m(num_rows))
    if plan.num_rows != num_rows or plan.num_slots != num_slots:
        raise ValueError(f"plan was built for N={plan.num_rows}, D={plan.num_slots}; "
                         f"this call has N={num_rows}, D={num_slots}")
    return plan


def sbmm_triton(
    x: torch.Tensor,
    delta_index: torch.Tensor,
    stacked: StackedDeltas,
    *,
    plan: RowPlan | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton SBMM: ``y[r] = x[r] @ W[delta_index[r]].T`` (zeros where the index is -1), one launch.

    Args:
        x: ``[N, in]`` fp16/fp32 (bf16 on CUDA), on the stack's device.
        delta_index: integer ``[N]``, values in ``[-1, D)``.
        stacked: ``D`` deltas in the ``transposed`` layout (``deltazip.kernels.stacked.repack``).
        plan: a :func:`group_rows` plan for ``delta_index`` and ``D`` (built here when None; pass
            one to share the grouping across the linears of a layer).
        block_n, block_k, split_k, num_warps: tiling overrides (defaults chosen from the shapes).
            ``split_k > 1`` (chosen automatically on CUDA when the grid would leave SMs idle) sums
            partial products with fp32 atomics, so the last bits may differ between runs; pass
            ``split_k=1`` for run-to-run identical output.
    Returns:
        ``[N, out]`` in ``x.dtype``, rows in the input order.
    """
    if stacked.layout != "transposed":
        raise ValueError(f"sbmm_triton reads the 'transposed' layout, the stack is {stacked.layout!r} "
                         "(deltazip.kernels.triton_fast.sbmm_fast reads 'mma'; dispatch.sbmm picks)")
    x = _check_x(x, stacked.in_features)
    if x.device != stacked.device or delta_index.device != x.device:
        raise ValueError(f"x ({x.device}), delta_index ({delta_index.device}) and the stack "
                         f"({stacked.device}) must be on one device")
    n, out_f, in_f = x.shape[0], stacked.out_features, stacked.in_features
    if n == 0:
        return x.new_zeros(0, out_f)
    plan = _plan_for(delta_index, n, stacked.num_deltas, plan)
    k = _kernels()
    group = stacked.effective_group
    bk, tile_scale = choose_block_k(in_f, group, stacked.bits, stacked.sparse)
    if block_k is not None:
        lo = min_block_k(stacked.bits, stacked.sparse)
        if block_k < lo or block_k & (block_k - 1):
            raise ValueError(f"block_k must be a power of two >= {lo}, got {block_k}")
        bk = block_k
        tile_scale = group == in_f or group % bk == 0
    bn = block_n or 64
    n_tiles = k.cdiv(out_f, bn)
    k_tiles = k.cdiv(in_f, bk)
    if split_k is None:
        # Few output tiles and few deltas (decode with a handful of variants) leave SMs idle;
        # split K across programs and reduce with fp32 atomics.
        busy = max(min(stacked.num_deltas, n), n // plan.block_m) * n_tiles
        split_k = auto_split_k(busy, k_tiles, x.device)
    split_k = max(1, min(split_k, k_tiles))
    if split_k == 1:
        y = torch.zeros(n, out_f, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(n, out_f, dtype=torch.float32, device=x.device)
    qw = stacked.qweight
    pos = stacked.positions if stacked.sparse else qw  # dummy pointer, never read when dense
    zr = stacked.zeros if stacked.asymmetric else stacked.scales  # dummy pointer for symmetric
    per = 32 // stacked.bits
    grid = (plan.num_tiles, n_tiles, split_k)
    with device_context(x):
        k.sbmm[grid](
            x, y, plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end,
            qw, pos, stacked.scales, zr,
            in_f, out_f, group, qw.shape[1], pos.shape[1], x.stride(0), y.stride(0),
            qw[0].numel(), pos[0].numel(), stacked.scales[0].numel(),
            BITS=stacked.bits, PER=per, POW2=per & (per - 1) == 0, SPARSE=stacked.sparse,
            ASYM=stacked.asymmetric,
            TILE_SCALE=tile_scale, SPLIT_K=split_k, IEEE=x.dtype == torch.float32,
            BLOCK_M=plan.block_m, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps,
        )
    return y if split_k == 1 else y.to(x.dtype)


def lora_triton(
    x: torch.Tensor,
    lora_index: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: torch.Tensor,
    *,
    plan: RowPlan | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Grouped LoRA on Triton: ``y[r] = (x[r] @ A[i].T) @ B[i].T * scale[i]``, ``i = lora_index[r]``.

    Two launches (shrink into an fp32 ``[N, rank]`` buffer, then expand), each over the row tiles of
    one :class:`RowPlan`; rows with index -1 get zeros.

    Args:
        x: ``[N, in]`` fp16/fp32 (bf16 on CUDA).
        lora_index: integer ``[N]`` in ``[-1, L)``.
        A: ``[L, rank, in]``; B: ``[L, out, rank]`` (any float dtype, read in ``x.dtype``); scale ``[L]``.
        plan: a :func:`group_rows` plan for ``lora_index`` and ``L``.
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if A.dim() != 3 or B.dim() != 3 or A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2]:
        raise ValueError(f"A must be [L, rank, in] and B [L, out, rank], got {tuple(A.shape)} and {tuple(B.shape)}")
    num, rank, in_f = A.shape
    out_f = B.shape[1]
    if scale.shape != (num,):
        raise ValueError(f"scale must be [{num}], got {tuple(scale.shape)}")
    x = _check_x(x, in_f)
    if not (x.device == A.device == B.device == scale.device == lora_index.device):
        raise ValueError("x, lora_index, A, B and scale must be on one device")
    n = x.shape[0]
    if n == 0:
        return x.new_zeros(0, out_f)
    plan = _plan_for(lora_index, n, num, plan)
    k = _kernels()
    A = A.contiguous()
    B = B.contiguous()
    scale32 = scale.to(torch.float32).contiguous()
    ieee = x.dtype == torch.float32
    br = max(16, min(64, _pow2_ceil(rank)))
    bk = block_k or 64
    bn = block_n or 64
    h = torch.zeros(n, rank, dtype=torch.float32, device=x.device)
    y = torch.zeros(n, out_f, dtype=x.dtype, device=x.device)
    with device_context(x):
        k.lora_shrink[(plan.num_tiles, k.cdiv(rank, br))](
            x, h, plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end, A,
            in_f, rank, x.stride(0), h.stride(0),
            IEEE=ieee, BLOCK_M=plan.block_m, BLOCK_R=br, BLOCK_K=bk, num_warps=num_warps,
        )
        k.lora_expand[(plan.num_tiles, k.cdiv(out_f, bn))](
            h, y, plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end, B, scale32,
            rank, out_f, h.stride(0), y.stride(0),
            IEEE=ieee, BLOCK_M=plan.block_m, BLOCK_N=bn, BLOCK_R=br, num_warps=num_warps,
        )
    return y
