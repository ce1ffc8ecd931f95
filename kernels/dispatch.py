"""Which path serves a stack's SBMM, decided once per stack: the CUDA kernel where it covers the stack,
else the torch reference (correct, slower).

:func:`prepare` is called when a stack is allocated for its slots (``PackedStore`` in the runtime, the
MoE stacks, :func:`sbmm` for a caller's own stack); it resolves the path once and returns a launch
object that a step calls with nothing else to decide: no environment reads, capability checks or
table lookups per call. The CUDA launch (``cuda_sbmm.Launch``) resolves each (rows, deltas) bucket's
measured choice (``dispatch_table``) on its first call and keeps it until the table changes.

:func:`coverage` says, without a device, whether the CUDA kernel serves a scheme (tests enumerate every
scheme compress writes against it); for those it does not, a prepared launch's ``reason`` is the
start-up line a server prints where a GPU serves them on the reference.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from deltazip.kernels import cuda_sbmm, dispatch_table, grouped_lora, reference
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.row_plan import RowPlan, group_rows
from deltazip.kernels.scheme import DeltaScheme
from deltazip.kernels.stacked import StackedDeltas, choose_layout, config_key, repack

__all__ = ["CALLS", "RowPlan", "coverage", "group_rows", "layout_for", "lora", "prepare", "sbmm", "sbmm_experts"]

# Calls per path ("cuda", "dequant_mm", "reference", "lora_<path>" of grouped_lora.CANDIDATES), counted by
# the launch objects' callers below and by bench/launches.py; ``CALLS.clear()`` resets it.
CALLS: Counter = Counter()


def coverage(scheme: DeltaScheme, in_features: int, dtype: torch.dtype) -> str | None:
    """None when the CUDA kernel serves deltas of ``scheme`` over ``in_features`` columns with ``dtype``
    activations on an sm_80+ GPU; else why the torch reference serves them."""
    return cuda_sbmm.covers(scheme, in_features, dtype)


def layout_for(scheme: DeltaScheme, in_features: int, dtype: torch.dtype, device: torch.device | str) -> str:
    """The stack layout of a configuration: the CUDA kernel's ``mma`` where it serves it on CUDA, else
    ``canonical`` (the reference reads it a slot at a time, with no copy); ``DELTAZIP_SBMM_LAYOUT`` as in
    ``stacked.choose_layout``."""
    if torch.device(device).type == "cuda" and coverage(scheme, in_features, dtype) is not None:
        return "canonical"
    return choose_layout("auto", bits=scheme.bits, group_size=scheme.group_size, in_features=in_features,
                         device=device)


class ReferenceLaunch:
    """A stack's SBMM on the torch reference (``reason``: why not the CUDA kernel)."""

    path = "reference"

    def __init__(self, stack: StackedDeltas, reason: str):
        self.stack, self.reason = stack, reason

    def __call__(self, y, x, idx, plan_of=None, present=None, held=None) -> torch.Tensor:
        """As ``cuda_sbmm.Launch.__call__``; rows of slots the stack does not hold (``present``) add nothing."""
        CALLS["reference"] += 1
        if present is not None:
            idx = torch.where(present[idx + 1], idx, torch.full_like(idx, -1))
        out = reference.sbmm(x, idx, self.stack)
        return out if y is None else y.add_(out)


class _Counted:
    """``cuda_sbmm.Launch`` with its calls counted in :data:`CALLS` by the path it takes."""

    def __init__(self, launch: cuda_sbmm.Launch):
        self.launch, self.path, self.reason = launch, "cuda", None

    def __call__(self, y, x, idx, plan_of=None, present=None, held=None) -> torch.Tensor:
        CALLS["cuda"] += 1
        return self.launch(y, x, idx, plan_of, present, held)

    def forget(self) -> None:
        self.launch.forget()


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the prepared CUDA launches, told when the table changes
# One lock for the set and for the changes told through it: prepare adds to it on the engine's or the start-up
# thread while the tuner's thread tells every launch of a change, and choices_held keeps changes out.
_CHOICES_LOCK = threading.RLock()


@contextlib.contextmanager
def choices_held() -> Iterator[None]:
    """Within the block, no change of the table reaches the prepared launches (the tuner's thread waits).

    A decode graph's capture holds it from its warm-up forward to the capture's end: the captured forward
    then takes the launches its warm-up resolved, so nothing is compiled or allocated inside the capture
    (an allocation there is filled only at replay, so a new split-K counter would start uninitialised for
    the launches that run eagerly)."""
    with _CHOICES_LOCK:
        yield


def _forget_all() -> None:
    with _CHOICES_LOCK:
        for launch in list(_LIVE):
            launch.forget()


dispatch_table.LISTENERS.append(_forget_all)


def _why_not_cuda(stack: StackedDeltas, dtype: torch.dtype) -> str | None:
    if stack.device.type != "cuda":
        return f"the device is {stack.device.type}"
    why = coverage(stack.scheme, stack.in_features, dtype)
    if why is None and stack.layout != "mma":
        why = "its stack is in the canonical layout (row groups not on the kernel's 64-row tiles)"
    if why is None and not cuda_sbmm.available(stack.device.index or 0):
        why = "the GPU is older than sm_80 or NVRTC is missing"
    return why


