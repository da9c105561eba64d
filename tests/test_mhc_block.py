"""mHC blocks on the CPU: the chain sdk/reference/mhc.py (MHCResidual, proven equal to transformers)
-> the blocks' torch twins (emulate_tile, tile by tile) over two layers and the head, both heads
(V4 weighted, GLM-5.3 mean), fp32 and bf16 streams, with the post-mix fused with the next mix.
Device tiles: compile-checked in tests/test_blocks_compile.py, run in tests/gpu/test_mhc_gpu.py."""
import pytest
import torch

from sdk.blocks.mhc import (MHCMixBlock, MHCMixConfig, MHCPostBlock, MHCPostConfig, MHCPreBlock, MHCPreConfig,
                            mix_rows)
from sdk.errors import UnsupportedConfigError
from sdk.reference.common import rms_norm
from sdk.reference.mhc import MHCResidual
from sdk.spec import ResidualSpec


class _Model:   # the two fields MHCResidual reads
    def __init__(self, n, head, norm_eps=1e-6):
        self.residual = ResidualSpec(kind="mhc", hc_mult=n, sinkhorn_iters=20, eps=1e-6, head=head)
        self.norm_eps = norm_eps


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def make_weights(n, d, layers, seed):
    g = torch.Generator().manual_seed(seed)
    w = {}
    for i in range(layers):
        for site in ("hc_attn", "hc_mlp"):
            p = f"layers.{i}.{site}."
            w[p + "fn"] = torch.randn((2 + n) * n, n * d, generator=g) * 0.02
            w[p + "base"] = torch.randn((2 + n) * n, generator=g) * 0.5
            w[p + "scale"] = 1 + 0.3 * torch.randn(3, generator=g)
    w["hc_head.fn"] = torch.randn(n, n * d, generator=g) * 0.02
    w["hc_head.base"] = torch.randn(n, generator=g) * 0.5
    w["hc_head.scale"] = 1 + 0.3 * torch.randn(1, generator=g)
    return w


def run_tiles(block, t):
    for spec in block.operand_specs():
        if spec.output and not spec.optional and spec.name not in t:
            t[spec.name] = torch.full(spec.shape, float("nan")).to({"fp32": torch.float32, "bf16": torch.bfloat16}[spec.dtype])
    for tile in reversed(range(block.num_tiles())):      # any order: tiles are independent
        block.emulate_tile(t, tile)
    return t


