"""GPU tests of the MoE blocks and the one-launch MoE layer (the H200): each model's real per-GPU
shard at batch 1, 8, 64 against sdk/reference/moe.py's routing and expert math (fp32), fresh
random inputs, every scratch/output buffer poisoned before each launch, several launches per
runtime (counter epochs; the dispatch table is never reset by the host); the router's selection
and dispatch table against its torch rule (ties included); skewed and all-experts routing.
Run: `pytest -m gpu tests/gpu/test_moe_gpu.py`."""
import pytest
import torch

from harness import need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2
POISON = ("logits", "topk_ids", "topk_w", "act", "shared_act", "shared_out", "out", "tok", "slot", "hits", "counts")


def _runtime(cfg, seed=0):
    from sdk.megakernel.moe_layer import build_program, make_weights
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    weights = make_weights(cfg, seed=seed, device="cuda")
    tensors.update(weights)
    return MegakernelRuntime(prog, tensors), weights


def _poison(t):
    for name in POISON:
        if name in t:
            if t[name].dtype.is_floating_point:
                t[name].fill_(float("nan"))
            else:
                t[name].fill_(-7)


def _launch(rt, cfg, x, ids=None):
    _poison(rt.tensors)
    rt.tensors["x"].copy_(x)
    if cfg.hash_routed:
        rt.tensors["input_ids"].copy_(ids)
    rt.run()
    return rt.tensors["out"]


def _check_routing(cfg, weights, rt, x, ids=None):
    """The kernel's experts per token equal the oracle's (route()), except on tokens whose k-th and
    (k+1)-th choices are within 1e-4 (fp32 logits summed in another order may swap those)."""
    from sdk.megakernel.moe_layer import router_logits
    from sdk.reference.moe import route
    logits = router_logits(cfg, weights, x)
    hashed = weights["router.tid2eid"][ids.long()].long() if cfg.hash_routed else None
    w_ref, ids_ref = route(cfg.moe_spec(), logits, weights.get("router.bias"), hashed)
    got = rt.tensors["topk_ids"].long()
    same = (got.sort(-1)[0] == ids_ref.sort(-1)[0]).all(-1)
    if not cfg.hash_routed:
        choice = {"sigmoid": logits.sigmoid(), "softmax": logits.softmax(-1),
                  "sqrtsoftplus": torch.nn.functional.softplus(logits).sqrt()}[cfg.scoring]
        if cfg.correction_bias:
            choice = choice + weights["router.bias"]
        top = choice.topk(cfg.top_k + 1, dim=-1)[0]
        near_tie = (top[:, -2] - top[:, -1]) < 1e-4
        same = same | near_tie
    assert same.all(), f"tokens {torch.where(~same)[0].tolist()} routed differently from route()"
    # weights of matching experts: equal to fp32 rounding
    o_ref, o = ids_ref.sort(-1)[1], got.sort(-1)[1]
    ok = (got.sort(-1)[0] == ids_ref.sort(-1)[0]).all(-1)
    assert torch.allclose(w_ref.gather(1, o_ref)[ok], rt.tensors["topk_w"].gather(1, o)[ok], rtol=1e-4, atol=1e-6)
    return (got.sort(-1)[0] == ids_ref.sort(-1)[0]).all()


def _select_case(case, m):
    """(RouterSelectConfig, logits [m, E]) of a named routing case."""
    from sdk.blocks.router import RouterSelectConfig
    if case == "ties":
        cfg = RouterSelectConfig(num_experts=64, top_k=4, m=m)
        logits = (torch.arange(64).float() % 4).repeat(m, 1)
        logits[-1, [7, 9, 30, 50, 63]] = 9.0
        if m > 2:
            logits[1] = 0.0
    elif case == "glm":
        cfg = RouterSelectConfig(num_experts=288, top_k=8, m=m, correction_bias=True, routed_scaling_factor=2.5,
                                 local_start=36, num_local=36)
        logits = torch.randn(m, 288).round()               # exact ties across the warps' expert sets
    elif case == "sqrtsoftplus":
        cfg = RouterSelectConfig(num_experts=384, top_k=6, m=m, scoring="sqrtsoftplus", correction_bias=True,
                                 routed_scaling_factor=1.5, local_start=96, num_local=48)
        logits = torch.randn(m, 384) * 3
    elif case == "v4_bf16":               # DeepSeek-V4's bf16 router (router_logits_dtype "model")
        cfg = RouterSelectConfig(num_experts=384, top_k=6, m=m, scoring="sqrtsoftplus", correction_bias=True,
                                 routed_scaling_factor=1.5, local_start=96, num_local=48, logits_bf16=True)
        logits = torch.randn(m, 384) * 3
    elif case == "groups_ties":
        cfg = RouterSelectConfig(num_experts=256, top_k=8, m=m, n_group=8, topk_group=4, correction_bias=True)
        logits = torch.randn(m, 256).round()               # many exact ties
    elif case == "random_kimi":
        cfg = RouterSelectConfig(num_experts=896, top_k=16, m=m, correction_bias=True, local_start=56, num_local=56)
        logits = torch.randn(m, 896)
    else:
        cfg = RouterSelectConfig(num_experts=384, top_k=6, m=m, scoring="softmax", routed_scaling_factor=1.5,
                                 local_start=96, num_local=48)
        logits = torch.randn(m, 384) * 3
    return cfg, logits


