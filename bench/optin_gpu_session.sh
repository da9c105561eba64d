#!/usr/bin/env bash
# The device calls of the next GPU session, one part per call (~580 s; carry [".device", ".whl"]):
#   source .device/prelude.sh && GIT_COMMIT=<sha> bash bench/optin_gpu_session.sh N > $OUT/all.log 2>&1
# 1 (default): the GPU suite but the whole-model files, with the sanitizers (TESTS_S 540: at 380 s
#    it reached 428 of ~465 tests on the H100, 2026-12-05 - 8 failed there, unnamed: the tests now
#    run -v, so they are named even if the limit cuts the run).
# 2: the V4.1 HCA attention sublayer at 32K, batch 1 and 8, plain vs in its mHC residual - "v4"
#    (the collapse after this site's coefficients) and V4.1's lagged "v41" - with timelines at
#    batch 1; then the whole V4.1 decoder layer in one launch (bench/layer_bench.py) against the
#    same two programs launched one after the other, PyTorch and the floor.
# 3: the whole models' GPU tests - test_sublayer_modes_gpu.py, test_plain_model_gpu.py (Kimi K3),
#    test_glm_model_gpu.py, test_dsv4_model_gpu.py (each at B=1 / 8, one GPU and 2 TP virtual
#    ranks), test_mhc_layer_gpu.py: 25/25 on the H100 at ef96324 (2026-12-05); and test_mhc_gpu.py
#    (the mHC blocks: the twenty-second session's pre tile, v4 coefficient op and prologue staging).
# 4: bench/model_bench.py - the three small models' whole step at B=1 / 8 against the floor and
#    against the same step in PyTorch under a CUDA graph (the reference backend's capturable form,
#    written after the H100 run: its first timing), timelines at B=1.
# 5: bench/model_bench.py --tp 2 (each model over 2 virtual ranks, 66 SMs each).
# 6: the GEMV / fp8 stack / MoE benches (issues 3 and 4).
# 7: Kimi K3 "wide" (one TP8 / EP16 rank's real widths, 4 layers, one GPU, batch 1): its whole-model
#    GPU test, then bench/model_bench.py --wide - the first whole model at real widths.
# 8: the twenty-third session's device changes: the decode row groups (more than 32 query rows on
#    a tile's keys: Kimi K3's 96 heads, 12 heads x 3-4 speculative tokens, V4.1-Flash's and
#    GLM-5.3's 64 heads), the grouped GEMV (V4.1-Flash's o_a groups on one GPU / whole groups a
#    rank) and the instruction records' window (bit-equal to resident records) - their GPU tests, then bench/mla_bench.py at 32K / 128K, the 96-head shard against the
#    12-head one on the same keys (what the repeated key reads cost) and T = 4 against T = 1.
# 9: bench/model_bench.py --deep - Kimi K3 at small's widths and the full 61-layer depth, batch 1 and
#    8: a step of the full instruction count (its records through a window) against PyTorch under
#    a CUDA graph and the floor.
# 10: the MLA decode core tile on Hopper warpgroup MMAs (mma="wgmma", the twenty-fourth session):
#    test_wgmma_tile (bf16 / fp8, 1 .. 128K tokens, ragged T = 2 / 4, 16-token pages, row groups),
#    then bench/mla_bench.py at its default (choose_mma: wgmma for bf16 at chunk 64 on Hopper) and
#    with `--set mma=warp` (batch 1 / 8 / 64), then compute-sanitizer on one wgmma case.
# 11: issue 5 at batch 1 (the twenty-fifth session): test_mla_gpu.py whole (the combine's narrower
#    auto tiles, the block-table prefetch; `11 bench` skips it), then mla_bench at its defaults
#    (both launches PDL) against plain launches (pdl=0), twice each, interleaved.
# 12: issue 5 at batch 1 (the twenty-sixth session): the decode tiles' first chunk copies before
#    their PDL wait (kv_before_wait) - its chain test (two cases sharing o_part, no host sync),
#    the wgmma tile's tests; then mla_bench at its default against kv_before_wait=0 and plain
#    launches, interleaved; the attention program with the mma.sync against the wgmma decode tile
#    (decode_mma) and its GPU test (`12 bench` skips the tests).
# 13: issue 5 on an H200 in one short call (the twenty-seventh session): only when the GPU is an
#    H200 (else it exits at once), mla_bench at its default against kv_before_wait=0 (bf16 shards,
#    batch 1 x 128K) and bulk_copy=0 (the fp8 cache at batch 1 and 64), interleaved; no tests.
# 15: the GEMV ring's copies spread by rows (GEMV_ISSUE "rows", the twenty-eighth session): the
#    megakernel and MoE GPU tests (`15 bench` skips them), then the fp8 / bf16 GEMVs and stacks and
#    the MoE layer at batch 1 against the old unit mapping (SDK_GEMV_ISSUE=units), interleaved.
# 16: fp8 tiles straddling two scale blocks (measured on an H100 in the twenty-ninth session:
#    bench/results/h100/megakernel_v29_straddle_l2hot.json): their GPU tests (`16 bench` skips
#    them), then the fp8 GEMV 7168x2048 alone and the fp8 stack L=8 I=2048 with 56-row (down)
#    tiles (128 SMs) against the default cut, interleaved, twice; and the fp8 consumer's own
#    rate: 7168 x 2048 / 4096 with the weights hot in the L2 (the time's slope), hfma2_alu too.
# 17: what bounds the fp8 stack (run on an H100 in the thirty-first session:
#    bench/results/h100/megakernel_v31_phases.json): the stack's batch-1 timeline (fp8, bf16 L=8
#    I=2048) twice; then Nsight Compute on the fp8 stack and an L2-hot fp8 GEMV
#    (bench/ncu_fp8_consumer.sh; NCU_CASES picks cases). (Its poll A/B is done: removed.)
# 18: the stack's epilogue (the twenty-ninth-session timeline, H100: gate/up 2.5 us and down 2.0 us
#    of each tile after its chunks): the signal's stamp (epi -> sig) and the last stage's refill
#    deferred (SDK_REFILL_DEFER=signal / begin) against none, fp8 and bf16 L=8 I=2048 at batch 1,
#    each with its timeline, then the three again without; `18 tests` adds the megakernel GPU
#    tests under begin.
# 19: the warp-sliced ring (GemvConfig.warp_ring, the thirty-second session): each warp copies the
#    weight units its lanes read into its own slice of every stage, so a chunk waits on warp
#    barriers instead of two CTA barriers (Nsight, H100: 30% of the stack's stalls at CTA
#    barriers). The fp8 / bf16 stacks L=8 I=2048 (B=1 twice, fp8 B=2) and fp8 L=4 I=18432 with
#    and without it, interleaved; the fp8 GEMVs 7168 x 2048 / 4096 hot in the L2 (the consumer's
#    own rate: the slope), cold, the gate/up shape hot, and 18432 x 7168; then its GPU tests
#    (`19 bench` skips them).
# 20: a tile's last refill after its signal (REFILL_DEFER, the default since the thirty-third
#    session, after part 18 measured it on an H100): SDK_REFILL_DEFER 0 / 1 on the fp8 and bf16
#    stacks L=8 I=2048 at batch 1 (timeline at 1), at fp8 batch 8 and I=18432, the warp-sliced
#    ring under it, 0 / 1 again; then the megakernel GPU tests (`20 bench` skips them). (Run on an
#    H100 with 2 / 3 deferred refills too - racy, removed: bench/results/h100/megakernel_v33_refill.json.)
# 21: the thirty-third session's H100 findings on an H200 in one call (exits at once elsewhere):
#    the stacks (fp8 / bf16 L=8 I=2048, fp8 I=18432, batch 1) under the default against
#    SDK_REFILL_DEFER=0; the warp-sliced ring on the fp8 stack and the L2-hot fp8 GEMVs (on the
#    H200 the CUDA-core consumer's ~30 GB/s an SM is under the bandwidth share, ~36: the ring's
#    faster consumer may pay there though it did not on the H100); then part 13's MLA cases.
# 22: the GEMV weights' ring copies evict-first in the L2 (gemv.WEIGHT_EVICT_FIRST, the default
#    since the thirty-fourth session after three interleaved H100 pairs) against plain copies
#    (SDK_WEIGHT_EVICT_FIRST=0): the fp8 / bf16 stacks L=8 I=2048 and fp8 I=18432 twice each way,
#    then the MoE Kimi K3 / V4.1-Flash batch 1. (The thirty-fourth session's parts 22-24 - the MoE
#    ring filled to 33 KB chunks, the schedule order "auto", evict-first on an H100 - ran; the
#    first two were not faster and were removed: bench/NOTES.md.)
# 25: the batch-1 MoE expert tile (issue 4): alone (bench/experts_bench.py; V4.1-Flash down /
#    gate-up with one hit expert - the op's config, mxfp4_decode="hfma2", smem_stages 0 / 4, the
#    tensor-core tile - hot and cold in the L2; GLM-5.3 / Kimi K3 gate-up base and hfma2), then
#    the MoE layers at batch 1 with and without hfma2 (timelines, twice interleaved), then Nsight
#    Compute's stalls on the V4.1 tiles (ncu_experts_*: details, SASS regions by bench.ncu_source).
# 26: the batch-1 expert tile (ExpertsConfig.batch1_tile, tile_b1: hit-major items, the hit list in
#    lane registers, x and the routing weight loaded once a hit - Nsight Compute on the general
#    tile (part 25) put ~40% of its stalls on per-item L2 round trips): its GPU tests and the MoE
#    layer's at batch 1 / the staged depths, then the V4.1 expert tiles alone and the MoE layers at
#    batch 1 against the general tile (expert_batch1_tile=0), interleaved, and with hfma2.
# 27: tile_b1's GPU test alone (3 / 1 / 0 hits, every model, f32 and hfma2; without the sanitizer
#    beside it: it did not finish in parts 26 and 29), then V4.1-Flash batch 1 in the phase and the
#    critical placement order and the three layers at batch 8, with timelines (issue 4).
# (28 / 29, the thirty-sixth session: tile_mma with 2-3 of a warp's K steps loaded at once - slower
#    at batch 8 on an H100, removed - and parts 27 + 28 in one call; bench/results/h100/megakernel_v36_moe.json.)
# 30: the batch-1 down tile's deeper ring (opt-in expert_down_smem_stages=-1: as deep as the
#    gate/up slots' shared memory holds, 8 for V4.1-Flash / GLM-5.3, 4 for Kimi K3; default 2) and
#    tile_b1's hit slots / routing weights in lane registers, the router select's weights from the
#    logits a warp holds (not a second global read; a warp a token): tile_b1's GPU test alone, the
#    staged layer test and the select's rule test, then the down tiles alone 2 / 4 / 8 deep, the
#    MoE layers at batch 1 against expert_down_smem_stages=-1 (interleaved, twice; P30_LEAN=1:
#    once), and V4.1-Flash batch 1 in the three placement orders with timelines (issue 4).
# The tests' parts are packed into $OUT/tests/results.tgz, the benches' into $OUT/results.tgz.
# A form that measures faster becomes the default (bench/NOTES.md says so); one that does not is removed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

