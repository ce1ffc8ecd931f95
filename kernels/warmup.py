"""Warm-up: compile, before the first request, every SBMM kernel variant a forward can launch.

Triton compiles a kernel the first time it sees a new combination of compile-time constants and
argument specializations; in a server that happens on the engine thread, inside a request. For one
stack (one linear's configuration) a forward picks:

- the kernel, from the stack's layout (``mma``: ``triton_fast``; ``transposed``: ``triton_sbmm``);
- the activation dtype (the model's);
- ``BLOCK_M``, from the step's token count (``default_block_m``: 16 up to 256 rows, else 64);
- ``SPLIT_K``, from the grid size (``auto_split_k``: a power of two up to 8).

Everything else (bits, group, K step, zero points) is fixed by the stack, and the integer arguments'
divisibility by the shape. :func:`warmup_stack` runs each combination once on dummy activations (a
few milliseconds per launch once compiled; the first process on a machine pays the compiles, later
ones hit Triton's on-disk cache). A server calls it at start for every distinct stack configuration,
through :func:`warmup_stacks` (``deltazip.runtime.serve.kernel_warmup`` collects the stacks the
served variants need), which also tunes the fast kernel's launch options per batch bucket
(``deltazip.kernels.autotune``) so that no request pays a compile or a tuning run.
"""

from __future__ import annotations

import torch

from deltazip.kernels import autotune
from deltazip.kernels.stacked import StackedDeltas
from deltazip.kernels.triton_sbmm import SPLIT_K_CHOICES, group_rows, interpret_mode, triton_importable


