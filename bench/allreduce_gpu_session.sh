#!/usr/bin/env bash
# All-reduce GPU session on the H200 (run from the repo root; the lead runs it), < 2.5 minutes:
#   bash bench/allreduce_gpu_session.sh        # logs + JSON under $OUT (default /tmp/out)
# 1. the all-reduce GPU tests (tests/gpu/test_allreduce_gpu.py: TP-sharded MLP stack N=2,4,8,
#    chains, missing rank -> KernelTimeoutError, 20 launches without reset),
# 2. the latency benchmark (bench/allreduce_bench.py: 8 KB .. 1 MB, N=8 virtual ranks; peer
#    stores go to local HBM: instruction overhead, not NVLink), then a summary table.
source "$(dirname "$0")/session_lib.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}   # one hardware queue per virtual rank
session_begin allreduce_env.txt

echo "== all-reduce GPU tests"
timeout 100 python -m pytest -m gpu tests/gpu/test_allreduce_gpu.py -v -p no:cacheprovider --durations=10 \
  > "$OUT/allreduce_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/allreduce_gpu_tests.log" | head -30

echo "== all-reduce benchmark"
session_budget ${AR_BUDGET_S:-145} 60 25
timeout $LIMIT python -m bench.allreduce_bench --out "$OUT" $QUICK \
  > "$OUT/allreduce_bench.log" 2>&1
BENCH_RC=$?

session_summary "all-reduce summary" "$OUT/allreduce_gpu_tests.log"
grep -E '(PASSED|FAILED|ERROR)( |$)' "$OUT/allreduce_gpu_tests.log" | grep '::' | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC"
show_from "all-reduce latency" "$OUT/allreduce_bench.log" 20
ls -la "$OUT"
