"""Start-up a user can deploy: while the delta-matmul kernels are tuned, ``/health`` answers 503 with the
progress; a variant registered after start runs at once on the default launch while its keys are tuned on
the tuner's thread, never the engine's.

Tuning only happens on CUDA; here the model's tuner (a component of the dispatcher, handed in through
``ServeConfig.tuner``) measures with a real slow callable instead of the GPU timer, and tunes the stacks
the reference serves on a CPU (``paths``). Everything else is the real server on a loopback port."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest
from _serving import served_set, single_thread

from deltazip.kernels.dispatch_table import Choice
from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.kernel_tuner import Tuner
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

SECONDS_PER_KEY = 0.25


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


class SlowMeasure:
    """Takes SECONDS_PER_KEY per key, as a GPU timing would take its time; records the thread and key."""

    def __init__(self):
        self.calls: list[tuple[str, str, int, int]] = []

    def __call__(self, stack, dtype, rows, deltas):
        time.sleep(SECONDS_PER_KEY)
        self.calls.append((threading.current_thread().name, f"b{stack.bits}/{stack.in_features}x{stack.out_features}",
                           rows, deltas))
        return Choice("cuda")


def test_health_answers_starting_while_tuning_and_a_late_variant_is_served_while_its_keys_are_tuned(served,
                                                                                                     tmp_path):
    arts = tmp_path / "arts"
    shutil.copytree(served.variant_dir("alpha"), arts / "alpha")  # 4-bit 2:4: read at start-up
    shutil.copytree(served.variant_dir("beta"), arts / "beta")  # 2-bit dense: read on its first request
    measure = SlowMeasure()
    tuner = Tuner(measure=measure, paths=("cuda", "reference"))
    metrics = Metrics()
    with single_thread():
        rt = build_runtime(ServeConfig(artifacts=arts, max_deltas=1, max_cpu_deltas=1, delta_compute="packed",
                                       tuner=tuner), observer=metrics)
        first = len(rt.startup.first)
        assert first >= 2 and not rt.startup.done.is_set()  # the first keys of alpha's stacks, not tuned yet
        with ServerThread(create_app(rt, metrics)) as srv:
            polls = []
            while True:
                r = httpx.get(srv.url + "/health", timeout=10)
                polls.append((r.status_code, r.json()))
                if r.status_code == 200:
                    break
                time.sleep(0.05)
            starting = [b for c, b in polls if c == 503]
            assert starting and all(b["status"] == "starting" and b["keys_total"] == first for b in starting)
            assert [b["keys_done"] for b in starting] == sorted(b["keys_done"] for b in starting)
            # the keys queued for the background at the end of start-up do not change the start-up total
            assert tuner.progress["keys_total"] > first and rt.startup.status()["keys_total"] == first
            assert polls[-1][1]["status"] == "ok"
            assert len(polls) >= first * SECONDS_PER_KEY / 0.3  # it answered all along the slow start
            at_ready = len(measure.calls)
            assert at_ready >= first
            assert {t for t, *_ in measure.calls[:first]} == {"deltazip-startup-tuning"}
            assert tuner.pending > 0  # the other buckets are left to the background
            # beta: a new stack configuration (2 bits) registered on its first request
            t0 = time.perf_counter()
            r = httpx.post(srv.url + "/v1/completions", timeout=120,
                           json={"model": "beta", "prompt": "zip model tune", "max_tokens": 6, "temperature": 0})
            took = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == served.expected("beta", "zip model tune", 6)
            beta_keys_left = tuner.pending
            assert beta_keys_left * SECONDS_PER_KEY > took  # answered before its keys could have been tuned
            assert tuner.wait(timeout=120)
    tuner.close()
    threads = {t for t, *_ in measure.calls}
    assert threads == {"deltazip-startup-tuning", "deltazip-tuner"}  # never the engine thread
    assert any(k.startswith("b2/") for _, k, _, _ in measure.calls[at_ready:])  # beta's keys, off the engine thread
    keys = [(k, r, d) for _, k, r, d in measure.calls]
    assert len(keys) == len(set(keys))  # each key measured once
