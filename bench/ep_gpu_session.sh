#!/usr/bin/env bash
# Expert-parallel MoE GPU session on the H200 (run from the repo root; the lead runs it), < 2 minutes:
#   bash bench/ep_gpu_session.sh        # logs + JSON under $OUT (default /tmp/out)
# 1. the EP GPU tests (tests/gpu/test_ep_gpu.py: EP MoE layer over N=2,4,8 virtual ranks vs the
#    single-rank reference, skewed routing, missing rank -> KernelTimeoutError, 20 launches
#    without reset),
# 2. the EP latency benchmark (bench/ep_bench.py: dispatch + combine per MoE layer at batch 1, 8,
#    64 over N=8 virtual ranks; peer stores go to local HBM: instruction overhead, not NVLink),
#    then a summary table.
source "$(dirname "$0")/session_lib.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-8}   # one hardware queue per virtual rank
session_begin ep_env.txt

echo "== EP GPU tests"
timeout 70 python -m pytest -m gpu tests/gpu/test_ep_gpu.py -v -p no:cacheprovider --durations=10 \
  > "$OUT/ep_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/ep_gpu_tests.log" | head -30

echo "== EP benchmark"
session_budget ${EP_BUDGET_S:-115} 40 25
timeout $LIMIT python -m bench.ep_bench --out "$OUT" $QUICK > "$OUT/ep_bench.log" 2>&1
BENCH_RC=$?

session_summary "EP summary" "$OUT/ep_gpu_tests.log"
grep -E '(PASSED|FAILED|ERROR)( |$)' "$OUT/ep_gpu_tests.log" | grep '::' | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC"
show_from "EP latency" "$OUT/ep_bench.log" 20
ls -la "$OUT"
