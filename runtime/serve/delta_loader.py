"""Background loads of variants into device slots, overlapping the engine's forwards (seed 003).

Before, a step whose scheduler picked a variant that was not resident read it from disk, decoded
it and copied it into a device slot on the engine thread: every running sequence of every other
variant stalled for the whole load. Here one loader thread does the slow part of a load while
steps go on:

1. **host**: the variant is read and decoded into host memory (``TieredCache.host_get``: a hit in
   the host LRU, or the cache's disk thread; on CUDA machines the host tier is pinned memory);
2. **stage** (``backend.stage_slot``): everything of the slot write but the final copy. On CUDA the
   variant's tensors are copied from that pinned memory into fresh device buffers on a side CUDA
   stream, and the thread waits for the copy's event — the ping-pong of seed 003: the copy of one
   variant runs while the compute stream works on the others. Where slots keep deltas dequantized
   (the CPU default) the packed deltas are dequantized here.

The slot write itself (``TieredCache.install`` -> ``backend.write_slot``) stays on the engine thread
between two forwards, after the compute stream has waited on the staging event: it copies staged
memory into the slot's stacks (device-to-device on a GPU, ~100x faster than the host link; a
memcpy on CPU) and updates the modules' slot tables. So a slot being written is never read by a
forward, and a slot is never evicted while a step uses it (``install`` protects the running
variants' slots).

The engine asks :meth:`DeltaLoader.state` from its scheduler's ``ready`` hook: requests of a
variant whose load is in flight wait (their variant keeps a slot reserved) while sequences of
resident variants keep decoding; the step after the load completes admits them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deltazip.runtime.serve.delta_cache import TieredCache


@dataclass
class Staged:
    """A loaded variant waiting for its slot write.

    Attributes:
        obj: what ``write_slot`` takes (device tensors on CUDA, the host object on CPU).
        event: CUDA event recorded on the side stream after the copies (None on CPU).
    """

    name: str
    obj: Any
    event: Any


class DeltaLoader:
    """One background thread that loads variants up to the point where only the slot write is left.

    Args:
        cache: the engine's tiered cache (host tier and device slots).
        stage: ``host_obj -> staged_obj``, run on the loader thread inside the side stream (None:
            the host object is written as it is).
        device: the serving device; a side stream is created on CUDA.
        on_done: called (loader thread) when a load finishes or fails, to wake the engine.
    """

    def __init__(self, cache: TieredCache, stage: Callable[[Any], Any] | None, device: torch.device,
                 on_done: Callable[[], None] | None = None):
        self.cache, self._stage, self.device = cache, stage, torch.device(device)
        self._on_done = on_done
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltazip-slot-loader")
        self._lock = threading.Lock()
        self._jobs: dict[str, Future] = {}

    # -- engine thread ----------------------------------------------------------------------------
    def start(self, name: str) -> None:
        """Begin loading ``name`` unless a load of it is already in flight or finished."""
        with self._lock:
            if name in self._jobs:
                return
            fut = self._jobs[name] = self._executor.submit(self._run, name)
        if self._on_done is not None:  # outside the lock: it may run at once, in this thread
            fut.add_done_callback(lambda _f: self._on_done())

    def state(self, name: str) -> str:
        """``idle`` (no load), ``loading``, ``ready`` (staged, waiting for its slot) or ``failed``."""
        with self._lock:
            fut = self._jobs.get(name)
        if fut is None:
            return "idle"
        if not fut.done():
            return "loading"
        return "failed" if fut.cancelled() or fut.exception() is not None else "ready"

    def busy(self) -> bool:
        """Some load is still in flight."""
        with self._lock:
            return any(not f.done() for f in self._jobs.values())

    def in_flight(self) -> list[str]:
        """Variants whose load is running or queued."""
        with self._lock:
            return [n for n, f in self._jobs.items() if not f.done()]

    def finished(self) -> list[str]:
        """Variants whose load is done (staged or failed) and not dropped yet."""
        with self._lock:
            return [n for n, f in self._jobs.items() if f.done()]

    def peek(self, name: str) -> Staged:
        """The finished load of ``name`` (re-raises its error); it stays until :meth:`drop`."""
        with self._lock:
            fut = self._jobs[name]
        return fut.result()

    def drop(self, name: str) -> None:
        """Forget the load of ``name`` (installed, failed, or its variant unloaded).

        A load still running finishes on its own and is discarded (its copies are complete when it
        ends); a staged one's event is waited for anyway before its buffers go back to the allocator.
        """
        with self._lock:
            fut = self._jobs.pop(name, None)
        if fut is None:
            return
        if not fut.done():
            fut.cancel()
            return
        staged = fut.result() if fut.exception() is None else None
        if staged is not None and staged.event is not None:
            staged.event.synchronize()

    def adopt(self, staged: Staged) -> None:
        """Make the current (compute) stream wait for ``staged``'s copies and own its device buffers
        (engine thread, right before the slot write).

        The buffers were allocated on the side stream; ``record_stream`` stops the caching allocator
        from handing them to the side stream again while compute kernels queued now still read them.
        """
        if staged.event is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.event)
        for t in device_tensors(staged.obj):
            t.record_stream(stream)

    def failures(self) -> dict[str, BaseException]:
        """Loads that raised, by variant."""
        with self._lock:
            done = [(n, f) for n, f in self._jobs.items() if f.done() and not f.cancelled()]
        return {n: f.exception() for n, f in done if f.exception() is not None}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- loader thread ----------------------------------------------------------------------------
    def _run(self, name: str) -> Staged:
        host = self.cache.host_get(name)  # disk read + decode, or a host-tier hit
        if self._stage is None:
            return Staged(name, host, None)
        if self._stream is None:  # CPU: the staging work (e.g. dequantizing) still leaves the engine thread
            return Staged(name, self._stage(host), None)
        with torch.cuda.stream(self._stream):
            obj = self._stage(host)
            event = torch.cuda.Event()
            event.record(self._stream)
        # Wait here, not on the engine thread: "ready" then means the copy is complete.
        event.synchronize()
        return Staged(name, obj, event)


def device_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every CUDA tensor reachable from ``obj`` (dicts, lists, dataclasses, ``.modules`` holders)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from device_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from device_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from device_tensors(getattr(obj, f.name))
