"""The MLA decode core tile on Hopper's warpgroup MMAs (`MLADecodeConfig.mma = "wgmma"`, sm_90a).

Why: at batch 1 the mma.sync tile (`_mla_cute.py`) is bound by its per-chunk instruction stream -
ldmatrix fragments, 8 warps' MMA chains, one 8-warp CTA a SM - not by the KV bytes (0.68 of copy
at 128K, Nsight Compute: 0.30 issues per scheduler-cycle). Here each warpgroup issues a chunk's
QK^T as 18 async wgmma instructions and its PV as 16, straight from shared memory.

The data layout makes one copy of a KV chunk serve both products:
- a stage holds CH = 64 tokens x d_qk bf16 in 128-byte swizzle atoms (8 tokens x 64 columns,
  16-byte pieces XOR-ed with token % 8), the atoms of a 64-column block for all 64 tokens
  together, then the next block: offset(t, d) = (d // 64) * 64 * 64 + t * 64 + d % 64 (swizzled);
- QK^T is computed transposed, S^T = K . Q^T: M = the chunk's 64 tokens, N = the tile's query rows
  (16 or 32), K = d_qk; A = the stage read K-major, B = Q (same atoms, rows for tokens);
- PV too, O^T = V^T . P^T: M = value columns, N = query rows, K = the chunk's tokens; A = the same
  stage read MN-major (V^T: columns contiguous, tokens strided - the same bytes), B = P (rows x
  64 tokens, one atom block).
The two warpgroups split QK^T's d_qk in halves (partial scores through shared memory, summed by
the softmax) and PV's value columns in halves (each holds O^T of d_v / 2 columns: 32 fp32
registers a thread at 16 rows). The softmax and masking are the mma.sync tile's: each warp owns
MP / 8 rows, P goes to shared memory (then a proxy fence: wgmma reads through the async proxy).

Pipeline: `stages` chunks of 64 tokens (2 fit beside Q at d_qk 576: 72 KB a stage), cp.async with
the swizzled destination computed per 16-byte piece; one chunk is in flight while the previous
one is computed. Outputs as the other tile: o_part (normalised, fp32) and lse_part.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from ._cute import DTYPE_MAP, TileSmem, fence_proxy_async_smem, gmem_tensor, smem_tensor
from ._mla_cute import (DEQUANT_BATCH, LOG2_E, chunk_first_row, dequant_convert, dequant_load_batch, first_chunks,
                        mask_future, online_softmax_step, split_chunks)
from .base import NUM_THREADS

NUM_WARPS = NUM_THREADS // 32
WG_THREADS = 128
ATOM = 64                                 # bf16 columns of one 128-byte swizzle row


def sw_tensor(dtype, addr, layout):
    """16-bit tensor at a 1 KB-aligned shared address through the 128-byte swizzle (an MMA
    operand view: the descriptors take the swizzle mode from the pointer)."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=1024)
    return cute.make_tensor(cute.recast_ptr(ptr, cute.make_swizzle(3, 4, 3), dtype=dtype), layout)


def pieces(dtype, addr, n):
    """The same bytes as n plain 16-byte pieces (the tile's own stores, swizzled by hand)."""
    e = 128 // dtype.width
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=1024)
    return cute.make_tensor(ptr, cute.make_layout((n, e), stride=(e, 1)))


