"""Find bit-identical tensors across checkpoints, straight from the bytes of their files.

A tensor's fingerprint is ``(dtype, shape, hash of its raw bytes)``: bytes are read from the file
(header -> absolute offsets -> positional reads), never decoded and never converted, so a bf16
tensor and its fp16 twin never match, and neither do two tensors with the same bytes but another
shape. Hashing runs on a thread pool; the three hashers release the GIL, so a scan is bounded by
reading the bytes (page cache or disk), not by hashing:

- ``xxh3`` (default): xxh3-128, ~10 GB/s per core, not cryptographic;
- ``blake3``: cryptographic, ~2 GB/s per core;
- ``blake2b``: blake2b-256 from hashlib, the seed blog's choice, ~0.5 GB/s per core.

``verify_bytes`` compares the bytes of every candidate pair before calling them identical (a hash
collision splits the group and is counted). For tensors with the same name and shape that differ
between checkpoints, :func:`scan_checkpoints` also measures *how* they differ (fraction of
elements changed, relative L2, max abs): the "should this be delta-compressed instead?" signal.
That part decodes numbers (numpy; bf16 and float8 widened by bit tricks), still without torch.

The scan result renders as a JSON-able report (:meth:`ScanResult.to_dict`) and as a
content-addressed manifest (:meth:`ScanResult.manifest`, schema in docs/dedup.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from deltazip.formats.checkpoint_files import CheckpointFiles, read_weight_table, resolve_checkpoint
from deltazip.formats.errors import InputError
from deltazip.formats.outputs import is_no_space, no_space_error, write_text_atomic

MANIFEST_FORMAT = "deltazip-dedup-manifest"
MANIFEST_VERSION = 1

# Reads are 4 MiB: big enough that syscall overhead vanishes, small enough that the buffer stays
# in L2/L3 between the read (memcpy from page cache) and the hash (measured best on the bench box).
_CHUNK = 4 * 1024 * 1024
# Tensors smaller than this are read in batches (one read for a run of neighbouring tensors).
_BATCH_BYTES = _CHUNK
# Elements per chunk when decoding tensors for the difference statistics.
_DIFF_ELEMS = 1024 * 1024

ProgressFn = Callable[[str, int, int], None]


# --------------------------------------------------------------------------------------- hashing

def _blake3():
    import blake3

    return blake3.blake3()


HASH_ALGORITHMS: dict[str, tuple[str, Callable[[], object]]] = {
    # CLI name -> (name recorded in reports/manifests, hasher factory)
    "xxh3": ("xxh3_128", xxhash.xxh3_128),
    "blake3": ("blake3", _blake3),
    "blake2b": ("blake2b-256", lambda: hashlib.blake2b(digest_size=32)),
}


def hash_name(algo: str) -> str:
    """``"xxh3"`` -> ``"xxh3_128"`` (the name stored in fingerprints)."""
    return _algo(algo)[0]


def new_hasher(algo: str = "xxh3"):
    """A fresh streaming hasher (``update(bytes-like)``, ``hexdigest()``); all release the GIL."""
    return _algo(algo)[1]()


def hash_bytes(data, algo: str = "xxh3") -> str:
    """Hex digest of one bytes-like object (memoryview, bytes, numpy buffer)."""
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()


def _algo(algo: str) -> tuple[str, Callable[[], object]]:
    try:
        return HASH_ALGORITHMS[algo]
    except KeyError:
        raise InputError(f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGORITHMS)}") from None


@dataclass(frozen=True)
class TensorFingerprint:
    """Identity of a tensor's content: dtype string, shape and the hash of its raw bytes.

    ``id`` is the manifest key, e.g. ``xxh3_128:5d0c...e1:BF16[2048,576]``.
    """

    dtype: str
    shape: tuple[int, ...]
    algo: str
    digest: str

    @property
    def id(self) -> str:
        return f"{self.algo}:{self.digest}:{self.dtype}[{','.join(map(str, self.shape))}]"


# ------------------------------------------------------------------------------------ components

_COMPONENT_RULES: list[tuple[re.Pattern[str], str | None]] = [
    (re.compile(r"(^|\.)(vision_tower|vision_model|visual|vision_encoder|image_encoder|vit|"
                r"multi_modal_projector|mm_projector)(\.|$)"), "vision encoder"),
    (re.compile(r"(^|\.)(audio_tower|audio_encoder|audio_model)(\.|$)"), "audio encoder"),
    (re.compile(r"(^|\.)(text_model|text_encoder)(\.|$)"), "text encoder"),
    (re.compile(r"(^|\.)(lm_head|embed_out)(\.|$)|^output\.weight$"), "lm_head"),
    (re.compile(r"(^|\.)(layers|h|blocks|block|blk|layer)\.(\d+)\."), None),  # -> "layer N"
    (re.compile(r"embed_tokens|(^|\.)(wte|wpe|word_embeddings|tok_embeddings|token_embd|embed_in|"
                r"embeddings)(\.|$)"), "embed"),
    (re.compile(r"norm|(^|\.)ln_f(\.|$)"), "norms"),
]


def component_of(name: str, file_component: str = "") -> str:
    """The report's component label of one tensor.

    ``model.embed_tokens.weight`` -> "embed", ``model.layers.3.mlp.up_proj.weight`` -> "layer 3",
    ``model.norm.weight`` -> "norms", ``lm_head.weight`` -> "lm_head", anything under
    ``vision_tower`` -> "vision encoder"; a diffusers component keeps its folder name.
    """
    if file_component:
        return file_component
    for pat, label in _COMPONENT_RULES:
        m = pat.search(name)
        if m:
            return label if label is not None else f"layer {int(m.group(3))}"
    return "other"


def _component_sort_key(c: str) -> tuple:
    order = {"embed": 0, "layer": 1, "norms": 2, "lm_head": 3}
    if c.startswith("layer "):
        return (1, int(c.split()[1]), c)
    return (order.get(c, 4), 0, c)


# ------------------------------------------------------------------------------------------ scan

@dataclass
class ScanConfig:
    """Options of a scan.

    Attributes:
        hash: ``xxh3`` | ``blake3`` | ``blake2b``.
        min_bytes: tensors smaller than this are not hashed and never deduplicated (they are
            listed under ``unhashed`` in the manifest, with their storage location).
        verify_bytes: compare the bytes of every candidate pair before calling it identical.
        diff_stats: measure how same-name, same-shape tensors differ (decodes the numbers).
        threads: reader/hasher threads; default ``min(8, 2 x cpu count)``: two per core keep a
            core busy hashing while the other thread of the pair waits on a read (cold files).
    """

    hash: str = "xxh3"
    min_bytes: int = 0
    verify_bytes: bool = False
    diff_stats: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        _algo(self.hash)
        if self.min_bytes < 0:
            raise InputError(f"--min-bytes must be >= 0, got {self.min_bytes}")
        if self.threads is None:
            self.threads = max(1, min(8, 2 * (os.cpu_count() or 1)))
        if self.threads < 1:
            raise InputError(f"threads must be >= 1, got {self.threads}")


@dataclass
class TensorRef:
    """One tensor occurrence: checkpoint index, qualified name, file and absolute byte range."""

    checkpoint: int
    name: str
    component: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    fingerprint: TensorFingerprint | None = None  # None: below min_bytes, not hashed

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class DiffStat:
    """How one tensor of ``checkpoint`` differs from the same-name, same-shape one of ``reference``.

    ``fraction_changed``: elements whose bit pattern differs (same dtype) or whose value differs
    (different dtypes); ``rel_l2``: ||b - a|| / ||a|| (float32 arithmetic for <= 32-bit floats,
    float64 for F64 and wide integers; per-chunk sums added in float64); ``max_abs``: max |b - a|.
    All None with ``skipped`` set when the dtype cannot be decoded (GGUF quantized, F4, F8_E8M0).
    """

    name: str
    component: str
    shape: tuple[int, ...]
    reference: int
    checkpoint: int
    dtype_reference: str
    dtype: str
    numel: int
    changed: int | None = None
    sumsq_diff: float | None = None
    sumsq_ref: float | None = None
    max_abs: float | None = None
    skipped: str | None = None

    @property
    def fraction_changed(self) -> float | None:
        return None if self.changed is None else (self.changed / self.numel if self.numel else 0.0)

    @property
    def rel_l2(self) -> float | None:
        if self.sumsq_diff is None:
            return None
        if self.sumsq_ref == 0:
            return 0.0 if self.sumsq_diff == 0 else math.inf
        return math.sqrt(self.sumsq_diff / self.sumsq_ref)


@dataclass
class ScanResult:
    """Everything a scan found; see :meth:`to_dict` for the report layout."""

    config: ScanConfig
    checkpoints: list[CheckpointFiles]
    refs: list[TensorRef]
    groups: dict[TensorFingerprint, list[int]]  # fingerprint -> indices into refs, scan order
    diffs: list[DiffStat] = field(default_factory=list)
    collisions: int = 0
    verified_pairs: int = 0
    hash_seconds: float = 0.0
    elapsed_seconds: float = 0.0

    # ---- derived numbers
    def _stored_and_reused(self) -> tuple[set[int], set[int]]:
        """First occurrence of each fingerprint is stored; every later one is reused."""
        stored, reused = set(), set()
        for idxs in self.groups.values():
            stored.add(idxs[0])
            reused.update(idxs[1:])
        return stored, reused

    def to_dict(self) -> dict:
        """The report as plain JSON data.

        Layout: ``{"hash", "min_bytes", "verify_bytes", "checkpoints": [...], "totals": {...},
        "components": [...], "groups": [...], "differing": [...], "differing_summary": [...],
        "collisions", "verified_pairs", "timing": {...}}``; bytes are integers, ratios in [0, 1]
        except ``saved_pct`` (percent).
        """
        _, reused = self._stored_and_reused()
        total_bytes = sum(r.nbytes for r in self.refs)
        saved = sum(self.refs[i].nbytes for i in reused)
        unique_bytes = sum(self.refs[idxs[0]].nbytes for idxs in self.groups.values())
        hashed = [r for r in self.refs if r.fingerprint is not None]

        ckpts = []
        for ci, ck in enumerate(self.checkpoints):
            mine = [i for i, r in enumerate(self.refs) if r.checkpoint == ci]
            ckpts.append({
                "index": ci,
                "path": str(ck.path),
                "kind": ck.kind,
                "files": len(ck.files),
                "skipped_files": [str(p) for p in ck.skipped],
                "tensors": len(mine),
                "bytes": sum(self.refs[i].nbytes for i in mine),
                "unhashed_tensors": sum(1 for i in mine if self.refs[i].fingerprint is None),
                "reused_tensors": sum(1 for i in mine if i in reused),
                "reused_bytes": sum(self.refs[i].nbytes for i in mine if i in reused),
            })

        comps: dict[str, dict] = {}
        for i, r in enumerate(self.refs):
            c = comps.setdefault(r.component, {"component": r.component, "tensors": 0, "bytes": 0,
                                               "reused_tensors": 0, "bytes_saved": 0})
            c["tensors"] += 1
            c["bytes"] += r.nbytes
            if i in reused:
                c["reused_tensors"] += 1
                c["bytes_saved"] += r.nbytes
        for c in comps.values():
            c["saved_pct"] = _pct(c["bytes_saved"], c["bytes"])

        groups = []
        for fp, idxs in self.groups.items():
            if len(idxs) < 2:
                continue
            nb = self.refs[idxs[0]].nbytes
            groups.append({
                "fingerprint": fp.id, "dtype": fp.dtype, "shape": list(fp.shape), "nbytes": nb,
                "count": len(idxs), "bytes_saved": nb * (len(idxs) - 1),
                "occurrences": [{"checkpoint": self.refs[i].checkpoint, "name": self.refs[i].name,
                                 "component": self.refs[i].component} for i in idxs],
            })
        groups.sort(key=lambda g: (-g["bytes_saved"], g["occurrences"][0]["checkpoint"], g["occurrences"][0]["name"]))

        return {
            "hash": hash_name(self.config.hash),
            "min_bytes": self.config.min_bytes,
            "verify_bytes": self.config.verify_bytes,
            "checkpoints": ckpts,
            "totals": {
                "checkpoints": len(self.checkpoints),
                "tensors": len(self.refs),
                "bytes": total_bytes,
                "hashed_tensors": len(hashed),
                "hashed_bytes": sum(r.nbytes for r in hashed),
                "unique_tensors": len(self.groups),
                "unique_bytes": unique_bytes,
                "reused_tensors": len(reused),
                "bytes_saved": saved,
                "saved_pct": _pct(saved, total_bytes),
                "bytes_after_dedup": total_bytes - saved,
            },
            "components": sorted(comps.values(), key=lambda c: _component_sort_key(c["component"])),
            "groups": groups,
            "differing": [_diff_dict(d) for d in self.diffs],
            "differing_summary": self._diff_summary(),
            "collisions": self.collisions,
            "verified_pairs": self.verified_pairs,
            "timing": {
                "hash_seconds": round(self.hash_seconds, 4),
                "elapsed_seconds": round(self.elapsed_seconds, 4),
                "hash_gb_per_s": round(sum(r.nbytes for r in hashed) / self.hash_seconds / 1e9, 3)
                if self.hash_seconds > 0 else None,
            },
        }

    def _diff_summary(self) -> list[dict]:
        """Differing tensors aggregated per (reference, checkpoint, component)."""
        agg: dict[tuple[int, int, str], dict] = {}
        for d in self.diffs:
            a = agg.setdefault((d.reference, d.checkpoint, d.component), {
                "reference": d.reference, "checkpoint": d.checkpoint, "component": d.component,
                "tensors": 0, "numel": 0, "changed": 0, "sumsq_diff": 0.0, "sumsq_ref": 0.0, "max_abs": 0.0,
                "undecoded": 0, "dtype_changed": 0})
            a["tensors"] += 1
            a["dtype_changed"] += d.dtype != d.dtype_reference
            if d.changed is None:
                a["undecoded"] += 1
                continue
            a["numel"] += d.numel
            a["changed"] += d.changed
            a["sumsq_diff"] += d.sumsq_diff
            a["sumsq_ref"] += d.sumsq_ref
            a["max_abs"] = max(a["max_abs"], d.max_abs) if not math.isnan(d.max_abs) else math.nan
        out = []
        for _, a in sorted(agg.items(), key=lambda kv: (kv[0][0], kv[0][1], _component_sort_key(kv[0][2]))):
            ssd, ssr = a.pop("sumsq_diff"), a.pop("sumsq_ref")
            a["fraction_changed"] = _finite(a["changed"] / a["numel"]) if a["numel"] else None
            a["rel_l2"] = _finite(math.sqrt(ssd / ssr)) if ssr > 0 else (0.0 if ssd == 0 else None)
            a["max_abs"] = _finite(a["max_abs"]) if a["numel"] else None
            out.append(a)
        return out

    def manifest(self) -> dict:
        """The content-addressed manifest (schema: docs/dedup.md).

        ``tensors``: fingerprint id -> {dtype, shape, nbytes, hash, refs, location: {checkpoint,
        file, offset, nbytes, name}} with ``offset`` absolute in ``file``; ``checkpoints``: per
        checkpoint its path, kind, files and ``tensors``: name -> fingerprint id, plus ``unhashed``:
        name -> location for tensors below ``min_bytes``.
        """
        tensors = {}
        for fp, idxs in self.groups.items():
            r = self.refs[idxs[0]]
            tensors[fp.id] = {
                "dtype": fp.dtype, "shape": list(fp.shape), "nbytes": r.nbytes, "hash": fp.digest,
                "refs": len(idxs), "location": _location(r),
            }
        ckpts = []
        for ci, ck in enumerate(self.checkpoints):
            mine = sorted((r for r in self.refs if r.checkpoint == ci), key=lambda r: r.name)
            ckpts.append({
                "path": str(ck.path.resolve()),
                "kind": ck.kind,
                "files": [str(f.path.resolve()) for f in ck.files],
                "tensors": {r.name: r.fingerprint.id for r in mine if r.fingerprint is not None},
                "unhashed": {r.name: {"dtype": r.dtype, "shape": list(r.shape), **_location(r)}
                             for r in mine if r.fingerprint is None},
            })
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "hash": hash_name(self.config.hash),
            "min_bytes": self.config.min_bytes,
            "verify_bytes": self.config.verify_bytes,
            "created_by": _tool_version(),
            "unique_tensors": len(tensors),
            "unique_bytes": sum(t["nbytes"] for t in tensors.values()),
            "tensors": tensors,
            "checkpoints": ckpts,
        }

    def write_manifest(self, path: str | Path) -> Path:
        """Write :meth:`manifest` atomically (temp file + rename): never a half-written manifest."""
        return write_json_atomic(path, self.manifest())


def _location(r: TensorRef) -> dict:
    return {"checkpoint": r.checkpoint, "file": str(r.file.resolve()), "offset": r.start,
            "nbytes": r.nbytes, "name": r.name}


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 4) if whole else 0.0


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Infinity: non-finite numbers become None."""
    return None if x is None or not math.isfinite(x) else float(x)


