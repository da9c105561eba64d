"""MoE blocks on CPU: the router's selection rule (scores, bias, groups, ties, hash routing), the
dispatch table, the expert formats (fp8 blocks, MXFP4 and its in-register decode), and the whole
MoE layer's instruction stream run by the PyVM against sdk/reference/moe.py's MoEReference, for
several steps (counter epochs, no resets) with NaN-poisoned buffers; plus compile checks of the
MoE blocks and the MoE megakernel for sm_90a, sm_100a and sm_103a (no GPU)."""
import dataclasses

import pytest
import torch

from sdk.blocks.experts import ExpertsBlock, ExpertsConfig, dequant_mxfp4, quantize_mxfp4
from sdk.blocks.formats import E2M1_VALUES
from sdk.blocks.router import RouterSelectBlock, RouterSelectConfig, route_rule
from sdk.megakernel import isa
from sdk.megakernel.moe_layer import (MoELayerConfig, build_program, make_weights, moe_reference_forward,
                                      reference, reference_weights_full)
from sdk.megakernel.pyvm import PyVM
from sdk.reference.moe import route
from sdk.schedule import schedule, validate

TOL = 1e-2
SCRATCH = ("logits", "topk_ids", "topk_w", "act", "shared_act", "shared_out", "out", "tok", "slot", "hits", "counts",
           "z", "routed")


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def _vm(cfg, num_sms=8, seed=0):
    prog = build_program(cfg)
    weights = make_weights(cfg, seed=seed)
    vm, sched = PyVM.from_program(prog, num_sms, weights)
    return vm, weights, sched


def _poison(t):
    for name in SCRATCH:
        if name in t:
            if t[name].dtype.is_floating_point:
                t[name].fill_(float("nan"))
            else:
                t[name].fill_(-7)         # garbage indices: the router must overwrite what is read


def _step(vm, cfg, x, ids=None, seed=0):
    _poison(vm.tensors)
    vm.tensors["x"].copy_(x)
    if cfg.hash_routed:
        vm.tensors["input_ids"].copy_(ids)
    vm.step(seed=seed)
    return vm.tensors["out"]


