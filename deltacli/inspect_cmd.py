"""``deltazip inspect``: lineage, config, sizes, bits per weight, ratios, side files and per-layer error of an
artifact; for a PEFT adapter, its settings, what it trains and whether the server would serve it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import BaseOpt, JsonOpt, OverwriteOpt, print_json
from deltazip.deltacli.render import render_adapter, render_summary
from deltazip.formats.errors import InputError


def inspect(
    artifact: Annotated[Path, typer.Argument(help="A deltazip artifact directory, or a PEFT adapter directory.",
                                             show_default=False)],
    plot: Annotated[Path | None, typer.Option("--plot", help="Write an image (.png, .pdf, .svg, ...): delta vs base "
                                              "weight magnitudes and per-layer error (needs the base model).")] = None,
    base: BaseOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Show what an artifact holds: sizes and bits per weight by tensor kind, compression ratios against
    the fine-tune's stored dtype, side files (copied vs referenced from the base), per-layer error. For
    a PEFT adapter directory: its settings, what it trains, and (with --base) whether the server would
    serve it on that base."""
    from deltazip.formats.artifact import Artifact
    from deltazip.formats.report import summarize
    from deltazip.runtime.serve.lora_summary import is_adapter, summarize_adapter

    if is_adapter(artifact):
        if plot is not None:
            raise InputError(f"--plot draws an artifact's layers; {artifact} is a PEFT adapter: drop --plot")
        doc = summarize_adapter(artifact, base)
        if json_out:
            print_json(doc)
        else:
            render_adapter(doc)
        return
    if plot is not None:  # the name and the location first: drawing reads the base model
        from deltazip.compress.plots import plot_format
        from deltazip.formats.outputs import artifact_inputs, check_output

        check_output(plot, "--plot", [*artifact_inputs("ARTIFACT", artifact), ("--base", base)], overwrite,
                     kind="file")
        plot_format(plot)
    art = Artifact(artifact)
    summary = summarize(art)
    if plot is not None:
        from deltazip.compress.plots import plot_artifact

        summary["plot"] = str(plot_artifact(art, base, plot))
    if json_out:
        print_json(summary)
    else:
        render_summary(summary, title=f"artifact {artifact}")
        if plot is not None:
            typer.echo(f"plot written to {summary['plot']}")


def register(app: typer.Typer) -> None:
    app.command("inspect", no_args_is_help=True)(inspect)
