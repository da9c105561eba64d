"""Helpers shared by the GPU benchmarks (bench/*_bench.py): timing under a CUDA graph (eager if
capture fails), the device copy bandwidth that the floors divide by, the commit and command line
recorded in each JSON, writing the JSON, and the summary lines the session scripts print.

Importing this module does not touch CUDA (the benchmarks are imported on CPU-only machines too);
every function here needs a GPU when called, except commit(), command_line(), write_json() and
the summary helpers."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

L2_FLUSH_BYTES = 256 << 20     # working set per timed graph: several times the H200's 60 MB L2


def flush_l2() -> None:
    """Evict the L2 (write L2_FLUSH_BYTES). A timeline recorded right after a run of the same
    weights finds the last ops' weights still in L2, while the timed loop rotates weight copies:
    the Kimi K3 MoE timeline spanned 67 us of an 80 us step before this."""
    torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    torch.cuda.synchronize()


def rotated_launches(prog, rt, make_weights, cfg, floor_bytes: int) -> tuple[list, int]:
    """Launch callables over enough weight copies that one launch's weights are out of the L2 when
    they come round again (the cache rows stay shared: at these shapes the weights dominate; with
    one copy, 60-100 MB per launch, part of them can still be in the 50 MB L2). Each copy is its own
    runtime (own counters) over the same inputs and scratch; launches run one after another."""
    from sdk.megakernel.runtime import MegakernelRuntime
    copies = max(1, min(8, -(-L2_FLUSH_BYTES // max(floor_bytes, 1))))
    rts = [rt]
    for i in range(1, copies):
        w = make_weights(cfg, seed=100 + i, device="cuda")
        rts.append(MegakernelRuntime(prog, {**rt.tensors, **{k: v for k, v in w.items() if k in prog.buffers}}))
    return [r.launch for r in rts] * max(1, 8 // copies), copies


def record_timeline(prog, tensors: dict, path: str, case: str, us: float) -> None:
    """The per-instruction record of one launch of `prog` over `tensors` (a second runtime with
    timing on), taken after an L2 flush - from HBM, as the timed replays' rotated copies - and
    written as JSON to `path` with the case name and the timed us (bench.timeline draws it)."""
    import json

    from sdk.megakernel.runtime import MegakernelRuntime
    rt = MegakernelRuntime(prog, tensors, timing=True)
    rt.run()
    flush_l2()
    rt.run()
    rec = rt.timing_record()
    rec.update({"case": case, "us": us})
    with open(path, "w") as f:
        json.dump(rec, f)


def commit() -> str:
    """The commit measured: $GIT_COMMIT (the session scripts set it; the device copy has no .git),
    else `git rev-parse HEAD` of this checkout, else 'unknown'."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(__file__)).decode().strip()
    except Exception:
        return "unknown"


def command_line() -> str:
    """How this process was started, for the JSON record: `python3 -m ... args`."""
    return " ".join([os.path.basename(sys.executable)] + sys.argv)


def arg_parser(description: str | None = None, out_from_env: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --out (the folder for the JSON; by default $OUT, else
    bench/results/h200; with out_from_env=False, none: no JSON) and --quick (fewer cases)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/h200") if out_from_env else None)
    ap.add_argument("--quick", action="store_true")
    return ap


def name_matches(name: str, match: list[str] | None) -> bool:
    """A --match filter: no filter, or `name` contains one of the strings (one ending in "$":
    `name` ends with it)."""
    return not match or any(name.endswith(m[:-1]) if m.endswith("$") else m in name for m in match)


def add_match_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--match", action="append", help="run only the cases whose name contains this "
                    "(repeatable; a trailing $: whose name ends with it)")


