"""Benchmark: dedup-scan throughput vs a raw read, and model loading with vs without the registry.

    python bench/dedup.py [--quick] [--out DIR] [--cache DIR] [--repeats N]

Prints ONE JSON document ``{"bench": "dedup", "machine": {...}, "config": {...}, "results": [...]}``
on stdout (progress notes go to stderr) and, with ``--out``, writes it to ``DIR/dedup.json``.

Part 1 - scan: generates synthetic bf16 safetensors checkpoints of an identical lineage (a base and
fine-tunes that rewrite the upper half of the layers; 2 shards each) under
``~/.cache/deltazip-bench/dedup`` (~0.85 GB with --quick, ~3.7 GB without), warms the page cache,
then times, side by side in one run and as medians of repeats: a raw sequential read of the same
files (``cat > /dev/null`` and a Python ``readinto`` loop), and ``scan_checkpoints`` with each
hash algorithm (difference statistics off, as they decode numbers), plus xxh3 with them on.

Part 2 - load: saves N small fp32 Llama checkpoints (base + fine-tunes sharing the embedding and the
lower half of the layers) and times loading all N: ``from_pretrained``, the dedup loader without
dedup (same code path, no hashing: the overhead baseline) and with a fresh registry, each alone and
followed by a first forward per model (all three loaders map files lazily, so that is when every
weight byte is read). Reports weight bytes referenced (distinct tensors), bytes saved, the
overheads; then the forward-pass cost of the read-only guard on shared weights.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def log(msg: str) -> None:
    print(f"[bench/dedup] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- machine

def machine_info() -> dict:
    import blake3
    import torch
    import xxhash

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "memory_bytes": mem,
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "xxhash": xxhash.VERSION, "blake3": getattr(blake3, "__version__", "?"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# ------------------------------------------------------------------------- synthetic checkpoints

def _write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]]) -> None:
    """Minimal safetensors writer (header + raw bytes in order); arrays are written as their bytes."""
    header, off = {}, 0
    for name, dtype, shape, arr in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h)
        for *_, arr in tensors:
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
    os.replace(tmp, path)


def _layout(hidden: int, inter: int, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    names = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
        names += [(p + f"self_attn.{k}_proj.weight", (hidden, hidden)) for k in "qkvo"]
        names += [(p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, inter))]
    names += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return names


def make_scan_corpus(root: Path, n_ckpt: int, hidden: int, inter: int, layers: int, vocab: int) -> tuple[list[Path], dict]:
    """Base + (n_ckpt - 1) fine-tunes; a fine-tune rewrites layers >= layers/2, final norm and lm_head.

    bf16 values: random 16-bit patterns with the top exponent bit cleared (finite, |x| < 2); a
    fine-tune flips the two lowest mantissa bits at random (a ~1% relative change, like a real
    fine-tune delta). Cached: regenerated only when the spec changes.
    """
    spec = dict(n_ckpt=n_ckpt, hidden=hidden, inter=inter, layers=layers, vocab=vocab, v=2)
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    base_dir = root / f"scan-{key}"
    paths = [base_dir / f"ckpt{c}" for c in range(n_ckpt)]
    if (base_dir / "done.json").is_file():
        return paths, spec
    shutil.rmtree(base_dir, ignore_errors=True)
    log(f"generating {n_ckpt} synthetic checkpoints under {base_dir}")
    layout = _layout(hidden, inter, layers, vocab)
    rng = np.random.default_rng(0)
    base = {}
    for name, shape in layout:
        a = rng.integers(0, 1 << 16, size=int(np.prod(shape)), dtype=np.uint16)
        a &= 0xBFFF
        base[name] = a
    for c, p in enumerate(paths):
        p.mkdir(parents=True)
        tensors = []
        for name, shape in layout:
            arr = base[name]
            upper = ".layers." in name and int(name.split(".")[2]) >= layers // 2
            if c > 0 and (upper or name in ("model.norm.weight", "lm_head.weight")):
                arr = arr ^ rng.integers(0, 4, size=arr.size, dtype=np.uint16)
            tensors.append((name, "BF16", shape, arr))
        half = len(tensors) // 2
        wmap = {}
        for s, part in enumerate((tensors[:half], tensors[half:])):
            fn = f"model-{s + 1:05d}-of-00002.safetensors"
            _write_safetensors(p / fn, part)
            wmap.update({t[0]: fn for t in part})
        (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (base_dir / "done.json").write_text(json.dumps(spec))
    return paths, spec


def corpus_files(paths: list[Path]) -> list[Path]:
    return sorted(f for p in paths for f in p.glob("*.safetensors"))


# --------------------------------------------------------------------------------------- timing

def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def raw_read(files: list[Path]) -> int:
    """``cat > /dev/null`` in Python: sequential 4 MiB readinto, one thread."""
    buf = bytearray(4 << 20)
    mv = memoryview(buf)
    n = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(mv):
                n += k
    return n


def raw_read_parallel(files: list[Path], threads: int) -> int:
    """The scan's read pattern without hashing: 4 MiB positional reads spread over ``threads``."""
    from concurrent.futures import ThreadPoolExecutor

    local = __import__("threading").local()
    chunk = 4 << 20
    jobs = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]

    def read(job) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(chunk))
        fd = os.open(job[0], os.O_RDONLY)
        try:
            return os.preadv(fd, [buf], job[1])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(read, jobs))


