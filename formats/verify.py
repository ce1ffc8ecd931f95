"""Every integrity check of an artifact, reporting all problems (``deltazip verify``).

Checks, in order (a later check is skipped only where an earlier failure makes it meaningless):

1. ``manifest.json``: its bytes against ``manifest.sha256``, valid JSON, schema and format version,
   the lossless tables of its entries (``deltazip.formats.artifact.manifest_problems``).
2. Files: every file listed in ``files`` exists with the listed size and sha256; no unlisted file.
3. Containers: every safetensors header parses; the tensors it holds are exactly those the manifest
   expects (no missing one, no extra one).
4. Tensors: every part reads; lossless parts pass their container checks (table, compressed-bytes
   checksum, every chunk decodes, decoded-bytes checksum); the entry checksum (sha256 of the
   decoded parts) matches; every part has the dtype and shape its entry implies (a fused-experts
   entry, ``shape`` ``[E, out, in]``, holds ``E*out`` packed rows; a ``transposed`` Conv1D entry is
   packed ``[out, in]`` like any linear); packed layouts hold their invariants (padding codes and
   unused bits zero; under 2:4 the two kept positions of every group distinct and ascending; zero
   points within ``[0, 2**bits)``; finite scales).
5. With a base fingerprint (the CLI computes it from ``--base``): it equals ``lineage.base_fingerprint``.
6. Side files: ``side_files`` is sound and agrees with ``files``; with a base directory, every side
   file kept by reference is there with the recorded size and sha256 (without one, a warning says
   that they were not checked).

This module reads the files itself instead of going through ``Artifact`` so that one problem does
not hide the next. What a kind's parts must hold is its codec's to say (``deltazip.formats.codecs``:
``layout_problems``, and ``manifest_problems`` for checks across entries such as an alias's target).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from deltazip.formats import chunked
from deltazip.formats.artifact import (
    MANIFEST,
    MANIFEST_SUM,
    entry_problems,
    expected_keys,
    file_problem,
    header_problems,
    manifest_sum_problem,
    stores_bytes,
)
from deltazip.formats.checksum import sha256_tensors
from deltazip.formats.codecs import Entry
from deltazip.formats.errors import DeltazipError
from deltazip.formats.safetensors_raw import read_table
from deltazip.formats.side_files import base_copy_problem, side_file_problems, side_file_table

Progress = Callable[[str, int, int], None]


def verify_artifact(path: str | Path, base_fingerprint: str | None = None,
                    progress: Progress | None = None, base_dir: str | Path | None = None) -> dict[str, Any]:
    """Run every check and collect every problem.

    Args:
        path: artifact directory.
        base_fingerprint: ``"xxh3-128:<hex>"`` of the base model to check the lineage against
            (``deltazip.models.checkpoint.Checkpoint(base).fingerprint()``), or None to skip.
        progress: optional ``progress(description, done, total)`` callback.
        base_dir: the base model directory, to check the side files kept by reference to it; None
            to skip (a warning then names them).
    Returns:
        ``{"artifact", "ok", "problems": [str], "warnings": [str], "checked": {...}}``; ``ok`` is
        True when ``problems`` is empty. Each problem is one line naming the file and tensor.
    """
    path = Path(path)
    v = _Verifier(path, progress or (lambda *a: None))
    v.run(base_fingerprint, None if base_dir is None else Path(base_dir))
    return {"artifact": str(path), "ok": not v.problems, "problems": v.problems, "warnings": v.warnings,
            "checked": v.checked}


class _Verifier:
    def __init__(self, path: Path, progress: Progress):
        self.path, self.progress = path, progress
        self.problems: list[str] = []
        self.first: dict[str, int] = {}  # path -> index of its first problem
        self.unchecked: dict[Path, list[str]] = {}  # container -> tensors that could not be checked in it
        self.warnings: list[str] = []
        self.checked = {"files": 0, "containers": 0, "tensors": 0, "parts": 0, "lossless_parts": 0, "chunks": 0,
                        "side_files_referenced": 0}

    def bad(self, where: str | Path, msg: str) -> None:
        self.first.setdefault(str(where), len(self.problems))
        self.problems.append(f"{where}: {msg}")

    def group_unchecked(self) -> None:
        """One problem per cause: the tensors of a missing or unreadable container are counted on the
        line that reports the container, not listed one line each."""
        for fpath, names in self.unchecked.items():
            what = f"{len(names)} tensor{'s' if len(names) > 1 else ''} in it cannot be checked ({_some(names)})"
            i = self.first.get(str(fpath))
            if i is None:
                self.bad(fpath, f"container missing or unreadable; {what}")
            else:
                self.problems[i] += f"; {what}"

    # -- 1. manifest --------------------------------------------------------------------------------
    def run(self, base_fingerprint: str | None, base_dir: Path | None = None) -> None:
        path = self.path
        if not path.is_dir():
            self.bad(path, "no such artifact directory")
            return
        mpath = path / MANIFEST
        if not mpath.is_file():
            self.bad(path, f"not a deltazip artifact (no {MANIFEST})")
            return
        raw = mpath.read_bytes()
        problem = manifest_sum_problem(path, raw)
        if problem:
            self.bad(path / MANIFEST_SUM, problem)
        elif not (path / MANIFEST_SUM).exists():
            self.warnings.append(f"{path}: no {MANIFEST_SUM} (artifact written before it existed): the manifest's "
                                 "own bytes are not covered by a checksum")
        try:
            m = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self.bad(mpath, f"corrupt manifest (invalid JSON: {e})")
            return
        problems = header_problems(m)
        for p in problems:
            self.bad(mpath, p)
        if problems:
            return
        self.manifest = m
        broken = set()
        for name, e in m["tensors"].items():
            problems = entry_problems(name, e, m["files"])
            for p in problems:
                self.bad(mpath, p)
            if problems:
                broken.add(name)
        for p in side_file_problems(m):
            self.bad(mpath, p)
        self.check_files(m["files"])
        self.check_tensors(m["tensors"], broken)
        self.check_side_references(m, base_dir)
        if base_fingerprint is not None:
            want = m["lineage"].get("base_fingerprint")
            if not want:
                self.bad(mpath, "lineage has no base_fingerprint to check the base against")
            elif want != base_fingerprint:
                self.bad(mpath, f"the given base is not the one this artifact was made against (its fingerprint "
                                f"{base_fingerprint} differs from the lineage's {want})")

    # -- 2. files -----------------------------------------------------------------------------------
    def check_files(self, files: dict[str, Any]) -> None:
        for i, (rel, info) in enumerate(sorted(files.items())):
            problem = file_problem(self.path, rel, info)
            if problem:
                self.bad(self.path / rel, problem)
            self.checked["files"] += 1
            self.progress("checking files", i + 1, len(files))
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path).as_posix()
            if p.is_file() and rel not in files and rel not in (MANIFEST, MANIFEST_SUM):
                self.bad(p, "file not listed in the manifest")

    # -- 6. side files kept by reference to the base ------------------------------------------------
    def check_side_references(self, m: dict[str, Any], base_dir: Path | None) -> None:
        if not isinstance(m.get("side_files"), dict):
            return  # absent (older artifact) or reported by side_file_problems
        refs = {n: i for n, i in side_file_table(m).items() if isinstance(i, dict) and i.get("source") == "base"}
        if not refs:
            return
        if base_dir is None:
            self.warnings.append(f"{self.path}: side files {', '.join(sorted(refs))} are kept by reference to the base "
                                 "model and were not checked; pass --base to check them")
            return
        for name, info in sorted(refs.items()):
            p = base_dir / name
            try:
                problem = base_copy_problem(info, p.read_bytes() if p.is_file() else None)
            except (KeyError, TypeError):
                continue  # malformed entry: reported by side_file_problems
            if problem:
                self.bad(p, f"side file {name} is kept by reference to the base, and this base's copy {problem}; "
                            "pass the right --base")
            self.checked["side_files_referenced"] += 1

    # -- 3./4. containers and tensors ---------------------------------------------------------------
    def check_tensors(self, tensors: dict[str, Any], broken: set[str]) -> None:
        by_file: dict[str, dict[str, tuple[str, str]]] = {}
        for name, e in tensors.items():
            if name in broken or not stores_bytes(e):
                continue
            for key, part in expected_keys(e, name).items():
                by_file.setdefault(e["file"], {})[key] = (name, part)
        containers = set(by_file) | {f for f in self.manifest["files"] if f.endswith(".safetensors")}
        tables: dict[str, dict] = {}
        for fname in sorted(containers):
            fpath = self.path / fname
            if not fpath.is_file():
                continue  # reported by check_files
            try:
                tables[fname], _ = read_table(fpath)
            except DeltazipError as e:
                self.bad(fpath, f"container header unreadable ({e})")
                continue
            self.checked["containers"] += 1
            self.compare_keys(fpath, by_file.get(fname, {}), set(tables[fname]))
        handles: dict[str, Any] = {}
        names = [n for n in tensors if n not in broken]
        for i, name in enumerate(names):
            self.check_tensor(name, tensors[name], tables, handles)
            self.checked["tensors"] += 1
            self.progress("checking tensors", i + 1, len(names))
        self.group_unchecked()

    def compare_keys(self, fpath: Path, want: dict[str, tuple[str, str]], have: set[str]) -> None:
        """The container's keys against the manifest's: one line for what it lacks, one for what it
        holds unlisted (each naming the first few)."""
        lacks = sorted(set(want) - have)
        if len(lacks) == 1:
            name, part = want[lacks[0]]
            self.bad(fpath, f"the manifest lists tensor {name!r} part {part!r} (stored as {lacks[0]!r}) but the "
                            "container lacks it")
        elif lacks:
            self.bad(fpath, f"the manifest lists {len(lacks)} tensor parts that the container lacks ({_some(lacks)})")
        extra = sorted(have - set(want))
        if len(extra) == 1:
            self.bad(fpath, f"the container holds tensor {extra[0]!r}, which the manifest does not list")
        elif extra:
            self.bad(fpath, f"the container holds {len(extra)} tensors the manifest does not list ({_some(extra)})")

    def check_tensor(self, name: str, e: dict[str, Any], tables: dict[str, dict], handles: dict[str, Any]) -> None:
        entry = Entry(name, e)
        for msg in entry.codec.manifest_problems(entry, self.manifest["tensors"]):
            self.bad(self.path / MANIFEST, msg)
        if not entry.stores_bytes:
            return
        fname = e["file"]
        fpath = self.path / fname
        table = tables.get(fname)
        if table is None:
            self.unchecked.setdefault(fpath, []).append(name)  # one line per container (group_unchecked)
            return
        lossless = e.get("lossless") or {}
        parts: dict[str, torch.Tensor] = {}
        complete = True
        for key, part in expected_keys(e, name).items():
            if key not in table:
                complete = False  # reported with the container
                continue
            t = self.read(fpath, fname, key, handles, name)
            if t is None:
                complete = False
                continue
            self.checked["parts"] += 1
            if part in lossless:
                t = self.decode(fpath, name, part, lossless[part], t)
                if t is None:
                    complete = False
                    continue
            parts[part] = t
        if not complete:
            return
        ordered = [parts[p] for p in e["parts"]]
        if sha256_tensors(*ordered) != e["checksum"]:
            self.bad(fpath, f"tensor {name!r}: checksum mismatch of its parts (corrupt data)")
        for msg in entry.codec.layout_problems(entry, parts):
            self.bad(fpath, f"tensor {name!r}: {msg}")

    def read(self, fpath: Path, fname: str, key: str, handles: dict[str, Any], name: str) -> torch.Tensor | None:
        try:
            if fname not in handles:
                handles[fname] = safe_open(str(fpath), framework="pt")
            return handles[fname].get_tensor(key)
        except Exception as err:  # safetensors' own error types
            self.bad(fpath, f"tensor {name!r}: {key!r} cannot be read ({err})")
            return None

    def decode(self, fpath: Path, name: str, part: str, meta: dict, stored: torch.Tensor) -> torch.Tensor | None:
        self.checked["lossless_parts"] += 1
        try:
            c = chunked.Container.from_json(meta)
            t = chunked.decode(c, stored)
        except chunked.ContainerError as err:
            self.bad(fpath, f"tensor {name!r} part {part!r}: {err}")
            return None
        except DeltazipError as err:  # codec library missing
            self.bad(fpath, f"tensor {name!r} part {part!r} cannot be decoded: {err}")
            return None
        self.checked["chunks"] += len(c.sizes)
        return t


def _some(names: list[str], shown: int = 3) -> str:
    """``'a', 'b', 'c' and 38 more``."""
    head = ", ".join(repr(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")

