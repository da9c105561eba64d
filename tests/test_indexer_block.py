"""Indexer blocks (IndexScoreBlock, TopKBlock) and sparse MLA (MLADecodeBlock with an index list) on
the CPU:

- the blocks' definitions (reference()) against the model references: sdk/reference/dsa.py
  (GLM-5.3's k-pool indexer `DSAIndexer.select`) and sdk/reference/dsv4_attention.py (V4's CSA
  `select`), tiny configs, ragged batches, T = 1..3, score ties (few heads: many all-zero ReLUs);
- their torch twins (emulate_tile: the device tiles' boundaries and algorithm, radix select
  included) against the definitions, with NaN-poisoned outputs;
- sparse MLA: MLAReference.attend with the DSA selection mask (the reference's sparse path) ==
  the blocks (reference and emulated tiles + combine) in absorbed form on a paged, scattered cache.
Device tiles: compile-checked here for sm_90a / sm_100a / sm_103a and in tests/test_blocks_compile.py;
run in tests/gpu/test_indexer_gpu.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sdk.blocks.indexer import (IndexScoreBlock, IndexScoreConfig, TopKBlock, TopKConfig, choose_keys_per_tile,
                                dsv4_csa_indexer_blocks, glm53_indexer_blocks, indexer_compile_cases)
from sdk.blocks.mla_decode import (MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig,
                                   absorb_weights)
from sdk.errors import UnsupportedConfigError
from sdk.reference.common import StepInfo
from sdk.reference.dsa import DSAIndexer, selection_mask
from sdk.blocks.formats import mxfp4_round_trip
from sdk.reference.dsv4_attention import DSV4AttentionReference, Rope
from sdk.reference.mla import MLAReference
from sdk.spec import DSAIndexerSpec, DSV4AttentionSpec, MLASpec, RopeSpec


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def step_of(starts, T):
    start = torch.tensor(starts)
    return StepInfo(start=start, positions=start[:, None] + torch.arange(T),
                    input_ids=torch.zeros(len(starts), T, dtype=torch.long))


def run_tiles(block, t, out_name, fill):
    """All tiles of `block` emulated into a `fill`-poisoned output."""
    spec = {o.name: o for o in block.operand_specs()}[out_name]
    t = dict(t)
    t[out_name] = torch.full(spec.shape, fill, dtype={"fp32": torch.float32, "int32": torch.int32}[spec.dtype])
    for tile in range(block.num_tiles()):
        block.emulate_tile(t, tile)
    return t[out_name]


def same_selection(got, want, scores):
    """Two entry sets are the same selection: equal, or (ties) the same multiset of scores."""
    got, want = sorted(int(e) for e in got if e >= 0), sorted(int(e) for e in want if e >= 0)
    if got == want:
        return True
    return len(got) == len(want) and torch.equal(scores[got].sort().values, scores[want].sort().values)


def score_and_select(score_blk, topk_blk, t):
    """Both blocks' definitions and their emulated tiles; checks twin == definition; returns the
    definition's scores and index list."""
    ref_scores = score_blk.reference(**t)["scores"]
    emu_scores = run_tiles(score_blk, t, "scores", float("nan"))
    for b, s in enumerate(t["start"].tolist()):
        n = score_blk.n_written(s)
        assert torch.allclose(emu_scores[b, :, :n], ref_scores[b, :, :n], rtol=1e-5, atol=1e-6)
        assert torch.isnan(emu_scores[b, :, n:]).all()                 # past n(T-1): not written
    ti = {"scores": emu_scores, "start": t["start"]}
    ref_idx = topk_blk.reference(**ti)["index"]
    emu_idx = run_tiles(topk_blk, ti, "index", -7)
    assert torch.equal(emu_idx, ref_idx)
    return ref_scores, ref_idx