ncu_experts() {   # DIR PREFIX LIMIT_S: Nsight Compute's stalls on the V4.1-Flash expert tiles (one hit)
  local st f
  for st in down gateup; do
    f="$1/$2$st"
    timeout "$3" ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters -o "$f" \
      python -m bench.profile_block experts deepseek_v41_flash $st 1 > "$f.log" 2>&1
    ncu -i "$f.ncu-rep" --page details > "$f.txt" 2>&1
    ncu -i "$f.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "${f}_sass.csv.gz"
    python -m bench.ncu_source "${f}_sass.csv.gz" --top 25 > "${f}_regions.txt" 2>&1
    rm -f "$f.ncu-rep"
  done
}
export GIT_COMMIT=${GIT_COMMIT:-unknown} DEVICE_ALL_S=${DEVICE_ALL_S:-575} TESTS_S=${TESTS_S:-540}

if [ "${1:-1}" = 3 ]; then   # the whole models in one launch a step: their tests
  GPU_TESTS="tests/gpu/test_sublayer_modes_gpu.py tests/gpu/test_plain_model_gpu.py tests/gpu/test_glm_model_gpu.py \
    tests/gpu/test_dsv4_model_gpu.py tests/gpu/test_mhc_layer_gpu.py tests/gpu/test_mhc_gpu.py" TESTS_S=550 OUT="$OUT/tests" DEVICE_ALL_S=560 bash bench/device_all.sh tests
  exit
