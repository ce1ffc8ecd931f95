"""IPC weight-sharing bench: K server workers mapping one owner's weights vs K independent servers.

    python bench/share.py [--quick] [--out DIR] [--pairs demo,synthetic] [--workers 1,2,4] [--repeats N]

For each model pair (``demo``: the `deltazip demo` tiny Llama; ``synthetic``: a 31.6 M-parameter
Llama stored in fp16, served in fp32 = 126 MB of weights, built on the spot; ``smollm2``: the
SmolLM2-135M pair when its package is installed) and each K, it starts, side by side in one run:

- ``shared``: ``deltazip serve --workers K``'s processes (the weight owner + K workers mapping its
  sealed memfd; :class:`deltazip.runtime.cluster.workers.WorkerPool`);
- ``independent``: K workers of the same code that each load the base themselves (= K separate
  single-process servers).

After every worker has answered one request (so the weights have been read), it reads
``/proc/PID/smaps_rollup`` of every process: **PSS summed over the deployment** (owner included —
shared pages are split between the processes using them, so the sum is the deployment's physical
footprint; shared libraries are split with every other process on the machine, which lowers both
modes alike) and **USS summed over the workers** (private memory: what each worker costs on its own).
Every process runs with ``weight_share.MEASURE_ENV`` (glibc's mmap threshold fixed at 128 KiB), as
the memory test does: what glibc's arenas keep of freed blocks varies by tens of MiB from one run or
worker to the next and would otherwise blur the comparison.

Startup: per worker, seconds from spawn to serving (``ready_s``) and of the weights phase alone —
``attach + build_runtime`` for a mapping worker, ``build_runtime`` (``from_pretrained``) for a
loading one; medians over ``--repeats`` K=1 starts (no CPU contention between starting workers),
plus the owner's one-time export.

Prints ONE JSON document ``{"bench": "share", "machine", "config", "results"}`` on stdout (progress
on stderr); with ``--out``, also writes ``DIR/share.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import demo_pair, machine, synthetic_llama  # noqa: E402

from deltazip.runtime.share.weight_share import MEASURE_ENV, smaps_rollup  # noqa: E402

MIB = 2**20


def log(msg: str) -> None:
    print(f"[bench/share] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- model pairs


def synthetic_pair() -> tuple[Path, str]:
    """A 31.6 M-parameter Llama (fp16 on disk) and one RTN variant, cached."""
    arts, base = synthetic_llama("share-synthetic-v2", seeds=[3], log=log)
    return arts, str(base)


def get_pair(name: str) -> tuple[Path, str]:
    from serve import build_variants  # bench/serve.py: compressed variants of a pair, cached

    if name == "synthetic":
        return synthetic_pair()
    if name == "demo":
        pair = demo_pair()
    elif name == "smollm2":
        from _pairs import smollm2_pair

        pair = smollm2_pair(log=log)
    else:
        raise SystemExit(f"unknown pair {name!r}; use demo, synthetic or smollm2")
    return build_variants(pair, 1, "rtn", log=log), pair["base"]


# ----------------------------------------------------------------------------------- measuring


def run_deployment(arts: Path, base: str, k: int, share: bool, threads: int) -> dict:
    import httpx

    from deltazip.runtime.cluster.workers import WorkerPool
    from deltazip.runtime.serve.assembly import ServeConfig
    from deltazip.runtime.serve.variant_sources import discover_variants

    variant = discover_variants(arts)[0].name
    cfg = ServeConfig(artifacts=arts, base=base, max_deltas=1, max_cpu_deltas=1, cpu_threads=threads)
    t0 = time.perf_counter()
    # No standby: a spare process would share the library pages (changing every PSS) and import
    # while the pool is measured.
    with WorkerPool(cfg, workers=k, share=share, front=False, env={"OMP_NUM_THREADS": str(threads), **MEASURE_ENV},
                    standby=False) as pool:
        up = time.perf_counter() - t0
        for w in pool.workers:  # read the weights once (a forward touches every matrix)
            r = httpx.post(w.url + "/v1/completions", timeout=300,
                           json={"model": variant, "prompt": "12 + 345 =", "max_tokens": 4, "temperature": 0})
            r.raise_for_status()
        pids = pool.pids()
        workers = [smaps_rollup(p) for p in pids["workers"]]
        owner = smaps_rollup(pids["owner"]) if share else None
        reports = [dict(w.report) for w in pool.workers]
        owner_report = dict(pool.owner_report)
    procs = workers + ([owner] if owner else [])
    return {"k": k, "mode": "shared" if share else "independent", "all_ready_s": round(up, 2),
            "pss_total_mib": round(sum(p["Pss"] for p in procs) / MIB, 1),
            "uss_workers_mib": round(sum(p["USS"] for p in workers) / MIB, 1),
            "rss_total_mib": round(sum(p["Rss"] for p in procs) / MIB, 1),
            "owner_pss_mib": round(owner["Pss"] / MIB, 1) if owner else None,
            "owner_uss_mib": round(owner["USS"] / MIB, 1) if owner else None,
            "shared_bytes_mib": round(owner_report["nbytes"] / MIB, 1) if share else None,
            "owner_export_s": round(owner_report.get("seconds", 0.0), 3) if share else None,
            "workers": reports}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo + synthetic pairs, 1 startup repeat")
    ap.add_argument("--out", type=Path, default=None, help="directory for share.json")
    ap.add_argument("--pairs", default=None, help="comma list of demo, synthetic, smollm2 (default demo,synthetic)")
    ap.add_argument("--workers", default="1,2,4", help="comma list of K")
    ap.add_argument("--repeats", type=int, default=None, help="K=1 starts per mode for the startup medians")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench/share.py needs Linux (memfd, /proc/PID/smaps_rollup)")
    pairs = (a.pairs or "demo,synthetic").split(",")
    ks = [int(x) for x in a.workers.split(",")]
    repeats = a.repeats or (1 if a.quick else 3)
    results = []
    for name in pairs:
        log(f"pair {name}: building/loading")
        arts, base = get_pair(name)
        runs = {}
        for k in ks:
            for share in (True, False):
                log(f"pair {name}: K={k} {'shared' if share else 'independent'}")
                runs[(k, share)] = run_deployment(arts, base, k, share, a.threads)
        weights = runs[(ks[0], True)]["shared_bytes_mib"]
        for k in ks:
            s, i = runs[(k, True)], runs[(k, False)]
            for r in (s, i):
                results.append({"pair": name, "weights_mib": weights,
                                **{key: v for key, v in r.items() if key != "workers"}})
            results.append({"pair": name, "k": k, "mode": "shared vs independent",
                            "pss_saved_mib": round(i["pss_total_mib"] - s["pss_total_mib"], 1),
                            "pss_shared_over_independent": round(s["pss_total_mib"] / i["pss_total_mib"], 3),
                            "uss_workers_saved_mib": round(i["uss_workers_mib"] - s["uss_workers_mib"], 1)})
        # Startup: K=1 starts (the K=1 runs above count as the first repeat).
        starts = {True: [runs[(1, True)]] if 1 in ks else [], False: [runs[(1, False)]] if 1 in ks else []}
        for rep in range(repeats - len(starts[True])):
            for share in (True, False):
                log(f"pair {name}: startup repeat {rep + 2} ({'map' if share else 'load'})")
                starts[share].append(run_deployment(arts, base, 1, share, a.threads))
        row = {"pair": name, "mode": "startup K=1 (medians)", "repeats": repeats}
        for share, label in ((True, "map"), (False, "load")):
            ws = [r["workers"][0] for r in starts[share]]
            row[f"{label}_ready_s"] = round(statistics.median(w["ready_s"] for w in ws), 3)
            row[f"{label}_weights_phase_s"] = round(statistics.median(
                (w["attach_s"] or 0.0) + w["build_runtime_s"] for w in ws), 3)
            row[f"{label}_import_s"] = round(statistics.median(w["import_s"] for w in ws), 3)
        row["owner_export_s"] = statistics.median(r["owner_export_s"] for r in starts[True])
        row["weights_phase_load_over_map"] = round(row["load_weights_phase_s"] / row["map_weights_phase_s"], 2)
        results.append(row)
        log(json.dumps(row))
    doc = {"bench": "share", "machine": machine(),
           "config": {"quick": a.quick, "pairs": pairs, "workers": ks, "repeats": repeats, "threads": a.threads,
                      "max_deltas": 1, "max_cpu_deltas": 1, "device": "cpu", "dtype": "float32 (auto on CPU)",
                      "memory": "PSS summed over owner + workers; USS summed over workers (/proc/PID/smaps_rollup)",
                      "allocator_env": MEASURE_ENV},
           "results": results}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "share.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