def _diff_dict(d: DiffStat) -> dict:
    return {
        "name": d.name, "component": d.component, "shape": list(d.shape), "reference": d.reference,
        "checkpoint": d.checkpoint, "dtype_reference": d.dtype_reference, "dtype": d.dtype, "numel": d.numel,
        "fraction_changed": _finite(d.fraction_changed), "rel_l2": _finite(d.rel_l2), "max_abs": _finite(d.max_abs),
        "skipped": d.skipped,
    }


def _tool_version() -> str:
    try:
        from importlib.metadata import version

        return f"deltazip {version('deltazip')}"
    except Exception:  # noqa: BLE001 - running from a source tree without install metadata
        return "deltazip 0+unknown"


def write_json_atomic(path: str | Path, doc: dict) -> Path:
    """Write one JSON document to ``path`` through a temp file in the same directory + rename."""
    path = Path(path)
    if not path.parent.is_dir():
        raise InputError(f"{path}: parent directory {path.parent} does not exist")
    try:
        return write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
    except OSError as e:
        if is_no_space(e):
            raise no_space_error(path, "--manifest", None) from None
        raise InputError(f"{path}: cannot write manifest ({e.strerror or e})") from e


def read_manifest(path: str | Path) -> dict:
    """Load a manifest written by :meth:`ScanResult.write_manifest`, checking format and version.

    Raises:
        InputError: unreadable file, not JSON, another format, or a version this code does not know.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a dedup manifest (invalid JSON: {e})") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{path}: not a dedup manifest (format is not {MANIFEST_FORMAT!r})")
    if doc.get("version") != MANIFEST_VERSION:
        raise InputError(f"{path}: dedup manifest version {doc.get('version')!r} is not supported "
                         f"(this deltazip reads version {MANIFEST_VERSION}); upgrade deltazip")
    for key in ("hash", "tensors", "checkpoints"):
        if key not in doc:
            raise InputError(f"{path}: dedup manifest lacks {key!r}")
    return doc


def collect_tensors(checkpoints: Sequence[CheckpointFiles]) -> list[TensorRef]:
    """Read every tensor table (no tensor bytes) of the resolved checkpoints.

    Done for ALL checkpoints before any hashing, so a corrupt file anywhere fails the scan at
    once with its name instead of after minutes of work. Names of diffusers components are
    qualified ``component/name``; a name in two files of one checkpoint is an error.
    """
    refs: list[TensorRef] = []
    for ci, ck in enumerate(checkpoints):
        seen: dict[str, Path] = {}
        for wf in ck.files:
            table = read_weight_table(wf)
            for name, e in sorted(table.items(), key=lambda kv: kv[1].start):
                q = f"{wf.component}/{name}" if wf.component else name
                if q in seen:
                    raise InputError(f"{ck.path}: tensor {q!r} appears in both {seen[q]} and {wf.path}")
                seen[q] = wf.path
                refs.append(TensorRef(ci, q, component_of(name, wf.component), wf.path, e.dtype, e.shape,
                                      e.start, e.end))
    return refs


def scan_checkpoints(paths: Sequence[str | Path], config: ScanConfig | None = None,
                     progress: ProgressFn | None = None) -> ScanResult:
    """Fingerprint every tensor of the given checkpoints and group identical ones.

    Args:
        paths: checkpoint arguments (see :func:`deltazip.formats.checkpoint_files.resolve_checkpoint`).
        config: options; defaults to xxh3, no size floor, no byte verification, diff stats on.
        progress: ``progress(phase, done_bytes, total_bytes)``, called from the calling thread.
    Returns:
        ScanResult; ``groups`` maps each fingerprint to the indices of its occurrences.
    Raises:
        InputError: a bad path or file, naming it (all headers are checked before hashing).
    """
    cfg = config or ScanConfig()
    t0 = time.perf_counter()
    if not paths:
        raise InputError("no checkpoints given")
    checkpoints = [resolve_checkpoint(p) for p in paths]
    refs = collect_tensors(checkpoints)
    todo = [i for i, r in enumerate(refs) if r.nbytes >= cfg.min_bytes]

    t1 = time.perf_counter()
    digests = _hash_all(refs, todo, cfg, progress)
    hash_seconds = time.perf_counter() - t1
    algo = hash_name(cfg.hash)
    groups: dict[TensorFingerprint, list[int]] = {}
    for i in todo:
        r = refs[i]
        r.fingerprint = TensorFingerprint(r.dtype, r.shape, algo, digests[i])
        groups.setdefault(r.fingerprint, []).append(i)

    res = ScanResult(cfg, checkpoints, refs, groups, hash_seconds=hash_seconds)
    if cfg.verify_bytes:
        _verify_groups(res, cfg, progress)
    if cfg.diff_stats:
        res.diffs = _diff_stats(refs, cfg.threads, progress)
    res.elapsed_seconds = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------- parallel byte reads

class _Work:
    """Shared state of one parallel phase: progress counter and a stop flag for fast failure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.stop = threading.Event()
        self.local = threading.local()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n

    def buffers(self, k: int = 1) -> list[memoryview]:
        """``k`` reusable per-thread read buffers of _CHUNK bytes (bytearray-backed)."""
        bufs = getattr(self.local, "bufs", None)
        if bufs is None or len(bufs) < k:
            bufs = self.local.bufs = [bytearray(_CHUNK) for _ in range(k)]
        return bufs


