"""The deltazip artifact (format version 2): ``manifest.json`` + safetensors containers.

See docs/format.md for the full description. In short, each tensor of the fine-tuned model has one
manifest entry whose ``kind`` says how to rebuild it from the base; each kind has one codec
(``deltazip.formats.codecs``) that owns its parts, checks and rebuild, and this module reaches kinds
only through that registry:

- ``packed``: a compressed linear delta (``deltazip.kernels.packed`` layout); the weight is
  ``base + delta`` when ``additive`` (ΔCompress, RTN) or the delta alone when not (SparseGPT on the
  full weights). ``transposed`` entries rebuild a Conv1D weight stored ``[in, out]``; ``experts``
  entries a fused ``[E, out, in]`` expert tensor whose experts' rows are stacked in the parts. The
  entry's ``scheme`` (``deltazip.kernels.scheme.DeltaScheme``, versioned) names the grid; v1/v2
  entries without it are read from their loose ``bits``/``group_size``/``sparsity``/``sym``.
- ``same``: bit-identical to the base tensor; nothing stored.
- ``dense_delta``: ``base + delta`` with the delta stored densely (fp16 unless the tensor is wider).
- ``full``: the fine-tuned tensor stored as it is (a tensor the base lacks or a changed shape).
- ``rows`` (v2): an embedding delta row by row: a bitmap of changed rows, and the changed rows
  group-quantized along the hidden dimension (``deltazip.formats.codecs.rows``).
- ``xor`` (v2): the exact XOR of the raw bits of fine-tune and base (``deltazip.formats.codecs.xor``).
- ``alias`` (v2): the same tensor as entry ``of`` (tied weights stored once).
- ``drop``: the delta was left out by ``--target-ratio``; rebuilt as the base tensor (lossy).

Readers read format version 1 too (it lacks the v2 kinds).

Optionally, a lossless stage stores parts as chunked GDeflate containers (``deltazip.formats.chunked``):
the entry then has ``codec: "gdeflate"`` and a ``lossless`` object with each compressed part's chunk
table; the reader decompresses transparently (CPU library on CPU, nvCOMP on a CUDA device).

Integrity: ``manifest.sha256`` holds the sha256 of ``manifest.json``'s bytes; ``files`` in the
manifest holds the size and sha256 of every other file. The reader checks the manifest on open and,
with ``check_tensors`` (default), each container file's size, sha256 and tensor list when it is first
opened, and the side files when ``hf_dir`` is asked for.

Writes go to a temporary sibling directory that is renamed into place at the end, so a half-written
artifact never looks valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltazip.formats import chunked, codecs, gdeflate
from deltazip.formats.atomic import apply_umask, remove_stale_siblings, temp_sibling
from deltazip.formats.checksum import sha256_file, sha256_tensors
from deltazip.formats.codecs import Entry, MatrixCodec
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.formats.outputs import check_output, is_no_space, no_space_error, replace_dir
from deltazip.formats.safetensors_raw import sort_metadata
from deltazip.formats.side_files import (
    SIDE_DIR,
    plain_name,
    side_file_dir,
    side_file_problems,
    side_file_record,
    side_file_table,
)
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.scheme import DeltaScheme

FORMAT_NAME = "deltazip"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
LOSSLESS = ("none", "gdeflate")
# The default: GDeflate where its library loads (every Linux install has it), else none. Measured in
# bench/lossless.py and docs/quality.md: it saves ≥ 10% of a ΔCompress artifact (most on the 2:4
# positions and the exact deltas' high bytes), decodes at GPU speed with nvCOMP at load time, and
# the tiered cache keeps decoded deltas in host memory, so no request waits on a decode twice.
LOSSLESS_DEFAULT = "auto"
CODECS = ("gdeflate",)
# A part is stored compressed only when that (container + its chunk table in the manifest) saves at
# least this fraction of its bytes: below it, decoding costs time on every load for next to nothing.
MIN_SAVING = 0.03
_SHARD_BYTES = 1 << 30


def resolve_lossless(value: str) -> str:
    """``"auto"`` -> ``"gdeflate"`` when nvCOMP's CPU GDeflate library loads, else ``"none"``;
    any other value is returned as it is (validated by the writer)."""
    if value != "auto":
        return value
    try:
        gdeflate.cpu_library()
    except gdeflate.CodecUnavailableError:
        return "none"
    return "gdeflate"


def stores_bytes(entry: dict[str, Any]) -> bool:
    """Whether an entry has stored parts (``file``, ``parts``, ``checksum``); ``same`` and ``alias`` do not."""
    return codecs.get(entry["kind"]).stores_bytes


def tool_version() -> str:
    try:
        return version("deltazip")
    except PackageNotFoundError:
        return "0+unknown"


def container_key(name: str, part: str, codec: str | None = None) -> str:
    """Name of one stored part of a tensor inside a safetensors container.

    ``NAME::PART`` for a part stored as it is; ``NAME::PART.gdeflate`` (a uint8 chunked container)
    for a part stored through the lossless stage. The distinct name makes a reader that does not
    know the ``codec`` field fail on a missing tensor instead of returning compressed bytes.
    """
    return f"{name}::{part}" + (f".{codec}" if codec else "")


def expected_keys(entry: dict[str, Any], name: str) -> dict[str, str]:
    """Container tensor name -> part name for one manifest entry."""
    lossless = entry.get("lossless") or {}
    return {container_key(name, p, entry.get("codec") if p in lossless else None): p for p in entry.get("parts") or []}


def default_filter(t: torch.Tensor) -> str:
    """The byte filter the writer uses for a part (measured in bench/lossless.py).

    Floating-point parts (scales, dense deltas, full tensors) get ``bytegroup``: their exponent
    bytes are far more repetitive than their mantissa bytes. Packed integer codes do not gain from
    it (every byte holds the same kind of code), so they get ``none``.
    """
    return "bytegroup" if t.dtype.is_floating_point and t.element_size() > 1 else "none"


class ArtifactWriter:
    """Collects tensors, writes sharded containers and the manifest, then renames into place.

    Use as a context manager; leaving it without ``finalize`` (or by an exception) removes
    everything written.

    Args:
        out_dir: artifact directory to create.
        overwrite: replace an existing ``out_dir`` (atomically, at ``finalize``).
        shard_bytes: start a new container file once this many stored bytes are pending.
        lossless: ``"none"``, ``"gdeflate"`` (parts stored as chunked GDeflate containers when
            that saves at least ``MIN_SAVING`` of their bytes) or ``"auto"`` (``resolve_lossless``).
        lossless_level: GDeflate level 0..12.
    """

    def __init__(self, out_dir: str | Path, overwrite: bool = False, shard_bytes: int = _SHARD_BYTES,
                 lossless: str = "none", lossless_level: int = gdeflate.DEFAULT_LEVEL, option: str = "--out"):
        lossless = resolve_lossless(lossless)
        if lossless not in LOSSLESS:
            raise InputError(f"unknown lossless stage {lossless!r}; use one of auto, {', '.join(LOSSLESS)}")
        try:
            gdeflate.check_level(lossless_level)
        except ValueError as e:
            raise InputError(f"--lossless-level: {e}") from e
        if lossless == "gdeflate":
            gdeflate.cpu_library()  # fail now, not after hours of compression
        self.lossless, self.lossless_level = lossless, lossless_level
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise InputError(f"output directory {self.out_dir} already exists; pass --overwrite to replace it")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise InputError(f"output path {self.out_dir} exists and is not a directory")
        self.overwrite, self.option = overwrite, option
        remove_stale_siblings(self.out_dir)  # temporaries of killed writers of the same output
        self.tmp = temp_sibling(self.out_dir)
        self.tmp.mkdir(parents=True)
        self.shard_bytes = shard_bytes
        self.entries: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_names: list[str] = []
        self._pending_bytes = 0
        self._shards = 0
        self._done = False
        self.side_files: dict[str, dict[str, Any]] = {}  # name -> sha256, bytes, source (docs/format.md)

    # -- adding tensors -------------------------------------------------------------------------
    def add_packed(self, name: str, delta: PackedDelta, dtype: torch.dtype, additive: bool, sym: bool | None = None,
                   transposed: bool = False, experts: int = 0) -> None:
        """A compressed linear (``[out, in]`` weight of fine-tuned ``dtype``) of kind ``packed``.

        Args:
            sym: if given, must agree with ``delta.scheme.sym`` (zero points stored or not).
            transposed: the checkpoint stores the weight ``[in, out]`` (GPT-2's ``Conv1D``); the
                entry's ``shape`` stays ``[out, in]`` and gets ``"transposed": true``.
            experts: E > 0 for a fused expert tensor ``[E, out, in]``: ``delta`` holds the E experts'
                ``[out, in]`` matrices stacked along rows (``[E*out, in]``); the entry's ``shape`` is
                ``[E, out, in]`` and it gets ``"experts": E``.
        """
        if sym is not None and sym != delta.scheme.sym:
            raise ValueError(f"{name}: sym={sym}, but the delta's scheme says sym={delta.scheme.sym}")
        entry, parts = codecs.get("packed").encode_delta(delta, dtype, additive, transposed, experts, name)
        self._add(name, entry, parts)

    def add_matrix(self, name: str, scheme: DeltaScheme, parts: dict[str, torch.Tensor], shape: list[int],
                   dtype: torch.dtype, additive: bool, transposed: bool = False, experts: int = 0) -> None:
        """A compressed linear of any matrix kind (``scheme.kind``): ``parts`` as its codec's ``encode``
        made them, ``shape`` ``[out, in]`` (``[E, out, in]`` for fused experts), orientation as
        :meth:`add_packed`."""
        codec = codecs.get(scheme.kind)
        if not isinstance(codec, MatrixCodec):
            raise ValueError(f"{name}: {scheme.kind!r} is not a compressed-linear kind")
        self._add(name, codec.fields(scheme, list(shape), dtype, additive, transposed, experts), parts)

    def add_file(self, src: str | Path, arcname: str, base_dir: str | Path | None = None) -> None:
        """Keep a small side file (config, tokenizer) with the artifact.

        Args:
            src: the fine-tune's file.
            arcname: its name among the side files (relative POSIX path).
            base_dir: the base model's directory. When it holds a file ``arcname`` byte-identical to
                ``src``, nothing is copied: the manifest's ``side_files`` records the file as
                ``source: "base"`` and readers take it from the base (checked). Otherwise (or
                without ``base_dir``) the file is copied under ``hf/`` (``source: "artifact"``).
        """
        if not plain_name(arcname):
            raise ValueError(f"side file name {arcname!r} is not a relative path")
        if arcname in self.side_files:
            raise ValueError(f"side file {arcname} added twice")
        data = Path(src).read_bytes()
        ref = Path(base_dir) / arcname if base_dir is not None else None
        if ref is not None and ref.is_file() and ref.stat().st_size == len(data) and ref.read_bytes() == data:
            self.side_files[arcname] = side_file_record(data, "base")
            return
        dst = self.tmp / SIDE_DIR / arcname
        with self._no_space(len(data)):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        self.side_files[arcname] = side_file_record(data, "artifact")

    def add_file_reference(self, arcname: str, info: dict[str, Any]) -> None:
        """Record a side file kept by reference to the base (``info``: its ``side_files`` entry from
        another artifact, for ``pack``/``unpack``)."""
        if not plain_name(arcname) or arcname in self.side_files:
            raise ValueError(f"side file {arcname!r} is not a relative path or was added twice")
        self.side_files[arcname] = {"sha256": info["sha256"], "bytes": info["bytes"], "source": "base"}

    def add_same(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A tensor bit-identical to the base's: no bytes stored."""
        self.entries[name] = codecs.get("same").fields(shape, dtype)

    def add_drop(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A tensor whose delta was left out (``--target-ratio``): rebuilt as the base's, no bytes stored."""
        self.entries[name] = codecs.get("drop").fields(shape, dtype)

    def add_dense_delta(self, name: str, delta: torch.Tensor, dtype: torch.dtype) -> None:
        """``base + delta`` stored densely; ``delta`` in its storage dtype (e.g. fp16)."""
        self._add(name, codecs.get("dense_delta").fields(delta, dtype), {"delta": delta})

    def add_full(self, name: str, tensor: torch.Tensor) -> None:
        """The fine-tuned tensor stored as it is."""
        self._add(name, codecs.get("full").fields(tensor), {"data": tensor})

    def add_rows(self, name: str, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
                 bits: int, group_size: int, max_abs_err: float) -> None:
        """An embedding delta row by row (``deltazip.formats.codecs.rows`` parts); ``max_abs_err`` is the
        largest element error the encoder measured against the exact float32 delta."""
        entry = codecs.get("rows").fields(shape, dtype, bits, group_size, int(parts["qweight"].shape[0]), max_abs_err)
        self._add(name, entry, parts)

    def add_xor(self, name: str, xor: torch.Tensor, dtype: torch.dtype) -> None:
        """``bits(ft) ^ bits(base)`` (``deltazip.formats.codecs.xor``): exact in any dtype."""
        self._add(name, codecs.get("xor").fields(xor.shape, dtype), {"xor": xor})

    def add_alias(self, name: str, of: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A tensor equal to entry ``of`` (tied weights): no bytes stored."""
        self.entries[name] = codecs.get("alias").fields(of, shape, dtype)

    def stored_size(self, parts: dict[str, torch.Tensor]) -> int:
        """Bytes ``parts`` would take in a container (after the lossless stage), without storing them:
        used to pick the smallest of several exact encodings."""
        parts = {k: v.detach().contiguous().cpu() for k, v in parts.items()}
        return sum(t.numel() * t.element_size() for t in self._store({}, parts).values())

    def entry_size(self, name: str, entry: dict[str, Any], parts: dict[str, torch.Tensor],
                   sample_bytes: int = 0, rows_scale: float = 1.0) -> int:
        """Bytes that adding entry ``name`` would add to the artifact, without adding it: its parts in the
        containers (after the lossless stage), their keys in the container header, and its manifest entry
        (chunk tables included). Used by the byte allocator (deltazip.compress.sensitivity).

        Args:
            entry: the entry's manifest fields before storage (a codec's ``fields``).
            parts: its tensors (empty for kinds that store nothing).
            sample_bytes: when > 0, a part larger than this is estimated from evenly spread rows (their
                lossless ratio and chunk table scaled to the whole part).
            rows_scale: ``parts`` hold a sample of the rows: the real parts have this many times more.
        """
        entry = dict(entry)
        if parts:
            entry.update(parts=list(parts), checksum="sha256:" + "0" * 64, file="deltas-00001.safetensors")
            container, meta, header = 0, {}, 0
            for part, t in parts.items():
                got, m = self._part_size(t.detach().contiguous().cpu(), sample_bytes, rows_scale)
                container += got
                header += len(container_key(name, part, "gdeflate" if m else None)) + 56 + 6 * t.dim()
                if m:
                    meta[part] = m
            if meta:
                entry.update(codec="gdeflate", lossless=meta)
            entry["stored_bytes"] = container
        else:
            container = header = 0
        text = json.dumps({name: entry}, separators=(",", ":"), ensure_ascii=False)
        return container + header + len(text.encode()) - 1

    def _part_size(self, t: torch.Tensor, sample_bytes: int, rows_scale: float) -> tuple[int, dict[str, Any] | None]:
        """``(stored bytes, lossless metadata or None)`` of a part that is ``rows_scale`` times ``t``'s rows;
        evenly spread rows of ``t`` stand for it when ``t`` is over ``sample_bytes``."""
        raw = t.numel() * t.element_size()
        full = raw * rows_scale
        if sample_bytes and raw > sample_bytes and t.dim() >= 1 and t.shape[0] > 1:
            k = max(1, t.shape[0] * sample_bytes // raw)  # rows spread over the part: leading rows are atypical
            t = t[torch.linspace(0, t.shape[0] - 1, k).round().long()].contiguous()
        scale = full / max(t.numel() * t.element_size(), 1)
        stored = self._store(e := {}, {"p": t})
        got = sum(v.numel() * v.element_size() for v in stored.values())
        m = e.get("lossless", {}).get("p")
        if m is not None and scale != 1.0:
            n = max(1, -(-int(full) // m["chunk_bytes"]))
            m = {**m, "chunks": (m["chunks"] * (n // len(m["chunks"]) + 1))[:n]}
        return round(got * scale), m

    def add_entry(self, name: str, entry: dict[str, Any], parts: dict[str, torch.Tensor]) -> None:
        """Re-add an entry read from another artifact (``pack``/``unpack``): ``entry`` is its manifest
        entry, ``parts`` its decoded parts. Storage fields are recomputed; the checksum must match."""
        entry = {k: v for k, v in entry.items() if k not in ("file", "parts", "checksum", "stored_bytes", "codec",
                                                              "lossless")}
        if not stores_bytes(entry):
            self.entries[name] = {**entry, "stored_bytes": 0}
            return
        self._add(name, entry, parts)

    def _add(self, name: str, entry: dict[str, Any], parts: dict[str, torch.Tensor]) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} added twice")
        parts = {k: v.detach().contiguous().cpu() for k, v in parts.items()}
        entry["parts"] = list(parts)
        entry["checksum"] = sha256_tensors(*parts.values())
        stored = self._store(entry, parts)
        entry["stored_bytes"] = sum(t.numel() * t.element_size() for t in stored.values())
        self.entries[name] = entry
        for key, t in stored.items():
            self._pending[container_key(name, *key)] = t
        self._pending_names.append(name)
        self._pending_bytes += entry["stored_bytes"]
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _store(self, entry: dict[str, Any], parts: dict[str, torch.Tensor]) -> dict[tuple, torch.Tensor]:
        """What goes into the container for each part: ``(part,)`` raw or ``(part, codec)`` compressed."""
        stored: dict[tuple, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for part, t in parts.items():
            raw = t.numel() * t.element_size()
            if self.lossless == "gdeflate" and raw:
                blob, m = chunked.encode(t, self.lossless_level, default_filter(t))
                # Count the chunk table the manifest gains too: tiny parts do not pay for it.
                if blob.size + len(json.dumps(m)) <= raw * (1 - MIN_SAVING):
                    stored[(part, "gdeflate")] = torch.from_numpy(blob)
                    meta[part] = m
                    continue
            stored[(part,)] = t
        if meta:
            entry["codec"] = "gdeflate"
            entry["lossless"] = meta
        return stored

    def _flush(self) -> None:
        if not self._pending:
            return
        self._shards += 1
        fname = f"deltas-{self._shards:05d}.safetensors"
        with self._no_space(self._pending_bytes):
            save_file(self._pending, str(self.tmp / fname), metadata={"format": FORMAT_NAME,
                                                                       "format_version": str(FORMAT_VERSION)})
            sort_metadata(self.tmp / fname)  # the same inputs give the same bytes (its docstring)
        for name in self._pending_names:
            self.entries[name]["file"] = fname
        self._pending, self._pending_names, self._pending_bytes = {}, [], 0

    # -- finishing ------------------------------------------------------------------------------
    def finalize(self, **fields: Any) -> Path:
        """Write containers and ``manifest.json`` (with ``fields`` merged in) and move into place."""
        self._flush()
        files = {}
        for p in sorted(q for q in self.tmp.rglob("*") if q.is_file()):
            files[p.relative_to(self.tmp).as_posix()] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "tool_version": tool_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **fields,
            **({"side_files": dict(sorted(self.side_files.items()))} if self.side_files else {}),
            "files": files,
            "tensors": self.entries,
        }
        # Compact: the manifest counts toward the artifact's bytes (indentation was ~1/3 of it, ~0.5% of a
        # SmolLM2 artifact); `deltazip inspect --json` or `jq .` print it readably.
        text = json.dumps(manifest, separators=(",", ":"), ensure_ascii=False).encode()
        for fname, data in ((MANIFEST, text), (MANIFEST_SUM, f"sha256:{hashlib.sha256(text).hexdigest()}\n".encode())):
            with self._no_space(len(data)), open(self.tmp / fname, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        apply_umask(self.tmp)
        replace_dir(self.tmp, self.out_dir)
        self._done = True
        return self.out_dir

    @contextlib.contextmanager
    def _no_space(self, pending: int):
        """A full disk while writing becomes one line naming the output and the bytes it needed (the
        ones written so far plus ``pending``); the caller's ``with`` removes what was written."""
        try:
            yield
        except Exception as e:
            if not is_no_space(e):
                raise
            written = sum(p.stat().st_size for p in self.tmp.rglob("*") if p.is_file())
            raise no_space_error(self.out_dir, self.option, written + pending) from None

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()


class Artifact:
    """Read side of an artifact: validated manifest, integrity-checked lazy tensor access.

    Args:
        path: artifact directory.
        check_tensors: check integrity as data is read (default on: a corrupt artifact must never
            yield wrong weights): each container file's size and sha256 against the manifest when it
            is first opened, and the side files' when ``hf_dir`` is called. The tensor list of every
            opened container is always compared with the manifest, and lossless containers always
            check their compressed bytes before decoding and (on CPU) their decoded bytes.
        device: default target of ``parts``/``packed``: None (CPU) or a CUDA device, where
            lossless parts are decoded by nvCOMP straight into device memory.
    """

    def __init__(self, path: str | Path, check_tensors: bool = True, device: torch.device | str | None = None):
        self.path = Path(path)
        self.check_tensors = check_tensors
        self.device = torch.device(device) if device is not None else None
        self.manifest = load_manifest(self.path)
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        self._handles: dict[str, Any] = {}
        self._hf_checked = False
        self._keys: dict[str, dict[str, tuple[str, str]]] = {}
        for name, e in self.tensors.items():
            if stores_bytes(e):
                for key, part in expected_keys(e, name).items():
                    self._keys.setdefault(e["file"], {})[key] = (name, part)

    # -- metadata -------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config", {})

    @property
    def lineage(self) -> dict[str, Any]:
        return self.manifest.get("lineage", {})

    @property
    def lossless(self) -> str:
        """``"gdeflate"`` when any tensor is stored through the lossless stage, else ``"none"``."""
        return "gdeflate" if any(e.get("codec") for e in self.tensors.values()) else "none"

    def entry(self, name: str) -> Entry:
        """The typed entry of tensor ``name`` (kind, scheme, additive, shapes...)."""
        if name not in self.tensors:
            raise ArtifactError(f"{self.path}: no tensor {name!r} in the manifest")
        return Entry(name, self.tensors[name])

    def entries(self) -> dict[str, Entry]:
        """Every typed entry, in manifest order."""
        return codecs.entries(self.tensors)

    def nbytes(self) -> int:
        """Bytes of every file in the artifact directory."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def hf_dir(self) -> Path:
        """Folder of the fine-tuned model's config and tokenizer files copied into the artifact.

        Side files kept by reference to the base are not there: readers that need every side file
        use :meth:`side_file_dir`. With ``check_tensors``, the first call checks every listed side
        file's size and sha256 and that no unlisted file sits there.
        """
        d = self.path / SIDE_DIR
        if self.check_tensors and not self._hf_checked:
            files = self.manifest["files"]
            for rel, info in files.items():
                if rel.startswith("hf/"):
                    problem = file_problem(self.path, rel, info)
                    if problem:
                        raise ArtifactError(f"{self.path / rel}: {problem}; the artifact is corrupt (run `deltazip verify`)")
            if d.is_dir():
                for p in sorted(d.rglob("*")):
                    if p.is_file() and p.relative_to(self.path).as_posix() not in files:
                        raise ArtifactError(f"{p}: file not listed in the manifest; the artifact was altered")
            self._hf_checked = True
        return d

    @property
    def side_files(self) -> dict[str, dict[str, Any]]:
        """Every side file: name -> ``sha256``, ``bytes``, ``source`` (``"artifact"``: copied under
        ``hf/``; ``"base"``: kept by reference to the base model's file of that name)."""
        return side_file_table(self.manifest)

    def side_file_dir(self, base_dir: str | Path | None) -> Path:
        """A directory holding every side file (``hf/`` itself when nothing is referenced); the
        referenced ones come from ``base_dir``, checked (``deltazip.formats.side_files``).

        Raises:
            InputError: a referenced file is missing from ``base_dir`` or differs (pass the right --base).
        """
        return side_file_dir(self, base_dir)

    # -- tensor access --------------------------------------------------------------------------
    def _handle(self, fname: str):
        if fname not in self._handles:
            fpath = self.path / fname
            if not fpath.is_file():
                raise ArtifactError(f"{self.path}: container file {fname} is missing; the artifact is incomplete")
            if self.check_tensors:
                problem = file_problem(self.path, fname, self.manifest["files"].get(fname))
                if problem:
                    raise ArtifactError(f"{fpath}: {problem}; the artifact is corrupt (run `deltazip verify`)")
            try:
                h = safe_open(str(fpath), framework="pt")
                keys = set(h.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ArtifactError(f"{fpath}: cannot open container ({e}); run `deltazip verify`") from e
            want = self._keys.get(fname, {})
            missing = sorted(k for k in want if k not in keys)
            if missing:
                name, part = want[missing[0]]
                raise ArtifactError(f"{fpath}: the manifest lists tensor {name!r} (part {part!r}, stored as "
                                    f"{missing[0]!r}) but the container lacks it"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            extra = sorted(keys - set(want))
            if extra:
                raise ArtifactError(f"{fpath}: the container holds tensor {extra[0]!r}, which the manifest does not "
                                    "list" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
            self._handles[fname] = h
        return self._handles[fname]

    def parts(self, name: str, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Stored tensors of one entry, decoded and integrity-checked, on ``device``.

        Args:
            name: tensor name.
            device: target (default: the Artifact's ``device``, else CPU). Lossless parts decode
                with the CPU library on CPU and with nvCOMP on a CUDA device.
        Returns:
            part name -> tensor in its stored dtype and shape (see docs/format.md).
        """
        e = self.entry(name).raw
        if not e.get("parts"):
            return {}
        dev = torch.device(device) if device is not None else self.device
        cuda = dev is not None and dev.type == "cuda"
        fpath = self.path / e["file"]
        h = self._handle(e["file"])
        lossless = e.get("lossless") or {}
        out = {}
        for part in e["parts"]:
            codec = e.get("codec") if part in lossless else None
            key = container_key(name, part, codec)
            try:
                t = h.get_tensor(key)
            except Exception as err:
                raise ArtifactError(f"{fpath}: tensor {key!r} cannot be read ({err})") from err
            if codec:
                try:
                    # On a GPU the decoded bytes stay there; their integrity rests on the compressed
                    # bytes' checksum (checked before decoding) and the file's sha256.
                    t = chunked.decode(lossless[part], t, device=dev if cuda else None, verify=not cuda)
                except chunked.ContainerError as err:
                    raise ArtifactError(f"{fpath}: tensor {name!r} part {part!r}: {err}; run `deltazip verify`") from err
                except gdeflate.CodecUnavailableError as err:
                    raise ArtifactError(f"{fpath}: tensor {name!r} is GDeflate-compressed: {err}") from err
            if cuda:
                t = t.to(dev)
            out[part] = t
        return out

    def packed(self, name: str, device: torch.device | str | None = None) -> PackedDelta:
        """The PackedDelta of a ``packed`` entry (on ``device``, see ``parts``)."""
        entry = self.entry(name)
        if entry.kind != "packed":
            raise ArtifactError(f"tensor {name!r} is {entry.kind}, not packed")
        return entry.codec.read(self, entry, device)

    def reconstruct(self, name: str, base: torch.Tensor | None) -> torch.Tensor:
        """The fine-tuned tensor as the compressor produced it, in its stored dtype (its codec's rebuild).

        Args:
            name: tensor name.
            base: the base model's tensor of that name (unused for ``full`` and non-additive entries).
                The result is on ``base``'s device (else the Artifact's ``device``, else CPU).
        """
        entry = self.entry(name)
        dev = base.device if base is not None else self.device
        return entry.codec.reconstruct(self, entry, base if entry.needs_base else None, dev)


def file_problem(root: Path, rel: str, info: Any) -> str | None:
    """Why file ``rel`` of an artifact does not match its ``files`` entry (None when it does)."""
    p = root / rel
    if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or not isinstance(info.get("sha256"), str):
        return "not listed in the manifest's 'files' (or listed without bytes/sha256)"
    if not p.is_file():
        return "missing"
    size = p.stat().st_size
    if size != info["bytes"]:
        return f"is {size} bytes, the manifest says {info['bytes']} (truncated or altered)"
    if sha256_file(p) != info["sha256"]:
        return "sha256 differs from the manifest"
    return None


def manifest_sum_problem(path: Path, raw: bytes) -> str | None:
    """Why ``manifest.json``'s bytes do not match ``manifest.sha256`` (None when they do or when the
    artifact predates the sidecar)."""
    spath = path / MANIFEST_SUM
    if not spath.exists():
        return None
    want = spath.read_bytes().decode("ascii", errors="replace").strip()
    if want != f"sha256:{hashlib.sha256(raw).hexdigest()}":
        return f"{MANIFEST} does not match {MANIFEST_SUM} (corrupt or edited manifest)"
    return None


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and validate ``manifest.json``: its checksum, format name, version, fields and types."""
    if not path.exists():
        raise InputError(f"{path}: no such artifact directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{path}: not a deltazip artifact (no {MANIFEST})")
    raw = mpath.read_bytes()
    problem = manifest_sum_problem(path, raw)
    if problem:
        raise ArtifactError(f"{path}: {problem}")
    try:
        m = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: corrupt manifest (invalid JSON: {e})") from e
    problems = manifest_problems(m)
    if problems:
        raise ArtifactError(f"{mpath}: {problems[0]}")
    return m


def manifest_problems(m: Any) -> list[str]:
    """Schema problems of a manifest dict (empty when it is sound)."""
    out = header_problems(m)
    if out:
        return out
    for name, e in m["tensors"].items():
        out += entry_problems(name, e, m["files"])
    return out + side_file_problems(m)


def header_problems(m: Any) -> list[str]:
    """Problems of the manifest's format, version and top-level fields; any one makes the rest
    of the manifest unreadable."""
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        return ["not a deltazip manifest (field 'format' is not 'deltazip')"]
    v = m.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool):
        return ["manifest has no integer 'format_version'"]
    if v > FORMAT_VERSION:
        return [f"format version {v} is newer than this deltazip understands ({FORMAT_VERSION}); upgrade deltazip"]
    if v < 1:
        return [f"unknown format version {v}"]
    return [f"manifest field {key!r} missing or not a {typ.__name__}"
            for key, typ in (("files", dict), ("tensors", dict), ("lineage", dict), ("config", dict))
            if not isinstance(m.get(key), typ)]


def entry_problems(name: str, e: Any, files: dict[str, Any]) -> list[str]:
    """Problems of one tensor entry (empty when it is sound): the fields every kind has, then the
    kind's own (its codec's ``field_problems``)."""
    if not isinstance(e, dict) or e.get("kind") not in codecs.kinds():
        return [f"tensor {name!r}: unknown kind {e.get('kind') if isinstance(e, dict) else e!r}"]
    out = []
    if (not isinstance(e.get("shape"), list) or not all(isinstance(s, int) and s >= 0 for s in e["shape"])
            or not isinstance(e.get("dtype"), str)):
        out.append(f"tensor {name!r}: missing or invalid shape or dtype")
    elif not isinstance(getattr(torch, e["dtype"], None), torch.dtype):
        out.append(f"tensor {name!r}: unknown dtype {e['dtype']!r}")
    codec = codecs.get(e["kind"])
    if codec.stores_bytes:
        if e.get("file") not in files:
            out.append(f"tensor {name!r}: container file {e.get('file')!r} is not listed in 'files'")
        if (not isinstance(e.get("parts"), list) or not all(isinstance(p, str) for p in e["parts"])
                or not isinstance(e.get("checksum"), str)):
            return out + [f"tensor {name!r}: missing parts or checksum"]
    out += codec.field_problems(name, e)
    return out + _codec_problems(name, e)


def _codec_problems(name: str, e: dict[str, Any]) -> list[str]:
    """Problems of an entry's lossless fields (``codec``, ``lossless``)."""
    if "codec" not in e and "lossless" not in e:
        return []
    codec = e.get("codec")
    if codec not in CODECS:
        return [f"tensor {name!r}: codec {codec!r} is unknown to this deltazip (it knows {', '.join(CODECS)}); "
                "upgrade deltazip"]
    table = e.get("lossless")
    if not stores_bytes(e) or not isinstance(table, dict) or not table:
        return [f"tensor {name!r}: codec {codec!r} without a 'lossless' table of its compressed parts"]
    out = []
    for part, meta in table.items():
        if part not in e["parts"]:
            out.append(f"tensor {name!r}: lossless part {part!r} is not one of its parts")
            continue
        try:
            chunked.Container.from_json(meta)
        except chunked.ContainerError as err:
            out.append(f"tensor {name!r} part {part!r}: {err}")
    return out


def repack(src: str | Path, dst: str | Path | None = None, lossless: str = "gdeflate",
           level: int = gdeflate.DEFAULT_LEVEL, overwrite: bool = False, progress=None) -> dict[str, Any]:
    """Add (``lossless="gdeflate"``) or remove (``"none"``) the lossless stage of an artifact.

    Every tensor is read (decoded and integrity-checked), then written again through an
    ``ArtifactWriter``; nothing is recompressed lossily, so every entry keeps its checksum (checked).
    The result replaces ``dst`` atomically; ``dst`` defaults to ``src`` (in place).

    Args:
        src: artifact to read.
        dst: artifact to write (default: ``src``).
        lossless: "gdeflate" or "none".
        level: GDeflate level 0..12.
        overwrite: allow replacing an existing ``dst`` other than ``src``.
        progress: optional ``progress(description, done, total)`` callback.
    Returns:
        ``{"artifact", "source", "lossless", "level", "bytes_before", "bytes_after", "tensors",
        "lossless_parts", "seconds", "changed"}``.
    """
    t0 = time.time()
    src = Path(src)
    art = Artifact(src)
    if dst is not None:  # in place (no --out, or --out ARTIFACT itself) is what pack/unpack are for
        check_output(dst, "--out", [("ARTIFACT", src)], overwrite, kind="dir", allow_same=True)
    same_dir = dst is None or Path(dst).resolve() == src.resolve()
    dst = src if dst is None else Path(dst)
    before = art.nbytes()
    report = {"artifact": str(dst), "source": str(src), "lossless": lossless,
              "level": level if lossless != "none" else None, "bytes_before": before, "tensors": len(art.tensors)}
    if same_dir and lossless == "none" and art.lossless == "none":
        return {**report, "bytes_after": before, "lossless_parts": 0, "seconds": round(time.time() - t0, 3),
                "changed": False}
    names = list(art.tensors)
    with ArtifactWriter(dst, overwrite=overwrite or same_dir, lossless=lossless, lossless_level=level) as w:
        for i, name in enumerate(names):
            e = art.tensors[name]
            w.add_entry(name, e, art.parts(name) if stores_bytes(e) else {})
            if stores_bytes(e) and w.entries[name]["checksum"] != e["checksum"]:
                raise ArtifactError(f"{src / e['file']}: tensor {name!r} decodes to bytes whose checksum differs "
                                    "from the manifest; the artifact is corrupt (run `deltazip verify`)")
            if progress:
                progress("repacking tensors", i + 1, len(names))
        hf = art.hf_dir()
        if hf.is_dir():
            for f in sorted(p for p in hf.rglob("*") if p.is_file()):
                w.add_file(f, f.relative_to(hf).as_posix())
        for name, info in art.side_files.items():
            if info["source"] == "base":  # stays a reference: the base is not needed to repack
                w.add_file_reference(name, info)
        n_lossless = sum(len(e.get("lossless") or {}) for e in w.entries.values())
        fields = {k: v for k, v in art.manifest.items()
                  if k not in ("format", "format_version", "tool_version", "created", "files", "tensors", "side_files")}
        out = w.finalize(**fields)
    return {**report, "bytes_after": Artifact(out).nbytes(), "lossless_parts": n_lossless,
            "seconds": round(time.time() - t0, 3), "changed": True}