@pytest.mark.parametrize("case,m,argmax", [("ties", 8, "shuffle"), ("groups_ties", 8, "shuffle"),
                                           ("random_kimi", 8, "shuffle"), ("softmax_ep", 8, "shuffle"),
                                           ("ties", 3, "shuffle"), ("ties", 1, "shuffle"),
                                           ("random_kimi", 1, "shuffle"), ("random_kimi", 2, "shuffle"),
                                           ("glm", 1, "shuffle"), ("sqrtsoftplus", 1, "shuffle"),
                                           ("ties", 8, "redux"), ("groups_ties", 8, "redux"), ("ties", 1, "redux"),
                                           ("random_kimi", 1, "redux"), ("glm", 1, "redux"), ("softmax_ep", 8, "redux"),
                                           ("v4_bf16", 1, "redux"), ("v4_bf16", 8, "redux"), ("v4_bf16", 3, "shuffle")])
def test_router_select_matches_rule(case, m, argmax):
    """The select tile on given logits: ids in selection order and weights equal the torch rule
    (ties: lower index first), the dispatch table equal up to the order inside each list. Batch
    1..3: the token's experts split over 8 / 4 / 2 warps, candidates merged (warps_per_token).
    Both warp argmax forms (butterfly shuffles, redux.sync)."""
    need_gpu()
    import dataclasses

    from sdk.blocks.router import RouterSelectBlock
    cfg, logits = _select_case(case, m)
    cfg = dataclasses.replace(cfg, warp_argmax=argmax)
    block = RouterSelectBlock(cfg)
    t = {k: v.cuda() for k, v in block.alloc_operands().items()}
    t["logits"] = logits.cuda()
    if cfg.correction_bias:
        t["bias"] = (torch.randn(cfg.num_experts) * 0.1).cuda() if case not in ("groups_ties", "glm") else torch.zeros(cfg.num_experts, device="cuda")
    for n in ("topk_ids", "tok", "slot", "hits", "counts"):
        t[n].fill_(-7)
    t["topk_w"].fill_(float("nan"))
    run_standalone(block, t)
    ref = {k: v.clone() for k, v in t.items()}
    block.emulate_tile(ref, 0)
    assert torch.equal(t["topk_ids"], ref["topk_ids"])
    # bf16 router: a score whose fp32 value sits at a bf16 rounding boundary may round the other way
    # (the device's softplus / sqrt vs torch's): one bf16 step of the weight
    tol = 8e-3 if cfg.logits_bf16 else 1e-5
    assert torch.allclose(t["topk_w"], ref["topk_w"], rtol=tol, atol=1e-7)
    assert torch.equal(t["counts"], ref["counts"])
    n_hit = int(ref["hits"][0])
    assert torch.equal(t["hits"][:1 + n_hit], ref["hits"][:1 + n_hit])
    for le in range(block.num_local):
        n = int(ref["counts"][le])
        assert sorted(t["tok"][le, :n].tolist()) == ref["tok"][le, :n].tolist()
        assert sorted(t["slot"][le, :n].tolist()) == ref["slot"][le, :n].tolist()


@pytest.mark.parametrize("fmt,kind", [("bf16", "groups_softmax"), ("fp8_e4m3", "hash_sqrtsoftplus"),
                                      ("mxfp4", "groups_softmax")])