def _read_into(f, mv: memoryview, offset: int, path: Path, what: str) -> None:
    """Fill ``mv`` from ``offset`` of the open file ``f`` or raise an InputError naming both."""
    f.seek(offset)
    got = 0
    while got < len(mv):
        try:
            n = f.readinto(mv[got:])
        except OSError as e:
            raise InputError(f"{path}: read failed at {what} ({e.strerror or e})") from e
        if not n:
            raise InputError(f"{path}: file ends at byte {offset + got} inside {what} (truncated or changed "
                             "while scanning?)")
        got += n


def _open(path: Path):
    try:
        return open(path, "rb", buffering=0)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from e


def _run_pool(tasks: list[Callable[[], object]], work: _Work, threads: int, phase: str, total: int,
              progress: ProgressFn | None) -> list:
    """Run tasks on a thread pool, report progress from this thread, fail fast on the first error."""
    results: list = [None] * len(tasks)
    if progress:
        progress(phase, 0, total)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltazip-dedup") as ex:
        futs: dict[Future, int] = {ex.submit(t): k for k, t in enumerate(tasks)}
        pending = set(futs)
        try:
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                for fut in done:
                    results[futs[fut]] = fut.result()  # re-raises the worker's InputError here
                if progress:
                    progress(phase, work.done, total)
        except BaseException:
            work.stop.set()
            for fut in pending:
                fut.cancel()
            raise
    if progress:
        progress(phase, total, total)
    return results


