"""GLM-5.3 configs and `spec_from_config`: transformers 5.24 `glm5_next` -> ModelSpec.

The architecture is transformers 5.24's `Glm5NextForConditionalGeneration` text model
(`Glm5NextTextModel` + `lm_head`); the vision tower is not part of the decode and is ignored.

Per layer (`layer_types[i]`):
  - "linear_attention": KDA (sdk/reference/kda.py), gate -5*sigmoid(exp(A_log)*(f_b f_a x + dt_bias))
    when `linear_lower_bound` is set (GLM-5.3), else Kimi-Linear's -exp(A_log)*softplus(...);
  - "indexed_attention": NoPE MLA restricted to the tokens the DSA k-pool indexer selects
    (sdk/reference/dsa.py); `indexer_types[i] == "shared"` reuses the previous layer's selection.
MLP per layer (`mlp_layer_types[i]`): "dense" SwiGLU or "sparse" MoE (sigmoid router, selection-only
correction bias, renormalised, x routed_scaling_factor, one shared expert, SwiGLU clamp).
Residual: mHC with `hc_mult` streams, Sinkhorn comb, unweighted-mean head.

Unsupported (rejected by name): RoPE in MLA (qk_rope_head_dim > 0), q_lora_rank None,
num_key_value_heads != num_attention_heads, activations other than SiLU, expert groups that do not
divide the experts, a "shared" indexer layer not directly after a layer that runs its own indexer
(transformers raises there too), index_kpool_always_select_tail=False with index_kpool > 1 (the first
kpool-1 tokens would attend to nothing), layer or MLP types other than the ones above.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

from sdk.errors import UnsupportedConfigError
from sdk.spec import (DSAIndexerSpec, DenseMlpSpec, KDASpec, LayerSpec, MLASpec, ModelSpec, MoESpec,
                      ResidualSpec, cfg_get)

NAME = "glm_53"
ARCH = "glm5_next"

# Glm5NextTextConfig's defaults (transformers 5.24 configuration_glm5_next.py, "T1" in
# MODEL-FACTS.md): they describe GLM-5.3-Flash. Used for keys a plain dict leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_shared_experts": 1, "n_routed_experts": 288, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "mlp_layer_types": None, "attention_bias": False, "index_topk": 2048, "index_head_dim": 128,
    "index_n_heads": 32, "layer_types": None, "indexer_types": None, "swiglu_limit": 10.0,
    "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "index_kpool": 16,
    "index_kpool_always_select_tail": True,
}

# A tiny config (CPU tests): every feature of the architecture within 5 layers.
#   layer 0: KDA + dense MLP       layer 1: MLA + DSA (own indexer) + dense MLP
#   layer 2: MLA + shared DSA + MoE   layer 3: KDA + MoE   layer 4: MLA + DSA + MoE
# kpool 4 and top-k 8 select 2 pools + a tail of <= 3 tokens (<= 11 tokens), so a 7-token prompt
# plus 32 new tokens really drops tokens; 8 indexer heads make exact score ties (all heads' ReLU = 0)
# between pools rare, since the order of tied pools is not defined.
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 2.5,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 0, "v_head_dim": 16,
    "index_n_heads": 8, "index_head_dim": 16, "index_topk": 8, "index_kpool": 4,
    "index_kpool_always_select_tail": True,
    "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                    "indexed_attention"],
    "indexer_types": ["full", "full", "shared", "full", "full"],
    "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"],
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "swiglu_limit": 10.0, "max_position_embeddings": 4096,
    "pad_token_id": 0, "tie_word_embeddings": False,
}
# TINY in the device blocks' shapes (hidden a multiple of 1024, 128-wide KDA heads, MLA's 512
# latent, 32 experts for the router's select, 256-multiples of every GEMV's K): the whole-model
# megakernel program (sdk/megakernel/mhc_model.py) runs it on the PyVM and the GPU. The layers are
# TINY's: KDA + dense, DSA + dense, shared DSA + MoE, KDA + MoE, DSA + MoE.
SMALL_TEXT: dict[str, Any] = dict(
    TINY_TEXT, vocab_size=1024, hidden_size=1024, intermediate_size=512, moe_intermediate_size=256,
    n_routed_experts=32, num_experts_per_tok=4, q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128,
    v_head_dim=128, index_n_heads=8, index_head_dim=64, index_topk=16, index_kpool=4, linear_num_heads=4,
    linear_head_dim=128)

# Only there so that the multimodal checkpoint's `model.visual.*` keys exist (and are ignored).
TINY_VISION: dict[str, Any] = {
    "depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "out_hidden_size": 64,
    "projection_intermediate_size": 32, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
TINY: dict[str, Any] = {"model_type": ARCH, "text_config": TINY_TEXT, "vision_config": TINY_VISION,
                        "tie_word_embeddings": False}

# GLM-5.3-Flash: every number is Glm5NextTextConfig's default (T1), which MODEL-FACTS.md lists as
# stated: hidden 4096, 45 layers, vocab 154880, no RoPE; KDA where i % 4 != 3 else MLA+DSA; layers
# 0-2 dense (12288); MLA 64 heads, q_lora 1536, kv_lora 512, nope 256, v 256; indexer 32 x 128,
# top-k 2048, kpool 16 (serving setups expect kpool 4, F26); KDA 64 x 128, conv 4, bound -5;
# MoE 288 experts top-8, 1 shared, 2048 wide, x2.5; mHC 4 streams, 20 Sinkhorn iterations.
# `layer_types`, `mlp_layer_types` and `indexer_types` are left to the config's own derivation
# (all indexers "full": index_topk_freq 1).
FULL_TEXT: dict[str, Any] = {k: v for k, v in TEXT_DEFAULTS.items() if v is not None}
FULL_TEXT["pad_token_id"] = 154820
FULL: dict[str, Any] = {"model_type": ARCH, "text_config": FULL_TEXT, "vision_config": {},
                        "tie_word_embeddings": False}

# GLM-5.3 (non-Flash): MODEL-FACTS.md states only hidden 6144, 256 experts, top-8 (F13, a MoE
# benchmark corpus). Everything else is ASSUMED equal to the Flash config (layer count, pattern,
# head counts, widths) until a config is published; see docs/models/glm_53.md.
FULL_NONFLASH_TEXT: dict[str, Any] = dict(FULL_TEXT, hidden_size=6144, n_routed_experts=256, num_experts_per_tok=8)
FULL_NONFLASH: dict[str, Any] = {"model_type": ARCH, "text_config": FULL_NONFLASH_TEXT,
                                 "vision_config": {"out_hidden_size": 6144}, "tie_word_embeddings": False}


def tiny() -> dict:
    return copy.deepcopy(TINY)


def small() -> dict:
    return {"model_type": ARCH, "text_config": copy.deepcopy(SMALL_TEXT), "vision_config": {},
            "tie_word_embeddings": False}


def full() -> dict:
    return copy.deepcopy(FULL)


def full_nonflash() -> dict:
    return copy.deepcopy(FULL_NONFLASH)


# ------------------------------------------------------------------------------- normalising
def _text_part(config: Any) -> Any:
    """The text config inside a top-level Glm5NextConfig (object or dict); a flat (text-only)
    config is its own text part, as Glm5NextConfig forwards flat keys to its text_config."""
    text = cfg_get(config, "text_config")
    return config if text is None else text


def text_fields(config: Any) -> dict[str, Any]:
    """Every text field the spec reads, with Glm5NextTextConfig's defaults and derivations applied
    (a transformers config object has applied them already; a dict gets the same treatment)."""
    text = _text_part(config)
    out = {k: cfg_get(text, k, d) for k, d in TEXT_DEFAULTS.items()}
    # tie_word_embeddings lives on the top-level config (it decides the tying in transformers).
    if cfg_get(config, "text_config") is not None:
        out["tie_word_embeddings"] = bool(cfg_get(config, "tie_word_embeddings", False))
    linear = cfg_get(text, "linear_attn_config")
    if isinstance(linear, Mapping):  # the legacy nested form, as Glm5NextTextConfig.__post_init__ reads it
        out["linear_head_dim"] = linear.get("head_dim", out["linear_head_dim"])
        out["linear_num_heads"] = linear.get("num_heads", out["linear_num_heads"])
        out["linear_conv_kernel_dim"] = linear.get("short_conv_kernel_size", out["linear_conv_kernel_dim"])
        out["linear_lower_bound"] = linear.get("gate_lower_bound", out["linear_lower_bound"])
        if linear.get("safe_gate", True) and out["linear_lower_bound"] is None:
            out["linear_lower_bound"] = -5.0
    n = out["num_hidden_layers"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["mlp_layer_types"] is None:
        out["mlp_layer_types"] = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    if out["layer_types"] is None:
        out["layer_types"] = ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    out["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in out["layer_types"]]
    if out["indexer_types"] is None:
        pattern = cfg_get(text, "index_topk_pattern")
        if pattern is not None:
            out["indexer_types"] = ([{"F": "full", "S": "shared"}[c] for c in pattern]
                                    if isinstance(pattern, str) else list(pattern))
        else:
            freq = max(cfg_get(text, "index_topk_freq", 1) or 1, 1)
            offset = cfg_get(text, "index_skip_topk_offset", 2)
            out["indexer_types"] = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
    return out


def _check(c: dict[str, Any]) -> None:
    """Raise UnsupportedConfigError naming every unsupported feature."""
    n = c["num_hidden_layers"]
    bad = []

    def need(ok: bool, what: str):
        if not ok:
            bad.append(what)

    need(c["qk_rope_head_dim"] == 0, f"qk_rope_head_dim={c['qk_rope_head_dim']!r} (only NoPE MLA)")
    need(c["q_lora_rank"] is not None, "q_lora_rank=None (the DSA indexer reads the q latent)")
    need(c["num_key_value_heads"] == c["num_attention_heads"],
         f"num_key_value_heads={c['num_key_value_heads']!r} != num_attention_heads")
    need(c["hidden_act"] == "silu", f"hidden_act={c['hidden_act']!r} (only silu)")
    need(c["n_shared_experts"] >= 1, f"n_shared_experts={c['n_shared_experts']!r} (needs >= 1)")
    need(c["n_group"] >= 1 and c["n_routed_experts"] % c["n_group"] == 0,
         f"n_group={c['n_group']!r} does not divide n_routed_experts={c['n_routed_experts']!r}")
    need(c["index_kpool"] >= 1 and c["index_topk"] % c["index_kpool"] == 0 and c["index_topk"] >= c["index_kpool"],
         f"index_topk={c['index_topk']!r} is not a positive multiple of index_kpool={c['index_kpool']!r}")
    need(c["index_kpool_always_select_tail"] or c["index_kpool"] == 1,
         "index_kpool_always_select_tail=False with index_kpool > 1")
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):
        need(len(c[key]) >= n, f"{key} has {len(c[key])} entries for {n} layers")
    if bad:
        raise UnsupportedConfigError(f"{NAME}: unsupported config feature(s): {'; '.join(bad)}")
    for i in range(n):
        need(c["layer_types"][i] in ("linear_attention", "indexed_attention"),
             f"layer_types[{i}]={c['layer_types'][i]!r}")
        need(c["mlp_layer_types"][i] in ("dense", "sparse"), f"mlp_layer_types[{i}]={c['mlp_layer_types'][i]!r}")
        need(c["indexer_types"][i] in ("full", "shared"), f"indexer_types[{i}]={c['indexer_types'][i]!r}")
        if c["layer_types"][i] == "indexed_attention" and c["indexer_types"][i] == "shared":
            # transformers hands a layer's top-k only to the very next layer, and only from a layer
            # that ran its own indexer; anything else raises there.
            ok = (i > 0 and c["layer_types"][i - 1] == "indexed_attention" and c["indexer_types"][i - 1] == "full")
            need(ok, f"indexer_types[{i}]='shared' without a full indexed_attention layer {i - 1} before it")
    if bad:
        raise UnsupportedConfigError(f"{NAME}: unsupported config feature(s): {'; '.join(bad)}")


def spec_from_config(config: Any) -> ModelSpec:
    """A top-level Glm5NextConfig (object or dict; its text part is used), a Glm5NextTextConfig or a
    flat dict of text keys -> ModelSpec."""
    c = text_fields(config)
    _check(c)
    d, eps = c["hidden_size"], c["rms_norm_eps"]
    kda = KDASpec(num_heads=c["linear_num_heads"], head_dim=c["linear_head_dim"],
                  conv_kernel=c["linear_conv_kernel_dim"],
                  gate_kind="softplus" if c["linear_lower_bound"] is None else "sigmoid",
                  gate_lower_bound=-5.0 if c["linear_lower_bound"] is None else float(c["linear_lower_bound"]),
                  a_log_flat=True, gate_rank=c["linear_head_dim"], conv_activation=c["hidden_act"],
                  # the checkpoint keeps the short conv's weight fp32 (weights.py keep_fp32)
                  extra=(("conv_weight_dtype", "fp32"),))
    layers = []
    for i in range(c["num_hidden_layers"]):
        if c["layer_types"][i] == "linear_attention":
            attn = kda
        else:
            indexer = DSAIndexerSpec(num_heads=c["index_n_heads"], head_dim=c["index_head_dim"],
                                     topk=c["index_topk"], kpool=c["index_kpool"],
                                     select_tail=bool(c["index_kpool_always_select_tail"]),
                                     shared=c["indexer_types"][i] == "shared")
            attn = MLASpec(kind="dsa_mla", num_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"],
                           kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
                           qk_rope_head_dim=0, v_head_dim=c["v_head_dim"],
                           softmax_scale=c["qk_nope_head_dim"] ** -0.5, indexer=indexer,
                           latent_norm_eps=eps, attention_bias=bool(c["attention_bias"]))
        if c["mlp_layer_types"][i] == "dense":
            mlp = DenseMlpSpec(intermediate_size=c["intermediate_size"], activation="silu",
                               swiglu_limit=c["swiglu_limit"])
        else:
            mlp = MoESpec(num_experts=c["n_routed_experts"], top_k=c["num_experts_per_tok"],
                          expert_intermediate_size=c["moe_intermediate_size"], num_shared_experts=1,
                          shared_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"],
                          scoring="sigmoid", correction_bias=True, n_group=c["n_group"],
                          topk_group=c["topk_group"], norm_topk_prob=bool(c["norm_topk_prob"]),
                          routed_scaling_factor=float(c["routed_scaling_factor"]), activation="silu",
                          swiglu_limit=c["swiglu_limit"])
        layers.append(LayerSpec(index=i, attention=attn, mlp=mlp))
    residual = ResidualSpec(kind="mhc", hc_mult=c["hc_mult"], sinkhorn_iters=c["hc_sinkhorn_iters"],
                            eps=c["hc_eps"], head="mean")
    return ModelSpec(name=NAME, arch=ARCH, hidden_size=d, vocab_size=c["vocab_size"], layers=tuple(layers),
                     norm_eps=eps, residual=residual, tie_word_embeddings=bool(c["tie_word_embeddings"]),
                     max_position_embeddings=c["max_position_embeddings"])


def hf_config(config: dict):
    """The transformers config object (Glm5NextConfig) of a config dict."""
    from transformers import Glm5NextConfig
    config = {k: v for k, v in config.items() if k != "model_type"}
    return Glm5NextConfig(**copy.deepcopy(config))
