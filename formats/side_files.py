"""Side files of an artifact: the fine-tune's config and tokenizer files, copied or kept by reference.

A side file byte-identical to the base model's file of the same name is not copied into the
artifact: the manifest's ``side_files`` records its ``sha256``, ``bytes`` and ``source: "base"``, and
a reader takes it from the base directory, checking both. The others are copied under ``hf/`` and
recorded with ``source: "artifact"`` (and, like every file, in ``files``). Artifacts written before
``side_files`` existed keep every side file under ``hf/``; they read as before.

Everything that needs the side files goes through :func:`side_file_dir` (a directory holding all of
them) or :func:`materialize_side_files` (copy them into a directory of your choice).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

from deltazip.formats.errors import InputError


class Artifact(Protocol):
    """What these functions read of a ``deltazip.formats.artifact.Artifact`` (named here so that this
    module, which the artifact reader imports, does not import it back)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def lineage(self) -> dict[str, Any]: ...

    def hf_dir(self) -> Path: ...


SIDE_DIR = "hf"
SOURCES = ("artifact", "base")

_lock = threading.Lock()
_dirs: dict[str, Path] = {}  # content key -> materialized directory (removed at interpreter exit)


def plain_name(name: Any) -> bool:
    """A relative POSIX path inside the side-file folder (no ``..``, no absolute path, no backslash)."""
    return (isinstance(name, str) and bool(name) and not name.startswith("/") and "\\" not in name
            and all(p not in ("", ".", "..") for p in name.split("/")))


def side_file_record(data: bytes, source: str) -> dict[str, Any]:
    """The ``side_files`` entry of a file with these bytes."""
    return {"sha256": "sha256:" + hashlib.sha256(data).hexdigest(), "bytes": len(data), "source": source}


def side_file_problems(m: dict[str, Any]) -> list[str]:
    """Problems of a manifest's ``side_files`` (empty when sound or absent).

    Checks each entry's fields, that each copied file is listed in ``files`` as ``hf/NAME`` with the
    same size and sha256, and that every ``hf/`` file in ``files`` is a copied side file.
    """
    sf = m.get("side_files")
    if sf is None:
        return []
    if not isinstance(sf, dict):
        return ["manifest field 'side_files' is not an object"]
    files = m.get("files") if isinstance(m.get("files"), dict) else {}
    out = []
    for name, info in sf.items():
        if not plain_name(name):
            out.append(f"side file {name!r}: not a relative file name")
        elif (not isinstance(info, dict) or info.get("source") not in SOURCES
              or not isinstance(info.get("bytes"), int) or isinstance(info.get("bytes"), bool) or info["bytes"] < 0
              or not isinstance(info.get("sha256"), str) or not info["sha256"].startswith("sha256:")):
            out.append(f"side file {name!r}: needs 'sha256', 'bytes' and 'source' ({' or '.join(SOURCES)})")
        elif info["source"] == "artifact":
            f = files.get(f"{SIDE_DIR}/{name}")
            if not isinstance(f, dict) or f.get("sha256") != info["sha256"] or f.get("bytes") != info["bytes"]:
                out.append(f"side file {name!r} is stored in the artifact, but 'files' lists no {SIDE_DIR}/{name} "
                           "with the same size and sha256")
    for rel in files:
        if rel.startswith(f"{SIDE_DIR}/"):
            info = sf.get(rel[len(SIDE_DIR) + 1:])
            if not isinstance(info, dict) or info.get("source") != "artifact":
                out.append(f"file {rel} is not listed in 'side_files' as stored in the artifact")
    return out