def parse_overrides(text: str | None) -> dict:
    """A --set value "key=value,..." -> {key: int where it parses (expert_mma=0), else the string
    (activation=silu)}: config overrides for a benchmark's cases."""
    out = {}
    for kv in filter(None, (text or "").split(",")):
        k, v = kv.split("=", 1)
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def run_record(props, copy_bw: float, results: list, **extra) -> dict:
    """The head of a benchmark's JSON: commit, command, GPU (`props`: torch device properties), SM
    count, copy bandwidth (GB/s), `extra`, torch version, time; then the per-case `results`."""
    return {"commit": commit(), "command": command_line(), "gpu": props.name, "sms": props.multi_processor_count,
            "copy_bw_gbs": copy_bw, **extra, "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "results": results}


def cu_stream():
    """The current torch stream as a CUstream, for the CuTe DSL compiled kernels."""
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def capture(calls) -> "torch.cuda.CUDAGraph":
    """`calls` (zero-arg callables) captured in one CUDA graph, warmed up on a side stream first
    and replayed once; raises if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_time_us(calls, replays: int = 5) -> float:
    """Median time per call (us) of `calls` (a list of zero-arg callables) captured in one CUDA
    graph (see capture); raises if capture fails (see timed())."""
    g = capture(calls)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    times.sort()
    return times[len(times) // 2]


def eager_time_us(calls, replays: int = 5) -> float:
    """Median time per call (us) of `calls` launched one by one (no graph)."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    times.sort()
    return times[len(times) // 2]


def timed(calls):
    """(us per call, mode): under a CUDA graph ('cuda_graph'), or eager ('eager', said in the
    record) if capture fails."""
    try:
        return graph_time_us(calls), "cuda_graph"
    except Exception as exc:  # capture unsupported: say so, time eagerly
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eager launches)", flush=True)
        torch.cuda.synchronize()
        return eager_time_us(calls), "eager"


def replayer(fn):
    """(call, mode): `fn` captured once in a CUDA graph and replayed by `call` ('cuda_graph'), or
    `fn` itself ('eager') if capture fails. NOT for launches that must run concurrently (the
    virtual ranks): see launch_together."""
    try:
        return capture([fn]).replay, "cuda_graph"
    except Exception as exc:  # capture unsupported: say so, launch eagerly
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; eager launches)", flush=True)
        torch.cuda.synchronize()
        return fn, "eager"


GATE_MIN_US = 200.0


def gate_us(host_us: float) -> float:
    """How long launch_together's GPU gate spins: 3x the host time of the N launches plus 100 us
    (Python's launches vary), at least GATE_MIN_US."""
    return max(GATE_MIN_US, 3.0 * host_us + 100.0)


def launch_together(fn, calibrate: int = 2):
    """(call, mode) for launches that must run concurrently and start together - the N virtual
    ranks' (`fn`: TPRuntime.launch, which forks every rank's stream from the current stream and
    joins them back). call(start=None) puts a GPU-side gate on the current stream - a spin kernel
    (torch.cuda._sleep) longer than the host takes to issue fn's launches - records the event
    `start` after it if given, then calls fn: the N launches queue behind the gate while the host
    issues them and become ready together when it ends. Eager launches, so each rank stays its own
    stream launch (concurrent: TPRuntime's conditions); only the host's launch skew (~30-60 us per
    rank, which every flag wait would measure) is gone. Mode 'eager_gated'.

    Why not one CUDA graph of the N launches (`replayer`, used until 2026-12-03): measured on the
    H200, the graph executor ran some ranks' kernel nodes only after another rank's kernel had
    ended (ranks 5-7 started when rank 0's flag wait gave up), for some message sizes / CTA
    counts, with CUDA_DEVICE_MAX_CONNECTIONS 8 or 32 - KernelTimeoutError 'rank 5 never arrived'
    in 4 of the 16 all-reduce cases - although all 8 x 16 CTAs fit the 132 SMs at once. Eager
    launches of the same configurations never did (0 failures in 60).

    Calibration: `calibrate` calls of fn (host time measured; synchronised: the caller checks
    their error words afterwards) and one timed spin for the gate's clock rate."""
    host = []
    for _ in range(calibrate):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    cycles = 1 << 20
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    torch.cuda.synchronize()
    per_us = cycles / max(a.elapsed_time(b) * 1e3, 1e-3)
    spin = math.ceil(gate_us(max(host, default=0.0)) * per_us)

    def call(start=None):
        torch.cuda._sleep(spin)
        if start is not None:
            start.record()
        fn()

    call.gate_us = spin / per_us
    return call, "eager_gated"


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 6) -> dict:
    """Device-memory bandwidth, GB/s, from 2 GiB buffers (33x the L2), several timed reps each:
      copy_*: (bytes read + bytes written) / time of a device-to-device copy, as elementwise
              kernels on wide dtypes (vectorised 16-byte accesses) and as cudaMemcpy;
      read:   bytes read / time of a sum over the buffer (what a GEMV does: read-only).
    'copy' is the best copy variant: the floor's denominator. The first session's 2715 GB/s
    came from a uint8 copy_ of 1 GiB (byte-wise elementwise kernel); DESIGN.md measured 4.26 TB/s."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    out = {}
    variants = {
        "copy_memcpy": lambda: b.copy_(a),                                   # same dtype: cudaMemcpyAsync
        "copy_fp32_kernel": lambda: torch.mul(a, 1.0, out=b),                # elementwise, 16-byte vectors
        "copy_int64_kernel": lambda: torch.bitwise_not(a.view(torch.int64), out=b.view(torch.int64)),
    }
    for name, fn in variants.items():
        us, _ = timed([fn] * reps)
        out[name] = 2 * nbytes / (us * 1e3)
    s = torch.empty((), dtype=torch.float32, device="cuda")
    us, _ = timed([lambda: torch.sum(a, dim=0, out=s)] * reps)
    out["read"] = nbytes / (us * 1e3)
    out["copy"] = max(v for k, v in out.items() if k.startswith("copy_"))
    del a, b
    torch.cuda.empty_cache()
    return out


def write_json(out_dir: str, name: str, obj) -> str:
    """Write `obj` as indented JSON to out_dir/name (the folder made if missing); returns the path.
    The benchmarks call it after every case, so a run cut short by its time limit keeps what ran."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    return path


