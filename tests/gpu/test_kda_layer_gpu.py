"""The whole KDA sublayer (input norm fused into the q|k|v, forget-gate, beta and output-gate
projections; short conv + delta rule + gated output norm; o_proj + residual) in ONE megakernel
launch on the H200 at the Kimi K3 TP8 (12 heads, hidden 7168, full-rank output gate) and GLM-5.3
TP8 (8 heads, hidden 6144, low-rank gates, fp32 conv weight) shards, against the model's
definition (KDAReference.forward + residual, bf16 as the model runs), fresh random inputs, the
output NaN-poisoned, two launches carrying the conv and recurrent states.
Run: `pytest -m gpu tests/gpu/test_kda_layer_gpu.py`."""
import pytest

from harness import clock_seed, need_gpu, program_runtime, rel_err

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
    carried = {}
    for launch in range(2):
        inp = dict(make_inputs(cfg, seed=seed + 1 + launch, device="cuda"), **carried)
        want = reference(cfg, w, inp)
        for name, v in inp.items():
            rt.tensors[name].copy_(v)
        rt.tensors["resid"].fill_(float("nan"))
        rt.run()
        x = inp["x"].float()
        err = rel_err(rt.tensors["resid"] - x, want["resid"] - x)
        assert err <= 2e-2, f"seed {seed}, launch {launch}: sublayer output rel err {err:.3e}"
        for name in ("state", "conv_state"):
            e = rel_err(rt.tensors[name], want[name])
            assert e <= 1e-2, f"seed {seed}, launch {launch}: {name} rel err {e:.3e}"
        carried = {"state": rt.tensors["state"].clone(), "conv_state": rt.tensors["conv_state"].clone()}
