"""Lossless stage bench: GDeflate (levels, byte-grouping filter) vs zstd vs ZipNN on real artifacts.

    python bench/lossless.py [--quick] [--out DIR] [--pairs demo,smollm2] [--repeats N]

For each model pair it makes (or reuses, cached under ~/.cache/deltazip-bench/lossless) a 2-bit and
a 4-bit ΔCompress artifact, then runs every codec on the same bytes: each stored part of each
tensor, compressed on its own (what the artifact writer does), grouped by part class (qweight,
positions, scales, zeros, dense_delta, full) and in total. GDeflate runs chunked (64 KiB) on all CPU
threads; zstd compresses whole parts (multi-threaded compression, single-threaded decompression, as
the library offers); ZipNN uses its own byte grouping and threads. Each time is the median of
``--repeats`` runs; MB/s are of uncompressed bytes. Then the artifact as a whole: bytes and the time
to load every tensor, without and with the lossless stage; GPU decode GB/s when CUDA is present.

The SmolLM2 pair is slow to build the first time: it is used when its cache exists or when
``--pairs smollm2`` asks for it. Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, SMOLLM2_RECIPE, _key, demo_pair, smollm2_pair  # noqa: E402

from deltazip.formats import gdeflate  # noqa: E402
from deltazip.formats.chunked import _group, _ungroup, chunk_offsets, tensor_u8  # noqa: E402

COMPRESS_REPEATS = 3  # lowered to 1 by --quick


def log(msg: str) -> None:
    print(f"[bench/lossless] {msg}", file=sys.stderr, flush=True)


def machine() -> dict:
    import importlib.metadata as md

    def ver(p):
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "threads": gdeflate.num_threads(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "nvcomp": ver("nvidia-libnvcomp-cu12"),
            "zstandard": ver("zstandard"), "zipnn": ver("zipnn"),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def make_artifact(pair: dict, bits: int, quick: bool) -> Path:
    """A ΔCompress artifact of ``pair`` at ``bits`` (2:4), cached; no lossless stage."""
    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.kernels.scheme import DeltaScheme

    nsamples, seqlen = (16, 64) if quick else (64, 128)
    d = CACHE / "lossless" / f"{pair['name']}-{_key(pair)}-{bits}bit-{nsamples}x{seqlen}"
    if (d / "manifest.json").is_file():
        return d
    log(f"compressing {pair['name']} at {bits} bits -> {d}")
    cfg = CompressConfig(scheme=DeltaScheme(bits=bits, group_size=pair["group_size"]),
                         nsamples=nsamples, seqlen=seqlen, device="cpu")
    compress_delta(pair["base"], pair["finetuned"], pair["calib"], d, cfg, overwrite=True)
    return d


def part_classes(art) -> dict[str, list[torch.Tensor]]:
    """Every stored part of the artifact, by class (raw tensors as the writer would compress them)."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, e in art.tensors.items():
        if e["kind"] in ("same", "alias"):
            continue
        for part, t in art.parts(name).items():
            cls = part if e["kind"] == "packed" else e["kind"]
            out.setdefault(cls, []).append(t)
    return out


def median_time(fn, repeats: int):
    times, res = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), res


# -- codecs: compress(list of tensors) -> list of blobs; decompress(blobs) -> list of raw uint8 arrays ----------

def gdeflate_codec(level: int, filt: str):
    def comp(ts):
        out = []
        for t in ts:
            raw = tensor_u8(t)
            w = t.element_size()
            data = _group(raw, w) if filt == "bytegroup" and w > 1 and raw.size else raw
            blobs, sizes = gdeflate.compress_chunks(data, level)
            out.append((b"".join(blobs), sizes, raw.size, w))
        return out

    def decomp(blobs):
        res = []
        for blob, sizes, n, w in blobs:
            o = gdeflate.decompress_chunks(blob, chunk_offsets(sizes, 1), sizes, n)
            res.append(_ungroup(o, w) if filt == "bytegroup" and w > 1 and n else o)
        return res

    return comp, decomp, lambda b: len(b[0])


def zstd_codec(level: int):
    import zstandard

    threads = gdeflate.num_threads()
    c = zstandard.ZstdCompressor(level=level, threads=threads if threads > 1 else 0)
    d = zstandard.ZstdDecompressor()

    def comp(ts):
        return [(c.compress(tensor_u8(t).tobytes()), tensor_u8(t).size) for t in ts]

    def decomp(blobs):
        return [np.frombuffer(d.decompress(b, max_output_size=n), dtype=np.uint8) for b, n in blobs]

    return comp, decomp, lambda b: len(b[0])


