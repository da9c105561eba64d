#!/usr/bin/env bash
# MoE GPU session on the H200 (run from the repo root; the lead runs it), < 4 minutes:
#   bash bench/moe_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the MoE GPU tests (tests/gpu/test_moe_gpu.py), 2. the MoE benchmark (bench/moe_bench.py),
# then a summary table.
source "$(dirname "$0")/session_lib.sh"
session_begin moe_env.txt

echo "== MoE GPU tests"
# MOE_TESTS: a -k expression selecting tests (default: all); each test at most 60 s
timeout $(( ${MOE_BUDGET_S:-225} * 2 / 3 )) python -m pytest -m gpu tests/gpu/test_moe_gpu.py -v -p no:cacheprovider \
  --durations=10 --timeout 60 ${MOE_TESTS:+-k "$MOE_TESTS"} > "$OUT/moe_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/moe_gpu_tests.log" | head -30

echo "== MoE benchmark"
session_budget ${MOE_BUDGET_S:-225} 120 40
timeout $LIMIT python -m bench.moe_bench --out "$OUT" $QUICK > "$OUT/moe_bench.log" 2>&1
BENCH_RC=$?

session_summary "MoE summary" "$OUT/moe_gpu_tests.log"
grep -E '(PASSED|FAILED|ERROR)( |$)' "$OUT/moe_gpu_tests.log" | grep '::' | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC"
if grep -q '^copy bandwidth' "$OUT/moe_bench.log"; then
  sed -n '/^copy bandwidth/,$p' "$OUT/moe_bench.log"
else
  grep -E '^(GPU|moe )' "$OUT/moe_bench.log"; tail -n 15 "$OUT/moe_bench.log"
fi
ls -la "$OUT"
