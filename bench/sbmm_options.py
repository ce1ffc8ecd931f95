"""The delta matmul's preview launch options at small batches, side by side, timed the way a decode step
runs them (GPU only).

At 1, 2 and 4 deltas with R rows each (1, 16), 2:4 deltas of 4 and 2 bits, group 128, fp16, the tuner
picks the fastest launch of each candidate set for the key (``kernel_tuning.tune`` with its own table:
the same choice a server would make with ``DELTAZIP_CUDA_PREVIEW`` naming the set) and the set's choice
is timed:

- ``validated``: the launch configs a server runs today (no preview);
- ``stream-k``: those plus the persistent one-wave grids;
- ``pdl``: every candidate as a programmatic dependent launch;
- ``evict-first``: every candidate with the L2 evict-first policy on its weight copies;
- ``all``: the three together;
- ``bmm_fp16``: ``torch.bmm`` over the deltas kept dense in fp16 (at one delta: the dense matmul of that delta),
  rows pre-grouped, no base GEMM before it.

Protocol (``timed``): as in a decoupled linear, every launch follows the base GEMM of its layer
(``x @ W^T`` in fp16, cuBLAS), so a programmatic dependent launch overlaps what it overlaps in serving:
a kernel that does not start its dependents early. A CUDA graph holds L such pairs, each on other weights
(a ring larger than 4x the L2), and the time of a graph of the L GEMMs alone is subtracted: µs per delta
matmul. ``--quick`` times 4096x4096 only. Prints one JSON document; ``--table`` adds markdown.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402
from sbmm_table import MAX_D, SHAPES, canonical_bytes, copy_bandwidth, graph_time, markdown, mma_stacks  # noqa: E402

from deltazip.formats.outputs import write_text_atomic  # noqa: E402

SETS = {"validated": frozenset(), "stream-k": frozenset({"stream-k"}), "pdl": frozenset({"pdl"}),
        "evict-first": frozenset({"evict-first"}), "all": frozenset({"stream-k", "pdl", "evict-first"})}
DELTAS = (1, 2, 4)


def log(msg: str) -> None:
    print(f"[bench/sbmm_options] {msg}", file=sys.stderr, flush=True)


def timed(pairs: list, base_only: list, replays: int) -> float:
    """µs per launch of ``pairs`` (each a base GEMM then a delta matmul) less that of the GEMMs alone."""
    return graph_time(pairs, replays) - graph_time(base_only, replays)


def point(out_f, in_f, bits, d, r, stacks, dense, bw, replays, tables) -> dict:
    from deltazip.kernels import dispatch_table
    from deltazip.kernels.row_plan import plan_rows
    from deltazip.runtime.serve import kernel_tuning

    dtype, n = torch.float16, d * r
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_launch = max(2, min(32, 2 * MAX_D // d))
    windows = [((i % 2), (i // 2 * d) % MAX_D) for i in range(n_launch)]
    x = torch.randn(n, in_f, device="cuda").to(dtype)
    y = torch.zeros(n, out_f, device="cuda", dtype=dtype)
    plans = [plan_rows([o + (k % d) for k in range(n)], MAX_D, "cuda") for _, o in windows]
    bases = [dense[s][(o + d) % MAX_D] for s, o in windows]  # another layer's base weight per launch
    base_only = [lambda w=w: torch.mm(x, w.T, out=y) for w in bases]
    us, chosen, wrong = {}, {}, {}
    for name, options in SETS.items():
        table = tables[name]
        cands = kernel_tuning.candidates(stacks[0], n, d, sms, options)
        choice = kernel_tuning.tune(stacks[0], dtype, n, d, table=table, cands=cands, save=False)
        key = dispatch_table.key(stacks[0], dtype, n, d)
        wrong[name] = sum("differs" in s for s in table.skipped.get(key, []))
        pairs = [lambda s=s, p=p, w=w, c=choice: (torch.mm(x, w.T, out=y), kernel_tuning.run_choice(c, x, stacks[s], p,
                                                                                                     out=y))
                 for (s, _), p, w in zip(windows, plans, bases)]
        us[name] = round(timed(pairs, base_only, replays), 2)
        chosen[name] = choice.to_json()
    xb = x.view(r, d, in_f).transpose(0, 1).contiguous()  # [d, r, in]: rows grouped per delta
    bmm = round(graph_time([lambda s=s, o=o: torch.bmm(xb, dense[s][o:o + d].transpose(1, 2)) for s, o in windows],
                           replays), 2)
    floor = d * canonical_bytes(out_f, in_f, bits, 128, r) / bw * 1e6
    return {"shape": f"{out_f}x{in_f}", "bits": bits, "dtype": "float16", "deltas": d, "rows_per_delta": r,
            "us": us, "floor_us": round(floor, 2), "bmm_fp16_us": bmm,
            "over_floor": {k: round(v / floor, 2) for k, v in us.items()},
            "vs_validated": {k: round(v / us["validated"], 3) for k, v in us.items() if k != "validated"},
            "vs_bmm": {k: round(v / bmm, 3) for k, v in us.items()},
            "dispatch": chosen, "wrong_configs_skipped": wrong}


def table(results: list[dict]) -> str:
    cols = {f"{k} µs": (lambda p, k=k: p["us"][k]) for k in SETS}
    cols.update({f"{k}/validated": (lambda p, k=k: p["vs_validated"][k]) for k in SETS if k != "validated"})
    cols.update({"floor": "floor_us", "best/floor": lambda p: min(p["over_floor"].values()),
                 "bmm fp16": "bmm_fp16_us", "best/bmm": lambda p: min(p["vs_bmm"].values())})
    return markdown(results, cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4096x4096 only")
    ap.add_argument("--out", type=Path, default=None, help="write sbmm_options.json (and options.md) here")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--bits", default="4,2", help="code widths, e.g. 4")
    ap.add_argument("--table", action="store_true", help="print a markdown table on stderr")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/sbmm_options.py needs a CUDA GPU", file=sys.stderr)
        return 1
    from deltazip.kernels import dispatch_table
    from deltazip.kernels.stacked import StackedDeltas
    from deltazip.runtime.serve import kernel_tuning

    t0 = time.time()
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e9:.0f} GB/s")
    shapes = SHAPES[:1] if args.quick else SHAPES[:2]
    bit_widths = tuple(int(b) for b in args.bits.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="sbmm_options_"))
    tables = {name: dispatch_table.Table(tmp / f"{name}.json") for name in SETS}  # one choice per set and key
    n = 0
    for out_f, in_f in shapes:  # every build any set's tuner times, compiled in parallel threads first
        for bits in bit_widths:
            meta = StackedDeltas.allocate(MAX_D, bits=bits, group_size=128, in_features=in_f, out_features=out_f,
                                          sparse=True, asymmetric=False, layout="mma", device="meta")
            for options in SETS.values():
                n += kernel_tuning.precompile(meta, torch.float16, [(d * r, d) for d in DELTAS for r in (1, 16)],
                                               props.multi_processor_count, 10 * props.major + props.minor, options)
    log(f"compiled {n} kernel builds in {time.time() - t0:.1f} s")
    results, mach = [], machine()

    def document(complete: bool) -> dict:
        return {"bench": "sbmm_options", "complete": complete,
                "machine": {**mach, "copy_GBps": round(bw / 1e9, 1), "cuda_runtime": torch.version.cuda},
                "config": {"quick": args.quick, "replays": args.replays, "group": 128, "sparsity": "2:4",
                           "bits": list(bit_widths), "sets": {k: sorted(v) for k, v in SETS.items()},
                           "protocol": "each delta matmul after its layer's base GEMM; GEMMs alone subtracted"},
                "results": results, "seconds": round(time.time() - t0, 1)}

    for out_f, in_f in shapes:
        for bits in bit_widths:
            stacks = mma_stacks(out_f, in_f, bits, 2)
            dense = [torch.randn(MAX_D, out_f, in_f, device="cuda", dtype=torch.float16) for _ in range(2)]
            for d in DELTAS:
                for r in (1, 16):
                    p = point(out_f, in_f, bits, d, r, stacks, dense, bw, args.replays, tables)
                    results.append(p)
                    log(json.dumps(p))
                    if args.out:  # each file whole after every point: a run stopped at its limit keeps them
                        args.out.mkdir(parents=True, exist_ok=True)
                        write_text_atomic(args.out / "sbmm_options.json", json.dumps(document(False), indent=1))
                        write_text_atomic(args.out / "options.md", table(results) + "\n")
            del stacks, dense
            torch.cuda.empty_cache()
    if args.table:
        print(table(results), file=sys.stderr)
    if args.out:
        write_text_atomic(args.out / "options.md", table(results) + "\n")
    emit(document(True), args.out, "sbmm_options.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
