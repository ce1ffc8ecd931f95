"""Cluster bench: `deltazip serve --ray` with 1 and 2 engine replicas beside the plain server.

    python bench/cluster.py [--quick] [--out DIR] [--variants 16] [--rate R] [--replicas 1,2]

Builds (cached by bench/serve.py's recipe) the demo pair and ``--variants`` compressed variants, makes
one open-loop zipf-1.5 trace (Poisson arrivals at ``--rate`` requests/s for ``--duration`` s, the
generator of bench/serve.py), and replays it, streaming, against each server started as a
subprocess: ``deltazip serve`` (one process, no Ray: the baseline), then ``deltazip serve --ray
--replicas N`` on a local Ray cluster for each N. Per server: start-up time (command to a healthy
``/health``), unloaded TTFT/E2E, and under the trace requests completed, throughput and TTFT/E2E
mean/p50/p99 (``summarize`` of bench/serve.py; SLO thresholds from the baseline's unloaded latency),
the share of each variant's requests answered by its most frequent replica (``x-deltazip-replica``),
the PSS summed over the server's processes after the trace, and the processes left once the
server was stopped by SIGINT (must be 0).

Tensor-parallel rows: if ``bench/_cluster_tp.py`` exists (written with ``--tensor-parallel``), its
``tp_rows(quick) -> list[dict]`` adds rows to the same document; without it
there are none and ``config["tensor_parallel"]`` says so.

Prints ONE JSON document ``{"bench": "cluster", "machine", "config", "results"}``; with ``--out``,
writes ``DIR/cluster.json`` (and the server logs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import demo_pair, machine  # noqa: E402
from serve import Server, build_variants, free_port, make_trace, one_request, summarize  # noqa: E402

# ---- tensor-parallel hook (another bench module adds these rows) ------------------------------
try:
    from _cluster_tp import tp_rows
except ImportError:
    tp_rows = None
# -----------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[bench/cluster] {msg}", file=sys.stderr, flush=True)


class ClusterServer(Server):
    """`deltazip serve [--ray --replicas N]` in its own process group; stopped by SIGINT (the command
    then deletes the application and stops its local Ray cluster)."""

    def __init__(self, arts: Path, base: str, replicas: int | None, args, logdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "deltazip.deltacli.app", "serve", str(arts), "--base", base, "--port",
               str(self.port), "--max-deltas", str(args.max_deltas), "--max-cpu-deltas", str(args.max_cpu_deltas),
               "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "100000", "--cpu-threads", "1"]
        if replicas:
            cmd += ["--ray", "--replicas", str(replicas)]
        self.log_path = logdir / f"server-{'ray-' + str(replicas) if replicas else 'single'}.log"
        env = dict(os.environ, DELTAZIP_LOG_LEVEL="warning", RAY_DEDUP_LOGS="1")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "w"), env=env,
                                     start_new_session=True)

    def descendants(self) -> set[int]:
        import psutil

        try:
            return {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def stop_and_count_leftovers(self, procs: set[int]) -> int:
        import psutil

        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.time() + 30
        while time.time() < deadline and (alive := [p for p in procs if _alive(p)]):
            time.sleep(0.5)
        for p in alive:  # leftovers are reported, then ended so the next server starts clean
            psutil.Process(p).kill()
        return len(alive)


def _pss_mib(pids: set[int]) -> float:
    """Proportional set size summed over the server's processes (shared pages split between them)."""
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            pass
    return round(total / 2**20, 1)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def replay_tracking(url: str, trace: list[dict], max_tokens: int) -> tuple[list[dict], float, dict]:
    """Replay ``trace`` (streaming); returns results, start time, and {variant: Counter(replica)}."""
    import httpx

    seen: dict = collections.defaultdict(collections.Counter)

    async def hook(response):
        rep = response.headers.get("x-deltazip-replica")
        if rep and response.request.method == "POST":
            seen[json.loads(response.request.content)["model"]][rep] += 1

    limits = httpx.Limits(max_connections=10000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits,
                                 event_hooks={"response": [hook]}) as http:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_request(http, r, t0, max_tokens) for r in trace))
    return res, t0, seen


def unloaded(url: str, prompts: list[str], names: list[str], max_tokens: int) -> dict:
    import statistics

    for m in names:  # warm-up: loads the variants, runs the first forwards
        asyncio.run(replay_tracking(url, [{"at": 0.0, "model": m, "prompt": prompts[0]}], max_tokens))
    res = []
    for i in range(5):
        out, _, _ = asyncio.run(replay_tracking(url, [{"at": 0.0, "model": names[i % len(names)],
                                                       "prompt": prompts[i % len(prompts)]}], max_tokens))
        res += out
    return {"ttft": statistics.median(r["ttft"] for r in res), "e2e": statistics.median(r["e2e"] for r in res)}


