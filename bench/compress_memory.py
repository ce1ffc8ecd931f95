"""Time and peak memory of one `deltazip compress` at two depths (or more) of a synthetic Llama pair.

    python bench/compress_memory.py [--quick] [--out DIR] [--shape 2b|7b|toy] [--layers 4 16]
        [--nsamples 16] [--seqlen 128] [--defaults] [--device auto|cpu|cuda] [--env NAME=VAR=VALUE,...]
        [--tree NAME=DIR] [--repeats N] [--extrapolate 32]

The pair (bench/_synthetic.py ``write_pair``): a Llama of the given shape made from a seed (on the GPU
when there is one) and a fine-tune of it, every linear moved by a low-rank-plus-noise delta, written to
disk once per depth. Each compression is the real CLI (``deltazip compress --json``, 4-bit 2:4, the
default method) in a fresh process, one at a time; the bench polls the process's ``/proc`` status
every 20 ms for its peak anonymous memory (``RssAnon``: what the process itself allocated, without the
checkpoints' file pages it maps) and reads the peak RSS, the peak GPU memory and the seconds from the
CLI's own ``stats``. ``--defaults`` leaves ``--nsamples``/``--seqlen`` at the CLI's defaults (256 x 2048,
what a user runs). ``--env`` adds candidates run side by side at every depth: the same compression with
environment variables set (e.g. ``--env glibc-mmap=MALLOC_MMAP_THRESHOLD_=65536``); ``--tree`` adds one
run by another checkout of deltazip (``git archive main | tar -x -C DIR``), e.g. the code before a change.

Each row: ``layers``, ``candidate``, ``repeat``, ``wall_s``, ``peak_rss_anon_mib``, ``peak_rss_mib``,
``peak_cuda_mib``, ``artifact_bytes``. ``--repeats N`` runs every candidate N times per depth, in turns
whose order alternates (A B, B A, ...: a machine whose load drifts favours none), and ``medians`` gives
each candidate's median wall time and peak per depth. ``flat`` compares the deepest run with the shallowest per candidate: its peak
anonymous memory over the shallow one's plus the extra artifact bytes (at most 1.10 is "flat in
depth"). ``--extrapolate N`` adds, for the deepest run, its time scaled per layer to N layers
(labelled ``extrapolated``). ``--quick``: the toy shape, depths 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, emit, machine, tree_shim  # noqa: E402
from _synthetic import write_pair  # noqa: E402

FLAT = 1.10


def log(msg: str) -> None:
    print(f"[bench/compress_memory] {msg}", file=sys.stderr, flush=True)


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    except (OSError, ValueError):
        pass
    return out


def run_polled(cmd: list[str], env: dict, period: float = 0.02) -> dict:
    """Run ``cmd``; its wall seconds, exit code, stdout, and peak ``RssAnon`` (KiB) polled from /proc."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = {"RssAnon": 0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            got = _status_kib(proc.pid, ("RssAnon",))
            peak["RssAnon"] = max(peak["RssAnon"], got.get("RssAnon", 0))
            time.sleep(period)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    return {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 2), "stdout": out, "stderr": err,
            "peak_rss_anon_kib": peak["RssAnon"]}


