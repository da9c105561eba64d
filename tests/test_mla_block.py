"""MLA decode blocks on the CPU: the chain sdk/reference/mla.py (proven equal to transformers) ->
absorbed form (`absorbed_attention`) -> the blocks' torch twins (`emulate_tile`, the PyVM's view of
the device tiles) on paged, scattered, ragged caches; plus config checks. The device tiles are
compile-checked in tests/test_blocks_compile.py (cases in sdk/compile.py) and run on the GPU in
tests/gpu/test_mla_gpu.py."""
from types import SimpleNamespace

import pytest
import torch

from sdk.blocks.mla_decode import (MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig,
                                   MLAHeadProjBlock, MLAHeadProjConfig, absorb_weights, absorbed_attention,
                                   choose_splits, quantize_kv_fp8)
from sdk.errors import UnsupportedConfigError
from sdk.reference.common import StepInfo
from sdk.reference.mla import MLAReference
from sdk.spec import MLASpec


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- reference -> absorbed form
@pytest.mark.parametrize("rope", [16, 0])
@pytest.mark.parametrize("T", [1, 3])
def test_absorbed_form_equals_reference_attend(rope, T):
    """MLAReference.attend (keys/values expanded through kv_b_proj) == absorbed attention over the
    latent cache with W_UK folded into q and W_UV applied after, on a ragged batch."""
    torch.manual_seed(0)
    H, L, nope, v = 4, 32, 16, 24
    spec = MLASpec(num_heads=H, kv_lora_rank=L, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                   v_head_dim=v, softmax_scale=0.0)
    kv_b = torch.randn(H * (nope + v), L, dtype=torch.float64) * L ** -0.5
    ref = MLAReference(None, SimpleNamespace(attention=spec), {"kv_b_proj.weight": kv_b})
    B, maxlen = 3, 20
    start = torch.tensor([5, 0, 12])
    pos = start[:, None] + torch.arange(T)[None]
    step = StepInfo(start=start, positions=pos, input_ids=torch.zeros(B, T, dtype=torch.long))
    cache = {"latent": torch.randn(B, maxlen, L + rope, dtype=torch.float64)}
    q_nope = torch.randn(B, T, H, nope, dtype=torch.float64)
    q_pe = torch.randn(B, T, H, rope, dtype=torch.float64)
    want = ref.attend(q_nope, q_pe, cache, step)                        # [B, T, H, v]

    w_uk_t, w_uv = absorb_weights(kv_b, H, nope, v)                    # [H, L, nope], [H, v, L]
    q_lat = torch.einsum("bthd,hld->bthl", q_nope, w_uk_t)
    q = torch.cat([q_lat, q_pe], -1)
    lens = start + T
    rows = [cache["latent"][b, :int(lens[b])] for b in range(B)]
    o_lat, _ = absorbed_attention(q, rows, lens, T, H, L, ref.scale)
    got = torch.einsum("bthl,hvl->bthv", o_lat.double(), w_uv)
    # the reference takes its softmax in fp32 (as transformers does), the rest is fp64 here
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_head_proj_block_is_the_absorption():
    torch.manual_seed(1)
    H, L, nope, v, m = 3, 128, 16, 24, 2
    kv_b = torch.randn(H * (nope + v), L)
    w_uk_t, w_uv = absorb_weights(kv_b, H, nope, v)
    blk = MLAHeadProjBlock(MLAHeadProjConfig(heads=H, n=L, k=nope, m=m, y_stride=L + 64, rows_per_tile=64))
    x = torch.randn(m, H, nope).to(torch.bfloat16)
    y = torch.full((m, H, L + 64), float("nan"), dtype=torch.bfloat16)
    t = {"x": x, "w": w_uk_t.to(torch.bfloat16), "y": y}
    for tile in range(blk.num_tiles()):
        blk.emulate_tile(t, tile)
    want = torch.einsum("mhd,hld->mhl", x.float(), w_uk_t.to(torch.bfloat16).float())
    assert rel(t["y"][..., :L], want) < 1e-2
    assert torch.isnan(t["y"][..., L:]).all()          # rope columns of the query are left alone
    assert rel(blk.reference(**{**t, "y": y.clone()})["y"][..., :L], want) < 1e-6


