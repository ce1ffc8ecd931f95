"""Where a command writes: one check for every output option, and atomic file writes.

The rules (DESIGN.md "Artifact principles", issue 25), enforced here for every command:

- No command writes over or into one of its own inputs: the output may not be an input, a directory
  holding an input, or a path inside an input, after resolving symlinks (hard links to an input file
  count as the input). Refused even with ``--overwrite``.
- Nothing existing is replaced without ``--overwrite``.
- The output's directory must exist (or, for a directory output, can be created) and take a new entry,
  and where the size is known the file system must have room for it: checked before any work.
- Writes are atomic: a temporary sibling renamed into place (:func:`atomic_file`, :func:`replace_dir`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deltazip.formats.atomic import current_umask, remove_stale_siblings, temp_sibling
from deltazip.formats.errors import InputError
from deltazip.formats.units import human_bytes

Inputs = Iterable[tuple[str, "str | Path | None"]]
"""``(label, path)`` pairs: the option (or argument) that named an input, and the path it named. Paths
that do not exist (hub ids, the word ``base``) are skipped."""

SPACE_MARGIN = 1.02
"""A write of N bytes needs N × this free (file system metadata, manifest, rounding to blocks)."""


class NoSpace(InputError):
    """The file system of an output has no room for it."""


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _relation(out: Path, inp: Path) -> str | None:
    """How ``out`` (resolved) stands to the input ``inp`` (resolved), if it touches it."""
    if out == inp or _same_file(out, inp):
        return "is"
    if out in inp.parents:
        return "holds"
    if inp in out.parents:
        return "is inside"
    return None


def check_not_input(out: str | Path, option: str, inputs: Inputs, allow_same: bool = False) -> None:
    """Refuse an output that is one of ``inputs``, holds one, or lies inside one (symlinks resolved).

    Args:
        allow_same: ``out`` may be exactly the input (``pack``/``unpack`` in place, atomically).
    Raises:
        InputError: naming the output, the input and what to do.
    """
    res = Path(out).resolve()
    for label, path in inputs:
        if path is None or not os.path.lexists(path):
            continue
        inp = Path(path).resolve()
        rel = _relation(res, inp)
        if rel is None or (rel == "is" and allow_same):
            continue
        what = {"is": "is", "holds": "contains", "is inside": "is inside"}[rel]
        raise InputError(f"{option} {out} {what} the input {label} {path}; writing there would destroy it "
                         f"(even with --overwrite): choose an output path outside every input")


def artifact_inputs(label: str, path: str | Path | None) -> list[tuple[str, str | Path | None]]:
    """``(label, path)`` and, when ``path`` is an artifact whose lineage names a local base model,
    that base too: commands that read an artifact read its base."""
    found: list[tuple[str, str | Path | None]] = [(label, path)]
    if path is None:
        return found
    try:
        lineage = json.loads((Path(path) / "manifest.json").read_text()).get("lineage") or {}
    except (OSError, ValueError, AttributeError):
        return found
    if isinstance(lineage.get("base"), str):
        found.append((f"(the base of {path})", lineage["base"]))
    return found


def _existing_ancestor(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_location(out: Path, option: str, kind: str) -> Path:
    """The directory that will take ``out``'s temporary sibling, probed for real (permission bits,
    read-only mounts, quotas all show). A file's directory must exist; a directory output's missing
    parents are created later, so its nearest existing ancestor is probed.

    Returns:
        The probed directory (for the free-space check).
    """
    parent = out.absolute().parent
    if kind == "file" and not parent.is_dir():
        raise InputError(f"{option} {out}: directory {parent} does not exist; create it first")
    where = _existing_ancestor(parent)
    if not where.is_dir():
        raise InputError(f"{option} {out}: {where} is not a directory; choose another path")
    probe = temp_sibling(where / out.name)
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    os.unlink(probe)
    return where


def check_space(where: str | Path, nbytes: int, option: str, out: str | Path) -> None:
    """Fail now when the file system holding ``where`` has less than ``nbytes`` (× margin) free.

    Raises:
        NoSpace: one line naming the output, the bytes needed and the bytes free.
    """
    need = int(nbytes * SPACE_MARGIN)
    free = shutil.disk_usage(where).free
    if need > free:
        raise NoSpace(f"{option} {out}: needs about {human_bytes(need)} ({need} bytes) but "
                      f"{_existing_ancestor(Path(where))} has {human_bytes(free)} free; free some space or "
                      "choose another location")


def check_output(out: str | Path, option: str, inputs: Inputs = (), overwrite: bool = False, kind: str = "dir",
                 allow_same: bool = False, nbytes: int | None = None) -> Path:
    """Every check of an output before any work: not an input, nothing replaced without ``overwrite``,
    a directory where a directory goes (and a file where a file goes), a writable location and (given
    ``nbytes``) room for it.

    Args:
        out: the path the command will write.
        option: the option that named it (``--out``), for the message.
        inputs: ``(label, path)`` of everything the command reads.
        overwrite: the command's ``--overwrite``.
        kind: ``"dir"`` or ``"file"``.
        allow_same: ``out`` may be exactly an input (rewritten in place, atomically).
        nbytes: bytes the output will take, when known.
    Returns:
        ``out`` as a Path.
    """
    out = Path(out)
    check_not_input(out, option, inputs, allow_same)
    same = allow_same and any(p is not None and os.path.lexists(p) and _same_file(out, Path(p)) for _, p in inputs)
    if os.path.lexists(out) and not same:
        if not overwrite:
            raise InputError(f"{option} {out} already exists; pass --overwrite to replace it")
        if kind == "file" and out.is_dir():
            raise InputError(f"{option} {out} is a directory; pass a file path")
        if kind == "dir" and not out.is_dir():
            raise InputError(f"{option} {out} exists and is not a directory; choose a directory path")
    where = check_writable_location(out, option, kind)
    if nbytes is not None:
        check_space(where, nbytes, option, out)
    return out


def is_no_space(e: OSError | Exception) -> bool:
    """An error that means the disk (or quota) is full, also when a library wrapped it in its own
    exception (safetensors raises ``SafetensorError("... No space left on device ...")``)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def no_space_error(out: str | Path, option: str, nbytes: int | None) -> NoSpace:
    """The one-line error for a write that ran out of space (what was written is removed by the caller)."""
    where = _existing_ancestor(Path(out).absolute().parent)
    need = f"needs about {human_bytes(nbytes)} ({nbytes} bytes); " if nbytes else ""
    free = shutil.disk_usage(where).free
    return NoSpace(f"{option} {out}: no space left on the device ({need}{human_bytes(free)} free in {where}); "
                   "nothing was written: free some space or choose another location")


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it replaces ``path`` in one rename,
    on any error it is removed. The file gets the mode ``open()`` gives (``0666 & ~umask``)."""
    path = Path(path)
    remove_stale_siblings(path)
    tmp = temp_sibling(path)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def replace_dir(tmp: str | Path, out: str | Path) -> Path:
    """Move the finished directory ``tmp`` to ``out``; an existing ``out`` is parked as a hidden
    sibling for the moment of the swap and then removed, so ``out`` is never missing or half-written."""
    tmp, out = Path(tmp), Path(out)
    old = None
    if os.path.lexists(out):
        old = temp_sibling(out, "old")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return out
