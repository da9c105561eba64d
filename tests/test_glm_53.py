"""GLM-5.3 (glm5_next): the DSA k-pool indexer, shared-indexer layers, the spec and the weight map.

The whole model against transformers is in tests/test_reference_vs_hf.py (-k glm); here the DSA
attention layers alone are also checked against transformers' `Glm5NextTextAttention`."""
import math

import pytest
import torch

from sdk import SdkError, UnsupportedConfigError, WeightsMismatchError, build_megakernel, plugins
from sdk.reference.common import StepInfo
from sdk.reference.dsa import DSAMLAReference, selection_mask
from sdk.reference.mla import MLAReference
from sdk.reference.model import random_weights
from sdk.reference.weights import Prefixed, expected_weights
from conftest import transformers_or_skip

from models.glm_53 import config as glm_config
from models.glm_53.weights import to_hf


@pytest.fixture(scope="module")
def entry():
    return plugins.get_model("glm_53")


@pytest.fixture(scope="module")
def spec(entry):
    return entry.spec("tiny")


def step_for(start: torch.Tensor, t: int) -> StepInfo:
    return StepInfo(start=start.clone(), positions=start[:, None] + torch.arange(t),
                    input_ids=torch.zeros(start.shape[0], t, dtype=torch.long))


def perturbed_weights(spec, seed):
    """Random canonical weights with the pooling gate / position terms large enough to matter."""
    w = random_weights(spec, seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed + 100)
    for name in w:
        if "index_kpool" in name:
            w[name] = torch.randn(w[name].shape, generator=g)
    return w


