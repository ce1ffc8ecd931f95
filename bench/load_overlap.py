"""How long a running variant stalls while another variant loads: synchronous loads vs the background
loader (``deltazip.runtime.serve.delta_loader``).

    python bench/load_overlap.py [--repeats 3] [--threads 1] [--tokens 48]

A 31.6 M-parameter synthetic Llama (fp16 on disk, as in bench/share.py) with two RTN 4-bit variants.
Per repeat and mode, a fresh engine (``--max-deltas 2``, no host tier: every load reads the disk)
decodes a long request of ``v1``; once it has produced a few tokens a request of ``v2`` arrives, whose
variant must be read, decoded and written into a slot. Measured on ``v1``'s token times:

- ``gap_ms_median``: its usual inter-token time;
- ``gap_ms_max_during_load``: its longest inter-token gap between ``v2``'s arrival and ``v2``'s first
  token (the stall a load imposes on a variant that does not need it);
- ``v2_ttft_ms``: ``v2``'s time to first token (load included).

``sync`` is the engine without the scheduler's ready hook (the load runs on the engine thread when
the scheduler selects ``v2``, as before the loader existed); ``overlapped`` is the default. Prints
ONE JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine, synthetic_llama  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pair() -> tuple[Path, Path]:
    """Base + two RTN variants (artifacts folder, base folder), cached."""
    return synthetic_llama("load-overlap-v1", seeds=[11, 12], log=log)


def one_run(arts: Path, base: Path, overlapped: bool, tokens: int, threads: int) -> dict:
    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime
    from deltazip.runtime.serve.engine import FinishEvent, SamplingParams, TokenEvent

    rt = build_runtime(ServeConfig(artifacts=arts, base=str(base), max_deltas=2, max_cpu_deltas=0, cpu_threads=threads,
                                   device="cpu"))
    eng = rt.engine
    if not overlapped:
        eng.scheduler.ready = None
    times: dict[str, list[float]] = {"v1": [], "v2": []}
    done = {k: threading.Event() for k in times}

    def sink(name):
        def fn(ev):
            if isinstance(ev, TokenEvent) and ev.token_id >= 0:
                times[name].append(time.perf_counter())
            if isinstance(ev, FinishEvent):
                done[name].set()
        return fn

    enc = eng.served["v1"].encoder
    eng.start()
    try:
        eng.submit("v1", enc("alpha beta")["input_ids"],
                   SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), sink("v1"))
        while len(times["v1"]) < 8:
            time.sleep(0.001)
        t_arrive = time.perf_counter()
        eng.submit("v2", enc("zip model")["input_ids"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                   sink("v2"))
        assert done["v1"].wait(600) and done["v2"].wait(600)
        st = eng.stats()["load_stats"]["v2"]
    finally:
        eng.shutdown()
    t_first = times["v2"][0]
    v1 = times["v1"]
    gaps = [b - a for a, b in zip(v1, v1[1:])]
    during = [b - a for a, b in zip(v1, v1[1:]) if b > t_arrive and a < t_first]
    if not during:  # v1 produced no token at all between v2's arrival and its first token
        after = [t for t in v1 if t > t_arrive]
        during = [(after[0] if after else t_first) - max(t for t in v1 if t <= t_arrive)]
    return {"gap_ms_median": round(statistics.median(gaps) * 1e3, 2),
            "gap_ms_max_during_load": round(max(during) * 1e3, 2),
            "v1_tokens_during_load": sum(1 for t in v1 if t_arrive < t < t_first),
            "v2_ttft_ms": round((t_first - t_arrive) * 1e3, 2),
            "v2_disk_load_ms": round(st["disk_seconds_last"] * 1e3, 2),
            "v2_slot_write_ms": round(st["device_seconds_last"] * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    ap.add_argument("--tokens", type=int, default=48, help="v1's completion length")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 24 tokens")
    ap.add_argument("--out", type=Path, default=None, help="also write DIR/load_overlap.json")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.tokens = 1, 24
    torch.set_num_threads(a.threads)
    arts, base = pair()
    runs: dict[str, list[dict]] = {"sync": [], "overlapped": []}
    for r in range(a.repeats):  # interleaved, so drift hits both modes alike
        for mode in runs:
            res = one_run(arts, base, mode == "overlapped", a.tokens, a.threads)
            log(f"repeat {r} {mode}: {json.dumps(res)}")
            runs[mode].append(res)
    summary = {mode: {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0]} for mode, rs in runs.items()}
    results = [{"mode": mode, "median": summary[mode], "runs": rs} for mode, rs in runs.items()]
    emit({"bench": "load_overlap", "machine": machine(),
          "config": {"repeats": a.repeats, "threads": a.threads, "tokens": a.tokens, "params": "31.6M",
                     "device": "cpu"},
          "results": results},
         a.out, "load_overlap.json")


if __name__ == "__main__":
    main()
