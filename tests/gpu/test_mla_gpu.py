"""MLA decode blocks on the GPU (the H200): the standalone device tiles against the fp32 absorbed
reference, fresh random inputs every run (seeded from the clock, seed printed on failure), pages
scattered at random over the pool, ragged batches, outputs poisoned with NaN before each launch.
Contexts 1 .. 262144. Run: `pytest -m gpu tests/gpu/test_mla_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2      # relative Frobenius error vs the fp32 reference (the bound)
K3_SCALE = 192 ** -0.5
GLM_SCALE = 256 ** -0.5


def make_case(cfg, lens, seed):
    """q, a page pool with each sequence's pages at random places, block table, lens (on GPU)."""
    from sdk.blocks.mla_decode import MLADecodeBlock, quantize_kv_fp8
    blk = MLADecodeBlock(cfg)
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-int(x) // cfg.page_size) for x in lens]
    assert sum(need) <= cfg.num_pages
    perm = torch.randperm(cfg.num_pages, device="cuda", generator=g)
    bt = torch.full((cfg.batch, blk.max_pages), 2 ** 30, dtype=torch.int32, device="cuda")  # unused: wild ids
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n].int()
        k += n
    pool = torch.randn(cfg.num_pages, cfg.page_size, blk.d_qk, device="cuda", generator=g)
    t = {"q": torch.randn(cfg.batch, cfg.q_tokens, cfg.heads, blk.d_qk, device="cuda", generator=g).to(torch.bfloat16),
         "block_table": bt, "seq_lens": torch.tensor(lens, dtype=torch.int32, device="cuda")}
    if blk.fp8:
        t["kv"], t["kv_scale"] = quantize_kv_fp8(pool, cfg.scale_group)
    else:
        t["kv"] = pool.to(torch.bfloat16)
    del pool
    t["o_part"] = torch.full((cfg.batch, cfg.num_splits, blk.rows, blk.d_v), float("nan"), device="cuda")
    t["lse_part"] = torch.full((cfg.batch, cfg.num_splits, blk.rows), float("nan"), device="cuda")
    return blk, t


def run_decode(blk, t, cols=0):
    """Core tiles then the combine (`cols` columns per combine tile, 0 = auto), both standalone;
    returns (out bf16, lse fp32)."""
    from sdk.blocks.mla_decode import MLACombineBlock, MLACombineConfig
    c = blk.config
    run_standalone(blk, t)
    comb = MLACombineBlock(MLACombineConfig(heads=c.heads, batch=c.batch, q_tokens=c.q_tokens, d_v=blk.d_v,
                                            num_splits=c.num_splits, cols_per_tile=cols))
    ct = {"o_part": t["o_part"], "lse_part": t["lse_part"],
          "out": torch.full((c.batch, c.q_tokens, c.heads, blk.d_v), float("nan"), dtype=torch.bfloat16, device="cuda"),
          "lse": torch.full((c.batch, c.q_tokens, c.heads), float("nan"), device="cuda")}
    run_standalone(comb, ct)
    return ct["out"], ct["lse"]


def check(blk, t, seed, cols=0):
    from sdk.blocks.mla_decode import absorbed_attention
    c = blk.config
    out, lse = run_decode(blk, t, cols)
    assert torch.isfinite(t["o_part"]).all(), f"seed {seed}: NaN left in o_part"
    assert not torch.isnan(t["lse_part"]).any(), f"seed {seed}: NaN left in lse_part"
    rows = [blk.gather_kv(t, b, 0, int(t["seq_lens"][b])) for b in range(c.batch)]
    want_o, want_lse = absorbed_attention(t["q"], rows, t["seq_lens"].cpu(), c.q_tokens, c.heads, blk.d_v, blk.scale)
    err = rel_err(out, want_o)
    lse_err = (lse - want_lse).abs().max().item()
    assert err <= BF16_TOL, f"seed {seed}: rel err {err:.3e}"
    assert lse_err <= 2e-2, f"seed {seed}: lse max abs err {lse_err:.3e}"
    return err


