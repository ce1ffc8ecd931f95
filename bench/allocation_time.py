"""What `--target-ratio` costs in time and memory: the CLI back to back, uniform 4-bit then allocated.

    python bench/allocation_time.py [--quick] [--pair smollm2] [--ratio 10] [--sizes 128x128,32x64] [--out DIR]

For each calibration size (``--nsamples`` x ``--seqlen``) it runs ``deltazip compress`` twice as a user
would, one process each, on the same pair: ``--bits 4`` (uniform 4-bit 2:4, the issue's reference
run) and ``--target-ratio R``. Each row gives the artifact's own ``stats.seconds`` (and, for the
allocated run, ``probe_seconds``: the sensitivity probe) and ``stats.peak_rss_mib``, the process's wall
time, the ratio reached, and the time ratio allocated / uniform, which the per-tensor
allocation issue bounds at 2x. Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import PAIR_NAMES, emit, get_pair, machine  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench/allocation_time] {msg}", file=sys.stderr, flush=True)


def run_compress(pair: dict, out: Path, nsamples: int, seqlen: int, method: list[str]) -> dict:
    """One ``deltazip compress`` process; its stats (times, peak RSS), wall time and ratio."""
    exe = Path(sys.executable).with_name("deltazip")
    cmd = [str(exe) if exe.exists() else "deltazip", "compress", "--base", pair["base"], "--finetuned",
           pair["finetuned"], "--calib", pair["calib"], *method, "--nsamples", str(nsamples), "--seqlen",
           str(seqlen), "--out", str(out), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed: {proc.stderr.decode()[-500:]}")
    doc = json.loads(proc.stdout)
    stats = doc["stats"]
    return {"method": " ".join(method), "seconds": stats["seconds"], "probe_seconds": stats.get("probe_seconds"),
            "peak_rss_mib": stats["peak_rss_mib"], "wall_s": round(wall, 2), "ratio": round(doc["ratio"], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2", choices=PAIR_NAMES)
    ap.add_argument("--ratio", type=float, default=10.0)
    ap.add_argument("--sizes", default="128x128,32x64", help="comma list of NSAMPLESxSEQLEN")
    ap.add_argument("--quick", action="store_true", help="only the --quick calibration size, 32x64")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    pair = get_pair(args.pair, log=log)
    sizes = "32x64" if args.quick else args.sizes
    rows = []
    with tempfile.TemporaryDirectory(prefix="dz-alloc-time-") as tmp:
        for size in sizes.split(","):
            nsamples, seqlen = (int(x) for x in size.lower().split("x"))
            pairs = {}
            for label, method in (("uniform", ["--bits", "4"]), ("target", ["--target-ratio", f"{args.ratio:g}"])):
                out = Path(tmp) / label
                log(f"{size}: compress {' '.join(method)}")
                pairs[label] = run_compress(pair, out, nsamples, seqlen, method)
                shutil.rmtree(out, ignore_errors=True)
            rows.append({"nsamples": nsamples, "seqlen": seqlen, **{k: v for k, v in pairs.items()},
                         "time_ratio": round(pairs["target"]["seconds"] / pairs["uniform"]["seconds"], 3)})
    emit({"bench": "allocation_time", "pair": args.pair, "target_ratio": args.ratio, "machine": machine(),
          "rows": rows}, args.out, "allocation_time.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
