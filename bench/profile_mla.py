"""One MLA decode case launched a few times, for Nsight Compute (where a split-KV tile's time goes):

    ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        python -m bench.profile_mla kimi_k3_tp8 32768 64 [chunk=64,stages=3,fp8=1]

Inputs as bench/mla_bench.py's (pages scattered over the pool), no timing, no reference.
"""
from __future__ import annotations

import sys

import torch


def main(argv=None):
    from bench.common import cu_stream, parse_overrides
    from bench.mla_bench import SHARDS
    from sdk.blocks._cute import standalone
    from sdk.blocks.mla_decode import MLADecodeBlock, MLADecodeConfig, choose_splits, quantize_kv_fp8
    a = argv if argv is not None else sys.argv[1:]
    shard, ctx, batch = a[0], int(a[1]), int(a[2])
    ov = parse_overrides(a[3] if len(a) > 3 else "")
    heads, rope, scale = SHARDS[shard]
    kv_dtype = "fp8_e4m3" if ov.pop("fp8", 0) else "bf16"
    splits = ov.pop("splits", 0) or choose_splits(batch, ctx)
    npg = -(-ctx // 64)
    cfg = MLADecodeConfig(heads=heads, softmax_scale=scale, batch=batch, rope=rope, num_pages=batch * npg,
                          max_seq_len=ctx, num_splits=splits, kv_dtype=kv_dtype, **ov)
    blk = MLADecodeBlock(cfg)
    kv = torch.randn(batch * npg, 64, blk.d_qk, device="cuda")
    kv_scale = None
    if blk.fp8:
        kv, kv_scale = quantize_kv_fp8(kv, cfg.scale_group)
    else:
        kv = kv.to(torch.bfloat16)
    t = {"q": torch.randn(batch, 1, heads, blk.d_qk, device="cuda").to(torch.bfloat16), "kv": kv, "kv_scale": kv_scale,
         "block_table": torch.randperm(batch * npg, device="cuda").int().view(batch, npg),
         "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
         "o_part": torch.empty(batch, splits, blk.rows, blk.d_v, device="cuda"),
         "lse_part": torch.empty(batch, splits, blk.rows, device="cuda")}
    optab = torch.tensor([t[n].data_ptr() for n in blk.operands()], dtype=torch.int64, device="cuda")
    fn = standalone(blk)
    for _ in range(4):
        fn(optab.data_ptr(), cu_stream())
    torch.cuda.synchronize()
    print(f"{shard} ctx={ctx} B={batch} splits={splits} stages={blk.stages} chunk={cfg.chunk}: 4 launches")


if __name__ == "__main__":
    main()
