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

from deltazip.formats.errors import InputError, first_line
from deltazip.models.checkpoint import Checkpoint
from deltazip.models.devices import check_device, check_dtype, resolve_device
from deltazip.models.loader import text_config
from deltazip.runtime.serve.engine import Engine, EngineConfig, ServedVariant
from deltazip.runtime.serve.images import log_images
from deltazip.runtime.serve.kernel_warmup import Startup
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
from deltazip.runtime.serve.startup_report import (
    capacity,
    log_variant,
    log_warmup,
    startup_report,
    variant_costs,
)
from deltazip.runtime.serve.variant_catalog import VariantCatalog
from deltazip.runtime.serve.variant_sources import (
    BaseTensorIndex,
    VariantRef,
    check_variant_name,
    compare_full_checkpoint,
    discover_variants,
    find_variants,
    inspect_variant,
    resolve_inside,
)
from deltazip.runtime.share.dedup_serving import DedupLedger, new_serving_registry

log = logging.getLogger("deltazip.serve")
MODES = ("delta", "swap")


# --------------------------------------------------------------------------------------------------
# Configuration and start-up
# --------------------------------------------------------------------------------------------------


def read_chat_template(path: Path) -> str:
    """The text of a ``--chat-template`` file, checked to compile as a Jinja template (InputError, one line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {path}: cannot read it ({type(e).__name__}: {first_line(e)}); pass a "
                         "UTF-8 Jinja file") from e
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise InputError(f"--chat-template {path}: line {e.lineno}: {(e.message or '').rstrip('.')}; fix the Jinja syntax") from e
    if not text.strip():
        raise InputError(f"--chat-template {path} is empty; pass a Jinja chat template")
    return text


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
    chat_template: Path | None = None  # a Jinja file rendering every model's chat requests (over their own)
    tuner: Any = None  # the delta-matmul tuner (deltazip.runtime.serve.kernel_tuner.Tuner); default: one per model
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
        self.chat_template_text = None if self.chat_template is None else read_chat_template(Path(self.chat_template))

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
    """A built server: the engine plus what the HTTP layer shows about the models.

    ``catalog``: every variant name the server answers for; those not read at start-up are read on
    first use (:func:`serve_on_first_use`). ``capacity``, ``warmup``: the start-up capacity report and
    kernel warm-up (``deltazip.runtime.serve.startup_report``).
    """

    engine: Engine
    config: ServeConfig
    base_name: str
    catalog: VariantCatalog
    created: int
    report: list[dict[str, Any]] = field(default_factory=list)
    tokenizers: Any = None
    base_index: BaseTensorIndex | None = None
    admin_lock: threading.Lock = field(default_factory=threading.Lock)
    capacity: dict[str, Any] = field(default_factory=dict)
    warmup: dict[str, Any] = field(default_factory=dict)  # the kernel warm-up's seconds and launches
    images: dict[str, Any] | None = None  # whether chat requests may send images (image-text bases)
    startup: Any = None  # kernel_warmup.Startup: the tuning the server runs once it answers /health
    _base_fp: str | None = None

    @property
    def backend(self):
        return self.engine.backend

    @property
    def variants(self) -> list[VariantInfo]:
        """The variants read and checked so far (start-up, first use, ``POST /v1/variants``)."""
        return self.catalog.checked()

    def base_fingerprint(self) -> str:
        if self._base_fp is None:
            self._base_fp = self.backend.base.fingerprint()
        return self._base_fp

    def variant(self, name: str) -> VariantInfo | None:
        return self.catalog.get(name)


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
    vocab = text_config(model_config).vocab_size
    if len(dec) > vocab:
        raise InputError(f"variant {v.name}: its tokenizer has {len(dec)} tokens but the base model only "
                         f"{vocab} embeddings")
    side = v.side_dir(base_path)
    return ServedVariant(v.name, dec, eos_token_ids(side, dec, model_config), base_name, enc, side)


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
    found: list[VariantRef] = field(default_factory=list)  # found on disk, read on first use

    def fingerprint(self) -> str:
        """The served base's fingerprint (computed once, on first use)."""
        if self.base_fp is None:
            self.base_fp = self.base.fingerprint()
        return self.base_fp


