"""mHC blocks on the GPU: the standalone device tiles (mix -> pre -> post with the fused next mix
-> head) against their torch twins and the fp32 reference (sdk/reference/mhc.py through the CPU
test's chain), fresh random inputs (seed printed), NaN-poisoned outputs.
Run: `pytest -m gpu tests/gpu/test_mhc_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu


def emulate(block, t):
    c = {k: v.detach().cpu().clone() for k, v in t.items()}
    for tile in range(block.num_tiles()):
        block.emulate_tile(c, tile)
    return c


def rel(a, b):
    # on the CPU, where emulate() leaves its outputs; |b| floored: no all-zero reference blows up
    return rel_err(a.cpu(), b.cpu(), min_norm=1e-30)


@pytest.mark.parametrize("d,m,sdt,ds", [(5120, 1, "fp32", 128), (5120, 8, "bf16", 128), (4096, 64, "fp32", 256),
                                        (5120, 64, "bf16", 128)])
def test_mhc_layer_on_gpu(d, m, sdt, ds):
    need_gpu()
    from sdk.blocks.mhc import (MHCMixBlock, MHCMixConfig, MHCPostBlock, MHCPostConfig, MHCPreBlock,
                                MHCPreConfig)
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 4
    dt = torch.float32 if sdt == "fp32" else torch.bfloat16
    S = d // ds
    x = torch.randn(m, n, d, device="cuda", generator=g).to(dt)
    fn = torch.randn(24, n * d, device="cuda", generator=g) * 0.02
    fn2 = torch.randn(24, n * d, device="cuda", generator=g) * 0.02
    mix = MHCMixBlock(MHCMixConfig(d=d, m=m, d_slice=ds, stream_dtype=sdt))
    t = {"streams": x, "fn": fn, "part": torch.full((S, m, 25), float("nan"), device="cuda")}
    want = emulate(mix, t)
    run_standalone(mix, t)
    assert rel(t["part"], want["part"]) < 1e-4, f"seed {seed}: mix"
    pre = MHCPreBlock(MHCPreConfig(d=d, m=m, slices=S, stream_dtype=sdt))
    tp = {"streams": x, "part": t["part"], "base": torch.randn(24, device="cuda", generator=g) * 0.5,
          "scale": 1 + 0.3 * torch.randn(3, device="cuda", generator=g),
          "norm_weight": 1 + 0.1 * torch.randn(d, device="cuda", generator=g),
          "coef": torch.full((m, 24), float("nan"), device="cuda"),
          "out": torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)}
    want = emulate(pre, tp)
    run_standalone(pre, tp)
    assert rel(tp["coef"], want["coef"]) < 1e-5, f"seed {seed}: coefficients"
    assert rel(tp["out"], want["out"]) < 1e-2, f"seed {seed}: collapse + norm"
    ref = pre.reference(**{k: v.cpu() for k, v in tp.items()})
    assert rel(tp["coef"], ref["coef"]) < 1e-5
    post = MHCPostBlock(MHCPostConfig(d=d, m=m, d_slice=ds, stream_dtype=sdt, next_rows=24))
    to = {"streams": x, "y": torch.randn(m, d, device="cuda", generator=g).to(torch.bfloat16), "coef": tp["coef"],
          "fn_next": fn2, "streams_out": torch.full_like(x, float("nan")),
          "part_next": torch.full((S, m, 25), float("nan"), device="cuda")}
    want = emulate(post, to)
    run_standalone(post, to)
    assert rel(to["streams_out"], want["streams_out"]) < (1e-6 if sdt == "fp32" else 1e-2), f"seed {seed}: post"
    assert rel(to["part_next"], want["part_next"]) < 1e-3, f"seed {seed}: fused next mix"
    head = MHCPreBlock(MHCPreConfig(d=d, m=m, kind="mean", stream_dtype=sdt))
    th = {"streams": to["streams_out"], "norm_weight": tp["norm_weight"],
          "coef": torch.full((m, 4), float("nan"), device="cuda"),
          "out": torch.full((m, d), float("nan"), device="cuda", dtype=torch.bfloat16)}
    want = emulate(head, th)
    run_standalone(head, th)
    assert rel(th["out"], want["out"]) < 1e-2, f"seed {seed}: mean head"
