"""Atomic directory writes: a hidden temporary sibling renamed into place, and what they leave behind.

A writer of ``out/`` works in ``.out.tmp-{pid}-{ns}`` next to it and renames it to ``out`` when done
(a replaced ``out`` is parked as ``.out.old-{pid}-{ns}`` for the moment of the swap). A writer that
was killed (SIGKILL, power loss) leaves its temporary behind; the next writer of the same ``out``
removes those whose process is gone (:func:`remove_stale_siblings`). The pid in the name is what
tells a dead writer from one still running.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

log = logging.getLogger("deltazip")


def temp_sibling(out: str | Path, tag: str = "tmp") -> Path:
    """``out.parent / .{out.name}.{tag}-{pid}-{ns}`` (not created)."""
    out = Path(out)
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{time.monotonic_ns()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_siblings(out: str | Path) -> list[Path]:
    """Remove the ``.{out.name}.tmp-*``/``.old-*`` siblings of ``out`` whose writer process is gone.

    Returns:
        The paths removed.
    """
    out = Path(out)
    parent = out.parent
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(?:tmp|old)-(\d+)-\d+$")
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed  # a missing or unreadable parent: the writer reports that itself
    for p in entries:
        m = pattern.match(p.name)
        if not m or pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        if not p.exists():
            removed.append(p)
            log.info("removed %s, left behind by an interrupted writer (pid %s)", p, m.group(1))
    return removed


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give every file under ``root`` mode ``0666 & ~umask`` and every directory ``0777 & ~umask``.

    Some writers create files 0600 whatever the umask (safetensors' ``save_file``, 0.8 at least);
    everything a command writes should get the modes that ``open()`` and ``mkdir()`` give.
    """
    mask = current_umask()
    root = Path(root)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(Path(dirpath) / d, 0o777 & ~mask)
        for f in filenames:
            p = Path(dirpath) / f
            if not p.is_symlink():
                os.chmod(p, 0o666 & ~mask)
