"""CuTe DSL device tiles of the indexer blocks (`indexer.py` documents the math and the formats).
Imports cutlass: imported only when a block's device tile is built.

IndexScore: MLADecodeBlock's QK^T machinery (`_mla_cute.py`: one-warp tiled MMA m16n8k16 bf16,
ldmatrix from 16-byte-padded shared rows, cp.async pipeline of key chunks) with one k-slice: warp
w computes all T*H query rows x entries [8w, 8w + 8) of a 64-entry chunk over the whole head_dim,
applies ReLU(. * scale) * w[row] in registers (coordinates from an identity tensor partitioned
like the accumulator) and parks the products in shared memory; after one barrier the head sums
are taken by 1-4 adjacent lanes per (token, entry) (butterfly shuffles) and stored coalesced.
V4.1's MXFP4 indexer (key_dtype "mxfp4"): a chunk is a page of 64 keys, staged raw and dequantised
into one bf16 chunk; q goes through MXFP4 in place when it lands (chunk 0); the products are the
BF16 stages bf16(ReLU(bf16(dot)) * bf16(w * scale)) and one lane per (token, entry) sums the heads
in order, rounded to bf16.

TopK: 256 threads per (sequence, token). Radix select on the uint32 image of the scores
(u ^ 0xFFFFFFFF for negative floats, u | 0x80000000 otherwise: unsigned order = float order):
4 passes of 8-bit histograms (shared-memory atomics) restricted to the entries that match the
prefix found so far; warp 0 finds the bin that holds the k-th largest (lane l owns bins 8l..8l+7,
a shuffle suffix sum over lanes). Then the threshold key is exact and `krem` of its ties are
taken, lowest index first. Compaction: thread i owns a contiguous range of entries, counts
(> threshold, == threshold), one block-wide exclusive scan (warp shuffles + 8 warp totals) gives
its output offset; selected entries are written ascending, expanded to `expand` tokens each.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as cwarp

from ._cute import (TileSmem, bits_to_f32, div_rn, e2m1_code, e2m1_pair, f16x2_to_f32,
                    f32x2_to_bf16x2, gmem_tensor, smem_tensor, stage_rows_async, ue8m0_exponent)
from .base import NUM_THREADS
from .formats import MXFP4_AMAX_FLOOR, MXFP4_GROUP
from .indexer import CHUNK, INDEX_KEY_PAGE, RADIX_BITS, RADIX_PASSES, index_key_page_words

NUM_WARPS = NUM_THREADS // 32


def build_index_score_tile(block):
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    c = block.config
    B, T, H, D = c.batch, c.q_tokens, c.heads, c.head_dim
    R, MP = block.rows, block.m_pad
    E, RATIO, KPT, ST = c.max_entries, c.ratio, c.keys_per_tile, c.stages
    NT = block.tiles_per_seq
    CH = CHUNK
    RS = D + 8                           # bf16 smem row stride (elements): +16 B, conflict-free ldmatrix
    SS = CH + 8                          # fp32 row stride of the products
    PIECES = D // 8
    NPIECE = CH * PIECES
    PPT = -(-NPIECE // NUM_THREADS)
    NO = T * CH                          # (token, entry) outputs per chunk
    P = max(1, NUM_THREADS // NO)        # lanes per output (a power of two: NO is a multiple of 64)
    scale = block.scale
    NEG_INF = -math.inf

    def bf16(x):
        """x rounded to bf16, as fp32 (V4.1's stage boundaries)."""
        return x.to(BFloat16).to(Float32)
    MX = block.mxfp4                     # V4.1's MXFP4 indexer (key_dtype): paged keys, q through
                                         # MXFP4, BF16 score stages
    assert not MX or CH == INDEX_KEY_PAGE  # a chunk is one page of keys
    NRP = index_key_page_words(D) // 4 if MX else 0    # mxfp4: 16-byte pieces of a page (272 at d = 128)
    RPT = -(-NRP // NUM_THREADS)
    CPK = D // 32                        # mxfp4: 16-byte pieces of a key's codes (a page's first part)
    SBK = D // MXFP4_GROUP               # mxfp4: scale bytes of a key (the page's second part)
    GPR = D // MXFP4_GROUP               # mxfp4: scale groups of a key
    NDQ = CH * GPR                       # mxfp4: dequant units of a chunk (32 values each)
    NQQ = R * GPR                        # mxfp4: quantise units of q (a row's 32-value group each)

    @cute.jit
    def load_chunk(mK, b, n, e0, st, sStage, tid, g2s):
        """cp.async entries e0 .. e0+CH-1 into stage st; entries >= n re-read entry n-1 (finite
        data, never stored)."""
        for k in cutlass.range_constexpr(PPT):
            i = tid + k * NUM_THREADS
            if i < NPIECE:
                j = i // PIECES
                p = i % PIECES
                e = e0 + j
                if e > n - 1:
                    e = n - 1
                cute.copy(g2s, mK[b, e, p, None], sStage[st, j, p, None])

    @cute.jit
    def scale_of(e: Int32) -> Float32:
        """A UE8M0 byte's scale 2^(E - 127) (E = 0: 2^-127, subnormal)."""
        sc = bits_to_f32(Int32(0x400000))
        if e > 0:
            sc = bits_to_f32(e << 23)
        return sc

    @cute.jit
    def load_page(mKp, b, n, e0, st, sRawP, tid, g2s4):
        """mxfp4: cp.async the page of entries e0 .. e0+CH-1 (e0 a multiple of 64) into stage st:
        the codes of the entries below n (CPK pieces each), then their scale bytes (whole pieces)."""
        ne = n - e0
        if ne > CH:
            ne = Int32(CH)
        ncode = ne * CPK
        nscale = (ne * SBK + 15) // 16
        base = (b * (E // CH) + e0 // CH) * NRP
        for k in cutlass.range_constexpr(RPT):
            i = tid + k * NUM_THREADS
            if i < NRP:
                if (i < ncode) | ((i >= CH * CPK) & (i < CH * CPK + nscale)):
                    cute.copy(g2s4, mKp[base + i, None], sRawP[st, i, None])

    @cute.jit
    def dequant_page(sRaw, sRawB, sKW, st, tid):
        """mxfp4: the stage's page into the bf16 chunk; unit = (entry, 32-value group): 4 words
        of codes and a UE8M0 byte. Entries the load skipped decode stale bytes - their scores are
        never stored."""
        for k in cutlass.range_constexpr(-(-NDQ // NUM_THREADS)):
            i = tid + k * NUM_THREADS
            if i < NDQ:
                j = i // GPR
                gi = i % GPR
                e = Int32(sRawB[st, CH * D // 2 + j * SBK + gi]) & 255
                sc = scale_of(e) * Float32(16384.0)                     # e2m1_pair's fp16 is value * 2^-14
                out = cute.make_rmem_tensor((4,), Int32)
                for q in cutlass.range_constexpr(4):
                    word = sRaw[st, j * (D // 8) + gi * 4 + q]            # codes of values 8q .. 8q + 7
                    v = [None] * 8
                    for p in cutlass.range_constexpr(4):
                        v[p], v[p + 4] = f16x2_to_f32(e2m1_pair(word, p))
                    for p in cutlass.range_constexpr(4):
                        out[p] = f32x2_to_bf16x2(v[2 * p] * sc, v[2 * p + 1] * sc)
                    sKW[j, gi * 4 + q, None].store(out.load())            # 8 bf16: one 16-byte store

    @cute.jit
    def quantize_q(sQv, tid):
        """mxfp4: q's rows through MXFP4 in place (formats.mxfp4_round_trip); unit = (row, 32-value
        group): its max |q|, the UE8M0 scale, each value's nearest E2M1 (ties to even) times it."""
        for k in cutlass.range_constexpr(-(-NQQ // NUM_THREADS)):
            u = tid + k * NUM_THREADS
            if u < NQQ:
                r = u // GPR
                gi = u % GPR
                v = cute.make_rmem_tensor((32,), Float32)
                for q in cutlass.range_constexpr(4):
                    piece = sQv[r, gi * 4 + q, None].load().to(Float32)
                    for p in cutlass.range_constexpr(8):
                        v[q * 8 + p] = piece[p]
                a = Float32(0.0)
                for i in cutlass.range_constexpr(32):
                    a = cute.arch.fmax(a, cute.arch.fmax(v[i], -v[i]))
                sc = scale_of(ue8m0_exponent(cute.arch.fmax(a, Float32(MXFP4_AMAX_FLOOR)), 6.0))
                inv = div_rn(Float32(1.0), sc)          # exact: a power of two
                for q in cutlass.range_constexpr(4):
                    # the 8 codes packed as a key word, decoded as dequant_page decodes the keys
                    word = Int32(0)
                    for p in cutlass.range_constexpr(8):
                        word = word | (e2m1_code(v[q * 8 + p] * inv) << (4 * p))
                    out = cute.make_rmem_tensor((8,), Float32)
                    for p in cutlass.range_constexpr(4):
                        out[p], out[p + 4] = f16x2_to_f32(e2m1_pair(word, p))
                    sQv[r, gi * 4 + q, None].store((out.load() * (sc * Float32(16384.0))).to(BFloat16))

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        b = t // NT
        jt = t % NT

        mQ = gmem_tensor(ptrs[0], BFloat16, (B, R, D // 8, 8), 16)
        mW = gmem_tensor(ptrs[1], Float32, (B, R), 4)
        mK = None
        mKp = None
        if cutlass.const_expr(MX):
            mKp = gmem_tensor(ptrs[2], Int32, (B * (E // CH) * NRP, 4), 16)
        else:
            mK = gmem_tensor(ptrs[2], BFloat16, (B, E, PIECES, 8), 16)
        mStart = gmem_tensor(ptrs[3], Int32, (B,), 4)
        mS = gmem_tensor(ptrs[4], Float32, (B, T, E), 4)

        smem = TileSmem(scratch, OWN)
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((MP, D), stride=(RS, 1)), byte_alignment=128)
        # bf16 keys: ST stages of bf16 rows; mxfp4: ST stages of raw records + one bf16 chunk
        skv = smem.allocate_tensor(BFloat16, cute.make_layout(((1 if MX else ST), CH, RS), stride=(CH * RS, RS, 1)),
                                   byte_alignment=128)
        sP = smem.allocate_tensor(Float32, cute.make_layout((MP, CH), stride=(SS, 1)), byte_alignment=16)
        sW = smem.allocate_tensor(Float32, cute.make_layout((MP,)), byte_alignment=16)
        sStage = cute.make_tensor(skv.iterator, cute.make_layout((ST, CH, PIECES, 8), stride=(CH * RS, RS, 8, 1)))
        sK = cute.make_tensor(skv.iterator, cute.make_layout((ST, CH, D), stride=(CH * RS, RS, 1)))
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
        sRaw, sRawB, sRawP, sKW, g2s4 = None, None, None, None, None
        if cutlass.const_expr(MX):
            raw = smem.allocate_tensor(Int32, cute.make_layout((ST, NRP * 4), stride=(NRP * 4, 1)), byte_alignment=16)
            sRaw = smem_tensor(raw.iterator.toint(), Int32, (ST, NRP * 4))
            sRawP = smem_tensor(raw.iterator.toint(), Int32, (ST, NRP, 4))
            sRawB = smem_tensor(raw.iterator.toint(), cutlass.Int8, (ST, NRP * 16))
            sKW = smem_tensor(skv.iterator.toint(), Int32, (CH, RS // 8, 4))     # 16-byte units of bf16
            g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                                       num_bits_per_copy=128)

        # ---- this tile's entries [lo, hi): n = entries visible to the last query token --------
        start = mStart[b]
        n = (start + T) // RATIO
        if n > E:
            n = Int32(E)
        lo = jt * KPT
        hi = lo + KPT
        if hi > n:
            hi = n
        nch = Int32(0)
        if hi > lo:
            nch = (hi - lo + CH - 1) // CH

        # q rides in the first stage's cp.async group
        sQv = cute.make_tensor(sQ.iterator, cute.make_layout((MP, D // 8, 8), stride=(RS, 8, 1)))
        stage_rows_async(g2s, mQ[b, None, None, None], Int32(0), sQv, R)
        for k in cutlass.range_constexpr(ST - 1):
            if k < nch:
                if cutlass.const_expr(MX):
                    load_page(mKp, b, n, lo + k * CH, k, sRawP, tid, g2s4)
                else:
                    load_chunk(mK, b, n, lo + k * CH, k, sStage, tid, g2s)
            cute.arch.cp_async_commit_group()
        for r in cutlass.range(tid, MP, NUM_THREADS, unroll=1):
            wr = Float32(0.0)
            if r < R:
                wr = mW[b, r]
                if cutlass.const_expr(MX):
                    wr = bf16(wr * scale)       # V4.1: bf16 weights with the scale folded in
            sW[r] = wr

        mma_op = cwarp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        tiled_qk = cute.make_tiled_mma(mma_op, (1, 1, 1))
        thr_qk = tiled_qk.get_slice(lane)
        cpy_q = cute.make_tiled_copy_A(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 4), BFloat16), tiled_qk)
        cpy_k = cute.make_tiled_copy_B(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 2), BFloat16), tiled_qk)
        thr_cq = cpy_q.get_slice(lane)
        thr_ck = cpy_k.get_slice(lane)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSsQ = thr_cq.partition_S(sQ)
        tSrQv = thr_cq.retile(tSrQ)
        cS = thr_qk.partition_C(cute.make_identity_tensor((MP, 8)))
        tSsP = thr_qk.partition_C(cute.local_tile(sP, (MP, 8), (0, wid)))

        for ci in cutlass.range(nch, unroll=1):
            st = ci % ST
            cute.arch.cp_async_wait_group(ST - 2)
            cute.arch.sync_threads()            # chunk ci landed; everyone is done with ci - 1's products
            nxt = ci + ST - 1
            if nxt < nch:
                if cutlass.const_expr(MX):
                    load_page(mKp, b, n, lo + nxt * CH, nxt % ST, sRawP, tid, g2s4)
                else:
                    load_chunk(mK, b, n, lo + nxt * CH, nxt % ST, sStage, tid, g2s)
            cute.arch.cp_async_commit_group()
            kst = st
            if cutlass.const_expr(MX):
                if ci == 0:
                    quantize_q(sQv, tid)        # q landed with chunk 0
                dequant_page(sRaw, sRawB, sKW, st, tid)
                kst = Int32(0)
                cute.arch.sync_threads()        # the chunk's bf16 keys (and at chunk 0 q) in place

            # ---- q . key for all rows x this warp's 8 entries, ReLU(. * scale) * w[row] ---------
            sKw = cute.local_tile(sK[kst, None, None], (8, D), (wid, 0))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKw))
            tSsK = thr_ck.partition_S(sKw)
            tSrKv = thr_ck.retile(tSrK)
            accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((MP, 8)), Float32)
            accS.fill(0.0)
            for k in cutlass.range_constexpr(D // 16):
                cute.copy(cpy_q, tSsQ[None, None, k], tSrQv[None, None, k])
                cute.copy(cpy_k, tSsK[None, None, k], tSrKv[None, None, k])
                cute.gemm(tiled_qk, accS, tSrQ[None, None, k], tSrK[None, None, k], accS)
            for i in cutlass.range_constexpr(cute.size(accS)):
                m_, n_ = cS[i]
                if cutlass.const_expr(MX):      # V4.1's stages: bf16(ReLU(bf16(dot)) * w)
                    tSsP[i] = bf16(cute.arch.fmax(bf16(accS[i]), Float32(0.0)) * sW[m_])
                else:
                    tSsP[i] = cute.arch.fmax(accS[i] * scale, Float32(0.0)) * sW[m_]
            cute.arch.sync_threads()            # all products of chunk ci in sP

            # ---- head sums per (token, entry); -inf where the entry is not visible to the token --
            e0 = lo + ci * CH
            if cutlass.const_expr(P > 1 and not MX):
                o = tid // P
                part = tid % P
                tq = o // CH
                j = o % CH
                acc = Float32(0.0)
                for h in cutlass.range(part, H, P, unroll=1):
                    acc = acc + sP[tq * H + h, j]
                for sh in cutlass.range_constexpr(int(math.log2(P))):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=P >> (sh + 1), mask=-1, mask_and_clamp=31)
                e = e0 + j
                if part == 0 and e < hi:
                    nt = (start + tq + 1) // RATIO
                    if e >= nt:
                        acc = Float32(NEG_INF)
                    mS[b, tq, e] = acc
            else:
                # one lane per (token, entry), heads in order (V4.1 keeps the fp32 sum's order)
                for o in cutlass.range(tid, NO, NUM_THREADS, unroll=1):
                    tq = o // CH
                    j = o % CH
                    acc = Float32(0.0)
                    if cutlass.const_expr(MX):
                        # unrolled: the loads go out together, the fp32 adds stay in head order
                        for h in cutlass.range(H, unroll_full=True):
                            acc = acc + sP[tq * H + h, j]
                        acc = bf16(acc)
                    else:
                        for h in cutlass.range(H, unroll=1):
                            acc = acc + sP[tq * H + h, j]
                    e = e0 + j
                    if e < hi:
                        nt = (start + tq + 1) // RATIO
                        if e >= nt:
                            acc = Float32(NEG_INF)
                        mS[b, tq, e] = acc

        cute.arch.cp_async_wait_group(0)        # nothing in flight when the tile ends
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile


def build_topk_tile(block):
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    c = block.config
    B, T, E, K = c.batch, c.q_tokens, c.max_entries, c.k
    RATIO, X, TAIL, WID = c.ratio, c.expand, c.tail, block.width
    NB = 1 << RADIX_BITS
    BPL = NB // 32                       # histogram bins per lane of warp 0
    assert NB == NUM_THREADS             # one bin per thread when clearing
    # entries a thread loads back to back before using them (TopKConfig.loads): every pass reads
    # the score row from L2, and one load per loop trip made each pass a chain of ~n / 256 round
    # trips (the V4.1 CSA top-k of 8192 entries at batch 1, one tile in the sublayer: 41.6 ->
    # 27.1 us on the H200 with 8). Warp-aggregated histogram atomics (match.any, one add per
    # distinct bin) measured slower still (30.8 us): not kept.
    U = c.loads
    CACHE = block.cache_row               # the ordered keys in shared memory after the first read

    @cute.jit
    def ordered(u: Uint32) -> Uint32:
        """The uint32 key whose unsigned order is the fp32 order of the bits u; -0.0 is keyed as
        +0.0 (scores of all-zero ReLUs with negative head weights are -0.0: a tie, not smaller)."""
        r = u | Uint32(0x80000000)
        if (u >> Uint32(31)) != Uint32(0):
            r = u ^ Uint32(0xFFFFFFFF)
        if u == Uint32(0x80000000):
            r = r ^ Uint32(0xFFFFFFFF)       # -0.0: ~u = 0x7FFFFFFF -> +0.0's key 0x80000000
        return r

    @cute.jit
    def keys_of(src, b, tq, first: Int32, step: cutlass.Constexpr, end: Int32, spare: Int32,
                cached: cutlass.Constexpr):
        """The ordered keys of the U entries first + step j (entries past `end` read `spare`
        instead), all U loads issued before any use: src is the cached row (`cached`) or the
        scores."""
        idx = [Int32(cutlass.select_(first + step * j < end, first + step * j, spare)) for j in range(U)]
        if cutlass.const_expr(cached):
            return tuple(src[i] for i in idx)
        raw = [src[b, tq, i] for i in idx]
        return tuple(ordered(r) for r in raw)

    @cute.jit
    def scan2(a: Int32, e: Int32, sX, lane, wid):
        """Block-wide exclusive prefix sums of (a, e) in thread order. Uses sX[2 : 2 + 2 * NUM_WARPS]."""
        ia = a
        ie = e
        for sh in cutlass.range_constexpr(5):
            off = 1 << sh
            va = cute.arch.shuffle_sync_up(ia, offset=off, mask=-1, mask_and_clamp=0)
            ve = cute.arch.shuffle_sync_up(ie, offset=off, mask=-1, mask_and_clamp=0)
            if lane >= off:
                ia = ia + va
                ie = ie + ve
        if lane == 31:
            sX[2 + wid] = ia
            sX[2 + NUM_WARPS + wid] = ie
        cute.arch.sync_threads()
        ba = Int32(0)
        be = Int32(0)
        for w in cutlass.range_constexpr(NUM_WARPS):
            if w < wid:
                ba = ba + sX[2 + w]
                be = be + sX[2 + NUM_WARPS + w]
        return ba + ia - a, be + ie - e

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        b = t // T
        tq = t % T
        mU = gmem_tensor(ptrs[0], Uint32, (B, T, E), 4)
        mStart = gmem_tensor(ptrs[1], Int32, (B,), 4)
        mI = gmem_tensor(ptrs[2], Int32, (B, T, WID), 4)

        smem = TileSmem(scratch, OWN)
        sH = smem.allocate_tensor(Int32, cute.make_layout((NB,)), byte_alignment=16)
        sX = smem.allocate_tensor(Int32, cute.make_layout((2 + 2 * NUM_WARPS,)), byte_alignment=16)
        src = mU                          # where the passes read the keys
        if cutlass.const_expr(CACHE):
            sK = smem.allocate_tensor(Uint32, cute.make_layout((E,)), byte_alignment=16)
            src = sK

        pos = mStart[b] + tq
        n = (pos + 1) // RATIO
        if n > E:
            n = Int32(E)
        take_all = n <= K
        prefix = Uint32(0)
        krem = Int32(K)

        if cutlass.const_expr(CACHE):
            # one read of the row from L2 (the only one), as ordered keys into shared memory
            if not take_all:
                for base in cutlass.range(tid, n, NUM_THREADS * U, unroll=1):
                    keys = keys_of(mU, b, tq, base, NUM_THREADS, n, Int32(0), False)
                    for j in cutlass.range_constexpr(U):
                        if base + NUM_THREADS * j < n:
                            sK[base + NUM_THREADS * j] = keys[j]
                cute.arch.sync_threads()

        # ---- radix select: the k-th largest key (prefix) and how many of its ties to take ------
        if not take_all:
            mask = Uint32(0)
            for p in cutlass.range_constexpr(RADIX_PASSES):
                shift = 32 - RADIX_BITS * (p + 1)
                sH[tid] = Int32(0)
                cute.arch.sync_threads()
                for base in cutlass.range(tid, n, NUM_THREADS * U, unroll=1):
                    keys = keys_of(src, b, tq, base, NUM_THREADS, n, Int32(0), CACHE)
                    for j in cutlass.range_constexpr(U):
                        key = keys[j]
                        if (base + NUM_THREADS * j < n) & ((key & mask) == prefix):
                            bin_ = Int32((key >> Uint32(shift)) & Uint32(NB - 1))
                            cute.arch.atomic_add(sH.iterator + bin_, Int32(1), sem="relaxed", scope="cta")
                cute.arch.sync_threads()
                if wid == 0:
                    mine = Int32(0)
                    for i in cutlass.range_constexpr(BPL):
                        mine = mine + sH[lane * BPL + i]
                    incl = mine                  # entries in the bins of lanes >= lane
                    for sh in cutlass.range_constexpr(5):
                        off = 1 << sh
                        v = cute.arch.shuffle_sync_down(incl, offset=off, mask=-1, mask_and_clamp=31)
                        if lane + off < 32:
                            incl = incl + v
                    above = incl - mine          # entries in higher bins than this lane's
                    for i in cutlass.range_constexpr(BPL):
                        bi = lane * BPL + (BPL - 1 - i)
                        h = sH[bi]
                        if above < krem and above + h >= krem:
                            sX[0] = bi
                            sX[1] = krem - above
                        above = above + h
                cute.arch.sync_threads()
                krem = sX[1]
                prefix = prefix | (Uint32(sX[0]) << Uint32(shift))
                mask = mask | Uint32((NB - 1) << shift)

        # ---- compaction: contiguous ranges per thread, ascending output ----------------------
        per = (n + NUM_THREADS - 1) // NUM_THREADS
        lo = tid * per
        hi = lo + per
        if hi > n:
            hi = n
        n_gt = Int32(0)
        n_eq = Int32(0)
        if take_all:
            if hi > lo:
                n_gt = hi - lo
        else:
            for e0 in cutlass.range(lo, hi, U, unroll=1):
                keys = keys_of(src, b, tq, e0, 1, hi, lo, CACHE)
                for j in cutlass.range_constexpr(U):
                    key = keys[j]
                    if e0 + j < hi:
                        if key > prefix:
                            n_gt = n_gt + 1
                        elif key == prefix:
                            n_eq = n_eq + 1
        gt_before, eq_before = scan2(n_gt, n_eq, sX, lane, wid)
        taken_before = eq_before
        if taken_before > krem:
            taken_before = krem
        o = gt_before + taken_before
        eb = eq_before
        for e0 in cutlass.range(lo, hi, U, unroll=1):
            keys = keys_of(src, b, tq, e0, 1, hi, lo, CACHE)
            for j in cutlass.range_constexpr(U):
                e = e0 + j
                take = take_all
                if not take_all:
                    key = keys[j]
                    if key > prefix:
                        take = True
                    elif key == prefix:
                        take = eb < krem
                        eb = eb + 1
                if take & (e < hi):
                    for i in cutlass.range_constexpr(X):
                        mI[b, tq, o * X + i] = e * X + i
                    o = o + 1
        nsel = n
        if nsel > K:
            nsel = Int32(K)
        for i in cutlass.range(nsel * X + tid, K * X, NUM_THREADS, unroll=1):
            mI[b, tq, i] = Int32(-1)
        if cutlass.const_expr(TAIL):
            count = (pos + 1) % X
            for i in cutlass.range(tid, X - 1, NUM_THREADS, unroll=1):
                v = Int32(-1)
                if i < count:
                    v = pos + 1 - count + i
                mI[b, tq, K * X + i] = v
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile
