"""``deltazip demo``: every step on a model pair made on the spot."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from deltazip.deltacli.common import JsonOpt, human_bytes, out_console, print_json, progress_bar


def demo(
    workdir: Annotated[Path | None, typer.Option("--workdir", help="Where the models and artifacts go "
                                                 "(default: a new temporary directory, kept).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of data, training and calibration.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Build a tiny base model and a full fine-tune of it, compress the delta, compare quality."""
    import os

    # Before torch loads: OpenMP threads that spin while waiting made this demo ten times slower on
    # busy cores (the demo then runs torch on one thread: its models are tiny).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from deltazip.demo.run import run_demo

    wd = workdir or Path(tempfile.mkdtemp(prefix="deltazip-demo-"))
    with progress_bar(json_out) as report:
        result = run_demo(wd, seed=seed, progress=report)
    if json_out:
        print_json(result)
        return
    t = Table(title=f"deltazip demo: task '{result['task']}' (held-out examples)")
    for col in ("model", "size", "ratio", "answer loss", "task accuracy", "time (s)"):
        t.add_column(col, justify="left" if col == "model" else "right", no_wrap=col == "model")
    for r in result["rows"]:
        t.add_row(r["model"], human_bytes(r["bytes"]), "-" if r["ratio"] is None else f"{r['ratio']:.1f}x",
                  f"{r['answer_loss']:.4f}", f"{100 * r['accuracy']:.1f}%",
                  "-" if r["seconds"] is None else f"{r['seconds']:.1f}")
    out_console.print(t)
    out_console.print("answer loss: cross-entropy (nats/token) of the held-out answers given their prompts; "
                      "the closer to the fine-tune's, the more of the fine-tune a variant kept")
    out_console.print(f"models and artifacts in {result['workdir']} (total {result['seconds']:.0f} s); try "
                      f"`deltazip inspect {result['rows'][2]['artifact']}`")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