def compress_once(pair: dict, out: Path, args: argparse.Namespace, env_extra: dict) -> dict:
    cmd = [sys.executable, "-m", "deltazip.deltacli.app", "compress", "--base", pair["base"], "--finetuned",
           pair["finetuned"], "--calib", pair["calib"], "--out", str(out), "--overwrite", "--json",
           "--bits", "4", "--device", args.device]
    if not args.defaults:
        cmd += ["--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen)]
    got = run_polled(cmd, {**os.environ, **env_extra})
    if got["rc"] != 0:
        raise SystemExit(f"bench: deltazip compress failed (exit {got['rc']}): {got['stderr'][-2000:]}")
    stats = json.loads(got["stdout"])["stats"]
    return {"wall_s": got["wall_s"], "compress_seconds": stats["seconds"],
            "peak_rss_anon_mib": round(got["peak_rss_anon_kib"] / 1024, 1), "peak_rss_mib": stats["peak_rss_mib"],
            "peak_cuda_mib": stats.get("peak_cuda_mib"), "device": stats.get("device"),
            "artifact_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def medians(results: list[dict]) -> list[dict]:
    """Per candidate and depth: the median wall time and peak anonymous memory over its repeats."""
    out = []
    keys = dict.fromkeys((r["candidate"], r["layers"]) for r in results if "extrapolated" not in r)
    for cand, layers in keys:
        rows = [r for r in results if r["candidate"] == cand and r["layers"] == layers and "extrapolated" not in r]
        out.append({"candidate": cand, "layers": layers, "runs": len(rows),
                    "wall_s": round(statistics.median(r["wall_s"] for r in rows), 2),
                    "peak_rss_anon_mib": round(statistics.median(r["peak_rss_anon_mib"] for r in rows), 1)})
    return out


def flatness(results: list[dict]) -> list[dict]:
    """Per candidate: the deepest run's peak anonymous memory over the shallowest's plus the extra
    artifact bytes, and the two times."""
    out = []
    for cand in dict.fromkeys(r["candidate"] for r in results):
        rows = sorted((r for r in results if r["candidate"] == cand and "extrapolated" not in r),
                      key=lambda r: r["layers"])
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        allowed = lo["peak_rss_anon_mib"] + (hi["artifact_bytes"] - lo["artifact_bytes"]) / 2**20
        out.append({"candidate": cand, "layers": [lo["layers"], hi["layers"]],
                    "peak_rss_anon_mib": [lo["peak_rss_anon_mib"], hi["peak_rss_anon_mib"]],
                    "wall_s": [lo["wall_s"], hi["wall_s"]],
                    "deep_over_shallow_plus_artifact": round(hi["peak_rss_anon_mib"] / allowed, 3),
                    "flat": hi["peak_rss_anon_mib"] <= FLAT * allowed})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="toy shape, depths 2 and 4")
    ap.add_argument("--out", type=Path, default=None, help="write compress_memory.json here (artifacts stay temporary)")
    ap.add_argument("--shape", choices=("2b", "7b", "toy"), default="2b")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--defaults", action="store_true", help="the CLI's own --nsamples/--seqlen (256 x 2048)")
    ap.add_argument("--device", default="auto", help="deltazip compress --device")
    ap.add_argument("--env", default="", help="extra candidates: NAME=VAR=VALUE[;VAR=VALUE],... (comma between)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a candidate run by the deltazip checkout DIR (repeatable)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per candidate and depth, in alternating order")
    ap.add_argument("--extrapolate", type=int, default=None, help="scale the deepest run's time to this many layers")
    ap.add_argument("--keep-pairs", action="store_true", help="keep the written pairs (default: removed after use)")
    a = ap.parse_args()
    if a.quick:
        a.shape, a.layers = "toy", [2, 4]
    cands = {"default": {}}
    for spec in filter(None, a.env.split(",")):
        name, _, assigns = spec.partition("=")
        cands[name] = dict(x.split("=", 1) for x in assigns.split(";") if x)
    shims = Path(tempfile.mkdtemp(prefix="deltazip-bench-trees-"))
    for spec in a.tree:
        name, _, tree = spec.partition("=")
        shim = tree_shim(Path(tree), shims / name)
        cands[name] = {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    gen_device = "cuda" if torch.cuda.is_available() and a.device != "cpu" else "cpu"
    calib_tokens = int(1.2 * (256 * 2048 if a.defaults else a.nsamples * a.seqlen)) + 4096
    results: list[dict] = []
    mach = machine()

    def document(complete: bool) -> dict:
        return {"bench": "compress_memory", "machine": mach, "complete": complete,
                "config": {"shape": a.shape, "layers": a.layers, "bits": 4, "sparsity": "2:4", "method": "deltazip",
                           "calibration": "CLI defaults" if a.defaults else f"{a.nsamples} x {a.seqlen}",
                           "device": a.device, "pair_made_on": gen_device, "candidates": cands},
                "results": results, "flat": flatness(results), "medians": medians(results)}

    with tempfile.TemporaryDirectory(prefix="deltazip-bench-compress-memory-") as tmp:
        for layers in sorted(a.layers):
            pair_dir = CACHE / "synthetic" / f"pair-{a.shape}-l{layers}"
            pair = write_pair(pair_dir, a.shape, layers, gen_device, calib_tokens, log=log)
            turns = [list(cands) if rep % 2 == 0 else list(cands)[::-1] for rep in range(a.repeats)]
            for rep, cand in ((rep, cand) for rep, order in enumerate(turns) for cand in order):
                log(f"compressing {layers} layers ({cand}, run {rep + 1} of {a.repeats})")
                row = {"shape": a.shape, "layers": layers, "candidate": cand, "repeat": rep,
                       "pair_written_s": pair["seconds"],
                       **compress_once(pair, Path(tmp) / f"art-{layers}-{cand}", a, cands[cand])}
                results.append(row)
                log(json.dumps(row))
                if a.out:  # the rows so far: a run stopped at a time limit keeps them
                    a.out.mkdir(parents=True, exist_ok=True)
                    (a.out / "compress_memory.json").write_text(json.dumps(document(False), indent=1))
            if not a.keep_pairs:
                import shutil

                shutil.rmtree(pair_dir, ignore_errors=True)
        if a.extrapolate and results:
            deep = max(results, key=lambda r: r["layers"])
            results.append({"shape": a.shape, "layers": a.extrapolate, "candidate": deep["candidate"],
                            "extrapolated": f"per layer from the {deep['layers']}-layer run",
                            "wall_s": round(deep["wall_s"] * a.extrapolate / deep["layers"], 1),
                            "compress_seconds": round(deep["compress_seconds"] * a.extrapolate / deep["layers"], 1)})
    emit(document(True), a.out, "compress_memory.json")


if __name__ == "__main__":
    main()
