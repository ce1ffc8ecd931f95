"""``deltazip serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints: ``GET /v1/models`` (the base and every variant, variants with ``parent`` = the base),
``GET /v1/models/{id}``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (chat template from
the model's tokenizer), both with SSE streaming (``data: {...}`` chunks ending in ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text). ``/v1/*`` needs ``Authorization: Bearer KEY``
when a key is configured; ``/health`` and ``/metrics`` stay open for probes and scrapers.

Variants are artifacts, PEFT LoRA adapters and plain full checkpoints under the served directory
(``deltazip.runtime.serve.variant_sources``); every tensor goes through one dedup registry and the bytes
it saves are logged at start-up and exported as ``deltazip_dedup_*`` metrics. Live management:
``GET /v1/variants`` (kind, tier, bytes per tier, last use, load times), ``POST /v1/variants``
(``{"path": ..., "name": ...}``, a directory inside the served one) and ``DELETE /v1/variants/{name}``
(drains the variant's requests, then unloads it from every tier).

Errors use OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``: unknown model 404,
invalid parameters 400, prompt longer than the context 400 (``context_length_exceeded``), wrong or
missing key 401, full queue 429 (``--max-queue``). Bad input never yields a 500. A client that
disconnects (mid-stream or while waiting) cancels its request; the engine frees the sequence.

This module holds the app, its metrics and the server thread; the runtime it serves (engine, model,
tokenizers, variants) is built without HTTP by :mod:`deltazip.runtime.serve.assembly`; the handlers,
streaming, auth and error shaping are in :mod:`deltazip.runtime.serve.routes`, the OpenAI wire
format in :mod:`deltazip.runtime.serve.openai_schema`.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from deltazip.runtime.serve import routes
from deltazip.runtime.serve.assembly import Runtime, ServeConfig, build_runtime
from deltazip.runtime.serve.engine import Engine

# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics of one server (own registry, so several servers can live in one process)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft_h = Histogram("deltazip_time_to_first_token_seconds", "Time from arrival to the first token",
                                buckets=buckets, registry=self.registry)
        self.e2e_h = Histogram("deltazip_e2e_request_latency_seconds", "Time from arrival to the last token",
                               buckets=buckets, registry=self.registry)
        self.finished_c = Counter("deltazip_requests_finished", "Requests that ended, by reason", ["reason"],
                                  registry=self.registry)
        # "path" is the route template (/v1/models/{model_id:path}) or "unmatched": never the raw
        # path, which anyone could make unbounded (401s and 404s are counted too).
        self.http_c = Counter("deltazip_http_requests", "HTTP requests by route template and status",
                              ["path", "status"], registry=self.registry)
        self.engine: Engine | None = None
        self.runtime: Runtime | None = None
        self.registry.register(_EngineCollector(self))

    # Engine observer interface (engine thread).
    def ttft(self, seconds: float) -> None:
        self.ttft_h.observe(seconds)

    def e2e(self, seconds: float) -> None:
        self.e2e_h.observe(seconds)

    def finished(self, reason: str) -> None:
        self.finished_c.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        eng = self.metrics.engine
        if eng is None:
            return
        st = eng.stats()
        for name, doc, value in (
            ("deltazip_queue_length", "Requests waiting to be scheduled", st["queue_length"]),
            ("deltazip_running_seqs", "Sequences in the running batch", st["running_seqs"]),
            ("deltazip_resident_deltas", "Variants in device slots", len(st["resident_deltas"])),
            ("deltazip_loading_deltas", "Variants being loaded in the background (their requests wait)",
             len(st["loading_deltas"])),
            ("deltazip_host_deltas", "Variants decoded in host memory", len(st["host_deltas"])),
            ("deltazip_tokens_per_second", "Generated tokens per second over the last 10 s", st["tokens_per_second"]),
            ("deltazip_device_weight_bytes", "Bytes of model weights on the device: the base plus every filled slot "
             "(swap mode: the whole models in its slots)", st["device_weight_bytes"]),
            ("deltazip_kv_cache_bytes", "Bytes of the KV cache (its block pool, and images' cross-attention keys)",
             st["kv_cache_bytes"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, key in (
            ("deltazip_generated_tokens", "Completion tokens generated", "generated_tokens"),
            ("deltazip_prompt_tokens", "Prompt tokens processed", "prompt_tokens"),
            ("deltazip_requests", "Requests accepted", "requests"),
            ("deltazip_preemptions", "Line-skipping sequences preempted", "preempted"),
            ("deltazip_engine_steps", "Engine steps", "steps"),
        ):
            yield CounterMetricFamily(name, doc, value=st[key])
        last = GaugeMetricFamily("deltazip_delta_load_seconds", "Last load time of a variant, by tier",
                                 labels=["variant", "tier"])
        total = CounterMetricFamily("deltazip_delta_load_seconds_total", "Time spent loading a variant, by tier",
                                    labels=["variant", "tier"])
        count = CounterMetricFamily("deltazip_delta_loads", "Loads of a variant, by tier", labels=["variant", "tier"])
        for variant, ls in sorted(st["load_stats"].items()):
            for tier in ("disk", "device"):
                last.add_metric([variant, tier], ls[f"{tier}_seconds_last"])
                total.add_metric([variant, tier], ls[f"{tier}_seconds_total"])
                count.add_metric([variant, tier], ls[f"{tier}_loads"])
        yield last
        yield total
        yield count
        rt = self.metrics.runtime
        if rt is None:
            return
        ledger, reg = rt.backend.ledger, rt.backend.registry
        per = ledger.snapshot()
        for name, doc, value in (
            ("deltazip_dedup_bytes_saved", "Bytes not stored thanks to tensor dedup (same as base + registry hits)",
             ledger.bytes_saved()),
            ("deltazip_dedup_same_as_base_bytes", "Bytes of variant tensors equal to the base's, served from it",
             sum(d.same_as_base for d in per.values())),
            ("deltazip_dedup_shared_bytes", "Bytes of variant loads answered with an already held tensor",
             sum(d.shared for d in per.values()) + ledger.base_reused_bytes),
            ("deltazip_dedup_held_bytes", "Bytes of the tensors the dedup registry holds now", reg.held_bytes()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        by_variant = GaugeMetricFamily("deltazip_variant_dedup_bytes_saved", "Bytes a variant does not store thanks "
                                       "to dedup", labels=["variant"])
        for name, d in sorted(per.items()):
            by_variant.add_metric([name], d.saved)
        yield by_variant


# --------------------------------------------------------------------------------------------------
# The app (handlers, streaming and error shaping: routes.py; the wire format: openai_schema.py)
# --------------------------------------------------------------------------------------------------


def create_app(rt: Runtime, metrics: Metrics | None = None):
    """The FastAPI application of a built :class:`Runtime`."""
    from fastapi import FastAPI

    metrics = metrics or Metrics()
    metrics.engine = rt.engine
    metrics.runtime = rt
    app = FastAPI(title="deltazip", lifespan=routes.engine_lifespan(rt.engine, rt.startup), docs_url=None, redoc_url=None,
                  openapi_url=None)
    routes.install(app, routes.AppState(rt, metrics))
    return app


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


class ServerThread:
    """Run an app with uvicorn in a background thread on a socket bound here (port 0: any free port).

    Used by the tests and the benchmark; ``deltazip serve`` runs uvicorn in the foreground instead.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="deltazip-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve_forever(cfg: ServeConfig, runtime: Runtime | None = None, metrics: Metrics | None = None,
                  sock: socket.socket | None = None, parallel=None) -> None:
    """Build (unless given) and run the server in the foreground until interrupted.

    Args:
        sock: a socket already bound to the port and listening (``deltazip serve`` binds it before
            loading models, ``deltazip.runtime.serve.listen``); default: uvicorn binds ``cfg.host:cfg.port``.
        parallel: the tensor-parallel backend factory (see ``assembly.build_model``).
    """
    import uvicorn

    metrics = metrics or Metrics()
    rt = runtime or build_runtime(cfg, observer=metrics, parallel=parallel)
    app = create_app(rt, metrics)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, lifespan="on", timeout_graceful_shutdown=5,
                            log_level=os.environ.get("DELTAZIP_LOG_LEVEL", "info").lower(), access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
    finally:  # also on SIGTERM/SIGINT, which may stop uvicorn before its lifespan shutdown runs
        if hasattr(rt.backend, "close"):  # tensor parallel: stop the worker ranks once the engine has stopped
            rt.engine.shutdown()
            rt.backend.close()