# ------------------------------------------------------------------------------ the indexer
def brute_force(x_seq, q_resid_seq, w, s, p):
    """Pool scores and the tail for query position p of one sequence, straight from the formula
    (python loops over pools, tokens and heads). Returns ({pool: score}, tail tokens)."""
    d = s.head_dim
    keys = torch.nn.functional.layer_norm(x_seq @ w["wk.weight"].T, (d,), w["k_norm.weight"], w["k_norm.bias"], 1e-6)
    gates = x_seq @ w["index_kpool_compress_gate"].T
    q = (q_resid_seq[p] @ w["wq_b.weight"].T).view(s.num_heads, d)
    head_w = (x_seq[p] @ w["weights_proj.weight"].T) / math.sqrt(s.num_heads)
    scores = {}
    for m in range((p + 1) // s.kpool):
        toks = list(range(m * s.kpool, (m + 1) * s.kpool))
        logits = gates[toks] + w["index_kpool_compress_ape"]              # [kpool, d]
        pooled = (logits.softmax(dim=0) * keys[toks]).sum(dim=0)          # per-channel softmax over tokens
        scores[m] = sum(float(head_w[h]) * max(0.0, float(q[h] @ pooled) / math.sqrt(d))
                        for h in range(s.num_heads))
    tail = list(range((p + 1) // s.kpool * s.kpool, p + 1))
    return scores, tail


@pytest.mark.parametrize("chunks", [[1] * 40, [7] + [1] * 33, [13, 14, 13]])
def test_indexer_selection_matches_brute_force(spec, chunks):
    layer = spec.layers[1]
    s = layer.attention.indexer
    w = perturbed_weights(spec, seed=5)
    mla = DSAMLAReference(spec, layer, Prefixed(w, "layers.1.attn."))
    iw = Prefixed(w, "layers.1.attn.indexer.")
    g = torch.Generator().manual_seed(7)
    b, n = 2, sum(chunks)
    x = torch.randn(b, n, spec.hidden_size, generator=g)
    cache = mla.new_cache(b, 64, "cpu", torch.float32)
    start, pos = torch.zeros(b, dtype=torch.long), 0
    q_resid_all = mla.project_q(x, step_for(start, n))[2]
    dropped = 0
    for t in chunks:
        step = step_for(start, t)
        xs = x[:, pos:pos + t]
        mla.indexer.update_cache(xs, cache, step)
        sel = mla.indexer.select(xs, q_resid_all[:, pos:pos + t], cache, step)
        assert sel.shape == (b, t, s.topk + s.kpool - 1)
        for r in range(b):
            for j in range(t):
                p = pos + j
                scores, tail = brute_force(x[r, :p + 1], q_resid_all[r], iw, s, p)
                got = [v for v in sel[r, j].tolist() if v >= 0]
                assert len(got) == len(set(got)) and all(v <= p for v in got)
                assert sorted(v for v in got if v >= len(scores) * s.kpool) == tail
                pools = sorted({v // s.kpool for v in got if v < len(scores) * s.kpool})
                for m in pools:  # whole pools only
                    assert all(m * s.kpool + i in got for i in range(s.kpool))
                # the chosen pools carry the k best scores (compared as scores: robust to ties)
                want = sorted(scores.values(), reverse=True)[:s.topk // s.kpool]
                assert sorted((scores[m] for m in pools), reverse=True) == pytest.approx(want, abs=1e-5)
                dropped += (p + 1) - len(got)
        start += t
        pos += t
    assert dropped > 0, "the tiny config must drop tokens within 40 tokens"


def test_selection_mask_ignores_unused_entries():
    idx = torch.tensor([[[0, -1, 3, -1], [-1, -1, -1, 2]]])
    mask = selection_mask(idx, 5)
    assert mask.tolist() == [[[True, False, False, True, False], [False, False, True, False, False]]]


def test_multi_token_indexer_cache_equals_single_steps(spec):
    layer = spec.layers[4]
    w = perturbed_weights(spec, seed=2)
    mla = DSAMLAReference(spec, layer, Prefixed(w, "layers.4.attn."))
    x = torch.randn(2, 19, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    a, b = mla.new_cache(2, 32, "cpu", torch.float32), mla.new_cache(2, 32, "cpu", torch.float32)
    start = torch.tensor([0, 0])
    out_a = mla.forward(x, a, step_for(start, 19))
    out_b = torch.cat([mla.forward(x[:, t:t + 1], b, step_for(start + t, 1)) for t in range(19)], dim=1)
    assert (out_a - out_b).abs().max() <= 1e-5
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    assert a["index_pool_k"][:, :4].abs().sum() > 0 and a["index_pool_k"][:, 4:].abs().sum() == 0


# --------------------------------------------------------------------------- shared layers
def test_shared_layer_reuses_previous_selection(spec):
    full, shared = spec.layers[1], spec.layers[2]
    assert not full.attention.indexer.shared and shared.attention.indexer.shared
    w = perturbed_weights(spec, seed=3)
    assert not any(k.startswith("layers.2.attn.indexer.") for k in w), "a shared layer has no indexer weights"
    m1 = DSAMLAReference(spec, full, Prefixed(w, "layers.1.attn."))
    m2 = DSAMLAReference(spec, shared, Prefixed(w, "layers.2.attn."))
    c1, c2 = m1.new_cache(1, 48, "cpu", torch.float32), m2.new_cache(1, 48, "cpu", torch.float32)
    assert set(c2) == {"latent"}
    x = torch.randn(1, 30, spec.hidden_size, generator=torch.Generator().manual_seed(4))
    step = step_for(torch.tensor([0]), 30)
    m1.forward(x, c1, step)
    out = m2.forward(x, c2, step)
    assert torch.equal(step.dsa_topk[2], step.dsa_topk[1])
    # the same attention computed by hand: plain MLA with the previous layer's selection
    plain = MLAReference(spec, shared, Prefixed(w, "layers.2.attn."))
    ref = plain.forward(x, plain.new_cache(1, 48, "cpu", torch.float32), step_for(torch.tensor([0]), 30),
                        index_mask=selection_mask(step.dsa_topk[1], 30))
    assert (out - ref).abs().max() <= 1e-6
    # and it differs from dense attention: the selection really drops tokens
    dense = plain.forward(x, plain.new_cache(1, 48, "cpu", torch.float32), step_for(torch.tensor([0]), 30))
    assert (out - dense).abs().max() > 1e-4


def test_shared_layer_without_a_previous_selection_is_an_error(spec):
    w = perturbed_weights(spec, seed=3)
    m2 = DSAMLAReference(spec, spec.layers[2], Prefixed(w, "layers.2.attn."))
    with pytest.raises(SdkError, match="shares the DSA top-k of layer 1"):
        m2.forward(torch.randn(1, 2, spec.hidden_size), m2.new_cache(1, 8, "cpu", torch.float32),
                   step_for(torch.tensor([0]), 2))


# ------------------------------------------------------------------------------------ spec
def test_tiny_covers_every_feature(spec):
    kinds = spec.layer_kinds()
    assert kinds == ["kda+dense", "dsa_mla+dense", "dsa_mla+moe", "kda+moe", "dsa_mla+moe"]
    assert [l.attention.indexer.shared for l in spec.layers if l.attention.kind == "dsa_mla"] == [False, True, False]
    assert spec.residual.kind == "mhc" and spec.residual.head == "mean" and spec.residual.hc_mult == 4
    assert spec.layers[0].attention.gate_kind == "sigmoid" and spec.layers[0].attention.gate_lower_bound == -5.0


def test_full_config_is_glm53_flash(entry):
    s = entry.spec("full")
    attn = [l.attention for l in s.layers]
    assert (s.hidden_size, s.num_layers, s.vocab_size) == (4096, 45, 154880)
    assert sum(a.kind == "kda" for a in attn) == 34 and sum(a.kind == "dsa_mla" for a in attn) == 11
    assert all((a.kind == "dsa_mla") == (i % 4 == 3) for i, a in enumerate(attn))
    assert [l.mlp.kind for l in s.layers[:4]] == ["dense", "dense", "dense", "moe"]
    mla, kda, moe = attn[3], attn[0], s.layers[3].mlp
    assert (mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim) == (64, 1536, 512, 256, 256)
    assert mla.softmax_scale == 256 ** -0.5
    assert (mla.indexer.num_heads, mla.indexer.head_dim, mla.indexer.topk, mla.indexer.kpool) == (32, 128, 2048, 16)
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel, kda.gate_kind) == (64, 128, 4, "sigmoid")
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.routed_scaling_factor) == (288, 8, 2048, 2.5)
    assert s.layers[0].mlp.intermediate_size == 12288 and moe.swiglu_limit == 10.0
    nonflash = entry.spec("full-nonflash")
    assert (nonflash.hidden_size, nonflash.layers[3].mlp.num_experts, nonflash.layers[3].mlp.top_k) == (6144, 256, 8)


def test_dict_and_transformers_configs_give_one_spec(entry):
    transformers_or_skip()
    for name in ("tiny", "full", "full-nonflash"):
        cfg = entry.config(name)
        assert entry.spec(entry.hf_config(cfg)) == entry.spec(cfg), name
    from transformers import Glm5NextConfig, Glm5NextTextConfig
    assert entry.spec(Glm5NextConfig()) == entry.spec("full")
    assert entry.spec(Glm5NextTextConfig()) == entry.spec("full")
    flat = dict(glm_config.TINY_TEXT)  # a flat (text-only) checkpoint config
    assert entry.spec(Glm5NextConfig(**flat)) == entry.spec(flat) == entry.spec("tiny")
    pattern = dict(glm_config.TINY_TEXT, indexer_types=None, index_topk_pattern="FFSFF")
    assert entry.spec(pattern) == entry.spec("tiny") == entry.spec(Glm5NextConfig(**pattern))


@pytest.mark.parametrize("change, named", [
    ({"qk_rope_head_dim": 64}, "qk_rope_head_dim=64"),
    ({"q_lora_rank": None}, "q_lora_rank=None"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail=False"),
    ({"index_topk": 6}, "index_topk=6"),
    ({"indexer_types": ["full", "shared", "full", "full", "full"]}, "indexer_types[1]='shared'"),
    ({"layer_types": ["linear_attention", "sliding_attention", "indexed_attention", "linear_attention",
                      "indexed_attention"]}, "layer_types[1]='sliding_attention'"),
    ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse", "latent"]}, "mlp_layer_types[4]='latent'"),
])
def test_spec_rejects_unsupported_features_by_name(entry, change, named):
    cfg = entry.config("tiny")
    cfg["text_config"].update(change)
    with pytest.raises(UnsupportedConfigError) as exc:
        entry.spec(cfg)
    assert named in str(exc.value)


def test_softplus_gate_when_no_lower_bound(entry):
    cfg = entry.config("tiny")
    cfg["text_config"]["linear_lower_bound"] = None
    assert entry.spec(cfg).layers[0].attention.gate_kind == "softplus"


# ------------------------------------------------------------------------------ weight map
def hf_state_dict(spec, seed=0):
    return {to_hf(k): v for k, v in random_weights(spec, seed=seed).items()}


def test_visual_and_mtp_weights_are_ignored(spec):
    mk = build_megakernel("glm_53", config="tiny")
    sd = hf_state_dict(spec)
    sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(48, 16)
    sd["model.visual.merger.proj.weight"] = torch.zeros(64, 16)
    sd[f"model.language_model.layers.{spec.num_layers}.self_attn.q_a_proj.weight"] = torch.zeros(3)  # MTP layer
    sd["model.language_model.layers.2.shared_head.head.weight"] = torch.zeros(3)
    mk.load_hf_state_dict(sd)
    assert mk.weights.keys() == expected_weights(spec).keys()


def test_tied_embeddings_ignore_the_lm_head_key(entry):
    cfg = entry.config("tiny")
    cfg["tie_word_embeddings"] = True
    mk = build_megakernel("glm_53", config=cfg)
    assert mk.spec.tie_word_embeddings
    sd = hf_state_dict(mk.spec)
    sd["lm_head.weight"] = sd["model.language_model.embed_tokens.weight"]
    mk.load_hf_state_dict(sd)


def test_weight_map_errors(spec):
    mk = build_megakernel("glm_53", config="tiny")
    sd = hf_state_dict(spec)
    idx = "model.language_model.layers.1.self_attn.indexer.index_kpool_compress_ape"
    kda = "model.language_model.layers.0.self_attn.conv1d.weight"
    bad = dict(sd)
    del bad[idx]
    bad[kda] = torch.zeros(3, 1, 4)
    bad["model.language_model.layers.2.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)  # shared: none
    with pytest.raises(WeightsMismatchError) as exc:
        mk.load_hf_state_dict(bad)
    assert exc.value.missing == [idx]
    assert exc.value.unexpected == ["model.language_model.layers.2.self_attn.indexer.wk.weight"]
    assert [k for k, _, _ in exc.value.misshaped] == [kda]
    with pytest.raises(KeyError, match="no transformers key"):
        to_hf("layers.0.nonsense.weight")


# ------------------------------------------------------------------- against transformers
def test_dsa_layers_match_transformers_attention(entry, spec):
    """The full and the shared DSA layer against Glm5NextTextAttention: 7-token prefill, then 33
    single steps (so sparse selection drops tokens), ragged-free batch of 2, per-step outputs and
    the selected token sets."""
    transformers_or_skip()
    from transformers import DynamicCache
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention
    text = entry.hf_config(entry.config("tiny")).text_config
    text._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = {i: Glm5NextTextAttention(text, i).eval() for i in (1, 2)}
    w = {}
    for i, m in hf.items():
        for n, p in m.named_parameters():
            torch.nn.init.normal_(p, std=0.3 if ("norm" in n or "kpool" in n) else 0.1)
            if n.endswith("norm.weight"):
                p.data += 1
            w[f"layers.{i}.attn.{n}"] = p.detach()
    ref = {i: DSAMLAReference(spec, spec.layers[i], Prefixed(w, f"layers.{i}.attn.")) for i in (1, 2)}
    b, prompt, new = 2, 7, 33
    x = torch.randn(b, prompt + new, spec.hidden_size)
    hf_cache = DynamicCache(config=text)
    caches = {i: ref[i].new_cache(b, 64, "cpu", torch.float32) for i in (1, 2)}
    start, pos, dropped = torch.zeros(b, dtype=torch.long), 0, 0
    with torch.no_grad():
        for t in [prompt] + [1] * new:
            xs, mask = x[:, pos:pos + t], torch.ones(b, t, dtype=torch.bool)
            o1, _, topk = hf[1](xs, mask, cache=hf_cache)
            o2, _, _ = hf[2](xs, mask, cache=hf_cache, prev_topk_indices=topk)
            step = step_for(start, t)
            r1, r2 = ref[1].forward(xs, caches[1], step), ref[2].forward(xs, caches[2], step)
            ours = step.dsa_topk[1]
            as_sets = lambda idx: [sorted(v for v in row if v >= 0) for row in idx.reshape(-1, idx.shape[-1]).tolist()]
            assert as_sets(ours) == as_sets(topk), f"selection differs at position {pos}"
            assert (o1 - r1).abs().max() <= 1e-5 and (o2 - r2).abs().max() <= 1e-5, f"position {pos}"
            dropped += int(((start + t)[:, None] - (ours[:, -1] >= 0).sum(-1, keepdim=True)).sum())
            start, pos = start + t, pos + t
    assert dropped > 0
