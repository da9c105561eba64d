"""Reference Kimi Delta Attention (KDA) decode: kimi_linear's and glm5_next's linear attention,
plus Kimi K3's full-rank output gate.

Follows transformers 5.24 `KimiLinearDeltaAttention` (models/kimi_linear) and
`Glm5NextTextLinearAttention` / `Glm5NextTextForgetGate` / `Glm5NextTextRMSNormGated`
(models/glm5_next). Per token, per head h (K = V = head_dim):

    q, k, v  = SiLU(causal depthwise conv_K(cat(q_proj x, k_proj x, v_proj x)))   (one conv, 3*H*K channels)
    g        = f_b_proj(f_a_proj x) + dt_bias                                       [H, K], fp32
    log decay a = -exp(A_log[h]) * softplus(g)                 gate_kind "softplus" (kimi_linear)
                = gate_lower_bound * sigmoid(exp(A_log[h]) * g) gate_kind "sigmoid" (glm5_next, Kimi K3; bound -5)
    beta     = sigmoid(b_proj x)                                                     [H]
    q, k     = l2norm(q), l2norm(k)   (x / sqrt(sum x^2 + 1e-6), fp32);  q *= K^-0.5
    S        = S * exp(a)[:, None]              (per key channel decay; S is [K, V] per head, fp32)
    S        = S + k (beta * (v - k^T S))       (delta rule)
    o        = q^T S                                                                 [V]
    out      = o_proj( RMSNorm(o) * norm_w * sigmoid(gate) ),  gate = g_b_proj(g_a_proj x)  (low rank)
                                                               or g_proj x               (full rank, Kimi K3)

The recurrence runs token by token (the definition), so a T-token call equals T single steps
exactly; transformers' chunked prefill agrees with it to fp32 rounding.

Spec fields (`KDASpec`): num_heads, head_dim, conv_kernel, gate_kind ("softplus" | "sigmoid"),
gate_lower_bound (the sigmoid kind's bound, glm5_next `linear_lower_bound`, default -5),
a_log_flat (A_log shaped [H] as in glm5_next, else [1, 1, H, 1] as in kimi_linear), gate_rank
(rank of f_a/f_b and g_a/g_b; 0 = head_dim, what both transformers models use),
output_gate_full_rank (Kimi K3: g_proj [H*K, D]), conv_activation ("silu": the HF hidden_act).
The output norm's eps is the model's `norm_eps` (both models use rms_norm_eps).

Local weight names (= the HF names under `self_attn.`), C = num_heads * head_dim, r = gate rank:
    q_proj.weight, k_proj.weight, v_proj.weight   [C, D]
    conv1d.weight                                 [3C, 1, conv_kernel]   (channels: q, then k, then v; no bias)
    forget_gate.f_a_proj.weight [r, D], forget_gate.f_b_proj.weight [C, r]
    forget_gate.dt_bias [C]  (fp32 in both checkpoints)
    forget_gate.A_log   [1, 1, H, 1]  or [H] when spec.a_log_flat
    b_proj.weight [H, D]
    g_a_proj.weight [r, D], g_b_proj.weight [C, r]    or   g_proj.weight [C, D] when output_gate_full_rank
    o_norm.weight [head_dim]
    o_proj.weight [D, C]

Cache: {"conv": [B, 3C, conv_kernel - 1] the last pre-conv inputs, model dtype (zeros = the conv's
left padding), "state": [B, H, K, V] fp32 recurrent state}. Both are updated in place. Ragged
batches need nothing special: every sequence carries its own state, and positions are not read.

Not implemented: the serving formats (BF16 state pool [slot, H, V, K], FP8 projections); padded
tokens inside a sequence (transformers zeroes them with the attention mask; the SDK never feeds
padding, ragged prompts are prefilled one sequence at a time).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import KDASpec, LayerSpec, ModelSpec
from .common import StepInfo, activation

GATE_KINDS = ("softplus", "sigmoid")
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    # sqrt(sum + eps), not F.normalize's max(norm, eps): what FLA's kernels and transformers do
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_log_decay(s: KDASpec, g: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """g [..., H, K] (fp32, dt_bias already added), A_log (any shape with H elements) -> log decay."""
    decay_rate = a_log.float().reshape(-1, 1).exp()  # [H, 1]
    if s.gate_kind == "softplus":
        # log(1 + exp(g)) with transformers' overflow guard (identity above 20)
        return -decay_rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    if s.gate_kind == "sigmoid":
        return s.gate_lower_bound * torch.sigmoid(decay_rate * g)
    raise UnsupportedConfigError(f"KDA gate_kind {s.gate_kind!r} is not implemented; supported: {GATE_KINDS}")


def kda_recurrence(q, k, v, log_decay, beta, state):
    """The delta rule, token by token. q, k, v, log_decay [B, T, H, K|V]; beta [B, T, H];
    state [B, H, K, V] fp32, updated in place. Returns o [B, T, H, V] fp32."""
    q, k, v, log_decay, beta = (t.float() for t in (q, k, v, log_decay, beta))
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    s = state.float()
    out = []
    for t in range(q.shape[1]):
        s = s * log_decay[:, t, :, :, None].exp()
        kv_mem = (s * k[:, t, :, :, None]).sum(dim=-2)                   # k^T S: [B, H, V]
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append((s * q[:, t, :, :, None]).sum(dim=-2))
    state.copy_(s)
    return torch.stack(out, dim=1)


class KDAReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        s: KDASpec = layer.attention
        if s.gate_kind not in GATE_KINDS:
            raise UnsupportedConfigError(f"KDA gate_kind {s.gate_kind!r} is not implemented; supported: {GATE_KINDS}")
        self.spec, self.w, self.eps = s, weights, model.norm_eps
        self.act = activation(s.conv_activation)

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: KDASpec = layer.attention
        d, h, kd = model.hidden_size, s.num_heads, s.head_dim
        c, r = h * kd, s.gate_rank or kd
        out = {"q_proj.weight": (c, d), "k_proj.weight": (c, d), "v_proj.weight": (c, d),
               "conv1d.weight": (3 * c, 1, s.conv_kernel),
               "forget_gate.f_a_proj.weight": (r, d), "forget_gate.f_b_proj.weight": (c, r),
               "forget_gate.dt_bias": (c,),
               "forget_gate.A_log": (h,) if s.a_log_flat else (1, 1, h, 1),
               "b_proj.weight": (h, d)}
        if s.output_gate_full_rank:
            out["g_proj.weight"] = (c, d)
        else:
            out["g_a_proj.weight"] = (r, d)
            out["g_b_proj.weight"] = (c, r)
        out["o_norm.weight"] = (kd,)
        out["o_proj.weight"] = (d, c)
        return out

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        s = self.spec
        c = s.num_heads * s.head_dim
        return {"conv": torch.zeros(batch, 3 * c, s.conv_kernel - 1, device=device, dtype=dtype),
                "state": torch.zeros(batch, s.num_heads, s.head_dim, s.head_dim, device=device, dtype=torch.float32)}

    def short_conv(self, qkv: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, 3C] -> act(causal depthwise conv) [B, T, 3C]; conv_state [B, 3C, K-1] rolls in place."""
        weight = self.w["conv1d.weight"]
        t, keep = qkv.shape[1], conv_state.shape[-1]
        full = torch.cat([conv_state.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)   # [B, 3C, K-1+T]
        if keep:
            conv_state.copy_(full[..., -keep:])
        # the conv runs in the weight's dtype (glm5_next keeps it fp32), as transformers does
        out = F.conv1d(full.to(weight.dtype), weight, groups=weight.shape[0])[..., -t:]
        return self.act(out).to(qkv.dtype).transpose(1, 2)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.output_gate_full_rank:
            return F.linear(x, self.w["g_proj.weight"])
        return F.linear(F.linear(x, self.w["g_a_proj.weight"]), self.w["g_b_proj.weight"])

    def forward(self, x: torch.Tensor, cache: dict, step: StepInfo) -> torch.Tensor:
        s, w = self.spec, self.w
        b, t, _ = x.shape
        heads = (b, t, s.num_heads, s.head_dim)
        qkv = torch.cat([F.linear(x, w["q_proj.weight"]), F.linear(x, w["k_proj.weight"]),
                         F.linear(x, w["v_proj.weight"])], dim=-1)
        q, k, v = (y.reshape(heads) for y in self.short_conv(qkv, cache["conv"]).chunk(3, dim=-1))
        g = F.linear(F.linear(x, w["forget_gate.f_a_proj.weight"]), w["forget_gate.f_b_proj.weight"])
        g = (g.float() + w["forget_gate.dt_bias"].float()).view(heads)
        log_decay = kda_log_decay(s, g, w["forget_gate.A_log"])
        beta = torch.sigmoid(F.linear(x, w["b_proj.weight"]))
        o = kda_recurrence(q, k, v, log_decay, beta, cache["state"]).to(x.dtype)
        # gated RMSNorm, strictly fp32 (transformers' RMSNormGated does not round before the weight)
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * w["o_norm.weight"].float()
        h = h * torch.sigmoid(self.output_gate(x).view(heads).float())
        return F.linear(h.to(x.dtype).reshape(b, t, -1), w["o_proj.weight"])