def _hash_all(refs: list[TensorRef], todo: list[int], cfg: ScanConfig, progress: ProgressFn | None) -> dict[int, str]:
    """Digest of every tensor in ``todo``; units are one big tensor or a run of small ones."""
    by_file: dict[Path, list[int]] = {}
    for i in todo:
        by_file.setdefault(refs[i].file, []).append(i)
    units: list[list[int]] = []
    for idxs in by_file.values():
        idxs.sort(key=lambda i: refs[i].start)
        cur: list[int] = []
        for i in idxs:
            r = refs[i]
            if r.nbytes >= _BATCH_BYTES:
                units.append([i])
                continue
            if cur and r.end - refs[cur[0]].start > _BATCH_BYTES:
                units.append(cur)
                cur = []
            cur.append(i)
        if cur:
            units.append(cur)
    work = _Work()
    algo = cfg.hash

    def hash_unit(unit: list[int]) -> list[tuple[int, str]]:
        if work.stop.is_set():
            return []
        first = refs[unit[0]]
        buf = memoryview(work.buffers(1)[0])
        out = []
        with _open(first.file) as f:
            if len(unit) == 1 and first.nbytes >= _BATCH_BYTES:
                h = new_hasher(algo)
                off = first.start
                while off < first.end:
                    if work.stop.is_set():
                        return []
                    n = min(_CHUNK, first.end - off)
                    _read_into(f, buf[:n], off, first.file, f"tensor {first.name!r}")
                    h.update(buf[:n])
                    off += n
                    work.add(n)
                out.append((unit[0], h.hexdigest()))
            else:
                # One read covers the run of small tensors (and any padding between them).
                base, span = first.start, refs[unit[-1]].end - first.start
                what = f"tensor {first.name!r}" if len(unit) == 1 else f"tensors {first.name!r}..{refs[unit[-1]].name!r}"
                _read_into(f, buf[:span], base, first.file, what)
                for i in unit:
                    r = refs[i]
                    out.append((i, hash_bytes(buf[r.start - base:r.end - base], algo)))
                work.add(sum(refs[i].nbytes for i in unit))
        return out

    total = sum(refs[i].nbytes for i in todo)
    tasks = [lambda u=u: hash_unit(u) for u in units]
    digests: dict[int, str] = {}
    for part in _run_pool(tasks, work, cfg.threads, "hashing", total, progress):
        digests.update(part)
    return digests


