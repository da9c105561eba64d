"""Indexer blocks and sparse MLA on the GPU: the standalone IndexScore / TopK / sparse MLADecode (+
combine) tiles against the blocks' fp32 definitions (reference(), proven equal to
sdk/reference/dsa.py and sdk/reference/dsv4_attention.py on the CPU: tests/test_indexer_block.py),
fresh random inputs (seed printed), ragged batches, contexts 1 .. 131072, NaN-poisoned outputs.
Shapes: V4.1-Flash CSA (64 x 128 indexer heads, ratio 4, top-512), GLM-5.3 DSA (32 x 128, kpool 16,
top-2048 = 128 pools + tail) and GLM-5.3's sparse MLA at TP8 (8 heads, NoPE, latent 512, lists of
2063 tokens on a paged cache with pages scattered at random).
Run: `pytest -m gpu tests/gpu/test_indexer_gpu.py` (well under a minute on an H200, compiles included)."""
import pytest
import torch

from harness import clock_seed, need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu


def score_case(heads, ratio, starts, T, seed, kpool_topk=None, v4_topk=512, device="cuda", key_dtype="bf16"):
    """Random q / weights / keys (key_dtype "mxfp4": their records), the indexer blocks for them,
    NaN / -7 poisoned outputs."""
    from sdk.blocks.indexer import (IndexScoreBlock, IndexScoreConfig, TopKBlock, TopKConfig,
                                    choose_keys_per_tile, quantize_index_keys)
    g = torch.Generator(device=device).manual_seed(seed)
    B, d = len(starts), 128
    E = max(1, (max(starts) + T) // ratio)
    if key_dtype == "mxfp4":
        E = 64 * -(-E // 64)               # whole pages of 64 keys
    kpt = choose_keys_per_tile(B, E)
    score = IndexScoreBlock(IndexScoreConfig(heads=heads, head_dim=d, batch=B, q_tokens=T, max_entries=E,
                                             ratio=ratio, keys_per_tile=kpt, stages=3 if heads * T > 64 else 4,
                                             key_dtype=key_dtype))
    if kpool_topk:                       # GLM: pools -> tokens + tail
        topk = TopKBlock(TopKConfig(k=kpool_topk // ratio, batch=B, q_tokens=T, max_entries=E, ratio=ratio,
                                    expand=ratio, tail=ratio > 1))
    else:
        topk = TopKBlock(TopKConfig(k=v4_topk, batch=B, q_tokens=T, max_entries=E, ratio=ratio))
    r = lambda *s: torch.randn(*s, device=device, generator=g)
    t = {"q": r(B, T, heads, d).to(torch.bfloat16), "weights": r(B, T, heads) * heads ** -0.5,
         "keys": quantize_index_keys(r(B, E, d)) if key_dtype == "mxfp4" else r(B, E, d).to(torch.bfloat16),
         "start": torch.tensor(starts, dtype=torch.int32, device=device),
         "scores": torch.full((B, T, E), float("nan"), device=device),
         "index": torch.full((B, T, topk.width), -7, dtype=torch.int32, device=device)}
    return score, topk, t


def check_scores_and_topk(score, topk, t, seed, run=run_standalone):
    run(score, t)
    run(topk, t)
    cpu = {k: v.cpu() for k, v in t.items()}
    want = score.reference(**cpu)["scores"]
    got = cpu["scores"]
    for b, s in enumerate(cpu["start"].tolist()):
        n = score.n_written(s)
        assert torch.isnan(got[b, :, n:]).all(), f"seed {seed}: scores written past n(T-1)"
        w, gg = want[b, :, :n], got[b, :, :n]
        assert torch.equal(torch.isinf(w), torch.isinf(gg)), f"seed {seed}: visibility (-inf) differs"
        fin = torch.isfinite(w)
        if fin.any():
            err = rel_err(gg[fin], w[fin], min_norm=1e-6)
            if score.mxfp4:
                # V4.1's BF16 stages: the same bf16 values but where the MMA's fp32 dot (another
                # order than torch's) rounds to the other bf16 neighbour (~64 x 2^-16 of the scores)
                same = (gg[fin] == w[fin]).float().mean().item()
                assert same >= 0.95 and err <= 5e-3, f"seed {seed}: {same:.3f} of the scores equal, rel err {err:.3e}"
            else:
                assert err <= 1e-4, f"seed {seed}: scores rel err {err:.3e}"
    # the selection: exactly the definition's on the device's own scores (deterministic: ties ->
    # lower index, ascending) ...
    idx = cpu["index"]
    assert torch.equal(idx, topk.reference(scores=got, start=cpu["start"])["index"]), f"seed {seed}: top-k"
    # ... and as good as the fp32 reference's selection (scores equal up to rounding)
    c = topk.config
    for b, s in enumerate(cpu["start"].tolist()):
        for tq in range(c.q_tokens):
            n = min(c.max_entries, (s + tq + 1) // c.ratio)
            ent = idx[b, tq, :c.k * c.expand:c.expand]
            ent = (ent[ent >= 0] // c.expand).long()
            assert ent.numel() == min(n, c.k), f"seed {seed}: {ent.numel()} entries selected"
            if n > c.k:
                kth = want[b, tq, :n].topk(c.k).values[-1]
                tol = (2.0 ** -7 if score.mxfp4 else 1e-4) * want[b, tq, :n].abs().max() + 1e-6
                assert (want[b, tq, ent] >= kth - tol).all(), f"seed {seed}: a selected entry is below the k-th"


@pytest.mark.parametrize("starts,T", [([0], 1), ([3, 4095, 131071, 517], 1), ([70000, 12], 2)])
def test_v4_csa_indexer(starts, T):
    need_gpu()
    seed = clock_seed()
    score, topk, t = score_case(64, 4, starts, T, seed)
    check_scores_and_topk(score, topk, t, seed)


@pytest.mark.parametrize("starts,T", [([0], 1), ([3, 4095, 131071, 517], 1), ([70000, 12], 2)])
def test_v4_csa_indexer_mxfp4_keys(starts, T):
    """V4.1's MXFP4 indexer (key_dtype="mxfp4", opt-in): 68 B keys in pages of 64, dequantised
    a page at a time into bf16 rows; q through MXFP4 as the tile stages it; the BF16 score stages -
    the definition's bf16 scores but where the MMA's dot rounds to the other bf16 neighbour."""
    need_gpu()
    seed = clock_seed()
    score, topk, t = score_case(64, 4, starts, T, seed, key_dtype="mxfp4")
    check_scores_and_topk(score, topk, t, seed)


@pytest.mark.parametrize("starts,T", [([0, 15, 16], 1), ([131071, 5000, 2047, 40], 1), ([33000, 100000], 2)])
def test_glm_dsa_indexer(starts, T):
    need_gpu()
    seed = clock_seed()
    score, topk, t = score_case(32, 16, starts, T, seed, kpool_topk=2048)
    check_scores_and_topk(score, topk, t, seed)


def test_topk_ties_131072():
    """131072 entries of 8 distinct values (heavy ties, signed zeros): exact list of the definition."""
    need_gpu()
    from sdk.blocks.indexer import TopKBlock, TopKConfig
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 131072
    blk = TopKBlock(TopKConfig(k=2048, batch=2, max_entries=n))
    s = (torch.randint(-3, 5, (2, 1, n), device="cuda", generator=g).float() * 0.5)
    s[0, 0, ::3] = -0.0
    t = {"scores": s, "start": torch.tensor([n - 1, 1000], dtype=torch.int32, device="cuda"),
         "index": torch.full((2, 1, 2048), -7, dtype=torch.int32, device="cuda")}
    run_standalone(blk, t)
    want = blk.reference(**{k: v.cpu() for k, v in t.items()})["index"]
    assert torch.equal(t["index"].cpu(), want), f"seed {seed}"


@pytest.mark.parametrize("mode", ["index", "outlier", "huge_range", "const", "signed_zero"])
def test_topk_score_distributions(mode):
    """Rows in shared memory (8192 entries, cache_row) and read from L2 (40000), whose histograms
    are skewed (indexer-like sums, an outlier over a narrow bulk) or degenerate (one value, signed
    zeros, a range past fp32): the definition's exact list."""
    need_gpu()
    from sdk.blocks.indexer import TopKBlock, TopKConfig
    from test_indexer_block import topk_scores
    seed = clock_seed()
    for n in (8192, 40000):
        g = torch.Generator().manual_seed(seed + n)
        blk = TopKBlock(TopKConfig(k=512, batch=1, max_entries=n))
        t = {"scores": topk_scores(n, mode, g).view(1, 1, n).cuda(),
             "start": torch.tensor([n - 1], dtype=torch.int32, device="cuda"),
             "index": torch.full((1, 1, 512), -7, dtype=torch.int32, device="cuda")}
        run_standalone(blk, t)
        want = blk.reference(**{k: v.cpu() for k, v in t.items()})["index"]
        assert torch.equal(t["index"].cpu(), want), f"n {n}, seed {seed}, cached {blk.cache_row}"


def sparse_mla_case(lens, T, seed, splits, heads=8, L=512, width=2048 + 15, page=64, device="cuda"):
    from sdk.blocks.mla_decode import MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig
    g = torch.Generator(device=device).manual_seed(seed)
    B = len(lens)
    need = [-(-n // page) for n in lens]
    P = sum(need) + 3
    cfg = MLADecodeConfig(heads=heads, softmax_scale=256 ** -0.5, batch=B, q_tokens=T, kv_lora=L, rope=0,
                          page_size=page, num_pages=P, max_seq_len=max(lens), num_splits=splits, chunk=64,
                          index_width=width)
    blk = MLADecodeBlock(cfg)
    comb = MLACombineBlock(MLACombineConfig(heads=heads, batch=B, q_tokens=T, d_v=L, num_splits=splits))
    perm = torch.randperm(P, device=device, generator=g)
    bt = torch.full((B, blk.max_pages), -1, dtype=torch.int32, device=device)
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n].int()
        k += n
    # index lists: distinct tokens before each query (a random choice), some -1, any order
    idx = torch.full((B, T, width), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for tq in range(T):
            visible = n - T + tq + 1
            m = min(width - 5, visible)
            idx[b, tq, :m] = torch.randperm(visible)[:m].int()
            idx[b, tq] = idx[b, tq, torch.randperm(width)]
    t = {"q": torch.randn(B, T, heads, L, device=device, generator=g).to(torch.bfloat16),
         "kv": torch.randn(P, page, L, device=device, generator=g).to(torch.bfloat16), "block_table": bt,
         "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device), "index": idx.to(device),
         "o_part": torch.full((B, splits, blk.rows, L), float("nan"), device=device),
         "lse_part": torch.full((B, splits, blk.rows), float("nan"), device=device),
         "out": torch.full((B, T, heads, L), float("nan"), dtype=torch.bfloat16, device=device),
         "lse": torch.full((B, T, heads), float("nan"), device=device)}
    return blk, comb, t


@pytest.mark.parametrize("lens,T,splits,heads", [([1], 1, 1, 8), ([131072, 100, 4096, 2], 1, 4, 8), ([20000, 7], 2, 8, 8),
                                                  ([131072, 9], 2, 4, 64)])   # GLM-5.3 on one GPU: 2 row groups
def test_glm_sparse_mla(lens, T, splits, heads):
    need_gpu()
    seed = clock_seed()
    blk, comb, t = sparse_mla_case(lens, T, seed, splits, heads=heads)
    run_standalone(blk, t)
    run_standalone(comb, t)
    assert torch.isfinite(t["o_part"]).all(), f"seed {seed}: NaN left in o_part"
    assert not torch.isnan(t["lse_part"]).any(), f"seed {seed}: NaN left in lse_part"
    cpu = {k: v.cpu() for k, v in t.items()}
    parts = blk.reference(**cpu)
    want = comb.reference(**parts)["out"]
    err = rel_err(t["out"].cpu(), want)
    assert err <= 1e-2, f"seed {seed}: rel err {err:.3e}"
    fin = torch.isfinite(parts["lse_part"])
    assert torch.equal(fin, torch.isfinite(cpu["lse_part"])), f"seed {seed}: empty splits differ"
    assert (cpu["lse_part"][fin] - parts["lse_part"][fin]).abs().max() < 2e-2, f"seed {seed}: lse"
