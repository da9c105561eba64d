"""DeepSeek-V4 attention prologue after the projections: the per-head RMSNorm (no weight) and RoPE
of the queries, the RMSNorm (kv_norm) and RoPE of the shared KV head - the decode core's `q` and
`new_kv` operands.

The definition is sdk/reference/dsv4_attention.py's forward (equal to transformers):
    q      = RoPE(rms_norm_v4(q_b(q_res).view(H, hd), None))         per head
             (q_norm=False, V4.1: RoPE(q_b(q_res)) - no per-head norm)
    new_kv = RoPE(rms_norm_v4(kv_proj(x), kv_norm))
with rms_norm_v4 = bf16(w * fp32(x) * rsqrt(mean(x^2) + eps)) and RoPE on the trailing `rope`
channels in interleaved pairs (2i, 2i + 1), fp32 from the bf16 normed values, one rounding; cos /
sin [M, rope / 2] bf16 = the main rope at each token's position (the host's tables). q_raw
[M, H, hd] and kv_raw [M, hd] are the q_b / kv_proj GEMVs' bf16 outputs (M = B * T tokens).

`DSV4PrologueBlock`: tile = one token; its H + 1 rows (the heads, then the KV head) go one per
warp, a lane holding hd / 32 consecutive channels (whole RoPE pairs): each row's norm is one warp
reduction, no CTA barrier. The sliding-window ring takes new_kv after the attention (the decode
core reads the old ring and new_kv separately).

Supported: hd a multiple of 64 (each lane two or more 8-channel units), rope even and <= hd.
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import NUM_THREADS, Block, Cost, OperandSpec

NUM_WARPS = NUM_THREADS // 32


@dataclass(frozen=True)
class DSV4PrologueConfig:
    heads: int = 8                       # query heads of this GPU (V4.1-Flash TP8: 8)
    head_dim: int = 512
    rope: int = 64
    batch: int = 1
    tokens: int = 1
    eps: float = 1e-6
    q_norm: bool = True                  # the per-head q RMSNorm (V4); False: V4.1, RoPE only


class DSV4PrologueBlock(Block):
    name = "dsv4_prologue"
    Config = DSV4PrologueConfig

    @property
    def m(self) -> int:
        return self.config.batch * self.config.tokens

    def check(self):
        c = self.config
        if c.head_dim % 64 or c.head_dim <= 0:
            self.unsupported(f"dsv4_prologue: head_dim={c.head_dim} (a multiple of 64: 32 lanes x whole 8-channel units)")
        if c.rope % 2 or not 0 <= c.rope <= c.head_dim:
            self.unsupported(f"dsv4_prologue: rope={c.rope} (even, at most head_dim)")
        if c.heads < 1 or self.m < 1:
            self.unsupported(f"dsv4_prologue: heads={c.heads}, {self.m} tokens")

    def operand_specs(self):
        c = self.config
        M, H, HD, R2 = self.m, c.heads, c.head_dim, max(c.rope // 2, 1)
        return [OperandSpec("q_raw", (M, H, HD), "bf16"),
                OperandSpec("kv_raw", (M, HD), "bf16"),
                OperandSpec("kv_norm", (HD,), "bf16"),
                OperandSpec("cos", (M, R2), "bf16", optional=c.rope == 0),
                OperandSpec("sin", (M, R2), "bf16", optional=c.rope == 0),
                OperandSpec("q", (c.batch, c.tokens, H, HD), "bf16", output=True),
                OperandSpec("new_kv", (c.batch, c.tokens, HD), "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.m

    def cost(self) -> Cost:
        c = self.config
        rows = c.heads + 1
        return Cost(bytes=rows * c.head_dim * 4 + c.head_dim * 2 + c.rope * 2, flops=rows * c.head_dim * 8)

    # -- torch faces ---------------------------------------------------------------------------
    def _token(self, t: dict, m: int):
        """(q [H, hd], new_kv [hd]) of token m, bf16: the reference's own functions."""
        from ..reference.dsv4_attention import Rope, rms_norm_v4
        c = self.config
        q = rms_norm_v4(t["q_raw"][m], None, c.eps) if c.q_norm else t["q_raw"][m]
        kv = rms_norm_v4(t["kv_raw"][m], t["kv_norm"], c.eps)
        if c.rope:
            cos, sin = t["cos"][m], t["sin"][m]
            q, kv = Rope.apply(q, cos[None], sin[None]), Rope.apply(kv, cos, sin)
        return q, kv

    def reference(self, **t):
        c = self.config
        out = {"q": t["q"].clone(), "new_kv": t["new_kv"].clone()}
        for m in range(self.m):
            b, tq = divmod(m, c.tokens)
            out["q"][b, tq], out["new_kv"][b, tq] = self._token(t, m)
        return out

    def emulate_tile(self, t, tile):
        b, tq = divmod(tile, self.config.tokens)
        t["q"][b, tq], t["new_kv"][b, tq] = self._token(t, tile)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import gmem_tensor

        c = self.config
        M, H, HD, RT, T = self.m, c.heads, c.head_dim, c.rope, c.tokens
        UPL = HD // 8 // 32                  # 8-channel units per lane
        CPL = UPL * 8                        # channels per lane
        R2 = max(RT // 2, 1)
        P0 = (HD - RT) // 2                  # first rope pair
        eps = float(c.eps)
        ix = {n: i for i, n in enumerate(self.operands())}

        @cute.jit
        def tile(ptrs, m: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            b = m // T
            tq = m % T
            mQr = gmem_tensor(ptrs[ix["q_raw"]], BFloat16, (M, H, HD // 8, 8), 16)
            mKr = gmem_tensor(ptrs[ix["kv_raw"]], BFloat16, (M, HD // 8, 8), 16)
            mNW = gmem_tensor(ptrs[ix["kv_norm"]], BFloat16, (HD // 8, 8), 16)
            mQ = gmem_tensor(ptrs[ix["q"]], BFloat16, (c.batch, T, H, HD // 8, 8), 16)
            mKV = gmem_tensor(ptrs[ix["new_kv"]], BFloat16, (c.batch, T, HD // 8, 8), 16)
            mCos = None
            mSin = None
            if cutlass.const_expr(RT > 0):
                mCos = gmem_tensor(ptrs[ix["cos"]], BFloat16, (M, R2), 2)
                mSin = gmem_tensor(ptrs[ix["sin"]], BFloat16, (M, R2), 2)
            x = cute.make_rmem_tensor((UPL, 8), Float32)
            for row in cutlass.range(warp, H + 1, NUM_WARPS, unroll=1):     # heads, then (row H) the KV head
                is_kv = row == H
                h = row
                if is_kv:
                    h = Int32(0)
                for j in cutlass.range_constexpr(UPL):
                    u = lane * UPL + j
                    if is_kv:
                        x[j, None].store(mKr[m, u, None].load().to(Float32))
                    else:
                        x[j, None].store(mQr[m, h, u, None].load().to(Float32))
                ss = Float32(0.0)
                for j in cutlass.range_constexpr(UPL):
                    for e in cutlass.range_constexpr(8):
                        ss = ss + x[j, e] * x[j, e]
                ss = cute.arch.warp_reduction_sum(ss)
                rstd = cute.math.rsqrt(ss / Float32(HD) + Float32(eps), fastmath=False)
                if cutlass.const_expr(not c.q_norm):
                    if not is_kv:
                        rstd = Float32(1.0)     # V4.1: q unnormed (x * 1, rounded to bf16: itself)
                for j in cutlass.range_constexpr(UPL):
                    u = lane * UPL + j
                    wv = cute.make_rmem_tensor((8,), Float32)
                    wv.fill(1.0)
                    if is_kv:
                        wv.store(mNW[u, None].load().to(Float32))
                    for e in cutlass.range_constexpr(8):
                        x[j, e] = (wv[e] * (x[j, e] * rstd)).to(BFloat16).to(Float32)
                if cutlass.const_expr(RT > 0):
                    for j in cutlass.range_constexpr(UPL):
                        for e in cutlass.range_constexpr(4):
                            pr = (lane * CPL + j * 8 + 2 * e) // 2           # this lane's pair index
                            if pr >= P0:
                                cs = mCos[m, pr - P0].to(Float32)
                                sn = mSin[m, pr - P0].to(Float32)
                                a = x[j, 2 * e]
                                bb = x[j, 2 * e + 1]
                                x[j, 2 * e] = (a * cs - bb * sn).to(BFloat16).to(Float32)
                                x[j, 2 * e + 1] = (bb * cs + a * sn).to(BFloat16).to(Float32)
                for j in cutlass.range_constexpr(UPL):
                    u = lane * UPL + j
                    if is_kv:
                        mKV[b, tq, u, None].store(x[j, None].load().to(BFloat16))
                    else:
                        mQ[b, tq, h, u, None].store(x[j, None].load().to(BFloat16))

        return tile


def dsv4_prologue_compile_cases():
    """V4.1-Flash TP8 (8 heads x 512, rope 64) at batch 1 and 64, T = 2; 16 heads (TP4)."""
    return [DSV4PrologueBlock(DSV4PrologueConfig(heads=8, batch=1, tokens=2)),
            DSV4PrologueBlock(DSV4PrologueConfig(heads=8, batch=64)),
            DSV4PrologueBlock(DSV4PrologueConfig(heads=8, batch=8, q_norm=False)),
            DSV4PrologueBlock(DSV4PrologueConfig(heads=16, batch=8))]


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSV4IndexQConfig:
    heads: int = 64                      # indexer heads (V4.1-Flash: 64; not sharded by TP)
    head_dim: int = 128
    rope: int = 64
    batch: int = 1
    tokens: int = 1


class DSV4IndexQBlock(Block):
    """The CSA indexer's queries: RoPE (interleaved pairs on the trailing `rope` channels, the
    compress rope at each token's position: cos / sin [M, rope / 2]) of q_raw = the indexer's
    q_b GEMV output [M, IH, ihd], no norm - sdk/reference/dsv4_attention.py `select`. Tile = one
    token; a thread rotates channel pairs (head, pair) in steps of NUM_THREADS, all loads first."""
    name = "dsv4_index_q"
    Config = DSV4IndexQConfig

    @property
    def m(self) -> int:
        return self.config.batch * self.config.tokens

    def check(self):
        c = self.config
        if c.head_dim % 2 or c.rope % 2 or not 0 <= c.rope <= c.head_dim or c.heads < 1 or self.m < 1:
            self.unsupported(f"dsv4_index_q: heads={c.heads}, head_dim={c.head_dim}, rope={c.rope} (even, <= head_dim)")

    def operand_specs(self):
        c = self.config
        M, R2 = self.m, max(c.rope // 2, 1)
        return [OperandSpec("q_raw", (M, c.heads, c.head_dim), "bf16"),
                OperandSpec("cos", (M, R2), "bf16", optional=c.rope == 0),
                OperandSpec("sin", (M, R2), "bf16", optional=c.rope == 0),
                OperandSpec("q", (c.batch, c.tokens, c.heads, c.head_dim), "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.m

    def cost(self) -> Cost:
        c = self.config
        return Cost(bytes=c.heads * c.head_dim * 4 + c.rope * 2, flops=c.heads * c.rope * 4)

    def _token(self, t: dict, m: int):
        from ..reference.dsv4_attention import Rope
        q = t["q_raw"][m]
        if self.config.rope:
            q = Rope.apply(q, t["cos"][m][None], t["sin"][m][None])
        return q

    def reference(self, **t):
        c = self.config
        out = t["q"].clone()
        for m in range(self.m):
            b, tq = divmod(m, c.tokens)
            out[b, tq] = self._token(t, m)
        return {"q": out}

    def emulate_tile(self, t, tile):
        b, tq = divmod(tile, self.config.tokens)
        t["q"][b, tq] = self._token(t, tile)

    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import gmem_tensor

        c = self.config
        M, H, HD, RT, T = self.m, c.heads, c.head_dim, c.rope, c.tokens
        NP = H * HD // 2                     # channel pairs of a token
        STEPS = -(-NP // NUM_THREADS)
        R2 = max(RT // 2, 1)
        P0 = (HD - RT) // 2                  # first rope pair of a head
        ix = {n: i for i, n in enumerate(self.operands())}

        @cute.jit
        def tile(ptrs, m: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            b = m // T
            tq = m % T
            mQr = gmem_tensor(ptrs[ix["q_raw"]], BFloat16, (M, NP, 2), 4)
            mQ = gmem_tensor(ptrs[ix["q"]], BFloat16, (c.batch, T, NP, 2), 4)
            x = cute.make_rmem_tensor((STEPS, 2), Float32)
            for k in cutlass.range_constexpr(STEPS):
                u = tid + k * NUM_THREADS
                if u < NP:
                    x[k, None].store(mQr[m, u, None].load().to(Float32))
            if cutlass.const_expr(RT > 0):
                mCos = gmem_tensor(ptrs[ix["cos"]], BFloat16, (M, R2), 2)
                mSin = gmem_tensor(ptrs[ix["sin"]], BFloat16, (M, R2), 2)
                for k in cutlass.range_constexpr(STEPS):
                    u = tid + k * NUM_THREADS
                    pr = u % (HD // 2)
                    if (u < NP) & (pr >= P0):
                        cs = mCos[m, pr - P0].to(Float32)
                        sn = mSin[m, pr - P0].to(Float32)
                        a = x[k, 0]
                        bb = x[k, 1]
                        x[k, 0] = a * cs - bb * sn
                        x[k, 1] = bb * cs + a * sn
            for k in cutlass.range_constexpr(STEPS):
                u = tid + k * NUM_THREADS
                if u < NP:
                    mQ[b, tq, u, None].store(x[k, None].load().to(BFloat16))

        return tile


def dsv4_index_q_compile_cases():
    """V4.1-Flash's indexer: 64 heads x 128, rope 64, batch 1 / 64, T = 2."""
    return [DSV4IndexQBlock(DSV4IndexQConfig(batch=1, tokens=2)), DSV4IndexQBlock(DSV4IndexQConfig(batch=64))]
