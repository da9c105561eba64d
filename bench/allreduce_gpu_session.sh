#!/usr/bin/env bash
# All-reduce GPU session on the H200 (run from the repo root; the lead runs it), < 2.5 minutes:
#   bash bench/allreduce_gpu_session.sh        # logs + JSON under $OUT (default /tmp/out)
# 1. the all-reduce GPU tests (tests/gpu/test_allreduce_gpu.py: TP-sharded MLP stack N=2,4,8,
#    chains, missing rank -> KernelTimeoutError, 20 launches without reset),
# 2. the latency benchmark (bench/allreduce_bench.py: 8 KB .. 1 MB, N=8 virtual ranks; peer
#    stores go to local HBM: instruction overhead, not NVLink), then a summary table.
source .device/prelude.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}   # one hardware queue per virtual rank
START=$(date +%s)
{
  echo "commit $GIT_COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', getattr(cutlass, '__version__', '?'))"
} > "$OUT/allreduce_env.txt" 2>&1

echo "== all-reduce GPU tests"
timeout 100 python -m pytest -m gpu tests/gpu/test_allreduce_gpu.py -v -p no:cacheprovider --durations=10 \
  > "$OUT/allreduce_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/allreduce_gpu_tests.log" | head -30

echo "== all-reduce benchmark"
REMAIN=$(( ${AR_BUDGET_S:-145} - ($(date +%s) - START) ))
QUICK=""
if [ $REMAIN -lt 60 ]; then QUICK="--quick"; fi
timeout $(( REMAIN > 25 ? REMAIN : 25 )) python -m bench.allreduce_bench --out "$OUT" $QUICK \
  > "$OUT/allreduce_bench.log" 2>&1
BENCH_RC=$?

echo
echo "================ all-reduce summary ($(( $(date +%s) - START )) s) ================"
echo "gpu tests: rc=$TESTS_RC  $(grep -E '[0-9]+ (passed|failed)' "$OUT/allreduce_gpu_tests.log" | tail -n 1)"
grep -E '(PASSED|FAILED|ERROR)( |$)' "$OUT/allreduce_gpu_tests.log" | grep '::' | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC"
if grep -q '^all-reduce latency' "$OUT/allreduce_bench.log"; then
  sed -n '/^all-reduce latency/,$p' "$OUT/allreduce_bench.log"
else
  tail -n 20 "$OUT/allreduce_bench.log"
fi
ls -la "$OUT"
