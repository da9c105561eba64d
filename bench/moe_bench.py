"""Benchmark of the one-launch MoE layer (router -> experts -> combine + shared expert) on each
model's per-GPU shard, beside the same work in PyTorch under a CUDA graph and the floor.

    python -m bench.moe_bench --out $OUT [--quick] [--cases kimi_k3:1:mxfp4,glm_53:8:fp8_e4m3]

Floor = (router weights + shared-expert weights + the weights of the local experts actually hit
this step + activations in/out) / the copy bandwidth measured in the same run.
PyTorch: F.linear router + sdk/reference/moe.py's route() + torch._grouped_mm over the local
experts (tokens sorted by expert, graph-capturable, reads only the hit experts' weights) + the
dense shared expert, all bf16 (the experts' weights dequantised to bf16 beforehand: PyTorch has no
MXFP4/fp8-block GEMM on Hopper; its bytes are then larger, said in the record).
Both run rotating over enough weight copies that no call finds its weights in the 50 MB L2 from
the previous call (in a model, the other layers' weights flush it). The PyTorch output is checked
against the reference too, so it is the same work.

JSON (moe_bench.json): commit, command, GPU, copy bandwidth, and per case: us, GB/s (floor bytes
/ time), fraction of the floor, PyTorch-graph us, speed-up, hit experts, relative errors.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from bench.common import (arg_parser, copy_bandwidth, flush_l2, parse_overrides, run_record, summary_lines, timed,
                          write_json)


WORKING_SET = 256 << 20        # bytes touched between two uses of one weight copy (>> L2)
MAX_COPIES = 12

DEFAULT_CASES = [("kimi_k3", 1, "mxfp4"), ("kimi_k3", 8, "mxfp4"), ("deepseek_v41_flash", 1, "mxfp4"),
                 ("deepseek_v41_flash", 8, "mxfp4"), ("glm_53", 1, "mxfp4"), ("glm_53", 8, "mxfp4"),
                 ("kimi_k3", 1, "bf16"), ("deepseek_v41_flash", 8, "fp8_e4m3"), ("glm_53", 64, "mxfp4")]
QUICK_CASES = [("kimi_k3", 1, "mxfp4"), ("deepseek_v41_flash", 1, "mxfp4"), ("glm_53", 8, "mxfp4"),
               ("kimi_k3", 8, "bf16")]


def torch_weights(cfg, w):
    """bf16 copies of the rank's weights for the PyTorch path."""
    from sdk.megakernel.moe_layer import _shared_dense, local_expert_weights
    gu, dn = [], []
    for e in range(cfg.local):
        a, b = local_expert_weights(cfg, w, e)
        gu.append(a.to(torch.bfloat16))
        dn.append(b.to(torch.bfloat16))
    t = {"router": w["router.weight"], "bias": w.get("router.bias"),
         "gu": torch.stack(gu), "dn": torch.stack(dn)}
    del gu, dn
    if cfg.latent:
        for n in ("latent_down", "latent_norm", "latent_up"):
            t[n] = w[n + ".weight"]
    if cfg.shared_intermediate:
        for n in ("gate", "up", "down"):
            t["s_" + n] = _shared_dense(cfg, w, "shared." + n).to(torch.bfloat16)
    return t


def torch_moe(cfg, t, x, out):
    """The layer in PyTorch ops with static shapes (capturable): writes `out` (bf16)."""
    from sdk.reference.common import swiglu
    from sdk.reference.moe import route
    m, k, L = x.shape[0], cfg.top_k, cfg.local
    logits = F.linear(x.float(), t["router"].float())
    rw, ids = route(cfg.moe_spec(), logits, t["bias"])
    le = ids.flatten() - cfg.local_start
    local = (le >= 0) & (le < L)
    key = torch.where(local, le, torch.full_like(le, L))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(L + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = counts[:L].cumsum(0).to(torch.int32)
    tok = order // k
    xe = F.linear(x, t["latent_down"]) if cfg.latent else x       # the experts' input
    xs = xe[tok]
    act = dict(act=cfg.activation, limit=cfg.swiglu_limit, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    h = torch._grouped_mm(xs, t["gu"].transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    a = swiglu(g, u, **act)
    y = torch._grouped_mm(a, t["dn"].transpose(1, 2), offs=offs)
    keep = local[order][:, None]
    y = torch.where(keep, y.float() * rw.flatten()[order][:, None].float(), torch.zeros((), device=x.device))
    acc = torch.zeros(m, cfg.expert_hidden, dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    if cfg.latent:
        acc = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + cfg.latent_norm_eps)
        acc = F.linear((acc * t["latent_norm"].float()).to(torch.bfloat16), t["latent_up"]).float()
    if cfg.shared_intermediate:
        sa = swiglu(F.linear(x, t["s_gate"]), F.linear(x, t["s_up"]), **act)
        acc = acc + F.linear(sa, t["s_down"]).float()
    out.copy_(acc)


def bench_case(model, batch, fmt, copy_bw, timeline_path=None, overrides=None, order="phase"):
    from sdk.megakernel.moe_layer import blocks, build_program, make_weights, preset, reference, weight_bytes_hit
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    cfg = preset(model, batch, expert_dtype=fmt, **(overrides or {}))
    prog = build_program(cfg)
    # a fixed input per case: every variant of a case (order, overrides) routes the same tokens
    gen = torch.Generator(device="cuda").manual_seed(1000 + batch)
    x = torch.randn(batch, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    # one copy first: routing, hits and the floor's bytes
    rts, ws = [], []

    def add_copy(seed):
        tensors = PyVM.alloc(prog, device="cuda")
        w = make_weights(cfg, seed=seed, device="cuda")
        tensors.update(w)
        tensors["x"].copy_(x)
        rts.append(MegakernelRuntime(prog, tensors, timing=timeline_path is not None and not rts,
                                     schedule_order=order))
        ws.append(w)

    add_copy(0)
    rts[0].run()
    hits = int(rts[0].tensors["hits"][0])
    fb = weight_bytes_hit(cfg, prog, hits)
    ref = reference(cfg, ws[0], x)
    err = ((rts[0].tensors["out"].float() - ref).norm() / ref.norm()).item()
    if timeline_path:
        flush_l2()                      # recorded from HBM, as the timed loop's rotated copies run
        rts[0].run()
        with open(timeline_path, "w") as f:
            json.dump({**rts[0].timing_record(), "case": f"moe {model} B={batch} {fmt} order={order}"}, f)
    copies = max(1, min(MAX_COPIES, -(-WORKING_SET // max(fb["total"], 1)) + 1))
    for i in range(1, copies):
        add_copy(i)
    # each copy is its own random layer, so its routing (hence its hits) can differ: the floor
    # uses the mean hits over the copies
    for rt in rts[1:]:
        rt.run()
    hit_list = [int(rt.tensors["hits"][0]) for rt in rts]
    mean_hits = sum(hit_list) / len(hit_list)
    fb = weight_bytes_hit(cfg, prog, mean_hits)
    floor_us = fb["total"] / (copy_bw * 1e3)
    reps = max(1, 24 // copies)
    calls = [rt.launch for rt in rts] * reps
    us, mode = timed(calls)
    for rt in rts:
        rt.check()
    tag = "".join(f" {k}={v}" for k, v in (overrides or {}).items()) + ("" if order == "phase" else f" order={order}")
    rec = {"case": f"moe {model} B={batch} {fmt}{tag}", "overrides": overrides or {}, "schedule_order": order, "model": model, "batch": batch, "format": fmt,
           "us": us, "mode": mode, "floor_us": floor_us, "floor_bytes": fb, "gbs": fb["total"] / (us * 1e3),
           "fraction_of_floor": floor_us / us, "hit_local_experts": hit_list, "weight_copies": copies,
           "rel_err": err, "num_local": cfg.local, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
           # the expert tile that ran: tensor cores (MXFP4 from batch 8 by default; --set expert_mma=0|1)
           "expert_mma": blocks(cfg)["gateup"].use_mma}
    # PyTorch under a CUDA graph, same copies
    try:
        tws = [torch_weights(cfg, w) for w in ws]
        outs = [torch.empty(batch, cfg.hidden, dtype=torch.bfloat16, device="cuda") for _ in tws]
        torch_moe(cfg, tws[0], x, outs[0])
        terr = ((outs[0].float() - ref).norm() / ref.norm()).item()
        tcalls = [(lambda t=t, o=o: torch_moe(cfg, t, x, o)) for t, o in zip(tws, outs)] * reps
        tus, tmode = timed(tcalls)
        rec.update({"torch_graph_us": tus, "torch_mode": tmode, "torch_rel_err": terr,
                    "speedup_vs_torch_graph": tus / us, "torch_weights": "bf16 (dequantised)"})
        del tws, outs
    except Exception as exc:
        rec["torch_error"] = f"{type(exc).__name__}: {exc}"[:400]
    del rts, ws
    torch.cuda.empty_cache()
    return rec


def _line(r) -> str:
    if "error" in r:
        return f"{r['case']:<36} ERROR {r['error'][:300]}"
    t = (f"torch-graph {r['torch_graph_us']:8.1f} us  x{r['speedup_vs_torch_graph']:.2f}"
         if "torch_graph_us" in r else f"torch: {r.get('torch_error', '?')[:80]}")
    return (f"{r['case']:<36} {r['us']:8.1f} us  floor {r['floor_us']:7.1f} us ({r['fraction_of_floor']*100:5.1f}%, "
            f"x{1 / r['fraction_of_floor']:.2f})  {r['gbs']:6.0f} GB/s  hits {sum(r['hit_local_experts']) / len(r['hit_local_experts']):.1f}  "
            f"{t}  err {r['rel_err']:.1e}")


def run(out_dir, cases, timeline=True, overrides=None, orders=("phase",)) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()["copy"]
    print(f"GPU {props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    results = []
    runs = [(case, order) for case in cases for order in orders]
    for i, ((model, batch, fmt), order) in enumerate(runs):
        t0 = time.time()
        tl = os.path.join(out_dir, f"timeline_moe_{model}_b{batch}_{fmt}{'' if order == 'phase' else '_' + order}.json") if (timeline and i < 2) else None
        try:
            r = bench_case(model, batch, fmt, copy_bw, tl, overrides, order)
        except Exception as exc:
            r = {"case": f"moe {model} B={batch} {fmt}", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            torch.cuda.empty_cache()
        r["wall_s"] = round(time.time() - t0, 1)
        print(_line(r), flush=True)
        results.append(r)
        # written after every case: a session cut short by its time limit keeps what ran
        report = run_record(props, copy_bw, results)
        write_json(out_dir, "moe_bench.json", report)
    return report


def summary(report) -> str:
    return summary_lines(report, _line)


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="model:batch:format,... (overrides the default list)")
    ap.add_argument("--no-timeline", action="store_true")
    ap.add_argument("--set", default="", help="MoELayerConfig overrides for every case: key=value,... "
                    "(e.g. expert_mma=0: the CUDA-core expert tile at batch 8+; expert_weight_l1=0; "
                    "shared_down_rows=32: one shared / latent GEMV's rows, see moe_layer.ROWS_OPS)")
    ap.add_argument("--order", default="phase", help="instruction placement order(s), comma-separated: "
                    "phase | critical | backfill (sdk.schedule); each case runs once per order, same routing")
    a = ap.parse_args(argv)
    if a.cases:
        cases = [(c.split(":")[0], int(c.split(":")[1]), c.split(":")[2]) for c in a.cases.split(",")]
    else:
        cases = QUICK_CASES if a.quick else DEFAULT_CASES
    overrides = parse_overrides(a.set)
    # OP_rows=N (OP in moe_layer.ROWS_OPS, e.g. shared_down_rows=32) goes into MoELayerConfig.op_rows
    from sdk.megakernel.moe_layer import ROWS_OPS
    op_rows = tuple((k[:-len("_rows")], overrides.pop(k)) for k in list(overrides)
                    if k.endswith("_rows") and k[:-len("_rows")] in ROWS_OPS)
    if op_rows:
        overrides["op_rows"] = op_rows
    rep = run(a.out, cases, timeline=not a.no_timeline, overrides=overrides, orders=a.order.split(","))
    print("\n" + summary(rep))


if __name__ == "__main__":
    main()
