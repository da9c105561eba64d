"""Unit tests of the DeepSeek-V4.1-Flash package: the V4 attention reference (sliding window, CSA/HCA
compression, indexer), the mHC residual, the config -> spec mapping and the weight map.

The whole model against transformers is tests/test_reference_vs_hf.py (-k deepseek)."""

import pytest
import torch
import torch.nn.functional as F

from sdk import build_megakernel, plugins
from sdk.errors import UnsupportedConfigError, WeightsMismatchError
from sdk.reference.common import StepInfo
from sdk.reference.dsv4_attention import DSV4AttentionReference, Rope, rope_inv_freq
from sdk.reference.mhc import MHCResidual, sinkhorn
from sdk.reference.model import random_weights
from sdk.reference.weights import Prefixed, expected_weights
from sdk.spec import ResidualSpec

MODEL = "deepseek_v41_flash"


@pytest.fixture(scope="module")
def entry():
    return plugins.get_model(MODEL)


@pytest.fixture(scope="module")
def tiny(entry):
    spec = entry.spec("tiny")
    return spec, random_weights(spec, seed=11)


def layer_of(spec, ratio, overlap):
    return next(l for l in spec.layers if l.attention.compress_ratio == ratio and l.attention.compress_overlap == overlap)


def attention(spec, weights, layer):
    w = dict(weights)
    g = torch.Generator().manual_seed(5)
    for name in list(w):  # non-trivial position biases and sinks (random_weights makes them ~0.02)
        if name.endswith(("position_bias", "sinks")):
            w[name] = torch.randn(w[name].shape, generator=g)
    return DSV4AttentionReference(spec, layer, Prefixed(w, f"layers.{layer.index}.attn."))


def step(start, t):
    start = torch.as_tensor(start, dtype=torch.long)
    return StepInfo(start=start.clone(), positions=start[:, None] + torch.arange(t),
                    input_ids=torch.zeros(len(start), t, dtype=torch.long))


def view(cache, rows):
    return {k: v[rows] for k, v in cache.items()}


# ---------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_ragged_multi_token_calls_equal_single_steps(tiny, kind):
    """Rows prefilled to different lengths, then decoded together 3 tokens at a time, equal each row
    run alone one token at a time -- outputs and every cache tensor -- across window slides and
    compression boundaries that each row crosses at its own step."""
    spec, weights = tiny
    layer = {"sliding": layer_of(spec, 0, False), "csa": layer_of(spec, 4, True), "hca": layer_of(spec, 8, False)}[kind]
    attn = attention(spec, weights, layer)
    lens, chunks, max_len = [5, 2, 7], 4, 40
    x = torch.randn(3, max(lens) + 3 * chunks, spec.hidden_size, generator=torch.Generator().manual_seed(0))

    cache = attn.new_cache(3, max_len, "cpu", torch.float32)
    got = [[] for _ in lens]
    for r, n in enumerate(lens):  # ragged prefill: one sequence at a time into its rows (views)
        got[r].append(attn.forward(x[r:r + 1, :n], view(cache, slice(r, r + 1)), step([0], n))[0])
    start = torch.tensor(lens)
    for c in range(chunks):
        idx = start[:, None] + torch.arange(3)
        out = attn.forward(x[torch.arange(3)[:, None], idx], cache, step(start, 3))
        for r in range(3):
            got[r].append(out[r])
        start += 3

    for r, n in enumerate(lens):
        alone = attn.new_cache(1, max_len, "cpu", torch.float32)
        single = torch.cat([attn.forward(x[r:r + 1, t:t + 1], alone, step([t], 1))[0] for t in range(n + 3 * chunks)])
        assert (torch.cat(got[r]) - single).abs().max().item() <= 1e-5, f"row {r}: outputs differ"
        for name, tensor in alone.items():
            assert (cache[name][r] - tensor[0]).abs().max().item() <= 1e-5, f"row {r}: cache {name!r} differs"


