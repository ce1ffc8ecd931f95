"""When the delta matmul's dispatcher (``deltazip.kernels.dispatch_table``) measures its choices: a few keys before a server reports ready, the others on a
background thread (a variant registered late, the keys a start-up left, ``deltazip tune`` ahead of time).

A key is one stack configuration, activation dtype and (rows, deltas) bucket (``dispatch_table.key``).
:class:`Tuner` holds the measuring function (by default ``kernel_tuning.tune`` on the GPU: compile, check
and time every candidate; a test hands in another real callable) and reports its progress; until a key is
measured, the prepared launches run it with the untuned default (``dispatch_table.default_choice``), and
when it is, ``dispatch_table.changed`` makes them pick the measured choice up at their next call.

Grouped LoRA's path choice (``deltazip.kernels.grouped_lora``) goes through the same thread: a request
that meets an unmeasured LoRA key hands it over (:class:`LoraJob`, queued by ``DeltaContext.defer_lora``)
and runs on ``grouped_lora.default_path`` until it is measured.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltazip.kernels import dispatch_table, grouped_lora
from deltazip.kernels.stacked import StackedDeltas
from deltazip.runtime.serve import kernel_tuning

log = logging.getLogger("deltazip.kernels")

# The buckets a server meets first: decode steps of a few rows, each on its own variant, and one prompt's
# prefill chunk. The others (kernel_tuning.buckets) are left to the background or to `deltazip tune`.
FIRST_PAIRS = ((1, 1), (2, 2), (4, 4), (8, 8), (512, 1))


@dataclass(frozen=True)
class Job:
    """One key to measure: a stack (its configuration), the activation dtype and a (rows, deltas) bucket."""

    stack: StackedDeltas
    dtype: torch.dtype
    rows: int
    deltas: int

    @property
    def key(self) -> str:
        return dispatch_table.key(self.stack, self.dtype, self.rows, self.deltas)

    def measured(self) -> bool:
        return self.key in dispatch_table.table_for(self.stack.device).entries

    def run(self, measure: Callable) -> None:
        measure(self.stack, self.dtype, self.rows, self.deltas)

    @property
    def table_device(self) -> torch.device | None:
        """Where the measured choice is saved (the dispatch table of the stack's GPU)."""
        return self.stack.device if self.stack.device.type == "cuda" else None


@dataclass(frozen=True)
class LoraJob:
    """One grouped-LoRA key to measure (``grouped_lora.Shape``), met by a request and deferred to the
    tuner (``DeltaContext.defer_lora``); its choice lives in the process (``grouped_lora.CHOICES``)."""

    shape: grouped_lora.Shape

    @property
    def key(self) -> tuple:
        return self.shape.key

    def measured(self) -> bool:
        return self.key in grouped_lora.CHOICES

    def run(self, measure: Callable) -> None:  # the tuner's SBMM measure does not apply
        grouped_lora.measure_shape(self.shape)

    table_device = None  # the choice lives in the process


def first_pairs(num_slots: int) -> list[tuple[int, int]]:
    """:data:`FIRST_PAIRS` that a server of ``num_slots`` slots can meet."""
    return [(r, d) for r, d in FIRST_PAIRS if d <= num_slots]


def precompile(jobs: list[Job | LoraJob]) -> int:
    """Compile, in parallel threads, every kernel build the candidates of these jobs' GPU keys launch
    (``kernel_tuning.precompile``), so that measuring them compiles nothing: on a cold cache, measuring
    keys one after another compiled some 20 builds one at a time. Returns how many were compiled."""
    groups: dict[tuple, list[Job]] = {}
    for j in jobs:
        if isinstance(j, Job) and j.stack.device.type == "cuda":
            groups.setdefault((id(j.stack), j.dtype), []).append(j)
    return sum(kernel_tuning.precompile(js[0].stack, js[0].dtype, [(j.rows, j.deltas) for j in js])
               for js in groups.values())


class Tuner:
    """Measures keys now (:meth:`tune_now`, with :attr:`progress`) or on its own thread (:meth:`tune_later`).

    Args:
        measure: ``(stack, dtype, rows, deltas) -> Choice``, the measurement of one key (default: the GPU
            tuner, ``kernel_tuning.tune`` without saving; the table is saved after each batch).
        idle: ``() -> bool``: the background thread measures only while it answers True (a server's
            engine with nothing to run), so that tuning does not compete with requests.
        paths: the prepared paths whose stacks are tuned (the CUDA kernel's; a test may widen it).
    """

    def __init__(self, measure: Callable | None = None, idle: Callable[[], bool] | None = None,
                 paths: tuple[str, ...] = ("cuda",)):
        self.measure = measure or (lambda st, dt, r, d: kernel_tuning.tune(st, dt, r, d, save=False))
        self.idle, self.paths = idle, paths
        self.progress = {"keys_done": 0, "keys_total": 0}
        self.done_keys: set[str] = set()
        self._claimed: set[str] = set()  # keys measured, being measured or queued
        self._queue: queue.Queue[Job | LoraJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._busy = 0
        self._lock = threading.Lock()
        # one measurement at a time: the start-up thread's tune_now and the background thread would
        # otherwise time kernels on one GPU at once, and save one table from two threads
        self._measuring = threading.Lock()

    def _untuned(self, jobs: list[Job | LoraJob]) -> list[Job | LoraJob]:
        """The jobs of keys neither in the table nor claimed yet, claimed now (each key is measured once)."""
        out = []
        with self._lock:
            for j in jobs:
                k = j.key
                if k not in self._claimed and not j.measured():
                    self._claimed.add(k)
                    out.append(j)
        return out

    def _run(self, job: Job | LoraJob) -> None:
        with self._measuring:
            job.run(self.measure)
        self.done_keys.add(job.key)
        with self._lock:
            self.progress["keys_done"] += 1

    def tune_now(self, jobs: list[Job | LoraJob]) -> int:
        """Measure every untuned key of ``jobs`` on this thread; returns how many were measured."""
        todo = self._untuned(jobs)
        with self._lock:
            self.progress["keys_total"] += len(todo)
        t0 = time.perf_counter()
        compiled = precompile(todo)
        for j in todo:
            self._run(j)
        if todo:
            self._save(todo)
            log.info("tuned %d delta-matmul keys in %.1f s (%d kernel builds compiled first, in parallel)", len(todo),
                     time.perf_counter() - t0, compiled)
        return len(todo)

    def tune_later(self, jobs: list[Job | LoraJob]) -> int:
        """Queue the untuned keys of ``jobs`` for the background thread (started on first use); returns
        how many were queued. Nothing waits for them."""
        todo = self._untuned(jobs)
        with self._lock:
            self.progress["keys_total"] += len(todo)
            self._busy += len(todo)
        for j in todo:
            self._queue.put(j)
        with self._lock:  # the start-up thread and the engine's may both queue the first keys
            if todo and self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="deltazip-tuner")
                self._thread.start()
        return len(todo)

    @property
    def pending(self) -> int:
        """Keys queued or being measured on the background thread."""
        return self._busy

    def wait(self, timeout: float) -> bool:
        """Block until the background thread has nothing left (True) or ``timeout`` seconds pass."""
        end = time.monotonic() + timeout
        while self._busy and time.monotonic() < end:
            time.sleep(0.01)
        return not self._busy

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            while self.idle is not None and not self.idle():
                time.sleep(0.02)
            try:
                self._run(job)
                self._save([job])
            except Exception as e:  # noqa: BLE001 - a failed key keeps its default; the server goes on
                log.warning("tuning %s failed (%s: %s); it keeps the default launch", job.key, type(e).__name__, e)
            finally:
                with self._lock:
                    self._busy -= 1

    def _save(self, jobs: list[Job | LoraJob]) -> None:
        with self._measuring:
            for dev in {j.table_device for j in jobs} - {None}:
                dispatch_table.table_for(dev).save()

    def close(self) -> None:
        """Stop the background thread after the key it is measuring."""
        if self._thread is not None:
            self._queue.put(None)
