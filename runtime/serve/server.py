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

This module builds the runtime (engine, model, tokenizers, variants) and the app; the handlers,
streaming, auth and error shaping are in :mod:`deltazip.runtime.serve.routes`, the OpenAI wire
format in :mod:`deltazip.runtime.serve.openai_schema`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltazip.formats.errors import InputError
from deltazip.formats.report import human_bytes
from deltazip.runtime.serve import routes
from deltazip.runtime.serve.engine import Engine, EngineConfig, ServedVariant
from deltazip.runtime.serve.model import (
    DeltaModel,
    SwapModels,
    VariantInfo,
    eos_token_ids,
    load_tokenizer,
    open_served_base,
    resolve_dtype,
)
from deltazip.runtime.serve.variant_sources import (
    BaseTensorIndex,
    check_variant_name,
    compare_full_checkpoint,
    discover_variants,
    inspect_variant,
    resolve_inside,
)
from deltazip.runtime.share.dedup_serving import DedupLedger, new_serving_registry

log = logging.getLogger("deltazip.serve")
MODES = ("delta", "swap")


# --------------------------------------------------------------------------------------------------
# Configuration and start-up
# --------------------------------------------------------------------------------------------------


@dataclass
class ServeConfig:
    """Everything ``deltazip serve`` takes (validated on construction)."""

    artifacts: Path
    base: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    mode: str = "delta"
    max_deltas: int = 4
    max_cpu_deltas: int = 16
    max_batch_tokens: int = 2048
    max_num_seqs: int = 32
    max_queue: int = 256
    device: str = "auto"
    dtype: str = "auto"
    delta_compute: str = "auto"
    cpu_threads: int | None = None
    preemption: bool = True
    workers: int = 1  # >1: engine processes sharing one weight owner (deltazip.runtime.share.workers)
    tensor_parallel: int = 1  # >1: each layer sharded over that many processes (deltazip.runtime.cluster)

    def __post_init__(self) -> None:
        self.artifacts = Path(self.artifacts)
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode!r} is unknown; use delta or swap")
        for name in ("max_deltas", "max_batch_tokens", "max_num_seqs", "max_queue"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_deltas < 0:
            raise InputError(f"--max-cpu-deltas must be >= 0, got {self.max_cpu_deltas}")
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port {self.port} is not a TCP port")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InputError(f"--device {self.device!r} is unknown; use auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InputError(f"--device {self.device} was asked for but no CUDA device is available")
        if self.workers < 1:
            raise InputError(f"--workers must be >= 1, got {self.workers}")
        if self.tensor_parallel < 1:
            raise InputError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and (self.mode != "delta" or self.workers > 1):
            raise InputError("--tensor-parallel shards the delta-mode model of one server; it does not combine with "
                             "--mode swap or --workers > 1 (drop one of them)")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InputError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.api_key == "":
            self.api_key = None

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class Runtime:
    """A built server: the engine plus what the HTTP layer shows about the models."""

    engine: Engine
    config: ServeConfig
    base_name: str
    variants: list[VariantInfo]
    created: int
    report: list[dict[str, Any]] = field(default_factory=list)
    tokenizers: Any = None
    base_index: BaseTensorIndex | None = None
    admin_lock: threading.Lock = field(default_factory=threading.Lock)
    _base_fp: str | None = None

    @property
    def backend(self):
        return self.engine.backend

    def base_fingerprint(self) -> str:
        if self._base_fp is None:
            self._base_fp = self.backend.base.fingerprint()
        return self._base_fp

    def variant(self, name: str) -> VariantInfo | None:
        return next((v for v in self.variants if v.name == name), None)


def check_against_base(v: VariantInfo, base, index: BaseTensorIndex, itemsize: int, base_fp) -> None:
    """The base checks a variant needs before planning: an artifact's lineage fingerprint, a full
    checkpoint's tensor-by-tensor comparison, a LoRA adapter's ``base_model_name_or_path``.

    Args:
        base_fp: ``() -> str``, the served base's fingerprint (computed only when needed).
    """
    if v.kind == "artifact":
        want = v.lineage.get("base_fingerprint")
        if not want or want != base_fp():
            raise InputError(f"artifact {v.name} ({v.path}) was compressed against a different base than {base.path} "
                             f"(base fingerprint differs or is missing); serve it with its own base")
    elif v.kind == "full":
        compare_full_checkpoint(v, index, itemsize)
    else:
        from deltazip.runtime.serve.lora_variant import check_lora_base

        check_lora_base(v.path, v.lineage.get("base"), base.path, base_fp)


def _served_entry(tokenizers, v: VariantInfo, base_path: Path, model_config, base_name: str) -> ServedVariant:
    dec, enc = tokenizers.get(v.tokenizer_dir(base_path))
    vocab = model_config.vocab_size
    if len(dec) > vocab:
        raise InputError(f"variant {v.name}: its tokenizer has {len(dec)} tokens but the base model only "
                         f"{vocab} embeddings")
    return ServedVariant(v.name, dec, eos_token_ids(v.side_dir(base_path), dec, model_config), base_name, enc)


def _variant_costs(v: VariantInfo, backend, seen: dict) -> dict[str, Any]:
    """Start-up figures of one variant: resident bytes, and dedup savings predicted from fingerprints
    (``seen``: fingerprint -> bytes of changed full-checkpoint tensors of earlier variants)."""
    out = {"kind": v.kind, "bytes_on_disk": v.disk_bytes, "bytes_resident": backend.resident_estimate(v.name),
           "dedup_same_as_base_bytes": v.same_as_base_bytes, "dedup_shared_bytes": 0}
    if v.kind == "full":
        itemsize = torch.tensor([], dtype=backend.dtype).element_size()
        changed = [e for e in v.entries.values() if e.kind != "same"]
        for e in changed:
            numel = e.numel
            fp = v.fingerprints[e.name]
            if fp in seen:
                out["dedup_shared_bytes"] += numel * itemsize
            seen[fp] = numel * itemsize
        out.update(tensors=len(v.tensors), changed_tensors=len(changed))
    return out


def _log_variant(v: VariantInfo, c: dict[str, Any], mode: str) -> None:
    if v.kind == "full":
        saved = c["dedup_same_as_base_bytes"] + c["dedup_shared_bytes"]
        # Delta mode: the changed tensors are dense per-row replacements, held once on the host
        # (identical copies share them) and referenced by the device slot (no copy on CPU; on a GPU
        # one device copy, shared by slots holding identical tensors).
        cost = "a whole model per device slot (swap mode)" if mode == "swap" else \
            f"{human_bytes(c['bytes_resident'])} of dense per-row replacements, held on the host and in its device slot"
        log.info("variant %s (full checkpoint): %s on disk; %d of %d tensors equal the base's, %d changed; dedup saves "
                 "%s (%s same as base, %s shared with other variants); %s", v.name, human_bytes(v.disk_bytes),
                 c["tensors"] - c["changed_tensors"], c["tensors"], c["changed_tensors"], human_bytes(saved),
                 human_bytes(c["dedup_same_as_base_bytes"]), human_bytes(c["dedup_shared_bytes"]), cost)
    else:
        what = "LoRA adapter" if v.kind == "lora" else "artifact"
        log.info("variant %s (%s): %s on disk, %s resident per device slot", v.name, what, human_bytes(v.disk_bytes),
                 human_bytes(c["bytes_resident"]))


def build_runtime(cfg: ServeConfig, observer: Any = None) -> Runtime:
    """Discover variants, check them against the base, build the model and the engine.

    Logs one line per variant (name, kind, bytes on disk, bytes it occupies in a device slot, and for
    full checkpoints what dedup saves) and one dedup summary line.
    """
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    variants = discover_variants(cfg.artifacts, allow_empty=cfg.base is not None)
    base = open_served_base(variants, cfg.base)
    # The base's own directory may sit among its variants: it is the base, not a full-checkpoint copy of it.
    variants = [v for v in variants if not (v.kind == "full" and v.path.resolve() == base.path.resolve())]
    base_name = Path(base.spec.rstrip("/")).name
    if base_name in {v.name for v in variants}:
        raise InputError(f"variant name {base_name!r} is also the base model's name; rename the variant directory")
    device = cfg.torch_device()
    dtype = resolve_dtype(cfg.dtype, device, base)
    registry, ledger = new_serving_registry(), DedupLedger()
    index = BaseTensorIndex(base, registry.fingerprint_bytes)
    fp_cache: list[str] = []

    def base_fp() -> str:
        if not fp_cache:
            fp_cache.append(base.fingerprint())
        return fp_cache[0]

    itemsize = torch.tensor([], dtype=dtype).element_size()
    for v in variants:
        if v.kind != "artifact":  # artifacts were checked by open_served_base
            check_against_base(v, base, index, itemsize, base_fp)
    if cfg.tensor_parallel > 1:
        from deltazip.runtime.cluster.tp_group import start_tensor_parallel

        backend = start_tensor_parallel(base, variants, cfg.max_deltas, device, dtype, cfg.tensor_parallel,
                                        delta_compute=cfg.delta_compute, max_cpu=cfg.max_cpu_deltas,
                                        registry=registry, ledger=ledger)
    elif cfg.mode == "delta":
        backend = DeltaModel(base, variants, cfg.max_deltas, device, dtype, delta_compute=cfg.delta_compute,
                             registry=registry, ledger=ledger)
    else:
        backend = SwapModels(base, variants, cfg.max_deltas, device, dtype, base_name, registry=registry,
                             ledger=ledger)
    tokenizers = _TokenizerPool()
    dec, enc = tokenizers.get(base.path)
    served = {base_name: ServedVariant(base_name, dec, eos_token_ids(base.path, dec, backend.config), None, enc)}
    for v in variants:
        served[v.name] = _served_entry(tokenizers, v, base.path, backend.config, base_name)
    engine = Engine(backend, served, base_name, EngineConfig(
        max_deltas=cfg.max_deltas, max_cpu_deltas=cfg.max_cpu_deltas, max_batch_tokens=cfg.max_batch_tokens,
        max_num_seqs=cfg.max_num_seqs, max_queue=cfg.max_queue, preemption=cfg.preemption), observer=observer)
    report = [{"model": base_name, "role": "base", "path": str(base.path), "bytes_on_disk": base.nbytes(),
               "bytes_resident": backend.base_bytes()}]
    log.info("base %s: %s on disk, %s resident (%s, %s, mode %s)", base_name, human_bytes(base.nbytes()),
             human_bytes(backend.base_bytes()), device, str(dtype).removeprefix("torch."), cfg.mode)
    seen: dict = {}
    for v in variants:
        c = _variant_costs(v, backend, seen)
        report.append({"model": v.name, "role": "variant", "path": str(v.path), **c})
        _log_variant(v, c, cfg.mode)
    same = sum(r.get("dedup_same_as_base_bytes", 0) for r in report)
    shared = sum(r.get("dedup_shared_bytes", 0) for r in report)
    log.info("dedup: %s not stored (%s of variant tensors equal to the base's, %s shared between variants, %s of "
             "duplicate tensors inside the base); every load goes through the registry, /metrics has the live "
             "figures", human_bytes(same + shared + ledger.base_reused_bytes), human_bytes(same), human_bytes(shared),
             human_bytes(ledger.base_reused_bytes))
    # Warm the host tier with as many variants as it holds, in the background.
    engine.cache.prefetch(([base_name] if cfg.mode == "swap" else []) + [v.name for v in variants])
    rt = Runtime(engine, cfg, base_name, variants, int(time.time()), report, tokenizers, index)
    if fp_cache:
        rt._base_fp = fp_cache[0]
    return rt


class VariantConflict(InputError):
    """A variant of that name is already served."""


def register_variant(rt: Runtime, path: str, name: str | None = None, timeout: float = 600.0) -> VariantInfo:
    """Add the variant at ``path`` (inside the served directory) to a running server.

    Checks run in the calling thread; the model changes (decoupling modules the variant needs) run
    on the engine thread between steps. Its host load starts in the background.

    Raises:
        InputError: bad path (outside the served directory, not a variant), bad name, a variant the
            base cannot serve; VariantConflict: the name is taken.
    """
    root = rt.config.artifacts
    real = resolve_inside(root, path)
    if real == rt.backend.base.path.resolve():
        raise InputError(f"path {path!r} is the served base itself; it is already served as {rt.base_name!r}")
    name = name if name is not None else real.name
    if not isinstance(name, str):
        raise InputError("name must be a string")
    check_variant_name(name)
    engine, backend = rt.engine, rt.backend
    with rt.admin_lock:  # one registration at a time: the name check and the commit go together
        if name == rt.base_name or name in engine.served or name in engine.removing():
            raise VariantConflict(f"a model named {name!r} is already served; pass another \"name\" or delete it first")
        v = inspect_variant(real, name)
        itemsize = torch.tensor([], dtype=backend.dtype).element_size()
        check_against_base(v, backend.base, rt.base_index, itemsize, rt.base_fingerprint)
        wanted: dict[str, str] = {}
        plan = backend.prepare_variant(v, wanted)
        sv = _served_entry(rt.tokenizers, v, backend.base.path, backend.config, rt.base_name)

        def commit() -> None:
            backend.commit_variant(v, plan, wanted)
            rt.variants.append(v)
            engine.served[name] = sv  # last: requests can only arrive once the model can serve them

        engine.run_on_engine(commit).result(timeout=timeout)
    c = _variant_costs(v, backend, {})
    rt.report.append({"model": v.name, "role": "variant", "path": str(v.path), **c})
    _log_variant(v, c, rt.config.mode)
    engine.cache.prefetch([name])
    return v


class _TokenizerPool:
    """Tokenizers by content: variants whose tokenizer files are identical share instances.

    Each distinct tokenizer is loaded twice: one instance encodes prompts on the event loop, the
    other decodes in the engine thread (a Rust tokenizer must not be used by two threads at once).
    """

    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")

    def __init__(self):
        self._by_hash: dict[str, tuple[Any, Any]] = {}

    def get(self, path: Path) -> tuple[Any, Any]:
        import hashlib

        h = hashlib.sha256()
        for f in self.FILES:
            p = Path(path) / f
            if p.is_file():
                h.update(f.encode() + b"\0" + p.read_bytes() + b"\0")
        key = h.hexdigest()
        if key not in self._by_hash:
            self._by_hash[key] = (load_tokenizer(Path(path)), load_tokenizer(Path(path)))
        return self._by_hash[key]


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
            ("deltazip_kv_cache_bytes", "Bytes of the KV cache pool (one row per sequence, as long as the longest)",
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
    app = FastAPI(title="deltazip", lifespan=routes.engine_lifespan(rt.engine), docs_url=None, redoc_url=None,
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
                  sock: socket.socket | None = None) -> None:
    """Build (unless given) and run the server in the foreground until interrupted.

    Args:
        sock: a socket already bound to the port and listening (``deltazip serve`` binds it before
            loading models, ``deltazip.runtime.serve.listen``); default: uvicorn binds ``cfg.host:cfg.port``.
    """
    import uvicorn

    metrics = metrics or Metrics()
    rt = runtime or build_runtime(cfg, observer=metrics)
    app = create_app(rt, metrics)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, lifespan="on", timeout_graceful_shutdown=5,
                            log_level=os.environ.get("DELTAZIP_LOG_LEVEL", "info").lower(), access_log=False)
    try:
        uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
    finally:  # also on SIGTERM/SIGINT, which may stop uvicorn before its lifespan shutdown runs
        if hasattr(rt.backend, "close"):  # tensor parallel: stop the worker ranks once the engine has stopped
            rt.engine.shutdown()
            rt.backend.close()
