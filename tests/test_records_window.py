"""The megakernel's instruction-record window (kernel.py, program.records_geometry), on the CPU.

A list too long to keep every record in shared memory (a whole model: hundreds of instructions a
SM) streams through WIN record slots, refilled half a window at a time. The protocol is modelled
here statement for statement with the kernel's loop - the consumer, the weight ring's producer
that runs up to P chunks ahead (reading a record past the window from global memory), the refill
at the window's middle - over random instruction lists: every record read from shared memory is
the one its slot holds, no refill overwrites a record the consumer or the producer still needs,
and the chunks are consumed exactly in the order produced, each after it was produced. (The
device code itself runs in the GPU tests: tests/gpu/test_megakernel_gpu.py, forced windows.)"""
import random

import pytest

from sdk.errors import UnsupportedConfigError
from sdk.megakernel.program import RECORDS_MAX_BYTES, RECORDS_WINDOW_BYTES, records_geometry


class Kernel:
    """The kernel's record and ring bookkeeping for one CTA: chunks[i] = chunks of instruction i
    (0: a plain tile)."""

    def __init__(self, chunks, win: int, stages: int):
        self.chunks, self.n = chunks, len(chunks)
        self.LR = win or self.n
        self.win, self.half, self.P = win, self.LR // 2, stages
        self.slots = [None] * self.LR
        self.produced, self.consumed = [], []
        self.i = 0

    def slot(self, i):
        return i % self.LR if self.win else i

    def read(self, i, who):
        """kernel.word: the smem slot, or (the producer only, past the resident end) global memory."""
        if who == "producer" and self.win and i >= self.hi:
            self.global_reads += 1
            return self.chunks[i]
        assert self.lo <= i < self.hi, f"{who} read record {i} outside the resident [{self.lo}, {self.hi})"
        assert self.slots[self.slot(i)] == i, f"{who} read slot {self.slot(i)}: record {self.slots[self.slot(i)]}, not {i}"
        return self.chunks[i]

    def load(self, r0, cnt):
        for r in range(r0, r0 + cnt):
            old = self.slots[self.slot(r)]
            assert old is None or old < min(self.i, self.pi), f"record {r} overwrote record {old}, still needed"
            self.slots[self.slot(r)] = r

    def next_streaming(self, i):
        while i < self.n and self.read(i, "producer") == 0:
            i += 1
        return i

    def produce(self):
        if self.pi < self.n:
            c = self.read(self.pi, "producer")
            self.produced.append((self.pi, self.pc))
            self.pc += 1
            if self.pc >= c:
                self.pc = 0
                self.pi = self.next_streaming(self.pi + 1)

    def run(self):
        self.lo, self.hi, self.pi, self.pc, self.global_reads = 0, (min(self.n, self.LR) if self.win else self.n), 0, 0, 0
        self.load(0, self.hi)
        self.pi = self.next_streaming(0)
        for _ in range(self.P):
            self.produce()
        while self.i < self.n:
            if self.win and self.i == self.lo + self.half and self.hi < self.n:
                cnt = min(self.half, self.n - self.hi)
                self.load(self.hi, cnt)
                self.lo, self.hi = self.lo + self.half, self.hi + cnt
            for ch in range(self.read(self.i, "consumer")):
                k = len(self.consumed)
                assert k < len(self.produced), f"instruction {self.i} chunk {ch}: never produced"
                assert self.produced[k] == (self.i, ch), f"consumed {(self.i, ch)}, produced {self.produced[k]}"
                self.consumed.append((self.i, ch))
                self.produce()
            self.i += 1
        want = [(i, c) for i, n in enumerate(self.chunks) for c in range(n)]
        assert self.consumed == want and self.produced == want


@pytest.mark.parametrize("win", [0, 4, 8, 16])
@pytest.mark.parametrize("stages", [2, 3, 6])
def test_window_protocol_on_random_lists(win, stages):
    rng = random.Random(win * 10 + stages)
    for _ in range(300):
        n = rng.randint(1, 70)
        plain = rng.random()            # lists from all-streaming to mostly plain tiles
        chunks = [0 if rng.random() < plain else rng.randint(1, 5) for _ in range(n)]
        Kernel(chunks, win if win < n else 0, stages).run()


def test_long_runs_of_plain_tiles_send_the_producer_to_global_memory():
    """30 plain tiles between two streaming instructions, a window of 8: the producer, P chunks
    ahead, reads the records past the window from global memory (it never waits for a refill:
    the ring's chunks stay P ahead), and the chunks come in order."""
    k = Kernel([2] + [0] * 30 + [3, 1], 8, 4)
    k.run()
    assert k.global_reads > 0 and k.consumed[-4:] == [(31, 0), (31, 1), (31, 2), (32, 0)]
    assert k.produced.index((31, 0)) < k.consumed.index((0, 1)) + 4        # issued before the plain run


def test_records_geometry_windows_only_long_lists():
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    blocks = [GemvBlock(GemvConfig(n=1024, k=1024))]
    nops, short, win = records_geometry(blocks, 20)
    per = short // 20
    assert win == 0 and nops == len(blocks[0].operands())
    n_fit = RECORDS_MAX_BYTES // per
    assert records_geometry(blocks, n_fit)[2] == 0
    _, b, win = records_geometry(blocks, n_fit + 1)
    assert win & (win - 1) == 0 and b == win * per <= RECORDS_WINDOW_BYTES < 2 * win * per
    assert records_geometry(blocks, 20, window=8) == (nops, 8 * per, 8)
    assert records_geometry(blocks, 20, window=0) == (nops, 20 * per, 0)    # the runtime's resident choice
    with pytest.raises(UnsupportedConfigError, match="records window"):
        records_geometry(blocks, n_fit + 1, window=0)
    assert records_geometry(blocks, 20, window=32)[2] == 0          # the whole list fits the window
    with pytest.raises(ValueError, match="power of two"):
        records_geometry(blocks, 20, window=6)
