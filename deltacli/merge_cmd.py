"""``deltazip merge``: base + artifact -> a plain Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import ArtifactArg, BaseOpt, JsonOpt, OverwriteOpt, print_json, progress_bar


def merge(
    artifact: ArtifactArg,
    out: Annotated[Path, typer.Option("--out", help="Directory of the merged checkpoint.", show_default=False)],
    base: BaseOpt = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard: e.g. 2GB, 500MB (powers of 1000), 1GiB, or bytes.")] = "2GB",
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write BASE + the artifact's delta as a checkpoint that AutoModelForCausalLM loads."""
    from deltazip.compress.merge import merge_to_dir, open_base, parse_shard_size
    from deltazip.formats.artifact import Artifact
    from deltazip.formats.outputs import artifact_inputs, check_output

    parse_shard_size(max_shard_size)  # a typo fails now, not after the base is read
    art = Artifact(artifact)
    # Before the base is fingerprinted (every byte read); merge_to_dir checks again with the base it opened.
    check_output(out, "--out", [*artifact_inputs("ARTIFACT", artifact), ("--base", base)], overwrite)
    b = open_base(art, base)
    with progress_bar(json_out) as report:
        path = merge_to_dir(art, b, out, overwrite=overwrite, max_shard_size=max_shard_size, progress=report)
    files = sorted(p.name for p in path.iterdir())
    if json_out:
        print_json({"merged": str(path), "base": str(b.path), "artifact": str(artifact), "files": files})
    else:
        typer.echo(f"merged {artifact} onto {b.path} -> {path} ({len(files)} files)")


def register(app: typer.Typer) -> None:
    app.command("merge", no_args_is_help=True)(merge)
