"""Latency of the in-kernel EP dispatch + combine per MoE layer, N virtual ranks on ONE GPU.

    python -m bench.ep_bench [--out DIR] [--ranks 8] [--quick] [--sms-per-rank N]

IMPORTANT: on one GPU the "peer" stores of the virtual ranks go to local HBM (through L2), not
over NVLink. This measures the EP instructions' own overhead - pushes, fence.sys, flag round
trips, the owner's table build, the return push and the weighted sum - not the interconnect.
Add the link time (bytes / NVLink bandwidth) for a multi-GPU estimate.

Method: the EP MoE program (sdk/megakernel/ep_moe.py) at hidden 7168, top-8 of 64 experts (8
per rank), small experts (I = 256: the expert GEMVs are not what is measured), shared expert
I = 256; one launch per rank on its own stream (SMs // N CTAs each, or --sms-per-rank: all ranks'
CTAs must fit the GPU at once, sdk.comm.runtime.ctas_per_rank refuses more) with the
per-instruction globaltimer record. All ranks share the GPU's clock, so over all ranks:
    dispatch_us     = last ep.table end - first ep.dispatch start (tokens reach their owners and
                                                                   the owners' tables are built)
    combine_us      = last ep.combine end - first ep.combine start: includes waiting for the
                      slowest rank's experts (a rank's combine tiles wait for its own down and
                      shared stages, then for every owner's return)
    ready_skew_us   = last - first rank's first ep.combine start: how far apart the ranks finish
                      their experts (routing is data-dependent: the owner with the most rows last)
    combine_last_us = last ep.combine end - last rank's first ep.combine start: the combine once
                      every rank is ready (return push, flags, weighted sum)
    layer_us        = last ep.combine end - first instruction start (the whole MoE layer)
Median over R launches; wall_us is the time per launch from CUDA events. The N ranks' launches
are eager stream launches released together by a GPU-side gate (bench.common.launch_together,
`launch_mode` 'eager_gated'; `launch_skew_us`: spread of the ranks' first instruction starts):
launched one Python launch apart, the later ranks start tens of microseconds late and every flag
wait measures that skew (the first run gave a 1.9 ms combine at batch 1); replayed from one CUDA
graph, some ranks' kernels can run only after others have ended (all-reduce bench, 2026-12-03,
bench/NOTES.md). JSON (bench/common.py): commit, command, GPU, per (ranks, batch) the numbers
above, bytes dispatched and returned per rank, tile counts.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.common import arg_parser, command_line, commit, launch_together, write_json

HIDDEN, EXPERTS, TOPK, INTER, SHARED = 7168, 64, 8, 256, 256


def measure(n: int, batch: int, reps: int, sms_per_rank: int | None = None) -> dict:
    from sdk.comm import VirtualRanks
    from sdk.comm.runtime import TPRuntime
    from sdk.megakernel.ep_moe import EPMoEConfig, build_program, make_weights, rank_tensors
    from sdk.megakernel.moe_layer import MoELayerConfig
    cfg = EPMoEConfig(MoELayerConfig(hidden=HIDDEN, num_experts=EXPERTS, top_k=TOPK, intermediate=INTER,
                                     batch=batch, correction_bias=True, shared_intermediate=SHARED), n)
    prog, comm = build_program(cfg)
    full = make_weights(cfg, seed=0, device="cuda")
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [rank_tensors(cfg, prog, comm, bufs, r, full, "cuda") for r in range(n)]
    for t in T:
        t["x"].copy_(torch.randn(batch, HIDDEN, device="cuda").to(torch.bfloat16))
    t0 = time.time()
    rt = TPRuntime(prog, comm, bufs, T, timing=True, num_sms=sms_per_rank)
    rt.run()                                    # compile + first launch
    compile_s = time.time() - t0
    labels = [op.label for op in prog.ops]
    idx = [(s, j, prog.instructions[i].op_index) for s, lst in enumerate(rt.runtimes[0].schedule.per_sm)
           for j, i in enumerate(lst)]
    S_, J_, O_ = (np.array(v) for v in zip(*idx))
    nops = len(labels)
    launch, launch_mode = launch_together(rt.launch)      # the ranks' launches together
    rt.check()
    op = {lb: k for k, lb in enumerate(labels)}
    comb = O_ == op["ep.combine"]
    res = {k: [] for k in ("dispatch_us", "combine_us", "ready_skew_us", "combine_last_us", "layer_us", "wall_us",
                           "launch_skew_us")}
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        rt.zero_timing()
        launch(ev0)
        ev1.record()
        torch.cuda.synchronize()
        rt.check()
        res["wall_us"].append(ev0.elapsed_time(ev1) * 1e3)
        start, end = np.full(nops, np.inf), np.full(nops, -np.inf)
        raw = [t.numpy() for t in rt.timing_raw()]
        base = int(raw[0][S_[0], J_[0], 0])      # int64 ns since boot: subtract before float
        ready, first = [], []
        for tim in raw:
            tim = (tim - base).astype(np.float64)
            np.minimum.at(start, O_, tim[S_, J_, 0])
            np.maximum.at(end, O_, tim[S_, J_, 1])
            ready.append(tim[S_[comb], J_[comb], 0].min())
            first.append(tim[S_, J_, 0].min())
        res["dispatch_us"].append((end[op["ep.table"]] - start[op["ep.dispatch"]]) / 1e3)
        res["combine_us"].append((end[op["ep.combine"]] - start[op["ep.combine"]]) / 1e3)
        res["ready_skew_us"].append((max(ready) - min(ready)) / 1e3)
        res["combine_last_us"].append((end[op["ep.combine"]] - max(ready)) / 1e3)
        res["layer_us"].append((end[op["ep.combine"]] - start.min()) / 1e3)
        res["launch_skew_us"].append((max(first) - min(first)) / 1e3)
    ids = T[0]["topk_ids"].cpu()
    owners = (ids.long() // cfg.local)
    sent_rows = sum(len(set(row.tolist())) for row in owners)      # rank 0's token rows sent (incl. to itself)
    out = {"ranks": n, "batch": batch, "hidden": HIDDEN, "top_k": TOPK, "experts": EXPERTS,
           **{k: round(statistics.median(v), 3) for k, v in res.items()},
           "dispatch_bytes_rank0": sent_rows * HIDDEN * 2, "return_bytes_rank0": batch * TOPK * HIDDEN * 2,
           "tiles": {lb: len(prog.ops[k].instructions) for k, lb in enumerate(labels) if lb.startswith("ep.")},
           "compile_s": round(compile_s, 2), "launch_mode": launch_mode, "sms_per_rank": rt.num_sms,
           "gate_us": round(launch.gate_us, 1)}
    out["ep_us"] = round(out["dispatch_us"] + out["combine_us"], 3)
    return out


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sms-per-rank", type=int, default=None,
                    help="CTAs (SMs) of each rank's launch; default SMs // ranks (ranks x this must fit the GPU)")
    args = ap.parse_args(argv)
    batches = [1, 64] if args.quick else [1, 8, 64]
    gpu = torch.cuda.get_device_name()
    from sdk.comm.runtime import ctas_per_rank
    for n in args.ranks:      # every rank's CTAs must fit the GPU at once: refuse now, not time out later
        ctas_per_rank(n, torch.cuda.get_device_properties(0).multi_processor_count, args.sms_per_rank)
    print(f"GPU {gpu}; virtual ranks {args.ranks}: peer stores go to LOCAL HBM (no NVLink): this is the EP "
          f"instructions' overhead, not the interconnect", flush=True)
    rows = []
    rec = {"bench": "ep", "commit": commit(), "command": command_line(), "gpu": gpu, "torch": torch.__version__,
           "note": "virtual ranks on one GPU: peer stores land in local HBM; dispatch = first dispatch tile start "
                   "to last table end, combine = first to last combine tile, over all ranks", "results": rows}
    for n in args.ranks:
        for b in batches:
            try:
                r = measure(n, b, args.reps, args.sms_per_rank)
            except Exception as exc:            # record and go on: the rest of the table still runs
                r = {"ranks": n, "batch": b, "error": f"{type(exc).__name__}: {exc}"}
            rows.append(r)
            print(r, flush=True)
            if args.out:
                write_json(args.out, "ep_bench.json", rec)
    print(f"\nEP latency per MoE layer (us, median of {args.reps}; hidden {HIDDEN}, top-{TOPK} of {EXPERTS})")
    print("combine = first to last combine tile, including the wait for the slowest rank's experts (skew: "
          "ready_skew_us); comb.last = the combine after the last rank is ready; l.skew = launch skew")
    print(f"{'ranks':>5} {'batch':>5} {'dispatch':>9} {'combine':>8} {'skew':>8} {'comb.last':>9} "
          f"{'d+c':>8} {'layer':>8} {'wall':>8} {'l.skew':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['ranks']:>5} {r['batch']:>5} ERROR {r['error'][:100]}")
        else:
            print(f"{r['ranks']:>5} {r['batch']:>5} {r['dispatch_us']:9.2f} {r['combine_us']:8.2f} "
                  f"{r['ready_skew_us']:8.2f} {r['combine_last_us']:9.2f} {r['ep_us']:8.2f} "
                  f"{r['layer_us']:8.2f} {r['wall_us']:8.1f} {r['launch_skew_us']:6.1f}")
    if args.out:
        print(f"wrote {args.out}/ep_bench.json")


if __name__ == "__main__":
    main()
