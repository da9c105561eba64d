"""An MLA attention layer sharded over N ranks by heads (tensor parallelism), with the output
projection's all-reduce fused with the residual add and the next RMSNorm - one megakernel launch
per rank and step.

    on rank r, heads [r*H/N, (r+1)*H/N):
        q[..., :L] = q_nope @ W_UK          \\
        o_lat      = split-KV attention      |  sdk/megakernel/mla_attention.py (its heads' shard;
        o          = o_lat @ W_UV^T         /    the latent cache is the same on every rank)
        p_r        = o @ W_o[:, r-th columns]^T      row-parallel o_proj: a partial [M, D]
    resid = x + sum_r p_r;  out = rmsnorm(resid) * norm          one fused all-reduce op

Every rank sums the partials in rank order, so the ranks' copies of resid and out are bit-equal.
Equal to `reference()`, the unsharded layer. The all-reduce is placed by the schedule like any
other op (it waits the o_proj GEMV); the algorithm (one-shot / two-shot) is chosen by size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.gemv import GemvConfig
from ..comm.ops import CommProgram
from ..errors import UnsupportedConfigError
from . import mla_attention as mla
from .mlp_stack import gemv_block
from .program import Program


@dataclass(frozen=True)
class TPAttentionConfig:
    attn: mla.MLAAttentionConfig      # the whole layer: heads = all heads of the model
    ranks: int
    hidden: int = 7168
    algo: str = "auto"                # "auto" | "oneshot" | "twoshot"
    wire: str = "bf16"
    eps: float = 1e-6
    num_sms: int = 132

    @property
    def shard(self) -> mla.MLAAttentionConfig:
        if self.attn.heads % self.ranks:
            raise UnsupportedConfigError(f"tp attention: {self.attn.heads} heads do not shard over {self.ranks} ranks")
        return replace(self.attn, heads=self.attn.heads // self.ranks)


def build_program(cfg: TPAttentionConfig) -> tuple[Program, CommProgram]:
    """The per-rank program (identical on every rank) and its comm bindings."""
    sh, D = cfg.shard, cfg.hidden
    prog = mla.build_program(sh)                  # q_nope, q, cache ... -> o [M, H/N, v]
    comm = CommProgram(prog, cfg.ranks)
    M = sh.tokens
    prog.buffer("x", (M, D), "bf16", "input")     # the residual stream entering the layer
    prog.buffer("o_proj", (D, sh.heads * sh.v), "bf16", "weight")
    prog.buffer("norm.weight", (D,), "bf16", "weight")
    prog.buffer("partial", (M, D), cfg.wire)
    prog.buffer("resid", (M, D), "fp32")
    prog.buffer("out", (M, D), "bf16", "output")
    w_uv_op = len(prog.ops) - 1
    o_op = prog.op(gemv_block(GemvConfig(n=D, k=sh.heads * sh.v, m=M, out_dtype=cfg.wire), 0, cfg.num_sms),
                   {"w": "o_proj", "x": "o", "y": "partial"}, waits=[w_uv_op], label="attn.o_proj")
    comm.allreduce("partial", "resid", res="x", norm_weight="norm.weight", out="out", waits=[o_op],
                   label="attn.allreduce", algo=cfg.algo, eps=cfg.eps)
    return prog, comm


def make_weights(cfg: TPAttentionConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """The unsharded layer's weights: kv_b_proj (+ its absorbed halves), o_proj [D, H*v], norm."""
    a = cfg.attn
    out = mla.make_weights(a, seed=seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    out["o_proj"] = (torch.randn(cfg.hidden, a.heads * a.v, generator=g, device=device)
                     * (a.heads * a.v) ** -0.5).to(torch.bfloat16)
    out["norm.weight"] = (1.0 + 0.1 * torch.randn(cfg.hidden, generator=g, device=device)).to(torch.bfloat16)
    return out


def shard_weights(cfg: TPAttentionConfig, full: dict, rank: int) -> dict[str, torch.Tensor]:
    h = cfg.shard.heads
    heads = slice(rank * h, (rank + 1) * h)
    v = cfg.attn.v
    return {"w_uk_t": full["w_uk_t"][heads].contiguous(), "w_uv": full["w_uv"][heads].contiguous(),
            "o_proj": full["o_proj"][:, rank * h * v:(rank + 1) * h * v].contiguous(),
            "norm.weight": full["norm.weight"]}


def shard_inputs(cfg: TPAttentionConfig, full: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank r's queries (its heads) beside the replicated cache, table, lengths and x."""
    h = cfg.shard.heads
    heads = slice(rank * h, (rank + 1) * h)
    out = {k: v for k, v in full.items() if k not in ("q_nope", "q")}
    out["q_nope"] = full["q_nope"][:, heads].contiguous()
    out["q"] = full["q"][:, :, heads].contiguous()
    return out


def rank_tensors(cfg: TPAttentionConfig, prog: Program, comm: CommProgram, bufs, rank: int, full_weights: dict,
                 device, timeout_s: float = 1.0) -> dict[str, torch.Tensor]:
    t = comm.alloc_rank_tensors(bufs, rank, device, timeout_s)
    for name, w in shard_weights(cfg, full_weights, rank).items():
        t[name] = w.to(device)
    return t


def reference(cfg: TPAttentionConfig, weights: dict, inputs: dict) -> torch.Tensor:
    """The unsharded layer in fp32: attention of all heads (expanded keys/values), o_proj,
    residual, RMSNorm -> out [M, D]."""
    from ..reference.common import rms_norm
    o = mla.reference(cfg.attn, weights, inputs)                  # [M, H, v]
    r = inputs["x"].float() + o.reshape(o.shape[0], -1) @ weights["o_proj"].float().T
    return rms_norm(r, weights["norm.weight"].float(), cfg.eps)