# ------------------------------------------------------------------ GLM-5.3: the k-pool indexer
@pytest.mark.parametrize("heads,kpool,topk,starts,T,kpt", [
    (8, 4, 8, [6, 0, 41, 17], 1, 64),          # the tiny glm_53 indexer (8 x 16, top 8 / pool 4)
    (8, 4, 8, [3, 30, 63], 3, 64),
    (2, 4, 12, [25, 50], 2, 128),               # 2 heads: many exact ties (both ReLUs 0)
    (4, 1, 5, [0, 9, 33], 2, 64),               # kpool 1: plain token top-k, no tail
])
def test_glm_indexer_blocks_equal_dsa_reference(heads, kpool, topk, starts, T, kpt):
    g = torch.Generator().manual_seed(heads * 100 + kpool + T)
    d, D, B = 16, 32, len(starts)
    spec = DSAIndexerSpec(num_heads=heads, head_dim=d, topk=topk, kpool=kpool, select_tail=True)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)
    # wq_b = identity so the reference's q IS the (bf16) q latent the block reads
    w = {"wq_b.weight": torch.eye(heads * d, dtype=torch.bfloat16), "weights_proj.weight": bf(heads, D)}
    ref = DSAIndexer(None, spec, w)
    max_seq = 96
    cache = {"index_pool_k": bf(B, max_seq // kpool, d)}
    x, q_resid = bf(B, T, D), bf(B, T, heads * d)
    step = step_of(starts, T)
    want = ref.select(x, q_resid, cache, step)                         # [B, T, topk + kpool - 1]

    score_blk, topk_blk = glm53_indexer_blocks(spec, B, T, max_seq, keys_per_tile=kpt)
    t = {"q": q_resid.view(B, T, heads, d), "keys": cache["index_pool_k"],
         "weights": F.linear(x, w["weights_proj.weight"]).float() * heads ** -0.5,
         "start": torch.tensor(starts, dtype=torch.int32)}
    scores, got = score_and_select(score_blk, topk_blk, t)
    assert got.shape == want.shape
    ties = 0
    for b in range(B):
        for tq in range(T):
            pos = starts[b] + tq
            n = (pos + 1) // kpool
            # pools: compare the chosen pools (ties: equal score multisets)
            gp = {int(e) // kpool for e in got[b, tq] if 0 <= e < n * kpool}
            wp = {int(e) // kpool for e in want[b, tq] if 0 <= e < n * kpool}
            ties += gp != wp
            assert same_selection(sorted(gp), sorted(wp), scores[b, tq]), (b, tq, gp, wp)
            # every token of a chosen pool, and the tail, as the reference
            gs = {int(e) for e in got[b, tq] if e >= 0}
            assert gs == {p * kpool + i for p in gp for i in range(kpool)} | {
                e for e in range(n * kpool, pos + 1)}
            assert len(gs) == int((got[b, tq] >= 0).sum())              # distinct
            if gp == wp:
                assert gs == {int(e) for e in want[b, tq] if e >= 0}
    print(f"GLM heads={heads}: {ties} selections differ only by tied scores")


def test_glm_shapes_from_model_config():
    """GLM-5.3's indexer (32 x 128, top-2048, kpool 16): blocks, operand shapes, list width."""
    spec = DSAIndexerSpec(num_heads=32, head_dim=128, topk=2048, kpool=16)
    score, topk = glm53_indexer_blocks(spec, batch=2, q_tokens=1, max_seq_len=131072)
    assert score.config.max_entries == 8192 and score.config.ratio == 16 and score.rows == 32
    assert topk.config.k == 128 and topk.width == 2048 + 15
    assert topk.width == DSAIndexer(None, spec, {}).width
    assert score.operands() == ["q", "weights", "keys", "start", "scores"]
    assert topk.operands() == ["scores", "start", "index"]


# ------------------------------------------------------------------ V4: the CSA indexer
def v4_select_inputs(starts, T, ih=4, ihd=32, ratio=4, topk=5, seed=0, key_format=None, seq=160, v41=False):
    """(spec, the score block's operands, the model's selection mask, entries, the model reference,
    its arguments); key_format: the keys' round trip through a cache format (the model selects over
    its values); v41: the model's V4.1 MXFP4 indexer (queries through MXFP4, BF16 score stages)."""
    g = torch.Generator().manual_seed(seed)
    rope = RopeSpec(dim=16, theta=10000.0, interleaved=True)
    spec = DSV4AttentionSpec(num_heads=2, head_dim=64, q_lora_rank=32, rope_dim=16, sliding_window=8,
                             compress_ratio=ratio, indexer=DSAIndexerSpec(num_heads=ih, head_dim=ihd, topk=topk),
                             o_groups=1, o_lora_rank=128, compress_overlap=True, rope=rope, compress_rope=rope)
    D = 48
    shapes = DSV4AttentionReference.expected_weights(SimpleNamespace(hidden_size=D), SimpleNamespace(attention=spec))
    w = {k: (torch.randn(*s, generator=g) * (s[-1] ** -0.5 if len(s) == 2 else 0.5)).to(torch.bfloat16)
         for k, s in shapes.items()}
    ref = DSV4AttentionReference(None, SimpleNamespace(attention=spec), w)
    if v41:
        ref.index_query_format, ref.bf16_index_stages = mxfp4_round_trip, True
    B, E = len(starts), seq // ratio
    x = torch.randn(B, T, D, generator=g).to(torch.bfloat16)
    q_res = torch.randn(B, T, 32, generator=g).to(torch.bfloat16)
    keys = torch.randn(B, E, ihd, generator=g).to(torch.bfloat16)
    if key_format is not None:
        keys = key_format(keys)
    step = step_of(starts, T)
    ready = torch.arange(E) < ((step.positions + 1) // ratio)[..., None]
    mask = ref.select(x, q_res, keys, ready, step)                     # [B, T, E]
    # the block's operands, as the reference computes them (post-RoPE q, scaled head weights)
    cos, sin = ref.indexer.rope.cos_sin(step.positions, x.dtype)
    q = Rope.apply(F.linear(q_res, w["indexer.q_b_proj.weight"]).view(B, T, ih, ihd), cos[:, :, None], sin[:, :, None])
    wts = F.linear(x, w["indexer.weights_proj.weight"]).float() * ih ** -0.5
    t = {"q": q, "weights": wts, "keys": keys, "start": torch.tensor(starts, dtype=torch.int32)}
    return spec, t, mask, E, ref, (x, q_res, keys, ready, step)


@pytest.mark.parametrize("starts,T,ih,kpt", [([10, 0, 77, 159 - 1], 1, 4, 64), ([3, 40, 100], 3, 4, 128),
                                             ([60, 120], 2, 1, 64)])   # 1 head: ties at 0
def test_v4_csa_indexer_blocks_equal_reference(starts, T, ih, kpt):
    spec, t, mask, E, _, _ = v4_select_inputs(starts, T, ih=ih, seed=len(starts) + T)
    score_blk, topk_blk = dsv4_csa_indexer_blocks(spec.indexer, spec.compress_ratio, len(starts), T, 160,
                                                  keys_per_tile=kpt)
    assert score_blk.config.max_entries == E
    scores, got = score_and_select(score_blk, topk_blk, t)
    for b in range(len(starts)):
        for tq in range(T):
            want = torch.nonzero(mask[b, tq]).flatten().tolist()
            row = got[b, tq]
            k = int((row >= 0).sum())
            assert k == len(want) and (row[k:] == -1).all() and torch.equal(row[:k], row[:k].sort().values)
            assert same_selection(row[:k].tolist(), want, scores[b, tq]), (b, tq)


def test_mxfp4_index_key_format():
    """quantize_index_keys: per key 128 E2M1 codes (two a byte) and 4 UE8M0 scales (one per 32
    values), 68 B, in planar pages of 64 keys (the 64 keys' codes, then their scales: V4.1-Flash's
    indexer cache); the scale is the smallest power of two with max |x| <= 6 * scale (edges exact),
    ties round to the even code, zero groups stay zero (scale byte 1: V4.1's writer floors the max
    at 6 x 2^-126); write_index_key places one key's record."""
    from sdk.blocks.formats import E2M1_VALUES, mxfp4_bytes, mxfp4_round_trip
    from sdk.blocks.indexer import (dequantize_index_keys, index_key_page_words, index_key_words,
                                    quantize_index_keys, write_index_key)
    assert index_key_words(128) == 17 and index_key_page_words(128) == 64 * 17
    page = torch.zeros(4352, dtype=torch.uint8)                  # key 1: every code, scale 2^0 (E = 127)
    page[64:72] = torch.arange(8, dtype=torch.uint8) * 17 + torch.tensor([0, 8] * 4, dtype=torch.uint8) * 16
    page[4096 + 4:4096 + 8] = 127
    vals = dequantize_index_keys(page.view(torch.int32)[None], 128)
    assert vals.shape == (64, 128) and (vals[0] == 0).all() and (vals[2:] == 0).all()
    assert torch.equal(vals[1, 0:16:2].float(), E2M1_VALUES[:8])
    assert torch.equal(vals[1, 1:16:2].float(), E2M1_VALUES[:8] * torch.tensor([1.0, -1.0] * 4))
    # the scale byte at the edges: max |x| = 6 * 2^k needs 2^k; a hair above needs 2^(k+1)
    x = torch.zeros(64, 128)
    x[5, 0], x[5, 32], x[5, 64] = 6.0 * 2.0 ** -3, 6.0 * 2.0 ** -3 * (1 + 2.0 ** -20), 1.5
    by = quantize_index_keys(x).view(torch.uint8)[0]
    assert by[4096 + 20:4096 + 24].tolist() == [124, 125, 125, 1]  # 2^-3, 2^-2, 1.5 = 6 / 4: 2^-2; zeros: 1
                                                                    # (V4.1's floor 6 x 2^-126)
    y = torch.zeros(64, 128)
    y[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.01, -6, 0.1, 0.3, 2.9, 4.5, 5.5, -1.0])
    got = dequantize_index_keys(quantize_index_keys(y), 128)[0]
    want = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, -0.0, -6, 0, 0.5, 3, 4, 6, -1])    # scale 2^0 (max 6)
    assert torch.equal(got[:16].float(), want) and (got[16:] == 0).all()
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 128, 128, generator=g) * 2.0 ** (4 * torch.randn(3, 128, 4, 1, generator=g)).repeat(1, 1, 1, 32)
         .flatten(2)).to(torch.bfloat16)
    cache = quantize_index_keys(x)
    assert cache.shape == (3, 2, 1088) and cache.dtype == torch.int32
    # the page layout: key j of page p - its codes at bytes 64 j .., its scales at 4096 + 4 j ..
    codes, scales = mxfp4_bytes(x)
    by = cache.view(torch.uint8)
    for b, key in ((0, 0), (1, 63), (2, 64), (2, 127)):
        p, j = divmod(key, 64)
        assert torch.equal(by[b, p, 64 * j:64 * j + 64], codes[b, key])
        assert torch.equal(by[b, p, 4096 + 4 * j:4096 + 4 * j + 4], scales[b, key])
    e = by[..., 4096:].reshape(3, 128, 4).float() - 127
    amax = x.float().abs().unflatten(-1, (-1, 32)).amax(-1)
    assert ((amax <= 6 * 2 ** e) & (amax > 3 * 2 ** e)).all()    # the smallest such power of two
    d = dequantize_index_keys(cache, 128)
    assert torch.equal(d, mxfp4_round_trip(x))
    assert ((d.float() - x.float()).abs() <= (2 ** e).repeat_interleave(32, -1)).all()   # half the widest step
    # one key written in place (the compressor's write): its bytes where the whole cache has them
    blank = torch.zeros_like(cache)
    write_index_key(blank, 2, 100, x[2, 100])
    mine = torch.zeros_like(by[2, 1], dtype=torch.bool)
    mine[64 * 36:64 * 37], mine[4096 + 4 * 36:4096 + 4 * 37] = True, True
    bb = blank.view(torch.uint8)
    assert torch.equal(bb[2, 1][mine], by[2, 1][mine]) and (bb[2, 1][~mine] == 0).all()
    assert (bb[:2] == 0).all() and (bb[2, 0] == 0).all()
    with pytest.raises(ValueError, match="pages"):
        quantize_index_keys(torch.randn(40, 128))


