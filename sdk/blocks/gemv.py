"""GEMV / skinny GEMM block: y[m, n] = sum_k x[m, k] * W[n, k], for M = 1..64 tokens.

Supported:
- weights bf16, or fp8-e4m3 with fp32 128x128 block scales `scale[n // 128, k // 128]` (the
  DeepSeek / Kimi checkpoint format: `weight_scale_inv`, multiplied in);
- x bf16 [M, K]; y bf16 or fp32 [M, N]; fp32 accumulation;
- fused SwiGLU epilogue (`swiglu=True`): two weights (gate, up) and
  y = act(gate(x)) * up(x), with the optional clamp limit (gate <= limit, |up| <= limit).

A tile is `rows_per_tile` output rows over the full K. Each warp owns one output row (SwiGLU: the
gate row and the up row together) at a time; its lanes stream the row in 16-byte vector loads
(8 bf16 or 16 fp8 per load), `unroll` loads per lane in flight, fp32 FMAs, then a warp shuffle
reduction. Many tiles spread the weight stream over all SMs.

Not yet: the tensor-core path for M >= 16 (warp MMA with swap-AB, weight rows as the MMA M
dimension). Today M > 8 runs as groups of 8 tokens, each re-reading the tile's weights (from L2):
correct, but bandwidth-efficient only at small M.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.common import swiglu as swiglu_ref
from .base import NUM_THREADS, Block, Cost, OperandSpec

TOKEN_GROUP = 8      # tokens accumulated in registers at once on the CUDA-core path


@dataclass(frozen=True)
class GemvConfig:
    n: int                               # output features (rows of W)
    k: int                               # input features
    m: int = 1                           # tokens (static: the megakernel is built per batch shape)
    rows_per_tile: int = 8
    weight_dtype: str = "bf16"           # "bf16" | "fp8_e4m3"
    swiglu: bool = False
    swiglu_limit: float | None = None
    out_dtype: str = "bf16"              # "bf16" | "fp32"
    unroll: int = 0                      # 16-byte loads per lane in flight per row; 0 = auto
    scale_block: int = 128


class GemvBlock(Block):
    name = "gemv"
    Config = GemvConfig

    # -- static facts --------------------------------------------------------------------------
    @property
    def elems_per_load(self) -> int:
        return 16 if self.config.weight_dtype == "fp8_e4m3" else 8

    @property
    def unroll(self) -> int:
        c = self.config
        if c.unroll:
            return c.unroll
        return 4 if c.swiglu else 8

    def check(self):
        c = self.config
        if c.weight_dtype not in ("bf16", "fp8_e4m3"):
            self.unsupported(f"gemv: weight dtype {c.weight_dtype!r} (supported: bf16, fp8_e4m3)")
        if c.out_dtype not in ("bf16", "fp32"):
            self.unsupported(f"gemv: out dtype {c.out_dtype!r} (supported: bf16, fp32)")
        if not 1 <= c.m <= 64:
            self.unsupported(f"gemv: m={c.m} tokens (supported: 1..64)")
        if c.m > TOKEN_GROUP and c.m % TOKEN_GROUP:
            self.unsupported(f"gemv: m={c.m} > {TOKEN_GROUP} must be a multiple of {TOKEN_GROUP}")
        if c.k % (self.elems_per_load * 32):
            self.unsupported(f"gemv: k={c.k} must be a multiple of {self.elems_per_load * 32}")
        if c.n % c.rows_per_tile:
            self.unsupported(f"gemv: n={c.n} must be a multiple of rows_per_tile={c.rows_per_tile}")
        if c.rows_per_tile % (NUM_THREADS // 32):
            self.unsupported(f"gemv: rows_per_tile={c.rows_per_tile} must be a multiple of the "
                             f"{NUM_THREADS // 32} warps")
        if c.weight_dtype == "fp8_e4m3" and (c.n % c.scale_block or c.k % c.scale_block):
            self.unsupported(f"gemv fp8: n={c.n}, k={c.k} must be multiples of the {c.scale_block} scale block")
        if c.swiglu_limit is not None and not c.swiglu:
            self.unsupported("gemv: swiglu_limit without swiglu")

    def operand_specs(self):
        c = self.config
        w, sc = c.weight_dtype, (c.n // c.scale_block, c.k // c.scale_block)
        fp8 = w == "fp8_e4m3"
        specs = []
        names = ("w_gate", "w_up") if c.swiglu else ("w",)
        for name in names:
            specs.append(OperandSpec(name, (c.n, c.k), w))
        if fp8:
            for name in names:
                specs.append(OperandSpec(name + "_scale", sc, "fp32"))
        specs.append(OperandSpec("x", (c.m, c.k), "bf16"))
        specs.append(OperandSpec("y", (c.m, c.n), c.out_dtype, output=True))
        return specs

    def num_tiles(self) -> int:
        return self.config.n // self.config.rows_per_tile

    def cost(self) -> Cost:
        c = self.config
        nw = 2 if c.swiglu else 1
        wbytes = 1 if c.weight_dtype == "fp8_e4m3" else 2
        obytes = 2 if c.out_dtype == "bf16" else 4
        r = c.rows_per_tile
        b = nw * r * c.k * wbytes + c.m * c.k * 2 + c.m * r * obytes
        if c.weight_dtype == "fp8_e4m3":
            b += nw * max(1, r // c.scale_block) * (c.k // c.scale_block) * 4
        return Cost(bytes=b, flops=2 * nw * r * c.k * c.m)

    def weight_bytes(self) -> int:
        """Bytes of all weights (and scales) of the whole op: the GEMV's bandwidth floor."""
        c = self.config
        nw = 2 if c.swiglu else 1
        b = nw * c.n * c.k * (1 if c.weight_dtype == "fp8_e4m3" else 2)
        if c.weight_dtype == "fp8_e4m3":
            b += nw * (c.n // c.scale_block) * (c.k // c.scale_block) * 4
        return b

    # -- torch faces ---------------------------------------------------------------------------
    def dequant(self, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        w = w.float()
        if scale is None:
            return w
        b = self.config.scale_block
        return w * scale.float().repeat_interleave(b, 0).repeat_interleave(b, 1)

    def reference(self, **t) -> dict[str, torch.Tensor]:
        c = self.config
        x = t["x"].float()
        if c.swiglu:
            g = x @ self.dequant(t["w_gate"], t.get("w_gate_scale")).T
            u = x @ self.dequant(t["w_up"], t.get("w_up_scale")).T
            return {"y": swiglu_ref(g, u, "silu", c.swiglu_limit)}
        return {"y": x @ self.dequant(t["w"], t.get("w_scale")).T}

    def emulate_tile(self, t: dict[str, torch.Tensor], tile: int) -> None:
        c = self.config
        rows = slice(tile * c.rows_per_tile, (tile + 1) * c.rows_per_tile)
        x = t["x"].float()

        def part(name):
            w = t[name][rows].float()
            s = t.get(name + "_scale")
            if s is not None:
                b = c.scale_block
                w = w * s.float().repeat_interleave(b, 0)[rows].repeat_interleave(b, 1)
            return x @ w.T

        if c.swiglu:
            y = swiglu_ref(part("w_gate"), part("w_up"), "silu", c.swiglu_limit)
        else:
            y = part("w")
        t["y"][:, rows] = y.to(t["y"].dtype)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32

        from ._cute import DTYPE_MAP, gmem_tensor

        c = self.config
        E = self.elems_per_load                     # weight elements per 16-byte load
        U = self.unroll
        nch = c.k // (E * 32)                       # 16-byte loads per lane per row
        n_main, tail = nch // U, nch % U
        R = c.rows_per_tile
        NW = NUM_THREADS // 32
        M = c.m
        MG = min(M, TOKEN_GROUP)
        fp8 = c.weight_dtype == "fp8_e4m3"
        SB = c.scale_block
        KB = c.k // SB
        wdt = DTYPE_MAP[c.weight_dtype]
        odt = DTYPE_MAP[c.out_dtype]
        nw = 2 if c.swiglu else 1
        limit = c.swiglu_limit
        swiglu = c.swiglu
        K = c.k

        @cute.jit
        def dot_chunk(wv, mX, m, ch):
            """fp32 dot of one loaded weight chunk (E elements, already fp32) with x[m, chunk]."""
            if cutlass.const_expr(fp8):
                x0 = mX[m, 2 * ch, None].load().to(Float32)
                x1 = mX[m, 2 * ch + 1, None].load().to(Float32)
                w0 = cute.make_rmem_tensor((16,), Float32)
                w0.store(wv)
                s = Float32(0.0)
                for e in cutlass.range_constexpr(8):
                    s = s + w0[e] * x0[e] + w0[e + 8] * x1[e]
                return s
            else:
                xv = mX[m, ch, None].load().to(Float32)
                return (wv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            mW = [gmem_tensor(ptrs[i], wdt, (c.n, K // E, E), 16) for i in range(nw)]
            if cutlass.const_expr(fp8):
                mS = [gmem_tensor(ptrs[nw + i], Float32, (c.n // SB, KB), 4) for i in range(nw)]
                xi = 2 * nw
            else:
                mS = [None] * nw
                xi = nw
            # x viewed in 8-element (16-byte) chunks
            mX = gmem_tensor(ptrs[xi], cutlass.BFloat16, (M, K // 8, 8), 16)
            mY = gmem_tensor(ptrs[xi + 1], odt, (M, c.n), 4)
            acc = cute.make_rmem_tensor((nw, MG), Float32)
            for g in cutlass.range(M // MG, unroll=1):
                for r in cutlass.range(warp, R, NW):
                    row = t * R + r
                    acc.fill(0.0)
                    for it in cutlass.range(n_main):
                        ch0 = it * (32 * U) + lane
                        # issue all U x nw 16-byte loads before any math: loads in flight
                        wl = [[mW[i][row, ch0 + 32 * u, None].load() for u in range(U)] for i in range(nw)]
                        for i in cutlass.range_constexpr(nw):
                            for u in cutlass.range_constexpr(U):
                                wf = wl[i][u].to(Float32)
                                sc = Float32(1.0)
                                if cutlass.const_expr(fp8):
                                    sc = mS[i][row // SB, ((ch0 + 32 * u) * E) // SB]
                                for m in cutlass.range_constexpr(MG):
                                    acc[i, m] = acc[i, m] + sc * dot_chunk(wf, mX, g * MG + m, ch0 + 32 * u)
                    for u in cutlass.range_constexpr(tail):
                        ch = n_main * (32 * U) + 32 * u + lane
                        for i in cutlass.range_constexpr(nw):
                            wf = mW[i][row, ch, None].load().to(Float32)
                            sc = Float32(1.0)
                            if cutlass.const_expr(fp8):
                                sc = mS[i][row // SB, (ch * E) // SB]
                            for m in cutlass.range_constexpr(MG):
                                acc[i, m] = acc[i, m] + sc * dot_chunk(wf, mX, g * MG + m, ch)
                    for m in cutlass.range_constexpr(MG):
                        a = cute.arch.warp_reduction_sum(acc[0, m])
                        if cutlass.const_expr(swiglu):
                            b = cute.arch.warp_reduction_sum(acc[1, m])
                            if cutlass.const_expr(limit is not None):
                                a = cute.arch.fmin(a, Float32(limit))
                                b = cute.arch.fmax(cute.arch.fmin(b, Float32(limit)), Float32(-limit))
                            a = a / (Float32(1.0) + cute.math.exp(-a, fastmath=True)) * b
                        if lane == 0:
                            mY[g * MG + m, row] = a.to(odt)

        return tile
