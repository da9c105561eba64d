"""Fused all-reduce ops in a megakernel program, and their per-rank bindings.

    prog = Program()
    comm = CommProgram(prog, ranks=4)           # declares comm.params, comm.err
    ...
    last = comm.allreduce("partial", "resid", res="resid", norm_weight="norm.1", out="h",
                          waits=[down_op], label="layers.0.allreduce")
    # per rank r (VirtualRanks or TorchSymmetricMemory built from comm.layout):
    tensors = comm.alloc_rank_tensors(bufs, r, device)   # locals zeroed, params set, peer views bound

Every rank builds the SAME program (same buffer names, same instructions, same schedule); only
the tensors bound to the names differ: the rank's own partial/residual, its own view of the
symmetric regions (`*.self`) and its views of the peers' (`*.{k}`). The rank index is data
(`comm.params[0]`), so all ranks share one compiled kernel.

Algorithm by message size (`choose_algo`): one-shot moves (N-1) x the message out of every rank
with one flag round trip; two-shot (reduce-scatter + all-gather) moves 2 (N-1)/N x the message
with two. One-shot wins while (N-1)(1 - 2/N) B / link_bw < alpha (one extra round trip), i.e.
below `crossover_bytes(N)`: ~430 KB at N = 8, ~170 KB at 16, ~33 KB at 72 with the assumed
NVLink 5 figures (alpha 2.5 us, 900 GB/s per direction; docs/gb300-nvl72-plan.md). N <= 2: always
one-shot (same bytes, one round trip fewer). Two-shot also needs the shards to fit its tiling
(`AllReduceBlock.check`), otherwise one-shot. The figures are assumptions until measured on the
NVLink machine; on one GPU both algorithms only measure instruction overhead.

mHC models (V4.1-Flash, GLM-5.3): `allreduce(partial, mhc=MHCEpilogue(streams=..., coef=...,
streams_out=..., fn_next=..., part_next=...))` post-mixes the reduced sum into the residual
streams in the all-reduce's epilogue (MHCPostBlock's math, y = the sum) instead of res + sum and
the norm; N streams, their dtype, fn_next's rows and dtype are read off the bound buffers.

Receive buffers are shared by all all-reduce ops of a program through two "colors"
(`comm.data.c0`, `comm.data.c1`, each sized for its largest op) used alternately by
consecutive all-reduces, and double-buffered inside by epoch parity; see docs/allreduce.md for
why that is enough. Requirement: each all-reduce op depends (transitively, through local
counters) on the previous one, as in a layer chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.allreduce import PARAMS_WORDS, AllReduceBlock, AllReduceConfig
from ..blocks.base import DTYPES
from ..errors import UnsupportedConfigError
from .buffers import SymmetricLayout

ROUND_TRIP_US = 2.5        # assumed cost of one flag round trip incl. fence.sys (NVLink 5; to measure)
LINK_GBS = 900.0           # NVLink 5 per GPU per direction (1.8 TB/s bidirectional, NVIDIA GB300 spec)
PARAMS, ERR = "comm.params", "comm.err"
_WB = {"bf16": 2, "fp32": 4}


def crossover_bytes(ranks: int, round_trip_us: float = ROUND_TRIP_US, link_gbs: float = LINK_GBS) -> float:
    """Message size above which two-shot beats one-shot (infinite for N <= 2)."""
    if ranks <= 2:
        return float("inf")
    return round_trip_us * 1e-6 * link_gbs * 1e9 / ((ranks - 1) * (1 - 2 / ranks))


def choose_algo(m: int, d: int, ranks: int, wire: str = "bf16", oneshot_max_bytes: float | None = None) -> str:
    """"oneshot" for messages up to `oneshot_max_bytes` (default `crossover_bytes(ranks)`),
    "twoshot" above when the message shards evenly over the ranks; else "oneshot"."""
    limit = crossover_bytes(ranks) if oneshot_max_bytes is None else oneshot_max_bytes
    if ranks == 1 or m * d * _WB[wire] <= limit:
        return "oneshot"
    try:
        AllReduceBlock(AllReduceConfig(ranks=ranks, m=m, d=d, phase="rs", wire=wire))
    except UnsupportedConfigError:
        return "oneshot"
    return "twoshot"


@dataclass(frozen=True)
class MHCEpilogue:
    """Program buffers of the all-reduce's mHC post-mix epilogue, named as MHCPostBlock's operands
    (so MHCPreBlock reads part_next unchanged): streams [M, N, D] (bf16 / fp32), coef [M, (2+N)N]
    fp32 (MHCPreBlock's), streams_out (may be streams: in place), and optionally fn_next
    [R, N*D] with part_next [D / d_slice, M, R + 1] fp32, the next pre-mix's partials."""
    streams: str
    coef: str
    streams_out: str
    fn_next: str | None = None
    part_next: str | None = None
    d_slice: int = 128
    round_coef: bool = True       # post / comb rounded to the stream dtype (V4, GLM-5.3); False: fp32 (V4.1)

    def config_fields(self, prog, m: int, d: int) -> dict:
        """The AllReduceConfig fields, read off the bound buffers' shapes and dtypes."""
        if (self.fn_next is None) != (self.part_next is None):
            raise ValueError("mHC epilogue: fn_next and part_next go together")
        x = prog.buffers[self.streams]
        if len(x.shape) != 3 or (x.shape[0], x.shape[2]) != (m, d):
            raise ValueError(f"mHC epilogue: streams {self.streams!r} is {list(x.shape)}, want [{m}, N, {d}]")
        fn = prog.buffers[self.fn_next] if self.fn_next else None
        return dict(residual="", norm=False, mhc_streams=x.shape[1], mhc_d_slice=self.d_slice,
                    stream_dtype=x.dtype, mhc_next_rows=fn.shape[0] if fn else 0,
                    fn_dtype=fn.dtype if fn else "fp32", mhc_round_coef=self.round_coef)

    def bindings(self) -> dict:
        return {"streams": self.streams, "coef": self.coef, "streams_out": self.streams_out,
                "fn_next": self.fn_next, "part_next": self.part_next}


class CommProgram:
    def __init__(self, prog, ranks: int):
        self.prog = prog
        self.ranks = ranks
        prog.buffer(PARAMS, (PARAMS_WORDS,), "int32", "input")
        prog.buffer(ERR, (8,), "int32", "scratch")
        self.symmetric: dict[str, tuple] = {}     # buffer -> (owner "self" | k, region, shape, dtype, offset)
        self.locals: list[str] = []               # per-op epoch state / row counters (zeroed at reset)
        self.flag_buffers: dict[str, str] = {}    # the rank's own flags buffer -> all-reduce label
        self.records: list[dict] = []             # one per all-reduce: label, algo, bytes, ops
        self._data_bytes = [0, 0]
        self._flags: list[tuple[str, int]] = []
        self._extra: list[tuple[str, int, str]] = []   # regions of other ops (region())
        self.op_kinds: dict[str, str] = {}          # flag label -> what the op is, for errors
        self._layout: SymmetricLayout | None = None

    # -- building ---------------------------------------------------------------------------
    def _sym(self, base: str, region: str, shape, dtype: str, offset: int = 0) -> dict:
        """Program buffers for the rank's own view and the N peer views of a symmetric region."""
        names = {}
        for owner in ["self"] + list(range(self.ranks)):
            name = f"{base}.{owner}"
            self.prog.buffer(name, shape, dtype, "scratch")
            self.symmetric[name] = (owner, region, tuple(shape), dtype, offset)
            names[owner] = name
        return names

    def _local(self, name, shape):
        self.prog.buffer(name, shape, "int32", "scratch")
        self.locals.append(name)
        return name

    def local(self, name: str, shape) -> str:
        """A per-rank int32 program buffer zeroed by reset() (an op's epoch state words)."""
        return self._local(name, shape)

    def region(self, base: str, shape, dtype: str, kind: str = "data", label: str | None = None,
                  what: str = "op") -> dict:
        """A symmetric region of its own, named `base`, for ops other than the all-reduce (EP
        dispatch/combine, sdk/blocks/ep.py): program buffers `{base}.self` and `{base}.{k}` (rank
        k's region seen from this rank) of `shape`; returns {"self" | k: buffer name}. kind
        "flags": zeroed by reset(), and a flag-wait timeout on them is reported as `what` `label`."""
        if self._layout is not None:
            raise ValueError("the symmetric layout was already used; add all symmetric regions first")
        n = 1
        for v in shape:
            n *= v
        self._extra.append((base, n * DTYPES[dtype].itemsize, kind))
        names = self._sym(base, base, shape, dtype)
        if kind == "flags":
            self.flag_buffers[names["self"]] = label or base
            self.op_kinds[label or base] = what
        return names

    def allreduce(self, partial: str, resid_out: str | None = None, *, res: str | None = None,
                  norm_weight: str | None = None, out: str | None = None, mhc: MHCEpilogue | None = None,
                  waits=(), label: str, algo: str = "auto", eps: float = 1e-6, tile_elems: int = 0,
                  oneshot_max_bytes: float | None = None, out_shard: bool = False) -> int:
        """resid_out = (res +) sum over ranks of partial; out = rmsnorm(resid_out) * norm_weight.
        resid_out's dtype is its buffer's: fp32, or bf16 (a plain-residual model's hidden state x,
        res = resid_out = x: updated in place). out_shard: `out` holds this rank's D / N columns of
        the normed rows only (at the start of its rows, which may be wider: zero padding for a
        K-sharded GEMV reading it).
        Or, with `mhc` (and none of resid_out / res / norm_weight / out): the mHC post-mix of the
        sum into the residual streams (MHCEpilogue). Returns the index of the (last) op, for
        later ops' waits."""
        if self._layout is not None:
            raise ValueError("the symmetric layout was already used; add all all-reduces first")
        p = self.prog
        m, d = p.buffers[partial].shape
        wire = p.buffers[partial].dtype
        N = self.ranks
        if algo == "auto":
            algo = choose_algo(m, d, N, wire, oneshot_max_bytes)
        if algo not in ("oneshot", "twoshot"):
            raise UnsupportedConfigError(f"all-reduce algorithm {algo!r} (auto, oneshot, twoshot)")
        if (norm_weight is None) != (out is None):
            raise ValueError(f"{label}: norm_weight and out go together")
        if (mhc is None) == (resid_out is None) or (mhc and (res or norm_weight)):
            raise ValueError(f"{label}: either resid_out (with res / norm_weight / out) or the mhc epilogue")
        color = len(self.records) % 2
        region = f"comm.data.c{color}"
        base = dict(ranks=N, m=m, d=d, wire=wire, residual=p.buffers[res].dtype if res else "",
                    norm=norm_weight is not None, eps=eps, tile_elems=tile_elems,
                    resid_dtype=p.buffers[resid_out].dtype if resid_out else "fp32",
                    out_shard=p.buffers[out].shape[-1] if out_shard else 0)
        # the epilogue's fields go to the phase that has the epilogue (oneshot, ag), not to rs
        epi = mhc.config_fields(p, m, d) if mhc else {}
        tail = {"params": PARAMS, "err": ERR,
                **(mhc.bindings() if mhc else {"res": res, "norm_weight": norm_weight, "resid_out": resid_out,
                                               "out": out})}
        wb = _WB[wire]
        if algo == "oneshot":
            ops = [self._oneshot(AllReduceBlock(AllReduceConfig(phase="oneshot", **{**base, **epi})), partial, tail,
                                 waits, label, color)]
        else:
            rs = AllReduceBlock(AllReduceConfig(phase="rs", **base))
            ag = AllReduceBlock(AllReduceConfig(phase="ag", **{**base, **epi}))
            S, T = rs.shard, rs.rs_tiles
            rsr = self._sym(f"{label}.rs_recv", region, (2, N, S), wire, 0)
            agr = self._sym(f"{label}.ag_recv", region, (2, N, S), wire, 2 * N * S)
            self._data_bytes[color] = max(self._data_bytes[color], 4 * N * S * wb)
            self._flags += [(f"{label}.rs_flags", T * N * 4), (f"{label}.ag_flags", T * N * 4)]
            rsf = self._sym(f"{label}.rs_flags", f"{label}.rs_flags", (T, N), "int32")
            agf = self._sym(f"{label}.ag_flags", f"{label}.ag_flags", (T, N), "int32")
            b1 = {"partial": partial, "rs_recv_self": rsr["self"], "rs_flags_self": rsf["self"],
                  "state": self._local(f"{label}.rs.state", (T,)), "params": PARAMS, "err": ERR}
            for k in range(N):
                b1.update({f"rs_recv_{k}": rsr[k], f"rs_flags_{k}": rsf[k], f"ag_recv_{k}": agr[k],
                           f"ag_flags_{k}": agf[k]})
            op1 = p.op(rs, b1, waits=waits, label=label + ".rs")
            b2 = {"ag_recv_self": agr["self"], "ag_flags_self": agf["self"],
                  "state": self._local(f"{label}.ag.state", (ag.num_tiles(),)), **tail}
            # the ag tiles wait (locally) for the rs op: every rank then runs all its rs tiles
            # before any ag tile can occupy a CTA, so no rank's rs tile queues behind a spinning
            # ag tile (docs/allreduce.md: deadlock freedom)
            op = p.op(ag, {k: v for k, v in b2.items() if v is not None}, waits=[op1], label=label + ".ag")
            self.flag_buffers[rsf["self"]] = label + ".rs"
            self.flag_buffers[agf["self"]] = label + ".ag"
            ops = [op1, op]
        self.records.append({"label": label, "algo": algo, "bytes": m * d * wb, "color": color, "ops": ops})
        return ops[-1]

    def allgather(self, shard: str, out: str, *, rotate: bool = False, waits=(), label: str) -> int:
        """out [M, N * W] = every rank's `shard` [M, W], rank k's at columns k * W (rotate: at
        ((k - rank) mod N) * W, this rank's own first) - one one-shot op (AllReduceConfig.gather),
        in the all-reduces' buffer colors and epochs. Returns the op."""
        if self._layout is not None:
            raise ValueError("the symmetric layout was already used; add all collectives first")
        m, w = self.prog.buffers[shard].shape
        wire = self.prog.buffers[shard].dtype
        blk = AllReduceBlock(AllReduceConfig(ranks=self.ranks, m=m, d=w, wire=wire, residual="", norm=False,
                                             gather=True, gather_rotate=rotate))
        color = len(self.records) % 2
        op = self._oneshot(blk, shard, {"params": PARAMS, "err": ERR, "gathered": out}, waits, label, color)
        self.records.append({"label": label, "algo": "gather", "bytes": m * w * _WB[wire], "color": color,
                             "ops": [op]})
        return op

    def _oneshot(self, blk: AllReduceBlock, partial: str, tail: dict, waits, label: str, color: int) -> int:
        """A one-shot op: its receive slots in buffer color `color`, its flags, its epoch state."""
        c, N, p = blk.config, self.ranks, self.prog
        m, d, wire = c.m, c.d, c.wire
        T = blk.num_tiles()
        recv = self._sym(f"{label}.recv", f"comm.data.c{color}", (2, N, m, d), wire)
        self._data_bytes[color] = max(self._data_bytes[color], 2 * N * m * d * _WB[wire])
        self._flags.append((f"{label}.flags", T * N * 4))
        flags = self._sym(f"{label}.flags", f"{label}.flags", (T, N), "int32")
        b = {"partial": partial, "recv_self": recv["self"], "flags_self": flags["self"],
             "state": self._local(f"{label}.state", (T,)), **tail}
        b.update({f"recv_{k}": recv[k] for k in range(N)})
        b.update({f"flags_{k}": flags[k] for k in range(N)})
        if "rowcnt" in blk.operands():
            b["rowcnt"] = self._local(f"{label}.rowcnt", (m,))
        op = p.op(blk, {k: v for k, v in b.items() if v is not None}, waits=waits, label=label)
        self.flag_buffers[flags["self"]] = label
        return op

    # -- binding ------------------------------------------------------------------------------
    @property
    def layout(self) -> SymmetricLayout:
        """The symmetric region layout (fixed on first use)."""
        if self._layout is None:
            self._check_chain()
            lay = SymmetricLayout()
            for c in (0, 1):
                if self._data_bytes[c]:
                    lay.add(f"comm.data.c{c}", self._data_bytes[c], "data")
            for name, nbytes in self._flags:
                lay.add(name, nbytes, "flags")
            for name, nbytes, kind in self._extra:
                lay.add(name, nbytes, kind)
            self._layout = lay
        return self._layout

    def _check_chain(self) -> None:
        """Each collective must wait (through local counters) for the one before it: the two
        alternating buffer colors are safe only then (docs/allreduce.md). Raises naming the pair."""
        p = self.prog
        by_counter = {op.counter: i for i, op in enumerate(p.ops)}
        waits = [{by_counter[c] for i in op.instructions for c, _ in p.instructions[i].waits} for op in p.ops]
        for a, b in zip(self.records, self.records[1:]):
            seen, todo = set(), [b["ops"][0]]
            while todo and a["ops"][-1] not in seen:
                for w in waits[todo.pop()] - seen:
                    seen.add(w)
                    todo.append(w)
            if a["ops"][-1] not in seen:
                raise ValueError(f"collective {b['label']!r} does not wait for {a['label']!r} before it: their "
                                 "receive buffers' colors alternate safely only along one chain of collectives")

    def bind(self, bufs, rank: int) -> dict[str, torch.Tensor]:
        """The symmetric program buffers of `rank`: its own and its peers' views."""
        out = {}
        for name, (owner, region, shape, dtype, offset) in self.symmetric.items():
            o = rank if owner == "self" else owner
            out[name] = bufs.view(o, rank, region, shape, DTYPES[dtype], offset)
        return out

    def alloc_rank_tensors(self, bufs, rank: int, device, timeout_s: float = 1.0) -> dict[str, torch.Tensor]:
        """Every buffer of the program for `rank`: symmetric views bound, everything else zeroed
        (callers then fill inputs and weights); params = [rank, flag-wait timeout in us]."""
        t = {}
        for b in self.prog.buffers.values():
            if b.name not in self.symmetric:
                t[b.name] = torch.zeros(b.shape, dtype=DTYPES[b.dtype], device=device)
        t.update(self.bind(bufs, rank))
        t[PARAMS][0] = rank
        t[PARAMS][1] = int(timeout_s * 1e6)
        return t

    def flag_ids(self, tensors: dict[str, torch.Tensor]) -> dict[int, str]:
        """Low 31 bits of the rank's own flag arrays' addresses -> all-reduce op label (what the
        error word's flag_id field holds)."""
        return {tensors[n].data_ptr() % (1 << 31): lbl for n, lbl in self.flag_buffers.items()}

    def reset(self, bufs, tensors_per_rank) -> None:
        """Zero flags (symmetric), epoch states and row counters (local) of the local ranks."""
        bufs.zero_flags()
        for r in bufs.local_ranks:
            for n in self.locals:
                tensors_per_rank[r][n].zero_()


def build_mhc_allreduce_chain(ranks: int, m: int, d: int, ops: int, *, n: int = 4, next_rows: int = 24,
                              d_slice: int = 128, algo: str = "auto", wire: str = "bf16",
                              stream_dtype: str = "fp32"):
    """`ops` all-reduces with the mHC epilogue in a chain (tests, benchmarks): op 0 post-mixes
    `streams_in` into `streams`, ops 1.. post-mix `streams` in place; op j uses coef.{j} and writes
    the next mix's partials of its result to part.{j} (next_rows > 0, one fn_next for all).
    Buffers: partial (wire, input), streams_in / streams [m, n, d], coef.{j} [m, (2+n)n] fp32,
    fn_next [next_rows, n d] fp32, part.{j} [d / d_slice, m, next_rows + 1] fp32.
    Returns (program, CommProgram)."""
    from ..megakernel.program import Program
    prog = Program()
    comm = CommProgram(prog, ranks)
    prog.buffer("partial", (m, d), wire, "input")
    prog.buffer("streams_in", (m, n, d), stream_dtype, "input")
    prog.buffer("streams", (m, n, d), stream_dtype, "output")
    if next_rows:
        prog.buffer("fn_next", (next_rows, n * d), "fp32", "weight")
    prev = None
    for j in range(ops):
        prog.buffer(f"coef.{j}", (m, (2 + n) * n), "fp32", "input")
        if next_rows:
            prog.buffer(f"part.{j}", (d // d_slice, m, next_rows + 1), "fp32", "output")
        epi = MHCEpilogue(streams="streams_in" if j == 0 else "streams", coef=f"coef.{j}", streams_out="streams",
                          fn_next="fn_next" if next_rows else None, part_next=f"part.{j}" if next_rows else None,
                          d_slice=d_slice)
        prev = comm.allreduce("partial", mhc=epi, waits=[prev] if prev is not None else [], label=f"ar{j}",
                              algo=algo)
    return prog, comm


def mhc_chain_reference(parts, streams, coefs, fn_next, *, d_slice: int = 128, wire_round: str | None = None):
    """The unsharded definition of one step of `build_mhc_allreduce_chain`: y = the fp32 sum of
    the ranks' partials (rank order), then MHCPostBlock.reference once per op (coefs: one per op).
    wire_round: y rounded to that dtype first, as two-shot's reduce-scatter sends it back to every
    rank. Returns (streams after the last op, [part_next of each op])."""
    from ..blocks.mhc import MHCPostBlock, MHCPostConfig
    m, n, d = streams.shape
    sdt = {v: k for k, v in DTYPES.items()}[streams.dtype]
    post = MHCPostBlock(MHCPostConfig(d=d, n=n, m=m, d_slice=d_slice, stream_dtype=sdt, y_dtype="fp32",
                                      next_rows=fn_next.shape[0]))
    y = sum(p.float() for p in parts)
    if wire_round:
        y = y.to(DTYPES[wire_round]).float()
    out = []
    for coef in coefs:
        r = post.reference(streams=streams, y=y, coef=coef, fn_next=fn_next)
        streams = r["streams_out"]
        out.append(r["part_next"])
    return streams, out
