#!/usr/bin/env bash
# Everything the H200 session runs, in one call (from the repo root, with .device/ carried):
#   bash bench/device_all.sh [part ...]     parts: suite megakernel moe mla_bench allreduce kda mla dsv4 indexer ep
#                                           tests bench:megakernel bench:moe bench:ep bench:allreduce ...
#                                           bench:moe@r16 (moe again, with BENCH_ARGS_moe_r16 / BENCH_S_moe_r16)
# `tests` runs every GPU test file at once over the CPU cores (compiling dominates a GPU test; it
# needs pytest-xdist: carry its wheels in .whl/ - git-ignored, fetch them once per checkout with
#   python3 -m pip download -q --no-deps -d .whl pytest-xdist execnet
# and add ".whl" to the run's carry - else one worker, ~10x slower) with compute-sanitizer on the
# small megakernel case alongside; `bench:NAME` runs bench/NAME_bench.py alone (BENCH_S_NAME seconds at most) (timings need the
# GPU to themselves, so benches run one after another, after the tests).
# DEVICE_ALL_S (default 570) bounds the whole call: a part gets at most what is left of it.
# Each part writes into its own folder; everything is packed into $OUT/results.tgz (the device
# returns at most 8 files), and each part's summary is printed at the end.
set -u
cd "$(dirname "$0")/.."
source .device/prelude.sh
OUT=${OUT:-/tmp/out}
WORK=/tmp/device_all
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown}
PARTS=${*:-suite megakernel moe kda mla}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv > "$WORK/env.txt" 2>&1
python -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)" >> "$WORK/env.txt" 2>&1
cat "$WORK/env.txt"
START=$(date +%s)
DEADLINE=$(( START + ${DEVICE_ALL_S:-570} ))
# left N: N, or what is left before the deadline if less (at least 5 s)
left() { local r=$(( DEADLINE - $(date +%s) )); r=$(( r < $1 ? r : $1 )); echo $(( r > 5 ? r : 5 )); }
for part in $PARTS; do
  T0=$(date +%s)
  mkdir -p "$WORK/$part"
  case $part in
    tests)
      ls .whl/*.whl >/dev/null 2>&1 && python -m pip install -q --no-deps --no-index .whl/*.whl > "$WORK/tests/install.log" 2>&1
      # 12 workers on an H200 (141 GB); 8 on an 80 GB card, where 12 ran one test out of memory
      # (test_moe_layer_tensor_core_experts[deepseek_v41_flash-8], H100, 2026-12-07)
      GB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
      DEFAULT_WORKERS=12; [ "${GB:-0}" -lt 100000 ] && DEFAULT_WORKERS=8
      WORKERS=1; python -c "import xdist" 2>/dev/null && WORKERS=${TEST_WORKERS:-$DEFAULT_WORKERS}
      TIMEOUT_FLAG=""; python -c "import pytest_timeout" 2>/dev/null && TIMEOUT_FLAG="--timeout ${TEST_TIMEOUT_S:-180}"
      # SANITIZE=0: no compute-sanitizer beside the tests (it shares the GPU with them; part 29 of the
      # thirty-sixth session finished 2 of 18 tests in 150 s beside it - whether it was the cause
      # is what a run without it tells)
      if [ "${SANITIZE:-1}" = 0 ]; then echo "sanitizer skipped (SANITIZE=0)" > "$WORK/tests/sanitizer.log"
      elif command -v compute-sanitizer >/dev/null 2>&1; then
        ( for tool in memcheck racecheck; do
            echo "---- $tool"; timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 python bench/sanitize_case.py
            echo "$tool rc=$?"; done ) > "$WORK/tests/sanitizer.log" 2>&1 &
      else echo "compute-sanitizer not found" > "$WORK/tests/sanitizer.log"; fi
      # SIGINT at the limit: pytest stops (under xdist without its final summary)
      timeout -s INT -k 15 $(left ${TESTS_S:-330}) python -m pytest -m gpu ${GPU_TESTS:-tests/gpu} -n $WORKERS $TIMEOUT_FLAG -v -rfE \
        -p no:cacheprovider --durations=15 > "$WORK/tests/gpu_tests.log" 2>&1
      echo "pytest rc=$? workers=$WORKERS" >> "$WORK/tests/gpu_tests.log"
      wait
      # -v: each test's outcome as it ends ("[gw3] [ 16%] FAILED tests/..."), so that a run cut off
      # at its limit (no final summary: 2026-12-05) still names its failures
      { grep -E "(^| )(FAILED|ERROR) tests/" "$WORK/tests/gpu_tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' \
          | sort -u | cut -c1-300 | head -n 40
        grep -E "passed|failed" "$WORK/tests/gpu_tests.log" | tail -n 1; tail -n 1 "$WORK/tests/gpu_tests.log"
        grep -E "rc=|ERROR SUMMARY" "$WORK/tests/sanitizer.log"; } > "$WORK/tests/summary.txt" ;;
    bench:*)
      # BENCH_S_<name> bounds it (default 200 s); BENCH_ARGS_<name> adds arguments (e.g. --quick)
      # bench:NAME@TAG runs NAME again with its own BENCH_S_NAME_TAG / BENCH_ARGS_NAME_TAG; BENCH_ENV_NAME[_TAG]
      # sets environment variables for it alone (VAR=value ...)
      tagged=${part#bench:}; name=${tagged%@*}; dir="$WORK/$part"
      limit_var=BENCH_S_${tagged/@/_}; args_var=BENCH_ARGS_${tagged/@/_}; env_var=BENCH_ENV_${tagged/@/_}
      eval "args=(${!args_var:-})"    # shell words: quoted arguments (Python literals) stay whole
      env ${!env_var:-} timeout $(left ${!limit_var:-200}) python -m bench.${name}_bench --out "$dir" "${args[@]}" \
        > "$dir/bench.log" 2>&1
      echo "rc=$?" >> "$dir/bench.log"
      for tl in "$dir"/timeline_*.json; do [ -f "$tl" ] && python -m bench.timeline "$tl" -o "${tl%.json}.png" --ops >> "$dir/bench.log" 2>&1; done
      { sed -n '/^copy bandwidth/,$p' "$dir/bench.log" | grep -q . && sed -n '/^copy bandwidth/,$p' "$dir/bench.log" || tail -n 25 "$dir/bench.log"; } > "$dir/summary.txt" ;;
    suite)  # the CPU suite on the device's Python/torch/transformers, then the reference on the GPU
      python -m pip install -q --no-deps --no-build-isolation -e . > "$WORK/suite/install.log" 2>&1
      timeout 240 python -m pytest -q -p no:cacheprovider -rs > "$WORK/suite/cpu_suite.log" 2>&1
      timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_reference_gpu.py \
        > "$WORK/suite/reference_gpu.log" 2>&1
      { grep -E "^SKIPPED" "$WORK/suite/cpu_suite.log" | cut -c1-160 | sort | uniq -c | head -n 8
        tail -n 1 "$WORK/suite/cpu_suite.log"; tail -n 1 "$WORK/suite/reference_gpu.log"; } > "$WORK/suite/summary.txt" ;;
    megakernel) [ -f bench/gpu_session.sh ] && OUT="$WORK/megakernel" MK_BUDGET_S=${MK_BUDGET_S:-215} timeout $(left $(( ${MK_BUDGET_S:-215} + 17 ))) bash bench/gpu_session.sh > "$WORK/megakernel/session.log" 2>&1
      sed -n '/= summary/,$p' "$WORK/megakernel/session.log" > "$WORK/megakernel/summary.txt" ;;
    moe) [ -f bench/moe_gpu_session.sh ] && OUT="$WORK/moe" MOE_BUDGET_S=${MOE_BUDGET_S:-145} timeout $(left $(( ${MOE_BUDGET_S:-145} + 13 ))) bash bench/moe_gpu_session.sh > "$WORK/moe/session.log" 2>&1
      tail -n 25 "$WORK/moe/session.log" > "$WORK/moe/summary.txt" ;;
    mla_bench) OUT="$WORK/mla_bench" timeout $(left 90) python -m bench.mla_bench --out "$WORK/mla_bench" --quick > "$WORK/mla_bench/session.log" 2>&1
      tail -n 25 "$WORK/mla_bench/session.log" > "$WORK/mla_bench/summary.txt" ;;
    allreduce) [ -f bench/allreduce_gpu_session.sh ] && OUT="$WORK/allreduce" timeout $(left 95) bash bench/allreduce_gpu_session.sh > "$WORK/allreduce/session.log" 2>&1
      tail -n 25 "$WORK/allreduce/session.log" > "$WORK/allreduce/summary.txt" ;;
    kda) [ -f bench/kda_gpu_session.sh ] && OUT="$WORK/kda" timeout $(left 200) bash bench/kda_gpu_session.sh > "$WORK/kda/session.log" 2>&1
      tail -n 25 "$WORK/kda/session.log" > "$WORK/kda/summary.txt" ;;
    dsv4) [ -f bench/dsv4_gpu_session.sh ] && OUT="$WORK/dsv4" timeout $(left 175) bash bench/dsv4_gpu_session.sh > "$WORK/dsv4/session.log" 2>&1
      tail -n 25 "$WORK/dsv4/session.log" > "$WORK/dsv4/summary.txt" ;;
    indexer) [ -f bench/indexer_gpu_session.sh ] && OUT="$WORK/indexer" timeout $(left 130) bash bench/indexer_gpu_session.sh > "$WORK/indexer/session.log" 2>&1
      tail -n 25 "$WORK/indexer/session.log" > "$WORK/indexer/summary.txt" ;;
    ep) [ -f bench/ep_gpu_session.sh ] && OUT="$WORK/ep" timeout $(left 130) bash bench/ep_gpu_session.sh > "$WORK/ep/session.log" 2>&1
      tail -n 25 "$WORK/ep/session.log" > "$WORK/ep/summary.txt" ;;
    mla) [ -f bench/mla_gpu_session.sh ] && OUT="$WORK/mla" timeout $(left 200) bash bench/mla_gpu_session.sh > "$WORK/mla/session.log" 2>&1
      tail -n 25 "$WORK/mla/session.log" > "$WORK/mla/summary.txt" ;;
  esac
  echo "[$part: $(( $(date +%s) - T0 )) s]" >> "$WORK/$part/summary.txt"
  tar -czf "$OUT/results.tgz" -C "$WORK" .   # after every part: a call cut off at its limit keeps what finished
done
for part in $PARTS; do echo; echo "######## $part"; cat "$WORK/$part/summary.txt" 2>/dev/null; done
echo; echo "total $(( $(date +%s) - START )) s"
