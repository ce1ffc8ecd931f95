"""One engine step, measured without HTTP: serving B rows of k variants in one delta step against the
k whole-model steps that swap mode needs for the same rows.

    python bench/step.py [--pair demo|smollm2|synthetic-7b] [--rows 8 32 64] [--variants 1 4 8] [--repeats 15]
        [--dtype auto|float32|bfloat16|float16] [--layers 4] [--max-swap 8] [--generate] [--quick]

``--pair synthetic-7b`` (bench/_synthetic.py): a Llama with Llama-2-7B layer shapes made from a seed on
the device, bf16, as many of its 32 layers as the device holds with every slot filled (at most
``--layers``; the count is in every row); each slot's variant is drawn on the device from random codes
and scales in the served layout (the same bytes as the artifact of that index, which plans the model:
one artifact is written, none is read), so every slot differs. Defaults to rows 32, variants 1 8 32,
the served dtype bf16 on CUDA, no swap rows, and transformers' ``generate`` timed on the same base and
batch before the delta model is built (``--generate`` adds it for the other pairs):
``generate_ms_per_token`` is the decode time per generated token (a run of 17 new tokens minus a run of
1, over 16), against ``base_ms`` per step. Every row stands beside its floor: the bytes a
memory-bound step must move (weights as below, plus the rows' KV cache) over the copy bandwidth
measured in the same run (``*_floor_ms``, ``base_bytes_efficiency`` = floor / time), and
``delta_over_scaled_base`` = delta time / (its weight bytes / the base's x the base time).

Builds the models the serving engine builds (``DeltaModel`` with ``k`` filled slots, ``SwapModels``
with ``k`` whole merged models) over the cached variants of ``bench/serve.py`` and times decode steps
through the engine's own KV pool, step mask and forward:

- ``delta``: one forward over all ``B`` rows, ``B / k`` per variant;
- ``swap``: ``k`` forwards of ``B / k`` rows, each on its own merged model (what the swap baseline
  runs for the same rows, before counting any model load);
- ``base``: one forward over ``B`` rows of the base alone (the floor: no delta work);
- ``delta_contiguous``: the ``delta`` step on the contiguous KV pool (``StepKV``: gather the rows'
  past, concatenate the new token, SDPA), the engine's layout before the paged cache and still its
  fallback for models without the attention interface.

Every row has a ``--context``-token past. Prints ONE JSON document with the median and p90 step times
(ms) of each, measured interleaved in one run, and the ratio ``swap / delta`` (> 1: the delta step
serves the same rows faster); ``delta_over_base`` beside ``weight_bytes_over_base``, the weight
bytes the delta step reads over those of the base step (base weights, the embedding table excepted,
plus ``variants`` times one variant's device bytes): the time ratio of a memory-bound step, as a GPU
decode step at these shapes is (a CPU one is compute-bound, and on CPU the deltas are dense). Per decode step of ``delta`` on each KV layout (``profile``): aten ops
(torch profiler, every nesting level, and outermost ops as dispatched), KV bytes copied beyond
appending the new tokens and bytes appended (``deltazip.runtime.serve.kv_meter``), and on CUDA the
kernel and CUDA-graph launches (a replayed graph's kernels are not aten ops: on CUDA the op and
KV-byte counts of the paged step cover what runs outside the graph). ``--quick``: rows 8 32,
variants 1 4, 7 repeats.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, demo_pair, emit, machine, smollm2_pair  # noqa: E402
from _synthetic import build_base, fit_layers, llama_config, random_variant, sizes, write_variants  # noqa: E402
from sbmm_table import copy_bandwidth  # noqa: E402
from serve import build_variants  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench/step] {msg}", file=sys.stderr, flush=True)


def decode_timer(model, slots: list[int], context: int, kv: str = "paged"):
    """A callable running one decode step of ``len(slots)`` rows (each with ``context`` past tokens),
    on the paged pool (``kv="paged"``, when the model runs the paged attention) or the contiguous one.
    On CUDA the paged delta step replays CUDA graphs, as the engine does. Its ``pool`` attribute
    is the KV pool; a call returns the step's logits ``[B, V]``."""
    from deltazip.runtime.serve.kv_cache import BlockPool
    from deltazip.runtime.serve.model_runner import (
        KVPool,
        forward_step,
        new_kv_pool,
        new_seq_kv,
        prefill_logits,
    )

    pool = new_kv_pool(model) if kv == "paged" else KVPool()
    kvs = [new_seq_kv(pool) for _ in slots]
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefill_logits(model, slots, torch.randint(0, vocab, (len(slots), context), generator=g).tolist(), kvs, pool)
    tok = torch.randint(0, vocab, (len(slots), 1), generator=g).tolist()
    graphs = None
    if model.device.type == "cuda" and isinstance(pool, BlockPool) and model.mode == "delta":
        from deltazip.runtime.serve.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(model, pool)  # what the engine replays on CUDA

    def step() -> torch.Tensor:
        past = [k.length for k in kvs]
        logits = None if graphs is None else graphs.run(kvs, slots, [t[0] for t in tok], ("bench",))
        if logits is None:
            logits = forward_step(model, pool, kvs, slots, tok, past)
        for k in kvs:  # keep the past fixed: every timed step sees the same context length
            k.length = past[0]
        return logits

    step.pool = pool
    return step