def zipnn_codec():
    import zipnn

    threads = gdeflate.num_threads()
    # ZipNN's byte mode groups bytes by the float width it is told; int32 codes are grouped as 4-byte
    # words and uint8 zero points as 2-byte ones (the best fit it offers).
    widths = {1: "float16", 2: "float16", 4: "float32"}

    def zn(t):
        return zipnn.ZipNN(method="zstd", input_format="byte", bytearray_dtype=widths[t.element_size()],
                           threads=threads)

    def comp(ts):
        out = []
        for t in ts:
            raw = tensor_u8(t).tobytes()
            z = zn(t)
            out.append((bytes(z.compress(raw)), z, raw))
        return out

    def decomp(blobs):
        return [np.frombuffer(bytes(z.decompress(b)), dtype=np.uint8) for b, z, _ in blobs]

    return comp, decomp, lambda b: len(b[0])


def run_codec(label: dict, codec, ts: list[torch.Tensor], repeats: int) -> dict:
    """One codec on one class of parts; compression is timed over COMPRESS_REPEATS runs, decoding over
    ``repeats`` (decoding is the figure that matters for loading; compression runs once per artifact)."""
    comp, decomp, size = codec
    raw = [tensor_u8(t) for t in ts]
    nbytes = sum(r.size for r in raw)
    tc, blobs = median_time(lambda: comp(ts), min(repeats, COMPRESS_REPEATS))
    td, outs = median_time(lambda: decomp(blobs), repeats)
    ok = all(np.array_equal(o, r) for o, r in zip(outs, raw))
    stored = sum(size(b) for b in blobs)
    return {**label, "raw_bytes": nbytes, "stored_bytes": stored, "ratio": round(nbytes / stored, 4) if stored else None,
            "compress_MBps": round(nbytes / tc / 1e6, 1), "decompress_MBps": round(nbytes / td / 1e6, 1),
            "compress_s": round(tc, 6), "decompress_s": round(td, 6), "roundtrip_ok": ok}


def gpu_decode(art_dir: Path, repeats: int) -> dict | None:
    """GB/s of nvCOMP decoding every lossless part of an artifact (decoded bytes / time)."""
    if gdeflate.gpu_problem() is not None:  # no device, or no nvCOMP GPU module for torch's CUDA
        return None
    from safetensors import safe_open

    from deltazip.formats.chunked import Container

    m = json.loads((art_dir / "manifest.json").read_text())
    jobs = []
    for name, e in m["tensors"].items():
        for part, meta in (e.get("lossless") or {}).items():
            with safe_open(str(art_dir / e["file"]), framework="pt") as h:
                stored = h.get_tensor(f"{name}::{part}.gdeflate").cuda()
            jobs.append((Container.from_json(meta), stored))
    if not jobs:
        return None

    def run():
        for c, s in jobs:
            gdeflate.gpu_decompress_chunks(s, c.offsets, c.sizes, c.nbytes, c.chunk_bytes, device="cuda")
        torch.cuda.synchronize()

    run()
    t, _ = median_time(run, repeats)
    n = sum(c.nbytes for c, _ in jobs)
    return {"decoded_bytes": n, "gpu_decode_GBps": round(n / t / 1e9, 2), "device": torch.cuda.get_device_name(0)}


def load_all(art_dir: Path) -> float:
    from deltazip.formats.artifact import Artifact

    t0 = time.perf_counter()
    a = Artifact(art_dir)
    for n in a.tensors:
        a.parts(n)
    return time.perf_counter() - t0


