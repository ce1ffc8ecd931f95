"""Entry points for SBMM and grouped LoRA: the Triton fast paths when they can run, else the reference.

Every path computes the same thing (``deltazip.kernels.reference.sbmm`` / ``lora_shrink_expand``
define it); a Triton path is taken when

- Triton is importable and ``x`` is on a CUDA device, and
- the call is supported: ``x`` is ``[N, in]`` in fp16/bf16/fp32 (no bf16 under the interpreter),
  everything sits on one device.

Which Triton kernel runs SBMM follows the stack's layout (``StackedDeltas.layout``): ``"mma"`` stacks
(the default on CUDA for bits 2/4/8, ``in`` a multiple of 128) go to the bandwidth-bound kernel
``deltazip.kernels.triton_fast`` (fp16/bf16 on tensor cores; fp32 exactly, on fp32 FMA);
``"transposed"`` stacks go to ``deltazip.kernels.triton_sbmm``. A list of
canonical deltas is repacked per call into the layout the call can use best.

The environment variable ``DELTAZIP_FORCE_TRITON`` overrides the choice: ``1`` takes the Triton path
for every supported call even without CUDA (with ``TRITON_INTERPRET=1`` this runs the kernels on
the CPU, which is how the parity tests run), and raises if Triton is missing; ``0`` always takes the
reference. Unset (or ``auto``) is the rule above.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from deltazip.kernels import cuda_sbmm, dispatch_table, reference
from deltazip.kernels.fast_layout import fast_supported
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.stacked import StackedDeltas, config_key, repack
from deltazip.kernels.triton_fast import can_run_fast, fast_dtypes, fast_enabled, sbmm_fast
from deltazip.kernels.triton_sbmm import (
    RowPlan,
    group_rows,
    lora_triton,
    sbmm_triton,
    supported_dtypes,
    triton_importable,
)

__all__ = ["CALLS", "RowPlan", "group_rows", "lora", "sbmm", "sbmm_experts", "triton_mode", "use_triton"]

_ENV = "DELTAZIP_FORCE_TRITON"

# Calls per path ("cuda", "dequant_mm", "fast", "transposed", "reference", "lora", "lora_reference"): one
# kernel launch each on the CUDA and Triton paths (plus one fp32 ``add_`` when split-K adds onto ``out``). A host-side count, read by
# bench/launches.py and the launch-count tests; ``CALLS.clear()`` resets it.
CALLS: Counter = Counter()


def triton_mode() -> str:
    """``"force"``, ``"off"`` or ``"auto"`` from ``DELTAZIP_FORCE_TRITON``."""
    raw = os.environ.get(_ENV, "auto").strip().lower()
    if raw in ("1", "true", "yes", "on", "force"):
        return "force"
    if raw in ("0", "false", "no", "off"):
        return "off"
    if raw in ("", "auto"):
        return "auto"
    raise ValueError(f"{_ENV}={raw!r}: use 1 (force Triton), 0 (reference only) or leave it unset")


def use_triton(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a call with activations ``x`` (and the other tensors it reads) takes the Triton path."""
    mode = triton_mode()
    if mode == "off":
        return False
    if mode == "auto" and (x.device.type != "cuda" or not triton_importable()):
        return False
    if mode == "force" and not triton_importable():
        raise RuntimeError(f"{_ENV}=1 but triton cannot be imported; install the 'kernels' extra")
    if x.dim() != 2 or x.dtype not in supported_dtypes(x.device):
        return False
    return all(t.device == x.device for t in tensors)


def cuda_path(x: torch.Tensor, stack: StackedDeltas) -> bool:
    """Whether a call with activations ``x`` on ``stack`` runs on the CUDA kernel (``mma`` layout, fp16 or
    bf16 on a GPU with NVRTC, a group size the kernel has a variant for, and not
    ``dispatch_table.distrusted``: no launch config gave the right result while tuning);
    ``DELTAZIP_FORCE_TRITON=1`` keeps the Triton kernels (their parity tests)."""
    return (x.is_cuda and stack.layout == "mma" and x.dim() == 2 and x.shape[-1] == stack.in_features
            and stack.device == x.device and triton_mode() != "force" and cuda_sbmm.supported(stack, x.dtype)
            and cuda_sbmm.available(x.device.index or 0) and not dispatch_table.distrusted(stack, x.dtype))


