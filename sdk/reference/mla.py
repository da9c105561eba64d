"""Reference multi-head latent attention (MLA) decode: kimi_linear's NoPE MLA, glm5_next's MLA
(without its DSA indexer) and DeepSeek-style MLA with RoPE on the shared key part.

Follows transformers 5.24 `KimiLinearAttention` (models/kimi_linear) and the attention half of
`Glm5NextTextAttention` (models/glm5_next):

    q        = q_b_proj(RMSNorm(q_a_proj(x)))            (q_lora_rank set)  or  q_proj(x)
               split per head into q_nope [qk_nope_head_dim] and q_pe [qk_rope_head_dim]
    c, k_pe  = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    c        = RMSNorm(c)                                 kv_a_layernorm
    cache   <- [c, k_pe] per token: the compressed latent, kv_lora_rank + qk_rope_head_dim values
    k_nope, v = split(kv_b_proj(c)) per head              (keys/values expanded from the latent)
    score    = (q_nope . k_nope + q_pe . k_pe) * softmax_scale,  causal, softmax in fp32
    out      = softmax(score) @ v                         per head [v_head_dim]
    out      = out * sigmoid(g_proj x)                    only with spec.output_gate (Kimi K3 `mla_use_output_gate`)
    out      = o_proj(out)

`k_pe` is one key part shared by all heads. With `spec.rope` None it is used as is (kimi_linear and
glm5_next: "NoPE"; glm5_next has qk_rope_head_dim = 0, kimi_linear 64); with a `RopeSpec` both q_pe
and k_pe are rotated at their absolute positions before k_pe is cached (DeepSeek-V2/V3 style; halves
or interleaved pairs). Rope scaling: YaRN as DeepSeek-V3 and transformers' `DeepseekV3Attention`
apply it - cos/sin from the YaRN frequencies times its attention factor (common.rope_cos_sin), and
the softmax scale times RopeSpec.mscale ** 2 (`mla_softmax_scale`); another rope type raises
`UnsupportedConfigError` naming it.

Local weight names (= the HF names under `self_attn.`):
    q_a_proj.weight [q_lora, D] (+ q_a_proj.bias if spec.attention_bias), q_a_layernorm.weight [q_lora],
    q_b_proj.weight [H*(nope+rope), q_lora]          when spec.q_lora_rank is set, else
    q_proj.weight   [H*(nope+rope), D]
    kv_a_proj_with_mqa.weight [kv_lora + rope, D] (+ .bias if spec.attention_bias)
    kv_a_layernorm.weight [kv_lora]
    kv_b_proj.weight [H*(nope+v), kv_lora]           per head: nope rows, then v rows
    g_proj.weight [H*v, D]                           when spec.output_gate
    o_proj.weight [D, H*v] (+ o_proj.bias if spec.attention_bias)

Spec fields read (`MLASpec`): num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, softmax_scale (the base: 0 = (nope+rope)^-0.5), rope, latent_norm_eps
(kimi_linear builds its latent norms with the RMSNorm default 1e-6; glm5_next with rms_norm_eps),
attention_bias, output_gate. `spec.indexer` is not read here: a DSA indexer lives in its own module that wraps
or subclasses this one and passes `index_mask` (below).

Cache: {"latent": [B, max_seq_len, kv_lora_rank + qk_rope_head_dim]} in the model dtype; token p
of sequence b lives at row p. Sequences may be at different lengths (ragged `step.start`); the T
new tokens are written at their positions, then each attends causally to positions <= its own.

Sparse attention hook: `forward(x, cache, step, index_mask=...)` with a BoolTensor
[B, T, L] (L <= max_seq_len, over cache positions 0..L-1): query t of sequence b attends only to
positions where the mask is True (and causal). Every query must keep at least one position. The
pieces (`project_q`, `project_kv`, `write_cache`, `attend`, `project_out`) are separate methods so
that a wrapper can reuse them, e.g. glm5_next's indexer needs `project_q`'s q_resid (the
q_a_layernorm output).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import LayerSpec, MLASpec, ModelSpec
from .common import StepInfo, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


def mla_softmax_scale(s: MLASpec) -> float:
    """The attention's logit scale: spec.softmax_scale (0 = (nope+rope)^-0.5) times YaRN's
    mscale ** 2 when the rope sets mscale_all_dim (transformers' `yarn_apply_mscale`, same order of
    products). The megakernel's decode takes this value too (sdk/megakernel/mla_layer.py)."""
    scale = s.softmax_scale or (s.qk_nope_head_dim + s.qk_rope_head_dim) ** -0.5
    if s.rope is not None:
        scale = scale * s.rope.mscale * s.rope.mscale
    return scale


class MLAReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        s: MLASpec = layer.attention
        self.check(s)
        self.spec, self.w = s, weights
        self.qk_head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim
        self.scale = mla_softmax_scale(s)

    @staticmethod
    def check(s: MLASpec) -> None:
        if s.rope is not None:
            rope_inv_freq(s.rope)          # raises naming an unsupported rope type or a YaRN key it lacks
            if s.rope.dim != s.qk_rope_head_dim:
                raise UnsupportedConfigError(
                    f"MLA: rope.dim={s.rope.dim} must equal qk_rope_head_dim={s.qk_rope_head_dim}")

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: MLASpec = layer.attention
        d, h = model.hidden_size, s.num_heads
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        out: dict[str, tuple] = {}
        if s.q_lora_rank:
            out["q_a_proj.weight"] = (s.q_lora_rank, d)
            if s.attention_bias:
                out["q_a_proj.bias"] = (s.q_lora_rank,)
            out["q_a_layernorm.weight"] = (s.q_lora_rank,)
            out["q_b_proj.weight"] = (h * qk, s.q_lora_rank)
        else:
            out["q_proj.weight"] = (h * qk, d)
        out["kv_a_proj_with_mqa.weight"] = (s.kv_lora_rank + s.qk_rope_head_dim, d)
        if s.attention_bias:
            out["kv_a_proj_with_mqa.bias"] = (s.kv_lora_rank + s.qk_rope_head_dim,)
        out["kv_a_layernorm.weight"] = (s.kv_lora_rank,)
        out["kv_b_proj.weight"] = (h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
        if s.output_gate:
            out["g_proj.weight"] = (h * s.v_head_dim, d)
        out["o_proj.weight"] = (d, h * s.v_head_dim)
        if s.attention_bias:
            out["o_proj.bias"] = (d,)
        return out

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        s = self.spec
        return {"latent": torch.zeros(batch, max_seq_len, s.kv_lora_rank + s.qk_rope_head_dim,
                                      device=device, dtype=dtype)}

    def _bias(self, proj: str):
        return self.w[f"{proj}.bias"] if self.spec.attention_bias else None

    # ------------------------------------------------------------------ pieces
    def project_q(self, x: torch.Tensor, step: StepInfo):
        """x [B, T, D] -> (q_nope [B, T, H, nope], q_pe [B, T, H, rope] (rotated), q_resid
        [B, T, q_lora] or None: the normalised q latent a DSA indexer reads)."""
        s, w = self.spec, self.w
        b, t, _ = x.shape
        if s.q_lora_rank:
            q_resid = rms_norm(F.linear(x, w["q_a_proj.weight"], self._bias("q_a_proj")),
                               w["q_a_layernorm.weight"], s.latent_norm_eps)
            q = F.linear(q_resid, w["q_b_proj.weight"])
        else:
            q_resid, q = None, F.linear(x, w["q_proj.weight"])
        q = q.view(b, t, s.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        if s.rope is not None:
            cos, sin = rope_cos_sin(s.rope, step.positions, q.dtype)
            q_pe = apply_rope(q_pe, cos, sin, s.rope.interleaved)
        return q_nope, q_pe, q_resid

    def project_kv(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """x [B, T, D] -> the cache rows [B, T, kv_lora + rope]: normalised latent, then k_pe
        (rotated at the token's position when spec.rope is set)."""
        s, w = self.spec, self.w
        ckv = F.linear(x, w["kv_a_proj_with_mqa.weight"], self._bias("kv_a_proj_with_mqa"))
        latent, k_pe = ckv.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w["kv_a_layernorm.weight"], s.latent_norm_eps)
        if s.rope is not None:
            cos, sin = rope_cos_sin(s.rope, step.positions, x.dtype)
            k_pe = apply_rope(k_pe, cos, sin, s.rope.interleaved)
        return torch.cat([latent, k_pe], dim=-1)

    @staticmethod
    def write_cache(cache: dict, step: StepInfo, rows: torch.Tensor) -> None:
        """Store the new tokens' rows at their positions (in place: `cache` may be a view)."""
        b = torch.arange(step.batch, device=rows.device)[:, None].expand_as(step.positions)
        cache["latent"][b, step.positions] = rows.to(cache["latent"].dtype)

    def attend(self, q_nope, q_pe, cache: dict, step: StepInfo, index_mask: torch.Tensor | None = None):
        """Attention of the new queries over cache positions [0, L), L = the longest sequence
        after this step. Returns [B, T, H, v_head_dim]."""
        s, w = self.spec, self.w
        h, nope, vd = s.num_heads, s.qk_nope_head_dim, s.v_head_dim
        length = step.cache_extent()
        kv = cache["latent"][:, :length].to(q_nope.dtype)
        latent, k_pe = kv.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        b = latent.shape[0]
        k_nope, v = F.linear(latent, w["kv_b_proj.weight"]).view(b, length, h, nope + vd).split([nope, vd], dim=-1)
        # [B, H, T, L]: the per-head part plus the shared (single-head) rope part
        scores = torch.einsum("bthd,blhd->bhtl", q_nope, k_nope) + torch.einsum("bthd,bld->bhtl", q_pe, k_pe)
        scores = scores * self.scale
        visible = torch.arange(length, device=scores.device)[None, None, :] <= step.positions[:, :, None]
        if index_mask is not None:
            sel = torch.zeros_like(visible)
            n = min(index_mask.shape[-1], length)
            sel[..., :n] = index_mask[..., :n].to(sel.device)
            visible = visible & sel
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.einsum("bhtl,blhd->bthd", probs, v)

    def project_out(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Per-head attention output [B, T, H, v] -> [B, T, D]: the optional output gate, o_proj."""
        if self.spec.output_gate:
            out = out * torch.sigmoid(F.linear(x, self.w["g_proj.weight"]).view_as(out))
        return F.linear(out.flatten(2), self.w["o_proj.weight"], self._bias("o_proj"))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, cache: dict, step: StepInfo,
                index_mask: torch.Tensor | None = None) -> torch.Tensor:
        q_nope, q_pe, _ = self.project_q(x, step)
        self.write_cache(cache, step, self.project_kv(x, step))
        return self.project_out(x, self.attend(q_nope, q_pe, cache, step, index_mask))
