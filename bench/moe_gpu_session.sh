#!/usr/bin/env bash
# MoE GPU session on the H200 (run from the repo root; the lead runs it), < 4 minutes:
#   bash bench/moe_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the MoE GPU tests (tests/gpu/test_moe_gpu.py), 2. the MoE benchmark (bench/moe_bench.py),
# then a summary table.
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
} > "$OUT/moe_env.txt" 2>&1

echo "== MoE GPU tests"
timeout 150 python -m pytest -m gpu tests/gpu/test_moe_gpu.py -v -p no:cacheprovider --durations=10 \
  > "$OUT/moe_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/moe_gpu_tests.log" | head -30

echo "== MoE benchmark"
REMAIN=$(( ${MOE_BUDGET_S:-225} - ($(date +%s) - START) ))
QUICK=""
if [ $REMAIN -lt 120 ]; then QUICK="--quick"; fi
timeout $(( REMAIN > 40 ? REMAIN : 40 )) python -m bench.moe_bench --out "$OUT" $QUICK > "$OUT/moe_bench.log" 2>&1
BENCH_RC=$?

echo
echo "================ MoE summary ($(( $(date +%s) - START )) s) ================"
echo "gpu tests: rc=$TESTS_RC  $(grep -E '[0-9]+ (passed|failed)' "$OUT/moe_gpu_tests.log" | tail -n 1)"
grep -E '(PASSED|FAILED|ERROR)( |$)' "$OUT/moe_gpu_tests.log" | grep '::' | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC"
if grep -q '^copy bandwidth' "$OUT/moe_bench.log"; then
  sed -n '/^copy bandwidth/,$p' "$OUT/moe_bench.log"
else
  grep -E '^(GPU|moe )' "$OUT/moe_bench.log"; tail -n 15 "$OUT/moe_bench.log"
fi
ls -la "$OUT"
