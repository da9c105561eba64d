"""The token embedding onto the mHC residual streams (DeepSeek-V4(.1), GLM-5.3), or into the plain
hidden state (Kimi K3: `flat`, one stream [m, d]): the first op of a whole-model decode step.

    streams[m, n, :] = table[ids[m], :]      for every stream n  (the model's `embed`: the
                                              embedding repeated on the N streams)

A tile is one token: each thread copies D / 1024 4-element bf16 vectors of the row, N stores each.
The ids are the host's (the step driver checks them against the vocabulary before the launch).

Supported: D a multiple of 4 * NUM_THREADS (1024), M = 1..64, N 1..8, V * D < 2^31.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec


@dataclass(frozen=True)
class EmbedStreamsConfig:
    vocab: int
    d: int
    n: int = 4                   # hc_mult: streams
    m: int = 1                   # tokens
    flat: bool = False           # n = 1 with the operand shaped [m, d]: a plain-residual model's
                                 # hidden state (the same memory as [m, 1, d])


class EmbedStreamsBlock(Block):
    name = "embed_streams"
    Config = EmbedStreamsConfig

    def check(self):
        c = self.config
        if c.d % (4 * NUM_THREADS):
            self.unsupported(f"embed_streams: d={c.d} must be a multiple of {4 * NUM_THREADS}")
        if not 1 <= c.m <= 64 or not 1 <= c.n <= 8:
            self.unsupported(f"embed_streams: m={c.m} tokens (1..64), n={c.n} streams (1..8)")
        if c.flat and c.n != 1:
            self.unsupported(f"embed_streams: flat takes one stream, not n={c.n}")
        if c.vocab * c.d >= 2 ** 31:
            self.unsupported(f"embed_streams: table {c.vocab} x {c.d} over 2^31 elements")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("ids", (c.m,), "int32"),
                OperandSpec("table", (c.vocab, c.d), "bf16"),
                OperandSpec("streams", (c.m, c.d) if c.flat else (c.m, c.n, c.d), "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.config.m

    def cost(self) -> Cost:
        c = self.config
        return Cost(bytes=c.d * 2 * (1 + c.n) + 4, flops=0)

    def reference(self, **t):
        c = self.config
        rows = t["table"][t["ids"].long()]
        return {"streams": rows.clone() if c.flat else rows[:, None, :].expand(-1, c.n, -1).clone()}

    def emulate_tile(self, t, tile):
        row = t["table"][int(t["ids"][tile])]
        t["streams"][tile] = (row if self.config.flat else row[None, :]).to(t["streams"].dtype)

    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Int32

        from ._cute import gmem_tensor

        c = self.config
        D, M, N, V = c.d, c.m, c.n, c.vocab
        NV = D // (4 * NUM_THREADS)

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mI = gmem_tensor(ptrs[0], Int32, (M,), 4)
            mT = gmem_tensor(ptrs[1], BFloat16, (V, D // 4, 4), 8)
            mS = gmem_tensor(ptrs[2], BFloat16, (M, N, D // 4, 4), 8)   # flat: N = 1, the same memory
            row = mI[t]
            # every load before the stores (which may alias the table, as far as the compiler
            # knows): one round trip, not one per vector
            vals = [mT[row, j * NUM_THREADS + tid, None].load() for j in range(NV)]
            for j in cutlass.range_constexpr(NV):
                for n in cutlass.range_constexpr(N):
                    mS[t, n, j * NUM_THREADS + tid, None].store(vals[j])

        return tile


def embed_compile_cases() -> list:
    """V4.1-Flash (vocab 129280, hidden 5120) and GLM-5.3's hidden, 4 streams; Kimi K3's plain
    hidden state (vocab 163840, hidden 7168)."""
    return [EmbedStreamsBlock(EmbedStreamsConfig(vocab=129280, d=5120, m=8)),
            EmbedStreamsBlock(EmbedStreamsConfig(vocab=4096, d=6144, m=64)),
            EmbedStreamsBlock(EmbedStreamsConfig(vocab=163840, d=7168, n=1, m=8, flat=True))]