fi

if [ "${1:-1}" = 4 ]; then   # ... their bench against PyTorch under a CUDA graph and the floor
  BENCH_S_model=550 DEVICE_ALL_S=560 bash bench/device_all.sh bench:model
  exit
fi

if [ "${1:-1}" = 5 ]; then   # ... over 2 TP ranks (virtual, 66 SMs each)
  BENCH_S_model_tp2=550 BENCH_ARGS_model_tp2="--tp 2" DEVICE_ALL_S=560 bash bench/device_all.sh bench:model@tp2
  exit
fi

if [ "${1:-1}" = 7 ]; then   # Kimi K3 at one rank's real widths: its GPU test, then its bench
  GPU_TESTS="tests/gpu/test_plain_model_gpu.py::test_k3_wide_model_one_launch_a_step" TESTS_S=240 OUT="$OUT/tests" \
    DEVICE_ALL_S=250 bash bench/device_all.sh tests
  BENCH_S_model_wide=300 BENCH_ARGS_model_wide="--wide" DEVICE_ALL_S=310 bash bench/device_all.sh bench:model@wide
  exit
fi

if [ "${1:-1}" = 8 ]; then   # this session's device paths: tests, then what the repeated key reads cost
  GPU_TESTS="tests/gpu/test_mla_gpu.py::test_row_groups tests/gpu/test_dsv4_gpu.py::test_dsv4_decode_row_groups \
    tests/gpu/test_indexer_gpu.py::test_glm_sparse_mla tests/gpu/test_mla_layer_gpu.py::test_mla_sublayer_one_launch \
    tests/gpu/test_megakernel_gpu.py::test_gemv_grouped tests/gpu/test_dsv4_model_gpu.py::test_grouped_o_a_one_launch_a_step \
    tests/gpu/test_megakernel_gpu.py::test_records_window_equals_resident_records \
    tests/gpu/test_plain_model_gpu.py::test_k3_model_through_a_records_window \
    tests/gpu/test_plain_model_gpu.py::test_k3_deep_model_one_launch_a_step" \
    TESTS_S=340 OUT="$OUT/tests" DEVICE_ALL_S=350 bash bench/device_all.sh tests
  C=kimi_k3_tp8:32768:1:bf16:1,kimi_k3_tp1:32768:1:bf16:1,kimi_k3_tp8:32768:1:bf16:4,kimi_k3_tp8:131072:1:bf16:1
  C=$C,kimi_k3_tp1:131072:1:bf16:1,kimi_k3_tp8:32768:8:bf16:1,kimi_k3_tp1:32768:8:bf16:1,kimi_k3_tp1:32768:1:fp8_e4m3:1
  BENCH_S_mla=200 BENCH_ARGS_mla="--cases $C" DEVICE_ALL_S=210 bash bench/device_all.sh bench:mla
  exit
fi

if [ "${1:-1}" = 10 ]; then   # the MLA decode tile on warpgroup MMAs (issue 5): its tests, then against the default
  GPU_TESTS="tests/gpu/test_mla_gpu.py::test_wgmma_tile tests/gpu/test_mla_gpu.py::test_kimi_k3_tp8_single_sequence_contexts" \
    TESTS_S=200 OUT="$OUT/tests" DEVICE_ALL_S=210 bash bench/device_all.sh tests
  C=kimi_k3_tp8:131072:1,glm_53_tp8:131072:1,kimi_k3_tp16:131072:1,kimi_k3_tp8:32768:1,kimi_k3_tp8:32768:8,kimi_k3_tp8:32768:64,kimi_k3_tp8:131072:1:fp8_e4m3,kimi_k3_tp8:32768:64:fp8_e4m3
  BENCH_S_mla=150 BENCH_ARGS_mla="--cases $C" BENCH_S_mla_warp=150 \
    BENCH_ARGS_mla_warp="--cases $C --set mma=warp" DEVICE_ALL_S=330 bash bench/device_all.sh bench:mla bench:mla@warp
  for tool in memcheck racecheck; do   # the wgmma tile under the sanitizers (one small case)
    timeout 60 compute-sanitizer --tool $tool --error-exitcode 3 python -m pytest -q -x -m gpu -p no:cacheprovider \
      "tests/gpu/test_mla_gpu.py::test_wgmma_tile[bf16-12-1-64-0.07216878364870322-lens2-64]" > "$OUT/sanitizer_wgmma_$tool.log" 2>&1
    echo "compute-sanitizer $tool (wgmma tile): rc=$?"
  done
  exit