def manual_entry(attn, prefix, x_row, w, ratio, overlap, dim):
    """Compressed entry `w` of one sequence, straight from the formula (independent of the cache)."""
    p = attn.w
    kv = x_row @ p[prefix + "kv_proj.weight"].T
    gate = x_row @ p[prefix + "gate_proj.weight"].T + p[prefix + "position_bias"].repeat(len(x_row) // ratio + 1, 1)[:len(x_row)]
    cur = slice(w * ratio, (w + 1) * ratio)
    if overlap:
        prev = slice((w - 1) * ratio, w * ratio)
        k, g = kv[cur, dim:], gate[cur, dim:]
        if w > 0:
            k, g = torch.cat([kv[prev, :dim], k]), torch.cat([gate[prev, :dim], g])
    else:
        k, g = kv[cur], gate[cur]
    pooled = (k * g.softmax(dim=0)).sum(0)
    pooled = pooled * torch.rsqrt(pooled.pow(2).mean() + attn.s.norm_eps) * p[prefix + "kv_norm.weight"]
    # rotate pairs (2i, 2i+1) of the trailing rope dims by angle (w * ratio) * inv_freq, as complex numbers
    inv_freq, factor = rope_inv_freq(attn.s.compress_rope)
    rd = 2 * len(inv_freq)
    z = torch.view_as_complex(pooled[-rd:].reshape(-1, 2).contiguous())
    z = z * torch.polar(torch.full_like(inv_freq, factor), (w * ratio) * inv_freq)
    return torch.cat([pooled[:-rd], torch.view_as_real(z).flatten()])


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compression_boundaries_ragged(tiny, kind):
    """A sequence's entry w appears exactly when its own length reaches (w+1)*ratio, and equals the
    softmax-gated pooling of its window(s), normed and rotated at position w*ratio."""
    spec, weights = tiny
    layer = layer_of(spec, 4, True) if kind == "csa" else layer_of(spec, 8, False)
    attn = attention(spec, weights, layer)
    s = attn.s
    r, lens = s.compress_ratio, [3, 4, 11, 16, 17]
    x = torch.randn(len(lens), 20, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    cache = attn.new_cache(len(lens), 32, "cpu", torch.float32)
    for b, n in enumerate(lens):
        attn.forward(x[b:b + 1, :n], view(cache, slice(b, b + 1)), step([0], n))
    names = [("comp_kv", "compressor.", s.compress_overlap, s.head_dim)]
    if s.indexer is not None:
        names.append(("index_keys", "indexer.", True, s.indexer.head_dim))
    for b, n in enumerate(lens):
        for key, prefix, overlap, dim in names:
            entries = cache[key][b]
            emitted = entries.abs().sum(-1) > 0
            assert emitted.tolist() == [w < n // r for w in range(entries.shape[0])], f"{key} row {b} (len {n})"
            for w in range(n // r):
                want = manual_entry(attn, prefix, x[b, :n], w, r, overlap, dim)
                assert torch.allclose(entries[w], want, atol=1e-5), f"{key} row {b} entry {w}"


def test_indexer_limits_the_compressed_entries_seen(tiny):
    """With top-k = 4 and 7 ready CSA entries, the last query sees 4 of them, not all 7."""
    spec, weights = tiny
    attn = attention(spec, weights, layer_of(spec, 4, True))
    x = torch.randn(1, 29, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    cache = attn.new_cache(1, 32, "cpu", torch.float32)
    attn.forward(x, cache, step([0], 29))
    ready = torch.arange(cache["index_keys"].shape[1])[None, None] < torch.tensor([[29 // 4]])[..., None]
    chosen = attn.select(x[:, -1:], torch.randn(1, 1, spec.layers[1].attention.q_lora_rank), cache["index_keys"],
                         ready, step([28], 1))
    assert int(ready.sum()) == 7 and int(chosen.sum()) == attn.s.indexer.topk == 4
    assert not (chosen & ~ready).any()


def test_rope_inverse_and_pairs():
    from sdk.spec import RopeSpec
    rope = Rope(RopeSpec(dim=8, theta=10000.0, interleaved=True))
    x = torch.randn(2, 3, 16)
    cos, sin = rope.cos_sin(torch.arange(3)[None].expand(2, 3), torch.float32)
    y = Rope.apply(x, cos, sin)
    assert torch.equal(y[..., :8], x[..., :8]) and not torch.allclose(y[..., 8:], x[..., 8:])
    assert torch.allclose(Rope.apply(y, cos, -sin), x, atol=1e-6)
    # position 1, first pair: rotation by 1 radian (inv_freq[0] = 1)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    assert torch.allclose(y[0, 1, 8:10], torch.stack([x[0, 1, 8] * c - x[0, 1, 9] * s, x[0, 1, 9] * c + x[0, 1, 8] * s]))


# ---------------------------------------------------------------------------------------- mHC
def test_sinkhorn_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    comb = torch.softmax(torch.randn(500, 4, 4, generator=g), dim=-1) + 1e-6
    out = sinkhorn(comb, 20, 1e-6)
    assert (out.sum(-2) - 1).abs().max() < 1e-5          # columns: normalised last
    assert (out.sum(-1) - 1).abs().max() < 1e-3          # rows: converged after 20 iterations
    few = sinkhorn(comb, 2, 1e-6)
    assert (few.sum(-1) - 1).abs().max() > 10 * (out.sum(-1) - 1).abs().max()
    assert (out > 0).all()


def mhc_setup(head="weighted", n=3, d=8, seed=0):
    from sdk.spec import ModelSpec
    spec = ModelSpec(name="t", arch="t", hidden_size=d, vocab_size=4, layers=(), norm_eps=1e-6,
                     residual=ResidualSpec(kind="mhc", hc_mult=n, sinkhorn_iters=20, eps=1e-6, head=head))
    g = torch.Generator().manual_seed(seed)
    w = {"layers.0.hc_attn.fn": 0.3 * torch.randn((2 + n) * n, n * d, generator=g),
         "layers.0.hc_attn.base": torch.randn((2 + n) * n, generator=g),
         "layers.0.hc_attn.scale": 1 + 0.3 * torch.randn(3, generator=g),
         "hc_head.fn": 0.3 * torch.randn(n, n * d, generator=g), "hc_head.base": torch.randn(n, generator=g),
         "hc_head.scale": torch.ones(1)}
    return spec, w


def test_mhc_around_uses_comb_transposed():
    spec, w = mhc_setup()
    res = MHCResidual(spec, w)
    streams = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(1))
    pre, post, comb = res.coefficients("layers.0.hc_attn.", streams)
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=1e-3)  # the direction matters
    seen = {}

    def sublayer(y):
        seen["in"] = y
        return torch.tanh(y)
    out = res.around(0, "attn", streams, sublayer)
    assert torch.allclose(seen["in"], torch.einsum("btn,btnd->btd", pre, streams), atol=1e-6)
    want = post[..., None] * torch.tanh(seen["in"])[..., None, :] + torch.einsum("btjk,btjd->btkd", comb, streams)
    assert torch.allclose(out, want, atol=1e-6)
    # the coefficients follow their formulas: pre in (eps, 1 + eps), post in (0, 2)
    assert (pre > 0).all() and (pre < 1 + 1e-5).all() and (post > 0).all() and (post < 2).all()


def test_mhc_heads_and_embed():
    spec, w = mhc_setup("weighted")
    streams = torch.randn(2, 5, 3, 8)
    res = MHCResidual(spec, w)
    assert torch.equal(res.embed(streams[:, :, 0]), streams[:, :, :1].expand(-1, -1, 3, -1))
    x = streams.flatten(2)
    pre = torch.sigmoid(F.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), w["hc_head.fn"])
                        + w["hc_head.base"]) + 1e-6
    assert torch.allclose(res.head(streams), (pre[..., None] * streams).sum(2), atol=1e-6)
    assert "hc_head.fn" in MHCResidual.expected_weights(spec)

    spec_mean, _ = mhc_setup("mean")
    assert torch.allclose(MHCResidual(spec_mean, w).head(streams), streams.mean(2))
    assert not any(k.startswith("hc_head") for k in MHCResidual.expected_weights(spec_mean))
    with pytest.raises(UnsupportedConfigError, match="max"):
        MHCResidual(mhc_setup("max")[0], w)


# ------------------------------------------------------------------------------ config / spec
def test_tiny_covers_every_layer_kind(entry):
    spec = entry.spec("tiny")
    kinds = {(l.attention.compress_ratio, l.attention.indexer is not None) for l in spec.layers}
    assert kinds == {(0, False), (4, True), (8, False)}
    assert [l.mlp.hash_routed for l in spec.layers] == [True, True, False, False]
    assert spec.residual.kind == "mhc" and spec.residual.hc_mult == 4


def test_full_spec_numbers(entry):
    spec = entry.spec("full")
    a, m = spec.layers[5].attention, spec.layers[5].mlp   # V4's default pattern: layer 5 is CSA
    assert (spec.hidden_size, spec.num_layers, a.num_heads, a.head_dim, a.rope_dim) == (5120, 43, 64, 512, 64)
    assert (a.sliding_window, a.compress_ratio, a.indexer.topk) == (128, 4, 512)
    assert {l.attention.compress_ratio for l in spec.layers} == {4, 128}
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.num_shared_experts) == (384, 6, 2304, 1)
    assert (m.scoring, m.routed_scaling_factor, m.swiglu_limit) == ("sqrtsoftplus", 1.5, 10.0)
    assert [l.mlp.hash_routed for l in spec.layers[:4]] == [True, True, True, False]
    assert (spec.residual.hc_mult, spec.residual.sinkhorn_iters) == (4, 20)
    shapes = expected_weights(spec)
    assert shapes["layers.5.attn.o_a_proj.weight"] == (8 * 1024, 64 * 512 // 8)
    assert shapes["layers.5.mlp.experts.gate_up_proj"] == (384, 2 * 2304, 5120)
    assert shapes["layers.0.hc_attn.fn"] == (24, 4 * 5120)


def test_dict_and_transformers_config_agree(entry):
    pytest.importorskip("transformers.models.deepseek_v4")
    for name in ("tiny", "full"):
        cfg = entry.config(name)
        assert entry.spec_from_config(cfg) == entry.spec_from_config(entry.hf_config(cfg)), name
    legacy = entry.config("tiny")  # legacy keys that DeepseekV4Config folds in
    del legacy["layer_types"], legacy["mlp_layer_types"], legacy["compress_rates"], legacy["partial_rotary_factor"]
    legacy.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=16, compress_rate_hca=16)
    assert entry.spec_from_config(legacy) == entry.spec_from_config(entry.hf_config(legacy))


@pytest.mark.parametrize("change, feature", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type"),
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]}, "layer_types"),
    ({"o_groups": 3}, "o_groups"),
])
def test_spec_rejects_unsupported_features_by_name(entry, change, feature):
    cfg = entry.config("tiny")
    cfg.update(change)
    with pytest.raises(UnsupportedConfigError, match=feature):
        entry.spec_from_config(cfg)


