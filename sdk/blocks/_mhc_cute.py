"""CuTe DSL device tiles of the mHC blocks (`mhc.py` documents the math, the cut and the layout),
and the post-mix that MHCPostBlock's tile shares with the all-reduce's mHC epilogue
(`post_mix_helpers`). Imports cutlass: imported only when a block's device tile is built."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ._cute import DTYPE_MAP, TileSmem, block_sum, gmem_tensor
from .base import NUM_THREADS
from .mhc import fn_slice_smem_bytes

NUM_WARPS = NUM_THREADS // 32


def _align(dtype: str) -> int:
    return 16 if dtype == "fp32" else 8          # bytes of a 4-element vector


def _partials_helpers(R, N, D, DS, fn_dtype):
    """(stage, partials): stage fn's slice in smem as fp32; one warp's partial dots of one token."""
    VPL = DS // 128
    V = DS // 4
    NVEC = R * N * V
    FULL = NVEC // NUM_THREADS          # vectors every thread stages
    STAGE_BATCH = 16                    # loads in flight per thread (16 x 4 registers at fp32)
    fdt = DTYPE_MAP[fn_dtype]

    @cute.jit
    def stage(fn_addr, t, sF, tid, barrier: cutlass.Constexpr = True):
        """fn's slice t into sF (fp32); barrier False: the caller's barrier orders it (a prologue)."""
        mF = gmem_tensor(fn_addr, fdt, (R, N, D // 4, 4), _align(fn_dtype))
        # STAGE_BATCH loads in flight, then their stores: a load-store pair at a time waited one
        # round trip per vector (12 a thread at V4.1's shapes)
        for k0 in cutlass.range_constexpr(0, FULL, STAGE_BATCH):
            ks = range(k0, min(k0 + STAGE_BATCH, FULL))
            vals = []
            for k in ks:
                i = tid + k * NUM_THREADS
                vals.append(mF[i // (N * V), (i // V) % N, t * V + i % V, None].load())
            for q, k in enumerate(ks):
                i = tid + k * NUM_THREADS
                sF[i // (N * V), (i // V) % N, i % V, None].store(vals[q].to(Float32))
        if cutlass.const_expr(NVEC % NUM_THREADS):
            i = tid + FULL * NUM_THREADS
            if i < NVEC:
                sF[i // (N * V), (i // V) % N, i % V, None].store(
                    mF[i // (N * V), (i // V) % N, t * V + i % V, None].load().to(Float32))
        if cutlass.const_expr(barrier):
            cute.arch.sync_threads()

    @cute.jit
    def partials(xs, sF, lane, mP, s, m):
        """xs: this lane's N * VPL 4-vectors (fp32 values as stored) of token m; writes mP[s, m, :]."""
        ss = Float32(0.0)
        for q in cutlass.range_constexpr(N * VPL):
            ss = ss + (xs[q] * xs[q]).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for r in cutlass.range_constexpr(R):
            acc = Float32(0.0)
            for n in cutlass.range_constexpr(N):
                for i in cutlass.range_constexpr(VPL):
                    f = sF[r, n, lane + 32 * i, None].load()
                    acc = acc + (xs[n * VPL + i] * f).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            acc = cute.arch.warp_reduction_sum(acc)
            if lane == 0:
                mP[s, m, r] = acc
        ss = cute.arch.warp_reduction_sum(ss)
        if lane == 0:
            mP[s, m, R] = ss

    return stage, partials