fi

if [ "${1:-1}" = 11 ]; then   # issue 5 at batch 1: the combine's tiling, the block-table prefetch, PDL
  [ "${2:-}" = bench ] || GPU_TESTS="tests/gpu/test_mla_gpu.py" TESTS_S=160 OUT="$OUT/tests" DEVICE_ALL_S=170 \
    bash bench/device_all.sh tests
  C=kimi_k3_tp8:131072:1,glm_53_tp8:131072:1,kimi_k3_tp16:131072:1,kimi_k3_tp8:32768:8,kimi_k3_tp8:32768:64
  # the default (both launches PDL) against plain launches, twice each, interleaved
  BENCH_S_mla=50 BENCH_ARGS_mla="--cases $C,kimi_k3_tp8:32768:1" \
    BENCH_S_mla_plain=50 BENCH_ARGS_mla_plain="--cases $C,kimi_k3_tp8:32768:1 --set pdl=0" \
    BENCH_S_mla_again=50 BENCH_ARGS_mla_again="--cases $C" \
    BENCH_S_mla_plain2=50 BENCH_ARGS_mla_plain2="--cases $C --set pdl=0" \
    DEVICE_ALL_S=220 bash bench/device_all.sh bench:mla bench:mla@plain bench:mla@again bench:mla@plain2
  exit
fi

if [ "${1:-1}" = 12 ]; then   # issue 5 at batch 1: the decode's first chunks copied before its PDL wait
  [ "${2:-}" = bench ] || GPU_TESTS="tests/gpu/test_mla_gpu.py::test_kv_before_wait_pdl_chain \
    tests/gpu/test_mla_gpu.py::test_attention_program_one_launch tests/gpu/test_mla_gpu.py::test_wgmma_tile" \
    TESTS_S=170 OUT="$OUT/tests" DEVICE_ALL_S=180 bash bench/device_all.sh tests
  C=kimi_k3_tp8:131072:1,glm_53_tp8:131072:1,kimi_k3_tp16:131072:1,kimi_k3_tp8:32768:8,kimi_k3_tp8:131072:1:fp8_e4m3
  P=kimi_k3_tp8:131072:1:program,kimi_k3_tp8:32768:64:program,kimi_k3_tp8:131072:8:program
  # the default (PDL, first chunks before the wait) against PDL alone and plain launches, interleaved;
  # the attention program (one launch) with the mma.sync decode tile against the wgmma one
  BENCH_S_mla=50 BENCH_ARGS_mla="--cases $C" \
    BENCH_S_mla_pdl=50 BENCH_ARGS_mla_pdl="--cases $C --set kv_before_wait=0" \
    BENCH_S_mla_plain=50 BENCH_ARGS_mla_plain="--cases $C --set pdl=0" \
    BENCH_S_mla_again=50 BENCH_ARGS_mla_again="--cases $C" \
    BENCH_S_mla_pdl2=50 BENCH_ARGS_mla_pdl2="--cases $C --set kv_before_wait=0" \
    BENCH_S_mla_prog=60 BENCH_ARGS_mla_prog="--cases $P" \
    BENCH_S_mla_progwg=60 BENCH_ARGS_mla_progwg="--cases $P --set decode_mma=wgmma" \
    DEVICE_ALL_S=400 bash bench/device_all.sh bench:mla bench:mla@pdl bench:mla@plain bench:mla@again bench:mla@pdl2 \
    bench:mla@prog bench:mla@progwg
  exit
fi

if [ "${1:-1}" = 13 ]; then   # issue 5's batch-1 and fp8 figures on an H200, benches only
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
  C=kimi_k3_tp8:131072:1,glm_53_tp8:131072:1,kimi_k3_tp16:131072:1,kimi_k3_tp8:131072:1:fp8_e4m3,kimi_k3_tp8:32768:64:fp8_e4m3
  BENCH_S_mla=45 BENCH_ARGS_mla="--cases $C" \
    BENCH_S_mla_pdl=45 BENCH_ARGS_mla_pdl="--cases $C --set kv_before_wait=0" \
    BENCH_S_mla_cp=45 BENCH_ARGS_mla_cp="--cases $C --set bulk_copy=0" \
    BENCH_S_mla_again=45 BENCH_ARGS_mla_again="--cases $C" \
    BENCH_S_mla_pdl2=45 BENCH_ARGS_mla_pdl2="--cases $C --set kv_before_wait=0" \
    DEVICE_ALL_S=230 bash bench/device_all.sh bench:mla bench:mla@pdl bench:mla@cp bench:mla@again bench:mla@pdl2
  exit
fi

