#!/usr/bin/env bash
# The prepared GPU check: every headline figure from one call of at most 8 minutes on one cold H100 or
# H200 with no network (set-up included). docs/dev/gpu-runs/README.md says how a window runs it.
#
#   bash bench/gpu_check.sh --window     # the window's call (WINDOW_LIMIT 570 s): the smoke call, then, unless
#                                        # one of its benches erred, the measuring steps (MEASURE_STEPS, default
#                                        # "serve compress step gdeflate table") in the same command, with what
#                                        # is left; no second call has to catch the machine in its 30 s warm
#   bash bench/gpu_check.sh              # the measuring call alone (the tests in it, no smoke)
#   bash bench/gpu_check.sh --smoke      # every step on the GPU at one layer and toy traffic (about 3 minutes),
#                                        # the GPU tests and every parity test (preview paths included) beside
#                                        # them: what breaks on a GPU, before measuring spends the minutes
#   bash bench/gpu_check.sh --dry-run    # the same steps on CPU at toy size (tests/test_gpu_check.py runs it;
#                                        # --window --dry-run runs both phases so)
#   STEPS="serve-all table-full" bash bench/gpu_check.sh   # the optional second call: uniform and azure-like
#                                        # serving, the full kernel table (STEPS="humming": humming's MoE GEMM;
#                                        # STEPS="preview compact lora": the preview paths' parity, the compact
#                                        # 2:4 layout's table, grouped LoRA; STEPS="preview options": the parity
#                                        # and the small-batch table of the preview launch options)
#
# Steps, in order, each under its own time limit (seconds; the whole call stays within TOTAL_LIMIT, 480:
# a step gets what is left when that is less, and a step left with under 15 s is skipped and named):
#   serve     150  bench/serve.py, 32 distinct variants of the synthetic 7B-shaped Llama (8 layers), zipf-1.5,
#                  delta vs swap
#   compress   95  bench/compress_memory.py: `deltazip compress --device cuda` at the default settings, 4 layers
#                  (COMPRESS_LAYERS; STEPS=compress COMPRESS_LAYERS=8 COMPRESS_LIMIT=300 as a second call)
#   step       65  bench/step.py: the decode step at batch 32 (base, generate, 1/8/32 variants, floors)
#   gdeflate   20  bench/gdeflate_decode.py: nvCOMP GPU decode against the CPU library, one 7B-shaped variant
#   tests      80  the gpu-marked tests and the CUDA kernel parity tests, at once, in parallel processes (the
#                  kernel file's offline builds are CI's, not the window's)
#   table      40  bench/sbmm_table.py --quick: the delta matmul table at 4096x4096 (the CUDA kernel beside
#                  dense fp16 bmm and the bandwidth floor)
#   preview   150  (not in the first call: STEPS=preview) the parity tests of the kernel's preview paths
#                  (kernels/preview.py: a padded last K tile, narrow, wide and split groups, 3-bit codes, and the
#                  launch options stream-k, pdl, evict-first); the first call's parity skips them
#   options   120  (not in the first call: STEPS=options) bench/sbmm_options.py --quick: the preview launch
#                  options at 1, 2 and 4 deltas, each after its layer's base GEMM, beside the validated launch
#   compact    60  (not in the first call: STEPS=compact) bench/sbmm_table.py --quick --bits 4 --compact: the
#                  4-bit points on the compact 2:4 layout (sparse-mma preview) beside the expanded one
#   lora       40  (not in the first call: STEPS=lora) bench/lora.py: grouped LoRA's four paths in bf16
# (450 s of limits after a set-up of about 25 s.)
# --smoke runs serve, compress, step and gdeflate at one layer and toy traffic (limits 70, 30, 40, 15 s; the
# whole call within 180 s), with the tests and preview parity (140 s each) started beside them at once.
# --window runs it and then STEPS="serve compress step gdeflate table" (the tests already ran) within the
# rest of WINDOW_LIMIT: serve 150, compress 95, step 65, gdeflate 20, table 40 fit the ~385 s left, and the
# second phase reuses the first's installs and compiled kernels. docs/dev/gpu-runs/README.md.
# Every bench writes its finished rows at once, so a step stopped at its limit keeps what it measured.
#
# Writes under $OUT (default /tmp/gpu_check) the 8 files a window keeps in docs/dev/gpu-runs/<gpu>-<date>/:
# gpu_check.log (everything printed), summary.md (versions, one line per step, the tables), commands.sh
# (every command with its limit), serve.json, compress_memory.json, step.json, gdeflate_decode.json,
# sbmm_table.json (a --window call: the log, summary and commands of both phases, the measuring phase's
# JSON). Python packages the image lacks travel as wheels in .whl/ (bench/gpu_wheels.sh makes it) and are
# installed with --no-deps where missing.
set -u
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # --window runs it again, from the checkout's root
cd "$(dirname "$0")/.."
DRY=
SMOKE=
WINDOW=
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --smoke) SMOKE=1 ;;
    --window) WINDOW=1 ;;
    *) echo "gpu_check.sh: unknown argument ${arg}; use --window, --smoke, --dry-run (alone or after one of those)" \
         "or nothing" >&2; exit 2 ;;
  esac