def build_mix_tile(block):
    c = block.config
    M, N, D, DS, R, S = c.m, c.n, c.d, c.d_slice, c.rows, block.slices
    VPL, V = DS // 128, DS // 4
    sdt = DTYPE_MAP[c.stream_dtype]
    stage, partials = _partials_helpers(R, N, D, DS, c.fn_dtype)

    def fn_view(scratch):
        smem = TileSmem(scratch, block.own_smem_bytes())
        return smem.allocate_tensor(Float32, cute.make_layout((R, N, V, 4), stride=(N * DS, DS, 4, 1)),
                                    byte_alignment=16)

    @cute.jit
    def prologue(ptrs, t: Int32, scratch):
        """fn's slice staged before the tile's wait (fn is a weight)."""
        tid, _, _ = cute.arch.thread_idx()
        stage(ptrs[1], t, fn_view(scratch), tid, False)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        mX = gmem_tensor(ptrs[0], sdt, (M, N, D // 4, 4), _align(c.stream_dtype))
        mP = gmem_tensor(ptrs[2], Float32, (S, M, R + 1), 4)
        sF = fn_view(scratch)                   # staged by the prologue
        for m in cutlass.range(wid, M, NUM_WARPS, unroll=1):
            xs = []
            for n in cutlass.range_constexpr(N):
                for i in cutlass.range_constexpr(VPL):
                    xs.append(mX[m, n, t * V + lane + 32 * i, None].load().to(Float32))
            partials(xs, sF, lane, mP, t, m)
        cute.arch.sync_threads()            # smem is reused by the next instruction

    return tile, prologue


def post_mix_helpers(M, N, D, DS, R2, stream_dtype, fn_dtype, round_coef=True):
    """(begin, mix_token): the mHC post-mix of one D-slice t, shared by MHCPostBlock's tile (y read
    from memory) and the all-reduce's mHC epilogue (y = the reduced sum, in registers).

    begin(fn_addr, t, tid, scratch[, staged]) -> sF
                                   all threads: stage fn_next's slice in smem (R2 > 0; ends with a
                                   barrier; staged: the prologue did) and return it; None without
                                   next partials
    prologue(fn_addr, t, tid, scratch)
                                   all threads, before the tile's wait: stage the slice, no barrier
    mix_token(addrs, sF, t, lane, m, ys)
                                   one warp, token m: X'_n = post_n y + sum_j comb[j, n] X_j over the
                                   lane's VPL 4-vectors of the slice (ys: y there as fp32 4-vectors),
                                   stored in the stream dtype, then (R2 > 0) the next mix's partials
                                   of the stored values into part_next[t, m, :].
                                   addrs = (streams, coef, streams_out, part_next) addresses."""
    NEXT = R2 > 0
    CW = (2 + N) * N
    S = D // DS
    VPL, V = DS // 128, DS // 4
    sdt = DTYPE_MAP[stream_dtype]
    SA = _align(stream_dtype)
    stage, partials = _partials_helpers(max(R2, 1), N, D, DS, fn_dtype)

    @cute.jit
    def rnd(x):
        """A scalar as stored in the stream dtype (V4's reference casts post / comb to it; V4.1's
        post-mix keeps them fp32: round_coef False)."""
        if cutlass.const_expr(not round_coef):
            return x
        v = cute.make_rmem_tensor((1,), Float32)
        v[0] = x
        return v.load().to(sdt).to(Float32)[0]

    def fn_view(scratch):
        """fn_next's slice in the tile's smem arena (None without next partials)."""
        if not NEXT:
            return None
        smem = TileSmem(scratch, fn_slice_smem_bytes(R2, N, DS))
        return smem.allocate_tensor(Float32, cute.make_layout((R2, N, V, 4), stride=(N * DS, DS, 4, 1)),
                                    byte_alignment=16)

    @cute.jit
    def begin(fn_addr, t: Int32, tid, scratch, staged: cutlass.Constexpr = False):
        """staged: a prologue already staged the slice (MHCPostBlock in the kernels)."""
        sF = fn_view(scratch)
        if cutlass.const_expr(NEXT and not staged):
            stage(fn_addr, t, sF, tid)
        return sF

    @cute.jit
    def prologue(fn_addr, t: Int32, tid, scratch):
        """Stage fn_next's slice before the tile's wait (no barrier: the kernel's orders it)."""
        stage(fn_addr, t, fn_view(scratch), tid, False)

    @cute.jit
    def mix_token(addrs, sF, t: Int32, lane, m, ys):
        mX = gmem_tensor(addrs[0], sdt, (M, N, D // 4, 4), SA)
        mC = gmem_tensor(addrs[1], Float32, (M, CW), 4)
        mXo = gmem_tensor(addrs[2], sdt, (M, N, D // 4, 4), SA)
        post = [rnd(mC[m, N + n]) for n in range(N)]
        comb = [rnd(mC[m, 2 * N + q]) for q in range(N * N)]      # comb[j, n] at j * N + n
        xs = [None] * (N * VPL)
        for i in cutlass.range_constexpr(VPL):
            v = t * V + lane + 32 * i
            xj = [mX[m, j, v, None].load().to(Float32) for j in range(N)]
            for n in cutlass.range_constexpr(N):
                acc = ys[i] * post[n]
                for j in cutlass.range_constexpr(N):
                    acc = acc + xj[j] * comb[j * N + n]
                st = acc.to(sdt)
                mXo[m, n, v, None].store(st)
                xs[n * VPL + i] = st.to(Float32)
        if cutlass.const_expr(NEXT):
            partials(xs, sF, lane, gmem_tensor(addrs[3], Float32, (S, M, R2 + 1), 4), t, m)

    return begin, mix_token, prologue


def build_post_tile(block):
    c = block.config
    M, DS = c.m, c.d_slice
    VPL, V = DS // 128, DS // 4
    ydt = DTYPE_MAP[c.y_dtype]
    begin, mix_token, _ = post_mix_helpers(M, c.n, c.d, DS, c.next_rows, c.stream_dtype, c.fn_dtype, c.round_coef)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        mY = gmem_tensor(ptrs[1], ydt, (M, c.d // 4, 4), _align(c.y_dtype))
        sF = begin(ptrs[3], t, tid, scratch, True)   # the prologue staged fn_next's slice before the wait
        for m in cutlass.range(wid, M, NUM_WARPS, unroll=1):
            ys = [mY[m, t * V + lane + 32 * i, None].load().to(Float32) for i in range(VPL)]
            mix_token((ptrs[0], ptrs[2], ptrs[4], ptrs[5]), sF, t, lane, m, ys)
        cute.arch.sync_threads()            # smem is reused by the next instruction

    return tile


def build_post_prologue(block):
    c = block.config
    _, _, prologue = post_mix_helpers(c.m, c.n, c.d, c.d_slice, c.next_rows, c.stream_dtype, c.fn_dtype, c.round_coef)

    @cute.jit
    def run(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        prologue(ptrs[3], t, tid, scratch)

    return run


def build_pre_tile(block):
    c = block.config
    M, N, D, S = c.m, c.n, c.d, c.slices
    R = block.rows
    CW = block.coef_width
    KIND = c.kind
    MEAN = KIND == "mean"
    SUB = KIND == "sublayer"
    COEF = block.rows > 0                # this tile computes coefficients (not "mean" / "carried")
    CARRIED = block.uses_carried         # V4.1: the collapse's pre is the previous site's (operand)
    COLLAPSE = c.collapse                # False: the coefficients only
    WRITE = c.write_coef                 # False: the pre only (for the collapse), no coef written
    NV = D // (4 * NUM_THREADS)
    LOGN = {1: 0, 2: 1, 4: 2}[N]
    sdt = DTYPE_MAP[c.stream_dtype]
    odt = DTYPE_MAP[c.out_dtype]
    NORM = c.out_norm
    PRE_AT = 64                          # scratch words [64, 64 + N): the pre coefficients
    SPLIT_AT = 128                       # scratch words [128, 128 + 8 * 32): the warps' partial sums
    # the collapse's stream (and norm weight) loads before everything else while they fit in 80
    # registers a thread (N = 4 with the norm: bf16 streams D <= 6144, fp32 D <= 4096)
    EARLY_STREAMS = NV * (N * (4 if c.stream_dtype == "fp32" else 2) + (4 if NORM else 0)) <= 80
    eps = c.hc_eps
    inv_nd = 1.0 / (N * D)

    @cute.jit
    def sigmoid(x):
        return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False))

    @cute.jit
    def row_sum(v):                      # over comb's columns j: the low log2(N) lane bits
        for k in cutlass.range_constexpr(LOGN):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << k, mask=-1, mask_and_clamp=31)
        return v

    @cute.jit
    def col_sum(v):                      # over comb's rows i: the next log2(N) lane bits
        for k in cutlass.range_constexpr(LOGN):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=N << k, mask=-1, mask_and_clamp=31)
        return v

    def load_streams(ptrs, t, tid):
        """This thread's stream vectors of token t, [NV][N] (as stored), then its norm weight
        vectors [NV] (NORM): the collapse's inputs."""
        mX = gmem_tensor(ptrs[0], sdt, (M, N, D // 4, 4), _align(c.stream_dtype))
        xs = [[mX[t, n, j * NUM_THREADS + tid, None].load() for n in range(N)] for j in range(NV)]
        if NORM:
            mW = gmem_tensor(ptrs[4], Float32, (D // 4, 4), 16)
            xs.append([mW[j * NUM_THREADS + tid, None].load() for j in range(NV)])
        return xs

    @cute.jit
    def collapse(ptrs, t: Int32, scratch, tid, xs):
        """The collapse (rounded to the stream dtype) with scratch's pre, and the fused RMSNorm;
        xs: load_streams' vectors."""
        mO = gmem_tensor(ptrs[7], odt, (M, D // 4, 4), _align(c.out_dtype))
        pres = [scratch[PRE_AT + n] for n in range(N)]
        vals = []
        ss = Float32(0.0)
        for j in cutlass.range_constexpr(NV):
            acc = xs[j][0].to(Float32) * pres[0]
            for n in cutlass.range_constexpr(1, N):
                acc = acc + xs[j][n].to(Float32) * pres[n]
            acc = acc.to(sdt).to(Float32)
            vals.append(acc)
            ss = ss + (acc * acc).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        if cutlass.const_expr(NORM):
            total = block_sum(ss, scratch)
            rstd2 = cute.math.rsqrt(total / Float32(D) + Float32(c.out_eps), fastmath=False)
            for j in cutlass.range_constexpr(NV):
                h = (vals[j] * rstd2).to(sdt).to(Float32)
                mO[t, j * NUM_THREADS + tid, None].store((h * xs[NV][j]).to(odt))
        else:
            for j in cutlass.range_constexpr(NV):
                mO[t, j * NUM_THREADS + tid, None].store(vals[j].to(odt))
        cute.arch.sync_threads()

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        wid = tid // 32
        xs = None
        if cutlass.const_expr(COLLAPSE and EARLY_STREAMS):
            # the streams are ready (this op waited for what wrote them): their loads go first, so
            # their latency passes under the partial sums and the coefficients' chain
            xs = load_streams(ptrs, t, tid)
        if cutlass.const_expr(CARRIED):
            # V4.1: the previous site's pre - the collapse needs nothing of this tile's own work,
            # so it goes first (the output is what the sublayer waits for)
            mK = gmem_tensor(ptrs[5], Float32, (M, (2 + N) * N), 4)
            if tid < N:
                scratch[PRE_AT + tid] = mK[t, tid]
            cute.arch.sync_threads()
            if cutlass.const_expr(not EARLY_STREAMS):
                xs = load_streams(ptrs, t, tid)
            collapse(ptrs, t, scratch, tid, xs)
        if cutlass.const_expr(MEAN):
            mC = gmem_tensor(ptrs[6], Float32, (M, CW), 4)
            if tid < N:
                scratch[PRE_AT + tid] = Float32(1.0 / N)
                mC[t, tid] = Float32(1.0 / N)
        if cutlass.const_expr(COEF):
            mC = gmem_tensor(ptrs[6], Float32, (M, CW), 4)
            mP = gmem_tensor(ptrs[1], Float32, (S, M, R + 1), 4)
            mB = gmem_tensor(ptrs[2], Float32, (R,), 4)
            mS = gmem_tensor(ptrs[3], Float32, (3 if SUB else 1,), 4)
            # the scales and biases (weights: ready) loaded first, not each behind a coef store
            ln = lane % N
            e = lane % (N * N)                             # lane (i, j) = (e // N, e % N)
            s_pre, b_pre = mS[0], mB[ln]
            if cutlass.const_expr(SUB and WRITE):
                s_post, b_post, s_comb, b_comb = mS[1], mB[N + ln], mS[2], mB[2 * N + e]
            # 1. the slices' partials -> scratch[0 .. R]: warp w sums slices w, w + 8, ... (its
            #    loads issued together), then R + 1 threads add the 8 warps' sums - one or two
            #    dependent L2 round trips, not S of them (40 at V4.1's D=5120, 8 at D=1024)
            if lane < R + 1:
                acc = Float32(0.0)
                for k in cutlass.range_constexpr(S // NUM_WARPS):
                    acc = acc + mP[wid + k * NUM_WARPS, t, lane]
                if cutlass.const_expr(S % NUM_WARPS):
                    if wid < S % NUM_WARPS:
                        acc = acc + mP[wid + (S // NUM_WARPS) * NUM_WARPS, t, lane]
                scratch[SPLIT_AT + wid * 32 + lane] = acc
            cute.arch.sync_threads()
            if tid < R + 1:
                acc = scratch[SPLIT_AT + tid]
                for w in cutlass.range_constexpr(1, NUM_WARPS):
                    acc = acc + scratch[SPLIT_AT + w * 32 + tid]
                scratch[tid] = acc
            cute.arch.sync_threads()
            # 2. the coefficients, warp 0
            if wid == 0:
                rstd = cute.math.rsqrt(scratch[R] * Float32(inv_nd) + Float32(c.norm_eps), fastmath=False)
                pre = sigmoid(scratch[ln] * rstd * s_pre + b_pre) + Float32(eps)
                if lane < N:
                    scratch[PRE_AT + lane] = pre
                    if cutlass.const_expr(WRITE):
                        mC[t, lane] = pre
                if cutlass.const_expr(SUB and WRITE):
                    post = Float32(2.0) * sigmoid(scratch[N + ln] * rstd * s_post + b_post)
                    if lane < N:
                        mC[t, N + lane] = post
                    v = scratch[2 * N + e] * rstd * s_comb + b_comb
                    mx = v
                    for k in cutlass.range_constexpr(LOGN):
                        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1 << k, mask=-1,
                                                                            mask_and_clamp=31))
                    ex = cute.math.exp(v - mx, fastmath=False)
                    cm = ex / row_sum(ex) + Float32(eps)
                    cm = cm / (col_sum(cm) + Float32(eps))
                    for _ in cutlass.range(c.iters - 1, unroll=1):
                        cm = cm / (row_sum(cm) + Float32(eps))
                        cm = cm / (col_sum(cm) + Float32(eps))
                    if lane < N * N:
                        mC[t, 2 * N + lane] = cm
        if cutlass.const_expr(COLLAPSE and not CARRIED):
            # 3. the collapse with this tile's own pre (or the mean's)
            cute.arch.sync_threads()
            if cutlass.const_expr(not EARLY_STREAMS):
                xs = load_streams(ptrs, t, tid)
            collapse(ptrs, t, scratch, tid, xs)
        elif cutlass.const_expr(COEF):
            cute.arch.sync_threads()       # scratch is reused by the next instruction

    return tile