def summary_lines(report, line) -> str:
    """The lines a session script prints from a report with 'copy_bw_gbs', 'gpu' and 'results':
    the copy bandwidth, then line(record) per case."""
    lines = [f"copy bandwidth {report['copy_bw_gbs']:.0f} GB/s on {report['gpu']}"]
    return "\n".join(lines + [line(r) for r in report["results"]])


def print_case_table(records, case_width: int, us_width: int) -> None:
    """One row per case: us, GB/s, fraction of the floor, torch graph us, speed-up, rel err ('-'
    where not measured); an ERROR row for a case that failed."""
    print(f"{'case':{case_width}s} {'us':>{us_width}s} {'GB/s':>7s} {'floor':>6s} {'torch us':>9s} {'speedup':>7s} "
          f"{'err':>8s}")
    for r in records:
        if "error" in r:
            print(f"{r['case']:{case_width}s} ERROR {r['error'][:120]}")
            continue
        tu = f"{r['torch_graph_us']:.1f}" if r["torch_graph_us"] else "-"
        sp = f"{r['speedup_vs_torch_graph']:.2f}x" if r["speedup_vs_torch_graph"] else "-"
        er = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        print(f"{r['case']:{case_width}s} {r['us']:{us_width}.1f} {r['gbs']:7.0f} {r['fraction_of_floor']:6.2f} "
              f"{tu:>9s} {sp:>7s} {er:>8s}")


def run_cases(json_name: str, cases, bench_one, label, out_dir: str | None = None, case_width: int = 40,
              us_width: int = 8) -> dict:
    """The loop the attention benchmarks share: the copy bandwidth, then `bench_one(case, copy_gbs)`
    per case (an exception becomes an error record named `label(case)`: one failing shape does not
    lose the others), the JSON `json_name` rewritten after every case (a run cut off at its time
    limit keeps what finished), and the summary table."""
    torch.cuda.init()
    bw = copy_bandwidth()
    res = {"commit": commit(), "command": command_line(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "copy_bandwidth_gbs": bw, "cases": []}
    for case in cases:
        try:
            rec = bench_one(case, bw["copy"])
        except Exception as exc:
            rec = {"case": label(case), "error": f"{type(exc).__name__}: {exc}"}
            torch.cuda.empty_cache()
        res["cases"].append(rec)
        print(json.dumps(rec), flush=True)
        if out_dir:
            write_json(out_dir, json_name, res)
    print(f"copy bandwidth {bw['copy']:.0f} GB/s (read-only {bw['read']:.0f} GB/s)")
    print_case_table(res["cases"], case_width=case_width, us_width=us_width)
    return res