if [ "${1:-1}" = 15 ]; then   # the GEMV ring's copies by rows against the old unit mapping
  [ "${2:-}" = bench ] || GPU_TESTS="tests/gpu/test_megakernel_gpu.py tests/gpu/test_moe_gpu.py" TESTS_S=190 \
    OUT="$OUT/tests" DEVICE_ALL_S=200 bash bench/device_all.sh tests
  F="'fp8_e4m3', None, True"
  G="[(18432, 7168, 1, $F), (7168, 2048, 1, $F), (7168, 2048, 1, 'bf16', None, True)]"
  S="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}, {'intermediate': 2048, 'layers': 8},
      {'intermediate': 18432, 'layers': 4, 'weight_dtype': 'fp8_e4m3'}]"
  M="--no-timeline --cases kimi_k3:1:mxfp4,glm_53:1:mxfp4"
  BENCH_S_megakernel=90 BENCH_ARGS_megakernel="--no-timeline --parts gemv,stack --gemv-cases \"$G\" --stack-cases \"$S\"" \
    BENCH_S_megakernel_units=90 BENCH_ARGS_megakernel_units="--no-timeline --parts gemv,stack --gemv-cases \"$G\" --stack-cases \"$S\"" \
    BENCH_ENV_megakernel_units="SDK_GEMV_ISSUE=units" \
    BENCH_S_megakernel_again=60 BENCH_ARGS_megakernel_again="--no-timeline --parts stack --stack-cases \"$S\"" \
    BENCH_S_megakernel_units2=60 BENCH_ARGS_megakernel_units2="--no-timeline --parts stack --stack-cases \"$S\"" \
    BENCH_ENV_megakernel_units2="SDK_GEMV_ISSUE=units" \
    BENCH_S_moe=45 BENCH_ARGS_moe="$M" BENCH_S_moe_units=45 BENCH_ARGS_moe_units="$M" BENCH_ENV_moe_units="SDK_GEMV_ISSUE=units" \
    DEVICE_ALL_S=${P15_S:-350} bash bench/device_all.sh bench:megakernel bench:megakernel@units bench:megakernel@again \
    bench:megakernel@units2 bench:moe bench:moe@units
  exit
fi

if [ "${1:-1}" = 30 ]; then   # issue 4: the down tile's deeper ring, the hits' slots in registers
  if [ "${2:-}" = one ]; then   # `30 one`: ONE tile_b1 case alone, its phases printed (-s), 240 s
    timeout -s INT -k 15 ${P30_T:-240} python -m pytest -p no:cacheprovider -m gpu -x -s -v \
      "tests/gpu/test_moe_gpu.py::test_experts_batch1_tile_equals_reference[deepseek_v41_flash-down-f32]" > "$OUT/one.log" 2>&1
    echo "pytest rc=$?"; tail -30 "$OUT/one.log"
    exit
  fi
  case "${2:-}" in ncu|bench) ;; *)      # `30 bench` / `30 ncu`: without the tests
    GPU_TESTS="tests/gpu/test_moe_gpu.py::test_experts_batch1_tile_equals_reference \
      tests/gpu/test_moe_gpu.py::test_moe_layer_expert_smem_stages tests/gpu/test_moe_gpu.py::test_router_select_matches_rule" \
      SANITIZE=0 TESTS_S=${P30_T:-170} OUT="$OUT/tests" \
      DEVICE_ALL_S=$(( ${P30_T:-170} + 10 )) bash bench/device_all.sh tests ;;
  esac
  [ "${2:-}" = tests ] && exit
  if [ "${2:-}" = ncu ]; then   # `30 ncu`: where tile_b1's warps stall now (V4.1-Flash, one hit), packed in ncu.tgz
    mkdir -p /tmp/ncu30 && ncu_experts /tmp/ncu30 experts_ 80 && tar czf "$OUT/ncu.tgz" -C /tmp ncu30
    exit
  fi
  M1="--no-timeline --cases deepseek_v41_flash:1:mxfp4,glm_53:1:mxfp4,kimi_k3:1:mxfp4"; D="--set expert_down_smem_stages=-1"
  BENCH_S_experts=50 BENCH_ARGS_experts="--cases deepseek_v41_flash:down:1,glm_53:down:1,kimi_k3:down:1 --variants 'base;smem_stages=4;smem_stages=8'" \
    BENCH_S_moe_a=38 BENCH_ARGS_moe_a="$M1" BENCH_S_moe_d=38 BENCH_ARGS_moe_d="$M1 $D" \
    BENCH_S_moe_o=50 BENCH_ARGS_moe_o="--cases deepseek_v41_flash:1:mxfp4 --order phase,critical,backfill" \
    BENCH_S_moe_a2=38 BENCH_ARGS_moe_a2="$M1" BENCH_S_moe_d2=38 BENCH_ARGS_moe_d2="$M1 $D" \
    DEVICE_ALL_S=${P30_S:-280} bash bench/device_all.sh bench:experts bench:moe@a bench:moe@d bench:moe@o \
    $([ -n "${P30_LEAN:-}" ] || echo bench:moe@a2 bench:moe@d2)
  exit
fi

if [ "${1:-1}" = 27 ]; then   # issue 4: tile_b1's test alone, then where the batch-1 / batch-8 layers' time goes
  GPU_TESTS="tests/gpu/test_moe_gpu.py::test_experts_batch1_tile_equals_reference" SANITIZE=0 TESTS_S=240 \
    OUT="$OUT/tests" DEVICE_ALL_S=250 bash bench/device_all.sh tests
  [ "${2:-}" = tests ] && exit
  BENCH_S_moe_crit=45 BENCH_ARGS_moe_crit="--cases deepseek_v41_flash:1:mxfp4 --order phase,critical" \
    BENCH_S_moe_b8=70 BENCH_ARGS_moe_b8="--cases deepseek_v41_flash:8:mxfp4,glm_53:8:mxfp4,kimi_k3:8:mxfp4" \
    DEVICE_ALL_S=${P27_S:-300} bash bench/device_all.sh bench:moe@crit bench:moe@b8
  exit
fi

