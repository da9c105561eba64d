"""Tensor-parallel programs over N ranks with the fused in-kernel all-reduce.

1. The dense SwiGLU MLP stack of `mlp_stack.py`, sharded over N ranks (Megatron style):

       h_0 = rmsnorm(x) * norm_0                             (replicated on every rank)
       for each layer l, on rank r:
           act   = silu(h_l @ gate_l[r]^T) * (h_l @ up_l[r]^T)   gate/up column-sharded: rows
                                                                [r*I/N, (r+1)*I/N) of gate, up
           p_r   = act @ down_l[:, r]^T                          down row-sharded (its input
                                                                columns): a partial [M, D]
           resid = (x if l == 0 else resid) + sum_r p_r          \\  one fused all-reduce op
           h_l+1 = rmsnorm(resid) * norm_l+1 (last: final_norm)  /   (or two-shot: rs + ag)
       out = h_L

   Ops per rank and layer: gateup_l (GEMV + SwiGLU; layer 0 with the fused RMSNorm prologue
   at batch <= 2, else a separate RMSNorm op), down_l (GEMV, wire-dtype partial), all-reduce_l.
   The residual stream and every h are replicated: all ranks sum the partials in rank order,
   so their copies stay bit-identical. Equal to `mlp_stack.reference` of the unsharded stack.

2. `build_allreduce_chain`: K all-reduce ops back to back (resid += sum of partials, norm),
   each waiting for the previous one: the all-reduce benchmark.

Supported: what GemvBlock supports per shard (I / N a multiple of 256 for the down GEMV's chunks;
fp8 also of 512), D a multiple of 1024 (RMSNorm), wire bf16 or fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.gemv import GemvConfig
from ..blocks.rmsnorm import RMSNormBlock, RMSNormConfig
from ..comm.ops import CommProgram
from ..errors import UnsupportedConfigError
from .mlp_stack import MLPStackConfig, _names, gemv_block
from .program import Program


@dataclass(frozen=True)
class TPStackConfig:
    stack: MLPStackConfig
    ranks: int
    algo: str = "auto"                   # "auto" | "oneshot" | "twoshot"
    wire: str = "bf16"                   # partial / transfer dtype
    oneshot_max_bytes: float | None = None   # None: crossover_bytes(ranks)


def build_program(cfg: TPStackConfig) -> tuple[Program, CommProgram]:
    """The per-rank program (identical on every rank) and its comm bindings."""
    s, N = cfg.stack, cfg.ranks
    d, i, m, wd = s.hidden, s.intermediate, s.batch, s.weight_dtype
    if i % N:
        raise UnsupportedConfigError(f"tp stack: intermediate {i} does not shard over {N} ranks")
    ish = i // N
    fp8 = wd == "fp8_e4m3"
    prog = Program()
    comm = CommProgram(prog, N)
    prog.buffer("x", (m, d), "bf16", "input")
    prog.buffer("resid", (m, d), "fp32")
    prog.buffer("h", (m, d), "bf16")
    prog.buffer("act", (m, ish), "bf16")
    prog.buffer("partial", (m, d), cfg.wire)
    prog.buffer("out", (m, d), "bf16", "output")
    fused0 = s.norm_fused
    prog.buffer("layers.0.norm.weight", (d,), "bf16", "weight")
    prog.buffer("final_norm.weight", (d,), "bf16", "weight")
    if s.layers < 1:
        raise UnsupportedConfigError("tp stack: at least one layer")
    prev = None
    if not fused0 and s.layers:
        prev = prog.op(RMSNormBlock(RMSNormConfig(d=d, m=m, eps=s.eps, residual_in=False, src_dtype="bf16",
                                                  write_resid=False)),
                       {"src": "x", "weight": "layers.0.norm.weight", "out": "h"}, label="layers.0.norm")
    for l in range(s.layers):
        _, gn, un, dn = _names(l)
        if l + 1 < s.layers:
            prog.buffer(f"layers.{l + 1}.norm.weight", (d,), "bf16", "weight")
        for name, shape in ((gn, (ish, d)), (un, (ish, d)), (dn, (d, ish))):
            prog.buffer(name + ".weight", shape, wd, "weight")
            if fp8:
                prog.buffer(name + ".weight_scale", (shape[0] // 128, shape[1] // 128), "fp32", "weight")
        norm_here = l == 0 and fused0
        gb = {"w_gate": gn + ".weight", "w_up": un + ".weight", "y": "act", "x": "x" if norm_here else "h"}
        if norm_here:
            gb["norm_weight"] = "layers.0.norm.weight"
        db = {"w": dn + ".weight", "x": "act", "y": "partial"}
        if fp8:
            gb.update({"w_gate_scale": gn + ".weight_scale", "w_up_scale": un + ".weight_scale"})
            db["w_scale"] = dn + ".weight_scale"
        g = prog.op(gemv_block(GemvConfig(n=ish, k=d, m=m, weight_dtype=wd, swiglu=True,
                                          swiglu_limit=s.swiglu_limit, norm=norm_here, norm_eps=s.eps),
                               s.gateup_rows, s.num_sms),
                    gb, waits=[prev] if prev is not None else [], label=f"layers.{l}.gateup")
        dop = prog.op(gemv_block(GemvConfig(n=d, k=ish, m=m, weight_dtype=wd, out_dtype=cfg.wire),
                                 s.down_rows, s.num_sms), db, waits=[g], label=dn)
        last = l + 1 == s.layers
        prev = comm.allreduce("partial", "resid", res="x" if l == 0 else "resid",
                              norm_weight="final_norm.weight" if last else f"layers.{l + 1}.norm.weight",
                              out="out" if last else "h", waits=[dop], label=f"layers.{l}.allreduce",
                              algo=cfg.algo, eps=s.eps, oneshot_max_bytes=cfg.oneshot_max_bytes)
    return prog, comm


def shard_weights(cfg: TPStackConfig, full: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights from the unsharded stack's (`mlp_stack.make_weights`)."""
    s, N = cfg.stack, cfg.ranks
    ish = s.intermediate // N
    rows = slice(rank * ish, (rank + 1) * ish)
    out = {}
    for name, w in full.items():
        if name.endswith(("gate.weight", "up.weight")):
            out[name] = w[rows].contiguous()
        elif name.endswith(("gate.weight_scale", "up.weight_scale")):
            out[name] = w[rank * ish // 128:(rank + 1) * ish // 128].contiguous()
        elif name.endswith("down.weight"):
            out[name] = w[:, rows].contiguous()
        elif name.endswith("down.weight_scale"):
            out[name] = w[:, rank * ish // 128:(rank + 1) * ish // 128].contiguous()
        else:
            out[name] = w                     # norms: replicated
    return out


def rank_tensors(cfg: TPStackConfig, prog: Program, comm: CommProgram, bufs, rank: int,
                 full_weights: dict[str, torch.Tensor], device, timeout_s: float = 1.0) -> dict[str, torch.Tensor]:
    t = comm.alloc_rank_tensors(bufs, rank, device, timeout_s)
    for name, w in shard_weights(cfg, full_weights, rank).items():
        if name in prog.buffers:
            t[name] = w.to(device)
    return t


def build_allreduce_chain(ranks: int, m: int, d: int, ops: int, algo: str = "auto", wire: str = "bf16",
                          norm: bool = True, tile_elems: int = 0, resid_dtype: str = "fp32") -> tuple[Program, CommProgram]:
    """`ops` fused all-reduces in a chain: resid += sum_r partial_r (in place), out = norm(resid).
    Buffers: partial (wire, input), resid (fp32, or bf16: a plain-residual model's x), norm.weight, out."""
    prog = Program()
    comm = CommProgram(prog, ranks)
    prog.buffer("partial", (m, d), wire, "input")
    prog.buffer("resid", (m, d), resid_dtype)
    prog.buffer("norm.weight", (d,), "bf16", "weight")
    prog.buffer("out", (m, d), "bf16", "output")
    prev = None
    for j in range(ops):
        prev = comm.allreduce("partial", "resid", res="resid", norm_weight="norm.weight" if norm else None,
                              out="out" if norm else None, waits=[prev] if prev is not None else [],
                              label=f"ar{j}", algo=algo, tile_elems=tile_elems)
    return prog, comm
