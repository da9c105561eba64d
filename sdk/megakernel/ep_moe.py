"""An expert-parallel MoE layer over N ranks, one megakernel launch per rank and step.

Every rank runs the SAME program (the rank is data: comm.params[0]) on its own M tokens, and
holds L = E / N routed experts (rank r: global experts [r*L, (r+1)*L)) plus a replicated shared
expert. Per rank and step:

    router.logits   GemvBlock               logits of this rank's tokens (all E experts)
    router.select   RouterSelectBlock       topk_ids, topk_w [M, k] (its local table is unused)
    ep.dispatch     EPDispatchBlock         token rows -> the owners' recv_x, meta -> every rank,
                                            dispatch flags (tile = token x column chunk)
    ep.table        EPTableBlock            waits for every rank's dispatch, builds this rank's
                                            table over the N*M received rows
    experts.gateup  ExpertsBlock(rows=N*M)  act[slot] = swiglu_e(recv_x[tok]) (hit experts only)
    experts.down    ExpertsBlock(scatter)   y[slot] = down_e(act[slot]), unweighted, wire dtype
    shared.gateup / shared.down  GemvBlock  the shared expert on this rank's tokens (fp32 out)
    ep.combine      EPCombineBlock          y rows -> the sources' ret, combine flags; then
                                            out = shared + sum_j topk_w[:, j] * ret[:, j]

Local dependencies (counters): select <- logits; dispatch <- select; table <- dispatch (so no
table tile can occupy a CTA ahead of one of its own rank's dispatch tiles: deadlock freedom,
sdk/blocks/ep.py); gateup <- table; down <- gateup; combine <- down, shared.down. Cross-rank:
the table's and the combine's flag waits. The protocol and why single-buffered receive regions
are safe across back-to-back steps: sdk/blocks/ep.py.

The result on every rank equals the single-rank layer (`moe_layer.reference` with all E experts,
the oracle of tests/test_moe_blocks.py) on that rank's tokens, up to the wire rounding of each
expert output (bf16 wire: one bf16 rounding per assignment) and the summation order (choices in
order here, experts ascending there).

Runs: the multi-rank PyVM (`sdk.comm.vm.MultiRankVM`, CPU), N virtual ranks on one GPU
(`sdk.comm.runtime.TPRuntime` with `sdk.comm.VirtualRanks`), and - written for it, not run yet -
one process per GPU with `sdk.comm.TorchSymmetricMemory` (the same program and bindings).
Supported: what the blocks support (N <= 32, M <= 64 per rank, E / N <= 256, hidden a multiple
of 256 with a shared expert (GemvBlock), formats of ExpertsBlock). Not: a TP-sharded shared
expert (it is replicated: every rank's tokens are its own), capacity limits on the receive
buffers (sized for the worst case: all N*M*k assignments on one rank).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.ep import EPCombineBlock, EPConfig, EPDispatchBlock, EPTableBlock
from ..blocks.experts import ExpertsBlock, ExpertsConfig
from ..comm.ops import ERR, PARAMS, CommProgram
from ..errors import UnsupportedConfigError
from . import moe_layer
from .moe_layer import MoELayerConfig
from .program import Program


@dataclass(frozen=True)
class EPMoEConfig:
    layer: MoELayerConfig        # the whole layer: all E experts (num_local 0); batch = tokens per rank
    ranks: int
    wire: str = "bf16"           # dtype of the returned expert outputs
    tile_cols: int = 0           # dispatch / combine columns per tile; 0 = auto

    @property
    def local(self) -> int:
        return self.layer.num_experts // self.ranks

    def ep_config(self) -> EPConfig:
        c = self.layer
        return EPConfig(ranks=self.ranks, m=c.batch, hidden=c.hidden, top_k=c.top_k, num_experts=c.num_experts,
                        wire=self.wire, shared=bool(c.shared_intermediate), tile_cols=self.tile_cols)

    def rank_layer(self) -> MoELayerConfig:
        """One rank's expert shard as a MoELayerConfig (rank 0's start: the router's local table,
        which the EP program does not use, must be the same code on every rank). Its expert
        tiles are rebuilt for EP (blocks below: the received rows, scatter) and not staged."""
        return replace(self.layer, num_local=self.local, rank=0, expert_smem_stages=0)


def blocks(cfg: EPMoEConfig) -> dict:
    c = cfg.layer
    if c.num_local not in (0, c.num_experts):
        raise UnsupportedConfigError("ep moe: give the whole layer (num_local = 0); the ranks split the experts")
    if c.num_experts % cfg.ranks:
        raise UnsupportedConfigError(f"ep moe: {c.num_experts} experts do not split over {cfg.ranks} ranks")
    b = moe_layer.blocks(cfg.rank_layer())
    N, M, L = cfg.ranks, c.batch, cfg.local
    ep = cfg.ep_config()
    b["dispatch"], b["table"], b["combine"] = EPDispatchBlock(ep), EPTableBlock(ep), EPCombineBlock(ep)
    hits = b["gateup"].config.expected_hits
    b["gateup"] = ExpertsBlock(ExpertsConfig(stage="gateup", hidden=c.hidden, intermediate=c.intermediate,
                                             num_local=L, top_k=c.top_k, m=M, rows=N * M,
                                             weight_dtype=c.expert_dtype, swiglu_limit=c.swiglu_limit,
                                             rows_per_tile=b["gateup"].config.rows_per_tile, expected_hits=hits))
    b["down"] = ExpertsBlock(ExpertsConfig(stage="down", hidden=c.hidden, intermediate=c.intermediate,
                                           num_local=L, top_k=c.top_k, m=M, rows=N * M, scatter=True,
                                           out_dtype=cfg.wire, weight_dtype=c.expert_dtype,
                                           rows_per_tile=b["down"].config.rows_per_tile, expected_hits=hits))
    return b


def build_program(cfg: EPMoEConfig) -> tuple[Program, CommProgram]:
    """The per-rank program (identical on every rank) and its symmetric bindings."""
    c = cfg.layer
    if c.mhc:
        raise UnsupportedConfigError(f"EP MoE: the mHC residual around the layer (mhc={c.mhc!r}) is the "
                                     f"single-GPU layer's (moe_layer.build_program) only, not yet expert-parallel")
    b = blocks(cfg)
    N, M, D, k, E, I, L = cfg.ranks, c.batch, c.hidden, c.top_k, c.num_experts, c.intermediate, cfg.local
    T = b["dispatch"].num_tiles()
    prog = Program()
    comm = CommProgram(prog, N)
    moe_layer.add_inputs_and_weights(prog, c, M, L)
    for name, shape, dt in (("logits", (M, E), "fp32"), ("topk_ids", (M, k), "int32"), ("topk_w", (M, k), "fp32"),
                            ("sel.counts", (L,), "int32"), ("sel.hits", (L + 1,), "int32"),
                            ("sel.tok", (L, M), "int32"), ("sel.slot", (L, M), "int32"),
                            ("counts", (L,), "int32"), ("hits", (L + 1,), "int32"),
                            ("tok", (L, N * M), "int32"), ("slot", (L, N * M), "int32"),
                            ("act", (N * M * k, I), "bf16"), ("y", (N * M * k, D), cfg.wire)):
        prog.buffer(name, shape, dt)
    prog.buffer("out", (M, D), "bf16", "output")
    recv = comm.region("ep.recv_x", (N * M, D), "bf16")
    meta = comm.region("ep.meta", (N * M, k), "int32")
    ret = comm.region("ep.ret", (M * k, D), cfg.wire)
    dfl = comm.region("ep.dflags", (T, N), "int32", kind="flags", label="ep.table", what="EP dispatch wait")
    cfl = comm.region("ep.cflags", (T, N), "int32", kind="flags", label="ep.combine", what="EP combine")

    sel = moe_layer.add_router(prog, c, b, {"counts": "sel.counts", "hits": "sel.hits", "tok": "sel.tok",
                                            "slot": "sel.slot"})

    db = {"x": "x", "topk_ids": "topk_ids", "state": comm.local("ep.dispatch.state", (T,)), "params": PARAMS}
    for o in range(N):
        db.update({f"recv_x_{o}": recv[o], f"meta_{o}": meta[o], f"dflags_{o}": dfl[o]})
    dis = prog.op(b["dispatch"], db, waits=[sel], label="ep.dispatch")
    table = {"counts": "counts", "hits": "hits", "tok": "tok", "slot": "slot"}
    tab = prog.op(b["table"], {"meta_self": meta["self"], "dflags_self": dfl["self"], **table,
                               "state": comm.local("ep.table.state", (1,)), "params": PARAMS, "err": ERR},
                  waits=[dis], label="ep.table")

    gu = prog.op(b["gateup"], {**moe_layer.expert_weights(c, "experts.gate_up"), **table, "x": recv["self"],
                               "act": "act"}, waits=[tab], label="experts.gateup")
    dn = prog.op(b["down"], {**moe_layer.expert_weights(c, "experts.down"), **table, "act": "act", "out": "y"},
                 waits=[gu], label="experts.down")
    cb = {"y": "y", "meta_self": meta["self"], "topk_w": "topk_w", "ret_self": ret["self"],
          "cflags_self": cfl["self"], "state": comm.local("ep.combine.state", (T,)), "params": PARAMS,
          "err": ERR, "out": "out"}
    for s in range(N):
        cb.update({f"ret_{s}": ret[s], f"cflags_{s}": cfl[s]})
    waits = [dn]
    if c.shared_intermediate:
        waits.append(moe_layer.add_shared_expert(prog, c, b))
        cb["shared"] = "shared_out"
    prog.op(b["combine"], cb, waits=waits, label="ep.combine")
    return prog, comm


# -- weights, per-rank tensors, reference ------------------------------------------------------
def make_weights(cfg: EPMoEConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """The whole layer's weights (all E experts) in the kernel's layout: `moe_layer.make_weights`."""
    return moe_layer.make_weights(replace(cfg.layer, num_local=0, rank=0), seed=seed, device=device)


def shard_weights(cfg: EPMoEConfig, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights: its L experts (and their scales); router and shared expert replicated."""
    lo, L = rank * cfg.local, cfg.local
    return {n: (w[lo:lo + L].contiguous() if n.startswith("experts.") else w) for n, w in full.items()}


