"""Replay a megakernel program's placements with MEASURED tile times, on CPU: which scheduler order
would have been faster, and would costs calibrated to the measurement change the placement?

    python -m bench.schedule_sim TIMELINE.json moe:kimi_k3:1:mxfp4
    python -m bench.schedule_sim timeline_dsv4_sublayer_hca_b1.json dsv4:hca:1:32768

TIMELINE.json is a per-instruction record of that program (bench/moe_bench.py writes one per
run, `timeline_moe_*.json`). Each tile's duration becomes its op's median tile time in the record;
`simulate()` then runs every SM's list in order (a tile starts when its SM is free and every op
it waits on has finished, plus one counter hop) for each order of `sdk.schedule`, once with the
placement the cost model makes and once with the placement the measured times would make. The
simulation ignores that tile times depend on what runs beside them (bandwidth sharing), so its
spans are a ranking, not a prediction; on the 2026-12-03 Kimi K3 records it ranked the orders as
the GPU did (batch 1: phase < backfill; batch 8: backfill < phase).
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from sdk.schedule import HOP_NS, ORDERS, schedule


def simulate(program, per_sm, duration_ns, hop_ns: float = HOP_NS) -> float:
    """Span (ns) of one step when instruction i takes duration_ns(instruction) on its SM."""
    counter_op = {op.counter: i for i, op in enumerate(program.ops)}
    tiles_left = [len(op.instructions) for op in program.ops]
    op_end = np.zeros(len(program.ops))
    pos, free = [0] * len(per_sm), [0.0] * len(per_sm)
    remaining = sum(len(lst) for lst in per_sm)
    while remaining:
        progressed = False
        for s, lst in enumerate(per_sm):
            while pos[s] < len(lst):
                ins = program.instructions[lst[pos[s]]]
                deps = [counter_op[c] for c, _ in ins.waits]
                if any(tiles_left[d] for d in deps):
                    break
                free[s] = max([free[s]] + [op_end[d] + hop_ns for d in deps]) + duration_ns(ins)
                tiles_left[ins.op_index] -= 1
                op_end[ins.op_index] = max(op_end[ins.op_index], free[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the placement deadlocks (sdk.schedule.validate names the stuck waits)")
    return max(free)


def op_medians(record: dict) -> dict[str, float]:
    """Median tile time (ns) per op label (the instruction label without its tile index)."""
    by: dict = {}
    for s, e, lab in zip(record["start_ns"], record["end_ns"], record["label"]):
        by.setdefault(lab.split("[")[0], []).append(e - s)
    return {k: statistics.median(v) for k, v in by.items()}


def build(spec: str):
    """'moe:MODEL:BATCH:FORMAT' -> the MoE layer program (bench/moe_bench.py's); 'dsv4:MODE:BATCH:CTX'
    -> the V4.1-Flash TP8 attention sublayer's (bench/dsv4_bench.py's bench_sublayer)."""
    kind, *rest = spec.split(":")
    if kind == "moe" and len(rest) == 3:
        from sdk.megakernel.moe_layer import build_program, preset
        return build_program(preset(rest[0], int(rest[1]), expert_dtype=rest[2]))
    if kind == "dsv4" and len(rest) == 3:
        from bench.dsv4_bench import sublayer_config
        from sdk.megakernel.dsv4_layer import build_program
        return build_program(sublayer_config(rest[0], int(rest[2]), int(rest[1])))
    raise ValueError(f"program {spec!r}: expected moe:MODEL:BATCH:FORMAT or dsv4:MODE:BATCH:CTX")


def report(program, record: dict, num_sms: int = 132) -> list[str]:
    med = op_medians(record)
    missing = {op.label for op in program.ops} - set(med)
    if missing:
        raise ValueError(f"the record has no tiles of ops {sorted(missing)}: not this program's record")
    measured = lambda ins: med[ins.label.split("[")[0]]          # noqa: E731
    by_key = {ins.block.key(): med[ins.label.split("[")[0]] for ins in program.instructions}
    lines = [f"{'order':<10} {'cost model':>11} {'measured costs':>15}   (simulated span, us)"]
    for order in ORDERS:
        plain = simulate(program, schedule(program, num_sms, order=order).per_sm, measured)
        calibrated = schedule(program, num_sms, order=order, cost_ns=lambda block: by_key[block.key()])
        lines.append(f"{order:<10} {plain / 1e3:>11.1f} {simulate(program, calibrated.per_sm, measured) / 1e3:>15.1f}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record", help="timeline JSON of the program")
    ap.add_argument("program", help="moe:MODEL:BATCH:FORMAT or dsv4:MODE:BATCH:CTX")
    a = ap.parse_args(argv)
    with open(a.record) as f:
        rec = json.load(f)
    print("\n".join(report(build(a.program), rec)))


if __name__ == "__main__":
    main()