def build_mla_decode_wgmma_tile(block):
    OWN = block.own_smem_bytes()
    c = block.config
    B, T, H = c.batch, c.q_tokens, c.heads
    R, MP = block.rows, block.m_pad
    TR, UR, RG = block.tile_rows, block.unit_rows, block.row_groups
    DQK, DV = block.d_qk, block.d_v
    CH = c.chunk                          # 64: one wgmma M extent of tokens
    ST = block.stages
    PS, MAXP, S = c.page_size, block.max_pages, c.num_splits
    KB = DQK // ATOM                      # 64-column blocks of a row
    PIECES = DQK // 8                     # 16-byte pieces of a row
    QP = MP * PIECES
    QPT = -(-QP // NUM_THREADS)
    STAGE_EL = CH * DQK                   # elements of a stage
    KH = DQK // 2 // 16                   # k16 steps of one warpgroup's half of d_qk
    DVG = DV // 2                         # value columns of one warpgroup
    SROW = block.score_row                # CH + 4
    RPW = MP // NUM_WARPS                 # softmax: rows of a warp (2 or 4) ..
    LPR = 32 // RPW                       # .. lanes of a row (16 or 8) ..
    EPL = CH // LPR                       # .. consecutive tokens of a lane (4 or 8)
    FP8 = block.fp8
    # the MMAs' operand type: f16 for an fp8 cache (as the mma.sync tile: e4m3 -> f16 is exact and
    # the scale one packed multiply), bf16 otherwise
    MDT = Float16 if FP8 else BFloat16
    kvdt = DTYPE_MAP[c.kv_dtype]
    ROW_BYTES = DQK * (1 if FP8 else 2)
    G = c.scale_group
    NG = DQK // G
    RS8 = DQK + 16                        # fp8 stage row stride (bytes): +16 B
    P8 = DQK // 16                        # fp8: 16-byte pieces of a row
    ROW_PIECES = P8 if FP8 else PIECES    # 16-byte pieces of a cache row
    NSC = CH * NG                         # fp8: scales per chunk
    SPT = -(-NSC // NUM_THREADS)
    NCV = CH * PIECES                     # fp8 dequant: 8-element units of a chunk (one f16 piece each)
    CVT = -(-NCV // NUM_THREADS)
    NBUF = 1 if FP8 else ST               # MMA-ready chunk buffers: the stages, or fp8's f16 one
    WHOLE_PAGE_CHUNKS = PS % CH == 0
    BEFORE_WAIT = c.kv_before_wait        # the first chunks' copies before griddepcontrol.wait
    scale_log2 = block.scale * LOG2_E
    scale_nat = block.scale
    NEG_INF = -math.inf
    assert MP % 16 == 0 and MP <= 32 and EPL <= 8 and 8 % EPL == 0

    def swz(row, piece):
        """Where 16-byte piece `piece` of row `row` lies in a swizzled operand (rows x KB 64-column
        blocks, from a 1 KB boundary): (column block, row, piece slot within the row's 128 bytes,
        XOR-ed with row % 8). The caller flattens it with its own row count (trace-time or
        dynamic ints)."""
        return (piece // 8, row, (piece % 8) ^ (row % 8))

    @cute.jit
    def cache_row(mBT, b, length, ci, j, page_row0):
        """Pool row of chunk row j, clamped to the sequence's last token (the mask drops it)."""
        tok = ci * CH + j
        if tok > length - 1:
            tok = length - 1
        row = Int32(0)
        if cutlass.const_expr(WHOLE_PAGE_CHUNKS):
            row = page_row0 + (tok - ci * CH)
        else:
            row = mBT[b, tok // PS] * PS + tok % PS
        return row

    @cute.jit
    def load_chunk(kv_addr, sc_addr, mBT, b, length, ci, page_row0, st, sPieces, sStage8, sScSt, tid, g2s, g2s4):
        """cp.async chunk ci (its first pool row page_row0, see chunk_first_row) into stage st: bf16
        rows straight into their swizzled places; fp8 rows into plain padded rows, with their
        scales (dequantised after the chunk lands)."""
        # the rows' 16-byte pieces: fp8 into the padded stage row, bf16 into the swizzled place
        for k in cutlass.range_constexpr(-(-CH * ROW_PIECES // NUM_THREADS)):
            i = tid + k * NUM_THREADS
            if i < CH * ROW_PIECES:
                j = i // ROW_PIECES
                p = i % ROW_PIECES
                row = cache_row(mBT, b, length, ci, j, page_row0)
                src = gmem_tensor(kv_addr + Int64(row) * Int64(ROW_BYTES) + Int64(p * 16), kvdt,
                                  (128 // kvdt.width,), 16)
                if cutlass.const_expr(FP8):
                    cute.copy(g2s, src, sStage8[st, j, p, None])
                else:
                    kb, r, pc = swz(j, p)
                    cute.copy(g2s, src, sPieces[((st * KB + kb) * CH + r) * 8 + pc, None])
        if cutlass.const_expr(FP8):
            for k in cutlass.range_constexpr(SPT):
                i = tid + k * NUM_THREADS
                if i < NSC:
                    j = i // NG
                    gi = i % NG
                    row = cache_row(mBT, b, length, ci, j, page_row0)
                    src = gmem_tensor(sc_addr + Int64(row) * Int64(NG * 4) + Int64(gi * 4), Float32, (1,), 4)
                    cute.copy(g2s4, src, sScSt[st, j, gi, None])

    @cute.jit
    def dequant(sStage8, sScSt, sBufW, tid, st):
        """fp8: stage st's e4m3 rows times their group scales -> the swizzled f16 chunk buffer
        (a unit: 8 e4m3 = 2 words -> 4 f16x2 words = one 16-byte piece)."""
        s8w = smem_tensor(sStage8.iterator.toint(), Int32, (ST, CH, RS8 // 8, 2))
        rw = cute.make_rmem_tensor((DEQUANT_BATCH, 2), Int32)
        rs = cute.make_rmem_tensor((DEQUANT_BATCH,), Float32)
        ro = cute.make_rmem_tensor((4,), Int32)
        for k0 in cutlass.range_constexpr(0, CVT, DEQUANT_BATCH):
            k1 = min(k0 + DEQUANT_BATCH, CVT)
            dequant_load_batch(s8w, sScSt, st, tid, k0, k1, NUM_THREADS, NCV, PIECES, G, rw, rs)
            for k in cutlass.range_constexpr(k0, k1):
                i = tid + k * NUM_THREADS
                if i < NCV:
                    dequant_convert(rw, rs, k - k0, ro)
                    kb, r, pc = swz(i // PIECES, i % PIECES)
                    sBufW[(kb * CH + r) * 8 + pc, None].store(ro.load())

    @cute.jit
    def softmax(sS, sPw, sRow, srow, lane, length, grow0, ci, m_run, l_run):
        """Warp w: the online softmax of rows w*RPW .. over chunk ci (the sum of the two
        warpgroups' partial scores); P (bf16) -> the swizzled sP, the rows' rescale factor, max
        and sum -> sRow. Returns the lane's row's running max and sum."""
        j0 = (lane % LPR) * EPL
        sc = cute.make_rmem_tensor((1, EPL), Float32)
        sc.store(cute.local_tile(sS[0, None, None], (1, EPL), (srow, lane % LPR)).load()
                 + cute.local_tile(sS[1, None, None], (1, EPL), (srow, lane % LPR)).load())
        if (ci + 1) * CH > length - T:    # the chunk reaches the new tokens or the end
            tqd = (grow0 + srow) // H
            if tqd > T - 1:
                tqd = T - 1
            mask_future(sc, ci * CH + j0, length, T, tqd)
        p, alpha, m_new, l_new = online_softmax_step(sc, m_run, l_run, scale_log2, LPR)
        # P's EPL tokens lie in one 16-byte piece of row srow (EPL divides 8)
        _, r, pc = swz(srow, j0 // 8)
        cute.local_tile(sPw, (1, EPL), (r * 8 + pc, (j0 % 8) // EPL)).store(p.to(MDT))
        if lane % LPR == 0:
            sRow[0, srow] = alpha
            sRow[1, srow] = m_new
            sRow[2, srow] = l_new
        return m_new, l_new

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        wg = tid // WG_THREADS
        s = t % S
        b = t // S
        grow0 = Int32(0)
        nrows = Int32(TR)
        if cutlass.const_expr(RG > 1):
            grow0 = (b % RG) * TR
            b = b // RG
            nrows = cutlass.min(Int32(TR), UR - grow0)
        row0 = grow0

        n_kv = 3 if FP8 else 2                 # index of block_table in the operand list
        mQ = gmem_tensor(ptrs[0], BFloat16, (B, R, PIECES, 8), 16)
        kv_addr = ptrs[1]
        sc_addr = ptrs[2] if FP8 else ptrs[1]
        mBT = gmem_tensor(ptrs[n_kv], Int32, (B, MAXP), 4)
        mLen = gmem_tensor(ptrs[n_kv + 1], Int32, (B,), 4)
        mO = gmem_tensor(ptrs[n_kv + 2], Float32, (B, S, R, DV), 4)
        mL = gmem_tensor(ptrs[n_kv + 3], Float32, (B, S, R), 4)

        # ---- shared memory: chunk buffers, Q, P at a 1 KB boundary (the swizzle atoms' period) ---
        smem = TileSmem(scratch, OWN)
        raw = smem.allocate_tensor(BFloat16, cute.make_layout(512 + NBUF * STAGE_EL + MP * DQK + MP * CH),
                                   byte_alignment=128)
        base = (raw.iterator.toint() + 1023) // 1024 * 1024
        q_addr = base + NBUF * STAGE_EL * 2
        p_addr = q_addr + MP * DQK * 2
        sStage8 = None
        sScSt = None
        if cutlass.const_expr(FP8):
            s8 = smem.allocate_tensor(kvdt, cute.make_layout(ST * CH * RS8), byte_alignment=128)
            sStage8 = cute.make_tensor(s8.iterator, cute.make_layout((ST, CH, P8, 16), stride=(CH * RS8, RS8, 16, 1)))
            sScSt = smem.allocate_tensor(Float32, cute.make_layout((ST, CH, NG, 1), stride=(CH * NG, NG, 1, 1)),
                                         byte_alignment=16)
        sS = smem.allocate_tensor(Float32, cute.make_layout((2, MP, CH), stride=(MP * SROW, SROW, 1)),
                                  byte_alignment=16)
        sRow = smem.allocate_tensor(Float32, cute.make_layout((3, MP), stride=(MP, 1)), byte_alignment=16)
        # MMA views. K (tokens x d_qk, per stage) K-major; V^T (value columns x tokens) MN-major,
        # this warpgroup's half of the columns; Q and P (rows x d_qk / tokens) K-major.
        sK = sw_tensor(MDT, base, cute.make_layout(((8, CH // 8), (ATOM, KB), NBUF),
                                                   stride=((ATOM, 8 * ATOM), (1, CH * ATOM), STAGE_EL)))
        sVt = sw_tensor(MDT, base + wg * (DVG // ATOM) * CH * ATOM * 2,
                        cute.make_layout(((ATOM, DVG // ATOM), (8, CH // 8), NBUF),
                                         stride=((1, CH * ATOM), (ATOM, 8 * ATOM), STAGE_EL)))
        sQ = sw_tensor(MDT, q_addr, cute.make_layout(((8, MP // 8), (ATOM, KB)),
                                                     stride=((ATOM, 8 * ATOM), (1, MP * ATOM))))
        sP = sw_tensor(MDT, p_addr, cute.make_layout(((8, MP // 8), (ATOM, CH // ATOM)),
                                                     stride=((ATOM, 8 * ATOM), (1, MP * ATOM))))
        sPieces = pieces(BFloat16, base, NBUF * STAGE_EL // 8)
        sBufW = pieces(Int32, base, STAGE_EL // 8)     # fp8: the f16 buffer as 4-word pieces
        sQw = pieces(MDT, q_addr, QP)
        sPw = pieces(MDT, p_addr, MP * CH // 8)

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), kvdt,
                                  num_bits_per_copy=128)
        g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

        # ---- split bounds (whole chunks) ----------------------------------------------------------
        length = mLen[b]
        c_lo, c_hi = split_chunks(length, CH, S, s)

        def issue_first(k):
            if c_lo + k < c_hi:
                load_chunk(kv_addr, sc_addr, mBT, b, length, c_lo + k,
                           chunk_first_row(mBT, b, c_lo + k, c_hi, CH, PS, WHOLE_PAGE_CHUNKS), k, sPieces, sStage8,
                           sScSt, tid, g2s, g2s4)

        first_chunks(issue_first, c_lo, length, T, CH, ST, BEFORE_WAIT)

        # the query rows (zero padding), swizzled like the keys
        rQ = cute.make_rmem_tensor((QPT, 8), BFloat16)
        for k in cutlass.range_constexpr(QPT):
            i = tid + k * NUM_THREADS
            if i < nrows * PIECES:
                rQ[k, None].store(mQ[b, row0 + i // PIECES, i % PIECES, None].load())
        for k in cutlass.range_constexpr(QPT):
            i = tid + k * NUM_THREADS
            if i < QP:
                r = i // PIECES
                p = i % PIECES
                kb, rr, pc = swz(r, p)
                dst = sQw[(kb * MP + rr) * 8 + pc, None]
                if r < nrows:
                    if cutlass.const_expr(FP8):
                        dst.store(rQ[k, None].load().to(Float32).to(Float16))
                    else:
                        dst.store(rQ[k, None].load())
                else:
                    dst.fill(0.0)
        fence_proxy_async_smem()                # Q (st.shared) -> the MMAs' async proxy; the chunk
                                                # loop's first barrier publishes it (cp.async chunks
                                                # need no fence: their wait and the barrier order them)

        # ---- the warpgroup MMAs ---------------------------------------------------------------------
        wtid = tid % WG_THREADS
        op_qk = warpgroup.MmaF16BF16Op(MDT, Float32, (CH, MP, 16), warpgroup.OperandSource.SMEM,
                                       OperandMajorMode.K, OperandMajorMode.K)
        op_pv = warpgroup.MmaF16BF16Op(MDT, Float32, (64, MP, 16), warpgroup.OperandSource.SMEM,
                                       OperandMajorMode.MN, OperandMajorMode.K)
        tiled_qk = cute.make_tiled_mma(cute.make_mma_atom(op_qk), (1, 1, 1))
        tiled_pv = cute.make_tiled_mma(cute.make_mma_atom(op_pv), (1, 1, 1))
        tiled_qk.set(warpgroup.Field.ACCUMULATE, True)    # every wgmma adds (accS zeroed per chunk)
        tiled_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_qk = tiled_qk.get_slice(wtid)
        thr_pv = tiled_pv.get_slice(wtid)
        tSrK = tiled_qk.make_fragment_A(thr_qk.partition_A(sK))        # (MMA, 1, DQK / 16, ST)
        tSrQ = tiled_qk.make_fragment_B(thr_qk.partition_B(sQ))        # (MMA, 1, DQK / 16)
        tOrV = tiled_pv.make_fragment_A(thr_pv.partition_A(sVt))       # (MMA, DVG / 64, CH / 16, ST)
        tOrP = tiled_pv.make_fragment_B(thr_pv.partition_B(sP))        # (MMA, 1, CH / 16)
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((CH, MP)), Float32)
        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((DVG, MP)), Float32)
        cS = thr_qk.partition_C(cute.make_identity_tensor((CH, MP)))   # (token, row) of accS
        cO = thr_pv.partition_C(cute.make_identity_tensor((DVG, MP)))  # (column, row) of accO
        accO.fill(0.0)

        srow = wid * RPW + lane // LPR
        if lane % LPR == 0:                     # a split without chunks: no key, lse = -inf
            sRow[1, srow] = NEG_INF
            sRow[2, srow] = 0.0
        m_run = Float32(NEG_INF)
        l_run = Float32(0.0)
        kv_row0_next = chunk_first_row(mBT, b, c_lo + ST - 1, c_hi, CH, PS, WHOLE_PAGE_CHUNKS)
        for ci in cutlass.range(c_lo, c_hi, unroll=1):
            it = ci - c_lo
            st = it % ST
            cute.arch.cp_async_wait_group(ST - 2)
            cute.arch.sync_threads()            # chunk ci landed; every warp is done with ci - 1
            nxt = ci + ST - 1
            kv_row0 = kv_row0_next
            kv_row0_next = chunk_first_row(mBT, b, nxt + 1, c_hi, CH, PS, WHOLE_PAGE_CHUNKS)   # a chunk ahead
            if nxt < c_hi:
                load_chunk(kv_addr, sc_addr, mBT, b, length, nxt, kv_row0, (it + ST - 1) % ST, sPieces,
                           sStage8, sScSt, tid, g2s, g2s4)
            cute.arch.cp_async_commit_group()
            buf = st
            if cutlass.const_expr(FP8):
                buf = 0
                dequant(sStage8, sScSt, sBufW, tid, st)
                fence_proxy_async_smem()        # the f16 chunk (st.shared) -> the MMAs' async proxy
                cute.arch.sync_threads()

            # S^T partial (this warpgroup's half of d_qk)
            accS.fill(0.0)
            warpgroup.fence()
            for k in cutlass.range_constexpr(KH):
                cute.gemm(tiled_qk, accS, tSrK[None, None, wg * KH + k, buf], tSrQ[None, None, wg * KH + k], accS)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            for i in cutlass.range_constexpr(cute.size(accS)):
                sS[wg, cS[i][1], cS[i][0]] = accS[i]
            cute.arch.sync_threads()            # both halves of chunk ci's scores in sS
            m_run, l_run = softmax(sS, sPw, sRow, srow, lane, length, grow0, ci, m_run, l_run)
            fence_proxy_async_smem()            # P (st.shared) -> the MMAs' async proxy
            cute.arch.sync_threads()            # P and the rescale factors shared

            for i in cutlass.range_constexpr(cute.size(accO)):
                accO[i] = accO[i] * sRow[0, cO[i][1]]
            warpgroup.fence()
            for k in cutlass.range_constexpr(CH // 16):
                cute.gemm(tiled_pv, accO, tOrV[None, None, k, buf], tOrP[None, None, k], accO)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: normalised partial output and its lse ---------------------------------------
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(cute.size(accO)):
            col = cO[i][0]
            r = cO[i][1]
            l = sRow[2, r]
            inv = Float32(0.0)
            if l > Float32(0.0):
                inv = Float32(1.0) / l
            if r < nrows:
                mO[b, s, row0 + r, wg * DVG + col] = accO[i] * inv
        if tid < MP:
            l = sRow[2, tid]
            lse = Float32(NEG_INF)
            if l > Float32(0.0):
                lse = sRow[1, tid] * scale_nat + cute.math.log(l, fastmath=False)
            if tid < nrows:
                mL[b, s, row0 + tid] = lse
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile
