"""Compression bench: ΔCompress vs llm-compressor (full weights) vs SparseGPT / RTN on real model pairs.

    python bench/compress.py [--quick] [--out DIR] [--pairs demo,smollm2] [--llmcompressor-python PATH]
                             [--methods SUBSTRING,...] [--calib-sizes 8x32,32x64,128x128]

Pairs (bench/_pairs.py): ``demo``, ``smollm2`` (a realistic fine-tune stored in bf16, the default) and
``smollm2-fp32`` (the earlier short fp32 fine-tune, an extra).

For each pair and method it runs the real CLI (`deltazip compress --json`) in a fresh process, so
time and peak RSS are those of one compression, then rebuilds the model (base + artifact) and
scores held-out loss and exact-match task accuracy beside the base and the uncompressed fine-tune.

The peer is llm-compressor, what a user would pick instead: its one-shot SparseGPT 2:4 + GPTQ on the
FULL fine-tune (W4A16 / W2A16-style with 2:4), same calibration windows (drawn by deltazip's own
sampler from the pair's calib.jsonl), same bits and group size. It pins its own transformers, so it
runs in a separate venv (default ``~/.cache/deltazip-bench/llmc-venv``, made with
``python3 -m venv``; ``pip install torch==2.13.0 llmcompressor``) through bench/_llmcompressor_run.py;
its saved checkpoint is loaded back there, dequantized, and scored here by the same code as every
other row. Without that venv its rows say ``skipped`` and why.

Every row reports ``ratio`` = bytes of the fine-tune in its stored dtype (``ratio_vs``) / bytes of the
whole artifact directory, ``recovery_pct`` = accuracy / the fine-tune's accuracy, ``heldout_ppl`` =
exp(held-out loss) and ``delta_ppl`` = its distance above the fine-tune's (held-out loss is over the
full texts, whose prompt digits are random: ``answer_loss``, the loss of the answer tokens given the
prompt, and ``delta_answer_loss`` measure what the fine-tune learned). Prints one JSON document on
stdout; progress and a summary table go to stderr.

``--calib-sizes NxL,...`` runs every chosen method once per calibration size (``--nsamples N --seqlen
L``; the default is 32x64 with ``--quick``, else 128x128), each row labelled with its size and
recording the windows the data held (``calib_windows`` x ``calib_seqlen``): the sizing table of
docs/compress.md. ``--render JSON [--no-times]`` prints a saved run's tables (without the time and
memory columns with ``--no-times``).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _pairs import CACHE, PAIR_NAMES, get_pair, machine, read_eval_rows, score_model, tree_shim  # noqa: E402

LLMC_PYTHON = CACHE / "llmc-venv" / "bin" / "python"
LLMC_SCRIPT = HERE / "_llmcompressor_run.py"
# (label, runner, args): runner "cli" = `deltazip compress` with these extra args; "llmcompressor" =
# bench/_llmcompressor_run.py with these extra args. The deltazip 4-bit and 2-bit rows come first.
METHODS = (
    ("deltazip 4-bit 2:4", "cli", ["--method", "deltazip", "--bits", "4"]),
    ("deltazip 2-bit 2:4", "cli", ["--method", "deltazip", "--bits", "2"]),
    ("llm-compressor 4-bit 2:4 (full weights)", "llmcompressor", ["--bits", "4", "--sparsity", "2:4"]),
    ("llm-compressor 2-bit 2:4 (full weights)", "llmcompressor", ["--bits", "2", "--sparsity", "2:4"]),
    ("deltazip 4-bit 2:4, base activations (ablation)", "cli", ["--method", "deltazip", "--bits", "4",
                                                                 "--calib-activations", "base"]),
    ("sparsegpt 4-bit 2:4", "cli", ["--method", "sparsegpt", "--bits", "4"]),
    ("rtn 4-bit 2:4", "cli", ["--method", "rtn", "--bits", "4"]),
    ("deltazip 2-bit 2:4, no lossless stage", "cli", ["--method", "deltazip", "--bits", "2", "--lossless", "none"]),
    # The Pareto table (issue 26): uniform 2/3/4-bit 2:4 against per-tensor settings under a byte budget.
    ("deltazip 3-bit 2:4", "cli", ["--method", "deltazip", "--bits", "3"]),
    *((f"deltazip --target-ratio {r}", "cli", ["--method", "deltazip", "--target-ratio", str(r)])
      for r in (6, 8, 10, 12, 14, 16)),
    # --max-bytes = the bytes the named row's artifact took (the allocation at exactly its size).
    ("deltazip --max-bytes of deltazip 2-bit 2:4", "match", ["deltazip 2-bit 2:4"]),
    # Today's rule before format v2 (embeddings/head stored in full or as exact fp16 deltas, side files
    # copied, no lossless stage by default): the code of an older checkout, given with --v1-tree.
    ("format v1 rule, deltazip 4-bit 2:4", "v1", ["--method", "deltazip", "--bits", "4"]),
    ("format v1 rule, deltazip 2-bit 2:4", "v1", ["--method", "deltazip", "--bits", "2"]),
)


def log(msg: str) -> None:
    print(f"[bench/compress] {msg}", file=sys.stderr, flush=True)


def _stored_dtype(ckpt) -> str:
    return "+".join(sorted({e.dtype for e in ckpt.table.values()}))


def _versus(q: dict, ft: dict) -> dict:
    """Recovery and perplexity distance of a scored row ``q`` against the fine-tune's scores ``ft``."""
    return {"recovery_pct": round(100 * q["accuracy"] / ft["accuracy"], 2) if ft["accuracy"] else None,
            "delta_ppl": round(q["heldout_ppl"] - ft["heldout_ppl"], 4),
            "delta_answer_loss": float(f"{q['answer_loss'] - ft['answer_loss']:.4g}")}


