"""Per-layer all-reduce messages and their estimated latency on an NVLink domain (host math only).

    python -m sdk.comm.plan kimi_k3 deepseek_v41_flash glm_53     # the tables of docs/gb300-nvl72-plan.md

Placement (decode, tensor-parallel attention with replicated hidden states):
  - after attention: o_proj is row-sharded over the TP group (each rank holds its heads' slice of
    o_proj's input columns), so each rank has a partial [batch, hidden] -> one all-reduce,
    fused with the residual add and the MLP's input RMSNorm;
  - after the MLP: a dense MLP (gate/up column-, down row-sharded) or an MoE whose routed
    experts are spread over the EP group and whose shared experts are TP-sharded: every rank
    holds the partial sum of its experts' and shard's contributions for all tokens -> one
    all-reduce over the group, fused with the residual add and the next layer's input norm.
  Two all-reduces per layer of batch x hidden x 2 bytes (bf16), whatever the group size N.

Latency model (assumptions, to be replaced by measurements on the NVLink machine):
  one-shot  t = alpha + (N - 1) B / link         (every rank pushes B to each of N - 1 peers)
  two-shot  t = 2 alpha + 2 (N - 1) / N B / link
with alpha the cost of one flag round trip inside the kernel and link the per-direction NVLink
bandwidth per GPU (ROUND_TRIP_US, LINK_GBS in ops.py). The chosen algorithm is the cheaper one
that the instruction supports for the shape (two-shot needs batch x hidden divisible by 4 N).
"""
from __future__ import annotations

import sys

from ..blocks.allreduce import AllReduceBlock, AllReduceConfig
from ..errors import UnsupportedConfigError
from .ops import LINK_GBS, ROUND_TRIP_US


def latency_us(nbytes: float, n: int, algo: str, round_trip_us: float = ROUND_TRIP_US,
               link_gbs: float = LINK_GBS) -> float:
    bw = link_gbs * 1e3                      # bytes per us
    if n == 1:
        return 0.0
    if algo == "oneshot":
        return round_trip_us + (n - 1) * nbytes / bw
    return 2 * round_trip_us + 2 * (n - 1) / n * nbytes / bw


def best(batch: int, hidden: int, n: int) -> tuple[str, float, float, float, bool]:
    """(chosen algorithm, its us, one-shot us, two-shot us, whether two-shot needs the message
    padded to a multiple of 4 N elements - not implemented yet: `AllReduceBlock.check` refuses)."""
    b = batch * hidden * 2
    one, two = latency_us(b, n, "oneshot"), latency_us(b, n, "twoshot")
    try:
        AllReduceBlock(AllReduceConfig(ranks=n, m=batch, d=hidden, phase="rs"))
        pad = False
    except UnsupportedConfigError:
        pad = True
    if two < one:
        return ("two-shot*" if pad else "two-shot"), two, one, two, pad
    return "one-shot", one, one, two, pad


def table(model: str, batches=(1, 8, 64), groups=(8, 16, 72)) -> str:
    from .. import plugins
    from ..graph import plan
    spec = plugins.get_model(model).spec("full")
    d = spec.hidden_size
    nl = len(spec.layers)
    lines = [f"### {model}: hidden {d}, {nl} layers, 2 all-reduces per layer ({2 * nl} per step)", "",
             "| batch | message | N | algorithm | per all-reduce µs (1-shot / 2-shot) | per step µs | layer floor µs (TP=EP=N, gb300) |",
             "|---|---|---|---|---|---|---|"]
    for bt in batches:
        for n in groups:
            algo, t, one, two, pad = best(bt, d, n)
            try:
                p = plan(spec, tp=n, ep=n, batch=bt, gpu="gb300")
                floor = f"{p.step_floor_us / nl:.1f}"
            except UnsupportedConfigError as exc:
                floor = f"n/a ({str(exc)[:40]})"
            two_s = f"{two:.1f}" + ("*" if pad else "")
            lines.append(f"| {bt} | {bt * d * 2 / 1024:.0f} KB | {n} | {algo} | {t:.1f} ({one:.1f} / {two_s}) | "
                         f"{2 * nl * t:.0f} | {floor} |")
    lines.append("")
    lines.append("\\* two-shot needs batch x hidden padded to a multiple of 4 N elements (not implemented: "
                 "the instruction refuses, one-shot runs instead)")
    return "\n".join(lines)


if __name__ == "__main__":
    for m in sys.argv[1:] or ["kimi_k3", "deepseek_v41_flash", "glm_53"]:
        print(table(m))
        print()
