"""The MoE router's selection and dispatch table (`RouterSelectBlock`). The gate GEMV before it
(logits = x @ W_router^T, W fp32 or bf16, fp32 out) is a `GemvBlock`: wide (Kimi K3: 896 x 7168
fp32 = 25.7 MB, ~6 us of bandwidth), it spreads over all SMs and streams through the
megakernel's smem ring; the selection is a few microseconds of register work in one CTA.

RouterSelectBlock (one tile) per token, in the order of `sdk/reference/moe.py:route()`:
    scores  = sigmoid | softmax | sqrt(softplus) of the logits
    choice  = scores + correction bias                  (selection only)
    group-limited top-k: keep the `topk_group` best of `n_group` groups (a group's score is the
              sum of its two best choices), mask the others
    ids     = top-k of choice (or, hash routing: tid2eid[input_ids[m]])
    weights = scores[ids], renormalised (norm_topk_prob), times routed_scaling_factor
  then the dispatch table of THIS rank's experts (local ids `le = id - local_start`,
  0 <= le < num_local):
    counts[le]      tokens routed to local expert le this step (0: the expert is not hit)
    hits[0]         H, the number of hit local experts; hits[1..H] their local ids, ascending
    tok[le, i]      token of the i-th assignment of expert le (i < counts[le])
    slot[le, i]     its assignment slot m * top_k + j (row of the `act` buffer and of topk_w)
  and topk_ids [M, k] (global expert ids), topk_w [M, k] fp32 (the final weights).

  Reset: the tile zeroes `counts` itself before filling it (a CTA barrier in between), and
  overwrites `hits`; the consumers wait on the tile's counter, so nothing is reset by the host
  and back-to-back launches (CUDA-graph replays) see only their own step's table.
  Order inside one expert's list: the device appends with atomics (any order); the order does
  not change any result (each assignment's rows are independent and the combine sums each
  token's experts in the fixed `hits` order). The torch twin appends in token order.

Tie rule (selection): among equal `choice` values the LOWER expert index wins, for the experts
and for the groups (argmax with index tie-break). torch.topk gives no tie guarantee; the tests
check this rule directly.

Supported: E a multiple of 32 (each lane holds E/32 scores in registers), E <= 1024, top_k <= 32,
num_local <= 256 (one thread per local expert), M = 1..64, n_group dividing E. Not: a NaN logit
(undefined order). DeepSeek-V4's `router_logits_dtype = "model"` (the model computes its router in
bf16): `logits_bf16` rounds each logit to bf16 and every step after it as torch's bf16 ops do -
the score (sigmoid; softplus then sqrt; softmax once), the renormalisation's sum and quotient and
the scaling - so the selection and the weights are the model's (the bias stays fp32, as the
model keeps it); the GEMV's fp32 logits round to the model's bf16 ones but where the summation
orders straddle a rounding boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import NUM_THREADS, Block, Cost, OperandSpec

SCORING = ("sigmoid", "softmax", "sqrtsoftplus")


@dataclass(frozen=True)
class RouterSelectConfig:
    num_experts: int
    top_k: int
    m: int = 1
    scoring: str = "sigmoid"
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hash_routed: bool = False
    vocab: int = 0                       # rows of tid2eid (hash routing)
    local_start: int = 0                 # this rank's experts: [local_start, local_start + num_local)
    num_local: int = 0                   # 0 = all experts
    warp_argmax: str = "redux"           # each top-k round's warp (value, index) max: "redux" (redux.sync
                                         # max of an order-preserving key, then min of the tied indices:
                                         # 2 instructions) or "shuffle" (5 butterfly steps of value +
                                         # index, ~300 cycles of latency). H200: K3 select 5.7 vs 7.4 us
                                         # at batch 1, 9.9 vs 10.8 at batch 8 (bench/select_bench.py)
    logits_bf16: bool = False            # DeepSeek-V4's router in bf16: logits, scores and weights rounded
                                         # as its bf16 ops round them (module docstring)


def route_rule(cfg: RouterSelectConfig, logits: torch.Tensor, bias: torch.Tensor | None,
               hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection rule the device implements, in torch (fp32): `route()` of the reference with
    the tie rule made explicit (lower index wins). Returns (weights [M, k] fp32, ids [M, k] int64)
    with ids of each token in selection order (best first). logits_bf16: the scores and weights
    computed in bf16 ops, as the model's bf16 router (returned as fp32 values)."""
    x = logits.to(torch.bfloat16) if cfg.logits_bf16 else logits.float()
    if cfg.scoring == "sigmoid":
        scores = x.sigmoid()
    elif cfg.scoring == "softmax":
        scores = x.softmax(dim=-1)
    else:
        scores = F.softplus(x).sqrt()
    m, e = scores.shape
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        choice = scores.float() + (bias.float() if bias is not None else 0.0)
        # a stable descending sort: among equal values the lower index comes first
        if cfg.n_group > 1:
            g = choice.view(m, cfg.n_group, e // cfg.n_group)
            gs = g.sort(dim=-1, descending=True, stable=True)[0][..., :2].sum(-1)
            keep = gs.sort(dim=-1, descending=True, stable=True)[1][:, :cfg.topk_group]
            mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
        ids = choice.sort(dim=-1, descending=True, stable=True)[1][:, :cfg.top_k]
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * cfg.routed_scaling_factor).float(), ids


