"""Expert parallelism inside the megakernel: dispatch of tokens to the ranks that own their
experts, and the combine of the experts' outputs back on the tokens' own rank, through
peer-visible (symmetric) buffers with epoch flags. Three blocks, one config (`EPConfig`):

N ranks, each with its own M tokens (its router ran on them: `topk_ids`, `topk_w` [M, k]) and
L = E / N experts: rank o owns global experts [o*L, (o+1)*L) (local id le = id - o*L).
An assignment is (source rank s, token m, choice j); its row index on the owner is
a = (s*M + m)*k + j ("slot"), its token row s*M + m ("tok").

Symmetric regions (every rank has each one; `{name}_{o}` operands are rank o's region as seen
from this rank, `{name}_self` this rank's own; all int32 flags start at zero and are never reset):

    recv_x   bf16  [N*M, D]    row s*M + m: token m of source s (written only if one of its k
                               experts lives on this owner)
    meta     int32 [N*M, k]    entry (s*M + m, j): local id of expert topk_ids[m, j] of source s
                               if this rank owns it, else -1 (all k entries written every step)
    dflags   int32 [Td, N]     dispatch flags: [dispatch tile, source] = epoch
    ret      wire  [M*k, D]    on the SOURCE: row m*k + j = expert output (unweighted) of its
                               assignment (m, j), written by the expert's owner
    cflags   int32 [Tc, N]     combine flags on the source: [combine tile, owner] = epoch

EPDispatchBlock (source side; tile (m, c) = token m, column chunk c of D):
    push x[m, chunk] to recv_x[rank*M + m] of every owner of one of m's experts; chunk 0 also
    writes m's k meta entries on EVERY rank; barrier, fence.sys, then flag dflags[tile, rank] =
    epoch (st.release.sys) on every rank (also those that got no row: they must know the tile
    is done).
EPTableBlock (owner side, one tile): lanes poll all Td x N dispatch flags >= epoch
    (acquire.sys, bounded), then build this rank's dispatch table over the received rows -
    counts [L], hits [H, ascending local ids], tok / slot [L, N*M] - the format of
    RouterSelectBlock's table, so `ExpertsBlock(rows=N*M)` runs on it unchanged: gate/up reads
    recv_x[tok], down (scatter mode) writes y[slot] = down_e(act[slot]) unweighted.
EPCombineBlock (both sides; tile (m, c) = token m of every source, column chunk c):
    as owner: for every source s and choice j with meta[s*M + m, j] >= 0, push y[(s*M+m)*k + j,
    chunk] to ret[m*k + j, chunk] of rank s; barrier, fence.sys, flag cflags[tile, rank] = epoch
    on every rank; as source: lanes < N poll cflags[tile, 0..N-1] >= epoch, then
        out[m, chunk] = shared[m, chunk] + sum_{j = 0..k-1} topk_w[m, j] * ret[m*k + j, chunk]
    in fp32, j in order: deterministic (no atomics), whatever rank finished first. The weights
    never travel: the source holds them.

Why epochs and single buffers are enough (no parity double-buffering, unlike the all-reduce):
  flags: step e (1, 2, ...) stores e, waits for >= e; each tile keeps its epoch in a local
  `state` word (no host write per step, CUDA-graph replayable).
  recv_x / meta of owner o are rewritten by source s only in s's NEXT launch, i.e. after s
  finished all its combine tiles, each of which waited for o's combine flag; o raises that flag
  after its down stage (local counter), which is after its table tile and gate/up read recv_x
  and meta, and its combine push read meta. ret of source s is rewritten by owner o only after
  o's table tile saw all of s's dispatch flags of the next step, i.e. after s's launch ended
  (and with it every read of ret). So with the chain dispatch -> table -> experts -> combine
  inside every launch, a rank can never run ahead into a buffer a peer still reads (the CPU
  test runs ranks unsynchronised, one rank always going first, to check it).
Deadlock freedom: as for the all-reduce (docs/allreduce.md): every rank runs the same program
  and schedule; a flag wait only waits for the same op's tiles to have STARTED on the peers; the
  table op also waits (local counter) on the dispatch op so that no rank's table tile can sit
  on a CTA ahead of one of its own dispatch tiles.
Bounded waits: a flag wait gives up after params[1] us, or as soon as the rank's error word is
  set; the first to give up claims the word with [ERR_PEER_TIMEOUT, tile, flag id, SM, seen,
  target, missing rank, epoch] (the all-reduce's format: sdk.comm.runtime.TPRuntime turns it into
  KernelTimeoutError naming the op and the rank that never arrived). Never a hang.

Supported: N = 1..32 ranks (owner bit masks in one int32), M = 1..64 tokens per rank, top_k
1..32, D a multiple of 8 (16-byte bf16 vectors), E a multiple of N with E / N <= 256 local
experts, wire (ret / y) bf16 or fp32, optional shared-expert input (fp32, added in the combine).
Not: NVLink multicast (disabled on our machines), capacity-limited receive buffers (they hold
the worst case, N*M*k assignments on one owner), fp8 dispatch, fusing the return push into the
down GEMV's epilogue (saves the y round trip and a counter hop: next step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .allreduce import PARAMS_WORDS, PeersNotReady
from .base import NUM_THREADS, Block, Cost, OperandSpec

MAX_EP_RANKS = 32
TILE_TARGET_SMALL = 2048     # columns per tile at M < 8: several SMs push one token's row
TILE_TARGET_LARGE = 8192     # M >= 8: whole rows (enough tiles anyway, fewer flags to poll)
_WIRE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class EPConfig:
    ranks: int                   # N
    m: int                       # tokens per rank
    hidden: int                  # D
    top_k: int
    num_experts: int             # E (global); each rank owns E / N
    wire: str = "bf16"           # dtype of the returned expert outputs (y, ret)
    shared: bool = False         # combine: add a shared-expert output [M, D] fp32
    out_dtype: str = "bf16"      # combine output
    tile_cols: int = 0           # dispatch / combine: columns per tile; 0 = auto


class _EPBase(Block):
    """Shapes, tiling and checks shared by the three EP blocks."""

    @property
    def local(self) -> int:
        return self.config.num_experts // self.config.ranks

    @property
    def cols(self) -> int:
        c = self.config
        if c.tile_cols:
            return c.tile_cols
        target = TILE_TARGET_SMALL if c.m < 8 else TILE_TARGET_LARGE
        cands = [w for w in range(8, c.hidden + 1, 8) if c.hidden % w == 0 and w <= target]
        return max(cands or [c.hidden])

    @property
    def chunks(self) -> int:
        return self.config.hidden // self.cols

    @property
    def dispatch_tiles(self) -> int:
        return self.config.m * self.chunks

    def check(self):
        c = self.config
        if not 1 <= c.ranks <= MAX_EP_RANKS:
            self.unsupported(f"ep: {c.ranks} ranks (supported 1..{MAX_EP_RANKS})")
        if not 1 <= c.m <= 64:
            self.unsupported(f"ep: m={c.m} tokens per rank (supported 1..64)")
        if not 1 <= c.top_k <= 32:
            self.unsupported(f"ep: top_k={c.top_k} (supported 1..32)")
        if c.num_experts % c.ranks or not 1 <= c.num_experts // c.ranks <= NUM_THREADS:
            self.unsupported(f"ep: {c.num_experts} experts over {c.ranks} ranks (E / N must be whole, "
                             f"1..{NUM_THREADS})")
        if c.wire not in _WIRE_BYTES or c.out_dtype not in _WIRE_BYTES:
            self.unsupported(f"ep: wire {c.wire!r}, out {c.out_dtype!r} (bf16, fp32)")
        w = self.cols
        if c.hidden % 8 or w % 8 or c.hidden % w or w > 8 * 8 * NUM_THREADS:
            self.unsupported(f"ep: hidden={c.hidden}, tile columns {w}: both multiples of 8, the columns "
                             f"dividing hidden, at most {8 * 8 * NUM_THREADS}")

    def _sym_specs(self, name, shape, dtype, output=True):
        N = self.config.ranks
        return [OperandSpec(f"{name}_{k}", shape, dtype, output=output) for k in range(N)]

    def _tail(self, tiles, err=True):
        specs = [OperandSpec("state", (tiles,), "int32", output=True),
                 OperandSpec("params", (PARAMS_WORDS,), "int32")]
        if err:
            specs.append(OperandSpec("err", (8,), "int32", output=True))
        return specs

    @staticmethod
    def _epoch(t, tile):
        return int(t["params"][0]), int(t["state"][tile]) + 1

    def _build_device_tile(self):
        from . import _ep_cute
        return _ep_cute.build(self)


class EPDispatchBlock(_EPBase):
    name = "ep_dispatch"
    Config = EPConfig

    def operand_specs(self):
        c = self.config
        N, M, D, K, T = c.ranks, c.m, c.hidden, c.top_k, self.dispatch_tiles
        return ([OperandSpec("x", (M, D), "bf16"), OperandSpec("topk_ids", (M, K), "int32")]
                + self._sym_specs("recv_x", (N * M, D), "bf16")
                + self._sym_specs("meta", (N * M, K), "int32")
                + self._sym_specs("dflags", (T, N), "int32")
                + self._tail(T, err=False))

    def num_tiles(self) -> int:
        return self.dispatch_tiles

    def cost(self) -> Cost:
        c = self.config
        fan = min(c.top_k, c.ranks)
        return Cost(bytes=self.cols * 2 * (1 + fan) + c.top_k * 4 * (1 + c.ranks), flops=0)

    def reference(self, xs, ids):
        """All N ranks' dispatch at once: per owner o, recv_x [N*M, D] (rows not sent: zero) and
        meta [N*M, k]."""
        c = self.config
        N, M, L = c.ranks, c.m, self.local
        out = []
        for o in range(N):
            rx = torch.zeros(N * M, c.hidden, dtype=torch.bfloat16)
            meta = torch.full((N * M, c.top_k), -1, dtype=torch.int32)
            for s in range(N):
                own = ids[s].long() // L == o
                rx[s * M:(s + 1) * M][own.any(-1)] = xs[s][own.any(-1)].to(torch.bfloat16)
                meta[s * M:(s + 1) * M] = torch.where(own, ids[s].long() - o * L, -1).to(torch.int32)
            out.append({"recv_x": rx, "meta": meta})
        return out

    def emulate_tile(self, t, tile):
        c = self.config
        rank, e = self._epoch(t, tile)
        M, L = c.m, self.local
        m, ch = divmod(tile, self.chunks)
        cols = slice(ch * self.cols, (ch + 1) * self.cols)
        ids = t["topk_ids"][m].long()
        owner = ids // L
        for o in range(c.ranks):
            if bool((owner == o).any()):
                t[f"recv_x_{o}"][rank * M + m, cols] = t["x"][m, cols]
            if ch == 0:
                t[f"meta_{o}"][rank * M + m] = torch.where(owner == o, ids - o * L, -1).to(torch.int32)
        for o in range(c.ranks):            # after the pushes (the device's barrier + fence.sys)
            t[f"dflags_{o}"][tile, rank] = e
        t["state"][tile] = e


class EPTableBlock(_EPBase):
    name = "ep_table"
    Config = EPConfig

    def operand_specs(self):
        c = self.config
        N, M, K, L = c.ranks, c.m, c.top_k, self.local
        return [OperandSpec("meta_self", (N * M, K), "int32"),
                OperandSpec("dflags_self", (self.dispatch_tiles, N), "int32"),
                OperandSpec("counts", (L,), "int32", output=True),
                OperandSpec("hits", (L + 1,), "int32", output=True),
                OperandSpec("tok", (L, N * M), "int32", output=True),
                OperandSpec("slot", (L, N * M), "int32", output=True)] + self._tail(1)

    def num_tiles(self) -> int:
        return 1

    def cost(self) -> Cost:
        c = self.config
        n = c.ranks * c.m * c.top_k
        # latency-bound (flag polls, one pass over the metadata with atomics): ~2 us as bytes at
        # one SM's share of the bandwidth, so the scheduler sees its length
        return Cost(bytes=max(n * 12, int(2000 * 4260 / 132)), flops=n)

    def reference(self, meta):
        """The table of one owner from its received metadata: {le: [(tok, slot), ...]} in
        (source, token, choice) order."""
        K = self.config.top_k
        table: dict[int, list] = {}
        flat = meta.reshape(-1)
        for a in range(flat.numel()):
            le = int(flat[a])
            if le >= 0:
                table.setdefault(le, []).append((a // K, a))
        return table

    def emulate_arrive(self, t, tile):
        """Nothing to push: the table only waits."""

    def emulate_missing(self, t, tile) -> list[int]:
        _, e = self._epoch(t, tile)
        f = t["dflags_self"].tolist()          # (plain lists: polled often by the multi-rank VM)
        return [k for k in range(self.config.ranks) if min(row[k] for row in f) < e]

    def emulate_finish(self, t, tile):
        _, e = self._epoch(t, tile)
        L = self.local
        table = self.reference(t["meta_self"])
        t["counts"].zero_()
        hits = sorted(table)
        for le in hits:
            n = len(table[le])
            t["counts"][le] = n
            t["tok"][le, :n] = torch.tensor([a for a, _ in table[le]], dtype=torch.int32)
            t["slot"][le, :n] = torch.tensor([s for _, s in table[le]], dtype=torch.int32)
        assert all(0 <= le < L for le in hits), "meta names an expert this rank does not own"
        t["hits"][0] = len(hits)
        if hits:
            t["hits"][1:1 + len(hits)] = torch.tensor(hits, dtype=torch.int32)
        t["state"][tile] = e

    def emulate_tile(self, t, tile):
        missing = self.emulate_missing(t, tile)
        if missing:
            raise PeersNotReady(f"ep table: ranks {missing} have not dispatched; run the ranks together "
                                f"with sdk.comm.vm.MultiRankVM")
        self.emulate_finish(t, tile)


class EPCombineBlock(_EPBase):
    name = "ep_combine"
    Config = EPConfig

    def operand_specs(self):
        c = self.config
        N, M, D, K, T, w = c.ranks, c.m, c.hidden, c.top_k, self.dispatch_tiles, c.wire
        return ([OperandSpec("y", (N * M * K, D), w), OperandSpec("meta_self", (N * M, K), "int32"),
                 OperandSpec("topk_w", (M, K), "fp32"),
                 OperandSpec("shared", (M, D), "fp32", optional=not c.shared),
                 OperandSpec("ret_self", (M * K, D), w), OperandSpec("cflags_self", (T, N), "int32")]
                + self._sym_specs("ret", (M * K, D), w)
                + self._sym_specs("cflags", (T, N), "int32")
                + self._tail(T)
                + [OperandSpec("out", (M, D), c.out_dtype, output=True)])

    def num_tiles(self) -> int:
        return self.dispatch_tiles

    def cost(self) -> Cost:
        c = self.config
        wb = _WIRE_BYTES[c.wire]
        # push: on average k of the N*k candidate rows of a token are this rank's; reduce: k rows
        return Cost(bytes=self.cols * (2 * c.top_k * wb + c.top_k * wb + 4 + 2) + c.ranks * c.top_k * 4,
                    flops=2 * self.cols * c.top_k)

    def reference(self, topk_w, ret, shared=None):
        """One source rank's combine: out = shared + sum_j topk_w[:, j] * ret[:, j] (fp32)."""
        c = self.config
        r = ret.float().reshape(c.m, c.top_k, c.hidden)
        out = (topk_w.float()[..., None] * r).sum(1)
        return out + shared.float() if shared is not None else out

    def _cols(self, tile):
        m, ch = divmod(tile, self.chunks)
        return m, slice(ch * self.cols, (ch + 1) * self.cols)

    def emulate_arrive(self, t, tile):
        """Push this rank's expert outputs of token m of every source, then flag every source."""
        c = self.config
        rank, e = self._epoch(t, tile)
        M, K = c.m, c.top_k
        m, cols = self._cols(tile)
        for s in range(c.ranks):
            mine = (t["meta_self"][s * M + m] >= 0).nonzero().flatten().tolist()
            for j in mine:
                t[f"ret_{s}"][m * K + j, cols] = t["y"][(s * M + m) * K + j, cols]
        for s in range(c.ranks):
            t[f"cflags_{s}"][tile, rank] = e

    def emulate_missing(self, t, tile) -> list[int]:
        _, e = self._epoch(t, tile)
        f = t["cflags_self"][tile].tolist()
        return [k for k in range(self.config.ranks) if f[k] < e]

    def emulate_finish(self, t, tile):
        c = self.config
        _, e = self._epoch(t, tile)
        K = c.top_k
        m, cols = self._cols(tile)
        acc = t["shared"][m, cols].float().clone() if c.shared else torch.zeros(self.cols)
        for j in range(K):                   # fixed order: the same bits whoever arrived first
            acc = acc + t["topk_w"][m, j].float() * t["ret_self"][m * K + j, cols].float()
        t["out"][m, cols] = acc.to(t["out"].dtype)
        t["state"][tile] = e

    def emulate_tile(self, t, tile):
        self.emulate_arrive(t, tile)
        missing = self.emulate_missing(t, tile)
        if missing:
            raise PeersNotReady(f"ep combine tile {tile}: ranks {missing} have not returned; run the ranks "
                                f"together with sdk.comm.vm.MultiRankVM")
        self.emulate_finish(t, tile)


def ep_compile_cases() -> list:
    """Representative configs for the compile check: Kimi K3 EP16 at batch 1 (row split in 4
    tiles), DeepSeek-V4.1-Flash EP8 at batch 64, GLM-5.3 EP8 at batch 8 with an fp32 wire."""
    k3 = EPConfig(ranks=16, m=1, hidden=7168, top_k=16, num_experts=896, shared=True)
    v4 = EPConfig(ranks=8, m=64, hidden=5120, top_k=6, num_experts=384, shared=True)
    glm = EPConfig(ranks=8, m=8, hidden=4096, top_k=8, num_experts=288, wire="fp32")
    return [EPDispatchBlock(k3), EPTableBlock(k3), EPCombineBlock(k3), EPDispatchBlock(v4), EPTableBlock(v4),
            EPCombineBlock(v4), EPCombineBlock(glm)]
