"""DeepSeek-V4 attention prologue block and the CSA indexer's query RoPE block
(sdk/blocks/dsv4_prologue.py) on the CPU: reference = emulation, ragged positions through the
host's cos / sin, no RoPE, bad configs, compile checks (the chain prologue -> core -> combine
against the model's attention is in test_dsv4_block.py; the indexer's queries inside the whole
CSA sublayer against the model in test_dsv4_layer.py)."""
import pytest
import torch

from sdk.blocks.dsv4_prologue import (DSV4IndexQBlock, DSV4IndexQConfig, DSV4PrologueBlock, DSV4PrologueConfig,
                                      dsv4_index_q_compile_cases, dsv4_prologue_compile_cases)
from sdk.errors import UnsupportedConfigError


def inputs(block, seed=0):
    c = block.config
    g = torch.Generator().manual_seed(seed)
    M, H, HD = block.m, c.heads, c.head_dim
    ang = torch.randn(M, max(c.rope // 2, 1), generator=g) * 3
    return {"q_raw": torch.randn(M, H, HD, generator=g).to(torch.bfloat16) * 4,
            "kv_raw": torch.randn(M, HD, generator=g).to(torch.bfloat16),
            "kv_norm": (1 + 0.1 * torch.randn(HD, generator=g)).to(torch.bfloat16),
            "cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16),
            "q": torch.full((c.batch, c.tokens, H, HD), float("nan")).to(torch.bfloat16),
            "new_kv": torch.full((c.batch, c.tokens, HD), float("nan")).to(torch.bfloat16)}


@pytest.mark.parametrize("kw", [dict(heads=8, batch=3, tokens=2), dict(heads=2, head_dim=128, rope=0, batch=2),
                                dict(heads=9, head_dim=64, rope=64)])
def test_reference_equals_emulation(kw):
    block = DSV4PrologueBlock(DSV4PrologueConfig(**kw))
    t = inputs(block)
    want = block.reference(**t)
    for tile in range(block.num_tiles()):
        block.emulate_tile(t, tile)
    assert torch.equal(t["q"], want["q"]) and torch.equal(t["new_kv"], want["new_kv"])
    assert torch.isfinite(t["q"].float()).all() and torch.isfinite(t["new_kv"].float()).all()
    # unit rms before the rope (rope is a rotation: the norm of each row is kept) - a sanity
    # bound on what the normalisation produced
    rms = t["q"].float().pow(2).mean(-1).sqrt()
    assert ((rms - 1).abs() < 2e-2).all()


def test_v41_queries_skip_the_head_norm():
    """q_norm=False (V4.1: no per-head q RMSNorm): q is the rope of q_raw alone - the model's
    (DSV4AttentionReference with q_head_norm=False uses the same Rope); the KV head keeps its norm."""
    from sdk.reference.dsv4_attention import Rope
    v4 = DSV4PrologueBlock(DSV4PrologueConfig(heads=4, head_dim=128, batch=2, tokens=2))
    v41 = DSV4PrologueBlock(DSV4PrologueConfig(heads=4, head_dim=128, batch=2, tokens=2, q_norm=False))
    t = inputs(v41)
    t["q_raw"] = t["q_raw"] * 3                 # rms 3: a norm would show
    got = v41.reference(**t)
    for tile in range(v41.num_tiles()):
        v41.emulate_tile(t, tile)
    assert torch.equal(t["q"], got["q"]) and torch.equal(t["new_kv"], got["new_kv"])
    want = Rope.apply(t["q_raw"], t["cos"][:, None], t["sin"][:, None]).view(got["q"].shape)
    assert torch.equal(got["q"], want)
    assert torch.equal(got["new_kv"], v4.reference(**t)["new_kv"])
    assert (got["q"].float().pow(2).mean(-1).sqrt() > 2).all()


@pytest.mark.parametrize("kw", [dict(head_dim=96), dict(rope=65), dict(rope=1024), dict(heads=0)])
def test_unsupported_configs_fail_loudly(kw):
    with pytest.raises(UnsupportedConfigError):
        DSV4PrologueBlock(DSV4PrologueConfig(**kw))


@pytest.mark.parametrize("kw", [dict(heads=8, head_dim=64, batch=3, tokens=2), dict(heads=4, rope=0)])
def test_index_q_is_the_models_rope(kw):
    """The indexer's queries: the model's Rope.apply per token (no norm), rows unchanged in norm."""
    from sdk.reference.dsv4_attention import Rope
    block = DSV4IndexQBlock(DSV4IndexQConfig(**kw))
    c = block.config
    t = inputs(DSV4PrologueBlock(DSV4PrologueConfig(heads=c.heads, head_dim=c.head_dim, rope=c.rope, batch=c.batch,
                                                    tokens=c.tokens)))
    want = block.reference(**t)["q"]
    for tile in range(block.num_tiles()):
        block.emulate_tile(t, tile)
    assert torch.equal(t["q"], want)
    q_raw = t["q_raw"].view(c.batch, c.tokens, c.heads, c.head_dim)
    if c.rope:
        model = torch.stack([torch.stack([Rope.apply(q_raw[b, tq], t["cos"][b * c.tokens + tq][None],
                                                     t["sin"][b * c.tokens + tq][None]) for tq in range(c.tokens)])
                             for b in range(c.batch)])
        assert torch.equal(want, model)
        assert not torch.equal(want, q_raw)
        assert torch.allclose(want.float().norm(dim=-1), q_raw.float().norm(dim=-1), rtol=1e-2)
    else:
        assert torch.equal(want, q_raw)


def test_registered():
    from sdk.blocks import builtin_blocks
    assert DSV4PrologueBlock in builtin_blocks() and DSV4IndexQBlock in builtin_blocks()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_compile(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    for block in dsv4_prologue_compile_cases() + dsv4_index_q_compile_cases():
        standalone(block, arch)
