"""Unit tests of the Kimi K3 package and its attention references (sdk/reference/kda.py, mla.py).

Each module is checked against an independent computation written here (explicit per-token,
per-head loops; the absorbed form of MLA; complex-number RoPE), against the transformers module
it follows where one exists (glm5_next's KDA for the sigmoid gate), and the whole model against
transformers' KimiLinearForCausalLM with unit-scale weights (the generic test in
test_reference_vs_hf.py uses the small init of transformers)."""
import math

import pytest
import torch
import torch.nn.functional as F

from sdk import UnsupportedConfigError, WeightsMismatchError, build_megakernel, plugins
from sdk.reference.common import StepInfo
from sdk.reference.kda import KDAReference
from sdk.reference.mla import MLAReference
from sdk.reference.model import random_weights
from sdk.reference.weights import Prefixed
from sdk.spec import DenseMlpSpec, KDASpec, LayerSpec, MLASpec, ModelSpec, RopeSpec

from conftest import transformers_or_skip

D = 32


def one_layer(attn, d=D, eps=1e-5) -> ModelSpec:
    return ModelSpec(name="t", arch="t", hidden_size=d, vocab_size=8, norm_eps=eps,
                     layers=(LayerSpec(0, attn, DenseMlpSpec(intermediate_size=8)),))


