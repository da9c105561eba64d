"""Benchmark of the indexer blocks (IndexScore + TopK) and GLM-5.3's sparse MLA decode, one decode
token per sequence, beside the same work in PyTorch under a CUDA graph and the floor:

- "v4_csa": V4.1-Flash CSA indexer, 64 x 128 heads, ratio 4, top-512, at 32K and 128K context;
  "v4_csa_mxfp4": the same with the keys as V4.1's 68 B mxfp4 records (the floor counts 68 B a key);
- "glm_dsa": GLM-5.3 k-pool indexer, 32 x 128 heads, kpool 16 (8192 pools at 128K), top-2048
  (128 pools + the tail);
- "glm_sparse_mla": GLM-5.3 TP8 sparse MLA (8 heads, NoPE, latent 512) over 2063-token lists on a
  paged cache (pages scattered), + the split combine.
Batch 1 and 8. Floor: bytes that must move / the copy bandwidth measured in this run
(bench/common.copy_bandwidth): indexer = key entries read + fp32 scores written (the scores'
re-reads by TopK are L2 traffic, not counted); sparse MLA = the selected latent rows.
PyTorch baseline: indexer = bf16 einsum, fp32 ReLU / head-weighted sum, masked torch.topk (no
token expansion); sparse MLA = gather of the selected rows through the block table, bf16 matmuls,
fp32 masked softmax.

    python -m bench.indexer_bench --out bench/results/h200 [--quick] [--match "v4_csa" ...]

JSON (indexer_bench.json): commit, command, GPU, copy bandwidth, per case us, GB/s, fraction of
floor, torch graph us, speed-up, rel err (indexer: scores vs the fp32 definition; sparse MLA: out).
"""
from __future__ import annotations

import time

import torch

from bench.common import L2_FLUSH_BYTES, add_match_option, arg_parser, cu_stream, name_matches, run_cases, timed

MODELS = {"v4_csa": dict(heads=64, ratio=4, topk=512), "glm_dsa": dict(heads=32, ratio=16, topk=2048),
          # V4.1's keys as 68 B mxfp4 records (key_dtype="mxfp4", opt-in)
          "v4_csa_mxfp4": dict(heads=64, ratio=4, topk=512, key_dtype="mxfp4")}


def _tab(block, ops):
    return torch.tensor([ops[n].data_ptr() if ops.get(n) is not None else 0 for n in block.operands()],
                        dtype=torch.int64, device="cuda")


