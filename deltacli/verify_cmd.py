"""``deltazip verify``: every integrity check of an artifact, naming every problem found."""

from __future__ import annotations

from typing import Annotated

import typer

from deltazip.deltacli.common import ArtifactArg, JsonOpt, out_console, print_json, progress_bar


def verify(
    artifact: ArtifactArg,
    base: Annotated[str | None, typer.Option("--base", help="Also check that this base model (directory or hub "
                                             "id) is the one the artifact was made against, and that it "
                                             "holds the side files the artifact references.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Check manifest, checksums of every file and tensor, packing invariants, lossless chunks and
    (with --base) the base fingerprint and the side files kept by reference to the base. Exit 0 when sound, 1 listing every problem."""
    from deltazip.formats.errors import DeltazipError
    from deltazip.formats.verify import verify_artifact

    fingerprint, base_dir, base_problems = None, None, []
    if base is not None:
        # compress/ computes the fingerprint; formats/ (below it) only compares it with the lineage.
        from deltazip.models.checkpoint import Checkpoint

        try:
            ck = Checkpoint(base, "base")
            base_dir = ck.path
            fingerprint = ck.fingerprint()
        except DeltazipError as e:
            base_problems.append(f"{base}: cannot fingerprint the base model ({e})")
    with progress_bar(json_out) as report:
        result = verify_artifact(artifact, fingerprint, progress=report, base_dir=base_dir)
    result["problems"] += base_problems
    result["ok"] = not result["problems"]
    result["base"] = base
    if json_out:
        print_json(result)
    else:
        for w in result["warnings"]:
            out_console.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)
        for p in result["problems"]:
            out_console.print(f"problem: {p}", markup=False, highlight=False, soft_wrap=True)
        c = result["checked"]
        what = (f"{c['files']} files, {c['containers']} containers, {c['tensors']} tensors "
                f"({c['lossless_parts']} lossless parts, {c['chunks']} chunks)"
                + (f", {c['side_files_referenced']} side files in the base" if c.get("side_files_referenced") else ""))
        if result["ok"]:
            out_console.print(f"{artifact}: sound ({what} checked"
                              + (", base fingerprint matches" if base else "") + ")",
                              markup=False, highlight=False, soft_wrap=True)
        else:
            out_console.print(f"{artifact}: {len(result['problems'])} problem(s) ({what} checked)",
                              markup=False, highlight=False, soft_wrap=True)
    if not result["ok"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify", no_args_is_help=True)(verify)
