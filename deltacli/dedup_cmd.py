"""``deltazip dedup-scan``: bit-identical tensors across checkpoints, bytes a dedup loader saves."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from deltazip.deltacli.common import JsonOpt, OverwriteOpt, human_bytes, out_console, print_json, progress_bar

_MIB = 1024 * 1024


class HashAlgo(str, Enum):
    xxh3 = "xxh3"
    blake3 = "blake3"
    blake2b = "blake2b"


def register(app: typer.Typer) -> None:
    app.command("dedup-scan")(dedup_scan)


def dedup_scan(
    checkpoints: Annotated[list[Path], typer.Argument(
        help="Checkpoints: HF model dirs (single or sharded safetensors), .safetensors files, diffusers "
             "pipeline dirs, GGUF files.", show_default=False)],
    hash_algo: Annotated[HashAlgo, typer.Option(
        "--hash", help="xxh3 (xxh3-128, fastest), blake3 (cryptographic) or blake2b (blake2b-256).")] = HashAlgo.xxh3,
    min_bytes: Annotated[int, typer.Option(
        "--min-bytes", min=0, help="Do not hash or deduplicate tensors smaller than this many bytes.")] = 0,
    verify_bytes: Annotated[bool, typer.Option(
        "--verify-bytes", help="Compare the bytes of every candidate pair before calling it identical.")] = False,
    manifest: Annotated[Path | None, typer.Option(
        "--manifest", help="Write a content-addressed manifest (JSON, see docs/dedup.md) here.",
        show_default=False)] = None,
    diff_stats: Annotated[bool, typer.Option(
        "--diff-stats/--no-diff-stats",
        help="Measure how same-name, same-shape tensors differ (fraction changed, relative L2, max abs).")] = True,
    top: Annotated[int, typer.Option("--top", min=1, help="Rows of the groups table (JSON lists all).")] = 15,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="Reader/hasher threads (default: 2 per CPU, max 8).",
                                                show_default=False)] = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Find bit-identical tensors across checkpoints and the memory a deduplicating loader saves."""
    from deltazip.formats.dedup_scan import ScanConfig, scan_checkpoints
    from deltazip.formats.outputs import check_output

    if manifest is not None:  # before the scan, which can take minutes
        check_output(manifest, "--manifest", [("CHECKPOINT", c) for c in checkpoints], overwrite, kind="file")
    cfg = ScanConfig(hash=hash_algo.value, min_bytes=min_bytes, verify_bytes=verify_bytes, diff_stats=diff_stats,
                     threads=threads)
    with progress_bar(json_out) as report:
        # The bar counts MiB: the shared bar prints raw done/total numbers.
        res = scan_checkpoints(checkpoints, cfg,
                               progress=lambda phase, done, total: report(f"{phase} (MiB)", done // _MIB,
                                                                          max(1, total // _MIB)))
    doc = res.to_dict()
    if manifest is not None:
        res.write_manifest(manifest)
        doc["manifest"] = str(manifest)
    if json_out:
        print_json(doc)
        return
    _render(doc, top)


def _render(doc: dict, top: int) -> None:
    con = out_console
    t = Table(title="Checkpoints", title_justify="left")
    for c in ("#", "checkpoint", "kind", "files", "tensors", "size", "reused from earlier", "reused %"):
        t.add_column(c, justify="right" if c not in ("checkpoint", "kind") else "left")
    for c in doc["checkpoints"]:
        t.add_row(str(c["index"]), escape(c["path"]), c["kind"], str(c["files"]), str(c["tensors"]), human_bytes(c["bytes"]),
                  f"{c['reused_tensors']} ({human_bytes(c['reused_bytes'])})",
                  f"{100 * c['reused_bytes'] / c['bytes']:.1f}%" if c["bytes"] else "-")
    con.print(t)
    for c in doc["checkpoints"]:
        if c["skipped_files"]:
            con.print(f"[dim]checkpoint {c['index']}: not read (other variants/duplicates): "
                      f"{escape(', '.join(Path(p).name for p in c['skipped_files']))}[/dim]")

    tot = doc["totals"]
    con.print(
        f"\n[bold]{tot['tensors']}[/bold] tensors, {human_bytes(tot['bytes'])} in {tot['checkpoints']} checkpoints; "
        f"{tot['unique_tensors']} unique tensors ({human_bytes(tot['unique_bytes'])} hashed with {doc['hash']}).\n"
        f"A deduplicating loader reuses [bold]{tot['reused_tensors']}[/bold] tensors and saves "
        f"[bold green]{human_bytes(tot['bytes_saved'])} ({tot['saved_pct']:.2f}%)[/bold green]: "
        f"{human_bytes(tot['bytes_after_dedup'])} instead of {human_bytes(tot['bytes'])}.")
    if doc["min_bytes"]:
        con.print(f"[dim]{tot['tensors'] - tot['hashed_tensors']} tensors below --min-bytes {doc['min_bytes']} "
                  "were not hashed.[/dim]")
    if doc["verify_bytes"]:
        con.print(f"Byte verification: {doc['verified_pairs']} pairs compared, {doc['collisions']} hash collisions.")
    tm = doc["timing"]
    if tm["hash_gb_per_s"] is not None:
        con.print(f"[dim]hashed {human_bytes(tot['hashed_bytes'])} in {tm['hash_seconds']:.2f} s "
                  f"({tm['hash_gb_per_s']:.2f} GB/s), total {tm['elapsed_seconds']:.2f} s[/dim]")

    t = Table(title="\nPer component", title_justify="left")
    for c in ("component", "tensors", "size", "reused", "saved", "saved %"):
        t.add_column(c, justify="left" if c == "component" else "right")
    for c in doc["components"]:
        t.add_row(escape(c["component"]), str(c["tensors"]), human_bytes(c["bytes"]), str(c["reused_tensors"]),
                  human_bytes(c["bytes_saved"]), f"{c['saved_pct']:.1f}%")
    con.print(t)

    groups = doc["groups"]
    if groups:
        t = Table(title=f"\nIdentical tensors (top {min(top, len(groups))} of {len(groups)} groups by bytes saved)",
                  title_justify="left")
        for c in ("tensor", "dtype", "shape", "size", "copies", "saved", "appears in"):
            t.add_column(c, justify="right" if c in ("size", "copies", "saved") else "left")
        for g in groups[:top]:
            occ = g["occurrences"]
            names = {o["name"] for o in occ}
            where = ", ".join(f"#{o['checkpoint']}" + ("" if len(names) == 1 else f":{o['name']}") for o in occ[:6])
            if len(occ) > 6:
                where += f", +{len(occ) - 6}"
            t.add_row(escape(occ[0]["name"]), g["dtype"], "x".join(map(str, g["shape"])) or "scalar", human_bytes(g["nbytes"]),
                      str(g["count"]), human_bytes(g["bytes_saved"]), escape(where))
        con.print(t)
    else:
        con.print("\nNo identical tensors.")

    summary = doc["differing_summary"]
    if summary:
        t = Table(title="\nSame name and shape, different bytes (delta-compression candidates)", title_justify="left")
        for c in ("vs", "component", "tensors", "other dtype", "elements changed", "rel. L2", "max |diff|"):
            t.add_column(c, justify="left" if c in ("vs", "component") else "right")
        for s in summary:
            t.add_row(f"#{s['checkpoint']} vs #{s['reference']}", escape(s["component"]), str(s["tensors"]),
                      str(s["dtype_changed"]) if s["dtype_changed"] else "-",
                      _fmt_frac(s["fraction_changed"]), _fmt_num(s["rel_l2"]), _fmt_num(s["max_abs"]))
        con.print(t)
        con.print("[dim]Small relative L2 with many elements changed: a delta compresses well "
                  "(deltazip compress); the --json output lists every tensor.[/dim]")
    if doc.get("manifest"):
        con.print(f"\nManifest written to {doc['manifest']} (schema: docs/dedup.md).", markup=False)


def _fmt_frac(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _fmt_num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
