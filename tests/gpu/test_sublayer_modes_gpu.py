"""The sublayer forms the whole-model programs use, each in ONE launch on the GPU against the model's
reference (fresh random inputs, outputs NaN-poisoned): Kimi K3's plain chain - dense MLP, KDA,
NoPE MLA and the latent MoE adding onto the bf16 hidden state in place (`resid_in_place`;
tests/test_plain_model.py on the CPU) - and GLM-5.3's MLA and dense MLP in their mHC sites
(tests/test_sublayer_sites.py on the CPU). When a whole-model GPU test fails, these say which piece.
Run: `pytest -m gpu tests/gpu/test_sublayer_modes_gpu.py`."""
import pytest

from harness import clock_seed, need_gpu, program_runtime, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["dense", "kda", "mla", "moe shared=256", "moe shared=0"])
def test_sublayer_in_place_one_launch(case):
    need_gpu()
    from test_plain_model import in_place_cases
    seed = clock_seed()
    name, prog, w, inputs, want = in_place_cases(seed % 1000, only=case, device="cuda")[0]
    rt = program_runtime(prog, {k: v for k, v in w.items() if k in prog.buffers})
    for k, v in inputs.items():
        rt.tensors[k].copy_(v)
    rt.run()
    rt.check()
    e = rel_err(rt.tensors["x"].float() - inputs["x"].float(), want.float() - inputs["x"].float())
    assert e < 2e-2, f"seed {seed}, {name}: the in-place increment rel err {e:.3e}"


@pytest.mark.parametrize("case", ["mla-v4", "mla-v41", "dense-v4"])
def test_sublayer_in_mhc_one_launch(case):
    need_gpu()
    from test_sublayer_sites import CASES
    from sdk.megakernel import dense_layer, mla_layer
    from sdk.megakernel.mhc_site import site_fn
    seed = clock_seed()
    cfg = CASES[case][0]()
    mod = mla_layer if isinstance(cfg, mla_layer.MLALayerConfig) else dense_layer
    w = mod.make_weights(cfg, seed=seed % 1000, device="cuda")
    prog = mod.build_program(cfg)
    rt = program_runtime(prog, {k: v for k, v in w.items() if k in prog.buffers})
    fn = site_fn(cfg.site, seed=seed % 1000 + 4, device="cuda")
    for launch in range(2):
        inp = (mod.make_inputs(cfg, [5 + launch, 70], seed=launch, device="cuda", hc_fn=fn) if mod is mla_layer
               else mod.make_inputs(cfg, seed=launch, device="cuda", hc_fn=fn))
        for name in ("coef", "part_next", "x", "y"):
            rt.tensors[name].fill_(float("nan"))
        for name, v in inp.items():
            rt.tensors[name].copy_(v)
        rt.run()
        want = mod.reference(cfg, w, inp, hc_fn=fn)
        s0 = inp["streams"].float()
        e = rel_err(rt.tensors["streams"].float() - s0, want["streams"].float() - s0)
        assert e < 2e-2, f"seed {seed}, {case} launch {launch}: the streams' increment rel err {e:.3e}"
        assert rel_err(rt.tensors["coef"], want["coef"]) < 1e-4
        assert rel_err(rt.tensors["part_next"], want["part_next"]) < 2e-2
    rt.check()
