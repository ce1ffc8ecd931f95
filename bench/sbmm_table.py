"""The delta-matmul table of issue 22, timed the way serving runs it (GPU only).

For Llama-7B shapes (4096x4096, 11008x4096, 4096x11008), 2:4 deltas at 4 and 2 bits, group 128, fp16 and
bf16 activations, D deltas in the batch (1, 4, 16, 64) with R rows each (1, 16), side by side:

- ``cuda``: what the server runs: the path and launch config the dispatcher measured best for this
  key (``deltazip.runtime.serve.kernel_tuning.tune``: the CUDA SBMM kernel's configs, and dequantize +
  cuBLAS at 16+ rows per delta), with the host-built plan;
- ``bmm_fp16``: ``torch.bmm`` over the deltas kept dense in fp16 (rows pre-grouped: cheaper than real);
- ``loop_fp16``: one dense fp16 matmul per delta (at D = 1: the dense matmul of that delta);
- ``cuda_compact`` (``--compact``, 4-bit points): as ``cuda`` on the compact 2:4 layout the sparse tensor
  cores read (``DELTAZIP_CUDA_PREVIEW=sparse-mma``), 3 bits per weight where ``cuda`` reads 4.

Protocol: each candidate is captured in a CUDA graph of L launches, each on other weights (a ring of
stacks and slots larger than 4x the L2), replayed 3 times to warm up, then each of ``--replays`` replays
is timed with events; a launch's time is the median replay / L. The floor is the canonical compressed
bytes (2:4 values, positions, scales; activations in and out) over the device-to-device copy bandwidth
measured in the same run (bytes read + written). Prints one JSON document; ``--table`` adds markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402

from deltazip.formats.outputs import write_text_atomic  # noqa: E402

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))  # (out, in)
MAX_D = 64


def log(msg: str) -> None:
    print(f"[bench/sbmm_table] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Bytes/s of an ``nbytes`` copy on ``device`` (read + written), median of 10 after 2 warm-ups
    (CUDA events on a GPU, the wall clock on a CPU)."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        if a.is_cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - t0)
    return 2 * a.numel() * 2 / statistics.median(times[2:])


def graph_time(launches: list, replays: int) -> float:
    """Median µs per launch of a CUDA graph holding ``launches`` (callables), after a warm-up."""
    for fn in launches:  # compile, allocate, autotune caches: outside the capture
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in launches:
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(launches))
    del g
    return statistics.median(times)


def canonical_bytes(out_f: int, in_f: int, bits: int, group: int, rows: int) -> int:
    """2:4 canonical bytes of one delta (kept codes, 2-bit positions, fp16 scales) + its rows' I/O."""
    kept = out_f * in_f // 2
    return kept * bits // 8 + kept * 2 // 8 + out_f * (in_f // group) * 2 + rows * (in_f + out_f) * 2


