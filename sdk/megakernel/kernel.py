"""The persistent megakernel in CuTe DSL (imports cutlass: import only where device code is built).

One launch per decode step: grid = number of SMs, one CTA (NUM_THREADS threads) per SM, each
walking its own instruction list (see `isa.py`):

    epoch = counters[EXIT] // num_ctas + 1
    copy this CTA's instruction records (words + operand pointers) into shared memory
    fill the smem ring: issue the first `stages` weight chunks of this CTA's stream
    for each instruction of this CTA:
        thread 0: for each dependency not already met on this CTA, bounded spin on an acquire
                  load until counter >= epoch * expected (globaltimer-bounded; on expiry claim
                  the error word)
        barrier (makes thread 0's acquire cover the whole CTA's following reads)
        dispatch on the opcode to the block (all blocks inline into this kernel):
          plain block:     its device tile
          streaming block: begin; per chunk: prep, wait for the chunk's stage, consume, refill
                           the stage with the stream's next chunk; end
        barrier; thread 0: release atomic +1 on the signal counter
    wait for outstanding copies; thread 0: release atomic +1 on counters[EXIT]

The weight stream of a CTA is the concatenation of the chunks of its streaming instructions, in
list order. The producer position runs `stages` chunks ahead of the consumer, so the ring holds
the NEXT instructions' weights while the CTA waits on a dependency or runs a plain tile: weights
never depend on activations, only the activations (read after the wait) do. cp.async copies
complete on their own, so an early exit (error word) only waits for them; it never hangs.

Instruction records live in shared memory for the whole launch (`records_geometry`): the words
and operand pointers of every instruction are read once, at the start, in two round trips;
afterwards the consumer and the producer read them from smem. (Read from global memory they
cost a round trip or two per tile: each acquire wait invalidates the SM's L1.) A list too long
for that (a whole model: hundreds of instructions a SM) streams through a window of WIN record
slots (record r in slot r % WIN): when the consumer reaches the window's second half, all
threads refill the first half's slots with the next WIN / 2 records (two round trips, before the
instruction's wait). The weight ring's producer, P chunks ahead and skipping plain tiles, may
need a record past the window: it reads those from global memory (rare: a run of more than
WIN / 2 plain tiles).

No grid-wide barrier, no counter reset. A CTA leaves early (after the error word is set) instead
of hanging. Optional timing record: globaltimer when every instruction's waits begin, when they
are met (its start), when a streaming tile's activations are staged and its chunks consumed,
before its signal and at its end: int64 [num_sms, max_len, isa.TIMING_STAMPS].

The refill of a streaming tile's last stage is issued after the tile's signal (REFILL_DEFER, env
SDK_REFILL_DEFER=0 to refill it right after its chunk like every other): the signal's release then
waits for none of this tile's refills on their way from the HBM. Measured on an H100 (2026-12-07,
bench/results/h100/megakernel_v33_refill.json): fp8 stack L=8 I=2048 161.5-161.7 -> 152.0-153.2
us, bf16 266.0-268.2 -> 257.9-258.6 us, fp8 I=18432 575.6 -> 555.1 us, fp8 batch 8 244.1 -> 238.6
us. Only the last: the wait for chunk c counts on chunk c - 1's refill being committed
(wait_group(stages - 1)), so leaving two refills would let the tile's last chunk be read before it
lands (tried: bf16 errors 1.5e-2 / 3.2e-2 with two / three, and no faster).

A warp-sliced ring (base.ring_mode: every streaming block's `warp_ring()`): warp w copies and
reads only stage bytes [w S, (w + 1) S), S = stage / 8, whatever op a chunk belongs to, so a
chunk's wait and its stage's refill need warp barriers; the CTA barrier stays at each tile's
first chunk (the activations its begin / prep staged) and around the signal.

Supported: any list of blocks following the contract in `sdk/blocks/base.py`.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.memory import SmemAllocator

from ..blocks._cute import (bounded_wait, gmem_tensor, scratch_region, smem_tensor, stream_tile, timing_stamp,
                            warp_slice)
from ..blocks.base import NUM_THREADS, env_switch, ring_geometry, ring_mode
from ..blocks.gemv import WEIGHT_EVICT_FIRST
from . import isa
from .program import records_geometry

REFILL_DEFER = env_switch("SDK_REFILL_DEFER", "1", "a tile's last refill after its signal")

OPTAB_EXTENT = 1 << 24        # static extent of the operand table view (never bounds-checked)
STAMP_OF = {"begun": isa.STAMP_BEGUN, "chunks": isa.STAMP_CHUNKS}     # stream_tile's timing stamps


def build(blocks, num_sms: int, max_len: int, timing: bool, pdl: bool = False, records_window: int | None = None):
    """The `@cute.jit` host function launching the megakernel for these opcode variants. pdl:
    launched as a programmatic dependent launch (see the kernel's griddepcontrol.wait).
    records_window: program.records_geometry's (None: its choice)."""
    nops = [len(b.operands()) for b in blocks]
    nch = [b.stream_chunks() for b in blocks]
    tiles = [None if nch[k] else b.device_tile() for k, b in enumerate(blocks)]
    prologues = [b.device_prologue() if not nch[k] and b.has_prologue() else None for k, b in enumerate(blocks)]
    faces = [b.device_stream() if nch[k] else None for k, b in enumerate(blocks)]
    S, L, W = num_sms, max_len, isa.WORDS
    NOPS, rec_bytes, WIN = records_geometry(blocks, max_len, records_window)
    stage_bytes, P, xbytes = ring_geometry(blocks, reserved=rec_bytes)
    sliced = ring_mode(blocks)
    # record slots in smem: every record of the list (WIN 0), or a window of WIN slots that the
    # list streams through, half a window at a time (record r in slot r % WIN)
    LR = WIN or L
    HALF = LR // 2
    NT = NUM_THREADS
    mutable = pdl and any(b.stream_data_mutable() for b in blocks if b.stream_chunks())

    @cute.jit
    def chunks_of(op: Int32) -> Int32:
        r = Int32(0)
        for k in cutlass.range_constexpr(len(blocks)):
            if cutlass.const_expr(nch[k] > 0):
                if op == k:
                    r = Int32(nch[k])
        return r

    def slot(i):
        """The smem slot of record i (trace-time choice: the identity when all are resident)."""
        return i % LR if WIN else i

    @cute.jit
    def word(sW, mIw, sm: Int32, hi: Int32, r: Int32, w: cutlass.Constexpr) -> Int32:
        """Word w of record r, from its smem slot; with a records window, a record at or past the
        resident end `hi` (only the producer reads so far ahead) from global memory."""
        v = sW[slot(r), w]
        if cutlass.const_expr(WIN):
            if r >= hi:
                v = mIw[sm, r, w]
        return v

    @cute.jit
    def pointer(sP, mOps, base: Int32, hi: Int32, r: Int32, j: cutlass.Constexpr) -> Int64:
        """Operand pointer j of record r (operand-table base `base`), as `word` reads its words."""
        v = sP[slot(r), j]
        if cutlass.const_expr(WIN):
            if r >= hi:
                v = mOps[base + j]
        return v

    @cute.jit
    def next_streaming(sW, mIw, sm: Int32, hi: Int32, n: Int32, i: Int32) -> Int32:
        """The first instruction at index >= i of this CTA's list that streams weights (n: none)."""
        done = Int32(0)
        while done == 0:
            if i >= n:
                done = Int32(1)
            else:
                if chunks_of(word(sW, mIw, sm, hi, i, isa.OPCODE)) > 0:
                    done = Int32(1)
                else:
                    i = i + 1
        return i

    @cute.jit
    def produce(sW, sP, mIw, mOps, sm: Int32, hi: Int32, n: Int32, ring_base, pi: Int32, pc: Int32, ps: Int32):
        """Issue chunk pc of instruction pi (the producer position) into stage ps % P, advance.
        Always commits one cp.async group (empty once the stream is exhausted)."""
        if pi < n:
            op = word(sW, mIw, sm, hi, pi, isa.OPCODE)
            t = word(sW, mIw, sm, hi, pi, isa.TILE)
            base = Int32(0)
            if cutlass.const_expr(WIN):
                base = word(sW, mIw, sm, hi, pi, isa.OPERANDS)
            addr = ring_base + (ps % P) * stage_bytes
            if cutlass.const_expr(sliced):
                addr = addr + warp_slice(stage_bytes)
            for k in cutlass.range_constexpr(len(blocks)):
                if cutlass.const_expr(nch[k] > 0):
                    if op == k:
                        faces[k].issue([pointer(sP, mOps, base, hi, pi, j) for j in range(nops[k])], t, pc, addr)
            pc = pc + 1
            if pc >= chunks_of(op):
                pc = Int32(0)
                pi = next_streaming(sW, mIw, sm, hi, n, pi + 1)
        cute.arch.cp_async_commit_group()
        return pi, pc, ps + 1

    @cute.jit
    def load_records(pI: Int64, mOps, sm: Int32, r0: Int32, cnt: Int32, sW, sP, cap: cutlass.Constexpr):
        """All threads: records r0 .. r0 + cnt - 1 (cnt <= cap) of this CTA's list into their
        slots, in two round trips (the words, then the operand pointers they index). Loads
        first, stores after, so each thread's loads are all in flight at once."""
        NWU = -(-(cap * W // 4) // NT)
        NPU = -(-(cap * NOPS) // NT)
        WQ = W // 4                              # 16-byte units of a record's words
        tid, _, _ = cute.arch.thread_idx()
        mIv = gmem_tensor(pI, Int32, (S, L * WQ, 4), 16)
        sWv = smem_tensor(sW.iterator.toint(), Int32, (LR * WQ, 4))
        wr = cute.make_rmem_tensor((NWU, 4), Int32)
        g0 = tid                                # this thread's first 16-byte unit of words ..
        if cutlass.const_expr(WIN):
            g0 = r0 * WQ + tid                  # .. in the CTA's list (from record r0)
        for j in cutlass.range_constexpr(NWU):
            if tid + NT * j < cnt * WQ:
                wr[j, None].store(mIv[sm, g0 + NT * j, None].load())
        for j in cutlass.range_constexpr(NWU):
            u = tid + NT * j
            if u < cnt * WQ:
                d = u                           # its smem unit: the record's slot, or (every
                if cutlass.const_expr(WIN):     # record resident, r0 = 0) the same index
                    d = slot(r0 + u // WQ) * WQ + u % WQ
                sWv[d, None].store(wr[j, None].load())
        cute.arch.sync_threads()
        pr = cute.make_rmem_tensor((NPU,), Int64)
        for j in cutlass.range_constexpr(NPU):
            u = tid + NT * j
            if u < cnt * NOPS:
                r = u // NOPS
                rs = r
                if cutlass.const_expr(WIN):
                    rs = slot(r0 + r)
                pr[j] = mOps[sW[rs, isa.OPERANDS] + (u - r * NOPS)]
        for j in cutlass.range_constexpr(NPU):
            u = tid + NT * j
            if u < cnt * NOPS:
                r = u // NOPS
                rs = r
                if cutlass.const_expr(WIN):
                    rs = slot(r0 + r)
                sP[rs, u - r * NOPS] = pr[j]
        cute.arch.sync_threads()

    @cute.kernel
    def kernel(pI: Int64, pN: Int64, pC: Int64, pE: Int64, pT: Int64, pTim: Int64, timeout_ns: Int64):
        smem = SmemAllocator()
        scratch = scratch_region(smem, blocks)
        flags = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        tid, _, _ = cute.arch.thread_idx()
        sm, _, _ = cute.arch.block_idx()
        # the next launch (the next decode step) may start on an SM as soon as this CTA leaves it
        cute.arch.griddepcontrol_launch_dependents()
        mN = gmem_tensor(pN, Int32, (S,), 4)
        mOps = gmem_tensor(pT, Int64, (OPTAB_EXTENT,), 8)
        mIw = gmem_tensor(pI, Int32, (S, L, W), 16)
        mTim = gmem_tensor(pTim, Int64, (S, L, isa.TIMING_STAMPS), 8)
        cbase = cute.make_ptr(Int32, pC, cute.AddressSpace.gmem, assumed_align=4)
        ebase = cute.make_ptr(Int32, pE, cute.AddressSpace.gmem, assumed_align=4)
        n = mN[sm]
        sP = smem.allocate_tensor(Int64, cute.make_layout((LR, NOPS), stride=(NOPS, 1)), byte_alignment=16)
        sW = smem.allocate_tensor(Int32, cute.make_layout((LR, W), stride=(W, 1)), byte_alignment=16)
        # records [lo, hi) are resident (all of them without a window)
        lo = Int32(0)
        hi = n
        if cutlass.const_expr(WIN):
            hi = cutlass.min(n, Int32(LR))
        load_records(pI, mOps, sm, Int32(0), hi, sW, sP, LR)
        ring_base = Int32(0)
        sx = Int32(0)
        pi, pc, ps, cseq = Int32(0), Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(P > 0):
            ring = smem.allocate_tensor(cutlass.Int8, cute.make_layout(P * stage_bytes), byte_alignment=128)
            xs = smem.allocate_tensor(cutlass.Int8, cute.make_layout(xbytes), byte_alignment=128)
            ring_base = ring.iterator.toint()
            sx = xs.iterator.toint()
            # fill the ring before anything waits: these are the first instructions' weights - but
            # after the PDL wait when a block streams data the previous launch writes (a state)
            if cutlass.const_expr(mutable):
                cute.arch.griddepcontrol_wait()
            pi = next_streaming(sW, mIw, sm, hi, n, Int32(0))
            for _ in cutlass.range_constexpr(P):
                pi, pc, ps = produce(sW, sP, mIw, mOps, sm, hi, n, ring_base, pi, pc, ps)

        # Everything above reads only what the host wrote before the launch (records, operand
        # table) and weights; from here on counters, the error word and activations, which the
        # previous launch writes. Launched with PDL (the runtime's pdl=True), this CTA may have
        # started while the previous step still runs: wait for that grid to finish and flush.
        # Without PDL this is a no-op.
        cute.arch.griddepcontrol_wait()
        if tid == 0:
            flags[1] = cute.arch.load(cbase, Int32, sem="acquire", scope="gpu") // S + 1
        cute.arch.sync_threads()
        epoch = flags[1]
        i = Int32(0)
        ok = Int32(1)
        last_c, last_t = Int32(-1), Int32(0)    # thread 0: a wait already met on this CTA
        staged = Int32(-1)                      # operand base of the last streaming tile
        deferred = Int32(0)                     # 1: the last streaming tile's last refill is due
        while i < n and ok != 0:
            if cutlass.const_expr(WIN):
                # the window's first half is done with (the consumer is past it, the producer at
                # or past the consumer, and reading records past the window from global memory):
                # refill its slots with the records after the window, all threads - once thread 0
                # has read the last instruction's signal word (after that instruction's barrier),
                # which lies in the first half
                if (i == lo + HALF) & (hi < n):
                    cute.arch.sync_threads()
                    cnt = cutlass.min(Int32(HALF), n - hi)
                    load_records(pI, mOps, sm, hi, cnt, sW, sP, HALF)
                    lo = lo + HALF
                    hi = hi + cnt
            r = slot(i)
            op = sW[r, isa.OPCODE]
            base = sW[r, isa.OPERANDS]
            t = sW[r, isa.TILE]
            # a block's prologue (weights only) before the wait: its loads overlap the wait; no
            # barrier here - thread 0 goes on to wait, the barrier below orders it before the tile
            for k in cutlass.range_constexpr(len(blocks)):
                if cutlass.const_expr(prologues[k] is not None):
                    if op == k:
                        prologues[k]([sP[r, j] for j in range(nops[k])], t, scratch)
            if tid == 0:
                if cutlass.const_expr(timing):
                    mTim[sm, i, isa.STAMP_WAIT] = cute.arch.globaltimer()
                st = Int32(1)
                for (cw, ew) in isa.WAITS:
                    c = sW[r, cw]
                    target = sW[r, ew] * epoch
                    # counters only grow: a (counter, target) met before is still met
                    if (c >= 0) & (st == 1) & ((c != last_c) | (target > last_t)):
                        st = bounded_wait(cbase + c, target, ebase, timeout_ns, isa.ERR_TIMEOUT, "gpu",
                                          (c, i, sm, None, target, op, epoch))
                        last_c, last_t = c, target
                flags[0] = st
                if cutlass.const_expr(timing):
                    mTim[sm, i, isa.STAMP_START] = cute.arch.globaltimer()
            cute.arch.sync_threads()
            ok = flags[0]
            if ok != 0:
                for k in cutlass.range_constexpr(len(blocks)):
                    if op == k:
                        ptrs = [sP[r, j] for j in range(nops[k])]
                        if cutlass.const_expr(nch[k] == 0):
                            tiles[k](ptrs, t, scratch)
                        else:
                            fresh = Int32(cutlass.select_(base == staged, 0, 1))
                            cseq, pi, pc, ps = stream_tile(
                                faces[k], nch[k], P, stage_bytes, ptrs, t, ring_base, sx, scratch, fresh,
                                cseq, pi, pc, ps,
                                lambda a, b, c: produce(sW, sP, mIw, mOps, sm, hi, n, ring_base, a, b, c),
                                (lambda what: timing_stamp(mTim, sm, i, STAMP_OF[what])) if timing else None,
                                REFILL_DEFER, sliced)
                            staged = base
                            if cutlass.const_expr(REFILL_DEFER):
                                deferred = Int32(1)
                cute.arch.sync_threads()
                if tid == 0:
                    sig = sW[r, isa.SIGNAL]
                    if cutlass.const_expr(timing):
                        mTim[sm, i, isa.STAMP_SIGNAL] = cute.arch.globaltimer()
                    if sig >= 0:
                        cute.arch.atomic_add(cbase + sig, Int32(1), sem="release", scope="gpu")
                    if cutlass.const_expr(timing):
                        mTim[sm, i, isa.STAMP_END] = cute.arch.globaltimer()
                if cutlass.const_expr(REFILL_DEFER):
                    # after the release: the barrier holds the refill until thread 0's fence is done
                    if deferred != 0:
                        cute.arch.sync_threads()
                        pi, pc, ps = produce(sW, sP, mIw, mOps, sm, hi, n, ring_base, pi, pc, ps)
                        deferred = Int32(0)
            i = i + 1
        if cutlass.const_expr(P > 0):
            cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.atomic_add(cbase, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def host(pI: Int64, pN: Int64, pC: Int64, pE: Int64, pT: Int64, pTim: Int64, timeout_ns: Int64,
             stream: "cuda.CUstream"):
        kernel(pI, pN, pC, pE, pT, pTim, timeout_ns).launch(
            grid=(S, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=pdl)

    import cuda.bindings.driver as cuda
    host.__annotations__["stream"] = cuda.CUstream
    return host


_cache: dict = {}


def compile_megakernel(blocks, num_sms: int, max_len: int, timing: bool = False, arch: str | None = None,
                       pdl: bool = False, records_window: int | None = None):
    """Compiled megakernel `fn(pI, pN, pC, pE, pT, pTim, timeout_ns, stream)`, cached in-process on
    (block static configs, num_sms, max_len, timing, arch, pdl, the records' window)."""
    # the kernel-wide switches are compiled in: part of the key
    key = (tuple(b.key() for b in blocks), num_sms, max_len, timing, arch, pdl, records_window, REFILL_DEFER,
           WEIGHT_EVICT_FIRST)
    if key not in _cache:
        import cuda.bindings.driver as cuda
        host = build(blocks, num_sms, max_len, timing, pdl, records_window)
        args = (Int64(0),) * 6 + (Int64(1), cuda.CUstream(0))
        if arch:
            _cache[key] = cute.compile(host, *args, options=f"--gpu-arch {arch}")
        else:
            _cache[key] = cute.compile(host, *args)
    return _cache[key]
