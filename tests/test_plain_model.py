"""A whole Kimi K3 decode step in one program (sdk/megakernel/plain_model.py), run by the PyVM (the
blocks' torch twins in a random valid order), against the model itself: the reference backend
(sdk/reference: KDA, NoPE MLA, the dense MLP, Stable LatentMoE with SiTU) on the same weights, step
after step from empty caches.

The program keeps the model's bf16 hidden state; the reference runs in fp32 on the same
(bf16-valued) weights, and the program's distance to it is compared with the bf16 reference's own:
the program rounds no worse than the model in bf16 does. The MoE layers' correction bias is wide
(std 10), so the top-k is the bias's choice and not a near-tie that a 1e-2 difference of the
activations moves (tests/test_dsv4_model.py says why)."""
import dataclasses
import re

import pytest
import torch

from sdk import build_megakernel
from sdk.errors import CapacityError, UnsupportedConfigError
from sdk.megakernel import dense_layer, kda_layer, mla_layer, moe_layer
from sdk.megakernel.mla_attention import MLAAttentionConfig
from sdk.megakernel.plain_model import PlainModelConfig, PlainModelRunner, build_program, chain, program_weights
from sdk.megakernel.pyvm import PyVM
from sdk.reference.common import rms_norm
from sdk.reference.model import random_weights

