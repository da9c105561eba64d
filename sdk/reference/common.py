"""Shared pieces of the reference decode: the step descriptor and small math helpers.

The reference is the SDK's definition of every model: plain PyTorch, written for clarity, and
proven token-for-token equal to transformers on tiny configs (tests/test_reference_vs_hf.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import yarn_mscale


@dataclass
class StepInfo:
    """What one decode call feeds every layer.

    start      LongTensor [B]: tokens already in each sequence's caches before this call (ragged).
    positions  LongTensor [B, T]: absolute position of each new token, start[:, None] + arange(T).
    input_ids  LongTensor [B, T]: the new tokens (hash routing and similar features read them).
    extent     the cache positions attention reads: None = up to the longest sequence after this
               call (read from the device: a host sync); an int (the built max_seq_len) keeps
               every shape of the step static, as a CUDA graph needs (ReferenceModel.capturable).
    """
    start: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor
    extent: int | None = None

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def cache_extent(self) -> int:
        """How many cache positions attention reads (the positions past a sequence are masked)."""
        return self.extent if self.extent is not None else int((self.start + self.num_tokens).max())


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
        raise UnsupportedConfigError(f"unsupported activation {name!r}; supported: "
                                     f"{sorted(ACTIVATIONS)} (and, gated MLPs only, {list(GATED)})") from None


# Gated activations that are not act(gate) * up: they take the pair (gate, up) whole.
GATED = ("situ",)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Kimi K3's SiTU [MODEL-FACTS F1, F7]:
        beta * tanh(gate / beta) * sigmoid(gate) * linear_beta * tanh(up / linear_beta)
    in fp32, rounded once to gate's dtype (the result is the only rounding). Both tanh soft-caps are
    odd and bounded: |out| < beta * linear_beta = 100 at K3's betas (4, 25)."""
    g, u = gate.float(), up.float()
    out = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", limit: float | None = None,
           beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """The gated MLP activation: act(gate) * up, with the DeepSeek-V4 / GLM clamp (gate <= limit,
    |up| <= limit) when given; act = "situ" is Kimi K3's SiTU with its two betas (`situ`; the
    betas are read for "situ" only)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    if act == "situ":
        return situ(gate, up, beta, linear_beta)
    return activation(act)(gate) * up


def near_tie_swaps(row: torch.Tensor, got: set, k: int, rtol: float, what: str = "") -> int:
    """How many entries of `got` (a selection of k indices of the score row) are not in the
    row's own top-k, after checking every entry only one of the two selected scores within
    rtol x max |row| of the k-th score - a near-tie that another arithmetic may order the other
    way (the indexers' bf16 products on the device vs an fp32 reference). AssertionError if not."""
    want = set(row.topk(k).indices.tolist())
    if got == want:
        return 0
    kth = row.topk(k).values[-1]
    tol = rtol * row.abs().max()
    for m in got ^ want:
        if abs(float(row[m] - kth)) > tol:
            raise AssertionError(f"{what}entry {m} (score {float(row[m]):.6g}) is no near-tie of the "
                                 f"top-{k} (k-th score {float(kth):.6g}, tolerance {float(tol):.3g})")
    return len(got - want)


def rope_inv_freq(rope, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] fp32, attention factor) of a `RopeSpec`, as transformers'
    `_compute_default_rope_parameters` / `_compute_yarn_parameters` compute them (the same code in
    5.17 and 5.24); the attention factor multiplies cos and sin. Rope types "default" and "yarn";
    any other raises UnsupportedConfigError naming it.

    YaRN keys read from `rope.scaling`: factor, original_max_position_embeddings (both required:
    transformers falls back to config.max_position_embeddings, which a RopeSpec does not carry, so
    the spec builder must fill them), attention_factor, mscale, mscale_all_dim, beta_fast (32),
    beta_slow (1), truncate (True; DeepSeek-V4's spec builder never keeps it, as transformers reads
    V4's from the top level of its per-layer-type dict, where it is absent)."""
    params = dict(rope.scaling)
    kind, dim, base = rope.rope_type, rope.dim, rope.theta
    # arange in int64, then float: transformers' values, and this function's before YaRN existed
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise UnsupportedConfigError(f"rope scaling: unsupported rope_type {kind!r} (supported: default, yarn)")
    missing = [k for k in ("factor", "original_max_position_embeddings") if not params.get(k)]
    if missing:
        raise UnsupportedConfigError(f"yarn rope scaling {params} lacks {', '.join(missing)}")
    factor, orig = params["factor"], params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        """The dimension whose wavelength makes `rotations` turns over the original context."""
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                  # transformers' guard against a zero-width ramp
    # dims below `low` keep their frequency (extrapolate), above `high` are divided by factor
    # (interpolate), linear in between
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(rope, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, rope.dim] for integer positions [B, T] (halves layout: cat(freqs, freqs)),
    YaRN frequencies and attention factor included (rope_inv_freq), cast to `dtype` last - what
    transformers' rotary embeddings return."""
    inv_freq, attention_factor = rope_inv_freq(rope, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


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
