"""The PyVM: a torch interpreter of the megakernel's instruction stream (CPU or GPU).

It runs exactly what the GPU runs - the encoded per-SM instruction words, the operand table, the
counters with their per-step epochs - but each tile is the block's `emulate_tile` in torch.
SMs advance in an interleaving chosen by a seed (any order the counters allow is a legal run of
the kernel), so a PyVM result that matches the reference for several seeds says the dependencies
are sufficient. A stuck stream raises `ScheduleError` naming the waits, as the GPU's error word
would. A megakernel bug is bisected against the PyVM instruction by instruction (`trace=True`
records the order of execution).
"""
from __future__ import annotations

import random

import numpy as np
import torch

from ..blocks.base import DTYPES
from ..schedule import ScheduleError
from . import isa


class PyVM:
    @classmethod
    def from_program(cls, program, num_sms: int, weights: dict[str, torch.Tensor]):
        """Schedule `program` on `num_sms` SMs, validate and encode it, and return (PyVM, schedule)
        with freshly allocated buffers plus `weights` bound (every weight buffer's, checked:
        program.check_weights)."""
        from ..schedule import schedule, validate
        from .program import check_weights, encode
        from .runtime import check_buffers
        check_weights(program, weights)
        sched = schedule(program, num_sms)
        validate(program, sched.per_sm)
        words, lengths = encode(program, sched.per_sm)
        tensors = cls.alloc(program)
        tensors.update(weights)
        check_buffers(program, tensors, "cpu")        # what the GPU runtime checks: aligned, contiguous
        return cls(program, words, lengths, tensors), sched

    def __init__(self, program, words: np.ndarray, lengths: np.ndarray, tensors: dict[str, torch.Tensor]):
        self.program = program
        self.words = words
        self.lengths = lengths
        self.tensors = tensors
        self.counters = np.zeros(program.num_counters, dtype=np.int64)
        self.blocks = program.opcodes.blocks
        self.trace: list = []

    @staticmethod
    def alloc(program, device="cpu") -> dict[str, torch.Tensor]:
        return {b.name: torch.zeros(b.shape, dtype=DTYPES[b.dtype], device=device)
                for b in program.buffers.values()}

    def _operands(self, block, base):
        return self.program.operand_views(block, base, self.tensors)

    def step(self, seed: int | None = 0, trace: bool = False) -> None:
        """Run one launch (one decode step)."""
        num_sms = len(self.lengths)
        epoch = int(self.counters[isa.EXIT_COUNTER]) // num_sms + 1
        rng = random.Random(seed)
        pos = [0] * num_sms
        live = [s for s in range(num_sms) if self.lengths[s] > 0]
        while live:
            ready = []
            for s in live:
                w = self.words[s, pos[s]]
                ok = all(self.counters[w[c]] >= epoch * w[e]
                         for c, e in isa.WAITS if w[c] >= 0)
                if ok:
                    ready.append(s)
            if not ready:
                stuck = []
                for s in live:
                    w = self.words[s, pos[s]]
                    for c, e in isa.WAITS:
                        if w[c] >= 0 and self.counters[w[c]] < epoch * w[e]:
                            stuck.append(f"SM {s} instruction {pos[s]} (opcode {w[isa.OPCODE]}): counter "
                                         f"{w[c]} ({self.program.counter_names[w[c]]}) = {self.counters[w[c]]} "
                                         f"< {epoch * w[e]}")
                raise ScheduleError("PyVM: deadlock; stuck waits:\n  " + "\n  ".join(stuck[:8]))
            s = ready[rng.randrange(len(ready))] if seed is not None else ready[0]
            w = self.words[s, pos[s]]
            block = self.blocks[w[isa.OPCODE]]
            block.emulate_tile(self._operands(block, int(w[isa.OPERANDS])), int(w[isa.TILE]))
            if trace:
                self.trace.append((s, pos[s]))
            if w[isa.SIGNAL] >= 0:
                self.counters[w[isa.SIGNAL]] += 1
            pos[s] += 1
            if pos[s] == self.lengths[s]:
                live.remove(s)
        self.counters[isa.EXIT_COUNTER] += num_sms
