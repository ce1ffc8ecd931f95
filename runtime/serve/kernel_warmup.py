"""Kernel warm-up of a decoupled model: no request compiles or tunes an SBMM kernel.

At build (and when a variant is added) :func:`warm_up_kernels` allocates the stacks that the served
variants' packed tensors will be written into (what their first load would allocate anyway: one per
linear or merged projection group and delta configuration, read from the manifests), then hands them
to ``deltazip.kernels.warmup.warmup_stacks``: every kernel variant a forward can launch is compiled,
and the launch options are tuned per batch bucket (``deltazip.kernels.autotune``, results cached on
disk per GPU model). Only on CUDA with ``delta_compute == "packed"``; elsewhere (CPU serving keeps the
deltas dequantized, nothing is compiled) it returns 0 without touching anything.
"""

from __future__ import annotations

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


def warm_up_kernels(model, *, force: bool = False, tune: bool | None = None) -> int:
    """Compile (and tune) every SBMM launch ``model`` can make; returns the number of warm-up launches.

    A no-op returning 0 unless the model runs packed deltas on CUDA (``force``: also on a CPU through
    the Triton interpreter, for the tests; tuning then needs ``tune=True`` and a GPU timer, so it is
    off by default there).
    """
    if model.delta_compute != "packed" or (model.device.type != "cuda" and not force):
        return 0
    from deltazip.kernels.warmup import warmup_stacks

    return warmup_stacks(served_stacks(model), dtypes=(model.dtype,), force=force,
                         tune=(model.device.type == "cuda") if tune is None else tune)

