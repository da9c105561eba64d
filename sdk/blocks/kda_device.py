"""CuTe DSL device code of `KDABlock` (imports cutlass: imported only by `KDABlock.device_tile()` /
`device_stream()`).

Two forms of the same per-token math (`delta_rule`):

- the one-tile form (`build_kda_tile`): one tile = one (sequence b, head h, V-slice); the tile
  loads its state slice into registers itself, derives q, k, the decay and beta of its head, runs
  the T tokens and writes the slice back;
- the streaming form (`build_kda_stream`, `KDAConfig.stream`): one tile = one sequence's group of
  `heads_per_tile` heads, their V-slices are the chunks of the megakernel's shared-memory ring
  (chunk c = head c // v_split of the group, slice c % v_split). The state is data no earlier
  instruction of the launch writes, so the ring loads it ahead, across instruction boundaries and
  before the tile's dependency wait, exactly like GEMV weights; `begin` stages the group's
  normalised q, k, decay, v and beta once (not once per slice), `consume` runs a slice from its
  stage, `end` has nothing left to do. begin's loads queue behind the ring's copies in flight
  (the same SM's memory pipeline), so a tile pays about the ring's latency once: more heads per
  tile spread it over more chunks.

Thread mapping (both forms): the 8 warps are NWV across the columns x NWK (`k_warps`) across K:
warp w = wk * NWV + wv. Thread (warp, lane) holds S[k0 : k0+RK, cols] in registers, k0 = (wk * LK
+ lane // LV) * RK, cols = 4 adjacent columns at slice*VS + wv*CW + (lane % LV)*4. The state rows
a thread owns are consecutive so its q / k / gate values are one vector load each; in the one-tile
form a warp's state load covers LK rows x (LV * 4) contiguous columns (one or more full 32-byte
sectors per row; 128 bytes with LV = 8). Every sum over K is a butterfly over the LK lanes of a
warp, then (NWK > 1) a sum of the NWK warps' partials through shared memory (two CTA barriers per
token); with NWK = 1 the delta rule needs no shared memory and no barrier. The output norm (sum
over all V) exchanges one float per column warp through `scratch`.

The streaming form's stage holds the slice [K, VS] row-major with its 16-byte units XOR-swizzled
by row group (unit u of row r at u ^ ((r // RK) % units per row)): the LK lanes of a warp read RK
rows apart, which unswizzled all start on the same banks.

See `sdk/blocks/kda.py` for the math, layouts and commit modes.
"""
from __future__ import annotations

from .base import NUM_THREADS, PRODUCER_THREADS, StreamFaces

L2NORM_EPS = 1e-6


def _log2(x: int) -> int:
    return x.bit_length() - 1


def _pow2_align(nbytes: int) -> int:
    """The largest power of two (<= 16) dividing nbytes: the alignment of a vector of that size."""
    a = 16
    while nbytes % a:
        a //= 2
    return a