if [ "${1:-1}" = 26 ]; then   # issue 4: the batch-1 expert tile (tile_b1) - its tests, then against the general tile
  GPU_TESTS="tests/gpu/test_moe_gpu.py::test_experts_batch1_tile_equals_reference \
    tests/gpu/test_moe_gpu.py::test_moe_layer_expert_smem_stages tests/gpu/test_moe_gpu.py::test_moe_layer_real_shard_one_launch \
    tests/gpu/test_moe_gpu.py::test_moe_layer_latent_situ_equals_moe_reference" TESTS_S=170 OUT="$OUT/tests" \
    DEVICE_ALL_S=180 bash bench/device_all.sh tests
  [ "${2:-}" = tests ] && exit             # `26 tests`: the tests alone
  M="--cases deepseek_v41_flash:1:mxfp4,glm_53:1:mxfp4,kimi_k3:1:mxfp4"; G="--set expert_batch1_tile=0"
  BENCH_S_experts=50 BENCH_ARGS_experts="--cases deepseek_v41_flash:down:1,deepseek_v41_flash:gateup:1 --variants 'base;batch1_tile=0;mxfp4_decode=hfma2'" \
    BENCH_S_moe_b1=55 BENCH_ARGS_moe_b1="$M" BENCH_S_moe_g=55 BENCH_ARGS_moe_g="$M $G" \
    BENCH_S_moe_b1b=38 BENCH_ARGS_moe_b1b="--no-timeline $M" BENCH_S_moe_gb=38 BENCH_ARGS_moe_gb="--no-timeline $M $G" \
    BENCH_S_moe_h=38 BENCH_ARGS_moe_h="--no-timeline $M --set expert_mxfp4_decode=hfma2" \
    DEVICE_ALL_S=${P26_S:-290} bash bench/device_all.sh bench:experts bench:moe@b1 bench:moe@g bench:moe@b1b bench:moe@gb bench:moe@h
  exit
fi

if [ "${1:-1}" = 25 ]; then   # issue 4: the batch-1 expert tile alone - which knob moves its ~12 us a hit
  V="base;mxfp4_decode=hfma2;smem_stages=0;smem_stages=4;smem_stages=0,mma=1"
  M="--cases deepseek_v41_flash:1:mxfp4,glm_53:1:mxfp4,kimi_k3:1:mxfp4"; H="--set expert_mxfp4_decode=hfma2"
  BENCH_S_experts=130 BENCH_ARGS_experts="--cases deepseek_v41_flash:down:1,deepseek_v41_flash:gateup:1 --variants '$V'" \
    BENCH_S_experts_glm=70 BENCH_ARGS_experts_glm="--cases glm_53:gateup:1,kimi_k3:gateup:1 --variants 'base;mxfp4_decode=hfma2'" \
    BENCH_S_moe_h0=60 BENCH_ARGS_moe_h0="$M" BENCH_S_moe_h1=60 BENCH_ARGS_moe_h1="$M $H" \
    BENCH_S_moe_h0b=40 BENCH_ARGS_moe_h0b="--no-timeline $M" BENCH_S_moe_h1b=40 BENCH_ARGS_moe_h1b="--no-timeline $M $H" \
    DEVICE_ALL_S=410 bash bench/device_all.sh bench:experts bench:experts@glm bench:moe@h0 bench:moe@h1 bench:moe@h0b bench:moe@h1b
  # where the V4.1 tiles' warps stall (ncu flushes the caches before the profiled launch)
  ncu_experts "$OUT" ncu_experts_ 70
  exit
fi

if [ "${1:-1}" = 22 ]; then   # the weights evict-first in the L2 (the default) against plain copies
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"
  F4="'intermediate': 18432, 'layers': 4, 'weight_dtype': 'fp8_e4m3'"
  S="--no-timeline --parts stack --stack-cases \"[{$F8}, {$L8}, {$F4}]\""; M="--no-timeline --cases kimi_k3:1:mxfp4,deepseek_v41_flash:1:mxfp4"
  BENCH_ARGS_megakernel_a0="$S" BENCH_ENV_megakernel_a0="SDK_WEIGHT_EVICT_FIRST=0" BENCH_ARGS_megakernel_a1="$S" \
    BENCH_ARGS_megakernel_b0="$S" BENCH_ENV_megakernel_b0="SDK_WEIGHT_EVICT_FIRST=0" BENCH_ARGS_megakernel_b1="$S" \
    BENCH_S_megakernel_a0=60 BENCH_S_megakernel_a1=60 BENCH_S_megakernel_b0=60 BENCH_S_megakernel_b1=60 \
    BENCH_S_moe_a0=45 BENCH_ARGS_moe_a0="$M" BENCH_ENV_moe_a0="SDK_WEIGHT_EVICT_FIRST=0" BENCH_S_moe_a1=45 BENCH_ARGS_moe_a1="$M" \
    DEVICE_ALL_S=${P22_S:-340} bash bench/device_all.sh bench:megakernel@a0 bench:megakernel@a1 bench:megakernel@b0 \
    bench:megakernel@b1 bench:moe@a0 bench:moe@a1
  exit
fi

if [ "${1:-1}" = 21 ]; then   # issues 3 and 5 on an H200: the refill after the signal, the warp ring
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "not an H200: nothing run"; exit 0; }
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"; W="'warp_ring': True"
  F4="'intermediate': 18432, 'layers': 4, 'weight_dtype': 'fp8_e4m3'"
  S="--parts stack --stack-cases \"[{$F8}, {$L8}, {$F4}]\""
  G8="7168, 2048, 1, 'fp8_e4m3', None, True"; H="7168, 4096, 1, 'fp8_e4m3', None, True"
  HOT="'rows_per_tile': 56, 'l2_hot': True"
  WR="--no-timeline --parts gemv,stack --stack-cases \"[{$F8, $W}, {$F8}, {$F8, $W}, {$F8}]\""
  WR="$WR --gemv-cases \"[($G8, {$HOT, $W}), ($G8, {$HOT}), ($H, {$HOT, $W}), ($H, {$HOT})]\""
  BENCH_S_megakernel_d0=60 BENCH_ARGS_megakernel_d0="--no-timeline $S" BENCH_ENV_megakernel_d0="SDK_REFILL_DEFER=0" \
    BENCH_S_megakernel=70 BENCH_ARGS_megakernel="$S" \
    BENCH_S_megakernel_w=80 BENCH_ARGS_megakernel_w="$WR" \
    BENCH_S_megakernel_d0b=60 BENCH_ARGS_megakernel_d0b="--no-timeline $S" BENCH_ENV_megakernel_d0b="SDK_REFILL_DEFER=0" \
    BENCH_S_megakernel_d1b=60 BENCH_ARGS_megakernel_d1b="--no-timeline $S" \
    OUT="$OUT/stack" DEVICE_ALL_S=${P21_S:-340} bash bench/device_all.sh bench:megakernel@d0 bench:megakernel \
    bench:megakernel@w bench:megakernel@d0b bench:megakernel@d1b
  [ "${2:-}" = stack ] || bash "$0" 13
  exit