def test_moe_layer_formats_and_routing_kinds(fmt, kind):
    need_gpu()
    from sdk.megakernel.moe_layer import MoELayerConfig, moe_reference_forward
    kw = dict(hidden=2048, num_experts=128, top_k=6, intermediate=512, num_local=32, rank=1, batch=8,
              expert_dtype=fmt, shared_intermediate=512, swiglu_limit=7.0, routed_scaling_factor=1.5)
    if kind == "groups_softmax":
        kw.update(scoring="softmax", n_group=8, topk_group=3, correction_bias=True)
    else:
        kw.update(scoring="sqrtsoftplus", hash_routed=True, vocab=1000)
    cfg = MoELayerConfig(**kw)
    rt, weights = _runtime(cfg, seed=7)
    cpu_w = {k: v.cpu() for k, v in weights.items()}
    for step in range(3):
        x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        ids = torch.randint(0, 1000, (cfg.batch,), dtype=torch.int32, device="cuda")
        out = _launch(rt, cfg, x, ids)
        _check_routing(cfg, weights, rt, x, ids)
        ref = moe_reference_forward(cfg, cpu_w, x.cpu(), ids.cpu())       # the oracle class itself
        assert rel_err(out.cpu(), ref) <= BF16_TOL, f"step {step}"


@pytest.mark.parametrize("fmt,mma", [("bf16", False), ("mxfp4", False), ("mxfp4", True)])
def test_moe_layer_skew_all_tokens_one_expert(fmt, mma):
    """Every token on one local expert (64 tokens: 8 groups of 8 through the same expert)."""
    need_gpu()
    from sdk.megakernel.moe_layer import MoELayerConfig, reference
    cfg = MoELayerConfig(hidden=2048, num_experts=128, top_k=4, intermediate=512, num_local=32, rank=2, batch=64,
                         correction_bias=True, expert_dtype=fmt, shared_intermediate=512, expert_mma=mma)
    rt, weights = _runtime(cfg, seed=3)
    weights["router.bias"].zero_()
    weights["router.bias"][70] = 100.0
    x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
    out = _launch(rt, cfg, x)
    assert int(rt.tensors["counts"][70 - 64]) == 64
    assert sorted(rt.tensors["tok"][6].tolist()) == list(range(64))
    assert rel_err(out, reference(cfg, weights, x)) <= BF16_TOL


def test_moe_layer_every_local_expert_hit():
    need_gpu()
    from sdk.megakernel.moe_layer import MoELayerConfig, reference
    cfg = MoELayerConfig(hidden=2048, num_experts=64, top_k=4, intermediate=512, batch=16, hash_routed=True,
                         vocab=16, scoring="sigmoid")
    rt, weights = _runtime(cfg, seed=4)
    weights["router.tid2eid"].copy_(torch.arange(64, dtype=torch.int32, device="cuda").reshape(16, 4))
    ids = torch.arange(16, dtype=torch.int32, device="cuda")
    x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
    out = _launch(rt, cfg, x, ids)
    assert int(rt.tensors["hits"][0]) == 64 and rt.tensors["hits"][1:].tolist() == list(range(64))
    assert rel_err(out, reference(cfg, weights, x, ids)) <= BF16_TOL


def test_moe_layer_cuda_graph_replays():
    """Launches captured in a CUDA graph and replayed: each replay is a new epoch and sees only
    its own step's dispatch table (no host reset between replays)."""
    need_gpu()
    from sdk.megakernel.moe_layer import MoELayerConfig, reference
    cfg = MoELayerConfig(hidden=2048, num_experts=128, top_k=8, intermediate=512, num_local=32, batch=8,
                         correction_bias=True, shared_intermediate=512)
    rt, weights = _runtime(cfg, seed=5)
    xs = [torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16) for _ in range(3)]
    rt.tensors["x"].copy_(xs[0])
    rt.run()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        rt.launch(s)
    torch.cuda.synchronize()
    for x in xs[1:] + xs[:1]:
        rt.tensors["x"].copy_(x)
        rt.tensors["out"].fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        rt.check()
        assert rel_err(rt.tensors["out"], reference(cfg, weights, x)) <= BF16_TOL


REAL = {"kimi_k3": "bf16", "deepseek_v41_flash": "mxfp4", "glm_53": "fp8_e4m3"}


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("model", list(REAL))
def test_moe_layer_real_shard_one_launch(model, batch):
    """The per-GPU shard of each model (router over all experts, this rank's experts, shared
    expert) in one launch; two launches with fresh inputs (epochs 1, 2)."""
    need_gpu()
    from sdk.megakernel.moe_layer import preset
    _check_two_steps(preset(model, batch, expert_dtype=REAL[model]), batch)


@pytest.mark.parametrize("model,fmt,stages,batches", [
    ("kimi_k3", "mxfp4", 3, (1, 4)), ("deepseek_v41_flash", "mxfp4", 3, (1,)), ("glm_53", "mxfp4", 3, (1, 4)),
    ("glm_53", "mxfp4", 2, (1, 8)), ("kimi_k3", "mxfp4", 2, (1,)), ("deepseek_v41_flash", "mxfp4", 2, (1, 4)),
    ("glm_53", "fp8_e4m3", 2, (1, 4))])
