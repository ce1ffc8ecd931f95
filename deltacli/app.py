"""The ``deltazip`` Typer app and ``main()``, which turns known errors into one line + exit 1."""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from deltazip.formats.errors import DeltazipError

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
    # transformers reads these variables when it is first imported; importing it here just to switch
    # its bars off would cost every command (``--version`` included) a second.
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def main() -> None:
    """Console entry point: known errors become one line on stderr and exit code 1."""
    debug = os.environ.get("DELTAZIP_DEBUG") == "1"
    _quiet_libraries()
    try:
        app(standalone_mode=True)
    except DeltazipError as e:
        if debug:
            raise
        print(f"deltazip: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("deltazip: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