def test_v41_index_score_stages_keep_the_head_order():
    """staged_index_scores: the terms are summed in fp32 in head order - with terms 2^24, 1, -2^24
    the ordered sum is 0 (2^24 + 1 rounds back to 2^24), any other grouping gives 1 - and the
    dot, the weight and the result are bf16 values."""
    from sdk.reference.dsv4_attention import staged_index_scores
    q = torch.zeros(1, 3, 16)
    q[..., 0] = 1.0
    k = torch.zeros(2, 16)
    k[0, 0], k[1, 0] = 1.0, 1.0 + 2.0 ** -10            # the second dot rounds to 1 in bf16
    w = torch.tensor([[2.0 ** 24, 1.0, -2.0 ** 24]])
    assert staged_index_scores(q, k, w).tolist() == [[0.0, 0.0]]
    w = torch.tensor([[1.0 + 2.0 ** -9, 0.0, 0.0]])     # the weight rounds to 1 in bf16
    assert staged_index_scores(q, k, w).tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("starts,T,kpt", [([10, 0, 77, 255], 1, 64), ([3, 40, 100, 200], 3, 128)])
def test_v4_csa_indexer_mxfp4_keys(starts, T, kpt):
    """key_dtype="mxfp4", V4.1's MXFP4 indexer: over the paged key cache, with the queries through
    MXFP4 and the BF16 score stages, the score block equals the model's V4.1 indexer scores
    (DSV4AttentionReference with index_query_format / bf16_index_stages) bit for bit - definition
    and emulated tiles - and its selection is the model's."""
    from dataclasses import replace

    from sdk.blocks.formats import mxfp4_round_trip
    from sdk.blocks.indexer import dequantize_index_keys, quantize_index_keys
    spec, t, mask, E, ref, args = v4_select_inputs(starts, T, ihd=128, seed=7 + T, key_format=mxfp4_round_trip,
                                                   seq=256, v41=True)
    cache = quantize_index_keys(t["keys"])
    assert torch.equal(dequantize_index_keys(cache, 128), t["keys"])   # the values take the round trip unchanged
    score_blk, topk_blk = dsv4_csa_indexer_blocks(spec.indexer, spec.compress_ratio, len(starts), T, 256,
                                                  keys_per_tile=kpt)
    mx_blk = IndexScoreBlock(replace(score_blk.config, key_dtype="mxfp4"))
    assert dict(zip(mx_blk.operands(), [o.shape for o in mx_blk.operand_specs()]))["keys"] == (len(starts), 1, 1088)
    mx_t = {**t, "keys": cache}
    got = mx_blk.reference(**mx_t)["scores"]
    model = ref.index_scores(*args)
    fp32 = score_blk.reference(**t)["scores"]
    for b, s in enumerate(starts):
        n = mx_blk.n_written(s)
        assert torch.equal(got[b, :, :n], model[b, :, :n]), b
        fin = torch.isfinite(got[b, :, :n])
        v = got[b, :, :n][fin]
        assert torch.equal(v, v.bfloat16().float())                       # bf16 scores
        assert (v != fp32[b, :, :n][fin]).any() or v.numel() == 0        # ... not the fp32 ones
    scores, idx = score_and_select(mx_blk, topk_blk, mx_t)              # emulated tiles == definition
    emu = run_tiles(mx_blk, mx_t, "scores", float("nan"))
    for b, s in enumerate(starts):
        n = mx_blk.n_written(s)
        assert torch.equal(emu[b, :, :n], got[b, :, :n]) and torch.isnan(emu[b, :, n:]).all()
    for b in range(len(starts)):
        for tq in range(T):
            row = idx[b, tq]
            k = int((row >= 0).sum())
            assert same_selection(row[:k].tolist(), torch.nonzero(mask[b, tq]).flatten().tolist(),
                                  scores[b, tq]), (b, tq)


