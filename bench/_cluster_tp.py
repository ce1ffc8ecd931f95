"""Tensor-parallel serving on CPU (gloo): tokens/s and TTFT with ``--tensor-parallel`` 1 and 2.

    python bench/_cluster_tp.py [--quick]

The demo pair's base (tiny Llama, cached under ~/.cache/deltazip-bench) with RTN 4-bit variants of
group 64 (the demo's default group of 128 would straddle the two shards of ``o_proj``'s 128 input
columns, which tensor parallel refuses). The same closed batch of requests — variants drawn from a
zipf-1.5 popularity, base rows among them — runs through the engine (no HTTP) over a single-process
``DeltaModel`` and over a 2-rank ``ShardedDeltaModel`` group, alternating, 3 repeats (5 without
``--quick``), medians reported; greedy texts are checked equal. One intra-op thread per rank. ``tp_rows(quick)`` returns the rows (``bench/cluster.py`` imports it);
``main()`` prints ``{"bench": "cluster_tp", "machine", "config", "results"}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import demo_pair, machine  # noqa: E402

PROMPTS = ["abc", "hello world", "shift me by one", "delta zip", "tensor parallel", "a b c d e f"]


def _log(msg: str) -> None:
    print(f"[bench/cluster_tp] {msg}", file=sys.stderr, flush=True)


def _variants(quick: bool) -> tuple[dict, Path]:
    from serve import build_variants  # bench/serve.py: cached RTN variants of the demo pair

    pair = {**demo_pair(), "group_size": 64}
    return pair, build_variants(pair, 4 if quick else 8, "rtn", log=_log)


def _workload(names: list[str], n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` (model, prompt) requests; models by zipf-1.5 over base + variants."""
    rng = random.Random(seed)
    models = ["base", *names]
    weights = [1 / (i + 1) ** 1.5 for i in range(len(models))]
    return [(rng.choices(models, weights)[0], rng.choice(PROMPTS)) for _ in range(n)]


def _run(backend, base_dir: Path, names: list[str], work, max_tokens: int, slots: int) -> dict:
    from deltazip.runtime.serve.assembly import ServeConfig, engine_for
    from deltazip.runtime.serve.engine import FinishEvent, SamplingParams

    eng = engine_for(backend, ServeConfig(max_deltas=slots, max_num_seqs=16))
    tok = eng.served["base"].encoder
    first: dict[int, float] = {}
    done: dict[int, FinishEvent] = {}
    cond = threading.Condition()

    def sink(i):
        def fn(ev):
            with cond:
                first.setdefault(i, time.perf_counter())
                if isinstance(ev, FinishEvent):
                    done[i] = ev
                    cond.notify_all()
        return fn

    eng.start()
    try:
        t0 = time.perf_counter()
        for i, (m, p) in enumerate(work):
            eng.submit(m, tok(p)["input_ids"], SamplingParams(max_tokens=max_tokens, temperature=0.0), sink(i))
        with cond:
            cond.wait_for(lambda: len(done) == len(work), timeout=600)
        span = time.perf_counter() - t0
    finally:
        eng.shutdown()
    tokens = sum(ev.completion_tokens for ev in done.values())
    ttft = sorted(first[i] - t0 for i in done)
    return {"tokens_per_s": tokens / span, "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "makespan_s": span, "generated_tokens": tokens, "texts": [done[i].text for i in range(len(work))]}


def tp_rows(quick: bool) -> list[dict]:
    """One row per tensor-parallel degree (1, 2) on CPU with gloo, same workload and variants."""
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.cluster.tp_group import start_tensor_parallel
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import discover_variants

    pair, arts = _variants(quick)
    variants = discover_variants(arts)
    names = [v.name for v in variants]
    base = Checkpoint(pair["base"])
    work = _workload(names, 24 if quick else 64)
    max_tokens, slots = (16 if quick else 32), 4
    cfg = json.loads((Path(pair["base"]) / "config.json").read_text())
    # Row-parallel layers (o_proj, down_proj) each all-reduce [tokens, hidden] fp32 activations.
    comm = {"allreduces_per_forward": 2 * cfg["num_hidden_layers"],
            "allreduce_bytes_per_token": 2 * cfg["num_hidden_layers"] * cfg["hidden_size"] * 4}
    repeats = 3 if quick else 5
    base_dir = Path(pair["base"])
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    backends = {1: DeltaModel(base, variants, slots, cpu, torch.float32)}
    runs: dict[int, list[dict]] = {1: [], 2: []}
    try:
        backends[2] = start_tensor_parallel(base, variants, slots, cpu, torch.float32, 2)
        for b in backends.values():
            _run(b, base_dir, names, work[:4], max_tokens, slots)  # warm-up: loads, allocations
        # Alternate the candidates so that both see the same (shared, noisy) machine.
        for _ in range(repeats):
            for world, b in backends.items():
                runs[world].append(_run(b, base_dir, names, work, max_tokens, slots))
    finally:
        if 2 in backends:
            backends[2].close()
        torch.set_num_threads(prev)
    rows = []
    for world, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "ttft_mean_s", "ttft_p50_s",
                                                                  "makespan_s")}
        _log(f"tp={world}: {med['tokens_per_s']:.1f} tok/s, TTFT p50 {med['ttft_p50_s'] * 1e3:.0f} ms (medians)")
        rows.append({"candidate": f"tensor-parallel {world}", "tensor_parallel": world,
                     "backend": "gloo" if world > 1 else "none", "device": "cpu", "threads_per_rank": 1,
                     "requests": len(work), "variants": len(names), "distribution": "zipf-1.5",
                     "max_tokens": max_tokens, "repeats": repeats, **(comm if world > 1 else {}), **med,
                     "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in rs],
                     "generated_tokens": rs[0]["generated_tokens"],
                     "greedy_texts_equal_tp1": all(r["texts"] == runs[1][0]["texts"] for r in rs)})
    for r in rows:
        r["tokens_per_s_vs_tp1"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 variants, 24 requests of 16 tokens")
    a = ap.parse_args()
    rows = tp_rows(a.quick)
    print(json.dumps({"bench": "cluster_tp", "machine": machine(), "config": {"quick": a.quick, "pair": "demo",
                      "compression": "rtn 4-bit group 64"}, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
