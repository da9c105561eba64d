"""Benchmark of the MLA decode blocks (core split-KV tiles + combine) on the GPU, per-GPU head
shards of Kimi K3 (TP8: 12 heads, TP16: 6) and GLM-5.3 (TP8: 8 heads, NoPE) at 32K and 128K
context, batch 1 / 8 / 64; beside the same work in PyTorch under a CUDA graph (paged gather +
bf16 matmuls + fp32 softmax) and the floor (cache bytes / copy bandwidth measured in this run).

    python -m bench.mla_bench --out bench/results/h200 [--quick] [--cases shard:ctx:batch:kv:T,..]
                              [--set chunk=64,stages=3,splits=64,min_chunks=4,cols=512]

--set overrides every case's decode config (chunk, stages, q_in_regs, mma), the split count
(splits: a fixed count; min_chunks: choose_splits' shortest split), the combine's columns per
tile (cols), pdl=0 (plain launches; the default launches both with PDL) and kv_before_wait=0 (with
PDL, the decode tiles' first chunk copies after griddepcontrol.wait, not before).

Timing: both launches (decode, combine) of many calls captured in one CUDA graph; when one
call's cache is smaller than 256 MB, calls rotate over several copies of the page pool (through
their block tables) so none reads what the previous one left in L2. Median of several replays.
JSON (mla_bench.json): commit, command, GPU, copy bandwidth, one record per case with us, GB/s,
fraction of floor, torch graph us and the speed-up, rel err of the timed configuration.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from bench.common import (L2_FLUSH_BYTES, arg_parser, cu_stream, parse_overrides, record_timeline, rotated_launches,
                          run_cases, timed)

SHARDS = {   # name: heads, rope, softmax scale
    "kimi_k3_tp8": (12, 64, 192 ** -0.5),
    "kimi_k3_tp16": (6, 64, 192 ** -0.5),
    "glm_53_tp8": (8, 0, 256 ** -0.5),
    # every head on each GPU (DP attention): 3 row groups of 32 read the same keys
    "kimi_k3_tp1": (96, 64, 192 ** -0.5),
}


def torch_decode_fn(q, kv, kv_scale, bt, lens_list, heads, T, d_v, scale, page):
    """The same work as unfused PyTorch: gather each sequence's pages, scores, masked softmax,
    PV; one batched path for equal lengths (what the benchmark uses)."""
    B = q.shape[0]
    L = lens_list[0]
    assert all(x == L for x in lens_list)
    npg = -(-L // page)
    tbl = bt[:, :npg].long()
    qpos = L - T + torch.arange(T * heads, device=q.device) // heads
    mask = torch.arange(npg * page, device=q.device)[None, :] > qpos[:, None]
    out = torch.empty(B, T * heads, d_v, dtype=torch.bfloat16, device=q.device)
    qq = q.view(B, T * heads, -1)

    def step():
        rows = kv[tbl].flatten(1, 2)                                   # [B, npg*page, d]
        if kv_scale is not None:
            sc = kv_scale[tbl].flatten(1, 2)
            rows = (rows.float() * sc.repeat_interleave(rows.shape[-1] // sc.shape[-1], -1)).to(torch.bfloat16)
        s = torch.matmul(qq, rows.transpose(1, 2)).float() * scale
        s.masked_fill_(mask, float("-inf"))
        p = torch.softmax(s, -1).to(torch.bfloat16)
        torch.matmul(p, rows[..., :d_v], out=out)
    return step, out


def bench_case(shard, ctx, batch, kvd, copy_bw, T=1, quick=False, overrides=None):
    from sdk.blocks._cute import standalone
    from sdk.blocks.mla_decode import (MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig,
                                       absorbed_attention, choose_chunk, choose_mma, choose_splits, quantize_kv_fp8,
                                       row_groups)
    heads, rope, scale = SHARDS[shard]
    ov = dict(overrides or {})
    page = 64
    groups = row_groups(T * heads)          # a sequence's tiles per split (more than 32 query rows)
    ov.setdefault("chunk", choose_chunk(batch * groups, ctx))
    ov.setdefault("mma", choose_mma(batch * groups, ctx, kvd, torch.cuda.get_device_capability())
                  if ov["chunk"] == 64 else "warp")
    splits = ov.pop("splits", 0) or choose_splits(batch * groups, ctx, min_chunks_per_split=ov.pop("min_chunks", 8),
                                                  chunk=ov["chunk"])
    ov.pop("min_chunks", None)
    cols = ov.pop("cols", 0)
    # both launches programmatic-dependent (PDL: each launch's CTAs start as the previous one's
    # last CTAs run, then wait for its results): measured faster at batch 1 (H200, 2026-12-06:
    # Kimi K3 TP8 128K 45.5 vs 46.9-47.3 us); pdl=0 launches plainly
    pdl = bool(ov.pop("pdl", 1))
    # with PDL each decode tile copies its first chunks before its wait (kv_before_wait: the grid
    # before it writes no cache row these read); kv_before_wait=0 keeps every read after the wait
    ov["kv_before_wait"] = pdl and bool(ov.get("kv_before_wait", 1))
    npg = -(-ctx // page)
    cfg0 = MLADecodeConfig(heads=heads, softmax_scale=scale, batch=batch, q_tokens=T, rope=rope, page_size=page,
                           num_pages=1, max_seq_len=ctx, num_splits=splits, kv_dtype=kvd, **ov)
    blk0 = MLADecodeBlock(cfg0)
    kvb = blk0.kv_bytes([ctx] * batch)
    copies = max(1, -(-L2_FLUSH_BYTES // kvb))
    pages = batch * npg * copies
    cfg = MLADecodeConfig(**{**cfg0.__dict__, "num_pages": pages})
    blk = MLADecodeBlock(cfg)
    comb = MLACombineBlock(MLACombineConfig(heads=heads, batch=batch, q_tokens=T, d_v=blk.d_v, num_splits=splits,
                                            cols_per_tile=cols))
    d = blk.d_qk
    # the pool, filled in slices (no fp32 copy of a 10 GB pool); pages of every call scattered
    kv = torch.empty(pages, page, d, dtype=torch.float8_e4m3fn if blk.fp8 else torch.bfloat16, device="cuda")
    kv_scale = torch.empty(pages, page, d // cfg.scale_group, device="cuda") if blk.fp8 else None
    step_pg = 4096
    for i in range(0, pages, step_pg):
        x = torch.randn(min(step_pg, pages - i), page, d, device="cuda")
        if blk.fp8:
            kv[i:i + x.shape[0]], kv_scale[i:i + x.shape[0]] = quantize_kv_fp8(x, cfg.scale_group)
        else:
            kv[i:i + x.shape[0]] = x.to(torch.bfloat16)
    perm = torch.randperm(pages, device="cuda").int().view(copies, batch, npg)
    q = torch.randn(batch, T, heads, d, device="cuda").to(torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    o_part = torch.empty(batch, splits, blk.rows, blk.d_v, device="cuda")
    lse_part = torch.empty(batch, splits, blk.rows, device="cuda")
    out = torch.empty(batch, T, heads, blk.d_v, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, T, heads, device="cuda")
    t0 = time.time()
    fn_dec, fn_comb = standalone(blk, pdl=pdl), standalone(comb, pdl=pdl)
    compile_s = time.time() - t0
    tables = []
    for i in range(copies):
        bt = perm[i].contiguous()
        ops = {"q": q, "kv": kv, "kv_scale": kv_scale, "block_table": bt, "seq_lens": lens,
               "o_part": o_part, "lse_part": lse_part}
        optab = torch.tensor([ops[n].data_ptr() for n in blk.operands()], dtype=torch.int64, device="cuda")
        tables.append((bt, optab))
    ctab = torch.tensor([x.data_ptr() for x in (o_part, lse_part, out, lse)], dtype=torch.int64, device="cuda")

    def call(optab):
        fn_dec(optab.data_ptr(), cu_stream())
        fn_comb(ctab.data_ptr(), cu_stream())

    # correctness of the timed configuration (copy 0), poisoned outputs
    for x in (o_part, lse_part, out, lse):
        x.fill_(float("nan"))
    call(tables[0][1])
    torch.cuda.synchronize()
    err = None
    if batch * ctx <= 8 * 32768:
        tens = {"kv": kv, "kv_scale": kv_scale, "block_table": tables[0][0]}
        rows = [blk.gather_kv(tens, b, 0, ctx) for b in range(batch)]
        want, _ = absorbed_attention(q, rows, [ctx] * batch, T, heads, blk.d_v, blk.scale)
        err = ((out.float() - want).norm() / want.norm()).item() if torch.isfinite(out).all() else float("nan")
        del rows

    reps = max(2, 8 // copies) if not quick else 2
    us, mode = timed([lambda o=o: call(o) for _, o in tables] * reps)
    # the decode launch alone: what the combine (its own launch) adds is us - decode_us
    decode_us, _ = timed([lambda o=o: fn_dec(o.data_ptr(), cu_stream()) for _, o in tables] * reps)

    torch_us, torch_note = None, "skipped (gather would exceed memory)"
    gather_bytes = batch * npg * page * d * 2 * (2 if blk.fp8 else 1)
    if gather_bytes <= (12 << 30):
        steps = []
        for bt, _ in tables[:max(1, min(copies, 4))]:
            st, _ = torch_decode_fn(q, kv, kv_scale, bt, [ctx] * batch, heads, T, blk.d_v, blk.scale, page)
            steps.append(st)
        try:
            torch_us, _ = timed(steps * max(1, 4 // len(steps)))
            torch_note = "torch: page gather + bf16 matmuls + fp32 softmax" + (" (+fp8 dequant)" if blk.fp8 else "")
        except torch.OutOfMemoryError:
            torch_note = "torch OOM"
        torch.cuda.empty_cache()
    floor_us = kvb / (copy_bw * 1e3)
    tag = "".join(f" {k}={v}" for k, v in (overrides or {}).items())
    rec = {"case": f"{shard} B={batch} ctx={ctx} T={T} {kvd}{tag}", "overrides": overrides or {}, "shard": shard, "heads": heads, "rope": rope,
           "batch": batch, "context": ctx, "q_tokens": T, "kv_dtype": kvd, "num_splits": splits,
           "chunk": cfg.chunk, "mma": cfg.mma, "pdl": pdl, "kv_before_wait": cfg.kv_before_wait, "stages": blk.stages,
           "combine_tiles": comb.num_tiles(),
           "kv_bytes": kvb, "us": us,
           "decode_us": decode_us, "gbs": kvb / (us * 1e3),
           "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
           "speedup_vs_torch_graph": (torch_us / us) if torch_us else None, "torch_note": torch_note,
           "timing_mode": mode, "rel_err": err, "l2_rotation_copies": copies, "compile_s": round(compile_s, 2)}
    del kv, kv_scale, tables
    torch.cuda.empty_cache()
    return rec


def bench_program_case(shard, ctx, batch, copy_bw, overrides=None):
    """The one-launch attention program (sdk/megakernel/mla_attention.py: W_UK -> decode ->
    combine -> W_UV as megakernel instructions) at a Kimi K3 head shard; floor = cache rows +
    absorbed weights; PyTorch: the same chain (einsum projections + the attention above).
    overrides: MLAAttentionConfig fields (decode_chunk=64,decode_stages=0)."""
    from sdk.megakernel.mla_attention import MLAAttentionConfig, build_program, make_inputs, make_weights, reference
    from sdk.megakernel.runtime import program_runtime
    heads, rope, scale = SHARDS[shard]
    if rope != 64:
        raise ValueError(f"{shard}: the program case takes the Kimi K3 shards (nope 128, rope 64, v 128)")
    npg = -(-ctx // 64)
    cfg = MLAAttentionConfig(heads=heads, softmax_scale=scale, batch=batch, num_pages=batch * npg, max_seq_len=ctx,
                             **(overrides or {}))
    prog = build_program(cfg)
    weights = make_weights(cfg, seed=0, device="cuda")
    inputs = make_inputs(cfg, [ctx] * batch, seed=1, device="cuda")
    t0 = time.time()
    rt = program_runtime(prog, weights, inputs)      # (kv_b_proj, the checkpoint's piece, is no buffer)
    rt.tensors["o"].fill_(float("nan"))
    rt.run()
    compile_s = time.time() - t0
    err = None
    if batch * ctx <= 8 * 32768:
        want = reference(cfg, weights, inputs)
        got = rt.tensors["o"].float()
        err = ((got - want).norm() / want.norm()).item() if torch.isfinite(got).all() else float("nan")
    us, mode = timed([rt.launch] * 8)
    rt.check()
    dec = prog.ops[1].block
    kvb = dec.kv_bytes([ctx] * batch)
    wb = prog.bytes_by_role("weight")
    floor_us = (kvb + wb) / (copy_bw * 1e3)
    # PyTorch: the same chain under a CUDA graph
    q, w_uk_t, w_uv = inputs["q"].clone(), weights["w_uk_t"], weights["w_uv"]
    att, out = torch_decode_fn(q, inputs["kv"], None, inputs["block_table"], [ctx] * batch, heads, 1, 512,
                               dec.scale, 64)
    q_nope = inputs["q_nope"]

    def torch_step():
        q[..., :512] = torch.einsum("mhk,hnk->mhn", q_nope, w_uk_t).view(q[..., :512].shape)
        att()
        torch.einsum("mhk,hnk->mhn", out.view(batch, heads, 512), w_uv)
    torch_us, _ = timed([torch_step] * 4)
    rec = {"case": f"{shard} B={batch} ctx={ctx} program" + "".join(f" {k}={v}" for k, v in (overrides or {}).items()),
           "config_overrides": overrides or {}, "decode_chunk": dec.config.chunk, "decode_stages": dec.stages,
           "decode_mma": dec.config.mma,
           "shard": shard, "heads": heads, "batch": batch,
           "context": ctx, "program_ops": [op.label for op in prog.ops], "instructions": len(prog.instructions),
           "num_splits": cfg.splits, "kv_bytes": kvb, "weight_bytes": wb, "us": us, "gbs": (kvb + wb) / (us * 1e3),
           "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
           "speedup_vs_torch_graph": torch_us / us, "timing_mode": mode, "rel_err": err,
           "compile_s": round(compile_s, 2), "note": "one megakernel launch; cache not rotated (>= 300 MB per call)"}
    del rt, inputs
    torch.cuda.empty_cache()
    return rec


def cases(quick: bool):
    out = []
    for shard in ("kimi_k3_tp8", "kimi_k3_tp16", "glm_53_tp8"):
        for ctx in (32768, 131072):
            for batch in (1, 8, 64):
                if quick and (batch == 8 or shard == "kimi_k3_tp16"):
                    continue
                out.append((shard, ctx, batch, "bf16", 1))
    out += [("kimi_k3_tp8", 32768, 8, "fp8_e4m3", 1), ("kimi_k3_tp8", 131072, 1, "fp8_e4m3", 1),
            ("kimi_k3_tp8", 131072, 64, "fp8_e4m3", 1), ("kimi_k3_tp16", 32768, 8, "bf16", 2),
            ("glm_53_tp8", 32768, 8, "bf16", 4)]
    return out


def run_sublayer_once(build_program, make_weights, make_inputs, cfg, batch: int, ctx: int):
    """(program, weights, inputs, runtime, seconds to compile and run once) of a sublayer module's
    program (mla_layer / dsa_layer: same build / weights / inputs functions) at `batch` sequences
    of `ctx` tokens, run once on the GPU."""
    from sdk.megakernel.runtime import program_runtime
    prog = build_program(cfg)
    w = make_weights(cfg, seed=0, device="cuda")
    inp = make_inputs(cfg, [ctx] * batch, seed=1, device="cuda")
    t0 = time.time()
    rt = program_runtime(prog, w, inp)
    rt.run()
    return prog, w, inp, rt, time.time() - t0


def bench_layer_case(shard, ctx, batch, copy_bw, overrides=None, timeline_path=None):
    """The whole MLA sublayer in one launch (sdk/megakernel/mla_layer.py: norms, q / kv
    projections, RoPE + cache append, attention, o_proj + residual) at a Kimi K3 head shard;
    floor = cache rows + all the sublayer's weights. PyTorch: MLAReference.forward's math on the
    dense cache is not a fair graph (it expands keys); reported without a torch ratio."""
    from sdk.megakernel.mla_attention import MLAAttentionConfig
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.mla_layer import MLALayerConfig, build_program, make_inputs, make_weights, reference
    from sdk.megakernel.program import RECORDS_MARGIN
    heads, rope, scale = SHARDS[shard]
    if rope != 64:
        raise ValueError(f"{shard}: the layer case takes the Kimi K3 shards")
    npg = -(-ctx // 64) + 1
    # overrides: MLALayerConfig fields (gemv_rows) and MLAAttentionConfig fields (decode_stages)
    ov = dict(overrides or {})
    layer_ov = {k: ov.pop(k) for k in list(ov) if k in MLALayerConfig.__dataclass_fields__}
    cfg = MLALayerConfig(MLAAttentionConfig(heads=heads, softmax_scale=scale, batch=batch, num_pages=batch * npg,
                                            max_seq_len=ctx, **ov), **layer_ov)
    prog, w, inp, rt, compile_s = run_sublayer_once(build_program, make_weights, make_inputs, cfg, batch, ctx)
    err = None
    if batch * ctx <= 8 * 32768:
        x = inp["x"].float()
        want = reference(cfg, w, inp) - x
        err = ((rt.tensors["resid"] - x - want).norm() / want.norm()).item()
    dec = next(op.block for op in prog.ops if op.label == "attn.decode")
    kvb, wb = dec.kv_bytes([ctx] * batch), prog.bytes_by_role("weight")
    launches, copies = rotated_launches(prog, rt, make_weights, cfg, kvb + wb)
    us, mode = timed(launches)
    rt.check()
    if timeline_path:
        record_timeline(prog, rt.tensors, timeline_path, f"{shard} B={batch} ctx={ctx} sublayer", us)
    floor_us = (kvb + wb) / (copy_bw * 1e3)
    rec = {"case": f"{shard} B={batch} ctx={ctx} sublayer", "shard": shard, "heads": heads, "batch": batch,
           "context": ctx, "program_ops": [op.label for op in prog.ops], "decode_stages": dec.stages,
           "ring_stage_bytes_stages": ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)[:2],
           "config_overrides": overrides or {}, "kv_bytes": kvb, "weight_bytes": wb, "us": us, "gbs": (kvb + wb) / (us * 1e3), "floor_us": floor_us,
           "fraction_of_floor": floor_us / us, "torch_graph_us": None, "speedup_vs_torch_graph": None,
           "timing_mode": mode, "rel_err": err, "compile_s": round(compile_s, 2), "weight_copies": copies,
           "note": "one launch; the new tokens' rows are rewritten each replay (same positions)"}
    del rt, inp
    torch.cuda.empty_cache()
    return rec


def bench_dsa_layer_case(shard, ctx, batch, copy_bw, timeline_path=None, overrides=None):
    """GLM-5.3's whole DSA sublayer in one launch (sdk/megakernel/dsa_layer.py: the MLA sublayer
    with the lightning indexer - its projections, key-cache append, scores over every pooled key,
    top-k - and the sparse decode over each token's list) at the GLM-5.3 TP8 head shard. Floor =
    the selected cache rows (min(list width, context) per token) + the indexer's pooled keys of
    the whole context (its scores read them all) + every weight of the sublayer. Reported without
    a torch ratio (no PyTorch sparse-MLA path to compare with fairly)."""
    from models.glm_53.config import full, spec_from_config
    from sdk.megakernel.dsa_layer import build_program, check_selection, make_inputs, make_weights, reference, shard_config
    if shard != "glm_53_tp8":
        raise ValueError(f"{shard}: the DSA sublayer case takes the GLM-5.3 TP8 shard")
    cfg = shard_config(spec_from_config(full()), batch=batch, max_seq_len=ctx,
                       num_pages=batch * -(-ctx // 64) + 4)
    if overrides:       # DSALayerConfig fields first (its decode_chunk: the sparse decode's), then its attention's
        ov = dict(overrides)
        layer_ov = {k: ov.pop(k) for k in list(ov) if k in type(cfg).__dataclass_fields__}
        cfg = replace(cfg, mla=replace(cfg.mla, attn=replace(cfg.mla.attn, **ov)), **layer_ov)
    prog, w, inp, rt, compile_s = run_sublayer_once(build_program, make_weights, make_inputs, cfg, batch, ctx)
    err, flips = None, None
    if batch * ctx <= 2 * 32768:            # the reference expands keys and values: small cases only
        flips = check_selection(cfg, w, inp, rt.tensors["index"])
        want = reference(cfg, w, inp, selection=rt.tensors["index"] if flips else None)
        x = inp["x"].float()
        err = ((rt.tensors["resid"] - want).norm() / (want - x).norm()).item()
    dec = next(op.block for op in prog.ops if op.label == "attn.decode")
    kvb = dec.kv_bytes([ctx] * batch)
    ikb = batch * (ctx // cfg.kpool) * cfg.index_head_dim * 2
    wb = prog.bytes_by_role("weight")
    launches, copies = rotated_launches(prog, rt, make_weights, cfg, kvb + ikb + wb)
    us, mode = timed(launches)
    rt.check()
    if timeline_path:
        record_timeline(prog, rt.tensors, timeline_path, f"{shard} B={batch} ctx={ctx} dsa_sublayer", us)
    floor_us = (kvb + ikb + wb) / (copy_bw * 1e3)
    rec = {"case": f"{shard} B={batch} ctx={ctx} dsa_sublayer", "shard": shard, "batch": batch, "context": ctx,
           "program_ops": [op.label for op in prog.ops], "index_width": cfg.width, "kv_bytes": kvb,
           "index_key_bytes": ikb, "weight_bytes": wb, "us": us, "gbs": (kvb + ikb + wb) / (us * 1e3),
           "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": None,
           "speedup_vs_torch_graph": None, "timing_mode": mode, "rel_err": err, "selection_near_tie_flips": flips,
           "compile_s": round(compile_s, 2), "weight_copies": copies,
           "note": "one launch; the new tokens' rows and index keys are rewritten each replay (same positions)"}
    del rt, inp
    torch.cuda.empty_cache()
    return rec


PROGRAM_CASES = [("kimi_k3_tp8", 32768, 8, "program", 1), ("kimi_k3_tp8", 32768, 64, "program", 1),
                 ("kimi_k3_tp8", 131072, 8, "program", 1), ("kimi_k3_tp8", 32768, 1, "sublayer", 1),
                 ("kimi_k3_tp8", 32768, 8, "sublayer", 1), ("glm_53_tp8", 32768, 1, "dsa_sublayer", 1),
                 ("glm_53_tp8", 32768, 8, "dsa_sublayer", 1), ("glm_53_tp8", 131072, 8, "dsa_sublayer", 1)]


def bench_one(c, bw, quick=False, overrides=None, timeline_dir=None):
    if c[3] == "program":
        return bench_program_case(c[0], c[1], c[2], bw, overrides)
    if c[3] == "sublayer":
        tl = os.path.join(timeline_dir, f"timeline_mla_{c[0]}_b{c[2]}_{c[1]}.json") if timeline_dir else None
        return bench_layer_case(c[0], c[1], c[2], bw, overrides, tl)
    if c[3] == "dsa_sublayer":
        tl = os.path.join(timeline_dir, f"timeline_dsa_{c[0]}_b{c[2]}_{c[1]}.json") if timeline_dir else None
        return bench_dsa_layer_case(c[0], c[1], c[2], bw, tl, overrides)
    return bench_case(c[0], c[1], c[2], c[3], bw, T=c[4], quick=quick, overrides=overrides)


def run(out_dir: str | None = None, quick: bool = False, case_list=None, overrides=None, timeline=False) -> dict:
    tag = "".join(f" {k}={v}" for k, v in (overrides or {}).items())
    return run_cases("mla_bench.json", case_list or (cases(quick) + ([] if quick else PROGRAM_CASES)),
                     lambda c, bw: bench_one(c, bw, quick, overrides, out_dir if timeline else None),
                     lambda c: f"{c[0]} B={c[2]} ctx={c[1]} T={c[4]} {c[3]}{tag}", out_dir, case_width=52, us_width=9)


def parse_cases(text: str):
    """"shard:ctx:batch[:kv[:T]],..." -> bench cases."""
    out = []
    for item in filter(None, text.split(",")):
        f = item.split(":")
        out.append((f[0], int(f[1]), int(f[2]), f[3] if len(f) > 3 else "bf16", int(f[4]) if len(f) > 4 else 1))
    return out


def main(argv=None):
    ap = arg_parser(out_from_env=False)
    ap.add_argument("--cases", default="", help="shard:ctx:batch[:kv|program|sublayer|dsa_sublayer[:T]],... (overrides the default list)")
    ap.add_argument("--set", default="", help="key=value,... : decode cases chunk, stages, q_in_regs, splits, "
                    "min_chunks, cols; program cases MLAAttentionConfig fields (decode_chunk, decode_stages); "
                    "sublayer cases MLALayerConfig / MLAAttentionConfig fields (gemv_rows, "
                    "decode_stages, head_proj_in_flight); dsa_sublayer cases DSALayerConfig / MLAAttentionConfig "
                    "fields (index_stages, decode_chunk, head_proj_in_flight)")
    ap.add_argument("--timeline", action="store_true", help="sublayer / dsa_sublayer cases: the per-instruction "
                    "record (timeline_mla_*.json / timeline_dsa_*.json in --out)")
    a = ap.parse_args(argv)
    overrides = parse_overrides(a.set)
    run(a.out, a.quick, parse_cases(a.cases) or None, overrides, timeline=a.timeline and bool(a.out))


if __name__ == "__main__":
    main()
