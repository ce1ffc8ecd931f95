"""GDeflate decode throughput: nvCOMP on the GPU against nvCOMP's CPU library, on one 7B-shaped variant.

    python bench/gdeflate_decode.py [--quick] [--out DIR] [--shape 7b|toy] [--layers 8] [--level 12]
        [--repeats 5]

The variant (bench/_synthetic.py ``random_variant``): every decoder-layer linear of ``--layers`` layers
of a Llama with Llama-2-7B shapes as a 4-bit 2:4 group-128 packed delta, its codes drawn from a
rounded Gaussian (the spread RTN of a Gaussian delta gives, so the bytes compress as an artifact's
do). Every part is stored the way ``deltazip compress --lossless gdeflate`` stores it (chunked GDeflate
at ``--level``, the byte filter the writer picks), encoded once by the CPU library. Then, side by side,
the median of ``--repeats`` decodes of every part: ``cpu`` (the CPU library, one thread per core, into
host memory) and ``gpu`` (nvCOMP's batched decoder, from device memory into device memory); both count
decoded bytes over the time of the codec alone (no checksums, no copies). Without a GPU (or without
the nvCOMP package matching torch's CUDA major) the ``gpu`` row says why it did not run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit, machine  # noqa: E402
from _synthetic import llama_config, random_variant  # noqa: E402

from deltazip.formats import chunked, gdeflate  # noqa: E402
from deltazip.formats.artifact import default_filter  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench/gdeflate_decode] {msg}", file=sys.stderr, flush=True)


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up (and on the GPU, the codec's set-up)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the toy shape, 2 layers, 3 repeats")
    ap.add_argument("--out", type=Path, default=None, help="write gdeflate_decode.json here")
    ap.add_argument("--shape", choices=("7b", "toy"), default="7b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--level", type=int, default=gdeflate.DEFAULT_LEVEL)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if a.quick:
        a.shape, a.layers, a.repeats = "toy", 2, 3
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    parts = [t.cpu() for d in random_variant(llama_config(a.shape, a.layers), 0, device).values()
             for t in d.parts().values()]
    drawn_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jobs = [(chunked.Container.from_json(meta), stored)
            for stored, meta in (chunked.encode(t, a.level, default_filter(t)) for t in parts)]
    encode_s = time.perf_counter() - t0
    raw = sum(c.nbytes for c, _ in jobs)
    stored_bytes = sum(s.size for _, s in jobs)
    log(f"{len(jobs)} parts, {raw / 1e9:.3f} GB -> {stored_bytes / 1e9:.3f} GB at level {a.level} "
        f"(drawn in {drawn_s:.1f} s, encoded in {encode_s:.1f} s)")

    def cpu() -> None:
        for c, s in jobs:
            gdeflate.decompress_chunks(s, c.offsets, c.sizes, c.nbytes, c.chunk_bytes)

    t = median_s(cpu, a.repeats)
    results = [{"backend": "cpu", "threads": gdeflate.num_threads(), "seconds": round(t, 4),
                "decode_GBps": round(raw / t / 1e9, 3)}]
    problem = gdeflate.gpu_problem()
    if problem is None:
        on_gpu = [(c, torch.from_numpy(s).cuda()) for c, s in jobs]

        def gpu() -> None:
            for c, s in on_gpu:
                gdeflate.gpu_decompress_chunks(s, c.offsets, c.sizes, c.nbytes, c.chunk_bytes, device="cuda")
            torch.cuda.synchronize()

        t = median_s(gpu, a.repeats)
        results.append({"backend": "gpu", "seconds": round(t, 4), "decode_GBps": round(raw / t / 1e9, 3)})
        results.append({"backend": "gpu/cpu", "speedup": round(results[0]["seconds"] / t, 2)})
    else:
        results.append({"backend": "gpu", "skipped": problem})
    for r in results:
        log(str(r))
    emit({"bench": "gdeflate_decode", "machine": machine(),
          "config": {"shape": a.shape, "layers": a.layers, "level": a.level, "repeats": a.repeats,
                     "variant": "4-bit 2:4 group 128, random codes (bench/_synthetic.py)", "parts": len(jobs),
                     "decoded_bytes": raw, "stored_bytes": stored_bytes, "encode_s": round(encode_s, 2)},
          "results": results}, a.out, "gdeflate_decode.json")


if __name__ == "__main__":
    main()