def mma_stacks(out_f, in_f, bits, count, compact=False):
    """``count`` stacks of ``MAX_D`` random slots in the ``mma`` layout (``compact``: the compact 2:4 one,
    whose metadata must be valid positions: one random slot packed, repeated over the slots)."""
    from deltazip.kernels import mma_layout, mma_sparse
    from deltazip.kernels.scheme import DeltaScheme
    from deltazip.kernels.stacked import StackedDeltas

    stacks = []
    for _ in range(count):
        if compact:
            q = mma_sparse.random_slot(bits, out_f, in_f).cuda().repeat(MAX_D, 1)
        else:
            words = mma_layout.slot_words(out_f, in_f, bits)
            q = torch.randint(-2**31, 2**31 - 1, (MAX_D, words), dtype=torch.int32, device="cuda")
        sc = (torch.rand(MAX_D, in_f // 128, mma_layout.padded_rows(out_f), device="cuda") * 0.02 + 0.002).half()
        stacks.append(StackedDeltas(q, sc, None, None, DeltaScheme(bits=bits, group_size=128, sparsity="2:4"), in_f,
                                    out_f, layout="mma", compact=compact))
    return stacks


def point(out_f, in_f, bits, dtype, d, r, rings, bw, quick, replays) -> dict:
    from deltazip.kernels.row_plan import plan_rows

    stacks, dense, compact = rings
    n = d * r
    # launch i reads stack i % 2, slots [o_i, o_i + d): distinct weights per launch across the ring
    n_launch = max(2, min(32, 2 * MAX_D // d))
    windows = [((i % 2), (i // 2 * d) % MAX_D) for i in range(n_launch)]
    x = torch.randn(n, in_f, device="cuda").to(dtype)
    y = torch.zeros(n, out_f, device="cuda", dtype=dtype)
    rows = [[o + (k % d) for k in range(n)] for _, o in windows]  # rows interleaved over the deltas
    plans = [plan_rows(rw, MAX_D, "cuda") for rw in rows]
    res = {}
    from deltazip.runtime.serve import kernel_tuning

    # what the server runs: the dispatcher's measured choice for this key (tuned now if not cached)
    choice = kernel_tuning.tune(stacks[0], dtype, n, d)
    t = graph_time([lambda s=s, p=p: kernel_tuning.run_choice(choice, x, stacks[s], p, out=y)
                    for (s, _), p in zip(windows, plans)], replays)
    best = (t, choice)
    res["cuda"] = round(best[0], 2)
    if compact:  # the compact 2:4 layout on the sparse MMA, the same rows and plans
        c_choice = kernel_tuning.tune(compact[0], dtype, n, d)
        res["cuda_compact"] = round(graph_time([lambda s=s, p=p: kernel_tuning.run_choice(c_choice, x, compact[s], p,
                                                                                            out=y)
                                                for (s, _), p in zip(windows, plans)], replays), 2)
    xb = x.view(r, d, in_f).transpose(0, 1).contiguous()  # [d, r, in]: rows grouped per delta
    res["bmm_fp16"] = round(graph_time([lambda s=s, o=o: torch.bmm(xb, dense[s][o:o + d].transpose(1, 2))
                                        for s, o in windows], replays), 2)
    res["loop_fp16"] = round(graph_time([lambda s=s, o=o: [torch.mm(xb[k], dense[s][o + k].T) for k in range(d)]
                                         for s, o in windows], replays), 2)
    floor = d * canonical_bytes(out_f, in_f, bits, 128, r) / bw * 1e6
    chosen = "cuda"
    return {"shape": f"{out_f}x{in_f}", "bits": bits, "dtype": str(dtype).removeprefix("torch."), "deltas": d,
            "rows_per_delta": r, "us": res, "floor_us": round(floor, 2), "chosen": chosen,
            "chosen_over_floor": round(res[chosen] / floor, 2), "dispatch": best[1].to_json(),
            "chosen_vs_bmm": round(res[chosen] / res["bmm_fp16"], 3),
            "chosen_vs_loop": round(res[chosen] / res["loop_fp16"], 3),
            **({"compact_vs_cuda": round(res["cuda_compact"] / res["cuda"], 3),
                "slot_bytes": stacks[0].qweight[0].numel() * 4, "compact_slot_bytes": compact[0].qweight[0].numel() * 4}
               if compact else {})}


def precompile_all(shapes, bit_widths=(4, 2), compact=False) -> None:
    """Every kernel build the tuner will time for the table's keys, compiled in parallel threads first
    (``kernel_tuning.precompile``): serially, the compiles alone took a large share of a GPU window."""
    from deltazip.kernels.stacked import StackedDeltas
    from deltazip.runtime.serve import kernel_tuning

    t0, n = time.time(), 0
    props = torch.cuda.get_device_properties(0)
    pairs = [(d * r, d) for d in (1, 4, 16, 64) for r in (1, 16)]
    for out_f, in_f in shapes:
        for bits in bit_widths:
            for packed in (False, True) if compact and bits == 4 else (False,):
                meta = StackedDeltas.allocate(MAX_D, bits=bits, group_size=128, in_features=in_f, out_features=out_f,
                                              sparse=True, asymmetric=False, layout="mma", device="meta",
                                              compact=packed)
                for dtype in (torch.float16, torch.bfloat16):
                    n += kernel_tuning.precompile(meta, dtype, pairs, props.multi_processor_count,
                                                   10 * props.major + props.minor)
    log(f"compiled {n} kernel builds in {time.time() - t0:.1f} s")


def parity(bits, dtype, compact=False) -> float:
    """Relative L2 error of the CUDA kernel against the reference on a small random stack."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _sbmm import make_delta

    from deltazip.kernels import cuda_sbmm, reference
    from deltazip.kernels.row_plan import plan_rows
    from deltazip.kernels.stacked import repack

    gen = torch.Generator().manual_seed(0)
    deltas = [make_delta(256, 1024, bits, 128, True, False, gen) for _ in range(4)]
    stack = repack(deltas, device="cuda", layout="mma", compact=compact)
    rows = [0, 3, 1, 1, 2, -1, 0, 3]
    x = torch.randn(len(rows), 1024, generator=gen).to(dtype).cuda()
    y = torch.full((len(rows), 256), float("nan"), dtype=dtype, device="cuda")
    y[torch.tensor(rows) < 0] = 0
    ref = reference.sbmm(x, torch.tensor(rows).cuda(), deltas).float()
    got = cuda_sbmm.sbmm_cuda(x, stack, plan_rows(rows, 4, "cuda")).float()
    return ((got - ref).norm() / ref.norm()).item()


def markdown(results: list[dict], columns: dict[str, object]) -> str:
    """A markdown table of points: shape, bits, dtype, D, R, then ``columns`` (header -> a key of the
    point, or a function of it)."""
    head = ["shape", "bits", "dtype", "D", "R", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in results:
        cells = [p["shape"], p["bits"], p["dtype"], p["deltas"], p["rows_per_delta"]]
        cells += [f(p) if callable(f) else p[f] for f in columns.values()]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    compact = {"compact µs": lambda p: p["us"].get("cuda_compact", "-"),
               "compact/cuda": lambda p: p.get("compact_vs_cuda", "-")} if any("compact_vs_cuda" in p for p in results) \
        else {}
    return markdown(results, {"cuda µs": lambda p: p["us"]["cuda"], **compact, "bmm fp16": lambda p: p["us"]["bmm_fp16"],
                              "loop fp16": lambda p: p["us"]["loop_fp16"], "floor": "floor_us",
                              "chosen/floor": "chosen_over_floor", "vs bmm": "chosen_vs_bmm",
                              "vs loop": "chosen_vs_loop", "config": config_label})


def config_label(p: dict) -> str:
    """The dispatcher's choice in a few words: ``rb 1 kt 2 split 4 (8 stages)``, or the path's name."""
    c = p.get("dispatch") or {}
    if c.get("path") != "cuda" or "rb" not in c:
        return str(c.get("path", "?"))
    deep = f" ({c['stages']} stages)" if c.get("stages", 4) != 4 else ""
    return f"rb {c['rb']} kt {c['kt']} split {c['split']}{deep}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4096x4096 only")
    ap.add_argument("--out", type=Path, default=None, help="write sbmm_table.json (and table.md) here")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,11008x4096")
    ap.add_argument("--table", action="store_true", help="print a markdown table on stderr")
    ap.add_argument("--bits", default="4,2", help="code widths, e.g. 4")
    ap.add_argument("--compact", action="store_true",
                    help="also time 4-bit points on the compact 2:4 layout (the sparse-mma preview)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/sbmm_table.py needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.time()
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e9:.0f} GB/s")
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bit_widths = tuple(int(b) for b in args.bits.split(","))
    checks = {f"{b}-bit {str(dt).removeprefix('torch.')}": parity(b, dt)
              for b in bit_widths for dt in (torch.float16, torch.bfloat16)}
    if args.compact:
        checks.update({f"4-bit compact {str(dt).removeprefix('torch.')}": parity(4, dt, compact=True)
                       for dt in (torch.float16, torch.bfloat16)})
    log(f"parity (relative L2 vs reference): {checks}")
    precompile_all(shapes, bit_widths, args.compact)
    results = []
    mach = machine()

    def document(complete: bool) -> dict:
        return {"bench": "sbmm_table", "complete": complete,
                "machine": {**mach, "copy_GBps": round(bw / 1e9, 1),
                            "cuda_runtime": torch.version.cuda},
                "config": {"quick": args.quick, "replays": args.replays, "group": 128, "sparsity": "2:4",
                           "bits": list(bit_widths), "compact": args.compact},
                "parity": checks, "results": results, "seconds": round(time.time() - t0, 1)}

    for out_f, in_f in shapes:
        for bits in bit_widths:
            rings = (mma_stacks(out_f, in_f, bits, 2),
                     [torch.randn(MAX_D, out_f, in_f, device="cuda", dtype=torch.float16) for _ in range(2)],
                     mma_stacks(out_f, in_f, bits, 2, compact=True) if args.compact and bits == 4 else None)
            for dtype in (torch.float16, torch.bfloat16):
                for d in (1, 4, 16, 64):
                    for r in (1, 16):
                        dense = [w if dtype == torch.float16 else None for w in rings[1]]
                        if dtype == torch.bfloat16:
                            dense = [w.view(torch.bfloat16) for w in rings[1]]  # same bytes, bf16 bits
                        p = point(out_f, in_f, bits, dtype, d, r, (rings[0], dense, rings[2]), bw, args.quick,
                                  args.replays)
                        results.append(p)
                        log(json.dumps(p))
                        if args.out:  # the points so far, each file whole: a run stopped at a limit keeps them
                            args.out.mkdir(parents=True, exist_ok=True)
                            write_text_atomic(args.out / "sbmm_table.json", json.dumps(document(False), indent=1))
                            write_text_atomic(args.out / "table.md", table(results) + "\n\n(stopped before the last "
                                                          "point: the rows above are the ones it finished)\n")
            del rings
            torch.cuda.empty_cache()
    doc = document(True)
    if args.table:
        print(table(results), file=sys.stderr)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table(results) + "\n")
    emit(doc, args.out, "sbmm_table.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
