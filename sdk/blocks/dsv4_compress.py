"""DeepSeek-V4 KV compression of the new tokens: the compressor state advances token by token and,
on the tokens that close a window, the window's compressed entry is written into the compressed
cache (CSA and HCA layers, and the CSA indexer's own compressor).

The definition is `Compressor.update` / `Compressor.entry` of sdk/reference/dsv4_attention.py
(equal to transformers' DeepseekV4CSACompressor / DeepseekV4HCACompressor), with the two
projections kv = kv_proj(x), gate = gate_proj(x) computed before (GEMVs) and the rope of each
window taken from the host's tables. For a sequence b and its new token t at position
p = start[b] + t, with r = ratio, c = dim (HCA) or 2 * dim (CSA, `overlap`), L = r or 2r slots:

    state_kv[b, p % L]   = kv[b, t]                                   (bf16)
    state_gate[b, p % L] = float(gate[b, t]) + position_bias[p % r]   (fp32)
    if (p + 1) % r == 0, window w = (p + 1) // r - 1:
      HCA: keys = the r slots, channel j of each
      CSA: channel j < dim of window w-1's slots (empty for w = 0), then channel dim + j of window
           w's slots (window w's slots are (w % 2) r .. (w % 2) r + r - 1)
      p_s    = bf16(softmax_s(gate_s))        (fp32 softmax over the window's keys, per channel)
      pooled = bf16(sum_s bf16(kv_s * p_s))
      entry  = RoPE(bf16(kv_norm * rmsnorm(pooled)))   interleaved pairs on the last `rope`
               channels, cos / sin [B, T, rope / 2] bf16 = the rope at position w * r (host table
               of the window that token t closes; unread for tokens that close none)
      entries[b, w] = entry                    (w >= max_entries: not written)

Blocks: `DSV4CompressBlock`, tile = one sequence (its T tokens in order: a T-token call equals T
single-token calls). Threads own output channel pairs (2i, 2i + 1) - the RoPE pairs - and the
state channels they pool (CSA: i and dim + i too), so the state written by a token is read back
by the same thread: one CTA-wide sum (the RMSNorm) per entry is the only exchange.

Supported: dim even and <= 2 * NUM_THREADS (V4.1-Flash: 512 main, 128 indexer), rope even and
<= dim, ratio >= 1, bf16 projections / state / entries, fp32 gate state. Not yet: the fp8 / fp4
entry formats of V4.1 serving (the decode core reads bf16 entries).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec


@dataclass(frozen=True)
class DSV4CompressConfig:
    dim: int = 512                       # entry width (the indexer's compressor: its head_dim, 128)
    ratio: int = 128                     # tokens per entry: HCA 128, CSA 4
    overlap: bool = False                # CSA: 2 * dim features, entries pool two windows
    rope: int = 64                       # trailing rope channels of the entry
    batch: int = 1
    tokens: int = 1                      # new tokens per sequence
    max_entries: int = 1024              # entries per sequence (max_seq_len // ratio)
    eps: float = 1e-6


class DSV4CompressBlock(Block):
    name = "dsv4_compress"
    Config = DSV4CompressConfig

    @property
    def width(self) -> int:
        return 2 * self.config.dim if self.config.overlap else self.config.dim

    @property
    def slots(self) -> int:
        return 2 * self.config.ratio if self.config.overlap else self.config.ratio

    def check(self):
        c = self.config
        if c.dim % 2 or not 2 <= c.dim <= 2 * NUM_THREADS:
            self.unsupported(f"dsv4_compress: dim={c.dim} (even, at most {2 * NUM_THREADS}: one channel pair a thread)")
        if c.rope % 2 or not 0 <= c.rope <= c.dim:
            self.unsupported(f"dsv4_compress: rope={c.rope} (even, at most dim={c.dim})")
        if c.ratio < 1 or c.batch < 1 or c.tokens < 1 or c.max_entries < 1:
            self.unsupported(f"dsv4_compress: ratio={c.ratio}, batch={c.batch}, tokens={c.tokens}, "
                             f"max_entries={c.max_entries} (all >= 1)")

    def operand_specs(self):
        c = self.config
        B, T, C, R2 = c.batch, c.tokens, self.width, max(c.rope // 2, 1)
        return [OperandSpec("kv", (B, T, C), "bf16"),
                OperandSpec("gate", (B, T, C), "bf16"),
                OperandSpec("position_bias", (c.ratio, C), "fp32"),
                OperandSpec("kv_norm", (c.dim,), "bf16"),
                OperandSpec("cos", (B, T, R2), "bf16", optional=c.rope == 0),
                OperandSpec("sin", (B, T, R2), "bf16", optional=c.rope == 0),
                OperandSpec("start", (B,), "int32"),
                OperandSpec("state_kv", (B, self.slots, C), "bf16", output=True),
                OperandSpec("state_gate", (B, self.slots, C), "fp32", output=True),
                OperandSpec("entries", (B, c.max_entries, c.dim), "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.config.batch

    def cost(self) -> Cost:
        c = self.config
        C = self.width
        per_token = C * (2 + 2 + 2 + 4 + 4)          # kv, gate in; state kv, gate out; bias
        # an entry reads the window's state (and the bias) once per `ratio` tokens
        entry = self.slots * C * 6 // c.ratio + c.dim * 4
        return Cost(bytes=c.tokens * (per_token + entry), flops=c.tokens * C * 8)

    # -- torch faces ---------------------------------------------------------------------------
    def _sequence(self, t: dict, b: int, out: dict) -> None:
        """Sequence b's T tokens, in order, on the tensors of `out` (state and entries in place)."""
        c = self.config
        r, d, L = c.ratio, c.dim, self.slots
        bias = t["position_bias"].float()
        skv, sg, ent = out["state_kv"], out["state_gate"], out["entries"]
        for tq in range(c.tokens):
            p = int(t["start"][b]) + tq
            skv[b, p % L] = t["kv"][b, tq].to(skv.dtype)
            sg[b, p % L] = t["gate"][b, tq].float() + bias[p % r]
            if (p + 1) % r:
                continue
            w = (p + 1) // r - 1
            if c.overlap:
                cur = (w % 2) * r + torch.arange(r)
                prev = ((w + 1) % 2) * r + torch.arange(r)
                pkv, pg = skv[b, prev, :d].float(), sg[b, prev, :d].float()
                if w == 0:
                    pkv, pg = torch.zeros_like(pkv), torch.full_like(pg, float("-inf"))
                kv = torch.cat([pkv, skv[b, cur, d:].float()])
                gate = torch.cat([pg, sg[b, cur, d:].float()])
            else:
                kv, gate = skv[b, :r].float(), sg[b, :r].float()
            prob = gate.softmax(dim=0).to(torch.bfloat16).float()
            pooled = (kv * prob).to(torch.bfloat16).float().sum(dim=0).to(torch.bfloat16).float()
            h = pooled * torch.rsqrt(pooled.pow(2).mean() + c.eps)
            h = (t["kv_norm"].float() * h).to(torch.bfloat16).float()
            if c.rope:
                cos, sin = t["cos"][b, tq].float(), t["sin"][b, tq].float()
                x = h[d - c.rope:]
                even, odd = x[0::2], x[1::2]
                rot = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten()
                h = torch.cat([h[:d - c.rope], rot.to(torch.bfloat16).float()])
            if w < c.max_entries:
                ent[b, w] = h.to(ent.dtype)

    def reference(self, **t):
        out = {n: t[n].clone() for n in ("state_kv", "state_gate", "entries")}
        for b in range(self.config.batch):
            self._sequence(t, b, out)
        return out

    def emulate_tile(self, t, tile):
        self._sequence(t, tile, t)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import block_sum, gmem_tensor

        c = self.config
        B, T, D, R, RT, E = c.batch, c.tokens, c.dim, c.ratio, c.rope, c.max_entries
        C, L = self.width, self.slots
        HALVES = 2 if c.overlap else 1       # state channel pairs a thread owns: i, and dim + i (CSA)
        NP = D // 2                          # channel pairs = active threads
        R2 = max(RT // 2, 1)
        P0 = (D - RT) // 2                   # first rope pair
        eps = float(c.eps)
        names = self.operands()
        ix = {n: i for i, n in enumerate(names)}

        def bf(x):
            return x.to(BFloat16).to(Float32)

        @cute.jit
        def tile(ptrs, b: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mKV = gmem_tensor(ptrs[ix["kv"]], BFloat16, (B, T, C // 2, 2), 4)
            mG = gmem_tensor(ptrs[ix["gate"]], BFloat16, (B, T, C // 2, 2), 4)
            mBias = gmem_tensor(ptrs[ix["position_bias"]], Float32, (R, C // 2, 2), 8)
            mNW = gmem_tensor(ptrs[ix["kv_norm"]], BFloat16, (D // 2, 2), 4)
            mStart = gmem_tensor(ptrs[ix["start"]], Int32, (B,), 4)
            mSKV = gmem_tensor(ptrs[ix["state_kv"]], BFloat16, (B, L, C // 2, 2), 4)
            mSG = gmem_tensor(ptrs[ix["state_gate"]], Float32, (B, L, C // 2, 2), 8)
            mEnt = gmem_tensor(ptrs[ix["entries"]], BFloat16, (B, E, D // 2, 2), 4)
            mCos = None
            mSin = None
            if cutlass.const_expr(RT > 0):
                mCos = gmem_tensor(ptrs[ix["cos"]], BFloat16, (B, T, R2), 2)
                mSin = gmem_tensor(ptrs[ix["sin"]], BFloat16, (B, T, R2), 2)
            active = tid < NP
            i = tid
            if i >= NP:
                i = Int32(NP - 1)            # idle threads mirror the last pair; they write nothing
            start = mStart[b]
            for tq in cutlass.range(T, unroll=1):
                p = start + tq
                slot = p % L
                # this token into the state: the thread's own channel pairs (read back below)
                if active:
                    for hh in cutlass.range_constexpr(HALVES):
                        u = i + hh * NP
                        kv2 = mKV[b, tq, u, None].load()
                        g2 = mG[b, tq, u, None].load().to(Float32) + mBias[p % R, u, None].load()
                        mSKV[b, slot, u, None].store(kv2)
                        mSG[b, slot, u, None].store(g2)
                if (p + 1) % R == 0:                     # uniform over the CTA: b, tq
                    w = (p + 1) // R - 1
                    # softmax over the window's keys per channel (max, then sum), then the pool
                    pooled = cute.make_rmem_tensor((2,), Float32)
                    for e in cutlass.range_constexpr(2):
                        mx = Float32(-3.0e38)
                        for k in cutlass.range(L if c.overlap else R, unroll=1):
                            sl, u = key_slot(w, k, i)
                            valid = key_valid(w, k)
                            g = mSG[b, sl, u, e]
                            if valid:
                                mx = cute.arch.fmax(mx, g)
                        z = Float32(0.0)
                        for k in cutlass.range(L if c.overlap else R, unroll=1):
                            sl, u = key_slot(w, k, i)
                            if key_valid(w, k):
                                z = z + cute.math.exp(mSG[b, sl, u, e] - mx, fastmath=False)
                        acc = Float32(0.0)
                        for k in cutlass.range(L if c.overlap else R, unroll=1):
                            sl, u = key_slot(w, k, i)
                            if key_valid(w, k):
                                prob = bf(cute.math.exp(mSG[b, sl, u, e] - mx, fastmath=False) / z)
                                acc = acc + bf(mSKV[b, sl, u, e].to(Float32) * prob)
                        pooled[e] = bf(acc)
                    ss = Float32(0.0)
                    if active:
                        ss = pooled[0] * pooled[0] + pooled[1] * pooled[1]
                    rstd = cute.math.rsqrt(block_sum(ss, scratch) / Float32(D) + Float32(eps), fastmath=False)
                    nw = mNW[i, None].load().to(Float32)
                    h0 = bf(nw[0] * (pooled[0] * rstd))
                    h1 = bf(nw[1] * (pooled[1] * rstd))
                    if cutlass.const_expr(RT > 0):
                        if i >= P0:
                            cs = mCos[b, tq, i - P0].to(Float32)
                            sn = mSin[b, tq, i - P0].to(Float32)
                            r0 = bf(h0 * cs - h1 * sn)
                            h1 = bf(h1 * cs + h0 * sn)
                            h0 = r0
                    if active & (w < E):
                        out2 = cute.make_rmem_tensor((2,), Float32)
                        out2[0] = h0
                        out2[1] = h1
                        mEnt[b, w, i, None].store(out2.load().to(BFloat16))

        @cute.jit
        def key_slot(w: Int32, k: Int32, i: Int32):
            """(slot, channel pair) of key k of window w for output pair i: HCA the window's k-th
            slot; CSA k < r: window w-1's slot k, first-half channels; k >= r: window w's slot
            k - r, second-half channels."""
            sl = k
            u = i
            if cutlass.const_expr(c.overlap):
                if k < R:
                    sl = ((w + 1) % 2) * R + k
                else:
                    sl = (w % 2) * R + (k - R)
                    u = i + NP
            return sl, u

        @cute.jit
        def key_valid(w: Int32, k: Int32):
            """CSA: window w-1 does not exist for w = 0 (its keys: kv 0, gate -inf)."""
            ok = True
            if cutlass.const_expr(c.overlap):
                ok = (w > 0) | (k >= R)
            return ok

        return tile


def dsv4_compress_compile_cases():
    """V4.1-Flash: the HCA (ratio 128) and CSA (ratio 4, overlapping) main compressors at 512 and
    the CSA indexer's (128 channels), batch 1 / 64, T = 1 / 2."""
    return [DSV4CompressBlock(DSV4CompressConfig(dim=512, ratio=128, batch=64)),
            DSV4CompressBlock(DSV4CompressConfig(dim=512, ratio=4, overlap=True, batch=1, tokens=2)),
            DSV4CompressBlock(DSV4CompressConfig(dim=128, ratio=4, overlap=True, batch=8))]