# ---------------------------------------------------------------- paged cache helpers
def make_case(cfg: MLADecodeConfig, lens, seed=0):
    """Random q, a page pool with every sequence's pages scattered at random, the block table."""
    g = torch.Generator().manual_seed(seed)
    blk = MLADecodeBlock(cfg)
    d = blk.d_qk
    B = cfg.batch
    need = [-(-int(x) // cfg.page_size) for x in lens]
    assert sum(need) <= cfg.num_pages
    perm = torch.randperm(cfg.num_pages, generator=g)
    bt = torch.full((B, blk.max_pages), -1, dtype=torch.int32)     # unused entries: invalid ids
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n].int()
        k += n
    pool = torch.randn(cfg.num_pages, cfg.page_size, d, generator=g)
    t = {"q": torch.randn(B, cfg.q_tokens, cfg.heads, d, generator=g).to(torch.bfloat16),
         "block_table": bt, "seq_lens": torch.tensor(lens, dtype=torch.int32)}
    if blk.fp8:
        t["kv"], t["kv_scale"] = quantize_kv_fp8(pool, cfg.scale_group)
    else:
        t["kv"] = pool.to(torch.bfloat16)
    t["o_part"] = torch.full((B, cfg.num_splits, blk.rows, blk.d_v), float("nan"))
    t["lse_part"] = torch.full((B, cfg.num_splits, blk.rows), float("nan"))
    return blk, t


def dense_rows(blk, t):
    return [blk.gather_kv(t, b, 0, int(t["seq_lens"][b])) for b in range(blk.config.batch)]


def run_emulated(blk, t):
    c = blk.config
    for tile in range(blk.num_tiles()):
        blk.emulate_tile(t, tile)
    comb = MLACombineBlock(MLACombineConfig(heads=c.heads, batch=c.batch, q_tokens=c.q_tokens,
                                            d_v=blk.d_v, num_splits=c.num_splits))
    out = {"o_part": t["o_part"], "lse_part": t["lse_part"],
           "out": torch.full((c.batch, c.q_tokens, c.heads, blk.d_v), float("nan"), dtype=torch.bfloat16),
           "lse": torch.full((c.batch, c.q_tokens, c.heads), float("nan"))}
    for tile in range(comb.num_tiles()):
        comb.emulate_tile(out, tile)
    return out


@pytest.mark.parametrize("splits,H,cols,want_cols", [(3, 3, 0, 512), (16, 3, 0, 32), (16, 4, 0, 64), (16, 8, 0, 128),
                                                      (20, 3, 256, 256), (132, 3, 512, 512), (40, 3, 32, 32)])
def test_combine_tilings_cover_every_output_once(splits, H, cols, want_cols):
    """Combine tiles = (sequence, query token, head, column slice): from 16 splits auto takes the
    widest of 128 / 64 / 32 columns that still gives 128 tiles (a batch-1 step's many splits
    spread over many SMs; here 2 x 2 x H rows), whole rows below; every tiling writes each output
    exactly once and equals the reference merge, -inf splits (no visible token) included."""
    B, T, L = 2, 2, 512
    comb = MLACombineBlock(MLACombineConfig(heads=H, batch=B, q_tokens=T, d_v=L, num_splits=splits,
                                            cols_per_tile=cols))
    assert comb.cols_per_tile == want_cols
    assert comb.num_tiles() == B * T * H * (L // want_cols)
    g = torch.Generator().manual_seed(splits)
    o_part = torch.randn(B, splits, T * H, L, generator=g)
    lse_part = torch.randn(B, splits, T * H, generator=g) * 4
    lse_part[:, ::2] = float("-inf")                     # empty splits
    o_part[:, ::2] = 0.0
    t = {"o_part": o_part, "lse_part": lse_part,
         "out": torch.full((B, T, H, L), float("nan"), dtype=torch.bfloat16),
         "lse": torch.full((B, T, H), float("nan"))}
    writes = torch.zeros(B, T, H, L)
    for tile in range(comb.num_tiles()):
        before = t["out"].clone()
        comb.emulate_tile(t, tile)
        writes += (before.isnan() & ~t["out"].isnan()).float()
    assert (writes == 1).all()
    want = comb.reference(o_part=o_part, lse_part=lse_part)
    err = (t["out"].float() - want["out"]).norm() / want["out"].norm()
    assert err < 4e-3, err
    assert torch.allclose(t["lse"], want["lse"], atol=1e-5)


def test_combine_rejects_unsupported_tilings():
    with pytest.raises(UnsupportedConfigError, match="cols_per_tile"):
        MLACombineBlock(MLACombineConfig(heads=2, d_v=512, num_splits=4, cols_per_tile=384))
    with pytest.raises(UnsupportedConfigError, match="d_v"):
        MLACombineBlock(MLACombineConfig(heads=2, d_v=200, num_splits=4))


CASES = [
    # heads, T, rope, splits, page, lens, kv dtype, chunk
    (12, 1, 64, 4, 64, [1, 100, 300], "bf16", 32),
    (6, 2, 64, 3, 16, [2, 65, 257], "bf16", 32),
    (8, 4, 0, 5, 64, [4, 31, 190], "bf16", 64),          # GLM-5.3: NoPE, 512 latent
    (12, 2, 64, 7, 64, [3, 200, 129], "fp8_e4m3", 32),    # more splits than chunks for short rows
    (8, 1, 0, 2, 32, [1, 77], "fp8_e4m3", 16),
    # row groups: 40 heads (2 tiles of 20), 12 heads x 3 tokens (2 of 18, the causal rule across
    # them), 16 x 4 fp8 (2 of 32), 12 x 4 with 16-token chunks
    (40, 1, 64, 3, 64, [1, 100, 300], "bf16", 32),
    (12, 3, 64, 4, 16, [3, 65, 257], "bf16", 32),
    (16, 4, 0, 5, 64, [4, 31, 190], "fp8_e4m3", 64),
    (12, 4, 64, 2, 32, [4, 33], "bf16", 16),
]


@pytest.mark.parametrize("heads,T,rope,splits,page,lens,kvd,chunk,max_rows", [c + (32,) for c in CASES] + [
    (24, 1, 64, 3, 64, [1, 100, 300], "bf16", 16, 16),       # 16-row tiles: 2 groups of 12
    (12, 2, 0, 2, 32, [2, 77], "fp8_e4m3", 16, 16)])
def test_emulated_decode_and_combine_equal_absorbed_attention(heads, T, rope, splits, page, lens, kvd, chunk,
                                                               max_rows):
    cfg = MLADecodeConfig(heads=heads, softmax_scale=192 ** -0.5, scale_factor=1.3, batch=len(lens), q_tokens=T,
                          rope=rope, page_size=page, num_pages=40, max_seq_len=512, num_splits=splits,
                          kv_dtype=kvd, chunk=chunk, max_tile_rows=max_rows)
    blk, t = make_case(cfg, lens)
    want_o, want_lse = absorbed_attention(t["q"], dense_rows(blk, t), t["seq_lens"], T, heads, blk.d_v, blk.scale)
    out = run_emulated(blk, t)
    assert torch.isfinite(t["o_part"]).all()
    assert rel(out["out"], want_o) < 1e-2
    assert torch.allclose(out["lse"], want_lse, atol=1e-4, rtol=1e-4)
    # the block's definition (exact per split) agrees with its chunked twin
    ref = blk.reference(**t)
    assert torch.equal(torch.isinf(ref["lse_part"]), torch.isinf(t["lse_part"]))
    fin = torch.isfinite(ref["lse_part"])
    assert torch.allclose(ref["lse_part"][fin], t["lse_part"][fin], atol=1e-4, rtol=1e-4)
    assert rel(t["o_part"], ref["o_part"]) < 1e-2


def test_fp8_cache_roundtrip_is_close():
    x = torch.randn(5, 64, 576)
    q, s = quantize_kv_fp8(x, 64)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 64, 9)
    back = q.float() * s.repeat_interleave(64, -1)
    assert rel(back, x) < 0.05


def test_causal_among_new_tokens():
    """T=3 new tokens: query 0 must not see tokens 1 and 2 of this step."""
    cfg = MLADecodeConfig(heads=2, softmax_scale=0.1, batch=1, q_tokens=3, rope=0, kv_lora=256,
                          page_size=16, num_pages=4, max_seq_len=64, chunk=64)
    blk, t = make_case(cfg, [3])
    out = run_emulated(blk, t)
    rows = dense_rows(blk, t)[0]
    # query 0 sees only token 0: its output is that token's latent
    assert rel(out["out"][0, 0, 0], rows[0, :256]) < 1e-2
    p = torch.softmax((t["q"][0, 1, 1].float() @ rows[:2].T) * 0.1, -1)
    assert rel(out["out"][0, 1, 1], p @ rows[:2, :256]) < 1e-2


def test_choose_splits():
    assert choose_splits(1, 131072) == 132
    assert choose_splits(64, 32768) == 2
    assert choose_splits(1, 100) == 1


def test_row_groups_cut_the_rows_evenly():
    """More than 32 query rows: equal groups of <= 32, a tile each, every row in one group."""
    for heads, T, groups, rows in [(12, 1, 1, 12), (32, 1, 1, 32), (33, 1, 2, 17), (96, 1, 3, 32),
                                   (12, 4, 2, 24), (12, 3, 2, 18)]:
        blk = MLADecodeBlock(MLADecodeConfig(heads=heads, q_tokens=T, softmax_scale=0.1, batch=3, num_splits=5))
        assert (blk.row_groups, blk.tile_rows) == (groups, rows)
        assert blk.num_tiles() == 3 * 5 * groups
        spans = [blk.group_span(g) for g in range(groups)]
        assert spans[0][0] == 0 and spans[-1][1] == heads * T
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        coords = {blk.tile_coords(t) for t in range(blk.num_tiles())}
        assert coords == {(b, 0, g, s) for b in range(3) for g in range(groups) for s in range(5)}
    half = MLADecodeBlock(MLADecodeConfig(heads=24, softmax_scale=0.1, max_tile_rows=16))  # 16-row tiles
    assert (half.row_groups, half.tile_rows, half.m_pad) == (2, 12, 16)
    sparse = MLADecodeBlock(MLADecodeConfig(heads=64, q_tokens=2, softmax_scale=0.1, batch=3, num_splits=4,
                                            rope=0, index_width=64))
    assert (sparse.row_groups, sparse.tile_rows, sparse.num_tiles()) == (2, 32, 3 * 2 * 2 * 4)
    assert sparse.tile_coords(4 * 2 * 2 + 4 + 3) == (1, 0, 1, 3)


@pytest.mark.parametrize("kw", [dict(heads=0), dict(heads=12, q_tokens=0), dict(heads=8, chunk=48),
                                dict(heads=8, max_tile_rows=24),
                                dict(heads=8, kv_dtype="int8"), dict(heads=8, rope=8),
                                dict(heads=8, kv_dtype="fp8_e4m3", scale_group=128, rope=64),
                                dict(heads=8, rope=0, index_width=64, kv_before_wait=True)])
def test_unsupported_configs_fail_loudly(kw):
    with pytest.raises(UnsupportedConfigError):
        MLADecodeBlock(MLADecodeConfig(softmax_scale=0.1, **kw))


def test_operands_and_cost():
    blk = MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=0.1, batch=2, num_splits=4, kv_dtype="fp8_e4m3"))
    assert blk.operands() == ["q", "kv", "kv_scale", "block_table", "seq_lens", "o_part", "lse_part"]
    assert blk.num_tiles() == 8
    assert blk.kv_bytes([1000, 24]) == 1024 * (576 + 36)
    assert blk.cost(4096).bytes > 1024 * (576 + 36)


