"""Benchmark: bytes the serving runtime's tensor dedup saves on a realistic set of full checkpoints.

    python bench/serve_dedup.py [--quick] [--out DIR]

The set (seed 000's use case, no compression step): the SmolLM2-135M pair of ``bench/_pairs.py``
(base + full fine-tune ``ft``), an identical copy of the base (``copy``), an A/B copy of the
fine-tune (``ft-ab``), and the fine-tune with its embeddings reset to the base's (``frozen-emb``, a
fine-tune with frozen embeddings). Files are hard links into the cached pair where possible, under
``~/.cache/deltazip-bench/serve-dedup``.

Builds ``deltazip serve``'s runtime (delta mode, CPU, fp32), loads every variant into the host tier
and reports, side by side: the bytes independent whole models would take, the bytes the runtime
holds (base + registry), its dedup ledger (same as base / shared between variants), and the
process RSS growth (``--quick`` changes nothing: the set is small enough). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def link_dir(src: Path, dst: Path) -> None:
    """``dst`` with every file of ``src`` hard-linked (copied where links are not possible)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (dst / f.name).exists():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)


def build_set(pair: dict, root: Path) -> Path:
    from safetensors.torch import load_file, save_file

    arts = root / "variants"
    if (root / "done.json").is_file():
        return arts
    base, ft = Path(pair["base"]), Path(pair["finetuned"])
    link_dir(ft, arts / "ft")
    link_dir(ft, arts / "ft-ab")
    link_dir(base, arts / "copy")
    frozen = arts / "frozen-emb"
    frozen.mkdir(parents=True, exist_ok=True)
    for f in ft.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, frozen / f.name)
    base_sd = load_file(next(base.glob("*.safetensors")))
    for f in ft.glob("*.safetensors"):
        sd = load_file(f)
        for name in sd:
            if "embed_tokens" in name:
                sd[name] = base_sd[name]
        save_file(sd, frozen / f.name, metadata={"format": "pt"})
    (root / "done.json").write_text(json.dumps({"built": time.time()}))
    return arts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from _pairs import CACHE, smollm2_pair

    from deltazip.runtime.serve.assembly import ServeConfig, build_runtime

    pair = smollm2_pair(log=lambda *a: print(*a, file=sys.stderr))
    arts = build_set(pair, CACHE / "serve-dedup")
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    rt = build_runtime(ServeConfig(artifacts=arts, base=pair["base"], max_deltas=4, max_cpu_deltas=8, dtype="float32",
                                   device="cpu"))
    names = [v.name for v in rt.variants]
    for n in names:
        rt.engine.cache.host_get(n)
    seconds = time.perf_counter() - t0
    backend = rt.backend
    base_bytes = backend.base_bytes()
    per = backend.ledger.snapshot()
    # fp32 bytes of each variant as a whole model (what an independent server would hold)
    sizes = {v.name: sum(math.prod(t["shape"]) * 4 for t in v.tensors.values()) for v in rt.variants}
    independent = base_bytes + sum(sizes.values())
    held = backend.registry.held_bytes()
    results = [
        {"candidate": "independent whole models", "weight_bytes": independent},
        {"candidate": "deltazip serve (dedup registry)", "weight_bytes": held,
         "bytes_saved": backend.ledger.bytes_saved(),
         "ratio_vs_independent": round(independent / held, 3),
         "rss_growth_bytes": rss_bytes() - rss0, "build_and_load_seconds": round(seconds, 2),
         "per_variant": {n: {"same_as_base": d.same_as_base, "shared": d.shared, "added": d.added,
                             "model_bytes": sizes[n]} for n, d in sorted(per.items())}},
    ]
    rt.engine.cache.shutdown()
    doc = {"bench": "serve_dedup",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "config": {"base": pair["base"], "variants": names, "dtype": "float32", "mode": "delta",
                      "quick": args.quick},
           "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve_dedup.json").write_text(text)


if __name__ == "__main__":
    main()
