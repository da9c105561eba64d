"""CuTe DSL device code of the EP blocks (imports cutlass: imported by `_EPBase._build_device_tile`
only). The data layout, the flag protocol and why it is safe are in sdk/blocks/ep.py.

All stores to peers are plain 16-byte vector stores; a tile publishes them with a CTA barrier,
then thread 0's `fence.acq_rel.sys` and one `st.release.sys` of the epoch per rank (the
all-reduce's pattern, sdk/blocks/allreduce.py). Waits are `ld.acquire.sys` polls by several
threads at once (one round trip when everything has arrived), bounded by globaltimer and by the
rank's error word.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ._cute import DTYPE_MAP, block_compact, gmem_tensor, peer_wait, write_hit_list
from .allreduce import PARAMS_WORDS
from .base import NUM_THREADS, SCRATCH_WORDS

_ST = SCRATCH_WORDS - 1          # scratch word: "every poll of the tile succeeded"
NT = NUM_THREADS


def build(block):
    from .ep import EPCombineBlock, EPDispatchBlock, EPTableBlock
    if isinstance(block, EPDispatchBlock):
        return _dispatch(block)
    if isinstance(block, EPTableBlock):
        return _table(block)
    if isinstance(block, EPCombineBlock):
        return _combine(block)
    raise TypeError(type(block).__name__)


def _common(block):
    c = block.config
    ix = {n: i for i, n in enumerate(block.operands())}
    return c, ix, c.ranks, c.m, c.hidden, c.top_k, block.local


@cute.jit
def _raise_flags(ptrs, first: cutlass.Constexpr, N: cutlass.Constexpr, idx: Int32, e: Int32):
    """Thread 0, after a CTA barrier: make the CTA's stores visible system-wide, then store the
    epoch into flag idx of every rank (operands first .. first + N - 1 are their flag arrays)."""
    cute.arch.fence_acq_rel_sys()
    for k in cutlass.range_constexpr(N):
        fb = cute.make_ptr(Int32, ptrs[first + k], cute.AddressSpace.gmem, assumed_align=4)
        cute.arch.store(fb + idx, e, sem="release", scope="sys")


def _dispatch(b):
    c, ix, N, M, D, K, L = _common(b)
    C, W8, D8, T = b.chunks, b.cols // 8, D // 8, b.dispatch_tiles
    NV = -(-W8 // NT)

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        mPar = gmem_tensor(ptrs[ix["params"]], Int32, (PARAMS_WORDS,), 4)
        mSt = gmem_tensor(ptrs[ix["state"]], Int32, (T,), 4)
        rank = mPar[0]
        e = mSt[t] + 1
        m = t // C
        cc = t - m * C
        mX = gmem_tensor(ptrs[ix["x"]], BFloat16, (M, D8, 8), 16)
        mIds = gmem_tensor(ptrs[ix["topk_ids"]], Int32, (M, K), 4)
        # owners of token m's experts, one bit per rank
        mask = Int32(0)
        for j in cutlass.range_constexpr(K):
            mask = mask | (Int32(1) << (mIds[m, j] // L))
        row = rank * M + m
        # peer tensors made once, outside staged control flow (values made inside an `if` body
        # cannot be used in another)
        mR = [gmem_tensor(ptrs[ix[f"recv_x_{o}"]], BFloat16, (N * M, D8, 8), 16) for o in range(N)]
        mMeta = [gmem_tensor(ptrs[ix[f"meta_{o}"]], Int32, (N * M, K), 4) for o in range(N)]
        for o in cutlass.range_constexpr(N):
            if ((mask >> o) & 1) != 0:
                # the row is re-read per owner (from L1/L2): a vector loaded outside this staged
                # `if` cannot be used inside it
                for jv in cutlass.range_constexpr(NV):
                    u = tid + NT * jv
                    if u < W8:
                        col = cc * W8 + u
                        mR[o][row, col, None].store(mX[m, col, None].load())
        if cc == 0:
            # every rank gets all k entries (-1: not its expert), so no stale entry survives
            if tid < K:
                eid = mIds[m, tid]
                for o in cutlass.range_constexpr(N):
                    le = eid - o * L
                    mMeta[o][row, tid] = Int32(cutlass.select_((le >= 0) & (le < L), le, Int32(-1)))
        cute.arch.sync_threads()
        if tid == 0:
            _raise_flags(ptrs, ix["dflags_0"], N, t * N + rank, e)
            mSt[t] = e

    return tile


def _table(b):
    c, ix, N, M, D, K, L = _common(b)
    NF = b.dispatch_tiles * N           # flags to poll
    NA = N * M * K                      # metadata entries

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        mPar = gmem_tensor(ptrs[ix["params"]], Int32, (PARAMS_WORDS,), 4)
        mSt = gmem_tensor(ptrs[ix["state"]], Int32, (1,), 4)
        e = mSt[0] + 1
        tmo = Int64(mPar[1]) * Int64(1000)
        ebase = cute.make_ptr(Int32, ptrs[ix["err"]], cute.AddressSpace.gmem, assumed_align=4)
        faddr = ptrs[ix["dflags_self"]]
        fbase = cute.make_ptr(Int32, faddr, cute.AddressSpace.gmem, assumed_align=4)
        flag_id = Int32(faddr % Int64(1 << 31))
        if tid == 0:
            scratch[_ST] = Float32(1.0)
        cute.arch.sync_threads()
        # every source's every dispatch tile: NF flags, polled NT at a time
        st = Int32(1)
        for i in cutlass.range(tid, NF, NT, unroll=1):
            if st == 1:
                st = peer_wait(fbase, i, e, tmo, ebase, t, flag_id, N)
        if st == 0:
            scratch[_ST] = Float32(0.0)
        cute.arch.sync_threads()
        if scratch[_ST] > Float32(0.5):
            cnt = cute.make_ptr(Int32, ptrs[ix["counts"]], cute.AddressSpace.gmem, assumed_align=4)
            mMeta = gmem_tensor(ptrs[ix["meta_self"]], Int32, (NA,), 4)
            mTok = gmem_tensor(ptrs[ix["tok"]], Int32, (L, N * M), 4)
            mSlot = gmem_tensor(ptrs[ix["slot"]], Int32, (L, N * M), 4)
            mHits = gmem_tensor(ptrs[ix["hits"]], Int32, (L + 1,), 4)
            for le in cutlass.range(tid, L, NT):
                cute.arch.store(cnt + le, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.sync_threads()
            # the order inside an expert's list does not matter: every assignment has its own
            # act / y row (slot) and the source sums in choice order
            for a in cutlass.range(tid, NA, NT, unroll=1):
                le = mMeta[a]
                if le >= 0:
                    pos = cute.arch.atomic_add(cnt + le, Int32(1), sem="relaxed", scope="gpu")
                    mTok[le, pos] = a // K
                    mSlot[le, pos] = a
            cute.arch.sync_threads()
            # hit list: local experts with assignments, ascending
            n_le = Int32(0)
            if tid < L:
                n_le = cute.arch.load(cnt + tid, Int32, sem="relaxed", scope="gpu")
            write_hit_list(n_le, mHits, scratch)
            if tid == 0:
                mSt[0] = e

    return tile


def _combine(b):
    c, ix, N, M, D, K, L = _common(b)
    C, W8, D8, T = b.chunks, b.cols // 8, D // 8, b.dispatch_tiles
    NV = -(-W8 // NT)
    NK = N * K                          # token m's assignments over all sources
    ROUNDS = -(-NK // NT)
    NW = NT // 32
    G = min(8, -(-W8 // 32))            # vectors in flight per lane while copying a hit
    NG = -(-W8 // (32 * G))
    assert NW + NT <= _ST, "combine: hit list does not fit the scratch"
    wdt = DTYPE_MAP[c.wire]
    odt = DTYPE_MAP[c.out_dtype]
    has_shared = c.shared

    @cute.jit
    def tile(ptrs, t: Int32, scratch):
        tid, _, _ = cute.arch.thread_idx()
        mPar = gmem_tensor(ptrs[ix["params"]], Int32, (PARAMS_WORDS,), 4)
        mSt = gmem_tensor(ptrs[ix["state"]], Int32, (T,), 4)
        rank = mPar[0]
        e = mSt[t] + 1
        tmo = Int64(mPar[1]) * Int64(1000)
        ebase = cute.make_ptr(Int32, ptrs[ix["err"]], cute.AddressSpace.gmem, assumed_align=4)
        m = t // C
        cc = t - m * C
        # 1. as owner: return this rank's expert outputs for token m of every source. Token m's
        #    N*K assignments are read one per thread (one round trip; a loop over them, each
        #    entry's load before its branch, was N*K = 64 dependent round trips: the combine after
        #    the last rank was ready took 19 / 144 us at batch 1 / 64 on the H200, now 9.5 / 80),
        #    this rank's hits compacted into smem (warp ballot + popc prefix), then one warp per
        #    hit copies its row chunk with G vectors in flight per lane.
        mY = gmem_tensor(ptrs[ix["y"]], wdt, (N * M * K, D8, 8), 16)
        mMeta = gmem_tensor(ptrs[ix["meta_self"]], Int32, (N * M, K), 4)
        lane = tid % 32
        warp = tid // 32
        buf = cute.make_rmem_tensor((G, 8), wdt)
        for rnd in cutlass.range_constexpr(ROUNDS):
            a = tid + NT * rnd
            ac = Int32(cutlass.select_(a < NK, a, Int32(NK - 1)))
            sa = ac // K
            le = mMeta[sa * M + m, ac - sa * K]
            hit = (a < NK) & (le >= 0)
            slot, total = block_compact(hit, scratch)
            if hit:
                scratch[NW + slot] = Float32(a)
            cute.arch.sync_threads()
            for h in cutlass.range(warp, total, NW, unroll=1):
                ah = Int32(scratch[NW + h])
                s = ah // K
                j = ah - s * K
                dst = ptrs[ix["ret_0"]]
                for k in cutlass.range_constexpr(1, N):
                    dst = cutlass.select_(s == k, ptrs[ix[f"ret_{k}"]], dst)
                mR = gmem_tensor(dst, wdt, (M * K, D8, 8), 16)
                for g in cutlass.range_constexpr(NG):
                    for v in cutlass.range_constexpr(G):
                        u = lane + 32 * (g * G + v)
                        if u < W8:
                            buf[v, None].store(mY[(s * M + m) * K + j, cc * W8 + u, None].load())
                    for v in cutlass.range_constexpr(G):
                        u = lane + 32 * (g * G + v)
                        if u < W8:
                            mR[m * K + j, cc * W8 + u, None].store(buf[v, None].load())
            cute.arch.sync_threads()
        if tid == 0:
            _raise_flags(ptrs, ix["cflags_0"], N, t * N + rank, e)
            scratch[_ST] = Float32(1.0)
        cute.arch.sync_threads()
        # 2. as source: lanes k < N wait for owner k's returns of this tile
        if tid < N:
            faddr = ptrs[ix["cflags_self"]]
            fbase = cute.make_ptr(Int32, faddr, cute.AddressSpace.gmem, assumed_align=4)
            if peer_wait(fbase, t * N + tid, e, tmo, ebase, t, Int32(faddr % Int64(1 << 31)), N) == 0:
                scratch[_ST] = Float32(0.0)
        cute.arch.sync_threads()
        if scratch[_ST] > Float32(0.5):
            # 3. out = shared + sum_j w_j * ret_j, j = 0..k-1 in order (fp32)
            mRet = gmem_tensor(ptrs[ix["ret_self"]], wdt, (M * K, D8, 8), 16)
            mW = gmem_tensor(ptrs[ix["topk_w"]], Float32, (M, K), 4)
            mO = gmem_tensor(ptrs[ix["out"]], odt, (M, D8, 8), 16)
            mSh = mO                   # no shared expert: never read
            if cutlass.const_expr(has_shared):
                mSh = gmem_tensor(ptrs[ix["shared"]], Float32, (M, D8, 8), 16)
            for jv in cutlass.range_constexpr(NV):
                u = tid + NT * jv
                if u < W8:
                    col = cc * W8 + u
                    acc = mRet[m * K, col, None].load().to(Float32) * mW[m, 0]
                    if cutlass.const_expr(has_shared):
                        acc = mSh[m, col, None].load() + acc
                    for j in cutlass.range_constexpr(1, K):
                        acc = acc + mRet[m * K + j, col, None].load().to(Float32) * mW[m, j]
                    mO[m, col, None].store(acc.to(odt))
            if tid == 0:
                mSt[t] = e

    return tile
