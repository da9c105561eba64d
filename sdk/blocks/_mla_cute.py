"""CuTe DSL device tiles of the MLA decode blocks (`mla_decode.py` documents the algorithm and the
formats). Imports cutlass: imported only when a block's device tile is built.

Layout idioms used below (standard CuTe):
- one-warp tiled MMAs over m16n8k16 bf16 (f16 for an fp8 cache; `warp.MmaF16BF16Op`, fp32
  accumulate), operands read from shared memory with `ldmatrix` (x4 for A, x2 for an 8-token B,
  x4 transposed for V);
- `mn_view(acc)`: the (rows, cols) view of an accumulator fragment ((2,2), M, N) for the
  per-row softmax; `a_view(p)`: the same registers viewed as the A operand of the next MMA
  (an m16n8 C fragment pair = one m16k16 A fragment), so P need not go through shared memory
  (the DSV4 tile; MLA decode shares the softmax rows out over its warps and P through smem);
- coordinates of every fragment element come from partitioning an identity tensor the same way,
  so masking and the epilogue never hard-code the MMA's thread layout;
- shared-memory rows of the KV chunks and of Q are padded by 16 bytes: 8 consecutive rows then
  start in 8 different bank groups and `ldmatrix` is conflict-free without a swizzle.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as cwarp

from ._cute import DTYPE_MAP, TileSmem, e4m3x4_to_f16x2x2, f32_to_f16x2_splat, gmem_tensor, mul_f16x2, smem_tensor
from .base import NUM_THREADS

NUM_WARPS = NUM_THREADS // 32
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def mn_view(acc):
    """((2,2), M, N) accumulator -> ((2, M), (2, N)) rows x cols view of the same registers."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
                          stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def a_view(p):
    """((2,2), M, N) C-layout registers (bf16) -> ((4, 2), M, N/2): the A operand of m16n8k16."""
    d = cute.logical_divide(p.layout, (None, None, 2))
    lay = cute.make_layout(((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
                           stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]))
    return cute.make_tensor(p.iterator, lay)


@cute.jit
def quad_max(v: Float32) -> Float32:
    v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31))
    return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31))


@cute.jit
def group_max(v: Float32, lanes: int) -> Float32:
    """Max over aligned groups of `lanes` consecutive lanes (a power of two), in every lane."""
    for k in cutlass.range_constexpr(int(math.log2(lanes))):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=lanes >> (k + 1), mask=-1, mask_and_clamp=31))
    return v


@cute.jit
def group_sum(v: Float32, lanes: int) -> Float32:
    """Sum over aligned groups of `lanes` consecutive lanes (a power of two), in every lane."""
    for k in cutlass.range_constexpr(int(math.log2(lanes))):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=lanes >> (k + 1), mask=-1, mask_and_clamp=31)
    return v


@cute.jit
def quad_sum(v: Float32) -> Float32:
    v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31)
    return v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31)


# fp8 dequant units a thread loads before it converts any. The units' shared loads then wait in
# flight together: a loop of load -> convert -> store runs one unit at a time, since the compiler
# cannot tell the e4m3 stage from the f16 buffer a store writes and keeps each load after the
# previous store.
DEQUANT_BATCH = 6


MBAR_MAX_TRIES = 1 << 22              # bounded mbarrier waits (each try_wait blocks up to a HW window)


@cute.jit
def mbar_init(addr: Int32):
    cute.arch.inline_ptx("mbarrier.init.shared::cta.b64 [{$r0}], 1;", read_only_args=[addr])


@cute.jit
def mbar_inval(addr: Int32):
    cute.arch.inline_ptx("mbarrier.inval.shared::cta.b64 [{$r0}];", read_only_args=[addr])


@cute.jit
def bulk_copies_g2s(bar: Int32, dst0: Int32, src0: Int64, n0: cutlass.Constexpr, dst1: Int32, src1: Int64,
                    n1: cutlass.Constexpr):
    """One thread: two cp.async.bulk copies global -> shared (sizes multiples of 16, addresses
    16-byte aligned) completing on the mbarrier at `bar`, which expects their bytes. The fence
    orders the barrier-ordered generic reads of the stage before the async proxy's writes."""
    cute.arch.inline_ptx("fence.proxy.async.shared::cta;")
    cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};",
                         read_only_args=[bar, Int32(n0 + n1)])
    for dst, src, n in ((dst0, src0, n0), (dst1, src1, n1)):
        cute.arch.inline_ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                             "[{$r0}], [{$r1}], {$r2}, [{$r3}];", read_only_args=[dst, src, Int32(n), bar])


@cute.jit
def mbar_wait(addr: Int32, phase: Int32):
    """Wait for the mbarrier's phase `phase` (parity) to complete; bounded: traps (a launch error
    the host sees) instead of hanging if the bytes never arrive."""
    done = Int32(0)
    tries = Int32(0)
    while done == 0:
        done = cute.arch.inline_ptx(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{$r0}], {$r1}; selp.u32 {$w0}, 1, 0, p; }",
            write_only_types=[Int32], read_only_args=[addr, phase])
        tries = tries + 1
        if tries > MBAR_MAX_TRIES:
            cute.arch.inline_ptx("trap;")