done
if [ -n "$WINDOW" ] && [ -n "$SMOKE" ]; then
  echo "gpu_check.sh: --window runs the smoke call itself; give --window or --smoke, not both" >&2; exit 2
fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"

if [ -n "$WINDOW" ]; then  # the smoke call, then the measuring steps unless a smoke bench broke: one command
  # Both phases write gpu_check.log, summary.md and commands.sh under $OUT as they go (a command stopped from
  # outside still brings back what it did); the smoke phase's JSON (one layer, toy traffic) stays in the
  # scratch, so every JSON under $OUT is a measurement. Both phases share the cubin and bench caches.
  WINDOW_LIMIT=${WINDOW_LIMIT:-570}
  base=${SCRATCH:-$(mktemp -d /tmp/gpu_check_window.XXXXXX)}  # the phases make their folders in it
  export DELTAZIP_BENCH_CACHE=${DELTAZIP_BENCH_CACHE:-$base/cache}
  w0=$(date +%s)
  STEPS="${SMOKE_STEPS:-tests preview serve compress step gdeflate}" OUT="$OUT" JSON_OUT="$base/smoke-json" \
    SCRATCH="$base/smoke" KEEP_SCRATCH=1 TOTAL_LIMIT="${SMOKE_LIMIT:-180}" bash "$SELF" --smoke ${DRY:+--dry-run}
  # a smoke bench that errs would err in the measuring call too; a test failure, or a bench stopped at its
  # (short) limit, does not stop the window: the measuring steps run, and the summary says what failed
  broke=$(awk '$1 != 124 && $1 != 137 {sub(/^[0-9]+ /, ""); print}' "$base/smoke/failed" 2>/dev/null \
    | grep -v -x -e "gpu-marked tests and CUDA kernel parity" -e "CUDA kernel preview-path parity" | paste -sd ';' -)
  if [ -n "$broke" ]; then
    echo "- window: stopped before the measuring steps: ${broke//;/; } failed in the smoke phase (gpu_check.log has" \
      "the error; fix it on CPU before the next call)" | tee -a "$OUT/summary.md"
    [ -z "${KEEP_SCRATCH:-}" ] && rm -rf "$base"
    exit 1
  fi
  left=$(( WINDOW_LIMIT - ($(date +%s) - w0) ))
  echo "=== window: ${left}s of WINDOW_LIMIT ${WINDOW_LIMIT}s left for the measuring steps" | tee -a "$OUT/gpu_check.log"
  APPEND=1 SETUP_DONE=1 STEPS="${MEASURE_STEPS:-serve compress step gdeflate table}" OUT="$OUT" \
    SCRATCH="$base/measure" TOTAL_LIMIT=$left bash "$SELF" ${DRY:+--dry-run}
  rc=$?
  [ -z "${KEEP_SCRATCH:-}" ] && rm -rf "$base"
  exit $rc
fi

