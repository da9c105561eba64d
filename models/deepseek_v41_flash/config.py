"""DeepSeek-V4.1-Flash configs and the transformers `deepseek_v4` config -> ModelSpec.

transformers 5.24 has no V4.1 class: the architecture is `deepseek_v4` (DeepseekV4Config). FULL
takes every number MODEL-FACTS.md states for V4.1-Flash and the V4 defaults for the rest; the
source of each is in the comment beside it and in docs/models/deepseek_v41_flash.md.

`spec_from_config` accepts a DeepseekV4Config or a plain dict in its keys (it resolves the same
defaults and legacy keys as DeepseekV4Config.__post_init__ without importing transformers) and
raises UnsupportedConfigError naming any feature the reference does not implement.
"""
from __future__ import annotations

import copy
import dataclasses

from sdk.errors import UnsupportedConfigError
from sdk.reference.common import ACTIVATIONS
from sdk.reference.moe import SCORING
from sdk.spec import (DSAIndexerSpec, DSV4AttentionSpec, LayerSpec, ModelSpec, MoESpec, ResidualSpec, RopeSpec,
                      as_items, cfg_get, reject_unsupported)

MODEL = "deepseek_v41_flash"

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}       # legacy `compress_ratios` entries
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}

# Small, fast on CPU, and long enough to exercise everything within a 7-token prompt + 32 new
# tokens: window 8 slides; CSA (ratio 4, indexer top-4 of up to 9 entries) and HCA (ratio 8,
# the config allows any rate) emit entries; the compress rope is YaRN; 2 hash-routed MoE layers.
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 8},
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,          # rope on the last 16 channels
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 128,           # = factor x original: no YaRN mismatch warning
    "tie_word_embeddings": False,
}

# Small, and in the device blocks' shapes (hidden a multiple of 1024, head_dim 512, one o_a group):
# the whole-model program (sdk/megakernel/mhc_model.py) runs it on the PyVM and the GPU
SMALL = {**TINY, "vocab_size": 512, "hidden_size": 1024, "num_attention_heads": 2, "head_dim": 512,
         "partial_rotary_factor": 64 / 512, "q_lora_rank": 256, "o_groups": 1, "o_lora_rank": 256,
         "index_n_heads": 8, "index_head_dim": 64, "n_routed_experts": 64, "num_experts_per_tok": 6,
         "moe_intermediate_size": 256}

# DeepSeek-V4.1-Flash. C = stated in MODEL-FACTS.md (source tag), V4 = DeepseekV4Config default
# (transformers 5.24, [T3]) assumed unchanged in V4.1, A = other assumption.
FULL = {
    "vocab_size": 129280,                   # V4
    "hidden_size": 5120,                    # C [F13,F19,F20]
    "num_hidden_layers": 43,                # V4 (not stated for V4.1)
    # layer_types / mlp_layer_types left to the V4 defaults: 2 HCA then CSA/HCA alternating (V4,
    # the V4.1 pattern is not stated); the first 3 MLPs hash-routed (C [T3,T4]).
    "num_attention_heads": 64,              # C [F18]
    "num_key_value_heads": 1,               # C shared-KV MQA [T4]
    "head_dim": 512,                        # C [T4,F18]
    "partial_rotary_factor": 64 / 512,      # C rope on the last 64 dims [T4]
    "q_lora_rank": 1024,                    # V4
    "o_groups": 8,                          # V4
    "o_lora_rank": 1024,                    # V4
    "sliding_window": 128,                  # C [F18]
    "compress_rates": dict(DEFAULT_COMPRESS_RATES),   # C CSA 4, HCA 128 [T4,F18]
    "index_n_heads": 64,                    # V4
    "index_head_dim": 128,                  # V4
    "index_topk": 512,                      # C [F21]
    "n_routed_experts": 384,                # C [F13,F19]
    "num_experts_per_tok": 6,               # C [F13,F19]
    "n_shared_experts": 1,                  # C [F13]
    "moe_intermediate_size": 2304,          # C [F13]
    "scoring_func": "sqrtsoftplus",         # C [F19]
    "routed_scaling_factor": 1.5,           # C [F19]
    "swiglu_limit": 10.0,                   # C V4 base [T3]
    "hc_mult": 4,                           # C [T4]
    "hc_sinkhorn_iters": 20,                # C [T4]
    "hc_eps": 1e-6,                         # V4
    "rms_norm_eps": 1e-6,                   # V4
    "rope_theta": 10000.0,                  # V4
    "compress_rope_theta": 160000.0,        # V4
    # YaRN factor 16 on the compress rope: the DeepseekV4Config comment [T3]; the original context
    # 65536 and betas 32/1 are A.
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                        "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,     # V4
    "tie_word_embeddings": False,           # V4
}


