"""``deltazip tune``: the kernel tuning a server does before it reports ready, done ahead of time.

:func:`tune_ahead` builds the delta-mode model of a serve configuration over every variant under the
served directory (every manifest read, so every delta configuration among them is covered, not only
those a server reads at start-up). Building it compiles the CUDA delta-matmul kernels and times the
launch choices of every batch bucket (``deltazip.kernels.dispatch_table``, through
``kernel_warmup.warm_up_kernels``; a server tunes only the first ones before it is ready); the choices land in the on-disk table that a later ``deltazip
serve`` on the same GPU model and software versions reads instead of timing again. Useful where
start-up time counts: at image build time, or before a fleet of servers starts.
"""

from __future__ import annotations

import time

import torch

from deltazip.formats.errors import InputError
from deltazip.runtime.serve.assembly import ServeConfig, build_model
from deltazip.runtime.serve.kernel_warmup import warm_up_kernels


def tune_ahead(cfg: ServeConfig) -> dict:
    """Compile and tune every delta-matmul launch ``deltazip serve`` with ``cfg`` can make.

    Args:
        cfg: the serve configuration (``artifacts``, ``base``, ``max_deltas``, ``device``, ``dtype``);
            its mode is taken as delta and its deltas as packed (what is tuned).
    Returns:
        ``{"gpu", "dtype", "variants", "keys_timed", "tuning_s", "seconds", "table", "table_entries",
        "skipped"}``: ``keys_timed`` the dispatch keys timed now (0 when the table already held them all).
    Raises:
        InputError: no such directory or no variants in it, no CUDA device, or tuning switched off
            (``DELTAZIP_AUTOTUNE=0``).
    """
    from deltazip.kernels import dispatch_table
    from deltazip.runtime.serve.variant_sources import find_variants

    find_variants(cfg.artifacts, allow_empty=cfg.base is not None)  # a wrong directory is named before the device
    device = cfg.torch_device()
    if device.type != "cuda":
        raise InputError(f"deltazip tune times the CUDA delta-matmul kernels and needs a GPU (the device is {device}); "
                         "on a CPU, deltazip serve keeps the deltas dequantized and has nothing to tune")
    if not dispatch_table.enabled():
        raise InputError("kernel tuning is switched off (DELTAZIP_AUTOTUNE=0); unset it to tune")
    cfg.mode, cfg.delta_compute = "delta", "packed"
    t0 = time.perf_counter()
    asm = build_model(cfg)
    t1 = time.perf_counter()
    timed = warm_up_kernels(asm.backend, everything=True)
    table = dispatch_table.table_for(device)
    return {"gpu": torch.cuda.get_device_name(device), "dtype": str(asm.dtype).removeprefix("torch."),
            "variants": len(asm.variants), "keys_timed": timed, "tuning_s": round(time.perf_counter() - t1, 2), "seconds": round(time.perf_counter() - t0, 2),
            "table": str(table.path), "table_entries": len(table.entries),
            "skipped": sum(len(v) for v in table.skipped.values())}
