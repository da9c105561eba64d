"""DeepSeek-V4.1's lagged mHC pre-mix on the CPU: the reference (sdk/reference/mhc.py, lagged_pre
with the "carried" head) against V4.1's formulas restated independently below, then the device
blocks' twins (MHCPreBlock lagged / kind "carried", MHCPostBlock round_coef=False) against the
reference, and the tiny V4.1 model through the reference backend.

V4.1's chain (vLLM's DeepSeek-V4.1 model: mhc_pre_delayed_torch, mhc_post_torch, the decoder
layer's forward): the first site's input is stream 0; every later site's input is the streams
collapsed with the pre-mix the PREVIOUS site computed; each site computes its own pre / post /
comb from its input streams; the post-mix is fp32, rounded once; the final collapse uses the last
site's pre (no hc_head weights)."""
import pytest
import torch

from sdk.blocks.mhc import (MHCMixBlock, MHCMixConfig, MHCPostBlock, MHCPostConfig, MHCPreBlock, MHCPreConfig,
                            first_site_carry, mix_rows)
from sdk.errors import UnsupportedConfigError
from sdk.reference.common import rms_norm
from sdk.reference.mhc import MHCResidual
from sdk.spec import ResidualSpec

from test_mhc_block import make_weights, rel, run_tiles

N, D, M, LAYERS, DS = 4, 1024, 3, 2, 256
SITES = [(i, s, site) for i in range(LAYERS) for s, site in (("attn", "hc_attn"), ("mlp", "hc_mlp"))]


class _Model:
    def __init__(self, lagged=True, head="carried"):
        self.residual = ResidualSpec(kind="mhc", hc_mult=N, sinkhorn_iters=20, eps=1e-6, head=head,
                                     lagged_pre=lagged)
        self.norm_eps = 1e-6


