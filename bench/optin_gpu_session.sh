#!/usr/bin/env bash
# The next device call (~580 s; carry [".device", ".whl"]), written at the end of the seventeenth session:
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh > $OUT/all.log 2>&1
# 1. the whole GPU suite (last whole run: 593eba8, 2026-12-04) with the sanitizers - the default
#    changes since: RouterSelect's counts in shared memory, the staged MXFP4 expert tiles below 8
#    tokens (auto_smem_stages), the standalone GEMV's rows and whole-K chunks (standalone_rows), the
#    V4.1 decode's 16-key fallback, the ring's lagged refill removed;
# 2. the standalone GEMVs (the new defaults beside the former ones: whole-K vs 1024-column chunks
#    for bf16 7168x2048, 16 vs 8 / 32 rows for fp8 18432x7168) and the fp8 stack L=8 I=2048 with its
#    timeline (57.7-59.0% of copy: which op or phase change takes the time);
# 3. the MoE layer at batch 1 with its timelines (the staged expert tiles' default): which phase
#    is now the longest (GLM-5.3 29.9 us = x5.2 the floor).
# The tests' parts are packed into $OUT/tests/results.tgz, the benches' into $OUT/results.tgz.
# A form that measures faster becomes the default (bench/NOTES.md says so); one that does not is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-575} TESTS_S=${TESTS_S:-390}

OUT="$OUT/tests" DEVICE_ALL_S=$TESTS_S bash bench/device_all.sh tests

S="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
export BENCH_ARGS_megakernel="--quick --parts gemv,stack --stack-cases \"$S\"" BENCH_S_megakernel=90
export BENCH_ARGS_moe='--cases glm_53:1:mxfp4,kimi_k3:1:mxfp4,deepseek_v41_flash:1:mxfp4' BENCH_S_moe=60
DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:megakernel bench:moe
