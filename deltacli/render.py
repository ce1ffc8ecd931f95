"""Rich rendering of reports for people (stdout); JSON output never goes through here."""

from __future__ import annotations

from rich.table import Table

from deltazip.deltacli.common import human_bytes, out_console


def render_summary(s: dict, title: str) -> None:
    """Sizes, ratios and per-layer errors of an artifact summary (formats.report.summarize)."""
    c = out_console
    c.print(f"[bold]{title}[/bold]")
    lin = s.get("lineage", {})
    cfg = s.get("config", {})
    c.print(f"base: {lin.get('base')}   fine-tuned: {lin.get('finetuned')}")
    c.print(f"method: {cfg.get('method')}  bits: {cfg.get('bits')}  sparsity: {cfg.get('sparsity')}  "
            f"group: {cfg.get('group_size')}  {'sym' if cfg.get('sym') else 'asym'}")
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
    st = s.get("stats", {})
    if "seconds" in st:
        c.print(f"time {st['seconds']:.1f} s, peak RSS {st.get('peak_rss_mib', 0):.0f} MiB on {st.get('device')}")
