"""Shared CLI pieces: option aliases, stderr console, JSON output, progress bars."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

# Logs, tables meant for people and progress go to stderr; stdout carries only --json output
# (or the human report when --json is off).
err_console = Console(stderr=True)
out_console = Console()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout; no progress bars.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the output directory if it exists.")]
ArtifactArg = Annotated[Path, typer.Argument(help="A deltazip artifact directory.", show_default=False)]


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


@contextmanager
def progress_bar(json_out: bool):
    """A rich Progress on stderr, or a no-op stand-in when bars are off.

    Yields a callable ``report(description, completed, total)`` that the library's progress
    callbacks can be pointed at.
    """
    if not progress_enabled(json_out):
        yield lambda desc, done, total: None
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
