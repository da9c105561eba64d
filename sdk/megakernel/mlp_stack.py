"""The first vertical slice: a stack of dense SwiGLU MLP layers with RMSNorm and residual,
decoded in ONE megakernel launch per step.

    r = x
    for each layer l:  h = rmsnorm(r) * norm_l;  r = r + down_l(silu(gate_l(h)) * up_l(h))
    out = rmsnorm(r) * final_norm

Ops per layer (op-level dependencies through counters), with the norm fused (`fuse_norm`, the
default at batch <= 2):
    gateup_l  GEMV with fused RMSNorm prologue and SwiGLU epilogue (waits down_{l-1});
              reads the residual stream r (layer 0: the bf16 input x)
    down_l    GEMV with fused residual epilogue, r = r + down(act) in place, fp32 (waits gateup_l);
              layer 0 writes r = x + down(act)
and without it a separate RMSNorm op per layer (one CTA per token, writes `normed`) before the
gate/up GEMV. A final RMSNorm (waits down_{L-1}) writes `out`. Buffers: x (bf16 input), resid
(fp32 residual stream), act (bf16), out (bf16), normed (bf16, unfused only).

Why the residual lives in the down epilogue: gateup_{l+1} reads r only after every down_l tile
signalled, and down_{l+1} writes r only after every gateup_{l+1} tile signalled (it needs their
act), so r can be updated in place with no extra buffer, op or hop.

Weights bf16, or fp8-e4m3 with 128x128 fp32 block scales (made here by quantizing random bf16
weights the way the DeepSeek/Kimi checkpoints are: scale = amax / 448 per block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.gemv import GemvBlock, GemvConfig, balanced_config, fill_stage
from ..blocks.rmsnorm import RMSNormBlock, RMSNormConfig
from .program import Program

FP8_MAX = 448.0


@dataclass(frozen=True)
class MLPStackConfig:
    hidden: int = 7168
    intermediate: int = 2048
    layers: int = 4
    batch: int = 1
    weight_dtype: str = "bf16"          # "bf16" | "fp8_e4m3"
    eps: float = 1e-6
    swiglu_limit: float | None = None
    gateup_rows: int = 0                # rows (of gate, and of up) per gate/up tile; 0 = balanced
    down_rows: int = 0                  # rows per down tile; 0 = balanced
    num_sms: int = 132                  # SMs the balanced tiles are cut for
    fuse_norm: bool | None = None       # RMSNorm inside the gate/up tiles; None = batch <= 2
    fp8_decode: str = "hfma2"           # GemvConfig.fp8_decode of the CUDA-core fp8 tiles
    gateup_mma: bool | None = None      # GemvConfig.mma of the gate/up GEMVs (None = auto)
    down_mma: bool | None = None        # ... of the down GEMVs
    gateup_chunk_k: int = 0             # GemvConfig.chunk_k of the gate/up GEMVs (0 = the widest
    down_chunk_k: int = 0               # that fits the ring's stage: gemv.fill_stage); ... of down
    warp_ring: bool | None = False      # GemvConfig.warp_ring of every GEMV (CUDA-core consumers,
                                        # the whole x staged: batch <= 4 at hidden 7168); None:
                                        # wherever every GEMV of the stack can take it (H100:
                                        # no faster at batch 1, 2-6% slower at 2: off by default)

    @property
    def norm_fused(self) -> bool:
        return self.batch <= 2 if self.fuse_norm is None else self.fuse_norm


def gemv_config(gc: GemvConfig, rows: int, num_sms: int) -> GemvConfig:
    """`gc` with `rows` rows per tile, or (rows = 0) the balanced count."""
    import dataclasses
    return dataclasses.replace(gc, rows_per_tile=rows) if rows else balanced_config(gc, num_sms)


def gemv_block(gc: GemvConfig, rows: int, num_sms: int) -> GemvBlock:
    """The GEMV block of `gc` with `rows` rows per tile, or (rows = 0) the balanced count."""
    return GemvBlock(gemv_config(gc, rows, num_sms))


def fit_chunks(configs: list[GemvConfig], chunk_k: list[int]) -> list[GemvBlock]:
    """The blocks of `configs`, each with its given chunk_k, or (0) the widest chunk that fits the
    ring stage their default chunks make (`fill_stage`)."""
    import dataclasses
    # rounded up to 1 KB: a chunk twice as wide as another's whose block scales overrun the
    # stage by a few bytes (fp8_decode="wgmma": unpadded rows) still fills it
    stage = max(GemvBlock(dataclasses.replace(c, chunk_k=k)).chunk_bytes() for c, k in zip(configs, chunk_k))
    stage = -(-stage // 1024) * 1024
    return [GemvBlock(dataclasses.replace(c, chunk_k=k) if k else fill_stage(c, stage))
            for c, k in zip(configs, chunk_k)]


def _names(l):
    p = f"layers.{l}."
    return p + "norm", p + "gate", p + "up", p + "down"


def build_program(cfg: MLPStackConfig) -> Program:
    d, i, m, wd = cfg.hidden, cfg.intermediate, cfg.batch, cfg.weight_dtype
    fused = cfg.norm_fused
    prog = Program()
    prog.buffer("x", (m, d), "bf16", "input")
    prog.buffer("resid", (m, d), "fp32")
    if not fused:
        prog.buffer("normed", (m, d), "bf16")
    prog.buffer("act", (m, i), "bf16")
    prog.buffer("out", (m, d), "bf16", "output")
    fp8 = wd == "fp8_e4m3"

    def gateup_config(first, ring):
        return gemv_config(GemvConfig(n=i, k=d, m=m, weight_dtype=wd, swiglu=True, swiglu_limit=cfg.swiglu_limit,
                                      norm=fused, norm_eps=cfg.eps, fp8_decode=cfg.fp8_decode, mma=cfg.gateup_mma,
                                      x_dtype=("bf16" if first else "fp32") if fused else "bf16",
                                      warp_ring=ring),
                           cfg.gateup_rows, cfg.num_sms)

    def down_config(first, ring):
        return gemv_config(GemvConfig(n=d, k=i, m=m, weight_dtype=wd, out_dtype="fp32", fp8_decode=cfg.fp8_decode,
                                      mma=cfg.down_mma, residual="bf16" if first else "fp32", warp_ring=ring),
                           cfg.down_rows, cfg.num_sms)

    def gateup_down(first):
        return fit_chunks([gateup_config(first, ring), down_config(first, ring)], [cfg.gateup_chunk_k, cfg.down_chunk_k])

    def norm(first):
        return RMSNormBlock(RMSNormConfig(d=d, m=m, eps=cfg.eps, residual_in=False,
                                          src_dtype="bf16" if first else "fp32", write_resid=False))

    # warp_ring None: sliced wherever every GEMV of the stack can be (the layers' GEMVs differ in
    # dtypes only, which the slicing does not depend on)
    ring = cfg.warp_ring
    if ring is None:
        ring = all(GemvBlock(gc).warp_ring_refusal() is None for gc in (gateup_config(True, False),
                                                                       down_config(True, False)))
    prev = None
    for l in range(cfg.layers):
        nn, gn, un, dn = _names(l)
        first = l == 0
        src = "x" if first else "resid"
        prog.buffer(nn + ".weight", (d,), "bf16", "weight")
        for name, shape in ((gn, (i, d)), (un, (i, d)), (dn, (d, i))):
            prog.buffer(name + ".weight", shape, wd, "weight")
            if fp8:
                prog.buffer(name + ".weight_scale", (shape[0] // 128, shape[1] // 128), "fp32", "weight")
        waits = [] if prev is None else [prev]
        gb = {"w_gate": gn + ".weight", "w_up": un + ".weight", "y": "act"}
        if fused:
            gb.update({"x": src, "norm_weight": nn + ".weight"})
        else:
            n_op = prog.op(norm(first), {"src": src, "weight": nn + ".weight", "out": "normed"}, waits=waits,
                           label=nn)
            gb["x"] = "normed"
            waits = [n_op]
        db = {"w": dn + ".weight", "x": "act", "res": src, "y": "resid"}
        if fp8:
            gb.update({"w_gate_scale": gn + ".weight_scale", "w_up_scale": un + ".weight_scale"})
            db["w_scale"] = dn + ".weight_scale"
        gateup, down = gateup_down(first)
        g_op = prog.op(gateup, gb, waits=waits, label=f"layers.{l}.gateup")
        prev = prog.op(down, db, waits=[g_op], label=dn)
    prog.buffer("final_norm.weight", (d,), "bf16", "weight")
    prog.op(norm(cfg.layers == 0), {"src": "resid" if cfg.layers else "x", "weight": "final_norm.weight",
                                    "out": "out"}, waits=[prev] if prev is not None else [], label="final_norm")
    return prog


def quantize_fp8(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization: w ~= q * scale[n // block, k // block]."""
    n, k = w.shape
    blocks = w.float().reshape(n // block, block, k // block, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale.float()


def make_weights(cfg: MLPStackConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights (generated on `device`), scaled so activations stay O(1) through the stack."""
    g = torch.Generator(device=device).manual_seed(seed)
    d, i = cfg.hidden, cfg.intermediate
    out = {}

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(torch.bfloat16)

    def norm_weight():
        return (1.0 + 0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)

    for l in range(cfg.layers):
        nn, gn, un, dn = _names(l)
        out[nn + ".weight"] = norm_weight()
        for name, shape, fan_in in ((gn, (i, d), d), (un, (i, d), d), (dn, (d, i), i)):
            w = rnd(*shape, std=fan_in ** -0.5)
            if cfg.weight_dtype == "fp8_e4m3":
                out[name + ".weight"], out[name + ".weight_scale"] = quantize_fp8(w)
            else:
                out[name + ".weight"] = w
    out["final_norm.weight"] = norm_weight()
    return out


def _dequant(weights, name):
    w = weights[name + ".weight"].float()
    s = weights.get(name + ".weight_scale")
    if s is not None:
        w = w * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w


def reference(cfg: MLPStackConfig, weights: dict, x: torch.Tensor) -> torch.Tensor:
    """The stack in fp32 torch (the definition the megakernel and the PyVM are checked against)."""
    def rms(r, w):
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + cfg.eps) * w.float()

    r = x.float()
    for l in range(cfg.layers):
        nn, gn, un, dn = _names(l)
        h = rms(r, weights[nn + ".weight"])
        g, u = h @ _dequant(weights, gn).T, h @ _dequant(weights, un).T
        if cfg.swiglu_limit is not None:
            g = g.clamp(max=cfg.swiglu_limit)
            u = u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        r = r + (torch.nn.functional.silu(g) * u) @ _dequant(weights, dn).T
    return rms(r, weights["final_norm.weight"])


def weight_bytes(prog: Program) -> int:
    return prog.bytes_by_role("weight")
