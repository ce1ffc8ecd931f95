"""What ``deltazip serve`` reports at start-up, one log line each (logger ``deltazip.serve``):

- the base (bytes on disk and resident, device, dtype, mode);
- every variant read at start-up (bytes on disk, bytes per device slot, what dedup saves), and one
  line for the variants found but read on first use;
- the dedup summary;
- ``kernel warm-up: ...``: what the start-up tuning of the delta matmul will do (it runs once the server
  answers, ``deltazip.runtime.serve.kernel_warmup``; nothing to compile on CPU or in swap mode);
- ``images: ...`` (image-text bases only, ``images.log_images``): whether chat requests may send
  images, and why not when they may not;
- ``capacity: ...``: how many variants fit on the device (``--max-deltas`` slots, and how many the
  free device memory would hold at the largest variant's size) and in host memory
  (``--max-cpu-deltas``, and how many the available memory would hold), the figures multi-LoRA
  servers report.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from deltazip.formats.units import human_bytes
from deltazip.runtime.serve.variant_sources import VariantInfo

log = logging.getLogger("deltazip.serve")


def variant_costs(v: VariantInfo, backend, seen: dict) -> dict[str, Any]:
    """Start-up figures of one variant: resident bytes, and dedup savings predicted from fingerprints
    (``seen``: fingerprint -> bytes of changed full-checkpoint tensors of earlier variants)."""
    out = {"kind": v.kind, "bytes_on_disk": v.disk_bytes, "bytes_resident": backend.resident_estimate(v.name),
           "dedup_same_as_base_bytes": v.same_as_base_bytes, "dedup_shared_bytes": 0}
    if v.kind == "full":
        itemsize = torch.tensor([], dtype=backend.dtype).element_size()
        changed = [e for e in v.entries.values() if e.kind != "same"]
        for e in changed:
            numel = e.numel
            fp = v.fingerprints[e.name]
            if fp in seen:
                out["dedup_shared_bytes"] += numel * itemsize
            seen[fp] = numel * itemsize
        out.update(tensors=len(v.tensors), changed_tensors=len(changed))
    return out


def log_variant(v: VariantInfo, c: dict[str, Any], mode: str) -> None:
    if v.kind == "full":
        saved = c["dedup_same_as_base_bytes"] + c["dedup_shared_bytes"]
        # Delta mode: the changed tensors are dense per-row replacements, held once on the host
        # (identical copies share them) and referenced by the device slot (no copy on CPU; on a GPU
        # one device copy, shared by slots holding identical tensors).
        cost = "a whole model per device slot (swap mode)" if mode == "swap" else \
            f"{human_bytes(c['bytes_resident'])} of dense per-row replacements, held on the host and in its device slot"
        log.info("variant %s (full checkpoint): %s on disk; %d of %d tensors equal the base's, %d changed; dedup saves "
                 "%s (%s same as base, %s shared with other variants); %s", v.name, human_bytes(v.disk_bytes),
                 c["tensors"] - c["changed_tensors"], c["tensors"], c["changed_tensors"], human_bytes(saved),
                 human_bytes(c["dedup_same_as_base_bytes"]), human_bytes(c["dedup_shared_bytes"]), cost)
    else:
        what = "LoRA adapter" if v.kind == "lora" else "artifact"
        log.info("variant %s (%s): %s on disk, %s resident per device slot", v.name, what, human_bytes(v.disk_bytes),
                 human_bytes(c["bytes_resident"]))


def startup_report(asm, cfg) -> list[dict[str, Any]]:
    """One entry per model read at start-up (sizes, dedup savings), each logged; then a line for the
    variants read on first use and the dedup summary line.

    Args:
        asm: the ``deltazip.runtime.serve.assembly.Assembly`` built; cfg: its ``ServeConfig``.
    """
    base, backend, ledger = asm.base, asm.backend, asm.ledger
    report = [{"model": asm.base_name, "role": "base", "path": str(base.path), "bytes_on_disk": base.nbytes(),
               "bytes_resident": backend.base_bytes()}]
    log.info("base %s: %s on disk, %s resident (%s, %s, mode %s)", asm.base_name, human_bytes(base.nbytes()),
             human_bytes(backend.base_bytes()), asm.device, str(asm.dtype).removeprefix("torch."), cfg.mode)
    seen: dict = {}
    for v in asm.variants:
        c = variant_costs(v, backend, seen)
        report.append({"model": v.name, "role": "variant", "path": str(v.path), **c})
        log_variant(v, c, cfg.mode)
    if asm.found:
        log.info("%d more variants found (%s ... %s): each is read and checked against the base when its first "
                 "request arrives", len(asm.found), asm.found[0].name, asm.found[-1].name)
    same = sum(r.get("dedup_same_as_base_bytes", 0) for r in report)
    shared = sum(r.get("dedup_shared_bytes", 0) for r in report)
    log.info("dedup: %s not stored (%s of variant tensors equal to the base's, %s shared between variants, %s of "
             "duplicate tensors inside the base); every load goes through the registry, /metrics has the live "
             "figures", human_bytes(same + shared + ledger.base_reused_bytes), human_bytes(same), human_bytes(shared),
             human_bytes(ledger.base_reused_bytes))
    return report


def log_warmup(backend) -> dict[str, Any]:
    """The ``kernel warm-up`` figures: a dict that the start-up tuning (``kernel_warmup.Startup``, which
    logs its own line when it ends) fills in; the line logged here says what there is to tune."""
    w = {"seconds": 0.0, "launches": 0}
    if not hasattr(backend, "tuner"):  # swap mode: whole models through transformers' own modules
        why = "nothing to compile: swap mode runs whole models"
    elif backend.device.type == "cuda" and backend.delta_compute == "packed":
        return w  # tuned once the server answers (/health: 503 meanwhile); kernel_warmup.Startup logs the line
    else:
        why = (f"nothing to compile: resident deltas are {backend.delta_compute} on {backend.device.type}; SBMM "
               f"kernels are compiled only for packed deltas on CUDA")
    log.info("kernel warm-up: %.3f s before ready (%s)", 0.0, why)
    return w


def capacity(asm, cfg, registered: int) -> dict[str, Any]:
    """How many variants fit on the device and in host memory, logged as one ``capacity:`` line.

    The size per variant is the largest among those read at start-up (device: as a slot holds it,
    host: as the host tier holds it); with none read, the sizes and what would fit are None.

    Args:
        asm: the ``Assembly``; cfg: its ``ServeConfig``; registered: every variant name served.
    """
    backend, read = asm.backend, asm.variants
    per_dev = max((backend.resident_estimate(v.name) for v in read), default=None)
    per_host = max((getattr(backend, "host_estimate", backend.resident_estimate)(v.name) for v in read), default=None)
    free_dev, avail = device_free_bytes(asm.device), host_available_bytes()
    out = {"variants": registered, "read_at_startup": len(read),
           "device": {"device": str(asm.device), "slots": cfg.max_deltas, "bytes_per_variant": per_dev,
                      "free_bytes": free_dev, "fits_in_free": _fits(free_dev, per_dev)},
           "host": {"slots": cfg.max_cpu_deltas, "bytes_per_variant": per_host, "available_bytes": avail,
                    "fits_in_available": _fits(avail, per_host)}}
    d, h = out["device"], out["host"]
    log.info("capacity: %d variant%s served (%d read at start-up, the others on first use); device %s: %d slots "
             "(--max-deltas) of %s per variant, %s free, room for %s; host memory: %d variants (--max-cpu-deltas) "
             "of %s each, %s available, room for %s", registered, "" if registered == 1 else "s", len(read), asm.device, cfg.max_deltas,
             _size(per_dev), _size(free_dev), _count(d["fits_in_free"]), cfg.max_cpu_deltas, _size(per_host),
             _size(avail), _count(h["fits_in_available"]))
    return out


def _fits(free: int | None, per: int | None) -> int | None:
    return None if free is None or not per else free // per


def _size(n: int | None) -> str:
    return "?" if n is None else human_bytes(n)


def _count(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: the CUDA allocator's view of the GPU, host memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes() if device.type == "cpu" else None


def host_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), else free physical pages; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
