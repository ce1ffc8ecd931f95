"""The peer in bench/compress.py: llm-compressor's one-shot SparseGPT 2:4 + GPTQ on a FULL fine-tune.

    LLMC_PYTHON bench/_llmcompressor_run.py --model FT_DIR --windows W.pt --bits 4 --group-size 64 \\
        --out ART_DIR --dense DENSE.safetensors --result RESULT.json

Runs with the interpreter of a separate venv that has ``llmcompressor`` installed (it pins its own
transformers, which clashes with deltazip's venv), so it imports nothing from deltazip. The recipe is
the one llm-compressor documents for 2:4 sparse W4A16: ``SparseGPTModifier(sparsity=0.5,
mask_structure="2:4")`` on the decoder layers, then ``GPTQModifier`` on every Linear but ``lm_head``,
here with a symmetric int grid of ``--bits`` bits and ``--group-size`` columns per group (W4A16 /
W2A16-style); dampening 0.01 as deltazip's; llm-compressor's defaults otherwise.

Calibration uses exactly the windows bench/compress.py drew with deltazip's own sampler
(``--windows``: int64 ``[nsamples, seqlen]`` from ``torch.save``), passed as a DataLoader.

Writes:
- ``--out``: the compressed checkpoint as llm-compressor saves it (compressed-tensors); its bytes count.
- ``--dense``: that checkpoint loaded back (transformers + compressed-tensors, dequantized), every tensor
  the fine-tune's own checkpoint has, as safetensors: the bench loads them into the fine-tune's
  architecture and scores them with the same code as every other row.
- ``--result``: JSON with versions, seconds, peak RSS of the compression, the saved format and how many
  4-element groups of the decompressed linear weights (along the input dim) hold at least 2 zeros.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[bench/_llmcompressor_run] {msg}", file=sys.stderr, flush=True)


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def two_four_stats(model, layer_prefix: str = "model.layers.") -> dict:
    """Groups of 4 consecutive input columns, over every Linear in the decoder layers: how many hold
    at least 2 zeros (i.e. are 2:4 sparse), and the fraction of zero weights."""
    import torch

    groups = ok = zeros = numel = mods = mods_ok = 0
    worst = (1.0, None)
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or not name.startswith(layer_prefix):
            continue
        w = m.weight.detach()
        assert w.shape[1] % 4 == 0, f"{name}: input dim {w.shape[1]} is not a multiple of 4"
        z = (w.reshape(-1, 4) == 0).sum(dim=1)
        g, k = z.numel(), int((z >= 2).sum())
        groups, ok = groups + g, ok + k
        zeros, numel = zeros + int((w == 0).sum()), numel + w.numel()
        mods, mods_ok = mods + 1, mods_ok + (k == g)
        worst = min(worst, (k / g, name), key=lambda t: t[0])
    assert mods, f"no Linear under {layer_prefix!r}"
    return {"linear_modules": mods, "groups": groups, "groups_2of4": ok, "frac_groups_2of4": ok / groups,
            "modules_fully_2of4": mods_ok, "zero_fraction": zeros / numel,
            "worst_module": worst[1], "worst_module_frac_2of4": worst[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path, help="fine-tuned HF checkpoint directory")
    ap.add_argument("--windows", required=True, type=Path, help="torch.save'd int64 [nsamples, seqlen]")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sparsity", default="2:4", help="'2:4' or 'none' (GPTQ only)")
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward")
    ap.add_argument("--out", required=True, type=Path, help="directory for the compressed checkpoint")
    ap.add_argument("--dense", required=True, type=Path, help="safetensors file for the decompressed weights")
    ap.add_argument("--result", required=True, type=Path, help="JSON result file")
    a = ap.parse_args()

    import compressed_tensors
    import llmcompressor
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from safetensors import safe_open
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    windows = torch.load(a.windows)
    assert windows.dtype == torch.long and windows.dim() == 2, f"windows: want int64 [n, seqlen], got " \
        f"{windows.dtype} {tuple(windows.shape)}"
    rows = [{"input_ids": w, "attention_mask": torch.ones_like(w)} for w in windows]
    loader = DataLoader(rows, batch_size=a.batch_size, shuffle=False)

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype="auto")
    tok = AutoTokenizer.from_pretrained(a.model)
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": a.bits, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": a.group_size}}
    recipe = []
    if a.sparsity == "2:4":
        recipe.append(SparseGPTModifier(sparsity=0.5, mask_structure="2:4", targets=[r"re:model.layers.\d+$"],
                                        dampening_frac=a.damp))
    else:
        assert a.sparsity == "none", f"--sparsity: '2:4' or 'none', got {a.sparsity!r}"
    recipe.append(GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], dampening_frac=a.damp))
    log(f"oneshot on {a.model}: {len(windows)} windows x {windows.shape[1]} tokens, recipe {recipe}")
    t1 = time.time()
    oneshot(model=model, recipe=recipe, dataset=loader, num_calibration_samples=len(windows),
            max_seq_length=int(windows.shape[1]))
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    compress_s = time.time() - t1
    process_s = time.time() - t0
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    qcfg = json.loads((a.out / "config.json").read_text()).get("quantization_config", {})
    log(f"saved {a.out} ({_dir_bytes(a.out)} bytes, format {qcfg.get('format')}) in {compress_s:.0f}s")
    del model

    # Load the artifact back as a user would, dequantized, and export what the fine-tune has.
    from transformers import CompressedTensorsConfig

    t2 = time.time()
    back = AutoModelForCausalLM.from_pretrained(a.out, dtype="auto",
                                                quantization_config=CompressedTensorsConfig(dequantize=True))
    stats = two_four_stats(back)
    sd = back.state_dict()
    names = []
    for f in sorted(a.model.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            names += list(fh.keys())
    missing = [n for n in names if n not in sd]
    assert not missing, f"the reloaded llm-compressor model lacks {missing[:5]} (of {len(missing)})"
    save_file({n: sd[n].detach().contiguous() for n in names}, str(a.dense))
    load_s = time.time() - t2

    res = {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
           "transformers": __import__("transformers").__version__, "torch": torch.__version__,
           "artifact": str(a.out), "artifact_bytes": _dir_bytes(a.out),
           "weight_bytes": sum(f.stat().st_size for f in a.out.glob("*.safetensors")),
           "format": qcfg.get("format"), "quant_config": qcfg.get("config_groups"),
           "nsamples": len(windows), "seqlen": int(windows.shape[1]), "bits": a.bits, "group_size": a.group_size,
           "sparsity": a.sparsity, "compress_seconds": round(compress_s, 1),
           "process_seconds_to_save": round(process_s, 1), "peak_rss_mib": round(peak_rss_mib, 1),
           "load_back_seconds": round(load_s, 1), "dense_tensors": len(names), **stats}
    a.result.write_text(json.dumps(res, indent=1))
    log(f"result {res}")


if __name__ == "__main__":
    main()
