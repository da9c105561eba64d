"""Kimi K3 configs and their ModelSpec.

The architecture followed is transformers 5.24 `kimi_linear` (KimiLinearConfig keys): KDA linear
attention and NoPE MLA layers, a dense first layer, then MoE with a sigmoid router, score
correction bias, group-limited top-k and one shared MLP. On top of it, Kimi K3 features that
kimi_linear lacks are implemented and switched on by the K3 config keys (the key names are those
public Kimi K3 ports read, e.g. vLLM's and TensorRT-LLM's kimi_linear K3 support; transformers
5.24 ignores them):

  - the sigmoid KDA gate, bound * sigmoid(exp(A_log) * (g + dt_bias)), bound -5 [MODEL-FACTS F11,
    F12]: `linear_attn_config["gate_lower_bound"]` (or top-level `linear_lower_bound`, glm5_next's
    name; `linear_attn_config["safe_gate"] = True` without a bound means -5, as in glm5_next);
  - the full-rank KDA output gate g_proj [MODEL-FACTS F3]: `linear_attn_config["use_full_rank_gate"]`;
  - the sigmoid MLA output gate, out * sigmoid(g_proj x) before o_proj: `mla_use_output_gate`
    (not in MODEL-FACTS: seen in public ports only, so the "full" config leaves it off);
  - Stable LatentMoE [MODEL-FACTS F1, F8, F15]: `routed_expert_hidden_size` (the latent width,
    3584 in K3): the routed experts run on latent_down(x), their weighted sum is RMSNorm'ed
    (eps 1e-5) and projected back by latent_up (MoESpec.latent_size; weight names in
    sdk/reference/moe.py, ours: no public class has them);
  - SiTU [MODEL-FACTS F1, F7]: `hidden_act="situ"`, for the routed and shared experts and the
    dense first layer alike (the config has one hidden_act); betas from the optional keys
    `situ_beta` / `situ_linear_beta` (cutlass' names; default 4 and 25). KDA's short conv stays
    SiLU (transformers' kimi_linear feeds hidden_act to it; SiTU is a gated activation).

Kimi K3 features NOT implemented are rejected by name when their key is set:
`attn_res_block_size` (attention residuals [F5]).

Both a transformers config object and a plain dict are accepted. A dict may use the attribute
names (n_group, num_experts_per_tok, ...) or the checkpoint names transformers maps them from
(num_expert_group, num_experts_per_token, ...), and the checkpoint's `linear_attn_config`
(1-indexed `full_attn_layers` / `kda_layers`, `num_heads`, `head_dim`, `short_conv_kernel_size`);
missing keys take KimiLinearConfig's defaults.
"""
from __future__ import annotations

from typing import Any, Mapping

from sdk.errors import UnsupportedConfigError
from sdk.spec import (DenseMlpSpec, KDASpec, LayerSpec, MLASpec, ModelSpec, MoESpec, cfg_get,
                      reject_unsupported)

MODEL = "kimi_k3"

# KimiLinearConfig's defaults (transformers 5.24) for the keys read here, so that a partial dict
# means what it means to transformers.
HF_DEFAULTS = {
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": None,
    "n_shared_experts": 1, "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "attention_bias": False, "num_local_experts": 256, "linear_head_dim": 128, "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
}
# attribute name -> the checkpoint name transformers' attribute_map reads it from
ALIASES = {
    "max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group", "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
}
LINEAR_ATTN_KEYS = {"linear_head_dim": "head_dim", "linear_num_heads": "num_heads",
                    "linear_conv_kernel_dim": "short_conv_kernel_size"}