def profile_step(step, cuda: bool) -> dict:
    """Ops, launches and KV traffic of one call of ``step`` (a :func:`decode_timer`); a profiler that
    fails (no CUPTI on a GPU machine, say) gives ``{"error": ...}`` instead of ending the bench, whose
    step times do not depend on it."""
    try:
        return _profile_step(step, cuda)
    except Exception as e:  # noqa: BLE001 - the counts are secondary to the timings already taken
        log(f"profiling a step failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _profile_step(step, cuda: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from deltazip.runtime.serve.kv_meter import KVCopyMeter

    with KVCopyMeter(step.pool) as meter:
        step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
    names = [e.name for e in prof.events()]
    out = {"aten_ops": sum(n.startswith("aten::") for n in names), "aten_ops_outermost": meter.ops,
           "kv_bytes_copied": meter.copied, "kv_bytes_appended": meter.appended}
    if cuda:
        out["kernel_launches"] = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") for n in names)
        out["graph_launches"] = sum(n == "cudaGraphLaunch" for n in names)
    return out


def generate_ms_per_token(base_dir, rows: int, context: int, dtype, device, sync, new: int = 16) -> float:
    """transformers' greedy ``generate`` on the base model, batch ``rows``: ms per decoded token
    (``new + 1`` tokens minus 1 token, over ``new``; median of 3)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf.config.vocab_size, (rows, context), generator=g).to(device)

    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    run(2)
    one = statistics.median(run(1) for _ in range(3))
    many = statistics.median(run(new + 1) for _ in range(3))
    return round((many - one) / new * 1e3, 3)


def synthetic_layers(shape: str, slots: int, device: torch.device, most: int) -> dict:
    """The most layers (at most ``most``) whose base and ``slots`` filled slots take at most 80% of the
    device's memory (on a CPU: ``most``)."""
    if device.type != "cuda":
        return {"layers": most, "limits": {"requested": most}}
    sz = sizes(shape)
    fit = fit_layers(0.8 * torch.cuda.get_device_properties(device).total_memory,
                     sz["model_layer"] + slots * sz["slot_layer"], sz["model_fixed"])
    return {"layers": min(most, fit), "limits": {"requested": most, "device": fit}}


def synthetic_model(a: argparse.Namespace, device: torch.device, dtype: torch.dtype, generate_ms: dict, log):
    """The synthetic-7b delta model with ``max(a.variants)`` slots, each filled with its own variant
    drawn on the device; times transformers' ``generate`` on the base first (into ``generate_ms``, per
    batch size), so its copy of the model is gone before the delta model is built."""
    from dataclasses import replace

    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.model import DeltaModel
    from deltazip.runtime.serve.variant_sources import inspect_variant

    k_max = max(a.variants)
    shape = a.shape or ("7b" if device.type == "cuda" else "toy")
    fit = synthetic_layers(shape, k_max, device, a.layers)
    a.layers, a.shape, a.layer_limits = fit["layers"], shape, fit["limits"]
    log(f"synthetic {shape}: {a.layers} layers (limits in layers: {fit['limits']})")
    root = CACHE / "synthetic" / f"{shape}-l{a.layers}"
    base = build_base(root / "base", shape, a.layers, device, log=log)
    write_variants(root / "one", base, shape, a.layers, 1, device, log=log)  # the plan of every slot
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for rows in a.rows:
        try:
            generate_ms[rows] = generate_ms_per_token(base["path"], rows, a.context, dtype, device, sync)
        except Exception as e:  # noqa: BLE001 - keep the engine's rows; say why this one is missing
            log(f"transformers' generate failed: {type(e).__name__}: {str(e)[:200]}")
            generate_ms[rows] = None
    plan = inspect_variant(root / "one" / "v00")
    variants = [replace(plan, name=f"v{i:02d}") for i in range(k_max)]
    dm = DeltaModel(Checkpoint(base["path"]), variants, k_max, device, dtype)
    tune_bench_keys(dm, [(r, k) for r in a.rows for k in a.variants if r % k == 0])  # before any slot is written
    cfg = llama_config(shape, a.layers)
    for i, v in enumerate(variants):
        dm.write_slot(i, v.name, dm.stage_slot(dm.host_from_packed(v.name, random_variant(cfg, i, device))))
    return dm, base["path"]


def tune_bench_keys(dm, pairs: list[tuple[int, int]]) -> dict:
    """Tune the delta-matmul keys this bench runs, ``(rows, variants)`` per stack configuration, and no
    other (a GPU window's seconds): what a server tunes before it answers."""
    from deltazip.runtime.serve import kernel_warmup

    t0 = time.perf_counter()
    n = dm.tuner.tune_now(kernel_warmup.jobs(dm, pairs))
    dm.warmup = {"seconds": time.perf_counter() - t0, "launches": n}
    return dm.warmup


def kv_bytes(config, rows: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of K and V a decode step of ``rows`` rows with ``context`` past tokens reads and writes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return rows * (context + 1) * per_token * torch.tensor([], dtype=dtype).element_size()


def floors(row: dict, bw: float, base_bytes: int, variant_bytes: int, kv: int) -> dict:
    """A row's floors: bytes over the copy bandwidth ``bw`` (bytes/s), in ms, and the ratios against them."""
    k = row["variants"]
    base_floor = (base_bytes + kv) / bw * 1e3
    delta_floor = (base_bytes + k * variant_bytes + kv) / bw * 1e3
    base_ms, delta_ms = row["base_ms"]["p50"], row["delta_ms"]["p50"]
    scaled = (base_bytes + k * variant_bytes) / base_bytes * base_ms
    return {"kv_bytes": kv, "base_floor_ms": round(base_floor, 4), "delta_floor_ms": round(delta_floor, 4),
            "base_bytes_efficiency": round(base_floor / base_ms, 3),
            "delta_bytes_efficiency": round(delta_floor / delta_ms, 3),
            "delta_over_scaled_base": round(delta_ms / scaled, 3)}


def time_rows(runs: dict, repeats: int, sync) -> tuple[dict, list[float]]:
    """Interleaved timings (ms) of every mode's callables, and the host ms of issuing each delta step."""
    host = []  # host time to issue one delta step (no sync: with CUDA graphs the GPU runs on)
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(2):  # warm-up
        for fns in runs.values():
            for f in fns:
                f()
    for _ in range(repeats):  # interleaved, so drift hits every mode alike
        for m, fns in runs.items():
            sync()
            t0 = time.perf_counter()
            for f in fns:
                f()
            if m == "delta":
                host.append((time.perf_counter() - t0) * 1e3)
            sync()
            times[m].append((time.perf_counter() - t0) * 1e3)
    return times, host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("demo", "smollm2", "synthetic-7b"), default="demo")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="default 8 32 64 (synthetic-7b: 32)")
    ap.add_argument("--variants", type=int, nargs="+", default=None, help="default 1 4 8 (synthetic-7b: 1 8 32)")
    ap.add_argument("--layers", type=int, default=32,
                    help="synthetic-7b: decoder layers, at most (fewer when the device holds fewer with every slot "
                         "filled)")
    ap.add_argument("--shape", choices=("7b", "toy"), default=None,
                    help="synthetic-7b: layer shapes (default 7b on a GPU, toy on CPU: a dry run)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="served dtype (auto: fp32 for the demo and smollm2 pairs, bf16 for synthetic-7b on CUDA)")
    ap.add_argument("--max-swap", type=int, default=None,
                    help="swap mode up to this many variants (whole models each; default 8, synthetic-7b 0)")
    ap.add_argument("--generate", action="store_true", help="also time transformers' generate on the base")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    ap.add_argument("--quick", action="store_true", help="rows 8 32, variants 1 4, 7 repeats")
    ap.add_argument("--out", type=Path, default=None, help="also write DIR/step.json")
    a = ap.parse_args()
    synthetic = a.pair == "synthetic-7b"
    a.rows = a.rows or ([32] if synthetic else [8, 32, 64])
    a.variants = a.variants or ([1, 8, 32] if synthetic else [1, 4, 8])
    a.max_swap = a.max_swap if a.max_swap is not None else (0 if synthetic else 8)
    if a.quick:
        a.rows, a.variants, a.repeats = ([32], [1, 8], 7) if synthetic else ([8, 32], [1, 4], 7)
    torch.set_num_threads(a.threads)
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.serve.attention import is_paged
    from deltazip.runtime.serve.model import DeltaModel, SwapModels
    from deltazip.runtime.serve.variant_sources import discover_variants

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Each phase logs its seconds (and the kernel tuning one line per stack): a run stopped at a time
    # limit says where its time went (the first H100 run's step bench printed nothing for 370 s).
    logging.basicConfig(level=logging.WARNING, format="[bench/step %(relativeCreated)7.0f ms] %(name)s: %(message)s")
    logging.getLogger("deltazip").setLevel(logging.INFO)
    t_start = time.perf_counter()

    def phase(msg: str) -> None:
        log(f"{msg} ({time.perf_counter() - t_start:.1f} s since start)")

    dtype = getattr(torch, a.dtype) if a.dtype != "auto" else (
        torch.bfloat16 if synthetic and device.type == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    k_max = max(a.variants)
    generate_ms: dict[int, float | None] = {}  # per batch size: generate runs the base alone, whatever k is
    t0 = time.perf_counter()
    if synthetic:
        dm, base_dir = synthetic_model(a, device, dtype, generate_ms, log)
        variants = list(dm.variants.values())
        build_s = time.perf_counter() - t0
        phase(f"synthetic {a.layers}-layer delta model built and {k_max} slots filled with distinct variants drawn "
              f"on {device} in {build_s:.1f} s (kernel warm-up {dm.warmup['seconds']:.1f} s)")
    else:
        pair = demo_pair() if a.pair == "demo" else smollm2_pair(log=log)
        arts, base_dir = build_variants(pair, k_max, "rtn"), pair["base"]
        variants = discover_variants(arts)[:k_max]
        dm = DeltaModel(Checkpoint(base_dir), variants, k_max, device, dtype)
        build_s = time.perf_counter() - t0
        phase(f"delta model built in {build_s:.1f} s (kernel warm-up {dm.warmup['seconds']:.1f} s, "
              f"{dm.warmup['launches']} launches)")
        tune_bench_keys(dm, [(r, k) for r in a.rows for k in a.variants if r % k == 0])  # before any slot is written
        for i, v in enumerate(variants):
            dm.write_slot(i, v.name, dm.load_host(v.name))
        phase(f"{len(variants)} variants written to delta slots (kernel tuning {dm.warmup['seconds']:.1f} s)")
    n_swap = min(k_max, a.max_swap)
    sw = None
    if n_swap:
        sw = SwapModels(Checkpoint(base_dir), variants[:n_swap], n_swap, device, dtype, "base")
        for i, v in enumerate(variants[:n_swap]):
            sw.write_slot(i, v.name, sw.load_host(v.name))
        phase(f"{n_swap} whole models written to swap slots")
    # What a memory-bound step must read: the base's weights (the embedding table only row by row) and
    # each distinct variant's device bytes; weight_bytes_over_base is the step-time ratio those
    # bytes alone would give (docs/serve.md, "What to expect from the step bench").
    emb = dm.model.get_input_embeddings().weight
    base_read_bytes = dm.base_bytes() - emb.numel() * emb.element_size()
    variant_bytes = dm.slot_bytes(0)
    bw = copy_bandwidth(device.type, 1 << 30 if device.type == "cuda" else 1 << 26)
    phase(f"copy bandwidth {bw / 1e9:.1f} GB/s")
    results: list[dict] = []
    mach = machine()

    def document(complete: bool) -> dict:
        return {"bench": "step", "machine": mach, "complete": complete,
                "config": {"pair": a.pair, "context": a.context, "repeats": a.repeats, "threads": a.threads,
                           "dtype": str(dtype).removeprefix("torch."), "layers": a.layers if synthetic else None,
                           "shape": a.shape if synthetic else None,
                           "layer_limits": getattr(a, "layer_limits", None),
                           "delta_model_build_s": round(build_s, 2), "kernel_warmup_s": round(dm.warmup["seconds"], 2),
                           "swap_variants": n_swap, "delta_compute": dm.delta_compute, "device": str(device),
                           "copy_GBps": round(bw / 1e9, 2), "base_weight_bytes_read": base_read_bytes,
                           "variant_device_bytes": variant_bytes, "paged_kv": is_paged(dm)},
                "results": results}

    for rows in a.rows:
        for k in a.variants:
            if rows % k:
                continue
            per = rows // k
            runs = {
                "delta": [decode_timer(dm, [i // per for i in range(rows)], a.context)],
                "base": [decode_timer(dm, [-1] * rows, a.context)],
            }
            if sw is not None and k <= n_swap:
                runs["swap"] = [decode_timer(sw, [s] * per, a.context) for s in range(k)]
            if not synthetic:
                runs["delta_contiguous"] = [decode_timer(dm, [i // per for i in range(rows)], a.context,
                                                         kv="contiguous")]
            times, host = time_rows(runs, a.repeats, sync)
            row = {"rows": rows, "variants": k, "layers": a.layers if synthetic else None,
                   "delta_host_ms": round(statistics.median(host), 3)}
            for m, ts in times.items():
                ts.sort()
                row[f"{m}_ms"] = {"p50": round(statistics.median(ts), 3), "p90": round(ts[int(0.9 * (len(ts) - 1))], 3)}
            if "swap_ms" in row:
                row["swap_over_delta"] = round(row["swap_ms"]["p50"] / row["delta_ms"]["p50"], 3)
            row["delta_over_base"] = round(row["delta_ms"]["p50"] / row["base_ms"]["p50"], 3)
            row["weight_bytes_over_base"] = round(1 + k * variant_bytes / base_read_bytes, 3)
            row |= floors(row, bw, base_read_bytes, variant_bytes, kv_bytes(dm.config, rows, a.context, dtype))
            row["profile"] = {"paged" if m == "delta" else "contiguous": profile_step(runs[m][0], device.type == "cuda")
                              for m in ("delta", "delta_contiguous") if m in runs}
            if synthetic or a.generate:
                if rows not in generate_ms:
                    try:
                        generate_ms[rows] = generate_ms_per_token(base_dir, rows, a.context, dtype, device, sync)
                    except Exception as e:  # noqa: BLE001 - keep the engine's rows; say why this one is missing
                        log(f"transformers' generate failed: {type(e).__name__}: {str(e)[:200]}")
                        generate_ms[rows] = None
                row["generate_ms_per_token"] = generate_ms[rows]
                row["generate_over_base"] = (None if generate_ms[rows] is None
                                             else round(generate_ms[rows] / row["base_ms"]["p50"], 3))
            results.append(row)
            log(json.dumps(row))
            if a.out is not None:  # the rows so far: a run stopped at a time limit still leaves them
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / "step.json").write_text(json.dumps(document(False), indent=1))
    emit(document(True), a.out, "step.json")


if __name__ == "__main__":
    main()
