"""The whole KDA sublayer (input norm fused into the q|k|v, forget-gate, beta and output-gate
projections; short conv + delta rule + gated output norm; o_proj + residual) in ONE megakernel
launch on the H200 at the Kimi K3 TP8 (12 heads, hidden 7168, full-rank output gate) and GLM-5.3
TP8 (8 heads, hidden 6144, low-rank gates, fp32 conv weight) shards, against the model's
definition (KDAReference.forward + residual, bf16 as the model runs), fresh random inputs, the
output NaN-poisoned, two launches carrying the conv and recurrent states.
Run: `pytest -m gpu tests/gpu/test_kda_layer_gpu.py`."""
import pytest

from harness import clock_seed, need_gpu, program_runtime, rel_err
from sublayer_launches import check_launches

pytestmark = pytest.mark.gpu

SHARDS = {"kimi_k3_tp8": dict(heads=12, hidden=7168),
          "glm53_tp8": dict(heads=8, hidden=6144, output_gate_full_rank=False, conv_w_dtype="fp32")}


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 2), (64, 1)])
@pytest.mark.parametrize("model", list(SHARDS))
def test_kda_sublayer_one_launch(model, batch, tokens):
    need_gpu()
    from sdk.megakernel.kda_layer import KDALayerConfig, build_program, make_inputs, make_weights, reference
    seed = clock_seed()
    cfg = KDALayerConfig(batch=batch, tokens=tokens, **SHARDS[model])
    w = make_weights(cfg, seed=seed, device="cuda")
    rt = program_runtime(build_program(cfg), w)
    check_launches(rt.tensors, lambda launch: rt.run(),
                   lambda launch: make_inputs(cfg, seed=seed + 1 + launch, device="cuda"),
                   lambda inp: reference(cfg, w, inp), ("state", "conv_state"), rel_err, what=f"seed {seed}, ")


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 2), (32, 2)])
def test_kda_sublayer_in_mhc_one_launch(batch, tokens):
    """GLM-5.3's KDA sublayer in its mHC residual (KDALayerConfig.mhc="v4", mhc_site.py): the
    streams in and out, this site's coefficients and the next site's partials compared too."""
    need_gpu()
    from sdk.megakernel.kda_layer import KDALayerConfig, build_program, make_inputs, make_weights, reference
    from sdk.megakernel.mhc_site import site_fn
    seed = clock_seed()
    cfg = KDALayerConfig(batch=batch, tokens=tokens, mhc="v4", **SHARDS["glm53_tp8"])
    w = make_weights(cfg, seed=seed, device="cuda")
    fn = site_fn(cfg.site, seed=seed + 7, device="cuda")
    rt = program_runtime(build_program(cfg), w)
    check_launches(rt.tensors, lambda launch: rt.run(),
                   lambda launch: make_inputs(cfg, seed=seed + 1 + launch, device="cuda", hc_fn=fn),
                   lambda inp: reference(cfg, w, inp, hc_fn=fn), ("state", "conv_state"), rel_err,
                   what=f"seed {seed}, ", out=("streams", "streams"), outputs=("coef", "part_next"),
                   poison=("coef", "part_next", "x", "y"))