def side_file_table(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every side file: name -> ``sha256``, ``bytes``, ``source``. For an artifact that predates
    ``side_files``, the ``hf/`` files of ``files``, all ``source: "artifact"``."""
    sf = manifest.get("side_files")
    if sf is not None:
        return dict(sf)
    prefix = f"{SIDE_DIR}/"
    return {rel[len(prefix):]: {"sha256": info.get("sha256"), "bytes": info.get("bytes"), "source": "artifact"}
            for rel, info in manifest.get("files", {}).items() if rel.startswith(prefix)}


def base_copy_problem(info: dict[str, Any], data: bytes | None) -> str | None:
    """Why the base's copy (``data``, None when missing) is not the referenced side file."""
    if data is None:
        return "is missing"
    if len(data) != info["bytes"]:
        return f"is {len(data)} bytes, the artifact references {info['bytes']}"
    if "sha256:" + hashlib.sha256(data).hexdigest() != info["sha256"]:
        return "differs from the file the artifact references (sha256)"
    return None


def _read(p: Path) -> bytes | None:
    return p.read_bytes() if p.is_file() else None


def referenced_files(art: Artifact, base_dir: str | Path | None) -> dict[str, bytes]:
    """The bytes of every side file ``art`` keeps by reference, read from ``base_dir`` and checked.

    Raises:
        InputError: some are referenced but no base is given, or the base's copy of one is missing
            or differs (one line naming the file and the fix: pass the right ``--base``).
    """
    refs = {n: i for n, i in side_file_table(art.manifest).items() if i["source"] == "base"}
    if not refs:
        return {}
    want = art.lineage.get("base") or "the base it was compressed against"
    if base_dir is None:
        raise InputError(f"{art.path}: side files {', '.join(sorted(refs))} are kept by reference to the base model; "
                         f"pass --base ({want})")
    base_dir = Path(base_dir)
    out = {}
    for name, info in sorted(refs.items()):
        data = _read(base_dir / name)
        problem = base_copy_problem(info, data)
        if problem:
            raise InputError(f"{base_dir / name}: side file {name} of artifact {art.path} is kept by reference to the "
                             f"base, and this base's copy {problem}; pass the right --base ({want})")
        out[name] = data
    return out


def materialize_side_files(art: Artifact, base_dir: str | Path | None, dst: str | Path) -> list[str]:
    """Write every side file of ``art`` into ``dst``: the copied ones from its ``hf/`` (checked as
    ``Artifact.hf_dir`` checks them), the referenced ones from ``base_dir`` (checked).

    Args:
        art: the artifact.
        base_dir: the base model directory (needed only when some side file is referenced).
        dst: directory to write into (created; existing files of the same names are replaced).
    Returns:
        The names written, sorted.
    Raises:
        InputError: see :func:`referenced_files`.
    """
    refs = referenced_files(art, base_dir)
    hf = art.hf_dir()
    dst = Path(dst)
    names = sorted(side_file_table(art.manifest))
    for name in names:
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name in refs:
            target.write_bytes(refs[name])
        else:
            shutil.copyfile(hf / name, target)
    return names


def side_file_dir(art: Artifact, base_dir: str | Path | None) -> Path:
    """A directory holding every side file of ``art`` (what ``from_pretrained`` wants to read).

    The artifact's own ``hf/`` when it keeps all of them (artifacts that predate ``side_files``
    included); otherwise a private directory with the copied files and the referenced ones from
    ``base_dir``, checked on every call. Artifacts with the same side files share one such
    directory; it is removed when the interpreter exits.

    Raises:
        InputError: see :func:`referenced_files`.
    """
    table = side_file_table(art.manifest)
    if not any(i["source"] == "base" for i in table.values()):
        return art.hf_dir()
    key = hashlib.sha256(json.dumps(sorted((n, i["sha256"]) for n, i in table.items())).encode()).hexdigest()
    with _lock:
        d = _dirs.get(key)
        if d is not None and d.is_dir():
            referenced_files(art, base_dir)  # the base given must still hold the right files
            art.hf_dir()
            return d
        d = Path(tempfile.mkdtemp(prefix="deltazip-side-"))
        try:
            materialize_side_files(art, base_dir, d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        atexit.register(shutil.rmtree, d, True)
        _dirs[key] = d
        return d