def rank_tensors(cfg: EPMoEConfig, prog: Program, comm: CommProgram, bufs, rank: int,
                 full_weights: dict[str, torch.Tensor], device, timeout_s: float = 1.0) -> dict[str, torch.Tensor]:
    """Every buffer of `rank`: symmetric views bound, weights of its shard, the rest zeroed."""
    t = comm.alloc_rank_tensors(bufs, rank, device, timeout_s)
    for name, w in shard_weights(cfg, full_weights, rank).items():
        if name in prog.buffers:
            t[name] = w.to(device)
    return t


def reference(cfg: EPMoEConfig, full_weights: dict, x: torch.Tensor, input_ids: torch.Tensor | None = None,
              routing: tuple | None = None) -> torch.Tensor:
    """fp32 [M, D] of one rank's tokens: the single-rank layer with all E experts."""
    return moe_layer.reference(replace(cfg.layer, num_local=0, rank=0), full_weights, x, input_ids, routing)


# -- compile checks (CPU, no GPU) ----------------------------------------------------------------
def ep_megakernel_cases() -> list[EPMoEConfig]:
    return [EPMoEConfig(MoELayerConfig(hidden=1024, num_experts=64, top_k=4, intermediate=256, batch=8,
                                       correction_bias=True, shared_intermediate=256, swiglu_limit=10.0), ranks=8)]


def compile_check(archs, num_sms: int = 16) -> dict:
    """Compile the EP MoE megakernel case(s) for each arch (16 CTAs: one rank's share of the H200
    at N = 8); the report format of sdk.compile.compile_check."""
    from ..compile import time_case
    from ..schedule import schedule
    from .kernel import compile_megakernel
    report: dict = {}
    for arch in archs:
        res = report.setdefault(arch, {})
        for cfg in ep_megakernel_cases():
            def build(cfg=cfg):
                prog, _ = build_program(cfg)
                compile_megakernel(prog.opcodes.blocks, num_sms, schedule(prog, num_sms).max_len, timing=True,
                                   arch=arch)
            time_case(res, f"megakernel ep_moe {cfg}", build)
    return report
