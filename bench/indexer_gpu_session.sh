#!/usr/bin/env bash
# Indexer (DSA / CSA scores + top-k) and GLM-5.3 sparse MLA GPU session on the H200 (run from the repo
# root; the lead runs it), < 2 minutes:
#   bash bench/indexer_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. the GPU tests (tests/gpu/test_indexer_gpu.py), 2. the benchmark (bench/indexer_bench.py, --quick
# when little time is left), then a summary table.
source "$(dirname "$0")/session_lib.sh"
session_begin indexer_env.txt

echo "== indexer GPU tests"
timeout 70 python -m pytest -m gpu tests/gpu/test_indexer_gpu.py -q -rA -p no:cacheprovider --durations=8 \
  > "$OUT/indexer_gpu_tests.log" 2>&1
TESTS_RC=$?
grep -E "^(FAILED|ERROR)|Error|error" "$OUT/indexer_gpu_tests.log" | head -n 20
tail -n 12 "$OUT/indexer_gpu_tests.log"

echo "== indexer benchmark"
session_budget 115 70 25
timeout $LIMIT python -m bench.indexer_bench --out "$OUT" $QUICK > "$OUT/indexer_bench.log" 2>&1
BENCH_RC=$?

session_summary "indexer summary" "$OUT/indexer_gpu_tests.log"
grep -E '^(PASSED|FAILED|ERROR)' "$OUT/indexer_gpu_tests.log" | sed 's/^/  /' | head -40
echo "bench: rc=$BENCH_RC $QUICK"
show_from "copy bandwidth" "$OUT/indexer_bench.log" 25