def build_model(cfg: ServeConfig, variants: list[VariantInfo] | None = None,
                parallel: Callable[..., Any] | None = None, base: Checkpoint | None = None,
                found: list[VariantRef] | None = None) -> Assembly:
    """Discover the variants (unless given), check them against the base and build the model.

    Args:
        cfg: the configuration (``artifacts``, ``base``, ``mode``, ``device``, ``dtype``,
            ``delta_compute``, ``max_deltas``, ``tensor_parallel``...).
        variants: the variants to serve instead of those under ``cfg.artifacts``.
        parallel: with ``cfg.tensor_parallel > 1``, the factory of the sharded model
            (``deltazip.runtime.cluster.tp_group.start_tensor_parallel``).
        base: the base, already opened and checked against the artifacts (eval picks its own);
            default: ``cfg.base`` or the artifacts' lineage, fingerprint-checked.
        found: variants besides ``variants`` that are only found, not read (:func:`startup_variants`):
            not part of the model yet; kept in ``Assembly.found`` once their names are checked.
    """
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    if variants is None:
        if cfg.artifacts is None:
            raise InputError("no served directory and no variants given")
        variants = discover_variants(cfg.artifacts, allow_empty=cfg.base is not None)
    base = base if base is not None else open_served_base(variants, cfg.base)
    # The base's own directory may sit among its variants: it is the base, not a full-checkpoint copy of it.
    base_real = base.path.resolve()
    variants = [v for v in variants if not (v.kind == "full" and v.path.resolve() == base_real)]
    found = [r for r in found or () if not (r.kind == "full" and r.path.resolve() == base_real)]
    base_name = cfg.base_name or Path(base.spec.rstrip("/")).name
    if base_name in {v.name for v in variants} or any(r.name == base_name for r in found):
        raise InputError(f"variant name {base_name!r} is also the base model's name; rename the variant directory")
    device = cfg.torch_device()
    dtype = served_dtype(cfg.dtype, device, base)
    registry, ledger = new_serving_registry(), DedupLedger()
    asm = Assembly(base, base_name, variants, None, device, dtype, BaseTensorIndex(base, registry.fingerprint_bytes),
                   ledger, found=found)
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
                          registry=registry, ledger=asm.ledger, tuner=cfg.tuner)
    return SwapModels(base, variants, cfg.max_deltas, device, dtype, asm.base_name, registry=registry,
                      ledger=asm.ledger)


def _engine(backend, base_name: str, variants: list[VariantInfo], cfg: ServeConfig, tokenizers: _TokenizerPool,
            observer: Any = None) -> Engine:
    """The engine over a built model: every served name with its tokenizer and EOS ids."""
    base = backend.base
    dec, enc = tokenizers.get(base.path)
    served = {base_name: ServedVariant(base_name, dec, eos_token_ids(base.path, dec, backend.config), None, enc,
                                       base.path)}
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


def startup_variants(cfg: ServeConfig) -> tuple[list[VariantInfo], list[VariantRef]]:
    """The variants under ``cfg.artifacts``: those read and checked at start-up, and those only found.

    Read now: the first ``max(--max-deltas, --max-cpu-deltas)`` by name, the ones the host tier is
    warmed with (without ``--base``, also the first artifact, whose lineage names the base). Every
    other variant costs a :class:`VariantRef` until its first request (:func:`serve_on_first_use`), so
    start-up time and host memory do not grow with the number of variants.

    Raises:
        InputError / ArtifactError: as :func:`discover_variants`, for the variants read now.
    """
    refs = find_variants(cfg.artifacts, allow_empty=cfg.base is not None)
    k = max(cfg.max_deltas, cfg.max_cpu_deltas)
    now, later = refs[:k], refs[k:]
    if cfg.base is None and not any(r.kind == "artifact" for r in now):
        first = next((r for r in later if r.kind == "artifact"), None)
        if first is not None:
            now, later = [*now, first], [r for r in later if r is not first]
    return [inspect_variant(r.path, r.name) for r in now], later


