"""``deltazip pack`` / ``unpack``: add or remove the lossless GDeflate stage of an artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import (
    ArtifactArg,
    JsonOpt,
    OverwriteOpt,
    human_bytes,
    out_console,
    print_json,
    progress_bar,
)
from deltazip.formats.gdeflate import DEFAULT_LEVEL, MAX_LEVEL, MIN_LEVEL

OutOpt = Annotated[Path | None, typer.Option("--out", help="Write the result here instead of replacing ARTIFACT "
                                             "in place.", show_default=False)]


def _run(artifact: Path, out: Path | None, lossless: str, level: int, overwrite: bool, json_out: bool) -> None:
    from deltazip.formats.artifact import repack

    with progress_bar(json_out) as report:
        r = repack(artifact, out, lossless=lossless, level=level, overwrite=overwrite, progress=report)
    if json_out:
        print_json(r)
        return
    if not r["changed"]:
        out_console.print(f"{artifact}: no lossless stage; nothing to do", markup=False, highlight=False)
        return
    ratio = r["bytes_before"] / r["bytes_after"] if r["bytes_after"] else float("nan")
    stage = f"GDeflate level {level}, {r['lossless_parts']} parts compressed" if lossless != "none" else "no lossless stage"
    out_console.print(f"{r['artifact']}: {human_bytes(r['bytes_before'])} -> {human_bytes(r['bytes_after'])} "
                      f"(x{ratio:.3f}; {stage}; {r['seconds']:.1f} s)", markup=False, highlight=False, soft_wrap=True)


def pack(
    artifact: ArtifactArg,
    level: Annotated[int, typer.Option("--level", min=MIN_LEVEL, max=MAX_LEVEL,
                                       help="GDeflate level (0 fastest .. 12 smallest).")] = DEFAULT_LEVEL,
    out: OutOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Add the lossless GDeflate stage to an artifact (no lossy recompression; atomic)."""
    _run(artifact, out, "gdeflate", level, overwrite, json_out)


def unpack(
    artifact: ArtifactArg,
    out: OutOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Remove the lossless stage: store every part raw again (atomic)."""
    _run(artifact, out, "none", DEFAULT_LEVEL, overwrite, json_out)


def register(app: typer.Typer) -> None:
    app.command("pack", no_args_is_help=True)(pack)
    app.command("unpack", no_args_is_help=True)(unpack)
