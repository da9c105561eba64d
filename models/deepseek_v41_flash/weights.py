"""The weight map: canonical names <-> transformers `DeepseekV4ForCausalLM` state-dict keys.

canonical                          transformers
embed.weight                       model.embed_tokens.weight
norm.weight / lm_head.weight       model.norm.weight / lm_head.weight
layers.{i}.attn_norm.weight        model.layers.{i}.input_layernorm.weight
layers.{i}.mlp_norm.weight         model.layers.{i}.post_attention_layernorm.weight
layers.{i}.attn.indexer.weights_proj.weight   model.layers.{i}.self_attn.compressor.indexer.scorer.weights_proj.weight
layers.{i}.attn.indexer.<x>        model.layers.{i}.self_attn.compressor.indexer.<x>
layers.{i}.attn.<x>                model.layers.{i}.self_attn.<x>
layers.{i}.mlp.<x>                 model.layers.{i}.mlp.<x>
layers.{i}.hc_attn.<x> / hc_mlp.<x>   model.layers.{i}.attn_hc.<x> / ffn_hc.<x>
hc_head.<x>                        model.hc_head.hc_<x>
Ignored: multi-token-prediction keys (`mtp.`), which transformers does not instantiate either.
"""
from __future__ import annotations

import re

from sdk.reference.weights import load_state_dict

_MTP = re.compile(r"(^|\.)mtp\.")
# Parameters transformers keeps in fp32 in a bf16 model (`_keep_in_fp32_modules_strict`) that the
# reference reads with explicit casts; the decoder's own norms are cast to the model dtype.
_FP32 = re.compile(r"(\.hc_(attn|mlp)\.|^hc_head\.|\.attn\.sinks$|position_bias$|q_a_norm\.weight$|"
                   r"kv_norm\.weight$|e_score_correction_bias$)")


def to_hf(name: str) -> str:
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return name
    if name.startswith("hc_head."):
        return "model.hc_head.hc_" + name[len("hc_head."):]
    m = re.match(r"layers\.(\d+)\.([^.]+)\.(.+)$", name)
    if not m:
        raise KeyError(f"deepseek_v41_flash: no transformers key for canonical weight {name!r}")
    i, part, rest = m.groups()
    prefix = f"model.layers.{i}."
    if part in ("attn_norm", "mlp_norm"):
        return prefix + {"attn_norm": "input_layernorm.", "mlp_norm": "post_attention_layernorm."}[part] + rest
    if part == "attn":
        if rest == "indexer.weights_proj.weight":
            return prefix + "self_attn.compressor.indexer.scorer.weights_proj.weight"
        if rest.startswith("indexer."):
            return prefix + "self_attn.compressor." + rest
        return prefix + "self_attn." + rest
    if part == "mlp":
        return prefix + "mlp." + rest
    if part in ("hc_attn", "hc_mlp"):
        return prefix + {"hc_attn": "attn_hc.", "hc_mlp": "ffn_hc."}[part] + rest
    raise KeyError(f"deepseek_v41_flash: no transformers key for canonical weight {name!r}")


def ignore(key: str) -> bool:
    return bool(_MTP.search(key))


def load_weights(spec, state_dict, dtype=None, device="cpu") -> dict:
    import torch
    tied = spec.tie_word_embeddings
    return load_state_dict(spec, state_dict, to_hf,
                           ignore=lambda k: ignore(k) or (tied and k == "lm_head.weight"),
                           dtype=dtype or torch.float32, device=device,
                           keep_dtype=lambda name: bool(_FP32.search(name)))
