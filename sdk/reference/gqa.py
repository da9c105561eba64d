"""Reference grouped-query attention (GQA) decode with RoPE: the plain attention kind.

    q, k, v = q_proj(x), k_proj(x), v_proj(x)            num_heads / num_kv_heads heads of head_dim
    q, k    = rope(q), rope(k) at absolute positions       halves layout (or interleaved pairs)
    out     = o_proj(softmax(q k^T / sqrt(head_dim)) v)    causal; each kv head serves num_heads/num_kv_heads q heads

Local weight names: q_proj.weight [H*hd, D], k_proj.weight [Hkv*hd, D], v_proj.weight [Hkv*hd, D],
o_proj.weight [D, H*hd]. Cache: {"k", "v"}: [B, max_seq_len, Hkv, hd], post-RoPE keys; token p of
sequence b at row p (ragged lengths per sequence). No biases, no sliding window, no rope scaling
(those raise `UnsupportedConfigError` where a spec asks for them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import GQASpec, LayerSpec, ModelSpec
from .common import StepInfo, apply_rope, rope_cos_sin


class GQAReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        s: GQASpec = layer.attention
        if s.num_heads % s.num_kv_heads:
            raise UnsupportedConfigError(f"layer {layer.index}: {s.num_heads} heads are not a multiple of "
                                         f"{s.num_kv_heads} kv heads")
        if s.rope is not None and s.rope.scaling:
            raise UnsupportedConfigError(f"layer {layer.index}: GQA rope scaling {dict(s.rope.scaling)}")
        self.spec, self.w = s, weights

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: GQASpec = layer.attention
        d, q, kv = model.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return {"q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d),
                "o_proj.weight": (d, q)}

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        s = self.spec
        shape = (batch, max_seq_len, s.num_kv_heads, s.head_dim)
        return {"k": torch.zeros(shape, device=device, dtype=dtype), "v": torch.zeros(shape, device=device, dtype=dtype)}

    def forward(self, x: torch.Tensor, cache: dict, step: StepInfo) -> torch.Tensor:
        s, w = self.spec, self.w
        b, t, _ = x.shape
        q = F.linear(x, w["q_proj.weight"]).view(b, t, s.num_heads, s.head_dim)
        k = F.linear(x, w["k_proj.weight"]).view(b, t, s.num_kv_heads, s.head_dim)
        v = F.linear(x, w["v_proj.weight"]).view(b, t, s.num_kv_heads, s.head_dim)
        if s.rope is not None:
            cos, sin = rope_cos_sin(s.rope, step.positions, x.dtype)
            q, k = apply_rope(q, cos, sin, s.rope.interleaved), apply_rope(k, cos, sin, s.rope.interleaved)
        rows = torch.arange(b, device=x.device)[:, None]
        cache["k"][rows, step.positions] = k
        cache["v"][rows, step.positions] = v
        length = int(step.positions.max()) + 1
        keys = cache["k"][:, :length].repeat_interleave(s.num_heads // s.num_kv_heads, dim=2)
        vals = cache["v"][:, :length].repeat_interleave(s.num_heads // s.num_kv_heads, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q.float(), keys.float()) * s.head_dim ** -0.5
        visible = torch.arange(length, device=x.device)[None, None, :] <= step.positions[:, :, None]  # [B, T, S]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vals.float()).to(x.dtype)
        return F.linear(out.reshape(b, t, -1), w["o_proj.weight"])
