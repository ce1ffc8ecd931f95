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
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from starlette.requests import Request  # at module level: FastAPI resolves endpoint annotations here

from deltazip.formats.errors import DeltazipError, InputError
from deltazip.formats.report import human_bytes
from deltazip.runtime.serve.engine import (
    Engine,
    EngineConfig,
    EngineError,
    FinishEvent,
    SamplingParams,
    ServedVariant,
    TokenEvent,
)
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
# One line per request at INFO: method, route template, model, status, latency, tokens.
access_log = logging.getLogger("deltazip.access")
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
        changed = [n for n, e in v.tensors.items() if e["kind"] != "same"]
        for n in changed:
            numel = 1
            for d in v.tensors[n]["shape"]:
                numel *= d
            fp = v.fingerprints[n]
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
# Request bodies
# --------------------------------------------------------------------------------------------------


def _models():
    """Pydantic request models (built lazily so importing this module does not need pydantic)."""
    from pydantic import BaseModel, ConfigDict, Field

    class _Common(BaseModel):
        # Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
        model_config = ConfigDict(extra="ignore")
        # Optional fields accept an explicit null (some clients send one) and mean the default then.
        model: str
        max_tokens: int | None = Field(default=None, ge=1)
        temperature: float | None = Field(default=None, ge=0.0, le=2.0)
        top_p: float | None = Field(default=None, gt=0.0, le=1.0)
        n: int | None = None
        stop: str | list[str] | None = None
        seed: int | None = None
        stream: bool | None = None
        stream_options: dict[str, Any] | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        logprobs: Any = None
        logit_bias: dict[str, float] | None = None
        user: str | None = None

    class CompletionRequest(_Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        echo: bool | None = None
        best_of: int | None = None
        suffix: str | None = None

    class ChatMessage(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "user", "assistant", "developer", "tool"]
        content: str | list[dict[str, Any]] | None = None

    class ChatRequest(_Common):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = Field(default=None, ge=1)
        tools: list[Any] | None = None

    return CompletionRequest, ChatRequest


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_body(status: int, message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _unsupported(req, *, chat: bool) -> None:
    """400 for OpenAI features this server does not implement (rather than silently ignoring them)."""
    checks = [
        (req.n not in (None, 1), "n", "only n=1 is supported"),
        (bool(req.presence_penalty) or bool(req.frequency_penalty), "presence_penalty",
         "presence_penalty and frequency_penalty are not supported (use 0)"),
        (req.logprobs not in (None, False, 0), "logprobs", "logprobs are not supported"),
        (bool(req.logit_bias), "logit_bias", "logit_bias is not supported"),
    ]
    if chat:
        checks.append((bool(req.tools), "tools", "tools are not supported"))
    else:
        checks += [(bool(req.echo), "echo", "echo is not supported"),
                   (req.best_of not in (None, 1), "best_of", "best_of is not supported"),
                   (req.suffix is not None, "suffix", "suffix is not supported")]
    for bad, param, msg in checks:
        if bad:
            raise ApiError(400, msg, param=param)


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _params(req, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=_stop_list(req.stop))
    except EngineError as e:
        raise ApiError(400, str(e), param=e.param) from e


# --------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------


class _Stream:
    """Bridges one engine request (engine thread) to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rid: str | None = None
        self.done = False

    def sink(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def create_app(rt: Runtime, metrics: Metrics | None = None):
    """The FastAPI application of a built :class:`Runtime`."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    CompletionRequest, ChatRequest = _models()
    engine = rt.engine
    api_key = rt.config.api_key
    metrics = metrics or Metrics()
    metrics.engine = engine
    metrics.runtime = rt

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            if hasattr(engine.backend, "close"):  # tensor parallel: stop the worker ranks
                engine.backend.close()

    app = FastAPI(title="deltazip", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        return JSONResponse(_error_body(status, message, type_, param, code), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return error(400, f"{msg}" + (f" (param: {param})" if param else ""), param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):
        log.exception("internal error")
        return error(500, f"internal server error: {type(exc).__name__}", "server_error")

    def route_of(scope) -> str:
        """The route template a request matches (``/v1/models/{model_id:path}``), ``unmatched`` for
        any other path: metric labels and log lines never carry a raw path (unbounded cardinality)."""
        from starlette.routing import Match

        partial = None
        for route in app.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
            if match == Match.PARTIAL and partial is None:
                partial = route.path  # the path matches, the method does not (405)
        return partial or "unmatched"

    def log_access(request: Request, route: str, status: int, t0: float) -> None:
        st = request.state
        usage = getattr(st, "usage", None) or {}
        access_log.info("%s %s model=%s status=%d latency=%.3fs prompt_tokens=%s completion_tokens=%s",
                        request.method, route, getattr(st, "model", "-"), status, time.perf_counter() - t0,
                        usage.get("prompt_tokens", "-"), usage.get("completion_tokens", "-"))

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next):
        t0 = time.perf_counter()
        route = route_of(request.scope)
        if api_key is not None and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                metrics.http_c.labels(route, "401").inc()
                log_access(request, route, 401, t0)
                return error(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY'.",
                             "invalid_request_error", code="invalid_api_key")
        response = await call_next(request)
        metrics.http_c.labels(route, str(response.status_code)).inc()
        body = response.body_iterator

        async def logged_body():  # the line is written once the body is sent (streams: at their end)
            try:
                async for chunk in body:
                    yield chunk
            finally:
                log_access(request, route, response.status_code, t0)

        response.body_iterator = logged_body()
        return response

    # -- plain endpoints ------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        alive = engine._thread is not None and engine._thread.is_alive()
        if not alive:
            return error(503, "the engine is not running", "server_error")
        return {"status": "ok", "models": 1 + len(rt.variants)}

    @app.get("/metrics")
    async def prom():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    def model_card(name: str) -> dict:
        parent = None if name == rt.base_name else rt.base_name
        return {"id": name, "object": "model", "created": rt.created, "owned_by": "deltazip",
                "root": name, "parent": parent}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(rt.base_name)] + [model_card(v.name) for v in rt.variants]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != rt.base_name and model_id not in engine.served:
            raise ApiError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return model_card(model_id)

    # -- generation -----------------------------------------------------------------------------
    def served_entry(name: str) -> ServedVariant:
        # A variant can be deleted between check_model and here: still a 404, never a KeyError.
        sv = engine.served.get(name)
        if sv is None:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return sv

    # -- live variant management --------------------------------------------------------------
    @app.get("/v1/variants")
    async def list_variants():
        rows = await asyncio.wrap_future(engine.run_on_engine(lambda: variant_table(rt)))
        return {"object": "list", "data": rows}

    @app.post("/v1/variants")
    async def add_variant(request: Request):
        body = await _json_body(request)
        path, name = body.get("path"), body.get("name")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "path must be a non-empty string: a variant directory inside the served directory",
                           param="path")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "name must be a string", param="name")
        try:
            v = await asyncio.to_thread(register_variant, rt, path, name)
        except VariantConflict as e:
            raise ApiError(409, str(e), param="name", code="variant_exists") from e
        except DeltazipError as e:
            param = "name" if str(e).startswith("variant name") else "path"
            raise ApiError(400, str(e).splitlines()[0], param=param, code="invalid_variant") from e
        row = await asyncio.wrap_future(engine.run_on_engine(lambda: variant_table(rt, only=v.name)))
        return JSONResponse(row[0] if row else {"id": v.name, "object": "variant"}, status_code=201)

    @app.delete("/v1/variants/{name:path}")
    async def delete_variant(name: str):
        def unload() -> None:  # engine thread, once the variant's requests are done
            rt.backend.remove_variant(name)
            rt.variants[:] = [v for v in rt.variants if v.name != name]

        try:
            fut = engine.remove_model(name, unload)
        except EngineError as e:
            raise ApiError(404, f"No variant named `{name}` is served (the base cannot be deleted).", param="name",
                           code="model_not_found") from e
        await asyncio.wrap_future(fut)
        log.info("variant %s deleted: its requests drained, unloaded from every tier", name)
        return {"id": name, "object": "model", "deleted": True}

    def check_model(name: str) -> None:
        if name not in engine.served:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def encode_prompts(name: str, prompt) -> list[list[int]]:
        tok = served_entry(name).encoder
        if isinstance(prompt, str):
            return [tok(prompt)["input_ids"]]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [tok(p)["input_ids"] for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
        raise ApiError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def encode_chat(name: str, messages) -> list[int]:
        tok = served_entry(name).encoder
        # The variant's own template, else the base's (a fine-tune that kept tokenizer files without
        # one still chats as its base does).
        template = getattr(tok, "chat_template", None) or getattr(engine.served[rt.base_name].encoder,
                                                                  "chat_template", None)
        if not template:
            raise ApiError(400, f"model `{name}` has no chat template (nor has the base); use /v1/completions",
                           param="messages")
        msgs = []
        for m in messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: only text is meaningful here
                if any(p.get("type") != "text" for p in content):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(str(p.get("text", "")) for p in content)
            msgs.append({"role": m.role, "content": content or ""})
        try:
            ids = tok.apply_chat_template(msgs, chat_template=template, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def submit_all(name: str, prompts: list[list[int]], params: SamplingParams, loop) -> list[_Stream]:
        try:
            for p in prompts:
                engine.validate(name, p, params)
        except EngineError as e:
            raise ApiError(e.status, str(e), param=e.param, code=e.code) from e
        streams: list[_Stream] = []
        try:
            for p in prompts:
                s = _Stream(loop)
                s.rid = engine.submit(name, p, params, s.sink)
                streams.append(s)
        except EngineError as e:
            for s in streams:
                engine.cancel(s.rid)
            type_ = "rate_limit_error" if e.status == 429 else "invalid_request_error"
            raise ApiError(e.status, str(e), type_, param=e.param, code=e.code) from e
        return streams

    async def collect(request: Request, s: _Stream) -> FinishEvent | None:
        """Wait for a request's end; cancel it (and return None) if the client goes away."""
        while True:
            try:
                ev = await asyncio.wait_for(s.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(s.rid)
                    return None
                continue
            if isinstance(ev, FinishEvent):
                s.done = True
                return ev

    def check_finish(ev: FinishEvent) -> None:
        if ev.reason == "error":
            raise ApiError(500, ev.error or "generation failed", "server_error")

    def usage(evs: list[FinishEvent]) -> dict:
        p = sum(e.prompt_tokens for e in evs)
        c = sum(e.completion_tokens for e in evs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def sse(request: Request, streams: list[_Stream], make_chunk, make_final, include_usage: bool,
                  head_chunks: list[dict]) -> AsyncIterator[str]:
        import json

        finished: list[FinishEvent] = []
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: _Stream):
            while True:
                ev = await s.queue.get()
                await merged.put((i, ev))
                if isinstance(ev, FinishEvent):
                    s.done = True
                    return

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            for c in head_chunks:
                yield f"data: {json.dumps(c)}\n\n"
            left = len(streams)
            while left:
                i, ev = await merged.get()
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield f"data: {json.dumps(make_chunk(i, ev.text))}\n\n"
                    continue
                left -= 1
                finished.append(ev)
                if ev.reason == "error":
                    body = _error_body(500, ev.error or "generation failed", "server_error", None, None)
                    yield f"data: {json.dumps(body)}\n\n"
                    continue
                yield f"data: {json.dumps(make_final(i, ev.reason))}\n\n"
            request.state.usage = usage(finished)
            if include_usage:
                yield f"data: {json.dumps(make_final(None, None) | {'choices': [], 'usage': usage(finished)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # Reached on normal completion and when the client disconnects (the response task is
            # cancelled): anything still running is cancelled so the engine frees its sequence.
            for t in tasks:
                t.cancel()
            for s in streams:
                if not s.done:
                    engine.cancel(s.rid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _json_body(request))
        request.state.model = req.model
        _unsupported(req, chat=False)
        check_model(req.model)
        prompts = encode_prompts(req.model, req.prompt)
        params = _params(req, req.max_tokens or 16)
        streams = submit_all(req.model, prompts, params, asyncio.get_running_loop())
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(i, text):
            return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}

        def final(i, reason):
            choices = [] if i is None else [{"index": i, "text": "", "logprobs": None, "finish_reason": reason}]
            return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": choices}

        if req.stream:
            include = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(sse(request, streams, chunk, final, include, []), media_type="text/event-stream")
        evs = []
        for s in streams:
            ev = await collect(request, s)
            if ev is None:
                for t in streams:
                    engine.cancel(t.rid)
                return Response(status_code=499)
            check_finish(ev)
            evs.append(ev)
        request.state.usage = usage(evs)
        return {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": i, "text": e.text, "logprobs": None, "finish_reason": e.reason}
                            for i, e in enumerate(evs)], "usage": request.state.usage}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatRequest, await _json_body(request))
        request.state.model = req.model
        _unsupported(req, chat=True)
        check_model(req.model)
        ids = encode_chat(req.model, req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, engine.max_len - len(ids))
        params = _params(req, max_tokens)
        streams = submit_all(req.model, [ids], params, asyncio.get_running_loop())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(i, text):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}

        def final(i, reason):
            choices = [] if i is None else [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}]
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": choices}

        if req.stream:
            include = bool((req.stream_options or {}).get("include_usage"))
            head = [{"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}]
            return StreamingResponse(sse(request, streams, chunk, final, include, head),
                                     media_type="text/event-stream")
        ev = await collect(request, streams[0])
        if ev is None:
            return Response(status_code=499)
        check_finish(ev)
        request.state.usage = usage([ev])
        return {"id": cid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ev.text},
                             "logprobs": None, "finish_reason": ev.reason}], "usage": request.state.usage}

    return app


