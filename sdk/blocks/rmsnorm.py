"""RMSNorm block with the fused residual add.

    residual_in=True:   r = src + delta            (src, delta fp32 [M, D]: residual stream, the
                                                    previous sublayer's output)
    residual_in=False:  r = src                    (src bf16 [M, D]: the step's input hidden, or
                                                    src_dtype="fp32": a residual stream that the
                                                    sublayers update in place)
    resid_out = r (fp32; write_resid=False: not written), out = r * rsqrt(mean(r^2) + eps) * weight

A tile is one token row. Each thread holds D / NUM_THREADS elements in registers (16-byte fp32
loads), one CTA-wide reduction for the sum of squares, fp32 math.
`resid_out` may alias `src` (in-place residual stream): each element is read and written by the
same thread.

Supported: D a multiple of 4 * NUM_THREADS (1024), M = 1..64. Not: other D (no tail handling),
weight-less norms, fp32 outputs of the normed row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec


@dataclass(frozen=True)
class RMSNormConfig:
    d: int
    m: int = 1
    eps: float = 1e-6
    residual_in: bool = True
    src_dtype: str = ""          # "" = fp32 with residual_in, else bf16; or "bf16" | "fp32"
    write_resid: bool = True


def _src_dtype(c) -> str:
    return c.src_dtype or ("fp32" if c.residual_in else "bf16")


class RMSNormBlock(Block):
    name = "rmsnorm"
    Config = RMSNormConfig

    def check(self):
        c = self.config
        if c.d % (4 * NUM_THREADS):
            self.unsupported(f"rmsnorm: d={c.d} must be a multiple of {4 * NUM_THREADS}")
        if not 1 <= c.m <= 64:
            self.unsupported(f"rmsnorm: m={c.m} tokens (supported: 1..64)")
        if _src_dtype(c) not in ("bf16", "fp32") or (c.residual_in and _src_dtype(c) != "fp32"):
            self.unsupported(f"rmsnorm: src dtype {_src_dtype(c)!r} (fp32 with residual_in, else bf16 or fp32)")

    def operand_specs(self):
        c = self.config
        shape = (c.m, c.d)
        return [OperandSpec("src", shape, _src_dtype(c)),
                OperandSpec("delta", shape, "fp32", optional=not c.residual_in),
                OperandSpec("weight", (c.d,), "bf16"),
                OperandSpec("resid_out", shape, "fp32", output=True, optional=not c.write_resid),
                OperandSpec("out", shape, "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.config.m

    def cost(self) -> Cost:
        c = self.config
        rd = 8 if c.residual_in else (4 if _src_dtype(c) == "fp32" else 2)
        return Cost(bytes=c.d * (rd + 2 + (4 if c.write_resid else 0) + 2), flops=6 * c.d)

    # -- torch faces ---------------------------------------------------------------------------
    def reference(self, **t):
        c = self.config
        r = t["src"].float() + (t["delta"].float() if c.residual_in else 0.0)
        out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + c.eps) * t["weight"].float()
        return {"resid_out": r, "out": out}

    def emulate_tile(self, t, tile):
        c = self.config
        r = t["src"][tile].float()
        if c.residual_in:
            r = r + t["delta"][tile].float()
        out = r * torch.rsqrt(r.pow(2).mean() + c.eps) * t["weight"].float()
        if c.write_resid:
            t["resid_out"][tile] = r.to(t["resid_out"].dtype)
        t["out"][tile] = out.to(t["out"].dtype)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import block_sum, gmem_tensor

        c = self.config
        D, M = c.d, c.m
        NV = D // (4 * NUM_THREADS)        # 4-element vectors per thread
        res_in = c.residual_in
        eps = c.eps
        src32 = _src_dtype(c) == "fp32"
        sdt = Float32 if src32 else BFloat16
        write_resid = c.write_resid

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mSrc = gmem_tensor(ptrs[0], sdt, (M, D // 4, 4), 16 if src32 else 8)
            mW = gmem_tensor(ptrs[2], BFloat16, (D // 4, 4), 8)
            mR = gmem_tensor(ptrs[3], Float32, (M, D // 4, 4), 16)
            mO = gmem_tensor(ptrs[4], BFloat16, (M, D // 4, 4), 8)
            vals = []
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(NV):
                v = mSrc[t, j * NUM_THREADS + tid, None].load().to(Float32)
                if cutlass.const_expr(res_in):
                    mD = gmem_tensor(ptrs[1], Float32, (M, D // 4, 4), 16)
                    v = v + mD[t, j * NUM_THREADS + tid, None].load()
                vals.append(v)
                ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            total = block_sum(ss, scratch)
            rstd = cute.math.rsqrt(total / Float32(D) + Float32(eps), fastmath=False)
            for j in cutlass.range_constexpr(NV):
                ch = j * NUM_THREADS + tid
                if cutlass.const_expr(write_resid):
                    mR[t, ch, None].store(vals[j])
                w = mW[ch, None].load().to(Float32)
                mO[t, ch, None].store((vals[j] * rstd * w).to(BFloat16))

        return tile