def module_weights(cls, model, seed, std=None):
    """Random local weights at unit scale (std 1/sqrt(fan_in)), norms near 1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cls.expected_weights(model, model.layers[0]).items():
        if "norm" in name:
            out[name] = 1 + 0.3 * torch.randn(shape, generator=g)
        elif len(shape) >= 2:
            out[name] = torch.randn(shape, generator=g) * (std or shape[-1] ** -0.5)
        else:
            out[name] = 0.5 * torch.randn(shape, generator=g)
    return out


def build(cls, attn, seed=0):
    model = one_layer(attn)
    w = module_weights(cls, model, seed)
    return cls(model, model.layers[0], Prefixed({f"a.{k}": v for k, v in w.items()}, "a.")), w


def step_info(start, t):
    start = torch.as_tensor(start, dtype=torch.long)
    return StepInfo(start=start, positions=start[:, None] + torch.arange(t),
                    input_ids=torch.zeros(len(start), t, dtype=torch.long))


# ------------------------------------------------------------------------------------ KDA
KDA_VARIANTS = {
    "kimi_linear": KDASpec(num_heads=2, head_dim=8, conv_kernel=4),
    "k3": KDASpec(num_heads=2, head_dim=8, conv_kernel=4, gate_kind="sigmoid", output_gate_full_rank=True),
    "glm5_next": KDASpec(num_heads=2, head_dim=8, conv_kernel=3, gate_kind="sigmoid", gate_lower_bound=-3.0,
                         a_log_flat=True, gate_rank=4),
}


def kda_direct(s: KDASpec, w, x, eps):
    """KDA over a whole sequence x [T, D], written from the formulas: explicit conv window sums,
    per-head matrices, per-token loop."""
    h, k = s.num_heads, s.head_dim
    c = h * k
    t_len = x.shape[0]
    pre = torch.cat([x @ w["q_proj.weight"].T, x @ w["k_proj.weight"].T, x @ w["v_proj.weight"].T], dim=-1)
    conv_w = w["conv1d.weight"][:, 0]                       # [3C, K]
    kk = s.conv_kernel
    post = torch.zeros_like(pre)
    for t in range(t_len):
        for j in range(kk):                                 # tap j sees token t - (K-1) + j
            src = t - (kk - 1) + j
            if src >= 0:
                post[t] += conv_w[:, j] * pre[src]
    post = F.silu(post)
    a_log = w["forget_gate.A_log"].reshape(h)
    states = [torch.zeros(k, k) for _ in range(h)]
    outs = torch.zeros(t_len, c)
    for t in range(t_len):
        g = (x[t] @ w["forget_gate.f_a_proj.weight"].T) @ w["forget_gate.f_b_proj.weight"].T + w["forget_gate.dt_bias"]
        beta = torch.sigmoid(x[t] @ w["b_proj.weight"].T)
        if s.output_gate_full_rank:
            gate = x[t] @ w["g_proj.weight"].T
        else:
            gate = (x[t] @ w["g_a_proj.weight"].T) @ w["g_b_proj.weight"].T
        for i in range(h):
            sl = slice(i * k, (i + 1) * k)
            q, key, v = post[t, sl], post[t, c + i * k:c + (i + 1) * k], post[t, 2 * c + i * k:2 * c + (i + 1) * k]
            q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(k)
            key = key / torch.sqrt((key * key).sum() + 1e-6)
            if s.gate_kind == "softplus":
                a = -torch.exp(a_log[i]) * F.softplus(g[sl])
            else:
                a = s.gate_lower_bound * torch.sigmoid(torch.exp(a_log[i]) * g[sl])
            S = torch.diag(torch.exp(a)) @ states[i]
            S = S + beta[i] * torch.outer(key, v - S.T @ key)
            states[i] = S
            o = S.T @ q
            o = o / torch.sqrt((o * o).mean() + eps) * w["o_norm.weight"]
            outs[t, sl] = o * torch.sigmoid(gate[sl])
    return outs @ w["o_proj.weight"].T, torch.stack(states)


@pytest.mark.parametrize("variant", sorted(KDA_VARIANTS))
def test_kda_in_chunks_equals_direct_formula(variant):
    s = KDA_VARIANTS[variant]
    mod, w = build(KDAReference, s, seed=1)
    torch.manual_seed(2)
    x = torch.randn(1, 9, D)
    cache = mod.new_cache(1, 16, "cpu", torch.float32)
    out, start = [], 0
    for n in (4, 1, 3, 1):                                  # prefill, single steps, a verify-sized chunk
        out.append(mod.forward(x[:, start:start + n], cache, step_info([start], n)))
        start += n
    want, state = kda_direct(s, w, x[0], eps=1e-5)
    assert (torch.cat(out, dim=1)[0] - want).abs().max() <= 1e-5
    assert (cache["state"][0] - state).abs().max() <= 1e-5
    assert want.abs().max() > 0.1                           # the comparison is not of near-zero values


@pytest.mark.parametrize("variant", sorted(KDA_VARIANTS))
def test_kda_t_tokens_equal_t_single_steps(variant):
    mod, _ = build(KDAReference, KDA_VARIANTS[variant], seed=3)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(4))
    ca, cb = (mod.new_cache(2, 16, "cpu", torch.float32) for _ in range(2))
    mod.forward(x[:, :2], ca, step_info([0, 0], 2))
    mod.forward(x[:, :2], cb, step_info([0, 0], 2))
    together = mod.forward(x[:, 2:], ca, step_info([2, 2], 5))
    single = torch.cat([mod.forward(x[:, t:t + 1], cb, step_info([t, t], 1)) for t in range(2, 7)], dim=1)
    # fp32 GEMMs over 5 rows and over 1 row round differently: agreement to ~1e-6 of O(1) values
    assert (together - single).abs().max() <= 1e-5
    for name in ca:
        assert (ca[name] - cb[name]).abs().max() <= 1e-5


def test_kda_sigmoid_gate_matches_glm5_next():
    """The sigmoid gate kind, flat A_log and gate lower bound against transformers' glm5_next KDA."""
    transformers_or_skip()
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention
    config = Glm5NextTextConfig(hidden_size=D, linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4,
                                linear_lower_bound=-3.0, num_hidden_layers=4, index_topk=16, index_kpool=4,
                                rms_norm_eps=1e-5)
    hf = Glm5NextTextLinearAttention(config, layer_idx=0).float()
    s = KDASpec(num_heads=2, head_dim=8, conv_kernel=4, gate_kind="sigmoid", gate_lower_bound=-3.0, a_log_flat=True)
    model = one_layer(s)
    w = module_weights(KDAReference, model, seed=5)
    hf.load_state_dict(w)                                   # the local names are the HF names
    mod = KDAReference(model, model.layers[0], w)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(x)
    got = mod.forward(x, mod.new_cache(2, 8, "cpu", torch.float32), step_info([0, 0], 6))
    assert want.abs().max() > 0.1
    assert (got - want).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------ MLA