MODE=${DRY:+ --dry-run}${SMOKE:+ --smoke}
JSON_OUT=${JSON_OUT:-$OUT}  # the benches' JSON (a window's smoke phase keeps its own out of $OUT)
mkdir -p "$JSON_OUT"
LOG="$OUT/gpu_check.log"
SUM="$OUT/summary.md"
CMDS="$OUT/commands.sh"
SCRATCH=${SCRATCH:-$(mktemp -d /tmp/gpu_check_scratch.XXXXXX)}
mkdir -p "$SCRATCH"
if [ -z "${APPEND:-}" ]; then
  : >"$LOG"
  : >"$SUM"
  printf '#!/usr/bin/env bash\n# The commands bench/gpu_check.sh%s ran, in order, each with its time limit.\n' \
    "$MODE" >"$CMDS"
else  # a window's measuring phase, after its smoke phase
  echo "" >>"$SUM"
  printf '# then the measuring phase (bench/gpu_check.sh%s, STEPS="%s"):\n' "$MODE" "${STEPS:-}" >>"$CMDS"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export DELTAZIP_CUDA_CACHE=${DELTAZIP_CUDA_CACHE:-/tmp/deltazip-cuda}
export DELTAZIP_BENCH_CACHE=${DELTAZIP_BENCH_CACHE:-$SCRATCH/cache}
PY=${PY:-python3}
TOTAL_LIMIT=${TOTAL_LIMIT:-$([ -n "$SMOKE" ] && echo 180 || echo 480)}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
stamp() { echo "=== [$(elapsed)s] $*" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$SUM"; }

stamp "setup${DRY:+ (dry run: nothing installed)}${SETUP_DONE:+ (done by the smoke phase)}"
if [ -z "$DRY" ] && [ -z "${SETUP_DONE:-}" ]; then
  for w in .whl/*.whl; do  # packages the image lacks; none of the image's own is replaced
    [ -f "$w" ] || continue
    dist=$(basename "$w" | cut -d- -f1 | tr _ -)
    $PY -m pip show -q "$dist" >/dev/null 2>&1 || \
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$w" >>"$LOG" 2>&1
  done
  # this checkout, unless the python already imports deltazip from it (a development venv)
  here=$($PY -c "import pathlib, deltazip.kernels as k; print(pathlib.Path(k.__path__[0]).resolve().parent)" 2>/dev/null)
  [ "$here" = "$(pwd -P)" ] || \
    $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || note "- pip install -e . failed"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv >>"$LOG" 2>&1
fi
versions=$($PY - <<'EOF'
import subprocess, sys
import torch
try:
    import triton
    tv = triton.__version__
except Exception:
    tv = "none"
if torch.cuda.is_available():
    drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() or "?"
    print(f"{torch.cuda.get_device_name(0)}, driver {drv}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"triton {tv}, python {sys.version.split()[0]}")
else:
    print(f"CPU only, torch {torch.__version__}, triton {tv}, python {sys.version.split()[0]}")
EOF
)
note "# GPU check${DRY:+ (dry run)}${SMOKE:+ (smoke: one layer, toy traffic)}: $versions"
nvcomp=$($PY -c "from deltazip.formats.gdeflate import gpu_problem; print(gpu_problem() or '')" 2>&1)
[ -n "$nvcomp" ] && note "- nvCOMP GPU decoder: $nvcomp"

run() {  # run NAME LIMIT CMD...: the command under its limit, one summary line, the command in commands.sh
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL_LIMIT - $(elapsed) ))
  if [ "$left" -lt 15 ]; then
    note "- $name: skipped (${left}s left of the ${TOTAL_LIMIT}s budget)"
    return 124
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  stamp "$name (limit ${limit}s): $*"
  # quoted, so the file re-runs as it is; one printf is one write, so the smoke phase's steps that run at
  # once (the tests beside the benches) cannot interleave their lines
  local line; line="timeout $limit$(printf ' %q' "$@")"
  printf '%s\n' "$line" >>"$CMDS"
  local s=$(date +%s) from=$(( $(wc -l <"$LOG") + 1 ))
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "$rc $name" >>"$SCRATCH/failed"  # read by --window
  local tail_line  # this step's own last pytest-style line, if it printed one
  tail_line=$(tail -n +"$from" "$LOG" | grep -E "[0-9]+ (passed|failed|skipped)|[0-9]+ errors?( |$)|needs a CUDA GPU" \
    | tail -1)
  note "- $name: exit $rc in $(( $(date +%s) - s ))s${tail_line:+ ($tail_line)}"
  return $rc
}

STEPS=" ${STEPS:-$([ -n "$SMOKE" ] && echo "tests preview serve compress step gdeflate" \
  || echo "serve compress step gdeflate tests table")} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
if [ -n "$DRY" ]; then  # toy sizes on CPU: every step's plumbing, in about a minute and a half
  SERVE_ARGS="--shape toy --layers 2 --variants 4 --duration 3 --rate 4 --drain 20 --cpu-threads 1"
  COMPRESS_ARGS="--shape toy --layers 2 --nsamples 4 --seqlen 32 --device cpu --extrapolate 32"
  STEP_ARGS="--shape toy --layers 2 --rows 8 --variants 1 4 --repeats 3"
  GDEFLATE_ARGS="--quick"
  TEST_PATHS="tests/formats/test_gdeflate.py"
  TABLE_ARGS="--quick"
  LORA_ARGS="--quick --repeats 3"
elif [ -n "$SMOKE" ]; then  # the GPU window's code paths at one 7B-shaped layer: what breaks, not how fast
  SERVE_ARGS="--layers 1 --variants 4 --duration 3 --rate 4 --drain 20"
  COMPRESS_ARGS="--shape 7b --layers 1 --nsamples 16 --seqlen 256 --device cuda --extrapolate 32"
  STEP_ARGS="--layers 1 --rows 8 --variants 1 4 --repeats 3"
  GDEFLATE_ARGS="--layers 1 --repeats 2"
  # the benches one after another in about 155 s with set-up; the tests beside them, ending by then too
  : "${SERVE_LIMIT:=70}" "${COMPRESS_LIMIT:=30}" "${STEP_LIMIT:=40}" "${GDEFLATE_LIMIT:=15}"
  : "${TESTS_LIMIT:=140}" "${PREVIEW_LIMIT:=140}"
  TEST_PATHS="tests"
  TABLE_ARGS="--quick"
  LORA_ARGS="--quick --repeats 3"
else
  SERVE_ARGS="--layers ${SERVE_LAYERS:-8} --variants 32 --duration ${SERVE_DURATION:-10} --rate ${SERVE_RATE:-20} --drain 20"
  COMPRESS_ARGS="--shape 7b --layers ${COMPRESS_LAYERS:-4} --defaults --device cuda --extrapolate 32"
  STEP_ARGS="--layers ${STEP_LAYERS:-32} --repeats 5"
  GDEFLATE_ARGS="--layers 8"
  TEST_PATHS="tests"
  TABLE_ARGS="--quick"
  LORA_ARGS="--repeats 11"
fi
XDIST=$([ -z "$DRY" ] && $PY -c "import xdist" 2>/dev/null && echo yes)
REQUIRE=--require-gpu
# on CPU the gpu-marked tests skip: the dry run checks the steps' plumbing (REQUIRE_GPU=1: they fail, as the
# window's do without a GPU)
[ -n "$DRY" ] && [ -z "${REQUIRE_GPU:-}" ] && REQUIRE=

PARITY_STOP=$([ -z "$SMOKE" ] && echo -x)
TEST_WORKERS=$([ -n "$SMOKE" ] && echo 6 || echo 8)  # a smoke call runs two such pytest runs and the benches at once
tests_step() {  # the gpu-marked tests and the kernel parity tests at once, each in parallel processes
  # (-x stops the parity run at its first failure, except in a smoke call, which wants every one; the
  # kernel file's offline builds run in CI, not in a window's seconds)
  run "gpu-marked tests and CUDA kernel parity" ${TESTS_LIMIT:-80} bash -c "
    $PY -m pytest -q -p no:cacheprovider ${XDIST:+-n $TEST_WORKERS} -m gpu $REQUIRE $TEST_PATHS \
      --deselect tests/kernels/test_cuda_sbmm.py --deselect tests/kernels/test_launch_options.py \
      > '$SCRATCH/tests.log' 2>&1 & a=\$!
    $PY -m pytest -q $PARITY_STOP -p no:cacheprovider ${XDIST:+-n 4} -m gpu $REQUIRE -k 'not preview' \
      tests/kernels/test_cuda_sbmm.py > '$SCRATCH/parity.log' 2>&1 & b=\$!
    wait \$a; ra=\$?; wait \$b; rb=\$?
    echo '--- gpu-marked tests'; cat '$SCRATCH/tests.log'; echo '--- CUDA kernel parity'; cat '$SCRATCH/parity.log'
    echo \"gpu-marked tests: \$(tail -1 '$SCRATCH/tests.log'); kernel parity: \$(tail -1 '$SCRATCH/parity.log')\"
    [ \$ra -eq 0 ] && [ \$rb -eq 0 ]"
}
preview_step() {  # the preview paths' GPU parity: what lets DELTAZIP_CUDA_PREVIEW paths become the default
  run "CUDA kernel preview-path parity" ${PREVIEW_LIMIT:-150} \
    $PY -m pytest -q -p no:cacheprovider ${XDIST:+-n $TEST_WORKERS} -m gpu -k preview $REQUIRE tests/kernels/test_cuda_sbmm.py \
    tests/kernels/test_launch_options.py
}
BACKGROUND=()
if [ -n "$SMOKE" ]; then  # correctness needs no quiet GPU: the tests run beside the one-layer benches
  for s in tests preview; do
    want $s || continue
    ( LOG="$SCRATCH/background-$s.log"; : >"$LOG"; "${s}_step" ) &
    BACKGROUND+=("$!:$s")
  done
fi

if want serve || want serve-all; then  # server logs (start-up, warm-up, capacity lines) go to the log
  dists=zipf-1.5
  want serve-all && dists=uniform,zipf-1.5,azure-like
  run "serving bench ($dists, delta vs swap)" ${SERVE_LIMIT:-150} \
    $PY bench/serve.py --pair synthetic-7b --quick --dists $dists $SERVE_ARGS --server-log-level info \
    --out "$SCRATCH/serve"
  [ -f "$SCRATCH/serve/serve.json" ] && cp "$SCRATCH/serve/serve.json" "$JSON_OUT/serve.json"
  for f in "$SCRATCH"/serve/server-*.pgid; do  # a bench killed at its limit leaves no server holding the GPU
    [ -f "$f" ] && kill -KILL -- "-$(cat "$f")" 2>/dev/null
  done
  for f in "$SCRATCH"/serve/server-*.log; do
    [ -f "$f" ] && { echo "--- $(basename "$f") (start-up lines and errors)"; \
      grep -E "warm-up|capacity|tuned|ready|Error|Traceback" "$f" | head -40; } >>"$LOG"
  done
  rm -rf "$DELTAZIP_BENCH_CACHE/synthetic"/*/arts "$DELTAZIP_BENCH_CACHE/synthetic"/*/swap  # disk for the next steps
fi
want compress && run "compression" \
  ${COMPRESS_LIMIT:-95} $PY bench/compress_memory.py $COMPRESS_ARGS --out "$JSON_OUT"
want step && run "decode step" ${STEP_LIMIT:-65} \
  $PY bench/step.py --pair synthetic-7b $STEP_ARGS --out "$JSON_OUT"
want gdeflate && run "GDeflate decode, GPU vs CPU" ${GDEFLATE_LIMIT:-20} \
  $PY bench/gdeflate_decode.py $GDEFLATE_ARGS --out "$JSON_OUT"
want tests && [ -z "$SMOKE" ] && tests_step
if want table || want table-full; then
  args=$TABLE_ARGS
  want table-full && args=""
  run "delta matmul table ($args)" ${TABLE_LIMIT:-40} $PY bench/sbmm_table.py $args --out "$SCRATCH/table"
  [ -f "$SCRATCH/table/sbmm_table.json" ] && cp "$SCRATCH/table/sbmm_table.json" "$JSON_OUT/sbmm_table.json"
fi

want preview && [ -z "$SMOKE" ] && preview_step
if want options; then  # the preview launch options beside the validated launch, at 1, 2 and 4 deltas
  run "preview launch options table" ${OPTIONS_LIMIT:-120} \
    $PY bench/sbmm_options.py --quick --out "$SCRATCH/options"
  [ -f "$SCRATCH/options/sbmm_options.json" ] && cp "$SCRATCH/options/sbmm_options.json" "$JSON_OUT/sbmm_options.json"
fi
if want compact; then  # the compact 2:4 layout on the sparse tensor cores, beside the expanded layout
  run "compact 2:4 delta matmul table" ${COMPACT_LIMIT:-60} env DELTAZIP_CUDA_PREVIEW=sparse-mma \
    $PY bench/sbmm_table.py --quick --bits 4 --compact --out "$SCRATCH/compact"
  [ -f "$SCRATCH/compact/sbmm_table.json" ] && cp "$SCRATCH/compact/sbmm_table.json" "$JSON_OUT/sbmm_compact.json"
fi
want lora && run "grouped LoRA paths" ${LORA_LIMIT:-40} $PY bench/lora.py $LORA_ARGS --out "$JSON_OUT"
if want humming; then  # optional: humming-kernels and its needs travel in .whl/humming/
  for w in .whl/humming/*.whl; do
    [ -f "$w" ] && [ -z "$DRY" ] || continue
    dist=$(basename "$w" | cut -d- -f1 | tr _ -)
    $PY -m pip show -q "$dist" >/dev/null 2>&1 || \
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$w" >>"$LOG" 2>&1
  done
  if $PY -c "import humming" 2>/dev/null; then
    run "humming-kernels MoE GEMM candidate" ${HUMMING_LIMIT:-90} $PY bench/humming_moe.py --out "$SCRATCH/humming"
    [ -f "$SCRATCH/humming/humming_moe.json" ] && cp "$SCRATCH/humming/humming_moe.json" "$JSON_OUT/"
    [ -f "$SCRATCH/humming/humming_table.md" ] && { note ""; cat "$SCRATCH/humming/humming_table.md" >>"$SUM"; }
  else
    note "- humming-kernels MoE GEMM candidate: not run (humming does not import; carry .whl/humming/)"
  fi
fi
for job in "${BACKGROUND[@]}"; do  # the smoke call's background tests: their log after the benches'
  wait "${job%%:*}"
  s=${job#*:}
  { echo "=== background: $s"; cat "$SCRATCH/background-$s.log"; } >>"$LOG"
done
[ "$JSON_OUT" != "$OUT" ] && NO_TABLES=1  # a window's smoke phase: its figures (toy traffic) are not kept
[ -z "${NO_TABLES:-}" ] && for kind in serve compress_memory step gdeflate_decode; do
  [ -f "$JSON_OUT/$kind.json" ] && { note ""; $PY bench/_summary_table.py "$kind" "$JSON_OUT/$kind.json" >>"$SUM"; }
done
if [ -z "${NO_TABLES:-}" ] && [ -f "$SCRATCH/table/table.md" ]; then
  note ""
  note "## Delta matmul (graph replay, µs per launch; bench/sbmm_table.py $TABLE_ARGS)"
  cat "$SCRATCH/table/table.md" >>"$SUM"
fi
if [ -z "${NO_TABLES:-}" ] && [ -f "$SCRATCH/options/options.md" ]; then
  note ""
  note "## Preview launch options at small batches (bench/sbmm_options.py --quick; µs per delta matmul after its base GEMM)"
  cat "$SCRATCH/options/options.md" >>"$SUM"
fi
if [ -z "${NO_TABLES:-}" ] && [ -f "$SCRATCH/compact/table.md" ]; then
  note ""
  note "## Compact 2:4 delta matmul (bench/sbmm_table.py --quick --bits 4 --compact, DELTAZIP_CUDA_PREVIEW=sparse-mma)"
  cat "$SCRATCH/compact/table.md" >>"$SUM"
fi
stamp "done"
[ -z "${KEEP_SCRATCH:-}" ] && rm -rf "$SCRATCH"
cat "$SUM"
