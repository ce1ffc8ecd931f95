"""Start-up of ``deltazip serve``: the kernel warm-up runs before ``/health`` reports ready (with tuning,
tests/runtime/serve/test_startup_tuning.py); start-up logs one line with the warm-up's duration and one
capacity line (variants on the device and in host memory); and after ready a request to a resident
variant runs no warm-up or tuning function."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import httpx
import pytest
from _cli import cli_command
from _serving import served_set, single_thread

from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
from deltazip.runtime.serve.server import Metrics, ServerThread, create_app

WARMUP = re.compile(r"kernel warm-up: (\d+\.\d{3}) s before ready \((.+)\)$")
CAPACITY = re.compile(r"capacity: (\d+) variants? served \((\d+) read at start-up, the others on first use\); "
                      r"device (\S+): (\d+) slots \(--max-deltas\) of (.+) per variant, (.+) free, room for ([\d,]+); "
                      r"host memory: (\d+) variants \(--max-cpu-deltas\) of (.+) each, (.+) available, room for ([\d,]+)$")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with single_thread():
        yield served_set(tmp_path_factory.getbasetemp() / "serving")


def test_startup_logs_the_warmup_and_the_capacity(served, caplog):
    import logging

    from deltazip.formats.units import human_bytes

    with single_thread(), caplog.at_level(logging.INFO, logger="deltazip.serve"):
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, max_deltas=2, max_cpu_deltas=3,
                                       delta_compute="packed"))
    msgs = [r.getMessage() for r in caplog.records]
    warm = [m for m in msgs if m.startswith("kernel warm-up:")]
    cap = [m for m in msgs if m.startswith("capacity:")]
    assert len(warm) == 1 and len(cap) == 1, msgs
    w = WARMUP.match(warm[0])
    assert w, warm[0]
    assert float(w.group(1)) == pytest.approx(rt.warmup["seconds"], abs=1e-3) and rt.warmup["launches"] == 0
    assert w.group(2).startswith("nothing to compile: resident deltas are packed on cpu")
    c = CAPACITY.match(cap[0])
    assert c, cap[0]
    per_dev = max(rt.backend.resident_estimate(n) for n in ("alpha", "beta", "gamma"))
    per_host = max(rt.backend.host_estimate(n) for n in ("alpha", "beta", "gamma"))
    d, h = rt.capacity["device"], rt.capacity["host"]
    assert (rt.capacity["variants"], rt.capacity["read_at_startup"]) == (3, 3)
    assert (d["slots"], d["bytes_per_variant"], h["slots"], h["bytes_per_variant"]) == (2, per_dev, 3, per_host)
    assert d["fits_in_free"] == d["free_bytes"] // per_dev and h["fits_in_available"] == h["available_bytes"] // per_host
    assert d["free_bytes"] > 0 and h["fits_in_available"] > 3
    assert c.groups() == ("3", "3", "cpu", "2", human_bytes(per_dev), human_bytes(d["free_bytes"]),
                          f"{d['fits_in_free']:,}", "3", human_bytes(per_host), human_bytes(h["available_bytes"]),
                          f"{h['fits_in_available']:,}")
    # packed deltas on the host tier take less than the same variant dequantized in a slot would
    assert per_host < max(rt.backend._estimate(n, packed=False) for n in ("alpha", "beta", "gamma"))


def test_health_is_not_ready_before_the_warmup_is_done(served):
    """A real ``deltazip serve`` process, probed from the moment it starts: every ``/health`` answer
    comes after the warm-up and capacity lines, and a probe sent during the build waits for them."""
    lines: list[tuple[float, str]] = []
    port = _free_port()
    proc = subprocess.Popen(cli_command("serve", served.artifacts, "--port", port, "--max-deltas", "2",
                                        "--cpu-threads", "1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env())

    def read() -> None:
        for ln in proc.stderr:
            lines.append((time.monotonic(), ln.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        probes = []  # (sent, answered, status)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                status = httpx.get(url + "/health", timeout=120).status_code
            except httpx.TransportError:  # the interpreter has not bound the port yet
                status = None
                assert proc.poll() is None, "\n".join(ln for _, ln in lines)
            probes.append((sent, time.monotonic(), status))
            if status == 200:
                break
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=10)
    at = {key: next(t for t, ln in lines if key in ln) for key in ("kernel warm-up:", "capacity:")}
    assert probes[-1][2] == 200, probes
    assert all(answered > at["kernel warm-up:"] and answered > at["capacity:"]
               for _, answered, status in probes if status == 200)
    sent_early = [p for p in probes if p[0] < at["kernel warm-up:"] and p[2] is not None]
    assert sent_early, "a probe must reach the server while the model is being built"
    assert all(status == 200 for _, _, status in sent_early)  # answered, after the warm-up
    assert WARMUP.search(next(ln for _, ln in lines if "kernel warm-up:" in ln))


def _env() -> dict:
    import os

    return dict(os.environ, DELTAZIP_LOG_LEVEL="INFO", OMP_WAIT_POLICY="PASSIVE")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_warmup_or_tuning_runs_for_a_request_to_a_resident_variant(served, monkeypatch):
    """Requests after ready, to a variant already in a slot, run none of the warm-up or tuning functions
    (counted by wrapping the real functions)."""
    import deltazip.runtime.serve.kernel_tuning as kernel_tuning
    import deltazip.runtime.serve.kernel_warmup as kernel_warmup
    import deltazip.runtime.serve.model as model_mod
    from deltazip.runtime.serve.kernel_tuner import Tuner

    calls: dict[str, int] = {}

    def counted(module, name):
        real = getattr(module, name)
        key = f"{getattr(module, '__module__', module.__name__)}.{module.__name__}.{name}"
        calls[key] = 0

        def wrapper(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in ((model_mod, "tune_new_keys"), (kernel_warmup, "warm_up_kernels"), (Tuner, "tune_now"),
                         (Tuner, "tune_later"), (kernel_tuning, "tune"), (kernel_tuning, "precompile")):
        counted(module, name)
    with single_thread():
        metrics = Metrics()
        rt = build_runtime(ServeConfig(artifacts=served.artifacts, max_deltas=2, delta_compute="packed"),
                           observer=metrics)
        with ServerThread(create_app(rt, metrics)) as srv:
            first = _complete(srv.url, "alpha")  # alpha into a slot
            state = {r["id"]: r["state"] for r in httpx.get(srv.url + "/v1/variants").json()["data"]}
            before = dict(calls)
            again = [_complete(srv.url, m) for m in ("alpha", "tiny-base", "alpha")]
    assert state["alpha"] == "device"
    assert calls == before, {k: calls[k] - before[k] for k in calls}
    want = served.expected("alpha", "zip model tune", 6)
    assert first == want and again == [want, served.expected("base", "zip model tune", 6), want]


def _complete(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": "zip model tune", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_start_up_thread_reads_the_served_stacks_while_variants_come_and_go():
    """``served_stacks`` runs on the start-up tuning's thread while the engine's may add a variant (POST
    /v1/variants) or remove one: it reads a copy of each map, skips a variant removed meanwhile, and does
    not fail. Here the first stack it asks for adds one variant and removes another, as the engine would."""
    from types import SimpleNamespace

    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.runtime.serve.kernel_warmup import served_stacks

    scheme = DeltaScheme()
    entry = SimpleNamespace(kernel_ready=True, scheme=scheme)
    variant = SimpleNamespace(entries={"w": entry})
    asked = []

    def stack_for(bits, group_size, sparse, asymmetric):
        if not asked:  # the engine meanwhile: one variant committed, another removed
            model._targets["c"] = {"w": [("m", "weight")]}
            model.variants["c"] = variant
            model._targets.pop("b")
            model.variants.pop("b")
        asked.append(bits)
        return stack

    stack = object()
    model = SimpleNamespace(
        _targets={"a": {"w": [("m", "weight")]}, "b": {"w": [("m", "weight")]}},
        variants={"a": variant, "b": variant},
        modules={"m": SimpleNamespace(_store=SimpleNamespace(stack_for=stack_for))})
    assert served_stacks(model) == [stack] and asked == [scheme.bits]  # "b" was gone when its turn came
