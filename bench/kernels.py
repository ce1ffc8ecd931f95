"""Benchmark: SBMM (one launch, every row times its own compressed delta) against the alternatives.

    python bench/kernels.py [--quick] [--out DIR] [--repeats N]

Prints ONE JSON document ``{"bench": "kernels", "machine": {...}, "config": {...}, "results": [...]}``
on stdout (progress notes go to stderr) and, with ``--out``, writes it to ``DIR/kernels.json`` plus
``DIR/kernels_speedup.png``. Needs a CUDA GPU and Triton: without them it prints one line on stderr
and exits 1 (no numbers are made up on a CPU).

For Llama-7B-like linears (out x in = 4096x4096, 11008x4096, 4096x11008), 1..64 deltas and 1..16
rows per delta (rows of different deltas interleaved, as in a serving batch), side by side in one
run, medians of CUDA-event timings with the L2 cache flushed before every repeat:

- ``loop_dequant``: per delta, dequantize the packed delta with the pure-torch reference, then
  ``x[rows] @ W.T`` in fp16 (the naive low-precision loop);
- ``loop_fp16``: per delta, ``x[rows] @ W16[d].T`` with the deltas already dense fp16 in memory;
- ``loop_triton``: per delta, one single-delta launch of the SBMM kernel (fused, but one launch each,
  plans prebuilt);
- ``bmm_fp16``: gather rows grouped by delta, ``torch.bmm`` over the stacked fp16 deltas, scatter back
  (needs every delta dense in fp16: 16x the memory of a 4-bit 2:4 delta);
- ``sbmm``: the transposed Triton SBMM (``triton_sbmm``, transposed layout) with the row plan built
  beforehand (a server builds it once per step and shares it across all linears); ``sbmm_with_plan``
  includes building the plan;
- ``sbmm_fast``: the bandwidth-bound kernel (``triton_fast``, mma layout: 2:4 expanded to dense codes
  at load), same plan;
- ``base_gemm``: the base model's ``x @ W_base.T`` for all rows, for scale.

Activations are fp16 and bf16 (``--quick``: fp16). Per point it reports the bytes SBMM must read
(the compressed deltas in use, plus x and y; the fast kernel's own layout reads more at 4-bit 2:4 and
its ``sbmm_fast_own_bytes`` say how much), achieved bandwidth and the ratio to the bandwidth floor
(compressed bytes / peak bandwidth; peak from NVML when available, else a measured
device-to-device copy). A parity check of both kernels against the reference runs for every
configuration before timing. ``tuning`` records sweep SBMM tile sizes at two points;
``semi_structured`` records compare, at prefill token counts on one delta, dense fp16, PyTorch's 2:4
semi-structured sparse matmul (cuSPARSELt/CUTLASS) of the dequantized delta, and SBMM.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path


def log(msg: str) -> None:
    print(f"[bench/kernels] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- machine


def nvml_peak_bandwidth(index: int) -> float | None:
    """Spec DRAM bandwidth in GB/s from NVML (max memory clock x bus width x 2), or None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * clock_mhz * 1e6 * bus_bits / 8 / 1e9
    except Exception:  # NVML present but unusable (containers, old drivers)
        return None