@pytest.mark.parametrize("ctx", [1, 2, 63, 64, 65, 1000, 4097, 32768, 131072, 262144])
def test_kimi_k3_tp8_single_sequence_contexts(ctx):
    """12 heads (Kimi K3 TP8), rope 64, bf16 cache, batch 1 from 1 to 262144 tokens (the pool at
    262144: 302 MB)."""
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig, choose_splits
    seed = clock_seed()
    pages = -(-ctx // 64) + 3
    cfg = MLADecodeConfig(heads=12, softmax_scale=K3_SCALE, batch=1, num_splits=choose_splits(1, ctx),
                          num_pages=pages, max_seq_len=max(ctx, 64))
    blk, t = make_case(cfg, [ctx], seed)
    check(blk, t, seed)


@pytest.mark.parametrize("kvd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,T,rope,scale,chunk", [(12, 1, 64, K3_SCALE, 32), (6, 2, 64, K3_SCALE, 32),
                                                      (12, 2, 64, K3_SCALE, 16), (8, 4, 0, GLM_SCALE, 64),
                                                      (8, 1, 0, GLM_SCALE, 32), (12, 1, 64, K3_SCALE, 64),
                                                      (8, 1, 0, GLM_SCALE, 64)])
def test_ragged_batches(kvd, heads, T, rope, scale, chunk):
    """Ragged batch of 8 (1 .. 9000 tokens), T new tokens causal among themselves, YaRN-like
    scale factor, pages scattered; Kimi K3 (TP8 / TP16) and GLM-5.3 (NoPE, TP8) shards."""
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig
    seed = clock_seed()
    g = torch.Generator().manual_seed(seed)
    lens = [T] + torch.randint(T, 9000, (7,), generator=g).tolist()
    cfg = MLADecodeConfig(heads=heads, softmax_scale=scale, scale_factor=1.21, batch=8, q_tokens=T, rope=rope,
                          num_pages=sum(-(-x // 64) for x in lens) + 8, max_seq_len=9000, num_splits=12,
                          kv_dtype=kvd, chunk=chunk)
    blk, t = make_case(cfg, lens, seed)
    check(blk, t, seed)


@pytest.mark.parametrize("kvd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("heads,T,ctx,max_rows", [(96, 1, 32768, 32), (12, 4, 9000, 32), (40, 1, 4097, 32),
                                                  (24, 1, 9000, 16), (12, 2, 4097, 16)])
def test_row_groups(kvd, heads, T, ctx, max_rows):
    """More than 32 (or max_tile_rows 16) query rows a sequence, cut into row groups (a tile
    each): Kimi K3's 96 heads on one GPU at 32K, 12 heads verifying 4 speculative tokens (causal
    across the groups), 40 heads in 2 groups of 20; 16-row tiles (the sublayers' last resort for
    shared memory): 24 heads in 2 of 12, 12 heads x 2 tokens. Ragged batch of 3, every row
    group's rows written once."""
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig, choose_splits
    seed = clock_seed()
    lens = [ctx, T, max(T, ctx // 3 + 1)]
    cfg = MLADecodeConfig(heads=heads, softmax_scale=K3_SCALE, scale_factor=1.21, batch=3, q_tokens=T,
                          num_pages=sum(-(-x // 64) for x in lens) + 4, max_seq_len=ctx,
                          num_splits=choose_splits(3 * 3, ctx), kv_dtype=kvd, max_tile_rows=max_rows)
    blk, t = make_case(cfg, lens, seed)
    assert blk.row_groups > 1
    check(blk, t, seed)


@pytest.mark.parametrize("heads,T,rope,scale,lens,page", [
    (12, 1, 64, K3_SCALE, [1], 64), (12, 1, 64, K3_SCALE, [63], 64), (12, 1, 64, K3_SCALE, [65], 64),
    (12, 1, 64, K3_SCALE, [131072], 64), (8, 1, 0, GLM_SCALE, [131072], 64), (6, 1, 64, K3_SCALE, [32768], 64),
    (12, 2, 64, K3_SCALE, [4097, 2, 9000, 300], 64), (8, 4, 0, GLM_SCALE, [9000, 4, 777], 64),
    (12, 1, 64, K3_SCALE, [5000, 1, 3001], 16), (40, 1, 64, K3_SCALE, [4097, 1000], 64),
    (96, 1, 64, K3_SCALE, [32768], 64)])
@pytest.mark.parametrize("kvd", ["bf16", "fp8_e4m3"])
def test_wgmma_tile(heads, T, rope, scale, lens, page, kvd):
    """mma="wgmma" (Hopper warpgroup MMAs from the swizzled chunk): single sequences from 1 to 128K
    tokens at Kimi K3 TP8 / TP16 and GLM-5.3 TP8 (NoPE), ragged batches with T = 2 / 4 causal new
    tokens (32-row tiles), 16-token pages (chunks straddle pages), row groups (40 heads: 2 of 20;
    96: 3 of 32); bf16 and fp8 caches."""
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig, choose_splits, row_groups
    seed = clock_seed()
    groups = row_groups(T * heads)
    cfg = MLADecodeConfig(heads=heads, softmax_scale=scale, scale_factor=1.21, batch=len(lens), q_tokens=T, rope=rope,
                          page_size=page, num_pages=sum(-(-x // page) for x in lens) + 4, max_seq_len=max(lens),
                          num_splits=choose_splits(len(lens) * groups, max(lens), chunk=64), chunk=64, mma="wgmma",
                          kv_dtype=kvd)
    blk, t = make_case(cfg, lens, seed)
    check(blk, t, seed)




@pytest.mark.parametrize("heads,T,rope,scale,lens,page,chunk,splits", [
    (12, 1, 64, K3_SCALE, [131072], 64, 64, 0), (8, 1, 0, GLM_SCALE, [131072], 64, 64, 0),
    (12, 1, 64, K3_SCALE, [1], 64, 64, 12), (12, 1, 64, K3_SCALE, [65], 64, 32, 12),
    (12, 2, 64, K3_SCALE, [4097, 2, 9000, 300], 64, 32, 0), (8, 4, 0, GLM_SCALE, [9000, 4, 777], 64, 64, 0),
    (12, 1, 64, K3_SCALE, [5000, 1, 3001], 16, 16, 0), (40, 1, 64, K3_SCALE, [4097, 1000], 64, 64, 0)])
@pytest.mark.parametrize("bulk", [True, False])
def test_fp8_bulk_copy(heads, T, rope, scale, lens, page, chunk, splits, bulk):
    """fp8 cache, mma.sync tile with bulk_copy (each chunk's rows and scales as two cp.async.bulk
    copies onto the stage's mbarrier; rows past a sequence's end hold whatever the page holds and
    must not reach the output) and without (16-byte cp.async, rows clamped): 128K single sequences
    (K3 TP8, GLM-5.3 TP8), splits of one chunk or none (1 and 65 tokens over 12 splits), ragged
    batches with T = 2 / 4, 16-token pages and chunks, row groups (40 heads)."""
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig, choose_splits, row_groups
    seed = clock_seed()
    groups = row_groups(T * heads)
    cfg = MLADecodeConfig(heads=heads, softmax_scale=scale, scale_factor=1.21, batch=len(lens), q_tokens=T, rope=rope,
                          page_size=page, num_pages=sum(-(-x // page) for x in lens) + 4, max_seq_len=max(lens),
                          num_splits=splits or choose_splits(len(lens) * groups, max(lens), chunk=chunk), chunk=chunk,
                          kv_dtype="fp8_e4m3", bulk_copy=bulk)
    blk, t = make_case(cfg, lens, seed)
    assert blk.bulk == bulk
    # the last page's rows past each sequence's end: NaN (e4m3 0x7f, and its scales), which a row
    # read past the end would carry into the output
    for b, n in enumerate(lens):
        last = int(t["block_table"][b, (n - 1) // page])
        t["kv"].view(torch.uint8)[last, n % page or page:] = 0x7F
        t["kv_scale"][last, n % page or page:] = float("nan")
    check(blk, t, seed)

@pytest.mark.parametrize("mma,chunk,kvd", [("wgmma", 64, "bf16"), ("wgmma", 64, "fp8_e4m3"), ("warp", 32, "bf16"),
                                           ("warp", 64, "fp8_e4m3")])
def test_kv_before_wait_pdl_chain(mma, chunk, kvd):
    """kv_before_wait: decode tiles copy their first chunks before griddepcontrol.wait. Two cases
    (ragged: 1-token and short sequences, whose first chunks reach the new rows and wait first;
    and long ones) share one o_part / lse_part, launched decode, combine, decode, combine, ... with
    PDL and no host sync between: a decode that wrote o_part before the combine before it had read
    it, or read keys before its wait where it must not, would change an output. Each case's last
    outputs are checked against the fp32 reference."""
    need_gpu()
    import cuda.bindings.driver as cuda

    from sdk.blocks._cute import standalone
    from sdk.blocks.mla_decode import MLACombineBlock, MLACombineConfig, MLADecodeConfig, absorbed_attention
    seed = clock_seed()
    cases = [[131072 - 7], [2, 70, 5000, 40000]]
    S, T = 66, 2
    cfgs = [MLADecodeConfig(heads=12, softmax_scale=K3_SCALE, batch=len(lens), q_tokens=T, page_size=64,
                            num_pages=sum(-(-x // 64) for x in lens) + 4, max_seq_len=131072, num_splits=S, chunk=chunk,
                            mma=mma, kv_dtype=kvd, kv_before_wait=True) for lens in cases]
    built = [make_case(cfg, lens, seed + i) for i, (cfg, lens) in enumerate(zip(cfgs, cases))]
    B = max(len(x) for x in cases)
    o_part = torch.empty(B, S, 12 * T, 512, device="cuda")       # shared by both cases
    lse_part = torch.empty(B, S, 12 * T, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    launches, outs = [], []
    for (blk, t), lens in zip(built, cases):
        comb = MLACombineBlock(MLACombineConfig(heads=12, batch=len(lens), q_tokens=T, d_v=512, num_splits=S))
        out = torch.full((len(lens), T, 12, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lens), T, 12), float("nan"), device="cuda")
        ops = {**t, "o_part": o_part, "lse_part": lse_part, "out": out, "lse": lse}
        tabs = [torch.tensor([0 if ops.get(n) is None else ops[n].data_ptr() for n in k.operands()], dtype=torch.int64,
                             device="cuda") for k in (blk, comb)]
        launches.append([(standalone(blk, pdl=True), tabs[0]), (standalone(comb, pdl=True), tabs[1])])
        outs.append((out, lse))
    for _ in range(3):
        for case in launches:
            for fn, tab in case:
                fn(tab.data_ptr(), stream)
    torch.cuda.synchronize()
    for (blk, t), lens, (out, lse) in zip(built, cases, outs):
        rows = [blk.gather_kv(t, b, 0, x) for b, x in enumerate(lens)]
        want_o, want_lse = absorbed_attention(t["q"], rows, lens, T, 12, blk.d_v, blk.scale)
        err = rel_err(out, want_o)
        assert err <= BF16_TOL, f"seed {seed}: lens {lens}: rel err {err:.3e}"
        assert (lse - want_lse).abs().max().item() <= 2e-2, f"seed {seed}: lens {lens}: lse"


@pytest.mark.parametrize("page", [16, 128])
def test_other_page_sizes_and_batch_64(page):
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig
    seed = clock_seed()
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3000, (64,), generator=g).tolist()
    cfg = MLADecodeConfig(heads=12, softmax_scale=K3_SCALE, batch=64, page_size=page,
                          num_pages=sum(-(-x // page) for x in lens) + 4, max_seq_len=3000, num_splits=2)
    blk, t = make_case(cfg, lens, seed)
    check(blk, t, seed)


def test_fp8_long_context():
    need_gpu()
    from sdk.blocks.mla_decode import MLADecodeConfig
    seed = clock_seed()
    cfg = MLADecodeConfig(heads=12, softmax_scale=K3_SCALE, batch=2, num_pages=2 * 2048 + 4, max_seq_len=131072,
                          num_splits=66, kv_dtype="fp8_e4m3")
    blk, t = make_case(cfg, [131072, 70001], seed)
    check(blk, t, seed)


@pytest.mark.parametrize("cols", [0, 512])
def test_pool_past_two_to_the_31_elements(cols):
    """A page pool of > 2^31 elements (Kimi K3 TP8 at batch 64 x 128K tokens holds 4.8e9): the
    sequences' pages lie at the top of the pool, so 32-bit element offsets would wrap; both
    combine tilings (auto: 64-column slices, 24 rows x 8 = 192 tiles; whole rows)."""
    need_gpu()
    from sdk.blocks.base import INDEX_LIMIT
    from sdk.blocks.mla_decode import MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = [5000, 3001]                         # 79 and 47 pages
    per_page = 64 * 576
    pages = INDEX_LIMIT // per_page + 160
    cfg = MLADecodeConfig(heads=12, softmax_scale=K3_SCALE, batch=2, num_pages=pages, max_seq_len=8192,
                          num_splits=20)
    blk = MLADecodeBlock(cfg)
    assert pages * per_page > INDEX_LIMIT
    kv = torch.empty(pages, 64, 576, dtype=torch.bfloat16, device="cuda")
    kv[:-256].fill_(float("nan"))               # rows a wrapped offset would read
    kv[-256:] = torch.randn(256, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    top = pages - 256 + torch.randperm(256, device="cuda", generator=g).int()
    bt = torch.full((2, blk.max_pages), 2 ** 30, dtype=torch.int32, device="cuda")
    bt[0, :79], bt[1, :47] = top[:79], top[79:126]
    t = {"q": torch.randn(2, 1, 12, 576, device="cuda", generator=g).to(torch.bfloat16), "kv": kv,
         "block_table": bt, "seq_lens": torch.tensor(lens, dtype=torch.int32, device="cuda"),
         "o_part": torch.full((2, 20, 12, 512), float("nan"), device="cuda"),
         "lse_part": torch.full((2, 20, 12), float("nan"), device="cuda")}
    auto = MLACombineBlock(MLACombineConfig(heads=12, batch=2, d_v=512, num_splits=20))
    assert auto.num_tiles() == 2 * 12 * 8            # 20 splits, 24 rows: 64-column slices
    check(blk, t, seed, cols)
    del kv, t
    torch.cuda.empty_cache()


@pytest.mark.parametrize("in_flight", [False, True])
def test_head_proj_blocks(in_flight):
    """W_UK absorption writes the first kv_lora columns of the query rows; W_UV maps the latent
    output to v per head. in_flight: every row of a warp loaded at once (rows_in_flight)."""
    need_gpu()
    from dataclasses import replace

    from sdk.blocks.mla_decode import MLAHeadProjBlock, MLAHeadProjConfig
    for cfg in (MLAHeadProjConfig(heads=12, n=512, k=128, m=8, y_stride=576),
                MLAHeadProjConfig(heads=8, n=256, k=512, m=3, rows_per_tile=32),
                MLAHeadProjConfig(heads=6, n=512, k=128, m=64, y_stride=576),
                MLAHeadProjConfig(heads=12, n=512, k=128, m=1, x_stride=192, y_stride=576),
                MLAHeadProjConfig(heads=12, n=128, k=512, m=9, rows_per_tile=32)):
        if in_flight:
            cfg = replace(cfg, rows_in_flight=cfg.rows_per_tile // 8)
        blk = MLAHeadProjBlock(cfg)
        t = {"x": torch.randn(cfg.m, cfg.heads, blk.xs, device="cuda").to(torch.bfloat16),
             "w": (torch.randn(cfg.heads, cfg.n, cfg.k, device="cuda") * cfg.k ** -0.5).to(torch.bfloat16),
             "y": torch.full((cfg.m, cfg.heads, blk.ys), float("nan"), dtype=torch.bfloat16, device="cuda")}
        run_standalone(blk, t)
        want = torch.einsum("mhk,hnk->mhn", t["x"][..., :cfg.k].float(), t["w"].float())
        assert rel_err(t["y"][..., :cfg.n], want) <= BF16_TOL
        if blk.ys > cfg.n:
            assert torch.isnan(t["y"][..., cfg.n:]).all(), "wrote past the projected columns"


def test_chain_against_reference_mla():
    """q_nope -[W_UK]-> q_lat (into the query rows beside q_pe) -> decode + combine -[W_UV]-> per-head
    output == sdk/reference/mla.py MLAReference.attend (expanded keys/values) on the GPU."""
    need_gpu()
    from types import SimpleNamespace

    from sdk.blocks.mla_decode import (MLAHeadProjBlock, MLAHeadProjConfig, MLADecodeConfig,
                                       absorb_weights)
    from sdk.reference.common import StepInfo
    from sdk.reference.mla import MLAReference
    from sdk.spec import MLASpec
    seed = clock_seed()
    torch.manual_seed(seed)
    H, L, nope, rope, v, T = 12, 512, 128, 64, 128, 2
    spec = MLASpec(num_heads=H, kv_lora_rank=L, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    kv_b = (torch.randn(H * (nope + v), L, device="cuda") * L ** -0.5).to(torch.bfloat16)
    ref = MLAReference(None, SimpleNamespace(attention=spec), {"kv_b_proj.weight": kv_b.float()})
    lens = [700, 2, 3001]
    B = len(lens)
    cfg = MLADecodeConfig(heads=H, softmax_scale=ref.scale, batch=B, q_tokens=T, num_pages=64, max_seq_len=4096,
                          num_splits=5)
    blk, t = make_case(cfg, lens, seed)
    q_nope = torch.randn(B, T, H, nope, device="cuda").to(torch.bfloat16)
    w_uk_t, w_uv = absorb_weights(kv_b, H, nope, v)
    uk = MLAHeadProjBlock(MLAHeadProjConfig(heads=H, n=L, k=nope, m=B * T, y_stride=L + rope))
    run_standalone(uk, {"x": q_nope.view(B * T, H, nope), "w": w_uk_t, "y": t["q"].view(B * T, H, L + rope)})
    out, _ = run_decode(blk, t)
    uv = MLAHeadProjBlock(MLAHeadProjConfig(heads=H, n=v, k=L, m=B * T, rows_per_tile=32))
    o = torch.full((B * T, H, v), float("nan"), dtype=torch.bfloat16, device="cuda")
    run_standalone(uv, {"x": out.view(B * T, H, L), "w": w_uv, "y": o})
    # the reference over a dense cache holding the same rows
    dense = torch.zeros(B, max(lens), L + rope, device="cuda")
    for b, n in enumerate(lens):
        dense[b, :n] = blk.gather_kv(t, b, 0, n)
    start = torch.tensor(lens, device="cuda") - T
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(T, device="cuda"),
                    input_ids=torch.zeros(B, T, dtype=torch.long, device="cuda"))
    want = ref.attend(q_nope.float(), t["q"][..., L:].float(), {"latent": dense}, step)
    assert rel_err(o.view(B, T, H, v), want) <= BF16_TOL, f"seed {seed}"


@pytest.mark.parametrize("T,kvd,chunk,mma", [(1, "bf16", 32, "warp"), (2, "fp8_e4m3", 32, "warp"), (1, "bf16", 64, "warp"),
                                            (1, "bf16", 64, "wgmma"), (2, "bf16", 64, "wgmma")])
def test_attention_program_one_launch(T, kvd, chunk, mma):
    """W_UK -> split-KV decode -> combine -> W_UV as megakernel instructions in ONE launch (Kimi K3
    TP8 shard: 12 heads), ragged batch, pages scattered, outputs and scratch poisoned, three
    launches of the same runtime (counter epochs) each equal to the expanded fp32 reference.
    chunk 64: the decode's 64-token stages (decode_chunk, 2 stages of 74 KB); wgmma: the Hopper
    decode tile inside the megakernel (decode_mma)."""
    need_gpu()
    from sdk.megakernel.mla_attention import (MLAAttentionConfig, build_program, make_inputs, make_weights,
                                              reference)
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    seed = clock_seed()
    lens = [T, 700, 4097, 20000]
    cfg = MLAAttentionConfig(heads=12, batch=4, q_tokens=T, num_pages=sum(-(-x // 64) for x in lens) + 4,
                             max_seq_len=20000, kv_dtype=kvd, scale_factor=1.21, decode_chunk=chunk,
                             decode_stages=3 if chunk == 32 else 0, decode_mma=mma)
    prog = build_program(cfg)
    weights = make_weights(cfg, seed=seed, device="cuda")
    inputs = make_inputs(cfg, lens, seed=seed + 1, device="cuda")
    tensors = PyVM.alloc(prog, device="cuda")
    tensors.update({k: v for k, v in weights.items() if k != "kv_b_proj"})
    rt = MegakernelRuntime(prog, tensors)
    want = reference(cfg, weights, inputs)
    for launch in range(3):
        for name, x in inputs.items():
            rt.tensors[name].copy_(x)
        for name in ("o_part", "lse_part", "o_lat", "lse", "o"):
            rt.tensors[name].fill_(float("nan"))
        rt.run()
        err = rel_err(rt.tensors["o"], want)
        assert err <= BF16_TOL, f"seed {seed}, launch {launch}: rel err {err:.3e}"

