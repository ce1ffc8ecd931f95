"""A markdown table of a bench/step.py or bench/serve.py JSON document (used by bench/gpu_check.sh).

    python bench/_summary_table.py step|serve FILE.json
"""

import json
import sys


def step_rows(d: dict) -> list[str]:
    out = ["| rows | variants | base ms | delta ms | swap ms | delta/base | weight bytes / base | generate ms/token | "
           "generate/base | host ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        sw = r.get("swap_ms", {}).get("p50", "-")
        out.append(f"| {r['rows']} | {r['variants']} | {r['base_ms']['p50']} | {r['delta_ms']['p50']} | {sw} | "
                   f"{r['delta_over_base']} | {r.get('weight_bytes_over_base', '-')} | "
                   f"{r.get('generate_ms_per_token', '-')} | "
                   f"{r.get('generate_over_base', '-')} | {r['delta_host_ms']} |")
    return out


def serve_rows(d: dict) -> list[str]:
    out = ["| mode | distribution | completed / requests | throughput req/s | tokens/s | TTFT p50 / p99 s | "
           "E2E p50 / p99 s | SLO (both) |", "|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        if r["mode"] in ("delta", "swap"):
            out.append(f"| {r['mode']} | {r['dist']} | {r['completed']} / {r['requests']} | {r['throughput_rps']} | "
                       f"{r['tokens_per_s']} | {r['ttft_s']['p50']} / {r['ttft_s']['p99']} | "
                       f"{r['e2e_s']['p50']} / {r['e2e_s']['p99']} | {r['slo_attainment']['both']} |")
    return out


kind, path = sys.argv[1], sys.argv[2]
d = json.load(open(path))
lines = (step_rows if kind == "step" else serve_rows)(d) + [""]
if not d.get("complete", True):
    lines += ["(stopped before the last configuration: the rows above are the ones it finished)", ""]
print("\n".join(lines + [json.dumps(d["config"])]))