MLA_VARIANTS = {
    "kimi_linear": MLASpec(num_heads=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=6),
    "no_q_lora_bias": MLASpec(num_heads=3, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=6, attention_bias=True),
    "glm5_next": MLASpec(num_heads=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=10, qk_rope_head_dim=0,
                         v_head_dim=10, latent_norm_eps=1e-5),
    "rope_halves": MLASpec(num_heads=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=6, rope=RopeSpec(dim=4, theta=100.0)),
    "k3_output_gate": MLASpec(num_heads=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=6, output_gate=True),
    "rope_interleaved": MLASpec(num_heads=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=6, rope=RopeSpec(dim=4, theta=100.0, interleaved=True)),
}


def rope_complex(x, pos, rope: RopeSpec):
    """RoPE as a complex rotation: pairs (2i, 2i+1) if interleaved, else (i, i + d/2)."""
    d = x.shape[-1]
    if rope.interleaved:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
    else:
        z = torch.complex(x[..., :d // 2], x[..., d // 2:])
    angle = pos * rope.theta ** (-torch.arange(0, d, 2).float() / d)
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)             # any fixed order: only dot products are compared


def mla_direct(s: MLASpec, w, x, allowed=None):
    """Causal MLA over a whole sequence x [T, D] in the absorbed form a decode kernel uses: queries
    projected into the latent space, scores and values taken directly over the cached latent."""
    rms = lambda v, wt, eps: v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * wt
    bias = (lambda n: w[n]) if s.attention_bias else (lambda n: 0)
    h, nope, rope, vd, r = s.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim, s.kv_lora_rank
    t_len = x.shape[0]
    if s.q_lora_rank:
        q = rms(x @ w["q_a_proj.weight"].T + bias("q_a_proj.bias"), w["q_a_layernorm.weight"], s.latent_norm_eps)
        q = q @ w["q_b_proj.weight"].T
    else:
        q = x @ w["q_proj.weight"].T
    q = q.view(t_len, h, nope + rope)
    ckv = x @ w["kv_a_proj_with_mqa.weight"].T + bias("kv_a_proj_with_mqa.bias")
    c = rms(ckv[:, :r], w["kv_a_layernorm.weight"], s.latent_norm_eps)
    q_pe, k_pe = q[..., nope:], ckv[:, r:]
    if s.rope is not None:
        pos = torch.arange(t_len).float()
        q_pe = rope_complex(q_pe, pos[:, None, None], s.rope)
        k_pe = rope_complex(k_pe, pos[:, None], s.rope)
    wkv = w["kv_b_proj.weight"].view(h, nope + vd, r)
    w_uk, w_uv = wkv[:, :nope], wkv[:, nope:]
    out = torch.zeros(t_len, h, vd)
    scale = (nope + rope) ** -0.5
    for t in range(t_len):
        for i in range(h):
            q_lat = w_uk[i].T @ q[t, i, :nope]                                  # [r]
            score = (c[:t + 1] @ q_lat + k_pe[:t + 1] @ q_pe[t, i]) * scale
            if allowed is not None:
                score = score.masked_fill(~allowed[t, :t + 1], float("-inf"))
            out[t, i] = w_uv[i] @ (score.softmax(-1) @ c[:t + 1])
    if s.output_gate:
        out = out * torch.sigmoid(x @ w["g_proj.weight"].T).view(t_len, h, vd)
    return out.reshape(t_len, h * vd) @ w["o_proj.weight"].T + bias("o_proj.bias")


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_ragged_cache_equals_direct_attention(variant):
    """Three sequences of different lengths, prefilled one at a time into the batch's cache views,
    then decoded together (a 2-token step, then a 1-token step)."""
    s = MLA_VARIANTS[variant]
    mod, w = build(MLAReference, s, seed=7)
    lens = [5, 2, 8]
    x = torch.randn(3, 11, D, generator=torch.Generator().manual_seed(8))
    cache = mod.new_cache(3, 16, "cpu", torch.float32)
    outs = [[] for _ in lens]
    for b, n in enumerate(lens):
        view = {k: v[b:b + 1] for k, v in cache.items()}
        outs[b].append(mod.forward(x[b:b + 1, :n], view, step_info([0], n))[0])
    start = torch.tensor(lens)
    for t in (2, 1):
        xb = torch.stack([x[b, start[b]:start[b] + t] for b in range(3)])
        y = mod.forward(xb, cache, step_info(start, t))
        for b in range(3):
            outs[b].append(y[b])
        start = start + t
    for b, n in enumerate(lens):
        want = mla_direct(s, w, x[b, :n + 3])
        got = torch.cat(outs[b])
        assert want.abs().max() > 0.1
        assert (got - want).abs().max() <= 1e-5, f"sequence {b}"


def test_mla_index_mask_attends_only_selected_tokens():
    s = MLA_VARIANTS["glm5_next"]
    mod, w = build(MLAReference, s, seed=9)
    x = torch.randn(1, 10, D, generator=torch.Generator().manual_seed(10))
    g = torch.Generator().manual_seed(11)
    allowed = torch.rand(10, 10, generator=g) < 0.5
    allowed |= torch.eye(10, dtype=torch.bool)             # every query keeps at least itself
    cache = mod.new_cache(1, 16, "cpu", torch.float32)
    got = torch.cat([mod.forward(x[:, :6], cache, step_info([0], 6), index_mask=allowed[None, :6, :6]),
                     mod.forward(x[:, 6:], cache, step_info([6], 4), index_mask=allowed[None, 6:])], dim=1)
    want = mla_direct(s, w, x[0], allowed=allowed)
    assert (got[0] - want).abs().max() <= 1e-5
    full = mla_direct(s, w, x[0])
    assert (want - full).abs().max() > 1e-3                  # the mask did change the result


def test_mla_rejects_unsupported_rope_scaling():
    """YaRN is supported (tests/test_mla_yarn.py); other rope types are refused by name."""
    s = MLASpec(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                rope=RopeSpec(dim=4, theta=1e4, scaling=(("factor", 8.0), ("rope_type", "llama3"))))
    with pytest.raises(UnsupportedConfigError, match="llama3"):
        build(MLAReference, s)


# ------------------------------------------------------------------------------ the model
def test_spec_rejects_unsupported_features_by_name():
    entry = plugins.get_model("kimi_k3")
    for key, value in [("hidden_act", "gelu"), ("routed_expert_hidden_size", -1), ("attn_res_block_size", 6),
                       ("mla_use_nope", False), ("moe_router_activation_func", "softmax"),
                       ("num_key_value_heads", 2)]:
        cfg = dict(entry.config("tiny"), **{key: value})
        with pytest.raises(UnsupportedConfigError, match=key):
            entry.spec(cfg)
    cfg = dict(entry.config("tiny"), layer_types=["linear_attention", "sliding_attention"] * 2)
    with pytest.raises(UnsupportedConfigError, match="sliding_attention"):
        entry.spec(cfg)


def test_spec_of_checkpoint_style_dict_matches_transformers_config():
    """Checkpoint key names and the 1-indexed linear_attn_config mean what transformers reads."""
    transformers_or_skip()
    entry = plugins.get_model("kimi_k3")
    ckpt = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
            "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None,
            "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "num_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1,
            "num_shared_experts": 2, "moe_renormalize": False, "routed_scaling_factor": 1.5,
            "first_k_dense_replace": 2, "model_max_length": 1024,
            "linear_attn_config": {"full_attn_layers": [3, 5], "kda_layers": [1, 2, 4], "num_heads": 2,
                                   "head_dim": 8, "short_conv_kernel_size": 3}}
    from_dict = entry.spec(ckpt)
    assert from_dict == entry.spec(entry.hf_config(ckpt))
    assert from_dict.layer_kinds() == ["kda+dense", "kda+dense", "mla+moe", "kda+moe", "mla+moe"]
    moe = from_dict.layers[2].mlp
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.shared_intermediate_size, moe.norm_topk_prob) == \
        (8, 2, 2, 32, False)


