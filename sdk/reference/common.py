"""Shared pieces of the reference decode: the step descriptor and small math helpers.

The reference is the SDK's definition of every model: plain PyTorch, written for clarity, and
proven token-for-token equal to transformers on tiny configs (tests/test_reference_vs_hf.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepInfo:
    """What one decode call feeds every layer.

    start      LongTensor [B]: tokens already in each sequence's caches before this call (ragged).
    positions  LongTensor [B, T]: absolute position of each new token, start[:, None] + arange(T).
    input_ids  LongTensor [B, T]: the new tokens (hash routing and similar features read them).
    """
    start: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, the result cast back to x's dtype before the weight (as transformers does)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(dtype) if weight is None else weight * h.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        from ..errors import UnsupportedConfigError
        raise UnsupportedConfigError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", limit: float | None = None) -> torch.Tensor:
    """act(gate) * up, with the DeepSeek-V4 / GLM clamp (gate <= limit, |up| <= limit) when given."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return activation(act)(gate) * up


def rope_cos_sin(rope, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, rope.dim] for integer positions [B, T] (halves layout: cat(freqs, freqs))."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.int64,
                                                  device=positions.device).float() / rope.dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, T, (H,) d] by cos/sin [B, T, d]. Interleaved pairs (2i, 2i+1) are first
    regrouped into halves, as transformers' DeepSeek `apply_rotary_pos_emb_interleave` does."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    if interleaved:
        *lead, d = x.shape
        x = x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