def v41_pre_delayed(streams, fn, scale, base, carried, eps=1e-6, norm_eps=1e-6, iters=20):
    """V4.1's pre for one site, streams [M, N, D]: (post, comb, layer input, own pre)."""
    n = streams.shape[1]
    x = streams.flatten(1).float()
    mixes = (x @ fn.t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax(mixes[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    layer_input = streams[:, 0] if carried is None else \
        (carried[:, :, None] * streams.float()).sum(1).to(streams.dtype)
    return post, comb, layer_input, pre


def v41_post(y, streams, post, comb):
    """X'[j] = post_j y + sum_i comb[i, j] X_i, in fp32, rounded once."""
    mixed = torch.einsum("mij,mih->mjh", comb.float(), streams.float())
    return (mixed + post[:, :, None] * y[:, None, :].float()).to(streams.dtype)


def setup(sdt, seed=0):
    torch.manual_seed(seed)
    dt = torch.float32 if sdt == "fp32" else torch.bfloat16
    w = make_weights(N, D, LAYERS, seed=seed + 1)
    norm_w = {f"{i}.{s}": 1 + 0.1 * torch.randn(D) for i, s, _ in SITES}
    final_w = 1 + 0.1 * torch.randn(D)
    proj = torch.randn(D, D) * D ** -0.5

    def sublayer(x):           # a deterministic stand-in for attention / MoE on the normed input
        return torch.tanh(x.float() @ proj).to(torch.bfloat16)

    return w, norm_w, final_w, sublayer, torch.randn(M, 1, D).to(dt)


def reference_chain(w, norm_w, final_w, sublayer, x0, head="carried"):
    ref = MHCResidual(_Model(head=head), w)
    h = ref.embed(x0)
    for i, s, _ in SITES:
        h = ref.around(i, s, h, lambda y, k=f"{i}.{s}": sublayer(rms_norm(y, norm_w[k], 1e-6)))
    return h[:, 0], rms_norm(ref.head(h), final_w, 1e-6)[:, 0]


@pytest.mark.parametrize("sdt", ["fp32", "bf16"])
def test_lagged_reference_equals_v41_formulas(sdt):
    w, norm_w, final_w, sublayer, x0 = setup(sdt)
    streams = x0[:, 0, None, :].expand(-1, N, -1).contiguous()     # the embedding on the N streams
    carried = y = post = comb = None
    for k, (i, s, site) in enumerate(SITES):
        if k:
            streams = v41_post(y, streams, post, comb)
        p = f"layers.{i}.{site}."
        post, comb, inp, carried = v41_pre_delayed(streams, w[p + "fn"], w[p + "scale"], w[p + "base"], carried)
        y = sublayer(rms_norm(inp, norm_w[f"{i}.{s}"], 1e-6))
    streams = v41_post(y, streams, post, comb)
    want_out = rms_norm((carried[:, :, None] * streams.float()).sum(1).to(streams.dtype), final_w, 1e-6)
    got_streams, got_out = reference_chain(w, norm_w, final_w, sublayer, x0)
    # the only difference: RMSNorm-then-linear (reference) vs linear-then-rstd (V4.1) in fp32, and
    # the rare bf16 flip of the stand-in sublayer's output it causes
    tol = 1e-4 if sdt == "fp32" else 1e-2
    err = rel(got_streams, streams)
    assert err < tol and rel(got_out, want_out) < tol
    # and the lag matters: the unlagged V4 chain on the same weights is far from it
    v4 = MHCResidual(_Model(lagged=False, head="mean"), w)
    h = v4.embed(x0)
    for i, s, _ in SITES:
        h = v4.around(i, s, h, lambda y, k=f"{i}.{s}": sublayer(rms_norm(y, norm_w[k], 1e-6)))
    print(f"{sdt}: lagged reference vs V4.1's formulas {err:.1e}, vs the unlagged chain {rel(h[:, 0], streams):.1e}")
    assert rel(h[:, 0], streams) > 10 * max(err, 1e-4)


@pytest.mark.parametrize("sdt", ["fp32", "bf16"])
def test_lagged_blocks_equal_reference(sdt):
    """mix (first site) -> per site: pre (lagged: the previous site's coef as `carried`; the first
    site: first_site_carry) -> post (fp32 coefficients, + the next site's mix partials) -> the
    "carried" head (the last site's coef)."""
    w, norm_w, final_w, sublayer, x0 = setup(sdt, seed=5)
    want_streams, want_out = reference_chain(w, norm_w, final_w, sublayer, x0)
    slices = D // DS
    streams = x0[:, 0, None, :].expand(-1, N, -1).contiguous()
    part = run_tiles(MHCMixBlock(MHCMixConfig(d=D, n=N, m=M, rows=mix_rows(N), d_slice=DS, stream_dtype=sdt)),
                     {"streams": streams, "fn": w["layers.0.hc_attn.fn"]})["part"]
    carried = first_site_carry(M, N)
    for k, (i, s, site) in enumerate(SITES):
        p = f"layers.{i}.{site}."
        pre = MHCPreBlock(MHCPreConfig(d=D, n=N, m=M, slices=slices, stream_dtype=sdt, out_dtype=sdt, lagged=True))
        t = run_tiles(pre, {"streams": streams, "part": part, "base": w[p + "base"], "scale": w[p + "scale"],
                            "norm_weight": norm_w[f"{i}.{s}"], "carried": carried})
        y = sublayer(t["out"])
        last = k == len(SITES) - 1
        nxt = 0 if last else mix_rows(N)
        post = MHCPostBlock(MHCPostConfig(d=D, n=N, m=M, d_slice=DS, stream_dtype=sdt, next_rows=nxt,
                                          round_coef=False))
        tt = {"streams": streams, "y": y, "coef": t["coef"], "streams_out": streams}
        if nxt:
            ni, _, nsite = SITES[k + 1]
            tt.update(fn_next=w[f"layers.{ni}.{nsite}.fn"], part_next=torch.full((slices, M, nxt + 1), float("nan")))
        run_tiles(post, tt)
        streams, part, carried = tt["streams_out"], tt.get("part_next"), t["coef"]
    head = MHCPreBlock(MHCPreConfig(d=D, n=N, m=M, kind="carried", stream_dtype=sdt, out_dtype=sdt))
    assert "part" not in head.alloc_operands() and "coef" not in head.alloc_operands()
    t = run_tiles(head, {"streams": streams, "norm_weight": final_w, "carried": carried})
    tol = 1e-4 if sdt == "fp32" else 2e-2
    err_streams, err_out = rel(streams, want_streams), rel(t["out"], want_out)
    print(f"lagged {sdt}: streams rel err {err_streams:.2e}, head out {err_out:.2e}")
    assert err_streams < tol and err_out < tol


def test_first_site_carry_selects_stream_zero():
    torch.manual_seed(2)
    x = torch.randn(2, N, D).to(torch.bfloat16)
    pre = MHCPreBlock(MHCPreConfig(d=D, m=2, kind="carried", stream_dtype="bf16", out_norm=False))
    out = pre.reference(streams=x, carried=first_site_carry(2, N))["out"]
    assert torch.equal(out, x[:, 0].float())


@pytest.mark.parametrize("kw", [dict(kind="head", lagged=True), dict(kind="mean", lagged=True)])
def test_lagged_needs_a_sublayer_site(kw):
    with pytest.raises(UnsupportedConfigError, match="lagged"):
        MHCPreBlock(MHCPreConfig(d=D, **kw))


def test_carried_head_needs_lagged_sites():
    with pytest.raises(UnsupportedConfigError, match="lagged_pre"):
        MHCResidual(_Model(lagged=False, head="carried"), {})


def test_tiny_v41_model_decodes():
    """The tiny V4.1 config (lagged mHC, carried head, queries without the head norm) through the
    reference backend: no hc_head weights; T = 3 tokens at once equal 3 single steps; the logits
    differ from V4's math on the same weights."""
    from sdk import build_megakernel
    from sdk.reference.model import random_weights
    v41 = build_megakernel("deepseek_v41_flash", "tiny_v41")
    assert v41.spec.residual.lagged_pre and v41.spec.residual.head == "carried"
    assert not any(l.attention.q_head_norm for l in v41.spec.layers)
    w = random_weights(v41.spec, seed=3)
    assert not any(k.startswith("hc_head.") for k in w)
    v41.load_weights(w)
    ids = torch.randint(0, v41.spec.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    st = v41.new_state(2)
    together = v41.decode(ids, st)
    st1 = v41.new_state(2)
    steps = torch.cat([v41.decode(ids[:, j:j + 1], st1) for j in range(3)], dim=1)
    assert torch.isfinite(together).all()
    assert rel(together, steps) < 1e-5
    v4 = build_megakernel("deepseek_v41_flash", "tiny")
    w4 = dict(w)
    n, d = v4.spec.residual.hc_mult, v4.spec.hidden_size
    w4.update({"hc_head.fn": torch.zeros(n, n * d), "hc_head.base": torch.zeros(n), "hc_head.scale": torch.ones(1)})
    v4.load_weights(w4)
    assert rel(v4.decode(ids, v4.new_state(2)), together) > 1e-3