def test_index_list_feeds_dsv4_csa_decode():
    """TopKBlock's V4 list is DSV4DecodeBlock's "index" operand: same shape, and its key rows are
    the selected entries."""
    from sdk.blocks.dsv4_attention import DSV4DecodeBlock, DSV4DecodeConfig
    spec, t, mask, E, _, _ = v4_select_inputs([70, 150], 2, seed=3)
    score_blk, topk_blk = dsv4_csa_indexer_blocks(spec.indexer, 4, 2, 2, 160)
    idx = topk_blk.reference(scores=score_blk.reference(**t)["scores"], start=t["start"])["index"]
    core = DSV4DecodeBlock(DSV4DecodeConfig(heads=2, mode="csa", batch=2, q_tokens=2, head_dim=256, window=8,
                                            ratio=4, max_entries=E, topk=spec.indexer.topk))
    shape = {o.name: o.shape for o in core.operand_specs()}["index"]
    assert tuple(idx.shape) == shape
    tt = {"window": torch.zeros(2, 8, 256), "new_kv": torch.zeros(2, 2, 256),
          "comp": torch.arange(E).float()[None, :, None].expand(2, E, 256), "index": idx,
          "start": torch.tensor([70, 150])}
    for b in range(2):
        for g in range(2):
            rows, vis = core.key_rows(tt, b, g)
            sel = rows[8 + 2:, 0][vis[0, 8 + 2:]].long().tolist()
            assert sorted(sel) == torch.nonzero(mask[b, g]).flatten().tolist()


