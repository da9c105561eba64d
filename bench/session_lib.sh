# Shared by the GPU session scripts (bench/*gpu_session.sh), which source it first:
#   source "$(dirname "$0")/session_lib.sh"
# On sourcing: `set -u`, cd to the repo root, source .device/prelude.sh (CuTe DSL and the project
# on PYTHONPATH; it uses relative paths, hence the cd first). Then the functions below.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source .device/prelude.sh

# session_begin ENV_FILE: OUT (default /tmp/out) made, GIT_COMMIT exported (the device copy may
# have no .git: then "unknown"), START = now, and $OUT/ENV_FILE written with the commit, the GPU
# and the torch / CuTe DSL versions.
session_begin() {
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
  START=$(date +%s)
  {
    echo "commit $GIT_COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
    python -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', getattr(cutlass, '__version__', '?'))"
  } > "$OUT/$1" 2>&1
}

# session_budget TOTAL_S QUICK_BELOW_S MIN_S: what is left of the session's TOTAL_S seconds for
# the benchmark. Sets REMAIN (TOTAL_S - seconds since START), QUICK ("--quick" when REMAIN <
# QUICK_BELOW_S, else "") and LIMIT (REMAIN, at least MIN_S: the benchmark's timeout).
session_budget() {
  REMAIN=$(( $1 - ($(date +%s) - START) ))
  QUICK=""
  if [ $REMAIN -lt $2 ]; then QUICK="--quick"; fi
  LIMIT=$(( REMAIN > $3 ? REMAIN : $3 ))
}

# session_summary TITLE TESTS_LOG [PATTERN]: the summary's banner (TITLE and the seconds since
# START) and the GPU tests' line: $TESTS_RC and the last line of TESTS_LOG matching PATTERN
# (default: pytest's "N passed / failed" count).
session_summary() {
  echo
  echo "================ $1 ($(( $(date +%s) - START )) s) ================"
  echo "gpu tests: rc=$TESTS_RC  $(grep -E "${3:-[0-9]+ (passed|failed)}" "$2" | tail -n 1)"
}

# show_from PATTERN LOG N: LOG from the first line starting with PATTERN (the benchmark's summary
# table) to the end; the last N lines of LOG if no line does (the run failed before its summary).
show_from() {
  if grep -q "^$1" "$2"; then
    sed -n "/^$1/,\$p" "$2"
  else
    tail -n "$3" "$2"
  fi
}