def run_cli(pair: dict, args: list[str], nsamples: int, seqlen: int, art: Path, pythonpath: Path | None = None
            ) -> dict:
    """`deltazip compress --json` in a fresh process; the merged model and the compressor's stats.
    ``pythonpath``: run another checkout's deltazip (``tree_shim``); its artifact is read by this one."""
    from deltazip.compress.merge import load_merged_model
    from deltazip.formats.artifact import Artifact
    from deltazip.models.checkpoint import Checkpoint

    cmd = [sys.executable, "-m", "deltazip.deltacli.app", "compress", "--base", pair["base"], "--finetuned",
           pair["finetuned"], "--calib", pair["calib"], "--out", str(art), "--nsamples", str(nsamples), "--seqlen",
           str(seqlen), "--device", "cpu", "--json", *args]  # --group-size: auto (64 on SmolLM2, 128 on demo)
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    t, cpu = time.time(), _children_cpu()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, cpu = time.time() - t, _children_cpu() - cpu
    if r.returncode != 0:  # the row says why; the other rows still run
        return {"error": f"compress failed ({' '.join(args)}): {r.stderr.strip()[-2000:]}"}
    s = json.loads(r.stdout)
    model = load_merged_model(Artifact(art), Checkpoint(pair["base"]))
    stats = {"bytes": s["artifact_bytes"], "linear_ratio": round(s["linear_ratio"], 3),
             "compress_seconds": s["stats"]["seconds"], "process_wall_seconds": round(wall, 1),
             "process_cpu_seconds": round(cpu, 1), "probe_seconds": s["stats"].get("probe_seconds"),
             "allocation": {k: v["settings"] for k, v in (s.get("allocation") or {}).get("by_kind", {}).items()}
             or None,
             "peak_rss_mib": s["stats"]["peak_rss_mib"],
             "mean_layer_rel_out_err": round(sum(L["rel_out_err"] or 0 for L in s["layers"])
                                             / max(1, len(s["layers"])), 5),
             "format_version": s.get("format_version"),
             "calib_windows": (s.get("calibration") or {}).get("nsamples"),
             "calib_seqlen": (s.get("calibration") or {}).get("seqlen"),
             "bytes_by_kind": {k: v["stored_bytes"] for k, v in s["by_kind"].items()},
             "weights_by_kind": {k: v.get("weights") for k, v in s["by_kind"].items()},
             "manifest_and_side_files_bytes": s["artifact_bytes"] - sum(v["stored_bytes"]
                                                                         for v in s["by_kind"].values())}
    return {"model": model, "stats": stats}


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children: a compression's own CPU time,
    which a shared machine's load does not inflate the way it does wall time."""
    import resource

    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run_llmcompressor(pair: dict, args: list[str], nsamples: int, seqlen: int, art: Path,
                      python: Path | None, why_not: str | None) -> dict:
    """bench/_llmcompressor_run.py in the llm-compressor venv; the fine-tune's architecture holding the
    loaded-back, dequantized weights of its artifact, and its stats. ``{"skipped": reason}`` without
    the venv, ``{"error": ...}`` when the run fails (the other rows still run)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deltazip.compress.calibration import load_calibration

    if python is None:
        return {"skipped": why_not}
    art.mkdir(parents=True, exist_ok=True)
    # The very windows `deltazip compress` draws: same file, tokenizer (the fine-tune's), sampler and seed 0.
    tok = AutoTokenizer.from_pretrained(pair["finetuned"])
    windows = load_calibration(pair["calib"], tok, nsamples, seqlen, seed=0).input_ids
    torch.save(windows, art / "windows.pt")
    out, dense, result = art / "compressed", art / "dense.safetensors", art / "result.json"
    cmd = [str(python), str(LLMC_SCRIPT), "--model", pair["finetuned"], "--windows", str(art / "windows.pt"),
           "--group-size", str(pair["group_size"]), "--out", str(out), "--dense", str(dense),
           "--result", str(result), *args]
    t = time.time()
    with open(art / "run.log", "w") as logf:
        r = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t
    if r.returncode != 0 or not result.is_file():
        tail = (art / "run.log").read_text()[-1500:]
        return {"error": f"llm-compressor run failed (exit {r.returncode}; log {art / 'run.log'}): {tail}"}
    res = json.loads(result.read_text())
    model = AutoModelForCausalLM.from_pretrained(pair["finetuned"], dtype=torch.float32).eval()
    sd = load_file(str(dense))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if model.config.tie_word_embeddings and k == "lm_head.weight"}
    assert not unexpected and set(missing) == tied, \
        f"dequantized llm-compressor weights do not fit the fine-tune: missing {missing}, unexpected {unexpected}"
    if tied:
        model.tie_weights()
    stats = {"bytes": res["artifact_bytes"], "weight_bytes": res["weight_bytes"], "format": res["format"],
             "compress_seconds": res["compress_seconds"], "process_wall_seconds": round(wall, 1),
             "peak_rss_mib": res["peak_rss_mib"],
             "frac_groups_2of4": round(res["frac_groups_2of4"], 4),
             "modules_fully_2of4": f"{res['modules_fully_2of4']}/{res['linear_modules']}",
             "zero_fraction": round(res["zero_fraction"], 4),
             "worst_module_frac_2of4": round(res["worst_module_frac_2of4"], 4),
             "versions": {k: res[k] for k in ("llmcompressor", "compressed_tensors", "transformers", "torch")}}
    return {"model": model, "stats": stats}


def bench_pair(pair: dict, quick: bool, workdir: Path, llmc: tuple[Path | None, str | None],
               methods=METHODS, v1: Path | None = None, sizes: list[tuple[int, int]] | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    from deltazip.models.checkpoint import Checkpoint

    tok = AutoTokenizer.from_pretrained(pair["finetuned"])
    rows = read_eval_rows(pair)
    if quick:
        rows = rows[:64]
    ft_ckpt = Checkpoint(pair["finetuned"])
    ft_bytes, ft_dtype = ft_ckpt.nbytes(), _stored_dtype(ft_ckpt)
    base_ckpt = Checkpoint(pair["base"])
    name = pair["name"]
    out = [{"pair": name, "model": "base", "bytes": base_ckpt.nbytes(), "dtype": _stored_dtype(base_ckpt),
            **score_model(pair["base"], tok, rows)},
           {"pair": name, "model": "finetuned", "bytes": ft_bytes, "dtype": ft_dtype, "ratio": 1.0,
            "ratio_vs": ft_dtype, **score_model(pair["finetuned"], tok, rows)}]
    ft_q = out[1]
    for r in out:
        r.update(_versus(r, ft_q))
        log(f"{name} {r['model']}: {r}")
    sizes = sizes or [(32, 64) if quick else (128, 128)]
    runs = [(m, size) for size in sizes for m in methods]
    for i, ((label, runner, args), (nsamples, seqlen)) in enumerate(runs):
        art = workdir / f"{name}-{i}"
        if len(sizes) > 1:
            label = f"{label}, --nsamples {nsamples} --seqlen {seqlen}"
        row = {"pair": name, "model": label}
        if runner == "cli":
            got = run_cli(pair, args, nsamples, seqlen, art)
        elif runner == "match":
            ref = next((r for r in out if r["model"] == args[0] and "bytes" in r), None)
            got = {"skipped": f"needs the row {args[0]!r} (run it too)"} if ref is None else \
                run_cli(pair, ["--method", "deltazip", "--max-bytes", str(ref["bytes"])], nsamples, seqlen, art)
        elif runner == "v1":
            got = ({"skipped": "pass --v1-tree DIR (a checkout of the format-v1 code, e.g. `git worktree add DIR "
                               "e436d4c`)"} if v1 is None else
                   run_cli(pair, args, nsamples, seqlen, art, pythonpath=tree_shim(v1, workdir / "v1-shim")))
        else:
            got = run_llmcompressor(pair, args, nsamples, seqlen, art, *llmc)
        if "model" not in got:
            out.append({**row, **got})
            log(f"{name} {label}: {got}")
            continue
        q = score_model(got.pop("model"), tok, rows)
        s = got["stats"]
        out.append({**row, "bytes": s["bytes"], "ratio": round(ft_bytes / s["bytes"], 3), "ratio_vs": ft_dtype,
                    **q, **_versus(q, ft_q), **{k: v for k, v in s.items() if k != "bytes"}})
        log(f"{name} {label}: {out[-1]}")
    return out


def _llmc_python(arg: str | None) -> tuple[Path | None, str | None]:
    """The llm-compressor interpreter, or None and why not."""
    p = Path(arg).expanduser() if arg else LLMC_PYTHON
    if not p.is_file():
        how = ("" if arg else f"; make it with `python3 -m venv {LLMC_PYTHON.parent.parent}` and "
               f"`{LLMC_PYTHON.parent}/pip install torch==2.13.0 llmcompressor`, or pass --llmcompressor-python")
        return None, f"no llm-compressor interpreter at {p}{how}"
    return p, None


def _table(results: list[dict]) -> str:
    def f(v, fmt="{}"):
        return "" if v is None else fmt.format(v)

    lines = [f"{'pair':13} {'model':48} {'MB':>8} {'ratio':>7} {'acc':>6} {'recov%':>7} {'ppl':>8} {'Δppl':>8} "
             f"{'ans loss':>8} {'2:4 grp':>7} {'s':>6} {'RSS MiB':>8}"]
    for r in results:
        if "accuracy" not in r:
            lines.append(f"{r['pair']:13} {r['model']:48} {(r.get('skipped') or r.get('error'))[:120]}")
            continue
        lines.append(f"{r['pair']:13} {r['model']:48} {r['bytes'] / 1e6:8.1f} {f(r.get('ratio'), '{:.2f}'):>7} "
                     f"{r['accuracy']:6.3f} {f(r.get('recovery_pct'), '{:.1f}'):>7} {r['heldout_ppl']:8.3f} "
                     f"{f(r.get('delta_ppl'), '{:+.3f}'):>8} {r['answer_loss']:8.3g} "
                     f"{f(r.get('frac_groups_2of4'), '{:.3f}'):>7} "
                     f"{f(r.get('compress_seconds'), '{:.0f}'):>6} {f(r.get('peak_rss_mib'), '{:.0f}'):>8}")
    return "\n".join(lines)


def markdown(results: list[dict], times: bool = True) -> str:
    """Two markdown tables of a run's rows: quality and size side by side, and bytes by tensor kind
    (what docs/quality.md shows); ``--render`` prints them from a saved JSON document. ``times=False``
    leaves out the time and memory columns (a table whose sizes and quality still hold after the code
    got faster)."""
    def f(v, fmt="{}"):
        return "" if v is None else fmt.format(v)

    out = ["| pair | model | bytes | ratio | bits/weight | accuracy | recovery % | Δppl | answer loss | 2:4 groups "
           "| compress s | CPU s | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ft = {r["pair"]: r for r in results if r["model"] == "finetuned"}
    for r in results:
        if "accuracy" not in r:
            out.append(f"| {r['pair']} | {r['model']} | {(r.get('skipped') or r.get('error'))[:100]} |" + " |" * 10)
            continue
        weights = sum(v for v in (r.get("weights_by_kind") or {}).values() if v) or None
        width = {"F32": 4, "BF16": 2, "F16": 2}.get(str(r.get("ratio_vs")), 0)
        n = weights or (ft[r["pair"]]["bytes"] / width if r["pair"] in ft and width else None)
        bpw = r["bytes"] * 8 / n if n and r["model"] not in ("base", "finetuned") else None
        out.append(f"| {r['pair']} | {r['model']} | {r['bytes'] / 1e6:.2f} MB | {f(r.get('ratio'), '{:.2f}×')} | "
                   f"{f(bpw, '{:.2f}')} | {r['accuracy']:.3f} | {f(r.get('recovery_pct'), '{:.1f}')} | "
                   f"{f(r.get('delta_ppl'), '{:+.3f}')} | {f(r.get('answer_loss'), '{:.3g}')} | "
                   f"{f(r.get('frac_groups_2of4'), '{:.3f}')} | {f(r.get('compress_seconds'), '{:.0f}')} | "
                   f"{f(r.get('process_cpu_seconds'), '{:.0f}')} | {f(r.get('peak_rss_mib'), '{:.0f}')} |")
    if not times:  # drop the last three columns of every row of the first table
        out = [row.rsplit("|", 4)[0] + "|" for row in out]
    kinds = sorted({k for r in results for k in (r.get("bytes_by_kind") or {})})
    if kinds:
        out += ["", "| model | " + " | ".join(kinds) + " | manifest + side files | total |",
                "|---|" + "---|" * (len(kinds) + 2)]
        for r in results:
            bk = r.get("bytes_by_kind")
            if not bk:
                continue
            cells = [f"{bk[k] / 1e6:.2f} MB" if k in bk else "" for k in kinds]
            out.append(f"| {r['model']} | " + " | ".join(cells)
                       + f" | {r.get('manifest_and_side_files_bytes', 0) / 1e6:.2f} MB | {r['bytes'] / 1e6:.2f} MB |")
    return "\n".join(out)


def pareto_plot(results: list[dict], out: Path) -> list[str]:
    """``compress-pareto-PAIR.png`` in ``out`` for each pair with --target-ratio rows: answer loss and
    accuracy against the ratio, uniform 2/3/4-bit 2:4 beside the allocations. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for pair in sorted({r["pair"] for r in results}):
        rows = [r for r in results if r["pair"] == pair and "accuracy" in r and r.get("ratio")]
        alloc = sorted((r for r in rows if "--target-ratio" in r["model"] or "--max-bytes" in r["model"]),
                       key=lambda r: r["ratio"])
        uni = sorted((r for r in rows if r["model"] in ("deltazip 2-bit 2:4", "deltazip 3-bit 2:4",
                                                         "deltazip 4-bit 2:4")), key=lambda r: r["ratio"])
        if not alloc:
            continue
        ft = next(r for r in rows if r["model"] == "finetuned")
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, label in ((axes[0], "answer_loss", "answer loss (nats/token)"), (axes[1], "accuracy",
                                                                                     "exact-match accuracy")):
            ax.plot([r["ratio"] for r in alloc], [r[key] for r in alloc], "o-", label="--target-ratio / --max-bytes")
            ax.plot([r["ratio"] for r in uni], [r[key] for r in uni], "s--", label="uniform 4/3/2-bit 2:4")
            for r in uni:
                ax.annotate(r["model"].split()[1], (r["ratio"], r[key]), fontsize=7)
            ax.axhline(ft[key], color="gray", lw=0.8, label="fine-tune")
            ax.set_xlabel(f"ratio vs the {ft.get('dtype', '')} fine-tune")
            ax.set_ylabel(label)
            if key == "answer_loss":
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.suptitle(f"{pair}: quality against size")
        fig.tight_layout()
        path = out / f"compress-pareto-{pair}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calibration samples and eval examples")
    ap.add_argument("--out", type=Path, default=None, help="directory for artifacts (default: temporary)")
    ap.add_argument("--pairs", default="demo,smollm2", help=f"comma list of: {', '.join(PAIR_NAMES)}")
    ap.add_argument("--llmcompressor-python", default=None, metavar="PATH",
                    help=f"python of a venv with llmcompressor installed (default: {LLMC_PYTHON} if it exists; "
                         "without one the llm-compressor rows are reported as skipped)")
    ap.add_argument("--methods", default=None,
                    help="comma list of labels or substrings; run only the methods whose label equals or "
                         "contains one (e.g. 'llm-compressor 4-bit'); default: all")
    ap.add_argument("--v1-tree", type=Path, default=None, metavar="DIR",
                    help="a checkout of the format-v1 code (git worktree add DIR e436d4c) for the 'format v1 "
                         "rule' rows (default: those rows are skipped)")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="print the markdown tables of a saved run's JSON document and exit")
    ap.add_argument("--no-times", action="store_true", help="--render without the time and memory columns")
    ap.add_argument("--calib-sizes", default=None, metavar="NxL,...",
                    help="run every method at each calibration size (--nsamples N --seqlen L), e.g. 8x32,32x64")
    a = ap.parse_args()
    if a.render:
        print(markdown(json.loads(a.render.read_text())["results"], times=not a.no_times))
        return
    sizes = None
    if a.calib_sizes:
        try:
            sizes = [tuple(int(x) for x in s.split("x")) for s in a.calib_sizes.split(",") if s.strip()]
            assert sizes and all(len(s) == 2 and min(s) > 0 for s in sizes)
        except (ValueError, AssertionError):
            raise SystemExit(f"bench/compress: --calib-sizes {a.calib_sizes!r}: give NxL pairs, e.g. 8x32,32x64") from None
    methods = METHODS
    if a.methods:
        wanted = [w.strip() for w in a.methods.split(",") if w.strip()]
        labels = {m[0] for m in METHODS}
        # a wanted item equal to a label picks that label only; otherwise it matches as a substring
        methods = tuple(m for m in METHODS if any(w == m[0] if w in labels else w in m[0] for w in wanted))
        if not methods:
            raise SystemExit(f"bench/compress: no method matches {a.methods!r}; methods: "
                             f"{'; '.join(m[0] for m in METHODS)}")
    pairs = [p.strip() for p in a.pairs.split(",") if p.strip()]
    unknown = [p for p in pairs if p not in PAIR_NAMES]
    if unknown:
        raise SystemExit(f"bench/compress: unknown pair(s) {', '.join(unknown)}; known: {', '.join(PAIR_NAMES)}")
    llmc = _llmc_python(a.llmcompressor_python)
    if llmc[0] is None:
        log(f"llm-compressor rows will be skipped: {llmc[1]}")
    results = []
    with tempfile.TemporaryDirectory(prefix="deltazip-bench-") as tmp:
        work = a.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in pairs:
            log(f"building/loading pair {name}")
            results += bench_pair(get_pair(name, log=log), a.quick, work, llmc, methods, a.v1_tree, sizes)
    log("summary (ratio vs the fine-tune's stored dtype; recovery = acc / fine-tune acc; Δppl vs fine-tune)\n"
        + _table(results))
    plots = pareto_plot(results, a.out) if a.out else []
    doc = {"bench": "compress", "machine": machine(),
           "config": {"quick": a.quick, "pairs": pairs, "methods": [m for m, _, _ in methods],
                      "nsamples_seqlen": [list(s) for s in sizes] if sizes else [32, 64] if a.quick else [128, 128],
                      "llmcompressor_python": str(llmc[0]) if llmc[0] else None},
           "results": results, "plots": plots}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
