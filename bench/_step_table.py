"""A markdown table of a bench/step.py JSON document (used by bench/gpu_check.sh)."""

import json
import sys

d = json.load(open(sys.argv[1]))
print("| rows | variants | base ms | delta ms | swap ms | delta/base | generate ms/token | generate/base | host ms |")
print("|---|---|---|---|---|---|---|---|---|")
for r in d["results"]:
    sw = r.get("swap_ms", {}).get("p50", "-")
    print(f"| {r['rows']} | {r['variants']} | {r['base_ms']['p50']} | {r['delta_ms']['p50']} | {sw} | "
          f"{r['delta_over_base']} | {r.get('generate_ms_per_token', '-')} | {r.get('generate_over_base', '-')} | "
          f"{r['delta_host_ms']} |")
print()
if not d.get("complete", True):
    print("(stopped before the last configuration: the rows above are the ones it finished)")
    print()
print(json.dumps(d["config"]))