def build_runtime(cfg: ServeConfig, observer: Any = None, parallel: Callable[..., Any] | None = None) -> Runtime:
    """Find the variants, read and check those the host tier is warmed with (:func:`startup_variants`;
    the others are read on first use), build the model and the engine.

    Logs one line per variant read (name, kind, bytes on disk, bytes it occupies in a device slot,
    and for full checkpoints what dedup saves), one for the variants read on first use, the dedup
    summary, the kernel warm-up and the capacity (``deltazip.runtime.serve.startup_report``); warms
    the host tier in the background. ``parallel``: see :func:`build_model`.
    """
    read, found = startup_variants(cfg) if cfg.artifacts is not None else (None, None)
    asm = build_model(cfg, read, parallel=parallel, found=found)
    tokenizers = _TokenizerPool()
    engine = _engine(asm.backend, asm.base_name, asm.variants, cfg, tokenizers, observer)
    report = startup_report(asm, cfg)
    catalog = VariantCatalog(asm.variants, asm.found)
    warmup = log_warmup(asm.backend)
    startup = Startup(asm.backend, warmup) if hasattr(asm.backend, "tuner") else None
    if startup is not None and asm.backend.tuner.idle is None:  # background keys wait for an idle engine
        asm.backend.tuner.idle = engine.idle
    images = log_images(engine, asm.base.path)
    cap = capacity(asm, cfg, len(catalog))
    # Warm the host tier with as many variants as it holds, in the background.
    engine.cache.prefetch(([asm.base_name] if cfg.mode == "swap" else []) + [v.name for v in asm.variants])
    rt = Runtime(engine, cfg, asm.base_name, catalog, int(time.time()), report, tokenizers, asm.index, capacity=cap,
                 warmup=warmup, startup=startup, images=images)
    rt._base_fp = asm.base_fp
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
    engine = rt.engine
    with rt.admin_lock:  # one registration at a time: the name check and the commit go together
        if name == rt.base_name or name in engine.served or name in rt.catalog or name in engine.removing():
            raise VariantConflict(f"a model named {name!r} is already served; pass another \"name\" or delete it first")
        v = inspect_variant(real, name)
        _check_and_commit(rt, v, timeout, first_use=False)
    engine.cache.prefetch([name])
    return v


def serve_on_first_use(rt: Runtime, name: str, timeout: float = 600.0) -> bool:
    """Serve ``name`` now if it is a variant found at start-up and not read yet: its manifest is read
    and checked, and it is checked against the base, planned and committed as ``POST /v1/variants``
    does (one read for concurrent first requests). True when ``name`` is served.

    Raises:
        VariantRefused: the variant failed a check; every later request gets the same one line.
    """
    if name in rt.engine.served:
        return True
    return rt.catalog.first_use(name, lambda ref: _check_and_commit(rt, inspect_variant(ref.path, ref.name), timeout,
                                                                    first_use=True))


def _check_and_commit(rt: Runtime, v: VariantInfo, timeout: float, first_use: bool) -> None:
    """Check ``v`` against the base and plan it (calling thread), then serve it (engine thread, between
    steps) and log its line. ``first_use``: ``v`` was found at start-up; it is served only if it was
    not deleted meanwhile (deletes of unread variants run on the engine thread too)."""
    engine, backend = rt.engine, rt.backend
    itemsize = torch.tensor([], dtype=backend.dtype).element_size()
    check_against_base(v, backend.base, rt.base_index, itemsize, rt.base_fingerprint)
    wanted: dict[str, str] = {}
    plan = backend.prepare_variant(v, wanted)
    sv = _served_entry(rt.tokenizers, v, backend.base.path, backend.config, rt.base_name)

    def commit() -> bool:
        if first_use and v.name not in rt.catalog.found:
            return False
        backend.commit_variant(v, plan, wanted)
        if first_use:
            rt.catalog.admit(v)
        else:
            rt.catalog.add(v)
        engine.served[v.name] = sv  # last: requests can only arrive once the model can serve them
        return True

    if engine.run_on_engine(commit).result(timeout=timeout):
        c = variant_costs(v, backend, {})
        rt.report.append({"model": v.name, "role": "variant", "path": str(v.path), **c})
        log_variant(v, c, rt.config.mode)


class _TokenizerPool:
    """Tokenizers by content: variants whose tokenizer files are identical share instances.

    Each distinct tokenizer is loaded twice: one instance encodes prompts on the event loop, the
    other decodes in the engine thread (a Rust tokenizer must not be used by two threads at once).
    """

    FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")

    def __init__(self):
        self._by_hash: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()  # first uses of several variants read at once (worker threads)

    def get(self, path: Path) -> tuple[Any, Any]:
        import hashlib

        h = hashlib.sha256()
        for f in self.FILES:
            p = Path(path) / f
            if p.is_file():
                h.update(f.encode() + b"\0" + p.read_bytes() + b"\0")
        key = h.hexdigest()
        with self._lock:
            if key not in self._by_hash:
                self._by_hash[key] = (load_tokenizer(Path(path)), load_tokenizer(Path(path)))
            return self._by_hash[key]
