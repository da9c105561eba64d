"""Benchmark of the DeepSeek-V4 attention decode blocks (core split-KV tiles + sink/un-rope combine)
at V4.1-Flash's per-GPU shape (TP8: 8 heads x 512, window 128), batch 1 / 8 / 64: HCA (ratio 128)
and CSA (top-512 of ratio-4 entries) at 32K and 128K context, and sliding-window-only layers;
beside the same work in PyTorch under a CUDA graph (gather of the keys, bf16 matmuls, fp32 masked
softmax with the sink) and the floor: bytes of window + new + compressed KV rows read (weights
not included) / the copy bandwidth measured in this run (bench/common.copy_bandwidth).

    python -m bench.dsv4_bench --out bench/results/h200 [--quick] [--match "sublayer csa" ...]
        [--set fill_stage=0,x_gemv_rows=16]      (DSV4LayerConfig fields for the sublayer cases)

Also the whole SWA / HCA attention sublayer in one launch ("sublayer:" cases, bench_sublayer:
projections and the output projection included; floor = weights + KV rows read; a timeline at
batch 1).

Timing: both launches of many calls in one CUDA graph, rotating over enough cache copies to
exceed the L2; median of replays. JSON (dsv4_bench.json): commit, command, GPU, copy bandwidth,
per case us, GB/s, fraction of floor, torch graph us, speed-up, rel err of the timed config.
"""
from __future__ import annotations

import os
import time

import torch

from bench.common import (L2_FLUSH_BYTES, add_match_option, arg_parser, cu_stream, name_matches, parse_overrides,
                          run_cases, timed)

HEADS, HD, W = 8, 512, 128


