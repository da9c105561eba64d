"""The Kimi K3 weight map: canonical names <-> transformers `KimiLinearForCausalLM` state-dict keys.

Attention and MLP local names are the HF names under `self_attn.` / `mlp.` (sdk/reference/kda.py,
mla.py and moe.py list them), so the map only renames the per-layer norms and the embeddings.
Router weights, the score correction bias and KDA's dt_bias stay fp32 whatever the model dtype
(transformers keeps them fp32: `_keep_in_fp32_modules_strict`).
"""
from __future__ import annotations

import re

import torch

from sdk.reference.weights import load_state_dict
from sdk.spec import ModelSpec

GLOBAL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight"}
LAYER_NORMS = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "forget_gate.dt_bias")


def to_hf(name: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    m = _LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"kimi_k3: no HF key for canonical weight {name!r}")
    i, rest = m.groups()
    if rest in LAYER_NORMS:
        return f"model.layers.{i}.{LAYER_NORMS[rest]}"
    if rest.startswith("attn."):
        return f"model.layers.{i}.self_attn.{rest[len('attn.'):]}"
    if rest.startswith("mlp."):
        return f"model.layers.{i}.mlp.{rest[len('mlp.'):]}"
    raise KeyError(f"kimi_k3: no HF key for canonical weight {name!r}")


def ignore(key: str) -> bool:
    """HF keys the decode does not read: none in a KimiLinearForCausalLM state dict."""
    return False


def keep_fp32(name: str) -> bool:
    return name.endswith(FP32)


def load_weights(spec: ModelSpec, state_dict, dtype=torch.float32, device="cpu") -> dict:
    no_shared = {l.index for l in spec.layers if l.mlp.kind == "moe" and not l.mlp.num_shared_experts}

    def ignore_unused(key: str) -> bool:
        # n_shared_experts = 0: transformers still builds a zero-width shared MLP; it adds nothing
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.shared_experts\..+", key)
        return ignore(key) or (m is not None and int(m.group(1)) in no_shared and state_dict[key].numel() == 0)

    return load_state_dict(spec, state_dict, to_hf, ignore_unused, dtype=dtype, device=device, keep_dtype=keep_fp32)
