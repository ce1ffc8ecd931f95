"""Shared CLI pieces: option aliases, stderr console, JSON output, progress bars."""

from __future__ import annotations

import json
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from deltazip.models.devices import DEVICES, DTYPES

PIPE_WIDTH = 10_000
"""Columns of a console that is not a terminal (a pipe, a file, a CI log): no line is wrapped or cut."""


class _Console(Console):
    """A rich Console that, when not writing to a terminal, is as wide as its text: piped output never
    breaks a command in two or cuts a path, and tables get the full width their cells need."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return size if self.is_terminal else ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


# Logs, tables meant for people and progress go to stderr; stdout carries only --json output
# (or the human report when --json is off).
err_console = _Console(stderr=True)
out_console = _Console()


def cli_name() -> str:
    """How to run this deltazip again from any directory: ``deltazip`` when that is what was run from
    PATH (or is on it), else the full path of the script that was run (``.venv/bin/deltazip`` after
    ``make demo``, which does not put it on PATH), else ``python -m deltazip.deltacli.app``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name != "deltazip":
        return f"{sys.executable} -m deltazip.deltacli.app"
    if "/" not in argv0:
        return "deltazip"  # found on PATH
    me = Path(argv0).resolve()
    found = shutil.which("deltazip")
    return "deltazip" if found and Path(found).resolve() == me else str(me)


def activate_hint() -> str:
    """``; or `source VENV/bin/activate` first ...`` when deltazip is not on PATH and runs in a venv."""
    if cli_name() == "deltazip" or sys.prefix == sys.base_prefix:
        return ""
    return f" (or run `source {Path(sys.prefix) / 'bin' / 'activate'}` once, then just `deltazip`)"

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout; no progress bars.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the output if it exists (never one of the "
                                             "command's inputs).")]
ArtifactArg = Annotated[Path, typer.Argument(help="A deltazip artifact directory.", show_default=False)]
# One --base, --device and --dtype for every command, with one accepted set (deltazip.models.devices).
BaseOpt = Annotated[str | None, typer.Option("--base", help="Base model: local HF directory or hub id (default: "
                                             "the base the artifacts' lineage names).", show_default=False)]
RequiredBaseOpt = Annotated[str, typer.Option("--base", help="Base model: local HF directory or hub id.",
                                              show_default=False)]
DeviceOpt = Annotated[str, typer.Option("--device", help=f"{DEVICES}.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help=f"Compute dtype: {DTYPES} (auto: float32 on CPU, on CUDA the "
                                       "checkpoint's half dtype).")]


def human_bytes(n: float) -> str:
    """``deltazip.formats.report.human_bytes``, imported on first use: formats.report imports torch,
    and ``deltazip --version``/``--help`` must not pay for that."""
    from deltazip.formats.report import human_bytes as _human_bytes

    return _human_bytes(n)


def print_json(doc: Any) -> None:
    """Write exactly one JSON document to stdout."""
    sys.stdout.write(json.dumps(doc, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def progress_enabled(json_out: bool) -> bool:
    """Progress bars only for a person at a terminal, never under --json."""
    return not json_out and err_console.is_terminal


class PlainProgress:
    """Progress as plain stderr lines, for a stderr that is not a terminal (CI logs, ``| tee``):
    a line when a stage starts, one at most every ``every`` seconds while it runs, one when it ends."""

    def __init__(self, every: float = 30.0, stream=None):
        self.every = every
        self.stream = stream
        self._stages: dict[str, list[float]] = {}  # description -> [start, last line]
        self._done: set[str] = set()

    def _say(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def __call__(self, desc: str, done: int, total: int) -> None:
        now = time.monotonic()
        st = self._stages.get(desc)
        if st is None:
            if desc in self._done and done >= total:
                return  # the end of a stage reported twice
            st = self._stages[desc] = [now, now]
            self._done.discard(desc)  # a stage that runs again
            if done < total:
                self._say(f"{desc}: {done}/{total}")
                return
        if done >= total:
            self._done.add(desc)
            del self._stages[desc]
            self._say(f"{desc}: done ({total}/{total}) in {now - st[0]:.1f} s")
        elif now - st[1] >= self.every:
            st[1] = now
            self._say(f"{desc}: {done}/{total} ({now - st[0]:.0f} s)")


@contextmanager
def progress_bar(json_out: bool):
    """A rich Progress on stderr at a terminal, plain lines when stderr is not one (one per stage at
    least), nothing under --json.

    Yields a callable ``report(description, completed, total)`` that the library's progress
    callbacks can be pointed at.
    """
    if json_out:
        yield lambda desc, done, total: None
        return
    if not progress_enabled(json_out):
        yield PlainProgress()
        return
    cols = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn()]
    with Progress(*cols, console=err_console, transient=True) as prog:
        tasks: dict[str, int] = {}

        def report(desc: str, done: int, total: int) -> None:
            if desc not in tasks:
                tasks[desc] = prog.add_task(desc, total=total)
            prog.update(tasks[desc], completed=done, total=total)

        yield report
