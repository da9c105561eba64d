#!/usr/bin/env bash
# KDA block GPU session on the H200 (run from the repo root; the lead runs it; < 3 minutes):
#   bash bench/kda_gpu_session.sh          # logs + JSON under $OUT (default /tmp/out)
# 1. GPU tests of the block (tests/gpu/test_kda_gpu.py): vs the fp32 reference, K3 / GLM-5.3 TP8
#    shapes, batch 1/8/64, ragged commit, NaN poison, 10,000-step bf16-state drift (JSON);
# 2. bench/kda_bench.py --quick: us, GB/s, fraction of the floor, torch CUDA-graph speed-up;
# 3. a summary table.
source .device/prelude.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
START=$(date +%s)
{
  echo "commit $GIT_COMMIT"; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
  python -c "import torch, cutlass; print('torch', torch.__version__, 'cutlass-dsl', getattr(cutlass, '__version__', '?'))"
} > "$OUT/env.txt" 2>&1

echo "== KDA GPU tests"
KDA_DRIFT_JSON="$OUT/kda_drift.json" timeout 100 python -m pytest -m gpu tests/gpu/test_kda_gpu.py -q -rA -s \
  -p no:cacheprovider --durations=6 > "$OUT/kda_gpu_tests.log" 2>&1
TESTS_RC=$?
tail -n 15 "$OUT/kda_gpu_tests.log"

echo "== KDA bench"
REMAIN=$(( 170 - ($(date +%s) - START) ))
timeout $(( REMAIN > 40 ? REMAIN : 40 )) python -m bench.kda_bench --out "$OUT" --quick > "$OUT/kda_bench.log" 2>&1
BENCH_RC=$?

echo
echo "================ KDA summary ($(( $(date +%s) - START )) s) ================"
echo "gpu tests: rc=$TESTS_RC  $(grep -E '[0-9]+ (passed|failed)' "$OUT/kda_gpu_tests.log" | tail -n 1)"
grep -E "^(FAILED|ERROR)" "$OUT/kda_gpu_tests.log" | head -n 8
if [ -f "$OUT/kda_drift.json" ]; then
  python -c "
import json; r = json.load(open('$OUT/kda_drift.json'))
for sd, d in r['drift'].items():
    print(f\"drift {r['steps']} steps, {sd} state: max rel err o {d['max_rel_err_o']:.2e}, final {d['final_rel_err_o']:.2e}, final state {d['final_rel_err_state']:.2e}\")"
fi
echo "bench: rc=$BENCH_RC"
sed -n '/^copy bandwidth/,$p' "$OUT/kda_bench.log" | grep -q . && sed -n '/^copy bandwidth/,$p' "$OUT/kda_bench.log" \
  || tail -n 25 "$OUT/kda_bench.log"
ls -la "$OUT"
