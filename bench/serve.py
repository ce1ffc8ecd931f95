"""Serving bench: `deltazip serve` (base + compressed deltas) against `--mode swap` (whole models).

    python bench/serve.py [--quick] [--out DIR] [--pair demo|smollm2] [--variants 32] [--rate R]

Builds (and caches under ~/.cache/deltazip-bench) a base model and ``--variants`` fine-tunes of it
compressed into artifacts: on CPU the demo pair (tiny Llama, `deltazip demo`), on a GPU the SmolLM2-135M
pair; variant 0 is the real fine-tune, the others are that fine-tune plus a small seeded
perturbation (so every variant is a distinct delta of the same size and format).

For each popularity distribution over the variants — ``uniform``, ``zipf-1.5`` and ``azure-like`` (a
synthetic bursty trace: time is cut into windows, in each a few variants are hot with lognormal
weights, the way per-function load looks in the Azure Functions traces; the real trace is not
downloaded) — it generates one open-loop trace with Poisson arrivals at ``--rate`` requests/s for
``--duration`` seconds, then replays the same trace against two servers started as subprocesses on
the same machine: ``deltazip serve --mode delta`` and ``deltazip serve --mode swap`` (same host
cache; the swap server gets as many whole-model slots as fit in the weight memory the delta server
used, read from its ``deltazip_device_weight_bytes`` gauge — ``--swap-slots same-count`` gives it
``--max-deltas`` instead; the KV cache of both grows on demand under the same ``--max-num-seqs``).
The client streams every request (SSE) and records time to first token (TTFT) and end-to-end
latency (E2E); requests still running ``--drain`` seconds after the trace's end count as failed.

``--pair synthetic-7b`` (bench/_synthetic.py): a Llama with Llama-2-7B layer shapes made from a seed
on the device, ``--layers`` of them (default: the most that fit the disk, host and device memory, at
most 8 here; printed with every figure), and ``--variants`` distinct random 4-bit 2:4 variants written
as artifacts in seconds. Both servers hold every variant in their host tier (``--max-cpu-deltas``
defaults to ``--variants``) and the trace starts once the tiers are warm. The swap server serves one
whole fine-tuned checkpoint hard-linked under every variant name: it swaps a variant's full weights in
from pinned host memory, and the names share one pinned copy (its registry deduplicates them) — the
best case for swapping, since 32 whole 7B models fit neither the disk nor the host memory, and a copy
costs the same whatever the values. Every swap row says so (``swap_weights``).

Per (mode, distribution): requests completed / refused, throughput (requests/s and tokens/s over
the makespan), TTFT and E2E mean / p50 / p99, and SLO attainment (share of requests within
``--slo-scale`` x the unloaded latency of the delta server, the same thresholds for both modes).
Prints ONE JSON document ``{"bench": "serve", "machine", "config", "results"}`` on stdout (progress on
stderr) and, with ``--out``, writes ``DIR/serve.json`` and ``DIR/serve.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, demo_pair, machine, smollm2_pair  # noqa: E402
from _synthetic import serving_layers, serving_set  # noqa: E402

DISTS = ("uniform", "zipf-1.5", "azure-like")
SWAP_WEIGHTS = {"checkpoint": "whole weights copied to the device from pinned host memory; every variant name "
                              "shares one pinned copy (the best case for swapping)",
                "artifacts": "each variant rebuilt into a whole model from its artifact on the host at load"}


def log(msg: str) -> None:
    print(f"[bench/serve] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- variants


def build_variants(pair: dict, n: int, method: str, log=log) -> Path:
    """``n`` compressed variants of ``pair``'s base, cached by recipe; returns the artifacts folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    recipe = {"pair": pair["base"], "n": n, "method": method, "noise": 0.02, "group": pair["group_size"]}
    d = CACHE / f"serve-{pair['name']}-{hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]}"
    arts = d / "artifacts"
    done = d / "done.json"
    if done.is_file():
        return arts
    d.mkdir(parents=True, exist_ok=True)
    from deltazip.models.checkpoint import Checkpoint

    ckpt = Checkpoint(pair["finetuned"])
    dtype = ckpt.dtype(next(n for n in ckpt.names if ckpt.dtype(n).is_floating_point))  # saved dtype of the variants
    ft = AutoModelForCausalLM.from_pretrained(pair["finetuned"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(pair["finetuned"])
    original = {k: v.clone() for k, v in ft.state_dict().items()}
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, group_size=pair["group_size"]),
                         method=method, nsamples=32, seqlen=64, device="auto")
    t0 = time.time()
    for i in range(n):
        name = f"v{i:02d}"
        if (arts / name / "manifest.json").is_file():
            continue
        src = Path(pair["finetuned"])
        if i:
            g = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for k, p in ft.state_dict().items():
                    base = original[k]
                    std = float(base.std()) if base.numel() > 1 else 0.0
                    p.copy_(base + recipe["noise"] * std * torch.randn(base.shape, generator=g))
            src = d / "ft-tmp"
            ft.to(dtype).save_pretrained(src, safe_serialization=True)
            ft.float()
            tok.save_pretrained(src)
        compress_delta(pair["base"], src, pair["calib"], arts / name, cfg, overwrite=True)
        log(f"variant {name} compressed ({time.time() - t0:.0f}s so far)")
    import shutil

    shutil.rmtree(d / "ft-tmp", ignore_errors=True)
    done.write_text(json.dumps(recipe))
    return arts


