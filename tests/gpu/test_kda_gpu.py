"""KDA block on the GPU (the H200): the standalone kernel (one CTA per tile, the same device tile
the megakernel inlines) against the block's fp32 reference (= sdk/reference/kda.py's recurrence)
on fresh random inputs, outputs poisoned with NaN; Kimi K3 (12 heads) and GLM-5.3 (8 heads) TP8
shapes at batch 1, 8, 64; ragged per-sequence states and accepted counts; and the drift of a bf16
state over 10,000 decode steps against the fp32 reference.

Run: `pytest -m gpu tests/gpu/test_kda_gpu.py -s` (the drift numbers are printed; with
KDA_DRIFT_JSON=path they are also written as JSON)."""
import json
import os

import pytest
import torch

import harness
from harness import need_gpu, run_standalone

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2      # bf16 outputs vs the fp32 reference (relative Frobenius), as the other blocks
# fp32 state: same fp32 math, only exp/rsqrt rounding and summation order differ. Measured on the
# H200: <= 1.45e-5 (3 tokens, conv + gated norm fused, per-token states, batch 64); the first guess
# of 1e-5 was under that. 1e-4 is the bound the other fp32 outputs here use, still far below any bug
# (a wrong gate, beta or order gives O(1e-1)).
FP32_STATE_TOL = 1e-4
BF16_STATE_TOL = 4e-3   # bf16 state storage: one rounding (2^-8 relative at most per element)


def rel_err(got, ref):
    # unchecked: the drift test records non-finite errors and asserts on them at the end
    return harness.rel_err(got, ref, check_finite=False, min_norm=1e-30)


def check_against_reference(block, t):
    ref = block.reference(**t)
    got = {k: v.clone() for k, v in t.items()}
    run_standalone(block, got)
    for name, r in ref.items():
        g = got[name]
        fin = torch.isfinite(r)
        # written exactly where the reference writes (poison left elsewhere), finite there
        assert torch.equal(torch.isfinite(g), fin), f"{name}: NaN poison not overwritten / wrongly overwritten"
        if not fin.any():
            continue
        if name in ("state", "states_out"):
            tol = FP32_STATE_TOL if g.dtype == torch.float32 else BF16_STATE_TOL
        elif name == "conv_state":
            assert torch.equal(g, r), "conv state: values are moved, not computed: must be exact"
            continue
        else:
            tol = BF16_TOL if g.dtype == torch.bfloat16 else 1e-4
        err = rel_err(g[fin], r[fin])
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"
    return got


def gpu_inputs(block, seed, **kw):
    return block.random_operands(seed=seed, device="cuda", **kw)


SHAPES = {"kimi_k3_tp8": 12, "glm53_tp8": 8}
CASES = [
    dict(),                                                        # plain decode, fp32 state
    dict(conv=True, out_norm=True),                                # the fused decode block
    dict(v_split=4, state_dtype="bf16", gate_kind="softplus"),
    dict(v_split=2, tokens=4, commit="none", out_dtype="fp32"),    # verify pass
    dict(tokens=3, commit="per_token", conv=True, out_norm=True, conv_w_dtype="fp32"),
    dict(conv=True, out_norm=True, tokens=2, commit="accepted"),  # staged conv, commit after verify
    dict(v_split=2, k_warps=1),                                    # K sums in-warp only
    dict(v_split=2, k_warps=8),                                    # K sums across 8 warps (smem)
    dict(v_split=4, k_warps=4, state_dtype="bf16"),
    dict(v_split=2, k_warps=2, tokens=3, commit="per_token", out_dtype="fp32"),
    dict(conv=True, out_norm=True, k_warps=2, tokens=2),
    dict(stream=True, v_split=4),                                  # the streaming form (ring)
    dict(stream=True, v_split=4, k_warps=1),
    dict(stream=True, v_split=2, k_warps=8, state_dtype="bf16", gate_kind="softplus"),
    dict(stream=True, v_split=2, tokens=3, commit="per_token", out_dtype="fp32"),
    dict(stream=True, tokens=4, commit="none", gate_kind="log_decay"),
    dict(stream=True, v_split=4, heads_per_tile=4),                # 4 heads per tile (one begin)
    dict(stream=True, v_split=2, heads_per_tile=2, tokens=3, commit="per_token", state_dtype="bf16"),
]


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "decode")
def test_kda_block_matches_reference(batch, model, kw):
    need_gpu()
    from sdk.blocks.kda import KDABlock, KDAConfig
    block = KDABlock(KDAConfig(batch=batch, heads=SHAPES[model], head_dim=128, **kw))
    t = gpu_inputs(block, seed=batch + len(kw))
    check_against_reference(block, t)


