"""humming-kernels' MoE GEMM as a delta-matmul candidate, side by side with deltazip's CUDA path (GPU only).

Issue 22 asks to measure a library kernel that multiplies many quantized weights in one launch, each delta
an "expert", before choosing. humming-kernels (vllm-project/humming, Apache-2.0, a 0.5 MiB wheel that
JIT-compiles with NVRTC, ``cu12``/``cu13`` extras) has an *indexed* MoE GEMM: tokens carry an expert id,
tokens are grouped by expert in blocks of the kernel's ``block_shape[0]`` rows, each block reads one
expert's b-bit weight. SBMM maps onto it directly: the delta slot of a row is its expert id.

It has no 2:4 format, so a 2:4 delta is expanded at load to dense b-bit codes (the pruned half coded as 0):
at 4 bits it reads 4 bits per weight where deltazip's 2:4 reads 3 (2 of codes, 1 of positions, per
weight); at 2 bits both read 2. Scales: one fp16/bf16 per 128 inputs per row, as deltazip's.

For each point (shape, bits, dtype, D deltas, R rows each) this times, in one process, with the same
protocol as bench/sbmm_table.py (CUDA graph of launches over a ring of weights larger than the L2,
median replay):

- ``cuda``: deltazip's dispatched path (the measured best of the CUDA SBMM configs and dequantize+cuBLAS);
- ``humming``: ``HummingLayer`` with ``num_experts = 64`` (random codes and scales: speed does not
  depend on values), its default heuristic configs (compiled once per shape/bits/dtype; the MoE block
  size taken from the config interval that holds M = D*R).

Correctness first: a small layer's output (4 experts, rows interleaved) is compared with the dense
product of humming's own dequantized weights, per bits and dtype; a point is timed only if that passed.

    python bench/humming_moe.py --out DIR        # JSON (humming_moe.json) and a markdown table

Needs ``pip install humming-kernels[cu13]`` (or ``[cu12]``), i.e. with nvidia-cuda-nvrtc, -runtime and
-cccl headers; see docs/kernels.md ("Libraries considered instead").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402
from sbmm_table import MAX_D, canonical_bytes, copy_bandwidth, graph_time, markdown, mma_stacks  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench/humming_moe] {msg}", file=sys.stderr, flush=True)


def humming_layer(out_f: int, in_f: int, bits: int, dtype: torch.dtype, experts: int, random: bool = True):
    """A ``HummingLayer`` of ``experts`` b-bit weights ``[out_f, in_f]`` with group-128 scales.

    ``random``: codes and scales are random (timing); else the caller loads tensors before ``transform``."""
    from humming.layer import HummingLayer
    from humming.schema import HummingWeightSchema

    schema = HummingWeightSchema(b_dtype=f"uint{bits}", weight_scale_group_size=128)
    layer = HummingLayer(shape_n=out_f, shape_k=in_f, weight_config=schema, num_experts=experts,
                         torch_dtype=dtype).cuda()
    if random:
        with torch.no_grad():
            for _, p in layer.named_parameters():
                if p.dtype.is_floating_point:
                    p.uniform_(0.002, 0.02)
                else:
                    p.random_()  # any code
        layer.transform()
    return layer


def block_rows(layer, m: int) -> int:
    """The MoE block size (rows of one expert per block) of the heuristic config humming launches at M=m."""
    from humming.tune import get_heuristics_config

    cfg = get_heuristics_config(layer.humming_config, shape_m=None, gemm_type="indexed")
    if isinstance(cfg, dict):
        return int(cfg["block_shape"][0])
    for lo, hi, single in cfg:  # (lo, hi], hi <= 0 unbounded: the interval humming's launcher picks for m
        if lo < m <= (hi if hi > 0 else 1 << 30):
            return int(single["block_shape"][0])
    raise RuntimeError(f"no humming config interval holds M={m}: {[(lo, hi) for lo, hi, _ in cfg]}")


def moe_plan(layer, experts_of_rows: list[int], num_experts: int) -> dict:
    """The indexed-GEMM routing tensors for rows whose expert ids are ``experts_of_rows``."""
    from humming.testing.data import generate_moe_tensors

    topk = torch.tensor(experts_of_rows, dtype=torch.int32, device="cuda").view(-1, 1)
    _, _, sorted_ids, expert_ids, padded = generate_moe_tensors(
        topk, num_experts, "indexed", block_size_config=block_rows(layer, len(experts_of_rows)))
    return {"sorted_ids": sorted_ids, "expert_ids": expert_ids, "num_tokens_padded": padded}


def run(layer, x: torch.Tensor, plan: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[i] = x[i] @ W[expert(i)]ᵀ``: one launch (``x`` ``[M, in]``, ``y`` ``[M, out]`` in row order)."""
    return layer(x, outputs=out, top_k=1, compute_config={"gemm_type": "indexed"}, **plan)


