"""The grouped GEMV (GemvConfig.groups, CPU): a block-diagonal W whose output rows of group j read
x's columns of group j - DeepSeek-V4's o_a over its o_groups groups of heads on one GPU. The torch
twin's tiles equal the per-group products; a tile never straddles two groups; what the groups
cannot take is refused by name. GPU twin: tests/gpu/test_megakernel_gpu.py test_gemv_grouped."""
import pytest
import torch

from sdk.blocks.gemv import GemvBlock, GemvConfig, balanced_config
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.mlp_stack import quantize_fp8


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m,wd", [(1, "bf16"), (8, "bf16"), (2, "fp8_e4m3")])
def test_grouped_tiles_equal_each_groups_product(m, wd):
    G, n, k = 4, 4 * 256, 1024
    blk = GemvBlock(balanced_config(GemvConfig(n=n, k=k, m=m, groups=G, weight_dtype=wd)))
    assert (n // G) % blk.config.rows_per_tile == 0
    assert [s.shape for s in blk.operand_specs() if s.name == "x"] == [(m, G * k)]
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
    t = {"x": torch.randn(m, G * k, generator=g).to(torch.bfloat16),
         "y": torch.full((m, n), float("nan")).to(torch.bfloat16)}
    if wd == "fp8_e4m3":
        t["w"], t["w_scale"] = quantize_fp8(w)
    else:
        t["w"] = w
    wf = blk.dequant(t["w"], t.get("w_scale"))
    want = torch.cat([t["x"][:, j * k:(j + 1) * k].float() @ wf[j * n // G:(j + 1) * n // G].T for j in range(G)], 1)
    assert rel(blk.reference(**t)["y"], want) < 1e-6
    for tile in range(blk.num_tiles()):
        blk.emulate_tile(t, tile)
    assert not torch.isnan(t["y"].float()).any()
    assert rel(t["y"], want) < 1e-2
    # a block-diagonal W over the whole x is the same product
    bd = torch.block_diag(*wf.view(G, n // G, k))
    assert rel(want, t["x"].float() @ bd.T) < 1e-6


@pytest.mark.parametrize("kw,what", [(dict(n=1024, k=512, groups=3), "groups=3"),
                                     (dict(n=768, k=512, groups=3, rows_per_tile=96), "groups=3"),   # a tile over 2 groups
                                     (dict(n=1024, k=512, groups=2, norm=True), "norm"),
                                     (dict(n=1024, k=512, groups=2, swiglu=True), "swiglu")])
def test_grouped_refusals(kw, what):
    kw.setdefault("rows_per_tile", 8)
    with pytest.raises(UnsupportedConfigError, match=what):
        GemvBlock(GemvConfig(**kw))
