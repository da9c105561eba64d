"""GPU tests of the fused in-kernel all-reduce with N virtual ranks on one GPU (N concurrent
megakernel launches, one stream and num_sms // N CTAs each; peer stores land in local HBM):
the TP-sharded MLP stack, all-reduce chains and chains of the all-reduce fused with the mHC
post-mix against the torch reference on fresh random inputs with NaN-poisoned outputs, several
steps without host resets; a rank that never launches ends the others in KernelTimeoutError
naming it, and the runtime recovers.
Run: `pytest -m gpu tests/gpu/test_allreduce_gpu.py`."""

import pytest
import torch

from harness import expect_missing_rank_timeout, need_gpu, rel_err

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


def _stack(n, algo, batch, layers=3, timeout_s=2.0, seed=0):
    from sdk.comm import VirtualRanks
    from sdk.comm.runtime import TPRuntime
    from sdk.megakernel.mlp_stack import MLPStackConfig, make_weights
    from sdk.megakernel.tp_stack import TPStackConfig, build_program, rank_tensors
    st = MLPStackConfig(hidden=7168, intermediate=2048, layers=layers, batch=batch)
    cfg = TPStackConfig(st, n, algo=algo)
    prog, comm = build_program(cfg)
    full = make_weights(st, seed=seed, device="cuda")
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [rank_tensors(cfg, prog, comm, bufs, r, full, "cuda") for r in range(n)]
    return st, full, TPRuntime(prog, comm, bufs, T, timeout_s=timeout_s), comm


@pytest.mark.parametrize("n,algo,batch", [(2, "oneshot", 1), (4, "oneshot", 1), (8, "oneshot", 1),
                                          (2, "twoshot", 8), (4, "twoshot", 8), (8, "twoshot", 8)])
def test_tp_mlp_stack(n, algo, batch):
    """hidden 7168, intermediate 2048 sharded over n ranks, 3 layers (odd: the epoch parity of the
    receive buffers matters), 3 steps without host resets, fresh inputs, poisoned outputs; every
    rank's output equals the unsharded reference and the other ranks' bit for bit."""
    need_gpu()
    from sdk.megakernel.mlp_stack import reference
    st, full, rt, comm = _stack(n, algo, batch)
    assert {r["algo"] for r in comm.records} == {algo}
    for step in range(3):
        x = torch.randn(batch, st.hidden, device="cuda").to(torch.bfloat16)
        for t in rt.tensors:
            t["x"].copy_(x)
            for name in ("out", "h", "act", "partial"):
                t[name].fill_(float("nan"))
        rt.run()
        ref = reference(st, full, x)
        for r, t in enumerate(rt.tensors):
            err = rel_err(t["out"], ref)
            assert err <= BF16_TOL, f"rank {r} step {step}: relative error {err:.3e}"
            assert torch.equal(t["out"], rt.tensors[0]["out"]), f"rank {r} differs from rank 0"


def _chain(n, m, d, algo, k=3, wire="bf16", timeout_s=2.0):
    from sdk.comm import VirtualRanks
    from sdk.comm.runtime import TPRuntime
    from sdk.megakernel.tp_stack import build_allreduce_chain
    prog, comm = build_allreduce_chain(n, m, d, k, algo=algo, wire=wire)
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [comm.alloc_rank_tensors(bufs, r, "cuda") for r in range(n)]
    nw = (1 + 0.1 * torch.randn(d, device="cuda")).to(torch.bfloat16)
    for t in T:
        t["norm.weight"].copy_(nw)
    return TPRuntime(prog, comm, bufs, T, timeout_s=timeout_s), nw


@pytest.mark.parametrize("n,algo,m,d,wire", [(2, "oneshot", 1, 7168, "bf16"), (4, "oneshot", 8, 4096, "fp32"),
                                             (8, "oneshot", 1, 7168, "bf16"), (2, "twoshot", 64, 7168, "bf16"),
                                             (4, "twoshot", 16, 4096, "bf16"), (8, "twoshot", 64, 7168, "bf16")])
