"""In-kernel all-reduce over peer-mapped symmetric buffers, fused with the residual add and the
following RMSNorm. One block class, three phases (`AllReduceConfig.phase`):

    "oneshot"  tile (m, c) = token row m, column chunk c of D:
               push: store this rank's partial[m, chunk] into slot `rank` of EVERY rank's receive
                     buffer (itself included), barrier, fence.sys, store the epoch into every
                     rank's flag [tile, rank] (release.sys);
               wait: lanes k < N poll this rank's flags [tile, k] >= epoch (acquire.sys), bounded;
               reduce: s = sum_k recv[k] (fp32, k = 0..N-1 on every rank, so all ranks compute
                     bit-identical sums and their replicated residual streams never drift);
                     resid_out = res + s (fp32);
               norm: the last of the row's C tiles to finish (a per-row arrival counter,
                     monotonic: last when it reaches epoch * C) re-reads the whole row and writes
                     out = rmsnorm(resid_out) * weight (bf16): the next op's input.
    "rs"       two-shot, first half (reduce-scatter): the flattened [M * D] message is cut into N
               shards of S = M*D/N elements; tile c covers elements [c*E, (c+1)*E) of every shard:
               push shard k's piece to rank k's rs buffer slot `rank`, flag, wait for the N pieces
               of this rank's shard, reduce (fp32, rank order), round to the wire dtype and push
               the reduced piece into slot `rank` of every rank's ag buffer, flag (ag flags).
    "ag"       two-shot, second half (all-gather + residual + norm): tile m = token row m: lanes
               poll the ag flags of all rs tiles of all ranks, then resid_out = res + gathered,
               out = rmsnorm(resid_out) * weight.

mHC epilogue (`mhc_streams` = N_hc > 0; DeepSeek-V4.1-Flash, GLM-5.3): instead of res + sum and
the norm, the reduced fp32 sum y is post-mixed into the N_hc residual streams exactly as
MHCPostBlock does (X'_n = post_n y + sum_j comb[j, n] X_j, optionally with the next pre-mix's
partial dot products of X'), one op and no extra dependency hop. The one-shot and ag tiles are
then MHCPostBlock's cut: tile t = D-slice t of `mhc_d_slice` columns over ALL M tokens (D /
d_slice tiles), so fn_next's slice is staged in shared memory once per tile (while the flags
travel); the one-shot push moves partial[:, slice]. The rs phase is unchanged. Operands: those
of MHCPostBlock but y (`streams`, `coef`, `fn_next`, `streams_out`, `part_next`) in place of
res / norm_weight / resid_out / out.

Epochs. Flags are int32 and never reset: step e (1, 2, ...) stores e. Each tile keeps its own
epoch in a local `state[tile]` word (read at the start, epoch = state + 1, written back at the
end): no host write per step, CUDA-graph safe. Receive buffers are double-buffered by epoch
parity ([2, ...], index e % 2), and the program alternates two buffer "colors" between
consecutive all-reduce ops (sdk/comm/layout.py): a rank can only run ahead into the next use of
the same buffer after every peer raised a flag for the op in between, which that peer only
does after it finished reading the buffer (see docs/allreduce.md for the argument).

Bounded waits. A flag wait gives up after params[1] microseconds (globaltimer) or as soon as
the rank's megakernel error word is non-zero; the first CTA to give up claims the error word
(CAS) and fills [ERR_PEER_TIMEOUT, tile, flag id, SM, value seen, epoch wanted, the rank that
never arrived, epoch]; the host turns that into KernelTimeoutError (sdk/comm/runtime.py). The
flag id is the low 31 bits of the waited flag array's address (the host maps it back to the op).

Operands (all int64 device addresses in the operand table): local buffers, the rank's own view
of its receive/flag buffers (`*_self`), and the N peers' buffers as seen from this rank
(`*_0` .. `*_{N-1}`, absolute rank order: on one GPU with virtual ranks they are just the other
ranks' tensors; across GPUs torch symmetric-memory peer views). The rank index is data
(`params[0]`), so all ranks share one compiled kernel.

Supported: N = 1..72 ranks, D a multiple of 4 (elements move in 4-vectors: 8 B bf16, 16 B fp32),
wire dtype bf16 or fp32, residual input none / bf16 / fp32 (may alias resid_out), optional norm;
or the mHC epilogue within MHCPostBlock's limits (N_hc in 1, 2, 4; d_slice a multiple of 128
dividing D; M <= 64; next_rows 0..32) and without residual or norm.
Not supported: NVLink multicast (multimem.*: disabled on these machines), Lamport (sentinel)
buffers, fp8 wire format, fusing the push into the producing GEMV's epilogue (next step).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import SdkError, UnsupportedConfigError
from .base import NUM_THREADS, SCRATCH_WORDS, Block, Cost, OperandSpec
from .mhc import MHCPostBlock, MHCPostConfig

ERR_PEER_TIMEOUT = 2        # error-word code of a flag wait that expired (isa.ERR_TIMEOUT is 1)
PEER_ERROR_FIELDS = ("code", "tile", "flag_id", "sm", "seen", "target", "peer", "epoch")
PARAMS_WORDS = 4            # params: [rank, flag-wait timeout in us, 0, 0]
MAX_RANKS = 72          # NVL72; the peer loops are unrolled (code size grows with N)
TILE_TARGET = 2048          # elements per tile (8 per thread): enough CTAs push at once at small M
_ST, _LAST = SCRATCH_WORDS - 1, SCRATCH_WORDS - 2   # scratch words: wait status, "last tile"
_WIRE_BYTES = {"bf16": 2, "fp32": 4}


class PeersNotReady(SdkError, RuntimeError):
    """The torch twin of a flag wait that cannot be satisfied yet (run several ranks with
    `sdk.comm.vm.MultiRankVM`, which interleaves them)."""


@dataclass(frozen=True)
class AllReduceConfig:
    ranks: int                  # N
    m: int                      # tokens
    d: int                      # hidden
    phase: str = "oneshot"      # "oneshot" | "rs" | "ag" (two-shot halves)
    wire: str = "bf16"          # dtype of the partials and of everything that crosses to peers
    residual: str = "fp32"      # dtype of `res` ("" = none: resid_out = the reduced sum)
    norm: bool = True           # out = rmsnorm(resid_out) * norm_weight (bf16)
    resid_dtype: str = "fp32"   # of resid_out: "bf16" is a plain-residual model's hidden state x,
                                # updated in place (res = resid_out = x; the norm reads it rounded)
    out_shard: int = 0          # > 0: `out` [M, out_shard] holds only this rank's D / N columns of the
                                # normed row (columns [rank * D/N, (rank+1) * D/N) at 0..D/N-1; the
                                # rest of the row, padding, untouched): the input of a K-sharded GEMV
    gather: bool = False        # oneshot all-GATHER instead: `partial` [M, D] is this rank's shard,
                                # `gathered` [M, N * D] (wire dtype) every rank's, rank k's at columns
                                # k * D (gather_rotate: (k - rank) mod N, this rank's own first)
    gather_rotate: bool = False
    eps: float = 1e-6
    tile_elems: int = 0         # oneshot: columns per tile; rs/ag: elements of a shard per rs tile; 0 = auto
    # the mHC epilogue (oneshot, ag): post-mix the sum into mhc_streams residual streams (0: off)
    mhc_streams: int = 0        # N_hc streams [M, N_hc, D]
    mhc_next_rows: int = 0      # > 0: the next pre-mix's partials (fn_next rows), as MHCPostBlock
    mhc_d_slice: int = 128      # D columns per tile (all tokens)
    stream_dtype: str = "fp32"  # of streams / streams_out
    fn_dtype: str = "fp32"      # of fn_next
    mhc_round_coef: bool = True  # post / comb rounded to the stream dtype (V4); False: fp32 (V4.1)


def _divisors4(n: int):
    return [w for w in range(4, n + 1, 4) if n % w == 0]


class AllReduceBlock(Block):
    name = "allreduce"
    Config = AllReduceConfig

    # -- static facts --------------------------------------------------------------------------
    @property
    def shard(self) -> int:
        """S: elements of one rank's shard of the flattened [M * D] message (two-shot)."""
        c = self.config
        return c.m * c.d // c.ranks

    @property
    def cols(self) -> int:
        """W (oneshot): columns of a row per tile."""
        c = self.config
        if c.tile_elems:
            return c.tile_elems
        return max([w for w in _divisors4(c.d) if w <= TILE_TARGET] or [c.d])

    @property
    def chunks(self) -> int:
        """C (oneshot): tiles per row."""
        return self.config.d // self.cols

    @property
    def piece(self) -> int:
        """E (two-shot): elements of each shard per rs tile."""
        c = self.config
        if c.tile_elems:
            return c.tile_elems
        S = self.shard
        cands = [t for t in range(1, NUM_THREADS // c.ranks + 1) if S % (4 * t) == 0]
        if not cands:
            return 0
        small = [t for t in cands if S // t <= TILE_TARGET]
        return S // (small[0] if small else cands[-1])

    @property
    def rs_tiles(self) -> int:
        return self.shard // self.piece if self.piece else 0

    @property
    def mhc(self) -> bool:
        """This phase ends in the mHC post-mix instead of residual + norm (mhc_streams > 0, and the
        phase is oneshot or ag: rs has no epilogue)."""
        return self.config.mhc_streams > 0 and self.config.phase != "rs"

    @cached_property
    def mhc_post(self) -> MHCPostBlock:
        """The MHCPostBlock whose tile the mHC epilogue is (y: the fp32 reduced sum): its limits,
        operands, math and torch twin are the epilogue's."""
        c = self.config
        return MHCPostBlock(MHCPostConfig(d=c.d, n=c.mhc_streams, m=c.m, d_slice=c.mhc_d_slice,
                                          stream_dtype=c.stream_dtype, y_dtype="fp32",
                                          next_rows=c.mhc_next_rows, fn_dtype=c.fn_dtype,
                                          round_coef=c.mhc_round_coef))

    def _check_mhc(self):
        c = self.config
        if c.residual or c.norm:
            self.unsupported(f"allreduce: the mHC epilogue (mhc_streams={c.mhc_streams}) replaces the residual "
                             f"add and the norm; set residual='' and norm=False (got residual={c.residual!r}, "
                             f"norm={c.norm})")
        if c.phase == "rs":
            self.unsupported("allreduce rs: the mHC epilogue runs in the ag phase; build the rs phase without it")
        if c.phase == "oneshot" and c.tile_elems:
            self.unsupported(f"allreduce oneshot with the mHC epilogue: the tile is a D-slice of mhc_d_slice="
                             f"{c.mhc_d_slice} columns; tile_elems={c.tile_elems} does not apply")
        try:
            self.mhc_post
        except UnsupportedConfigError as exc:
            self.unsupported(f"allreduce mHC epilogue: {exc}")

    def check(self):
        c = self.config
        if not 1 <= c.ranks <= MAX_RANKS:
            self.unsupported(f"allreduce: {c.ranks} ranks (supported 1..{MAX_RANKS})")
        if c.phase not in ("oneshot", "rs", "ag"):
            self.unsupported(f"allreduce: phase {c.phase!r} (oneshot, rs, ag)")
        if c.wire not in _WIRE_BYTES:
            self.unsupported(f"allreduce: wire dtype {c.wire!r} (bf16, fp32)")
        if c.residual not in ("", "bf16", "fp32"):
            self.unsupported(f"allreduce: residual dtype {c.residual!r} ('', bf16, fp32)")
        if c.resid_dtype not in ("bf16", "fp32"):
            self.unsupported(f"allreduce: resid_out dtype {c.resid_dtype!r} (bf16, fp32)")
        if c.out_shard and (not c.norm or c.d % (4 * c.ranks) or c.out_shard < c.d // c.ranks):
            self.unsupported(f"allreduce: out_shard={c.out_shard} needs the norm, d={c.d} in 4-vector shards of "
                             f"{c.ranks} ranks, and a row of at least d / ranks")
        if c.gather and (c.phase != "oneshot" or c.residual or c.norm or c.mhc_streams):
            self.unsupported("allreduce gather: the one-shot phase, without residual, norm or mHC epilogue")
        if c.d % 4 or c.m < 1:
            self.unsupported(f"allreduce: d={c.d} must be a multiple of 4, m={c.m} >= 1")
        if c.norm and c.d > 16 * 4 * NUM_THREADS:
            self.unsupported(f"allreduce: fused norm over d={c.d} > {16 * 4 * NUM_THREADS}")
        if c.mhc_streams:
            self._check_mhc()
        if c.phase == "oneshot":
            w = self.cols
            if not c.mhc_streams and (w % 4 or c.d % w or w > 8 * 4 * NUM_THREADS):
                self.unsupported(f"allreduce oneshot: tile columns {w} must divide d={c.d}, be a multiple "
                                 f"of 4 and at most {8 * 4 * NUM_THREADS}")
        else:
            if (c.m * c.d) % (4 * c.ranks):
                self.unsupported(f"allreduce two-shot: m*d={c.m * c.d} must split into {c.ranks} shards "
                                 f"of 4-element vectors")
            e = self.piece
            if not e or e % 4 or self.shard % e or e > 16 * 4 * NUM_THREADS:
                self.unsupported(f"allreduce two-shot: no piece size for shard {self.shard} (tile_elems="
                                 f"{c.tile_elems}): it must divide the shard, be a multiple of 4, <= "
                                 f"{16 * 4 * NUM_THREADS}")
            if self.rs_tiles * c.ranks > NUM_THREADS:
                self.unsupported(f"allreduce two-shot: {self.rs_tiles} rs tiles x {c.ranks} ranks flags "
                                 f"exceed the {NUM_THREADS} polling threads of an ag tile")

    def operand_specs(self):
        c = self.config
        N, M, D, w = c.ranks, c.m, c.d, c.wire
        specs = []
        if c.phase == "oneshot":
            recv = (2, N, M, D)
            flags = (self.num_tiles(), N)
            specs += [OperandSpec("partial", (M, D), w), OperandSpec("recv_self", recv, w),
                      OperandSpec("flags_self", flags, "int32")]
            specs += [OperandSpec(f"recv_{k}", recv, w, output=True) for k in range(N)]
            specs += [OperandSpec(f"flags_{k}", flags, "int32", output=True) for k in range(N)]
        elif c.phase == "rs":
            buf = (2, N, self.shard)
            flags = (self.rs_tiles, N)
            specs += [OperandSpec("partial", (M, D), w), OperandSpec("rs_recv_self", buf, w),
                      OperandSpec("rs_flags_self", flags, "int32")]
            for pre in ("rs_recv", "rs_flags", "ag_recv", "ag_flags"):
                shape, dt = (buf, w) if pre.endswith("recv") else (flags, "int32")
                specs += [OperandSpec(f"{pre}_{k}", shape, dt, output=True) for k in range(N)]
        else:
            specs += [OperandSpec("ag_recv_self", (2, N, self.shard), w),
                      OperandSpec("ag_flags_self", (self.rs_tiles, N), "int32")]
        specs += [OperandSpec("state", (self.num_tiles(),), "int32", output=True),
                  OperandSpec("params", (PARAMS_WORDS,), "int32"),
                  OperandSpec("err", (8,), "int32", output=True)]
        if c.phase == "oneshot" and c.norm and self.chunks > 1:
            specs.append(OperandSpec("rowcnt", (M,), "int32", output=True))
        if c.gather:
            specs.append(OperandSpec("gathered", (M, N * D), w, output=True))
        elif self.mhc:
            specs += [s for s in self.mhc_post.operand_specs() if s.name != "y"]
        elif c.phase != "rs":
            if c.residual:
                specs.append(OperandSpec("res", (M, D), c.residual))
            if c.norm:
                specs.append(OperandSpec("norm_weight", (D,), "bf16"))
            specs.append(OperandSpec("resid_out", (M, D), c.resid_dtype, output=True))
            if c.norm:
                specs.append(OperandSpec("out", (M, c.out_shard or D), "bf16", output=True))
        return specs

    def num_tiles(self) -> int:
        c = self.config
        if self.mhc:
            return self.mhc_post.num_tiles()
        return {"oneshot": c.m * self.chunks if c.phase == "oneshot" else 0, "rs": self.rs_tiles,
                "ag": c.m}[c.phase]

    def own_smem_bytes(self) -> int:
        return self.mhc_post.own_smem_bytes() if self.mhc else 0

    def cost(self) -> Cost:
        c = self.config
        wb = _WIRE_BYTES[c.wire]
        N = c.ranks
        if self.mhc:
            # the slice of every token: pushed (oneshot: read once, stored N times) and reduced from
            # N slots, or gathered (ag); then MHCPostBlock's tile less its y read (y is in registers)
            n = c.m * c.mhc_d_slice
            post = self.mhc_post.cost()
            b = n * wb * (1 + 2 * N if c.phase == "oneshot" else 1) + post.bytes - n * 4
            return Cost(bytes=b, flops=N * n + post.flops)
        if c.phase == "oneshot":
            n = self.cols
            b = n * wb * (1 + N + N) + n * (8 + (2 if c.norm else 0))
        elif c.phase == "rs":
            n = self.piece
            b = n * wb * (N + N + N + N)
        else:
            b = c.d * (wb + 8 + (4 if c.norm else 0))
        return Cost(bytes=b, flops=N * b // wb)

    # -- torch faces ---------------------------------------------------------------------------
    def reference(self, partials, res=None, norm_weight=None, **mhc_inputs) -> dict[str, torch.Tensor]:
        """The whole all-reduce (any phase: the op the phases implement together): fp32 sum of the
        N ranks' partials, + residual, RMSNorm; or, with the mHC epilogue, MHCPostBlock's
        reference on that sum (mhc_inputs: streams, coef, fn_next)."""
        c = self.config
        if c.gather:                    # rank 0's view (gather_rotate: rank r's = these blocks rolled by -r)
            return {"gathered": torch.cat(list(partials), dim=1)}
        r = sum(p.float() for p in partials)
        if c.mhc_streams:
            return self.mhc_post.reference(y=r, **mhc_inputs)
        if c.residual:
            r = res.float() + r
        if c.resid_dtype == "bf16":
            r = r.to(torch.bfloat16).float()
        out = {"resid_out": r}
        if c.norm:
            out["out"] = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + c.eps) * norm_weight.float()
        return out

    @staticmethod
    def _sum_slots(slots):
        """fp32 sum of the N receive slots (slots [N, ...]) in rank order, like the device, so that
        every rank computes the same bits."""
        s = slots[0].float()
        for k in range(1, len(slots)):
            s = s + slots[k].float()
        return s

    def _epoch(self, t, tile):
        e = int(t["state"][tile]) + 1
        return int(t["params"][0]), e, e % 2

    def _norm_row(self, t, m):
        c = self.config
        r = t["resid_out"][m].float()
        o = (r * torch.rsqrt(r.pow(2).mean() + c.eps) * t["norm_weight"].float()).to(torch.bfloat16)
        if c.out_shard:
            w = c.d // c.ranks
            rank = int(t["params"][0])
            t["out"][m, :w] = o[rank * w:(rank + 1) * w]
        else:
            t["out"][m] = o

    def _cut(self, tile):
        """(rows, cols) of the [M, D] message that a one-shot tile (or an ag tile with the mHC
        epilogue) covers: token row m, chunk c; with the mHC epilogue all rows of D-slice `tile`."""
        c = self.config
        if self.mhc:
            return slice(None), slice(tile * c.mhc_d_slice, (tile + 1) * c.mhc_d_slice)
        m, ch = divmod(tile, self.chunks)
        return m, slice(ch * self.cols, (ch + 1) * self.cols)

    def emulate_arrive(self, t, tile) -> None:
        """The tile's pushes and flag stores (everything before its wait)."""
        c = self.config
        rank, e, par = self._epoch(t, tile)
        if c.phase == "oneshot":
            rows, cols = self._cut(tile)
            for k in range(c.ranks):
                t[f"recv_{k}"][par, rank, rows, cols] = t["partial"][rows, cols]
                t[f"flags_{k}"][tile, rank] = e
        elif c.phase == "rs":
            S, E = self.shard, self.piece
            flat = t["partial"].reshape(-1)
            for k in range(c.ranks):
                t[f"rs_recv_{k}"][par, rank, tile * E:(tile + 1) * E] = flat[k * S + tile * E:k * S + (tile + 1) * E]
                t[f"rs_flags_{k}"][tile, rank] = e

    def emulate_missing(self, t, tile) -> list[int]:
        """Ranks whose flags the tile still waits for (empty: it may finish)."""
        c = self.config
        _, e, _ = self._epoch(t, tile)
        if c.phase == "oneshot":
            f = t["flags_self"][tile]
        elif c.phase == "rs":
            f = t["rs_flags_self"][tile]
        else:
            f = t["ag_flags_self"].min(dim=0).values
        return [k for k in range(c.ranks) if int(f[k]) < e]

    def emulate_finish(self, t, tile) -> None:
        """Everything after the wait: reduce, residual, norm (or the mHC post-mix), and (rs) the
        all-gather push."""
        c = self.config
        rank, e, par = self._epoch(t, tile)
        if c.gather:
            m, cols = self._cut(tile)
            D = c.d
            for k in range(c.ranks):
                at = ((k - rank) % c.ranks if c.gather_rotate else k) * D
                t["gathered"][m, at + cols.start:at + cols.stop] = t["recv_self"][par][k, m, cols]
        elif self.mhc:
            rows, cols = self._cut(tile)
            if c.phase == "oneshot":
                y = self._sum_slots(t["recv_self"][par][:, rows, cols])
            else:
                y = t["ag_recv_self"][par].reshape(c.m, c.d)[rows, cols].float()
            self.mhc_post.emulate_slice(t, tile, y)
        elif c.phase == "oneshot":
            m, cols = self._cut(tile)
            s = self._sum_slots(t["recv_self"][par][:, m, cols])
            if c.residual:
                s = s + t["res"][m, cols].float()
            t["resid_out"][m, cols] = s
            if c.norm:
                last = True
                if self.chunks > 1:
                    t["rowcnt"][m] += 1
                    last = int(t["rowcnt"][m]) == e * self.chunks
                if last:
                    self._norm_row(t, m)
        elif c.phase == "rs":
            E = self.piece
            piece = slice(tile * E, (tile + 1) * E)
            q = self._sum_slots(t["rs_recv_self"][par][:, piece]).to(t["rs_recv_self"].dtype)
            for k in range(c.ranks):
                t[f"ag_recv_{k}"][par, rank, piece] = q
                t[f"ag_flags_{k}"][tile, rank] = e
        else:
            m = tile
            g = t["ag_recv_self"][par].reshape(c.m, c.d)[m].float()
            if c.residual:
                g = g + t["res"][m].float()
            t["resid_out"][m] = g
            if c.norm:
                self._norm_row(t, m)
        t["state"][tile] = e

    def emulate_tile(self, t, tile) -> None:
        """One tile at once: only possible when the peers' flags are already there (N = 1, or a
        driver that arrived for every rank first); otherwise PeersNotReady."""
        self.emulate_arrive(t, tile)
        missing = self.emulate_missing(t, tile)
        if missing:
            raise PeersNotReady(f"all-reduce tile {tile}: ranks {missing} have not arrived; run the ranks "
                                f"together with sdk.comm.vm.MultiRankVM")
        self.emulate_finish(t, tile)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32, Int64

        from ._cute import DTYPE_MAP, block_sum, gmem_tensor, peer_wait

        c = self.config
        N, M, D = c.ranks, c.m, c.d
        D4 = D // 4
        NT = NUM_THREADS
        ix = {n: i for i, n in enumerate(self.operands())}
        wdt = DTYPE_MAP[c.wire]
        VA = 4 * _WIRE_BYTES[c.wire]                  # alignment of a 4-vector of the wire dtype
        T = self.num_tiles()
        phase, norm, eps, gather = c.phase, c.norm, c.eps, c.gather
        rdt = DTYPE_MAP[c.residual] if c.residual else None
        RA = 4 * _WIRE_BYTES.get(c.residual, 4)
        odt, OA = DTYPE_MAP[c.resid_dtype], 4 * _WIRE_BYTES[c.resid_dtype]
        SH4 = D // N // 4 if c.out_shard else 0       # out_shard: this rank's 4-vectors of a row
        O4 = c.out_shard // 4 if c.out_shard else D4
        C = self.chunks if phase == "oneshot" else 1
        W4 = self.cols // 4 if phase == "oneshot" else 0
        S4 = self.shard // 4 if phase != "oneshot" else 0
        E4 = self.piece // 4 if phase != "oneshot" else 0
        TRS = self.rs_tiles if phase != "oneshot" else 0

        def nv(n4):
            return -(-n4 // NT)

        if self.mhc:
            from ._mhc_cute import post_mix_helpers
            DS = c.mhc_d_slice
            V, VPL = DS // 4, DS // 128              # 4-vectors of a slice row; per lane
            begin, mix_token, _ = post_mix_helpers(M, c.mhc_streams, D, DS, c.mhc_next_rows, c.stream_dtype,
                                                c.fn_dtype, c.mhc_round_coef)

        @cute.jit
        def push(ptrs, par: Int32, rank: Int32, m, col, v):
            """One-shot: store the 4-vector v (token m, column col) into slot `rank` of every rank's
            receive buffer (this rank's own included: one uniform loop)."""
            for k in cutlass.range_constexpr(N):
                mR = gmem_tensor(ptrs[ix[f"recv_{k}"]], wdt, (2, N, M, D4, 4), VA)
                mR[par, rank, m, col, None].store(v)

        @cute.jit
        def slot_sum(mS, par: Int32, m, col):
            """fp32 sum of the N receive slots' 4-vector (m, col) in rank order (k = 0..N-1 on every
            rank: bit-identical sums everywhere)."""
            acc = mS[par, 0, m, col, None].load().to(Float32)
            for k in cutlass.range_constexpr(1, N):
                acc = acc + mS[par, k, m, col, None].load().to(Float32)
            return acc

        @cute.jit
        def gathered(mA, par: Int32, f):
            """4-vector f of the flattened [M * D] reduced message, from the shard slot holding it."""
            sh = f // S4
            return mA[par, sh, f - sh * S4, None].load().to(Float32)

        @cute.jit
        def wait_flags(faddr, first: Int32, count: cutlass.Constexpr, e: Int32, tmo: Int64, ebase,
                       t: Int32, scratch):
            """Threads tid < count wait for flags[first + tid] >= e in parallel (one L2 round trip
            when all arrived, instead of `count` dependent ones). Returns 1 when all arrived."""
            tid, _, _ = cute.arch.thread_idx()
            if tid == 0:
                scratch[_ST] = Float32(1.0)
            cute.arch.sync_threads()
            if tid < count:
                fbase = cute.make_ptr(Int32, faddr, cute.AddressSpace.gmem, assumed_align=4)
                flag_id = Int32(faddr % Int64(1 << 31))
                st = peer_wait(fbase, first + tid, e, tmo, ebase, t, flag_id, N)
                if st == 0:
                    scratch[_ST] = Float32(0.0)
            cute.arch.sync_threads()
            return scratch[_ST] > Float32(0.5)

        @cute.jit
        def raise_flags(ptrs, pre: cutlass.Constexpr, idx: Int32, e: Int32):
            """Thread 0, after a barrier: make the CTA's stores visible system-wide, then flag them."""
            cute.arch.fence_acq_rel_sys()
            for k in cutlass.range_constexpr(N):
                fb = cute.make_ptr(Int32, ptrs[ix[f"{pre}_{k}"]], cute.AddressSpace.gmem, assumed_align=4)
                cute.arch.store(fb + idx, e, sem="release", scope="sys")

        @cute.jit
        def norm_row(ptrs, m: Int32, scratch, rank: Int32):
            tid, _, _ = cute.arch.thread_idx()
            mRo = gmem_tensor(ptrs[ix["resid_out"]], odt, (M, D4, 4), OA)
            mW = gmem_tensor(ptrs[ix["norm_weight"]], BFloat16, (D4, 4), 8)
            mO = gmem_tensor(ptrs[ix["out"]], BFloat16, (M, O4, 4), 8)
            lo = rank * SH4
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(nv(D4)):
                u = tid + NT * j
                if u < D4:
                    v = mRo[m, u, None].load().to(Float32)
                    ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            tot = block_sum(ss, scratch)
            rstd = cute.math.rsqrt(tot / Float32(D) + Float32(eps), fastmath=False)
            for j in cutlass.range_constexpr(nv(D4)):
                u = tid + NT * j
                if u < D4:
                    if cutlass.const_expr(SH4 > 0):
                        # only this rank's columns, at the start of its out row
                        if u >= lo:
                            if u < lo + SH4:
                                v = mRo[m, u, None].load().to(Float32)
                                w = mW[u, None].load().to(Float32)
                                mO[m, u - lo, None].store((v * rstd * w).to(BFloat16))
                    else:
                        v = mRo[m, u, None].load().to(Float32)
                        w = mW[u, None].load().to(Float32)
                        mO[m, u, None].store((v * rstd * w).to(BFloat16))

        @cute.jit
        def prologue(ptrs, t: Int32):
            mPar = gmem_tensor(ptrs[ix["params"]], Int32, (PARAMS_WORDS,), 4)
            mSt = gmem_tensor(ptrs[ix["state"]], Int32, (T,), 4)
            e = mSt[t] + 1
            ebase = cute.make_ptr(Int32, ptrs[ix["err"]], cute.AddressSpace.gmem, assumed_align=4)
            return mPar[0], e, e % 2, Int64(mPar[1]) * Int64(1000), ebase, mSt

        @cute.jit
        def tile_oneshot(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            rank, e, par, tmo, ebase, mSt = prologue(ptrs, t)
            m = t // C
            cc = t - m * C
            mP = gmem_tensor(ptrs[ix["partial"]], wdt, (M, D4, 4), VA)
            # push this rank's chunk into slot `rank` of every rank's receive buffer
            for j in cutlass.range_constexpr(nv(W4)):
                u = tid + NT * j
                if u < W4:
                    col = cc * W4 + u
                    push(ptrs, par, rank, m, col, mP[m, col, None].load())
            cute.arch.sync_threads()
            if tid == 0:
                raise_flags(ptrs, "flags", t * N + rank, e)
            if cutlass.const_expr(gather):
                if wait_flags(ptrs[ix["flags_self"]], t * N, N, e, tmo, ebase, t, scratch):
                    # every rank's chunk from its receive slot to its columns of the gathered row
                    mS = gmem_tensor(ptrs[ix["recv_self"]], wdt, (2, N, M, D4, 4), VA)
                    mG = gmem_tensor(ptrs[ix["gathered"]], wdt, (M, N * D4, 4), VA)
                    for k in cutlass.range_constexpr(N):
                        at = k * D4
                        if cutlass.const_expr(c.gather_rotate):
                            at = ((k - rank + N) % N) * D4
                        for j in cutlass.range_constexpr(nv(W4)):
                            u = tid + NT * j
                            if u < W4:
                                col = cc * W4 + u
                                mG[m, at + col, None].store(mS[par, k, m, col, None].load())
                    if tid == 0:
                        mSt[t] = e
            elif wait_flags(ptrs[ix["flags_self"]], t * N, N, e, tmo, ebase, t, scratch):
                mS = gmem_tensor(ptrs[ix["recv_self"]], wdt, (2, N, M, D4, 4), VA)
                mRo = gmem_tensor(ptrs[ix["resid_out"]], odt, (M, D4, 4), OA)
                for j in cutlass.range_constexpr(nv(W4)):
                    u = tid + NT * j
                    if u < W4:
                        col = cc * W4 + u
                        acc = slot_sum(mS, par, m, col)
                        if cutlass.const_expr(rdt is not None):
                            mRes = gmem_tensor(ptrs[ix["res"]], rdt, (M, D4, 4), RA)
                            acc = acc + mRes[m, col, None].load().to(Float32)
                        mRo[m, col, None].store(acc.to(odt))
                if cutlass.const_expr(norm):
                    cute.arch.sync_threads()
                    if cutlass.const_expr(C > 1):
                        # the row's last tile to finish normalises it (arrivals counted per row,
                        # never reset: the last one of step e brings the count to e * C)
                        if tid == 0:
                            rc = cute.make_ptr(Int32, ptrs[ix["rowcnt"]], cute.AddressSpace.gmem, assumed_align=4)
                            old = cute.arch.atomic_add(rc + m, Int32(1), sem="acq_rel", scope="gpu")
                            scratch[_LAST] = Float32(0.0)
                            if old + 1 == e * C:
                                scratch[_LAST] = Float32(1.0)
                        cute.arch.sync_threads()
                        if scratch[_LAST] > Float32(0.5):
                            norm_row(ptrs, m, scratch, rank)
                    else:
                        norm_row(ptrs, m, scratch, rank)
                if tid == 0:
                    mSt[t] = e

        @cute.jit
        def tile_rs(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            rank, e, par, tmo, ebase, mSt = prologue(ptrs, t)
            mP = gmem_tensor(ptrs[ix["partial"]], wdt, (N, S4, 4), VA)      # flattened into shards
            for k in cutlass.range_constexpr(N):
                mR = gmem_tensor(ptrs[ix[f"rs_recv_{k}"]], wdt, (2, N, S4, 4), VA)
                for j in cutlass.range_constexpr(nv(E4)):
                    u = tid + NT * j
                    if u < E4:
                        mR[par, rank, t * E4 + u, None].store(mP[k, t * E4 + u, None].load())
            cute.arch.sync_threads()
            if tid == 0:
                raise_flags(ptrs, "rs_flags", t * N + rank, e)
            if wait_flags(ptrs[ix["rs_flags_self"]], t * N, N, e, tmo, ebase, t, scratch):
                mS = gmem_tensor(ptrs[ix["rs_recv_self"]], wdt, (2, N, S4, 4), VA)
                for j in cutlass.range_constexpr(nv(E4)):
                    u = tid + NT * j
                    if u < E4:
                        acc = mS[par, 0, t * E4 + u, None].load().to(Float32)
                        for k in cutlass.range_constexpr(1, N):
                            acc = acc + mS[par, k, t * E4 + u, None].load().to(Float32)
                        q = acc.to(wdt)
                        for k in cutlass.range_constexpr(N):
                            mA = gmem_tensor(ptrs[ix[f"ag_recv_{k}"]], wdt, (2, N, S4, 4), VA)
                            mA[par, rank, t * E4 + u, None].store(q)
                cute.arch.sync_threads()
                if tid == 0:
                    raise_flags(ptrs, "ag_flags", t * N + rank, e)
                    mSt[t] = e

        @cute.jit
        def tile_ag(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            rank, e, par, tmo, ebase, mSt = prologue(ptrs, t)
            if wait_flags(ptrs[ix["ag_flags_self"]], Int32(0), TRS * N, e, tmo, ebase, t, scratch):
                mA = gmem_tensor(ptrs[ix["ag_recv_self"]], wdt, (2, N, S4, 4), VA)
                mRo = gmem_tensor(ptrs[ix["resid_out"]], odt, (M, D4, 4), OA)
                for j in cutlass.range_constexpr(nv(D4)):
                    u = tid + NT * j
                    if u < D4:
                        g = gathered(mA, par, t * D4 + u)
                        if cutlass.const_expr(rdt is not None):
                            mRes = gmem_tensor(ptrs[ix["res"]], rdt, (M, D4, 4), RA)
                            g = g + mRes[t, u, None].load().to(Float32)
                        mRo[t, u, None].store(g.to(odt))
                if cutlass.const_expr(norm):
                    cute.arch.sync_threads()
                    norm_row(ptrs, t, scratch, rank)
                if tid == 0:
                    mSt[t] = e

        def mhc_addrs(ptrs):
            return tuple(ptrs[ix[n]] for n in ("streams", "coef", "streams_out", "part_next"))

        @cute.jit
        def tile_oneshot_mhc(ptrs, t: Int32, scratch):
            """D-slice t of all M tokens: push, flag, stage fn_next's slice, wait, reduce, post-mix."""
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            wid = tid // 32
            rank, e, par, tmo, ebase, mSt = prologue(ptrs, t)
            mP = gmem_tensor(ptrs[ix["partial"]], wdt, (M, D4, 4), VA)
            # push partial[:, slice t] (M x V 4-vectors, over all threads) into slot `rank` of every rank
            for j in cutlass.range_constexpr(nv(M * V)):
                u = tid + NT * j
                if u < M * V:
                    m = u // V
                    col = t * V + u - m * V
                    push(ptrs, par, rank, m, col, mP[m, col, None].load())
            cute.arch.sync_threads()
            if tid == 0:
                raise_flags(ptrs, "flags", t * N + rank, e)
            sF = begin(ptrs[ix["fn_next"]], t, tid, scratch)      # fn_next's slice loads while the flags travel
            if wait_flags(ptrs[ix["flags_self"]], t * N, N, e, tmo, ebase, t, scratch):
                mS = gmem_tensor(ptrs[ix["recv_self"]], wdt, (2, N, M, D4, 4), VA)
                for m in cutlass.range(wid, M, NT // 32, unroll=1):        # one warp per token
                    ys = [slot_sum(mS, par, m, t * V + lane + 32 * i) for i in range(VPL)]
                    mix_token(mhc_addrs(ptrs), sF, t, lane, m, ys)
                if tid == 0:
                    mSt[t] = e
            cute.arch.sync_threads()            # smem (fn_next's slice) is reused by the next instruction

        @cute.jit
        def tile_ag_mhc(ptrs, t: Int32, scratch):
            """D-slice t of all M tokens: stage fn_next's slice, wait for every rs tile's gathered
            pieces, post-mix the gathered (reduced) slice."""
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            wid = tid // 32
            rank, e, par, tmo, ebase, mSt = prologue(ptrs, t)
            sF = begin(ptrs[ix["fn_next"]], t, tid, scratch)      # loads while the last pieces arrive
            if wait_flags(ptrs[ix["ag_flags_self"]], Int32(0), TRS * N, e, tmo, ebase, t, scratch):
                mA = gmem_tensor(ptrs[ix["ag_recv_self"]], wdt, (2, N, S4, 4), VA)
                for m in cutlass.range(wid, M, NT // 32, unroll=1):
                    ys = [gathered(mA, par, m * D4 + t * V + lane + 32 * i) for i in range(VPL)]
                    mix_token(mhc_addrs(ptrs), sF, t, lane, m, ys)
                if tid == 0:
                    mSt[t] = e
            cute.arch.sync_threads()

        if self.mhc:
            return {"oneshot": tile_oneshot_mhc, "ag": tile_ag_mhc}[phase]
        return {"oneshot": tile_oneshot, "rs": tile_rs, "ag": tile_ag}[phase]


def allreduce_compile_cases() -> list[AllReduceBlock]:
    """Representative configs for the compile check (sdk/compile.py): every phase, both wire
    dtypes, with and without residual / norm, row-split and whole-row one-shot tiles, the mHC
    epilogue (one-shot and ag)."""
    return [
        AllReduceBlock(AllReduceConfig(ranks=8, m=1, d=7168)),                            # 4 tiles per row
        AllReduceBlock(AllReduceConfig(ranks=2, m=8, d=1024, residual="bf16", wire="fp32")),
        # a plain-residual model's x updated in place (bf16), one-shot and ag, no norm
        AllReduceBlock(AllReduceConfig(ranks=8, m=1, d=7168, residual="bf16", resid_dtype="bf16", norm=False)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=7168, phase="ag", residual="bf16", resid_dtype="bf16",
                                       norm=False)),
        # Kimi K3's latent MoE at TP8: the experts' partial sums (fp32) reduced, normed, each rank
        # keeping its 448 columns in a 512-wide row (the K-sharded latent up reads it); and the
        # gathers of its row-sharded router logits (fp32, rotated) and latent down (bf16)
        AllReduceBlock(AllReduceConfig(ranks=8, m=1, d=112, wire="fp32", residual="", norm=False, gather=True,
                                       gather_rotate=True)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=448, residual="", norm=False, gather=True)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=1, d=3584, wire="fp32", residual="", out_shard=512)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=3584, phase="ag", wire="fp32", residual="", out_shard=512)),
        AllReduceBlock(AllReduceConfig(ranks=4, m=4, d=4096, residual="", norm=False)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=7168, phase="rs")),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=7168, phase="ag")),
        # the mHC epilogue: V4.1-Flash (D 5120, 4 streams, the next sublayer's mix fused) one-shot
        # at batch 1, GLM-5.3 (D 4096, 4 streams, bf16 streams) ag half of a two-shot at batch 64
        AllReduceBlock(AllReduceConfig(ranks=8, m=1, d=5120, residual="", norm=False, mhc_streams=4,
                                       mhc_next_rows=24)),
        AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=4096, phase="ag", residual="", norm=False, mhc_streams=4,
                                       mhc_next_rows=24, mhc_d_slice=256, stream_dtype="bf16")),
    ]