def parity(bits: int, dtype: torch.dtype) -> float:
    """Relative L2 error of humming's indexed GEMM against the dense product of its own dequantized
    weights: 4 experts of 256x1024 with 2:4-pruned values, 8 rows interleaved over them."""
    from humming.schema import HummingWeightSchema

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4, 256, 1024, device="cuda", generator=gen) * 0.02
    w.view(4, 256, 256, 4)[..., 2:] = 0  # 2:4: the last two of every four inputs pruned
    layer = humming_layer(256, 1024, bits, dtype, 4, random=False)
    tensors = HummingWeightSchema.quant_tensor(w.to(dtype), layer.weight_schema, dtype)
    wq = layer.weight_schema.dequant_tensors(tensors).float()
    layer.load_from_tensors(tensors)
    layer.transform()
    rows = [0, 3, 1, 1, 2, 0, 3, 2]
    x = torch.randn(len(rows), 1024, device="cuda", generator=gen).to(dtype)
    got = run(layer, x, moe_plan(layer, rows, 4)).float()
    ref = torch.stack([x[i].float() @ wq[e].T for i, e in enumerate(rows)])
    return ((got - ref).norm() / ref.norm()).item()


def point(out_f, in_f, bits, dtype, d, r, rings, bw, replays) -> dict:
    from deltazip.kernels.row_plan import plan_rows
    from deltazip.runtime.serve import kernel_tuning

    stacks, layers = rings
    n = d * r
    n_launch = max(2, min(32, 2 * MAX_D // d))
    windows = [((i % 2), (i // 2 * d) % MAX_D) for i in range(n_launch)]
    x = torch.randn(n, in_f, device="cuda").to(dtype)
    y = torch.zeros(n, out_f, device="cuda", dtype=dtype)
    rows = [[o + (k % d) for k in range(n)] for _, o in windows]  # rows interleaved over the deltas
    res = {}
    plans = [plan_rows(rw, MAX_D, "cuda") for rw in rows]
    choice = kernel_tuning.tune(stacks[0], dtype, n, d)
    res["cuda"] = round(graph_time([lambda s=s, p=p: kernel_tuning.run_choice(choice, x, stacks[s], p, out=y)
                                    for (s, _), p in zip(windows, plans)], replays), 2)
    hplans = [moe_plan(layers[s], rw, MAX_D) for (s, _), rw in zip(windows, rows)]
    res["humming"] = round(graph_time([lambda s=s, p=p: run(layers[s], x, p, out=y)
                                       for (s, _), p in zip(windows, hplans)], replays), 2)
    floor = d * canonical_bytes(out_f, in_f, bits, 128, r) / bw * 1e6
    dense_bytes = out_f * in_f * bits // 8 + out_f * (in_f // 128) * 2 + r * (in_f + out_f) * 2
    return {"shape": f"{out_f}x{in_f}", "bits": bits, "dtype": str(dtype).removeprefix("torch."), "deltas": d,
            "rows_per_delta": r, "us": res, "floor_us": round(floor, 2),
            "humming_floor_us": round(d * dense_bytes / bw * 1e6, 2),
            "cuda_over_floor": round(res["cuda"] / floor, 2), "humming_over_floor": round(res["humming"] / floor, 2),
            "humming_vs_cuda": round(res["humming"] / res["cuda"], 3), "dispatch": choice.to_json()}


def table(results: list[dict]) -> str:
    return markdown(results, {"cuda µs": lambda p: p["us"]["cuda"], "humming µs": lambda p: p["us"]["humming"],
                              "floor (2:4)": "floor_us", "humming floor (dense b-bit)": "humming_floor_us",
                              "cuda/floor": "cuda_over_floor", "humming/floor": "humming_over_floor",
                              "humming/cuda": "humming_vs_cuda"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="D 1 and 16 with 1 row each (overrides --deltas/--rows)")
    ap.add_argument("--out", type=Path, default=None, help="write humming_moe.json and humming_table.md here")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--shapes", default="4096x4096", help="comma list of OUTxIN (default 4096x4096)")
    ap.add_argument("--dtypes", default="float16", help="comma list of float16, bfloat16")
    ap.add_argument("--deltas", default="1,16,64")
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args(argv)
    if args.quick:
        args.deltas, args.rows = "1,16", "1"
    if not torch.cuda.is_available():
        print("bench/humming_moe.py needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        import humming
    except Exception as e:  # noqa: BLE001
        print(f"bench/humming_moe.py: humming-kernels is not importable ({type(e).__name__}: {e}); "
              "pip install 'humming-kernels[cu13]' (or [cu12], matching torch's CUDA)", file=sys.stderr)
        return 1
    t0 = time.time()
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e9:.0f} GB/s; humming {humming.__version__}")
    dtypes = [getattr(torch, s) for s in args.dtypes.split(",")]
    checks, failures, results = {}, {}, []
    for bits in (4, 2):
        for dtype in dtypes:
            key = f"{bits}-bit {str(dtype).removeprefix('torch.')}"
            try:
                checks[key] = parity(bits, dtype)
            except Exception as e:  # noqa: BLE001  (recorded, the other settings still run)
                failures[key] = f"{type(e).__name__}: {e}"
                log(f"parity {key} failed:\n{traceback.format_exc()}")
    log(f"parity (relative L2 vs humming's dequantized weights): {checks}")
    for shape in args.shapes.split(","):
        out_f, in_f = (int(v) for v in shape.split("x"))
        for bits in (4, 2):
            stacks = None
            for dtype in dtypes:
                key = f"{bits}-bit {str(dtype).removeprefix('torch.')}"
                if checks.get(key, 1.0) > 2e-2:
                    continue
                try:
                    stacks = stacks or mma_stacks(out_f, in_f, bits, 2)
                    s = time.time()
                    layers = [humming_layer(out_f, in_f, bits, dtype, MAX_D) for _ in range(2)]
                    log(f"{shape} {key}: humming layers built in {time.time() - s:.1f} s")
                    for d in (int(v) for v in args.deltas.split(",")):
                        for r in (int(v) for v in args.rows.split(",")):
                            p = point(out_f, in_f, bits, dtype, d, r, (stacks, layers), bw, args.replays)
                            results.append(p)
                            log(str(p))
                    del layers
                except Exception as e:  # noqa: BLE001
                    failures[f"{shape} {key}"] = f"{type(e).__name__}: {e}"
                    log(f"{shape} {key} failed:\n{traceback.format_exc()}")
                torch.cuda.empty_cache()
    doc = {"bench": "humming_moe",
           "machine": {**machine(), "humming": humming.__version__, "copy_GBps": round(bw / 1e9, 1),
                       "cuda_runtime": torch.version.cuda},
           "config": vars(args) | {"out": str(args.out) if args.out else None},
           "parity": checks, "failures": failures, "results": results, "seconds": round(time.time() - t0, 1),
           "median_humming_vs_cuda": statistics.median([p["humming_vs_cuda"] for p in results]) if results else None}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "humming_table.md").write_text(table(results) + "\n")
    print(table(results), file=sys.stderr)
    emit(doc, args.out, "humming_moe.json")
    return 0 if results and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
