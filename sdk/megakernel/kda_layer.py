"""A whole KDA (Kimi Delta Attention) sublayer of one GPU's head shard in ONE megakernel launch:
the input RMSNorm fused into the projections, the short conv + delta rule + gated output norm
(one KDA op), and the output projection with the residual add.

    x (bf16 [M, D], M = B * T: the residual stream entering the sublayer)
    qkv   = GEMV(rmsnorm(x) * input_norm, [W_q; W_k; W_v])           [M, 3C]  (the conv's channels q | k | v)
    bf_a  = GEMV(rmsnorm(x) * input_norm, [W_b; W_f_a; 0])           [M, P]   (beta logits in columns
                                                                              0..H-1, f_a in H..H+r-1)
    gate  = GEMV(rmsnorm(x) * input_norm, W_g)                       [M, C]   (full rank: Kimi K3)
          = GEMV(GEMV(rmsnorm(x) * input_norm, [W_g_a; 0]), [W_g_b 0])         (low rank: GLM-5.3)
    g     = GEMV(bf_a, [0 W_f_b 0])                                   [M, C]   (raw gate; dt_bias in the KDA op)
    o     = KDA(conv, out_norm)(qkv, conv_state, g, beta = bf_a, state, gate)  [B, T, H, K]; conv_state
                                                                              and state updated in place
    resid = x + o @ W_o^T       (fp32: the o_proj GEMV's residual epilogue)
          | x += o @ W_o^T      (`resid_in_place`: a plain-residual model's chain, bf16 in place -
                                 the hidden state the next sublayer reads; sdk/megakernel/plain_model.py)

Why beta and f_a share one GEMV: a GEMV's K comes in 256s (32 lanes x 16 bytes), so the forget
gate's rank (128 in both models) is padded to 256 anyway (zero columns in W_f_b), and the beta
rows fill part of that padding: one 256-row GEMV instead of a 128-row one and a 12-row one - the
latter, 2 tiles on 2 SMs streaming 100 KB each, took 15 us at Kimi K3 TP8 batch 1 (H200
timeline). The KDA op reads beta as the first `heads` columns of each bf_a row
(KDAConfig.beta_width = P), f_b multiplies the beta columns by zeros.

The KDA op reads four producers; f_b (tiny, after bf_a anyway) also waits for qkv and the KDA op
waits for f_b and the gate - the measured program (52.0 us at K3 TP8 batch 1). The KDA op could
now wait for all three itself (isa.MAX_WAITS = 3); the one run of that form (57.5 us) was taken
with a GEMV regression in the same build, so it is not the default until measured cleanly. The
waiting GEMVs still stream their weights before the wait (the ring loads weights ahead).
`reference()` is sdk/reference/kda.py's KDAReference.forward on rmsnorm(x) in bf16 (the model's
own projections, conv, gate and norm) plus the residual: the program is checked against the
model's definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..blocks.gemv import GemvConfig
from ..blocks.kda import KDABlock, KDAConfig
from .mhc_site import MHCSiteFields, add_collapse, add_post, partial_output, site_inputs, site_weights
from .mhc_site import reference as site_reference
from .mlp_stack import gemv_block
from .program import Program

GEMV_K_GROUP = 256          # a GEMV's K in multiples of 32 lanes x 8 bf16


@dataclass(frozen=True)
class KDALayerConfig(MHCSiteFields):
    heads: int                           # this GPU's KDA heads (Kimi K3 TP8: 12, GLM-5.3 TP8: 8)
    batch: int = 1
    tokens: int = 1                      # T per sequence
    head_dim: int = 128
    hidden: int = 7168                   # Kimi K3 7168, GLM-5.3 6144
    gate_rank: int = 0                   # rank of f_a / f_b (and g_a / g_b); 0 = head_dim
    output_gate_full_rank: bool = True   # Kimi K3's g_proj; GLM-5.3: g_a / g_b
    gate_kind: str = "sigmoid"
    gate_lower_bound: float = -5.0
    conv_kernel: int = 4
    conv_w_dtype: str = "bf16"           # GLM-5.3 keeps the conv weight fp32
    eps: float = 1e-6                    # the model's norm_eps: the input and the output norms
    state_dtype: str = "fp32"
    num_sms: int = 132
    resid_in_place: bool = False         # plain residual: x += o_proj(o) (bf16, in place) instead of resid
    partial_out: bool = False            # with resid_in_place, tensor parallel: the last GEMV writes this
                                         # rank's partial (bf16 `partial`, no residual); the model's
                                         # all-reduce adds the ranks' partials onto x (tp_model.py)
    x_gemv_rows: int = 32                # rows per tile of the GEMVs that read x, cut alike: they run
                                         # side by side (0: each balanced as if alone - K3 TP8's qkv
                                         # then took 96 SMs and the gate the other 36; H200: B=1 52.0
                                         # vs 56.0 us, B=8 84.4 vs 98.9, GLM-5.3 34.1 / 50.7 vs 36.2 / 61.3)

    @property
    def site(self):
        """The mHC site around the sublayer (sdk/megakernel/mhc_site.py), or None (plain residual)."""
        from .mhc_site import site_of
        return site_of(self, "KDA layer", self.tokens_total, self.eps)

    @property
    def rank(self) -> int:
        return self.gate_rank or self.head_dim

    @property
    def rank_padded(self) -> int:
        return -(-self.rank // GEMV_K_GROUP) * GEMV_K_GROUP

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim

    @property
    def bfa_width(self) -> int:
        """P: columns of bf_a (beta logits, then f_a), a multiple of GEMV_K_GROUP."""
        return -(-(self.heads + self.rank) // GEMV_K_GROUP) * GEMV_K_GROUP

    @property
    def tokens_total(self) -> int:
        return self.batch * self.tokens

    @property
    def spec(self):
        """The KDASpec the sublayer computes (what `reference()` runs KDAReference with)."""
        from ..spec import KDASpec
        return KDASpec(num_heads=self.heads, head_dim=self.head_dim, conv_kernel=self.conv_kernel,
                       gate_kind=self.gate_kind, gate_lower_bound=self.gate_lower_bound, a_log_flat=True,
                       gate_rank=self.gate_rank, output_gate_full_rank=self.output_gate_full_rank)

    @property
    def kda(self) -> KDAConfig:
        """The KDA op: conv and gated output norm fused (whole heads per tile)."""
        return KDAConfig(batch=self.batch, heads=self.heads, head_dim=self.head_dim, tokens=self.tokens,
                         state_dtype=self.state_dtype, gate_kind=self.gate_kind,
                         gate_lower_bound=self.gate_lower_bound, conv=True, conv_kernel=self.conv_kernel,
                         conv_w_dtype=self.conv_w_dtype, out_norm=True, norm_eps=self.eps,
                         beta_width=self.bfa_width)

    def weight_shapes(self) -> dict[str, tuple[tuple, str]]:
        """Program weight name -> (shape, dtype)."""
        D, C, H, K, r, P = self.hidden, self.channels, self.heads, self.head_dim, self.rank_padded, self.bfa_width
        w = {"input_norm": ((D,), "fp32" if self.mhc else "bf16"), "w_qkv": ((3 * C, D), "bf16"), "w_bf_a": ((P, D), "bf16"),
             "w_f_b": ((C, P), "bf16"),
             "conv_w": ((3 * C, self.conv_kernel), self.conv_w_dtype), "dt_bias": ((C,), "fp32"),
             "a_log": ((H,), "fp32"), "o_norm": ((K,), "bf16"), "w_o": ((D, C), "bf16")}
        if self.output_gate_full_rank:
            w["w_g"] = ((C, D), "bf16")
        else:
            w.update({"w_g_a": ((r, D), "bf16"), "w_g_b": ((C, r), "bf16")})
        if self.site:
            w.update(self.site.weight_shapes())
        return w


def from_spec(a, hidden: int, eps: float, batch: int, num_sms: int = 132, **kw) -> KDALayerConfig:
    """The sublayer of a model's KDA layer (a: KDASpec; kw: the site's or resid_in_place). The short
    conv's weight keeps the checkpoint's dtype (KDASpec extra conv_weight_dtype: GLM-5.3's fp32)."""
    return KDALayerConfig(heads=a.num_heads, batch=batch, head_dim=a.head_dim, hidden=hidden, gate_rank=a.gate_rank,
                          output_gate_full_rank=a.output_gate_full_rank, gate_kind=a.gate_kind,
                          gate_lower_bound=a.gate_lower_bound, conv_kernel=a.conv_kernel,
                          conv_w_dtype=dict(a.extra).get("conv_weight_dtype", "bf16"), eps=eps, num_sms=num_sms, **kw)


def build_program(cfg: KDALayerConfig) -> Program:
    D, C, M, r, P = cfg.hidden, cfg.channels, cfg.tokens_total, cfg.rank_padded, cfg.bfa_width
    kda = KDABlock(cfg.kda)
    prog = Program()
    site = cfg.site
    if not site:
        prog.buffer("x", (M, D), "bf16", "input")
    for name, (shape, dtype) in cfg.weight_shapes().items():
        prog.buffer(name, shape, dtype, "weight")
    # mHC: x = the streams' collapse with the input norm fused (mhc_site.py); resid -> y + the post-mix
    x_ops, coef_op = add_collapse(prog, site, site.blocks(), "input_norm", label="kda.") if site else ([], None)
    # the recurrent caches: read and written in place every step
    prog.buffer("conv_state", (cfg.batch, 3 * C, cfg.conv_kernel - 1), "bf16", "input")
    prog.buffer("state", (cfg.batch, cfg.heads, cfg.head_dim, cfg.head_dim), cfg.state_dtype, "input")
    for name, width in (("qkv", 3 * C), ("bf_a", P), ("gate", C), ("g", C)):
        prog.buffer(name, (M, width), "bf16")
    if not cfg.output_gate_full_rank:
        prog.buffer("g_a", (M, r), "bf16")
    prog.buffer("o", (M, C), "bf16")
    if site:
        prog.buffer("y", (M, D), "bf16")
    elif not cfg.resid_in_place:
        prog.buffer("resid", (M, D), "fp32", "output")

    def gemv(n, k, **kw):
        return gemv_block(GemvConfig(n=n, k=k, m=M, norm_eps=cfg.eps, **kw), 0, cfg.num_sms)

    def from_x(n, w, y, label=""):
        blk = gemv_block(GemvConfig(n=n, k=D, m=M, norm=not site, norm_eps=cfg.eps), cfg.x_gemv_rows, cfg.num_sms)
        norm = {} if site else {"norm_weight": "input_norm"}
        return prog.op(blk, {"w": w, "x": "x", **norm, "y": y}, waits=x_ops, label=label)

    qkv = from_x(3 * C, "w_qkv", "qkv", label="kda.qkv")
    bf_a = from_x(P, "w_bf_a", "bf_a", label="kda.beta_f_a")
    if cfg.output_gate_full_rank:
        gate = from_x(C, "w_g", "gate", label="kda.gate")
    else:
        g_a = from_x(r, "w_g_a", "g_a", label="kda.g_a")
        gate = prog.op(gemv(C, r), {"w": "w_g_b", "x": "g_a", "y": "gate"}, waits=[g_a], label="kda.g_b")
    g = prog.op(gemv(C, P), {"w": "w_f_b", "x": "bf_a", "y": "g"}, waits=[bf_a, qkv], label="kda.f_b")
    core = prog.op(kda, {"qkv": "qkv", "conv_state": "conv_state", "conv_w": "conv_w", "g": "g", "dt_bias": "dt_bias",
                         "a_log": "a_log", "beta": "bf_a", "state": "state", "out_gate": "gate", "norm_w": "o_norm",
                         "o": "o"}, waits=[g, gate], label="kda.core")
    if not site:
        # every reader of x is done (the KDA op waits for all of them): o_proj may rewrite it
        if partial_output(prog, cfg, M, D):
            prog.op(gemv(D, C), {"w": "w_o", "x": "o", "y": "partial"}, waits=[core], label="kda.o_proj")
            return prog
        y, out = ("x", "bf16") if cfg.resid_in_place else ("resid", "fp32")
        prog.op(gemv(D, C, out_dtype=out, residual="bf16"), {"w": "w_o", "x": "o", "res": "x", "y": y},
                waits=[core], label="kda.o_proj")
        return prog
    o_proj = prog.op(gemv(D, C), {"w": "w_o", "x": "o", "y": "y"}, waits=[core], label="kda.o_proj")
    add_post(prog, site.blocks(), "y", [o_proj, coef_op], label="kda.")
    return prog


def make_weights(cfg: KDALayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights in the program's names: projections scaled by fan-in^-1/2, gates like a
    trained model's (A_log = log U(1, 16), dt_bias small); bf_a's rows: W_b, W_f_a, zeros (W_f_b's
    columns: zeros under beta, W_f_b, zeros); the low-rank output gate's padding zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, (shape, dtype) in cfg.weight_shapes().items():
        x = torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5
        w[name] = x.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    H, r = cfg.heads, cfg.rank
    w["w_bf_a"][H + r:] = 0
    w["w_f_b"][:, :H] = 0
    w["w_f_b"][:, H + r:] = 0
    w["w_f_b"] *= (cfg.bfa_width / r) ** 0.5              # scaled by the true fan-in
    if "w_g_a" in w:
        w["w_g_a"][r:] = 0
        w["w_g_b"][:, r:] = 0
        w["w_g_b"] *= (cfg.rank_padded / r) ** 0.5
    w["conv_w"] = (0.5 * torch.randn(3 * cfg.channels, cfg.conv_kernel, generator=g, device=device)).to(w["conv_w"].dtype)
    w["dt_bias"] = 0.5 * torch.randn(cfg.channels, generator=g, device=device)
    w["a_log"] = torch.empty(H, device=device).uniform_(1, 16, generator=g).log()
    w["input_norm"] = (1 + 0.1 * torch.randn(cfg.hidden, generator=g, device=device)).to(torch.bfloat16)
    w["o_norm"] = (1 + 0.1 * torch.randn(cfg.head_dim, generator=g, device=device)).to(torch.bfloat16)
    if cfg.site:            # the input norm fp32 (bf16 values: the model's), the site's mix weights
        w["input_norm"] = w["input_norm"].float()
        w.update(site_weights(cfg.site, g, device))
    return w


def weights_from_model(cfg: KDALayerConfig, get) -> dict[str, torch.Tensor]:
    """The program's weights but the input norm from the model's: get(name) -> its weight under
    the HF name (sdk/reference/kda.py). The inverse of `reference`'s mapping: bf_a's rows are
    b_proj | f_a | zeros, f_b's columns zeros | f_b | zeros, the low-rank gate's padding zero."""
    C, H, r, P, D = cfg.channels, cfg.heads, cfg.rank, cfg.bfa_width, cfg.hidden
    f_a = get("forget_gate.f_a_proj.weight")
    zeros = f_a.new_zeros
    w = {"w_qkv": torch.cat([get(n + "_proj.weight") for n in "qkv"]),
         "w_bf_a": torch.cat([get("b_proj.weight").to(f_a.dtype), f_a, zeros(P - H - r, D)]),
         "w_f_b": torch.cat([zeros(C, H), get("forget_gate.f_b_proj.weight").to(f_a.dtype), zeros(C, P - H - r)], 1),
         "conv_w": get("conv1d.weight"), "dt_bias": get("forget_gate.dt_bias"), "a_log": get("forget_gate.A_log"),
         "o_norm": get("o_norm.weight"), "w_o": get("o_proj.weight")}
    if cfg.output_gate_full_rank:
        w["w_g"] = get("g_proj.weight")
    else:
        pad = cfg.rank_padded - r
        g_a, g_b = get("g_a_proj.weight"), get("g_b_proj.weight")
        w["w_g_a"] = torch.cat([g_a, g_a.new_zeros(pad, D)])
        w["w_g_b"] = torch.cat([g_b, g_b.new_zeros(C, pad)], 1)
    return w


def make_inputs(cfg: KDALayerConfig, seed: int = 0, device="cpu", hc_fn=None) -> dict[str, torch.Tensor]:
    """x and the two caches (random: a sequence some steps in); mHC: the streams instead of x, with
    this site's partials of them (`hc_fn`: mhc_site.site_fn) - mhc_site.site_inputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    B, C, H, K = cfg.batch, cfg.channels, cfg.heads, cfg.head_dim
    sdt = torch.float32 if cfg.state_dtype == "fp32" else torch.bfloat16
    out = {"x": torch.randn(cfg.tokens_total, cfg.hidden, generator=g, device=device).to(torch.bfloat16),
           "conv_state": torch.randn(B, 3 * C, cfg.conv_kernel - 1, generator=g, device=device).to(torch.bfloat16),
           "state": (0.1 * torch.randn(B, H, K, K, generator=g, device=device)).to(sdt)}
    if cfg.site:
        del out["x"]
        out.update(site_inputs(cfg.site, g, hc_fn, device))
    return out


def reference(cfg: KDALayerConfig, weights: dict, inputs: dict, hc_fn=None) -> dict[str, torch.Tensor]:
    """{resid [M, D] fp32, conv_state, state [B, H, K, K] fp32}: x + KDAReference.forward(bf16(
    rmsnorm(x) * input_norm)) with the checkpoint's weights in bf16 (the model's dtype; the conv
    in the conv weight's), the caches updated as the model updates them. mHC: {streams, coef,
    part_next, caches} - the model's residual around it (mhc_site.reference, this site's fn `hc_fn`)."""
    from ..reference.common import rms_norm
    from ..reference.kda import KDAReference
    C, H, r = cfg.channels, cfg.heads, cfg.rank
    w = weights
    q, k, v = w["w_qkv"].split(C)
    hf = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v,
          "conv1d.weight": w["conv_w"].view(3 * C, 1, cfg.conv_kernel),
          "forget_gate.f_a_proj.weight": w["w_bf_a"][H:H + r], "forget_gate.f_b_proj.weight": w["w_f_b"][:, H:H + r],
          "forget_gate.dt_bias": w["dt_bias"], "forget_gate.A_log": w["a_log"], "b_proj.weight": w["w_bf_a"][:H],
          "o_norm.weight": w["o_norm"], "o_proj.weight": w["w_o"]}
    if cfg.output_gate_full_rank:
        hf["g_proj.weight"] = w["w_g"]
    else:
        hf.update({"g_a_proj.weight": w["w_g_a"][:r], "g_b_proj.weight": w["w_g_b"][:, :r]})
    model = SimpleNamespace(norm_eps=cfg.eps, hidden_size=cfg.hidden)
    ref = KDAReference(model, SimpleNamespace(attention=cfg.spec), hf)
    cache = {"conv": inputs["conv_state"].clone(), "state": inputs["state"].float().clone()}
    B, T, D = cfg.batch, cfg.tokens, cfg.hidden
    if cfg.site:
        res = site_reference(cfg.site, w, inputs, hc_fn, w["input_norm"],
                             lambda h: ref.forward(h.view(B, T, D), cache, None).reshape(B * T, D))
    else:
        x = inputs["x"].float()
        h = rms_norm(x, w["input_norm"].float(), cfg.eps).to(torch.bfloat16)
        out = ref.forward(h.view(B, T, D), cache, None)
        res = {"resid": x + out.float().reshape(cfg.tokens_total, cfg.hidden)}
    return {**res, "conv_state": cache["conv"], "state": cache["state"]}