def test_allreduce_chain(n, algo, m, d, wire):
    """3 chained all-reduces per launch, 4 launches with fresh partials: resid and out equal the
    fp32 math (two-shot rounds the reduced shard to the wire dtype, as a bf16 all-reduce does)."""
    need_gpu()
    from sdk.blocks.allreduce import AllReduceBlock, AllReduceConfig
    K = 3
    rt, nw = _chain(n, m, d, algo, K, wire)
    blk = AllReduceBlock(AllReduceConfig(ranks=n, m=m, d=d, wire=wire))
    wdt = torch.bfloat16 if wire == "bf16" else torch.float32
    want = torch.randn(m, d, device="cuda")
    for t in rt.tensors:
        t["resid"].copy_(want)
    for step in range(4):
        parts = [torch.randn(m, d, device="cuda").to(wdt) for _ in range(n)]
        for t, p in zip(rt.tensors, parts):
            t["partial"].copy_(p)
            t["out"].fill_(float("nan"))
        rt.run()
        for _ in range(K):
            ref = blk.reference(parts, res=want, norm_weight=nw)
            want = ref["resid_out"]
        for r, t in enumerate(rt.tensors):
            assert rel_err(t["resid"], want) <= (1e-5 if algo == "oneshot" else BF16_TOL), f"rank {r} step {step}"
            assert rel_err(t["out"], ref["out"]) <= BF16_TOL
            assert torch.equal(t["resid"], rt.tensors[0]["resid"])


def _mhc_chain(n, m, d, algo, k, stream_dtype, timeout_s=2.0):
    from sdk.comm import VirtualRanks
    from sdk.comm.ops import build_mhc_allreduce_chain
    from sdk.comm.runtime import TPRuntime
    prog, comm = build_mhc_allreduce_chain(n, m, d, k, algo=algo, stream_dtype=stream_dtype)
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [comm.alloc_rank_tensors(bufs, r, "cuda") for r in range(n)]
    return TPRuntime(prog, comm, bufs, T, timeout_s=timeout_s), comm


@pytest.mark.parametrize("n,algo,m,d,sdt", [(2, "oneshot", 1, 5120, "fp32"), (4, "oneshot", 8, 4096, "bf16"),
                                            (8, "oneshot", 1, 5120, "fp32"), (2, "twoshot", 64, 4096, "fp32"),
                                            (4, "twoshot", 8, 5120, "bf16"), (8, "twoshot", 64, 5120, "fp32")])
