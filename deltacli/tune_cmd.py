"""``deltazip tune``: compile and tune the delta-matmul kernels for a served directory, ahead of ``serve``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import BaseOpt, DeviceOpt, DtypeOpt, JsonOpt, out_console, print_json


def tune(
    artifacts: Annotated[Path, typer.Argument(help="The directory you serve (deltazip artifacts, full checkpoints, "
                                                   "LoRA adapters); every variant's delta configuration is tuned.",
                                              show_default=False)],
    base: BaseOpt = None,
    max_deltas: Annotated[int, typer.Option(help="The --max-deltas you serve with (batches of up to this many "
                                                 "variants are timed; a larger value also covers smaller ones).")] = 4,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    json_out: JsonOpt = False,
) -> None:
    """Compile the CUDA delta-matmul kernels and time their launch choices for this GPU, the served
    dtype and shapes, and every variant under ARTIFACTS; the choices are cached on disk, so a later
    `deltazip serve` on this GPU model starts without timing them (it does the same before it reports
    ready otherwise)."""
    from deltazip.runtime.serve.assembly import ServeConfig
    from deltazip.runtime.serve.tune_ahead import tune_ahead

    cfg = ServeConfig(artifacts=artifacts, base=base, max_deltas=max_deltas, device=device, dtype=dtype)
    if not json_out:  # one line per stack as it is tuned (deltazip.kernels): minutes should not pass silently
        logging.basicConfig(level=os.environ.get("DELTAZIP_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    r = tune_ahead(cfg)
    if json_out:
        print_json(r)
        return
    out_console.print(f"tuned the delta matmul on {r['gpu']} ({r['dtype']}) for {r['variants']} variants: "
                      f"{r['keys_timed']} keys timed in {r['tuning_s']} s ({r['seconds']} s with loading), "
                      f"{r['table_entries']} in the table, {r['skipped']} configs skipped; {r['table']}",
                      markup=False, highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("tune", no_args_is_help=True)(tune)