# A small model with every feature of the full one: KDA and MLA layers, a dense first layer, MoE
# layers with 16 experts in 4 groups (group-limited top-k), a shared expert, q_lora and a shared
# (unrotated) rope part in MLA.
TINY = {
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "max_position_embeddings": 4096,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


# TINY with Kimi K3's own MoE: Stable LatentMoE (a 48-wide latent of the 64 hidden) and SiTU (at
# betas other than K3's, so that a lost beta shows). transformers implements neither: this config
# runs on the SDK's backends only (tests/test_kimi_k3.py).
TINY_K3 = dict(TINY, routed_expert_hidden_size=48, hidden_act="situ", situ_beta=3.0, situ_linear_beta=20.0,
               n_group=1, topk_group=1, routed_scaling_factor=1.0)


# TINY_K3 in the device blocks' shapes (hidden a multiple of 1024, 128-wide KDA heads, MLA's
# 512 + 64 latent, 32 experts for the router's select, 256-multiples of every GEMV's K): the
# whole-model megakernel program (sdk/megakernel/plain_model.py) runs it on the PyVM and the GPU.
# KDA, MLA, KDA, MLA; a dense first layer, then the latent MoE.
SMALL = dict(TINY_K3, vocab_size=1024, hidden_size=1024, intermediate_size=512, moe_intermediate_size=256,
             routed_expert_hidden_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=512,
             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
             linear_num_heads=4, linear_head_dim=128,
             linear_attn_config={"gate_lower_bound": -5.0, "use_full_rank_gate": True},
             num_local_experts=32, num_experts_per_tok=4)


def _full_layer_types(n: int = 61) -> list[str]:
    # ASSUMED (not stated [F3]): Kimi-Linear's 3:1 pattern as in its checkpoint, MLA on every 4th
    # layer (1-indexed 4, 8, ...) and on the last one.
    return ["full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "linear_attention" for i in range(n)]


# Kimi K3 at full scale, in kimi_linear's form. Sources: MODEL-FACTS.md tags; "assumed" = not stated.
FULL = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,                 # assumed: Kimi K2 / Kimi-Linear tokenizer
    "hidden_size": 7168,                  # [F1]
    "intermediate_size": 18432,           # assumed: Kimi K2's dense first-layer MLP
    "moe_intermediate_size": 3072,        # [F1, F8] expert 3584 -> 2*3072 -> 3584
    "routed_expert_hidden_size": 3584,    # [F1, F8, F15] Stable LatentMoE: experts on a 3584-wide latent
    "num_hidden_layers": 61,              # assumed: Kimi K2's depth (count not stated [F3])
    "num_attention_heads": 96,            # [F10]
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,                  # [F3] (inferred from TP1 shapes)
    "kv_lora_rank": 512,                  # [F3]
    "qk_nope_head_dim": 128,              # [F3]
    "qk_rope_head_dim": 64,               # [F3]; latent 512 + 64 = 576 per token [F9]; scale 1/sqrt(192) [F16]
    "v_head_dim": 128,                    # [F3]
    "mla_use_nope": True,                 # [F3, F9]: no RoPE; the 64-wide key part is shared, not rotated
    "linear_attn_config": {
        "num_heads": 96,                  # [F12] (12 per TP8 rank)
        "head_dim": 128,                  # [F12]
        "short_conv_kernel_size": 4,      # [F12]
        "gate_lower_bound": -5.0,         # [F11, F12] sigmoid KDA gate
        "use_full_rank_gate": True,       # [F3] (inferred) full-rank output gate
    },
    "num_local_experts": 896,             # [F1, F2]
    "num_experts_per_tok": 16,            # [F1, F2]
    "n_group": 1,                         # [F2] no expert groups
    "topk_group": 1,
    "n_shared_experts": 2,                # [F1] one shared MLP of 6144 = 2 * moe_intermediate_size
    "routed_scaling_factor": 1.0,         # [F2] no routed scale
    "norm_topk_prob": True,               # [F2] renormalised over the selected experts
    "hidden_act": "situ",                 # [F1, F7] SiTU, beta 4, beta_lin 25 (the defaults of situ_beta /
                                          # situ_linear_beta); assumed for the dense first layer too
    "rms_norm_eps": 1e-5,                 # [F1, F5] eps 1e-5 in K3's own norms
    "attention_bias": False,
    "tie_word_embeddings": False,
    "layer_types": _full_layer_types(61),
    "mlp_layer_types": ["dense"] + ["sparse"] * 60,   # assumed: first_k_dense_replace = 1 (K2, Kimi-Linear)
}


# One rank's widths of the full model on one GPU: hidden 7168, the 163840 vocab, the 3584 latent and
# the 3072-wide experts as they are; the heads of one TP8 rank (12 MLA, 12 KDA) and its 2304 of the
# dense MLP; 4 layers (the full model's first four: KDA, KDA, KDA, MLA) and 64 experts (an EP16
# rank holds 56; the router's select takes multiples of 32) of which a token takes 16 - all here,
# where a deployed EP16 rank holds ~1 of a token's 16. The whole-model program at real per-GPU
# widths with no peers, for the GPU test and bench/model_bench.py --wide (~19 GB of bf16 weights,
# its reference as much); `megakernel plan` gives the deployed shards. Batch 8 builds too (the
# whole program fitted: program.fitted_sublayers); the GPU test and bench run batch 1.
# SMALL's widths at the full model's depth: 61 layers in its pattern (KDA 3:1 MLA, a dense first
# layer, then the latent MoE). The whole-model program then has the full model's instruction count
# on each SM (hundreds: its records stream through a window of shared memory, kernel.py) at weights
# a CPU and any GPU hold.
DEEP = dict(SMALL, num_hidden_layers=61, layer_types=_full_layer_types(61), mlp_layer_types=["dense"] + ["sparse"] * 60)


WIDE = dict(FULL, num_hidden_layers=4, layer_types=_full_layer_types(61)[:4],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_attention_heads=12, num_key_value_heads=12,
            linear_attn_config=dict(FULL["linear_attn_config"], num_heads=12), intermediate_size=2304,
            num_local_experts=64)


def _copy(config: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in config.items()}


def tiny() -> dict:
    return _copy(TINY)


def tiny_k3() -> dict:
    return _copy(TINY_K3)


def small() -> dict:
    return _copy(SMALL)


def full() -> dict:
    return _copy(FULL)


def wide() -> dict:
    return _copy(WIDE)


def deep() -> dict:
    return _copy(DEEP)


def _get(config: Any, name: str) -> Any:
    """An attribute of a KimiLinearConfig, or from a dict by attribute or checkpoint name."""
    if not isinstance(config, Mapping):
        return getattr(config, name, HF_DEFAULTS.get(name))
    linear = config.get("linear_attn_config") or {}
    if name in LINEAR_ATTN_KEYS and LINEAR_ATTN_KEYS[name] in linear:
        return linear[LINEAR_ATTN_KEYS[name]]
    for key in (ALIASES.get(name), name):
        if key is not None and key in config:
            return config[key]
    return HF_DEFAULTS.get(name)


def _layer_types(config: Any, n: int) -> list[str]:
    types = cfg_get(config, "layer_types")
    if types is not None:
        return list(types)
    linear = cfg_get(config, "linear_attn_config") or {}
    if "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * n
        for i in linear["full_attn_layers"]:
            types[i - 1] = "full_attention"   # 1-indexed in the checkpoint
        for i in linear["kda_layers"]:
            types[i - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _mlp_layer_types(config: Any, n: int) -> list[str]:
    types = cfg_get(config, "mlp_layer_types")
    if types is not None:
        return list(types)
    first_dense = cfg_get(config, "first_k_dense_replace", 1)
    return ["dense" if i < first_dense else "sparse" for i in range(n)]


def _kda_gate(config: Any) -> tuple[str, float]:
    """(gate_kind, lower bound): the sigmoid kind when a lower bound is configured (glm5_next's keys)."""
    linear = cfg_get(config, "linear_attn_config") or {}
    bound = cfg_get(config, "linear_lower_bound")
    if bound is None:
        bound = linear.get("gate_lower_bound")
    if bound is None and linear.get("safe_gate") is True:
        bound = -5.0
    return ("softplus", -5.0) if bound is None else ("sigmoid", float(bound))


def spec_from_config(config: Any) -> ModelSpec:
    n = _get(config, "num_hidden_layers")
    heads = _get(config, "num_attention_heads")
    reject_unsupported(config, MODEL, {
        # transformers' kimi_linear is NoPE only; a checkpoint saying otherwise is not followed
        "mla_use_nope": lambda v: v is None or v is True,
        "moe_router_activation_func": lambda v: v is None or v == "sigmoid",
        "hidden_act": lambda v: v is None or v in ("silu", "situ"),
        # kimi_linear's MLA expands the latent to num_attention_heads key/value heads
        "num_key_value_heads": lambda v: v is None or v == heads,
        "routed_expert_hidden_size": lambda v: not v or (isinstance(v, int) and v > 0),
        # Kimi K3 features not implemented yet (docs/models/kimi_k3.md)
        "attn_res_block_size": lambda v: not v,           # AttnRes
    })
    layer_types, mlp_types = _layer_types(config, n), _mlp_layer_types(config, n)
    bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")} |
                 {t for t in mlp_types if t not in ("dense", "sparse")}, key=str)
    if bad or len(layer_types) != n or len(mlp_types) != n:
        raise UnsupportedConfigError(
            f"{MODEL}: unsupported config feature(s): layer_types/mlp_layer_types {bad or 'of wrong length'} "
            f"(supported: linear_attention, full_attention / dense, sparse; one per layer)")
    gate_kind, bound = _kda_gate(config)
    act = _get(config, "hidden_act")
    # SiTU's betas (cutlass' situ_beta / situ_linear_beta names; 4 and 25 in K3 [MODEL-FACTS F7])
    betas = dict(situ_beta=float(cfg_get(config, "situ_beta", None) or 4.0),
                 situ_linear_beta=float(cfg_get(config, "situ_linear_beta", None) or 25.0))
    kda = KDASpec(num_heads=_get(config, "linear_num_heads"), head_dim=_get(config, "linear_head_dim"),
                  conv_kernel=_get(config, "linear_conv_kernel_dim"), gate_kind=gate_kind, gate_lower_bound=bound,
                  output_gate_full_rank=bool((cfg_get(config, "linear_attn_config") or {}).get("use_full_rank_gate")),
                  # SiTU is a gated (two-input) activation: K3's short conv keeps SiLU
                  conv_activation="silu" if act == "situ" else act)
    nope, rope = _get(config, "qk_nope_head_dim"), _get(config, "qk_rope_head_dim")
    mla = MLASpec(num_heads=heads, q_lora_rank=_get(config, "q_lora_rank") or None,
                  kv_lora_rank=_get(config, "kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                  v_head_dim=_get(config, "v_head_dim"), softmax_scale=(nope + rope) ** -0.5,
                  rope=None, latent_norm_eps=1e-6,   # kimi_linear builds q_a/kv_a norms with the default eps
                  attention_bias=bool(_get(config, "attention_bias")),
                  output_gate=bool(cfg_get(config, "mla_use_output_gate", False)))
    n_shared = _get(config, "n_shared_experts") or 0
    moe = MoESpec(num_experts=_get(config, "num_local_experts"), top_k=_get(config, "num_experts_per_tok"),
                  expert_intermediate_size=_get(config, "moe_intermediate_size"),
                  num_shared_experts=n_shared,
                  shared_intermediate_size=_get(config, "moe_intermediate_size") * n_shared,
                  scoring="sigmoid", correction_bias=True,
                  n_group=_get(config, "n_group") or 1, topk_group=_get(config, "topk_group") or 1,
                  norm_topk_prob=bool(_get(config, "norm_topk_prob")),
                  routed_scaling_factor=float(_get(config, "routed_scaling_factor")),
                  activation=act, **betas,
                  # Stable LatentMoE; its norm's eps 1e-5 is stated [MODEL-FACTS F1, F8, F15]
                  latent_size=cfg_get(config, "routed_expert_hidden_size", None) or 0, latent_norm_eps=1e-5)
    # the dense first layer follows hidden_act too (SiTU in "full": assumed, not stated)
    dense = DenseMlpSpec(intermediate_size=_get(config, "intermediate_size"), activation=act, **betas)
    layers = tuple(LayerSpec(index=i, attention=kda if layer_types[i] == "linear_attention" else mla,
                             mlp=moe if mlp_types[i] == "sparse" else dense) for i in range(n))
    return ModelSpec(name=MODEL, arch="kimi_linear", hidden_size=_get(config, "hidden_size"),
                     vocab_size=_get(config, "vocab_size"), layers=layers, norm_eps=float(_get(config, "rms_norm_eps")),
                     # kimi_linear never ties (KimiLinearForCausalLM._tied_weights_keys is empty,
                     # whatever tie_word_embeddings says): lm_head is always its own weight
                     tie_word_embeddings=False,
                     max_position_embeddings=_get(config, "max_position_embeddings") or 0)


def hf_config(config: dict):
    """The transformers config object of a config dict (imports transformers)."""
    from transformers import KimiLinearConfig
    return KimiLinearConfig(**{k: v for k, v in config.items() if k != "model_type"})