@cute.jit
def dequant_load_batch(s8w, sScSt, st: Int32, tid: Int32, k0: cutlass.Constexpr, k1: cutlass.Constexpr,
                       threads: cutlass.Constexpr, units: cutlass.Constexpr, per_row: cutlass.Constexpr,
                       group: cutlass.Constexpr, rw, rs, last_row=None):
    """Load half of the fp8 dequant, thread tid's turns k0 .. k1 - 1 over a chunk's units (unit i:
    e4m3 elements 8u .. 8u + 7 of row j = i // per_row, u = i % per_row, of stage st; s8w: the
    stages as (stage, row, unit, 2) words): the unit's 2 words -> rw[k - k0, :], its group's scale
    (sScSt) -> rs[k - k0]. A turn past the last unit loads that one again (harmless: the caller
    skips its store). `last_row`: rows past it read that row (a bulk-copied chunk's rows past the
    sequence's end hold whatever the page holds; their dequantised copies must stay finite)."""
    for k in cutlass.range_constexpr(k0, k1):
        i = tid + k * threads
        if cutlass.const_expr((k + 1) * threads > units):
            i = min(i, units - 1)
        j = i // per_row
        if cutlass.const_expr(last_row is not None):
            j = min(j, last_row)
        u = i % per_row
        rs[k - k0] = sScSt[st, j, (u * 8) // group, 0]
        rw[k - k0, None].store(s8w[st, j, u, None].load())


@cute.jit
def dequant_convert(rw, rs, k: cutlass.Constexpr, ro):
    """Convert half: loaded unit k's 2 e4m3 words times its scale -> ro: 4 f16x2 words (one exact
    cvt.rn.f16x2.e4m3x2 per pair, one packed multiply)."""
    sc2 = f32_to_f16x2_splat(rs[k])
    for w in cutlass.range_constexpr(2):
        lo, hi = e4m3x4_to_f16x2x2(rw[k, w])
        ro[2 * w] = mul_f16x2(lo, sc2)
        ro[2 * w + 1] = mul_f16x2(hi, sc2)


@cute.jit
def split_chunks(nk: Int32, chunk: cutlass.Constexpr, splits: cutlass.Constexpr, s: Int32):
    """Chunk range [c_lo, c_hi) of split s when the nk keys' chunks are cut into `splits` equal
    ranges of whole chunks (splits past the end get an empty range)."""
    n_chunks = (nk + chunk - 1) // chunk
    per = (n_chunks + splits - 1) // splits
    c_lo = s * per
    if c_lo > n_chunks:
        c_lo = n_chunks
    c_hi = c_lo + per
    if c_hi > n_chunks:
        c_hi = n_chunks
    return c_lo, c_hi


@cute.jit
def chunk_first_row(mBT, b: Int32, ci: Int32, c_hi: Int32, chunk: cutlass.Constexpr, page: cutlass.Constexpr,
                    whole_pages: cutlass.Constexpr):
    """First pool row of chunk ci (< c_hi) when chunks never straddle a page (`whole_pages`; else
    0: each row looks its own page up). The chunk loops read it one chunk ahead: a block-table
    load just before a chunk's copies put an L2 round trip into every chunk's issue."""
    row0 = Int32(0)
    if cutlass.const_expr(whole_pages):
        if ci < c_hi:
            row0 = mBT[b, (ci * chunk) // page] * page + (ci * chunk) % page
    return row0


@cute.jit
def first_chunks(issue, c_lo: Int32, length: Int32, q_tokens: cutlass.Constexpr, chunk: cutlass.Constexpr,
                 stages: cutlass.Constexpr, before_wait: cutlass.Constexpr):
    """The pipeline's first stages - 1 chunks, one cp.async group each (`issue(k)` copies chunk
    c_lo + k into stage k). `before_wait` (MLADecodeConfig.kv_before_wait): when those chunks hold
    only rows older than the step's q_tokens new ones, they are copied BEFORE griddepcontrol.wait,
    while the previous grid - which may write q and the new rows, not the older rows, the block
    table or the lengths - still runs; then the wait. Otherwise (or for a chunk range reaching the
    new rows) the copies follow the wait. The caller reads q and writes outputs after this.
    (The loop is written out in each branch: the DSL refuses a local function that a staged `if`
    calls when it captures the caller's names - SCOPE_CLOSURE_CAPTURE.)"""
    if cutlass.const_expr(before_wait):
        early = (c_lo + stages - 1) * chunk <= length - q_tokens
        if early:
            for k in cutlass.range_constexpr(stages - 1):
                issue(k)
                cute.arch.cp_async_commit_group()
        cute.arch.griddepcontrol_wait()
        if not early:
            for k in cutlass.range_constexpr(stages - 1):
                issue(k)
                cute.arch.cp_async_commit_group()
    else:
        for k in cutlass.range_constexpr(stages - 1):
            issue(k)
            cute.arch.cp_async_commit_group()


@cute.jit
def mask_future(sc, first_tok: Int32, length: Int32, q_tokens: cutlass.Constexpr, tq: Int32):
    """-inf on the scores sc (1, n) of tokens first_tok .. first_tok + n - 1 that query token tq
    (of the last q_tokens of a `length`-token sequence) may not see: token > length - T + tq."""
    for e in cutlass.range_constexpr(cute.size(sc)):
        if first_tok + e > length - q_tokens + tq:
            sc[0, e] = -math.inf


@cute.jit
def online_softmax_step(sc, m_run: Float32, l_run: Float32, scale_log2: cutlass.Constexpr,
                        lanes: cutlass.Constexpr):
    """One chunk of a row's online softmax, the row's scores spread over `lanes` aligned lanes
    (sc: this lane's (1, n) of them, unscaled): (P = exp(scale (s - m_new)), the rescale factor
    of the running output, the new running max and sum). A row with no visible key yet keeps max
    -inf and sum 0."""
    mx = group_max(sc.load().reduce(cute.ReductionOp.MAX, -math.inf, 0), lanes)
    m_new = cute.arch.fmax(m_run, mx)
    m_use = m_new
    if m_new == -math.inf:
        m_use = Float32(0.0)
    p = cute.math.exp2(sc.load() * scale_log2 - m_use * scale_log2, fastmath=True)
    alpha = cute.math.exp2(m_run * scale_log2 - m_use * scale_log2, fastmath=True)
    l_new = l_run * alpha + group_sum(p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), lanes)
    return p, alpha, m_new, l_new


def build_mla_decode_tile(block):
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    c = block.config
    B, T, H = c.batch, c.q_tokens, c.heads
    R, MP = block.rows, block.m_pad
    SPARSE = block.sparse                # DSA: keys = each query token's index list
    TR = block.tile_rows                 # query rows of one tile (at most 32) ..
    UR = block.unit_rows                 # .. of the unit's rows (T x H, or H when sparse) ..
    RG = block.row_groups                # .. cut into RG groups of TR (the last may have fewer)
    IW = max(c.index_width, 1)
    DQK, DV = block.d_qk, block.d_v
    CH, NWN, NWK = c.chunk, block.nwn, block.nwk
    KS = DQK // NWK                      # d_qk slice of one warp in QK^T
    TPW = block.tpw                      # tokens of one warp in QK^T
    Q_REGS = block.q_regs                # the warp's Q slice loaded into registers once
    DVW = DV // NUM_WARPS                # value columns of one warp in PV
    ST = block.stages
    PS, MAXP, S = c.page_size, block.max_pages, c.num_splits
    FP8 = block.fp8
    # the MMAs' operand type: f16 for an fp8 cache (e4m3 -> f16 is one exact conversion per pair
    # and the scale one packed multiply; to bf16 every element would take an fp32 round trip)
    MDT = Float16 if FP8 else BFloat16
    G = c.scale_group
    NG = DQK // G
    RS = DQK + 8                         # bf16 smem row stride (elements): +16 B
    BULK = block.bulk                    # fp8: a chunk's rows + scales as 2 bulk copies (whole pages)
    RS8 = DQK + (0 if BULK else 16)      # fp8 stage row stride (bytes): +16 B for cp.async's pieces
    SROW = block.score_row               # fp32 row stride of the partial scores sS: CH + 8
    EP = 16 if FP8 else 8                # elements per 16-byte piece
    PIECES = DQK // EP                   # 16-byte pieces per cache row
    NPIECE = CH * PIECES
    PPT = -(-NPIECE // NUM_THREADS)      # pieces per thread per chunk
    NSC = CH * NG                        # fp8: scales per chunk
    SPT = -(-NSC // NUM_THREADS)
    CV = DQK // 8                        # fp8 dequant: 8-element units per row (8-byte loads and
                                         # 16-byte stores of consecutive threads: no bank conflicts)
    NCV = CH * CV
    CVT = -(-NCV // NUM_THREADS)
    QPT = -(-MP * (DQK // 8) // NUM_THREADS)   # 16-byte query pieces per thread
    kvdt = DTYPE_MAP[c.kv_dtype]
    scale_log2 = block.scale * LOG2_E
    scale_nat = block.scale
    n_ops_kv = 3 if FP8 else 2           # index of block_table in the operand list
    n_ops_out = n_ops_kv + (3 if SPARSE else 2)   # index of o_part (sparse: index list before it)
    NEG_INF = -math.inf
    HIDDEN = 0x7FFFFFFF                  # sparse mask: a token no query sees
    ROW_BYTES = DQK * (1 if FP8 else 2)  # one cache row
    WHOLE_PAGE_CHUNKS = (not SPARSE) and PS % CH == 0   # dense chunks never straddle a page
    BEFORE_WAIT = c.kv_before_wait       # the first chunks' copies before griddepcontrol.wait
    NBUF = 1 if FP8 else ST              # MMA-ready chunk buffers: the stages, or fp8's f16 one
    RPW = MP // NUM_WARPS                # softmax: rows of one warp (2 or 4) ..
    LPR = 32 // RPW                      # .. lanes of one row (16 or 8) ..
    EPL = CH // LPR                      # .. and consecutive tokens of one lane (1 .. 8)
    PROW = block.p_row

    @cute.jit
    def token_of(mIdx, b, tq, length, nk, ci, j):
        """Cache token of chunk row j: ci*CH + j (dense) or the index list's entry there (sparse),
        clamped to a real token of the sequence (finite data; the mask drops the extras)."""
        tok = ci * CH + j
        if tok > nk - 1:
            tok = nk - 1
        if cutlass.const_expr(SPARSE):
            tok = mIdx[b, tq, tok]
            if tok < 0:
                tok = Int32(0)
        if tok > length - 1:
            tok = length - 1
        return tok

    @cute.jit
    def cache_row(mBT, mIdx, b, tq, length, nk, ci, j, page_row0):
        """Pool row of chunk row j (page_row0: the chunk's first row when it lies in one page)."""
        row = Int32(0)
        if cutlass.const_expr(WHOLE_PAGE_CHUNKS):
            last = nk - 1 - ci * CH             # rows past the sequence's end read its last token
            if j > last:
                j = last
            row = page_row0 + j
        else:
            tok = token_of(mIdx, b, tq, length, nk, ci, j)
            row = mBT[b, tok // PS] * PS + tok % PS
        return row

    @cute.jit
    def kv_row(kv_addr, row):
        """Cache row `row` as (PIECES, EP): addressed from a 64-bit base (a pool may hold more
        than 2^31 elements: Kimi K3 at 64 x 128K tokens is 4.8e9)."""
        return gmem_tensor(kv_addr + Int64(row) * Int64(ROW_BYTES), kvdt, (PIECES, EP), 16)

    @cute.jit
    def scale_row(sc_addr, row):
        return gmem_tensor(sc_addr + Int64(row) * Int64(NG * 4), Float32, (NG, 1), 4)

    @cute.jit
    def load_chunk(kv_addr, sc_addr, mBT, mIdx, b, tq, length, nk, ci, page_row0, st, sStage, sScSt, sTok, tid,
                   g2s, g2s4, bar_base):
        """cp.async the cache rows of chunk ci (in one page: from page_row0, chunk_first_row)
        into stage st (sparse: and the chunk's tokens for the mask into sTok[st], plain stores:
        read after the barriers the chunk passes). BULK: thread 0 copies the chunk's rows and
        their scales (contiguous within the page) as two bulk copies onto stage st's mbarrier."""
        if cutlass.const_expr(BULK):
            if tid == 0:
                bulk_copies_g2s(bar_base + st * 8,
                                sStage.iterator.toint() + st * (CH * RS8),
                                kv_addr + Int64(page_row0) * Int64(ROW_BYTES), CH * ROW_BYTES,
                                sScSt.iterator.toint() + st * (CH * NG * 4),
                                sc_addr + Int64(page_row0) * Int64(NG * 4), CH * NG * 4)
        else:
            for k in cutlass.range_constexpr(PPT):
                i = tid + k * NUM_THREADS
                if i < NPIECE:
                    j = i // PIECES
                    p = i % PIECES
                    row = cache_row(mBT, mIdx, b, tq, length, nk, ci, j, page_row0)
                    cute.copy(g2s, kv_row(kv_addr, row)[p, None], sStage[st, j, p, None])
            if cutlass.const_expr(FP8):             # the rows' scales, one 4-byte copy each
                for k in cutlass.range_constexpr(SPT):
                    i = tid + k * NUM_THREADS
                    if i < NSC:
                        row = cache_row(mBT, mIdx, b, tq, length, nk, ci, i // NG, page_row0)
                        cute.copy(g2s4, scale_row(sc_addr, row)[i % NG, None], sScSt[st, i // NG, i % NG, None])
        if cutlass.const_expr(SPARSE):
            for j in cutlass.range(tid, CH, NUM_THREADS, unroll=1):
                e = ci * CH + j
                tok = Int32(HIDDEN)
                if e < nk:
                    v = mIdx[b, tq, e]
                    if v >= 0:
                        tok = v
                sTok[st, j] = tok

    # ---- the chunk's phases (outside `tile`: staged control flow cannot call closures) ------
    @cute.jit
    def dequant(sStage, sScSt, skv, tid, st, dst, last):
        """fp8: stage st's e4m3 rows times their group scales -> f16 chunk buffer dst. A unit:
        8 e4m3 (2 words) -> 4 f16x2 words, each times the f16x2 scale. BULK: rows past `last`
        (the sequence's last token in the chunk) repeat it."""
        s8w = smem_tensor(sStage.iterator.toint(), Int32, (ST, CH, RS8 // 8, 2))
        skw = smem_tensor(skv.iterator.toint(), Int32, (NBUF, CH, RS // 8, 4))
        rw = cute.make_rmem_tensor((DEQUANT_BATCH, 2), Int32)
        rs = cute.make_rmem_tensor((DEQUANT_BATCH,), Float32)
        ro = cute.make_rmem_tensor((4,), Int32)
        for k0 in cutlass.range_constexpr(0, CVT, DEQUANT_BATCH):
            k1 = min(k0 + DEQUANT_BATCH, CVT)
            dequant_load_batch(s8w, sScSt, st, tid, k0, k1, NUM_THREADS, NCV, CV, G, rw, rs,
                               last if BULK else None)
            for k in cutlass.range_constexpr(k0, k1):
                i = tid + k * NUM_THREADS
                if i < NCV:
                    dequant_convert(rw, rs, k - k0, ro)
                    skw[dst, i // CV, i % CV, None].store(ro.load())

    @cute.jit
    def scores(sKV, sS, mma, frag_q, nw, kp, buf):
        """This warp's partial scores of chunk buffer buf (rows x TPW tokens over its d_qk
        slice) -> sS[kp]; two accumulators (even / odd k-steps): two MMA chains of half the
        length."""
        tiled_qk, thr_qk, thr_ck, cpy_q, cpy_k = mma
        tSrQ, tSsQ, tSrQv = frag_q
        sKw = cute.local_tile(sKV[buf, None, None], (TPW, KS), (nw, kp))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sKw))
        tSsK = thr_ck.partition_S(sKw)
        tSrKv = thr_ck.retile(tSrK)
        accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((MP, TPW)), Float32)
        accS2 = cute.make_rmem_tensor(thr_qk.partition_shape_C((MP, TPW)), Float32)
        accS.fill(0.0)
        accS2.fill(0.0)
        for k in cutlass.range_constexpr(KS // 16):
            if cutlass.const_expr(not Q_REGS):
                cute.copy(cpy_q, tSsQ[None, None, k], tSrQv[None, None, k])
            cute.copy(cpy_k, tSsK[None, None, k], tSrKv[None, None, k])
            acc_k = accS if k % 2 == 0 else accS2
            cute.gemm(tiled_qk, acc_k, tSrQ[None, None, k], tSrK[None, None, k], acc_k)
        accS.store(accS.load() + accS2.load())
        tSsS = thr_qk.partition_C(cute.local_tile(sS[kp, None, None], (MP, TPW), (0, nw)))
        for i in cutlass.range_constexpr(cute.size(accS)):
            tSsS[i] = accS[i]

    @cute.jit
    def softmax(sS, sP, sRow, sTok, srow, lane, length, tq, grow0, ci, st, m_run, l_run):
        """Warp w: the online softmax of rows w*RPW .. (LPR lanes x EPL tokens a row; the unit's
        rows grow0 + those) over chunk ci (stage st: the sparse mask's tokens): the scores are the
        sum of the NWK k-slices; P -> sP, the rows' rescale factor, max and sum -> sRow. Returns
        the lane's row's running max and sum."""
        j0 = (lane % LPR) * EPL
        sc = cute.make_rmem_tensor((1, EPL), Float32)
        sc.store(cute.local_tile(sS[0, None, None], (1, EPL), (srow, lane % LPR)).load())
        for kk in cutlass.range_constexpr(1, NWK):
            sc.store(sc.load() + cute.local_tile(sS[kk, None, None], (1, EPL), (srow, lane % LPR)).load())
        if cutlass.const_expr(SPARSE):
            for e in cutlass.range_constexpr(EPL):
                if sTok[st, j0 + e] > length - T + tq:
                    sc[0, e] = NEG_INF
        elif (ci + 1) * CH > length - T:    # the chunk reaches the new tokens or the end
            tqd = (grow0 + srow) // H
            if tqd > T - 1:
                tqd = T - 1
            mask_future(sc, ci * CH + j0, length, T, tqd)
        p, alpha, m_new, l_new = online_softmax_step(sc, m_run, l_run, scale_log2, LPR)
        cute.local_tile(sP, (1, EPL), (srow, lane % LPR)).store(p.to(MDT))
        if lane % LPR == 0:
            sRow[0, srow] = alpha
            sRow[1, srow] = m_new
            sRow[2, srow] = l_new
        return m_new, l_new

    @cute.jit
    def rescale_pv(accO, sRow, sKVt, mma, frag_p, wid, lane, buf):
        """O[:, this warp's value columns] = O * alpha + P @ V (chunk buffer buf)."""
        tiled_pv, thr_pv, thr_cv, cpy_v, cpy_p = mma
        tOrP, tOsP, tOrPv = frag_p
        accO_mn = mn_view(accO)
        cO_mn = mn_view(thr_pv.partition_C(cute.make_identity_tensor((MP, DVW))))
        for r in cutlass.range_constexpr(cute.size(accO_mn, mode=[0])):
            accO_mn[r, None] = accO_mn[r, None].load() * sRow[0, cO_mn[r, 0][0]]
        sVt = cute.local_tile(sKVt[buf, None, None], (DVW, CH), (wid, 0))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tOsV = thr_cv.partition_S(sVt)
        tOrVv = thr_cv.retile(tOrV)
        for k in cutlass.range_constexpr(CH // 16):
            cute.copy(cpy_p, tOsP[None, None, k], tOrPv[None, None, k])
            cute.copy(cpy_v, tOsV[None, None, k], tOrVv[None, None, k])
            cute.gemm(tiled_pv, accO, tOrP[None, None, k], tOrV[None, None, k], accO)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        s = t % S
        b = t // S
        grow0 = Int32(0)                        # the row group's first row within its unit
        nrows = Int32(TR)                       # .. and its row count
        if cutlass.const_expr(RG > 1):
            grow0 = (b % RG) * TR
            b = b // RG
            nrows = cutlass.min(Int32(TR), UR - grow0)
        tq = Int32(0)                           # sparse: the tile's query token
        if cutlass.const_expr(SPARSE):
            tq = b % T
            b = b // T
        row0 = tq * H + grow0                   # the tile's first query row

        mQ = gmem_tensor(ptrs[0], BFloat16, (B, R, DQK // 8, 8), 16)
        kv_addr = ptrs[1]
        sc_addr = ptrs[2] if FP8 else ptrs[1]
        mBT = gmem_tensor(ptrs[n_ops_kv], Int32, (B, MAXP), 4)
        mLen = gmem_tensor(ptrs[n_ops_kv + 1], Int32, (B,), 4)
        mIdx = None
        if cutlass.const_expr(SPARSE):
            mIdx = gmem_tensor(ptrs[n_ops_kv + 2], Int32, (B, T, IW), 4)
        mO = gmem_tensor(ptrs[n_ops_out], Float32, (B, S, R, DV), 4)
        mL = gmem_tensor(ptrs[n_ops_out + 1], Float32, (B, S, R), 4)

        smem = TileSmem(scratch, OWN)
        sQ = smem.allocate_tensor(MDT, cute.make_layout((MP, DQK), stride=(RS, 1)), byte_alignment=128)
        # partial scores, rows padded by 8 floats: the MMA fragments' 8-byte accesses (row g, columns
        # 2q, 2q+1) of a half-warp then cover 32 distinct banks; with CH-float rows (a multiple of
        # 32) every row started on bank 0 - 4 wavefronts where 1 does, on the tile's heaviest smem
        # traffic (every warp reads all NWK x MP x CH scores of a chunk)
        sS = smem.allocate_tensor(Float32, cute.make_layout((NWK, MP, CH), stride=(MP * SROW, SROW, 1)),
                                  byte_alignment=16)
        sStage = None
        sScSt = None
        if cutlass.const_expr(FP8):
            s8 = smem.allocate_tensor(kvdt, cute.make_layout((ST, CH, RS8), stride=(CH * RS8, RS8, 1)),
                                      byte_alignment=128)
            sStage = cute.make_tensor(s8.iterator, cute.make_layout((ST, CH, PIECES, EP),
                                                                    stride=(CH * RS8, RS8, EP, 1)))
            sScSt = smem.allocate_tensor(Float32, cute.make_layout((ST, CH, NG, 1), stride=(CH * NG, NG, 1, 1)),
                                         byte_alignment=16)
            skv = smem.allocate_tensor(MDT, cute.make_layout((NBUF, CH, RS), stride=(CH * RS, RS, 1)),
                                       byte_alignment=128)
        else:
            skv = smem.allocate_tensor(BFloat16, cute.make_layout((ST, CH, RS), stride=(CH * RS, RS, 1)),
                                       byte_alignment=128)
            sStage = cute.make_tensor(skv.iterator, cute.make_layout((ST, CH, PIECES, EP),
                                                                     stride=(CH * RS, RS, EP, 1)))
        sTok = None
        if cutlass.const_expr(SPARSE):
            sTok = smem.allocate_tensor(Int32, cute.make_layout((ST, CH), stride=(CH, 1)), byte_alignment=16)
        bar_base = Int32(0)
        if cutlass.const_expr(BULK):
            # one mbarrier per stage (arrival count 1: thread 0's expect_tx), fresh for every tile
            sBar = smem.allocate_tensor(Int64, cute.make_layout(ST), byte_alignment=8)
            bar_base = sBar.iterator.toint()
            if tid == 0:
                for s_ in cutlass.range_constexpr(ST):
                    mbar_init(bar_base + s_ * 8)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
        # P of the chunk (MMA operand type) and, per row, [0] the chunk's rescale factor, [1], [2]
        # the running max and sum (written by the row's softmax lanes)
        sP = smem.allocate_tensor(MDT, cute.make_layout((MP, CH), stride=(PROW, 1)), byte_alignment=16)
        sRow = smem.allocate_tensor(Float32, cute.make_layout((3, MP), stride=(MP, 1)), byte_alignment=16)
        sKV = cute.make_tensor(skv.iterator, cute.make_layout((NBUF, CH, DQK), stride=(CH * RS, RS, 1)))
        sKVt = cute.make_tensor(skv.iterator, cute.make_layout((NBUF, DQK, CH), stride=(CH * RS, 1, RS)))

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), kvdt,
                                  num_bits_per_copy=128)
        g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)

        # ---- split bounds (whole chunks), the query rows ---------------------------------------
        length = mLen[b]
        nk = length                             # keys walked: tokens, or index-list positions
        if cutlass.const_expr(SPARSE):
            nk = Int32(IW)
        c_lo, c_hi = split_chunks(nk, CH, S, s)

        # pipeline prologue first (the KV stream matters, Q is small)
        def issue_first(k):
            if c_lo + k < c_hi:
                load_chunk(kv_addr, sc_addr, mBT, mIdx, b, tq, length, nk, c_lo + k,
                           chunk_first_row(mBT, b, c_lo + k, c_hi, CH, PS, WHOLE_PAGE_CHUNKS), k, sStage, sScSt,
                           sTok, tid, g2s, g2s4, bar_base)

        first_chunks(issue_first, c_lo, length, T, CH, ST, BEFORE_WAIT)

        # the query rows: every thread's pieces loaded at once (an unroll-1 loop waited for each
        # load in turn - serial round trips in the tile's fixed cost), then stored (zero padding)
        sQv = cute.make_tensor(sQ.iterator, cute.make_layout((MP, DQK // 8, 8), stride=(RS, 8, 1)))
        rQ = cute.make_rmem_tensor((QPT, 8), BFloat16)
        for k in cutlass.range_constexpr(QPT):
            i = tid + k * NUM_THREADS
            if i < nrows * (DQK // 8):
                rQ[k, None].store(mQ[b, row0 + i // (DQK // 8), i % (DQK // 8), None].load())
        for k in cutlass.range_constexpr(QPT):
            i = tid + k * NUM_THREADS
            if i < MP * (DQK // 8):
                r = i // (DQK // 8)
                p = i % (DQK // 8)
                if r < nrows:
                    if cutlass.const_expr(FP8):
                        sQv[r, p, None].store(rQ[k, None].load().to(Float32).to(Float16))
                    else:
                        sQv[r, p, None].store(rQ[k, None].load())
                else:
                    sQv[r, p, None].fill(0.0)

        # ---- MMA machinery ---------------------------------------------------------------------
        mma_op = cwarp.MmaF16BF16Op(MDT, Float32, (16, 8, 16))
        tiled_qk = cute.make_tiled_mma(mma_op, (1, 1, 1))
        tiled_pv = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(16, 16, 16))
        thr_qk = tiled_qk.get_slice(lane)
        thr_pv = tiled_pv.get_slice(lane)
        cpy_q = cute.make_tiled_copy_A(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 4), MDT), tiled_qk)
        cpy_k = cute.make_tiled_copy_B(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 2), MDT), tiled_qk)
        cpy_v = cute.make_tiled_copy_B(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(True, 4), MDT), tiled_pv)
        thr_cq = cpy_q.get_slice(lane)
        thr_ck = cpy_k.get_slice(lane)
        thr_cv = cpy_v.get_slice(lane)

        nw = wid % NWN
        kp = wid // NWN
        sQk = cute.local_tile(sQ, (MP, KS), (0, kp))
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQk))
        tSsQ = thr_cq.partition_S(sQk)
        tSrQv = thr_cq.retile(tSrQ)
        if cutlass.const_expr(Q_REGS):
            cute.arch.sync_threads()            # Q staged
            for k in cutlass.range_constexpr(KS // 16):
                cute.copy(cpy_q, tSsQ[None, None, k], tSrQv[None, None, k])

        accO = cute.make_rmem_tensor(thr_pv.partition_shape_C((MP, DVW)), Float32)
        accO.fill(0.0)
        accO_mn = mn_view(accO)
        NROW = cute.size(accO_mn, mode=[0])
        cO_mn = mn_view(thr_pv.partition_C(cute.make_identity_tensor((MP, DVW))))   # (row, col) of accO
        srow = wid * RPW + lane // LPR          # softmax: this lane's row
        if lane % LPR == 0:                     # a split without chunks: no key, lse = -inf
            sRow[1, srow] = NEG_INF
            sRow[2, srow] = 0.0
        cpy_p = cute.make_tiled_copy_A(cute.make_copy_atom(cwarp.LdMatrix8x8x16bOp(False, 4), MDT), tiled_pv)
        thr_cp = cpy_p.get_slice(lane)
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_A(sP))
        tOsP = thr_cp.partition_S(sP)
        tOrPv = thr_cp.retile(tOrP)
        mma_qk = (tiled_qk, thr_qk, thr_ck, cpy_q, cpy_k)
        frag_q = (tSrQ, tSsQ, tSrQv)
        mma_pv = (tiled_pv, thr_pv, thr_cv, cpy_v, cpy_p)
        frag_p = (tOrP, tOsP, tOrPv)

        m_run = Float32(NEG_INF)
        l_run = Float32(0.0)
        kv_row0_next = chunk_first_row(mBT, b, c_lo + ST - 1, c_hi, CH, PS, WHOLE_PAGE_CHUNKS)
        for ci in cutlass.range(c_lo, c_hi, unroll=1):
            it = ci - c_lo
            st = it % ST
            if cutlass.const_expr(BULK):
                mbar_wait(bar_base + st * 8, (it // ST) % 2)    # the stage's (it // ST)-th fill
            else:
                cute.arch.cp_async_wait_group(ST - 2)
            cute.arch.sync_threads()            # chunk ci landed; every warp is done with ci - 1
            nxt = ci + ST - 1
            kv_row0 = kv_row0_next
            kv_row0_next = chunk_first_row(mBT, b, nxt + 1, c_hi, CH, PS, WHOLE_PAGE_CHUNKS)   # a chunk ahead
            if nxt < c_hi:
                load_chunk(kv_addr, sc_addr, mBT, mIdx, b, tq, length, nk, nxt, kv_row0, (it + ST - 1) % ST,
                           sStage, sScSt, sTok, tid, g2s, g2s4, bar_base)
            cute.arch.cp_async_commit_group()
            buf = st
            if cutlass.const_expr(FP8):
                buf = 0
                dequant(sStage, sScSt, skv, tid, st, 0, nk - 1 - ci * CH)
                cute.arch.sync_threads()
            scores(sKV, sS, mma_qk, frag_q, nw, kp, buf)
            cute.arch.sync_threads()            # all partial scores of chunk ci in sS
            m_run, l_run = softmax(sS, sP, sRow, sTok, srow, lane, length, tq, grow0, ci, st, m_run, l_run)
            cute.arch.sync_threads()            # P and the rescale factors of chunk ci shared
            rescale_pv(accO, sRow, sKVt, mma_pv, frag_p, wid, lane, buf)

        cute.arch.cp_async_wait_group(0)        # nothing in flight when the tile ends
        if cutlass.const_expr(BULK):
            # every fill was waited for in the loop (and a barrier passed since): retire the
            # mbarriers before the next instruction reuses their shared memory
            if tid == 0:
                for s_ in cutlass.range_constexpr(ST):
                    mbar_inval(bar_base + s_ * 8)

        # ---- epilogue: normalised partial output and its lse ----------------------------------
        cute.arch.sync_threads()                # the row owners' last max / sum (or their init)
        for r in cutlass.range_constexpr(NROW):
            m_ = cO_mn[r, 0][0]
            l = sRow[2, m_]
            inv = Float32(0.0)
            lse = Float32(NEG_INF)
            if l > Float32(0.0):
                inv = Float32(1.0) / l
                lse = sRow[1, m_] * scale_nat + cute.math.log(l, fastmath=False)
            if m_ < nrows:
                for cc in cutlass.range_constexpr(cute.size(accO_mn, mode=[1])):
                    mO[b, s, row0 + m_, wid * DVW + cO_mn[r, cc][1]] = accO_mn[r, cc] * inv
                if wid == 0 and lane % 4 == 0:
                    mL[b, s, row0 + m_] = lse
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile


def build_mla_combine_tile(block):
    OWN = block.own_smem_bytes()          # its TileSmem capacity
    c = block.config
    B, T, H, DV, S = c.batch, c.q_tokens, c.heads, c.d_v, c.num_splits
    R = T * H
    CW = block.cols_per_tile             # output columns of one tile
    NCQ = DV // CW
    CG = CW // 4                         # 16-byte column groups of a tile
    SG = NUM_THREADS // CG               # split groups: thread (sg, cg) sums splits sg, sg + SG, ..
    LPL = -(-S // 32)                    # lse values per lane of warp 0
    NEG_INF = -math.inf

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        cq = t % NCQ
        h = (t // NCQ) % H
        tq = (t // (NCQ * H)) % T
        b = t // (NCQ * H * T)
        r = tq * H + h
        mO = gmem_tensor(ptrs[0], Float32, (B, S, R, DV // 4, 4), 16)
        mL = gmem_tensor(ptrs[1], Float32, (B, S, R), 4)
        mOut = gmem_tensor(ptrs[2], BFloat16, (B, T, H, DV), 2)
        mLse = gmem_tensor(ptrs[3], Float32, (B, T, H), 4)
        smem = TileSmem(scratch, OWN)
        sW = smem.allocate_tensor(Float32, cute.make_layout(S), byte_alignment=16)
        sR = smem.allocate_tensor(Float32, cute.make_layout((SG, CW), stride=(CW, 1)), byte_alignment=16)
        # ---- the splits' weights: warp 0 holds the S lse values (all loads in flight at once;
        # loops of dependent loads were serial round trips in a batch-1 step's fixed cost),
        # reduces max and sum of exp, and writes each split's weight exp(lse_s - lse) -----------
        if tid < 32:
            lv = cute.make_rmem_tensor((LPL,), Float32)
            for k in cutlass.range_constexpr(LPL):
                lv[k] = NEG_INF
                if lane + 32 * k < S:
                    lv[k] = mL[b, lane + 32 * k, r]
            mx = lv.load().reduce(cute.ReductionOp.MAX, NEG_INF, 0)
            for off in cutlass.range_constexpr(5):
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1 << off, mask=-1,
                                                                     mask_and_clamp=31))
            ex = cute.make_rmem_tensor((LPL,), Float32)
            ex.fill(0.0)
            if mx != NEG_INF:
                ex.store(cute.math.exp(lv.load() - mx, fastmath=True))
            den = ex.load().reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for off in cutlass.range_constexpr(5):
                den = den + cute.arch.shuffle_sync_bfly(den, offset=1 << off, mask=-1, mask_and_clamp=31)
            inv = Float32(0.0)
            if den > Float32(0.0):
                inv = Float32(1.0) / den
            for k in cutlass.range_constexpr(LPL):
                if lane + 32 * k < S:
                    sW[lane + 32 * k] = ex[k] * inv
            if tid == 0 and cq == 0:
                lse = Float32(NEG_INF)
                if den > Float32(0.0):
                    lse = mx + cute.math.log(den, fastmath=False)
                mLse[b, tq, h] = lse
        cute.arch.sync_threads()
        # ---- weighted sum: 16-byte loads, several splits in flight per thread -----------------
        cg = tid % CG
        sg = tid // CG
        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for sp in cutlass.range(sg, S, SG, unroll=4):
            acc.store(acc.load() + mO[b, sp, r, cq * CG + cg, None].load() * sW[sp])
        for e in cutlass.range_constexpr(4):
            sR[sg, cg * 4 + e] = acc[e]
        cute.arch.sync_threads()
        for col in cutlass.range(tid, CW, NUM_THREADS, unroll=1):
            v = Float32(0.0)
            for g in cutlass.range_constexpr(SG):
                v = v + sR[g, col]
            mOut[b, tq, h, cq * CW + col] = v.to(BFloat16)
        cute.arch.sync_threads()                # smem is reused by the next instruction

    return tile


def build_head_proj_tile(block):
    c = block.config
    H, N, K, M = c.heads, c.n, c.k, c.m
    XS, YS = block.xs, block.ys
    RPT = c.rows_per_tile
    KP = K // 8                          # 16-byte pieces per row
    PPL = -(-KP // 32)                   # pieces per lane
    MG = min(M, 8)                       # tokens accumulated at once
    NGRP = -(-M // MG)
    per = N // RPT

    @cute.jit
    def views(ptrs, t: Int32):
        """(lane, warp, head, row block of the head, x, w, y views) of tile t."""
        tid, _, _ = cute.arch.thread_idx()
        return (tid % 32, tid // 32, t // per, t % per,
                gmem_tensor(ptrs[0], BFloat16, (M, H, XS // 8, 8), 16),
                gmem_tensor(ptrs[1], BFloat16, (H, N, KP, 8), 16),
                gmem_tensor(ptrs[2], BFloat16, (M, H, YS), 2))

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        lane, wid, h, j, mX, mW, mY = views(ptrs, t)
        acc = cute.make_rmem_tensor((MG,), Float32)
        for r in cutlass.range(wid, RPT, NUM_WARPS, unroll=1):
            n = j * RPT + r
            wv = [mW[h, n, lane + 32 * u, None].load().to(Float32) if (KP % 32 == 0 or u < PPL - 1)
                  else None for u in range(PPL)]
            for g in cutlass.range(NGRP, unroll=1):
                acc.fill(0.0)
                for u in cutlass.range_constexpr(PPL):
                    p = lane + 32 * u
                    if cutlass.const_expr(KP % 32 == 0 or u < PPL - 1):
                        for mm in cutlass.range_constexpr(MG):
                            m = g * MG + mm
                            if m < M:
                                xv = mX[m, h, p, None].load().to(Float32)
                                acc[mm] = acc[mm] + (wv[u] * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    else:
                        if p < KP:
                            w_last = mW[h, n, p, None].load().to(Float32)
                            for mm in cutlass.range_constexpr(MG):
                                m = g * MG + mm
                                if m < M:
                                    xv = mX[m, h, p, None].load().to(Float32)
                                    acc[mm] = acc[mm] + (w_last * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                for mm in cutlass.range_constexpr(MG):
                    v = cute.arch.warp_reduction_sum(acc[mm])
                    m = g * MG + mm
                    if lane == 0 and m < M:
                        mY[m, h, n] = v.to(BFloat16)

    RIF = c.rows_in_flight
    RPW = RPT // NUM_WARPS               # rows of a warp: wid, wid + NUM_WARPS, ...

    @cute.jit
    def tile_in_flight(ptrs, t: Int32, scratch):
        """rows_in_flight: the lane's x pieces of a token group loaded once for all the tile's
        rows, then RIF rows' weights issued before any is used (one row at a time made every row
        a dependent DRAM round trip: the W_UK tiles took 5.7 us on Kimi K3's batch-1 critical
        path). Pieces past k and tokens past m read clamped addresses and are masked out."""
        lane, wid, h, j, mX, mW, mY = views(ptrs, t)
        pcs = [Int32(cutlass.select_(lane + 32 * u < KP, lane + 32 * u, KP - 1)) for u in range(PPL)]
        oks = [Float32(cutlass.select_(lane + 32 * u < KP, 1.0, 0.0)) for u in range(PPL)]
        for g in cutlass.range(NGRP, unroll=1):
            ms = [Int32(cutlass.select_(g * MG + mm < M, g * MG + mm, M - 1)) for mm in range(MG)]
            xv = [[mX[ms[mm], h, pcs[u], None].load() for u in range(PPL)] for mm in range(MG)]
            for r0 in cutlass.range(0, RPW, RIF, unroll=1):
                ns = [j * RPT + wid + NUM_WARPS * (r0 + i) for i in range(RIF)]
                wv = [[mW[h, ns[i], pcs[u], None].load() for u in range(PPL)] for i in range(RIF)]
                # every (row, token) sum before any store: the RIF x MG warp reductions interleave
                sums = []
                for i in cutlass.range_constexpr(RIF):
                    for mm in cutlass.range_constexpr(MG):
                        a = Float32(0.0)
                        for u in cutlass.range_constexpr(PPL):
                            d = (wv[i][u].to(Float32) * xv[mm][u].to(Float32)).reduce(cute.ReductionOp.ADD,
                                                                                    Float32(0.0), 0)
                            a = a + d * oks[u]
                        sums.append(cute.arch.warp_reduction_sum(a))
                for i in cutlass.range_constexpr(RIF):
                    for mm in cutlass.range_constexpr(MG):
                        if lane == 0 and g * MG + mm < M:
                            mY[g * MG + mm, h, ns[i]] = sums[i * MG + mm].to(BFloat16)

    return tile_in_flight if RIF else tile
