"""YaRN RoPE scaling for MLA, DeepSeek-V3 style, on the CPU.

- MLAReference with a YaRN rope against transformers' DeepseekV3Attention (its rotary embedding
  and its `yarn_apply_mscale` softmax scale), fp32, positions far beyond the original context;
  these DeepSeek-V3 pieces are the same code in transformers 5.17 and 5.24, so the test runs on both.
- rope_cos_sin without scaling: bit-identical to the formula before YaRN existed (frozen copy), and
  rope_inv_freq's YaRN equal to DeepSeek-V4's former private copy (frozen), bit for bit.
- The MLA sublayer program (sdk/megakernel/mla_layer.py) with YaRN through the PyVM against
  MLAReference.forward: the host tables and the decode's scale carry YaRN.
- Unsupported rope types raise UnsupportedConfigError naming them.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from sdk.errors import UnsupportedConfigError
from sdk.megakernel.mla_attention import MLAAttentionConfig
from sdk.megakernel.mla_layer import MLALayerConfig, build_program, make_inputs, make_weights, reference
from sdk.reference.common import StepInfo, rope_cos_sin, rope_inv_freq
from sdk.reference.mla import MLAReference
from sdk.spec import MLASpec, RopeSpec
from test_mla_layer import pyvm_resid


def yarn(**extra) -> dict:
    params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, **extra}
    return {k: v for k, v in params.items() if v is not None}


def items(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def mla(rope: RopeSpec | None, **kw) -> MLASpec:
    return MLASpec(**{"num_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                      "qk_rope_head_dim": rope.dim if rope else 8, "v_head_dim": 8, "rope": rope, **kw})


def reference_of(spec: MLASpec, weights=None) -> MLAReference:
    return MLAReference(None, SimpleNamespace(attention=spec), weights or {})


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def steps(start: int, t: int, batch: int) -> StepInfo:
    s = torch.full((batch,), start, dtype=torch.long)
    return StepInfo(start=s, positions=s[:, None] + torch.arange(t), input_ids=torch.zeros(batch, t, dtype=torch.long))


# -------------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("interleave,rope_dim,mscale_all_dim", [(True, 16, 1.0), (False, 32, 0.707),
                                                                  (True, 32, 0.707), (False, 16, None)])
def test_mla_reference_equals_deepseek_v3_attention_with_yarn(interleave, rope_dim, mscale_all_dim):
    """A 256-token sequence (4x the original 64) in transformers at once; the reference prefills
    200 tokens, then decodes the last 56 one at a time from its latent cache. Every output within
    1e-5 relative. mscale_all_dim 0.707 makes the cos/sin attention factor != 1 (1.037);
    None: no softmax-scale correction, attention factor mscale(4) = 1.139."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    params = yarn(mscale=1.0 if mscale_all_dim else None, mscale_all_dim=mscale_all_dim)
    config = DeepseekV3Config(vocab_size=64, hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim,
                              v_head_dim=24, max_position_embeddings=256, num_hidden_layers=1,
                              rope_interleave=interleave, rope_parameters={"rope_theta": 10000.0, **params})
    config._attn_implementation = "eager"
    torch.manual_seed(int(1000 * (mscale_all_dim or 0)) + rope_dim)
    hf = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            torch.nn.init.normal_(p, std=0.15 if "norm" in name else p.shape[-1] ** -0.5)
            if name.endswith("layernorm.weight"):
                p += 1
    weights = {name: p.detach() for name, p in hf.named_parameters()}   # = the reference's local names

    rope_params = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    assert rope_params == params, "transformers changed the rope parameters"
    spec = MLASpec(num_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim,
                   v_head_dim=24, latent_norm_eps=config.rms_norm_eps,
                   rope=RopeSpec(dim=rope_dim, theta=10000.0, interleaved=interleave, scaling=items(rope_params)))
    ref = reference_of(spec, weights)
    assert ref.scale == hf.scaling

    b, n, prefill = 2, 256, 200
    x = torch.randn(b, n, 128)
    positions = torch.arange(n)[None].expand(b, n)
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None].expand(b, 1, n, n)
    with torch.no_grad():
        want, _ = hf(x, DeepseekV3RotaryEmbedding(config)(x, positions), causal)
        cache = ref.new_cache(b, n, "cpu", torch.float32)
        got = [ref.forward(x[:, :prefill], cache, steps(0, prefill, b))]
        got += [ref.forward(x[:, p:p + 1], cache, steps(p, 1, b)) for p in range(prefill, n)]
    got = torch.cat(got, dim=1)
    err = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert err <= 1e-5, f"max relative error {err:.2e}"


# -------------------------------------------------------------------------------- rope tables
def old_rope_cos_sin(rope: RopeSpec, positions, dtype):
    """rope_cos_sin as it was before YaRN (frozen copy)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rope.dim, 2, dtype=torch.int64,
                                                  device=positions.device).float() / rope.dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def old_dsv4_rope_inv_freq(rope: RopeSpec):
    """DeepSeek-V4's rope_inv_freq before it moved to sdk/reference/common.py (frozen copy)."""
    params = dict(rope.scaling)
    kind = params.get("rope_type", "default")
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = params["factor"]
    orig = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