# ------------------------------------------------------------------ top-k: radix select, ties
def topk_scores(n: int, mode: str, g: torch.Generator) -> torch.Tensor:
    """A score row of n entries for the top-k tests (CPU and GPU)."""
    if mode == "rand":
        s = torch.randn(n, generator=g)
    elif mode == "ints":                    # heavy ties: 16 distinct values
        s = torch.randint(0, 16, (n,), generator=g).float() * 0.25
    elif mode == "const":
        s = torch.full((n,), 3.5)
    elif mode == "neg":
        s = -torch.rand(n, generator=g) - 1e-3
    elif mode == "index":                   # indexer-like: sums of weighted ReLUs, both signs
        s = (torch.relu(torch.randn(64, n, generator=g)) * torch.randn(64, 1, generator=g)).sum(0)
    elif mode == "outlier":                 # one value far above a narrow bulk: one value interval
        s = 1.0 + 1e-3 * torch.rand(n, generator=g)     # holds nearly every entry
        s[n // 3] = 1e30
    elif mode == "huge_range":              # max - min overflows fp32
        s = torch.randn(n, generator=g)
        s[1], s[2] = 3e38, -3e38
    else:                                   # +0.0 and -0.0 are ties, some positives above
        s = torch.where(torch.rand(n, generator=g) < 0.5, 0.0, -0.0)
        s[torch.randperm(n, generator=g)[:n // 8]] = torch.rand(n // 8, generator=g)
    return s


@pytest.mark.parametrize("n,k,mode", [(131072, 2048, "rand"), (40000, 512, "ints"), (300, 512, "rand"),
                                      (5000, 100, "const"), (4096, 128, "signed_zero"), (1000, 1000, "ints"),
                                      (1001, 1000, "ints"), (7000, 300, "neg"), (8256, 512, "index"),
                                      (8256, 512, "outlier"), (3000, 64, "huge_range")])
def test_topk_radix_select_equals_stable_topk(n, k, mode):
    """The PyVM's device algorithm (radix passes, compaction) = the definition, incl. rows whose
    histograms are skewed (indexer-like sums, one outlier over a narrow bulk) or whose range
    overflows fp32."""
    s = topk_scores(n, mode, torch.Generator().manual_seed(n + k))
    blk = TopKBlock(TopKConfig(k=k, batch=1, q_tokens=1, max_entries=n))
    t = {"scores": s.view(1, 1, n), "start": torch.tensor([n - 1], dtype=torch.int32)}
    want = blk.reference(**t)["index"][0, 0]
    got = run_tiles(blk, t, "index", -7)[0, 0]
    assert torch.equal(got, want)
    # the definition: the k largest, ties to the lower index, ascending
    order = sorted(range(n), key=lambda i: (-float(s[i]), i))[:k]
    assert want[:min(n, k)].tolist() == sorted(order)
    assert (want[min(n, k):] == -1).all()


def test_topk_expand_and_tail():
    """GLM list: pools -> tokens, the tail of the incomplete pool; ragged tokens; few visible pools."""
    blk = TopKBlock(TopKConfig(k=2, batch=2, q_tokens=3, max_entries=10, ratio=4, expand=4, tail=True))
    s = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]).expand(2, 3, 10).clone()
    t = {"scores": s, "start": torch.tensor([0, 13], dtype=torch.int32)}
    got = run_tiles(blk, t, "index", -7)
    assert torch.equal(got, blk.reference(**t)["index"])
    # sequence 0, token 0 (pos 0): no pool yet, tail = [0]; token 2 (pos 2): tail = [0, 1, 2]
    assert got[0, 0].tolist() == [-1] * 8 + [0, -1, -1]
    assert got[0, 2].tolist() == [-1] * 8 + [0, 1, 2]
    # sequence 1, token 2 (pos 15): pools 0..3 complete, top 2 = pools 3, 1; no tail
    assert got[1, 2].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, -1, -1, -1]
    # token 0 (pos 13): pools 0..2 visible: pools 1, 2; tail 12, 13
    assert got[1, 0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, -1]


# ------------------------------------------------------------------ sparse MLA (DSA)
def paged(cfg: MLADecodeConfig, rows_per_seq, seed=0):
    """Scatter each sequence's cache rows over random pages: (kv pool, block table)."""
    g = torch.Generator().manual_seed(seed)
    blk = MLADecodeBlock(cfg)
    perm = torch.randperm(cfg.num_pages, generator=g)
    pool = torch.randn(cfg.num_pages, cfg.page_size, blk.d_qk, generator=g)
    bt = torch.full((cfg.batch, blk.max_pages), -1, dtype=torch.int32)
    k = 0
    for b, rows in enumerate(rows_per_seq):
        n = -(-rows.shape[0] // cfg.page_size)
        bt[b, :n] = perm[k:k + n].int()
        k += n
        for i in range(rows.shape[0]):
            pool[bt[b, i // cfg.page_size], i % cfg.page_size] = rows[i]
    return pool, bt


@pytest.mark.parametrize("T,splits,chunk,kvd,H", [(1, 1, 32, "bf16", 4), (2, 3, 16, "bf16", 4), (3, 2, 64, "bf16", 4),
                                                  (2, 2, 32, "fp8_e4m3", 4),
                                                  (2, 2, 32, "bf16", 40)])     # 2 row groups of 20 heads
def test_sparse_mla_equals_reference_sparse_attention(T, splits, chunk, kvd, H):
    """MLAReference.attend(index_mask = the DSA selection) == absorbed sparse MLA blocks."""
    from sdk.blocks.mla_decode import quantize_kv_fp8
    g = torch.Generator().manual_seed(T * 10 + splits)
    L, nope, v, kpool, topk = 256, 16, 24, 4, 8
    starts, maxlen = [5, 0, 37, 20], 48
    B = len(starts)
    spec = MLASpec(num_heads=H, kv_lora_rank=L, qk_nope_head_dim=nope, qk_rope_head_dim=0, v_head_dim=v)
    kv_b = torch.randn(H * (nope + v), L, generator=g) * L ** -0.5
    ref = MLAReference(None, SimpleNamespace(attention=spec), {"kv_b_proj.weight": kv_b})
    step = step_of(starts, T)
    latent = torch.randn(B, maxlen, L, generator=g).to(torch.bfloat16).float()   # what a bf16 cache holds
    if kvd == "fp8_e4m3":                   # the reference sees the cache's dequantised values
        q8, sc = quantize_kv_fp8(latent, 64)
        latent = (q8.float() * sc.repeat_interleave(64, -1)).to(torch.bfloat16).float()
    cache = {"latent": latent}
    q_nope = torch.randn(B, T, H, nope, generator=g)
    # a DSA selection from the GLM blocks on random pooled keys (pools + tail, -1 padded)
    idx_spec = DSAIndexerSpec(num_heads=2, head_dim=16, topk=topk, kpool=kpool)
    score_blk, topk_blk = glm53_indexer_blocks(idx_spec, B, T, maxlen, keys_per_tile=64)
    ti = {"q": torch.randn(B, T, 2, 16, generator=g).to(torch.bfloat16), "weights": torch.randn(B, T, 2, generator=g),
          "keys": torch.randn(B, maxlen // kpool, 16, generator=g).to(torch.bfloat16),
          "start": torch.tensor(starts, dtype=torch.int32)}
    idx = topk_blk.reference(scores=score_blk.reference(**ti)["scores"], start=ti["start"])["index"]
    length = max(starts) + T
    want = ref.attend(q_nope, torch.zeros(B, T, H, 0), cache, step,
                      index_mask=selection_mask(idx.long(), length))       # [B, T, H, v]

    w_uk_t, w_uv = absorb_weights(kv_b, H, nope, v)
    q = torch.einsum("bthd,hld->bthl", q_nope, w_uk_t)
    cfg = MLADecodeConfig(heads=H, softmax_scale=ref.scale, batch=B, q_tokens=T, kv_lora=L, rope=0, page_size=16,
                          num_pages=16, max_seq_len=64, num_splits=splits, chunk=chunk, kv_dtype=kvd,
                          index_width=topk_blk.width)
    blk = MLADecodeBlock(cfg)
    pool, bt = paged(cfg, [latent[b, :starts[b] + T] for b in range(B)])
    t = {"q": q.to(torch.bfloat16), "block_table": bt, "seq_lens": torch.tensor(starts, dtype=torch.int32) + T,
         "index": idx}
    if kvd == "fp8_e4m3":
        t["kv"], t["kv_scale"] = quantize_kv_fp8(pool, 64)
    else:
        t["kv"] = pool.to(torch.bfloat16)
    comb = MLACombineBlock(MLACombineConfig(heads=H, batch=B, q_tokens=T, d_v=L, num_splits=splits))

    def through_combine(parts):
        return torch.einsum("bthl,hvl->bthv", comb.reference(**parts)["out"], w_uv)
    exact = through_combine(blk.reference(**{**t, "q": q}))
    assert rel(exact, want) < 1e-4
    t["o_part"] = torch.full((B, splits, blk.rows, L), float("nan"))
    t["lse_part"] = torch.full((B, splits, blk.rows), float("nan"))
    for tile in range(blk.num_tiles()):
        blk.emulate_tile(t, tile)
    assert not torch.isnan(t["o_part"]).any() and not torch.isnan(t["lse_part"]).any()
    got = through_combine({"o_part": t["o_part"], "lse_part": t["lse_part"]})
    assert rel(got, want) < 1e-2


def test_sparse_mla_masks_invalid_and_future_tokens():
    """-1 entries, and tokens after the query (T > 1: later new tokens), are never attended."""
    cfg = MLADecodeConfig(heads=2, softmax_scale=0.1, batch=1, q_tokens=2, kv_lora=128, rope=0, page_size=16,
                          num_pages=2, max_seq_len=32, chunk=16, index_width=4)
    blk = MLADecodeBlock(cfg)
    assert blk.tile_rows == 2 and blk.rows == 4 and blk.num_tiles() == 2
    rows = torch.randn(10, 128)
    pool, bt = paged(cfg, [rows])
    # length 10: query 0 is token 8, query 1 token 9; query 0 lists token 9 (future) and -1
    idx = torch.tensor([[[3, 9, -1, 5], [9, -1, -1, -1]]], dtype=torch.int32)
    t = {"q": torch.randn(1, 2, 2, 128).to(torch.bfloat16), "kv": pool.to(torch.bfloat16), "block_table": bt,
         "seq_lens": torch.tensor([10], dtype=torch.int32), "index": idx}
    out = blk.reference(**t)
    kv = pool.to(torch.bfloat16).float()
    keys = torch.stack([kv[bt[0, 0], 3], kv[bt[0, 0], 5]])
    p = torch.softmax(t["q"][0, 0].float() @ keys.T * 0.1, -1)
    assert rel(out["o_part"][0, 0, :2], p @ keys) < 1e-5
    assert rel(out["o_part"][0, 0, 2:], kv[bt[0, 0], 9].expand(2, -1)) < 1e-5


# ------------------------------------------------------------------ configs, costs, compile
def test_operands_costs_and_splits():
    s = IndexScoreBlock(IndexScoreConfig(heads=64, batch=2, q_tokens=2, max_entries=32768, ratio=4,
                                         keys_per_tile=1024, stages=3))
    assert s.num_tiles() == 64 and s.rows == 128
    assert s.key_bytes([131071, 3]) == (32768 + 1) * (256 + 8)
    assert s.cost().bytes > 1024 * 256
    mx = IndexScoreBlock(IndexScoreConfig(heads=64, batch=2, q_tokens=2, max_entries=32768, ratio=4,
                                          keys_per_tile=1024, stages=3, key_dtype="mxfp4"))
    assert mx.key_bytes([131071, 3]) == (32768 + 1) * (68 + 8) and mx.cost().bytes < s.cost().bytes
    assert mx.smem_bytes() < s.smem_bytes()
    tk = TopKBlock(TopKConfig(k=512, batch=2, q_tokens=2, max_entries=32768, ratio=4))
    assert tk.num_tiles() == 4 and tk.width == 512
    assert choose_keys_per_tile(1, 32768) == 256 and choose_keys_per_tile(8, 32768) == 2048
    sp = MLADecodeBlock(MLADecodeConfig(heads=8, softmax_scale=0.1, rope=0, batch=2, q_tokens=3, num_splits=2,
                                        index_width=2063))
    assert sp.operands() == ["q", "kv", "block_table", "seq_lens", "index", "o_part", "lse_part"]
    assert sp.num_tiles() == 12 and sp.kv_bytes([100, 5000]) == (100 + 2063) * 3 * 1024


@pytest.mark.parametrize("cls,kw", [
    (IndexScoreBlock, dict(heads=64, q_tokens=3)), (IndexScoreBlock, dict(heads=8, head_dim=24)),
    (IndexScoreBlock, dict(heads=8, keys_per_tile=100)), (TopKBlock, dict(k=5000)),
    (IndexScoreBlock, dict(heads=8, key_dtype="fp8")), (IndexScoreBlock, dict(heads=8, head_dim=64, key_dtype="mxfp4")),
    (IndexScoreBlock, dict(heads=8, max_entries=96, key_dtype="mxfp4")),          # 1.5 pages of 64 keys
    (TopKBlock, dict(k=8, ratio=4, expand=2, tail=True)),
    (MLADecodeBlock, dict(heads=40, softmax_scale=0.1, index_width=-1)),
])
def test_unsupported_configs_fail_loudly(cls, kw):
    with pytest.raises(UnsupportedConfigError):
        cls(cls.Config(**kw))


def test_blocks_are_registered():
    from sdk.blocks import builtin_blocks
    assert {IndexScoreBlock, TopKBlock} <= set(builtin_blocks())


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_indexer_and_sparse_mla_compile(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.blocks.mla_decode import mla_compile_cases
    sparse = [b for b in mla_compile_cases() if isinstance(b, MLADecodeBlock) and b.sparse]
    assert sparse
    for blk in indexer_compile_cases() + sparse:
        standalone(blk, arch)
