"""All-reduce instruction latency vs message size, N virtual ranks on ONE GPU.

    python -m bench.allreduce_bench --out DIR [--ranks 8] [--quick] [--sms-per-rank N]

IMPORTANT: on one GPU the "peer" stores of the virtual ranks go to local HBM (through L2), not
over NVLink. This measures the instruction's own overhead - pushes, fence.sys, flag round trip,
reduction, residual, fused RMSNorm, and the counter hop to the next op - not the interconnect.
Add the link time (bytes / NVLink bandwidth) for a multi-GPU estimate (docs/gb300-nvl72-plan.md).

Method: per (algorithm, size), one program per rank with K fused all-reduces in a chain (each
op waits for the previous one: resid += sum of partials, out = rmsnorm(resid)), launched on the
N ranks' streams (SMs // N CTAs each, or --sms-per-rank: all ranks' CTAs must fit the GPU at
once, sdk.comm.runtime.ctas_per_rank refuses more) with the per-instruction globaltimer record. All ranks
share the GPU's clock, so per all-reduce j: end_j = last tile end over all ranks; the reported
latency is (end_{K-1} - end_0) / (K - 1): the steady-state time per all-reduce in a dependent
chain, launch skew excluded. Median over R launches. Also: the span of one op (first tile start
to last tile end over all ranks, median over ops), and the wall time per launch (CUDA events),
for context. The N ranks' launches are eager stream launches released together by a GPU-side
gate (bench.common.launch_together, `launch_mode` 'eager_gated'; `launch_skew_us`: the spread of
the ranks' first instruction starts). Not one CUDA graph: replayed from a graph, some ranks'
kernels ran only after others had ended, and 4 of 16 cases timed out ('rank 5 never arrived',
2026-12-03; bench/NOTES.md).

Message = M tokens x D=4096 bf16 (8 KB per token): 8 KB .. 1 MB. JSON: commit, command, GPU,
ranks, note, per (algo, bytes): us per all-reduce, op span, wall us. --mhc: the same with the mHC
post-mix epilogue (GLM-5.3 / V4.1-Flash residual streams; allreduce_mhc_bench.json).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import commit, launch_together, write_json


def measure(n: int, m: int, d: int, algo: str, k: int, reps: int, sms_per_rank: int | None = None,
            mhc: bool = False) -> dict:
    """mhc: the all-reduces post-mix into 4 mHC residual streams (fp32) with the next pre-mix's
    24 partials (sdk.comm.ops.build_mhc_allreduce_chain) instead of residual + RMSNorm."""
    from sdk.comm import VirtualRanks
    from sdk.comm.ops import build_mhc_allreduce_chain
    from sdk.comm.runtime import TPRuntime
    from sdk.megakernel.tp_stack import build_allreduce_chain
    build = build_mhc_allreduce_chain if mhc else build_allreduce_chain
    prog, comm = build(n, m, d, k, algo=algo)
    bufs = VirtualRanks(n, comm.layout, "cuda")
    T = [comm.alloc_rank_tensors(bufs, r, "cuda") for r in range(n)]
    for t in T:
        t["partial"].copy_(torch.randn(m, d, device="cuda").to(torch.bfloat16) * 1e-3)
        if mhc:       # streams, mixing coefficients (positive, < 1) and the next mix's weights
            for name in ["streams_in", "fn_next"] + [f"coef.{j}" for j in range(k)]:
                t[name].copy_(torch.rand_like(t[name]) * 0.5)
        else:
            t["norm.weight"].fill_(1.0)
    t0 = time.time()
    rt = TPRuntime(prog, comm, bufs, T, timing=True, num_sms=sms_per_rank)
    rt.run()                                   # compile + first launch
    compile_s = time.time() - t0
    # every instruction's (SM, list index, chain position of its all-reduce); same on all ranks
    op_of = {o: j for j, rec in enumerate(comm.records) for o in rec["ops"]}
    idx = [(s, jj, op_of[prog.instructions[i].op_index])
           for s, lst in enumerate(rt.runtimes[0].schedule.per_sm) for jj, i in enumerate(lst)]
    S_, J_, A_ = (np.array(v) for v in zip(*idx))
    launch, launch_mode = launch_together(rt.launch)      # the ranks' launches together
    rt.check()
    lat, span, wall, skew = [], [], [], []
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        rt.zero_timing()
        launch(ev0)
        ev1.record()
        torch.cuda.synchronize()
        rt.check()
        wall.append(ev0.elapsed_time(ev1) * 1e3)
        st = [t for t in rt.rank_starts() if t is not None]
        skew.append((max(st) - min(st)) / 1e3)
        start = np.full(k, np.inf)
        end = np.zeros(k)
        raw = [t.numpy() for t in rt.timing_raw()]
        base = int(raw[0][S_[0], J_[0], 0])        # int64 ns since boot: subtract before float
        for tim in raw:
            tim = (tim - base).astype(np.float64)
            np.minimum.at(start, A_, tim[S_, J_, 0])
            np.maximum.at(end, A_, tim[S_, J_, 1])
        lat.append((end[-1] - end[0]) / (k - 1) / 1e3)
        span.append(float(np.median(end - start)) / 1e3)
    return {"algo": algo, "epilogue": "mhc" if mhc else "residual+norm", "m": m, "d": d, "bytes": m * d * 2,
            "ranks": n, "chain": k,
            "us_per_allreduce": round(statistics.median(lat), 3), "op_span_us": round(statistics.median(span), 3),
            "wall_us_per_launch": round(statistics.median(wall), 2), "tiles": [len(prog.ops[o].instructions)
                                                                              for o in comm.records[0]["ops"]],
            "compile_s": round(compile_s, 2), "launch_mode": launch_mode, "sms_per_rank": rt.num_sms,
            "launch_skew_us": round(statistics.median(skew), 2), "gate_us": round(launch.gate_us, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8])
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (8 KB, 64 KB, 256 KB, 1 MB)")
    ap.add_argument("--mhc", action="store_true", help="the mHC post-mix epilogue (4 streams, 24 next-mix "
                    "partials) instead of residual + RMSNorm; sizes M = 1, 8, 64 unless --quick")
    ap.add_argument("--sms-per-rank", type=int, default=None,
                    help="CTAs (SMs) of each rank's launch; default SMs // ranks (ranks x this must fit the GPU)")
    args = ap.parse_args(argv)
    ms = [1, 8, 32, 128] if args.quick else [1, 8, 64] if args.mhc else [1, 2, 4, 8, 16, 32, 64, 128]
    gpu = torch.cuda.get_device_name()
    from sdk.comm.runtime import ctas_per_rank
    for n in args.ranks:      # every rank's CTAs must fit the GPU at once: refuse now, not time out later
        ctas_per_rank(n, torch.cuda.get_device_properties(0).multi_processor_count, args.sms_per_rank)
    print(f"GPU {gpu}; virtual ranks {args.ranks}: peer stores go to LOCAL HBM (no NVLink): this is the "
          f"all-reduce instruction's overhead, not the interconnect")
    rows = []
    for n in args.ranks:
        for algo in ("oneshot", "twoshot"):
            for m in ms:
                chain = args.chain
                while True:
                    try:
                        r = measure(n, m, args.d, algo, chain, args.reps, args.sms_per_rank, args.mhc)
                    except Exception as exc:      # e.g. a size two-shot cannot tile: record, go on
                        # a long chain of large messages puts more instruction records on one SM
                        # than its shared memory holds: measure a shorter chain instead
                        if "records" in str(exc) and chain > 2:
                            chain //= 2
                            continue
                        r = {"algo": algo, "m": m, "d": args.d, "bytes": m * args.d * 2, "ranks": n,
                             "error": f"{type(exc).__name__}: {exc}"}
                    break
                rows.append(r)
                print(json.dumps(r), flush=True)
    res = {"bench": "allreduce", "commit": commit(), "command": " ".join([sys.executable, "-m", "bench.allreduce_bench"]
                                                                          + (argv if argv is not None else sys.argv[1:])),
           "gpu": gpu, "torch": torch.__version__,
           "note": "virtual ranks on one GPU: peer stores land in local HBM, so this is the instruction's "
                   "overhead (pushes, fence.sys, flag round trip, reduce, residual, RMSNorm, counter hop), "
                   "not NVLink", "results": rows}
    path = write_json(args.out, "allreduce_mhc_bench.json" if args.mhc else "allreduce_bench.json", res)
    print(f"\nall-reduce latency (us per fused all-reduce in a chain; op span in parentheses), D={args.d} bf16")
    print(f"{'ranks':>5} {'bytes':>9} " + " ".join(f"{a:>18}" for a in ("oneshot", "twoshot")))
    for n in args.ranks:
        for m in ms:
            cells = []
            for algo in ("oneshot", "twoshot"):
                r = next(x for x in rows if x["ranks"] == n and x["m"] == m and x["algo"] == algo)
                cells.append(f"{r['us_per_allreduce']:8.2f} ({r['op_span_us']:6.2f})" if "error" not in r
                             else f"{'error':>18}")
            print(f"{n:>5} {m * args.d * 2:>9} " + " ".join(f"{c:>18}" for c in cells))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
