#!/usr/bin/env bash
# DeepSeek-V4 attention + mHC GPU session on the H200 (run from the repo root; the lead runs it), < 3 minutes:
#   bash bench/dsv4_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the DSV4 GPU tests (tests/gpu/test_mhc_gpu.py tests/gpu/test_dsv4_gpu.py), 2. the DSV4 benchmark (bench/dsv4_bench.py,
# --quick when little time is left), then a summary table.
source .device/prelude.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
START=$(date +%s)
{
  echo "commit $GIT_COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', getattr(cutlass, '__version__', '?'))"
} > "$OUT/dsv4_env.txt" 2>&1

echo "== DSV4 GPU tests"
timeout 95 python -m pytest -m gpu tests/gpu/test_mhc_gpu.py tests/gpu/test_dsv4_gpu.py -q -rA -p no:cacheprovider --durations=8 \
  > "$OUT/dsv4_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/dsv4_gpu_tests.log" | head -n 20
tail -n 12 "$OUT/dsv4_gpu_tests.log"

echo "== DSV4 benchmark"
REMAIN=$(( 170 - ($(date +%s) - START) ))
QUICK=""
if [ $REMAIN -lt 100 ]; then QUICK="--quick"; fi
timeout $(( REMAIN > 30 ? REMAIN : 30 )) python -m bench.dsv4_bench --out "$OUT" $QUICK > "$OUT/dsv4_bench.log" 2>&1
BENCH_RC=$?

echo
echo "================ DSV4 summary ($(( $(date +%s) - START )) s) ================"
echo "gpu tests: rc=$TESTS_RC  $(grep -E '[0-9]+ (passed|failed)' "$OUT/dsv4_gpu_tests.log" | tail -n 1)"
grep -E '^(PASSED|FAILED|ERROR)' "$OUT/dsv4_gpu_tests.log" | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC $QUICK"
if grep -q '^copy bandwidth' "$OUT/dsv4_bench.log"; then
  sed -n '/^copy bandwidth/,$p' "$OUT/dsv4_bench.log"
else
  tail -n 25 "$OUT/dsv4_bench.log"
fi