def variant_table(rt: Runtime, only: str | None = None) -> list[dict[str, Any]]:
    """``GET /v1/variants`` rows (run on the engine thread, so slots and tiers do not move meanwhile).

    Per variant: kind, tier (``device``/``host``/``loading``/``disk``, or ``draining`` while a delete
    waits for its requests), bytes on disk, in the host tier (tensors its host object references,
    shared ones included), in its device slot, bytes dedup saves it, last request (unix time) and
    the latest disk->host and host->device load times (seconds).
    """
    eng, be = rt.engine, rt.backend
    removing = eng.removing()
    root = Path(rt.config.artifacts).resolve()
    rows = []
    for v in list(rt.variants):
        if only is not None and v.name != only:
            continue
        slot = eng.cache.slot_of(v.name)
        host = eng.cache.host_object(v.name)
        st = eng.cache.stats.get(v.name)
        try:
            rel = str(Path(v.path).resolve().relative_to(root))
        except ValueError:
            rel = str(v.path)
        rows.append({
            "id": v.name, "object": "variant", "kind": v.kind, "path": rel,
            "state": "draining" if v.name in removing else eng.cache.state(v.name),
            "bytes_on_disk": v.disk_bytes,
            "bytes_host": host.nbytes() if host is not None and hasattr(host, "nbytes") else 0,
            "bytes_device": be.slot_bytes(slot) if slot is not None else 0,
            "bytes_device_estimate": be.resident_estimate(v.name),
            "bytes_dedup_saved": be.ledger.get(v.name).saved,
            "last_used": eng.last_used.get(v.name),
            "load_seconds": {"disk": st.disk_seconds_last if st and st.disk_loads else None,
                             "device": st.device_seconds_last if st and st.device_loads else None},
        })
    return rows


async def _json_body(request) -> Any:
    import json

    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _parse(model_cls, body: dict):
    """Validate a request body; pydantic's complaint becomes a 400 naming the parameter."""
    from pydantic import ValidationError

    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise ApiError(400, f"{first.get('msg', 'invalid value')} (param: {param})", param=param) from e


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
