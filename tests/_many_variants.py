"""Start-up time and host memory of ``deltazip serve`` with many registered variants (issue 23 item 4).

The variants are hard-linked copies of one small artifact under different names (one copy of the
bytes on disk, distinct variants to the server). Each server is a real ``deltazip serve`` process on a
loopback port: start-up is the time from spawning it to the first ``/health`` answer (connections
wait in the listen backlog while it builds), memory its ``VmRSS`` once ready. Runs of the small and
the large directory alternate; the figures are medians.

    python tests/_many_variants.py [--variants 10000] [--small 4] [--repeats 3] [--out DIR]

prints one JSON document (``{"bench": "many_variants", ...}``); ``test_registration_scale.py`` runs
the same measurement and asserts the bounds.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def link_copies(src: Path, root: Path, n: int, prefix: str = "v") -> Path:
    """``root`` with ``n`` variants ``{prefix}00000..``, each every file of artifact ``src`` hard-linked."""
    files = [f for f in sorted(src.rglob("*")) if f.is_file()]
    for i in range(n):
        dst = root / f"{prefix}{i:05d}"
        for f in files:
            target = dst / f.relative_to(src)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(f, target)
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(arts: Path, base: Path, cold: list[str] = (), timeout: float = 600.0) -> dict:
    """Spawn ``deltazip serve arts --base base`` on a free loopback port, wait for ``/health``, send one
    greedy request to each variant in ``cold`` (none used before: each is read on first use), and
    return ``{"seconds", "rss_bytes", "models", "cold": [(seconds, status, text)], "stderr"}`` (the server
    is stopped again; ``rss_bytes`` is taken before the requests)."""
    port = _free_port()
    cmd = [sys.executable, "-c", "from deltazip.deltacli.app import main; main()", "serve", str(arts), "--base",
           str(base), "--port", str(port), "--cpu-threads", "1"]
    env = dict(os.environ, DELTAZIP_LOG_LEVEL="INFO", OMP_WAIT_POLICY="PASSIVE")
    err_path = Path(arts).parent / f".serve-{port}.stderr"
    with open(err_path, "w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            health = _wait_ready(proc, f"http://127.0.0.1:{port}/health", t0 + timeout, err_path)
            seconds = time.perf_counter() - t0
            rss = _rss_bytes(proc.pid)
            answers = [_timed_completion(f"http://127.0.0.1:{port}", name) for name in cold]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    stderr = err_path.read_text()
    err_path.unlink()
    return {"seconds": seconds, "rss_bytes": rss, "models": health.get("models"), "cold": answers, "stderr": stderr}


def _timed_completion(url: str, model: str) -> tuple[float, int, str | None]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": "zip model tune", "max_tokens": 4, "temperature": 0})
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    return time.perf_counter() - t0, r.status_code, text


def _wait_ready(proc: subprocess.Popen, url: str, deadline: float, err_path: Path) -> dict:
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"deltazip serve exited with {proc.returncode}: {err_path.read_text()[-2000:]}")
        try:
            r = httpx.get(url, timeout=max(1.0, deadline - time.perf_counter()))
        except httpx.TransportError:  # not listening yet (the interpreter is still starting)
            time.sleep(0.05)
            continue
        if r.status_code == 200:
            return r.json()
        time.sleep(0.05)
    raise RuntimeError(f"deltazip serve was not ready within the time limit: {err_path.read_text()[-2000:]}")


def measure(small: Path, large: Path, base: Path, repeats: int = 2, cold: int = 8) -> dict:
    """Alternating start-ups of the servers over ``small`` and ``large``; medians and ratios. Each
    large server then answers one request to each of ``cold`` variants spread over its names (read on
    first use): ``cold`` holds their latencies (seconds), statuses and texts."""
    runs: dict[str, list[dict]] = {"small": [], "large": []}
    names = sorted(p.name for p in large.iterdir())
    probe = names[len(names) // (cold + 1)::len(names) // (cold + 1)][:cold] if cold else []
    answers = []
    for _ in range(repeats):
        for key, arts in (("small", small), ("large", large)):
            r = start_server(arts, base, probe if key == "large" else [])
            runs[key].append({k: r[k] for k in ("seconds", "rss_bytes", "models")})
            answers += r["cold"]
    med = {k: {"seconds": statistics.median(r["seconds"] for r in v),
               "rss_bytes": statistics.median(r["rss_bytes"] for r in v),
               "models": v[0]["models"]} for k, v in runs.items()}
    extra = med["large"]["models"] - med["small"]["models"]
    return {"runs": runs, "median": med, "startup_ratio": med["large"]["seconds"] / med["small"]["seconds"],
            "bytes_per_extra_variant": (med["large"]["rss_bytes"] - med["small"]["rss_bytes"]) / max(extra, 1),
            "cold": {"variants": probe, "statuses": sorted({a[1] for a in answers}),
                     "texts": sorted({str(a[2]) for a in answers}),
                     "p50_seconds": statistics.median(a[0] for a in answers) if answers else None,
                     "max_seconds": max((a[0] for a in answers), default=None)}}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=10_000)
    ap.add_argument("--small", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="keep the built directories here (default: a temp dir)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _serving import ServedSet, served_set, single_thread

    work = a.out or Path(tempfile.mkdtemp(prefix="many-variants-"))
    built = work / "serving"
    if (built / "artifacts" / "alpha" / "manifest.json").is_file():  # a kept --out from an earlier run
        s = ServedSet(built, built / "tiny-base", built / "artifacts")
    else:
        with single_thread():
            s = served_set(built)
    small = link_copies(s.variant_dir("alpha"), work / "small", a.small)
    large = link_copies(s.variant_dir("alpha"), work / "large", a.variants)
    res = measure(small, large, s.base_dir, a.repeats)
    import torch

    print(json.dumps({"bench": "many_variants",
                      "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                      "config": {"small": a.small, "variants": a.variants, "repeats": a.repeats,
                                 "artifact": "the serving tests' alpha (2-layer Llama, hidden 64), hard-linked"},
                      "results": [res]}, indent=1))


if __name__ == "__main__":
    main()