def run_server(name: str, replicas: int | None, arts, base, a, logdir, trace, prompts, names, slo) -> tuple[dict, dict]:
    log(f"starting {name}")
    srv = ClusterServer(arts, base, replicas, a, logdir)
    procs: set[int] = set()
    try:
        srv.wait_ready(timeout=900)
        startup = time.perf_counter() - srv.t0
        procs = srv.descendants()
        idle = unloaded(srv.url, prompts, names[:2], a.max_tokens)
        slo = slo or {k: a.slo_scale * v for k, v in idle.items()}
        log(f"{name}: {len(trace)} requests over {a.duration:.0f}s")
        res, t0, seen = asyncio.run(replay_tracking(srv.url, trace, a.max_tokens))
        procs |= srv.descendants()
        pss = _pss_mib({srv.proc.pid} | procs)
    finally:
        leftovers = srv.stop_and_count_leftovers(procs) if srv.proc.poll() is None else -1
    affinity = None
    if replicas:
        total = sum(sum(c.values()) for c in seen.values())
        affinity = round(sum(max(c.values()) for c in seen.values()) / total, 4) if total else None
    row = {"server": name, "replicas": replicas or 1, "ray": bool(replicas), "startup_s": round(startup, 2),
           "unloaded_s": {k: round(v, 4) for k, v in idle.items()}, **summarize(res, t0, slo),
           "variant_on_one_replica_share": affinity, "pss_mib_after_trace": pss,
           "processes": len(procs) + 1, "processes_left_after_stop": leftovers}
    log(json.dumps(row))
    return row, slo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short trace, RTN-compressed variants (a few minutes)")
    ap.add_argument("--out", type=Path, default=None, help="directory for cluster.json and the server logs")
    ap.add_argument("--variants", type=int, default=None, help="default 8 quick, 16")
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--duration", type=float, default=None, help="trace length in seconds (default 15 quick, 40)")
    ap.add_argument("--replicas", default="1,2", help="Ray replica counts to run")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-deltas", type=int, default=4)
    ap.add_argument("--max-cpu-deltas", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--slo-scale", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.variants = a.variants or (8 if a.quick else 16)
    a.duration = a.duration or (15.0 if a.quick else 40.0)
    method = "rtn" if a.quick else "deltazip"
    pair = demo_pair()
    log(f"building/loading {a.variants} variants ({method})")
    arts, base = build_variants(pair, a.variants, method, log=log), pair["base"]
    names = [f"v{i:02d}" for i in range(a.variants)]
    rows = [json.loads(x) for x in Path(pair["eval"]).read_text().splitlines() if x.strip()]
    prompts = [r["prompt"] for r in rows][:64]
    trace = make_trace("zipf-1.5", names, a.rate, a.duration, prompts, a.seed)
    results, slo = [], None
    config = {"quick": a.quick, "pair": "demo", "variants": a.variants, "compression": f"{method} 4-bit",
              "dist": "zipf-1.5", "rate_rps": a.rate, "duration_s": a.duration, "trace_requests": len(trace),
              "max_tokens": a.max_tokens, "max_deltas": a.max_deltas, "max_cpu_deltas": a.max_cpu_deltas,
              "max_num_seqs": a.max_num_seqs, "cpu_threads_per_engine": 1, "slo_scale": a.slo_scale}
    with tempfile.TemporaryDirectory(prefix="deltazip-bench-cluster-") as tmp:
        logdir = a.out or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        for replicas in [None, *(int(x) for x in a.replicas.split(",") if x)]:
            name = f"ray-{replicas}" if replicas else "single (no ray)"
            row, slo = run_server(name, replicas, arts, base, a, logdir, trace, prompts, names, slo)
            results.append(row)
        config["slo"] = {k: round(v, 4) for k, v in slo.items()}
        if tp_rows is None:
            config["tensor_parallel"] = "bench/_cluster_tp.py is missing: no tensor-parallel rows"
        else:
            results += tp_rows(a.quick)  # its own pair and variants (group 64: two ranks split it)
            config["tensor_parallel"] = "rows from bench/_cluster_tp.py"
        doc = {"bench": "cluster", "machine": machine(), "config": config, "results": results}
        if a.out:
            (a.out / "cluster.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
