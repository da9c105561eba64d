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
# Part 2 (`bash bench/optin_gpu_session.sh 2`, ~300 s), written in the eighteenth session: the V4.1
# HCA attention sublayer at 32K, batch 1 and 8, plain vs in its mHC residual - "v4" (the collapse
# after this site's coefficients) and V4.1's lagged "v41" (the collapse its own op, the coefficients
# beside the sublayer) - with timelines at batch 1: what the mHC ends cost, and whether the lag
# takes the coefficients off the sublayer's path. Its tests (test_dsv4_sublayer_in_mhc_one_launch,
# the lagged cases of test_mhc_two_sites_one_launch) run in part 1's suite. Then the whole V4.1
# decoder layer in one launch (bench/layer_bench.py: HCA / CSA attention + MoE, each in its lagged
# mHC site) against the same two programs launched one after the other, PyTorch and the floor.
# Part 3 (`bash bench/optin_gpu_session.sh 3`): the whole DeepSeek-V4.1 model (small_v41), the
# whole Kimi K3 model (small; nineteenth session: the plain residual chain) and the whole GLM-5.3
# model (small; nineteenth session: KDA / DSA / dense sites, the shared indexer, the mean head) as
# ONE launch a decode step - their GPU tests (test_sublayer_modes_gpu.py: the in-place and site
# sublayer forms alone first, then test_plain_model_gpu.py, test_glm_model_gpu.py,
# test_dsv4_model_gpu.py, test_mhc_layer_gpu.py; twentieth session: test_plain_model_gpu.py also runs Kimi K3 over
# 2 tensor-parallel virtual ranks). Part 4 (`bash bench/optin_gpu_session.sh 4`): bench/model_bench.py on
# the three (us per step vs the reference and the floor, timeline at batch 1), then K3 with --tp 2.
# The tests' parts are packed into $OUT/tests/results.tgz, the benches' into $OUT/results.tgz.
# A form that measures faster becomes the default (bench/NOTES.md says so); one that does not is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-575} TESTS_S=${TESTS_S:-390}

if [ "${1:-1}" = 3 ]; then   # the whole models in one launch a step: their tests
  GPU_TESTS="tests/gpu/test_sublayer_modes_gpu.py tests/gpu/test_plain_model_gpu.py tests/gpu/test_glm_model_gpu.py \
    tests/gpu/test_dsv4_model_gpu.py tests/gpu/test_mhc_layer_gpu.py" TESTS_S=550 OUT="$OUT/tests" DEVICE_ALL_S=560 bash bench/device_all.sh tests
  exit
fi

if [ "${1:-1}" = 4 ]; then   # ... and their bench; then Kimi K3 and GLM-5.3 over 2 TP ranks (virtual, 66 SMs each)
  BENCH_S_model=380 BENCH_S_model_tp2=170 BENCH_ARGS_model_tp2="--tp 2" DEVICE_ALL_S=560 \
    bash bench/device_all.sh bench:model bench:model@tp2
  exit
fi

if [ "${1:-1}" = 2 ]; then
  M='--match "sublayer hca B=1 ctx=32768$" --match "sublayer hca B=8 ctx=32768$"'
  export BENCH_ARGS_dsv4="$M" BENCH_ARGS_dsv4_v4="$M --set mhc=v4" BENCH_ARGS_dsv4_v41="$M --set mhc=v41,q_head_norm=0"
  export BENCH_S_dsv4=90 BENCH_S_dsv4_v4=90 BENCH_S_dsv4_v41=90 BENCH_S_layer=240
  DEVICE_ALL_S=575 bash bench/device_all.sh bench:dsv4 bench:dsv4@v4 bench:dsv4@v41 bench:layer
  exit
fi

# the whole-model and layer-join tests (long compiles) run in part 3
GPU_TESTS=$(ls tests/gpu/test_*.py | grep -v -e test_dsv4_model_gpu -e test_mhc_layer_gpu -e test_plain_model_gpu \
  -e test_glm_model_gpu -e test_sublayer_modes_gpu | tr '\n' ' ') \
  OUT="$OUT/tests" DEVICE_ALL_S=$TESTS_S bash bench/device_all.sh tests

S="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
export BENCH_ARGS_megakernel="--quick --parts gemv,stack --stack-cases \"$S\"" BENCH_S_megakernel=90
export BENCH_ARGS_moe='--cases glm_53:1:mxfp4,kimi_k3:1:mxfp4,deepseek_v41_flash:1:mxfp4' BENCH_S_moe=60
DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:megakernel bench:moe