def bench_scan(paths: list[Path], repeats: int) -> list[dict]:
    from deltazip.formats.dedup_scan import ScanConfig, scan_checkpoints

    files = corpus_files(paths)
    nbytes = sum(f.stat().st_size for f in files)
    raw_read(files)  # warm the page cache
    raw_read(files)
    out = []
    cat = shutil.which("cat")
    cands: list[tuple[str, dict, object]] = []
    if cat:
        cands.append(("raw_read", {"method": "cat files > /dev/null"},
                      lambda: subprocess.run([cat, *map(str, files)], stdout=subprocess.DEVNULL, check=True)))
    cands.append(("raw_read", {"method": "python readinto 4 MiB, 1 thread"}, lambda: raw_read(files)))
    threads = min(8, 2 * (os.cpu_count() or 1))
    cands.append(("raw_read", {"method": f"python pread 4 MiB, {threads} threads (scan's reads, no hashing)"},
                  lambda: raw_read_parallel(files, threads)))
    last = {}
    for algo in ("xxh3", "blake3", "blake2b"):
        def run(algo=algo):
            last[algo] = scan_checkpoints(paths, ScanConfig(hash=algo, diff_stats=False))
        cands.append(("scan", {"hash": algo, "diff_stats": False}, run))

    def run_diff():
        last["diff"] = scan_checkpoints(paths, ScanConfig(hash="xxh3", diff_stats=True))
    cands.append(("scan", {"hash": "xxh3", "diff_stats": True}, run_diff))

    # Interleave candidates repeat by repeat so that background load hits them all alike.
    times: dict[int, list[float]] = {i: [] for i in range(len(cands))}
    for r in range(repeats):
        for i, (_, _, fn) in enumerate(cands):
            if cands[i][1].get("diff_stats") and r >= max(1, repeats // 2 + 1):
                continue  # the slow diff-stats variant: fewer repeats
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
        log(f"scan repeat {r + 1}/{repeats} done")
    raw_best = None
    for i, (name, params, _) in enumerate(cands):
        med = statistics.median(times[i])
        row = {"name": name, **params, "bytes": nbytes, "repeats": len(times[i]), "seconds_median": round(med, 4),
               "seconds_all": [round(t, 4) for t in times[i]], "gb_per_s": round(nbytes / med / 1e9, 3)}
        if name == "raw_read":
            raw_best = max(raw_best or 0.0, row["gb_per_s"])
        out.append(row)
    for row in out:
        if row["name"] == "scan":
            row["vs_fastest_raw_read"] = round(row["gb_per_s"] / raw_best, 3)
            row["vs_cat"] = round(row["gb_per_s"] / out[0]["gb_per_s"], 3) if cat else None
            res = last["diff" if row["diff_stats"] else row["hash"]].to_dict()
            row["bytes_saved"] = res["totals"]["bytes_saved"]
            row["saved_pct"] = res["totals"]["saved_pct"]
            row["hash_phase_gb_per_s"] = res["timing"]["hash_gb_per_s"]
    return out


# ---------------------------------------------------------------------------------- model loads

def make_models(root: Path, n: int, hidden: int, inter: int, layers: int, vocab: int) -> list[Path]:
    """Base + fine-tunes: each fine-tune rewrites layers >= layers/2, final norm and lm_head."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(n=n, hidden=hidden, inter=inter, layers=layers, vocab=vocab, v=2)
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    d = root / f"models-{key}"
    paths = [d / f"m{i}" for i in range(n)]
    if (d / "done.json").is_file():
        return paths
    shutil.rmtree(d, ignore_errors=True)
    log(f"building {n} Llama checkpoints under {d}")
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    # fp32: on a CPU, bf16 matmuls fall back to slow kernels and would drown the forward timing.
    base = LlamaForCausalLM(cfg)
    base.save_pretrained(paths[0])
    for i in range(1, n):
        m = LlamaForCausalLM(cfg)
        m.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in m.named_parameters():
                upper = ".layers." in name and int(name.split(".")[2]) >= layers // 2
                if upper or name in ("model.norm.weight", "lm_head.weight"):
                    p.add_((0.01 * p.float().std() * torch.randn(p.shape, generator=g)).to(p.dtype))
        m.save_pretrained(paths[i])
        del m
    (d / "done.json").write_text(json.dumps(spec))
    return paths


def _weight_bytes(models) -> int:
    """Bytes of distinct weight tensors (by data pointer) referenced by all models together.

    Tensors are views into per-file memory maps, so storages are not the unit: a tensor that two
    models share is counted once, as memory is.
    """
    seen, total = set(), 0
    for m in models:
        for p in m.parameters():
            key = (p.data_ptr(), p.numel() * p.element_size())
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total


def bench_load(paths: list[Path], repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from deltazip.runtime.share.dedup_loader import load_model
    from deltazip.runtime.share.dedup_registry import TensorDedupRegistry

    files = [f for p in paths for f in p.glob("*.safetensors")]
    raw_read(files)
    # One intra-op thread: on a small shared box, OpenMP worker spinning under oversubscription
    # made forward times swing 10x between identical runs; one thread keeps candidates comparable.
    torch.set_num_threads(1)

    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))

    def first_forward(models):
        # Loads are lazy (memory maps): a first forward touches every weight page, so "load +
        # first forward" is the end-to-end time a server sees before its first token.
        with torch.inference_mode():
            for m in models:
                m(ids[:, :4])

    def from_pretrained():
        return [AutoModelForCausalLM.from_pretrained(p).eval() for p in paths], None

    def no_dedup():
        return [load_model(p, dedup=False).model for p in paths], None

    def dedup():
        reg = TensorDedupRegistry()
        return [load_model(p, registry=reg).model for p in paths], reg

    modes = {"from_pretrained": from_pretrained, "loader_no_dedup": no_dedup, "loader_dedup": dedup}
    for fn in modes.values():  # one warm-up round: imports, page cache, allocator
        fn()
    gc.collect()
    times: dict[str, list[float]] = {k: [] for k in modes}
    times_ff: dict[str, list[float]] = {k: [] for k in modes}
    held: dict[str, int] = {}
    stats: dict[str, dict] = {}
    kept: dict[str, list] = {}
    for r in range(repeats):
        for k, fn in modes.items():
            gc.collect()
            t0 = time.perf_counter()
            models, reg = fn()
            times[k].append(time.perf_counter() - t0)
            first_forward(models)
            times_ff[k].append(time.perf_counter() - t0)
            held[k] = _weight_bytes(models)
            if reg is not None:
                stats[k] = reg.stats.as_dict()
            if r == repeats - 1 and k in ("loader_no_dedup", "loader_dedup"):
                kept[k] = models[-1:]
            del models, reg
        log(f"load repeat {r + 1}/{repeats} done")
    med = {k: statistics.median(v) for k, v in times.items()}
    mff = {k: statistics.median(v) for k, v in times_ff.items()}
    out = []
    for k in modes:
        row = {"name": "load", "mode": k, "n_models": len(paths), "repeats": repeats,
               "seconds_median": round(med[k], 4), "seconds_all": [round(t, 4) for t in times[k]],
               "load_and_first_forward_seconds_median": round(mff[k], 4),
               "weight_bytes_held": held[k]}
        if k == "loader_dedup":
            row["registry"] = stats[k]
            row["bytes_saved"] = held["loader_no_dedup"] - held[k]
            row["saved_pct"] = round(100 * row["bytes_saved"] / held["loader_no_dedup"], 2)
            for base in ("loader_no_dedup", "from_pretrained"):
                row[f"load_overhead_pct_vs_{base}"] = round(100 * (med[k] / med[base] - 1), 2)
                row[f"load_and_first_forward_overhead_pct_vs_{base}"] = round(100 * (mff[k] / mff[base] - 1), 2)
        out.append(row)

    # Forward-pass cost of the read-only guard: the same weights, private vs shared (guarded).
    fw: dict[str, list[float]] = {"loader_no_dedup": [], "loader_dedup": []}
    with torch.inference_mode():
        for m in (kept["loader_no_dedup"][0], kept["loader_dedup"][0]):
            m(ids)
        for _ in range(max(5, 4 * repeats)):
            for k in fw:
                t0 = time.perf_counter()
                kept[k][0](ids)
                fw[k].append(time.perf_counter() - t0)
        same = torch.equal(kept["loader_no_dedup"][0](ids).logits, kept["loader_dedup"][0](ids).logits)
    fmed = {k: statistics.median(v) for k, v in fw.items()}
    out.append({"name": "forward", "batch": 1, "seq": 32, "repeats": len(fw["loader_dedup"]),
                "ms_median_private_weights": round(1e3 * fmed["loader_no_dedup"], 3),
                "ms_median_shared_readonly_weights": round(1e3 * fmed["loader_dedup"], 3),
                "guard_overhead_pct": round(100 * (fmed["loader_dedup"] / fmed["loader_no_dedup"] - 1), 2),
                "identical_logits": bool(same)})
    return out


# ------------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~0.85 GB scan corpus, 3 models, fewer repeats")
    ap.add_argument("--out", type=Path, help="also write dedup.json here")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "deltazip-bench" / "dedup",
                    help="where generated checkpoints are kept between runs")
    ap.add_argument("--repeats", type=int, help="repeats per candidate (medians are reported)")
    args = ap.parse_args()

    if args.quick:
        scan_spec = dict(n_ckpt=2, hidden=1024, inter=2816, layers=12, vocab=32000)
        model_spec = dict(n=3, hidden=512, inter=1408, layers=8, vocab=32000)
        repeats = args.repeats or 3
    else:
        scan_spec = dict(n_ckpt=5, hidden=1024, inter=2816, layers=24, vocab=32000)
        model_spec = dict(n=4, hidden=768, inter=2048, layers=12, vocab=32000)
        repeats = args.repeats or 5
    try:
        args.cache.mkdir(parents=True, exist_ok=True)
        cache = args.cache
    except OSError:
        cache = Path(tempfile.mkdtemp(prefix="deltazip-bench-dedup-"))

    t0 = time.perf_counter()
    scan_paths, _ = make_scan_corpus(cache, **scan_spec)
    model_paths = make_models(cache, **model_spec)
    results = bench_scan(scan_paths, repeats)
    results += bench_load(model_paths, repeats)
    doc = {
        "bench": "dedup",
        "machine": machine_info(),
        "config": {"quick": args.quick, "repeats": repeats, "cache": str(cache), "scan_corpus": scan_spec,
                   "scan_corpus_bytes": sum(f.stat().st_size for f in corpus_files(scan_paths)),
                   "models": model_spec, "scan_threads": min(8, 2 * (os.cpu_count() or 1)), "torch_threads_in_load": 1,
                   "wall_seconds": None},
        "results": results,
    }
    doc["config"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dedup.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