fi
if [ "${1:-1}" = 20 ]; then   # issue 3: how many of a tile's last refills go after its signal
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"; W="'warp_ring': True"
  F4="'intermediate': 18432, 'layers': 4, 'weight_dtype': 'fp8_e4m3'"
  S="--parts stack --stack-cases \"[{$F8}, {$L8}]\""; N="--no-timeline $S"
  X="--no-timeline --parts stack --stack-cases \"[{$F8, 'batch': 8}, {$F4}]\""
  BENCH_ARGS_megakernel_d0="$N" BENCH_ENV_megakernel_d0="SDK_REFILL_DEFER=0" \
    BENCH_ARGS_megakernel="$S" \
    BENCH_ARGS_megakernel_w="--no-timeline --parts stack --stack-cases \"[{$F8, $W}, {$F8, 'batch': 2, $W}, {$F8, 'batch': 2}]\"" \
    BENCH_ARGS_megakernel_x0="$X" BENCH_ENV_megakernel_x0="SDK_REFILL_DEFER=0" BENCH_ARGS_megakernel_x1="$X" \
    BENCH_ARGS_megakernel_d0b="$N" BENCH_ENV_megakernel_d0b="SDK_REFILL_DEFER=0" BENCH_ARGS_megakernel_d1b="$N" \
    DEVICE_ALL_S=${P20_S:-330} bash bench/device_all.sh bench:megakernel@d0 bench:megakernel bench:megakernel@w bench:megakernel@x0 bench:megakernel@x1 bench:megakernel@d0b bench:megakernel@d1b
  [ "${2:-}" = bench ] || GPU_TESTS="tests/gpu/test_megakernel_gpu.py" TESTS_S=200 OUT="$OUT/tests" \
    DEVICE_ALL_S=210 bash bench/device_all.sh tests
  exit
fi
if [ "${1:-1}" = 19 ]; then   # issue 3: the warp-sliced ring (warp barriers a chunk) against the CTA's two
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"; W="'warp_ring': True"
  F4="'intermediate': 18432, 'layers': 4, 'weight_dtype': 'fp8_e4m3'"
  S="[{$F8, $W}, {$F8}, {$L8, $W}, {$L8}, {$F8, $W}, {$F8}, {$L8, $W}, {$L8}, {$F8, 'batch': 2, $W}, {$F8, 'batch': 2}"
  S="$S, {$F4, $W}, {$F4}]"
  # P19_QUICK=1 (a short call): the B=1 stacks twice and the L2-hot fp8 GEMVs alone
  [ "${P19_QUICK:-0}" = 1 ] && S="[{$F8, $W}, {$F8}, {$L8, $W}, {$L8}, {$F8, $W}, {$F8}, {$L8, $W}, {$L8}]"
  G8="7168, 2048, 1, 'fp8_e4m3', None, True"; H="7168, 4096, 1, 'fp8_e4m3', None, True"
  Q="4096, 7168, 1, 'fp8_e4m3', None, True"    # the stack's gate/up chunks: 32 rows x 1024 columns
  HOT="'rows_per_tile': 56, 'l2_hot': True"
  G="[($G8, {$HOT, $W}), ($G8, {$HOT}), ($H, {$HOT, $W}), ($H, {$HOT}), ($G8, {'rows_per_tile': 56, $W}), ($G8, {'rows_per_tile': 56})"
  G="$G, ($Q, {'rows_per_tile': 32, 'chunk_k': 1024, 'l2_hot': True, $W}), ($Q, {'rows_per_tile': 32, 'chunk_k': 1024, 'l2_hot': True})"
  G="$G, (18432, 7168, 1, 'fp8_e4m3', None, True, {$W}), (18432, 7168, 1, 'fp8_e4m3', None, True)]"
  [ "${P19_QUICK:-0}" = 1 ] && G="[($G8, {$HOT, $W}), ($G8, {$HOT}), ($H, {$HOT, $W}), ($H, {$HOT})]"
  BENCH_S_megakernel=${P19_BENCH_S:-300} BENCH_ARGS_megakernel="--no-timeline --parts gemv,stack --gemv-cases \"$G\" --stack-cases \"$S\"" \
    DEVICE_ALL_S=${P19_S:-310} bash bench/device_all.sh bench:megakernel
  [ "${2:-}" = bench ] || GPU_TESTS="tests/gpu/test_megakernel_gpu.py -k warp_ring" TESTS_S=170 OUT="$OUT/tests" \
    DEVICE_ALL_S=180 bash bench/device_all.sh tests
  exit
fi
if [ "${1:-1}" = 18 ]; then   # issue 3: where the stack's epilogue goes; the last refill deferred
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"
  S="--parts stack --stack-cases \"[{$F8}, {$L8}]\""
  BENCH_S_megakernel=70 BENCH_ARGS_megakernel="$S" \
    BENCH_S_megakernel_signal=70 BENCH_ARGS_megakernel_signal="$S" BENCH_ENV_megakernel_signal="SDK_REFILL_DEFER=signal" \
    BENCH_S_megakernel_begin=70 BENCH_ARGS_megakernel_begin="$S" BENCH_ENV_megakernel_begin="SDK_REFILL_DEFER=begin" \
    BENCH_S_megakernel_again=50 BENCH_ARGS_megakernel_again="--no-timeline $S" \
    BENCH_S_megakernel_signal2=50 BENCH_ARGS_megakernel_signal2="--no-timeline $S" BENCH_ENV_megakernel_signal2="SDK_REFILL_DEFER=signal" \
    BENCH_S_megakernel_begin2=50 BENCH_ARGS_megakernel_begin2="--no-timeline $S" BENCH_ENV_megakernel_begin2="SDK_REFILL_DEFER=begin" \
    DEVICE_ALL_S=${P18_S:-330} bash bench/device_all.sh bench:megakernel bench:megakernel@signal bench:megakernel@begin \
    bench:megakernel@again bench:megakernel@signal2 bench:megakernel@begin2
  [ "${2:-}" = tests ] && SDK_REFILL_DEFER=begin GPU_TESTS="tests/gpu/test_megakernel_gpu.py" TESTS_S=200 \
    OUT="$OUT/tests" DEVICE_ALL_S=210 bash bench/device_all.sh tests
  exit
fi
if [ "${1:-1}" = 17 ]; then   # issue 3: what bounds the fp8 consumer
  L8="'intermediate': 2048, 'layers': 8"; F8="$L8, 'weight_dtype': 'fp8_e4m3'"
  S="--parts stack --stack-cases \"[{$F8}, {$L8}]\""
  BENCH_S_megakernel=90 BENCH_ARGS_megakernel="$S" BENCH_S_megakernel_again=75 BENCH_ARGS_megakernel_again="$S" \
    DEVICE_ALL_S=${P17_S:-180} bash bench/device_all.sh bench:megakernel bench:megakernel@again
  [ "${2:-}" = bench ] || NCU_CASES=${NCU_CASES:-"stack gateup"} OUT="$OUT/ncu" bash bench/ncu_fp8_consumer.sh
  exit
fi
if [ "${1:-1}" = 16 ]; then   # issue 3: 56-row fp8 down tiles (straddling scale blocks) against 64
  [ "${2:-}" = bench ] || GPU_TESTS="${P16_TESTS:-tests/gpu/test_megakernel_gpu.py}" TESTS_S=190 OUT="$OUT/tests" DEVICE_ALL_S=200 \
    bash bench/device_all.sh tests
  L8="'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'"
  S="[{$L8, 'down_rows': 56}, {$L8}, {$L8, 'down_rows': 56}, {$L8}, {$L8, 'batch': 2, 'down_rows': 56}, {$L8, 'batch': 2}, {$L8, 'fp8_decode': 'hfma2_alu'}]"
  G8="7168, 2048, 1, 'fp8_e4m3', None, True"
  H="7168, 4096, 1, 'fp8_e4m3', None, True"
  G="[($G8, {'rows_per_tile': 56}), ($G8), ($G8, {'rows_per_tile': 56}), ($G8), ($G8, {'rows_per_tile': 56, 'l2_hot': True})"
  G="$G, ($H, {'rows_per_tile': 56, 'l2_hot': True}), ($G8, {'rows_per_tile': 64, 'l2_hot': True}), ($H, {'rows_per_tile': 64, 'l2_hot': True})"
  G="$G, (7168, 1024, 1, 'bf16', None, True, {'rows_per_tile': 56, 'l2_hot': True}), (7168, 2048, 1, 'bf16', None, True, {'rows_per_tile': 56, 'l2_hot': True})"
  A="'rows_per_tile': 56, 'l2_hot': True, 'fp8_decode': 'hfma2_alu'"     # no F2FP: is it the limit?
  G="$G, ($G8, {$A}), ($H, {$A})"
  Q="4096, 7168, 1, 'fp8_e4m3', None, True"    # the stack's gate/up chunks: 32 rows x 1024 columns
  G="$G, ($Q, {'rows_per_tile': 32, 'chunk_k': 1024, 'l2_hot': True}), ($Q, {'rows_per_tile': 32, 'chunk_k': 1024})]"
  BENCH_S_megakernel=260 BENCH_ARGS_megakernel="--parts gemv,stack --gemv-cases \"$G\" --stack-cases \"$S\"" \
    DEVICE_ALL_S=${P16_S:-270} bash bench/device_all.sh bench:megakernel
  exit
fi

if [ "${1:-1}" = 9 ]; then   # the full depth: a step's time at the full instruction count
  BENCH_S_model_deep=550 BENCH_ARGS_model_deep="--deep" DEVICE_ALL_S=560 bash bench/device_all.sh bench:model@deep
  exit
fi

if [ "${1:-1}" = 6 ]; then   # issues 3 and 4: the standalone GEMVs, the fp8 stack, the MoE layer at B=1
  S="[{'intermediate': 2048, 'layers': 8, 'weight_dtype': 'fp8_e4m3'}]"
  export BENCH_ARGS_megakernel="--quick --parts gemv,stack --stack-cases \"$S\"" BENCH_S_megakernel=120
  export BENCH_ARGS_moe='--cases glm_53:1:mxfp4,kimi_k3:1:mxfp4,deepseek_v41_flash:1:mxfp4' BENCH_S_moe=90
  DEVICE_ALL_S=300 bash bench/device_all.sh bench:megakernel bench:moe
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
  OUT="$OUT/tests" DEVICE_ALL_S=$(( TESTS_S + 20 )) bash bench/device_all.sh tests