# ----------------------------------------------------------------------------------- traces


def popularity(dist: str, n: int, t: float, rng_state: dict) -> list[float]:
    """Variant weights at time ``t`` for a distribution."""
    if dist == "uniform":
        return [1.0] * n
    if dist == "zipf-1.5":
        return [1.0 / (i + 1) ** 1.5 for i in range(n)]
    if dist == "azure-like":
        window = int(t // rng_state["window"])
        if window not in rng_state["cache"]:
            r = random.Random(1000 + window)
            hot = r.sample(range(n), k=max(1, n // 8))
            w = [0.02] * n  # a trickle for everyone, bursts for a few
            for h in hot:
                w[h] = math.exp(r.gauss(0.0, 1.0)) * 4
            rng_state["cache"][window] = w
        return rng_state["cache"][window]
    raise ValueError(dist)


def make_trace(dist: str, names: list[str], rate: float, duration: float, prompts: list[str], seed: int) -> list[dict]:
    """Poisson arrivals; each request picks a variant by the distribution's weights at its time."""
    rng = random.Random(seed)
    state = {"window": max(duration / 6, 1.0), "cache": {}}
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        w = popularity(dist, len(names), t, state)
        v = rng.choices(range(len(names)), weights=w)[0]
        out.append({"at": t, "model": names[v], "prompt": rng.choice(prompts)})
    return out


# ----------------------------------------------------------------------------------- server + client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str, name: str) -> float:
    """One un-labelled gauge or counter from the server's Prometheus /metrics."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise SystemExit(f"/metrics has no {name}")


class Server:
    """`deltazip serve` in a subprocess (its own process group, ended by pid at exit)."""

    def __init__(self, arts: Path, base: str, mode: str, args: argparse.Namespace, logdir: Path, slots: int):
        self.cmd = [sys.executable, "-m", "deltazip.deltacli.app", "serve", str(arts), "--base", base, "--mode", mode,
                    "--max-deltas", str(slots), "--max-cpu-deltas", str(args.max_cpu_deltas), "--max-num-seqs",
                    str(args.max_num_seqs), "--max-queue", "100000"]
        if args.cpu_threads:
            self.cmd += ["--cpu-threads", str(args.cpu_threads)]
        self.log_path = logdir / f"server-{mode}.log"
        self.env = dict(os.environ, DELTAZIP_LOG_LEVEL=args.server_log_level)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*self.cmd, "--port", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "w"), env=self.env, start_new_session=True)
        # its process group, for a caller that must end it when this bench is killed (bench/gpu_check.sh)
        self.log_path.with_suffix(".pgid").write_text(str(self.proc.pid))

    def wait_ready(self, timeout: float = 600) -> None:
        import httpx

        t0, tries = time.time(), 1
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                text = self.log_path.read_text()
                if "already in use" in text and tries < 3:  # another process took the free port first
                    tries += 1
                    self._start()
                    continue
                raise SystemExit(f"server exited: {text[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def one_request(http, req: dict, t_start: float, max_tokens: int) -> dict:
    await asyncio.sleep(max(0.0, t_start + req["at"] - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": req["model"], "prompt": req["prompt"], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, tokens, status = None, 0, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            if status != 200:
                await r.aread()
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
                        ttft = time.perf_counter() - sent
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a transport failure counts as a failed request, the bench goes on
        return {"status": -1, "error": type(e).__name__, "sent": sent}
    end = time.perf_counter()
    return {"status": status, "sent": sent, "end": end, "ttft": ttft if ttft is not None else end - sent,
            "e2e": end - sent, "tokens": tokens}


async def replay(url: str, trace: list[dict], max_tokens: int, limit: float | None = None) -> tuple[list[dict], float]:
    """Send ``trace`` on its schedule; requests not finished ``limit`` seconds after the start are
    cancelled and come back as ``{"status": -2}`` (unfinished)."""
    import httpx

    limits = httpx.Limits(max_connections=10000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one_request(http, r, t0, max_tokens)) for r in trace]
        done, pending = await asyncio.wait(tasks, timeout=limit) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() if t in done else {"status": -2, "error": "unfinished at the drain limit"} for t in tasks], t0


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def summarize(res: list[dict], t0: float, slo: dict) -> dict:
    ok = [r for r in res if r["status"] == 200]
    span = (max(r["end"] for r in ok) - t0) if ok else float("nan")
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]

    def stats(xs):
        return {"mean": round(statistics.fmean(xs), 4) if xs else None, "p50": round(pct(xs, 50), 4) if xs else None,
                "p99": round(pct(xs, 99), 4) if xs else None}

    n = len(res)
    return {"requests": n, "completed": len(ok), "refused_or_failed": n - len(ok),
            "unfinished_at_drain_limit": sum(r["status"] == -2 for r in res),
            "makespan_s": round(span, 3), "throughput_rps": round(len(ok) / span, 3) if ok else 0.0,
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / span, 2) if ok else 0.0,
            "ttft_s": stats(ttft), "e2e_s": stats(e2e),
            "slo_attainment": {"ttft": round(sum(t <= slo["ttft"] for t in ttft) / n, 4),
                               "e2e": round(sum(t <= slo["e2e"] for t in e2e) / n, 4),
                               "both": round(sum(a <= slo["ttft"] and b <= slo["e2e"] for a, b in zip(ttft, e2e)) / n, 4)}}


def wait_host_tier(url: str, want: int, timeout: float) -> float | None:
    """Seconds until the server's host tier holds ``want`` variants with none loading (None: not
    within ``timeout``)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if scrape(url, "deltazip_host_deltas") >= want and scrape(url, "deltazip_loading_deltas") == 0:
            return round(time.time() - t0, 2)
        time.sleep(0.5)
    log(f"the host tier did not reach {want} variants in {timeout:.0f} s; the trace starts anyway")
    return None


def unloaded_latency(url: str, prompts: list[str], max_tokens: int, models: list[str]) -> dict:
    """Median TTFT / E2E of single requests on an idle server (after a warm-up of each model)."""
    trace = [{"at": 0.0, "model": m, "prompt": prompts[0]} for m in models]
    for r in trace:  # warm-up: loads the variants, runs the first forwards
        asyncio.run(replay(url, [r], max_tokens))
    res = []
    for i in range(5):
        out, _ = asyncio.run(replay(url, [{"at": 0.0, "model": models[i % len(models)], "prompt": prompts[i % len(prompts)]}],
                                    max_tokens))
        res += out
    return {"ttft": statistics.median(r["ttft"] for r in res), "e2e": statistics.median(r["e2e"] for r in res)}


# ----------------------------------------------------------------------------------- plot


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    dists = [d for d in DISTS if any(r["dist"] == d for r in results)]
    x = range(len(dists))
    for k, mode in enumerate(("delta", "swap")):
        rows = {r["dist"]: r for r in results if r["mode"] == mode}
        off = [i + (k - 0.5) * 0.38 for i in x]
        axes[0].bar(off, [rows[d]["throughput_rps"] for d in dists], 0.38, label=mode)
        axes[1].bar(off, [rows[d]["ttft_s"]["p50"] or 0 for d in dists], 0.38, label=f"{mode} p50")
        axes[1].scatter(off, [rows[d]["ttft_s"]["p99"] or 0 for d in dists], marker="_", s=300, color="k")
        axes[2].bar(off, [rows[d]["e2e_s"]["p50"] or 0 for d in dists], 0.38, label=f"{mode} p50")
        axes[2].scatter(off, [rows[d]["e2e_s"]["p99"] or 0 for d in dists], marker="_", s=300, color="k")
    for ax, title in zip(axes, ("throughput (requests/s)", "TTFT (s), bar p50, tick p99", "E2E latency (s)")):
        ax.set_xticks(list(x), dists)
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------- main


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def synthetic_pair(a: argparse.Namespace, device: str) -> dict:
    """The synthetic-7b serving set (bench/_synthetic.py) at the most layers this machine holds, at most
    ``--layers``: ``{"arts", "base", "swap"}`` paths and what the JSON's config records of it."""
    shape = a.shape or ("7b" if device == "cuda" else "toy")
    fit = serving_layers(shape, a.variants, CACHE / "synthetic", device, most=a.layers)
    a.layers = fit["layers"]
    log(f"synthetic {shape}: {a.layers} layers (limits in layers: {fit['limits']})")
    got = serving_set(CACHE / "synthetic", shape, a.layers, a.variants, device, log=log)
    return {"arts": got["arts"], "base": got["base"], "swap": got["swap"], "shape": shape, "layers": a.layers,
            "layer_limits": fit["limits"], "variants_written": {k: got["variants_info"][k] for k in
                                                                ("seconds", "bytes", "GBps", "threads")},
            "base_written_s": got["base_info"]["seconds"]}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short traces and RTN-compressed variants (a few minutes)")
    ap.add_argument("--out", type=Path, default=None, help="directory for serve.json and serve.png")
    ap.add_argument("--pair", choices=("demo", "smollm2", "synthetic-7b"), default=None,
                    help="model pair (default: demo on CPU, smollm2 on a GPU); synthetic-7b: Llama-2-7B layer "
                         "shapes made from a seed, --layers of them, random distinct variants (bench/_synthetic.py)")
    ap.add_argument("--layers", type=int, default=8,
                    help="synthetic-7b: decoder layers, at most (fewer when the disk, host or device memory holds "
                         "fewer; the count used is in the JSON beside every figure)")
    ap.add_argument("--shape", choices=("7b", "toy"), default=None,
                    help="synthetic-7b: layer shapes (default 7b on a GPU, toy on CPU: a dry run)")
    ap.add_argument("--variants", type=int, default=32)
    ap.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 6 CPU, 20 GPU)")
    ap.add_argument("--duration", type=float, default=None, help="trace length in seconds (default 20 quick, 60)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-deltas", type=int, default=None,
                    help="device slots of the delta server (default 8; synthetic-7b: every variant)")
    ap.add_argument("--swap-slots", choices=("equal-memory", "same-count"), default="equal-memory",
                    help="swap server's slots: as many whole models as fit in the delta server's weight memory "
                         "(default), or the same count as --max-deltas")
    ap.add_argument("--max-cpu-deltas", type=int, default=None,
                    help="host cache entries, both modes (default 16; synthetic-7b: every variant and the base)")
    ap.add_argument("--dists", default=",".join(DISTS), help=f"comma list of: {', '.join(DISTS)}")
    ap.add_argument("--drain", type=float, default=60.0,
                    help="seconds after a trace's end before requests still running are counted as failed")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--cpu-threads", type=int, default=None, help="server torch threads (default 1 on CPU)")
    ap.add_argument("--slo-scale", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--swap-from", choices=("artifacts", "checkpoint"), default=None,
                    help="what the swap server loads: the artifacts, each rebuilt into a whole model at load, or "
                         "(synthetic-7b, its default) one whole fine-tuned checkpoint under every variant name")
    ap.add_argument("--server-log-level", default="warning",
                    help="the servers' DELTAZIP_LOG_LEVEL (info: their start-up lines, kernel tuning and one line per "
                         "request, in DIR/server-MODE.log)")
    ap.add_argument("--artifacts", type=Path, default=None,
                    help="serve these artifacts instead of building variants (needs --base)")
    ap.add_argument("--base", default=None, help="base model of --artifacts")
    a = ap.parse_args()
    # A time limit's SIGTERM (gpu_check.sh runs this under `timeout`) unwinds like Ctrl-C, so the
    # servers' process groups are stopped (Server.stop in a finally) instead of outliving the bench.
    signal.signal(signal.SIGTERM, _interrupt)
    gpu = torch.cuda.is_available()
    a.pair = a.pair or ("smollm2" if gpu else "demo")
    a.rate = a.rate or (20.0 if gpu else 6.0)
    a.duration = a.duration or (20.0 if a.quick else 60.0)
    a.cpu_threads = a.cpu_threads or (None if gpu else 1)
    method = "rtn" if a.quick else "deltazip"

    dists = [d for d in a.dists.split(",") if d]
    unknown = sorted(set(dists) - set(DISTS))
    if unknown:
        raise SystemExit(f"--dists: unknown {', '.join(unknown)}; use {', '.join(DISTS)}")
    synthetic: dict = {}
    if a.pair == "synthetic-7b" and a.artifacts is None:
        synthetic = synthetic_pair(a, "cuda" if gpu else "cpu")
        a.artifacts, a.base, swap_arts = Path(synthetic.pop("arts")), synthetic.pop("base"), Path(synthetic.pop("swap"))
        a.swap_from = a.swap_from or "checkpoint"
        a.max_cpu_deltas = a.max_cpu_deltas or a.variants + 1
        a.max_deltas = a.max_deltas or a.variants
    a.max_cpu_deltas = a.max_cpu_deltas or 16
    a.max_deltas = a.max_deltas or 8
    a.swap_from = a.swap_from or "artifacts"
    if a.swap_from == "checkpoint" and not synthetic:
        raise SystemExit("--swap-from checkpoint is built for --pair synthetic-7b only")
    if a.artifacts is not None:
        if not a.base:
            raise SystemExit("--artifacts needs --base")
        from deltazip.runtime.serve.variant_sources import find_variants

        arts, base = a.artifacts, a.base
        names = [v.name for v in find_variants(arts)]  # names only: the servers read and check the variants
        prompts = ["alpha beta", "zip model tune", "12 + 345 =", "delta gamma"]
        if not synthetic:
            a.pair, method = f"given: {arts}", "as given"
        else:
            method = "random codes and scales"
    else:
        log(f"building/loading pair {a.pair}")
        pair = demo_pair() if a.pair == "demo" else smollm2_pair(log=log)
        log(f"building/loading {a.variants} variants ({method})")
        arts, base = build_variants(pair, a.variants, method), pair["base"]
        names = [f"v{i:02d}" for i in range(a.variants)]
        rows = [json.loads(x) for x in Path(pair["eval"]).read_text().splitlines() if x.strip()]
        prompts = [r["prompt"] for r in rows][:64]
    a.variants = len(names)
    traces = {d: make_trace(d, names, a.rate, a.duration, prompts, a.seed + DISTS.index(d)) for d in dists}
    results, slo, unloaded = [], None, {}
    with tempfile.TemporaryDirectory(prefix="deltazip-bench-serve-") as tmp:
        logdir = a.out or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        memory: dict = {}
        mach = machine()

        def document(complete: bool) -> dict:
            return {"bench": "serve", "machine": mach, "complete": complete,
                    "config": {"quick": a.quick, "pair": a.pair, "variants": a.variants, **synthetic,
                               "swap_weights": SWAP_WEIGHTS[a.swap_from],
                               "compression": method if a.artifacts else f"{method} 4-bit 2:4", "drain_s": a.drain,
                               "rate_rps": a.rate, "duration_s": a.duration, "max_tokens": a.max_tokens,
                               "max_deltas": a.max_deltas, "swap_slots": a.swap_slots, "swap_from": a.swap_from,
                               "memory": memory, "max_cpu_deltas": a.max_cpu_deltas,
                               "max_num_seqs": a.max_num_seqs, "cpu_threads": a.cpu_threads,
                               "slo": {k: round(v, 4) for k, v in (slo or {}).items()}, "slo_scale": a.slo_scale,
                               "unloaded_latency_s": {m: {k: round(v, 4) for k, v in u.items()}
                                                      for m, u in unloaded.items()},
                               "trace_requests": {d: len(t) for d, t in traces.items()}},
                    "results": results}

        for mode in ("delta", "swap"):
            slots = a.max_deltas
            if mode == "swap" and a.swap_slots == "equal-memory":
                # The baseline keeps as many whole models as fit in the weight memory the delta
                # server used (base + its filled slots), as in the paper's comparison.
                slots = max(1, int(memory["delta_device_weight_bytes"] // memory["model_bytes"]))
            memory[f"{mode}_slots"] = slots
            log(f"starting deltazip serve --mode {mode} --max-deltas {slots}")
            srv = Server(swap_arts if mode == "swap" and a.swap_from == "checkpoint" else arts, base, mode, a, logdir,
                         slots)
            try:
                t_start = time.time()
                srv.wait_ready()
                memory[f"{mode}_ready_s"] = round(time.time() - t_start, 2)
                if synthetic:  # every variant in host memory before the trace, in both modes
                    want = min(a.max_cpu_deltas, a.variants + (mode == "swap"))
                    memory[f"{mode}_host_tier_warm_s"] = wait_host_tier(srv.url, want, 600)
                if mode == "delta":
                    memory["model_bytes"] = scrape(srv.url, "deltazip_device_weight_bytes")  # the base alone
                unloaded[mode] = unloaded_latency(srv.url, prompts, a.max_tokens, names[:2])
                if slo is None:  # thresholds from the delta server, used for both modes
                    slo = {k: a.slo_scale * v for k, v in unloaded[mode].items()}
                for dist in dists:
                    log(f"{mode} / {dist}: {len(traces[dist])} requests over {a.duration:.0f}s")
                    res, t0 = asyncio.run(replay(srv.url, traces[dist], a.max_tokens, a.duration + a.drain))
                    row = {"mode": mode, "dist": dist, **summarize(res, t0, slo)}
                    results.append(row)
                    log(json.dumps(row))
                    if a.out:  # the rows so far: a run stopped at a time limit still leaves them
                        (a.out / "serve.json").write_text(json.dumps(document(False), indent=1))
                memory[f"{mode}_device_weight_bytes"] = scrape(srv.url, "deltazip_device_weight_bytes")
                # host and device tensors the server holds, each once: swap's names share one copy
                memory[f"{mode}_held_bytes"] = scrape(srv.url, "deltazip_dedup_held_bytes")
            finally:
                srv.stop()
        for dist in dists:
            d = next(r for r in results if r["mode"] == "delta" and r["dist"] == dist)
            s = next(r for r in results if r["mode"] == "swap" and r["dist"] == dist)
            results.append({"mode": "delta/swap", "dist": dist, "swap_weights": SWAP_WEIGHTS[a.swap_from],
                            "throughput_delta_over_swap": _ratio(d["throughput_rps"], s["throughput_rps"]),
                            "tokens_per_s_delta_over_swap": _ratio(d["tokens_per_s"], s["tokens_per_s"]),
                            "ttft_p50_swap_over_delta": _ratio(s["ttft_s"]["p50"], d["ttft_s"]["p50"]),
                            "ttft_p99_swap_over_delta": _ratio(s["ttft_s"]["p99"], d["ttft_s"]["p99"])})
        doc = document(True)
        if a.out:
            (a.out / "serve.json").write_text(json.dumps(doc, indent=1))
            plot([r for r in results if r["mode"] in ("delta", "swap")], a.out / "serve.png")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
