"""Tensor dedup of the served models: the base and every variant share identical tensors.

Every tensor the server keeps (the base's parameters, a variant's decoded tensors on the host, the
tensors a device slot references) is handed out by one
:class:`~deltazip.runtime.share.dedup_registry.TensorDedupRegistry` in weak mode: a tensor bit-identical to
one already held on the same device is not stored again, and a tensor nobody references any more
(a variant evicted from the host LRU, unloaded, or cleared from its slot) is freed.

Two kinds of savings are counted by :class:`DedupLedger`:

- *same as base*: a full-checkpoint variant's tensors whose bytes equal the base's tensor of the
  same name (found from the safetensors bytes at registration, see
  ``deltazip.runtime.serve.variant_sources``); they are never read from disk at all;
- *registry hits*: tensors a variant load asked the registry for and got an already held one
  (another variant's copy, or the base's under another name).

All sizes are bytes of the tensor in the dtype the server holds it in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from deltazip.runtime.share.dedup_registry import TORCH_TO_ST, TensorDedupRegistry


def new_serving_registry() -> TensorDedupRegistry:
    """The registry a server uses: weak references, so unloading a variant frees its tensors."""
    return TensorDedupRegistry(weak=True)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def share_tensor(registry: TensorDedupRegistry, t: torch.Tensor,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, bool]:
    """The registry's read-only copy of ``t`` on ``device`` (default: ``t``'s own device).

    ``t`` must be memory the caller owns (freshly loaded, nobody else writes it): on a miss the
    registry keeps ``t`` itself when it already lives on ``device`` (no copy), otherwise one copy
    to the device. The fingerprint is taken from the host bytes, before any device copy.

    Returns:
        (tensor, reused): reused is True when an identical tensor was already held (nothing
        allocated).
    """
    dev = torch.device(device) if device is not None else t.device
    with DisableTorchFunctionSubclass():
        src = t.detach().contiguous()
        host = src if src.device.type == "cpu" else src.cpu()
        raw = memoryview(torch.Tensor.numpy(host.reshape(-1).view(torch.uint8))) if host.numel() else memoryview(b"")
    return registry.acquire_bytes(raw, TORCH_TO_ST[t.dtype], tuple(t.shape), device=dev, build=lambda: src)


def share_parameters(model: nn.Module, registry: TensorDedupRegistry) -> tuple[list[torch.Tensor], int, int]:
    """Route every parameter of ``model`` through the registry, in place (tied parameters stay tied).

    Each parameter becomes a read-only ``nn.Parameter`` (``requires_grad=False``) over the
    registry's tensor. The model's own memory is kept when it is new to the registry, so nothing
    is copied; an identical tensor already held replaces it (and the model's copy is freed).

    Returns:
        (held, new_bytes, reused_bytes): ``held`` are the registry tensors; keep them referenced
        as long as the model lives (in weak mode the registry forgets tensors nobody holds, and an
        ``nn.Parameter`` wrapper is a different object).
    """
    replaced: dict[int, nn.Parameter] = {}
    held: list[torch.Tensor] = []
    new_bytes = reused_bytes = 0
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in replaced:
                t, reused = share_tensor(registry, p.data, p.device)
                held.append(t)
                if reused:
                    reused_bytes += tensor_nbytes(t)
                else:
                    new_bytes += tensor_nbytes(t)
                replaced[id(p)] = nn.Parameter(t, requires_grad=False)
            mod._parameters[pname] = replaced[id(p)]
    return held, new_bytes, reused_bytes


@dataclass
class VariantDedup:
    """Dedup figures of one variant (bytes).

    same_as_base: tensors equal to the base's and served from it (never loaded);
    shared: tensors of its latest host load answered by the registry with a held tensor;
    added: tensors of its latest host load the registry had to store.
    """

    same_as_base: int = 0
    shared: int = 0
    added: int = 0

    @property
    def saved(self) -> int:
        return self.same_as_base + self.shared


class DedupLedger:
    """Per-variant dedup figures, written by the loader thread and read by the HTTP thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_variant: dict[str, VariantDedup] = {}
        self.base_new_bytes = 0
        self.base_reused_bytes = 0

    def set_same_as_base(self, variant: str, nbytes: int) -> None:
        with self._lock:
            self._by_variant.setdefault(variant, VariantDedup()).same_as_base = nbytes

    def record_load(self, variant: str, shared: int, added: int) -> None:
        """The figures of a fresh host load of ``variant`` (replacing those of an earlier load)."""
        with self._lock:
            d = self._by_variant.setdefault(variant, VariantDedup())
            d.shared, d.added = shared, added

    def forget(self, variant: str) -> None:
        with self._lock:
            self._by_variant.pop(variant, None)

    def get(self, variant: str) -> VariantDedup:
        with self._lock:
            d = self._by_variant.get(variant)
            return VariantDedup(d.same_as_base, d.shared, d.added) if d else VariantDedup()

    def snapshot(self) -> dict[str, VariantDedup]:
        with self._lock:
            return {k: VariantDedup(v.same_as_base, v.shared, v.added) for k, v in self._by_variant.items()}

    def bytes_saved(self) -> int:
        """Total bytes not stored thanks to dedup: the base's internal duplicates plus every variant's."""
        with self._lock:
            return self.base_reused_bytes + sum(v.saved for v in self._by_variant.values())


class LoadTally:
    """Counts one variant load's registry answers (``share`` wraps :func:`share_tensor`)."""

    def __init__(self, registry: TensorDedupRegistry, device: torch.device | str | None = None):
        self.registry, self.device = registry, device
        self.shared = 0
        self.added = 0

    def share(self, t: torch.Tensor) -> torch.Tensor:
        out, reused = share_tensor(self.registry, t, self.device)
        self._count(out, reused)
        return out

    def share_raw(self, raw, st_dtype: str, shape, pin_memory: bool = False) -> torch.Tensor:
        """Like :meth:`share` for a tensor given as its file bytes (a safetensors view): the lookup
        runs on the bytes, so a tensor already held is never even copied out of the file."""
        out, reused = self.registry.acquire_bytes(raw, st_dtype, shape, device=self.device, pin_memory=pin_memory)
        self._count(out, reused)
        return out

    def _count(self, t: torch.Tensor, reused: bool) -> None:
        if reused:
            self.shared += tensor_nbytes(t)
        else:
            self.added += tensor_nbytes(t)