@pytest.mark.parametrize("batch,model,tokens", [(8, "kimi_k3_tp8", 1), (64, "glm53_tp8", 1), (4, "kimi_k3_tp8", 3)])
def test_kda_staged_conv_equals_per_lane_conv(batch, model, tokens):
    """conv_staged (each conv output computed once per tile into shared memory) runs the same fp32
    operations as the per-lane conv: outputs, state and conv state bit-identical, and equal to
    the reference."""
    need_gpu()
    from sdk.blocks.kda import KDABlock, KDAConfig
    kw = dict(batch=batch, heads=SHAPES[model], head_dim=128, tokens=tokens, conv=True, out_norm=True)
    plain, staged = KDABlock(KDAConfig(conv_staged=False, **kw)), KDABlock(KDAConfig(conv_staged=True, **kw))
    t = gpu_inputs(plain, seed=batch + tokens)
    got_staged = check_against_reference(staged, t)
    got_plain = {k: v.clone() for k, v in t.items()}
    run_standalone(plain, got_plain)
    for name in ("o", "state", "conv_state"):
        assert torch.equal(got_staged[name], got_plain[name]), f"{name}: staged conv differs from the per-lane conv"


@pytest.mark.parametrize("kw", [dict(), dict(conv=True, out_norm=True), dict(state_dtype="bf16", v_split=2),
                                dict(stream=True, v_split=4), dict(stream=True, v_split=2, heads_per_tile=4)],
                         ids=["core", "conv+norm", "bf16-state", "stream", "stream-4-heads"])
def test_kda_ragged_accepted_commit(kw):
    """Batch 8, every sequence its own state scale (one all-zero: a fresh sequence) and its own
    accepted count 0..4 of a 4-token verify: the commit pass writes exactly those."""
    need_gpu()
    from sdk.blocks.kda import KDABlock, KDAConfig
    acc = [0, 1, 2, 3, 4, 4, 1, 0]
    block = KDABlock(KDAConfig(batch=8, heads=12, tokens=4, commit="accepted", **kw))
    t = gpu_inputs(block, seed=7, n_accepted=acc)
    scale = torch.tensor([0.0, 0.1, 1.0, 3.0, 0.3, 0.01, 10.0, 1.0], device="cuda")
    t["state"] = (t["state"].float() * scale[:, None, None, None]).to(t["state"].dtype)
    got = check_against_reference(block, t)
    for b, j in enumerate(acc):
        assert torch.isfinite(got["o"][b, :j].float()).all()
        assert torch.isnan(got["o"][b, j:].float()).all()
        if j == 0:
            assert torch.equal(got["state"][b], t["state"][b])


def test_kda_bf16_state_drift_10k_steps():
    """10,000 decode steps (Kimi K3 TP8 shape, batch 8, sigmoid gate, fresh random inputs every
    step): the block with a bf16 state and with an fp32 state against the fp32 reference carried
    in torch. Drift = relative error of the output o per step; the max over steps is reported.
    Bounds fixed before measuring: bf16 state <= 5e-2 (the state is a contraction - decay and
    the delta rule's (I - beta k k^T) - so rounding errors do not grow without bound), fp32 <= 1e-3."""
    need_gpu()
    from sdk.blocks.kda import KDABlock, KDAConfig
    steps = int(os.environ.get("KDA_DRIFT_STEPS", "10000"))
    B, H, K = 8, 12, 128
    blk = {sd: KDABlock(KDAConfig(batch=B, heads=H, head_dim=K, state_dtype=sd, out_dtype="fp32"))
           for sd in ("bf16", "fp32")}
    base = gpu_inputs(blk["fp32"], seed=11)
    state_ref = torch.zeros(B, H, K, K, device="cuda")
    tens = {sd: dict(base, state=torch.zeros(B, H, K, K, device="cuda", dtype=torch.bfloat16 if sd == "bf16"
                                               else torch.float32)) for sd in blk}
    g = torch.Generator(device="cuda").manual_seed(5)
    errs = {sd: [] for sd in blk}
    for step in range(steps):
        fresh = {n: torch.randn(base[n].shape, device="cuda", generator=g).to(base[n].dtype)
                 for n in ("q", "k", "v", "g", "beta")}
        ref_t = dict(base, **fresh, state=state_ref)
        ref = blk["fp32"].reference(**ref_t)
        state_ref = ref["state"]
        for sd, b in blk.items():
            t = tens[sd]
            t.update(fresh)
            t["o"].fill_(float("nan"))
            run_standalone(b, t)
            errs[sd].append(rel_err(t["o"], ref["o"]))
    drift = {sd: {"max_rel_err_o": max(e), "final_rel_err_o": e[-1], "mean_rel_err_o": sum(e) / len(e),
                  "final_rel_err_state": rel_err(tens[sd]["state"], state_ref)} for sd, e in errs.items()}
    rec = {"steps": steps, "batch": B, "heads": H, "head_dim": K, "gate_kind": "sigmoid", "drift": drift,
           "gpu": torch.cuda.get_device_name(0)}
    print("\nKDA drift:", json.dumps(rec, indent=1))
    if os.environ.get("KDA_DRIFT_JSON"):
        with open(os.environ["KDA_DRIFT_JSON"], "w") as f:
            json.dump(rec, f, indent=1)
    assert all(torch.isfinite(torch.tensor(e)).all() for e in errs.values())
    assert drift["fp32"]["max_rel_err_o"] <= 1e-3, drift
    assert drift["bf16"]["max_rel_err_o"] <= 5e-2, drift