def _packed_plan(plan: RowPlan) -> RowPlan:
    """A device plan (``group_rows``) with the packed tensor the CUDA kernel reads (one device concat)."""
    from dataclasses import replace

    packed = torch.cat([plan.perm, plan.tile_slot, plan.tile_start, plan.tile_end])
    return replace(plan, packed=packed)


def _sbmm_cuda(x, delta_index, stack, plan, out, present, held) -> torch.Tensor:
    """The CUDA paths, chosen by measurement (``deltazip.kernels.dispatch_table``)."""
    n = x.shape[0]
    if plan is None or plan.packed is None or plan.block_m != 16:
        if plan is None or plan.block_m != 16:
            plan = group_rows(delta_index, stack.num_deltas, 16)
        plan = _packed_plan(plan)
    deltas = len(plan.slot_rows) if plan.slot_rows is not None else min(n, stack.num_deltas)
    choice = dispatch_table.lookup(stack, x.dtype, n, deltas) or dispatch_table.default_choice(stack, n, deltas)
    if choice.path == "dequant_mm" and plan.slot_rows is not None and not torch.cuda.is_current_stream_capturing():
        CALLS["dequant_mm"] += 1
        return cuda_sbmm.dequant_mm(x, stack, plan, out=out, slots=held)
    CALLS["cuda"] += 1
    return cuda_sbmm.sbmm_cuda(x, stack, plan, out=out, present=present, config=choice.config)


