#!/usr/bin/env bash
# The opt-in forms written at the end of the thirteenth session (compiled and CPU-tested, never run
# on the H200), each beside its default, in ONE device call (~550 s; carry [".device", ".whl"]):
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh > $OUT/all.log 2>&1
# 1. the ring's bulk form (SDK_RING_COPIES=bulk): the GEMV / stack / DSV4 and MLA sublayer GPU tests
#    under it, then bulk vs cp.async: the standalone bf16 / fp8 GEMVs and the one-launch stack
#    (bench:megakernel), the V4.1 HCA / CSA sublayers at batch 1 (bench:dsv4), Kimi K3's MLA
#    sublayer and MoE layer at batch 1 (bench:mla, bench:moe);
# 2. MLAAttentionConfig.decode_chunk=64: the attention program's GPU test (its chunk-64 case), then
#    the program at B=64 32K / B=8 128K with 32- and 64-token decode chunks.
# The tests' parts are packed into $OUT/bulk_tests/results.tgz, the benches' into $OUT/results.tgz.
# Each form that measures faster becomes the default (bench/NOTES.md says so); one that does not
# is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-545} TESTS_S=${TESTS_S:-140}

# the tests first, under the bulk form (one device_all run: the environment applies to its pytest)
SDK_RING_COPIES=bulk GPU_TESTS="tests/gpu/test_megakernel_gpu.py tests/gpu/test_dsv4_layer_gpu.py
  tests/gpu/test_mla_layer_gpu.py tests/gpu/test_mla_gpu.py::test_attention_program_one_launch" \
  OUT="$OUT/bulk_tests" DEVICE_ALL_S=$TESTS_S bash bench/device_all.sh tests
# the benches, most wanted first (device_all gives a part at most what is left of the call)
B="SDK_RING_COPIES=bulk"
G="[(18432, 7168, 1, 'bf16', None, True), (7168, 2048, 1, 'bf16', None, True), (18432, 7168, 1, 'fp8_e4m3', None, True)]"
S="[{'intermediate': 2048, 'layers': 8}, {'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
export BENCH_ARGS_megakernel="--parts gemv,stack --no-timeline --gemv-cases \"$G\" --stack-cases \"$S\"" BENCH_S_megakernel=50
export BENCH_ARGS_megakernel_bulk="$BENCH_ARGS_megakernel" BENCH_S_megakernel_bulk=50 BENCH_ENV_megakernel_bulk="$B"
D='--quick --match "sublayer hca B=1 ctx=32768$" --match "sublayer csa B=1 ctx=32768$"'
export BENCH_ARGS_dsv4="$D" BENCH_S_dsv4=60 BENCH_ARGS_dsv4_bulk="$D" BENCH_S_dsv4_bulk=60 BENCH_ENV_dsv4_bulk="$B"
P="kimi_k3_tp8:32768:64:program,kimi_k3_tp8:131072:8:program"
export BENCH_ARGS_mla="--cases kimi_k3_tp8:32768:1:sublayer,$P" BENCH_S_mla=60 \
  BENCH_ARGS_mla_bulk="--cases kimi_k3_tp8:32768:1:sublayer --timeline" BENCH_S_mla_bulk=30 BENCH_ENV_mla_bulk="$B" \
  BENCH_ARGS_mla_c64="--cases $P --set decode_chunk=64,decode_stages=0" BENCH_S_mla_c64=45
export BENCH_ARGS_moe="--cases kimi_k3:1:mxfp4 --no-timeline" BENCH_S_moe=40 \
  BENCH_ARGS_moe_bulk="--cases kimi_k3:1:mxfp4 --no-timeline" BENCH_S_moe_bulk=40 BENCH_ENV_moe_bulk="$B"
DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:megakernel bench:megakernel@bulk bench:dsv4 \
  bench:dsv4@bulk bench:mla bench:mla@bulk bench:mla@c64 bench:moe bench:moe@bulk