def variants(stack: StackedDeltas, dtypes: tuple[torch.dtype, ...]) -> list[tuple[torch.dtype, int, int]]:
    """``(dtype, BLOCK_M, SPLIT_K)`` combinations a forward through ``stack`` can launch."""
    from deltazip.kernels.triton_fast import fast_config, fast_dtypes
    from deltazip.kernels.triton_sbmm import choose_block_k, supported_dtypes

    if stack.layout == "mma":
        bk, _ = fast_config(stack)
        ok = fast_dtypes(stack.device)
    else:
        bk, _ = choose_block_k(stack.in_features, stack.effective_group, stack.bits, stack.sparse)
        ok = supported_dtypes(stack.device)
    k_tiles = -(-stack.in_features // bk)
    splits = [s for s in SPLIT_K_CHOICES if s <= k_tiles]
    return [(dt, bm, sk) for dt in dtypes if dt in ok for bm in (16, 64) for sk in splits]


def warmup_stack(stack: StackedDeltas, dtypes: tuple[torch.dtype, ...] = (torch.float16,), *,
                 force: bool = False) -> int:
    """Launch every variant of :func:`variants` once (slot 0, dummy activations); returns the launch count.

    Does nothing (returns 0) off CUDA or without Triton, where nothing would be compiled, unless
    ``force`` (the tests run it through the interpreter that way). Results are discarded; the stack
    is only read.
    """
    if not triton_importable() or (stack.device.type != "cuda" and not force):
        return 0
    if stack.device.type != "cuda" and not interpret_mode():
        return 0
    from deltazip.kernels.triton_fast import sbmm_fast
    from deltazip.kernels.triton_sbmm import sbmm_triton

    run = sbmm_fast if stack.layout == "mma" else sbmm_triton
    count = 0
    for dtype, block_m, split_k in variants(stack, dtypes):
        rows = block_m  # one full row tile of slot 0
        x = torch.zeros(rows, stack.in_features, dtype=dtype, device=stack.device)
        index = torch.zeros(rows, dtype=torch.int64, device=stack.device)
        try:
            run(x, index, stack, plan=group_rows(index, stack.num_deltas, block_m), split_k=split_k)
        except Exception as e:  # noqa: BLE001 - a variant that does not fit the device is never launched
            # by a forward either (tuning skips it too); it must not stop a server from starting
            SKIPPED.append(f"{signature(stack)} {dtype} BLOCK_M={block_m} SPLIT_K={split_k}: {type(e).__name__}")
            continue
        count += 1
    if stack.device.type == "cuda":
        torch.cuda.synchronize(stack.device)
    return count


# Batch buckets tuned at start: decode batches (powers of two up to 256 rows, the 16-row tiles) and
# prefill chunks (64-row tiles).
TUNE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

_warmed: set[tuple] = set()  # signatures warmed in this process
SKIPPED: list[str] = []  # warm-up launches that raised (a variant the device cannot run)


def signature(stack: StackedDeltas) -> tuple:
    """What the compiled kernels of a stack depend on (two stacks with one signature share them)."""
    return (str(stack.device), stack.layout, stack.bits, stack.effective_group, stack.sparse, stack.asymmetric,
            stack.in_features, stack.out_features)


def warmup_stacks(stacks: list[StackedDeltas], dtypes: tuple[torch.dtype, ...], *, force: bool = False,
                  tune: bool = True, buckets: tuple[int, ...] = TUNE_BUCKETS) -> int:
    """:func:`warmup_stack` once per distinct :func:`signature` not warmed yet in this process, then,
    for ``mma`` stacks on CUDA with ``tune`` (and ``DELTAZIP_AUTOTUNE`` not 0), the per-bucket tuning
    of :func:`deltazip.kernels.autotune.tune` (cached on disk: a later start only reads the file).
    Returns the warm-up launches made (tuning launches not counted)."""
    count = 0
    for stack in stacks:
        sig = signature(stack) + tuple(dtypes)
        if sig in _warmed:
            continue
        cuda_dtypes = tuple(dt for dt in dtypes if _cuda_path(stack, dt))
        if cuda_dtypes:  # the CUDA kernel serves these: compile its variants by tuning every bucket
            count += _warm_cuda(stack, cuda_dtypes, tune)
            # a dtype whose every launch config failed the tuner's check is served (and warmed) elsewhere
            dtypes_left = tuple(dt for dt in dtypes if not _cuda_path(stack, dt))
            if not dtypes_left:
                _warmed.add(sig)
                continue
        else:
            dtypes_left = dtypes
        n = warmup_stack(stack, dtypes_left, force=force)
        count += n
        if tune and stack.layout == "mma" and stack.device.type == "cuda" and autotune.enabled():
            from deltazip.kernels.triton_fast import fast_dtypes

            for dt in dtypes_left:
                if dt in fast_dtypes(stack.device):
                    for rows in buckets:
                        autotune.tune(stack, dt, rows, save=False)
            autotune.cache_for(stack.device).save()
        if n:
            _warmed.add(sig)
    return count


def _cuda_path(stack: StackedDeltas, dtype: torch.dtype) -> bool:
    from deltazip.kernels import cuda_sbmm, dispatch_table
    from deltazip.kernels.dispatch import triton_mode

    return (stack.device.type == "cuda" and triton_mode() != "force" and cuda_sbmm.supported(stack, dtype)
            and cuda_sbmm.available(stack.device.index or 0) and not dispatch_table.distrusted(stack, dtype))


def _warm_cuda(stack: StackedDeltas, dtypes: tuple[torch.dtype, ...], tune: bool) -> int:
    """Tune (which compiles every launch variant) or, untuned, launch the default variant once per
    activation dtype; returns the launches made."""
    from deltazip.kernels import cuda_sbmm, dispatch_table
    from deltazip.kernels.host_plan import plan_rows

    count = 0
    for dt in dtypes:
        if tune and autotune.enabled():
            count += dispatch_table.tune_stack(stack, dt)
            continue
        for rows in (1, 16):
            x = torch.zeros(rows, stack.in_features, dtype=dt, device=stack.device)
            cuda_sbmm.sbmm_cuda(x, stack, plan_rows([0] * rows, stack.num_deltas, stack.device))
            count += 1
    torch.cuda.synchronize(stack.device)
    return count
