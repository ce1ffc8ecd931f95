"""``deltazip demo``: every step on a model pair made on the spot."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from deltazip.deltacli.common import (
    JsonOpt,
    activate_hint,
    cli_name,
    human_bytes,
    out_console,
    print_json,
    progress_bar,
)


def demo(
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where the models and artifacts go "
                                                 "(default: a new temporary directory, kept).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of data, training and calibration.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Use a --workdir that is not empty, replacing "
                                            "the demo's own files in it.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build a tiny base model and a full fine-tune of it, compress the delta, compare quality."""
    from deltazip.formats.outputs import check_output

    if workdir is not None and not (workdir.is_dir() and not any(workdir.iterdir())):  # an empty one is fine
        check_output(workdir, "--workdir", (), overwrite, kind="dir")
    from deltazip.demo.run import run_demo

    wd = workdir or _new_workdir()
    with progress_bar(json_out) as report:
        result = run_demo(wd, seed=seed, progress=report)
    if json_out:
        print_json(result)
        return
    t = Table(title=escape(f"deltazip demo: task '{result['task']}' (held-out examples)"))
    for col in ("model", "size", "ratio", "answer loss", "task accuracy", "time (s)"):
        t.add_column(col, justify="left" if col == "model" else "right", no_wrap=col == "model")
    for r in result["rows"]:
        t.add_row(escape(r["model"]), human_bytes(r["bytes"]), "-" if r["ratio"] is None else f"{r['ratio']:.1f}x",
                  f"{r['answer_loss']:.4f}", f"{100 * r['accuracy']:.1f}%",
                  "-" if r["seconds"] is None else f"{r['seconds']:.1f}")
    out_console.print(t)
    out_console.print("answer loss: cross-entropy (nats/token) of the held-out answers given their prompts; "
                      "the closer to the fine-tune's, the more of the fine-tune a variant kept")
    out_console.print(closing_hint(result), markup=False, highlight=False)


def closing_hint(result: dict) -> str:
    """Where the demo's files are and a command to try next, runnable as printed (``deltazip`` is not
    on PATH after ``make demo``: the full path of the script then)."""
    return (f"models and artifacts in {result['workdir']} (total {result['seconds']:.0f} s); try "
            f"`{cli_name()} inspect {result['rows'][2]['artifact']}`{activate_hint()}")


def _new_workdir() -> Path:
    """A new temporary directory with the mode the umask gives (``mkdtemp`` makes it 0700)."""
    import os

    from deltazip.formats.atomic import current_umask

    wd = Path(tempfile.mkdtemp(prefix="deltazip-demo-"))
    os.chmod(wd, 0o777 & ~current_umask())
    return wd


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
