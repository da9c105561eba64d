"""A whole DeepSeek-V4.1 decoder layer in ONE megakernel launch (sdk/megakernel/mhc_layer.py): the
attention sublayer at the TP8 shard (8 heads, hidden 5120; HCA ratio 128 or CSA ratio 4 with the
indexer) and the MoE layer at the EP8 shard (48 local MXFP4 experts of 384, the shared expert),
each in V4.1's lagged mHC site, joined; two launches carrying the attention caches, fresh streams
each, the outputs NaN-poisoned, against the two sublayers' model references in sequence.
Run: `pytest -m gpu tests/gpu/test_mhc_layer_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err

pytestmark = pytest.mark.gpu

V41_TP8 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, max_seq_len=16384)


@pytest.mark.parametrize("mode,batch", [("hca", 1), ("hca", 8), ("csa", 1)])
def test_v41_layer_one_launch(mode, batch):
    need_gpu()
    import random

    from sdk.megakernel import dsv4_layer, moe_layer
    from sdk.megakernel.mhc_layer import join, layer_names
    from sdk.megakernel.mhc_site import site_fn
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    seed = clock_seed()
    rnd = random.Random(seed)
    attn = dsv4_layer.DSV4LayerConfig(mode=mode, batch=batch, mhc="v41", q_head_norm=False,
                                      **dict(V41_TP8, ratio=4 if mode == "csa" else 128))
    moe = moe_layer.preset("deepseek_v41_flash", batch, expert_dtype="mxfp4", mhc="v41")
    prog = join(dsv4_layer.build_program(attn), moe_layer.build_program(moe))
    name1, name2 = layer_names()
    wa = dsv4_layer.make_weights(attn, seed=seed, device="cuda")
    wm = moe_layer.make_weights(moe, seed=seed + 1, device="cuda")
    t = PyVM.alloc(prog, device="cuda")
    t.update({name1(k): v for k, v in wa.items()})
    t.update({name2(k): v for k, v in wm.items()})
    rt = MegakernelRuntime(prog, t)
    fn = site_fn(attn.site, seed=seed + 2, device="cuda")
    starts = [rnd.choice([127, 128, 254, 5, 4000, 15998]) for _ in range(batch)]
    caches = ["window"] + list(attn.cache_shapes())
    carried = {}
    for launch in range(2):
        inp = dsv4_layer.make_inputs(attn, [s + launch for s in starts], seed=seed + 3 + launch, device="cuda",
                                     hc_fn=fn)
        inp.update(carried)
        for name, v in inp.items():
            t[name if name in ("streams", "part", "carried") else name1(name)].copy_(v)
        for name in ("coef", "part_next", "attn.coef", "mlp.part", "attn.x", "mlp.x", "mlp.out", "attn.y"):
            t[name].fill_(float("nan"))
        rt.run()
        want_a = dsv4_layer.reference(attn, wa, inp, index=t["attn.index"] if mode == "csa" else None, hc_fn=fn)
        want = moe_layer.mhc_reference(moe, wm, {"streams": want_a["streams"].to(torch.bfloat16),
                                                 "carried": want_a["coef"]}, wa["hc_fn_next"])
        s0 = inp["streams"].float()
        what = f"seed {seed}, launch {launch}"
        e = rel_err(t["streams"].float() - s0, want["streams"].float() - s0)
        assert e <= 3e-2, f"{what}: the layer's streams increment rel err {e:.3e}"
        for name, got, ref, tol in (("coef", t["coef"], want["coef"], 5e-3),
                                    ("part_next", t["part_next"], want["part_next"], 3e-2),
                                    ("attn.coef", t["attn.coef"], want_a["coef"], 1e-4)):
            e = rel_err(got, ref)
            assert e <= tol, f"{what}: {name} rel err {e:.3e}"
        for name in caches:
            e = rel_err(t[name1(name)], want_a[name])
            assert e <= 1e-2, f"{what}: {name} rel err {e:.3e}"
        carried = {n: t[name1(n)].clone() for n in caches}
