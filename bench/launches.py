"""Ops and SBMM launches per decode step, one ``DeltaLinear`` per projection against merged groups.

    python bench/launches.py [--hidden 128] [--intermediate 256] [--heads 2] [--kv-heads 1]
                             [--rows 4] [--slots 3] [--out DIR]

Builds a Llama model from a transformers config in code (random weights, nothing downloaded),
decouples every linear of its layers (``DeltaLinear``), fills ``--slots`` slots with random 4-bit 2:4
deltas and runs one decode step (``--rows`` rows, one token each, every row on a slot) under the torch
profiler. Four settings: deltas ``dequantized`` (what a CPU server runs) or ``packed`` (SBMM: the CUDA
kernel on a GPU; without CUDA the reference over the kernel's layout, forced), each with one ``DeltaLinear``
per projection (``per_linear``) or with q/k/v and gate/up merged (``merged``,
``deltazip.runtime.serve.projections``). Per setting and per layer (the difference between a 2-layer
and a 1-layer model, so embeddings, final norm and lm_head drop out):

- ``top_level_ops``: aten ops dispatched from Python (on a GPU each is one kernel launch or more);
  without CUDA the packed setting's count includes the reference's own ops;
- ``gemms``: ``aten::linear`` calls;
- ``sbmm``: ``dispatch.sbmm`` calls by path (``dispatch.CALLS``; one kernel launch each).

Prints ONE JSON document; with ``--out`` also writes ``DIR/launches.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pairs import emit  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench/launches] {msg}", file=sys.stderr, flush=True)


def random_delta(out_f: int, in_f: int, gen: torch.Generator, bits: int = 4, group: int = 64):
    """A random 4-bit 2:4 symmetric packed delta ``[out_f, in_f]``."""
    from deltazip.formats.packing import pack_delta

    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=gen)
    scales = (torch.rand(out_f, in_f // group, generator=gen) * 0.002 + 0.0005).half()
    keep = torch.rand(out_f, in_f // 4, 4, generator=gen).argsort(-1)[..., :2]
    mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(out_f, in_f)
    return pack_delta(codes, scales, None, mask, bits, group)


def build(*, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, slots: int,
          dequantize: bool, merge: bool, dtype=torch.float32, device="cpu", seed: int = 0):
    """``(model, ctx)``: a Llama with every layer linear decoupled and ``slots`` slots filled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltazip.runtime.serve.delta_linear import DeltaContext, DeltaLinear
    from deltazip.runtime.serve.projections import merge_projections

    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=intermediate,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
                                  vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    ctx = DeltaContext(slots, dequantize=dequantize)
    modules = {}
    for name, mod in list(model.model.layers.named_modules()):
        if isinstance(mod, torch.nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.model.layers.get_submodule(parent_name)
            setattr(parent, child, DeltaLinear(mod, ctx))
            modules[name] = getattr(parent, child)
    if merge:
        merge_projections(model, modules, ctx)
    gen = torch.Generator().manual_seed(seed + 1)
    for name in sorted(modules):
        lin = modules[name]
        for s in range(slots):
            lin.load_slot(s, packed=random_delta(lin.out_features, lin.in_features, gen))
    return model, ctx


def count_step(model, ctx, rows: int, slots: int) -> dict:
    """Top-level aten ops, ``aten::linear`` calls and SBMM calls of one decode step (``rows`` rows)."""
    from torch.profiler import ProfilerActivity, profile

    from deltazip.kernels import dispatch

    device = next(model.parameters()).device
    ids = torch.arange(rows, device=device).remainder(60).unsqueeze(1) + 3
    row_slots = [r % slots for r in range(rows)]
    with torch.no_grad():
        ctx.bind(row_slots, device)
        model(input_ids=ids, use_cache=False)  # warm: compiles, plans
        ctx.bind(row_slots, device)
        dispatch.CALLS.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits = model(input_ids=ids, use_cache=False).logits
        calls = dict(dispatch.CALLS)
        ctx.unbind()
    events = prof.events()
    top = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    return {"top_level_ops": len(top), "gemms": sum(e.name == "aten::linear" for e in events),
            "sbmm": calls, "logits": logits}


def per_layer(setting: dict, args) -> dict:
    """Counts of the 2-layer model minus the 1-layer model's (one layer's worth), and the logits."""
    got = {}
    for layers in (1, 2):
        model, ctx = build(layers=layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                           kv_heads=args.kv_heads, slots=args.slots, **setting)
        got[layers] = count_step(model, ctx, args.rows, args.slots)
    one, two = got[1], got[2]
    paths = set(one["sbmm"]) | set(two["sbmm"])
    return {"top_level_ops": two["top_level_ops"] - one["top_level_ops"], "gemms": two["gemms"] - one["gemms"],
            "sbmm": {p: two["sbmm"].get(p, 0) - one["sbmm"].get(p, 0) for p in sorted(paths)},
            "logits": two["logits"]}


def run(args) -> dict:
    results = []
    for compute in ("dequantized", "packed"):
        if compute == "packed" and not torch.cuda.is_available():
            os.environ["DELTAZIP_SBMM_LAYOUT"] = "mma"
        logits = {}
        for merge in (False, True):
            r = per_layer({"dequantize": compute == "dequantized", "merge": merge}, args)
            logits[merge] = r.pop("logits")
            results.append({"compute": compute, "projections": "merged" if merge else "per_linear", "per_layer": r})
            log(f"{compute:11s} {'merged' if merge else 'per_linear':10s} {r}")
        diff = (logits[True].float() - logits[False].float()).abs().max().item()
        results.append({"compute": compute, "max_abs_logit_diff_merged_vs_per_linear": diff})
    return {"bench": "launches", "machine": {"platform": platform.platform(), "torch": torch.__version__,
                                             "cuda": torch.cuda.is_available()},
            "config": vars(args), "results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true",
                    help="accepted for the bench convention: the default configuration already runs in seconds")
    args = ap.parse_args(argv)
    doc = run(args)
    doc["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in doc["config"].items()}
    emit(doc, args.out, "launches.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