# the model keeps these fp32 in a bf16 checkpoint (models/kimi_k3/weights.py)
FP32 = re.compile(r"(mlp\.gate\.weight$|e_score_correction_bias$|forget_gate\.dt_bias$)")


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite values (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def run(prog, weights, inputs, seed=0):
    vm, _ = PyVM.from_program(prog, 8, {k: v for k, v in weights.items() if k in prog.buffers})
    for k, v in inputs.items():
        vm.tensors[k].copy_(v)
    vm.step(seed=seed)
    return vm.tensors


def small_weights(spec, seed, bias_std=10.0):
    """Random weights with bf16 values (fp32 where the model keeps fp32), every matrix (and the
    short conv) at std fan_in^-1/2 - random_weights' 0.02 leaves the short conv's output so small
    that KDA's output norm runs in its eps regime and the KDA layers add ~nothing - and a wide
    correction bias."""
    w = random_weights(spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for k in w:
        if k.endswith("e_score_correction_bias"):
            w[k] = bias_std * torch.randn(w[k].shape, generator=g)
        elif w[k].dim() >= 2 and w[k].is_floating_point():
            w[k] *= w[k].shape[-1] ** -0.5 / 0.02
    return {k: (v.to(torch.bfloat16).to(torch.float32 if FP32.search(k) else torch.bfloat16)
                if v.is_floating_point() else v) for k, v in w.items()}


def reference(spec, w, dtype, max_seq_len=80, max_batch=2, device="cpu"):
    """The reference backend of `spec` (kimi_k3's, or a variant of it) in `dtype` on the weights w."""
    from sdk import plugins
    from sdk.reference.model import ReferenceModel
    ref = ReferenceModel(plugins.get_model("kimi_k3"), spec, device=device, dtype=dtype, max_seq_len=max_seq_len,
                         max_batch=max_batch)
    return ref.load_weights({k: v.to(dtype) if v.is_floating_point() and not FP32.search(k) else v
                             for k, v in w.items()})


SPEC = build_megakernel("kimi_k3", "small").spec


# -- each sublayer in place ---------------------------------------------------------------------
def in_place_cases(seed=0, only=None, device="cpu"):
    """(name, program, weights, inputs, the reference's x + f(norm(x)) fp32) of each sublayer with
    resid_in_place: dense, KDA, NoPE MLA (its own input eps), the latent MoE with and without a
    shared expert. only: that case alone (the GPU test's)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(2, 1024, generator=g, device=device).to(torch.bfloat16)
    cases = []
    if only in (None, "dense"):
        cfg = dense_layer.DenseLayerConfig(hidden=1024, intermediate=512, batch=2, activation="situ", eps=1e-5,
                                           resid_in_place=True)
        w = dense_layer.make_weights(cfg, seed, device)
        cases.append(("dense", dense_layer.build_program(cfg), w, {"x": x}, dense_layer.reference(cfg, w, {"x": x})))
    if only in (None, "kda"):
        cfg = kda_layer.KDALayerConfig(heads=2, batch=2, hidden=1024, eps=1e-5, resid_in_place=True)
        w, inp = kda_layer.make_weights(cfg, seed, device), kda_layer.make_inputs(cfg, seed, device)
        cases.append(("kda", kda_layer.build_program(cfg), w, inp, kda_layer.reference(cfg, w, inp)["resid"]))
    if only in (None, "mla"):
        cfg = mla_layer.MLALayerConfig(MLAAttentionConfig(heads=4, batch=2, num_pages=8, max_seq_len=128),
                                       hidden=1024, q_lora=512, rope_mode="none", eps=1e-6, input_eps=1e-5,
                                       resid_in_place=True)
        w, inp = mla_layer.make_weights(cfg, seed, device), mla_layer.make_inputs(cfg, [5, 70], seed, device)
        cases.append(("mla", mla_layer.build_program(cfg), w, inp, mla_layer.reference(cfg, w, inp)))
    for shared in (256, 0):
        if only not in (None, f"moe shared={shared}"):
            continue
        cfg = moe_layer.MoELayerConfig(hidden=1024, num_experts=32, top_k=4, intermediate=256, correction_bias=True,
                                       shared_intermediate=shared, activation="situ", latent=512, batch=2,
                                       norm_eps=1e-5, resid_in_place=True)
        w = {**moe_layer.make_weights(cfg, seed, device),
             "mlp_norm": (1 + 0.1 * torch.randn(1024, generator=g, device=device)).to(torch.bfloat16)}
        h = rms_norm(x.float(), w["mlp_norm"].float(), 1e-5).to(torch.bfloat16)
        want = x.float() + moe_layer.reference(dataclasses.replace(cfg, resid_in_place=False), w, h).float()
        cases.append((f"moe shared={shared}", moe_layer.build_program(cfg), w, {"x": x}, want))
    return cases


def test_sublayers_in_place_equal_their_references():
    """resid_in_place: x += f(norm(x)) in bf16 equals the fp32 residual version's reference,
    within bf16's rounding of the result (in_place_cases)."""
    for name, prog, w, inputs, want in in_place_cases():
        assert "resid" not in prog.buffers and "out" not in prog.buffers, name
        got = run(prog, w, {k: v.clone() for k, v in inputs.items()})["x"]
        err = rel(got, want)
        print(f"{name}: x in place vs the reference {err:.1e}")
        assert err < 6e-3, (name, err)
        # the update is real: x moved by more than the tolerance
        assert rel(inputs["x"], want) > 5 * err, name


def test_in_place_refusals():
    with pytest.raises(UnsupportedConfigError, match="latent"):
        moe_layer.build_program(moe_layer.MoELayerConfig(num_experts=32, resid_in_place=True))
    with pytest.raises(UnsupportedConfigError, match="plain residual"):
        kda_layer.build_program(kda_layer.KDALayerConfig(heads=2, hidden=1024, mhc="v4", resid_in_place=True))
    kda = kda_layer.build_program(kda_layer.KDALayerConfig(heads=2, hidden=1024))     # not in place
    with pytest.raises(ValueError, match="resid_in_place"):
        chain([kda], ["l0."], build_program(PlainModelConfig(SPEC)))


# -- the whole model ------------------------------------------------------------------------------
TIE_MARGIN = 0.02      # a top-k margin (sigmoid score + bias units) under which bf16 noise may flip it


def test_program_equals_the_model_step_after_step(margins):
    """70 steps of small (KDA, MLA, KDA, MLA; dense then latent MoE with SiTU) at batch 2: the MLA
    caches cross their first 64-token page. The program's logits against the fp32 model, beside
    the bf16 model's own distance to it (the program's is smaller); steps where the model's expert choice is a near-tie
    (margin < TIE_MARGIN) are counted and left out (at most 10 of the 70)."""
    w = small_weights(SPEC, seed=1)
    steps_against_the_model(PlainModelRunner(PlainModelConfig(SPEC, batch=2, max_seq_len=80), w), w, margins,
                            "program")


def steps_against_the_model(runner, w, margins, label, after_step=None):
    """70 steps of runner (batch 2) against the fp32 model on the weights w, beside the bf16
    model's own distance; near-tie steps counted apart; after_step(step): more checks per step."""
    ref32, ref16 = reference(SPEC, w, torch.float32), reference(SPEC, w, torch.bfloat16)
    s32, s16 = ref32.new_state(2), ref16.new_state(2)
    g = torch.Generator().manual_seed(2)
    errs, errs16, ties = [], [], []
    for step in range(70):
        ids = torch.randint(0, SPEC.vocab_size, (2,), generator=g)
        margins.on, margins.values = True, []
        want = ref32.decode(ids[:, None], s32)[:, 0]
        margins.on = False
        err = rel(runner.decode(ids), want)
        (ties if min(margins.values) < TIE_MARGIN else errs).append(err)
        if after_step is not None:
            after_step(step)
        if step < 8:
            errs16.append(rel(ref16.decode(ids[:, None], s16)[:, 0], want))
    print(f"{label} vs fp32 model, per step:", " ".join(f"{e:.1e}" for e in errs))
    print(f"near-tie steps ({len(ties)}):", " ".join(f"{e:.1e}" for e in ties))
    print("bf16 model vs fp32 model, first steps:", " ".join(f"{e:.1e}" for e in errs16))
    # the bf16 model itself is 2.6-3.7e-2 from the fp32 one here; the program ~2e-2 (at most 4.3e-2)
    assert len(errs) >= 60 and max(errs) < 5e-2 and sum(errs) / len(errs) < 2.5e-2, errs
    assert sum(errs[:8]) < sum(errs16), (errs[:8], errs16)


def test_a_wrong_weight_is_seen():
    """The comparison's power: half of one MoE layer's experts zeroed, or one KDA layer's output
    gate swapped for another layer's, moves the logits far past the tolerance."""
    w = small_weights(SPEC, seed=3)
    ref = reference(SPEC, w, torch.float32)
    ids = torch.tensor([7, 300])
    want = ref.decode(ids[:, None], ref.new_state(2))[:, 0]
    cfg = PlainModelConfig(SPEC, batch=2, max_seq_len=80)
    ok = rel(PlainModelRunner(cfg, w).decode(ids), want)
    bad = dict(w)
    bad["layers.2.mlp.experts.down_proj"] = w["layers.2.mlp.experts.down_proj"].clone()
    bad["layers.2.mlp.experts.down_proj"][::2] = 0
    gate = dict(w, **{"layers.2.attn.g_proj.weight": w["layers.0.attn.g_proj.weight"]})
    errs = [rel(PlainModelRunner(cfg, b).decode(ids), want) for b in (bad, gate)]
    print(f"right {ok:.1e}, half the experts zeroed {errs[0]:.1e}, another layer's gate {errs[1]:.1e}")
    assert ok < 3e-2 and min(errs) > 4 * ok


def test_program_shape_and_refusals():
    cfg = PlainModelConfig(SPEC, batch=2, max_seq_len=80)
    prog = build_program(cfg)
    labels = [op.label for op in prog.ops]
    assert labels[0] == "embed" and labels[-1] == "lm_head"
    assert prog.buffers["x"].role == "scratch" and prog.buffers["logits"].role == "output"
    assert prog.buffers["l1.attn.kv"].shape == (2 * 2, 64, 576)       # 2 pages per sequence
    assert {n for n, b in prog.buffers.items() if b.role == "weight"} == set(program_weights(cfg, small_weights(SPEC, 0)))
    # what the program cannot run is refused by name
    with pytest.raises(UnsupportedConfigError, match="plain residual"):
        PlainModelConfig(build_megakernel("deepseek_v41_flash", "small_v41").spec).layers()
    with pytest.raises(UnsupportedConfigError, match="latent"):
        PlainModelConfig(build_megakernel("kimi_k3", "tiny").spec).layers()
    with pytest.raises(UnsupportedConfigError, match="whole model on one GPU: kimi_k3's bf16 weights are"):
        build_megakernel("kimi_k3", "full", backend="megakernel")
    mla = SPEC.layers[1].attention
    roped = dataclasses.replace(SPEC, layers=tuple(dataclasses.replace(l, attention=dataclasses.replace(
        mla, output_gate=True)) if l.index == 1 else l for l in SPEC.layers))
    with pytest.raises(UnsupportedConfigError, match="output_gate"):
        PlainModelConfig(roped).layers()
    w = small_weights(SPEC, 0)
    with pytest.raises(UnsupportedConfigError, match="nvfp4"):
        program_weights(dataclasses.replace(cfg, expert_dtype="nvfp4"), w)
    with pytest.raises(UnsupportedConfigError, match="layers.3.attn.kv_b_proj.weight"):
        program_weights(cfg, {k: v for k, v in w.items() if k != "layers.3.attn.kv_b_proj.weight"})
    runner = PlainModelRunner(PlainModelConfig(SPEC, batch=2, max_seq_len=2), w)
    with pytest.raises(ValueError, match="vocabulary"):
        runner.decode(torch.tensor([0, SPEC.vocab_size]))
    with pytest.raises(CapacityError, match="batch"):
        runner.decode(torch.tensor([1, 2, 3]))
    runner.decode(torch.tensor([1, 2]))
    runner.decode(torch.tensor([1, 2]))
    with pytest.raises(CapacityError, match="max_seq_len"):
        runner.decode(torch.tensor([1, 2]))


def test_megakernel_backend_generates():
    """build_megakernel("kimi_k3", "small", backend="megakernel"): greedy generation through the
    program equals the (fp32) reference backend's - the same tokens, the logits within bf16's
    distance - for prompts of one length and ragged ones (a short prompt starts generating while
    the longer one is still read: one token of every row a launch). The correction bias (std 100)
    keeps the experts' choice off near-ties."""
    w = small_weights(SPEC, seed=4, bias_std=100.0)
    ref = reference(SPEC, w, torch.float32, max_seq_len=16)
    mk = build_megakernel("kimi_k3", "small", backend="megakernel", max_seq_len=16, max_batch=2)
    mk.load_weights(w)
    prompt = torch.tensor([[5, 17, 3, 8], [9, 1, 200, 0]])
    for lens in (None, [4, 2]):
        out, want = mk.generate(prompt, 3, prompt_lens=lens), ref.generate(prompt, 3, prompt_lens=lens)
        assert out.shape == want.shape == (2, 7) and torch.equal(out, want), (lens, out, want)
        assert mk.last_logits.shape == ref.last_logits.shape == (2, 3, SPEC.vocab_size)
        assert rel(mk.last_logits, ref.last_logits) < 5e-2, lens
    with pytest.raises(CapacityError, match="max_seq_len"):
        mk.generate(prompt, 13)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp4"])
def test_quantised_experts_from_the_models_weights(fmt):
    """expert_dtype fp8 / MXFP4: the program's experts quantised from the model's bf16 weights at
    load (moe_layer.experts_from_model); the program equals the model run on the experts'
    quantised values (a 1e-2 difference: bf16's), and differs from the bf16 model by the
    quantisation itself (fp8 ~6e-2, MXFP4 ~0.2 on these random weights)."""
    from sdk.blocks.experts import dequant_experts
    from sdk.megakernel.moe_layer import in_expert_format
    w = small_weights(SPEC, 5, bias_std=100.0)
    wq = dict(w)
    for k in w:
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q = in_expert_format(w[k], fmt)
            wq[k] = dequant_experts(q["weight"], q.get("scale"), fmt).to(torch.bfloat16)
    ref, ref_bf16 = reference(SPEC, wq, torch.float32), reference(SPEC, w, torch.float32)
    runner = PlainModelRunner(PlainModelConfig(SPEC, batch=2, max_seq_len=80, expert_dtype=fmt), w)
    assert runner.tensors["l1.mlp.experts.down.weight"].dtype == (torch.float8_e4m3fn if fmt == "fp8_e4m3"
                                                                  else torch.int32)
    s, s16 = ref.new_state(2), ref_bf16.new_state(2)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, SPEC.vocab_size, (2,), generator=g)
        got = runner.decode(ids)
        err, err16 = rel(got, ref.decode(ids[:, None], s)[:, 0]), rel(got, ref_bf16.decode(ids[:, None], s16)[:, 0])
        print(f"{fmt} step {step}: vs the model on the quantised experts {err:.1e}, vs the bf16 model {err16:.1e}")
        assert err < 3e-2 and err16 > 2 * err


@pytest.mark.parametrize("interleaved,yarn", [(True, True), (False, False)])
def test_roped_mla_in_the_chain(interleaved, yarn):
    """MLA with RoPE (DeepSeek-V3 style: interleaved pairs with YaRN scaling, or halves without) in
    the plain chain: the runner feeds each step's rotation tables; 20 steps against the fp32 model
    within bf16's distance. Run as NoPE instead (the identity rotation left in place) it is far off:
    the rotation is what is checked."""
    from sdk.spec import RopeSpec
    scaling = (("factor", 4.0), ("original_max_position_embeddings", 8), ("rope_type", "yarn")) if yarn else ()
    rope = RopeSpec(dim=64, theta=10000.0, interleaved=interleaved, scaling=scaling)
    spec = dataclasses.replace(SPEC, layers=tuple(
        dataclasses.replace(l, attention=dataclasses.replace(l.attention, rope=rope)) if l.attention.kind == "mla"
        else l for l in SPEC.layers))
    w = small_weights(spec, seed=4, bias_std=100.0)
    ref = reference(spec, w, torch.float32, max_seq_len=32)
    runner = PlainModelRunner(PlainModelConfig(spec, batch=2, max_seq_len=32), w)
    assert [a.rope_mode for a, _ in runner.cfg.layers()[1::2]] == ["interleaved" if interleaved else "halves"] * 2
    nope = PlainModelRunner(PlainModelConfig(spec, batch=2, max_seq_len=32), w)
    nope.roped = []                                   # the identity rotation: NoPE
    for t in nope.rank_tensors():
        for _, p in runner.roped:
            t[p + "cos"].fill_(1)
            t[p + "sin"].zero_()
    state = ref.new_state(2)
    g = torch.Generator().manual_seed(5)
    errs, nope_errs = [], []
    for _ in range(20):
        ids = torch.randint(0, spec.vocab_size, (2,), generator=g)
        want = ref.decode(ids[:, None], state)[:, 0]
        errs.append(rel(runner.decode(ids), want))
        nope_errs.append(rel(nope.decode(ids), want))
    print("RoPE'd MLA program vs fp32 model:", " ".join(f"{e:.1e}" for e in errs))
    print("the same as NoPE:", " ".join(f"{e:.1e}" for e in nope_errs[-5:]))
    assert max(errs) < 5e-2 and sum(errs) / len(errs) < 3e-2, errs
    assert sum(nope_errs[5:]) > 4 * sum(errs[5:]), nope_errs


def test_wide_config_builds_at_real_widths():
    """Config "wide" (one TP8 / EP16 rank's widths, 4 layers: the GPU test and model_bench --wide):
    the one-GPU program builds at batch 1 with every weight of that shape - the 64 experts' real
    3584 x 3072 latent shape, the 163840 x 7168 embedding and head."""
    from sdk import plugins
    spec = plugins.get_model("kimi_k3").spec("wide")
    assert [l.attention.kind for l in spec.layers] == ["kda", "kda", "kda", "mla"]
    assert spec.hidden_size == 7168 and spec.layers[3].attention.num_heads == 12
    prog = build_program(PlainModelConfig(spec, batch=1, max_seq_len=4096))
    experts = sum(prog.bytes_of(n) for n in prog.buffers if n.endswith(("experts.gate_up.weight",
                                                                        "experts.down.weight")))
    assert experts == 3 * 64 * 3 * 3072 * 3584 * 2              # 3 MoE layers of 64 bf16 experts
    assert 18e9 < prog.bytes_by_role("weight") < 20e9


def test_deep_config_builds_at_the_full_depth():
    """Config "deep" (small's widths, the full model's 61 layers): the whole-model program has the
    full instruction count on its SMs - more records than shared memory keeps resident, so they
    stream through a window (program.records_geometry) - and its ring still fits. (On the PyVM two
    steps are 0.083 / 0.104 from the fp32 model, the bf16 model 0.110 / 0.117: the GPU test checks
    that bound, tests/gpu/test_plain_model_gpu.py.)"""
    from sdk import plugins
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.program import RECORDS_MAX_BYTES, records_geometry
    from sdk.schedule import schedule
    spec = plugins.get_model("kimi_k3").spec("deep")
    assert len(spec.layers) == 61 and sum(l.attention.kind == "mla" for l in spec.layers) == 16
    prog = build_program(PlainModelConfig(spec, batch=1, max_seq_len=16))
    max_len = schedule(prog, 132).max_len
    nops, rec, window = records_geometry(prog.opcodes.blocks, max_len)
    assert max_len * rec // window > RECORDS_MAX_BYTES and max_len > window > 0
    assert ring_geometry(prog.opcodes.blocks, reserved=rec)[1] >= 2
