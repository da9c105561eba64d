#!/usr/bin/env bash
# The opt-in forms written at the end of the twelfth session (compiled and CPU-tested, never run on
# the H200), each beside its default, in ONE device call (~550 s; carry [".device", ".whl"]):
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh > $OUT/all.log 2>&1
# (device_all packs its parts into $OUT/results.tgz; the ncu summaries land in $OUT beside it)
# 1. their GPU tests (bench/device_all.sh `tests`, with the sanitizers' small case),
# 2. the V4.1 CSA sublayer B=1: default / TopKConfig.loads=32 + branchless / index_q_rows=32,
# 3. the Kimi K3 MLA sublayer B=1: default / head_proj_in_flight; GLM-5.3's DSA sublayer B=1 with all
#    three of its forms (timelines for each),
# 4. the wgmma fp8 GEMV and stack: default / x_smem_max=16384,
# 5. Nsight Compute of the top-k tile alone, default vs loads=32 + branchless (bench/NOTES.md:
#    17.9 us with neither).
# Each form that measures faster becomes the default (and its NOTES entry says so).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export GIT_COMMIT=${GIT_COMMIT:-unknown}
export DEVICE_ALL_S=${DEVICE_ALL_S:-480} TESTS_S=${TESTS_S:-150}
export GPU_TESTS="tests/gpu/test_indexer_gpu.py::test_topk_score_distributions tests/gpu/test_mla_gpu.py::test_head_proj_blocks
  tests/gpu/test_mla_layer_gpu.py tests/gpu/test_megakernel_gpu.py::test_gemv_fp8_wgmma
  tests/gpu/test_megakernel_gpu.py::test_mlp_stack_fp8_wgmma"

CSA='--quick --match "sublayer csa B=1"'
export BENCH_ARGS_dsv4="$CSA" BENCH_S_dsv4=50
export BENCH_ARGS_dsv4_topk="$CSA --set topk_loads=32,topk_branchless=1" BENCH_S_dsv4_topk=50
export BENCH_ARGS_dsv4_iq="$CSA --set index_q_rows=32" BENCH_S_dsv4_iq=50
export BENCH_ARGS_mla="--cases kimi_k3_tp8:32768:1:sublayer,glm_53_tp8:32768:1:dsa_sublayer --timeline" BENCH_S_mla=60
export BENCH_ARGS_mla_hp="--cases kimi_k3_tp8:32768:1:sublayer --set head_proj_in_flight=1 --timeline" BENCH_S_mla_hp=40
export BENCH_ARGS_mla_dsa="--cases glm_53_tp8:32768:1:dsa_sublayer --timeline
  --set topk_loads=32,topk_branchless=1,head_proj_in_flight=1" BENCH_S_mla_dsa=45
WG="'fp8_e4m3', None, True, {'fp8_decode': 'wgmma', 'rows_per_tile': 32"
ST="{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3', 'fp8_decode': 'wgmma'"
export BENCH_ARGS_megakernel_xs="--parts gemv,stack --no-timeline
  --gemv-cases \"[(18432, 7168, 1, $WG}), (18432, 7168, 1, $WG, 'x_smem_max': 16384})]\"
  --stack-cases \"[$ST}, $ST, 'x_smem_max': 16384}]\"" BENCH_S_megakernel_xs=90

bash bench/device_all.sh tests bench:dsv4 bench:dsv4@topk bench:dsv4@iq bench:mla bench:mla@hp bench:mla@dsa \
  bench:megakernel@xs

for form in "" "loads=32,branchless=1"; do
  name=ncu_topk_${form:+optin}
  timeout 45 ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    python -m bench.profile_block topk 8256 512 $form > "$OUT/${name%_}.txt" 2>&1
  grep -E "Duration|Issued Warp" "$OUT/${name%_}.txt"
done
