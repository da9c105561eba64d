"""Benchmarks of the megakernel slice on the GPU: the GEMV block alone and the one-launch MLP stack,
each beside the same work in PyTorch under a CUDA graph and the bytes / bandwidth floor, with
the copy bandwidth measured in the same run.

    python -m bench.megakernel_bench --out bench/results/h200 [--quick]
    from bench.megakernel_bench import run; run(out_dir, quick=False)   # the `megakernel bench` entry

Every timing replays a CUDA graph of many calls that rotate through enough weight copies to
exceed the L2 (so no call reads weights the previous one left in cache), and takes the median
of several replays. JSON: commit, command, GPU name, copy bandwidth, one record per case with
us, GB/s, fraction of the floor and speed-up over the graphed PyTorch. `--timeline` also writes the
per-instruction timing record of one megakernel launch (JSON; render with bench/timeline.py).
"""
from __future__ import annotations

import ast
import json
import os
import time

import torch

from bench.common import (L2_FLUSH_BYTES, arg_parser, copy_bandwidth, cu_stream, flush_l2, run_record,
                          summary_lines, timed, write_json)


# ----------------------------------------------------------------------------------- GEMV
def bench_gemv(n, k, m, wd, copy_bw, max_stages=None, pdl=True, overrides=None):
    from sdk.blocks._cute import standalone
    from sdk.blocks.base import ring_geometry
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.megakernel.mlp_stack import quantize_fp8
    overrides = overrides or {}
    # num_ctas: the grid (SMs); l2_hot: one weight copy, re-read from the L2 launch after launch
    # (the consumer's own rate: the L2 feeds an SM faster than its share of the HBM)
    cfg_kw = {kk: v for kk, v in overrides.items() if kk not in ("num_ctas", "l2_hot")}
    block = GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype=wd, **cfg_kw))
    # persistent: one CTA per SM, weights through the smem ring; pdl (standalone's default, the
    # " no-pdl" cases without): back-to-back launches overlap (the next one fills its ring on the
    # SMs the previous one has left)
    fn = standalone(block, max_stages=max_stages, pdl=pdl, num_ctas=overrides.get("num_ctas"))
    stages = ring_geometry([block], max_stages)[1]
    wbytes = block.weight_bytes()
    copies = 1 if overrides.get("l2_hot") else max(2, -(-L2_FLUSH_BYTES // wbytes))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    tables, copies_w = [], []
    for _ in range(copies):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
        if wd == "fp8_e4m3":
            q, sc = quantize_fp8(w)
            ptrs = [q.data_ptr(), sc.data_ptr(), x.data_ptr(), y.data_ptr()]
            copies_w.append((w, q, sc))
        else:
            ptrs = [w.data_ptr(), x.data_ptr(), y.data_ptr()]
            copies_w.append((w, None, None))
        tables.append(torch.tensor(ptrs, dtype=torch.int64, device="cuda"))
    # correctness of the timed configuration (last copy), output poisoned first
    y.fill_(float("nan"))
    fn(tables[-1].data_ptr(), cu_stream())
    torch.cuda.synchronize()
    w, q, sc = copies_w[-1]
    ref_w = q.float() * sc.repeat_interleave(128, 0).repeat_interleave(128, 1) if q is not None else w.float()
    ref = x.float() @ ref_w.T
    err = ((y.float() - ref).norm() / ref.norm()).item()
    us, mode = timed([lambda t=t: fn(t.data_ptr(), cu_stream()) for t in tables] * 4)
    torch_us, _ = timed([lambda w=cw[0]: torch.matmul(x, w.t(), out=y) for cw in copies_w] * 4)
    floor_us = wbytes / (copy_bw * 1e3)
    return {"case": _gemv_name(n, k, m, wd, max_stages and stages, pdl, overrides),
            "pdl": pdl, "fp8_decode": block.config.fp8_decode, "mma": block.use_mma, "overrides": overrides,
            "kind": "gemv", "n": n, "k": k, "m": m, "stages": stages,
            "rows_per_tile": block.config.rows_per_tile, "chunk_k": block.chunk_k,
            "tile_balance": block.tile_balance(_num_sms()),
            "weight_dtype": wd, "weight_bytes": wbytes, "us": us, "gbs": wbytes / (us * 1e3),
            "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
            "torch_note": "torch bf16 matmul of the same shape" if wd != "bf16" else "torch bf16 matmul",
            "speedup_vs_torch_graph": torch_us / us, "timing_mode": mode, "rel_err": err}


def _gemv_name(n, k, m, wd, stages=None, pdl=True, overrides=None) -> str:
    ov = dict(overrides or {})
    dec = ov.pop("fp8_decode", "hfma2")
    return (f"gemv n={n} k={k} m={m} {wd}" + (f" stages={stages}" if stages else "") + ("" if pdl else " no-pdl")
            + (f" {dec}-decode" if dec != "hfma2" else "") + "".join(f" {key}={v}" for key, v in ov.items()))


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def gemv_chain_program(n, k, m, wd, count):
    """`count` independent GEMVs of one shape in ONE megakernel launch: y_j = x @ W_j^T, each W_j
    its own buffer, no dependencies - the GEMV as the megakernel runs it (no launch, no ring fill
    per GEMV: the ring streams straight from one GEMV's weights into the next one's)."""
    from sdk.megakernel.mlp_stack import gemv_block
    from sdk.blocks.gemv import GemvConfig
    from sdk.megakernel.program import Program
    prog = Program()
    prog.buffer("x", (m, k), "bf16", "input")
    block = gemv_block(GemvConfig(n=n, k=k, m=m, weight_dtype=wd), 0, 132)
    for j in range(count):
        prog.buffer(f"w{j}", (n, k), wd, "weight")
        ops = {"w": f"w{j}", "x": "x", "y": f"y{j}"}
        if wd == "fp8_e4m3":
            prog.buffer(f"w{j}_scale", (n // 128, k // 128), "fp32", "weight")
            ops["w_scale"] = f"w{j}_scale"
        prog.buffer(f"y{j}", (m, n), "bf16", "output")
        prog.op(block, ops, label=f"gemv{j}")
    return prog


def bench_gemv_chain(n, k, m, wd, copy_bw, count=None):
    """µs per GEMV inside one launch of `count` GEMVs (count: >= 2 x L2 of weights, >= 4)."""
    from sdk.megakernel.mlp_stack import quantize_fp8
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    wbytes1 = n * k * (1 if wd == "fp8_e4m3" else 2)
    count = count or max(4, -(-L2_FLUSH_BYTES // wbytes1))
    prog = gemv_chain_program(n, k, m, wd, count)
    tensors = PyVM.alloc(prog, device="cuda")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    tensors["x"].copy_(x)
    ref_w = []
    for j in range(count):
        w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
        if wd == "fp8_e4m3":
            q, sc = quantize_fp8(w)
            tensors[f"w{j}"].copy_(q)
            tensors[f"w{j}_scale"].copy_(sc)
            ref_w.append(q.float() * sc.repeat_interleave(128, 0).repeat_interleave(128, 1))
        else:
            tensors[f"w{j}"].copy_(w)
            ref_w.append(w.float())
        tensors[f"y{j}"].fill_(float("nan"))
    rt = MegakernelRuntime(prog, tensors)
    rt.run()
    err = max(((tensors[f"y{j}"].float() - x.float() @ ref_w[j].T).norm() / (x.float() @ ref_w[j].T).norm()).item()
              for j in (0, count - 1))
    wbytes = prog.bytes_by_role("weight")
    us, mode = timed([lambda: rt.launch()] * 4)
    rt.check()
    floor_us = wbytes / (copy_bw * 1e3)
    per = us / count
    del rt, tensors, ref_w
    torch.cuda.empty_cache()
    return {"case": f"gemv n={n} k={k} m={m} {wd} x{count} in one launch", "kind": "gemv_chain", "n": n, "k": k,
            "m": m, "weight_dtype": wd, "count": count, "weight_bytes": wbytes, "us": us, "us_per_gemv": per,
            "gbs": wbytes / (us * 1e3), "floor_us": floor_us, "fraction_of_floor": floor_us / us,
            "timing_mode": mode, "rel_err": err}


# ----------------------------------------------------------------------------------- MLP stack
def torch_stack_calls(cfg, weights, x):
    """The same stack as unfused PyTorch bf16 ops (what the graph baseline runs)."""
    import torch.nn.functional as F
    L = cfg.layers

    def deq(name):
        w = weights[name + ".weight"]
        if w.dtype == torch.float8_e4m3fn:   # baseline on dequantized bf16 copies (same shapes)
            s = weights[name + ".weight_scale"]
            return (w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
        return w

    W = [(weights[f"layers.{l}.norm.weight"], deq(f"layers.{l}.gate"), deq(f"layers.{l}.up"),
          deq(f"layers.{l}.down")) for l in range(L)]
    fw = weights["final_norm.weight"]
    out = torch.empty_like(x)

    def step():
        r = x
        for nw, wg, wu, wdn in W:
            h = F.rms_norm(r, (cfg.hidden,), nw, cfg.eps)
            r = r + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wdn)
        out.copy_(F.rms_norm(r, (cfg.hidden,), fw, cfg.eps))
    return step, out


def _stack_name(cfg) -> str:
    return (f"mlp_stack L={cfg.layers} I={cfg.intermediate} B={cfg.batch} {cfg.weight_dtype}"
            + ("" if cfg.fuse_norm is None else f" fuse_norm={cfg.fuse_norm}")
            + (f" rows={cfg.gateup_rows}/{cfg.down_rows}" if cfg.gateup_rows or cfg.down_rows else "")
            + (f" {cfg.fp8_decode}-decode" if cfg.fp8_decode != "hfma2" else "")
            + (f" chunk_k={cfg.gateup_chunk_k}/{cfg.down_chunk_k}" if cfg.gateup_chunk_k or cfg.down_chunk_k else "")
            + (" warp_ring" if cfg.warp_ring else ""))


def bench_stack(cfg, copy_bw, timeline_path=None, pdl=False):
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.mlp_stack import build_program, make_weights, reference, weight_bytes
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    weights = make_weights(cfg, seed=1, device="cuda")
    tensors.update(weights)
    t0 = time.time()
    rt = MegakernelRuntime(prog, tensors, pdl=pdl)
    compile_s = time.time() - t0
    x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
    tensors["x"].copy_(x)
    tensors["out"].fill_(float("nan"))
    rt.run()
    ref = reference(cfg, weights, x)
    err = ((tensors["out"].float() - ref).norm() / ref.norm()).item()
    wbytes = weight_bytes(prog)
    reps = max(4, -(-L2_FLUSH_BYTES // wbytes))
    us, mode = timed([lambda: rt.launch()] * reps)
    rt.check()
    step, _ = torch_stack_calls(cfg, weights, x)
    torch_us, _ = timed([step] * reps)
    floor_us = wbytes / (copy_bw * 1e3)
    rec = {"case": _stack_name(cfg) + (" pdl" if pdl else ""), "pdl": pdl,
           "fuse_norm": cfg.norm_fused,
           "rows_per_tile": [b.config.rows_per_tile for b in prog.opcodes.blocks if hasattr(b.config, "rows_per_tile")],
           "tile_balance": [round(b.tile_balance(rt.num_sms), 3) for b in prog.opcodes.blocks
                            if hasattr(b, "tile_balance")],
           "max_instructions_per_sm": rt.max_len,
           "ring": dict(zip(("stage_bytes", "stages", "x_bytes"), ring_geometry(prog.opcodes.blocks))),
           "kind": "mlp_stack", "hidden": cfg.hidden, "intermediate": cfg.intermediate,
           "layers": cfg.layers, "batch": cfg.batch, "weight_dtype": cfg.weight_dtype,
           "weight_bytes": wbytes, "us": us, "us_per_layer": us / cfg.layers, "gbs": wbytes / (us * 1e3),
           "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
           "speedup_vs_torch_graph": torch_us / us, "timing_mode": mode, "rel_err": err,
           "launches_per_step": 1, "instructions": len(prog.instructions), "max_per_sm": rt.max_len,
           "sched_est_us": rt.schedule.est_ns / 1e3, "compile_s": compile_s}
    if timeline_path:
        rt_t = MegakernelRuntime(prog, tensors, timing=True)
        rt_t.run()
        flush_l2()                      # recorded from HBM, as the timed loop's rotated copies run
        rt_t.run()
        rec_t = rt_t.timing_record()
        rec_t.update({"case": rec["case"], "us": us})
        with open(timeline_path, "w") as f:
            json.dump(rec_t, f)
        rec["timeline"] = os.path.basename(timeline_path)
    del rt, tensors, weights
    torch.cuda.empty_cache()
    return rec


def stack_cases(quick: bool) -> list:
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cases = [MLPStackConfig(intermediate=2048, layers=8, batch=1),
             MLPStackConfig(intermediate=2048, layers=8, batch=1, gateup_rows=8, down_rows=16),  # v2's tiles
             MLPStackConfig(intermediate=18432, layers=4, batch=1),
             MLPStackConfig(intermediate=2048, layers=8, batch=8),
             MLPStackConfig(intermediate=2048, layers=8, batch=1, weight_dtype="fp8_e4m3"),
             # fp8 with f32 FMAs after the e4m3 -> f16 -> f32 conversions (the default before hfma2)
             MLPStackConfig(intermediate=2048, layers=8, batch=1, weight_dtype="fp8_e4m3", fp8_decode="cvt"),
             MLPStackConfig(intermediate=18432, layers=4, batch=1, weight_dtype="fp8_e4m3")]
    if not quick:
        cases += [MLPStackConfig(intermediate=4096, layers=8, batch=1),
                  MLPStackConfig(intermediate=12288, layers=4, batch=1),
                  MLPStackConfig(intermediate=2048, layers=16, batch=1),
                  MLPStackConfig(intermediate=2048, layers=8, batch=1, fuse_norm=False),
                  MLPStackConfig(intermediate=2048, layers=8, batch=64),
                  MLPStackConfig(intermediate=18432, layers=4, batch=1, weight_dtype="fp8_e4m3", fp8_decode="cvt"),
                  # fp8 down GEMV (7168 rows; fp8 tiles divide the 128-row scale block): balanced_config
                  # takes 64 rows = 112 tiles, one per SM on 112 of 132 (max/mean tiles per SM 1.18);
                  # 8 rows = 896 tiles is balanced (1.03) at 7x the tiles - which wins is measured here
                  MLPStackConfig(intermediate=2048, layers=8, batch=1, weight_dtype="fp8_e4m3", down_rows=8),
                  MLPStackConfig(intermediate=2048, layers=8, batch=1, weight_dtype="fp8_e4m3", fp8_decode="int"),
                  MLPStackConfig(intermediate=18432, layers=4, batch=1, weight_dtype="fp8_e4m3", fp8_decode="int")]
    # (config, PDL launches): the first case again with back-to-back steps overlapping
    return [(c, False) for c in cases] + [(cases[0], True)]


def gemv_cases(quick: bool):
    """(n, k, m, weight dtype, max ring stages or None, PDL launches[, GemvConfig overrides]). PDL is the
    standalone kernel's default (measured 2026-12-03: 7168x2048 52.4% -> 69.3%, 4096x7168
    73.4% -> 86.7%); the " no-pdl" cases keep the plain launch's figure beside it."""
    cases = [(7168, 2048, 1, "bf16", None, True), (18432, 7168, 1, "bf16", None, True),
             (7168, 2048, 1, "bf16", None, False),
             # a 6- / 4-stage ring (~105 / ~72 KB of smem): two or three CTAs fit an SM, so with PDL
             # the next launch's CTA streams its weights beside the previous one's, not after it
             (7168, 2048, 1, "bf16", 6, True), (7168, 2048, 1, "bf16", 4, True), (4096, 7168, 1, "bf16", 6, True),
             # fp8 at batch 1 on the tensor cores with full 16-row m-tiles (8-row tiles pad the
             # MMA's 16 rows with a repeated row: twice the conversions; measured 41% at 8 rows)
             (18432, 7168, 1, "fp8_e4m3", None, True), (18432, 7168, 1, "fp8_e4m3", None, True, {"mma": True, "rows_per_tile": 16}),
             (7168, 2048, 1, "fp8_e4m3", None, True, {"mma": True, "rows_per_tile": 16}),
             (18432, 7168, 1, "fp8_e4m3", None, True, {"fp8_decode": "cvt"}),
             (7168, 2048, 1, "fp8_e4m3", None, True), (7168, 2048, 1, "fp8_e4m3", None, True, {"fp8_decode": "cvt"}),
             # the 29 MB shape takes whole-K chunks by default since 2026-12-05 (84.5 / 85.4% vs 82.4-83.7%):
             # its former 1024-column chunks beside, and fewer stages of whole-K chunks
             (7168, 2048, 1, "bf16", None, True, {"chunk_k": 1024}), (7168, 2048, 1, "bf16", 4, True),
             (7168, 2048, 1, "bf16", 3, True),
             # fp8 CUDA-core rows: 16 by default since 2026-12-05 (90.1-90.2%); the former 8 (65.5%), 32 (91-92%)
             (18432, 7168, 1, "fp8_e4m3", None, True, {"rows_per_tile": 8}),
             (18432, 7168, 1, "fp8_e4m3", None, True, {"rows_per_tile": 32, "chunk_k": 1024})]
    if not quick:
        cases += [(18432, 7168, 1, "bf16", 4, True), (18432, 7168, 1, "bf16", 8, True),   # bytes in flight
                  (4096, 7168, 1, "bf16", None, True), (4096, 7168, 1, "bf16", None, False),
                  (7168, 18432, 1, "bf16", None, True),
                  (18432, 7168, 1, "fp8_e4m3", None, True, {"fp8_decode": "int"}),
                  (18432, 7168, 8, "bf16", None, True)]
    return cases


def gemv_chain_cases(quick: bool):
    """(n, k, m, weight dtype) of the in-launch GEMV chains: the shapes whose single launch is
    short (7-14 us of traffic) first."""
    cases = [(7168, 2048, 1, "bf16"), (4096, 7168, 1, "bf16")]
    if not quick:
        cases += [(18432, 7168, 1, "bf16"), (18432, 7168, 1, "fp8_e4m3"), (18432, 7168, 8, "bf16")]
    return cases


def run(out_dir: str, quick: bool = False, timeline: bool = True, parts=("gemv", "chain", "stack"),
        gemv_list=None, stack_list=None) -> dict:
    """Run the benchmarks of `parts` (GEMV alone, in-launch GEMV chains, MLP stacks); write
    `megakernel_bench.json` (and a timeline of the first stack case) into out_dir. gemv_list /
    stack_list: run these cases (gemv_cases() tuples, MLPStackConfig keyword dicts) instead of
    the built-in lists of those parts."""
    os.makedirs(out_dir, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    copy_bw = bw["copy"]
    print(f"GPU {props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_bw:.0f} GB/s "
          f"(read+write; variants " + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()) + ")")
    if not 3800 <= copy_bw <= 4800 and "H200" in props.name:
        print(f"  WARNING: copy bandwidth {copy_bw:.0f} GB/s is off the H200's ~4260 GB/s measured in DESIGN.md")
    results = []
    report = run_record(props, copy_bw, results, bandwidth_gbs=bw,
                        floor_note="floor = bytes that must move / copy_bw_gbs")

    def save():   # after every case: a run cut short by its time limit still leaves its results
        write_json(out_dir, "megakernel_bench.json", report)

    if gemv_list is None:
        gemv_list = gemv_cases(quick) if "gemv" in parts else []
    if stack_list is None:
        stack_list = stack_cases(quick) if "stack" in parts else []
    else:
        from sdk.megakernel.mlp_stack import MLPStackConfig
        stack_list = [(MLPStackConfig(**kw), False) for kw in stack_list]
    for n, k, m, wd, st, pdl, *ov in gemv_list:
        try:
            r = bench_gemv(n, k, m, wd, copy_bw, st, pdl, *ov)
        except Exception as exc:
            r = {"case": _gemv_name(n, k, m, wd, st, pdl, *ov), "error": f"{type(exc).__name__}: {exc}"}
        print(_line(r))
        results.append(r)
        save()
    for n, k, m, wd in (gemv_chain_cases(quick) if "chain" in parts else []):
        try:
            r = bench_gemv_chain(n, k, m, wd, copy_bw)
        except Exception as exc:
            r = {"case": f"gemv n={n} k={k} m={m} {wd} chain", "error": f"{type(exc).__name__}: {exc}"}
        print(_line(r))
        results.append(r)
        save()
    for i, (cfg, pdl) in enumerate(stack_list):
        tl = os.path.join(out_dir, "timeline_mlp_stack.json") if (timeline and i == 0) else None
        try:
            r = bench_stack(cfg, copy_bw, tl, pdl)
        except Exception as exc:
            r = {"case": _stack_name(cfg) + (" pdl" if pdl else ""), "error": f"{type(exc).__name__}: {exc}"}
        print(_line(r))
        results.append(r)
        save()
    return report


def _line(r) -> str:
    if "error" in r:
        return f"{r['case']:<44} ERROR {r['error'][:200]}"
    torch_part = (f"torch-graph {r['torch_graph_us']:9.1f} us  x{r['speedup_vs_torch_graph']:.2f}"
                  if "torch_graph_us" in r else f"{r['us_per_gemv']:9.1f} us per GEMV" if "us_per_gemv" in r else "")
    return (f"{r['case']:<44} {r['us']:9.1f} us {r['gbs']:7.0f} GB/s  floor {r['fraction_of_floor']*100:5.1f}%  "
            f"{torch_part}  err {r['rel_err']:.1e}")


def summary(report) -> str:
    return summary_lines(report, _line)


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--parts", default="gemv,chain,stack", help="comma-separated: gemv (alone), chain "
                    "(GEMVs in one launch), stack (one-launch MLP stacks)")
    ap.add_argument("--gemv-cases", default=None, help="instead of the built-in GEMV list: a Python literal "
                    "list of (n, k, m, weight dtype, stages or None, pdl[, {GemvConfig overrides, or num_ctas: the grid}])")
    ap.add_argument("--stack-cases", default=None, help="instead of the built-in stack list: a Python literal "
                    "list of MLPStackConfig keyword dicts, e.g. \"[{'intermediate': 2048, 'layers': 8}]\"")
    a = ap.parse_args(argv)
    lit = lambda v: None if v is None else ast.literal_eval(v)
    rep = run(a.out, quick=a.quick, timeline=not a.no_timeline, parts=a.parts.split(","),
              gemv_list=lit(a.gemv_cases), stack_list=lit(a.stack_cases))
    print("\n" + summary(rep))


if __name__ == "__main__":
    main()