def _same_bytes(a: TensorRef, b: TensorRef, work: _Work) -> bool:
    """Chunked byte comparison of two tensors' ranges (possibly in different files)."""
    if a.nbytes != b.nbytes:
        return False
    ba, bb = work.buffers(2)[:2]
    ma, mb = memoryview(ba), memoryview(bb)
    with _open(a.file) as fa, _open(b.file) as fb:
        off = 0
        while off < a.nbytes:
            n = min(_CHUNK, a.nbytes - off)
            _read_into(fa, ma[:n], a.start + off, a.file, f"tensor {a.name!r}")
            _read_into(fb, mb[:n], b.start + off, b.file, f"tensor {b.name!r}")
            # bytearray == bytearray is a memcmp; memoryview == memoryview compares item by item.
            same = ba == bb if n == _CHUNK else ma[:n].tobytes() == mb[:n].tobytes()
            work.add(2 * n)
            if not same:
                return False
            off += n
    return True


def _verify_groups(res: ScanResult, cfg: ScanConfig, progress: ProgressFn | None) -> None:
    """Split every multi-member group into byte-identical classes; count hash collisions."""
    work = _Work()
    refs = res.refs
    multi = [(fp, idxs) for fp, idxs in res.groups.items() if len(idxs) > 1]

    def split(idxs: list[int]) -> tuple[list[list[int]], int]:
        classes: list[list[int]] = []
        pairs = 0
        for i in idxs:
            for cls in classes:
                pairs += 1
                if _same_bytes(refs[cls[0]], refs[i], work):
                    cls.append(i)
                    break
            else:
                classes.append([i])
        return classes, pairs

    total = sum(2 * refs[i].nbytes for _, idxs in multi for i in idxs[1:])
    results = _run_pool([lambda ix=ix: split(ix) for _, ix in multi], work, cfg.threads, "verifying", total, progress)
    for (fp, _), (classes, pairs) in zip(multi, results):
        res.verified_pairs += pairs
        if len(classes) == 1:
            continue
        res.collisions += len(classes) - 1
        # Same hash, different bytes: keep the first class under the fingerprint, give the others
        # a distinguishing suffix so they stay separate unique tensors in the manifest.
        res.groups[fp] = classes[0]
        for k, cls in enumerate(classes[1:], start=1):
            alt = TensorFingerprint(fp.dtype, fp.shape, fp.algo, f"{fp.digest}-collision{k}")
            res.groups[alt] = cls
            for i in cls:
                refs[i].fingerprint = alt