@pytest.mark.parametrize("dim,theta", [(64, 10000.0), (16, 50000.0), (4, 100.0), (128, 1e6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cos_sin_without_scaling_is_bit_identical_to_before(dim, theta, dtype):
    g = torch.Generator().manual_seed(dim)
    positions = torch.randint(0, 200_000, (3, 7), generator=g)
    positions[0, 0] = 0
    for interleaved in (False, True):
        rope = RopeSpec(dim=dim, theta=theta, interleaved=interleaved)
        for new, old in zip(rope_cos_sin(rope, positions, dtype), old_rope_cos_sin(rope, positions, dtype)):
            assert new.dtype == old.dtype and torch.equal(new, old)


@pytest.mark.parametrize("params", [yarn(), yarn(mscale=1.0, mscale_all_dim=0.707, beta_fast=16),
                                    yarn(attention_factor=1.0, factor=16.0, original_max_position_embeddings=4096),
                                    {"rope_type": "default"}])
def test_rope_inv_freq_equals_deepseek_v4s_former_copy(params):
    rope = RopeSpec(dim=64, theta=160000.0, interleaved=True, scaling=items(params))
    (new, new_factor), (old, old_factor) = rope_inv_freq(rope), old_dsv4_rope_inv_freq(rope)
    assert torch.equal(new, old) and new_factor == old_factor


def test_yarn_tables_carry_the_attention_factor():
    """cos^2 + sin^2 = attention_factor^2; the fastest dim keeps its frequency (it turns > 32 times
    over the original 64 positions), the slow ones are divided by the factor."""
    rope = RopeSpec(dim=32, theta=10000.0, scaling=items(yarn(mscale=1.0, mscale_all_dim=0.707)))
    inv_freq, factor = rope_inv_freq(rope)
    want = (0.1 * math.log(4.0) + 1) / (0.1 * 0.707 * math.log(4.0) + 1)
    assert factor == pytest.approx(want, rel=1e-12) and factor > 1.03
    plain, _ = rope_inv_freq(RopeSpec(dim=32, theta=10000.0))
    assert inv_freq[0] == plain[0] and torch.allclose(inv_freq[-2:], plain[-2:] / 4.0)
    cos, sin = rope_cos_sin(rope, torch.arange(300)[None], torch.float32)
    assert torch.allclose(cos.pow(2) + sin.pow(2), torch.full_like(cos, factor ** 2), rtol=1e-5)


def test_mscale_is_derived_from_the_scaling():
    """RopeSpec.mscale: yarn_mscale(factor, mscale_all_dim), else 1; MLA's scale times its square."""
    assert RopeSpec(dim=16, theta=1e4).mscale == 1.0
    assert RopeSpec(dim=16, theta=1e4, scaling=items(yarn())).mscale == 1.0
    rope = RopeSpec(dim=16, theta=1e4, scaling=items(yarn(mscale=1.0, mscale_all_dim=1.0)))
    assert rope.mscale == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-12)
    s = mla(rope)
    assert reference_of(s).scale == pytest.approx((8 + 16) ** -0.5 * rope.mscale ** 2, rel=1e-12)
    assert reference_of(mla(rope, softmax_scale=0.1)).scale == pytest.approx(0.1 * rope.mscale ** 2, rel=1e-12)


# ---------------------------------------------------------------------------- the sublayer program
@pytest.mark.parametrize("mode,mscale_all_dim", [("interleaved", 0.707), ("halves", 1.0)])
def test_layer_program_with_yarn_equals_mla_reference_forward(mode, mscale_all_dim):
    """Positions up to 299 (original context 64): the YaRN tables and the mscale ** 2 scale reach
    the program; the result differs from the unscaled layer's by far more than the tolerance."""
    attn = MLAAttentionConfig(heads=4, batch=2, q_tokens=1, num_pages=16, max_seq_len=512, num_splits=3)
    scaling = items(yarn(mscale=1.0, mscale_all_dim=mscale_all_dim))
    cfg = MLALayerConfig(attn, hidden=1024, q_lora=512, rope_mode=mode, rope_scaling=scaling)
    prog = build_program(cfg)
    dec = next(op.block for op in prog.ops if op.label == "attn.decode")
    assert dec.config.softmax_scale * dec.config.scale_factor == reference_of(cfg.spec).scale
    assert cfg.rope.mscale > 1.09 and reference_of(cfg.spec).scale == pytest.approx(
        attn.softmax_scale * cfg.rope.mscale ** 2, rel=1e-12)
    w = make_weights(cfg, seed=2)
    inp = make_inputs(cfg, [300, 280], seed=3)
    want = reference(cfg, w, inp)
    x = inp["x"].float()
    for seed in (0, 1):
        err = rel(pyvm_resid(prog, w, inp, seed) - x, want - x)
        assert err < 2e-2, f"interleaving {seed}: {err}"
    plain = MLALayerConfig(attn, hidden=1024, q_lora=512, rope_mode=mode)
    unscaled = reference(plain, w, make_inputs(plain, [300, 280], seed=3))
    assert rel(unscaled - x, want - x) > 0.1, "YaRN did not change the layer"


# ------------------------------------------------------------------------------ unsupported
@pytest.mark.parametrize("kind", ["llama3", "dynamic", "longrope"])
def test_unsupported_rope_types_are_named(kind):
    rope = RopeSpec(dim=8, theta=1e4, scaling=items({"rope_type": kind, "factor": 8.0}))
    with pytest.raises(UnsupportedConfigError, match=kind):
        reference_of(mla(rope))
    with pytest.raises(UnsupportedConfigError, match=kind):
        MLALayerConfig(MLAAttentionConfig(heads=4), rope_scaling=rope.scaling)


def test_incomplete_or_misplaced_yarn_is_named():
    rope = RopeSpec(dim=8, theta=1e4, scaling=(("factor", 40.0), ("rope_type", "yarn")))
    with pytest.raises(UnsupportedConfigError, match="original_max_position_embeddings"):
        reference_of(mla(rope))
    with pytest.raises(UnsupportedConfigError, match="rope_scaling"):
        MLALayerConfig(MLAAttentionConfig(heads=4), rope_mode="none", rope_scaling=items(yarn()))