def bench_case(mode, ctx, batch, copy_bw, quick=False, splits=None):
    from sdk.blocks._cute import standalone
    from sdk.blocks.dsv4_attention import (DSV4CombineBlock, DSV4CombineConfig, DSV4DecodeBlock,
                                           DSV4DecodeConfig, choose_splits)
    ratio = {"swa": 1, "hca": 128, "csa": 4}[mode]
    start = ctx - 1
    E = max(1, ctx // ratio)
    probe = DSV4DecodeBlock(DSV4DecodeConfig(heads=HEADS, mode=mode, batch=batch, ratio=ratio, max_entries=E))
    forced, splits = splits, splits or choose_splits(batch, probe.keys_of(start))
    core = DSV4DecodeBlock(DSV4DecodeConfig(**{**probe.config.__dict__, "num_splits": splits}))
    comb = DSV4CombineBlock(DSV4CombineConfig(heads=HEADS, batch=batch, num_splits=splits))
    kvb = core.kv_bytes([start] * batch)
    copies = max(1, -(-L2_FLUSH_BYTES // kvb))
    # one CSA comp cache holds all ctx/4 entries (the indexer's view) but the attention reads 512
    comp_entries = E if mode != "csa" else E
    per_copy = batch * (W + 1 + comp_entries) * HD * 2
    copies = min(copies, max(1, (8 << 30) // per_copy))
    r = lambda *s: torch.randn(*s, device="cuda").to(torch.bfloat16)
    q = r(batch, 1, HEADS, HD)
    bufs = [{"window": r(batch, W, HD), "new_kv": r(batch, 1, HD), "comp": r(batch, comp_entries, HD)}
            for _ in range(copies)]
    starts = torch.full((batch,), start, dtype=torch.int32, device="cuda")
    idx = None
    if mode == "csa":
        idx = torch.stack([torch.randperm(E, device="cuda")[:512] for _ in range(batch)]).int().view(batch, 1, 512)
    o_part = torch.empty(batch, 1, splits, core.rows, HD, device="cuda")
    lse_part = torch.empty(batch, 1, splits, core.rows, device="cuda")
    ang = torch.randn(batch, 1, 32, device="cuda")
    cs, sn = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    sinks = torch.randn(HEADS, device="cuda")
    out = torch.empty(batch, 1, HEADS, HD, dtype=torch.bfloat16, device="cuda")
    t0 = time.time()
    fc, fm = standalone(core), standalone(comb)
    compile_s = time.time() - t0
    tabs = []
    for bf in bufs:
        ops = {"q": q, **bf, "index": idx, "start": starts, "o_part": o_part, "lse_part": lse_part}
        tabs.append(torch.tensor([ops[n].data_ptr() if ops.get(n) is not None else 0 for n in core.operands()],
                                 dtype=torch.int64, device="cuda"))
    ops = {"o_part": o_part, "lse_part": lse_part, "sinks": sinks, "cos": cs, "sin": sn, "out": out}
    ctab = torch.tensor([ops[n].data_ptr() for n in comb.operands()], dtype=torch.int64, device="cuda")

    def call(tab):
        fc(tab.data_ptr(), cu_stream())
        fm(ctab.data_ptr(), cu_stream())
    out.fill_(float("nan"))
    call(tabs[0])
    torch.cuda.synchronize()
    err = None
    if batch <= 8:
        cpu = {"q": q, **bufs[0], "index": idx, "start": starts, "sinks": sinks, "cos": cs, "sin": sn}
        cpu = {k: v.cpu() for k, v in cpu.items() if v is not None}
        cpu.update(core.reference(**cpu))
        want = comb.reference(**cpu)["out"]
        err = ((out.float().cpu() - want).norm() / want.norm()).item()
    us, mode_t = timed([lambda t=t: call(t) for t in tabs] * max(2, (2 if quick else 8) // copies))

    # unfused PyTorch: gather the keys, scores, masked softmax with the sink, PV
    def torch_step(bf):
        nc = {"swa": 0, "hca": (start + 1) // ratio, "csa": 512}[mode]
        qq = q.view(batch, HEADS, HD)

        def step():
            keys = [bf["window"], bf["new_kv"]]
            if mode == "hca":
                keys.append(bf["comp"][:, :nc])
            elif mode == "csa":
                keys.append(torch.gather(bf["comp"], 1, idx.view(batch, 512, 1).long().expand(-1, -1, HD)))
            k = torch.cat(keys, 1)
            s = torch.matmul(qq, k.transpose(1, 2)).float() * HD ** -0.5
            s = torch.cat([s, sinks.view(1, HEADS, 1).expand(batch, -1, -1)], -1)
            p = torch.softmax(s, -1)[..., :-1].to(torch.bfloat16)
            return torch.matmul(p, k)
        return step
    torch_us = None
    try:
        torch_us, _ = timed([torch_step(bf) for bf in bufs[:4]] * 2)
    except torch.OutOfMemoryError:
        pass
    floor_us = kvb / (copy_bw * 1e3)
    rec = {"case": case_name((mode, ctx, batch, forced)), "mode": mode, "batch": batch, "context": ctx,
           "heads": HEADS, "num_splits": splits, "chunk": core.config.chunk, "stages": core.stages,
           "kv_bytes": kvb, "us": us, "gbs": kvb / (us * 1e3), "floor_us": floor_us,
           "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
           "speedup_vs_torch_graph": torch_us / us if torch_us else None, "timing_mode": mode_t,
           "rel_err": err, "l2_rotation_copies": copies, "compile_s": round(compile_s, 2)}
    del bufs, tabs
    torch.cuda.empty_cache()
    return rec


def sublayer_config(mode, ctx, batch, splits=None, **overrides):
    """The V4.1-Flash TP8 sublayer configuration the bench runs (bench.schedule_sim rebuilds it)."""
    from sdk.megakernel.dsv4_layer import DSV4LayerConfig
    return DSV4LayerConfig(mode=mode, batch=batch, heads=HEADS, hidden=5120, q_rank=1024, o_rank=1024, window=W,
                           ratio=4 if mode == "csa" else 128, max_seq_len=ctx + 256, num_splits=splits or 0,
                           **overrides)


def bench_sublayer(mode, ctx, batch, copy_bw, timeline_path=None, splits=None, **overrides):
    """The SWA / HCA / CSA attention sublayer (sdk/megakernel/dsv4_layer.py: projections, norms +
    RoPE, compressors, the CSA indexer, split-KV decode, combine, ring write, o_a / o_b + residual)
    in ONE launch at the
    V4.1-Flash TP8 shard (8 heads, hidden 5120), sequences at `ctx` tokens (every sequence closes
    a compressor window: the compressor's worst step), against DSV4AttentionReference.forward
    (+ input norm, residual; its compressor `capturable`) as PyTorch under a CUDA graph, and the
    floor: weights + the KV rows the attention reads. `overrides`: DSV4LayerConfig fields. Launches alternate over
    weight copies (rotated_launches: the weights dominate the bytes). With mhc ("v4" / "v41"): the
    streams in and out (read twice, written once: in the floor), the output compared is the
    streams' increment, the torch side the model's MHCResidual around the attention."""
    from bench.common import record_timeline, rotated_launches
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.dsv4_layer import build_program, make_inputs, make_weights, reference
    from sdk.megakernel.mhc_site import site_fn
    from sdk.megakernel.program import RECORDS_MARGIN
    from sdk.megakernel.runtime import program_runtime
    cfg = sublayer_config(mode, ctx, batch, splits, **overrides)
    prog = build_program(cfg)
    starts = [ctx - 1] * batch
    wb = prog.bytes_by_role("weight")
    dec = next(op.block for op in prog.ops if op.label == "v4.decode")
    kvb = dec.kv_bytes(starts)
    if mode == "csa":       # + the indexer's keys (bf16 or mxfp4 records), all of every sequence's ready entries
        score = next(op.block for op in prog.ops if op.label == "v4.i_scores")
        kvb += sum(min(cfg.max_entries, (s + 1) // cfg.ratio) for s in starts) * score.key_bytes_each
    if cfg.mhc:         # the streams: read by the collapse (and v4's coefficients) and the post, written once
        kvb += 3 * prog.bytes_of("streams")
    w = make_weights(cfg, seed=0, device="cuda")
    hc_fn = site_fn(cfg.site, seed=2, device="cuda") if cfg.mhc else None
    inp = make_inputs(cfg, starts, seed=1, device="cuda", hc_fn=hc_fn)
    rt = program_runtime(prog, w, inputs={k: v.clone() for k, v in inp.items()})
    out, base = ("streams", "streams") if cfg.mhc else ("resid", "x")
    for name in ("coef", "part_next") if cfg.mhc else ("resid",):
        rt.tensors[name].fill_(float("nan"))
    rt.run()
    # CSA: the attention over the program's own index list, after checking it is a top-k of the
    # reference's scores up to near-ties (a near-tie swap moves the output by up to ~5e-2 on
    # random caches and says nothing about the attention; dsv4_layer.reference)
    want = reference(cfg, w, inp, index=rt.tensors["index"] if mode == "csa" else None, hc_fn=hc_fn)
    x = inp[base].float()
    d = rt.tensors[out].float() - x
    err = ((d - (want[out].float() - x)).norm() / (want[out].float() - x).norm()).item()
    launches, copies = rotated_launches(prog, rt, make_weights, cfg, wb + kvb)
    us, mode_t = timed(launches)
    rt.check()
    case = case_name((f"sublayer:{mode}", ctx, batch, splits, overrides))
    if timeline_path:
        record_timeline(prog, rt.tensors, timeline_path, case, us)
    torch_us, torch_mode = timed([lambda: reference(cfg, w, inp, capturable=True, hc_fn=hc_fn)])
    floor_us = (wb + kvb) / (copy_bw * 1e3)
    return {"case": case, "mode": mode, "batch": batch, "context": ctx, "heads": HEADS, "weight_bytes": wb,
            "kv_bytes": kvb, "program_ops": [op.label for op in prog.ops], "decode_stages": dec.stages,
            "ring_stage_bytes_stages": ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)[:2],
            "num_splits": dec.config.num_splits, "us": us, "gbs": (wb + kvb) / (us * 1e3), "floor_us": floor_us,
            "fraction_of_floor": floor_us / us, "torch_us": torch_us, "torch_timing_mode": torch_mode,
            "torch_graph_us": torch_us if torch_mode == "cuda_graph" else None,
            "speedup_vs_torch_graph": torch_us / us if torch_mode == "cuda_graph" else None,
            "speedup_vs_torch": torch_us / us, "timing_mode": mode_t, "rel_err": err, "copies": copies}


def cases(quick):
    out = []
    for mode in ("hca", "csa"):
        for ctx in ((32768,) if quick else (32768, 131072)):
            for batch in (1, 8, 64):
                out.append((mode, ctx, batch))
    out += [("swa", 4096, 1), ("swa", 4096, 64)]
    # the whole SWA / HCA sublayer in one launch (bench_sublayer)
    out += [("sublayer:hca", 32768, b) for b in (1, 8, 64)] + [("sublayer:swa", 4096, 1)]
    # CSA (the indexer chain in the program)
    out += [("sublayer:csa", 32768, b) for b in (1, 8, 64)]
    # batch 1 with more KV splits than choose_splits' 4-chunk minimum gives
    out += [("hca", 32768, 1, 12), ("sublayer:hca", 32768, 1, 12), ("sublayer:swa", 4096, 1, 5)]
    return out


def case_name(c):
    """mode, ctx, batch[, KV splits forced[, DSV4LayerConfig overrides]]"""
    name = f"v41flash_tp8 {c[0].replace(':', ' ')} B={c[2]} ctx={c[1]}"
    name += f" S={c[3]}" if len(c) > 3 and c[3] else ""
    return name + "".join(f" {k}={v}" for k, v in (c[4] if len(c) > 4 else {}).items())


def bench_one(c, bw, quick, out_dir):
    mode, ctx, batch = c[:3]
    splits = c[3] if len(c) > 3 else None
    overrides = c[4] if len(c) > 4 else {}
    if mode.startswith("sublayer:"):
        tag = (f"_s{splits}" if splits else "") + "".join(f"_{k}{v if isinstance(v, str) else int(v)}" for k, v in overrides.items())
        tl = (os.path.join(out_dir, f"timeline_dsv4_sublayer_{mode[9:]}_b{batch}{tag}.json")
              if out_dir and batch == 1 else None)
        return bench_sublayer(mode[9:], ctx, batch, bw, tl, splits, **overrides)
    return bench_case(mode, ctx, batch, bw, quick, splits)


def run(out_dir=None, quick=False, match=None, overrides=None):
    """match: run only the cases whose name contains one of these strings (one ending in "$": whose
    name ends with it); overrides (DSV4LayerConfig fields): given to every sublayer case."""
    todo = [c for c in cases(quick) if name_matches(case_name(c), match)]
    if overrides:
        todo = [(*c[:3], c[3] if len(c) > 3 else None, {**(c[4] if len(c) > 4 else {}), **overrides})
                if c[0].startswith("sublayer:") else c for c in todo]
    return run_cases("dsv4_bench.json", todo, lambda c, bw: bench_one(c, bw, quick, out_dir),
                     case_name, out_dir, case_width=44)


def main(argv=None):
    ap = arg_parser(out_from_env=False)
    add_match_option(ap)
    ap.add_argument("--set", default="", help="key=value,... : DSV4LayerConfig fields for the sublayer cases "
                    "(e.g. fill_stage=0,x_gemv_rows=16,decode_stages=2)")
    a = ap.parse_args(argv)
    run(a.out, a.quick, a.match, parse_overrides(a.set))


if __name__ == "__main__":
    main()
