"""The GQA reference: decode with ragged caches equals full causal attention over each sequence."""
import torch
import torch.nn.functional as F

from sdk.reference.common import StepInfo
from sdk.reference.gqa import GQAReference
from sdk.reference.weights import Prefixed
from sdk.spec import DenseMlpSpec, GQASpec, LayerSpec, ModelSpec, RopeSpec


def make(seed=0):
    attn = GQASpec(num_heads=4, num_kv_heads=2, head_dim=8, rope=RopeSpec(dim=8, theta=10000.0))
    layer = LayerSpec(0, attn, DenseMlpSpec(intermediate_size=8))
    model = ModelSpec(name="t", arch="t", hidden_size=16, vocab_size=10, layers=(layer,))
    g = torch.Generator().manual_seed(seed)
    w = {k: 0.3 * torch.randn(s, generator=g) for k, s in GQAReference.expected_weights(model, layer).items()}
    return GQAReference(model, layer, Prefixed(w, "")), w


def full_attention(x, w, spec):
    """Whole-sequence causal attention with torch's SDPA, RoPE written independently (complex rotation)."""
    t = x.shape[0]
    q = (x @ w["q_proj.weight"].T).view(t, spec.num_heads, spec.head_dim)
    k = (x @ w["k_proj.weight"].T).view(t, spec.num_kv_heads, spec.head_dim)
    v = (x @ w["v_proj.weight"].T).view(t, spec.num_kv_heads, spec.head_dim)
    half = spec.head_dim // 2
    inv = 1.0 / (spec.rope.theta ** (torch.arange(half).float() * 2 / spec.head_dim))
    rot = torch.polar(torch.ones(t, half), torch.arange(t).float()[:, None] * inv)[:, None]

    def rope(z):
        zc = torch.complex(z[..., :half], z[..., half:]) * rot
        return torch.cat([zc.real, zc.imag], dim=-1)

    q, k = rope(q), rope(k)
    rep = spec.num_heads // spec.num_kv_heads
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).reshape(t, -1) @ w["o_proj.weight"].T


def test_ragged_decode_equals_full_causal_attention():
    attn, w = make()
    g = torch.Generator().manual_seed(1)
    lens = [7, 3]
    xs = [torch.randn(n, 16, generator=g) for n in lens]
    cache = attn.new_cache(2, 16, "cpu", torch.float32)
    outs = [[], []]
    # prefill each sequence alone into its rows of the cache, then decode both together
    for b, n in enumerate(lens):
        part = {k: v[b:b + 1] for k, v in cache.items()}
        pre = n - 2
        pos = torch.arange(pre)[None]
        outs[b].append(attn.forward(xs[b][None, :pre], part, StepInfo(torch.tensor([0]), pos, pos))[0])
    for j in range(2):
        start = torch.tensor([n - 2 + j for n in lens])
        x = torch.stack([xs[b][n - 2 + j] for b, n in enumerate(lens)])[:, None]
        y = attn.forward(x, cache, StepInfo(start, start[:, None], start[:, None]))
        for b in range(2):
            outs[b].append(y[b])
    for b in range(2):
        got = torch.cat(outs[b])
        want = full_attention(xs[b], w, attn.spec)
        assert (got - want).abs().max() < 1e-5
