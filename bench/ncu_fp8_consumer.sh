#!/usr/bin/env bash
# Which pipe or stall bounds the fp8 GEMV's CUDA-core consumer (run on an H100 in the thirty-first
# session for "stack gateup": bench/results/h100/megakernel_v31_phases.json's ncu summary).
# Nsight Compute on standalone fp8 GEMVs whose weights stay in the L2 (bench/profile_block.py
# launches one a few times on the same weights): the stack's gate/up shape (32 rows x 1024-column chunks, K = 7168) with the F2FP decode and the
# integer one (hfma2_alu), the down shape (56 rows, K = 4096), bf16, and the whole one-launch fp8
# stack L=8 I=2048 (its weights from the HBM: the consumer's stalls in their real setting). Writes
# $OUT/ncu_<case>.txt; NCU_CASES="gateup down" runs those alone.
#   source .device/prelude.sh && bash bench/ncu_fp8_consumer.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
P='regex:sm__inst_executed_pipe_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active|smsp__inst_executed\.avg\.per_cycle_active|smsp__warps_issue_stalled_[a-z_]+_per_warp_active\.pct|sm__throughput\.avg\.pct_of_peak_sustained_elapsed|l1tex__data_pipe_lsu_wavefronts_mem_shared\.sum|smsp__cycles_active\.avg'
for c in "gateup:4096 7168 1 fp8_e4m3 rows_per_tile=32,chunk_k=1024" \
         "gateup_alu:4096 7168 1 fp8_e4m3 rows_per_tile=32,chunk_k=1024,fp8_decode=hfma2_alu" \
         "down:7168 4096 1 fp8_e4m3 rows_per_tile=56" \
         "bf16:7168 2048 1 bf16 rows_per_tile=56" \
         "stack:2048 8 fp8_e4m3"; do
  name=${c%%:*}; args=${c#*:}
  [ -n "${NCU_CASES:-}" ] && [[ " $NCU_CASES " != *" $name "* ]] && continue    # a subset, by name
  timeout 120 ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section InstructionStats --metrics "$P" \
    python -m bench.profile_block $([ "$name" = stack ] && echo stack || echo gemv) $args > "$OUT/ncu_$name.txt" 2>&1
  echo "$name rc=$?"
done