def measured_copy_bandwidth(torch) -> float:
    """Device-to-device copy of 1 GiB: (read + write bytes) / median time, GB/s."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times[2:]) / 1e9


def machine_info(torch, triton) -> dict:
    props = torch.cuda.get_device_properties(0)
    spec = nvml_peak_bandwidth(torch.cuda.current_device())
    copy = measured_copy_bandwidth(torch)
    return {
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "gpu": props.name, "capability": f"{props.major}.{props.minor}", "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "peak_bandwidth_GBps_spec": spec, "copy_bandwidth_GBps_measured": round(copy, 1),
        "floor_bandwidth_GBps": round(spec if spec else copy, 1),
        "floor_bandwidth_source": "nvml spec" if spec else "measured device copy",
    }


# ---------------------------------------------------------------------------------- timing


class Timer:
    """Median GPU time of a callable over repeats (CUDA events), L2 flushed before each repeat."""

    def __init__(self, torch, repeats: int, warmup: int = 3):
        self.torch = torch
        self.repeats = repeats
        self.warmup = warmup
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (64 << 20)
        self.flush_buf = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            self.flush_buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)  # microseconds
        return statistics.median(times)


# ------------------------------------------------------------------------------------ deltas


def make_unique_deltas(torch, out_f, in_f, bits, group, count, seed):
    """``count`` random 2:4 deltas (canonical PackedDelta on the GPU) with small scales."""
    from deltazip.formats.packing import pack_delta

    gen = torch.Generator(device="cuda").manual_seed(seed)
    deltas = []
    for _ in range(count):
        codes = torch.randint(0, 2**bits, (out_f, in_f), device="cuda", generator=gen)
        scales = (torch.rand(out_f, in_f // group, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        keep = torch.rand(out_f, in_f // 4, 4, device="cuda", generator=gen).argsort(-1)[..., :2]
        mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool, device="cuda").scatter_(-1, keep, True)
        deltas.append(pack_delta(codes, scales, None, mask.reshape(out_f, in_f), bits, group))
        del codes, mask
    return deltas


def slot_bytes(stack, slot_count: int) -> int:
    """Compressed bytes of ``slot_count`` slots of a stack."""
    parts = [stack.qweight, stack.scales, stack.zeros, stack.positions]
    return sum(p[0].numel() * p.element_size() for p in parts if p is not None) * slot_count


# -------------------------------------------------------------------------------- benchmarks


def point_methods(torch, x, index, rows, ones, single_plans, perm, plan, canonical, singles, w16, stack, w_base,
                  fstack):
    """The candidates of one (shape, deltas, rows per delta) point, as zero-argument callables."""
    from deltazip.kernels import reference
    from deltazip.kernels.triton_fast import sbmm_fast
    from deltazip.kernels.triton_sbmm import sbmm_triton

    n, in_f = x.shape
    d, out_f = w16.shape[0], w16.shape[1]
    r = n // d
    dt = x.dtype

    def loop_dequant():
        y = torch.zeros(n, out_f, dtype=dt, device="cuda")
        for s in range(d):
            w = reference.delta_weight(canonical[s]).to(dt)
            y[rows[s]] = x[rows[s]] @ w.T
        return y

    def loop_fp16():
        y = torch.zeros(n, out_f, dtype=dt, device="cuda")
        for s in range(d):
            y[rows[s]] = x[rows[s]] @ w16[s].T
        return y

    def loop_triton():
        y = torch.zeros(n, out_f, dtype=dt, device="cuda")
        for s in range(d):
            y[rows[s]] = sbmm_triton(x[rows[s]], ones[s], singles[s], plan=single_plans[s])
        return y

    def bmm_fp16():
        xg = x[perm].view(d, r, in_f)
        yg = torch.bmm(xg, w16.transpose(1, 2))
        y = torch.empty(n, out_f, dtype=dt, device="cuda")
        y[perm] = yg.reshape(n, out_f)
        return y

    def sbmm():
        return sbmm_triton(x, index, stack, plan=plan)

    def sbmm_with_plan():
        return sbmm_triton(x, index, stack)

    def sbmm_fast_():
        return sbmm_fast(x, index, fstack, plan=plan)

    def base_gemm():
        return x @ w_base.T

    return {"loop_dequant": loop_dequant, "loop_fp16": loop_fp16, "loop_triton": loop_triton,
            "bmm_fp16": bmm_fp16, "sbmm": sbmm, "sbmm_with_plan": sbmm_with_plan, "sbmm_fast": sbmm_fast_,
            "base_gemm": base_gemm}


def mma_view(fstack, d: int):
    """The first ``d`` slots of an mma-layout stack, as a stack (views, no copy)."""
    from dataclasses import replace

    return replace(fstack, qweight=fstack.qweight[:d], scales=fstack.scales[:d])


def bench_shape(torch, timer, floor_gbps, out_f, in_f, bits, group, deltas_list, rows_list, dtype, unique=4):
    from deltazip.kernels import reference
    from deltazip.kernels.stacked import StackedDeltas
    from deltazip.kernels.triton_fast import sbmm_fast
    from deltazip.kernels.triton_sbmm import group_rows, sbmm_triton

    dt = getattr(torch, dtype)
    d_max = max(deltas_list)
    log(f"shape {out_f}x{in_f} bits={bits} g={group} {dtype}: building {d_max} deltas")
    uniq = make_unique_deltas(torch, out_f, in_f, bits, group, min(unique, d_max), seed=out_f + in_f + bits)
    stack = StackedDeltas.allocate(d_max, bits=bits, group_size=group, in_features=in_f, out_features=out_f,
                                   sparse=True, asymmetric=False, device="cuda", layout="transposed")
    fstack = StackedDeltas.allocate(d_max, bits=bits, group_size=group, in_features=in_f, out_features=out_f,
                                    sparse=True, asymmetric=False, device="cuda", layout="mma")
    for s in range(d_max):
        stack.write(s, uniq[s % len(uniq)])
        fstack.write(s, uniq[s % len(uniq)])
    canonical = [stack.unstack(s) for s in range(d_max)]  # distinct memory per slot for the loops
    dense_u = [reference.delta_weight(d).to(dt) for d in uniq]
    w16 = torch.empty(d_max, out_f, in_f, dtype=dt, device="cuda")
    for s in range(d_max):
        w16[s].copy_(dense_u[s % len(uniq)])
    del dense_u
    w_base = (torch.randn(out_f, in_f, device="cuda") * 0.02).to(dt)

    # Parity of both SBMM kernels against the reference before any timing.
    gen = torch.Generator(device="cuda").manual_seed(1)
    xc = torch.randn(24, in_f, device="cuda", generator=gen).to(dt)
    ic = torch.randint(-1, min(4, d_max), (24,), device="cuda", generator=gen)
    sub = StackedDeltas(stack.qweight[:4], stack.scales[:4], None, stack.positions[:4], bits, group, in_f, out_f)
    rc = reference.sbmm(xc, ic, canonical[:4]).float()
    parity = {}
    for name, yc in (("sbmm", sbmm_triton(xc, ic, sub)), ("sbmm_fast", sbmm_fast(xc, ic, mma_view(fstack, 4)))):
        parity[name] = ((yc.float() - rc).norm() / rc.norm().clamp_min(1e-12)).item()
    log(f"  parity: relative L2 error vs reference = {parity}")

    results = []
    for d in deltas_list:
        sub = StackedDeltas(stack.qweight[:d], stack.scales[:d], None, stack.positions[:d], bits, group, in_f, out_f)
        fsub = mma_view(fstack, d)
        singles = [StackedDeltas(stack.qweight[s:s + 1], stack.scales[s:s + 1], None, stack.positions[s:s + 1],
                                 bits, group, in_f, out_f) for s in range(d)]
        for r in rows_list:
            n = d * r
            index = torch.arange(d, device="cuda").repeat_interleave(r)[torch.randperm(n, device="cuda")]
            x = torch.randn(n, in_f, device="cuda").to(dt)
            rows = [(index == s).nonzero(as_tuple=True)[0] for s in range(d)]
            ones = [torch.zeros(len(rw), dtype=torch.long, device="cuda") for rw in rows]
            single_plans = [group_rows(o, 1) for o in ones]
            perm = torch.argsort(index, stable=True)
            plan = group_rows(index, d)

            methods = point_methods(torch, x, index, rows, ones, single_plans, perm, plan, canonical, singles,
                                    w16[:d], sub, w_base, fsub)
            us = {name: round(timer(fn), 2) for name, fn in methods.items()}
            tiles = (r + plan.block_m - 1) // plan.block_m
            act = x.element_size() * n * (in_f + out_f)
            nbytes = slot_bytes(stack, d) * tiles + act
            own_fast = slot_bytes(fstack, d) * tiles + act
            gbps = nbytes / (us["sbmm"] * 1e-6) / 1e9
            floor_us = nbytes / (floor_gbps * 1e9) * 1e6
            rec = {
                "kind": "sbmm", "shape": f"{out_f}x{in_f}", "out": out_f, "in": in_f, "bits": bits,
                "sparse_24": True, "group": group, "dtype": dtype, "deltas": d, "rows_per_delta": r, "tokens": n,
                "median_us": us,
                "sbmm_speedup_vs": {k: round(v / us["sbmm"], 2) for k, v in us.items() if k != "sbmm"},
                "sbmm_fast_speedup_vs": {k: round(v / us["sbmm_fast"], 2) for k, v in us.items() if k != "sbmm_fast"},
                "sbmm_bytes": nbytes, "sbmm_GBps": round(gbps, 1), "floor_us": round(floor_us, 2),
                "sbmm_over_floor": round(us["sbmm"] / floor_us, 2),
                "sbmm_fast_GBps": round(nbytes / (us["sbmm_fast"] * 1e-6) / 1e9, 1),
                "sbmm_fast_own_bytes": own_fast,
                "sbmm_fast_own_GBps": round(own_fast / (us["sbmm_fast"] * 1e-6) / 1e9, 1),
                "sbmm_fast_over_floor": round(us["sbmm_fast"] / floor_us, 2), "parity_rel_l2": parity,
            }
            log(f"  D={d:3d} R={r:2d}: sbmm {us['sbmm']:9.1f} us, fast {us['sbmm_fast']:9.1f} us "
                f"({rec['sbmm_fast_over_floor']:.2f}x floor), loop_dequant {us['loop_dequant']:9.1f}, "
                f"loop_fp16 {us['loop_fp16']:8.1f}, bmm {us['bmm_fp16']:8.1f}, base {us['base_gemm']:8.1f}")
            results.append(rec)
    return results


def bench_tuning(torch, timer, floor_gbps, out_f, in_f, bits, group, d, r, quick):
    from deltazip.kernels.stacked import StackedDeltas
    from deltazip.kernels.triton_sbmm import group_rows, sbmm_triton

    uniq = make_unique_deltas(torch, out_f, in_f, bits, group, min(4, d), seed=7)
    stack = StackedDeltas.allocate(d, bits=bits, group_size=group, in_features=in_f, out_features=out_f,
                                   sparse=True, asymmetric=False, device="cuda", layout="transposed")
    for s in range(d):
        stack.write(s, uniq[s % len(uniq)])
    n = d * r
    index = torch.arange(d, device="cuda").repeat_interleave(r)[torch.randperm(n, device="cuda")]
    x = torch.randn(n, in_f, dtype=torch.float16, device="cuda")
    block_ns = (64, 128) if quick else (32, 64, 128)
    block_ks = (128,) if quick else (32, 64, 128)
    warps = (4, 8)
    splits = (1, 2, 4) if quick else (1, 2, 4, 8)
    block_ms = (16,) if r <= 16 else (16, 64)
    ref = sbmm_triton(x, index, stack).float()
    out = []
    for bm in block_ms:
        plan = group_rows(index, d, bm)
        for bn in block_ns:
            for bk in block_ks:
                if group % bk:
                    continue
                for nw in warps:
                    for sk in splits:
                        fn = functools.partial(sbmm_triton, x, index, stack, plan=plan, block_n=bn, block_k=bk,
                                               split_k=sk, num_warps=nw)
                        try:
                            ok = torch.allclose(fn().float(), ref, rtol=1e-2, atol=1e-3)
                            t = timer(fn)
                        except Exception as e:  # a tiling the compiler rejects (e.g. out of shared memory)
                            out.append({"kind": "tuning", "shape": f"{out_f}x{in_f}", "deltas": d,
                                        "rows_per_delta": r, "block_m": bm, "block_n": bn, "block_k": bk,
                                        "num_warps": nw, "split_k": sk, "error": str(e).splitlines()[0][:200]})
                            continue
                        nbytes = slot_bytes(stack, d) + 2 * n * (in_f + out_f)
                        out.append({"kind": "tuning", "shape": f"{out_f}x{in_f}", "deltas": d, "rows_per_delta": r,
                                    "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": nw, "split_k": sk,
                                    "median_us": round(t, 2), "GBps": round(nbytes / (t * 1e-6) / 1e9, 1),
                                    "matches_default": ok})
    best = min((o for o in out if "median_us" in o), key=lambda o: o["median_us"], default=None)
    default_us = round(timer(lambda: sbmm_triton(x, index, stack)), 2)
    log(f"  tuning {out_f}x{in_f} D={d} R={r}: default {default_us} us, best {best}")
    out.append({"kind": "tuning_summary", "shape": f"{out_f}x{in_f}", "deltas": d, "rows_per_delta": r,
                "default_us": default_us, "best": best})
    return out


def bench_semi_structured(torch, timer, out_f, in_f, bits, group, token_counts):
    from deltazip.kernels import reference
    from deltazip.kernels.stacked import repack
    from deltazip.kernels.triton_fast import sbmm_fast
    from deltazip.kernels.triton_sbmm import sbmm_triton

    delta = make_unique_deltas(torch, out_f, in_f, bits, group, 1, seed=3)[0]
    stack = repack([delta], layout="transposed")
    fstack = repack([delta], layout="mma")
    w16 = reference.delta_weight(delta).half()
    sparse_w, sparse_err = None, None
    try:
        from torch.sparse import to_sparse_semi_structured

        sparse_w = to_sparse_semi_structured(w16)
    except Exception as e:  # not built with cuSPARSELt/CUTLASS 2:4, or unsupported GPU
        sparse_err = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    out = []
    for n in token_counts:
        x = torch.randn(n, in_f, dtype=torch.float16, device="cuda")
        index = torch.zeros(n, dtype=torch.long, device="cuda")
        rec = {"kind": "semi_structured", "shape": f"{out_f}x{in_f}", "bits": bits, "group": group, "tokens": n,
               "median_us": {"dense_fp16": round(timer(lambda x=x: x @ w16.T), 2),
                             "sbmm": round(timer(lambda x=x, i=index: sbmm_triton(x, i, stack)), 2),
                             "sbmm_fast": round(timer(lambda x=x, i=index: sbmm_fast(x, i, fstack)), 2)}}
        if sparse_w is not None:
            try:
                f = torch.nn.functional.linear
                got = f(x, sparse_w).float()
                rec["semi_structured_rel_l2"] = ((got - (x @ w16.T).float()).norm() / (x @ w16.T).float().norm()).item()
                rec["median_us"]["semi_structured_fp16"] = round(timer(functools.partial(f, x, sparse_w)), 2)
            except Exception as e:
                rec["semi_structured_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            rec["semi_structured_error"] = sparse_err
        best = min(rec["median_us"], key=rec["median_us"].get)
        rec["fastest"] = best
        log(f"  2:4 prefill n={n}: {rec['median_us']} -> {best}")
        out.append(rec)
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in results if r.get("kind") == "sbmm"]
    shapes = sorted({r["shape"] for r in pts})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for rpd in sorted({r["rows_per_delta"] for r in pts}):
            sel = sorted((r for r in pts if r["shape"] == shape and r["rows_per_delta"] == rpd),
                         key=lambda r: r["deltas"])
            if sel:
                ax.plot([r["deltas"] for r in sel], [r["sbmm_speedup_vs"]["loop_dequant"] for r in sel],
                        marker="o", label=f"{rpd} rows/delta")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("deltas in batch")
        ax.set_ylabel("SBMM speedup vs per-delta dequant loop")
        ax.set_title(shape)
        ax.axhline(3, ls="--", c="gray", lw=0.8)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer points and repeats (a few minutes)")
    ap.add_argument("--out", type=Path, default=None, help="directory for kernels.json and the PNG")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per point (median reported)")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench/kernels.py: unset TRITON_INTERPRET (the interpreter is not a benchmark)", file=sys.stderr)
        return 1
    try:
        import triton
    except ImportError:
        print("bench/kernels.py needs triton (pip install 'deltazip[kernels]')", file=sys.stderr)
        return 1

    repeats = args.repeats or (10 if args.quick else 30)
    shapes = [(4096, 4096), (11008, 4096), (4096, 11008)]
    deltas_list = [1, 16] if args.quick else [1, 4, 16, 64]
    rows_list = [1, 16] if args.quick else [1, 4, 16]
    quants = [(4, 128)] if args.quick else [(4, 128), (2, 128)]
    prefill_tokens = [1024] if args.quick else [256, 1024, 4096]
    dtypes = ["float16"] if args.quick else ["float16", "bfloat16"]
    machine = machine_info(torch, triton)
    floor_gbps = machine["floor_bandwidth_GBps"]
    log(f"{machine['gpu']}: floor bandwidth {floor_gbps} GB/s ({machine['floor_bandwidth_source']})")
    timer = Timer(torch, repeats)
    torch.manual_seed(0)

    results: list[dict] = []
    for dtype in dtypes:
        for bits, group in quants:
            for out_f, in_f in shapes:
                results += bench_shape(torch, timer, floor_gbps, out_f, in_f, bits, group, deltas_list, rows_list,
                                       dtype)
    for d, r in ((16, 1), (16, 16)):
        results += bench_tuning(torch, timer, floor_gbps, 4096, 4096, 4, 128, d, r, args.quick)
    results += bench_semi_structured(torch, timer, 4096, 4096, 4, 128, prefill_tokens)

    doc = {
        "bench": "kernels",
        "machine": machine,
        "config": {
            "quick": args.quick, "repeats": repeats, "timing": "median of CUDA-event times, L2 flushed per repeat",
            "shapes_out_x_in": [f"{o}x{i}" for o, i in shapes], "deltas": deltas_list, "rows_per_delta": rows_list,
            "quantization": [{"bits": b, "group": g, "sparse_24": True, "symmetric": True} for b, g in quants],
            "activation_dtypes": dtypes, "prefill_tokens": prefill_tokens,
            "sbmm_bytes": "compressed bytes of the deltas in use x row tiles per delta + x and y (fp16)",
        },
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(text)
        try:
            plot(results, args.out / "kernels_speedup.png")
        except Exception as e:  # the JSON is the result; a failed plot is only noted
            log(f"plot failed: {type(e).__name__}: {e}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
