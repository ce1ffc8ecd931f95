"""Benchmark without a GPU: the SBMM kernels' SASS, compiled offline for sm_80 and sm_90.

    python bench/kernels_sass.py [--quick] [--out DIR] [--arch 80,90]

Prints ONE JSON document ``{"bench": "kernels_sass", "machine": {...}, "config": {...}, "results":
[...]}`` on stdout (progress on stderr); with ``--out`` also writes ``DIR/kernels_sass.json``. Needs
only Triton (its compiler, ptxas and cuobjdump ship with it); without them it prints one line on
stderr and exits 1.

For every variant (transposed kernel ``triton_sbmm`` and the fast kernel ``triton_fast``; bits 2/3/4/8,
2:4 or dense, symmetric or asymmetric, fp16 or bf16 activations) and arch, a result row has:

- ``instr_per_weight``: SASS instructions in the main K loop (the body of the backward branch that
  holds the tensor-core instructions) divided by the weights one thread processes per iteration;
- ``registers``, ``shared_bytes`` (Triton's allocation, pipelining buffers included) and
  ``loop_smem_stores`` (``STS`` in the loop: a dequantized tile going through shared memory);
- ``bound``: the bound these imply against HBM bandwidth on A100 (sm_80) or H100/H200 (sm_90), as a
  multiple of the floor (the time to read the compressed delta once); the model is in
  ``deltazip.kernels.sass`` and docs/kernels.md.

``summary`` puts transposed and fast side by side per (bits, sparse, asym, dtype, arch) with the ratio of
their instruction counts, and checks the issue's goal (fast kernel, 4 bits, sm_90: at most 3
instructions per weight). The fast kernel has no 3-bit variant (those deltas stay on the transposed
kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[bench/kernels_sass] {msg}", file=sys.stderr, flush=True)


def machine_info() -> dict:
    import torch
    import triton

    from deltazip.kernels import sass

    tool = os.path.join(sass.triton_bin_dir() or "", "cuobjdump")
    try:
        version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception:  # the version is informative only
        version = None
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "cpus": os.cpu_count(), "cuobjdump": version,
            "gpu": "none needed (offline compile)"}


def summarize(results: list[dict]) -> dict:
    from deltazip.kernels import sass

    by = {}
    for r in results:
        by.setdefault((r["bits"], r["sparse"], r["asym"], r["dtype"], r["arch"]), {})[r["kernel"]] = r
    pairs = []
    for (bits, sparse, asym, dtype, arch), ks in sorted(by.items()):
        old, new = ks.get("transposed"), ks.get("fast")
        row = {"bits": bits, "sparse": sparse, "asym": asym, "dtype": dtype, "arch": arch,
               "transposed_instr_per_weight": old and old["instr_per_weight"],
               "fast_instr_per_weight": new and new["instr_per_weight"],
               "transposed_bound_x_floor": old and [b["bound_x_floor"] for b in old["bound"]],
               "fast_bound_x_floor": new and [b["bound_x_floor"] for b in new["bound"]]}
        if old and new:
            row["instr_ratio_transposed_over_fast"] = round(old["instr_per_weight"] / new["instr_per_weight"], 2)
        pairs.append(row)
    goal_rows = [r for r in results if r["kernel"] == "fast" and r["bits"] == 4 and r["arch"] == "sm_90"]
    worst = max(goal_rows, key=lambda r: r["instr_per_weight"], default=None)
    main_rows = [r for r in goal_rows if r["sparse"] and not r["asym"]]
    return {
        "side_by_side": pairs,
        "goal": {
            "instr_per_weight_max": sass.GOAL_INSTR_PER_WEIGHT, "kernel": "fast", "bits": 4, "arch": "sm_90",
            "default_config_4bit_24_sym": {r["dtype"]: r["instr_per_weight"] for r in main_rows},
            "worst_4bit_variant": worst and {k: worst[k] for k in ("sparse", "asym", "dtype", "instr_per_weight")},
            "met_by_default_config": bool(main_rows) and all(
                r["instr_per_weight"] <= sass.GOAL_INSTR_PER_WEIGHT for r in main_rows),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4-bit variants only (a minute or two on 2 cores)")
    ap.add_argument("--out", type=Path, default=None, help="directory for kernels_sass.json")
    ap.add_argument("--arch", default="80,90", help="comma-separated SM versions (default 80,90)")
    args = ap.parse_args()

    from deltazip.kernels import sass

    why = sass.tools_available()
    if why is not None:
        print(f"bench/kernels_sass.py: {why}; nothing compiled", file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        log("TRITON_INTERPRET is set; the offline compile ignores it")
    archs = [int(a) for a in args.arch.split(",") if a.strip()]
    variants = sass.variants(quick=args.quick)
    results = []
    t0 = time.time()
    for arch in archs:
        for v in variants:
            t = time.time()
            row = sass.describe(v, arch)
            results.append(row)
            log(f"sm_{arch} {v.kernel:6s} {v.bits}-bit {'2:4  ' if v.sparse else 'dense'} "
                f"{'asym' if v.asym else 'sym '} {v.dtype}: {row['instr_per_weight']:6.2f} instr/weight, "
                f"{row['registers']} regs, {row['shared_bytes']} B smem ({time.time() - t:.1f}s)")
    doc = {
        "bench": "kernels_sass",
        "machine": machine_info(),
        "config": {
            "quick": args.quick, "archs": [f"sm_{a}" for a in archs],
            "shape_out_x_in": "4096x4096", "group_size": 128, "rows_per_tile": 16,
            "compile": "triton.compile(ASTSource, GPUTarget('cuda', arch, 32)); pointers and ints divisible by 16 "
                       "marked tt.divisibility=16, as the JIT specializes them at 7B shapes",
            "loop": "body of the backward branch holding the tensor-core instructions (cuobjdump -sass)",
            "instr_per_weight": "loop instructions / (weights one thread handles per loop iteration)",
            "bound_model": {
                "issue_per_SM_cycle": sass.ISSUE_PER_SM_CYCLE, "gpus": sass.GPUS,
                "floor": "canonical compressed bytes per weight / HBM bandwidth",
                "bound_x_floor": "max(instr/weight / issue rate, bytes read/weight / HBM) / floor",
            },
            "seconds": None,
        },
        "results": results,
        "summary": summarize(results),
    }
    doc["config"]["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels_sass.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
