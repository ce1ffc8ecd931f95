"""Tiered cache of variants: device slots <- host memory (LRU) <- disk.

Seeds 001 §5.4 ("hierarchical management") and 002 (device / host / disk tiers):

- **device**: ``num_slots`` slots (``--max-deltas``); a slot holds one variant in the form the
  forward reads (stacked packed deltas for the decoupled model, a whole model in swap mode).
  Slots are written only by the engine thread, between forwards.
- **host**: an LRU of up to ``max_cpu`` decoded variants (``--max-cpu-deltas``; pinned memory on
  CUDA machines so host->device copies are asynchronous DMA). 0 keeps nothing: every device load
  reads the disk.
- **disk**: the artifact directories. Decoding (checksums, lossless stage, unpacking) happens on
  the way to the host tier, in one background thread: ``prefetch`` queues the variants that waiting
  requests need, so that by the time the scheduler selects them only the host->device copy is left.

All disk loads run on that one thread (a synchronous ``host_get`` waits for its future), so the
loader callables never run concurrently. Every load is timed per variant and tier; ``stats``
returns the numbers the server exports as metrics.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class VariantLoadStats:
    """Load counters and times of one variant (seconds)."""

    disk_loads: int = 0
    disk_seconds_last: float = 0.0
    disk_seconds_total: float = 0.0
    device_loads: int = 0
    device_seconds_last: float = 0.0
    device_seconds_total: float = 0.0
    host_hits: int = 0
    device_hits: int = 0
    host_bytes: int = 0


class SlotsExhausted(RuntimeError):
    """More variants asked for at once than there are device slots (a scheduler bug if it happens)."""


class TieredCache:
    """Device slots, host LRU and disk for a set of named variants.

    Args:
        load_host: ``name -> obj``: read and decode a variant from disk into host memory (runs on the
            loader thread). ``obj`` may expose ``nbytes()``.
        write_device: ``(slot, name, obj) -> None``: copy a host object into a device slot (engine
            thread).
        clear_device: ``slot -> None``: forget what a slot holds.
        num_slots: device slots (>= 1).
        max_cpu: host LRU capacity in variants (>= 0).
    """

    def __init__(self, load_host: Callable[[str], Any], write_device: Callable[[int, str, Any], None],
                 clear_device: Callable[[int], None], num_slots: int, max_cpu: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_cpu < 0:
            raise ValueError(f"max_cpu must be >= 0, got {max_cpu}")
        self._load_host, self._write_device, self._clear_device = load_host, write_device, clear_device
        self.num_slots, self.max_cpu = num_slots, max_cpu
        self._lock = threading.Lock()
        self._host: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._dropped: set[str] = set()  # evicted while a load was pending: that load is not kept
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltazip-delta-loader")
        self.slots: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        self._slot_tick = [0] * num_slots
        self._tick = 0
        self.stats: dict[str, VariantLoadStats] = {}

    # -- host tier (any thread) -----------------------------------------------------------------
    def _stat(self, name: str) -> VariantLoadStats:
        # the loader and the engine threads both count (setdefault: one entry per name, in one step)
        st = self.stats.get(name)
        return st if st is not None else self.stats.setdefault(name, VariantLoadStats())

    def load_stats(self) -> dict[str, dict]:
        """Each variant's load counters as plain dicts, read while the loader may add entries (``/metrics``)."""
        return {k: vars(v).copy() for k, v in list(self.stats.items())}

    def _load(self, name: str) -> Any:
        t0 = time.perf_counter()
        try:
            obj = self._load_host(name)
        except BaseException:
            with self._lock:
                self._pending.pop(name, None)
            raise
        dt = time.perf_counter() - t0
        nbytes = obj.nbytes() if hasattr(obj, "nbytes") else 0
        with self._lock:
            # Leaving "pending" and entering the LRU under one lock: no reader sees neither.
            self._pending.pop(name, None)
            if name in self._dropped:  # the variant was unloaded meanwhile
                self._dropped.discard(name)
                return obj
            st = self._stat(name)
            st.disk_loads += 1
            st.disk_seconds_last = dt
            st.disk_seconds_total += dt
            st.host_bytes = nbytes
            if self.max_cpu > 0:
                self._host[name] = obj
                self._host.move_to_end(name)
                while len(self._host) > self.max_cpu:
                    self._host.popitem(last=False)
        return obj

    def _future(self, name: str) -> Future:
        """The pending load of ``name``, started if none is (caller holds the lock)."""
        fut = self._pending.get(name)
        if fut is None:
            fut = self._executor.submit(self._load, name)
            self._pending[name] = fut
        return fut

    def prefetch(self, names: Iterable[str]) -> None:
        """Start loading into host memory the variants that waiting requests need (no waiting).

        At most ``max_cpu`` are queued, oldest need first, so that prefetching never evicts a
        variant it just fetched; with ``max_cpu == 0`` there is nowhere to keep them and nothing is
        prefetched.
        """
        with self._lock:
            room = self.max_cpu
            for n in dict.fromkeys(names):
                if room <= 0:
                    break
                room -= 1
                if n in self._host or n in self._pending or n in self._slot_of:
                    continue
                self._future(n)

    def host_get(self, name: str) -> Any:
        """The decoded variant, from the host LRU or loaded from disk now (blocks until loaded)."""
        with self._lock:
            obj = self._host.get(name)
            if obj is not None:
                self._host.move_to_end(name)
                self._stat(name).host_hits += 1
                return obj
            fut = self._future(name)
        return fut.result()

    def on_host(self) -> list[str]:
        with self._lock:
            return list(self._host)

    # -- device tier (engine thread only) -------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def ensure(self, names: Iterable[str], keep: Iterable[str] = ()) -> dict[str, int]:
        """Make every variant in ``names`` resident; returns ``name -> slot``.

        Slots holding ``names`` or ``keep`` are never evicted; others are reused least recently used
        first (empty slots before any).
        """
        names = list(dict.fromkeys(names))
        protect = set(names) | set(keep)
        out: dict[str, int] = {}
        self._tick += 1
        missing = []
        for n in names:
            s = self._slot_of.get(n)
            if s is None:
                missing.append(n)
            else:
                out[n] = s
                self._slot_tick[s] = self._tick
                self._stat(n).device_hits += 1
        if not missing:
            return out
        free = self._evictable(protect)
        if len(free) < len(missing):
            raise SlotsExhausted(f"{len(missing)} variants need a device slot but only {len(free)} of "
                                 f"{self.num_slots} can be freed")
        for n, s in zip(missing, free):
            self._write(s, n, self.host_get(n))
            out[n] = s
        return out

    def _evictable(self, protect: set[str]) -> list[int]:
        """Slots that may take a new variant: empty ones first, then least recently used."""
        free = [s for s in range(self.num_slots) if self.slots[s] is None]
        return free + sorted((s for s in range(self.num_slots) if self.slots[s] is not None
                              and self.slots[s] not in protect), key=lambda s: self._slot_tick[s])

    def _write(self, s: int, name: str, obj: Any) -> None:
        old = self.slots[s]
        if old is not None:
            del self._slot_of[old]
            self.slots[s] = None
            self._clear_device(s)
        t0 = time.perf_counter()
        self._write_device(s, name, obj)
        dt = time.perf_counter() - t0
        self.slots[s], self._slot_of[name], self._slot_tick[s] = name, s, self._tick
        st = self._stat(name)
        st.device_loads += 1
        st.device_seconds_last = dt
        st.device_seconds_total += dt

    def install(self, name: str, obj: Any, protect: Iterable[str] = ()) -> int | None:
        """Write an already loaded (and, on CUDA, staged) variant into a slot; returns the slot, or
        None when every slot holds a variant in ``protect`` (try again after some finish).

        Engine thread, between forwards: the slot chosen is empty or holds a variant no running
        request uses, so no forward reads it while it is written.
        """
        s = self._slot_of.get(name)
        if s is not None:
            return s
        free = self._evictable(set(protect))
        if not free:
            return None
        self._tick += 1
        self._write(free[0], name, obj)
        return free[0]

    def evict(self, name: str) -> None:
        """Drop ``name`` from every tier (engine thread): its device slot is cleared, its host copy
        forgotten, and a load in flight is discarded when it lands. Its load stats go too."""
        s = self._slot_of.pop(name, None)
        if s is not None:
            self.slots[s] = None
            self._clear_device(s)
        with self._lock:
            self._host.pop(name, None)
            if name in self._pending:
                self._dropped.add(name)
            self.stats.pop(name, None)

    def state(self, name: str) -> str:
        """Where ``name`` is: ``device``, ``host``, ``loading`` (disk to host in flight) or ``disk``."""
        if name in self._slot_of:
            return "device"
        with self._lock:
            if name in self._host:
                return "host"
            return "loading" if name in self._pending else "disk"

    def host_object(self, name: str) -> Any:
        """The host tier's object of ``name`` without touching the LRU order (None when not there)."""
        with self._lock:
            return self._host.get(name)

    def resident(self) -> list[str]:
        """Variants in device slots, by slot."""
        return [n for n in self.slots if n is not None]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
