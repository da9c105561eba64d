#!/usr/bin/env bash
# MLA decode GPU session on the H200 (run from the repo root; the lead runs it), < 3 minutes:
#   bash bench/mla_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the MLA GPU tests (tests/gpu/test_mla_gpu.py), 2. the MLA benchmark (bench/mla_bench.py,
# --quick when little time is left), then a summary table.
source "$(dirname "$0")/session_lib.sh"
session_begin mla_env.txt

echo "== MLA GPU tests"
timeout 95 python -m pytest -m gpu tests/gpu/test_mla_gpu.py -q -rA -p no:cacheprovider --durations=8 \
  > "$OUT/mla_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/mla_gpu_tests.log" | head -n 20
tail -n 12 "$OUT/mla_gpu_tests.log"

echo "== MLA benchmark"
session_budget 170 100 30
timeout $LIMIT python -m bench.mla_bench --out "$OUT" $QUICK > "$OUT/mla_bench.log" 2>&1
BENCH_RC=$?

session_summary "MLA summary" "$OUT/mla_gpu_tests.log"
grep -E '^(PASSED|FAILED|ERROR)' "$OUT/mla_gpu_tests.log" | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC $QUICK"
show_from "copy bandwidth" "$OUT/mla_bench.log" 25
