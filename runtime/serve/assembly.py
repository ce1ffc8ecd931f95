"""Assembling a served runtime, without HTTP: configuration, variants checked against the base, the
model, the tokenizers and the engine.

- :func:`build_engine`: the one public builder of an :class:`~deltazip.runtime.serve.engine.Engine`
  from a :class:`ServeConfig` (what eval, cluster, benches and tests call);
  :func:`build_model` is its model half (the decoupled or swapping model with its dedup registry,
  the variants checked against the base), which eval runs directly; :func:`engine_for` puts the
  engine's half over a model built elsewhere (a test's model with slots filled, a tensor-parallel
  group).
- :func:`build_runtime`: the engine plus what the HTTP layer shows (variants, start-up report,
  tokenizers), for ``deltazip serve``, the worker processes and the Ray replicas.
- :func:`register_variant`: add a variant to a running runtime.

Tensor parallel is handed in, not imported: ``deltazip serve --tensor-parallel N`` passes
``deltazip.runtime.cluster.tp_group.start_tensor_parallel`` as ``parallel`` (``serve/`` sits below
``cluster/``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltazip.formats.errors import InputError
from deltazip.formats.report import human_bytes
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.devices import check_device, check_dtype, resolve_device
from deltazip.runtime.serve.engine import Engine, EngineConfig, ServedVariant
from deltazip.runtime.serve.kv_cache import DEFAULT_BLOCK_SIZE
from deltazip.runtime.serve.model import (
    DeltaModel,
    SwapModels,
    VariantInfo,
    eos_token_ids,
    load_tokenizer,
    open_served_base,
    served_dtype,
)
from deltazip.runtime.serve.openai_schema import DEFAULT_MAX_REQUEST_BYTES
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
    """Everything ``deltazip serve`` takes (validated on construction).

    ``artifacts``: the served directory (None: the variants are handed to :func:`build_model`);
    ``base_name``: the base's served model name (default: its directory name).
    """

    artifacts: Path | None = None
    base: str | None = None
    base_name: str | None = None
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
    workers: int = 1  # >1: engine processes sharing one weight owner (deltazip.runtime.cluster.workers)
    tensor_parallel: int = 1  # >1: each layer sharded over that many processes (deltazip.runtime.cluster)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get 413
    # Engine knobs without a CLI option (tests and benches turn them): see EngineConfig.
    chunked_prefill: bool = True
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        self.artifacts = None if self.artifacts is None else Path(self.artifacts)
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode!r} is unknown; use delta or swap")
        for name in ("max_deltas", "max_batch_tokens", "max_num_seqs", "max_queue"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_deltas < 0:
            raise InputError(f"--max-cpu-deltas must be >= 0, got {self.max_cpu_deltas}")
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port {self.port} is not a TCP port")
        check_device(self.device)
        check_dtype(self.dtype)
        if self.workers < 1:
            raise InputError(f"--workers must be >= 1, got {self.workers}")
        if self.tensor_parallel < 1:
            raise InputError(f"--tensor-parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and (self.mode != "delta" or self.workers > 1):
            raise InputError("--tensor-parallel shards the delta-mode model of one server; it does not combine with "
                             "--mode swap or --workers > 1 (drop one of them)")
        if self.max_request_bytes < 1024:
            raise InputError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InputError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.api_key == "":
            self.api_key = None

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def engine_config(self) -> EngineConfig:
        """The engine's part of the configuration."""
        return EngineConfig(max_deltas=self.max_deltas, max_cpu_deltas=self.max_cpu_deltas,
                            max_batch_tokens=self.max_batch_tokens, max_num_seqs=self.max_num_seqs,
                            max_queue=self.max_queue, preemption=self.preemption,
                            chunked_prefill=self.chunked_prefill, kv_block_size=self.kv_block_size,
                            cuda_graphs=self.cuda_graphs)


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


