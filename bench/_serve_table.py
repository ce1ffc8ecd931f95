"""A markdown table of a bench/serve.py JSON document (used by bench/gpu_check.sh)."""

import json
import sys

d = json.load(open(sys.argv[1]))
print("| mode | distribution | completed / requests | throughput req/s | tokens/s | TTFT p50 / p99 s | E2E p50 / p99 s | SLO (both) |")
print("|---|---|---|---|---|---|---|---|")
for r in d["results"]:
    if r["mode"] not in ("delta", "swap"):
        continue
    print(f"| {r['mode']} | {r['dist']} | {r['completed']} / {r['requests']} | {r['throughput_rps']} | {r['tokens_per_s']} | "
          f"{r['ttft_s']['p50']} / {r['ttft_s']['p99']} | {r['e2e_s']['p50']} / {r['e2e_s']['p99']} | "
          f"{r['slo_attainment']['both']} |")
print()
if not d.get("complete", True):
    print("(stopped before the last configuration: the rows above are the ones it finished)")
    print()
print(json.dumps(d["config"]))