def test_full_config_spec():
    spec = plugins.get_model("kimi_k3").spec("full")
    kda = next(l.attention for l in spec.layers if l.attention.kind == "kda")
    mla = next(l.attention for l in spec.layers if l.attention.kind == "mla")
    moe = spec.layers[1].mlp
    assert spec.hidden_size == 7168 and spec.layers[0].mlp.kind == "dense"
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel, kda.gate_kind, kda.gate_lower_bound,
            kda.output_gate_full_rank) == (96, 128, 4, "sigmoid", -5.0, True)
    assert mla.kv_lora_rank + mla.qk_rope_head_dim == 576 and mla.rope is None
    assert math.isclose(mla.softmax_scale, 192 ** -0.5)
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.shared_intermediate_size,
            moe.routed_scaling_factor, moe.n_group) == (896, 16, 3072, 6144, 1.0, 1)
    # Stable LatentMoE and SiTU [MODEL-FACTS F1, F7, F8, F15]; the KDA conv keeps SiLU
    assert (moe.latent_size, moe.latent_norm_eps, moe.activation, moe.situ_beta, moe.situ_linear_beta) == \
        (3584, 1e-5, "situ", 4.0, 25.0)
    assert spec.layers[0].mlp.activation == "situ" and kda.conv_activation == "silu"