def hf_config(config: dict):
    """The transformers DeepseekV4Config of a config dict (imports transformers lazily)."""
    from transformers import DeepseekV4Config
    return DeepseekV4Config(**copy.deepcopy(dict(config)))


# ------------------------------------------------------------------------ config resolution
def _get(config, name, default=None):
    value = cfg_get(config, name)
    return default if value is None else value


def _layer_types(config, n: int) -> list[str]:
    types = cfg_get(config, "layer_types")
    if types is None and cfg_get(config, "compress_ratios") is not None:
        ratios = list(cfg_get(config, "compress_ratios"))
        bad = [r for r in ratios if r not in RATIO_TO_TYPE]
        if bad:
            raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): compress_ratios entries {bad}")
        types = [RATIO_TO_TYPE[r] for r in ratios]
    if types is None:  # the V4 default: 2 HCA, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return list(types)[:n]


def _mlp_layer_types(config, n: int) -> list[str]:
    types = cfg_get(config, "mlp_layer_types")
    if types is None:
        n_hash = _get(config, "num_hash_layers", 3)
        types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    return list(types)[:n]


def _compress_rates(config) -> dict:
    rates = dict(_get(config, "compress_rates", DEFAULT_COMPRESS_RATES))
    if cfg_get(config, "compress_rate_csa") is not None:
        rates[CSA] = cfg_get(config, "compress_rate_csa")
    if cfg_get(config, "compress_rate_hca") is not None:
        rates[HCA] = cfg_get(config, "compress_rate_hca")
    return rates


def _rope_parameters(config, partial: float) -> dict:
    """{"main": {...}, "compress": {...}} as DeepseekV4Config.__post_init__ builds it."""
    rp = cfg_get(config, "rope_parameters") or cfg_get(config, "rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    main = {"rope_type": "default", "rope_theta": _get(config, "rope_theta", 10000.0),
            "partial_rotary_factor": partial}
    compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if "type" in compress and "rope_type" not in compress:
        compress["rope_type"] = compress.pop("type")
    compress.update(rope_theta=_get(config, "compress_rope_theta", 160000.0), partial_rotary_factor=partial)
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": compress}


def _rope_spec(params: dict, head_dim: int) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): rope_type={kind!r}")
    if kind == "yarn" and not params.get("factor"):
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): yarn rope without a factor")
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
            "mscale", "mscale_all_dim")
    scaling = {"rope_type": kind, **{k: params[k] for k in keep if params.get(k) is not None}}
    return RopeSpec(dim=int(head_dim * params.get("partial_rotary_factor", 1.0)), theta=float(params["rope_theta"]),
                    interleaved=True, scaling=as_items(scaling))


