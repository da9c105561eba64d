"""ModelSpec: a transformers config normalised into what the SDK builds from.

A model package turns its HF config (object or dict) into a `ModelSpec`: per-layer attention kind,
MLP or MoE, norms, residual kind, vocab and weight quantization. Everything downstream (the
reference decode, the decode graph, the scheduler, the megakernel) reads the spec, never the HF
config. A config feature the SDK does not implement raises `UnsupportedConfigError` naming it.

Attention kinds (one frozen dataclass each, `kind` tells them apart):
  - `KDASpec`        Kimi Delta Attention (linear attention with a per-channel forget gate);
  - `MLASpec`        multi-head latent attention, with or without RoPE, optionally with a DSA
                     lightning indexer (`indexer`) for sparse attention over the selected tokens;
  - `DSV4AttentionSpec` DeepSeek-V4: one shared 512-wide KV head, sliding window, CSA/HCA
                     compressed KV (with its indexer for CSA), attention sinks, grouped low-rank output;
  - `GQASpec`        plain grouped-query attention with RoPE.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import UnsupportedConfigError


def cfg_get(config: Any, name: str, default: Any = None) -> Any:
    """Read `name` from a transformers config object or a plain dict."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def reject_unsupported(config: Any, model: str, checks: Mapping[str, Any]) -> None:
    """Raise naming every config feature whose value is not one the SDK implements.

    `checks` maps a config key to a predicate on its value (True = supported)."""
    bad = []
    for key, ok in checks.items():
        value = cfg_get(config, key)
        if not ok(value):
            bad.append(f"{key}={value!r}")
    if bad:
        raise UnsupportedConfigError(f"{model}: unsupported config feature(s): {', '.join(bad)}")


# ---------------------------------------------------------------------------------------- rope
def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1.0 for factor <= 1): DeepSeek's
    `yarn_get_mscale`, the `get_mscale` of transformers' `_compute_yarn_parameters`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeSpec:
    """A rope. `scaling` holds the HF rope_parameters beyond theta as sorted (key, value) pairs
    (empty: plain RoPE). sdk/reference/common.py turns it into frequencies and the cos/sin factor
    (rope types "default" and "yarn"); `mscale` below is derived from it, never stored, so that a
    spec built from a config cannot disagree with its own scaling."""
    dim: int                       # rotated channels per head
    theta: float
    interleaved: bool = False      # pairs (2i, 2i+1) instead of halves
    scaling: tuple = ()            # sorted (key, value) pairs of the HF rope_parameters, if any

    @property
    def rope_type(self) -> str:
        return dict(self.scaling).get("rope_type", "default")

    @property
    def mscale(self) -> float:
        """DeepSeek-V3's YaRN softmax-scale correction: yarn_mscale(factor, mscale_all_dim) when the
        scaling is not the default rope and sets mscale_all_dim, else 1.0 (transformers'
        `yarn_apply_mscale`). MLA multiplies its softmax scale by mscale ** 2
        (sdk/reference/mla.py `mla_softmax_scale`); DeepSeek-V4's attention does not read it
        (nor does transformers' deepseek_v4)."""
        params = dict(self.scaling)
        if self.rope_type == "default" or not params.get("mscale_all_dim"):
            return 1.0
        return yarn_mscale(params["factor"], params["mscale_all_dim"])


# ---------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class AttentionSpec:
    kind: str = ""


@dataclass(frozen=True)
class GQASpec(AttentionSpec):
    kind: str = "gqa"
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope: RopeSpec | None = None


# --- KDA (owned by the KDA reference) ---
@dataclass(frozen=True)
class KDASpec(AttentionSpec):
    kind: str = "kda"
    num_heads: int = 0
    head_dim: int = 0              # K = V per head
    conv_kernel: int = 4
    gate_kind: str = "softplus"    # "softplus": -exp(A_log)*softplus(g+dt_bias); "sigmoid": -5*sigmoid(exp(A_log)*(g+dt_bias))
    gate_lower_bound: float = -5.0  # "sigmoid" kind: log decay = gate_lower_bound * sigmoid(...) (glm5_next linear_lower_bound)
    a_log_flat: bool = False       # A_log stored as [H] (glm5_next) instead of [1, 1, H, 1] (kimi_linear)
    gate_rank: int = 0             # rank of the low-rank forget gate f_a/f_b (and output gate g_a/g_b); 0 = head_dim
    output_gate_full_rank: bool = False  # Kimi K3: one g_proj [H*K, D] instead of low-rank g_a_proj / g_b_proj
    conv_activation: str = "silu"  # after the short conv (the HF config's hidden_act)
    extra: tuple = ()              # further per-model knobs as sorted (key, value) pairs


# --- MLA / DSA (owned by the MLA reference) ---
@dataclass(frozen=True)
class DSAIndexerSpec:
    num_heads: int = 0
    head_dim: int = 0
    topk: int = 0
    extra: tuple = ()
    # GLM-5.3 (glm5_next) k-pool indexer, sdk/reference/dsa.py:
    kpool: int = 1                 # keys softmax-gate-pooled per `kpool` tokens; top topk/kpool pools
    select_tail: bool = True       # also attend to the incomplete last pool's tokens
    shared: bool = False           # no own indexer: reuse the previous layer's top-k selection


