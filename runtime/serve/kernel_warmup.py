"""Kernel tuning of a decoupled model: a few keys before ready, the rest off the engine thread.

The stacks the served variants' packed tensors go into are allocated (and their launches prepared,
``deltazip.kernels.dispatch.prepare``) when the model is built; :func:`served_stacks` lists them, read
from the manifests. The model's tuner (``deltazip.runtime.serve.kernel_tuner.Tuner``) measures the dispatcher's
choices:

- at start-up (:class:`Startup`, on its own thread while the server already answers ``/health`` with 503
  and the progress): the keys a server meets first (``tuner.first_pairs``) of every stack the CUDA kernel
  serves; the other buckets are queued for the tuner's background thread, which measures them while the
  engine is idle (or ``deltazip tune`` measures them ahead of time);
- for a variant registered later (:func:`tune_new_keys`, engine thread): every key of its new stacks is
  queued, nothing waits; the variant is served at once with the untuned default launch.

Only keys of stacks on the CUDA path are tuned (on a CPU nothing is); the tuner's ``paths`` can widen it.
"""

from __future__ import annotations

import logging
import threading
import time

from deltazip.kernels import dispatch, dispatch_table, preview
from deltazip.kernels.stacked import StackedDeltas
from deltazip.runtime.serve import kernel_tuning
from deltazip.runtime.serve.kernel_tuner import Job, first_pairs

log = logging.getLogger("deltazip.serve")


def served_stacks(model) -> list[StackedDeltas]:
    """The stacks the packed tensors of ``model``'s variants go into (allocated now if needed).

    Args:
        model: a ``deltazip.runtime.serve.model.DeltaModel``.
    """
    stacks: dict[int, StackedDeltas] = {}
    # the start-up thread reads the variants while the engine's may add or remove one: a copy of the plans,
    # made in one step, and a variant removed meanwhile is skipped
    for name, targets in list(model._targets.items()):
        v = model.variants.get(name)
        if v is None:
            continue
        for tname, where in list(targets.items()):
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


def jobs(model, pairs: list[tuple[int, int]] | None = None) -> list[Job]:
    """The keys of ``model``'s served stacks on a tuned path (``model.tuner.paths``), one stack per
    configuration: ``pairs`` of (rows, deltas), default every bucket (``kernel_tuning.buckets``)."""
    if model.delta_compute != "packed":
        return []
    out, seen = [], set()
    for stack in served_stacks(model):
        sig = dispatch_table.key(stack, model.dtype, 1, 1)
        if sig in seen or dispatch.prepare(stack, model.dtype).path not in model.tuner.paths:
            continue
        seen.add(sig)
        for r, d in kernel_tuning.buckets(stack.num_deltas) if pairs is None else pairs:
            out.append(Job(stack, model.dtype, r, d))
    return out


def warm_up_kernels(model, *, everything: bool = False) -> int:
    """Measure the first keys of every served stack now and queue the others for the background (all now
    with ``everything``: ``deltazip tune``); returns the keys measured now."""
    first = jobs(model, first_pairs(model.num_slots))
    n = model.tuner.tune_now(jobs(model) if everything else first)
    if not everything:
        model.tuner.tune_later(jobs(model))
    return n


def tune_new_keys(model) -> int:
    """Queue every untuned key of ``model``'s stacks for the tuner's background thread (a variant added
    while serving: it runs at once on the default launch); returns how many were queued."""
    n = model.tuner.tune_later(jobs(model))
    if n:
        log.info("delta-matmul tuning: %d new keys queued off the engine thread (the default launch serves them "
                 "meanwhile)", n)
    return n


def reference_lines(model) -> list[str]:
    """One line per stack configuration a GPU serves on the torch reference, naming the scheme and why,
    or on a preview kernel path (``deltazip.kernels.preview``: not yet validated on a GPU)."""
    if model.device.type != "cuda" or model.delta_compute != "packed":
        return []
    lines, on_cuda = {}, False
    for st in served_stacks(model):
        launch = dispatch.prepare(st, model.dtype)
        on_cuda |= launch.path == "cuda"
        if launch.path == "reference":
            s = st.scheme
            what = (f"{s.bits}-bit {'2:4' if s.sparse else 'dense'} groups of {st.effective_group} "
                    f"[{st.out_features}x{st.in_features}] {str(model.dtype).removeprefix('torch.')}")
            lines[what] = (f"delta matmul: {what} runs on the torch reference (correct, slower than the CUDA "
                           f"kernel): {launch.reason}")
        elif used := preview.used_by(st):
            what = f"[{st.out_features}x{st.in_features}]"
            lines[what] = (f"delta matmul: {what} runs on the CUDA kernel's preview path {', '.join(used)} "
                           f"({preview.ENV}; not yet validated by the parity tests on a GPU)")
    if on_cuda and (options := preview.launch_options()):
        lines["launch options"] = (f"delta matmul: the tuner also times the CUDA kernel's preview launch options "
                                   f"{', '.join(sorted(options))} ({preview.ENV}; not yet validated by the parity "
                                   "tests on a GPU)")
    return list(lines.values())


class Startup:
    """The start-up tuning of a model, run on its own thread once the server answers (``run``); ``done``
    is set when it finished (at once when there is nothing to tune), and :meth:`status` is what ``/health``
    answers meanwhile. ``warmup``: the dict the start-up report shows, filled in when done."""

    def __init__(self, model, warmup: dict):
        self.model, self.warmup = model, warmup
        self.done = threading.Event()
        self.error: str | None = None
        self.first = jobs(model, first_pairs(model.num_slots)) if hasattr(model, "tuner") else []
        for line in reference_lines(model) if hasattr(model, "tuner") else []:
            log.info(line)
        if not self.first:
            self.done.set()

    def status(self) -> dict:
        """What ``/health`` answers while starting: the start-up keys measured of those it waits for. Only
        the first keys count: the others, queued for the background just before start-up ends, would
        make the total grow at the last moment."""
        n = len(self.first)
        return {"status": "starting", "stage": "tuning the delta-matmul kernels",
                "keys_done": min(self.model.tuner.progress["keys_done"], n), "keys_total": n}

    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            n = warm_up_kernels(self.model)
            self.warmup.update(seconds=round(time.perf_counter() - t0, 3), launches=n,
                               background_keys=self.model.tuner.pending)
            log.info("kernel warm-up: %.3f s before ready (%d delta-matmul keys tuned for %s; %d more tuned in "
                     "the background)", self.warmup["seconds"], n, self.model.dtype, self.model.tuner.pending)
        except Exception as e:  # noqa: BLE001 - the defaults serve every key; the server must still come up
            self.error = f"{type(e).__name__}: {e}"
            log.warning("kernel tuning at start-up failed (%s); the default launches serve every key", self.error)
        finally:
            self.done.set()

    def start(self) -> None:
        """Run on a thread unless already done."""
        if not self.done.is_set():
            threading.Thread(target=self.run, daemon=True, name="deltazip-startup-tuning").start()
