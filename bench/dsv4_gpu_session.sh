#!/usr/bin/env bash
# DeepSeek-V4 attention + mHC GPU session on the H200 (run from the repo root; the lead runs it), < 3 minutes:
#   bash bench/dsv4_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the DSV4 GPU tests (tests/gpu/test_mhc_gpu.py tests/gpu/test_dsv4_gpu.py), 2. the DSV4 benchmark (bench/dsv4_bench.py,
# --quick when little time is left), then a summary table.
source "$(dirname "$0")/session_lib.sh"
session_begin dsv4_env.txt

echo "== DSV4 GPU tests"
timeout 95 python -m pytest -m gpu tests/gpu/test_mhc_gpu.py tests/gpu/test_dsv4_gpu.py -q -rA -p no:cacheprovider --durations=8 \
  > "$OUT/dsv4_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/dsv4_gpu_tests.log" | head -n 20
tail -n 12 "$OUT/dsv4_gpu_tests.log"

echo "== DSV4 benchmark"
session_budget 170 100 30
timeout $LIMIT python -m bench.dsv4_bench --out "$OUT" $QUICK > "$OUT/dsv4_bench.log" 2>&1
BENCH_RC=$?

session_summary "DSV4 summary" "$OUT/dsv4_gpu_tests.log"
grep -E '^(PASSED|FAILED|ERROR)' "$OUT/dsv4_gpu_tests.log" | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC $QUICK"
show_from "copy bandwidth" "$OUT/dsv4_bench.log" 25
