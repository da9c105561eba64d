"""Tensor-parallel MLA attention on the GPU (the H200) with N virtual ranks: each rank's heads
shard - W_UK -> split-KV decode -> combine -> W_UV -> row-parallel o_proj -> the fused all-reduce
+ residual + RMSNorm - in one megakernel launch per rank and step; fresh random inputs, pages
scattered, outputs and intermediates poisoned, two steps without host resets; every rank equals
the unsharded fp32 layer and the other ranks bit for bit.
Run: `pytest -m gpu tests/gpu/test_tp_attention_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


@pytest.mark.parametrize("n,algo", [(2, "oneshot"), (4, "twoshot"), (8, "oneshot")])
def test_tp_attention_layer(n, algo):
    need_gpu()
    from sdk.comm import VirtualRanks
    from sdk.comm.runtime import TPRuntime
    from sdk.megakernel.mla_attention import MLAAttentionConfig, make_inputs
    from sdk.megakernel.tp_attention import (TPAttentionConfig, build_program, make_weights, rank_tensors,
                                             reference, shard_inputs)
    seed = clock_seed()
    lens = [700, 5000]
    attn = MLAAttentionConfig(heads=16, batch=2, num_pages=sum(-(-x // 64) for x in lens) + 4, max_seq_len=5000,
                              scale_factor=1.21)
    cfg = TPAttentionConfig(attn, n, hidden=7168, algo=algo)
    prog, comm = build_program(cfg)
    assert {r["algo"] for r in comm.records} == {algo}
    full = make_weights(cfg, seed=seed, device="cuda")
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [rank_tensors(cfg, prog, comm, bufs, r, full, "cuda") for r in range(n)]
    rt = TPRuntime(prog, comm, bufs, T, timeout_s=2.0)
    for step in range(2):
        inp = make_inputs(attn, lens, seed=seed + 1 + step, device="cuda")
        inp["x"] = torch.randn(attn.tokens, cfg.hidden, device="cuda").to(torch.bfloat16)
        for r, t in enumerate(rt.tensors):
            for name, v in shard_inputs(cfg, inp, r).items():
                t[name].copy_(v)
            for name in ("o_part", "lse_part", "o_lat", "o", "partial", "out"):
                t[name].fill_(float("nan"))
        rt.run()
        want = reference(cfg, full, inp)
        for r, t in enumerate(rt.tensors):
            err = rel_err(t["out"], want)
            assert err <= BF16_TOL, f"seed {seed}, rank {r}, step {step}: rel err {err:.3e}"
            assert torch.equal(t["out"], rt.tensors[0]["out"]), f"seed {seed}: rank {r} differs from rank 0"
