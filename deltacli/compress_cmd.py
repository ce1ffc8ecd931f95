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
from deltazip.deltacli.render import render_summary
from deltazip.formats.gdeflate import DEFAULT_LEVEL, MAX_LEVEL, MIN_LEVEL


def compress(
    base: RequiredBaseOpt,
    finetuned: Annotated[str, typer.Option("--finetuned", help="Fine-tuned model: local HF directory or hub id.",
                                           show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Artifact directory to create.", show_default=False)],
    calib: Annotated[str, typer.Option("--calib", help="Calibration data: .jsonl/.json/.txt/.parquet or a hub "
                                       "dataset id (not needed for --method rtn).")] = "",
    bits: Annotated[int, typer.Option(help="Bits per kept delta value: 2, 3, 4 or 8.")] = 4,
    sparsity: Annotated[str, typer.Option(help="'2:4' (structured, only kept values stored) or 'none'.")] = "2:4",
    group_size: Annotated[int, typer.Option(help="Input columns per quantization group; -1 = one per row.")] = 128,
    embed_bits: Annotated[int, typer.Option(help="Bits per changed embedding value (rows stored row by row); "
                                            "0 = same as --bits.")] = 0,
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
    from deltazip.compress.config import CompressConfig, scheme_from_options
    from deltazip.compress.pipeline import compress_delta

    cfg = CompressConfig(scheme=scheme_from_options(bits, sparsity, group_size, sym, scheme), nsamples=nsamples,
                         seqlen=seqlen, damp=damp, method=method, device=device, dtype=dtype, seed=seed,
                         batch_size=batch_size, calib_activations=calib_activations, embed_bits=embed_bits,
                         embed_group_size=embed_group_size)
    with progress_bar(json_out) as report:
        summary = compress_delta(base, finetuned, calib or None, out, cfg, overwrite=overwrite, progress=report,
                                 lossless=lossless, lossless_level=lossless_level)
    if json_out:
        print_json(summary)
    else:
        render_summary(summary, title=f"compressed {finetuned} -> {out}")


def register(app: typer.Typer) -> None:
    app.command("compress", no_args_is_help=True)(compress)
