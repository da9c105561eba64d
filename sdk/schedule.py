"""Placing a megakernel program's instructions on SMs, and proving the placement runs.

`schedule(program, num_sms)` is list scheduling by cost: instructions are taken in a topological
order (`op_order`: by phase, or critical path first), and each goes to
the SM where it would finish first (order "backfill": critical path first, and into an idle gap
of an SM's list where it fits - insertion list scheduling, as HEFT), given
  - the SM's estimated clock (the sum of the costs already placed there),
  - when its dependencies are met (the finish time of the last tile of each op it waits for,
    plus one counter hop, ~0.5 us measured on the H200),
  - its own cost: `block.cost().bytes` at the SM's share of the measured copy bandwidth.
Because every SM's list is in topological order and all CTAs are resident at once (grid = SMs),
the oldest unfinished instruction always has its dependencies met: no deadlock. `validate()`
checks that by simulation instead of trusting the argument.

`validate(program, per_sm)` raises `ScheduleError` for a counter whose expected count differs
from the number of instructions that signal it (an unsatisfiable wait, or one that a later step
would pass too early), a wait on a counter nobody signals, and any deadlock (cycles included),
naming the stuck instructions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import SdkError

HOP_NS = 500.0            # one dependency passed through a global counter (H200, measured)
COPY_BW_GBS = 4260.0      # H200 copy bandwidth, measured (bytes/ns = GB/s)
INSTR_OVERHEAD_NS = 150.0  # fetch + dispatch + barrier + signal of one instruction (estimate)


class ScheduleError(SdkError, ValueError):
    """An instruction stream that cannot run to the end: names the stuck waits."""


@dataclass
class Schedule:
    num_sms: int
    per_sm: list            # per SM: instruction indices, in execution order
    est_ns: float           # estimated makespan
    busy_ns: np.ndarray     # estimated busy time per SM

    @property
    def max_len(self) -> int:
        return max(len(x) for x in self.per_sm)


def instruction_ns(block, num_sms: int, bandwidth_gbs: float = COPY_BW_GBS) -> float:
    return block.cost().bytes / (bandwidth_gbs / num_sms) + INSTR_OVERHEAD_NS


ORDERS = ("phase", "critical", "backfill")


def op_order(program, num_sms: int, hop_ns: float = HOP_NS, bandwidth_gbs: float = COPY_BW_GBS,
             order: str = "phase", cost_ns=None) -> list[int]:
    """The order in which instructions are placed (a topological order: every SM's list keeps it).
    "phase": by topological level, then program order. "critical": op by op, among the ops whose
    dependencies are all placed the one with the longest estimated path to the end of the
    program (its own span and its successors', each op alone on the SMs); ties: inputs ready
    first, then program order. Why "critical" exists: phase order puts a short side branch first
    wherever it shares a level with the critical path (Kimi K3's shared-expert down GEMV ahead of
    the routed experts on every SM: 3 us of the batch-1 timeline); not yet the default (unmeasured)."""
    if order not in ORDERS:
        raise ValueError(f"schedule order {order!r}: one of {ORDERS}")
    if order == "phase":
        return sorted(range(len(program.instructions)),
                      key=lambda i: (program.instructions[i].phase, program.instructions[i].op_index, i))
    ops = program.ops
    counter_op = {op.counter: i for i, op in enumerate(ops)}
    deps = [sorted({counter_op[c] for c, _ in program.instructions[op.instructions[0]].waits}) if op.instructions
            else [] for op in ops]
    cost_ns = cost_ns or (lambda block: instruction_ns(block, num_sms, bandwidth_gbs))
    cost = [[cost_ns(program.instructions[i].block) for i in op.instructions]
            for op in ops]
    span = [max(sum(c) / num_sms, max(c, default=0.0)) for c in cost]      # the op alone on the SMs
    tail = [0.0] * len(ops)                        # longest estimated path from the op to the end
    for j in reversed(range(len(ops))):           # deps always precede their users in program order
        for d in deps[j]:
            tail[d] = max(tail[d], span[j] + tail[j])
    done = [None] * len(ops)
    order: list[int] = []
    left = set(range(len(ops)))
    while left:
        ready = {j: max((done[d] + hop_ns for d in deps[j]), default=0.0)
                 for j in left if all(done[d] is not None for d in deps[j])}
        j = min(ready, key=lambda j: (-(span[j] + tail[j]), ready[j], j))
        done[j] = ready[j] + span[j]
        order.extend(ops[j].instructions)
        left.remove(j)
    return order


def schedule(program, num_sms: int, *, hop_ns: float = HOP_NS, bandwidth_gbs: float = COPY_BW_GBS,
             order: str = "phase", cost_ns=None) -> Schedule:
    """Place every instruction (see the module docstring). order "backfill": critical order, and an
    instruction may go into an idle gap of an SM's list (before instructions placed earlier) where
    it fits whole between its inputs being ready and the next instruction's estimated start.
    Measured on the H200 (Kimi K3 latent MoE, bench/results/h200/moe_bench_v9_order.json): phase
    80.5 / 229.0 us at batch 1 / 8, backfill 87.0 / 218.5 - "phase" stays the default.
    cost_ns(block) -> ns replaces the byte-based `instruction_ns` (bench/schedule_sim.py: measured
    tile times)."""
    if order not in ORDERS:
        raise ValueError(f"schedule order {order!r}: one of {ORDERS}")
    backfill = order == "backfill"
    clocks = np.zeros(num_sms)
    busy = np.zeros(num_sms)
    per_sm: list[list[int]] = [[] for _ in range(num_sms)]
    slots: list[list[tuple[float, float]]] = [[] for _ in range(num_sms)]   # estimated (start, end) per entry
    max_gap = np.zeros(num_sms)                     # longest idle gap in each SM's list (backfill)
    op_done = np.zeros(len(program.ops))            # finish time of an op's last tile
    counter_op = {op.counter: i for i, op in enumerate(program.ops)}
    cost_ns = cost_ns or (lambda block: instruction_ns(block, num_sms, bandwidth_gbs))
    cost_cache: dict = {}
    for i in op_order(program, num_sms, hop_ns, bandwidth_gbs, "critical" if backfill else order, cost_ns):
        ins = program.instructions[i]
        k = ins.block.key()
        if k not in cost_cache:
            cost_cache[k] = cost_ns(ins.block)
        cost = cost_cache[k]
        ready = max((op_done[counter_op[c]] + hop_ns for c, _ in ins.waits), default=0.0)
        start = np.maximum(clocks, ready)
        # earliest finish (equal cost: earliest start); ties go to the least busy SM, so the
        # remainder tiles of successive ops rotate over the SMs instead of piling on SM 0
        s = int(np.argmin(start + 1e-6 * busy))
        at, pos = float(start[s]), len(per_sm[s])
        if backfill:
            for g in np.flatnonzero(max_gap >= cost):
                gap = _first_gap(slots[g], ready, cost)
                if gap is not None and (gap[0], busy[g]) < (at, busy[s]):
                    s, (at, pos) = int(g), gap
        per_sm[s].insert(pos, i)
        slots[s].insert(pos, (at, at + cost))
        if pos == len(slots[s]) - 1:
            if at - clocks[s] > max_gap[s]:
                max_gap[s] = at - clocks[s]
            clocks[s] = at + cost
        elif backfill:
            max_gap[s] = _longest_gap(slots[s])
        busy[s] += cost
        op_done[ins.op_index] = max(op_done[ins.op_index], at + cost)
    return Schedule(num_sms, per_sm, float(clocks.max(initial=0.0)), busy)


def _first_gap(slots, ready: float, cost: float):
    """(start, list position) of the earliest idle gap in `slots` that holds [start, start + cost)
    with start >= ready, or None. The list stays sorted by start, so every SM's list remains in one
    global topological order (an instruction placed before another starts, in the estimate, after
    its own inputs finished and ends before that one starts: it cannot be that one's successor)."""
    prev_end = 0.0
    for pos, (st, en) in enumerate(slots):
        at = max(prev_end, ready)
        if at + cost <= st:
            return at, pos
        prev_end = en
    return None


def _longest_gap(slots) -> float:
    prev_end, best = 0.0, 0.0
    for st, en in slots:
        best = max(best, st - prev_end)
        prev_end = en
    return best


def validate(program, per_sm) -> None:
    """Simulate the instruction stream (one step) and raise ScheduleError unless it completes."""
    n_signal = np.zeros(program.num_counters, dtype=np.int64)
    for ins in program.instructions:
        if ins.signal >= 0:
            n_signal[ins.signal] += 1
    problems = []
    for c in range(1, program.num_counters):
        if n_signal[c] != program.expected[c]:
            problems.append(f"counter {c} ({program.counter_names[c]}): expected {program.expected[c]} "
                            f"signals per step, {n_signal[c]} instructions signal it")
    for ins in program.instructions:
        for c, e in ins.waits:
            if not 0 < c < program.num_counters:
                problems.append(f"{ins.label} waits on counter {c}, which does not exist")
            elif e > n_signal[c]:
                problems.append(f"{ins.label} waits for {e} signals on counter {c} "
                                f"({program.counter_names[c]}), only {n_signal[c]} instructions signal it")
            elif e != program.expected[c]:
                problems.append(f"{ins.label} waits for {e} signals on counter {c} "
                                f"({program.counter_names[c]}), which gets {program.expected[c]} per step")
    placed = sorted(i for lst in per_sm for i in lst)
    if placed != list(range(len(program.instructions))):
        problems.append("the placement does not hold every instruction exactly once")
    if problems:
        raise ScheduleError("invalid instruction stream:\n  " + "\n  ".join(problems))
    counters = np.zeros(program.num_counters, dtype=np.int64)
    pos = [0] * len(per_sm)
    remaining = len(placed)
    while remaining:
        progressed = False
        for s, lst in enumerate(per_sm):
            while pos[s] < len(lst):
                ins = program.instructions[lst[pos[s]]]
                if any(counters[c] < e for c, e in ins.waits):
                    break
                if ins.signal >= 0:
                    counters[ins.signal] += 1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for s, lst in enumerate(per_sm):
                if pos[s] < len(lst):
                    ins = program.instructions[lst[pos[s]]]
                    need = ", ".join(f"counter {c} ({program.counter_names[c]}) = {counters[c]} < {e}"
                                     for c, e in ins.waits if counters[c] < e)
                    stuck.append(f"SM {s} at #{pos[s]} {ins.label}: {need}")
            raise ScheduleError(f"deadlock: {remaining} instructions can never run; first stuck:\n  "
                                + "\n  ".join(stuck[:8]) + (f"\n  ... ({len(stuck)} SMs stuck)" if len(stuck) > 8 else ""))