# -------------------------------------------------------------------------------- weight map
def test_weight_map_matches_transformers_and_reports_mismatches(entry):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers has no deepseek_v4")
    config = entry.hf_config(entry.config("tiny"))
    torch.manual_seed(0)
    sd = transformers.DeepseekV4ForCausalLM(config).state_dict()
    mk = build_megakernel(MODEL, config=config, backend="reference")
    mk.load_hf_state_dict(sd)  # every key used, none missing
    mk.load_hf_state_dict({**sd, "mtp.0.emb.weight": torch.zeros(1)})  # MTP keys are ignored

    bad = dict(sd)
    del bad["model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"]
    bad["model.layers.0.self_attn.surprise.weight"] = torch.zeros(1)
    bad["model.layers.2.self_attn.compressor.position_bias"] = torch.zeros(3, 3)
    with pytest.raises(WeightsMismatchError) as err:
        mk.load_hf_state_dict(bad)
    e = err.value
    assert e.missing == ["model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"]
    assert e.unexpected == ["model.layers.0.self_attn.surprise.weight"]
    assert [k for k, _, _ in e.misshaped] == ["model.layers.2.self_attn.compressor.position_bias"]


def test_generate_runs_from_random_weights_in_bf16(entry):
    spec = entry.spec("tiny")
    mk = build_megakernel(MODEL, config="tiny", backend="reference", dtype=torch.bfloat16, max_seq_len=64)
    mk.load_weights(random_weights(spec, seed=1, dtype=torch.bfloat16))
    out = mk.generate(torch.tensor([[1, 2, 3, 4, 5]]), 12)
    assert out.shape == (1, 17) and torch.isfinite(mk.last_logits.float()).all()