@pytest.mark.parametrize("head", ["weighted", "mean"])
@pytest.mark.parametrize("sdt", ["fp32", "bf16"])
def test_two_layers_and_head_equal_reference(head, sdt):
    """embed -> [attn site, mlp site] x 2 layers -> head, sublayers replaced by a fixed nonlinear
    map of their (normed) input; blocks: mix (first site only), pre (coefficients + collapse +
    fused norm), post (residual write + the next site's mix partials)."""
    torch.manual_seed(0)
    n, d, m, layers, ds = 4, 1024, 3, 2, 256
    dt = torch.float32 if sdt == "fp32" else torch.bfloat16
    w = make_weights(n, d, layers, seed=1)
    norm_w = {f"{i}.{s}": 1 + 0.1 * torch.randn(d) for i in range(layers) for s in ("attn", "mlp")}
    final_w = 1 + 0.1 * torch.randn(d)
    proj = torch.randn(d, d) * d ** -0.5

    def sublayer(x):      # deterministic stand-in for attention / MoE (on the normed input)
        return torch.tanh(x.float() @ proj).to(torch.bfloat16)

    ref = MHCResidual(_Model(n, head), w)
    x0 = torch.randn(m, 1, d).to(dt)
    h = ref.embed(x0)                                              # [m, 1, n, d]
    for i in range(layers):
        for s, site in (("attn", "hc_attn"), ("mlp", "hc_mlp")):
            h = ref.around(i, s, h, lambda y, k=f"{i}.{s}": sublayer(rms_norm(y, norm_w[k], 1e-6)))
    want = rms_norm(ref.head(h), final_w, 1e-6)[:, 0]

    # ---- the blocks ----
    slices = d // ds
    streams = h0 = ref.embed(x0)[:, 0].contiguous()               # [m, n, d]
    sites = [(i, s, site) for i in range(layers) for s, site in (("attn", "hc_attn"), ("mlp", "hc_mlp"))]
    p0 = "layers.0.hc_attn."
    part = run_tiles(MHCMixBlock(MHCMixConfig(d=d, n=n, m=m, rows=mix_rows(n), d_slice=ds, stream_dtype=sdt)),
                     {"streams": h0, "fn": w[p0 + "fn"]})["part"]
    for k, (i, s, site) in enumerate(sites):
        p = f"layers.{i}.{site}."
        pre = MHCPreBlock(MHCPreConfig(d=d, n=n, m=m, slices=slices, stream_dtype=sdt, out_dtype=sdt))
        t = run_tiles(pre, {"streams": streams, "part": part, "base": w[p + "base"], "scale": w[p + "scale"],
                            "norm_weight": norm_w[f"{i}.{s}"]})
        # the reference's coefficients on the same streams (fp32, the RMSNorm-then-linear order)
        rp, rpost, rcomb = ref.coefficients(p, streams[:, None])
        assert torch.allclose(t["coef"][:, :n], rp[:, 0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(t["coef"][:, n:2 * n], rpost[:, 0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(t["coef"][:, 2 * n:], rcomb[:, 0].flatten(1), atol=1e-5, rtol=1e-5)
        y = sublayer(t["out"])
        last = k == len(sites) - 1
        if last:
            nxt_rows, fn_next = (n, w["hc_head.fn"]) if head == "weighted" else (0, None)
        else:
            ni, _, nsite = sites[k + 1]
            nxt_rows, fn_next = mix_rows(n), w[f"layers.{ni}.{nsite}.fn"]
        post = MHCPostBlock(MHCPostConfig(d=d, n=n, m=m, d_slice=ds, stream_dtype=sdt, next_rows=nxt_rows))
        tt = {"streams": streams, "y": y, "coef": t["coef"], "streams_out": streams}     # in place
        if nxt_rows:
            tt["fn_next"] = fn_next
            tt["part_next"] = torch.full((slices, m, nxt_rows + 1), float("nan"))
        run_tiles(post, tt)
        streams, part = tt["streams_out"], tt.get("part_next")
    if head == "weighted":
        hb = MHCPreBlock(MHCPreConfig(d=d, n=n, m=m, kind="head", slices=slices, stream_dtype=sdt,
                                        out_dtype=sdt))
        t = run_tiles(hb, {"streams": streams, "part": part, "base": w["hc_head.base"],
                           "scale": w["hc_head.scale"], "norm_weight": final_w})
    else:
        hb = MHCPreBlock(MHCPreConfig(d=d, n=n, m=m, kind="mean", stream_dtype=sdt, out_dtype=sdt))
        t = run_tiles(hb, {"streams": streams, "norm_weight": final_w})
    # fp32 streams: the only differences are fp32 summation orders (and the rare bf16 flip of the
    # stand-in sublayer's output they cause); bf16 streams: one rounding per mix vs the reference's two
    tol = 1e-4 if sdt == "fp32" else 2e-2
    err_streams, err_out = rel(streams, h[:, 0]), rel(t["out"], want)
    print(f"{head} {sdt}: streams rel err {err_streams:.2e}, head out {err_out:.2e}")
    assert err_streams < tol and err_out < tol


def test_blocks_definition_equals_twin():
    """reference() (whole op) == emulate_tile over all tiles, for each block."""
    torch.manual_seed(3)
    n, d, m = 4, 1024, 5
    x = torch.randn(m, n, d)
    fn = torch.randn(24, n * d) * 0.02
    mix = MHCMixBlock(MHCMixConfig(d=d, m=m))
    t = run_tiles(mix, {"streams": x, "fn": fn})
    assert torch.allclose(t["part"], mix.reference(streams=x, fn=fn)["part"], atol=1e-5)
    part = t["part"]
    pre = MHCPreBlock(MHCPreConfig(d=d, m=m, slices=mix.slices))
    ops = {"streams": x, "part": part, "base": torch.randn(24) * 0.3, "scale": torch.ones(3), "norm_weight": torch.ones(d)}
    t = run_tiles(pre, dict(ops))
    r = pre.reference(**ops)
    assert torch.allclose(t["coef"], r["coef"], atol=1e-6)
    assert rel(t["out"], r["out"]) < 1e-2
    # Sinkhorn: columns sum to 1 (up to eps), rows approximately
    comb = t["coef"][:, 8:].view(m, 4, 4)
    assert torch.allclose(comb.sum(-2), torch.ones(m, 4), atol=1e-4)
    assert torch.allclose(comb.sum(-1), torch.ones(m, 4), atol=1e-2)
    post = MHCPostBlock(MHCPostConfig(d=d, m=m, next_rows=24))
    ops = {"streams": x, "y": torch.randn(m, d).to(torch.bfloat16), "coef": t["coef"], "fn_next": fn}
    tt = run_tiles(post, {**ops, "streams_out": torch.empty_like(x), "part_next": torch.empty(8, m, 25)})
    r = post.reference(**ops)
    assert torch.allclose(tt["streams_out"], r["streams_out"], atol=1e-5)
    assert torch.allclose(tt["part_next"], r["part_next"], atol=1e-4)


@pytest.mark.parametrize("cls,kw", [(MHCMixBlock, dict(d=1024, n=3)), (MHCMixBlock, dict(d=1000)),
                                    (MHCMixBlock, dict(d=1024, d_slice=96)), (MHCPreBlock, dict(d=1536)),
                                    (MHCPreBlock, dict(d=1024, kind="max")), (MHCPostBlock, dict(d=1024, m=65)),
                                    (MHCPostBlock, dict(d=1024, stream_dtype="fp8_e4m3")),
                                    (MHCPreBlock, dict(d=1024, write_coef=False, collapse=False)),
                                    (MHCPreBlock, dict(d=1024, write_coef=False, kind="mean")),
                                    (MHCPreBlock, dict(d=1024, write_coef=False, lagged=True))])
def test_unsupported_configs_fail_loudly(cls, kw):
    with pytest.raises(UnsupportedConfigError):
        cls(cls.Config(**kw))


def test_operands_and_cost():
    post = MHCPostBlock(MHCPostConfig(d=5120, next_rows=24))
    assert post.operands() == ["streams", "y", "coef", "fn_next", "streams_out", "part_next"]
    assert post.num_tiles() == 40
    mix = MHCMixBlock(MHCMixConfig(d=5120))
    assert mix.num_tiles() * mix.cost().bytes >= 24 * 4 * 5120 * 4      # all of fn is read once
    assert MHCPreBlock(MHCPreConfig(d=5120, kind="mean")).operands()[-2:] == ["coef", "out"]


def test_blocks_are_registered():
    from sdk.blocks import builtin_blocks
    assert {MHCMixBlock, MHCPreBlock, MHCPostBlock} <= set(builtin_blocks())


def test_pre_without_coef_collapses_alike():
    """write_coef=False (the v4 site's hc_pre beside its hc_coef op): the same collapse, no coef."""
    g = torch.Generator().manual_seed(3)
    d, m, S = 1024, 3, 8
    t = {"streams": torch.randn(m, 4, d, generator=g), "part": torch.randn(S, m, 25, generator=g).abs(),
         "base": 0.5 * torch.randn(24, generator=g), "scale": 1 + 0.3 * torch.randn(3, generator=g),
         "norm_weight": 1 + 0.1 * torch.randn(d, generator=g)}
    full = run_tiles(MHCPreBlock(MHCPreConfig(d=d, m=m, slices=S)), dict(t))
    alone = MHCPreBlock(MHCPreConfig(d=d, m=m, slices=S, write_coef=False))
    assert alone.operand_specs()[6].optional and "coef" not in alone.reference(**t)
    got = run_tiles(alone, {**t, "out": torch.full((m, d), float("nan")).bfloat16()})
    assert "coef" not in got and torch.equal(got["out"], full["out"])
