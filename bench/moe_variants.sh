#!/usr/bin/env bash
# A/B of the expert tile's knobs on the MoE benchmark (device run, repo root, .device carried):
#   bash bench/moe_variants.sh CASES "SET1" "SET2" ...   (SETn: moe_bench --set strings; "" = defaults)
# One moe_bench process per variant (each its own compile), JSON under $OUT/variant_N/.
source "$(dirname "$0")/session_lib.sh"
session_begin moe_variants_env.txt
CASES=$1; shift
i=0
for set in "$@"; do
  echo "== variant $i: ${set:-defaults}"
  timeout ${VARIANT_S:-90} python -m bench.moe_bench --out "$OUT/variant_$i" --cases "$CASES" --no-timeline \
    ${set:+--set "$set"} 2>&1 | grep -E "^moe |Error" | head -n 20
  i=$((i + 1))
done