def bench_artifact(pair: dict, bits: int, art_dir: Path, levels, repeats: int, work: Path) -> list[dict]:
    from deltazip.formats.artifact import Artifact, repack

    art = Artifact(art_dir)
    classes = part_classes(art)
    rows = []
    base = {"pair": pair["name"], "bits": bits}
    for cls, ts in classes.items():
        lab = {**base, "kind": "codec", "part": cls}
        for level in levels:
            for filt in ("none", "bytegroup"):
                if filt == "bytegroup" and all(t.element_size() == 1 for t in ts):
                    continue
                rows.append(run_codec({**lab, "codec": "gdeflate", "level": level, "filter": filt},
                                      gdeflate_codec(level, filt), ts, repeats))
        for zl in (3, 19):
            rows.append(run_codec({**lab, "codec": "zstd", "level": zl, "filter": "none"}, zstd_codec(zl), ts, repeats))
        rows.append(run_codec({**lab, "codec": "zipnn", "level": 3, "filter": "zipnn-bytegroup"}, zipnn_codec(), ts,
                              repeats))
        best = max((r for r in rows if r["part"] == cls), key=lambda r: r["ratio"] or 0)
        log(f"{pair['name']} {bits}-bit {cls}: {sum(t.numel() * t.element_size() for t in ts)} bytes, best ratio "
            f"{best['ratio']} ({best['codec']} {best['level']} {best['filter']})")
    # Every part is compressed on its own, so the whole artifact's figures are sums over the classes.
    # "auto" is the writer's policy: bytegroup for float parts, none for integer parts.
    float_cls = {c for c, ts in classes.items() if ts[0].dtype.is_floating_point and ts[0].element_size() > 1}
    combos = {(r["codec"], r["level"], r["filter"]) for r in rows if r["part"] in classes}
    combos |= {("gdeflate", lv, "auto") for lv in levels}
    for codec, level, filt in sorted(combos, key=str):
        picked = []
        for cls in classes:
            f = ("bytegroup" if cls in float_cls else "none") if filt == "auto" else filt
            f = "none" if f == "bytegroup" and cls not in float_cls and all(t.element_size() == 1 for t in classes[cls]) else f
            r = next((r for r in rows if r["part"] == cls and (r["codec"], r["level"], r["filter"]) == (codec, level, f)),
                     None)
            if r is None:
                break
            picked.append(r)
        else:
            raw, stored = sum(r["raw_bytes"] for r in picked), sum(r["stored_bytes"] for r in picked)
            tc, td = sum(r["compress_s"] for r in picked), sum(r["decompress_s"] for r in picked)
            rows.append({**base, "kind": "codec", "part": "all", "codec": codec, "level": level, "filter": filt,
                         "raw_bytes": raw, "stored_bytes": stored, "ratio": round(raw / stored, 4),
                         "compress_MBps": round(raw / tc / 1e6, 1), "decompress_MBps": round(raw / td / 1e6, 1),
                         "compress_s": round(tc, 6), "decompress_s": round(td, 6),
                         "roundtrip_ok": all(r["roundtrip_ok"] for r in picked)})
    # The artifact as a whole, with the writer's own policy (MIN_SAVING, chunk tables in the manifest).
    plain_t, _ = median_time(lambda: load_all(art_dir), repeats)
    rows.append({**base, "kind": "artifact", "lossless": "none", "level": None, "bytes": art.nbytes(),
                 "ratio_vs_finetuned": round(art.lineage["finetuned_bytes"] / art.nbytes(), 3),
                 "load_all_seconds": round(plain_t, 4)})
    for level in levels:
        dst = work / f"{pair['name']}-{bits}bit-gdeflate{level}"
        t0 = time.perf_counter()
        r = repack(art_dir, dst, lossless="gdeflate", level=level, overwrite=True)
        pack_s = time.perf_counter() - t0
        lt, _ = median_time(lambda dst=dst: load_all(dst), repeats)
        row = {**base, "kind": "artifact", "lossless": "gdeflate", "level": level, "bytes": r["bytes_after"],
               "ratio_vs_finetuned": round(art.lineage["finetuned_bytes"] / r["bytes_after"], 3),
               "saving": round(1 - r["bytes_after"] / r["bytes_before"], 4), "lossless_parts": r["lossless_parts"],
               "pack_seconds": round(pack_s, 3), "load_all_seconds": round(lt, 4)}
        g = gpu_decode(dst, repeats)
        if g:
            row.update(g)
        rows.append(row)
        log(f"{pair['name']} {bits}-bit artifact: {row}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="demo pair only (unless asked), fewer levels and repeats")
    ap.add_argument("--out", type=Path, default=None, help="directory for the packed artifacts (default: temporary)")
    ap.add_argument("--pairs", default=None, help="comma list of: demo, smollm2 (default: demo, plus smollm2 when "
                                                   "its cache exists)")
    ap.add_argument("--repeats", type=int, default=None, help="timing repeats (median); default 3 quick, 5 full")
    a = ap.parse_args()
    smol_cached = (CACHE / f"smollm2-{_key(SMOLLM2_RECIPE)}" / "pair.json").is_file()
    pairs = a.pairs.split(",") if a.pairs else (["demo", "smollm2"] if smol_cached else ["demo"])
    repeats = a.repeats or (3 if a.quick else 5)
    global COMPRESS_REPEATS
    COMPRESS_REPEATS = 1 if a.quick else 3
    levels = (1, 6, 9, 12) if not a.quick else (1, 9, 12)
    import tempfile

    results = []
    with tempfile.TemporaryDirectory(prefix="deltazip-lossless-") as tmp:
        work = a.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in pairs:
            log(f"building/loading pair {name}")
            pair = demo_pair() if name == "demo" else smollm2_pair(log=log)
            for bits in (2, 4):
                results += bench_artifact(pair, bits, make_artifact(pair, bits, a.quick), levels, repeats, work)
    doc = {"bench": "lossless", "machine": machine(),
           "config": {"quick": a.quick, "pairs": pairs, "bits": [2, 4], "gdeflate_levels": list(levels),
                      "chunk_bytes": gdeflate.PAGE_BYTES, "repeats": repeats,
                      "compress_repeats": COMPRESS_REPEATS, "zstd_levels": [3, 19],
                      "threads": gdeflate.num_threads(), "timing": "median of repeats; MB/s of uncompressed bytes"},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