def test_moe_layer_expert_smem_stages(model, fmt, stages, batches):
    """ExpertsConfig.smem_stages (opt-in): the CUDA-core expert tiles copy each warp's (row, hit
    expert) items into its shared-memory slots with cp.async, stages - 1 ahead - the same math, so
    the layer equals the reference as the plain tiles do; batch 4 / 8: several tokens per expert
    (the 2..8-token variants read the slot too); at batch 1 a random step may hit no local expert. (V4.1-Flash
    3 deep at batch 4 is refused at build time: its slots and x leave the weight ring one stage.)"""
    need_gpu()
    from sdk.megakernel.moe_layer import preset
    for batch in batches:
        _check_two_steps(preset(model, batch, expert_dtype=fmt, expert_mma=False, expert_smem_stages=stages), batch)


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("model", list(REAL))
def test_moe_layer_tensor_core_experts(model, batch):
    """The same shards with MXFP4 experts on the tensor-core tile (ExpertsConfig.mma)."""
    need_gpu()
    from sdk.megakernel.moe_layer import preset
    _check_two_steps(preset(model, batch, expert_dtype="mxfp4", expert_mma=True), batch)


def _check_two_steps(cfg, batch):
    from sdk.megakernel.moe_layer import reference
    rt, weights = _runtime(cfg, seed=batch)
    for step in range(2):
        x = torch.randn(batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        out = _launch(rt, cfg, x)
        exact_routing = _check_routing(cfg, weights, rt, x)
        routing = (rt.tensors["topk_w"].float(), rt.tensors["topk_ids"].long())
        err = rel_err(out, reference(cfg, weights, x, routing=routing))
        assert err <= BF16_TOL, f"step {step}: relative error {err:.3e} (kernel's routing)"
        if exact_routing:
            err = rel_err(out, reference(cfg, weights, x))
            assert err <= BF16_TOL, f"step {step}: relative error {err:.3e} (oracle routing)"
        hits = int(rt.tensors["hits"][0])
        assert hits == int((rt.tensors["counts"] > 0).sum())


@pytest.mark.parametrize("batch,fmt,mma", [(1, "mxfp4", False), (8, "mxfp4", True), (4, "bf16", False)])
def test_moe_layer_latent_situ_equals_moe_reference(batch, fmt, mma):
    """Kimi K3's Stable LatentMoE with SiTU (betas 2 / 3, so a lost beta shows): latent-down GEMV,
    experts on the latent with the SiTU epilogue (CUDA-core and tensor-core tiles), the fp32 sum's
    RMSNorm + latent-up GEMV with the SiTU shared expert - against MoEReference.forward itself,
    three launches with fresh inputs."""
    need_gpu()
    from sdk.megakernel.moe_layer import MoELayerConfig, moe_reference_forward
    cfg = MoELayerConfig(hidden=2048, num_experts=128, top_k=6, intermediate=512, num_local=32, rank=1,
                         batch=batch, expert_dtype=fmt, expert_mma=mma, correction_bias=True,
                         shared_intermediate=512, activation="situ", situ_beta=2.0, situ_linear_beta=3.0,
                         latent=1024)
    rt, weights = _runtime(cfg, seed=11)
    cpu_w = {k: v.cpu() for k, v in weights.items()}
    for step in range(3):
        x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        out = _launch(rt, cfg, x)
        ref = moe_reference_forward(cfg, cpu_w, x.cpu())
        assert rel_err(out.cpu(), ref) <= BF16_TOL, f"step {step}"


@pytest.mark.parametrize("batch", [1, 8])
def test_kimi_k3_latent_shard_one_launch(batch):
    """Kimi K3's real per-GPU MoE shard (EP16) with its latent (3584) and SiTU, two launches."""
    need_gpu()
    from sdk.megakernel.moe_layer import preset
    _check_two_steps(preset("kimi_k3", batch, expert_dtype="mxfp4", activation="situ", latent=3584), batch)


@pytest.mark.parametrize("model,batch,mhc", [("deepseek_v41_flash", 1, "v41"), ("deepseek_v41_flash", 8, "v41"),
                                             ("glm_53", 1, "v4"), ("glm_53", 64, "v4")])
def test_moe_layer_in_mhc_one_launch(model, batch, mhc):
    """The real shard in the model's mHC residual (MoELayerConfig.mhc, mhc_site.py): the streams'
    collapse + input norm first (v41: V4.1's lagged form), the post-mix of the streams in place
    fused with the next site's partials last; two launches with fresh streams, the outputs
    poisoned, against MHCResidual.around the layer's reference."""
    need_gpu()
    from harness import clock_seed
    from sdk.megakernel.mhc_site import site_fn, site_inputs
    from sdk.megakernel.moe_layer import mhc_reference, preset
    seed = clock_seed()
    cfg = preset(model, batch, expert_dtype=REAL[model], mhc=mhc)
    rt, weights = _runtime(cfg, seed=seed)
    fn = site_fn(cfg.site, seed=seed + 1, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    for launch in range(2):
        inp = site_inputs(cfg.site, g, fn, device="cuda")
        _poison(rt.tensors)
        for name in ("coef", "part_next", "x"):
            rt.tensors[name].fill_(float("nan"))
        for name, v in inp.items():
            rt.tensors[name].copy_(v)
        rt.run()
        want = mhc_reference(cfg, weights, inp, fn)
        s0 = inp["streams"].float()
        e = rel_err(rt.tensors["streams"].float() - s0, want["streams"].float() - s0)
        assert e <= 2 * BF16_TOL, f"seed {seed}, launch {launch}: streams' increment rel err {e:.3e}"
        for name, tol in (("coef", 1e-4), ("part_next", 2 * BF16_TOL)):
            e = rel_err(rt.tensors[name], want[name])
            assert e <= tol, f"seed {seed}, launch {launch}: {name} rel err {e:.3e}"


@pytest.mark.parametrize("decode", ["f32", "hfma2"])
@pytest.mark.parametrize("model,stage", [("deepseek_v41_flash", "down"), ("deepseek_v41_flash", "gateup"),
                                         ("glm_53", "down"), ("glm_53", "gateup"), ("kimi_k3", "down"),
                                         ("kimi_k3", "gateup")])
def test_experts_batch1_tile_equals_reference(model, stage, decode):
    """The batch-1 expert tile (tile_b1: items hit-major, the hit list in lane registers, x and the
    routing weight loaded per hit) of each model's MoE layer, standalone, one token routed to 3
    local experts (the last two and the first), then 1, then 0 - the written rows equal the
    block's fp32 reference: to fp32 summation order for decode "f32", within the hfma2 arithmetic's
    ~2e-3 for "hfma2"; poisoned outputs, so a row the tile misses fails."""
    need_gpu()
    import dataclasses
    import time

    from bench.experts_bench import expert_op, operands
    from sdk.blocks.experts import ExpertsBlock
    t0 = time.time()

    def mark(what):        # where the time goes (the test has not finished inside 95-240 s on the device)
        print(f"[{time.time() - t0:7.1f} s] {model} {stage} {decode}: {what}", flush=True)
    base = expert_op(model, stage)
    blk = ExpertsBlock(dataclasses.replace(base.config, mxfp4_decode=decode))
    assert blk.config.m == 1 and blk.config.smem_stages >= 2 and not blk.use_mma     # tile_b1's case
    out = "act" if stage == "gateup" else "out"
    L = blk.config.num_local                   # experts L-2, L-1, 0: the last ones' 64-bit offsets, a wrap
    mark("block built")
    shared, (three,) = operands(blk, 3, seed=5, routings=1, first=L - 2)
    torch.cuda.synchronize()
    mark("operands on the GPU")
    for hits, routing in ((3, three), (1, None), (0, None)):
        if routing is None:                    # fewer hits: the same routing, its list cut short
            routing = {k: v.clone() for k, v in three.items()}
            kept = routing["hits"][1:1 + hits].long()
            routing["counts"].zero_()
            routing["counts"][kept] = 1
            routing["hits"][0] = hits
        t = routing | shared
        t[out].fill_(float("nan"))
        run_standalone(blk, t)
        mark(f"{hits} hits: kernel compiled and run")
        ref = blk.reference(**{k: v.cpu() for k, v in t.items()})[out].float()
        mark(f"{hits} hits: reference")
        if stage == "gateup":                  # the written rows: the assignments of the hits
            slots = routing["slot"][routing["hits"][1:1 + hits].long(), 0].long().cpu()
            got, want = t[out].float().cpu()[slots], ref[slots]
        else:
            got, want = t[out].float().cpu(), ref
        assert torch.isfinite(got).all(), f"{hits} hits: rows left unwritten"
        if hits:
            err = rel_err(got, want)
            assert err <= (2e-4 if decode == "f32" else 5e-3), f"{hits} hits: relative error {err:.2e}"
        elif stage == "down":
            assert torch.equal(got, want)          # the shared experts' sums alone
        else:
            assert torch.isnan(t[out]).all()       # no hit: the tile writes no act row
