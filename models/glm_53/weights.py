"""GLM-5.3 weight map: canonical names <-> the state dict of transformers'
`Glm5NextForConditionalGeneration` (text model under `model.language_model.`, `lm_head` on top).

    embed.weight                  model.language_model.embed_tokens.weight
    norm.weight                   model.language_model.norm.weight
    lm_head.weight                lm_head.weight            (absent from the spec when tied)
    layers.{i}.attn_norm.weight   model.language_model.layers.{i}.input_layernorm.weight
    layers.{i}.mlp_norm.weight    model.language_model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.attn.<local>       model.language_model.layers.{i}.self_attn.<local>   (KDA, MLA, indexer.*)
    layers.{i}.mlp.<local>        model.language_model.layers.{i}.mlp.<local>
    layers.{i}.hc_attn.<local>    model.language_model.layers.{i}.attn_hc.<local>    (mHC fn / base / scale)
    layers.{i}.hc_mlp.<local>     model.language_model.layers.{i}.ffn_hc.<local>

Ignored: the vision tower and its merger (`model.visual.*`), multi-token-prediction layers past the
last decoder layer and their `shared_head` (transformers ignores them on load too), and
`lm_head.weight` when the embeddings are tied (the state dict still lists it then).
"""
from __future__ import annotations

import re

import torch

from sdk.reference.weights import load_state_dict
from sdk.spec import ModelSpec

TEXT = "model.language_model."
_TOP = {"embed.weight": TEXT + "embed_tokens.weight", "norm.weight": TEXT + "norm.weight",
        "lm_head.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(attn_norm|mlp_norm|attn|mlp|hc_attn|hc_mlp)(?:\.(.+))?$")
_SITE = {"attn": "self_attn", "mlp": "mlp", "hc_attn": "attn_hc", "hc_mlp": "ffn_hc"}
_NORM = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}


def to_hf(name: str) -> str:
    """Canonical weight name -> transformers state-dict key."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"glm_53: no transformers key for canonical weight {name!r}")
    i, site, local = m.groups()
    if site in _NORM:
        return f"{TEXT}layers.{i}.{_NORM[site]}"
    return f"{TEXT}layers.{i}.{_SITE[site]}.{local}"


def ignore_for(spec: ModelSpec):
    """The keys of a glm5_next state dict that the decode of `spec` does not read."""
    mtp = re.compile(re.escape(TEXT) + r"layers\.(\d+)\.")

    def ignore(key: str) -> bool:
        if key.startswith("model.visual.") or ".shared_head." in key:
            return True
        if key == "lm_head.weight" and spec.tie_word_embeddings:
            return True
        m = mtp.match(key)
        return m is not None and int(m.group(1)) >= spec.num_layers

    return ignore


# Glm5NextPreTrainedModel._keep_in_fp32_modules_strict: these stay fp32 whatever the model dtype.
_FP32 = re.compile(r"(mlp\.gate\.weight|e_score_correction_bias|conv1d\.weight|dt_bias|A_log"
                   r"|hc_(attn|mlp)\.(base|scale))$")


def keep_fp32(name: str) -> bool:
    return _FP32.search(name) is not None


def load_weights(spec: ModelSpec, state_dict, dtype=torch.float32, device="cpu") -> dict:
    """A transformers glm5_next state dict -> the reference's canonical weights (checked key by key:
    `WeightsMismatchError` lists every missing, unexpected and mis-shaped key). The parameters that
    transformers keeps in fp32 stay fp32."""
    return load_state_dict(spec, state_dict, to_hf, ignore_for(spec), dtype=dtype, device=device,
                           keep_dtype=keep_fp32)