class RouterSelectBlock(Block):
    name = "router_select"
    Config = RouterSelectConfig

    @property
    def num_local(self) -> int:
        return self.config.num_local or self.config.num_experts

    def check(self):
        c = self.config
        if c.scoring not in SCORING:
            self.unsupported(f"router_select: scoring {c.scoring!r} (supported: {SCORING})")
        if c.warp_argmax not in ("shuffle", "redux"):
            self.unsupported(f"router_select: warp_argmax {c.warp_argmax!r} (supported: shuffle, redux)")
        if c.num_experts % 32 or c.num_experts > 1024:
            self.unsupported(f"router_select: {c.num_experts} experts (supported: multiples of 32, <= 1024)")
        if not 1 <= c.top_k <= 32:
            self.unsupported(f"router_select: top_k={c.top_k} (supported: 1..32)")
        if not 1 <= c.m <= 64:
            self.unsupported(f"router_select: m={c.m} tokens (supported: 1..64)")
        if not 1 <= self.num_local <= NUM_THREADS or c.local_start + self.num_local > c.num_experts:
            self.unsupported(f"router_select: local experts [{c.local_start}, +{self.num_local}) "
                             f"(supported: at most {NUM_THREADS}, inside the {c.num_experts} experts)")
        if c.n_group > 1 and (c.num_experts % c.n_group or not 1 <= c.topk_group <= c.n_group
                              or c.n_group > 32 or c.num_experts // c.n_group < 2):
            self.unsupported(f"router_select: n_group={c.n_group}, topk_group={c.topk_group}")
        if c.hash_routed and c.vocab <= 0:
            self.unsupported("router_select: hash routing needs vocab > 0 (rows of tid2eid)")

    def operand_specs(self):
        c = self.config
        L, M, k = self.num_local, c.m, c.top_k
        return [OperandSpec("logits", (M, c.num_experts), "fp32"),
                OperandSpec("bias", (c.num_experts,), "fp32", optional=not c.correction_bias),
                OperandSpec("tid2eid", (max(c.vocab, 1), k), "int32", optional=not c.hash_routed),
                OperandSpec("input_ids", (M,), "int32", optional=not c.hash_routed),
                OperandSpec("topk_ids", (M, k), "int32", output=True),
                OperandSpec("topk_w", (M, k), "fp32", output=True),
                OperandSpec("counts", (L,), "int32", output=True),
                OperandSpec("hits", (L + 1,), "int32", output=True),
                OperandSpec("tok", (L, M), "int32", output=True),
                OperandSpec("slot", (L, M), "int32", output=True)]

    def num_tiles(self) -> int:
        return 1

    def own_smem_bytes(self) -> int:
        """The local experts' token counts while the tile dispatches (int32 each)."""
        return -(-4 * self.num_local // 16) * 16

    @property
    def warps_per_token(self) -> int:
        """Warps that select one token's experts: 1 (a warp per token), or with fewer tokens than
        warps the largest power of two that fits (8 at batch 1): two short passes instead of one
        warp's K rounds over all E scores. Correct on the H200 (rule tests at batch 1 / 2 / 3),
        but the select instruction measured ~10 us at Kimi K3 batch 1 either way: its time is
        elsewhere (docs/moe.md). Elementwise scoring without groups or hashing only (softmax needs
        the whole row's normaliser, groups the whole row's group scores)."""
        c = self.config
        if c.scoring == "softmax" or c.n_group > 1 or c.hash_routed or c.m * 2 > NUM_THREADS // 32:
            return 1
        w = 1
        while w * 2 * c.m <= NUM_THREADS // 32:
            w *= 2
        return w

    def cost(self) -> Cost:
        c = self.config
        L = self.num_local
        b = c.m * c.num_experts * 4 + c.m * c.top_k * 8 * 2 + L * (8 + 8 * c.m)
        # the work is latency, not bytes: ~1.3 us of set-up and merge, then per selected expert a
        # round of ~270 ns plus a scan of E / 32 / WPT values per lane, per group of 8 tokens
        # (one warp per token). Calibrated on the H200 (bench/select_bench.py, redux rounds: K3
        # 5.7 / 9.9 us at batch 1 / 8, GLM 3.5 / 3.5, V4.1 3.3 / 4.0; model 6.2 / 9.9, 3.6 / 4.2,
        # 3.0 / 3.6). Counted as bytes at one SM's share so the scheduler sees its length.
        w = self.warps_per_token
        groups = 1 if w > 1 else (c.m + 7) // 8
        lat_ns = 1300 + groups * c.top_k * (270 + 9.5 * c.num_experts / 32 / w)
        return Cost(bytes=max(b, int(lat_ns * 4260 / 132)), flops=c.m * c.num_experts * 10)

    # -- torch faces ---------------------------------------------------------------------------
    def _select(self, t):
        c = self.config
        hash_ids = None
        if c.hash_routed:
            hash_ids = t["tid2eid"][t["input_ids"].long()].long()
        return route_rule(c, t["logits"], t.get("bias") if c.correction_bias else None, hash_ids)

    def reference(self, **t):
        w, ids = self._select(t)
        return {"topk_ids": ids.to(torch.int32), "topk_w": w}

    def emulate_tile(self, t, tile):
        c = self.config
        w, ids = self._select(t)
        t["topk_ids"].copy_(ids.to(torch.int32))
        t["topk_w"].copy_(w)
        t["counts"].zero_()
        hits = []
        for le in range(self.num_local):
            m_idx, j_idx = torch.where(ids == c.local_start + le)      # token order
            n = len(m_idx)
            t["counts"][le] = n
            if n:
                hits.append(le)
                t["tok"][le, :n] = m_idx.to(torch.int32)
                t["slot"][le, :n] = (m_idx * c.top_k + j_idx).to(torch.int32)
        t["hits"][0] = len(hits)
        if hits:
            t["hits"][1:1 + len(hits)] = torch.tensor(hits, dtype=torch.int32)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import TileSmem, bits_to_f32, f32_bits, gmem_tensor, lane_list_get, redux_u32, write_hit_list

        c = self.config
        E, M, K = c.num_experts, c.m, c.top_k
        NE = E // 32
        L = self.num_local
        OWN = self.own_smem_bytes()
        NW = NUM_THREADS // 32
        G = E // c.n_group if c.n_group > 1 else E
        NG = c.n_group
        grouped = c.n_group > 1
        scoring = c.scoring
        has_bias = c.correction_bias
        hashed = c.hash_routed
        renorm = c.norm_topk_prob
        scale = float(c.routed_scaling_factor)
        lo = c.local_start
        NEG = -math.inf
        WPT = self.warps_per_token       # > 1: the warps of a token split its experts (split_select)
        NI = -(-NE // WPT)               # expert slots per lane in a split warp
        NC = -(-(WPT * K) // 32)         # merge: candidates per lane

        def sel_f(cond, a, b):
            return Float32(cutlass.select_(cond, a, b))

        LB = c.logits_bf16

        @cute.jit
        def bf(x: Float32) -> Float32:
            """x as a bf16 op stores it (logits_bf16), else x."""
            r = x
            if cutlass.const_expr(LB):
                v = cute.make_rmem_tensor((1,), Float32)
                v[0] = x
                r = v.load().to(BFloat16).to(Float32)[0]
            return r

        def sel_i(cond, a, b):
            return Int32(cutlass.select_(cond, a, b))

        @cute.jit
        def score_of(x: Float32, mx: Float32, inv_sum: Float32) -> Float32:
            s = Float32(0.0)
            x = bf(x)
            if cutlass.const_expr(scoring == "sigmoid"):
                s = bf(Float32(1.0) / (Float32(1.0) + cute.math.exp(-x, fastmath=False)))
            elif cutlass.const_expr(scoring == "softmax"):
                s = bf(cute.math.exp(x - mx, fastmath=False) * inv_sum)
            else:
                # softplus, overflow-safe: max(x, 0) + log1p(exp(-|x|)) (= torch's within fp32)
                sp = bf(cute.arch.fmax(x, Float32(0.0)) + cute.math.log1p(
                    cute.math.exp(-cute.math.absf(x), fastmath=False), fastmath=False))
                s = bf(cute.math.sqrt(sp, fastmath=False))
            return s

        @cute.jit
        def argmax_bfly(v: Float32, e: Int32):
            """Warp-wide (value, index) max; ties: lower index. Every lane gets the result."""
            for off in cutlass.range_constexpr(5):
                ov = cute.arch.shuffle_sync_bfly(v, offset=16 >> off)
                oe = cute.arch.shuffle_sync_bfly(e, offset=16 >> off)
                take = (ov > v) | ((ov == v) & (oe < e))
                v = sel_f(take, ov, v)
                e = sel_i(take, oe, e)
            return v, e

        @cute.jit
        def argmax_redux(v: Float32, e: Int32):
            """argmax_bfly's result (max value, ties: lower index) in two redux instructions: the
            max of an order-preserving unsigned key of v (sign bit flipped for v >= 0, all bits
            for v < 0), then the min index among the lanes holding that key. (-0.0 sorts below
            +0.0 here; the scores it compares are sigmoid / softmax / sqrtsoftplus + bias.)"""
            bits = f32_bits(v)
            key = bits ^ ((bits >> 31) | Int32(-2147483648))
            top = redux_u32(key, "max")
            be = redux_u32(sel_i(key == top, e, Int32(2147483647)), "min")
            back = sel_i(top < 0, top ^ Int32(-2147483648), top ^ Int32(-1))     # top bit set: v >= 0
            return bits_to_f32(back), be

        warp_argmax = argmax_redux if c.warp_argmax == "redux" else argmax_bfly

        def argmax_slots(v, e, n):
            """(value, index) max over n register slots as a tree (depth log2 n, not a chain of n);
            ties: lower index. Plain Python: the tree is unrolled while tracing."""
            vs = [v[i] for i in range(n)]
            es = [e[i] for i in range(n)]
            while len(vs) > 1:
                nv, ne = [], []
                for i in range(0, len(vs) - 1, 2):
                    take = (vs[i + 1] > vs[i]) | ((vs[i + 1] == vs[i]) & (es[i + 1] < es[i]))
                    nv.append(sel_f(take, vs[i + 1], vs[i]))
                    ne.append(sel_i(take, es[i + 1], es[i]))
                if len(vs) % 2:
                    nv.append(vs[-1])
                    ne.append(es[-1])
                vs, es = nv, ne
            return vs[0], es[0]

        @cute.jit
        def top_k_of_slots(v, e, n: cutlass.Constexpr, lane):
            """The warp's K best (value, index) of its n slots per lane, in order: lane j < K gets
            the j-th. Each round: the lane's best slot (tree), the warp's best (butterfly), mask it."""
            my_v = Float32(NEG)
            my_e = Int32(E)
            for j in cutlass.range(K, unroll=1):
                bv, be = argmax_slots(v, e, n)
                bv, be = warp_argmax(bv, be)
                for i in cutlass.range_constexpr(n):
                    v[i] = sel_f(e[i] == be, Float32(NEG), v[i])
                    e[i] = sel_i(e[i] == be, Int32(E + 1), e[i])
                my_v = sel_f(lane == j, bv, my_v)
                my_e = sel_i(lane == j, be, my_e)
            return my_v, my_e

        @cute.jit
        def finish(m, my_e, mLg, mIds, mTw, mTok, mSlot, sCnt, lane, mx, inv_sum, sc=None):
            """Token m's selected experts (lane j < K: the j-th) -> weights, topk outputs, dispatch.
            The selected experts' logits from the warp's registers (sc: a warp a token), else read
            again from mLg (the split select: a copy of the token's logits in shared memory would
            take a weight-ring stage from layers whose expert tiles stage nothing - Kimi K3 fp8 / bf16
            experts at batch 1: 7 -> 6 stages)."""
            my_w = Float32(0.0)
            if cutlass.const_expr(sc is not None):
                # NE shuffles instead of a global load: that load was a dependent round trip on the
                # router's critical path (the select takes 4.5-9 us inside the layer, 3.3 alone)
                lg = lane_list_get(sc, my_e, NE)
                if lane < K:
                    my_w = score_of(lg, mx, inv_sum)
            elif lane < K:
                my_w = score_of(mLg[m, my_e], mx, inv_sum)
            if cutlass.const_expr(renorm):
                tot = cute.arch.warp_reduction_sum(my_w)
                my_w = bf(my_w / bf(bf(tot) + Float32(1e-20)))
            my_w = bf(my_w * Float32(scale))
            if lane < K:
                mIds[m, lane] = my_e
                mTw[m, lane] = my_w
                le = my_e - lo
                if (le >= 0) & (le < L):
                    pos = cute.arch.atomic_add(sCnt.iterator + le, Int32(1), sem="relaxed", scope="cta")
                    mTok[le, pos] = m
                    mSlot[le, pos] = m * K + lane

        @cute.jit
        def split_select(mLg, mB, mIds, mTw, mTok, mSlot, sCnt, lane, warp, scratch):
            """WPT warps per token: warp q of token m takes the experts i * 32 + lane with i = q,
            q + WPT, ..; each finds its K best, writes them to scratch; after a barrier the token's
            first warp merges the WPT * K candidates (K rounds over NC per lane). Elementwise
            scoring only (no softmax normaliser, no groups: see warps_per_token)."""
            m = warp // WPT
            q = warp % WPT
            if m < M:
                v = cute.make_rmem_tensor((NI,), Float32)
                e = cute.make_rmem_tensor((NI,), Int32)
                for s in cutlass.range_constexpr(NI):
                    i = s * WPT + q
                    v[s] = Float32(NEG)
                    e[s] = Int32(E)
                    if i < NE:
                        x = score_of(mLg[m, i * 32 + lane], Float32(0.0), Float32(1.0))
                        if cutlass.const_expr(has_bias):
                            x = x + mB[i * 32 + lane]
                        v[s] = x
                        e[s] = i * 32 + lane
                bv, be = top_k_of_slots(v, e, NI, lane)
                if lane < K:
                    scratch[2 * (warp * K + lane)] = bv
                    scratch[2 * (warp * K + lane) + 1] = Float32(be)
            cute.arch.sync_threads()
            if (m < M) & (q == 0):
                cv = cute.make_rmem_tensor((NC,), Float32)
                ce = cute.make_rmem_tensor((NC,), Int32)
                for s in cutlass.range_constexpr(NC):
                    cidx = s * 32 + lane
                    cv[s] = Float32(NEG)
                    ce[s] = Int32(E)
                    if cidx < WPT * K:
                        cv[s] = scratch[2 * (m * WPT * K + cidx)]
                        ce[s] = Int32(scratch[2 * (m * WPT * K + cidx) + 1])
                _, my_e = top_k_of_slots(cv, ce, NC, lane)
                finish(m, my_e, mLg, mIds, mTw, mTok, mSlot, sCnt, lane, Float32(0.0), Float32(1.0))

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            mLg = gmem_tensor(ptrs[0], Float32, (M, E), 4)
            mIds = gmem_tensor(ptrs[4], Int32, (M, K), 4)
            mTw = gmem_tensor(ptrs[5], Float32, (M, K), 4)
            mTok = gmem_tensor(ptrs[8], Int32, (L, M), 4)
            mSlot = gmem_tensor(ptrs[9], Int32, (L, M), 4)
            mHits = gmem_tensor(ptrs[7], Int32, (L + 1,), 4)
            mCnt = gmem_tensor(ptrs[6], Int32, (L,), 4)
            # the counts live in shared memory while the tokens are dispatched (one tile does them
            # all): slot positions come from shared-memory atomics, not a global round trip each,
            # and the hit list from the same counts; global gets them once, at the end
            sCnt = TileSmem(scratch, OWN).allocate_tensor(Int32, cute.make_layout((L,)), byte_alignment=16)
            # 1. this step's counts start at 0
            for le in cutlass.range(tid, L, NUM_THREADS):
                sCnt[le] = Int32(0)
            cute.arch.sync_threads()
            # 2. per token: scores, selection, weights, dispatch (one warp per token, or WPT)
            if cutlass.const_expr(WPT > 1):
                mBs = gmem_tensor(ptrs[1], Float32, (E,), 4) if has_bias else None
                split_select(mLg, mBs, mIds, mTw, mTok, mSlot, sCnt, lane, warp, scratch)
            else:
                sc = cute.make_rmem_tensor((NE,), Float32)
                ch = cute.make_rmem_tensor((NE,), Float32)
                for m in cutlass.range(warp, M, NW):
                    mx = Float32(NEG)
                    for i in cutlass.range_constexpr(NE):
                        sc[i] = bf(mLg[m, i * 32 + lane])
                        mx = cute.arch.fmax(mx, sc[i])
                    inv_sum = Float32(1.0)
                    if cutlass.const_expr(scoring == "softmax"):
                        mx = cute.arch.warp_reduction_max(mx)
                        ssum = Float32(0.0)
                        for i in cutlass.range_constexpr(NE):
                            ssum = ssum + cute.math.exp(sc[i] - mx, fastmath=False)
                        inv_sum = Float32(1.0) / cute.arch.warp_reduction_sum(ssum)
                    my_e = Int32(0)            # lane j < K: the j-th selected expert of token m
                    if cutlass.const_expr(hashed):
                        mT = gmem_tensor(ptrs[2], Int32, (c.vocab, K), 4)
                        mIn = gmem_tensor(ptrs[3], Int32, (M,), 4)
                        if lane < K:
                            my_e = mT[mIn[m], lane]
                    else:
                        if cutlass.const_expr(has_bias):
                            # all NE bias loads in flight at once (ch holds them until the scores are
                            # known); a load next to its use is a round trip per expert group of 32
                            mB = gmem_tensor(ptrs[1], Float32, (E,), 4)
                            for i in cutlass.range_constexpr(NE):
                                ch[i] = mB[i * 32 + lane]
                        for i in cutlass.range_constexpr(NE):
                            v = score_of(sc[i], mx, inv_sum)
                            if cutlass.const_expr(has_bias):
                                v = v + ch[i]
                            ch[i] = v
                        if cutlass.const_expr(grouped):
                            # group score = sum of its two best choices; keep the topk_group best groups
                            gsc = cute.make_rmem_tensor((NG,), Float32)
                            for g in cutlass.range_constexpr(NG):
                                b1 = Float32(NEG)
                                b2 = Float32(NEG)
                                for i in cutlass.range_constexpr(NE):
                                    inside = (i * 32 + lane) // G == g
                                    v = sel_f(inside, ch[i], Float32(NEG))
                                    b2 = cute.arch.fmax(b2, cute.arch.fmin(b1, v))
                                    b1 = cute.arch.fmax(b1, v)
                                for off in cutlass.range_constexpr(5):
                                    o1 = cute.arch.shuffle_sync_bfly(b1, offset=16 >> off)
                                    o2 = cute.arch.shuffle_sync_bfly(b2, offset=16 >> off)
                                    b2 = cute.arch.fmax(cute.arch.fmax(b2, o2), cute.arch.fmin(b1, o1))
                                    b1 = cute.arch.fmax(b1, o1)
                                gsc[g] = b1 + b2
                            keep = cute.make_rmem_tensor((NG,), Int32)
                            keep.fill(0)
                            for r in cutlass.range(c.topk_group, unroll=1):
                                bv = Float32(NEG)
                                bg = Int32(NG)
                                for g in cutlass.range_constexpr(NG):
                                    better = (keep[g] == 0) & ((gsc[g] > bv) | (bg == NG))
                                    bv = sel_f(better, gsc[g], bv)
                                    bg = sel_i(better, Int32(g), bg)
                                for g in cutlass.range_constexpr(NG):
                                    keep[g] = sel_i(bg == g, Int32(1), keep[g])
                            for i in cutlass.range_constexpr(NE):
                                grp = (i * 32 + lane) // G
                                kept = Int32(0)
                                for g in cutlass.range_constexpr(NG):
                                    kept = sel_i(grp == g, keep[g], kept)
                                ch[i] = sel_f(kept != 0, ch[i], Float32(NEG))
                        # a loop, not unrolled: K x NE unrolled compares are tens of thousands of
                        # instructions run once each - instruction-fetch bound (28 us measured at K3)
                        for j in cutlass.range(K, unroll=1):
                            bv = Float32(NEG)
                            be = Int32(E)
                            for i in cutlass.range_constexpr(NE):
                                # ascending index within the lane: strict > keeps the lower index
                                better = (ch[i] > bv) | (be == E)
                                bv = sel_f(better, ch[i], bv)
                                be = sel_i(better, Int32(i * 32) + lane, be)
                            bv, be = warp_argmax(bv, be)
                            for i in cutlass.range_constexpr(NE):
                                ch[i] = sel_f(be == i * 32 + lane, Float32(NEG), ch[i])
                            my_e = sel_i(lane == j, be, my_e)
                    # weights: the score of each selected expert (recomputed from its logit)
                    finish(m, my_e, mLg, mIds, mTw, mTok, mSlot, sCnt, lane, mx, inv_sum, sc)
            cute.arch.sync_threads()
            # 3. the counts to global, and the hit list: local experts with tokens, ascending
            n_le = Int32(0)
            if tid < L:
                n_le = sCnt[tid]
                mCnt[tid] = n_le
            write_hit_list(n_le, mHits, scratch)

        return tile
