#!/usr/bin/env bash
# Written in the fourteenth session for the next device calls (~580 s each; carry [".device", ".whl"]):
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh 1 > $OUT/all.log 2>&1
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh 2 > $OUT/all.log 2>&1
# Part 1:
# 1. the ring's lagged refill (SDK_RING_REFILL=lagged: one barrier a chunk): the GEMV / stack /
#    sublayer GPU tests under it (and the sanitizers), then lagged vs the default on the GEMVs, the
#    stack and the V4.1 HCA sublayer at batch 1;
# 2. fp8_decode="hfma2_alu" (the fp8 tiles' e4m3 -> f16 in integer ops) beside "hfma2" (GEMV 18432x7168
#    and the L=8 I=2048 stack; its GPU tests are in test_megakernel_gpu.py), and a sweep of the
#    CUDA-core fp8 GEMV's rows / chunk_k and the fp8 stack's tile rows (existing knobs, default form);
# 3. the MoE layer at batch 1 (GLM-5.3, Kimi K3) with and without the expert tiles' L2 prefetch
#    (expert_prefetch, sixteenth session; it replaced the attention program's decode-chunk check -
#    64 by default, measured better at B=8 / B=64 - which no longer fits the call).
# Part 2: V4.1's serving cache formats - the fp8 sliding-window records (window_dtype="fp8_e4m3"),
# the fp4 compressed entries (comp_dtype="fp4_e2m1") and V4.1's MXFP4 indexer (index_dtype="mxfp4":
# keys in pages of 64, MXFP4 queries, BF16 score stages; fifteenth / sixteenth sessions): their GPU
# tests (the decode core, the ring write bit for bit, the compressors' records, the score tile over
# the key pages, the SWA / HCA / CSA sublayers) and the
# sublayers with the formats and without (HCA B=1 / B=64, CSA B=8); the KDA streaming form in the
# megakernel with and without the lagged refill; the expert prefetch's GPU test (its benches: part 1).
# The tests' parts are packed into $OUT/lag_tests/results.tgz (part 2: $OUT/format_tests/), the
# benches' into $OUT/results.tgz.
# A form that measures faster becomes the default (bench/NOTES.md says so); one that does not is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PART=${1:-1}
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-580} TESTS_S=${TESTS_S:-190}

if [ "$PART" = 2 ]; then
  TESTS_S=${PART2_TESTS_S:-260}     # the formats' tests compile a few more sublayer programs
  GPU_TESTS="tests/gpu/test_dsv4_gpu.py tests/gpu/test_dsv4_layer_gpu.py tests/gpu/test_dsv4_compress_gpu.py
    tests/gpu/test_indexer_gpu.py::test_v4_csa_indexer_mxfp4_keys
    tests/gpu/test_moe_gpu.py::test_moe_layer_expert_prefetch" \
    OUT="$OUT/format_tests" DEVICE_ALL_S=$TESTS_S \
    bash bench/device_all.sh tests
  D='--quick --match "sublayer hca B=1 ctx=32768$" --match "sublayer hca B=64 ctx=32768$" --match "sublayer csa B=8 ctx=32768$"'
  export BENCH_ARGS_dsv4="$D" BENCH_S_dsv4=90 BENCH_ARGS_dsv4_q="$D --set window_dtype=fp8_e4m3,comp_dtype=fp4_e2m1,index_dtype=mxfp4" \
    BENCH_S_dsv4_q=90
  # the KDA streaming form in the megakernel (69-78% of copy; its chunks cross stream_tile too) under
  # the lagged refill
  K='--quick --match "megakernel layers stream v_split=4 hpt=4" --match "megakernel layers stream v_split=4 hpt=2"'
  export BENCH_ARGS_kda="$K" BENCH_S_kda=50 BENCH_ARGS_kda_lag="$K" BENCH_S_kda_lag=50 BENCH_ENV_kda_lag="SDK_RING_REFILL=lagged"
  # the score tile over bf16 keys vs mxfp4 records (v4_csa / v4_csa_mxfp4 at 32K, B=1 / 8)
  export BENCH_ARGS_indexer='--quick --match v4_csa' BENCH_S_indexer=50
  DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:dsv4 bench:dsv4@q bench:indexer bench:kda \
    bench:kda@lag
  exit 0
fi

SDK_RING_REFILL=lagged GPU_TESTS="tests/gpu/test_megakernel_gpu.py tests/gpu/test_dsv4_layer_gpu.py
  tests/gpu/test_mla_layer_gpu.py tests/gpu/test_kda_layer_gpu.py tests/gpu/test_mla_gpu.py::test_attention_program_one_launch" \
  OUT="$OUT/lag_tests" DEVICE_ALL_S=$TESTS_S bash bench/device_all.sh tests
L="SDK_RING_REFILL=lagged"
G="[(18432, 7168, 1, 'bf16', None, True), (7168, 2048, 1, 'bf16', None, True), (18432, 7168, 1, 'fp8_e4m3', None, True)]"
S="[{'intermediate': 2048, 'layers': 8}, {'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
export BENCH_ARGS_megakernel="--parts gemv,stack --no-timeline --gemv-cases \"$G\" --stack-cases \"$S\"" BENCH_S_megakernel=50
export BENCH_ARGS_megakernel_lag="$BENCH_ARGS_megakernel" BENCH_S_megakernel_lag=50 BENCH_ENV_megakernel_lag="$L"
GS="[(18432, 7168, 1, 'fp8_e4m3', None, True, {'fp8_decode': 'hfma2_alu'}), (18432, 7168, 1, 'fp8_e4m3', None, True, {'rows_per_tile': 16}), (18432, 7168, 1, 'fp8_e4m3', None, True, {'rows_per_tile': 32}),
 (18432, 7168, 1, 'fp8_e4m3', None, True, {'rows_per_tile': 32, 'chunk_k': 1024}), (18432, 7168, 1, 'fp8_e4m3', None, True, {'rows_per_tile': 32, 'mma': True})]"
SS="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3', 'fp8_decode': 'hfma2_alu'},
 {'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3', 'gateup_rows': 32}, {'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3', 'down_rows': 32}]"
export BENCH_ARGS_megakernel_sweep="--parts gemv,stack --no-timeline --gemv-cases \"$GS\" --stack-cases \"$SS\"" BENCH_S_megakernel_sweep=90
D='--quick --match "sublayer hca B=1 ctx=32768$"'
export BENCH_ARGS_dsv4="$D" BENCH_S_dsv4=45 BENCH_ARGS_dsv4_lag="$D" BENCH_S_dsv4_lag=45 BENCH_ENV_dsv4_lag="$L"
# the MoE layer at batch 1 with and without the expert tiles' L2 prefetch (expert_prefetch,
# sixteenth session: the SASS shows a row's loads issued in 4 waves) - issue 4's largest gap (GLM-5.3
# x5.7 the floor); each run's rel err against the reference is in its JSON (the GPU test is in part 2)
M='--no-timeline --cases glm_53:1:mxfp4,kimi_k3:1:mxfp4'
export BENCH_ARGS_moe="$M" BENCH_S_moe=70 BENCH_ARGS_moe_pf="$M --set expert_prefetch=1" BENCH_S_moe_pf=70
DEVICE_ALL_S=$(( DEVICE_ALL_S - TESTS_S )) bash bench/device_all.sh bench:megakernel bench:megakernel@lag bench:moe \
  bench:moe@pf bench:megakernel@sweep bench:dsv4 bench:dsv4@lag
