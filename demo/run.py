"""``deltazip demo``: build a model pair on the spot, compress its delta, prove quality holds.

Rows: base, fine-tuned, ΔCompress at 4 and 2 bits (2:4), at the same 2-bit 2:4 budget the RTN
(delta, no calibration) and SparseGPT (full weights) baselines, and ΔCompress asked for a size instead
of a bit width (``--target-ratio 10``: per-tensor settings), each with size, ratio, answer loss
(cross-entropy of the held-out answers given their prompts), task accuracy and time. The answer
loss is where the methods differ even when they all answer right.

The models are tiny: torch runs on one thread here (``threads``), which on a small shared CPU is as
fast as two and costs half the CPU time (the CLI also makes OpenMP's idle threads sleep rather than
spin, which on busy cores was a tenfold slowdown).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deltazip.compress.config import CompressConfig
from deltazip.compress.merge import load_merged_model
from deltazip.compress.pipeline import compress_delta
from deltazip.demo.pair import make_demo_pair
from deltazip.formats.artifact import Artifact
from deltazip.formats.errors import DeltazipWarning
from deltazip.kernels.scheme import DeltaScheme
from deltazip.models.checkpoint import Checkpoint
from deltazip.runtime.eval.generated_tasks import answer_loss, exact_match_accuracy, heldout_loss

ALL_WINDOWS = 1 << 20
"""``--nsamples`` that compress caps at the windows the calibration data holds side by side."""

# (row name, method, bits, target ratio or None): the variants the demo compresses.
VARIANTS = (
    ("deltazip 4-bit 2:4", "deltazip", 4, None),
    ("deltazip 2-bit 2:4", "deltazip", 2, None),
    ("rtn 2-bit 2:4", "rtn", 2, None),
    ("sparsegpt 2-bit 2:4", "sparsegpt", 2, None),
    ("deltazip --target-ratio 10", "deltazip", 4, 10.0),
)


def _evaluate(model, tok, eval_rows: list[dict]) -> dict:
    examples = [(r["prompt"], r["answer"]) for r in eval_rows]
    max_new = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in examples) + 2
    return {"answer_loss": answer_loss(model, tok, examples),
            "heldout_loss": heldout_loss(model, tok, [r["text"] for r in eval_rows]),
            "accuracy": exact_match_accuracy(model, tok, examples, max_new_tokens=max_new)}


def run_demo(workdir: str | Path, seed: int = 0, nsamples: int = 0, progress: Callable | None = None,
             threads: int | None = 1) -> dict:
    """Run the whole demo in ``workdir``; returns ``{"pair": ..., "rows": [...]}``.

    Args:
        nsamples: calibration windows of 64 tokens; 0: every window the calibration data holds.
        threads: torch intra-op threads for the run (restored after); None keeps torch's setting.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_demo(Path(workdir), seed, nsamples, progress or (lambda *a: None))
    finally:
        torch.set_num_threads(previous)


def _run_demo(workdir: Path, seed: int, nsamples: int, progress: Callable) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    t0 = time.time()
    pair = make_demo_pair(workdir, seed=seed, progress=progress)
    build_s = time.time() - t0
    tok = AutoTokenizer.from_pretrained(pair.finetuned_dir)
    eval_rows = [json.loads(line) for line in Path(pair.eval_path).read_text().splitlines() if line.strip()]
    ft_bytes = Checkpoint(pair.finetuned_dir).nbytes()
    rows = []
    for label, path in (("base", pair.base_dir), ("fine-tuned", pair.finetuned_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rows.append({"model": label, "bytes": Checkpoint(path).nbytes(), "ratio": None, **_evaluate(model, tok, eval_rows),
                     "seconds": round(build_s, 2) if label == "fine-tuned" else None})
    base = Checkpoint(pair.base_dir, "base")
    progress("compressing variants", 0, len(VARIANTS))
    for i, (label, method, bits, target) in enumerate(VARIANTS):
        out = workdir / "artifacts" / label.replace("--", "").replace(" ", "-").replace(":", "")
        cfg = CompressConfig(scheme=DeltaScheme(bits=bits, group_size=128), method=method, target_ratio=target,
                             nsamples=nsamples or ALL_WINDOWS, seqlen=64, seed=seed, device="cpu")
        t = time.time()
        with warnings.catch_warnings():
            if not nsamples:  # all the windows the data holds, as asked: no line saying they were capped
                warnings.filterwarnings("ignore", message="calibrating on", category=DeltazipWarning)
            summary = compress_delta(pair.base_dir, pair.finetuned_dir, str(pair.calib_path), out, cfg,
                                     overwrite=True, progress=lambda desc, done, total, label=label:
                                     progress(f"{label}: {desc}", done, total))
        secs = time.time() - t
        model = load_merged_model(Artifact(out), base)
        rows.append({"model": label, "bytes": summary["artifact_bytes"], "ratio": ft_bytes / summary["artifact_bytes"],
                     **_evaluate(model, tok, eval_rows), "seconds": round(secs, 2), "artifact": str(out)})
        progress("compressing variants", i + 1, len(VARIANTS))
    return {"workdir": str(workdir), "task": pair.task_name, "pair": {"base": str(pair.base_dir),
            "finetuned": str(pair.finetuned_dir), "calib": str(pair.calib_path), "eval": str(pair.eval_path),
            "info": pair.info}, "finetuned_bytes": ft_bytes, "rows": rows,
            "seconds": round(time.time() - t0, 2)}
