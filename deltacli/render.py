"""Rich rendering of reports for people (stdout); JSON output never goes through here."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from deltazip.deltacli.common import human_bytes, out_console


def render_summary(s: dict, title: str) -> None:
    """Sizes, ratios and per-layer errors of an artifact summary (formats.report.summarize)."""
    c = out_console
    c.print(f"[bold]{escape(title)}[/bold]")
    lin = s.get("lineage", {})
    cfg = s.get("config", {})
    c.print(f"base: {lin.get('base')}   fine-tuned: {lin.get('finetuned')}", markup=False)
    alloc = s.get("allocation")
    grid = "bits: per tensor (allocation below)" if alloc and alloc.get("record") else \
        f"bits: {cfg.get('bits')}  sparsity: {cfg.get('sparsity')}"
    c.print(f"method: {cfg.get('method')}  {grid}  group: {_group_text(cfg, s.get('groups') or {})}  "
            f"{'sym' if cfg.get('sym') else 'asym'}")
    ft_dtype = s.get("finetuned_dtype") or "?"
    t = Table(title=f"bytes by tensor kind (ratio vs the {ft_dtype} fine-tune)")
    for col in ("kind", "tensors", "weights", "original", "stored", "bits/weight", "ratio"):
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind, k in s["by_kind"].items():
        bpw, r = k.get("bits_per_weight"), k.get("ratio")
        t.add_row(kind, str(k["tensors"]), f"{k.get('weights', 0):,}", human_bytes(k["original_bytes"]),
                  human_bytes(k["stored_bytes"]), "-" if bpw is None else f"{bpw:.3f}",
                  "-" if r is None else f"{r:.2f}x")
    c.print(t)
    ratio = s.get("ratio")
    lr = s.get("linear_ratio")
    bpw = s.get("bits_per_weight")
    mixed = [d for d in s.get("finetuned_dtypes", {}) if d != ft_dtype]
    what = f"{ft_dtype} fine-tune" + (f" (also {', '.join(mixed)} tensors)" if mixed else "")
    c.print(f"fine-tuned checkpoint {human_bytes(s['finetuned_bytes'])} -> artifact "
            f"{human_bytes(s['artifact_bytes'])}: ratio [bold]{ratio:.2f}x[/bold] vs {what}"
            + (f", {bpw:.3f} bits per weight" if bpw else "")
            + (f", linear layers {lr:.2f}x" if lr else ""))
    side = s.get("side_files")
    if side:
        cp, ref = side["copied"], side["referenced"]
        c.print(f"side files: {cp['files']} copied ({human_bytes(cp['bytes'])}, in the artifact), "
                f"{ref['files']} referenced from the base ({human_bytes(ref['bytes'])}, not stored)")
    layers = s.get("layers") or []
    if layers:
        lt = Table(title="per-layer error (calibration data)")
        for col in ("layer", "rel. output err", "rel. update err", "mean linear out err", "mean linear weight err"):
            lt.add_column(col, justify="right")

        def f(v):
            return "-" if v is None else f"{v:.4f}"

        for L in layers:
            lt.add_row(str(L["index"]), f(L["rel_out_err"]), f(L["rel_update_err"]), f(L["mean_linear_out_err"]),
                       f(L["mean_linear_weight_err"]))
        c.print(lt)
    if alloc:
        render_allocation(alloc)
    st = s.get("stats", {})
    if "seconds" in st:
        probe = f" (sensitivity probe {st['probe_seconds']:.1f} s)" if "probe_seconds" in st else ""
        c.print(f"time {st['seconds']:.1f} s{probe}, peak RSS {st.get('peak_rss_mib', 0):.0f} MiB on {st.get('device')}")


def _group_text(cfg: dict, groups: dict[str, int]) -> str:
    """``64``, ``64 (auto)``, or ``auto: 64 x120, 128 x30`` when tensors got different groups."""
    if len(groups) > 1:
        return ("auto: " if cfg.get("group_auto") else "") + ", ".join(f"{g} x{n}" for g, n in groups.items())
    return f"{cfg.get('group_size')}" + (" (auto)" if cfg.get("group_auto") else "")


def render_allocation(alloc: dict) -> None:
    """The per-tensor settings of a --target-ratio artifact: by tensor kind, then mean code bits by layer."""
    c = out_console
    rec = alloc.get("record") or {}
    if rec:
        what = f"--target-ratio {rec['target_ratio']:g}" if rec.get("target_ratio") else f"--max-bytes {rec.get('max_bytes')}"
        c.print(f"allocation ({what}): budget {human_bytes(rec['budget_bytes'])}, planned "
                f"{human_bytes(rec['planned_bytes'])}, measured error {rec['relative_error']:.4g} of the delta's "
                "(0 = exact, 1 = every delta dropped)")
    t = Table(title="settings by tensor kind (code bits, weighted by weights; drop = 0)")
    for col in ("kind", "tensors", "mean bits", "settings"):
        t.add_column(col, justify="left" if col in ("kind", "settings") else "right")
    for kind, k in alloc["by_kind"].items():
        sets = ", ".join(f"{lab} x{n}" for lab, n in sorted(k["settings"].items(), key=lambda kv: -kv[1]))
        t.add_row(kind, str(k["tensors"]), f"{k['mean_bits']:.2f}", sets)
    c.print(t)
    layers = alloc.get("by_layer") or []
    if layers:
        lt = Table(title="mean code bits by layer")
        lt.add_column("layer", justify="right")
        lt.add_column("mean bits", justify="right")
        lt.add_column("", justify="left")
        for L in layers:
            bar = "#" * round(2 * (L["mean_bits"] or 0))
            lt.add_row(str(L["index"]), f"{L['mean_bits']:.2f}", bar)
        c.print(lt)


def render_error_curve(sens: dict) -> None:
    """``--report``: the measured error-vs-size curve (allocations, and each uniform setting)."""
    c = out_console
    t = Table(title=f"measured error vs size (sensitivity probe {sens['probe_seconds']:.1f} s on {sens['tokens']:,} "
                    "calibration tokens; error relative to dropping every delta)")
    for col in ("setting", "ratio", "bytes", "relative error"):
        t.add_column(col, justify="right" if col != "setting" else "left")
    for p in sens["points"]:
        t.add_row("--target-ratio", f"{p['ratio']:.2f}x", human_bytes(p["bytes"]), f"{p['relative_error']:.4g}")
    for p in sens["uniform"]:
        t.add_row(f"uniform {p['setting']}", f"{p['ratio']:.2f}x", human_bytes(p["bytes"]), f"{p['relative_error']:.4g}")
    c.print(t)


def render_adapter(s: dict) -> None:
    """A PEFT adapter's summary (``deltazip.runtime.serve.lora_summary.summarize_adapter``)."""
    c, cfg = out_console, s["config"]
    c.print(f"[bold]PEFT adapter {escape(s['path'])}[/bold] ({escape(str(cfg.get('peft_type', 'LORA')))})")
    c.print(f"trained on: {cfg.get('base_model_name_or_path') or '(not named)'}", markup=False)
    rank = ", ".join(str(r) for r in s["ranks_stored"]) or "-"
    c.print(f"r: {cfg.get('r', '-')}  alpha: {cfg.get('lora_alpha', '-')}  ranks stored: {rank}"
            f"{'  rsLoRA' if cfg.get('use_rslora') else ''}{'  DoRA' if s['dora_magnitudes'] else ''}"
            f"{'  LoRA biases' if s['lora_biases'] else ''}", markup=False)
    named = ", ".join(f"{n} x{k}" for n, k in s["adapted_by_name"].items()) or "none"
    c.print(f"adapted modules: {s['adapted_modules']} ({named}); {s['factor_weights']:,} factor weights", markup=False)
    if s["whole_tensors"]:
        c.print(f"whole tensors (modules_to_save, trained biases): {len(s['whole_tensors'])}, e.g. "
                f"{s['whole_tensors'][0]}", markup=False)
    for m, n in s["token_rows"].items():
        c.print(f"token rows: {m}: {n}", markup=False)
    c.print(f"on disk: {human_bytes(s['bytes_on_disk'])}")
    if s["refused"]:
        c.print(f"[red]not served[/red]: {escape(s['refused'])}")
    on = s.get("on_base")
    if on is None:
        return
    if not on["serves"]:
        c.print(f"on {escape(on['base'])}: [red]refused[/red]: {escape(on['why'])}")
        return
    parts = [f"{on['linears']} linears"] + ([f"{len(on['experts_params'])} experts parameters"]
                                             if on["experts_params"] else [])
    parts += [f"{len(on['saved'])} whole tensors"] if on["saved"] else []
    parts += [f"token rows of {m} ({t['rows']}{'' if t['from'] == m else ', tied to ' + t['from']})"
              for m, t in on["token_rows"].items()]
    c.print(f"on {escape(on['base'])} ({on['architecture']}): [green]served[/green]: {escape(', '.join(parts))}")
