"""A markdown section of one bench JSON document (used by bench/gpu_check.sh for summary.md).

    python bench/_summary_table.py serve|step|compress_memory|gdeflate_decode FILE.json

Every section starts with the machine the figures came from (GPU, driver, torch, CUDA, Triton) and
its tables carry the layer count the figures were measured at.
"""

import json
import sys


def machine_line(d: dict) -> str:
    m = d.get("machine", {})
    if not m.get("cuda"):
        return f"CPU ({m.get('cpus')} cores), torch {m.get('torch')}"
    return (f"{m['cuda']}, driver {m.get('driver')}, torch {m.get('torch')}, CUDA {m.get('cuda_runtime')}, "
            f"Triton {m.get('triton')}")


def _p(r: dict, key: str) -> str:
    v = r.get(key) or {}
    return f"{v.get('p50')} / {v.get('p99')}"


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def serve_rows(d: dict) -> list[str]:
    c = d["config"]
    out = [f"## Serving: {c['variants']} variants, {c.get('layers', '-')} layers of {c.get('shape', c['pair'])} "
           f"(bench/serve.py --pair {c['pair']}; {machine_line(d)})", "",
           "| mode | layers | distribution | completed / requests | req/s | tokens/s | TTFT p50 / p99 s | "
           "E2E p50 / p99 s | SLO (both) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        if r["mode"] in ("delta", "swap"):
            out.append(f"| {r['mode']} | {c.get('layers', '-')} | {r['dist']} | {r['completed']} / {r['requests']} | "
                       f"{r['throughput_rps']} | {r['tokens_per_s']} | {_p(r, 'ttft_s')} | {_p(r, 'e2e_s')} | "
                       f"{r['slo_attainment']['both']} |")
    for r in d["results"]:
        if r["mode"] == "delta/swap":
            out.append(f"| delta / swap | {c.get('layers', '-')} | {r['dist']} | | "
                       f"{r['throughput_delta_over_swap']}x | {r.get('tokens_per_s_delta_over_swap')}x | "
                       f"swap/delta p99 {r.get('ttft_p99_swap_over_delta')} | | |")
    mem = c["memory"]
    out += ["", f"Swap: {c.get('swap_weights')}. Slots: {mem.get('delta_slots')} delta, {mem.get('swap_slots')} swap "
                f"(equal device memory); KV cache grows on demand in both, max {c['max_num_seqs']} sequences. "
                f"Ready after {mem.get('delta_ready_s')} s (delta) and {mem.get('swap_ready_s')} s (swap); host tiers "
                f"warm {mem.get('delta_host_tier_warm_s')} s / {mem.get('swap_host_tier_warm_s')} s later; tensors "
                f"held (host and device, each once): {_gb(mem.get('delta_held_bytes'))} / "
                f"{_gb(mem.get('swap_held_bytes'))} GB."]
    if c.get("variants_written"):
        w = c["variants_written"]
        out.append(f"Variants written as artifacts: {w['bytes'] / 1e9:.2f} GB in {w['seconds']} s "
                   f"({w['threads']} writer threads); layers limited by {c.get('layer_limits')}.")
    return out


def step_rows(d: dict) -> list[str]:
    c = d["config"]
    out = [f"## Decode step (bench/step.py --pair {c['pair']}, {c.get('layers') or '-'} layers, context "
           f"{c['context']}, copy {c.get('copy_GBps')} GB/s; {machine_line(d)})", "",
           "| rows | variants | layers | base ms | base floor ms | base bytes eff. | delta ms | delta floor ms | "
           "delta / scaled base | swap ms | generate ms/token | generate / base |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        sw = r.get("swap_ms", {}).get("p50", "-")
        out.append(f"| {r['rows']} | {r['variants']} | {r.get('layers') or '-'} | {r['base_ms']['p50']} | "
                   f"{r.get('base_floor_ms', '-')} | {r.get('base_bytes_efficiency', '-')} | {r['delta_ms']['p50']} | "
                   f"{r.get('delta_floor_ms', '-')} | {r.get('delta_over_scaled_base', '-')} | {sw} | "
                   f"{r.get('generate_ms_per_token', '-')} | {r.get('generate_over_base', '-')} |")
    return out


def compress_rows(d: dict) -> list[str]:
    c = d["config"]
    out = [f"## Compression of the synthetic {c['shape']} pair ({c['calibration']}, --device {c['device']}; "
           f"{machine_line(d)})", "",
           "| layers | candidate | wall s | compress s | peak host RSS MiB | peak anonymous MiB | peak GPU MiB |",
           "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        label = f"{r['layers']} ({r['extrapolated']})" if r.get("extrapolated") else r["layers"]
        out.append(f"| {label} | {r['candidate']} | {r['wall_s']} | {r.get('compress_seconds', '-')} | "
                   f"{r.get('peak_rss_mib', '-')} | {r.get('peak_rss_anon_mib', '-')} | {r.get('peak_cuda_mib', '-')} |")
    return out


def gdeflate_rows(d: dict) -> list[str]:
    c = d["config"]
    out = [f"## GDeflate decode, one {c['shape']}-shaped variant of {c['layers']} layers "
           f"({c['decoded_bytes'] / 1e9:.2f} GB, level {c['level']}; {machine_line(d)})", ""]
    for r in d["results"]:
        out.append("- " + ", ".join(f"{k} {v}" for k, v in r.items()))
    return out


RENDER = {"serve": serve_rows, "step": step_rows, "compress_memory": compress_rows, "gdeflate_decode": gdeflate_rows}

kind, path = sys.argv[1], sys.argv[2]
d = json.load(open(path))
lines = RENDER[kind](d) + [""]
if not d.get("complete", True):
    lines += ["(stopped before the last configuration: the rows above are the ones it finished)", ""]
print("\n".join(lines))