CASES = {
    "sigmoid_bias_shared": dict(correction_bias=True, shared_intermediate=256, batch=3),
    "softmax_groups_fp8_ep": dict(scoring="softmax", n_group=4, topk_group=2, num_local=16, rank=2, batch=5,
                                  expert_dtype="fp8_e4m3", shared_intermediate=256, swiglu_limit=1.0,
                                  routed_scaling_factor=2.5, norm_topk_prob=False),
    "sqrtsoftplus_mxfp4_ep": dict(scoring="sqrtsoftplus", correction_bias=True, num_local=32, rank=1, batch=8,
                                  expert_dtype="mxfp4", routed_scaling_factor=1.5, swiglu_limit=10.0,
                                  shared_intermediate=256, router_dtype="bf16"),
    "hash_routed": dict(scoring="sqrtsoftplus", hash_routed=True, vocab=40, batch=4, num_local=32,
                        expert_dtype="mxfp4", routed_scaling_factor=1.5),
    "batch1_topk8": dict(top_k=8, correction_bias=True, batch=1, shared_intermediate=256),
    # Kimi K3's SiTU in the experts and the shared expert, at betas other than K3's 4 / 25 (so
    # that a beta lost between the spec, the blocks' twins and the reference shows)
    "situ_shared_mxfp4": dict(correction_bias=True, batch=4, num_local=32, rank=1, expert_dtype="mxfp4",
                              shared_intermediate=256, activation="situ", situ_beta=2.0, situ_linear_beta=3.0),
    # Kimi K3's Stable LatentMoE (a 512 latent of the 1024 hidden) with SiTU, with and without the
    # shared expert (which then joins in the latent up GEMV's residual)
    "latent_situ_shared_mxfp4": dict(correction_bias=True, batch=5, num_local=32, rank=1, expert_dtype="mxfp4",
                                     shared_intermediate=256, activation="situ", latent=512),
    "latent_bf16_batch1": dict(correction_bias=True, batch=1, latent=256, activation="situ", situ_beta=3.0),
    # per-op rows of the shared / latent GEMVs (MoELayerConfig.op_rows)
    "latent_op_rows": dict(correction_bias=True, batch=2, latent=512, activation="situ", shared_intermediate=256,
                           shared_rows=16, op_rows=(("shared_down", 32), ("latent_up", 64))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pyvm_moe_layer_equals_moe_reference(name):
    """The PyVM-run instruction stream equals MoEReference.forward (the oracle class, with the
    other ranks' experts zero) on three steps of fresh inputs, buffers poisoned before each."""
    cfg = MoELayerConfig(**CASES[name])
    vm, weights, sched = _vm(cfg)
    full = reference_weights_full(cfg, weights)
    for step in range(3):
        x = torch.randn(cfg.batch, cfg.hidden).to(torch.bfloat16)
        ids = torch.randint(0, max(cfg.vocab, 1), (cfg.batch,), dtype=torch.int32)
        out = _step(vm, cfg, x, ids, seed=step)
        oracle = moe_reference_forward(cfg, weights, x, ids, full)
        assert rel(out, oracle) <= TOL, f"step {step}"
        # the layer-level reference used by the GPU tests is the same function
        assert torch.allclose(reference(cfg, weights, x, ids), oracle, rtol=1e-5, atol=1e-6)
    assert vm.counters[isa.EXIT_COUNTER] == 3 * len(sched.per_sm)


@pytest.mark.parametrize("mhc,extra", [("v4", dict(shared_intermediate=256, batch=3)),
                                       ("v41", dict(expert_dtype="mxfp4", num_local=32, rank=1, batch=5,
                                                    shared_intermediate=256)),
                                       ("v41", dict(latent=512, activation="situ", batch=2))])
def test_pyvm_moe_layer_in_mhc_equals_reference(mhc, extra):
    """The layer wrapped in the model's mHC residual (MoELayerConfig.mhc, mhc_site.py): the
    streams' collapse + the layer's input norm first (v41: with the previous site's pre, the
    coefficients beside the layer; the router and shared expert wait for the collapse), the
    post-mix of the streams in place from the layer's output, fused with the next site's
    partials - against MHCResidual.around the layer's reference, three steps, outputs poisoned."""
    from sdk.megakernel.mhc_site import site_fn, site_inputs
    from sdk.megakernel.moe_layer import mhc_reference
    cfg = MoELayerConfig(correction_bias=True, mhc=mhc, **extra)
    vm, weights, _ = _vm(cfg)
    prog = vm.program
    first = "moe.hc_in" if mhc == "v41" else "moe.hc_pre"
    for label in ("router.logits", "shared.gateup", "latent.down"):
        op = next((o for o in prog.ops if o.label == label), None)
        if op is not None:      # x's readers wait for the collapse alone
            assert {prog.counter_names[c] for i in op.instructions for c, _ in prog.instructions[i].waits} == {first}
    fn = site_fn(cfg.site, seed=4)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        inp = site_inputs(cfg.site, g, fn)
        _poison(vm.tensors)
        for name in ("coef", "part_next", "x"):
            vm.tensors[name].fill_(float("nan"))
        for name, v in inp.items():
            vm.tensors[name].copy_(v)
        vm.step(seed=step)
        want = mhc_reference(cfg, weights, inp, fn)
        s0 = inp["streams"].float()
        assert rel(vm.tensors["streams"].float() - s0, want["streams"].float() - s0) <= TOL, f"step {step}"
        assert rel(vm.tensors["coef"], want["coef"]) <= 1e-5
        assert rel(vm.tensors["part_next"], want["part_next"]) <= TOL


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_bf16_router_equals_the_models(scoring):
    """RouterSelectConfig.logits_bf16 (MoELayerConfig.router_logits_bf16): the twin's selection and
    weights are the model's bf16 router's (sdk/reference/moe.py route() on bf16 logits: scores,
    renormalisation and scaling in bf16 ops, the bias fp32) - exactly, on the same logits; the fp32
    rule differs from it (on 64 tokens some selection or weight moves)."""
    from sdk.spec import MoESpec
    torch.manual_seed(11)
    m, e, k = 64, 384, 6
    logits = torch.randn(m, e) * 3
    bias = torch.randn(e) * 0.1
    spec = MoESpec(num_experts=e, top_k=k, expert_intermediate_size=8, scoring=scoring, correction_bias=True,
                   norm_topk_prob=True, routed_scaling_factor=1.5, extra=(("router_logits_dtype", "model"),))
    want_w, want_ids = route(spec, logits.to(torch.bfloat16), bias)
    cfg = RouterSelectConfig(num_experts=e, top_k=k, m=m, scoring=scoring, correction_bias=True,
                             routed_scaling_factor=1.5, logits_bf16=True)
    w, ids = route_rule(cfg, logits, bias)
    order = want_ids.sort(-1)[1]
    assert torch.equal(ids.sort(-1)[0], want_ids.sort(-1)[0])
    assert torch.equal(w.gather(1, ids.sort(-1)[1]), want_w.float().gather(1, order))
    w32, ids32 = route_rule(dataclasses.replace(cfg, logits_bf16=False), logits, bias)
    assert not torch.equal(w32, w) or not torch.equal(ids32, ids)
    # the layer's reference takes the same path (bf16 logits from its fp32 GEMV) as the block
    layer = MoELayerConfig(num_experts=64, top_k=6, batch=4, scoring=scoring, correction_bias=True,
                           router_logits_bf16=True)
    assert layer.moe_spec().extra == (("router_logits_dtype", "model"),)
    vm, weights, _ = _vm(layer)
    x = torch.randn(4, layer.hidden).to(torch.bfloat16)
    out = _step(vm, layer, x)
    assert rel(out, reference(layer, weights, x)) <= TOL


def test_op_rows_set_one_gemv_each():
    """op_rows overrides shared_rows per op; Kimi K3's shared.down / latent.up in 32-row tiles make
    every streaming chunk of its batch-1 layer 16.9 KB (the ring's stage: 12 of them instead of 7
    stages of 29.6 KB set by the 56-row tiles); an unknown op name is refused."""
    from sdk.blocks.base import ring_geometry
    from sdk.errors import UnsupportedConfigError
    from sdk.megakernel.moe_layer import blocks, preset
    b = blocks(MoELayerConfig(**CASES["latent_op_rows"]))
    rows = {k: b[k].config.rows_per_tile for k in ("shared_gateup", "shared_down", "latent_down", "latent_up")}
    assert rows == {"shared_gateup": 16, "shared_down": 32, "latent_down": 16, "latent_up": 64}
    plain = dict(expert_dtype="mxfp4", expert_smem_stages=0)        # no staged expert slots beside the ring
    k3 = build_program(preset("kimi_k3", 1, op_rows=(("shared_down", 32), ("latent_up", 32)), **plain))
    assert ring_geometry(k3.opcodes.blocks)[:2] == (16896, 12)
    assert ring_geometry(build_program(preset("kimi_k3", 1, **plain)).opcodes.blocks)[:2] == (29568, 7)
    with pytest.raises(UnsupportedConfigError, match="unknown op"):
        blocks(MoELayerConfig(**dict(CASES["latent_op_rows"], op_rows=(("router", 8),))))


def test_pyvm_order_independent_bitwise():
    """Any legal interleaving gives the same bits (the combine is deterministic)."""
    cfg = MoELayerConfig(**CASES["sigmoid_bias_shared"])
    x = torch.randn(cfg.batch, cfg.hidden).to(torch.bfloat16)
    outs = []
    for seed in (0, 1, 2):
        vm, _, _ = _vm(cfg)
        outs.append(_step(vm, cfg, x, seed=seed).clone())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _select_block(**kw):
    return RouterSelectBlock(RouterSelectConfig(**kw))


def _run_select(block, logits, bias=None, tid2eid=None, input_ids=None):
    t = block.alloc_operands()
    t["logits"] = logits
    if bias is not None:
        t["bias"] = bias
    if tid2eid is not None:
        t["tid2eid"], t["input_ids"] = tid2eid, input_ids
    block.emulate_tile(t, 0)
    return t


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("groups", [(1, 1), (8, 3)])
def test_select_rule_equals_reference_route(scoring, groups):
    """No ties: the device rule selects the reference's experts with the reference's weights."""
    from sdk.spec import MoESpec
    ng, tg = groups
    spec = MoESpec(num_experts=128, top_k=6, scoring=scoring, correction_bias=True, n_group=ng, topk_group=tg,
                   routed_scaling_factor=2.5)
    cfg = RouterSelectConfig(num_experts=128, top_k=6, m=16, scoring=scoring, correction_bias=True, n_group=ng,
                             topk_group=tg, routed_scaling_factor=2.5)
    logits = torch.randn(16, 128) * 2
    bias = torch.randn(128) * 0.1
    w_ref, ids_ref = route(spec, logits, bias)
    w, ids = route_rule(cfg, logits, bias)
    o_ref, o = ids_ref.sort(-1)[1], ids.sort(-1)[1]
    assert torch.equal(ids_ref.sort(-1)[0], ids.sort(-1)[0])
    assert torch.allclose(w_ref.gather(1, o_ref), w.gather(1, o), rtol=1e-6, atol=1e-7)


def test_bias_selects_but_does_not_weigh():
    cfg = RouterSelectConfig(num_experts=64, top_k=2, m=1, correction_bias=True, norm_topk_prob=False)
    logits = torch.zeros(1, 64)
    logits[0, 5] = 3.0
    bias = torch.zeros(64)
    bias[40] = 10.0                       # expert 40 wins the selection through its bias only
    w, ids = route_rule(cfg, logits, bias)
    assert ids[0, 0] == 40 and ids[0, 1] == 5
    assert torch.allclose(w[0], torch.tensor([0.5, torch.sigmoid(torch.tensor(3.0)).item()]))


def test_tie_rule_lower_index_wins():
    """Ties: the device rule takes the lower expert index (and the lower group index).
    torch.topk (the reference's route()) gives no tie guarantee and on CPU picks other indices,
    so the rule is tested directly; both pick experts of the same top values."""
    cfg = RouterSelectConfig(num_experts=64, top_k=4, m=3)
    logits = torch.zeros(3, 64)                       # token 0: all equal
    logits[1, [7, 9, 30, 50, 63]] = 1.0               # token 1: five equal winners for four places
    logits[2] = torch.arange(64).float() % 4          # token 2: 16-way tie at the top value
    w, ids = route_rule(cfg, logits, None)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [7, 9, 30, 50]
    assert ids[2].tolist() == [3, 7, 11, 15]
    from sdk.spec import MoESpec
    _, ids_ref = route(MoESpec(num_experts=64, top_k=4), logits, None)
    assert torch.equal(logits.gather(1, ids_ref).sort(-1)[0], logits.gather(1, ids).sort(-1)[0])
    # groups tie too: 4 groups of 16, all group scores equal -> groups 0 and 1 kept
    g = RouterSelectConfig(num_experts=64, top_k=4, m=1, n_group=4, topk_group=2)
    _, gi = route_rule(g, torch.zeros(1, 64), None)
    assert gi[0].tolist() == [0, 1, 2, 3]
    g2 = RouterSelectConfig(num_experts=64, top_k=4, m=1, n_group=4, topk_group=2)
    lg = torch.zeros(1, 64)
    lg[0, [20, 21, 40, 41, 60, 61]] = 1.0              # groups 1, 2, 3 tie; 1 and 2 kept
    _, gi = route_rule(g2, lg, None)
    assert sorted(gi[0].tolist()) == [20, 21, 40, 41]
    # the dispatch table of a tie case lists token order
    b = _select_block(num_experts=64, top_k=4, m=3)
    t = _run_select(b, logits)
    assert t["topk_ids"][0].tolist() == [0, 1, 2, 3]
    assert int(t["counts"][3]) == 2 and t["tok"][3, :2].tolist() == [0, 2]


def test_dispatch_skew_all_tokens_one_expert():
    """Every token routed to the same (local) expert: one hit, count M, in token order."""
    m, e = 8, 64
    b = _select_block(num_experts=e, top_k=1, m=m, correction_bias=True, local_start=32, num_local=32)
    bias = torch.zeros(e)
    bias[45] = 100.0
    t = _run_select(b, torch.randn(m, e), bias)
    assert int(t["hits"][0]) == 1 and int(t["hits"][1]) == 13
    assert int(t["counts"][13]) == m and int(t["counts"].sum()) == m
    assert t["tok"][13].tolist() == list(range(m))
    assert t["slot"][13].tolist() == list(range(m))       # top_k = 1: slot = token


def test_dispatch_every_expert_hit():
    """Hash routing that covers every local expert: hits = all, ascending; counts add up."""
    m, e, k = 16, 64, 4
    tid2eid = torch.arange(m * k, dtype=torch.int32).reshape(m, k) % e
    b = _select_block(num_experts=e, top_k=k, m=m, hash_routed=True, vocab=m)
    t = _run_select(b, torch.randn(m, e), tid2eid=tid2eid, input_ids=torch.arange(m, dtype=torch.int32))
    assert int(t["hits"][0]) == e and t["hits"][1:].tolist() == list(range(e))
    assert t["counts"].tolist() == [1] * e
    for le in range(e):
        a = int(t["slot"][le, 0])
        assert int(t["topk_ids"].reshape(-1)[a]) == le and int(t["tok"][le, 0]) == a // k


def test_layer_skew_and_every_expert_hit_pyvm():
    """The whole layer under skewed routing (all tokens on one expert, > 8 tokens: several token
    groups) and under routing that hits every local expert."""
    cfg = MoELayerConfig(batch=12, top_k=2, correction_bias=True, num_local=32, rank=1, shared_intermediate=256)
    vm, weights, _ = _vm(cfg)
    weights["router.bias"][:] = 0.0
    weights["router.bias"][40] = 100.0
    vm.tensors["router.bias"].copy_(weights["router.bias"])
    x = torch.randn(cfg.batch, cfg.hidden).to(torch.bfloat16)
    out = _step(vm, cfg, x)
    assert int(vm.tensors["counts"][8]) == cfg.batch
    assert rel(out, moe_reference_forward(cfg, weights, x)) <= TOL
    cfg = MoELayerConfig(batch=16, top_k=4, hash_routed=True, vocab=16, num_local=64)
    vm, weights, _ = _vm(cfg)
    weights["router.tid2eid"].copy_(torch.arange(64, dtype=torch.int32).reshape(16, 4))
    vm.tensors["router.tid2eid"].copy_(weights["router.tid2eid"])
    ids = torch.arange(16, dtype=torch.int32)
    x = torch.randn(cfg.batch, cfg.hidden).to(torch.bfloat16)
    out = _step(vm, cfg, x, ids)
    assert int(vm.tensors["hits"][0]) == 64
    assert rel(out, moe_reference_forward(cfg, weights, x, ids)) <= TOL


def test_mxfp4_roundtrip_and_device_decode():
    """quantize -> dequantize is exact on e2m1 x 2^s values; the device's integer decode of a
    packed word (nibbles p and p+4 into an fp16 pair, times 2^14) gives every e2m1 value."""
    codes = torch.randint(0, 16, (4, 256))
    s = torch.randint(-8, 4, (4, 8)).float()
    w = E2M1_VALUES[codes] * torch.exp2(s).repeat_interleave(32, -1)
    packed, scales = quantize_mxfp4(w)
    assert torch.equal(dequant_mxfp4(packed, scales), w)
    # the decode formula, on every 32-bit word made of the 16 nibbles
    words = torch.tensor([sum(((i + p) % 16) << (4 * p) for p in range(8)) for i in range(16)], dtype=torch.int64)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    for p in range(4):
        wp = words >> (4 * p)                                       # arithmetic shift, as on device
        h = ((wp & 0x00070007) << 9) | ((wp & 0x00080008) << 12)
        pair = h.view(torch.float16).float().reshape(-1, 2) * 2.0 ** 14    # (lo, hi) per word
        for i in range(16):
            assert pair[i, 0] == E2M1_VALUES[(i + p) % 16] or (pair[i, 0] == 0 and E2M1_VALUES[(i + p) % 16] == 0)
            assert pair[i, 1] == E2M1_VALUES[(i + p + 4) % 16] or (pair[i, 1] == 0 and E2M1_VALUES[(i + p + 4) % 16] == 0)
    # the scale bits: (s + 14) << 23 is 2^(s - 127) * 2^14 as fp32
    e8 = torch.arange(0, 241, dtype=torch.int32)
    f = ((e8 + 14) << 23).view(torch.float32)
    assert torch.equal(f, torch.exp2(e8.float() - 127 + 14))


def test_experts_block_reference_formats():
    """The experts stages' emulation (tile by tile) equals a direct torch computation."""
    for fmt in ("bf16", "fp8_e4m3", "mxfp4"):
        cfg = MoELayerConfig(batch=4, expert_dtype=fmt, num_local=64)
        vm, weights, _ = _vm(cfg)
        x = torch.randn(cfg.batch, cfg.hidden).to(torch.bfloat16)
        out = _step(vm, cfg, x)
        routing = (vm.tensors["topk_w"].clone(), vm.tensors["topk_ids"].long().clone())
        assert rel(out, reference(cfg, weights, x, routing=routing)) <= TOL, fmt


def test_block_checks_fail_loudly():
    from sdk.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError):
        RouterSelectBlock(RouterSelectConfig(num_experts=100, top_k=4))
    with pytest.raises(UnsupportedConfigError):
        RouterSelectBlock(RouterSelectConfig(num_experts=1024, top_k=4, num_local=512))
    with pytest.raises(UnsupportedConfigError):
        ExpertsBlock(ExpertsConfig(stage="down", hidden=1024, intermediate=200, num_local=4, top_k=2,
                                   weight_dtype="mxfp4"))
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    for bad in (dict(stage="down", activation="situ"), dict(stage="gateup", activation="gelu")):
        with pytest.raises(UnsupportedConfigError, match="activation"):
            ExpertsBlock(ExpertsConfig(hidden=1024, intermediate=256, num_local=4, top_k=2, **bad))
    for bad in (dict(activation="situ"), dict(swiglu=True, activation="relu")):
        with pytest.raises(UnsupportedConfigError, match="activation"):
            GemvBlock(GemvConfig(n=256, k=1024, **bad))


def test_expert_smem_stages_slots_and_checks():
    """smem_stages: a warp's item is its output row's weight rows (gate and up) and their scale
    words - GLM-5.3's MXFP4 gate/up: 2 x (128 chunks x 16 B + 32 words x 4 B) = 4352 B; 8 warps x 3
    slots = 104448 B of the plain tiles' arena, and the batch-1 layer's weight ring keeps 6 of its
    12 stages. Refused clearly: 1 stage, the tensor-core tile, slots past SMEM_STAGES_MAX_BYTES."""
    from sdk.blocks.base import ring_geometry
    from sdk.blocks.experts import SMEM_STAGES_MAX_BYTES
    from sdk.errors import UnsupportedConfigError
    from sdk.megakernel.moe_layer import blocks, build_program, preset
    b = blocks(preset("glm_53", 1, expert_dtype="mxfp4", expert_smem_stages=3))
    assert b["gateup"].item_words * 4 == 2 * (128 * 16 + 32 * 4) == 4352
    assert b["gateup"].own_smem_bytes() == 8 * 3 * 4352
    assert b["down"].item_words * 4 == 64 * 16 + 16 * 4            # K = 2048: 64 chunks, 16 scale words
    assert blocks(preset("glm_53", 1, expert_dtype="mxfp4", expert_smem_stages=0))["gateup"].own_smem_bytes() == 0
    assert ring_geometry(build_program(preset("glm_53", 1, expert_dtype="mxfp4",
                                              expert_smem_stages=3)).opcodes.blocks)[1] == 6
    fp8 = blocks(preset("glm_53", 1, expert_dtype="fp8_e4m3", expert_smem_stages=2))["gateup"]
    assert fp8.item_words * 4 == 2 * (4096 + 32 * 4)                # fp8: 16 per chunk, the block row's 32 scales
    base = b["gateup"].config
    for bad, match in ((dict(smem_stages=1), "2..8"), (dict(smem_stages=2, mma=True, m=8), "CUDA-core"),
                       (dict(smem_stages=2, weight_dtype="bf16"), f"at most {SMEM_STAGES_MAX_BYTES}")):
        with pytest.raises(UnsupportedConfigError, match=match):
            ExpertsBlock(dataclasses.replace(base, **bad))


def test_expert_smem_stages_auto():
    """By default (expert_smem_stages None) the MXFP4 expert tiles are staged below 8 tokens
    (measured faster at batch 1 on the H200: GLM-5.3 / Kimi K3 / V4.1-Flash) where the weight ring
    keeps 3 stages; not from 8 tokens (the tensor-core tile), not fp8 (untimed), not bf16 (no fit).
    Both 2 deep; expert_down_smem_stages=-1 (opt-in): the down tile as deep as the gate/up slots'
    shared memory holds (at most 8) - V4.1-Flash and GLM-5.3 8 (their down items are a quarter of
    a gate/up item), Kimi K3 4 - the weight ring the same as with down at 2."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.moe_layer import auto_smem_stages, blocks, preset

    def stages(model, batch, fmt, **kw):
        b = blocks(preset(model, batch, expert_dtype=fmt, **kw))
        return b["gateup"].config.smem_stages, b["down"].config.smem_stages
    for model, down in (("glm_53", 8), ("kimi_k3", 4), ("deepseek_v41_flash", 8)):
        deep = dict(expert_down_smem_stages=-1)
        assert stages(model, 1, "mxfp4") == stages(model, 4, "mxfp4") == (2, 2)
        assert stages(model, 1, "mxfp4", **deep) == stages(model, 4, "mxfp4", **deep) == (2, down)
        assert stages(model, 8, "mxfp4", **deep) == stages(model, 1, "fp8_e4m3", **deep) == (0, 0)
        assert stages(model, 8, "mxfp4") == stages(model, 1, "fp8_e4m3") == stages(model, 1, "bf16") == (0, 0)
        assert stages(model, 1, "mxfp4", expert_down_smem_stages=3) == (2, 3)
        b = blocks(preset(model, 1, expert_dtype="mxfp4", **deep))
        assert b["down"].own_smem_bytes() <= b["gateup"].own_smem_bytes()
        ring = [ring_geometry(build_program(preset(model, 1, expert_dtype="mxfp4", **kw)).opcodes.blocks)
                for kw in ({}, deep)]
        assert ring[0] == ring[1] and ring[0][1] >= 3
    assert auto_smem_stages(preset("glm_53", 1, expert_dtype="mxfp4", expert_mma=True)) == 0


def test_gemv_situ_epilogue_twins_equal_reference_situ():
    """GemvBlock's swiglu epilogue with activation="situ": its fp32 reference and its tile-by-tile
    emulation are sdk/reference/common.py's SiTU (with the config's betas) of the two GEMVs."""
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.reference.common import situ
    block = GemvBlock(GemvConfig(n=64, k=256, m=3, swiglu=True, activation="situ", situ_beta=2.0,
                                 situ_linear_beta=3.0))
    g = torch.Generator().manual_seed(0)
    t = block.alloc_operands()
    t["x"] = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    t["w_gate"] = (torch.randn(64, 256, generator=g) * 0.2).to(torch.bfloat16)
    t["w_up"] = (torch.randn(64, 256, generator=g) * 0.2).to(torch.bfloat16)
    x = t["x"].float()
    want = situ(x @ t["w_gate"].float().T, x @ t["w_up"].float().T, 2.0, 3.0)
    assert torch.allclose(block.reference(**t)["y"], want, rtol=0, atol=0)
    for tile in range(block.num_tiles()):
        block.emulate_tile(t, tile)
    assert (t["y"].float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_compile_situ_blocks(arch):
    """Kimi K3's SiTU epilogue compiles in the shared expert's GEMV and the experts' gate/up stage
    (CUDA-core and tensor-core tiles); not run on a GPU yet."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.compile import failures, time_case
    from sdk.megakernel.moe_layer import situ_block_cases
    report = {arch: {}}
    cases = situ_block_cases()
    assert {b.config.activation for b in cases} == {"situ"} and len(cases) == 4
    for b in cases:
        time_case(report[arch], f"{b.name} {b.config}", lambda b=b: standalone(b, arch))
    assert not failures(report), "\n".join(failures(report))


