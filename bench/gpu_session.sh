#!/usr/bin/env bash
# One GPU session on the H200 (run from the repo root; the lead runs it):
#   bash bench/gpu_session.sh            # writes logs + JSON under $OUT (default /tmp/out)
# In order: GPU tests (<= 270 s), compute-sanitizer memcheck + racecheck on small megakernel cases (if the
# tool exists, <= 110 s each), the benchmarks (what is left of 525 s; JSON written after every case);
# then a summary table. Budget: < 9 minutes in all.
source "$(dirname "$0")/session_lib.sh"
session_begin env.txt

echo "== GPU tests"
timeout 270 python -m pytest -m gpu tests/gpu/test_megakernel_gpu.py -q -rA -p no:cacheprovider --durations=8 > "$OUT/gpu_tests.log" 2>&1
TESTS_RC=$?
tail -n 30 "$OUT/gpu_tests.log"

SAN="not run (compute-sanitizer not found)"
if command -v compute-sanitizer >/dev/null 2>&1; then
  echo "== compute-sanitizer"
  : > "$OUT/sanitizer.log"
  SAN=""
  for tool in memcheck racecheck; do
    echo "---- $tool" >> "$OUT/sanitizer.log"
    timeout 110 compute-sanitizer --tool $tool --error-exitcode 3 python bench/sanitize_case.py >> "$OUT/sanitizer.log" 2>&1
    rc=$?
    SAN="$SAN $tool=rc$rc"
    tail -n 4 "$OUT/sanitizer.log"
  done
fi

echo "== benchmarks"
session_budget ${MK_BUDGET_S:-525} 200 30
timeout $LIMIT python -m bench.megakernel_bench --out "$OUT" $QUICK > "$OUT/bench.log" 2>&1
BENCH_RC=$?
if [ -f "$OUT/timeline_mlp_stack.json" ]; then
  python -m bench.timeline "$OUT/timeline_mlp_stack.json" -o "$OUT/timeline_mlp_stack.png" >> "$OUT/bench.log" 2>&1 \
    || echo "(timeline PNG not rendered here: render it on CPU with python -m bench.timeline)"
fi

session_summary "summary" "$OUT/gpu_tests.log" '^[0-9]+ (passed|failed)|passed|failed'
echo "sanitizer:$SAN"
echo "bench: rc=$BENCH_RC"
sed -n '/^copy bandwidth/,$p' "$OUT/bench.log" || tail -n 20 "$OUT/bench.log"
[ $BENCH_RC -eq 0 ] || tail -n 20 "$OUT/bench.log"
ls -la "$OUT"
