"""Grouped LoRA: the four paths ``deltazip.kernels.grouped_lora`` measures, side by side in one run.

    python bench/lora.py [--adapters 8 32] [--rank 16] [--shapes 576x1536 4096x4096] [--rows 1 8 32 256]
        [--repeats 21] [--quick] [--out DIR]

For each linear shape (``in x out``), stack of ``--adapters`` adapters of rank ``--rank`` and batch of
``--rows`` rows spread over as many adapters as there are rows (``min(rows, adapters)``): the median
seconds of ``loop`` (a GEMM pair per adapter in the batch), ``stacked`` (two GEMMs over every adapter),
``gathered`` (each row's factors gathered, two batched matmuls) and ``grouped`` (torch's grouped GEMM),
each checked against the loop first, the path ``grouped_lora`` would choose, and each path's ratio to the
loop. On CPU fp32, on a GPU bf16.
``--quick``: one shape (576x1536), 8 adapters, rows 1 and 32, 7 repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--shapes", nargs="+", default=["576x1536", "4096x4096"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.shapes, a.adapters, a.rows, a.repeats = ["576x1536"], [8], [1, 32], 7
    from deltazip.kernels import grouped_lora

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in a.shapes:
        in_f, out_f = (int(v) for v in shape.split("x"))
        for num in a.adapters:
            A = (torch.randn(num, a.rank, in_f, generator=gen) / in_f**0.5).to(device, dtype)
            B = (torch.randn(num, out_f, a.rank, generator=gen) / a.rank**0.5).to(device, dtype)
            scale = (torch.rand(num, generator=gen) + 0.5).to(device)
            for n in a.rows:
                x = torch.empty(n, in_f, device=device, dtype=dtype)
                times = grouped_lora.measure(x, A, B, scale, reps=a.repeats)
                ok = {k: v for k, v in times.items() if isinstance(v, float)}
                row = {"in": in_f, "out": out_f, "adapters": num, "rank": a.rank, "rows": n,
                       "used_adapters": min(n, num), "median_s": times, "chosen": min(ok, key=ok.get)}
                row["over_loop"] = {k: round(v / ok["loop"], 3) for k, v in ok.items()} if "loop" in ok else {}
                rows_out.append(row)
                print(f"[bench/lora] {shape} L={num} rows={n}: {row['chosen']} {row['over_loop']}", file=sys.stderr)
    emit({"bench": "lora", "machine": machine(), "dtype": str(dtype).removeprefix("torch."),
          "threads": torch.get_num_threads(), "results": rows_out}, a.out, "lora.json")


if __name__ == "__main__":
    main()