@dataclass
class Assembly:
    """What :func:`build_model` made: the served base, its name, the checked variants and the model
    (``backend``: a ``DeltaModel``, ``SwapModels`` or a tensor-parallel one), with the base's tensor
    index and fingerprint (computed once, when a check needed it)."""

    base: Any
    base_name: str
    variants: list[VariantInfo]
    backend: Any
    device: torch.device
    dtype: torch.dtype
    index: BaseTensorIndex
    ledger: DedupLedger
    base_fp: str | None = None

    def fingerprint(self) -> str:
        """The served base's fingerprint (computed once, on first use)."""
        if self.base_fp is None:
            self.base_fp = self.base.fingerprint()
        return self.base_fp


def build_model(cfg: ServeConfig, variants: list[VariantInfo] | None = None,
                parallel: Callable[..., Any] | None = None, base: Checkpoint | None = None) -> Assembly:
    """Discover the variants (unless given), check them against the base and build the model.

    Args:
        cfg: the configuration (``artifacts``, ``base``, ``mode``, ``device``, ``dtype``,
            ``delta_compute``, ``max_deltas``, ``tensor_parallel``...).
        variants: the variants to serve instead of those under ``cfg.artifacts``.
        parallel: with ``cfg.tensor_parallel > 1``, the factory of the sharded model
            (``deltazip.runtime.cluster.tp_group.start_tensor_parallel``).
        base: the base, already opened and checked against the artifacts (eval picks its own);
            default: ``cfg.base`` or the artifacts' lineage, fingerprint-checked.
    """
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    if variants is None:
        if cfg.artifacts is None:
            raise InputError("no served directory and no variants given")
        variants = discover_variants(cfg.artifacts, allow_empty=cfg.base is not None)
    base = base if base is not None else open_served_base(variants, cfg.base)
    # The base's own directory may sit among its variants: it is the base, not a full-checkpoint copy of it.
    variants = [v for v in variants if not (v.kind == "full" and v.path.resolve() == base.path.resolve())]
    base_name = cfg.base_name or Path(base.spec.rstrip("/")).name
    if base_name in {v.name for v in variants}:
        raise InputError(f"variant name {base_name!r} is also the base model's name; rename the variant directory")
    device = cfg.torch_device()
    dtype = served_dtype(cfg.dtype, device, base)
    registry, ledger = new_serving_registry(), DedupLedger()
    asm = Assembly(base, base_name, variants, None, device, dtype, BaseTensorIndex(base, registry.fingerprint_bytes),
                   ledger)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    for v in variants:
        if v.kind != "artifact":  # artifacts were checked by open_served_base
            check_against_base(v, base, asm.index, itemsize, asm.fingerprint)
    asm.backend = _backend(cfg, asm, registry, parallel)
    return asm


def _backend(cfg: ServeConfig, asm: Assembly, registry, parallel: Callable[..., Any] | None):
    base, variants, device, dtype = asm.base, asm.variants, asm.device, asm.dtype
    if cfg.tensor_parallel > 1:
        if parallel is None:
            raise InputError("--tensor-parallel needs the tensor-parallel backend (deltazip.runtime.cluster); "
                             "serve through `deltazip serve`, which hands it in")
        return parallel(base, variants, cfg.max_deltas, device, dtype, cfg.tensor_parallel,
                        delta_compute=cfg.delta_compute, max_cpu=cfg.max_cpu_deltas, registry=registry,
                        ledger=asm.ledger)
    if cfg.mode == "delta":
        return DeltaModel(base, variants, cfg.max_deltas, device, dtype, delta_compute=cfg.delta_compute,
                          registry=registry, ledger=asm.ledger)
    return SwapModels(base, variants, cfg.max_deltas, device, dtype, asm.base_name, registry=registry,
                      ledger=asm.ledger)