def bench_indexer(model, ctx, batch, copy_bw, quick=False):
    from sdk.blocks._cute import standalone
    from sdk.blocks.indexer import (IndexScoreBlock, IndexScoreConfig, TopKBlock, TopKConfig, choose_keys_per_tile,
                                    dequantize_index_keys, quantize_index_keys)
    m = MODELS[model]
    H, d, r = m["heads"], 128, m["ratio"]
    E, start = ctx // r, ctx - 1
    mx = m.get("key_dtype") == "mxfp4"
    score = IndexScoreBlock(IndexScoreConfig(heads=H, batch=batch, max_entries=E, ratio=r,
                                             keys_per_tile=choose_keys_per_tile(batch, E),
                                             key_dtype=m.get("key_dtype", "bf16")))
    glm = model == "glm_dsa"
    topk = TopKBlock(TopKConfig(k=m["topk"] // r if glm else m["topk"], batch=batch, max_entries=E, ratio=r,
                                expand=r if glm else 1, tail=glm))
    kvb = score.key_bytes([start] * batch)
    copies = max(1, min(-(-L2_FLUSH_BYTES // kvb), (8 << 30) // (batch * E * score.key_bytes_each)))
    q = torch.randn(batch, 1, H, d, device="cuda").to(torch.bfloat16)
    w = torch.randn(batch, 1, H, device="cuda") * H ** -0.5
    keys = [quantize_index_keys(torch.randn(batch, E, d, device="cuda")) if mx
            else torch.randn(batch, E, d, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    starts = torch.full((batch,), start, dtype=torch.int32, device="cuda")
    scores = torch.empty(batch, 1, E, device="cuda")
    index = torch.empty(batch, 1, topk.width, dtype=torch.int32, device="cuda")
    t0 = time.time()
    fs, ft = standalone(score), standalone(topk)
    compile_s = time.time() - t0
    stabs = [_tab(score, {"q": q, "weights": w, "keys": k, "start": starts, "scores": scores}) for k in keys]
    ttab = _tab(topk, {"scores": scores, "start": starts, "index": index})

    def call(tab):
        fs(tab.data_ptr(), cu_stream())
        ft(ttab.data_ptr(), cu_stream())
    scores.fill_(float("nan"))
    call(stabs[0])
    torch.cuda.synchronize()
    err = None
    if batch == 1:
        cpu = {"q": q.cpu(), "weights": w.cpu(), "keys": keys[0].cpu(), "start": starts.cpu()}
        want = score.reference(**cpu)["scores"]
        err = ((scores.cpu() - want).norm() / want.norm()).item()
        assert torch.equal(index.cpu(), topk.reference(scores=scores.cpu(), start=starts.cpu())["index"])
    us, mode_t = timed([lambda t=t: call(t) for t in stabs] * max(2, (2 if quick else 8) // copies))

    def torch_step(k):
        def step():
            # mxfp4: the pages dequantised first; the BF16 stages' roundings left out (fp32 sums: a
            # per-head loop of roundings would slow the baseline, not make it the fairer one)
            kv = dequantize_index_keys(k, d) if mx else k
            s = torch.relu(torch.einsum("bhd,bed->bhe", q.view(batch, H, d), kv).float() * d ** -0.5)
            s = (s * w.view(batch, H, 1)).sum(1)
            return s.topk(min(topk.config.k, E), dim=-1).indices
        return step
    torch_us = None
    try:
        torch_us, _ = timed([torch_step(k) for k in keys[:4]] * 2)
    except torch.OutOfMemoryError:
        pass
    floor_us = kvb / (copy_bw * 1e3)
    rec = {"case": f"{model} B={batch} ctx={ctx}", "model": model, "batch": batch, "context": ctx, "heads": H,
           "entries": E, "k": topk.config.k, "keys_per_tile": score.config.keys_per_tile, "bytes": kvb, "us": us,
           "gbs": kvb / (us * 1e3), "floor_us": floor_us, "fraction_of_floor": floor_us / us,
           "torch_graph_us": torch_us, "speedup_vs_torch_graph": torch_us / us if torch_us else None,
           "timing_mode": mode_t, "rel_err": err, "l2_rotation_copies": copies, "compile_s": round(compile_s, 2)}
    del keys, stabs
    torch.cuda.empty_cache()
    return rec


def bench_sparse_mla(ctx, batch, copy_bw, quick=False):
    from sdk.blocks._cute import standalone
    from sdk.blocks.mla_decode import (MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig,
                                       choose_splits)
    H, L, W, page = 8, 512, 2048 + 15, 64
    splits = choose_splits(batch, W, chunk=64, min_chunks_per_split=4)
    pages = batch * (ctx // page)
    cfg = MLADecodeConfig(heads=H, softmax_scale=256 ** -0.5, batch=batch, kv_lora=L, rope=0, page_size=page,
                          num_pages=pages, max_seq_len=ctx, num_splits=splits, chunk=64, index_width=W)
    blk = MLADecodeBlock(cfg)
    comb = MLACombineBlock(MLACombineConfig(heads=H, batch=batch, d_v=L, num_splits=splits))
    kvb = blk.kv_bytes([ctx] * batch)
    pool = torch.randn(pages, page, L, device="cuda").to(torch.bfloat16)
    bt = torch.randperm(pages, device="cuda").int().view(batch, ctx // page)
    idxs = [torch.stack([torch.randperm(ctx, device="cuda")[:W] for _ in range(batch)]).int().view(batch, 1, W)
            for _ in range(max(1, min(8, -(-L2_FLUSH_BYTES // kvb))))]
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 1, H, L, device="cuda").to(torch.bfloat16)
    o_part = torch.empty(batch, splits, H, L, device="cuda")
    lse_part = torch.empty(batch, splits, H, device="cuda")
    out = torch.empty(batch, 1, H, L, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, 1, H, device="cuda")
    t0 = time.time()
    fd, fc = standalone(blk), standalone(comb)
    compile_s = time.time() - t0
    tabs = [_tab(blk, {"q": q, "kv": pool, "block_table": bt, "seq_lens": lens, "index": i, "o_part": o_part,
                       "lse_part": lse_part}) for i in idxs]
    ctab = _tab(comb, {"o_part": o_part, "lse_part": lse_part, "out": out, "lse": lse})

    def call(tab):
        fd(tab.data_ptr(), cu_stream())
        fc(ctab.data_ptr(), cu_stream())
    out.fill_(float("nan"))
    call(tabs[0])
    torch.cuda.synchronize()
    err = None
    if batch == 1:
        cpu = {"q": q.cpu(), "kv": pool.cpu(), "block_table": bt.cpu(), "seq_lens": lens.cpu(), "index": idxs[0].cpu()}
        want = comb.reference(**blk.reference(**cpu))["out"]
        err = ((out.float().cpu() - want).norm() / want.norm()).item()
    us, mode_t = timed([lambda t=t: call(t) for t in tabs] * max(2, (2 if quick else 8) // len(tabs)))

    def torch_step(idx):
        def step():
            tok = idx.view(batch, W).long()
            rows = bt.long().gather(1, tok // page) * page + tok % page
            kv = pool.view(-1, L)[rows]                                          # [B, W, L]
            s = torch.matmul(q.view(batch, H, L), kv.transpose(1, 2)).float() * 256 ** -0.5
            p = torch.softmax(s.masked_fill((tok < 0)[:, None], float("-inf")), -1).to(torch.bfloat16)
            return torch.matmul(p, kv)
        return step
    torch_us, _ = timed([torch_step(i) for i in idxs[:4]] * 2)
    floor_us = kvb / (copy_bw * 1e3)
    rec = {"case": f"glm_sparse_mla B={batch} ctx={ctx}", "model": "glm_sparse_mla", "batch": batch, "context": ctx,
           "heads": H, "index_width": W, "num_splits": splits, "stages": blk.stages, "bytes": kvb, "us": us,
           "gbs": kvb / (us * 1e3), "floor_us": floor_us, "fraction_of_floor": floor_us / us,
           "torch_graph_us": torch_us, "speedup_vs_torch_graph": torch_us / us if torch_us else None,
           "timing_mode": mode_t, "rel_err": err, "compile_s": round(compile_s, 2)}
    del pool, tabs
    torch.cuda.empty_cache()
    return rec


def cases(quick):
    out = [(m, ctx, b) for m in ("v4_csa", "v4_csa_mxfp4") for ctx in ((32768,) if quick else (32768, 131072))
           for b in (1, 8)]
    out += [("glm_dsa", 131072, b) for b in (1, 8)]
    out += [("glm_sparse_mla", 131072 if not quick else 32768, b) for b in (1, 8)]
    return out


def run(out_dir=None, quick=False, match=None):
    def one(case, bw):
        model, ctx, batch = case
        if model == "glm_sparse_mla":
            return bench_sparse_mla(ctx, batch, bw, quick)
        return bench_indexer(model, ctx, batch, bw, quick)

    name = lambda c: f"{c[0]} B={c[2]} ctx={c[1]}"         # noqa: E731
    return run_cases("indexer_bench.json", [c for c in cases(quick) if name_matches(name(c), match)], one, name,
                     out_dir, case_width=36)


def main(argv=None):
    ap = arg_parser(out_from_env=False)
    add_match_option(ap)
    a = ap.parse_args(argv)
    run(a.out, a.quick, a.match)


if __name__ == "__main__":
    main()
