"""The deltazip artifact (format version 1): ``manifest.json`` + safetensors containers.

See docs/format.md for the full description. In short, each tensor of the fine-tuned model has one
manifest entry whose ``kind`` says how to rebuild it from the base:

- ``packed``: a compressed linear delta (``deltazip.kernels.packed`` layout); the weight is
  ``base + delta`` when ``additive`` (ΔCompress, RTN) or the delta alone when not (SparseGPT on the
  full weights).
- ``same``: bit-identical to the base tensor; nothing stored.
- ``dense_delta``: ``base + delta`` with the delta stored densely (fp16 unless the tensor is wider).
- ``full``: the fine-tuned tensor stored as it is (a tensor the base lacks or a changed shape).

Writes go to a temporary sibling directory that is renamed into place at the end, so a half-written
artifact never looks valid.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deltazip.formats.checksum import sha256_file, sha256_tensors
from deltazip.formats.errors import ArtifactError, InputError
from deltazip.kernels.packed import PackedDelta
from deltazip.kernels.reference import delta_weight

FORMAT_NAME = "deltazip"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KINDS = ("packed", "same", "dense_delta", "full")
PACKED_PARTS = ("qweight", "positions", "scales", "zeros")
_SHARD_BYTES = 1 << 30


def tool_version() -> str:
    try:
        return version("deltazip")
    except PackageNotFoundError:
        return "0+unknown"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float16 -> 'float16'."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in manifest")
    return dt


def container_key(name: str, part: str) -> str:
    """Name of one stored part of a tensor inside a safetensors container."""
    return f"{name}::{part}"


class ArtifactWriter:
    """Collects tensors, writes sharded containers and the manifest, then renames into place.

    Use as a context manager; leaving it without ``finalize`` (or by an exception) removes
    everything written.
    """

    def __init__(self, out_dir: str | Path, overwrite: bool = False, shard_bytes: int = _SHARD_BYTES):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise InputError(f"output directory {self.out_dir} already exists; pass --overwrite to replace it")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise InputError(f"output path {self.out_dir} exists and is not a directory")
        self.overwrite = overwrite
        self.tmp = self.out_dir.parent / f".{self.out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        self.tmp.mkdir(parents=True)
        self.shard_bytes = shard_bytes
        self.entries: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_names: list[str] = []
        self._pending_bytes = 0
        self._shards = 0
        self._done = False

    # -- adding tensors -------------------------------------------------------------------------
    def add_packed(self, name: str, delta: PackedDelta, dtype: torch.dtype, additive: bool, sym: bool) -> None:
        """A compressed linear (``[out, in]`` weight of fine-tuned ``dtype``)."""
        delta.validate()
        parts = {"qweight": delta.qweight, "positions": delta.positions, "scales": delta.scales,
                 "zeros": delta.zeros}
        entry = {
            "kind": "packed", "shape": [delta.out_features, delta.in_features], "dtype": dtype_name(dtype),
            "bits": delta.bits, "group_size": delta.group_size, "sym": sym,
            "sparsity": "2:4" if delta.sparse else "none", "additive": additive,
        }
        self._add(name, entry, {k: v for k, v in parts.items() if v is not None})

    def add_file(self, src: str | Path, arcname: str) -> None:
        """Copy a small side file (config, tokenizer) into the artifact under ``hf/``."""
        dst = self.tmp / "hf" / arcname
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)

    def add_same(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A tensor bit-identical to the base's: no bytes stored."""
        self.entries[name] = {"kind": "same", "shape": list(shape), "dtype": dtype_name(dtype), "stored_bytes": 0}

    def add_dense_delta(self, name: str, delta: torch.Tensor, dtype: torch.dtype) -> None:
        """``base + delta`` stored densely; ``delta`` in its storage dtype (e.g. fp16)."""
        entry = {"kind": "dense_delta", "shape": list(delta.shape), "dtype": dtype_name(dtype),
                 "delta_dtype": dtype_name(delta.dtype)}
        self._add(name, entry, {"delta": delta})

    def add_full(self, name: str, tensor: torch.Tensor) -> None:
        """The fine-tuned tensor stored as it is."""
        entry = {"kind": "full", "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}
        self._add(name, entry, {"data": tensor})

    def _add(self, name: str, entry: dict[str, Any], parts: dict[str, torch.Tensor]) -> None:
        if name in self.entries:
            raise ValueError(f"tensor {name} added twice")
        parts = {k: v.detach().contiguous().cpu() for k, v in parts.items()}
        entry["parts"] = list(parts)
        entry["checksum"] = sha256_tensors(*parts.values())
        entry["stored_bytes"] = sum(t.numel() * t.element_size() for t in parts.values())
        self.entries[name] = entry
        for part, t in parts.items():
            self._pending[container_key(name, part)] = t
        self._pending_names.append(name)
        self._pending_bytes += entry["stored_bytes"]
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        self._shards += 1
        fname = f"deltas-{self._shards:05d}.safetensors"
        save_file(self._pending, str(self.tmp / fname), metadata={"format": FORMAT_NAME,
                                                                   "format_version": str(FORMAT_VERSION)})
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
            "files": files,
            "tensors": self.entries,
        }
        mpath = self.tmp / MANIFEST
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if self.out_dir.exists():
            old = self.out_dir.parent / f".{self.out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(self.out_dir, old)
        os.rename(self.tmp, self.out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._done = True
        return self.out_dir

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()


@dataclass
class EntryView:
    """A manifest entry with typed accessors."""

    name: str
    raw: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.raw["kind"]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw["shape"])

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.raw["dtype"])


