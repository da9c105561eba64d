"""The MLA decode prologue after the projections: RoPE of the query's rope part, and the new
tokens' cache rows (normalised latent + rotated shared key) written into the paged cache.

`MLARopeAppendBlock`, one tile per new token m (sequence b = m // T, token t = m % T, position
p = seq_lens[b] - T + t):
    q[b, t, h, L:]            = rope(q_raw[m, h, nope:], p)            for every head h
    cache row of (b, p)       = [ kv_norm * bf16(rmsnorm(ckv[m, :L])),  rope(ckv[m, L:], p) ]
with q_raw the q_b GEMV's output [M, H, nope + rope], ckv the kv_a GEMV's [M, L + rope] (fp32),
cos / sin [M, rope] the host's tables for the tokens' positions (bf16, halves layout, as
sdk/reference/common.rope_cos_sin makes them: YaRN's frequencies and attention factor included). RoPE modes: "interleaved" (pairs (2i, 2i+1),
DeepSeek / Kimi: regrouped into halves first, as the reference does), "halves", or "none" (the
rope part passes unrotated: kimi_linear NoPE); rope = 0 (GLM-5.3) writes the latent only.
The W_UK block fills q[..., :L]; the decode core waits on both. Arithmetic follows
sdk/reference/mla.py in bf16: the normalised latent is rounded to bf16 before the weight, the
rotation is done in fp32 from bf16 inputs and rounded once.

fp8 cache (kv_dtype "fp8_e4m3", the decode core's format): the bf16 row above is quantised per
group of 64 columns - scale = amax / 448 (at least 1e-12), e4m3 = round(value / scale), the
`quantize_kv_fp8` rule - into the row and its 9 (Kimi K3) fp32 scales [num_pages, page, d_qk / 64].
On the device one warp owns one group (256 threads x 2 latent values = 8 warps x 64 columns; the
rope group is warp 0's), so a group's amax is one warp reduction.

Supported: kv_lora a multiple of 256, rope even, page_size >= 1, any T; fp8: scale_group 64 and
rope 0 or 64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec

ROPE_MODES = ("interleaved", "halves", "none")


@dataclass(frozen=True)
class MLARopeAppendConfig:
    heads: int
    batch: int = 1
    q_tokens: int = 1
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    rope_mode: str = "interleaved"
    eps: float = 1e-6
    kv_dtype: str = "bf16"              # "bf16" | "fp8_e4m3" (with per-token scales per scale_group)
    scale_group: int = 64
    page_size: int = 64
    num_pages: int = 1024
    max_seq_len: int = 4096


class MLARopeAppendBlock(Block):
    name = "mla_rope_append"
    Config = MLARopeAppendConfig
    wide_operands = ("kv", "kv_scale")  # rows addressed from a 64-bit base, as the decode core's

    @property
    def m(self) -> int:
        return self.config.batch * self.config.q_tokens

    @property
    def d_qk(self) -> int:
        return self.config.kv_lora + self.config.rope

    @property
    def max_pages(self) -> int:
        return math.ceil(self.config.max_seq_len / self.config.page_size)

    @property
    def fp8(self) -> bool:
        return self.config.kv_dtype == "fp8_e4m3"

    @property
    def rotates(self) -> bool:
        return self.config.rope > 0 and self.config.rope_mode != "none"

    def check(self):
        c = self.config
        if c.rope_mode not in ROPE_MODES:
            self.unsupported(f"mla_rope_append: rope_mode {c.rope_mode!r} (supported: {ROPE_MODES})")
        if c.kv_lora % NUM_THREADS or c.rope % 2 or c.rope < 0 or c.rope // 2 > NUM_THREADS:
            self.unsupported(f"mla_rope_append: kv_lora={c.kv_lora} (a multiple of {NUM_THREADS}), rope={c.rope} (even)")
        if c.kv_dtype not in ("bf16", "fp8_e4m3"):
            self.unsupported(f"mla_rope_append: kv dtype {c.kv_dtype!r} (supported: bf16, fp8_e4m3)")
        if self.fp8 and (c.scale_group != 64 or c.rope not in (0, 64) or c.kv_lora != 2 * NUM_THREADS):
            self.unsupported(f"mla_rope_append fp8: scale_group={c.scale_group}, rope={c.rope}, kv_lora={c.kv_lora} "
                             f"(supported: 64-column groups, one warp each: kv_lora 512, rope 0 or 64)")
        if not 1 <= self.m <= 64 or c.heads < 1:
            self.unsupported(f"mla_rope_append: {self.m} tokens, {c.heads} heads (supported: 1..64 tokens)")

    def operand_specs(self):
        c = self.config
        M, R = self.m, max(c.rope, 1)
        return [OperandSpec("q_raw", (M, c.heads, c.nope + c.rope), "bf16"),
                OperandSpec("ckv", (M, self.d_qk), "fp32"),
                OperandSpec("kv_norm", (c.kv_lora,), "bf16"),
                OperandSpec("cos", (M, R), "bf16", optional=not self.rotates),
                OperandSpec("sin", (M, R), "bf16", optional=not self.rotates),
                OperandSpec("block_table", (c.batch, self.max_pages), "int32"),
                OperandSpec("seq_lens", (c.batch,), "int32"),
                OperandSpec("q", (c.batch, c.q_tokens, c.heads, self.d_qk), "bf16", output=True),
                OperandSpec("kv", (c.num_pages, c.page_size, self.d_qk), c.kv_dtype, output=True),
                OperandSpec("kv_scale", (c.num_pages, c.page_size, self.d_qk // c.scale_group), "fp32",
                            output=True, optional=not self.fp8)]

    def num_tiles(self) -> int:
        return self.m

    def cost(self) -> Cost:
        c = self.config
        b = c.heads * c.rope * 4 + self.d_qk * 6 + c.kv_lora * 2 + c.rope * 4
        return Cost(bytes=b, flops=6 * self.d_qk + 6 * c.heads * c.rope)

    # -- torch faces ---------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., R] (bf16 values) rotated by sdk/reference/common.apply_rope in fp32 (one
        rounding, as the device); unrotated for mode "none"."""
        if not self.rotates:
            return x.float()
        from ..reference.common import apply_rope
        return apply_rope(x.float(), cos.float(), sin.float(), self.config.rope_mode == "interleaved")

    def _token(self, t: dict, m: int):
        """(q rope part [H, R], cache row [d_qk], page row index) of new token m."""
        c = self.config
        b, tq = divmod(m, c.q_tokens)
        pos = int(t["seq_lens"][b]) - c.q_tokens + tq
        row = int(t["block_table"][b, pos // c.page_size]) * c.page_size + pos % c.page_size
        ckv = t["ckv"][m].float()
        lat = ckv[:c.kv_lora]
        h = (lat * torch.rsqrt(lat.pow(2).mean() + c.eps)).to(torch.bfloat16).float()
        lat_out = (h * t["kv_norm"].float()).to(torch.bfloat16)
        cos = t["cos"][m] if self.rotates else None
        sin = t["sin"][m] if self.rotates else None
        kpe = self._rope(ckv[c.kv_lora:].to(torch.bfloat16), cos, sin).to(torch.bfloat16)
        qpe = self._rope(t["q_raw"][m, :, c.nope:], cos, sin).to(torch.bfloat16)
        return qpe, torch.cat([lat_out, kpe]), row

    def _store(self, t: dict, row: int, cache_row: torch.Tensor) -> None:
        """Write one cache row (bf16 values) into t["kv"] (and its scales, fp8)."""
        kv = t["kv"].view(-1, self.d_qk)
        if self.fp8:
            from .mla_decode import quantize_kv_fp8
            q8, sc = quantize_kv_fp8(cache_row.float(), self.config.scale_group)
            kv[row] = q8.to(kv.device)
            t["kv_scale"].view(-1, self.d_qk // self.config.scale_group)[row] = sc.to(t["kv_scale"].device)
        else:
            kv[row] = cache_row.to(kv.device)

    def reference(self, **t):
        c = self.config
        out = {"q": t["q"].clone(), "kv": t["kv"].clone()}
        if self.fp8:
            out["kv_scale"] = t["kv_scale"].clone()
        for m in range(self.m):
            qpe, cache_row, row = self._token(t, m)
            b, tq = divmod(m, c.q_tokens)
            out["q"][b, tq, :, c.kv_lora:] = qpe.to(out["q"].device)
            self._store({**t, **out}, row, cache_row)
        return out

    def emulate_tile(self, t, tile):
        c = self.config
        qpe, cache_row, row = self._token(t, tile)
        b, tq = divmod(tile, c.q_tokens)
        t["q"][b, tq, :, c.kv_lora:] = qpe.to(t["q"].device)
        self._store(t, row, cache_row)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64

        from ._cute import block_sum, gmem_tensor

        c = self.config
        M, H, T, L, R, NOPE = self.m, c.heads, c.q_tokens, c.kv_lora, c.rope, c.nope
        DQK = self.d_qk
        PS, MAXP = c.page_size, self.max_pages
        LPT = L // NUM_THREADS               # latent values per thread
        R2 = R // 2
        ROT = self.rotates
        INTER = c.rope_mode == "interleaved"
        eps = c.eps
        FP8 = self.fp8
        G = c.scale_group
        NGRP = DQK // G                      # fp8: scales per row

        @cute.jit
        def pair(a: Float32, b: Float32, mCos, mSin, m, i):
            """(out[i], out[i + R/2]) of rope pair i with inputs a = x[i], b = x[i + R/2] of the
            halves layout; "none": unrotated."""
            lo = a
            hi = b
            if cutlass.const_expr(ROT):
                lo = a * mCos[m, i].to(Float32) - b * mSin[m, i].to(Float32)
                hi = b * mCos[m, i + R2].to(Float32) + a * mSin[m, i + R2].to(Float32)
            return lo, hi

        @cute.jit
        def rotate(mX, xi, mCos, mSin, m, i, via_bf16: cutlass.Constexpr):
            """Rope pair i of the vector mX[xi:xi + R] (bf16, or fp32 first rounded to bf16:
            via_bf16, the reference's bf16 ckv)."""
            ia = xi + i
            ib = xi + i + R2
            if cutlass.const_expr(INTER):                # pairs (2i, 2i + 1) regrouped into halves
                ia = xi + 2 * i
                ib = xi + 2 * i + 1
            a = mX[ia]
            b = mX[ib]
            if cutlass.const_expr(via_bf16):
                return pair(a.to(BFloat16).to(Float32), b.to(BFloat16).to(Float32), mCos, mSin, m, i)
            return pair(a.to(Float32), b.to(Float32), mCos, mSin, m, i)

        @cute.jit
        def store_fp8(v, ptrs, row, col0, stride: cutlass.Constexpr, group):
            """The calling warp's 2 values per lane (columns col0 and col0 + stride) are one scale
            group of the row: scale = warp amax / 448 (>= 1e-12), e4m3 = value / scale (the
            quantize_kv_fp8 rule); lane 0 writes the group's scale."""
            amax = cute.arch.fmax(cute.math.absf(v[0]), cute.math.absf(v[1]))
            amax = cute.arch.warp_reduction_max(amax)
            scale = cute.arch.fmax(amax / Float32(448.0), Float32(1e-12))
            q = cute.make_rmem_tensor((2,), Float32)
            for i in cutlass.range_constexpr(2):
                q[i] = cute.arch.fmax(cute.arch.fmin(v[i] / scale, Float32(448.0)), Float32(-448.0))
            q8 = cute.make_rmem_tensor((2,), Float8E4M3FN)
            q8.store(q.load().to(Float8E4M3FN))
            mRow8 = gmem_tensor(ptrs[8] + Int64(row) * Int64(DQK), Float8E4M3FN, (DQK,), 1)
            mRow8[col0] = q8[0]
            mRow8[col0 + stride] = q8[1]
            if cute.arch.lane_idx() == 0:
                mSc = gmem_tensor(ptrs[9] + Int64(row) * Int64(NGRP * 4), Float32, (NGRP,), 4)
                mSc[group] = scale

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            b = t // T
            tq = t % T
            mQr = gmem_tensor(ptrs[0], BFloat16, (M * H * (NOPE + R),), 2)
            mC = gmem_tensor(ptrs[1], Float32, (M, DQK), 4)
            mN = gmem_tensor(ptrs[2], BFloat16, (L,), 2)
            mCos = None
            mSin = None
            if cutlass.const_expr(ROT):
                mCos = gmem_tensor(ptrs[3], BFloat16, (M, R), 2)
                mSin = gmem_tensor(ptrs[4], BFloat16, (M, R), 2)
            mBT = gmem_tensor(ptrs[5], Int32, (c.batch, MAXP), 4)
            mLen = gmem_tensor(ptrs[6], Int32, (c.batch,), 4)
            mQ = gmem_tensor(ptrs[7], BFloat16, (c.batch, T, H, DQK), 2)
            pos = mLen[b] - T + tq
            row = mBT[b, pos // PS] * PS + pos % PS
            # normalised latent: one CTA-wide sum of squares
            vals = []
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(LPT):
                v = mC[t, tid * LPT + i]
                vals.append(v)
                ss = ss + v * v
            rstd = cute.math.rsqrt(block_sum(ss, scratch) / Float32(L) + Float32(eps), fastmath=False)
            lat = cute.make_rmem_tensor((LPT,), Float32)       # the row's bf16 values, as fp32
            for i in cutlass.range_constexpr(LPT):
                col = tid * LPT + i
                hn = (vals[i] * rstd).to(BFloat16).to(Float32)
                lat[i] = (hn * mN[col].to(Float32)).to(BFloat16).to(Float32)
            if cutlass.const_expr(FP8):
                # warp w owns latent columns [64 w, 64 w + 64): one scale group
                store_fp8(lat, ptrs, row, tid * LPT, 1, tid // 32)
            else:
                mRow = gmem_tensor(ptrs[8] + Int64(row) * Int64(DQK * 2), BFloat16, (DQK,), 2)
                for i in cutlass.range_constexpr(LPT):
                    mRow[tid * LPT + i] = lat[i].to(BFloat16)
            if cutlass.const_expr(R > 0):
                # the shared key part: ckv's rope columns, rounded to bf16 like the reference's
                if tid < R2:
                    kin = gmem_tensor(ptrs[1], Float32, (M * DQK,), 4)
                    lo, hi = rotate(kin, t * DQK + L, mCos, mSin, t, tid, True)
                    kp = cute.make_rmem_tensor((2,), Float32)
                    kp[0] = lo.to(BFloat16).to(Float32)
                    kp[1] = hi.to(BFloat16).to(Float32)
                    if cutlass.const_expr(FP8):
                        store_fp8(kp, ptrs, row, L + tid, R2, L // G)     # warp 0: the rope group
                    else:
                        mRow = gmem_tensor(ptrs[8] + Int64(row) * Int64(DQK * 2), BFloat16, (DQK,), 2)
                        mRow[L + tid] = kp[0].to(BFloat16)
                        mRow[L + tid + R2] = kp[1].to(BFloat16)
                # the query's rope part, every head
                for j in cutlass.range(tid, H * R2, NUM_THREADS, unroll=1):
                    hd = j // R2
                    i = j % R2
                    lo, hi = rotate(mQr, (t * H + hd) * (NOPE + R) + NOPE, mCos, mSin, t, i, False)
                    mQ[b, tq, hd, L + i] = lo.to(BFloat16)
                    mQ[b, tq, hd, L + i + R2] = hi.to(BFloat16)

        return tile
