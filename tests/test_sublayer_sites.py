"""The MLA and dense-MLP sublayers in the model's mHC residual (MLALayerConfig / DenseLayerConfig
`mhc`, sdk/megakernel/mhc_site.py) - GLM-5.3's DSA layers and dense first layers in its
whole-model program: the streams' collapse with the input norm first (the GEMVs that read x wait
for it alone), the post-mix of the streams in place from the sublayer's output, fused with the
next site's partials - run by the PyVM against MHCResidual.around the sublayer's reference, three
steps of fresh inputs, outputs NaN-poisoned."""
import pytest
import torch

from sdk.megakernel import dense_layer, mla_layer
from sdk.megakernel.mhc_site import site_fn
from sdk.megakernel.mla_attention import MLAAttentionConfig
from sdk.megakernel.pyvm import PyVM


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite values (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def mla_cfg(mhc):
    attn = MLAAttentionConfig(heads=4, batch=2, num_pages=8, max_seq_len=128, rope=0, nope=128)
    return mla_layer.MLALayerConfig(attn, hidden=1024, q_lora=512, rope_mode="none", eps=1e-5, mhc=mhc)


CASES = {
    "mla-v4": (lambda: mla_cfg("v4"), ("attn.q_a", "attn.kv_a")),
    "mla-v41": (lambda: mla_cfg("v41"), ("attn.q_a", "attn.kv_a")),
    "dense-v4": (lambda: dense_layer.DenseLayerConfig(hidden=1024, intermediate=512, batch=3, swiglu_limit=10.0,
                                                       mhc="v4"), ("mlp.gateup",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sublayer_in_mhc_equals_reference(case):
    make, readers = CASES[case]
    cfg = make()
    mod = mla_layer if isinstance(cfg, mla_layer.MLALayerConfig) else dense_layer
    w = mod.make_weights(cfg, seed=1)
    prog = mod.build_program(cfg)
    vm, _ = PyVM.from_program(prog, 8, {k: v for k, v in w.items() if k in prog.buffers})
    first = next(op.label for op in prog.ops if op.label.endswith(("hc_pre", "hc_in")))
    for label in readers:        # x's readers wait for the collapse alone
        op = next(o for o in prog.ops if o.label == label)
        assert {prog.counter_names[c] for i in op.instructions for c, _ in prog.instructions[i].waits} == {first}
    fn = site_fn(cfg.site, seed=4)
    for step in range(3):
        inp = (mod.make_inputs(cfg, [5 + step, 70], seed=step, hc_fn=fn) if mod is mla_layer
               else mod.make_inputs(cfg, seed=step, hc_fn=fn))
        for name in ("coef", "part_next", "x", "y"):
            vm.tensors[name].fill_(float("nan"))
        for name, v in inp.items():
            vm.tensors[name].copy_(v)
        vm.step(seed=step)
        want = mod.reference(cfg, w, inp, hc_fn=fn)
        s0 = inp["streams"].float()
        err = rel(vm.tensors["streams"].float() - s0, want["streams"].float() - s0)
        print(f"{case} step {step}: the streams' increment {err:.1e}")
        assert err < 1e-2, f"step {step}"
        assert rel(vm.tensors["coef"], want["coef"]) <= 1e-5
        assert rel(vm.tensors["part_next"], want["part_next"]) < 1e-2


def test_v4_site_coefficients_op_beside_the_collapse():
    """MHCSite.split_coef (the default): the v4 site's hc_pre computes only its pre for the
    collapse, and an hc_coef op of its own - which x's readers do not wait for - computes the
    coefficients the post-mix needs. Same twins, same order of sums: every output bit-equal to the
    single hc_pre op's program over three steps."""
    import dataclasses
    base = dense_layer.DenseLayerConfig(hidden=1024, intermediate=512, batch=3, swiglu_limit=10.0, mhc="v4")
    w = dense_layer.make_weights(base, seed=1)
    fn = site_fn(base.site, seed=4)
    runs = {}
    for split in (True, False):
        cfg = dataclasses.replace(base, hc_split_coef=split)
        prog = dense_layer.build_program(cfg)
        labels = [op.label for op in prog.ops]
        assert ("mlp.hc_coef" in labels) == split
        if split:                            # the post waits for the coefficients, the GEMVs do not
            waits = lambda label: {prog.counter_names[c] for op in prog.ops if op.label == label
                                   for i in op.instructions for c, _ in prog.instructions[i].waits}
            assert waits("mlp.gateup") == {"mlp.hc_pre"} and "mlp.hc_coef" in waits("mlp.hc_post")
            assert prog.ops[labels.index("mlp.hc_pre")].block.config.write_coef is False
        vm, _ = PyVM.from_program(prog, 8, {k: v for k, v in w.items() if k in prog.buffers})
        outs = []
        for step in range(3):
            inp = dense_layer.make_inputs(cfg, seed=step, hc_fn=fn)
            for name in ("coef", "part_next", "x", "y"):
                vm.tensors[name].fill_(float("nan"))
            for name, v in inp.items():
                vm.tensors[name].copy_(v)
            vm.step(seed=step)
            outs.append({k: vm.tensors[k].clone() for k in ("streams", "coef", "part_next", "x")})
        runs[split] = outs
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: {k}"
            assert torch.isfinite(a[k].float()).all(), f"step {step}: {k} not written"
