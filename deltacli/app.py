"""The ``deltazip`` Typer app and ``main()``, which turns known errors into one line + exit 1."""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import threading
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated

import typer

from deltazip.formats.errors import DeltazipError, DeltazipWarning

app = typer.Typer(
    name="deltazip",
    help="Compress fine-tuned LLMs as deltas against their base, deduplicate tensors, serve and evaluate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# One module per command group; each exposes ``register(app)``.
COMMAND_MODULES = (
    "deltazip.deltacli.compress_cmd",
    "deltazip.deltacli.inspect_cmd",
    "deltazip.deltacli.merge_cmd",
    "deltazip.deltacli.demo_cmd",
    "deltazip.deltacli.dedup_cmd",
    "deltazip.deltacli.verify_cmd",
    "deltazip.deltacli.pack_cmd",
    "deltazip.deltacli.serve_cmd",
    "deltazip.deltacli.eval_cmd",
    "deltazip.deltacli.tune_cmd",
)


def _version() -> str:
    try:
        return version("deltazip")
    except PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"deltazip {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version_cb, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """deltazip: many fine-tuned variants of one base model, for the memory of a few."""


for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def _quiet_libraries() -> None:
    """Our own progress bars and messages only: the libraries' bars would clutter stderr."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Before torch loads, for every command: OpenMP threads that spin while waiting made the demo ten
    # times slower on busy cores, and compress on the demo pair a hundred times slower than the demo.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # transformers reads these variables when it is first imported; importing it here just to switch
    # its bars off would cost every command (``--version`` included) a second.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised in the main thread by our handler.

    Not a KeyboardInterrupt: Typer turns that into a silent exit 130. A BaseException, so that
    ``with``/``finally`` blocks on the way out remove what they were writing (``.NAME.tmp-*``)
    and no ``except Exception`` swallows it.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signum)


def _install_signal_handlers() -> dict[int, object]:
    """SIGINT and SIGTERM raise :class:`Interrupted`; returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, _raise_interrupted)
    sys.unraisablehook = _redeliver_lost_interrupts(sys.unraisablehook)
    return previous


def _redeliver_lost_interrupts(hook):
    """An ``unraisablehook`` that sends a signal again when its :class:`Interrupted` was lost.

    A signal handler runs between any two bytecodes of the main thread, also inside a ``__del__`` or a
    weakref callback, where Python prints and drops what it raises: the command then ran on to the end
    as if never interrupted. The signal is sent again a moment later (from a thread: sent from here, the
    handler would run inside this hook), and again each time it lands in such a frame.
    """

    def unraisable(u) -> None:
        if isinstance(u.exc_value, Interrupted):
            threading.Timer(0.02, os.kill, (os.getpid(), u.exc_value.signum)).start()
            return
        hook(u)

    unraisable.previous = hook
    return unraisable


_FIXES = {
    errno.EACCES: "permission denied; choose a directory you can write to (or fix its permissions)",
    errno.EPERM: "operation not permitted; choose a directory you can write to (or fix its permissions)",
    errno.EROFS: "read-only file system; choose a directory on a writable file system",
    errno.ENOSPC: "no space left on the device; free some space or choose another directory",
    errno.EDQUOT: "disk quota exceeded; free some space or choose another directory",
    errno.ENOENT: "no such file or directory; check the path",
    errno.ENOTDIR: "a part of the path is not a directory; check the path",
    errno.EISDIR: "is a directory; pass a file path",
    errno.EADDRINUSE: "address already in use; stop the other server or choose another --port",
}


def os_error_line(e: OSError) -> str:
    """One line for an OS error: the path it concerns (for a hidden temporary ``.NAME.tmp-*`` entry,
    the directory it was being written in) and what to do about it."""
    path = e.filename
    if path is not None:
        p = Path(os.fsdecode(path))
        if p.name.startswith(".") and ".tmp-" in p.name:
            p = p.parent  # the user never named the hidden temporary: name the directory they chose
        path = str(p)
    what = _FIXES.get(e.errno) or (e.strerror or str(e) or type(e).__name__)
    if e.filename2 is not None:
        return f"{path} -> {os.fsdecode(e.filename2)}: {what}"
    return f"{path}: {what}" if path is not None else what


def _one_line_warnings(show):
    """A ``warnings.showwarning`` that prints our own warnings as one ``deltazip: warning:`` line and
    hands the others to ``show``."""

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, DeltazipWarning):
            print(f"deltazip: warning: {message}", file=sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def main() -> None:
    """Console entry point: known errors become one line on stderr and exit code 1; SIGINT and
    SIGTERM clean up and print one line, then exit 130 (SIGINT) or end by the SIGTERM."""
    debug = os.environ.get("DELTAZIP_DEBUG") == "1"
    _quiet_libraries()
    previous = _install_signal_handlers()
    previous_show = warnings.showwarning
    warnings.showwarning = _one_line_warnings(previous_show)
    try:
        app(standalone_mode=True)
    except DeltazipError as e:
        if debug:
            raise
        print(f"deltazip: error: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        if debug:
            raise
        print(f"deltazip: error: {os_error_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as e:
        name = "SIGTERM" if e.signum == signal.SIGTERM else "SIGINT"
        print(f"deltazip: interrupted ({name})", file=sys.stderr)
        if previous.get(e.signum) is signal.SIG_DFL:
            # Cleaned up; now end the way the sender expects, by that signal (service managers count
            # a SIGTERM death as a clean stop, an exit code 143 as a failure).
            sys.stderr.flush()
            signal.signal(e.signum, signal.SIG_DFL)
            os.kill(os.getpid(), e.signum)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        print("deltazip: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        warnings.showwarning = previous_show
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = getattr(sys.unraisablehook, "previous", sys.unraisablehook)


if __name__ == "__main__":
    main()