def test_latent_moe_and_situ_keys_build_the_spec():
    """routed_expert_hidden_size and hidden_act="situ" (with or without the beta keys) from a dict
    and from a KimiLinearConfig (which keeps unknown keys as attributes) give the same spec."""
    transformers_or_skip()
    entry = plugins.get_model("kimi_k3")
    cfg = entry.config("tiny_k3")
    spec = entry.spec(cfg)
    assert spec == entry.spec(entry.hf_config(cfg))
    moe, dense, kda = spec.layers[1].mlp, spec.layers[0].mlp, spec.layers[0].attention
    assert (moe.latent_size, moe.activation, moe.situ_beta, moe.situ_linear_beta) == (48, "situ", 3.0, 20.0)
    assert (dense.activation, dense.situ_beta, dense.situ_linear_beta) == ("situ", 3.0, 20.0)
    assert kda.conv_activation == "silu"
    default = entry.spec({k: v for k, v in cfg.items() if not k.startswith("situ_")}).layers[1].mlp
    assert (default.situ_beta, default.situ_linear_beta) == (4.0, 25.0)
    plain = entry.spec("tiny").layers[1].mlp
    assert (plain.latent_size, plain.activation) == (0, "silu")


def unit_scale_hf_model(config, seed):
    transformers = transformers_or_skip()
    from test_reference_vs_hf import perturb_
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).eval().float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        perturb_(model, seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:   # logits of order 1, not transformers' 0.02-std ones
                p.normal_(0, 0.5 if "conv1d" in name else p.shape[-1] ** -0.5, generator=g)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("variant", ["tiny", "no_q_lora_bias"])
def test_matches_transformers_with_unit_scale_weights(variant):
    entry = plugins.get_model("kimi_k3")
    cfg = entry.config("tiny")
    if variant == "no_q_lora_bias":
        cfg.update(q_lora_rank=None, attention_bias=True)
    config = entry.hf_config(cfg)
    model = unit_scale_hf_model(config, seed=5)
    ids = torch.randint(1, cfg["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    mk = build_megakernel("kimi_k3", config=config, backend="reference")
    mk.load_hf_state_dict(model.state_dict())
    out = mk.generate(ids, 32)
    hf_logits = torch.stack(hf.logits, dim=1)
    assert hf_logits.std() > 0.5
    assert (mk.last_logits - hf_logits).abs().max() <= 1e-4
    assert torch.equal(out, hf.sequences)


def test_weight_map_errors_list_missing_unexpected_and_misshaped():
    transformers = transformers_or_skip()
    entry = plugins.get_model("kimi_k3")
    config = entry.hf_config(entry.config("tiny"))
    sd = dict(transformers.KimiLinearForCausalLM(config).state_dict())
    spec = entry.spec(config)
    sd.pop("model.layers.0.self_attn.forget_gate.A_log")
    sd["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightsMismatchError) as err:
        entry.load_weights(spec, sd)
    e = err.value
    assert e.missing == ["model.layers.0.self_attn.forget_gate.A_log"]
    assert e.unexpected == ["model.layers.1.self_attn.rotary_emb.inv_freq"]
    assert [k for k, _, _ in e.misshaped] == ["model.layers.1.self_attn.kv_b_proj.weight"]


def test_router_and_gate_parameters_stay_fp32():
    transformers = transformers_or_skip()
    entry = plugins.get_model("kimi_k3")
    config = entry.hf_config(entry.config("tiny"))
    w = entry.load_weights(entry.spec(config), transformers.KimiLinearForCausalLM(config).state_dict(),
                           dtype=torch.bfloat16)
    assert w["layers.1.mlp.gate.weight"].dtype == torch.float32
    assert w["layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert w["layers.0.attn.forget_gate.dt_bias"].dtype == torch.float32
    assert w["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16


def multi_token_and_single_steps(mk, seed):
    """Logits of 5 tokens decoded in one call and one at a time, after the same 4-token prompt."""
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(seed))
    a, b = mk.new_state(2), mk.new_state(2)
    mk.decode(ids[:, :4], a)
    mk.decode(ids[:, :4], b)
    together = mk.decode(ids[:, 4:], a)
    return together, torch.cat([mk.decode(ids[:, t:t + 1], b) for t in range(4, 9)], dim=1)


def test_k3_gate_model_multi_token_equals_single_steps():
    """The whole tiny model with K3's sigmoid KDA gate, full-rank KDA output gate and MLA output gate."""
    cfg = dict(plugins.get_model("kimi_k3").config("tiny"), mla_use_output_gate=True,
               linear_attn_config={"gate_lower_bound": -5.0, "use_full_rank_gate": True})
    mk = build_megakernel("kimi_k3", config=cfg, backend="reference", max_seq_len=32)
    kda, mla = mk.spec.layers[0].attention, mk.spec.layers[1].attention
    assert (kda.gate_kind, kda.gate_lower_bound, kda.output_gate_full_rank, mla.output_gate) == \
        ("sigmoid", -5.0, True, True)
    mk.load_weights(random_weights(mk.spec, seed=2, std=0.1))
    together, single = multi_token_and_single_steps(mk, seed=2)
    assert (together - single).abs().max() <= 1e-5


def test_k3_latent_situ_model_multi_token_equals_single_steps():
    """The tiny model with Kimi K3's latent MoE and SiTU (no transformers class: the reference
    alone; the MoE layer itself is checked against a direct loop in tests/test_latent_moe.py)."""
    mk = build_megakernel("kimi_k3", config="tiny_k3", backend="reference", max_seq_len=32)
    assert mk.spec.layers[1].mlp.latent_size == 48
    w = random_weights(mk.spec, seed=3, std=0.1)
    assert w["layers.1.mlp.latent_down.weight"].shape == (48, 64)
    assert w["layers.1.mlp.experts.gate_up_proj"].shape == (16, 64, 48)
    mk.load_weights(w)
    together, single = multi_token_and_single_steps(mk, seed=3)
    assert together.std() > 0
    assert (together - single).abs().max() <= 1e-5


def test_k3_latent_weights_load_by_hf_style_names():
    """The latent MoE's weights map like every MLP weight: layers.{i}.mlp.X <-> model.layers.{i}.mlp.X."""
    from models.kimi_k3.weights import to_hf
    entry = plugins.get_model("kimi_k3")
    spec = entry.spec("tiny_k3")
    w = random_weights(spec, seed=4)
    sd = {to_hf(k): v for k, v in w.items()}
    assert "model.layers.1.mlp.latent_up.weight" in sd
    loaded = entry.load_weights(spec, sd)
    assert all(torch.equal(loaded[k], w[k]) for k in w)
