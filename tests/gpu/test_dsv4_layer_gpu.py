"""The DeepSeek-V4 attention sublayer (SWA, HCA and CSA layers) in ONE megakernel launch at V4.1-Flash's
TP8 shard (8 heads x 512 = one of the 8 o_a groups, hidden 5120, q / o rank 1024, window 128, HCA
ratio 128, CSA ratio 4 with the 64 x 128 indexer picking 512 entries) against the model's definition (DSV4AttentionReference.forward + residual, bf16 as the
model runs), ragged sequences around window boundaries, the output NaN-poisoned, two launches
carrying the ring, the compressor state and the entries.
Run: `pytest -m gpu tests/gpu/test_dsv4_layer_gpu.py`."""
import pytest

from harness import clock_seed, need_gpu, program_runtime, rel_err
from sublayer_launches import check_launches

pytestmark = pytest.mark.gpu

V41_TP8 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, ratio=128, max_seq_len=16384)


BF = ("bf16", "bf16", "bf16")


@pytest.mark.parametrize("mode,batch,T,formats", [
    ("hca", 1, 1, BF), ("hca", 8, 2, BF), ("hca", 64, 1, BF), ("swa", 8, 1, BF), ("csa", 1, 1, BF), ("csa", 8, 1, BF),
    ("csa", 64, 1, BF),
    # V4.1's serving formats: the ring as fp8 records, the compressed entries as fp4 records, the
    # indexer's keys as mxfp4 records
    ("hca", 1, 1, ("fp8_e4m3", "bf16", "bf16")), ("hca", 8, 2, ("fp8_e4m3", "fp4_e2m1", "bf16")),
    ("swa", 64, 1, ("fp8_e4m3", "bf16", "bf16")), ("hca", 64, 1, ("bf16", "fp4_e2m1", "bf16")),
    ("csa", 8, 1, ("fp8_e4m3", "fp4_e2m1", "bf16")), ("csa", 1, 1, ("bf16", "bf16", "mxfp4")),
    ("csa", 8, 1, ("fp8_e4m3", "fp4_e2m1", "mxfp4"))])
def test_dsv4_sublayer_one_launch(mode, batch, T, formats):
    """Two launches carrying every cache, against the model (+ residual); with quantised caches
    (formats = (window_dtype, comp_dtype, index_dtype)) compared as values (cache_values) against
    the model over the dequantised caches, its new ring rows / entries / keys through the same
    records."""
    need_gpu()
    import random

    from sdk.megakernel.dsv4_layer import (DSV4LayerConfig, build_program, cache_values, make_inputs, make_weights,
                                           reference)
    seed = clock_seed()
    rnd = random.Random(seed)
    cfg = DSV4LayerConfig(mode=mode, batch=batch, tokens=T, window_dtype=formats[0], comp_dtype=formats[1],
                          index_dtype=formats[2],
                          **dict(V41_TP8, ratio=4 if mode == "csa" else 128))
    w = make_weights(cfg, seed=seed, device="cuda")
    rt = program_runtime(build_program(cfg), w)
    # starts just before / at / past a window boundary, and far in
    starts = [rnd.choice([127, 128, 255 - T, 5, 4000, 16000 - 2 * T]) for _ in range(batch)]

    def err(a, b):
        return rel_err(cache_values(cfg, a.cpu()), cache_values(cfg, b.cpu()))
    check_launches(rt.tensors, lambda launch: rt.run(),
                   lambda launch: make_inputs(cfg, [s + launch * T for s in starts], seed=seed + 1 + launch,
                                              device="cuda"),
                   # CSA: the attention over the program's own selection, which must be a top-k of the
                   # reference's scores up to near-ties (dsv4_layer.reference's `index`)
                   lambda inp: reference(cfg, w, inp, index=rt.tensors["index"] if mode == "csa" else None),
                   ["window"] + list(cfg.cache_shapes()), err, what=f"seed {seed}, ",
                   reference_after_run=mode == "csa")


@pytest.mark.parametrize("mode,batch,mhc,formats", [
    ("hca", 1, "v4", BF), ("swa", 8, "v4", BF), ("hca", 1, "v41", BF), ("csa", 8, "v41", BF),
    ("hca", 64, "v41", ("fp8_e4m3", "fp4_e2m1", "bf16"))])
def test_dsv4_sublayer_in_mhc_one_launch(mode, batch, mhc, formats):
    """The sublayer wrapped in its mHC residual (DSV4LayerConfig.mhc, docs/mhc.md): the streams'
    collapse + input norm first ("v41": V4.1's lagged form, with the previous site's pre, the
    coefficients beside the sublayer), the post-mix of the streams in place fused with the next
    site's partials last - against the model's MHCResidual.around the model's attention; this
    site's coef and the next site's partials compared too."""
    need_gpu()
    import random

    from sdk.megakernel.dsv4_layer import (DSV4LayerConfig, build_program, cache_values, make_inputs, make_weights,
                                           reference)
    from sdk.megakernel.mhc_site import site_fn
    seed = clock_seed()
    rnd = random.Random(seed)
    cfg = DSV4LayerConfig(mode=mode, batch=batch, mhc=mhc, q_head_norm=mhc != "v41", window_dtype=formats[0],
                          comp_dtype=formats[1], index_dtype=formats[2],
                          **dict(V41_TP8, ratio=4 if mode == "csa" else 128))
    w = make_weights(cfg, seed=seed, device="cuda")
    fn = site_fn(cfg.site, seed=seed + 7, device="cuda")
    rt = program_runtime(build_program(cfg), w)
    starts = [rnd.choice([127, 128, 254, 5, 4000, 15998]) for _ in range(batch)]

    def err(a, b):
        return rel_err(cache_values(cfg, a.cpu()), cache_values(cfg, b.cpu()))
    check_launches(rt.tensors, lambda launch: rt.run(),
                   lambda launch: make_inputs(cfg, [s + launch for s in starts], seed=seed + 1 + launch,
                                              device="cuda", hc_fn=fn),
                   lambda inp: reference(cfg, w, inp, index=rt.tensors["index"] if mode == "csa" else None,
                                         hc_fn=fn),
                   ["window"] + list(cfg.cache_shapes()), err, what=f"seed {seed}, ",
                   reference_after_run=mode == "csa", out=("streams", "streams"), outputs=("coef", "part_next"),
                   poison=("coef", "part_next", "x", "y"))
