"""``deltazip compress``: ΔCompress a fine-tune against its base into an artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deltazip.deltacli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    OverwriteOpt,
    RequiredBaseOpt,
    print_json,
    progress_bar,
)
from deltazip.deltacli.render import render_error_curve, render_summary
from deltazip.formats.gdeflate import DEFAULT_LEVEL, MAX_LEVEL, MIN_LEVEL


def compress(
    base: RequiredBaseOpt,
    finetuned: Annotated[str, typer.Option("--finetuned", help="Fine-tuned model: local HF directory or hub id.",
                                           show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory to create.", show_default=False)],
    calib: Annotated[str, typer.Option("--calib", help="Calibration data: .jsonl/.json/.txt/.parquet or a hub "
                                       "dataset id (not needed for --method rtn).")] = "",
    calib_images: Annotated[Path | None, typer.Option("--calib-images", help="Image-text fine-tunes that "
                            "changed the vision tower or projector: a directory of images (.png/.jpg) whose "
                            "reading calibrates their compression; without it they are stored exactly.",
                            show_default=False)] = None,
    bits: Annotated[int | None, typer.Option(help="Bits per kept delta value: 2, 3, 4 or 8 \\[default: 4].",
                                             show_default=False)] = None,
    sparsity: Annotated[str | None, typer.Option(help="'2:4' (structured, only kept values stored) or 'none' "
                                                 "\\[default: 2:4].", show_default=False)] = None,
    group_size: Annotated[str, typer.Option(help="Input columns per quantization group: auto (the largest of "
                                            "128/64/32 dividing every compressed input dimension, per tensor if "
                                            "none divides them all), a size, or -1 = one per row.")] = "auto",
    embed_bits: Annotated[int, typer.Option(help="Bits per changed embedding value (rows stored row by row); "
                                            "0 = same as --bits.")] = 0,
    target_ratio: Annotated[float, typer.Option("--target-ratio", help="Choose bits, 2:4 or dense (or drop the "
                                                "delta) per tensor to keep the measured error lowest within "
                                                "fine-tuned bytes / R; replaces --bits/--sparsity/--embed-bits.",
                                                show_default=False)] = 0.0,
    max_bytes: Annotated[int, typer.Option("--max-bytes", help="Like --target-ratio, with the artifact's size "
                                           "in bytes.", show_default=False)] = 0,
    report: Annotated[bool, typer.Option("--report", help="Measure every tensor's error per setting first and "
                                         "print the error-vs-size curve (sizes a --target-ratio run reaches).")
                      ] = False,
    embed_group_size: Annotated[int, typer.Option(help="Hidden columns per group of embedding rows; 0 = same as "
                                                  "--group-size, -1 = one per row.")] = 0,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric grid or asymmetric with zero points.")] = True,
    scheme: Annotated[str, typer.Option(help="Kind of the compressed linears: 'packed' (2:4 + GPTQ codes) or "
                                        "another registered scheme (deltazip.formats.codecs).")] = "packed",
    nsamples: Annotated[int, typer.Option(help="Calibration windows.")] = 256,
    seqlen: Annotated[int, typer.Option(help="Tokens per window (truncated to what the data has).")] = 2048,
    damp: Annotated[float, typer.Option(help="Hessian dampening relative to its mean diagonal.")] = 0.01,
    method: Annotated[str, typer.Option(help="deltazip (delta + reconstructed calibration), sparsegpt (solver on "
                                        "full weights) or rtn (round-to-nearest delta).")] = "deltazip",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    seed: Annotated[int, typer.Option(help="Seed of the calibration sampler.")] = 0,
    batch_size: Annotated[int, typer.Option(help="Calibration windows per layer forward.")] = 8,
    calib_activations: Annotated[str, typer.Option(help="'reconstructed' (ΔCompress) or 'base' (ablation: "
                                                   "calibrate on the base model's own activations).")] = "reconstructed",
    lossless: Annotated[str, typer.Option("--lossless", help="Lossless stage after packing: 'auto' (GDeflate where "
                                          "nvCOMP's CPU library loads, else none), 'gdeflate' (chunked, decodable by "
                                          "nvCOMP on a GPU) or 'none'.")] = "auto",
    lossless_level: Annotated[int, typer.Option("--lossless-level", min=MIN_LEVEL, max=MAX_LEVEL,
                                                help="GDeflate level (0 fastest .. 12 smallest).")] = DEFAULT_LEVEL,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Compress the delta between FINETUNED and BASE (2:4 prune + GPTQ quantize, layer by layer)."""
    from deltazip.compress.pipeline import compress_delta

    cfg = _config(bits, sparsity, group_size, sym, scheme, embed_bits, target_ratio, max_bytes,
                  nsamples=nsamples, seqlen=seqlen, damp=damp, method=method, device=device, dtype=dtype, seed=seed,
                  batch_size=batch_size, calib_activations=calib_activations, embed_group_size=embed_group_size,
                  report=report)
    with progress_bar(json_out) as bar:
        summary = compress_delta(base, finetuned, calib or None, out, cfg, overwrite=overwrite, progress=bar,
                                 lossless=lossless, lossless_level=lossless_level, calib_images=calib_images)
    if json_out:
        print_json(summary)
        return
    render_summary(summary, title=f"compressed {finetuned} -> {out}")
    if report:
        render_error_curve(summary["sensitivity"])


def _config(bits, sparsity, group_size, sym, scheme, embed_bits, target_ratio, max_bytes, **options):
    """The CompressConfig the options name; --bits/--sparsity/--embed-bits and a budget exclude each other."""
    from deltazip.compress.config import CompressConfig, parse_group_size, scheme_from_options
    from deltazip.formats import codecs
    from deltazip.formats.errors import InputError
    from deltazip.kernels.scheme import kind_rules

    if (target_ratio or max_bytes) and (bits is not None or sparsity is not None or embed_bits):
        given = next(f for f, v in (("--bits", bits), ("--sparsity", sparsity), ("--embed-bits", embed_bits or None))
                     if v is not None)
        budget = "--target-ratio" if target_ratio else "--max-bytes"
        raise InputError(f"{given} and {budget} both say how many bits to store: {budget} chooses bits and "
                         f"sparsity per tensor, so drop {given}")
    group, auto = parse_group_size(group_size)
    if auto and scheme in codecs.kinds() and kind_rules(scheme).whole_rows_only:
        group, auto = -1, False  # a scheme of whole-row groups only: auto is its one group
    return CompressConfig(scheme=scheme_from_options(4 if bits is None else bits, sparsity or "2:4", group, sym,
                                                     scheme), group_auto=auto, embed_bits=embed_bits,
                          target_ratio=target_ratio, max_bytes=max_bytes, **options)


def register(app: typer.Typer) -> None:
    app.command("compress", no_args_is_help=True)(compress)
