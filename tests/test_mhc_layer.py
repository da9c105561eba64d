"""A whole mHC decoder layer in one program (sdk/megakernel/mhc_layer.py): DeepSeek-V4.1's attention
sublayer and MoE layer, each in V4.1's lagged mHC site, joined; run by the PyVM over two launches
carrying the attention caches, against the two sublayers' model references in sequence (the
attention's MHCResidual.around, then the MoE's on its streams with its coef as the carried pre)."""
import pytest
import torch

from sdk.megakernel import dsv4_layer, moe_layer
from sdk.megakernel.mhc_layer import join, op_waits
from sdk.megakernel.mhc_site import site_fn
from sdk.megakernel.pyvm import PyVM

TINY_ATTN = dict(heads=2, hidden=1024, q_rank=256, o_rank=256, window=8, ratio=4, max_seq_len=64, batch=3, tokens=2)


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def v41_layer(mode="hca", mhc="v41"):
    attn = dsv4_layer.DSV4LayerConfig(mode=mode, mhc=mhc, q_head_norm=mhc != "v41", **TINY_ATTN)
    moe = moe_layer.MoELayerConfig(hidden=1024, batch=attn.tokens_total, mhc=mhc, correction_bias=True,
                                   scoring="sqrtsoftplus", expert_dtype="mxfp4", num_local=32, rank=1,
                                   shared_intermediate=256, routed_scaling_factor=1.5, swiglu_limit=10.0)
    return attn, moe


@pytest.mark.parametrize("mode,mhc", [("hca", "v41"), ("swa", "v4")])
def test_pyvm_layer_equals_sublayer_references(mode, mhc):
    attn, moe = v41_layer(mode, mhc)
    prog = join(dsv4_layer.build_program(attn), moe_layer.build_program(moe))
    waits = op_waits(prog)
    labels = [op.label for op in prog.ops]
    post = labels.index("attn.v4.hc_post")
    for first in ("mlp.moe.hc_in" if mhc == "v41" else "mlp.moe.hc_pre", "mlp.moe.hc_coef"):
        assert waits[labels.index(first)] == [post]          # the MoE site starts after the attention's post
    assert prog.buffers["attn.coef"].role == "scratch" and prog.buffers["coef"].role == "output"
    wa = dsv4_layer.make_weights(attn, seed=1)
    wm = moe_layer.make_weights(moe, seed=2)
    weights = {**{"attn." + k: v for k, v in wa.items()}, **{"mlp." + k: v for k, v in wm.items()}}
    vm, _ = PyVM.from_program(prog, 8, weights)
    fn = site_fn(attn.site, seed=3)
    starts = [0, 5, 30]
    caches = ["window"] + list(attn.cache_shapes())
    carried = {}
    for launch in range(2):
        inp = dsv4_layer.make_inputs(attn, [s + launch * attn.tokens for s in starts], seed=10 + launch, hc_fn=fn)
        inp.update(carried)
        for name, v in inp.items():
            vm.tensors[name if name in ("streams", "part", "carried") else "attn." + name].copy_(v)
        for name in ("coef", "part_next", "attn.coef", "mlp.part", "attn.x", "mlp.x", "mlp.out"):
            vm.tensors[name].fill_(float("nan"))
        vm.step(seed=launch)
        want_a = dsv4_layer.reference(attn, wa, inp, hc_fn=fn)
        moe_in = {"streams": want_a["streams"].to(torch.bfloat16), "carried": want_a["coef"]}
        want = moe_layer.mhc_reference(moe, wm, moe_in, wa["hc_fn_next"])
        s0 = inp["streams"].float()
        assert rel(vm.tensors["streams"].float() - s0, want["streams"].float() - s0) <= 2e-2, f"launch {launch}"
        # the MoE site's coefficients are of the streams after the attention, whose bf16 roundings
        # differ (v4: the reference rounds the post-mix's coefficients and products in bf16)
        assert rel(vm.tensors["coef"], want["coef"]) <= 5e-3
        assert rel(vm.tensors["part_next"], want["part_next"]) <= 2e-2
        assert rel(vm.tensors["attn.coef"], want_a["coef"]) <= 1e-5
        for name in caches:
            assert rel(vm.tensors["attn." + name], want_a[name]) <= 1e-2, name
        carried = {n: vm.tensors["attn." + n].clone() for n in caches}


def test_join_refuses_a_plain_sublayer():
    attn, moe = v41_layer()
    plain = dsv4_layer.build_program(dsv4_layer.DSV4LayerConfig(mode="hca", **TINY_ATTN))
    with pytest.raises(ValueError, match="not in an mHC site"):
        join(plain, moe_layer.build_program(moe))