class Artifact:
    """Read side of an artifact: validated manifest, checksummed lazy tensor access.

    Args:
        path: artifact directory.
        check_tensors: verify each tensor's checksum when it is read (default on: a corrupt
            artifact must never yield wrong weights).
    """

    def __init__(self, path: str | Path, check_tensors: bool = True):
        self.path = Path(path)
        self.check_tensors = check_tensors
        self.manifest = load_manifest(self.path)
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        self._handles: dict[str, Any] = {}

    # -- metadata -------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config", {})

    @property
    def lineage(self) -> dict[str, Any]:
        return self.manifest.get("lineage", {})

    def entry(self, name: str) -> EntryView:
        if name not in self.tensors:
            raise ArtifactError(f"{self.path}: no tensor {name!r} in the manifest")
        return EntryView(name, self.tensors[name])

    def nbytes(self) -> int:
        """Bytes of every file in the artifact directory."""
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def hf_dir(self) -> Path:
        """Folder of the fine-tuned model's config and tokenizer files kept with the artifact."""
        return self.path / "hf"

    # -- tensor access --------------------------------------------------------------------------
    def _handle(self, fname: str):
        if fname not in self._handles:
            fpath = self.path / fname
            if not fpath.is_file():
                raise ArtifactError(f"{self.path}: container file {fname} is missing; the artifact is incomplete")
            try:
                self._handles[fname] = safe_open(str(fpath), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ArtifactError(f"{fpath}: cannot open container ({e}); run `deltazip verify`") from e
        return self._handles[fname]

    def parts(self, name: str) -> dict[str, torch.Tensor]:
        """Stored tensors of one entry, checksum-verified."""
        e = self.entry(name).raw
        if not e.get("parts"):
            return {}
        h = self._handle(e["file"])
        out = {}
        for part in e["parts"]:
            key = container_key(name, part)
            try:
                out[part] = h.get_tensor(key)
            except Exception as err:
                raise ArtifactError(f"{self.path / e['file']}: tensor {key!r} cannot be read ({err})") from err
        if self.check_tensors and sha256_tensors(*out.values()) != e["checksum"]:
            raise ArtifactError(f"{self.path / e['file']}: checksum mismatch for tensor {name!r}; the artifact "
                                f"is corrupt (run `deltazip verify`)")
        return out

    def packed(self, name: str) -> PackedDelta:
        """The PackedDelta of a ``packed`` entry."""
        ev = self.entry(name)
        if ev.kind != "packed":
            raise ArtifactError(f"tensor {name!r} is {ev.kind}, not packed")
        p = self.parts(name)
        e = ev.raw
        d = PackedDelta(qweight=p["qweight"], scales=p["scales"], zeros=p.get("zeros"),
                        positions=p.get("positions"), bits=e["bits"], group_size=e["group_size"],
                        in_features=e["shape"][1], out_features=e["shape"][0])
        try:
            d.validate()
        except ValueError as err:
            raise ArtifactError(f"{self.path}: tensor {name!r} has an invalid packed layout: {err}") from err
        return d

    def reconstruct(self, name: str, base: torch.Tensor | None) -> torch.Tensor:
        """The fine-tuned tensor as the compressor produced it, in its stored dtype.

        Args:
            name: tensor name.
            base: the base model's tensor of that name (unused for ``full`` and non-additive entries).
        """
        ev = self.entry(name)
        kind, dtype = ev.kind, ev.dtype
        if kind == "full":
            return self.parts(name)["data"]
        if kind == "packed" and not ev.raw["additive"]:
            return delta_weight(self.packed(name)).to(dtype)
        if base is None:
            raise ArtifactError(f"tensor {name!r} is stored relative to the base, but no base tensor was given")
        if tuple(base.shape) != ev.shape:
            raise InputError(f"base tensor {name} has shape {list(base.shape)}, the artifact expects "
                             f"{list(ev.shape)}: wrong base model?")
        if kind == "same":
            return base.to(dtype)
        if kind == "packed":
            delta = delta_weight(self.packed(name))
        elif kind == "dense_delta":
            delta = self.parts(name)["delta"].float()
        else:
            raise ArtifactError(f"tensor {name!r} has unknown kind {kind!r}")
        return (base.float() + delta.to(base.device)).to(dtype)


def load_manifest(path: Path) -> dict[str, Any]:
    """Read and validate ``manifest.json``: format name, version, required fields and types."""
    if not path.exists():
        raise InputError(f"{path}: no such artifact directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{path}: not a deltazip artifact (no {MANIFEST})")
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: corrupt manifest (invalid JSON: {e})") from e
    problems = manifest_problems(m)
    if problems:
        raise ArtifactError(f"{mpath}: {problems[0]}")
    return m


def manifest_problems(m: Any) -> list[str]:
    """Schema problems of a manifest dict (empty when it is sound)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        return ["not a deltazip manifest (field 'format' is not 'deltazip')"]
    v = m.get("format_version")
    if not isinstance(v, int):
        return ["manifest has no integer 'format_version'"]
    if v > FORMAT_VERSION:
        return [f"format version {v} is newer than this deltazip understands ({FORMAT_VERSION}); upgrade deltazip"]
    if v < 1:
        return [f"unknown format version {v}"]
    out = []
    for key, typ in (("files", dict), ("tensors", dict), ("lineage", dict), ("config", dict)):
        if not isinstance(m.get(key), typ):
            out.append(f"manifest field {key!r} missing or not a {typ.__name__}")
    if out:
        return out
    for name, e in m["tensors"].items():
        if not isinstance(e, dict) or e.get("kind") not in KINDS:
            out.append(f"tensor {name!r}: unknown kind {e.get('kind') if isinstance(e, dict) else e!r}")
            continue
        if not isinstance(e.get("shape"), list) or not isinstance(e.get("dtype"), str):
            out.append(f"tensor {name!r}: missing shape or dtype")
        if e["kind"] != "same":
            if e.get("file") not in m["files"]:
                out.append(f"tensor {name!r}: container file {e.get('file')!r} is not listed in 'files'")
            if not isinstance(e.get("parts"), list) or not isinstance(e.get("checksum"), str):
                out.append(f"tensor {name!r}: missing parts or checksum")
        if e["kind"] == "packed":
            for key in ("bits", "group_size", "sparsity", "additive", "sym"):
                if key not in e:
                    out.append(f"tensor {name!r}: packed entry lacks {key!r}")
    return out
