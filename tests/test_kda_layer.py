"""The KDA sublayer program (sdk/megakernel/kda_layer.py: projections with the input norm fused,
the KDA op with conv + gated norm, o_proj + residual) run by the PyVM equals the model's
definition (KDAReference.forward + residual), two steps carrying the conv and recurrent states;
both output-gate forms (Kimi K3 full rank, GLM-5.3 low rank) and a padded beta / rank."""
import pytest

from sdk.megakernel.kda_layer import KDALayerConfig, build_program, make_inputs, make_weights, reference
from sublayer_launches import check_launches

TINY = dict(heads=4, head_dim=64, hidden=256, batch=3)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kw", [dict(), dict(output_gate_full_rank=False, conv_w_dtype="fp32", tokens=2),
                                dict(heads=12, hidden=512, gate_kind="softplus")],
                         ids=["k3-full-gate", "glm-low-rank-T2", "12-heads-softplus"])
def test_pyvm_sublayer_equals_model_reference(kw):
    from sdk.megakernel.pyvm import PyVM
    cfg = KDALayerConfig(**{**TINY, **kw})
    w = make_weights(cfg, seed=1)
    vm, _ = PyVM.from_program(build_program(cfg), 8, w)
    check_launches(vm.tensors, lambda step: vm.step(seed=step), lambda step: make_inputs(cfg, seed=10 + step),
                   lambda inp: reference(cfg, w, inp), ("state", "conv_state"), rel)


@pytest.mark.parametrize("mhc", ["v4", "v41"])
def test_pyvm_sublayer_in_mhc_equals_model_reference(mhc):
    """GLM-5.3's KDA sublayer in its mHC residual (KDALayerConfig.mhc, mhc_site.py): the streams'
    collapse + the input norm first (the x GEMVs wait for it alone), the post-mix of the streams in
    place from o_proj's output last, fused with the next site's partials - against MHCResidual
    around KDAReference, two launches carrying the caches."""
    from sdk.megakernel.mhc_site import site_fn
    from sdk.megakernel.pyvm import PyVM
    cfg = KDALayerConfig(**{**TINY, "hidden": 1024, "output_gate_full_rank": False, "tokens": 2, "mhc": mhc})
    prog = build_program(cfg)
    first = "kda.hc_in" if mhc == "v41" else "kda.hc_pre"
    qkv = next(op for op in prog.ops if op.label == "kda.qkv")
    assert {prog.counter_names[c] for i in qkv.instructions for c, _ in prog.instructions[i].waits} == {first}
    w = make_weights(cfg, seed=1)
    fn = site_fn(cfg.site, seed=2)
    vm, _ = PyVM.from_program(prog, 8, w)
    check_launches(vm.tensors, lambda step: vm.step(seed=step), lambda step: make_inputs(cfg, seed=10 + step, hc_fn=fn),
                   lambda inp: reference(cfg, w, inp, hc_fn=fn), ("state", "conv_state"), rel,
                   out=("streams", "streams"), outputs=("coef", "part_next"), poison=("coef", "part_next", "x", "y"))


def test_padding():
    """K3 TP8: beta (12 rows) and f_a (rank 128) in one 256-row GEMV, W_f_b's K 256 with zeros
    under the beta columns; GLM-5.3's low-rank output gate padded to 256."""
    cfg = KDALayerConfig(heads=12, batch=1)
    assert (cfg.bfa_width, cfg.rank_padded, cfg.kda.beta_width) == (256, 256, 256)
    shapes = cfg.weight_shapes()
    assert shapes["w_bf_a"][0] == (256, 7168) and shapes["w_f_b"][0] == (1536, 256) and "w_g" in shapes
    w = make_weights(KDALayerConfig(**TINY, output_gate_full_rank=False), seed=0)
    assert not w["w_bf_a"][4 + 64:].any() and not w["w_f_b"][:, :4].any() and not w["w_f_b"][:, 68:].any()
    assert not w["w_g_a"][64:].any() and not w["w_g_b"][:, 64:].any()
    ops = [op.label for op in build_program(KDALayerConfig(heads=8, hidden=6144, output_gate_full_rank=False)).ops]
    assert ops == ["kda.qkv", "kda.beta_f_a", "kda.g_a", "kda.g_b", "kda.f_b", "kda.core", "kda.o_proj"]