def _engine(backend, base_name: str, variants: list[VariantInfo], cfg: ServeConfig, tokenizers: _TokenizerPool,
            observer: Any = None) -> Engine:
    """The engine over a built model: every served name with its tokenizer and EOS ids."""
    base = backend.base
    dec, enc = tokenizers.get(base.path)
    served = {base_name: ServedVariant(base_name, dec, eos_token_ids(base.path, dec, backend.config), None, enc)}
    for v in variants:
        served[v.name] = _served_entry(tokenizers, v, base.path, backend.config, base_name)
    return Engine(backend, served, base_name, cfg.engine_config(), observer=observer)


def engine_for(backend, cfg: ServeConfig | None = None, base_name: str = "base", observer: Any = None) -> Engine:
    """An engine over a model built elsewhere (a test's ``DeltaModel`` with slots already filled, a
    bench's tensor-parallel group): the served names, tokenizers and EOS ids as :func:`build_engine`
    gives them; ``cfg``: the engine knobs (default ``ServeConfig()``'s)."""
    cfg = cfg or ServeConfig()
    return _engine(backend, base_name, list(backend.variants.values()), cfg, _TokenizerPool(), observer)


def build_engine(cfg: ServeConfig, variants: list[VariantInfo] | None = None, observer: Any = None,
                 parallel: Callable[..., Any] | None = None, base: Checkpoint | None = None) -> Engine:
    """The engine of a configuration: :func:`build_model`, then tokenizers and the engine (not
    started; nothing prefetched). Arguments as :func:`build_model`; ``observer``: the engine's
    metrics sink."""
    asm = build_model(cfg, variants, parallel, base)
    return _engine(asm.backend, asm.base_name, asm.variants, cfg, _TokenizerPool(), observer)


def build_runtime(cfg: ServeConfig, observer: Any = None, parallel: Callable[..., Any] | None = None) -> Runtime:
    """Discover variants, check them against the base, build the model and the engine.

    Logs one line per variant (name, kind, bytes on disk, bytes it occupies in a device slot, and for
    full checkpoints what dedup saves) and one dedup summary line; warms the host tier in the
    background. ``parallel``: see :func:`build_model`.
    """
    asm = build_model(cfg, parallel=parallel)
    tokenizers = _TokenizerPool()
    engine = _engine(asm.backend, asm.base_name, asm.variants, cfg, tokenizers, observer)
    report = _startup_report(asm, cfg)
    # Warm the host tier with as many variants as it holds, in the background.
    engine.cache.prefetch(([asm.base_name] if cfg.mode == "swap" else []) + [v.name for v in asm.variants])
    rt = Runtime(engine, cfg, asm.base_name, asm.variants, int(time.time()), report, tokenizers, asm.index)
    rt._base_fp = asm.base_fp
    return rt


def _startup_report(asm: Assembly, cfg: ServeConfig) -> list[dict[str, Any]]:
    """One entry per served model (sizes, dedup savings), each logged; then the dedup summary line."""
    base, backend, ledger = asm.base, asm.backend, asm.ledger
    report = [{"model": asm.base_name, "role": "base", "path": str(base.path), "bytes_on_disk": base.nbytes(),
               "bytes_resident": backend.base_bytes()}]
    log.info("base %s: %s on disk, %s resident (%s, %s, mode %s)", asm.base_name, human_bytes(base.nbytes()),
             human_bytes(backend.base_bytes()), asm.device, str(asm.dtype).removeprefix("torch."), cfg.mode)
    seen: dict = {}
    for v in asm.variants:
        c = _variant_costs(v, backend, seen)
        report.append({"model": v.name, "role": "variant", "path": str(v.path), **c})
        _log_variant(v, c, cfg.mode)
    same = sum(r.get("dedup_same_as_base_bytes", 0) for r in report)
    shared = sum(r.get("dedup_shared_bytes", 0) for r in report)
    log.info("dedup: %s not stored (%s of variant tensors equal to the base's, %s shared between variants, %s of "
             "duplicate tensors inside the base); every load goes through the registry, /metrics has the live "
             "figures", human_bytes(same + shared + ledger.base_reused_bytes), human_bytes(same), human_bytes(shared),
             human_bytes(ledger.base_reused_bytes))
    return report


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
