"""The PyVM of N ranks run together: the N ranks' instruction streams (the same encoded words,
each rank with its own tensors, counters and epochs) interleaved by a seeded random choice over
every (rank, SM) that can make progress.

A block that waits on peers (`emulate_missing`, i.e. `AllReduceBlock`) runs in two parts, like
its device tile: `emulate_arrive` (pushes + flags) as soon as the instruction reaches the head
of its SM's list and its local counters are met, and `emulate_finish` only once no peer flag is
missing. Ranks are NOT synchronised between steps: a rank that finished step s starts step s+1
(after `before_step(rank, s+1)`) while slower ranks are still in step s - the case the epoch
flags and the parity-double-buffered receive regions must survive. `max_skew` records the
largest step difference seen between a rank that pushed and the slowest unfinished rank.

A rank listed in `absent` never runs (a GPU that never arrives): the others end in
`ScheduleError` naming the missing ranks - the PyVM twin of the device's KernelTimeoutError.
"""
from __future__ import annotations

import random

import numpy as np

from ..megakernel import isa
from ..schedule import ScheduleError


class MultiRankVM:
    def __init__(self, program, words: np.ndarray, lengths: np.ndarray, tensors_per_rank: list[dict],
                 per_sm: list[list[int]] | None = None):
        self.program = program
        self.words = words
        self.lengths = lengths
        self.tensors = tensors_per_rank
        self.n = len(tensors_per_rank)
        self.num_sms = len(lengths)
        self.counters = [np.zeros(program.num_counters, dtype=np.int64) for _ in range(self.n)]
        self.blocks = program.opcodes.blocks
        self.per_sm = per_sm
        self.max_skew = 0
        self._ops = [{} for _ in range(self.n)]    # rank -> {operand base: tensors by operand name}

    def _operands(self, r, block, base):
        cache = self._ops[r]
        if base not in cache:
            cache[base] = self.program.operand_views(block, base, self.tensors[r])
        return cache[base]

    def _label(self, s, j):
        if self.per_sm is None:
            return f"SM {s} #{j}"
        return self.program.instructions[self.per_sm[s][j]].label

    def run(self, steps: int, before_step=None, after_step=None, seed: int | None = 0, absent=(),
            favor: float = 0.0) -> None:
        """Run `steps` launches on every present rank. before_step(rank, step) sets the rank's
        inputs before its launch `step`; after_step(rank, step) reads its outputs after it.
        favor: probability of picking the lowest-numbered rank that can progress (lets that rank
        run ahead into the next step while the others still finish the previous one)."""
        rng = random.Random(seed)
        S = self.num_sms
        present = [r for r in range(self.n) if r not in set(absent)]
        step = {r: 0 for r in present}
        pos = {r: [0] * S for r in present}
        arrived = {r: [False] * S for r in present}
        epoch = {}

        def start(r):
            epoch[r] = int(self.counters[r][isa.EXIT_COUNTER]) // S + 1
            pos[r] = [0] * S
            arrived[r] = [False] * S
            if before_step:
                before_step(r, step[r])

        for r in present:
            start(r)
        live = set(present)
        while live:
            cands = []
            stuck = []
            for r in sorted(live):
                for s in range(S):
                    j = pos[r][s]
                    if j >= self.lengths[s]:
                        continue
                    w = self.words[s, j]
                    need = [(int(w[c]), int(w[e]) * epoch[r]) for c, e in
                            isa.WAITS if w[c] >= 0]
                    unmet = [(c, v) for c, v in need if self.counters[r][c] < v]
                    if unmet:
                        stuck.append(f"rank {r} SM {s} {self._label(s, j)}: counter " + ", ".join(
                            f"{c} ({self.program.counter_names[c]}) = {self.counters[r][c]} < {v}" for c, v in unmet))
                        continue
                    block = self.blocks[w[isa.OPCODE]]
                    if hasattr(block, "emulate_missing"):
                        if not arrived[r][s]:
                            cands.append((r, s, "arrive"))
                            continue
                        missing = block.emulate_missing(self._operands(r, block, int(w[isa.OPERANDS])), int(w[isa.TILE]))
                        if missing:
                            stuck.append(f"rank {r} SM {s} {self._label(s, j)}: flags of rank(s) {missing} "
                                         f"missing (epoch {epoch[r]})")
                            continue
                    cands.append((r, s, "run"))
            if not cands:
                raise ScheduleError("MultiRankVM: no rank can progress"
                                    + (f" (absent ranks {sorted(absent)})" if absent else "")
                                    + "; stuck:\n  " + "\n  ".join(stuck[:12]))
            if seed is None:
                r, s, what = cands[0]
            elif favor and rng.random() < favor:
                lead = [c for c in cands if c[0] == cands[0][0]]
                r, s, what = lead[rng.randrange(len(lead))]
            else:
                r, s, what = cands[rng.randrange(len(cands))]
            w = self.words[s, pos[r][s]]
            block = self.blocks[w[isa.OPCODE]]
            t = self._operands(r, block, int(w[isa.OPERANDS]))
            tile = int(w[isa.TILE])
            if what == "arrive":
                block.emulate_arrive(t, tile)
                arrived[r][s] = True
                self.max_skew = max(self.max_skew, step[r] - min(step[q] for q in live))
                continue
            if hasattr(block, "emulate_missing"):
                block.emulate_finish(t, tile)
            else:
                block.emulate_tile(t, tile)
            if w[isa.SIGNAL] >= 0:
                self.counters[r][w[isa.SIGNAL]] += 1
            pos[r][s] += 1
            arrived[r][s] = False
            if all(pos[r][q] >= self.lengths[q] for q in range(S)):
                self.counters[r][isa.EXIT_COUNTER] += S
                if after_step:
                    after_step(r, step[r])
                step[r] += 1
                if step[r] < steps:
                    start(r)
                else:
                    live.discard(r)