def sbmm(
    x: torch.Tensor,
    delta_index: torch.Tensor,
    deltas: StackedDeltas | list[PackedDelta],
    *,
    plan: RowPlan | None = None,
    out: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
    held: set[int] | None = None,
) -> torch.Tensor:
    """``y[r] = x[r] @ W[delta_index[r]].T``; rows with index -1 get zeros.

    Args:
        x: ``[N, in]`` activations (fp16, bf16 or fp32).
        delta_index: integer ``[N]`` with values in ``[-1, D)``.
        deltas: a ``StackedDeltas`` (what a server keeps on the GPU; no work per call) or a list of
            ``D`` canonical ``PackedDelta`` (repacked on every call on the Triton path; deltas of
            different bits/group/sparsity are split into one stack and one launch per configuration).
        plan: optional :func:`group_rows` plan for ``delta_index`` (Triton path with a single
            configuration only; lets the linears of one layer share the grouping).
        out: ``[N, out]`` in ``x.dtype`` (a ``StackedDeltas`` only): the product is added onto it in
            place (``out += x W^T``, in the fast kernel's epilogue: no zero-filled buffer, no separate
            add) and ``out`` is returned.
        present, held: CUDA path only: which slots the stack holds, as a device bool ``[D + 1]``
            indexed by ``slot + 1`` and a host set (rows of other slots get nothing added; the plan
            can then be the batch's shared one).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if isinstance(deltas, StackedDeltas) and cuda_path(x, deltas):
        return _sbmm_cuda(x, delta_index, deltas, plan, out, present, held)
    if isinstance(deltas, StackedDeltas):
        if x.dim() != 2 or x.shape[-1] != deltas.in_features or not use_triton(x, delta_index, deltas.qweight):
            CALLS["reference"] += 1
            return _add_into(out, reference.sbmm(x, delta_index, deltas))
        if deltas.layout == "mma":
            if (can_run_fast(x, deltas) and (plan is None or plan.block_m >= 16)
                    and (triton_mode() == "force" or fast_enabled() or not x.is_cuda)):
                CALLS["fast"] += 1
                return sbmm_fast(x, delta_index, deltas, plan=plan, out=out)
            CALLS["reference"] += 1
            return _add_into(out, reference.sbmm(x, delta_index, deltas))
        CALLS["transposed"] += 1
        return _add_into(out, sbmm_triton(x, delta_index, deltas, plan=plan))
    if out is not None:
        raise ValueError("sbmm(out=...) takes a StackedDeltas; a list of deltas returns a new tensor")
    deltas = list(deltas)
    if not deltas:
        raise ValueError("sbmm needs at least one delta")
    if not use_triton(x, delta_index) or x.shape[-1] != deltas[0].in_features:
        return reference.sbmm(x, delta_index, deltas)
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(deltas):
        groups.setdefault(config_key(d), []).append(i)
    # The list path repacks per call anyway, so a host-side range check costs nothing extra.
    reference._check_index(delta_index, x.shape[0], len(deltas), "delta_index")
    if len(groups) == 1:
        return _sbmm_list(x, delta_index, deltas, plan)
    if len({(k[3], k[4]) for k in groups}) != 1:
        return reference.sbmm(x, delta_index, deltas)  # raises with the mismatching shapes
    # One launch per configuration: remap the index to the group's local slots (-1 elsewhere).
    index = delta_index.to(torch.int64)
    y = None
    for members in groups.values():
        local = torch.full((len(deltas) + 1,), -1, dtype=torch.int64, device=x.device)
        local[torch.tensor(members, device=x.device)] = torch.arange(len(members), device=x.device)
        sub = local[torch.where(index < 0, torch.full_like(index, len(deltas)), index)]
        part = _sbmm_list(x, sub, [deltas[i] for i in members], None)
        y = part if y is None else y + part  # each row is non-zero in exactly one group
    return y


def sbmm_experts(
    x: torch.Tensor,
    slot_index: torch.Tensor,
    expert_index: torch.Tensor,
    deltas: StackedDeltas | list[PackedDelta],
    num_experts: int,
) -> torch.Tensor:
    """Mixture-of-experts SBMM: ``y[p] = x[p] @ Δ(slot[p], expert[p]).T`` for routed pairs ``p``.

    The groups are (slot, expert) pairs (``reference.expert_groups``: entry ``slot * E + expert`` of
    ``deltas``), so every pair of the batch runs through the same kernel as a dense linear's rows,
    whichever variant and expert it belongs to; slot -1 gives zeros.

    Args:
        x: ``[P, in]``; slot_index, expert_index: integer ``[P]``; deltas: ``slots * E`` entries;
        num_experts: ``E``.
    Returns:
        ``[P, out]`` in ``x.dtype``.
    """
    return sbmm(x, reference.expert_groups(slot_index, expert_index, num_experts), deltas)


def _add_into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return y if out is None else out.add_(y)


def _sbmm_list(x: torch.Tensor, index: torch.Tensor, deltas: list[PackedDelta], plan: RowPlan | None) -> torch.Tensor:
    """One configuration of canonical deltas, repacked for this call into the layout it runs best on."""
    d = deltas[0]
    if fast_supported(d.bits, d.group_size, d.in_features) and (plan is None or plan.block_m >= 16):
        stack = repack(deltas, device=x.device, layout="mma")
        if cuda_path(x, stack):
            return _sbmm_cuda(x, index, stack, plan, None, None, None)
        if x.dtype in fast_dtypes(x.device) and (triton_mode() == "force" or fast_enabled() or not x.is_cuda):
            return sbmm_fast(x, index, stack, plan=plan)
    return sbmm_triton(x, index, repack(deltas, device=x.device, layout="transposed"), plan=plan)


def lora(
    x: torch.Tensor,
    lora_index: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    scale: torch.Tensor,
    *,
    plan: RowPlan | None = None,
) -> torch.Tensor:
    """Grouped LoRA ``y[r] = (x[r] @ A[i].T) @ B[i].T * scale[i]``, ``i = lora_index[r]``; -1 gives zeros.

    Args:
        x: ``[N, in]``; lora_index: integer ``[N]`` in ``[-1, L)``; A: ``[L, rank, in]``;
        B: ``[L, out, rank]``; scale: ``[L]``.
        plan: optional :func:`group_rows` plan for ``lora_index`` (Triton path only).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if not use_triton(x, lora_index, A, B, scale) or A.dim() != 3 or x.shape[-1] != A.shape[-1]:
        CALLS["lora_reference"] += 1
        return reference.lora_shrink_expand(x, lora_index, A, B, scale)
    CALLS["lora"] += 1
    return lora_triton(x, lora_index, A, B, scale, plan=plan)