def prepare(stack: StackedDeltas, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """The launch object serving ``stack`` with ``dtype`` activations, made once and kept on the stack.

    Call it as ``launch(y, x, idx, plan_of=None, present=None, held=None)``: ``y[r] += x[r] @ W[idx[r]]^T``
    (``y`` None: returns a new tensor); ``plan_of(idx)``: the step's shared row plan; ``present``: device
    bool ``[D + 1]`` of the slots the stack holds (by ``slot + 1``), ``held`` the same as a host set.
    Its ``path`` is ``"cuda"`` or ``"reference"``, ``reason`` why not the CUDA kernel (None on it)."""
    launches = stack.__dict__.setdefault("_launches", {})
    launch = launches.get(dtype)
    if launch is not None:
        return launch
    why = _why_not_cuda(stack, dtype)
    ref = ReferenceLaunch(stack, why or "the tuner found every launch config of this configuration wrong")
    if why is not None:
        launch = ref
    else:
        def choose(rows: int, deltas: int) -> tuple[str, cuda_sbmm.CudaConfig | None]:
            if dispatch_table.distrusted(stack, dtype):
                return "reference", None
            c = dispatch_table.lookup(stack, dtype, rows, deltas) or dispatch_table.default_choice(stack, rows, deltas)
            return c.path, c.config

        launch = _Counted(cuda_sbmm.Launch(stack, dtype, choose, ref))
        with _CHOICES_LOCK:
            _LIVE.add(launch)
    launches[dtype] = launch
    return launch


def sbmm(x: torch.Tensor, delta_index: torch.Tensor, deltas: StackedDeltas | list[PackedDelta], *,
         plan: RowPlan | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[r] = x[r] @ W[delta_index[r]].T``; rows with index -1 get zeros.

    Args:
        x: ``[N, in]`` activations (fp16, bf16 or fp32).
        delta_index: integer ``[N]`` with values in ``[-1, D)``.
        deltas: a ``StackedDeltas`` or a list of ``D`` canonical ``PackedDelta`` (stacked per call).
        plan: optional row plan of ``delta_index`` (``deltazip.kernels.row_plan``).
        out: ``[N, out]`` in ``x.dtype`` (a ``StackedDeltas`` only): the product is added onto it in place
            and ``out`` is returned.
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    if isinstance(deltas, StackedDeltas):
        if x.dim() != 2 or x.shape[-1] != deltas.in_features or x.device != deltas.device:
            return reference.sbmm(x, delta_index, deltas)  # raises with the mismatch named
        return prepare(deltas, x.dtype)(out, x, delta_index, None if plan is None else (lambda _: plan))
    if out is not None:
        raise ValueError("sbmm(out=...) takes a StackedDeltas; a list of deltas returns a new tensor")
    deltas = list(deltas)
    if not deltas:
        raise ValueError("sbmm needs at least one delta")
    if not x.is_cuda or len({config_key(d) for d in deltas}) != 1:
        return reference.sbmm(x, delta_index, deltas)
    reference._check_index(delta_index, x.shape[0], len(deltas), "delta_index")
    d = deltas[0]
    stack = repack(deltas, device=x.device, layout=layout_for(d.scheme, d.in_features, x.dtype, x.device))
    return sbmm(x, delta_index, stack, plan=plan)


def sbmm_experts(x: torch.Tensor, slot_index: torch.Tensor, expert_index: torch.Tensor,
                 deltas: StackedDeltas | list[PackedDelta], num_experts: int) -> torch.Tensor:
    """Mixture-of-experts SBMM: ``y[p] = x[p] @ Δ(slot[p], expert[p]).T`` for routed pairs ``p``.

    The groups are (slot, expert) pairs (``reference.expert_groups``: entry ``slot * E + expert`` of
    ``deltas``), so every pair of the batch runs through the same kernel as a dense linear's rows (a
    device row plan: the routing is only on the device); slot -1 gives zeros.

    Args:
        x: ``[P, in]``; slot_index, expert_index: integer ``[P]``; deltas: ``slots * E`` entries;
        num_experts: ``E``.
    Returns:
        ``[P, out]`` in ``x.dtype``.
    """
    return sbmm(x, reference.expert_groups(slot_index, expert_index, num_experts), deltas)


def lora(x: torch.Tensor, lora_index: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         scale: torch.Tensor, defer: Callable[[grouped_lora.Shape], None] | None = None) -> torch.Tensor:
    """Grouped LoRA ``y[r] = (x[r] @ A[i].T) @ B[i].T * scale[i]``, ``i = lora_index[r]``; -1 gives zeros,
    on the path measured fastest for the shape and rows bucket (``deltazip.kernels.grouped_lora``: a GEMM
    pair per adapter, two GEMMs over every adapter, or torch's grouped GEMM), counted in :data:`CALLS`
    as ``lora_<path>``.

    Args:
        x: ``[N, in]``; lora_index: integer ``[N]`` in ``[-1, L)``; A: ``[L, rank, in]``;
        B: ``[L, out, rank]``; scale: ``[L]``; defer: as ``grouped_lora.lora`` (a server's request path
        measures nothing: it hands an unmeasured key to its tuner).
    Returns:
        ``[N, out]`` in ``x.dtype``.
    """
    reference.check_lora_shapes(x, A, B, scale)
    y, path = grouped_lora.lora(x, lora_index, A, B, scale, defer)
    CALLS[f"lora_{path}"] += 1
    return y

