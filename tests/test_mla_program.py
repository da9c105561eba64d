"""MLA attention as megakernel instructions (sdk/megakernel/mla_attention.py) on the CPU: the
program's instruction stream through the PyVM, in several SM interleavings, equals the expanded
(non-absorbed) fp32 attention of sdk/reference/mla.py; the GPU twin is in tests/gpu/test_mla_gpu.py."""
import pytest

from sdk.megakernel.mla_attention import MLAAttentionConfig, build_program, make_inputs, make_weights, reference
from sdk.megakernel.pyvm import PyVM


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("T,kvd,lens,chunk", [(1, "bf16", [300, 1, 97], 32), (2, "fp8_e4m3", [130, 2, 64], 32),
                                               (1, "bf16", [300, 1, 97], 64)])
def test_program_equals_expanded_reference(T, kvd, lens, chunk):
    cfg = MLAAttentionConfig(heads=4, batch=3, q_tokens=T, num_pages=16, max_seq_len=512, num_splits=3,
                             kv_dtype=kvd, scale_factor=1.1, decode_chunk=chunk, decode_stages=3 if chunk == 32 else 0)
    prog = build_program(cfg)
    assert prog.ops[1].block.config.chunk == chunk
    assert [op.label for op in prog.ops] == ["attn.w_uk", "attn.decode", "attn.combine", "attn.w_uv"]
    weights = make_weights(cfg, seed=1)
    inputs = make_inputs(cfg, lens, seed=2)
    want = reference(cfg, weights, inputs)
    for seed in (0, 1, 2):
        vm, _ = PyVM.from_program(prog, num_sms=7, weights={k: v for k, v in weights.items() if k != "kv_b_proj"})
        for name, x in inputs.items():
            vm.tensors[name].copy_(x)
        vm.tensors["o"].fill_(float("nan"))
        vm.step(seed=seed)
        assert rel_err(vm.tensors["o"], want) < 1e-2, f"interleaving {seed}"


@pytest.mark.parametrize("batch,ctx,kvd,chunk,stages", [(64, 32768, "bf16", 64, 2), (8, 131072, "bf16", 64, 2),
                                                       (1, 131072, "fp8_e4m3", 64, 2), (1, 32768, "bf16", 32, 3),
                                                       (4, 20000, "bf16", 32, 3)])
def test_program_takes_64_token_chunks_for_long_splits(batch, ctx, kvd, chunk, stages):
    """decode_chunk 0 (the default): the attention program's decode takes 64-token chunks in its 2
    stages where choose_chunk does (every split >= 15 chunks of 64: measured on the H200, Kimi K3
    TP8 B=64 32K 675 -> 639 us), else 32 in decode_stages; the MLA sublayer keeps 32 (its ring)."""
    from sdk.blocks.mla_decode import choose_chunk
    from sdk.megakernel.mla_attention import decode_block
    cfg = MLAAttentionConfig(batch=batch, max_seq_len=ctx, num_pages=batch * -(-ctx // 64), kv_dtype=kvd)
    dec = build_program(cfg).ops[1].block
    assert (dec.config.chunk, dec.stages) == (chunk, stages) and chunk == choose_chunk(batch, ctx)
    assert decode_block(cfg).config.chunk == 32          # what the sublayers' add_attention_core builds


@pytest.mark.parametrize("ctx", [512, 131072])
def test_program_with_the_wgmma_decode_tile(ctx):
    """decode_mma="wgmma": the Hopper decode tile inside the program, at 64-token chunks whatever
    the context (the only chunk it takes) in its auto 2 stages; inputs and reference build from
    the same config; the instruction stream (the PyVM emulates the tile, not its MMAs) equals the
    reference at the short context."""
    cfg = MLAAttentionConfig(heads=12, batch=2, max_seq_len=ctx, num_pages=2 * -(-ctx // 64), decode_mma="wgmma")
    dec = build_program(cfg).ops[1].block
    assert (dec.config.mma, dec.config.chunk, dec.stages) == ("wgmma", 64, 2)
    if ctx > 512:
        return
    prog = build_program(cfg)
    weights, inputs = make_weights(cfg, seed=3), make_inputs(cfg, [ctx, 70], seed=4)
    vm, _ = PyVM.from_program(prog, num_sms=5, weights={k: v for k, v in weights.items() if k != "kv_b_proj"})
    for name, x in inputs.items():
        vm.tensors[name].copy_(x)
    vm.tensors["o"].fill_(float("nan"))
    vm.step(seed=0)
    assert rel_err(vm.tensors["o"], reference(cfg, weights, inputs)) < 1e-2


def test_program_decode_mma_auto(monkeypatch):
    """decode_mma "auto" (the default): the wgmma tile on a Hopper GPU for a bf16 cache at 64-token
    chunks (long splits), else the mma.sync tile - with no GPU, at 32-token chunks, for fp8."""
    import torch
    long = dict(batch=1, max_seq_len=131072, num_pages=2048)
    assert build_program(MLAAttentionConfig(**long)).ops[1].block.config.mma == "warp"        # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert build_program(MLAAttentionConfig(**long)).ops[1].block.config.mma == "wgmma"
    assert build_program(MLAAttentionConfig(**long, kv_dtype="fp8_e4m3")).ops[1].block.config.mma == "warp"
    short = MLAAttentionConfig(batch=1, max_seq_len=4096, num_pages=64)
    assert build_program(short).ops[1].block.config.mma == "warp"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    assert build_program(MLAAttentionConfig(**long)).ops[1].block.config.mma == "warp"


def test_program_rejects_lengths_over_the_built_limit():
    cfg = MLAAttentionConfig(heads=4, batch=1, num_pages=4, max_seq_len=128)
    with pytest.raises(ValueError, match="lens"):
        make_inputs(cfg, [129])


def test_ring_leaves_room_for_the_attention_tile():
    """A streaming GEMV beside the MLA decode tile: the weight ring takes only what the decode
    tile's own pipeline leaves, and a decode tile too large to leave 2 ring stages is a clear
    error naming it (not a launch failure)."""
    from sdk.blocks.base import SCRATCH_WORDS, SMEM_BUDGET, ring_geometry
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.blocks.mla_decode import MLADecodeBlock, MLADecodeConfig
    from sdk.errors import UnsupportedConfigError
    gemv = GemvBlock(GemvConfig(n=7168, k=1536, m=1))
    alone = ring_geometry([gemv])
    small = MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=0.07, stages=2))
    beside = ring_geometry([gemv, small])
    assert beside[0] == alone[0] and beside[1] < alone[1]
    stage, stages, xbytes = beside
    assert stages * stage + xbytes + 4 * SCRATCH_WORDS + small.smem_bytes() <= SMEM_BUDGET
    big = MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=0.07, stages=5))   # 210 KB
    with pytest.raises(UnsupportedConfigError, match="MLADecodeBlock tiles"):
        ring_geometry([gemv, big])
