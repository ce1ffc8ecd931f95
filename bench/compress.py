"""Compression bench: ΔCompress vs SparseGPT (full weights) vs RTN (delta) on real model pairs.

    python bench/compress.py [--quick] [--out DIR] [--pairs demo,smollm2]

For each pair and method it runs the real CLI (`deltazip compress --json`) in a fresh process, so
time and peak RSS are those of one compression, then rebuilds the model (base + artifact) and
scores held-out loss and exact-match task accuracy beside the base and the uncompressed fine-tune.
Prints one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import demo_pair, machine, smollm2_pair  # noqa: E402

# (label, extra CLI args)
METHODS = (
    ("deltazip 4-bit 2:4", ["--method", "deltazip", "--bits", "4"]),
    ("deltazip 2-bit 2:4", ["--method", "deltazip", "--bits", "2"]),
    ("deltazip 4-bit 2:4, base activations (ablation)", ["--method", "deltazip", "--bits", "4",
                                                          "--calib-activations", "base"]),
    ("sparsegpt 4-bit 2:4", ["--method", "sparsegpt", "--bits", "4"]),
    ("rtn 4-bit 2:4", ["--method", "rtn", "--bits", "4"]),
)


def log(msg: str) -> None:
    print(f"[bench/compress] {msg}", file=sys.stderr, flush=True)


def score(model_dir_or_model, tok, eval_rows: list[dict]) -> dict:
    from transformers import AutoModelForCausalLM

    from deltazip.runtime.tasks import exact_match_accuracy, heldout_loss

    model = model_dir_or_model
    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ex = [(r["prompt"], r["answer"]) for r in eval_rows]
    max_new = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in ex) + 2
    return {"heldout_loss": round(heldout_loss(model, tok, [r["text"] for r in eval_rows]), 4),
            "accuracy": round(exact_match_accuracy(model, tok, ex, max_new_tokens=max_new), 4)}


def bench_pair(pair: dict, quick: bool, workdir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from deltazip.compress.checkpoint import Checkpoint
    from deltazip.compress.merge import load_merged_model
    from deltazip.formats.artifact import Artifact

    tok = AutoTokenizer.from_pretrained(pair["finetuned"])
    rows = [json.loads(x) for x in Path(pair["eval"]).read_text().splitlines() if x.strip()]
    if quick:
        rows = rows[:64]
    ft_bytes = Checkpoint(pair["finetuned"]).nbytes()
    out = []
    for label in ("base", "finetuned"):
        out.append({"pair": pair["name"], "model": label, "bytes": ft_bytes, **score(pair[label], tok, rows)})
        log(f"{pair['name']} {label}: {out[-1]}")
    nsamples, seqlen = (32, 64) if quick else (128, 128)
    base = Checkpoint(pair["base"])
    for label, args in METHODS:
        art = workdir / f"{pair['name']}-{len(out)}"
        cmd = [sys.executable, "-m", "deltazip.deltacli.app", "compress", "--base", pair["base"], "--finetuned",
               pair["finetuned"], "--calib", pair["calib"], "--out", str(art), "--group-size",
               str(pair["group_size"]), "--nsamples", str(nsamples), "--seqlen", str(seqlen), "--device", "cpu",
               "--json", *args]
        t = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.time() - t
        if r.returncode != 0:
            raise SystemExit(f"compress failed for {label}: {r.stderr.strip()}")
        s = json.loads(r.stdout)
        q = score(load_merged_model(Artifact(art), base), tok, rows)
        out.append({"pair": pair["name"], "model": label, "bytes": s["artifact_bytes"],
                    "ratio": round(s["ratio"], 3), "linear_ratio": round(s["linear_ratio"], 3),
                    "compress_seconds": s["stats"]["seconds"], "process_wall_seconds": round(wall, 1),
                    "peak_rss_mib": s["stats"]["peak_rss_mib"],
                    "mean_layer_rel_out_err": round(sum(L["rel_out_err"] or 0 for L in s["layers"])
                                                    / max(1, len(s["layers"])), 5), **q})
        log(f"{pair['name']} {label}: {out[-1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calibration samples and eval examples")
    ap.add_argument("--out", type=Path, default=None, help="directory for artifacts (default: temporary)")
    ap.add_argument("--pairs", default="demo,smollm2", help="comma list of: demo, smollm2")
    a = ap.parse_args()
    pairs = a.pairs.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="deltazip-bench-") as tmp:
        work = a.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in pairs:
            log(f"building/loading pair {name}")
            pair = demo_pair() if name == "demo" else smollm2_pair(log=log)
            results += bench_pair(pair, a.quick, work)
    doc = {"bench": "compress", "machine": machine(),
           "config": {"quick": a.quick, "pairs": pairs, "methods": [m for m, _ in METHODS],
                      "nsamples_seqlen": [32, 64] if a.quick else [128, 128]},
           "results": results}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
