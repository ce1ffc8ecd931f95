"""Fast SBMM: the bandwidth-bound Triton path for stacks in the ``mma`` layout.

Same semantics and signature as ``deltazip.kernels.reference.sbmm`` (through
``deltazip.kernels.dispatch.sbmm``); this module is the host side of
``deltazip.kernels._triton_fast_kernels.sbmm_fast_kernel``. Triton is imported lazily, as in
``deltazip.kernels.triton_sbmm`` (whose row plans, checks and kernel loader this module shares).

What makes it fast (docs/kernels.md has the numbers):

- the weight tile is the *A* operand of the tensor-core instruction (``y^T = W x^T``), so it is
  dequantized straight into the registers the instruction reads: no shared-memory round trip;
- the weights were laid out once, at load, in that register order (``deltazip.kernels.fast_layout``),
  so a thread reads its codes with 16-byte vector loads and needs no shuffles;
- dequantization is two instructions per *pair* of weights (a ``LOP3`` that ORs two codes into the
  mantissas of a magic fp16/bf16 number, a packed ``HFMA2`` that subtracts ``magic + zero point``),
  plus a shift per word;
- 2:4 deltas were expanded at load (pruned positions hold the zero point), so they run the dense
  kernel: Triton has no sparse tensor-core instruction.

Supported: bits 2, 4 and 8, any group size that is a multiple of the K step (32, or 64 at 2 bits),
``in_features`` a multiple of 128, activations fp16 and bf16 (bf16 not in the interpreter); fp32
activations run too, exactly but on fp32 FMA (no tensor cores). ``dispatch`` decides what runs.
"""

from __future__ import annotations

import torch

from deltazip.kernels import autotune

# the version gate lives in a leaf module that the layout choice (kernels/stacked.py) can import too
from deltazip.kernels.availability import triton_fast_enabled as fast_enabled  # noqa: F401 - dispatch imports it
from deltazip.kernels.fast_layout import block_k_for, fast_supported, padded_rows
from deltazip.kernels.stacked import StackedDeltas
from deltazip.kernels.triton_sbmm import (
    RowPlan,
    _check_x,
    _kernels,
    _plan_for,
    auto_split_k,
    device_context,
    interpret_mode,
)

FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)



def fast_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """Activation dtypes the fast kernel takes on ``device`` (the interpreter has no bf16). fp32 is
    correct but not fast (fp32 FMA instead of tensor cores): it is there so that an fp32 model on a
    GPU, whose stacks get the ``mma`` layout too, does not fall back to the reference."""
    if device.type == "cuda" and not interpret_mode():
        return FAST_DTYPES
    return (torch.float16, torch.float32)


def fast_config(stacked: StackedDeltas) -> tuple[int, int]:
    """``(BLOCK_K, G_SHIFT)`` for a stack: the K step, and ``log2`` of K steps per group (31 when
    the whole row is one group, -1 when the count is not a power of two: a division per step)."""
    group = stacked.effective_group
    bk = block_k_for(stacked.in_features, stacked.group_size, stacked.bits)
    if bk is None:
        raise ValueError(f"group size {group} has no fast K step (multiple of 32, or 64 at 2 bits)")
    steps = group // bk
    if group == stacked.in_features:
        return bk, 31
    if steps & (steps - 1) == 0:
        return bk, steps.bit_length() - 1
    return bk, -1