def test_blocks_are_registered():
    from sdk.blocks import builtin_blocks
    assert {MLADecodeBlock, MLACombineBlock, MLAHeadProjBlock} <= set(builtin_blocks())


def test_choose_chunk_long_splits_take_64():
    """chunk 64 only when every split walks >= 15 chunks of 64 (B=1 at 128K: 993 tokens a split;
    B=8 / B=64 at 32K+), else 32."""
    from sdk.blocks.mla_decode import choose_chunk
    assert choose_chunk(1, 32768) == 32 and choose_chunk(1, 65536) == 32 and choose_chunk(1, 131072) == 64
    assert choose_chunk(8, 32768) == 64 and choose_chunk(64, 131072) == 64
    assert choose_chunk(64, 1000) == 32


def test_wgmma_tile_refusals_and_smem():
    """mma="wgmma": a dense bf16 cache at chunk 64 only; 2 stages of 64 swizzled 576-column rows
    (72 KB each) beside Q, P and the two warpgroups' partial scores."""
    cfg = dict(heads=12, softmax_scale=0.1, chunk=64, mma="wgmma")
    blk = MLADecodeBlock(MLADecodeConfig(**cfg))
    blk.check()
    assert blk.stages == 2 and blk.nwk == 2 and blk.score_row == 68
    assert blk.smem_bytes() == 1024 + 2 * 64 * 576 * 2 + 16 * 576 * 2 + 16 * 64 * 2 + 2 * 16 * 68 * 4 + 3 * 16 * 4
    for bad in (dict(chunk=32), dict(index_width=2048), dict(mma="tcgen05"),
                dict(stages=3)):
        with pytest.raises(UnsupportedConfigError):
            MLADecodeBlock(MLADecodeConfig(**{**cfg, **bad})).check()
    MLADecodeBlock(MLADecodeConfig(**{**cfg, "rope": 0, "stages": 3})).check()   # GLM-5.3: 3 stages fit
    fp8 = MLADecodeBlock(MLADecodeConfig(**{**cfg, "kv_dtype": "fp8_e4m3", "stages": 3}))   # one f16 buffer
    fp8.check()
    assert fp8.smem_bytes() == (1024 + 64 * 576 * 2 + 16 * 576 * 2 + 16 * 64 * 2 + 3 * 64 * 592 + 3 * 64 * 9 * 4
                                + 2 * 16 * 68 * 4 + 3 * 16 * 4)