class _Parts:
    """Constants and device helpers the two forms share (built at trace time from the config)."""

    def __init__(self, block):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import DTYPE_MAP

        c = block.config
        self.B, self.T, self.H, self.K = c.batch, c.tokens, c.heads, c.head_dim
        self.V, self.C = c.head_dim, c.heads * c.head_dim
        self.VS, self.VSPLIT = block.vs, c.v_split
        self.LV, self.LK, self.RK = block.lanes
        NW = NUM_THREADS // 32
        self.NWK = NWK = block.nwk
        self.NWV = NW // NWK
        self.CW = self.VS // self.NWV
        self.XW = block.k_exchange_words()
        VS, LV, LK = self.VS, self.LV, self.LK
        KOFS = [LV << i for i in range(_log2(LK))]   # butterfly offsets across the K lanes
        VOFS = [1 << i for i in range(_log2(LV))]    # ... across the column lanes
        self.idx = {name: i for i, name in enumerate(block.operands())}
        self.commit = c.commit
        self.write_state = c.commit in ("all", "accepted")
        self.log_decay = log_decay = c.gate_kind == "log_decay"
        sigmoid_gate = c.gate_kind == "sigmoid"
        lb = float(c.gate_lower_bound)
        self.sdt, self.odt = DTYPE_MAP[c.state_dtype], DTYPE_MAP[c.out_dtype]
        self.s_align = 16 if c.state_dtype == "fp32" else 8
        self.o_align = 16 if c.out_dtype == "fp32" else 8
        self.gdt = Float32 if (log_decay or c.g_dtype == "fp32") else BFloat16
        self.beta_sig = c.beta_sigmoid
        scale = c.head_dim ** -0.5
        eps = L2NORM_EPS

        def kred(x):
            """Sum over the K lanes of the warp (all of K for this lane's columns)."""
            for o in KOFS:
                x = x + cute.arch.shuffle_sync_bfly(x, offset=o)
            return x

        def vred(x):
            for o in VOFS:
                x = x + cute.arch.shuffle_sync_bfly(x, offset=o)
            return x

        def sigmoid(x):
            return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=True))

        def decay(x, rate):
            """exp(a) of the raw gate x = g + dt_bias (not log_decay)."""
            a = Float32(0.0)
            if cutlass.const_expr(sigmoid_gate):
                a = Float32(lb) * sigmoid(rate * x)
            else:
                # softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow, no branch
                sp = cute.arch.fmax(x, Float32(0.0)) + cute.math.log1p(
                    cute.math.exp(-cute.math.absf(x), fastmath=False), fastmath=False)
                a = -rate * sp
            return cute.math.exp(a, fastmath=False)

        @cute.jit
        def ex_put(sX, base: cutlass.Constexpr, wk: Int32, col: Int32, kl: Int32, vals):
            """This warp's K-partial sums of its 4 columns into row wk of the exchange at `base`
            (one lane per column group: the K lanes hold the same values after kred)."""
            if kl == 0:
                for e in cutlass.range_constexpr(4):
                    sX[base + wk * VS + col + e] = vals[e]

        @cute.jit
        def ex_get(sX, base: cutlass.Constexpr, col: Int32, vals):
            """vals = the sums over the NWK rows of the exchange at `base` (after a CTA barrier)."""
            for e in cutlass.range_constexpr(4):
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(NWK):
                    tot = tot + sX[base + w * VS + col + e]
                vals[e] = tot

        RK = self.RK

        @cute.jit
        def delta_rule(rS, rq, rk, rd, rv, racc, beta: Float32, qs: Float32, ks: Float32, sX,
                       wv: Int32, wk: Int32, col: Int32, kl: Int32, lane: Int32, norms: cutlass.Constexpr):
            """One token on this thread's [RK, 4] of S (fp32, in place): S = S * decay;
            delta = beta (v - k^T S); S += k delta^T; racc = o = q^T S for its 4 columns.
            norms: q and k are raw, qs / ks their squared norms over this warp's K rows (after
            kred) - the l2norm (and q's K^-0.5) is applied here, k's factoring out of k^T S; else
            q and k come normalised. NWK > 1: the warps' partial K sums (and qs / ks) meet in sX."""
            racc.fill(0.0)
            for j in cutlass.range_constexpr(RK):
                d = rd[j]
                for e in cutlass.range_constexpr(4):
                    s = rS[j, e] * d
                    rS[j, e] = s
                    racc[e] = racc[e] + s * rk[j]
            for e in cutlass.range_constexpr(4):
                racc[e] = kred(racc[e])
            if cutlass.const_expr(NWK > 1):
                ex_put(sX, 0, wk, col, kl, racc)
                if cutlass.const_expr(norms):
                    if (wv == 0) & (lane == 0):
                        sX[2 * NWK * VS + 2 * wk] = qs
                        sX[2 * NWK * VS + 2 * wk + 1] = ks
                cute.arch.sync_threads()
                if cutlass.const_expr(norms):
                    qs = Float32(0.0)
                    ks = Float32(0.0)
                    for w in cutlass.range_constexpr(NWK):
                        qs = qs + sX[2 * NWK * VS + 2 * w]
                        ks = ks + sX[2 * NWK * VS + 2 * w + 1]
                ex_get(sX, 0, col, racc)
            qn = Float32(1.0)
            kn = Float32(1.0)
            if cutlass.const_expr(norms):
                qn = cute.math.rsqrt(qs + Float32(eps)) * Float32(scale)
                kn = cute.math.rsqrt(ks + Float32(eps))
            for e in cutlass.range_constexpr(4):
                rv[e] = beta * (rv[e] - racc[e] * kn)                     # delta
            racc.fill(0.0)
            for j in cutlass.range_constexpr(RK):
                kj = rk[j] * kn
                qj = rq[j] * qn
                for e in cutlass.range_constexpr(4):
                    s = rS[j, e] + kj * rv[e]
                    rS[j, e] = s
                    racc[e] = racc[e] + s * qj
            for e in cutlass.range_constexpr(4):
                racc[e] = kred(racc[e])
            if cutlass.const_expr(NWK > 1):
                ex_put(sX, NWK * VS, wk, col, kl, racc)
                cute.arch.sync_threads()
                ex_get(sX, NWK * VS, col, racc)

        def lane_coords(tid):
            """(lane, wv, wk, vl, kl, kq, col) of this thread in the mapping above."""
            lane = tid % 32
            warp = tid // 32
            kl = lane // LV
            wk = warp // self.NWV
            return lane, warp % self.NWV, wk, lane % LV, kl, wk * LK + kl, (warp % self.NWV) * self.CW + (lane % LV) * 4

        self.kred, self.vred, self.sigmoid, self.decay = kred, vred, sigmoid, decay
        self.delta_rule, self.lane_coords = delta_rule, lane_coords
        self.scale, self.eps = scale, eps