@pytest.mark.parametrize("kw", [dict(v_split=4), dict(conv=True, out_norm=True), dict(v_split=4, stream=True)],
                         ids=["core", "conv+norm", "stream"])
def test_kda_pdl_back_to_back_steps_feed_each_other(kw):
    """standalone(pdl=True): the one-tile-per-CTA kernel launched with programmatic dependent
    launch, 4 steps back to back on one stream without a host sync, each reading the state (and
    conv state) the step before wrote in place: equal to 4 reference steps - every CTA waits for
    the previous grid before its first read."""
    need_gpu()
    import cuda.bindings.driver as cuda

    from sdk.blocks._cute import standalone
    from sdk.blocks.kda import KDABlock, KDAConfig
    block = KDABlock(KDAConfig(batch=64, heads=8, head_dim=128, **kw))
    t = gpu_inputs(block, seed=harness.clock_seed())
    ref = dict(t)
    for _ in range(4):
        ref = dict(ref, **block.reference(**ref))
    fn = standalone(block, pdl=True)
    optab = torch.tensor([t[n].data_ptr() for n in block.operands()], dtype=torch.int64, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    for _ in range(4):
        fn(optab.data_ptr(), stream)
    torch.cuda.synchronize()
    for name in ("o", "state") + (("conv_state",) if block.config.conv else ()):
        if name == "conv_state":
            assert torch.equal(t[name], ref[name]), "conv state after 4 steps"
        else:
            tol = BF16_TOL if t[name].dtype == torch.bfloat16 else FP32_STATE_TOL
            err = rel_err(t[name], ref[name])
            assert err <= tol, f"{name} after 4 steps: relative error {err:.3e} > {tol}"


@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("kw", [dict(v_split=4), dict(v_split=4, stream=True), dict(conv=True, out_norm=True),
                                dict(v_split=2, stream=True, tokens=2, state_dtype="bf16"),
                                dict(v_split=4, stream=True, heads_per_tile=4)],
                         ids=["core", "stream", "conv+norm", "stream-bf16-T2", "stream-4-heads"])
def test_kda_layer_chain_one_launch(model, kw):
    """KDA as megakernel instructions: three layers in ONE megakernel launch (bench.kda_bench.
    layer_chain - layer l+1's v is layer l's output, waited for through the counters; the conv
    variant's layers independent), batch 64 at the TP8 shapes, two launches carrying the states,
    outputs NaN-poisoned before each: every layer's output and state equal the chained fp32
    reference."""
    need_gpu()
    from bench.kda_bench import layer_chain, layer_chain_inputs, layer_chain_reference
    from sdk.blocks.kda import KDABlock, KDAConfig
    L = 3
    block = KDABlock(KDAConfig(batch=64, heads=SHAPES[model], head_dim=128, **kw))
    prog = layer_chain(block, L)
    seed = harness.clock_seed()
    t = layer_chain_inputs(block, L, seed=seed, device="cuda")
    rt = harness.program_runtime(prog, {}, inputs=t)
    carried = {}
    for launch in range(2):
        fresh = layer_chain_inputs(block, L, seed=seed + 1 + launch, device="cuda")
        fresh.update(carried)
        ref = layer_chain_reference(block, fresh, L)
        for name, v in fresh.items():
            rt.tensors[name].copy_(v)
        rt.run()
        for name, r in ref.items():
            g = rt.tensors[name]
            base = name.rstrip("0123456789")
            if base == "conv_state":
                assert torch.equal(g, r), f"seed {seed}, launch {launch}: {name} (values are moved: exact)"
                continue
            tol = (FP32_STATE_TOL if g.dtype == torch.float32 else BF16_STATE_TOL) if base == "state" else BF16_TOL
            err = harness.rel_err(g, r)
            assert err <= tol, f"seed {seed}, launch {launch}: {name} relative error {err:.3e} > {tol}"
        carried = {f"{n}{i}": rt.tensors[f"{n}{i}"].clone() for i in range(L) for n in ("state", "conv_state")
                   if f"{n}{i}" in rt.tensors}
