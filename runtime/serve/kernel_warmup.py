"""Kernel warm-up of a decoupled model: no request compiles or tunes an SBMM kernel.

At build (and when a variant is added) :func:`warm_up_kernels` allocates the stacks that the served
variants' packed tensors will be written into (what their first load would allocate anyway: one per
linear or merged projection group and delta configuration, read from the manifests), then hands them
to the dispatch tuner (``deltazip.kernels.dispatch_table.tune_stack``): every kernel build a forward
can launch is compiled, and the launch choices are timed per batch bucket (results cached on disk per
GPU model). Only on CUDA with ``delta_compute == "packed"``; elsewhere (CPU serving keeps the
deltas dequantized, nothing is compiled) it returns 0 without touching anything.
"""

from __future__ import annotations

import torch

from deltazip.kernels.stacked import StackedDeltas


def served_stacks(model) -> list[StackedDeltas]:
    """The stacks the packed tensors of ``model``'s variants go into (allocated now if needed).

    Args:
        model: a ``deltazip.runtime.serve.model.DeltaModel``.
    """
    stacks: dict[int, StackedDeltas] = {}
    for name, targets in model._targets.items():
        v = model.variants[name]
        for tname, where in targets.items():
            e = v.entries[tname]
            if not e.kernel_ready:
                continue
            s = e.scheme
            for mname, attr in where:
                mod = model.modules.get(mname)
                if attr != "weight" or mod is None or not hasattr(mod, "_store"):
                    continue
                st = mod._store.stack_for(s.bits, s.group_size, s.sparse, not s.sym)
                stacks[id(st)] = st
    return list(stacks.values())


_warmed: set[tuple] = set()  # stack configurations tuned in this process


def warm_up_kernels(model, *, tune: bool | None = None) -> int:
    """Compile and tune every SBMM launch ``model`` can make on the CUDA kernel; returns the keys timed
    (or, untuned, the default launches made). A no-op returning 0 unless the model runs packed deltas
    on CUDA."""
    if model.delta_compute != "packed" or model.device.type != "cuda":
        return 0
    from deltazip.kernels import cuda_sbmm, dispatch, dispatch_table
    from deltazip.kernels.row_plan import plan_rows

    tune = dispatch_table.enabled() if tune is None else tune
    count = 0
    for stack in served_stacks(model):
        sig = dispatch_table.key(stack, model.dtype, 1, 1)
        if sig in _warmed or dispatch.prepare(stack, model.dtype).path != "cuda":
            continue
        _warmed.add(sig)
        if tune:
            count += dispatch_table.tune_stack(stack, model.dtype)
            continue
        for rows in (1, 16):
            x = torch.zeros(rows, stack.in_features, dtype=model.dtype, device=stack.device)
            cuda_sbmm.sbmm_cuda(x, stack, plan_rows([0] * rows, stack.num_deltas, stack.device))
            count += 1
    return count