def sbmm_fast(
    x: torch.Tensor,
    delta_index: torch.Tensor,
    stacked: StackedDeltas,
    *,
    plan: RowPlan | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    unroll: int | None = None,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[r] = x[r] @ W[delta_index[r]].T`` (zeros where the index is -1), one launch.

    Args:
        x: ``[N, in]`` fp16 (bf16 too on CUDA; fp32 slowly), on the stack's device; any row stride and
            storage offset (a non-unit column stride is made contiguous).
        delta_index: integer ``[N]``, values in ``[-1, D)``.
        stacked: ``D`` deltas in the ``mma`` layout (``StackedDeltas.allocate(..., layout="mma")``).
        plan: a ``group_rows`` plan for ``delta_index`` and ``D`` (built here when None).
        split_k: K splits summed with fp32 atomics (default: chosen on CUDA when the grid would
            leave SMs idle; ``1`` gives run-to-run identical output).
        num_warps, num_stages: launch options (4 warps = one warpgroup per 64-row tile).
        unroll: K steps per loop iteration (2 halves the loop's bookkeeping per weight).
        config: launch options as a dict (``split_k``, ``num_warps``, ``num_stages``, ``unroll``) for
            the ones not given; when None, the per-GPU tuned ones (``deltazip.kernels.autotune``) if
            any, else the defaults (split-K by :func:`auto_split_k`, 4 warps, unroll 2).
        out: ``[N, out]`` in ``x.dtype`` with unit column stride (e.g. the base GEMM's output): the
            product is *added* onto it in the kernel's epilogue (``out += x W^T``; rows with index
            -1 untouched) and ``out`` is returned. With split-K the splits are summed in an fp32
            buffer first and added with one ``add_``.
    Returns:
        ``[N, out]`` in ``x.dtype`` (``out`` itself when given).
    """
    if stacked.layout != "mma":
        raise ValueError(f"sbmm_fast needs a stack in the 'mma' layout, got {stacked.layout!r}")
    x = _check_x(x, stacked.in_features)
    if x.dtype not in fast_dtypes(x.device):
        raise ValueError(f"x dtype {x.dtype} is not supported by the fast kernel on {x.device}; "
                         f"use one of {fast_dtypes(x.device)}")
    if x.device != stacked.device or delta_index.device != x.device:
        raise ValueError(f"x ({x.device}), delta_index ({delta_index.device}) and the stack "
                         f"({stacked.device}) must be on one device")
    n, out_f, in_f = x.shape[0], stacked.out_features, stacked.in_features
    if out is not None:
        _check_out(out, x, out_f)
    if n == 0:
        return x.new_zeros(0, out_f) if out is None else out
    plan = _plan_for(delta_index, n, stacked.num_deltas, plan)
    if plan.block_m < 16:
        raise ValueError(f"the fast kernel needs row tiles of at least 16 rows, the plan has {plan.block_m}")
    bk, g_shift = fast_config(stacked)
    k = _kernels()
    n_tiles = padded_rows(out_f) // 64
    k_tiles = in_f // bk
    if config is None:
        config = autotune.lookup(stacked, x.dtype, n) or {}
    split_k = config.get("split_k") if split_k is None else split_k
    num_warps = config.get("num_warps", 4) if num_warps is None else num_warps
    num_stages = config.get("num_stages") if num_stages is None else num_stages
    unroll = config.get("unroll", 2) if unroll is None else unroll
    if split_k is None:
        busy = max(min(stacked.num_deltas, n), n // plan.block_m) * n_tiles
        split_k = auto_split_k(busy, k_tiles, x.device)
    split_k = max(1, min(split_k, k_tiles))
    acc = out is not None and split_k == 1
    if acc:
        y = out
    else:
        y = torch.zeros(n, out_f, dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    zr = stacked.zeros if stacked.asymmetric else stacked.scales  # dummy pointer when symmetric
    opts = {"num_warps": num_warps}
    if num_stages is not None:
        opts["num_stages"] = num_stages
    with device_context(x):
        k.fast[(plan.num_tiles, n_tiles, split_k)](
            x, y, plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end,
            stacked.qweight, stacked.scales, zr,
            in_f, out_f, padded_rows(out_f), stacked.effective_group, x.stride(0), y.stride(0),
            stacked.qweight[0].numel(), stacked.scales[0].numel(), ((1 << stacked.bits) - 1) * 0x10001,
            BITS=stacked.bits, ASYM=stacked.asymmetric, BF16=x.dtype == torch.bfloat16, IEEE=x.dtype == torch.float32,
            SPLIT_K=split_k,
            BLOCK_M=plan.block_m, BLOCK_K=bk, G_SHIFT=g_shift, USE_ASM=not interpret_mode(), UNROLL=unroll,
            ACC=acc, **opts,
        )
    if out is not None:
        return out if acc else out.add_(y)
    return y if split_k == 1 else y.to(x.dtype)


def _check_out(out: torch.Tensor, x: torch.Tensor, out_f: int) -> None:
    if out.shape != (x.shape[0], out_f) or out.dtype != x.dtype or out.device != x.device or (
            out_f > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{x.shape[0]}, {out_f}] {x.dtype} on {x.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}")


def can_run_fast(x: torch.Tensor, stacked: StackedDeltas) -> bool:
    """Whether :func:`sbmm_fast` takes this call (layout, shape, dtype); device checks are dispatch's."""
    return (stacked.layout == "mma" and x.dim() == 2 and x.shape[-1] == stacked.in_features
            and x.dtype in fast_dtypes(x.device)
            and fast_supported(stacked.bits, stacked.group_size, stacked.in_features))