def test_mhc_allreduce_chain(n, algo, m, d, sdt):
    """The all-reduce fused with the mHC post-mix (V4.1-Flash D 5120, GLM-5.3 D 4096; 4 streams,
    the next mix's 24 partials): 3 chained per launch (the first out of place, then in place),
    3 launches with fresh partials, streams and coefficients, poisoned outputs; every rank's
    streams and partials equal the unsharded definition (sdk.comm.ops.mhc_chain_reference; y
    rounded to bf16 for two-shot, as its reduce-scatter sends it) and rank 0's bit for bit.
    Tolerances: fp32 streams 1e-5 (FMA contraction: ulps), bf16 streams 1e-2 (an ulp may flip a
    bf16 rounding), partials 1e-3 (warp-reduction order; tests/gpu/test_mhc_gpu.py's bound)."""
    need_gpu()
    from sdk.comm.ops import mhc_chain_reference
    K, hc = 3, 4
    rt, comm = _mhc_chain(n, m, d, algo, K, sdt)
    assert {r["algo"] for r in comm.records} == {algo}
    dt = torch.float32 if sdt == "fp32" else torch.bfloat16
    fn = torch.randn(24, hc * d, device="cuda") * 0.02
    for t in rt.tensors:
        t["fn_next"].copy_(fn)
    for step in range(3):
        parts = [torch.randn(m, d, device="cuda").to(torch.bfloat16) for _ in range(n)]
        x = torch.randn(m, hc, d, device="cuda").to(dt)
        # coefficients shaped like MHCPreBlock's: pre > 0, post in (0, 2), comb rows sum to 1
        coefs = [torch.cat([torch.rand(m, 2 * hc, device="cuda") * 2,
                            torch.softmax(torch.randn(m, hc * hc, device="cuda").view(m, hc, hc), -1).flatten(1)], 1)
                 for _ in range(K)]
        for t, p in zip(rt.tensors, parts):
            t["partial"].copy_(p)
            t["streams_in"].copy_(x)
            t["streams"].fill_(float("nan"))
            for j in range(K):
                t[f"coef.{j}"].copy_(coefs[j])
                t[f"part.{j}"].fill_(float("nan"))
        rt.run()
        want_x, want_p = mhc_chain_reference(parts, x, coefs, fn, wire_round="bf16" if algo == "twoshot" else None)
        for r, t in enumerate(rt.tensors):
            err = rel_err(t["streams"], want_x)
            assert err <= (1e-5 if sdt == "fp32" else 1e-2), f"rank {r} step {step}: streams relative error {err:.3e}"
            for j in range(K):
                err = rel_err(t[f"part.{j}"], want_p[j])
                assert err <= 1e-3, f"rank {r} step {step}: part.{j} relative error {err:.3e}"
                assert torch.equal(t[f"part.{j}"], rt.tensors[0][f"part.{j}"]), f"rank {r}: part.{j} differs"
            assert torch.equal(t["streams"], rt.tensors[0]["streams"]), f"rank {r} differs from rank 0"


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_missing_rank_times_out_and_recovers(algo):
    """Rank 3 of 4 is never launched: ranks 0-2 end in KernelTimeoutError naming rank 3 within
    ~the flag timeout (no hang); after it the runtime resets and a full run is correct."""
    need_gpu()
    from sdk.blocks.allreduce import AllReduceBlock, AllReduceConfig
    m, d = (2, 4096) if algo == "oneshot" else (64, 4096)
    rt, nw = _chain(4, m, d, algo, k=2, timeout_s=0.4)
    parts = [torch.randn(m, d, device="cuda").to(torch.bfloat16) for _ in range(4)]
    for t, p in zip(rt.tensors, parts):
        t["partial"].copy_(p)
    expect_missing_rank_timeout(rt, "ar0")
    # recovered: counters, flags, epochs reset; all four ranks run correctly again
    r0 = torch.randn(m, d, device="cuda")
    for t in rt.tensors:
        t["resid"].copy_(r0)
        t["out"].fill_(float("nan"))
    rt.run()
    blk = AllReduceBlock(AllReduceConfig(ranks=4, m=m, d=d))
    ref = blk.reference(parts, res=blk.reference(parts, res=r0, norm_weight=nw)["resid_out"], norm_weight=nw)
    for t in rt.tensors:
        assert rel_err(t["out"], ref["out"]) <= BF16_TOL


def test_many_steps_no_reset():
    """20 launches back to back, no host synchronisation and no stream join between them: each
    rank's stream free-runs, so a fast rank starts launch k+1 while others finish launch k (the
    epochs and the parity buffers make that safe)."""
    need_gpu()
    from sdk.blocks.allreduce import AllReduceBlock, AllReduceConfig
    n, m, d = 8, 1, 7168
    rt, nw = _chain(n, m, d, "oneshot", k=1)
    parts = [torch.randn(m, d, device="cuda").to(torch.bfloat16) for _ in range(n)]
    for t, p in zip(rt.tensors, parts):
        t["partial"].copy_(p)
    torch.cuda.synchronize()
    for _ in range(20):
        rt.launch(join=False)
    rt.join()
    torch.cuda.synchronize()
    rt.check()
    s = sum(p.float() for p in parts)
    for t in rt.tensors:
        assert rel_err(t["resid"], 20 * s) <= 1e-5
    ref = AllReduceBlock(AllReduceConfig(ranks=n, m=m, d=d, residual="")).reference(
        [20 * s], norm_weight=nw)["out"]
    assert rel_err(rt.tensors[0]["out"], ref) <= BF16_TOL
