"""The tuner's background thread measures only while its ``idle`` gate says the engine has nothing to
run, and a served runtime wires that gate to its engine (tuning on a GPU competes with requests for
the same SMs and would time them too)."""

from __future__ import annotations

import threading
import time

import torch

from deltazip.kernels.dispatch_table import Choice
from deltazip.kernels.scheme import DeltaScheme
from deltazip.kernels.stacked import StackedDeltas
from deltazip.runtime.serve.kernel_tuner import Job, Tuner


def _stack(bits: int) -> StackedDeltas:
    return StackedDeltas.allocate(2, DeltaScheme(bits=bits, group_size=128, sparsity="2:4", sym=True),
                                  in_features=256, out_features=128, layout="mma")


def test_background_keys_wait_while_the_engine_is_busy():
    measured: list[float] = []
    busy = threading.Event()
    busy.set()

    def measure(stack, dtype, rows, deltas):
        measured.append(time.monotonic())
        return Choice("cuda")

    tuner = Tuner(measure=measure, idle=lambda: not busy.is_set())
    jobs = [Job(_stack(4), torch.float16, r, d) for r, d in ((1, 1), (2, 2), (4, 4))]
    assert tuner.tune_later(jobs) == 3
    time.sleep(0.5)
    assert measured == [] and tuner.pending == 3  # nothing measured while the engine runs requests
    freed = time.monotonic()
    busy.clear()
    assert tuner.wait(timeout=10)
    assert len(measured) == 3 and min(measured) >= freed
    tuner.close()


def test_a_served_runtime_gates_its_tuner_on_its_engine(tmp_path):
    """build_runtime hands the engine's ``idle`` to the model's tuner: False while a request is in the
    engine, True before and after."""
    import httpx
    from _serving import served_set, single_thread

    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

    with single_thread():
        served = served_set(tmp_path / "serving")
        tuner = Tuner(measure=lambda *a: Choice("cuda"))
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, max_deltas=1, max_cpu_deltas=1, tuner=tuner),
                           observer=Metrics())
        assert tuner.idle == rt.engine.idle
        with ServerThread(create_app(rt, Metrics())) as srv:
            rt.startup.done.wait(60)
            assert rt.engine.idle()
            seen = []
            stop = threading.Event()

            def watch():
                while not stop.is_set():
                    seen.append(rt.engine.idle())
                    time.sleep(0.002)

            w = threading.Thread(target=watch)
            w.start()
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"model": "alpha", "prompt": "zip the model", "max_tokens": 24, "temperature": 0})
            stop.set()
            w.join()
            assert r.status_code == 200, r.text
            assert False in seen  # busy while the request ran
            assert rt.engine.idle()


def test_the_start_up_and_background_threads_never_measure_at_once():
    """Start-up tuning (``tune_now``) and the background thread share one GPU: timing two kernels at once
    would time neither. One key is measured at a time, whichever thread measures it."""
    inside, most, lock = [0], [0], threading.Lock()

    def measure(stack, dtype, rows, deltas):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        with lock:
            inside[0] -= 1
        return Choice("cuda")

    tuner = Tuner(measure=measure)
    assert tuner.tune_later([Job(_stack(4), torch.float16, r, d) for r, d in ((1, 1), (2, 2), (4, 4))]) == 3
    assert tuner.tune_now([Job(_stack(2), torch.float16, r, d) for r, d in ((1, 1), (2, 2), (4, 4))]) == 3
    assert tuner.wait(timeout=10)
    assert most[0] == 1 and tuner.progress["keys_done"] == 6
    tuner.close()


def test_keys_queued_from_several_threads_at_once_start_one_background_thread(monkeypatch):
    """The start-up thread and the engine's may queue the first keys together: one background thread
    measures them (two would time kernels at once, and ``close`` stops one). The tuner's thread is slow
    to make here, so that every queuing thread reaches the check while the first is making it."""
    real = threading.Thread

    class SlowToMake(real):
        def __init__(self, *a, **k):
            if k.get("name") == "deltazip-tuner":
                time.sleep(0.05)
            super().__init__(*a, **k)

    def measure(stack, dtype, rows, deltas):
        time.sleep(0.01)
        return Choice("cuda")

    before = set(threading.enumerate())
    tuner = Tuner(measure=measure)
    jobs = [Job(_stack(b), dt, 1, 1) for b, dt in [(2, torch.float16), (4, torch.float16), (2, torch.bfloat16),
                                                    (4, torch.bfloat16)]]
    barrier = threading.Barrier(len(jobs))

    def queue(j):
        barrier.wait()
        tuner.tune_later([j])

    threads = [real(target=queue, args=(j,)) for j in jobs]
    monkeypatch.setattr(threading, "Thread", SlowToMake)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    started = [t for t in threading.enumerate() if t.name == "deltazip-tuner" and t not in before]
    assert tuner.wait(timeout=10) and tuner.progress["keys_done"] == 4
    for _ in started:
        tuner._queue.put(None)
    assert len(started) == 1, started
