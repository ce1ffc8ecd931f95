#!/usr/bin/env bash
# One prepared GPU check (issues 22 and 23): on one H100/H200 with no network; the default steps take at most 6 minutes.
#
#   bash bench/gpu_check.sh            # writes $OUT (default /tmp/gpu_check): gpu_check.log, summary.md,
#                                      # step.json, serve.json, sbmm_table.json, table.md, humming_moe.json,
#                                      # humming_table.md (8 files)
#
# Works with whatever torch and Triton the machine has. Python packages the image lacks travel as
# wheels in .whl/ (see docs/kernels.md, "GPU check"), installed with --no-deps beside the image's own. nvCOMP must match the CUDA major version: nvidia-nvcomp-cu13 under CUDA 13,
# nvidia-nvcomp-cu12 under CUDA 12; a mismatch is named in one line and the nvCOMP tests skip.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
SUM="$OUT/summary.md"
: >"$LOG"
: >"$SUM"
export PYTHONUNBUFFERED=1 DELTAZIP_CUDA_CACHE=/tmp/deltazip-cuda HF_HUB_OFFLINE=1
PY=${PY:-python3}
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$SUM"; }

step "setup"
if compgen -G ".whl/*.whl" >/dev/null; then  # packages the image lacks (none of them is replaced)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl >>"$LOG" 2>&1
fi
if compgen -G ".whl/humming/*.whl" >/dev/null; then  # humming-kernels and its needs, each only where missing
  for w in .whl/humming/*.whl; do
    dist=$(basename "$w" | cut -d- -f1 | tr _ -)
    $PY -m pip show -q "$dist" >/dev/null 2>&1 || \
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$w" >>"$LOG" 2>&1
  done
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || { echo "pip install -e . failed" | tee -a "$SUM"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1
versions=$($PY - <<'EOF'
import torch, sys
try:
    import triton; tv = triton.__version__
except Exception:
    tv = "none"
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {tv}, "
      f"python {sys.version.split()[0]}")
EOF
)
note "# GPU check: $versions"
cuda_major=$($PY -c "import torch; print((torch.version.cuda or '0').split('.')[0])")
if ! $PY -c "import nvidia.nvcomp" 2>/dev/null; then
  note "- nvCOMP: not importable; install nvidia-nvcomp-cu${cuda_major} (the package must match CUDA ${cuda_major})"
fi

run() {  # run NAME TIMEOUT CMD...: one line per step in the summary
  local name=$1 limit=$2; shift 2
  step "$name: $*"
  local s=$(date +%s) from=$(( $(wc -l <"$LOG") + 1 ))
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local tail_line  # this step's own last pytest-style line, if it printed one
  tail_line=$(tail -n +"$from" "$LOG" | grep -E "[0-9]+ (passed|failed)|[0-9]+ errors?( |$)" | tail -1)
  note "- $name: exit $rc in $(( $(date +%s) - s ))s${tail_line:+ ($tail_line)}"
  return $rc
}

# STEPS picks what runs. The default is issue 22's check, at most 6 minutes with set-up at its limits
# (tests 110 s, parity 100, table 120): the gpu-marked tests, the CUDA kernel's parity, the kernel table.
# Issue 23's benches and the humming candidate are a second call: STEPS="step serve humming" (limits
# step 300, serve 270, humming 90; step and serve alone fit a 10-minute call).
STEPS=" ${STEPS:-tests parity table} "
[ -n "${SKIP_STEP:-}" ] && STEPS=${STEPS/ step / }
[ -n "${SKIP_HUMMING:-}" ] && STEPS=${STEPS/ humming / }
want() { [[ "$STEPS" == *" $1 "* ]]; }
xdist=$($PY -c "import xdist" 2>/dev/null && echo yes)  # pytest-xdist travels in .whl/ (with execnet)
# the gpu-marked tests run serially (servers, Ray, two-process tests); TESTS_XDIST="-n 8" spreads them
want tests && run "gpu-marked tests" ${TESTS_LIMIT:-110} $PY -m pytest -q -p no:cacheprovider ${TESTS_XDIST:-} -m gpu \
  --require-gpu tests --deselect tests/kernels/test_cuda_sbmm.py
# parity in 4 processes where xdist is there: its offline compile screens and the GPU tests' first
# launches compile about 150 kernel builds (cached on disk, shared by the processes)
pxdist=${xdist:+-n 4}
want parity && run "CUDA kernel parity" ${PARITY_LIMIT:-100} $PY -m pytest -q -x -p no:cacheprovider $pxdist \
  tests/kernels/test_cuda_sbmm.py
want table && run "delta matmul table" ${TABLE_LIMIT:-120} $PY bench/sbmm_table.py --out "$OUT" --table ${TABLE_ARGS:-}
want step && run "decode step bench (synthetic 7B-shaped Llama)" ${STEP_LIMIT:-300} \
  $PY bench/step.py --pair synthetic-7b --repeats 5 --out "$OUT"
# serve: the delta server first, so a run stopped at its limit keeps the delta rows; the swap server loads
# whole merged checkpoints (one merge, hard-linked under the 32 names); host tiers of 8 variants bound the
# start-up reads.
if want serve; then  # server logs (warm-up, capacity, tuning lines) to the log, serve.json to $OUT
  SERVE_OUT=/tmp/gpu_check_serve; rm -rf "$SERVE_OUT"
  run "serving bench (synthetic 7B-shaped Llama, 32 variants, delta vs swap)" ${SERVE_LIMIT:-270} \
    $PY bench/serve.py --pair synthetic-7b --quick --duration ${SERVE_DURATION:-10} --variants 32 \
    --max-deltas 8 --max-cpu-deltas 8 \
    --server-log-level info --out "$SERVE_OUT"
  [ -f "$SERVE_OUT/serve.json" ] && cp "$SERVE_OUT/serve.json" "$OUT/serve.json"
  for f in "$SERVE_OUT"/server-*.log; do
    [ -f "$f" ] && { echo "--- $(basename "$f") (start-up lines and errors)"; \
      grep -E "warm-up|capacity|tuned|Error|Traceback" "$f" | head -40; } >>"$LOG"
  done
fi
if want humming; then
  if $PY -c "import humming" 2>/dev/null; then
    run "humming-kernels MoE GEMM candidate" ${HUMMING_LIMIT:-90} $PY bench/humming_moe.py --out "$OUT"
  else
    note "- humming-kernels MoE GEMM candidate: not run (humming does not import; carry .whl/humming/)"
  fi
fi
if [ -f "$OUT/step.json" ]; then
  note ""
  note "## Decode step (bench/step.py --pair synthetic-7b)"
  $PY bench/_summary_table.py step "$OUT/step.json" >>"$SUM"
fi
if [ -f "$OUT/serve.json" ]; then
  note ""
  note "## Serving (bench/serve.py --pair synthetic-7b --quick)"
  $PY bench/_summary_table.py serve "$OUT/serve.json" >>"$SUM"
fi
if [ -f "$OUT/table.md" ]; then
  note ""
  note "## Delta matmul (graph replay, µs per launch)"
  cat "$OUT/table.md" >>"$SUM"
fi
if [ -f "$OUT/humming_table.md" ]; then
  note ""
  note "## humming-kernels MoE GEMM vs the dispatched CUDA path (graph replay, µs per launch)"
  cat "$OUT/humming_table.md" >>"$SUM"
fi
step "done"
cat "$SUM"