@dataclass(frozen=True)
class MLASpec(AttentionSpec):
    kind: str = "mla"
    num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 0      # 0 = NoPE
    v_head_dim: int = 128
    softmax_scale: float = 0.0     # 0 = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    rope: RopeSpec | None = None   # None with qk_rope_head_dim > 0: the shared key part is not rotated (kimi_linear NoPE)
    indexer: DSAIndexerSpec | None = None
    latent_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm eps (kimi_linear: 1e-6; glm5_next: rms_norm_eps)
    attention_bias: bool = False   # biases on q_a_proj (or q_proj: never), kv_a_proj_with_mqa and o_proj
    output_gate: bool = False      # Kimi K3 `mla_use_output_gate`: out * sigmoid(g_proj x) per head before o_proj
    extra: tuple = ()


# --- DeepSeek-V4 attention (owned by the V4 reference) ---
@dataclass(frozen=True)
class DSV4AttentionSpec(AttentionSpec):
    kind: str = "dsv4"
    num_heads: int = 0
    head_dim: int = 512
    q_lora_rank: int = 0
    rope_dim: int = 64
    sliding_window: int = 128
    compress_ratio: int = 0        # 0: sliding window only; 4: CSA (with indexer); 128: HCA
    indexer: DSAIndexerSpec | None = None
    o_groups: int = 8
    o_lora_rank: int = 1024
    extra: tuple = ()
    compress_overlap: bool = False  # CSA: entry w pools window w-1 (first half of the features) and window w
    rope: RopeSpec | None = None    # rope of q and the sliding KV ("main" on sliding-only layers, else "compress")
    compress_rope: RopeSpec | None = None  # rope of the compressed entries and the indexer ("compress")
    norm_eps: float = 1e-6         # q_a_norm, per-head q norm, kv_norm, the compressors' kv_norm
    softmax_scale: float = 0.0     # 0: head_dim ** -0.5
    q_head_norm: bool = True       # V4's per-head q RMSNorm (no weight) before RoPE; V4.1 drops it
                                   # (flashinfer 0.7.2's V4.1 rotary: "without per-query-head RMSNorm")


# ----------------------------------------------------------------------------------------- mlp
@dataclass(frozen=True)
class DenseMlpSpec:
    kind: str = "dense"
    intermediate_size: int = 0
    activation: str = "silu"       # gated: act(gate) * up, or "situ" (Kimi K3; sdk/reference/common.py `situ`)
    swiglu_limit: float | None = None
    situ_beta: float = 4.0         # "situ" only: the gate's beta and the up's beta_lin
    situ_linear_beta: float = 25.0


@dataclass(frozen=True)
class MoESpec:
    kind: str = "moe"
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    scoring: str = "sigmoid"       # "sigmoid" | "softmax" | "sqrtsoftplus"
    correction_bias: bool = False  # e_score_correction_bias: selection only
    n_group: int = 1               # group-limited top-k: keep the best `topk_group` of `n_group` groups
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hash_routed: bool = False      # token id -> experts table instead of a learned top-k
    activation: str = "silu"       # experts' and shared experts' gated activation: "silu" | ... | "situ"
    swiglu_limit: float | None = None
    situ_beta: float = 4.0         # "situ" only (Kimi K3: 4 and 25 [MODEL-FACTS F1, F7])
    situ_linear_beta: float = 25.0
    # Kimi K3's Stable LatentMoE: the routed experts run on a latent z = latent_down(x) of this
    # width; their weighted sum is RMSNorm'ed (eps below) and projected back (latent_up).
    # The router and the shared experts stay on the hidden size. 0 = no latent (experts on x).
    latent_size: int = 0
    latent_norm_eps: float = 1e-5
    extra: tuple = ()


# ------------------------------------------------------------------------------------ residual
@dataclass(frozen=True)
class ResidualSpec:
    kind: str = "plain"            # "plain" | "mhc" (manifold-constrained hyper-connections)
    hc_mult: int = 1
    sinkhorn_iters: int = 0
    eps: float = 1e-6
    head: str = "weighted"         # mHC collapse before the final norm: "weighted" (V4) | "mean" (GLM)
                                   # | "carried" (V4.1: the last sublayer's emitted pre-mix, no weights)
    lagged_pre: bool = False       # V4.1: a sublayer's input is collapsed with the pre-mix the previous
                                   # site computed; each site's own pre-mix is carried to the next one
    extra: tuple = ()


# -------------------------------------------------------------------------------- quantization
@dataclass(frozen=True)
class QuantSpec:
    experts: str = "bf16"          # "bf16" | "fp8_block128" | "mxfp4" | "nvfp4"
    dense: str = "bf16"            # attention / shared / dense-MLP projections
    kv_cache: str = "bf16"


# --------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class LayerSpec:
    index: int
    attention: AttentionSpec
    mlp: DenseMlpSpec | MoESpec


@dataclass(frozen=True)
class ModelSpec:
    name: str                      # SDK model id, e.g. "kimi_k3"
    arch: str                      # transformers model_type the reference follows
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float = 1e-6
    residual: ResidualSpec = field(default_factory=ResidualSpec)
    tie_word_embeddings: bool = False
    quant: QuantSpec = field(default_factory=QuantSpec)
    max_position_embeddings: int = 0
    extra: tuple = ()              # per-model features as sorted (key, value) pairs

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def get(self, key: str, default: Any = None) -> Any:
        """A per-model feature from `extra`."""
        return dict(self.extra).get(key, default)

    def layer_kinds(self) -> list[str]:
        return [f"{l.attention.kind}+{l.mlp.kind}" for l in self.layers]

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def as_items(d: Mapping[str, Any] | None) -> tuple:
    """A dict as sorted (key, value) pairs, hashable for frozen specs."""
    return tuple(sorted((d or {}).items()))
