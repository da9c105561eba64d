#!/usr/bin/env bash
# The seventeenth session's device call (~580 s; carry [".device", ".whl"]):
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh > $OUT/all.log 2>&1
# 1. tests: the V4.1 sublayer cases (the fp8-window ones now fall back to 16-key decode chunks where
#    32 left the weight ring one stage), the MoE layer with the staged expert tiles (expert_smem_stages,
#    opt-in) and the real shards (the router's shared-memory counts, default since 2026-12-05), the
#    megakernel GEMV / stack tests (the fp8 GEMV's standalone rows: 16 where 8 made 8 KB chunks);
# 2. benches: the MoE layer at batch 1 (GLM-5.3, Kimi K3, V4.1-Flash) plain vs staged 3 / 2 deep;
#    the GEMVs with standalone_rows' defaults and the bf16 7168x2048 chunk variants (issue 3's 85%);
#    the V4.1 sublayers with V4.1's cache formats (HCA B=1, CSA B=8; plain measured the same day).
# The tests' parts are packed into $OUT/tests/results.tgz, the benches' into $OUT/results.tgz.
# A form that measures faster becomes the default (bench/NOTES.md says so); one that does not is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-575} TESTS_S=${TESTS_S:-235}

GPU_TESTS="tests/gpu/test_dsv4_layer_gpu.py::test_dsv4_sublayer_one_launch
  tests/gpu/test_moe_gpu.py::test_moe_layer_expert_smem_stages tests/gpu/test_moe_gpu.py::test_moe_layer_real_shard_one_launch
  tests/gpu/test_megakernel_gpu.py" OUT="$OUT/tests" DEVICE_ALL_S=$TESTS_S bash bench/device_all.sh tests

M='--no-timeline --cases glm_53:1:mxfp4,kimi_k3:1:mxfp4,deepseek_v41_flash:1:mxfp4'
export BENCH_ARGS_moe="$M" BENCH_S_moe=55 BENCH_ARGS_moe_s3="$M --set expert_smem_stages=3" BENCH_S_moe_s3=55 \
  BENCH_ARGS_moe_s2="$M --set expert_smem_stages=2" BENCH_S_moe_s2=55
G="[(18432, 7168, 1, 'fp8_e4m3', None, True), (4096, 7168, 1, 'fp8_e4m3', None, True), (7168, 2048, 1, 'fp8_e4m3', None, True),
 (18432, 7168, 1, 'fp8_e4m3', None, True, {'rows_per_tile': 32, 'chunk_k': 1024}), (18432, 7168, 1, 'bf16', None, True),
 (7168, 2048, 1, 'bf16', None, True), (7168, 2048, 1, 'bf16', None, True, {'chunk_k': 2048}),
 (7168, 2048, 1, 'bf16', 6, True, {'chunk_k': 2048}), (7168, 2048, 1, 'bf16', None, True, {'rows_per_tile': 16})]"
S="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
export BENCH_ARGS_megakernel="--parts gemv,stack --no-timeline --gemv-cases \"$G\" --stack-cases \"$S\"" BENCH_S_megakernel=70
D='--quick --match "sublayer hca B=1 ctx=32768$" --match "sublayer csa B=8 ctx=32768$"'
export BENCH_ARGS_dsv4_q="$D --set window_dtype=fp8_e4m3,comp_dtype=fp4_e2m1,index_dtype=mxfp4" BENCH_S_dsv4_q=80
DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:moe bench:moe@s3 bench:moe@s2 bench:megakernel \
  bench:dsv4@q
