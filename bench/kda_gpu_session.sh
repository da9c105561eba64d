#!/usr/bin/env bash
# KDA block GPU session on the H200 (run from the repo root; the lead runs it; < 3 minutes):
#   bash bench/kda_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. GPU tests of the block (tests/gpu/test_kda_gpu.py): vs the fp32 reference, K3 / GLM-5.3 TP8
#    shapes, batch 1/8/64, ragged commit, NaN poison, 10,000-step bf16-state drift (JSON);
# 2. bench/kda_bench.py --quick: us, GB/s, fraction of the floor, torch CUDA-graph speed-up;
# 3. a summary table.
source "$(dirname "$0")/session_lib.sh"
session_begin env.txt

echo "== KDA GPU tests"
KDA_DRIFT_JSON="$OUT/kda_drift.json" timeout 100 python -m pytest -m gpu tests/gpu/test_kda_gpu.py -q -rA -s \
  -p no:cacheprovider --durations=6 > "$OUT/kda_gpu_tests.log" 2>&1
TESTS_RC=$?
tail -n 15 "$OUT/kda_gpu_tests.log"

echo "== KDA bench"
session_budget 170 0 40     # always --quick below: QUICK unused
timeout $LIMIT python -m bench.kda_bench --out "$OUT" --quick > "$OUT/kda_bench.log" 2>&1
BENCH_RC=$?

session_summary "KDA summary" "$OUT/kda_gpu_tests.log"
grep -E "^(FAILED|ERROR)" "$OUT/kda_gpu_tests.log" | head -n 8
if [ -f "$OUT/kda_drift.json" ]; then
  python -c "
import json; r = json.load(open('$OUT/kda_drift.json'))
for sd, d in r['drift'].items():
    print(f\"drift {r['steps']} steps, {sd} state: max rel err o {d['max_rel_err_o']:.2e}, final {d['final_rel_err_o']:.2e}, final state {d['final_rel_err_state']:.2e}\")"
fi
echo "bench: rc=$BENCH_RC"
show_from "copy bandwidth" "$OUT/kda_bench.log" 25
ls -la "$OUT"