def test_real_shard_programs_schedule():
    """Each model's per-GPU shard builds, schedules and validates at batch 1, 8, 64."""
    from sdk.megakernel.moe_layer import PRESETS, preset
    for model in PRESETS:
        for batch in (1, 8, 64):
            prog = build_program(preset(model, batch, expert_dtype="mxfp4"))
            validate(prog, schedule(prog, 132).per_sm)
    # Kimi K3 with its Stable LatentMoE (7168 -> 3584) and SiTU: the latent GEMVs around the experts
    for batch in (1, 8, 64):
        prog = build_program(preset("kimi_k3", batch, expert_dtype="mxfp4", latent=3584, activation="situ"))
        validate(prog, schedule(prog, 132).per_sm)
        assert [o.label for o in prog.ops] == ["router.logits", "router.select", "latent.down", "experts.gateup",
                                               "experts.down", "shared.gateup", "shared.down", "latent.up"]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_compile_moe_blocks_and_megakernel(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.compile import failures
    from sdk.megakernel.moe_layer import compile_check
    report = compile_check([arch])        # the blocks themselves: sdk.compile.block_cases()
    assert not failures(report), "\n".join(failures(report))
    assert len(report[arch]) == 4          # the plain layer, the latent + SiTU layer, the staged experts, in mHC


def _tile_mma_arithmetic(packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for MXFP4 rows computed the way ExpertsBlock's tensor-core tile (mma=True) does:
    per step of 128 columns, each quad thread q decodes its 16-byte chunk (one scale group) into
    f16 pairs (e2m1 * 2^-14; pair p of a word = elements p, p+4), multiplies them by 2^(s_q - s_max)
    in f16 (groups more than 2^14 below the row's largest flush to 0), x as f16 pairs of the same
    elements; the MMA sums the step in fp32; the step is scaled by 2^(s_max - 127 + 14)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    codes_b = packed.contiguous().view(torch.uint8)
    codes = torch.stack([codes_b & 15, codes_b >> 4], dim=-1).flatten(-2).long()      # [n, k]
    e2m1_f16 = (E2M1_VALUES[codes] * 2.0 ** -14).to(torch.float16)                  # exact
    s8 = scales.contiguous().view(torch.uint8).long()                                  # [n, k/32]
    xh = x.float().to(torch.float16)                                                    # [m, k]
    y = torch.zeros(x.shape[0], n)
    for st in range(k // 128):
        groups = s8[:, 4 * st: 4 * st + 4]                                             # [n, 4]
        smax = groups.max(dim=1).values
        part = torch.zeros(x.shape[0], n)
        for q in range(4):
            cols = slice(128 * st + 32 * q, 128 * st + 32 * q + 32)
            d = groups[:, q] - smax
            factor = torch.where(d >= -14, torch.exp2(d.float()), torch.zeros(())).to(torch.float16)
            a = (e2m1_f16[:, cols] * factor[:, None]).float()                        # HMUL2 (rn)
            part += xh[:, cols].float() @ a.T                                          # the MMA: fp32 sums
        y += part * torch.exp2((smax - 127).float() + 14.0)[None, :]
    return y


def _mxfp4_rows_case(seed: int, n: int, spread: int, xscale: float = 1.0, k: int = 1024, m: int = 3):
    """(packed, scales, x, x @ dequant(W)^T) for n random MXFP4 rows of k; spread > 0 gives each
    row's scale groups exponents up to 2^spread apart; x of RMS xscale, bf16."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    if spread:
        w = w * torch.exp2(torch.randint(-spread, 1, (n, k // 32), generator=g).float()).repeat_interleave(32, 1)
    packed, scales = quantize_mxfp4(w)
    x = (torch.randn(m, k, generator=g) * xscale).to(torch.bfloat16)
    return packed, scales, x, x.float() @ dequant_mxfp4(packed, scales).T


@pytest.mark.parametrize("spread", [0, 20])
def test_experts_tile_mma_arithmetic_matches_dequantised_reference(spread):
    """The tensor-core expert tile's arithmetic (decode pairs, relative group scales in f16, fp32
    MMA sums) against x @ dequant(W)^T; spread > 0 gives each row's scale groups exponents up to
    2^spread apart (the flush of groups > 2^14 below the row's largest must stay negligible)."""
    packed, scales, x, ref = _mxfp4_rows_case(11, 48, spread)
    got = _tile_mma_arithmetic(packed, scales, x)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 2e-3, rel


def _hfma2_arithmetic(packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for MXFP4 rows computed the way ExpertsBlock's CUDA-core tile with
    mxfp4_decode="hfma2" does: per 32-column scale group (one 16-byte load), 16 f16 pairs (e2m1 *
    2^-14; pair 4q + p = elements 8q + p, 8q + p + 4) times x's same elements * 2^HFMA2_X_EXP as
    f16 (satfinite),
    in two chains (even / odd pairs) of packed FMAs each rounding to f16 once per op; the chains'
    halves widened and added in fp32, (lo0 + hi0) + (lo1 + hi1), then scaled by 2^(s - 127 + 14)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    codes_b = packed.contiguous().view(torch.uint8)
    codes = torch.stack([codes_b & 15, codes_b >> 4], dim=-1).flatten(-2).long()      # [n, k]
    w16 = (E2M1_VALUES[codes] * 2.0 ** -14).to(torch.float16).double()               # exact
    from sdk.blocks.experts import HFMA2_X_EXP
    xh = (x.float() * 2.0 ** HFMA2_X_EXP).clamp(-65504, 65504).to(torch.float16).double()    # satfinite
    G = k // 32
    order = torch.tensor([8 * q + p + 4 * h for q in range(4) for p in range(4) for h in range(2)])
    wp = w16.view(n, G, 32)[:, :, order].view(1, n, G, 16, 2)       # [1, n, G, pair, half]
    xp = xh.view(-1, G, 32)[:, :, order].view(-1, 1, G, 16, 2)      # [m, 1, G, pair, half]
    f16 = lambda t: t.to(torch.float16).double()                    # one rounding
    chains = []
    for c in range(2):
        a = f16(wp[..., c, :] * xp[..., c, :])
        for j in range(1, 8):
            a = f16(wp[..., 2 * j + c, :] * xp[..., 2 * j + c, :] + a)
        chains.append(a.float())
    s8 = scales.contiguous().view(torch.uint8).float()                                # [n, G]
    part = (chains[0][..., 0] + chains[0][..., 1]) + (chains[1][..., 0] + chains[1][..., 1])     # [m, n, G]
    return (part * torch.exp2(s8 - 127 + 14 - HFMA2_X_EXP)[None]).sum(-1)


@pytest.mark.parametrize("spread,xscale,bound", [(0, 1.0, 2e-3), (20, 1.0, 2e-3), (0, 1000.0, 2e-3),
                                                 (0, 1e-2, 2e-3), (0, 1e-3, 1.5e-2)])
def test_experts_hfma2_arithmetic_matches_dequantised_reference(spread, xscale, bound):
    """mxfp4_decode="hfma2"'s arithmetic (f16 products and chains, fp32 widening and scales)
    against x @ dequant(W)^T: large x (RMS 1000, |x| < 4096: no clamp, a chain's half < 192 in
    units of the decode's 2^-14), small x (RMS 0.01 / 0.001: f16 subnormal products - the
    documented ~1e-3 / ~1e-2), row scale groups 2^20 apart."""
    packed, scales, x, ref = _mxfp4_rows_case(12, 40, spread, xscale)
    got = _hfma2_arithmetic(packed, scales, x)
    assert torch.isfinite(got).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < bound, rel


@pytest.mark.parametrize("experts,k,m,scoring,groups,want", [(896, 16, 1, "sigmoid", 1, 8), (288, 8, 3, "sigmoid", 1, 2),
                                                            (384, 6, 2, "sqrtsoftplus", 1, 4), (896, 16, 5, "sigmoid", 1, 1),
                                                            (384, 6, 1, "softmax", 1, 1), (256, 8, 1, "sigmoid", 8, 1)])
def test_router_select_warps_per_token(experts, k, m, scoring, groups, want):
    """Fewer tokens than warps: a token's experts split over a power of two of warps (slots
    i = s * WPT + q of warp q cover every group of 32 experts exactly once), candidates merged;
    softmax (whole-row normaliser) and groups keep one warp per token."""
    from sdk.blocks.router import RouterSelectBlock, RouterSelectConfig
    cfg = RouterSelectConfig(num_experts=experts, top_k=k, m=m, scoring=scoring, n_group=groups,
                             topk_group=min(groups, 4), num_local=32)
    w = RouterSelectBlock(cfg).warps_per_token
    assert w == want and m * w <= 8
    ne = experts // 32
    slots = -(-ne // w)
    covered = sorted(s * w + q for q in range(w) for s in range(slots) if s * w + q < ne)
    assert covered == list(range(ne))
    assert 2 * w * k <= 576                      # the candidates fit the tile's scratch words
