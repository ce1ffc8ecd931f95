"""``deltazip eval``: lm-eval tasks and perplexity on artifacts, HF models and the base, side by side."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from deltazip.deltacli.common import (
    BaseOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    OverwriteOpt,
    err_console,
    human_bytes,
    out_console,
    print_json,
)
from deltazip.formats.errors import InputError


def register(app: typer.Typer) -> None:
    app.command("eval", no_args_is_help=True)(eval_targets)


def eval_targets(
    targets: Annotated[list[str], typer.Argument(
        help="What to evaluate: deltazip artifact directories (run through the serving model), plain HF "
             "model directories, or the word 'base'.", show_default=False)],
    tasks: Annotated[str, typer.Option("--tasks", help="Comma-separated lm-eval task names (deltazip's own "
                                                       "tasks, e.g. deltazip_shift, are always available).")] = "",
    base: BaseOpt = None,
    include_path: Annotated[list[Path] | None, typer.Option(
        "--include-path", help="Directory of extra lm-eval task YAMLs (repeatable).", show_default=False)] = None,
    num_fewshot: Annotated[int | None, typer.Option("--num-fewshot", help="Few-shot examples per prompt.",
                                                    show_default=False)] = None,
    limit: Annotated[float | None, typer.Option("--limit", help="Examples per task (a count, or a fraction < 1).",
                                                show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests per forward.")] = 8,
    apply_chat_template: Annotated[bool, typer.Option(
        "--apply-chat-template", help="Render each prompt (and its few-shot examples) with the target's chat "
                                      "template, as a chat request to `deltazip serve` is: for instruct and chat "
                                      "fine-tunes.")] = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    perplexity: Annotated[Path | None, typer.Option(
        "--perplexity", help="Text file: perplexity in non-overlapping windows of the model's context.",
        show_default=False)] = None,
    ppl_window: Annotated[int | None, typer.Option("--ppl-window", help="Perplexity window in tokens (default: "
                                                                        "the model's context, at most 2048).",
                                                   show_default=False)] = None,
    reference: Annotated[str | None, typer.Option(
        "--reference", help="The uncompressed fine-tune to compute recovery % against (default: a TARGET that is "
                            "an artifact's lineage fine-tune).", show_default=False)] = None,
    output: Annotated[Path | None, typer.Option("--output", help="Write lm-eval's results and the summary here "
                                                                 "(JSON).", show_default=False)] = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Evaluate compressed variants with lm-eval through the same model code that `deltazip serve` runs."""
    if output is not None:  # before lm-eval loads and long before the evaluation
        from deltazip.formats.outputs import artifact_inputs, check_output

        inputs = [i for t in targets for i in artifact_inputs("TARGET", t)]
        inputs += [("--base", base), ("--perplexity", perplexity), ("--reference", reference)]
        inputs += [("--include-path", p) for p in include_path or []]
        check_output(output, "--output", inputs, overwrite, kind="file")
    if json_out or not sys.stderr.isatty():
        # lm-eval's bars: stdout stays one JSON document, and a log file gets no carriage-return soup.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise InputError("deltazip eval needs lm-eval; install it with `pip install 'deltazip[eval]'`") from None
    from deltazip.runtime.eval.run import EvalOptions, run_eval, serialisable

    # lm-eval warns on every model object passed in (expected here) and on custom datasets.
    logging.getLogger("lm_eval").setLevel(logging.ERROR)

    opts = EvalOptions(tasks=tasks.split(",") if tasks else [], base=base, include_path=list(include_path or []),
                       num_fewshot=num_fewshot, limit=int(limit) if limit is not None and limit >= 1 else limit,
                       batch_size=batch_size, device=device, dtype=dtype, perplexity=perplexity,
                       ppl_window=ppl_window, reference=reference, apply_chat_template=apply_chat_template)
    say = None if json_out else (lambda msg: err_console.print(f"[dim]{escape(msg)}[/dim]"))
    res = run_eval(targets, opts, progress=say)
    summary = res["summary"]
    if output is not None:
        from deltazip.formats.outputs import write_text_atomic

        doc = {"deltazip": summary, "lm_eval": {k: _without_samples(v) for k, v in res["lm_eval"].items()}}
        write_text_atomic(output, json.dumps(serialisable(doc), indent=2) + "\n")  # never half a file
        summary["output"] = str(output)
    if json_out:
        print_json(serialisable(summary))
    else:
        out_console.print(render_table(summary))
        if output is not None:
            err_console.print(f"wrote {output}", markup=False)


def _without_samples(results: dict) -> dict:
    return {k: v for k, v in results.items() if k not in ("samples",)}


def render_table(summary: dict) -> Table:
    """One column per target, one row per task metric (artifacts: value and recovery %)."""
    labels = [t["label"] for t in summary["targets"]]
    table = Table(title="deltazip eval", show_lines=False)
    table.add_column("task / metric")
    for t in summary["targets"]:
        table.add_column(f"{escape(t['label'])}\n[dim]{escape(t['kind'])}[/dim]", justify="right")
    for row in summary["metrics"]:
        filt = "" if row["filter"] == "none" else f" [{row['filter']}]"
        cells = []
        for label in labels:
            v = row["values"].get(label)
            if v is None:
                cells.append("-")
                continue
            rec = row["recovery_pct"].get(label)
            cells.append(f"{v:.4f}" + (f" ({rec:.1f}%)" if rec is not None else ""))
        table.add_row(escape(f"{row['task']} {row['metric']}{filt}"), *cells)
    if summary["perplexity"]:
        table.add_row("perplexity", *[f"{summary['perplexity'][lb]['perplexity']:.3f}"
                                      if lb in summary["perplexity"] else "-" for lb in labels])
    table.add_row("bytes", *[human_bytes(t["bytes"]) if t["bytes"] is not None else "-" for t in summary["targets"]])
    table.add_row("seconds", *[f"{t['seconds']:.1f}" for t in summary["targets"]])
    return table
