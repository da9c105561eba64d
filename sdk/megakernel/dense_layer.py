"""A dense MLP sublayer (Kimi K3's first layer; GLM-5.3's first ones) in ONE megakernel launch:

    act = act_fn(rmsnorm(x) * mlp_norm @ W_gate^T, rmsnorm(x) * mlp_norm @ W_up^T)
                                           GEMV: the norm fused in its prologue, the gated epilogue
                                           (SwiGLU with the model's clamp, or Kimi K3's SiTU)
    resid = x + act @ W_down^T             GEMV with the residual epilogue (fp32)
          | x += act @ W_down^T            (`resid_in_place`: a plain-residual model's chain, bf16
                                           in place; sdk/megakernel/plain_model.py)

In an mHC residual (`mhc` "v4" / "v41": GLM-5.3's first layers; sdk/megakernel/mhc_site.py) the
streams come in instead of x: x = the collapse normed with the fp32 mlp_norm (its own op), the
gate/up GEMV reads it as it is, down writes y and the post-mix updates the streams.

The down GEMV waits for every gate/up tile (it reads the whole act row), so by then nothing reads
x any more: it may be rewritten in place. `reference()` is the model's own dense MLP
(sdk/reference/moe.py: spec_dense_mlp) on bf16(rmsnorm(x) * mlp_norm), plus the residual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.gemv import GemvConfig
from .mhc_site import MHCSiteFields, add_collapse, add_post, partial_output
from .mlp_stack import gemv_block
from .program import Program


@dataclass(frozen=True)
class DenseLayerConfig(MHCSiteFields):
    hidden: int = 1024
    intermediate: int = 512
    batch: int = 1                       # tokens (batch x tokens per sequence)
    activation: str = "silu"             # "silu" | "situ" (Kimi K3)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    swiglu_limit: float | None = None
    eps: float = 1e-6                    # the input norm's (the model's norm_eps)
    resid_in_place: bool = False         # x += down(act) (bf16, in place) instead of resid (fp32)
    partial_out: bool = False            # with resid_in_place, tensor parallel: the last GEMV writes this
                                         # rank's partial (bf16 `partial`, no residual); the model's
                                         # all-reduce adds the ranks' partials onto x (tp_model.py)
    gateup_rows: int = 0                 # rows per tile (0: balanced over num_sms)
    down_rows: int = 0
    num_sms: int = 132

    @property
    def site(self):
        """The mHC site around the sublayer (sdk/megakernel/mhc_site.py), or None (plain residual)."""
        from .mhc_site import site_of
        return site_of(self, "dense MLP layer", self.batch, self.eps)

    @property
    def spec(self):
        """The DenseMlpSpec the sublayer computes (what `reference()` runs)."""
        from ..spec import DenseMlpSpec
        return DenseMlpSpec(intermediate_size=self.intermediate, activation=self.activation,
                            swiglu_limit=self.swiglu_limit, situ_beta=self.situ_beta,
                            situ_linear_beta=self.situ_linear_beta)

    def weight_shapes(self) -> dict[str, tuple]:
        """Program weight name -> (shape, dtype)."""
        D, I = self.hidden, self.intermediate
        w = {"mlp_norm": ((D,), "fp32" if self.mhc else "bf16"), "gate_proj": ((I, D), "bf16"),
             "up_proj": ((I, D), "bf16"), "down_proj": ((D, I), "bf16")}
        if self.site:
            w.update(self.site.weight_shapes())
        return w


def build_program(cfg: DenseLayerConfig) -> Program:
    D, I, M = cfg.hidden, cfg.intermediate, cfg.batch
    site = cfg.site
    prog = Program()
    if not site:
        prog.buffer("x", (M, D), "bf16", "input")
    for name, (shape, dtype) in cfg.weight_shapes().items():
        prog.buffer(name, shape, dtype, "weight")
    # mHC: x = the streams' collapse with mlp_norm (mhc_site.py); down -> y + the post-mix
    x_ops, coef_op = add_collapse(prog, site, site.blocks(), "mlp_norm", label="mlp.") if site else ([], None)
    prog.buffer("act", (M, I), "bf16")
    if site:
        prog.buffer("y", (M, D), "bf16")
    elif not cfg.resid_in_place:
        prog.buffer("resid", (M, D), "fp32", "output")
    gateup = gemv_block(GemvConfig(n=I, k=D, m=M, swiglu=True, swiglu_limit=cfg.swiglu_limit, activation=cfg.activation,
                                   situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, norm=not site,
                                   norm_eps=cfg.eps), cfg.gateup_rows, cfg.num_sms)
    norm = {} if site else {"norm_weight": "mlp_norm"}
    gu = prog.op(gateup, {"w_gate": "gate_proj", "w_up": "up_proj", "x": "x", **norm, "y": "act"}, waits=x_ops,
                 label="mlp.gateup")
    if site:
        down = gemv_block(GemvConfig(n=D, k=I, m=M), cfg.down_rows, cfg.num_sms)
        dn = prog.op(down, {"w": "down_proj", "x": "act", "y": "y"}, waits=[gu], label="mlp.down")
        add_post(prog, site.blocks(), "y", [dn, coef_op], label="mlp.")
        return prog
    if partial_output(prog, cfg, M, D):
        prog.op(gemv_block(GemvConfig(n=D, k=I, m=M), cfg.down_rows, cfg.num_sms),
                {"w": "down_proj", "x": "act", "y": "partial"}, waits=[gu], label="mlp.down")
        return prog
    y, out = ("x", "bf16") if cfg.resid_in_place else ("resid", "fp32")
    down = gemv_block(GemvConfig(n=D, k=I, m=M, out_dtype=out, residual="bf16"), cfg.down_rows, cfg.num_sms)
    prog.op(down, {"w": "down_proj", "x": "act", "res": "x", "y": y}, waits=[gu], label="mlp.down")
    return prog


def make_weights(cfg: DenseLayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random bf16 weights (projections scaled by fan-in^-1/2, the norm near 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = {n: (torch.randn(*s, generator=g, device=device) * s[-1] ** -0.5).to(torch.bfloat16)
         for n, (s, _) in cfg.weight_shapes().items() if n in ("gate_proj", "up_proj", "down_proj")}
    w["mlp_norm"] = (1 + 0.1 * torch.randn(cfg.hidden, generator=g, device=device)).to(torch.bfloat16)
    if cfg.site:            # the norm fp32 (bf16 values: the model's), the site's mix weights
        from .mhc_site import site_weights
        w["mlp_norm"] = w["mlp_norm"].float()
        w.update(site_weights(cfg.site, g, device))
    return w


def make_inputs(cfg: DenseLayerConfig, seed: int = 0, device="cpu", hc_fn=None) -> dict[str, torch.Tensor]:
    """x [M, D] bf16; mHC: the streams instead, with this site's partials of them (`hc_fn`:
    mhc_site.site_fn)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if cfg.site:
        from .mhc_site import site_inputs
        return site_inputs(cfg.site, g, hc_fn, device)
    return {"x": torch.randn(cfg.batch, cfg.hidden, generator=g, device=device).to(torch.bfloat16)}


def reference(cfg: DenseLayerConfig, weights: dict, inputs: dict, hc_fn=None):
    """x + the model's dense MLP on bf16(rmsnorm(x) * mlp_norm), in fp32 from the bf16 weights:
    resid [M, D] fp32; mHC: {streams, coef, part_next} - the model's residual around it
    (mhc_site.reference, this site's fn `hc_fn`)."""
    from ..reference.common import rms_norm
    from ..reference.moe import spec_dense_mlp
    f = {k + ".weight": v.float() for k, v in weights.items() if not k.startswith("hc_")}

    def mlp(h):
        return spec_dense_mlp(h.float(), f, "", cfg.spec)

    if cfg.site:
        from .mhc_site import reference as site_reference
        return site_reference(cfg.site, weights, inputs, hc_fn, weights["mlp_norm"], mlp)
    x = inputs["x"].float()
    return x + mlp(rms_norm(x, f["mlp_norm.weight"], cfg.eps).to(torch.bfloat16))