def build_kda_tile(block):
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32

    from ._cute import DTYPE_MAP, TileSmem, gmem_tensor

    c = block.config
    P = _Parts(block)
    B, T, H, K, V, C = P.B, P.T, P.H, P.K, P.V, P.C
    VS, VSPLIT, RK, NWK, NWV, XW = P.VS, P.VSPLIT, P.RK, P.NWK, P.NWV, P.XW
    idx, commit, write_state, log_decay = P.idx, P.commit, P.write_state, P.log_decay
    sdt, odt, s_align, o_align, gdt = P.sdt, P.odt, P.s_align, P.o_align, P.gdt
    kred, vred, sigmoid = P.kred, P.vred, P.sigmoid
    conv, out_norm = c.conv, c.out_norm
    g_align = min(16, RK * (4 if gdt is Float32 else 2))
    in_align = min(16, RK * 2)
    W1 = c.conv_kernel - 1
    WK = c.conv_kernel
    cw_bf16 = c.conv_w_dtype == "bf16"
    cwdt = DTYPE_MAP[c.conv_w_dtype]
    NCS = 3 * K * W1                         # conv-state values of one head
    NCS_R = -(-NCS // NUM_THREADS)
    norm_eps = float(c.norm_eps)
    staged = c.conv_staged and c.conv
    hoist = T == 1 and not c.conv              # token 0's inputs loaded before the state (see tile)
    NCONV = T * 3 * K                        # staged conv outputs of the tile's head (all tokens)

    def bf16_round(x):
        return x.to(BFloat16).to(Float32)

    @cute.jit
    def window(mX, mCS, b: Int32, ch: Int32, s: Int32) -> Float32:
        """Element s of channel ch of cat(conv_state, qkv^T): the conv's input sequence."""
        x = Float32(0.0)
        if s < W1:
            x = mCS[b, ch, s].to(Float32)
        else:
            x = mX[b, s - W1, ch].to(Float32)
        return x

    @cute.jit
    def conv_out(mX, mCS, mCW, b: Int32, ch: Int32, t: Int32) -> Float32:
        """bf16(SiLU(conv)) of channel ch at token t, as KDAReference.short_conv rounds it."""
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(WK):
            acc = acc + mCW[ch, i].to(Float32) * window(mX, mCS, b, ch, t + i)
        if cutlass.const_expr(cw_bf16):
            acc = bf16_round(acc)
        return bf16_round(acc * sigmoid(acc))

    @cute.jit
    def load_token(mQ, mK, mV, mG, mBeta, b: Int32, t: Int32, h: Int32, kq: Int32, c4: Int32, rq, rk, rv, rd, rb):
        """Issue token t's input loads (q, k, v given): q, k rows k0.., v columns, raw gate, beta."""
        rq.store(mQ[b, t, h, kq, None].load().to(Float32))
        rk.store(mK[b, t, h, kq, None].load().to(Float32))
        rv.store(mV[b, t, h, c4, None].load().to(Float32))
        rd.store(mG[b, t, h, kq, None].load().to(Float32))
        rb[0] = mBeta[b, t, h].to(Float32)

    @cute.jit
    def tile(ptrs, tile_id: Int32, scratch):
        smem = TileSmem(scratch, block.own_smem_bytes())
        sConv = None
        if cutlass.const_expr(staged):
            sConv = smem.allocate_tensor(Float32, cute.make_layout((T, 3, K), stride=(3 * K, K, 1)),
                                         byte_alignment=16)
        sX = scratch                                   # unused with NWK = 1
        if cutlass.const_expr(NWK > 1):
            sX = smem.allocate_tensor(Float32, cute.make_layout(XW), byte_alignment=16)
        tid, _, _ = cute.arch.thread_idx()
        lane, wv, wk, vl, kl, kq, col = P.lane_coords(tid)
        bh = tile_id // VSPLIT
        sl = tile_id % VSPLIT
        b = bh // H
        h = bh % H
        c4 = (sl * VS + col) // 4                      # this lane's 4-column group in [0, V/4)
        k0 = kq * RK

        mS = gmem_tensor(ptrs[idx["state"]], sdt, (B, H, K, V // 4, 4), s_align)
        mG = gmem_tensor(ptrs[idx["g"]], gdt, (B, T, H, K // RK, RK), g_align)
        mBeta = gmem_tensor(ptrs[idx["beta"]], BFloat16, (B, T, block.beta_width), 2)
        mO = gmem_tensor(ptrs[idx["o"]], odt, (B, T, H, V // 4, 4), o_align)
        if cutlass.const_expr(conv):
            mX = gmem_tensor(ptrs[idx["qkv"]], BFloat16, (B, T, 3 * C), 2)
            mCS = gmem_tensor(ptrs[idx["conv_state"]], BFloat16, (B, 3 * C, W1), 2)
            mCW = gmem_tensor(ptrs[idx["conv_w"]], cwdt, (3 * C, WK), 2 if cw_bf16 else 4)
        else:
            mQ = gmem_tensor(ptrs[idx["q"]], BFloat16, (B, T, H, K // RK, RK), in_align)
            mK = gmem_tensor(ptrs[idx["k"]], BFloat16, (B, T, H, K // RK, RK), in_align)
            mV = gmem_tensor(ptrs[idx["v"]], BFloat16, (B, T, H, V // 4, 4), 8)
        if cutlass.const_expr(commit == "per_token"):
            mSO = gmem_tensor(ptrs[idx["states_out"]], sdt, (B, T, H, K, V // 4, 4), s_align)
        if cutlass.const_expr(out_norm):
            mGate = gmem_tensor(ptrs[idx["out_gate"]], BFloat16, (B, T, H, V // 4, 4), 8)
            mNw = gmem_tensor(ptrs[idx["norm_w"]], BFloat16, (V // 4, 4), 8)

        rq = cute.make_rmem_tensor((RK,), Float32)
        rk = cute.make_rmem_tensor((RK,), Float32)
        rd = cute.make_rmem_tensor((RK,), Float32)
        rv = cute.make_rmem_tensor((4,), Float32)
        rb = cute.make_rmem_tensor((1,), Float32)
        racc = cute.make_rmem_tensor((4,), Float32)


        # Issued first, before the state: the gate weights and (one decode token, q, k, v given)
        # the token's inputs, a few hundred bytes from L2 - their latency then hides under the
        # state's instead of following it. (Not with T > 1: dt_bias held across the token loop
        # took v_split=2 verify tiles from 128 to 159 registers, one CTA per SM instead of two.)
        a_log = Float32(0.0)
        rdt = cute.make_rmem_tensor((RK,), Float32)
        if cutlass.const_expr(not log_decay):
            mDt = gmem_tensor(ptrs[idx["dt_bias"]], Float32, (H, K // RK, RK), min(16, RK * 4))
            mA = gmem_tensor(ptrs[idx["a_log"]], Float32, (H,), 4)
            a_log = mA[h]
            if cutlass.const_expr(hoist):
                rdt.store(mDt[h, kq, None].load())
        if cutlass.const_expr(hoist):
            load_token(mQ, mK, mV, mG, mBeta, b, Int32(0), h, kq, c4, rq, rk, rv, rd, rb)
        # the state slice: all loads issued at once (RK x 16 bytes in flight per thread)
        rS = cute.make_rmem_tensor((RK, 4), Float32)
        for j in cutlass.range_constexpr(RK):
            rS[j, None].store(mS[b, h, k0 + j, c4, None].load().to(Float32))
        rate = cute.math.exp(a_log, fastmath=False)

        n_tok = Int32(T)
        if cutlass.const_expr(commit == "accepted"):
            mN = gmem_tensor(ptrs[idx["n_accepted"]], Int32, (B,), 4)
            n_tok = mN[b]
            if n_tok > T:
                n_tok = Int32(T)
            if n_tok < 0:
                n_tok = Int32(0)

        if cutlass.const_expr(staged):
            # the head's conv outputs [T, q|k|v, K], each computed by one thread while the state
            # loads are in flight; the token loop reads its rows / columns as vectors
            for i in cutlass.range(tid, NCONV, NUM_THREADS, unroll=1):
                tt = i // (3 * K)
                part = (i // K) % 3
                ch = i % K
                sConv[tt, part, ch] = conv_out(mX, mCS, mCW, b, part * C + h * K + ch, tt)
            cute.arch.sync_threads()

        for t in cutlass.range(n_tok, unroll=1):
            # -- inputs of this token: q, k rows k0.., v columns, gate -> decay, beta
            if cutlass.const_expr(staged):
                sQK = cute.make_tensor(sConv.iterator, cute.make_layout((T, 3, K // RK, RK), stride=(3 * K, K, RK, 1)))
                sV4 = cute.make_tensor(sConv.iterator, cute.make_layout((T, 3, K // 4, 4), stride=(3 * K, K, 4, 1)))
                rq.store(sQK[t, 0, kq, None].load())
                rk.store(sQK[t, 1, kq, None].load())
                rv.store(sV4[t, 2, c4, None].load())
            elif cutlass.const_expr(conv):
                for j in cutlass.range_constexpr(RK):
                    rq[j] = conv_out(mX, mCS, mCW, b, h * K + k0 + j, t)
                    rk[j] = conv_out(mX, mCS, mCW, b, C + h * K + k0 + j, t)
                for e in cutlass.range_constexpr(4):
                    rv[e] = conv_out(mX, mCS, mCW, b, 2 * C + c4 * 4 + e + h * K, t)
            elif cutlass.const_expr(not hoist):
                load_token(mQ, mK, mV, mG, mBeta, b, t, h, kq, c4, rq, rk, rv, rd, rb)
            if cutlass.const_expr(conv):
                rd.store(mG[b, t, h, kq, None].load().to(Float32))
                rb[0] = mBeta[b, t, h].to(Float32)
            if cutlass.const_expr(log_decay):
                for j in cutlass.range_constexpr(RK):
                    rd[j] = cute.math.exp(rd[j], fastmath=False)
            else:
                if cutlass.const_expr(not hoist):
                    rdt.store(mDt[h, kq, None].load())
                for j in cutlass.range_constexpr(RK):
                    rd[j] = P.decay(rd[j] + rdt[j], rate)
            qs = Float32(0.0)
            ks = Float32(0.0)
            for j in cutlass.range_constexpr(RK):
                qs = qs + rq[j] * rq[j]
                ks = ks + rk[j] * rk[j]
            qs = kred(qs)
            ks = kred(ks)
            beta = rb[0]
            if cutlass.const_expr(P.beta_sig):
                beta = sigmoid(beta)
            P.delta_rule(rS, rq, rk, rd, rv, racc, beta, qs, ks, sX, wv, wk, col, kl, lane, True)

            if cutlass.const_expr(out_norm):
                # RMSNorm(bf16(o)) over all V: columns lanes, then the 8 warps through scratch
                ss = Float32(0.0)
                for e in cutlass.range_constexpr(4):
                    racc[e] = bf16_round(racc[e])
                    ss = ss + racc[e] * racc[e]
                ss = vred(ss)
                if (lane == 0) & (wk == 0):
                    scratch[wv] = ss
                cute.arch.sync_threads()
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(NWV):
                    tot = tot + scratch[w]
                cute.arch.sync_threads()
                rstd = cute.math.rsqrt(tot / Float32(V) + Float32(norm_eps))
                gate = mGate[b, t, h, c4, None].load().to(Float32)
                nw = mNw[c4, None].load().to(Float32)
                for e in cutlass.range_constexpr(4):
                    racc[e] = racc[e] * rstd * nw[e] * sigmoid(gate[e])
            if (kl == 0) & (wk == 0):
                mO[b, t, h, c4, None].store(racc.load().to(odt))
            if cutlass.const_expr(commit == "per_token"):
                for j in cutlass.range_constexpr(RK):
                    mSO[b, t, h, k0 + j, c4, None].store(rS[j, None].load().to(sdt))

        if cutlass.const_expr(write_state):
            if n_tok > 0:
                for j in cutlass.range_constexpr(RK):
                    mS[b, h, k0 + j, c4, None].store(rS[j, None].load().to(sdt))
            if cutlass.const_expr(conv):
                # new conv state = window columns n_tok .. n_tok+W1-1 of the head's 3K channels,
                # spread over all threads; read everything before anyone overwrites it
                rc = cute.make_rmem_tensor((NCS_R,), Float32)
                for r in cutlass.range_constexpr(NCS_R):
                    i = tid + NUM_THREADS * r
                    if i < NCS:
                        chl = i // W1
                        rc[r] = window(mX, mCS, b, (chl // K) * C + h * K + chl % K, n_tok + i % W1)
                cute.arch.sync_threads()
                for r in cutlass.range_constexpr(NCS_R):
                    i = tid + NUM_THREADS * r
                    if i < NCS:
                        chl = i // W1
                        mCS[b, (chl // K) * C + h * K + chl % K, i % W1] = rc[r].to(BFloat16)

    return tile


def build_kda_stream(block):
    """The streaming form (see the module docstring): tile t = (b, group g) = (t // (H / HPT),
    t % (H / HPT)), heads g * HPT + i; chunk c = V-slice c % v_split of head i = c // v_split.
    Smem activations `sx`: [T, HPT, 4, K] fp32 (q * K^-0.5 / |q|, k / |k|, exp(a), v), then beta
    [T, HPT] fp32, then the cross-warp K-sum exchange (NWK > 1)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.nvgpu import cpasync

    from ._cute import gmem_tensor, producer_slot, smem_tensor

    P = _Parts(block)
    B, T, H, K, V = P.B, P.T, P.H, P.K, P.V
    VS, RK, VSPLIT = P.VS, P.RK, P.VSPLIT
    HPT = block.config.heads_per_tile
    GROUPS = H // HPT                        # head groups (tiles) per sequence
    idx, commit, write_state, log_decay = P.idx, P.commit, P.write_state, P.log_decay
    sdt, odt, s_align, o_align, gdt = P.sdt, P.odt, P.s_align, P.o_align, P.gdt
    NW = NUM_THREADS // 32
    NP = PRODUCER_THREADS
    sb = 4 if block.config.state_dtype == "fp32" else 2
    EU = 16 // sb                            # state elements per 16-byte unit
    UPR = VS // EU                           # units per row of a slice (a power of two)
    UNITS = K * UPR                          # units of a chunk
    H4 = EU // 4                             # 4-column groups per unit
    KPL = K // 32                            # K elements per lane in begin (one warp per token)
    SX_BETA = T * HPT * 4 * K                # fp32 word offsets in sx
    SX_EX = block.stream_sx_exchange_offset()

    @cute.jit
    def issue(ptrs, t: Int32, ch: Int32, stage_addr):
        p = producer_slot()
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                   sdt, num_bits_per_copy=128)
        mS = gmem_tensor(ptrs[idx["state"]], sdt, (B * H, K, V // EU, EU), 16)
        sS = smem_tensor(stage_addr, sdt, (K, UPR, EU))
        bh = t * HPT + ch // VSPLIT              # = b * H + g * HPT + head of the group
        sl = ch % VSPLIT
        for j in cutlass.range_constexpr(-(-UNITS // NP)):
            u = p + NP * j
            if (p >= 0) & (u < UNITS):
                r = u // UPR
                cu = u - r * UPR
                cute.copy(atom, mS[bh, r, sl * UPR + cu, None], sS[r, cu ^ ((r // RK) % UPR), None])

    @cute.jit
    def begin(ptrs, t: Int32, sx, scratch, fresh: Int32):
        """The group's inputs, one warp per (token, head): l2norms by warp butterflies, gate -> decay."""
        tid, _, _ = cute.arch.thread_idx()
        lane = tid % 32
        warp = tid // 32
        b = t // GROUPS
        h0 = (t % GROUPS) * HPT
        sIn = smem_tensor(sx, Float32, (T * HPT, 4, K))
        sBeta = smem_tensor(sx + 4 * SX_BETA, Float32, (T * HPT,))
        # each lane's KPL consecutive elements as one vector load per operand, all issued first
        a16, ag = _pow2_align(2 * KPL), _pow2_align((2 if gdt is BFloat16 else 4) * KPL)
        mQ = gmem_tensor(ptrs[idx["q"]], BFloat16, (B, T, H, 32, KPL), a16)
        mK = gmem_tensor(ptrs[idx["k"]], BFloat16, (B, T, H, 32, KPL), a16)
        mV = gmem_tensor(ptrs[idx["v"]], BFloat16, (B, T, H, 32, KPL), a16)
        mG = gmem_tensor(ptrs[idx["g"]], gdt, (B, T, H, 32, KPL), ag)
        mBeta = gmem_tensor(ptrs[idx["beta"]], BFloat16, (B, T, block.beta_width), 2)
        rdt = cute.make_rmem_tensor((KPL,), Float32)
        rq = cute.make_rmem_tensor((KPL,), Float32)
        rk = cute.make_rmem_tensor((KPL,), Float32)
        rg = cute.make_rmem_tensor((KPL,), Float32)
        rv = cute.make_rmem_tensor((KPL,), Float32)
        n_tok = Int32(T)
        if cutlass.const_expr(commit == "accepted"):
            mN = gmem_tensor(ptrs[idx["n_accepted"]], Int32, (B,), 4)
            n_tok = mN[b]
        for item in cutlass.range(warp, T * HPT, NW, unroll=1):     # item = tt * HPT + head of the group
            tt = item // HPT
            h = h0 + item % HPT
            # every load issued before the first use: they wait behind the ring's copies in flight
            a_log = Float32(0.0)
            if cutlass.const_expr(not log_decay):
                mDt = gmem_tensor(ptrs[idx["dt_bias"]], Float32, (H, 32, KPL), _pow2_align(4 * KPL))
                mA = gmem_tensor(ptrs[idx["a_log"]], Float32, (H,), 4)
                a_log = mA[h]
                rdt.store(mDt[h, lane, None].load())
            rq.store(mQ[b, tt, h, lane, None].load().to(Float32))
            rk.store(mK[b, tt, h, lane, None].load().to(Float32))
            rg.store(mG[b, tt, h, lane, None].load().to(Float32))
            rv.store(mV[b, tt, h, lane, None].load().to(Float32))
            beta = mBeta[b, tt, h].to(Float32)
            rate = cute.math.exp(a_log, fastmath=False)
            qs = Float32(0.0)
            ks = Float32(0.0)
            for e in cutlass.range_constexpr(KPL):
                kk = lane * KPL + e
                qs = qs + rq[e] * rq[e]
                ks = ks + rk[e] * rk[e]
                d = Float32(0.0)
                if cutlass.const_expr(log_decay):
                    d = cute.math.exp(rg[e], fastmath=False)
                else:
                    d = P.decay(rg[e] + rdt[e], rate)
                sIn[item, 2, kk] = d
                sIn[item, 3, kk] = rv[e]
            for o in (1, 2, 4, 8, 16):
                qs = qs + cute.arch.shuffle_sync_bfly(qs, offset=o)
                ks = ks + cute.arch.shuffle_sync_bfly(ks, offset=o)
            qn = cute.math.rsqrt(qs + Float32(P.eps)) * Float32(P.scale)
            kn = cute.math.rsqrt(ks + Float32(P.eps))
            for e in cutlass.range_constexpr(KPL):
                sIn[item, 0, lane * KPL + e] = rq[e] * qn
                sIn[item, 1, lane * KPL + e] = rk[e] * kn
            if lane == 0:
                if cutlass.const_expr(P.beta_sig):
                    beta = P.sigmoid(beta)
                sBeta[item] = beta
        if n_tok > T:
            n_tok = Int32(T)
        if n_tok < 0:
            n_tok = Int32(0)
        cute.arch.sync_threads()
        return [n_tok]

    @cute.jit
    def prep(ptrs, t: Int32, ch: Int32, state, sx, scratch, fresh: Int32):
        pass

    @cute.jit
    def consume(ptrs, t: Int32, ch: Int32, stage_addr, state, sx):
        """Chunk ch of tile t (V-slice ch % v_split of the group's head ch // v_split): the slice
        from its stage into registers, the T tokens, the outputs (and the slice) straight to
        global memory."""
        n_tok = state[0]
        tid, _, _ = cute.arch.thread_idx()
        lane, wv, wk, vl, kl, kq, col = P.lane_coords(tid)
        hg = ch // VSPLIT                              # the head within the group
        b = t // GROUPS
        h = (t % GROUPS) * HPT + hg
        cl = col // 4                                  # this lane's 4-column group in the slice
        c4 = (ch % VSPLIT) * (VS // 4) + cl            # ... in [0, V/4)
        sS = smem_tensor(stage_addr, sdt, (K, UPR, H4, 4))
        sw = kq % UPR                                  # the swizzle of this thread's rows
        rS = cute.make_rmem_tensor((RK, 4), Float32)
        for j in cutlass.range_constexpr(RK):
            rS[j, None].store(sS[kq * RK + j, (cl // H4) ^ sw, cl % H4, None].load().to(Float32))
        sQK = smem_tensor(sx, Float32, (T * HPT, 4, K // RK, RK))
        sV4 = smem_tensor(sx, Float32, (T * HPT, 4, K // 4, 4))
        sBeta = smem_tensor(sx + 4 * SX_BETA, Float32, (T * HPT,))
        sX = smem_tensor(sx + 4 * SX_EX, Float32, (max(1, block.k_exchange_words()),))
        mO = gmem_tensor(ptrs[idx["o"]], odt, (B, T, H, V // 4, 4), o_align)
        rq = cute.make_rmem_tensor((RK,), Float32)
        rk = cute.make_rmem_tensor((RK,), Float32)
        rd = cute.make_rmem_tensor((RK,), Float32)
        rv = cute.make_rmem_tensor((4,), Float32)
        racc = cute.make_rmem_tensor((4,), Float32)
        for tt in cutlass.range(n_tok, unroll=1):
            item = tt * HPT + hg
            rq.store(sQK[item, 0, kq, None].load())
            rk.store(sQK[item, 1, kq, None].load())
            rd.store(sQK[item, 2, kq, None].load())
            rv.store(sV4[item, 3, c4, None].load())
            P.delta_rule(rS, rq, rk, rd, rv, racc, sBeta[item], Float32(0.0), Float32(0.0), sX,
                         wv, wk, col, kl, lane, False)
            if (kl == 0) & (wk == 0):
                mO[b, tt, h, c4, None].store(racc.load().to(odt))
            if cutlass.const_expr(commit == "per_token"):
                mSO = gmem_tensor(ptrs[idx["states_out"]], sdt, (B, T, H, K, V // 4, 4), s_align)
                for j in cutlass.range_constexpr(RK):
                    mSO[b, tt, h, kq * RK + j, c4, None].store(rS[j, None].load().to(sdt))
        if cutlass.const_expr(write_state):
            if n_tok > 0:
                mS = gmem_tensor(ptrs[idx["state"]], sdt, (B, H, K, V // 4, 4), s_align)
                for j in cutlass.range_constexpr(RK):
                    mS[b, h, kq * RK + j, c4, None].store(rS[j, None].load().to(sdt))

    @cute.jit
    def end(ptrs, t: Int32, state, scratch):
        pass

    return StreamFaces(issue=issue, begin=begin, prep=prep, consume=consume, end=end)
