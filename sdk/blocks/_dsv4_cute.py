"""CuTe DSL device tiles of the DeepSeek-V4 attention decode blocks (`dsv4_attention.py` documents
the key space, the masks and the formats). Imports cutlass: imported only when a tile is built.

The core tile is MLADecodeBlock's tensor-core tile (`_mla_cute.py`: warp MMA m16n8k16, ldmatrix,
online softmax, cp.async pipeline of KV chunks) with K = V = the whole 512-wide row and two
changes: a chunk row comes from one of three sources (ring slot, this call's token, compressed
entry - HCA in order, CSA through the index list) and the mask is the per-row visibility rule of
the key (window position, causal among new tokens, compressed readiness). bf16 caches, or the
ring as fp8 records (window_dtype) and / or the entries as fp4 records (comp_dtype): staged raw
beside the stage, dequantised into it per chunk.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as cwarp

from ._cute import (TileSmem, bits_to_f32, e2m1_pair, e4m3_piece, e4m3x4_to_f16x2x2, f16x2_to_f32,
                    f32x2_to_bf16x2, gmem_tensor, smem_tensor, stage_rows_async, ue8m0_exponent)
from ._mla_cute import LOG2_E, a_view, mn_view, quad_max, quad_sum, split_chunks
from .dsv4_attention import comp_record_words, window_record_words
from .base import NUM_THREADS

NUM_WARPS = NUM_THREADS // 32


def build_dsv4_decode_tile(block):
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    c = block.config
    B, T, H = c.batch, c.q_tokens, c.heads
    TQ, G = block.tq, block.groups
    R = block.rows                       # a query group's rows ..
    RG, TR = block.row_groups, block.tile_rows   # .. cut evenly into RG tiles of TR
    MP = 16 * math.ceil(TR / 16)
    D = c.head_dim
    W = c.window
    E = max(c.max_entries, 1)
    K = max(c.topk, 1)
    NCM = block.n_comp_max
    MODE = c.mode
    RATIO = c.ratio
    CH = c.chunk
    NWN = CH // 8
    NWK = NUM_WARPS // NWN
    KS = D // NWK
    DVW = D // NUM_WARPS
    ST = block.stages
    S = c.num_splits
    RS = D + 8
    PIECES = D // 8
    NPIECE = CH * PIECES
    PPT = -(-NPIECE // NUM_THREADS)
    FP8W = block.fp8_window              # the ring holds V4.1's fp8 records (window_dtype)
    FP4C = block.fp4_comp                # the entries are V4.1's fp4 records (comp_dtype)
    RAWW = block.raw_row_bytes // 4      # quantised rows: words of a staged record row
    RP = window_record_words(D) // 4 if FP8W else 0     # fp8: 16-byte pieces of a record (33)
    RPC = comp_record_words(D) // 4 if FP4C else 0      # fp4: 16-byte pieces of a record (18)
    NDQ = CH * (D // 16)                 # fp8: dequant units of a chunk (16 values each)
    scale_log2 = block.scale * LOG2_E
    scale_nat = block.scale
    NEG_INF = -math.inf

    @cute.jit
    def key_row(mIdx, b, g, start, j):
        """(source 0 ring / 1 new / 2 comp, row in that source, compressed entry or -1) of key j."""
        src = Int32(0)
        row = j
        ent = Int32(-1)
        if j >= W:
            src = Int32(1)
            row = j - W
            if j >= W + T:
                src = Int32(2)
                row = j - W - T
                if cutlass.const_expr(MODE == "csa"):
                    row = mIdx[b, g, j - W - T]
                ent = row
                if row < 0:
                    row = Int32(0)
                if row > E - 1:
                    row = Int32(E - 1)
        return src, row, ent

    @cute.jit
    def load_chunk(mRing, mNew, mComp, mIdx, b, g, start, nk, ci, st, sStage, tid, g2s, sRaw, g2s4):
        """cp.async keys ci*CH + i into stage st. Keys past nk re-read key nk - 1 (finite data;
        the mask drops them). fp8 window: a ring row's record (RP pieces) goes to the stage's
        raw rows instead (dequant_window makes it the stage row)."""
        for k in cutlass.range_constexpr(PPT):
            i = tid + k * NUM_THREADS
            if i < NPIECE:
                jj = i // PIECES
                p = i % PIECES
                j = ci * CH + jj
                if j > nk - 1:
                    j = nk - 1
                src, row, ent = key_row(mIdx, b, g, start, j)
                if src == 0:
                    if cutlass.const_expr(FP8W):
                        if p < RP:
                            cute.copy(g2s4, mRing[b, row, p, None], sRaw[st, jj, p, None])
                    else:
                        cute.copy(g2s, mRing[b, row, p, None], sStage[st, jj, p, None])
                elif src == 1:
                    cute.copy(g2s, mNew[b, row, p, None], sStage[st, jj, p, None])
                else:
                    if cutlass.const_expr(NCM > 0):
                        if cutlass.const_expr(FP4C):
                            if p < RPC:
                                cute.copy(g2s4, mComp[b, row, p, None], sRaw[st, jj, p, None])
                        else:
                            cute.copy(g2s, mComp[b, row, p, None], sStage[st, jj, p, None])

    @cute.jit
    def visible(mIdx, b, g, start, nk, j, tq):
        """Key j visible to the tile's query tq (0 .. TQ-1)."""
        qp = start + g * TQ + tq
        ok = j < nk
        if j < W:
            last = start - 1
            pos = last - (last - j + W) % W
            ok = ok and pos >= 0 and pos > qp - W
        elif j < W + T:
            ok = ok and (j - W) <= qp - start
        else:
            src, row, ent = key_row(mIdx, b, g, start, j)
            ok = ok and ent >= 0 and ent < (qp + 1) // RATIO and ent < E
        return ok

    @cute.jit
    def dequant_rows(sRaw, sRawB, sStageW, st, ci, nk, tid):
        """The stage's quantised rows - the keys load_chunk staged raw: ring rows (clamped key
        < W) with FP8W, entry rows (clamped key >= W + T) with FP4C - from their records into
        bf16 stage rows; unit = (row, 16 values). fp8: 4 words and a UE8M0 scale byte; fp4: 8
        bytes of codes and an E4M3 scale byte."""
        for k in cutlass.range_constexpr(-(-NDQ // NUM_THREADS)):
            i = tid + k * NUM_THREADS
            if i < NDQ:
                jj = i // (D // 16)
                p = i % (D // 16)
                j = ci * CH + jj
                if j > nk - 1:
                    j = nk - 1
                if cutlass.const_expr(FP8W):
                    if j < W:
                        e = Int32(sRawB[st, jj, D + p // 2]) & 255
                        sc = bits_to_f32(Int32(0x400000))                   # E = 0: 2^-127
                        if e > 0:
                            sc = bits_to_f32(e << 23)                       # 2^(E - 127)
                        for q in cutlass.range_constexpr(4):
                            # e4m3 -> f16 -> f32 (exact), times the scale, rounded to bf16
                            lo, hi = e4m3x4_to_f16x2x2(sRaw[st, jj, p, q])
                            v0, v1 = f16x2_to_f32(lo)
                            v2, v3 = f16x2_to_f32(hi)
                            sStageW[st, jj, 8 * p + 2 * q] = f32x2_to_bf16x2(v0 * sc, v1 * sc)
                            sStageW[st, jj, 8 * p + 2 * q + 1] = f32x2_to_bf16x2(v2 * sc, v3 * sc)
                if cutlass.const_expr(FP4C):
                    if j >= W + T:
                        # the E4M3 scale (exact in fp32) times 2^14: e2m1_pair's fp16 is the value * 2^-14
                        s16, _ = f16x2_to_f32(e4m3x4_to_f16x2x2(Int32(sRawB[st, jj, D // 2 + p]) & 255)[0])
                        sc = s16 * Float32(16384.0)
                        for q in cutlass.range_constexpr(2):
                            word = sRaw[st, jj, p // 2, 2 * (p % 2) + q]       # codes of values 8q .. 8q + 7
                            v = [None] * 8
                            for k in cutlass.range_constexpr(4):
                                v[k], v[k + 4] = f16x2_to_f32(e2m1_pair(word, k))
                            for k in cutlass.range_constexpr(4):
                                sStageW[st, jj, 8 * p + 4 * q + k] = f32x2_to_bf16x2(v[2 * k] * sc, v[2 * k + 1] * sc)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        s = t % S
        bg = t // S
        r0 = Int32(0)                           # the row group's first row in its query group
        if cutlass.const_expr(RG > 1):
            r0 = (bg % RG) * TR
            bg = bg // RG
        g = bg % G
        b = bg // G

        mQ = gmem_tensor(ptrs[0], BFloat16, (B, T * H, D // 8, 8), 16)
        if cutlass.const_expr(FP8W):
            mRing = gmem_tensor(ptrs[1], Int32, (B, W, RP, 4), 16)
        else:
            mRing = gmem_tensor(ptrs[1], BFloat16, (B, W, PIECES, 8), 16)
        mNew = gmem_tensor(ptrs[2], BFloat16, (B, T, PIECES, 8), 16)
        mComp = None
        if cutlass.const_expr(NCM > 0):
            if cutlass.const_expr(FP4C):
                mComp = gmem_tensor(ptrs[3], Int32, (B, E, RPC, 4), 16)
            else:
                mComp = gmem_tensor(ptrs[3], BFloat16, (B, E, PIECES, 8), 16)
        mIdx = None
        if cutlass.const_expr(MODE == "csa"):
            mIdx = gmem_tensor(ptrs[4], Int32, (B, T, K), 4)
        mStart = gmem_tensor(ptrs[5], Int32, (B,), 4)
        mO = gmem_tensor(ptrs[6], Float32, (B, G, S, R, D), 4)
        mL = gmem_tensor(ptrs[7], Float32, (B, G, S, R), 4)

        smem = TileSmem(scratch, OWN)
        sQ = smem.allocate_tensor(BFloat16, cute.make_layout((MP, D), stride=(RS, 1)), byte_alignment=128)
        sS = smem.allocate_tensor(Float32, cute.make_layout((NWK, MP, CH), stride=(MP * CH, CH, 1)),
                                  byte_alignment=16)
        skv = smem.allocate_tensor(BFloat16, cute.make_layout((ST, CH, RS), stride=(CH * RS, RS, 1)),
                                   byte_alignment=128)
        sStage = cute.make_tensor(skv.iterator, cute.make_layout((ST, CH, PIECES, 8), stride=(CH * RS, RS, 8, 1)))
        sKV = cute.make_tensor(skv.iterator, cute.make_layout((ST, CH, D), stride=(CH * RS, RS, 1)))
        sKVt = cute.make_tensor(skv.iterator, cute.make_layout((ST, D, CH), stride=(CH * RS, 1, RS)))
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                  num_bits_per_copy=128)
        sRaw, sRawB, sStageW, g2s4 = None, None, None, None
        if cutlass.const_expr(FP8W or FP4C):
            raw = smem.allocate_tensor(Int32, cute.make_layout((ST, CH, RAWW), stride=(CH * RAWW, RAWW, 1)),
                                       byte_alignment=16)
            sRaw = smem_tensor(raw.iterator.toint(), Int32, (ST, CH, RAWW // 4, 4))
            sRawB = smem_tensor(raw.iterator.toint(), cutlass.Int8, (ST, CH, RAWW * 4))
            sStageW = smem_tensor(skv.iterator.toint(), Int32, (ST, CH, RS // 2))
            g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                                       num_bits_per_copy=128)

        # ---- the key count of this (sequence, group) and the split's chunk range --------------
        start = mStart[b]
        nk = Int32(W + T + NCM)
        if cutlass.const_expr(MODE == "hca"):
            ready = (start + T) // RATIO
            if ready > E:
                ready = Int32(E)
            nk = W + T + ready
        c_lo, c_hi = split_chunks(nk, CH, S, s)

        # q rides in the first stage's cp.async group
        sQv = cute.make_tensor(sQ.iterator, cute.make_layout((MP, D // 8, 8), stride=(RS, 8, 1)))
        stage_rows_async(g2s, mQ[b, None, None, None], g * TQ * H + r0, sQv, TR)
        for k in cutlass.range_constexpr(ST - 1):
            if c_lo + k < c_hi:
                load_chunk(mRing, mNew, mComp, mIdx, b, g, start, nk, c_lo + k, k, sStage, tid, g2s, sRaw, g2s4)
            cute.arch.cp_async_commit_group()

        mma_op = cwarp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        tiled_qk = cute.make_tiled_mma(mma_op, (1, 1, 1))
        tiled_pv = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(16, 16, 16))
        thr_qk = tiled_qk.get_slice(lane)
        thr_pv = tiled_pv.get_slice(lane)
        cpy_q = cute.make_tiled_copy_A(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 4), BFloat16), tiled_qk)
        cpy_k = cute.make_tiled_copy_B(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 2), BFloat16), tiled_qk)
        cpy_v = cute.make_tiled_copy_B(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(True, 4), BFloat16), tiled_pv)
        thr_cq = cpy_q.get_slice(lane)
        thr_ck = cpy_k.get_slice(lane)
        thr_cv = cpy_v.get_slice(lane)

        nw = wid % NWN
        kp = wid // NWN
        sQk = cute.local_tile(sQ, (MP, KS), (0, kp))
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQk))
        tSsQ = thr_cq.partition_S(sQk)
        tSrQv = thr_cq.retile(tSrQ)

        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((MP, DVW)), Float32)
        accO.fill(0.0)
        accO_mn = mn_view(accO)
        NROW = cute.size(accO_mn, mode=[0])
        row_max = cute.make_rmem_tensor((NROW,), Float32)
        row_sum = cute.make_rmem_tensor((NROW,), Float32)
        row_max.fill(NEG_INF)
        row_sum.fill(0.0)

        cS = thr_pv.partition_C(cute.make_identity_tensor((MP, CH)))

        for ci in cutlass.range(c_lo, c_hi, unroll=1):
            it = ci - c_lo
            st = it % ST
            cute.arch.cp_async_wait_group(ST - 2)
            cute.arch.sync_threads()
            nxt = ci + ST - 1
            if nxt < c_hi:
                load_chunk(mRing, mNew, mComp, mIdx, b, g, start, nk, nxt, (it + ST - 1) % ST, sStage, tid, g2s,
                           sRaw, g2s4)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(FP8W or FP4C):
                # the chunk's quantised rows (ring records, entry records) into its bf16 stage rows
                has_rows = Int32(0)
                if cutlass.const_expr(FP8W):
                    if ci * CH < W:
                        has_rows = Int32(1)
                if cutlass.const_expr(FP4C):
                    if (ci + 1) * CH > W + T:
                        has_rows = Int32(1)
                if has_rows != 0:
                    dequant_rows(sRaw, sRawB, sStageW, st, ci, nk, tid)
                    cute.arch.sync_threads()

            sKw = cute.local_tile(sKV[st, None, None], (8, KS), (nw, kp))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKw))
            tSsK = thr_ck.partition_S(sKw)
            tSrKv = thr_ck.retile(tSrK)
            accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((MP, 8)), Float32)
            accS.fill(0.0)
            for k in cutlass.range_constexpr(KS // 16):
                cute.copy(cpy_q, tSsQ[None, None, k], tSrQv[None, None, k])
                cute.copy(cpy_k, tSsK[None, None, k], tSrKv[None, None, k])
                cute.gemm(tiled_qk, accS, tSrQ[None, None, k], tSrK[None, None, k], accS)
            tSsS = thr_qk.partition_C(cute.local_tile(sS[kp, None, None], (MP, 8), (0, nw)))
            for i in cutlass.range_constexpr(cute.size(accS)):
                tSsS[i] = accS[i]
            cute.arch.sync_threads()

            accP = cute.make_rmem_tensor(thr_pv.partition_shape_C((MP, CH)), Float32)
            tPs0 = thr_pv.partition_C(sS[0, None, None])
            for i in cutlass.range_constexpr(cute.size(accP)):
                accP[i] = tPs0[i]
            for kk in cutlass.range_constexpr(1, NWK):
                tPsk = thr_pv.partition_C(sS[kk, None, None])
                for i in cutlass.range_constexpr(cute.size(accP)):
                    accP[i] = accP[i] + tPsk[i]
            # every key's visibility per row (window, causal, compressed readiness / selection)
            for i in cutlass.range_constexpr(cute.size(accP)):
                m_, n_ = cS[i]
                tq = (r0 + m_) // H
                if tq > TQ - 1:
                    tq = TQ - 1
                if not visible(mIdx, b, g, start, nk, ci * CH + n_, tq):
                    accP[i] = NEG_INF
            accP_mn = mn_view(accP)
            for r in cutlass.range_constexpr(NROW):
                row = accP_mn[r, None].load()
                mx = quad_max(row.reduce(cute.ReductionOp.MAX, NEG_INF, 0))
                m_new = cute.arch.fmax(row_max[r], mx)
                m_use = m_new
                if m_new == NEG_INF:
                    m_use = Float32(0.0)
                p = cute.math.exp2(row * scale_log2 - m_use * scale_log2, fastmath=True)
                alpha = cute.math.exp2(row_max[r] * scale_log2 - m_use * scale_log2, fastmath=True)
                row_sum[r] = row_sum[r] * alpha + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                accO_mn[r, None] = accO_mn[r, None].load() * alpha
                row_max[r] = m_new
                accP_mn[r, None] = p

            rP = cute.make_rmem_tensor(accP.layout, BFloat16)
            rP.store(accP.load().to(BFloat16))
            tOrP = a_view(rP)
            sVt = cute.local_tile(sKVt[st, None, None], (DVW, CH), (wid, 0))
            tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
            tOsV = thr_cv.partition_S(sVt)
            tOrVv = thr_cv.retile(tOrV)
            for k in cutlass.range_constexpr(CH // 16):
                cute.copy(cpy_v, tOsV[None, None, k], tOrVv[None, None, k])
                cute.gemm(tiled_pv, accO, tOrP[None, None, k], tOrV[None, None, k], accO)

        cute.arch.cp_async_wait_group(0)

        cO_mn = mn_view(thr_pv.partition_C(cute.make_identity_tensor((MP, DVW))))
        for r in cutlass.range_constexpr(NROW):
            l = quad_sum(row_sum[r])
            inv = Float32(0.0)
            lse = Float32(NEG_INF)
            if l > Float32(0.0):
                inv = Float32(1.0) / l
                lse = row_max[r] * scale_nat + cute.math.log(l, fastmath=False)
            m_ = cO_mn[r, 0][0]
            if m_ < TR:
                for cc in cutlass.range_constexpr(cute.size(accO_mn, mode=[1])):
                    mO[b, g, s, r0 + m_, wid * DVW + cO_mn[r, cc][1]] = accO_mn[r, cc] * inv
                if wid == 0 and lane % 4 == 0:
                    mL[b, g, s, r0 + m_] = lse
        cute.arch.sync_threads()

    return tile


def build_dsv4_combine_tile(block):
    """Tile (b, tq, h, cq): the head's split weights (sink in the denominator), then the weighted
    sum of 128 columns with thread (split group sg, 16-byte column group cg) summing splits sg,
    sg + SG, ... (4 loads in flight), the groups' sums added through smem, rounded to bf16 and
    un-roped in pairs (the reference's order)."""
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    from .dsv4_attention import COMBINE_COLS
    c = block.config
    B, T, H, D, S = c.batch, c.q_tokens, c.heads, c.head_dim, c.num_splits
    G, R = block.groups, block.rows
    PTG = c.per_token_groups
    CW = COMBINE_COLS
    NCQ = D // CW
    CG = CW // 4                         # 16-byte column groups of a tile
    SG = NUM_THREADS // CG               # split groups
    RD = c.rope_dim
    R2 = max(RD // 2, 1)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        cq = t % NCQ
        h = (t // NCQ) % H
        tq = (t // (NCQ * H)) % T
        b = t // (NCQ * H * T)
        g = Int32(0)
        r = tq * H + h
        if cutlass.const_expr(PTG):
            g = tq
            r = h
        mO = gmem_tensor(ptrs[0], Float32, (B, G, S, R, D // 4, 4), 16)
        mL = gmem_tensor(ptrs[1], Float32, (B, G, S, R), 4)
        mSink = gmem_tensor(ptrs[2], Float32, (H,), 4)
        mOut = gmem_tensor(ptrs[5], BFloat16, (B, T, H, D), 2)
        smem = TileSmem(scratch, OWN)
        sW = smem.allocate_tensor(Float32, cute.make_layout(S), byte_alignment=16)
        sR = smem.allocate_tensor(Float32, cute.make_layout((SG, CW), stride=(CW, 1)), byte_alignment=16)
        sM = smem.allocate_tensor(Float32, cute.make_layout(2), byte_alignment=16)
        # ---- the head's weights: warp 0 reduces max and sum of exp over the S lse values + sink ----
        if tid < 32:
            sink = mSink[h]
            mx = sink
            for sp in cutlass.range(lane, S, 32, unroll=1):
                mx = cute.arch.fmax(mx, mL[b, g, sp, r])
            for off in cutlass.range_constexpr(5):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1 << off, mask=-1,
                                                                     mask_and_clamp=31))
            den = Float32(0.0)
            for sp in cutlass.range(lane, S, 32, unroll=1):
                den = den + cute.math.exp(mL[b, g, sp, r] - mx, fastmath=False)
            for off in cutlass.range_constexpr(5):
                den = den + cute.arch.shuffle_sync_bfly(den, offset=1 << off, mask=-1, mask_and_clamp=31)
            if tid == 0:
                sM[0] = mx
                sM[1] = den + cute.math.exp(sink - mx, fastmath=False)    # the sink's share
        cute.arch.sync_threads()
        mx = sM[0]
        inv = Float32(1.0) / sM[1]
        for sp in cutlass.range(tid, S, NUM_THREADS, unroll=1):
            sW[sp] = cute.math.exp(mL[b, g, sp, r] - mx, fastmath=False) * inv
        cute.arch.sync_threads()
        # ---- weighted sum: 16-byte loads, several splits in flight per thread -----------------
        cg = tid % CG
        sg = tid // CG
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for sp in cutlass.range(sg, S, SG, unroll=4):
            acc.store(acc.load() + mO[b, g, sp, r, cq * CG + cg, None].load() * sW[sp])
        for e in cutlass.range_constexpr(4):
            sR[sg, cg * 4 + e] = acc[e]
        cute.arch.sync_threads()
        # ---- the groups' sums, bf16 (the reference rounds o first), un-roped in column pairs ----
        for p in cutlass.range(tid, CW // 2, NUM_THREADS, unroll=1):
            x0 = Float32(0.0)
            x1 = Float32(0.0)
            for gi in cutlass.range_constexpr(SG):
                x0 = x0 + sR[gi, 2 * p]
                x1 = x1 + sR[gi, 2 * p + 1]
            x0 = x0.to(BFloat16).to(Float32)
            x1 = x1.to(BFloat16).to(Float32)
            col = cq * CW + 2 * p
            if cutlass.const_expr(RD > 0):
                if col >= D - RD:
                    mCos = gmem_tensor(ptrs[3], BFloat16, (B, T, R2), 2)
                    mSin = gmem_tensor(ptrs[4], BFloat16, (B, T, R2), 2)
                    i = (col - (D - RD)) // 2
                    cs = mCos[b, tq, i].to(Float32)
                    sn = mSin[b, tq, i].to(Float32)
                    y0 = x0 * cs + x1 * sn               # rotate by -position: (x0, x1) R(-theta)
                    y1 = x1 * cs - x0 * sn
                    x0 = y0
                    x1 = y1
            mOut[b, tq, h, col] = x0.to(BFloat16)
            mOut[b, tq, h, col + 1] = x1.to(BFloat16)
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile


def build_dsv4_ring_write_fp8_tile(block):
    """The ring write into V4.1's SWA records (dsv4_attention.quantize_window_fp8, bit for bit):
    thread i takes 8 values (a 16-byte unit) of a row; the 4 threads of a 32-value group (4
    consecutive lanes) share its max |x| by two shuffles; E = the max's biased exponent - 8, + 1
    when its mantissa exceeds 1.75, clamped to [0, 254]; the values * 2^(127 - E) to e4m3 (round
    to nearest even; |v| <= 448 by the choice of E) as two words; the group's first lane writes
    E into the record's scale bytes."""
    from .dsv4_attention import SCALE_GROUP, WINDOW_AMAX_FLOOR, window_record_words
    c = block.config
    B, T, HD, W = c.batch, c.q_tokens, c.head_dim, c.window
    T0 = max(0, T - W)
    U = HD // 8                              # 8-value units per row
    UG = SCALE_GROUP // 8                    # units per scale group (4 lanes)
    N = (T - T0) * U                         # a multiple of 32: whole warps per pass (shuffles)
    RW = window_record_words(HD)

    @cute.jit
    def tile(ptrs, b: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        mNew = gmem_tensor(ptrs[0], BFloat16, (B, T, U, 8), 16)
        mStart = gmem_tensor(ptrs[1], Int32, (B,), 4)
        mRec = gmem_tensor(ptrs[2], Int32, (B, W, RW // 2, 2), 8)          # 8-byte value pairs
        mRecB = gmem_tensor(ptrs[2], cutlass.Int8, (B, W, RW * 4), 1)      # the scale bytes
        start = mStart[b]
        v = cute.make_rmem_tensor((8,), Float32)
        for i in cutlass.range(tid, N, NUM_THREADS, unroll=1):
            tq = T0 + i // U
            u = i % U
            v.store(mNew[b, tq, u, None].load().to(Float32))
            a = cute.arch.fmax(v.load().reduce(cute.ReductionOp.MAX, Float32(0.0), 0),
                               (-v.load()).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
            for sh in cutlass.range_constexpr(2):
                a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << sh))
            e = ue8m0_exponent(cute.arch.fmax(a, Float32(WINDOW_AMAX_FLOOR)), 448.0)    # V4.1's floor
            inv = bits_to_f32((Int32(254) - e) << 23)                      # 2^(127 - E)
            row = (start + tq) % W
            rec = cute.make_rmem_tensor((2,), Int32)
            rec[0], rec[1], *_ = e4m3_piece([v[k] * inv for k in range(8)])  # (the remainders: unused)
            mRec[b, row, u, None].store(rec.load())
            if u % UG == 0:
                mRecB[b, row, HD + u // UG] = cutlass.Int8(e)

    return tile