def spec_from_config(config) -> ModelSpec:
    """A DeepseekV4Config (object or dict) -> ModelSpec."""
    reject_unsupported(config, MODEL, {
        "quantization_config": lambda v: not v,            # FP8 / MXFP4 checkpoints: not yet
        "mlp_bias": lambda v: not v,                        # shared-expert biases
        "num_key_value_heads": lambda v: v in (None, 1),    # V4 is shared-KV MQA
        "n_shared_experts": lambda v: v in (None, 1),       # transformers builds exactly one
        "q_lora_rank": lambda v: v is None or v > 0,        # V4 always has the q low-rank path
        "hidden_act": lambda v: v is None or v in ACTIVATIONS,
        "scoring_func": lambda v: v is None or v in SCORING,
    })
    n = _get(config, "num_hidden_layers", 43)
    hidden = _get(config, "hidden_size", 4096)
    head_dim = _get(config, "head_dim", 512)
    heads = _get(config, "num_attention_heads", 64)
    o_groups = _get(config, "o_groups", 8)
    eps = _get(config, "rms_norm_eps", 1e-6)
    layer_types, mlp_types = _layer_types(config, n), _mlp_layer_types(config, n)
    bad = [t for t in layer_types if t not in (SLIDING, CSA, HCA)] + [t for t in mlp_types if t not in ("hash_moe", "moe")]
    if len(layer_types) != n or len(mlp_types) != n or bad:
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): layer_types={layer_types!r}, "
                                     f"mlp_layer_types={mlp_types!r} for {n} layers")
    if (heads * head_dim) % o_groups:
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): o_groups={o_groups} does not divide "
                                     f"{heads} heads x {head_dim}")
    partial = cfg_get(config, "partial_rotary_factor")
    if partial is None:
        legacy = cfg_get(config, "qk_rope_head_dim")
        partial = legacy / head_dim if legacy is not None else 64 / 512
    rope = _rope_parameters(config, partial)
    main_rope, compress_rope = _rope_spec(rope["main"], head_dim), _rope_spec(rope["compress"], head_dim)
    if main_rope.dim != compress_rope.dim or main_rope.dim % 2 or main_rope.dim > head_dim:
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): rope dims main={main_rope.dim}, "
                                     f"compress={compress_rope.dim} for head_dim {head_dim}")
    rates = _compress_rates(config)
    q_lora = _get(config, "q_lora_rank", 1024)
    index_head_dim = _get(config, "index_head_dim", 128)
    if index_head_dim < compress_rope.dim:
        raise UnsupportedConfigError(f"{MODEL}: unsupported config feature(s): index_head_dim={index_head_dim} "
                                     f"is smaller than the rope dim {compress_rope.dim}")
    indexer = DSAIndexerSpec(num_heads=_get(config, "index_n_heads", 64), head_dim=index_head_dim,
                             topk=_get(config, "index_topk", 512))
    inter = _get(config, "moe_intermediate_size", 2048)
    layers = []
    for i in range(n):
        kind = layer_types[i]
        attention = DSV4AttentionSpec(
            num_heads=heads, head_dim=head_dim, q_lora_rank=q_lora, rope_dim=main_rope.dim,
            sliding_window=_get(config, "sliding_window", 128),
            compress_ratio=0 if kind == SLIDING else int(rates[kind]),
            indexer=indexer if kind == CSA else None, compress_overlap=kind == CSA,
            o_groups=o_groups, o_lora_rank=_get(config, "o_lora_rank", 1024),
            rope=main_rope if kind == SLIDING else compress_rope, compress_rope=compress_rope, norm_eps=eps)
        hashed = mlp_types[i] == "hash_moe"
        mlp = MoESpec(
            num_experts=_get(config, "n_routed_experts", 256), top_k=_get(config, "num_experts_per_tok", 6),
            expert_intermediate_size=inter, num_shared_experts=1, shared_intermediate_size=inter,
            scoring=_get(config, "scoring_func", "sqrtsoftplus"), correction_bias=not hashed,
            norm_topk_prob=True,        # transformers' V4 routers always renormalise (norm_topk_prob is unused)
            routed_scaling_factor=float(_get(config, "routed_scaling_factor", 1.5)), hash_routed=hashed,
            activation=_get(config, "hidden_act", "silu"), swiglu_limit=float(_get(config, "swiglu_limit", 10.0)),
            extra=as_items({"router_logits_dtype": "model"}))
        layers.append(LayerSpec(index=i, attention=attention, mlp=mlp))
    residual = ResidualSpec(kind="mhc", hc_mult=_get(config, "hc_mult", 4), sinkhorn_iters=_get(config, "hc_sinkhorn_iters", 20),
                            eps=float(_get(config, "hc_eps", 1e-6)), head="weighted")
    spec = ModelSpec(name=MODEL, arch="deepseek_v4", hidden_size=hidden, vocab_size=_get(config, "vocab_size", 129280),
                     layers=tuple(layers), norm_eps=eps, residual=residual,
                     tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
                     max_position_embeddings=_get(config, "max_position_embeddings", 1048576))
    return with_v41_features(spec) if _get(config, V41_SWITCH, False) else spec


# The SDK's own config key (not a checkpoint's: V4.1's is not public) that switches on the V4.1
# features of the reference which transformers' deepseek_v4 lacks; configs "tiny_v41", "full_v41".
V41_SWITCH = "sdk_v41_features"


def with_v41_features(spec: ModelSpec) -> ModelSpec:
    """`spec` with V4.1's decode math where it differs from V4 and is known (docs/models/
    deepseek_v41_flash.md): the lagged mHC pre-mix with the carried head (no hc_head weights), the
    queries without the per-head RMSNorm. Its logits differ from transformers' deepseek_v4."""
    layers = tuple(dataclasses.replace(l, attention=dataclasses.replace(l.attention, q_head_norm=False))
                   for l in spec.layers)
    residual = dataclasses.replace(spec.residual, lagged_pre=True, head="carried")
    return dataclasses.replace(spec, layers=layers, residual=residual)
