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
