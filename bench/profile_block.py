"""One standalone block launched a few times, for Nsight Compute (which pipe or stall bounds it):

    ncu --clock-control none --kernel-name regex:cutlass --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
        --section WarpStateStats python -m bench.profile_block gemv 18432 7168 1 fp8_e4m3 [key=value,...]
    ... python -m bench.profile_block kda 12 64 [v_split=2,...]        (heads, batch)
    ... python -m bench.profile_block topk 8256 512 [cache_row=0,...]   (entries, k)
    ... python -m bench.profile_block compress 128 1 [channels_per_tile=32]  (ratio, batch)
    ... python -m bench.profile_block experts glm_53 gateup 2 [mma=1,...]      (model, stage, hits)
    ... python -m bench.profile_block stack 2048 8 fp8_e4m3 [down_rows=32,...]  (intermediate, layers)

gemv: N K M weight-dtype, GemvConfig overrides (e.g. fp8_decode=int); kda: heads batch, KDAConfig
overrides; topk: one row of `entries` indexer-like scores (sums of weighted ReLUs), TopKConfig
overrides; compress: V4.1's 512-channel compressor with every window closing, DSV4CompressConfig
overrides; stack: the one-launch MLP stack megakernel at batch 1 (hidden 7168), MLPStackConfig
overrides; experts: a model's MoE layer expert op (moe_layer.preset at batch 1, MXFP4) with one
token routed to `hits` local experts (the question: is the batch-1 CUDA-core tile issue- or
latency-bound - stall reasons), ExpertsConfig overrides. Random inputs, no timing, no reference (bench/megakernel_bench.py and bench/kda_bench.py
check and time the same configurations). MLA decode: bench/profile_mla.py.
"""
from __future__ import annotations

import dataclasses
import sys

import torch


def gemv_table(n: int, k: int, m: int, wd: str, ov: dict):
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.megakernel.mlp_stack import quantize_fp8
    blk = GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype=wd, **ov))
    w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    keep = [w, x, y]
    if wd == "fp8_e4m3":
        q, sc = quantize_fp8(w)
        keep += [q, sc]
        ptrs = [q.data_ptr(), sc.data_ptr(), x.data_ptr(), y.data_ptr()]
    else:
        ptrs = [w.data_ptr(), x.data_ptr(), y.data_ptr()]
    return blk, torch.tensor(ptrs, dtype=torch.int64, device="cuda"), keep


def kda_table(heads: int, batch: int, ov: dict):
    from sdk.blocks.kda import KDABlock, KDAConfig
    blk = KDABlock(KDAConfig(batch=batch, heads=heads, head_dim=128, **ov))
    t = blk.random_operands(seed=batch, device="cuda", n_accepted=[1] * batch)
    return blk, torch.tensor([t[n].data_ptr() for n in blk.operands()], dtype=torch.int64, device="cuda"), t


def topk_table(entries: int, k: int, ov: dict):
    from sdk.blocks.indexer import TopKBlock, TopKConfig
    blk = TopKBlock(TopKConfig(k=k, batch=1, max_entries=entries, **ov))
    g = torch.Generator(device="cuda").manual_seed(entries)
    w = torch.randn(64, 1, device="cuda", generator=g)
    scores = (torch.relu(torch.randn(64, entries, device="cuda", generator=g)) * w).sum(0).view(1, 1, entries)
    t = {"scores": scores, "start": torch.tensor([entries - 1], dtype=torch.int32, device="cuda"),
         "index": torch.empty(1, 1, blk.width, dtype=torch.int32, device="cuda")}
    return blk, torch.tensor([t[n].data_ptr() for n in blk.operands()], dtype=torch.int64, device="cuda"), t


def compress_table(ratio: int, batch: int, ov: dict):
    """V4.1's main compressor (512 channels; CSA's overlapping windows at ratio 4), every sequence's
    window closing at this token (the pooling runs)."""
    from sdk.blocks.dsv4_compress import DSV4CompressBlock, DSV4CompressConfig
    blk = DSV4CompressBlock(DSV4CompressConfig(dim=512, ratio=ratio, overlap=ratio == 4, batch=batch, tokens=1,
                                               max_entries=64, **ov))
    C, L = blk.width, blk.slots
    g = torch.Generator(device="cuda").manual_seed(ratio)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    t = {"kv": r(batch, 1, C).to(torch.bfloat16), "gate": r(batch, 1, C).to(torch.bfloat16),
         "position_bias": r(ratio, C), "start": torch.full((batch,), ratio - 1, dtype=torch.int32, device="cuda"),
         "state_kv": r(batch, L, C).to(torch.bfloat16), "state_gate": r(batch, L, C),
         "entries": torch.empty(batch, 64, 512, dtype=torch.bfloat16, device="cuda")}
    return blk, torch.tensor([t[n].data_ptr() for n in blk.operands()], dtype=torch.int64, device="cuda"), t


def experts_table(model: str, stage: str, hits: int, ov: dict, device="cuda"):
    from sdk.blocks.experts import ExpertsBlock

    from bench.experts_bench import expert_op, operands
    base = expert_op(model, stage)
    blk = ExpertsBlock(dataclasses.replace(base.config, **ov))
    shared, (routing,) = operands(base, hits, seed=hits, device=device, routings=1)
    t = routing | shared
    return blk, torch.tensor([t[n].data_ptr() if n in t else 0 for n in blk.operands()], dtype=torch.int64,
                             device=device), t


def run_stack(intermediate: int, layers: int, wd: str, ov: dict):
    """The MLP stack megakernel (bench/megakernel_bench.py's stack case) launched 4 times."""
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program, make_weights
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    cfg = MLPStackConfig(intermediate=intermediate, layers=layers, weight_dtype=wd, **ov)
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    tensors.update(make_weights(cfg, seed=1, device="cuda"))
    tensors["x"].copy_(torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16))
    rt = MegakernelRuntime(prog, tensors)
    for _ in range(4):
        rt.launch()
    torch.cuda.synchronize()
    rt.check()
    print(f"{cfg}: 4 launches, {len(prog.instructions)} instructions")


def main(argv=None):
    from bench.common import cu_stream, parse_overrides
    from sdk.blocks._cute import standalone
    a = argv if argv is not None else sys.argv[1:]
    if a[0] == "stack":
        return run_stack(int(a[1]), int(a[2]), a[3], parse_overrides(a[4] if len(a) > 4 else None))
    if a[0] == "gemv":
        blk, optab, keep = gemv_table(int(a[1]), int(a[2]), int(a[3]), a[4], parse_overrides(a[5] if len(a) > 5 else None))
    elif a[0] == "kda":
        blk, optab, keep = kda_table(int(a[1]), int(a[2]), parse_overrides(a[3] if len(a) > 3 else None))
    elif a[0] == "topk":
        blk, optab, keep = topk_table(int(a[1]), int(a[2]), parse_overrides(a[3] if len(a) > 3 else None))
    elif a[0] == "compress":
        blk, optab, keep = compress_table(int(a[1]), int(a[2]), parse_overrides(a[3] if len(a) > 3 else None))
    elif a[0] == "experts":
        blk, optab, keep = experts_table(a[1], a[2], int(a[3]), parse_overrides(a[4] if len(a) > 4 else None))
    else:
        raise SystemExit(f"unknown block {a[0]!r}: gemv | kda | topk | compress | experts | stack")
    fn = standalone(blk)
    for _ in range(4):
        fn(optab.data_ptr(), cu_stream())
    torch.cuda.synchronize()
    print(f"{blk.config}: 4 launches, {len(keep)} operand tensors")


if __name__ == "__main__":
    main()