@pytest.mark.parametrize("heads,T,rope,kvd", [(12, 1, 64, "bf16"), (8, 1, 0, "bf16"), (12, 2, 64, "bf16"),
                                              (12, 1, 64, "fp8_e4m3")])
def test_wgmma_tile_compiles_for_hopper(heads, T, rope, kvd):
    """The warpgroup-MMA tile traces and compiles for sm_90a: 18 + 16 wgmma per chunk (QK^T over
    half of d_qk = 576, PV over 4 k16 steps of the chunk); 16- and 32-row tiles."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    blk = MLADecodeBlock(MLADecodeConfig(heads=heads, softmax_scale=0.07, q_tokens=T, rope=rope, num_pages=64,
                                         max_seq_len=4096, num_splits=4, chunk=64, mma="wgmma",
                                         kv_dtype=kvd))
    blk.check()
    assert callable(standalone(blk, "sm_90a"))


@pytest.mark.parametrize("mma,chunk,kvd", [("wgmma", 64, "bf16"), ("warp", 32, "bf16"), ("warp", 64, "fp8_e4m3")])
def test_kv_before_wait_tile_owns_the_wait_and_compiles(mma, chunk, kvd):
    """kv_before_wait: the block tells the standalone PDL kernel that its tile waits itself
    (tile_waits_for_grid), and both tiles compile so. Where the wait lands (after the first
    chunks' copies) is not visible here: the GPU chain test checks the results."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    cfg = dict(heads=12, softmax_scale=0.07, q_tokens=2, num_pages=64, max_seq_len=4096, num_splits=4, chunk=chunk,
               mma=mma, kv_dtype=kvd)
    blk = MLADecodeBlock(MLADecodeConfig(**cfg, kv_before_wait=True))
    assert blk.tile_waits_for_grid() and not MLADecodeBlock(MLADecodeConfig(**cfg)).tile_waits_for_grid()
    assert callable(standalone(blk, "sm_90a", pdl=True))


