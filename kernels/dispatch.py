"""Entry points for SBMM and grouped LoRA: the CUDA kernel where it covers the call, else the reference.

Every path computes the same thing (``deltazip.kernels.reference.sbmm`` / ``lora_shrink_expand``
define it). The CUDA kernel (``deltazip.kernels.cuda_sbmm``) serves a call when the stack is in the
``mma`` layout, ``x`` is fp16 or bf16 on the stack's GPU (compute capability 8.0+, NVRTC present), the
kernel has a variant for the stack's group size, and no launch config of it failed the tuner's check
(``dispatch_table.distrusted``). Everything else runs the torch reference: correct, slower.
"""

from __future__ import annotations

from collections import Counter

import torch

from deltazip.kernels import cuda_sbmm, dispatch_table, reference
from deltazip.kernels.mma_layout import supported as mma_supported
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.row_plan import BLOCK_M, RowPlan, group_rows
from deltazip.kernels.stacked import StackedDeltas, config_key, repack

__all__ = ["CALLS", "RowPlan", "group_rows", "lora", "sbmm", "sbmm_experts"]

# Calls per path ("cuda", "dequant_mm", "reference", "lora_reference"): one kernel launch each on the CUDA
# path. A host-side count, read by bench/launches.py and the launch-count tests; ``CALLS.clear()`` resets it.
CALLS: Counter = Counter()


def cuda_path(x: torch.Tensor, stack: StackedDeltas) -> bool:
    """Whether a call with activations ``x`` on ``stack`` runs on the CUDA kernel (module docstring)."""
    return (x.is_cuda and stack.layout == "mma" and x.dim() == 2 and x.shape[-1] == stack.in_features
            and stack.device == x.device and cuda_sbmm.supported(stack, x.dtype)
            and cuda_sbmm.available(x.device.index or 0) and not dispatch_table.distrusted(stack, x.dtype))


def _sbmm_cuda(x, delta_index, stack, plan, out, present, held) -> torch.Tensor:
    """The CUDA paths, chosen by measurement (``deltazip.kernels.dispatch_table``)."""
    if plan is None or plan.packed is None or plan.block_m != BLOCK_M:
        plan = group_rows(delta_index, stack.num_deltas, BLOCK_M)
    n, deltas = x.shape[0], plan.slots_used
    choice = dispatch_table.lookup(stack, x.dtype, n, deltas) or dispatch_table.default_choice(stack, n, deltas)
    if choice.path == "dequant_mm" and plan.slot_rows is not None and not torch.cuda.is_current_stream_capturing():
        CALLS["dequant_mm"] += 1
        return cuda_sbmm.dequant_mm(x, stack, plan, out=out, slots=held)
    CALLS["cuda"] += 1
    return cuda_sbmm.sbmm_cuda(x, stack, plan, out=out, present=present, config=choice.config)


def sbmm(x: torch.Tensor, delta_index: torch.Tensor, deltas: StackedDeltas | list[PackedDelta], *,
         plan: RowPlan | None = None, out: torch.Tensor | None = None, present: torch.Tensor | None = None,
         held: set[int] | None = None) -> torch.Tensor:
    """``y[r] = x[r] @ W[delta_index[r]].T``; rows with index -1 get zeros.

    Args:
        x: ``[N, in]`` activations (fp16, bf16 or fp32).
        delta_index: integer ``[N]`` with values in ``[-1, D)``.
        deltas: a ``StackedDeltas`` (what a server keeps on the GPU) or a list of ``D`` canonical
            ``PackedDelta`` (stacked per call; deltas of different configurations run one call each).
        plan: optional row plan of ``delta_index`` (``deltazip.kernels.row_plan``), shared by the linears
            of a step.
        out: ``[N, out]`` in ``x.dtype`` (a ``StackedDeltas`` only): the product is added onto it in place
            and ``out`` is returned.
        present, held: CUDA path only: which slots the stack holds, as a device bool ``[D + 1]`` indexed
            by ``slot + 1`` and a host set (rows of other slots get nothing added).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if isinstance(deltas, StackedDeltas):
        if cuda_path(x, deltas):
            return _sbmm_cuda(x, delta_index, deltas, plan, out, present, held)
        CALLS["reference"] += 1
        y = reference.sbmm(x, delta_index, deltas)
        return y if out is None else out.add_(y)
    if out is not None:
        raise ValueError("sbmm(out=...) takes a StackedDeltas; a list of deltas returns a new tensor")
    deltas = list(deltas)
    if not deltas:
        raise ValueError("sbmm needs at least one delta")
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(deltas):
        groups.setdefault(config_key(d), []).append(i)
    first = deltas[0]
    if not x.is_cuda or len(groups) != 1 or not mma_supported(first.bits, first.group_size, first.in_features):
        return reference.sbmm(x, delta_index, deltas)
    reference._check_index(delta_index, x.shape[0], len(deltas), "delta_index")
    return sbmm(x, delta_index, repack(deltas, device=x.device), plan=plan)


def sbmm_experts(x: torch.Tensor, slot_index: torch.Tensor, expert_index: torch.Tensor,
                 deltas: StackedDeltas | list[PackedDelta], num_experts: int) -> torch.Tensor:
    """Mixture-of-experts SBMM: ``y[p] = x[p] @ Δ(slot[p], expert[p]).T`` for routed pairs ``p``.

    The groups are (slot, expert) pairs (``reference.expert_groups``: entry ``slot * E + expert`` of
    ``deltas``), so every pair of the batch runs through the same kernel as a dense linear's rows; slot
    -1 gives zeros.

    Args:
        x: ``[P, in]``; slot_index, expert_index: integer ``[P]``; deltas: ``slots * E`` entries;
        num_experts: ``E``.
    Returns:
        ``[P, out]`` in ``x.dtype``.
    """
    return sbmm(x, reference.expert_groups(slot_index, expert_index, num_experts), deltas)


def lora(x: torch.Tensor, lora_index: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         scale: torch.Tensor) -> torch.Tensor:
    """Grouped LoRA ``y[r] = (x[r] @ A[i].T) @ B[i].T * scale[i]``, ``i = lora_index[r]``; -1 gives zeros.

    Args:
        x: ``[N, in]``; lora_index: integer ``[N]`` in ``[-1, L)``; A: ``[L, rank, in]``;
        B: ``[L, out, rank]``; scale: ``[L]``.
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    CALLS["lora_reference"] += 1
    return reference.lora_shrink_expand(x, lora_index, A, B, scale)