# ------------------------------------------------------------------------------- difference stats

# dtype string -> (numpy storage dtype of the raw elements, accumulation dtype). Elements are
# decoded with numpy (single pass per op, GIL released, so pairs run on the thread pool): bf16 and
# float8 are widened with bit shifts / a table since numpy has no such types.
_DECODE: dict[str, tuple[str, str]] = {
    "F64": ("float64", "float64"), "F32": ("float32", "float32"), "F16": ("float16", "float32"),
    "BF16": ("uint16", "float32"), "F8_E4M3": ("uint8", "float32"), "F8_E5M2": ("uint8", "float32"),
    "I64": ("int64", "float64"), "I32": ("int32", "float64"), "I16": ("int16", "float32"), "I8": ("int8", "float32"),
    "U8": ("uint8", "float32"), "U16": ("uint16", "float32"), "U32": ("uint32", "float64"),
    "U64": ("uint64", "float64"), "BOOL": ("uint8", "float32"),
}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_E4M3_LUT: np.ndarray | None = None


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8 e4m3fn bit patterns (bias 7, no inf, 0x7f/0xff NaN)."""
    global _E4M3_LUT
    if _E4M3_LUT is None:
        b = np.arange(256, dtype=np.int32)
        sign = np.where(b & 0x80, -1.0, 1.0)
        exp, man = (b >> 3) & 0xF, b & 0x7
        val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
        val = np.where((exp == 15) & (man == 7), np.nan, val)
        _E4M3_LUT = (sign * val).astype(np.float32)
    return _E4M3_LUT


def _decode_into(dtype: str, raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Decode raw little-endian element bytes ``raw`` (uint8, n * itemsize) into ``out`` (n,)."""
    store = np.dtype(_DECODE[dtype][0])
    el = raw.view(store)
    if dtype == "BF16":  # bf16 is the top half of a float32
        np.left_shift(el, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif dtype == "F8_E5M2":  # e5m2 is the top half of a float16
        np.copyto(out, np.left_shift(el, 8, dtype=np.uint16).view(np.float16), casting="unsafe")
    elif dtype == "F8_E4M3":
        np.take(_e4m3_table(), el, out=out)
    else:
        np.copyto(out, el, casting="unsafe")
    return out


def _diff_pairs(refs: list[TensorRef]) -> list[tuple[int, int]]:
    """(reference, other) pairs: same name and shape, different fingerprint, reference = the
    earliest checkpoint holding that name with that shape."""
    first: dict[tuple[str, tuple[int, ...]], int] = {}
    pairs = []
    for i, r in enumerate(refs):
        if r.fingerprint is None:
            continue
        key = (r.name, r.shape)
        j = first.setdefault(key, i)
        if j != i and refs[j].checkpoint != r.checkpoint and refs[j].fingerprint != r.fingerprint:
            pairs.append((j, i))
    return pairs


def _diff_stats(refs: list[TensorRef], threads: int, progress: ProgressFn | None) -> list[DiffStat]:
    """Measure every differing same-name pair, chunk by chunk (bounded memory), pairs in parallel."""
    pairs = _diff_pairs(refs)
    if not pairs:
        return []
    work = _Work()

    def one(j: int, i: int) -> DiffStat:
        a, b = refs[j], refs[i]
        d = DiffStat(b.name, b.component, b.shape, a.checkpoint, b.checkpoint, a.dtype, b.dtype, math.prod(a.shape))
        if a.dtype not in _DECODE or b.dtype not in _DECODE:
            d.skipped = f"cannot decode dtype {a.dtype if a.dtype not in _DECODE else b.dtype}"
        elif not work.stop.is_set():
            _diff_one(a, b, d, work)
        work.add(a.nbytes + b.nbytes)
        return d

    total = sum(refs[i].nbytes + refs[j].nbytes for j, i in pairs)
    return _run_pool([lambda j=j, i=i: one(j, i) for j, i in pairs], work, threads, "comparing", total, progress)


def _diff_one(a: TensorRef, b: TensorRef, d: DiffStat, work: _Work) -> None:
    sa, sb = np.dtype(_DECODE[a.dtype][0]).itemsize, np.dtype(_DECODE[b.dtype][0]).itemsize
    acc = np.float64 if "float64" in (_DECODE[a.dtype][1], _DECODE[b.dtype][1]) else np.float32
    same_dtype = a.dtype == b.dtype
    # Per-thread scratch, reused across chunks and pairs (fresh pages would cost page faults).
    bufs = getattr(work.local, "diff", None)
    if bufs is None:
        bufs = work.local.diff = [np.empty(_DIFF_ELEMS * 8, dtype=np.uint8) for _ in range(2)] + \
            [np.empty(_DIFF_ELEMS, dtype=np.float64) for _ in range(3)]
    rawa, rawb, fa, fb, fd = bufs
    changed, ssd, ssr, mx = 0, 0.0, 0.0, 0.0
    with _open(a.file) as fa_, _open(b.file) as fb_:
        for e0 in range(0, d.numel, _DIFF_ELEMS):
            n = min(_DIFF_ELEMS, d.numel - e0)
            ra, rb = rawa[:n * sa], rawb[:n * sb]
            _read_into(fa_, memoryview(ra), a.start + e0 * sa, a.file, f"tensor {a.name!r}")
            _read_into(fb_, memoryview(rb), b.start + e0 * sb, b.file, f"tensor {b.name!r}")
            if same_dtype:
                # Bit patterns, so that -0.0 vs 0.0 or a changed NaN payload still count as changes.
                it = _UINT_OF_SIZE[sa]
                changed += int(np.count_nonzero(ra.view(it) != rb.view(it)))
            xa = _decode_into(a.dtype, ra, fa.view(acc)[:n])
            xb = _decode_into(b.dtype, rb, fb.view(acc)[:n])
            if not same_dtype:
                changed += int(np.count_nonzero(xa != xb))
            diff = np.subtract(xb, xa, out=fd.view(acc)[:n])
            ssd += float(np.dot(diff, diff))  # BLAS dot: one pass, blocked partial sums
            ssr += float(np.dot(xa, xa))
            if n:
                m = max(float(diff.max()), -float(diff.min()))
                mx = m if (m > mx or math.isnan(m)) else mx  # a NaN anywhere stays visible
    d.changed, d.sumsq_diff, d.sumsq_ref, d.max_abs = changed, ssd, ssr, mx