def test_choose_mma_takes_wgmma_on_hopper_for_long_bf16_splits():
    """wgmma where it measured faster (H200, 2026-12-06): Hopper, bf16 cache, chunk 64 (long
    splits); else the mma.sync tile (B=1 32K, the fp8 cache, other GPUs)."""
    from sdk.blocks.mla_decode import choose_mma
    hopper = (9, 0)
    assert choose_mma(1, 131072, "bf16", hopper) == "wgmma" and choose_mma(64, 32768, "bf16", hopper) == "wgmma"
    assert choose_mma(1, 32768, "bf16", hopper) == "warp"
    assert choose_mma(1, 131072, "fp8_e4m3", hopper) == "warp"
    assert choose_mma(1, 131072, "bf16", (10, 0)) == "warp" and choose_mma(1, 131072, "bf16", None) == "warp"




def test_bulk_copy_refusals_smem_and_compile():
    """bulk_copy (on by default where it applies): an fp8 dense cache on the mma.sync tile with
    chunks inside pages; unpadded e4m3
    stages (the dequant reads them, not ldmatrix) plus one mbarrier a stage - 3 stages of 64
    tokens fit at d_qk 576; compiles for sm_90a, sm_100a and sm_103a."""
    cfg = dict(heads=12, softmax_scale=0.07, chunk=64, kv_dtype="fp8_e4m3", bulk_copy=True, num_pages=64,
               max_seq_len=4096, num_splits=4)
    for bad in (dict(kv_dtype="bf16"), dict(mma="wgmma"), dict(page_size=32), dict(rope=0, index_width=64)):
        with pytest.raises(UnsupportedConfigError, match="bulk_copy"):
            MLADecodeBlock(MLADecodeConfig(**{**cfg, **bad}))
    auto = {**cfg, "bulk_copy": None}           # the default: wherever the conditions hold
    assert MLADecodeBlock(MLADecodeConfig(**auto)).bulk
    assert not MLADecodeBlock(MLADecodeConfig(**{**auto, "page_size": 32})).bulk
    assert not MLADecodeBlock(MLADecodeConfig(**{**auto, "kv_dtype": "bf16"})).bulk
    blk = MLADecodeBlock(MLADecodeConfig(**cfg, stages=3))
    plain = MLADecodeBlock(MLADecodeConfig(**{**cfg, "bulk_copy": False}, stages=3))
    assert plain.smem_bytes() - blk.smem_bytes() == 3 * 64 * 16 - 3 * 8
    assert blk.smem_bytes() <= 227 * 1024
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    for arch in ("sm_90a", "sm_100a", "sm_103a"):
        assert callable(standalone(blk, arch))
