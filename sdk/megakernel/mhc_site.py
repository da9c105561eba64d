"""One mHC site around a sublayer program (docs/mhc.md): the two ends a sublayer gains when the
model's residual is mHC (DeepSeek-V4(.1), GLM-5.3) - the streams in, the sublayer's normed input
from their collapse, the streams updated in place from the sublayer's output:

    v4  (transformers' V4, GLM-5.3):  hc_pre  = the pre from `part`, then the collapse with it
                                                and the sublayer's norm               -> x
                                      hc_coef = all the coefficients (the Sinkhorn), beside the
                                                collapse and the sublayer             -> coef
                                      (split_coef False: one hc_pre op for both, the Sinkhorn
                                      on the sublayer's path                          -> x, coef)
    v41 (V4.1's lagged pre-mix):      hc_in   = the collapse with `carried`'s pre + the norm -> x
                                      hc_coef = this site's coefficients (beside the sublayer) -> coef
    both:  ... the sublayer: x -> y ...
           hc_post = X'_n = post_n y + sum_j comb[j, n] X_j in place, fused with the NEXT site's
                     mix partials (hc_fn_next)                                        -> part_next

Buffers: inputs `streams` [M, N, D] bf16 (rewritten in place), `part` [S, M, R+1] (this site's
partials: the previous post's part_next), v41 `carried` [M, R] (the previous site's coef);
outputs `coef` [M, R] (this site's: the post's, and V4.1's next site's carried), `part_next`.
Weights: `hc_base` [R], `hc_scale` [3], `hc_fn_next` [R, N*D] fp32 and the sublayer's norm weight
as fp32 (bf16 values). The sublayer's ops that read x wait for `x_ops`; the post waits for the
sublayer's last op and the coefficients (it rewrites the streams they read).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

KINDS = ("v4", "v41")


@dataclass(frozen=True, kw_only=True)
class MHCSiteFields:
    """The mHC fields of a sublayer config (DSV4LayerConfig, MoELayerConfig, KDALayerConfig inherit
    them; keyword-only), which `site_of` turns into its MHCSite."""
    mhc: str = ""                # the residual around the sublayer: "" plain (x in, the sublayer's
                                 # residual out); "v4" mHC (streams in and out, the input = the
                                 # collapse with this site's pre); "v41" V4.1's lagged mHC (the
                                 # collapse with the previous site's pre `carried`, its own op; the
                                 # coefficients beside the sublayer)
    hc_mult: int = 4
    hc_iters: int = 20           # Sinkhorn iterations
    hc_eps: float = 1e-6
    hc_d_slice: int = 128        # D columns per tile of the post-mix
    hc_last: bool = False        # the model's last site (no next site's partials)
    hc_head_rows: int = 0        # the last site: the head fn's rows whose partials it computes
    hc_split_coef: bool = True   # v4: the coefficients in an op of their own beside the collapse


@dataclass(frozen=True)
class MHCSite:
    kind: str                    # "v4" | "v41"
    hidden: int
    tokens: int                  # M = batch x tokens per sequence
    hc_mult: int = 4
    iters: int = 20              # Sinkhorn iterations
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6       # the mix's RMSNorm and the sublayer's norm (the model's norm_eps)
    d_slice: int = 128           # D columns per post-mix tile
    last: bool = False           # the model's last site: no next site - its post-mix computes the
                                 # head's partials (head_rows > 0: V4's weighted head, its fn as
                                 # hc_fn_next) or none (V4.1's carried head, GLM-5.3's mean head)
    head_rows: int = 0
    split_coef: bool = True      # v4: hc_pre computes only its pre (sigmoid) for the collapse, and
                                 # hc_coef - on another SM, beside the collapse and the sublayer - all
                                 # the coefficients: the Sinkhorn (20 dependent iterations, ~2 us)
                                 # leaves the sublayer's path, as in V4.1's site. Identical values.

    @property
    def next_rows(self) -> int:
        """Rows of the next fn whose partials the post-mix computes (0: none)."""
        return self.head_rows if self.last else self.rows

    @property
    def slices(self) -> int:
        return self.hidden // self.d_slice

    @property
    def rows(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def blocks(self) -> dict:
        from ..blocks.mhc import MHCPostBlock, MHCPostConfig, MHCPreBlock, MHCPreConfig
        from ..errors import UnsupportedConfigError
        if self.kind not in KINDS:
            raise UnsupportedConfigError(f"mHC site: kind {self.kind!r} (supported: {', '.join(KINDS)})")
        common = dict(d=self.hidden, n=self.hc_mult, m=self.tokens, stream_dtype="bf16")
        pre = dict(common, slices=self.slices, iters=self.iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps,
                   out_eps=self.norm_eps, out_dtype="bf16")
        post = MHCPostBlock(MHCPostConfig(**common, d_slice=self.d_slice, next_rows=self.next_rows,
                                          round_coef=self.kind == "v4"))
        if self.kind == "v4" and not self.split_coef:
            return {"hc_pre": MHCPreBlock(MHCPreConfig(**pre)), "hc_post": post}
        if self.kind == "v4":
            return {"hc_pre": MHCPreBlock(MHCPreConfig(**pre, write_coef=False)),
                    "hc_coef": MHCPreBlock(MHCPreConfig(**pre, collapse=False)), "hc_post": post}
        return {"hc_in": MHCPreBlock(MHCPreConfig(**pre, kind="carried")),
                "hc_coef": MHCPreBlock(MHCPreConfig(**pre, collapse=False)), "hc_post": post}

    def weight_shapes(self) -> dict:
        """This site's mix bias / scales and the NEXT site's fn (the post's partials)."""
        out = {"hc_base": ((self.rows,), "fp32"), "hc_scale": ((3,), "fp32")}
        if self.next_rows:
            out["hc_fn_next"] = ((self.next_rows, self.hc_mult * self.hidden), "fp32")
        return out

    def buffer_shapes(self) -> dict:
        """name -> (shape, dtype, role): what a call reads beside the weights and what it writes."""
        M, R = self.tokens, self.rows
        out = {"streams": ((M, self.hc_mult, self.hidden), "bf16", "input"),
               "part": ((self.slices, M, R + 1), "fp32", "input")}
        if self.kind == "v41":
            out["carried"] = ((M, R), "fp32", "input")
        out["coef"] = ((M, R), "fp32", "output")
        if self.next_rows:
            out["part_next"] = ((self.slices, M, self.next_rows + 1), "fp32", "output")
        return out


def site_of(cfg, layer: str, tokens: int, norm_eps: float) -> MHCSite | None:
    """The site of a sublayer config with the fields mhc, hidden, hc_mult, hc_iters, hc_eps,
    hc_d_slice, hc_last, hc_head_rows (DSV4LayerConfig, MoELayerConfig, KDALayerConfig), or None
    where mhc is "" (the plain residual); `layer` names it in the error."""
    from ..errors import UnsupportedConfigError
    if not cfg.mhc:
        return None
    if getattr(cfg, "resid_in_place", False):
        raise UnsupportedConfigError(f"{layer}: resid_in_place is the plain residual's chain; mhc={cfg.mhc!r} "
                                     "sites update the streams instead")
    if cfg.mhc not in KINDS:
        raise UnsupportedConfigError(f"{layer}: mhc {cfg.mhc!r} (supported: '', {', '.join(KINDS)})")
    return MHCSite(cfg.mhc, cfg.hidden, tokens, cfg.hc_mult, cfg.hc_iters, cfg.hc_eps, norm_eps, cfg.hc_d_slice,
                   cfg.hc_last, cfg.hc_head_rows, cfg.hc_split_coef)


def partial_output(prog, cfg, tokens: int, hidden: int) -> bool:
    """Whether a plain-residual sublayer (`resid_in_place`) ends in a tensor-parallel partial
    (`partial_out`): then its `partial` [tokens, hidden] bf16 buffer is declared here, for the last
    GEMV to write without the residual (sdk/megakernel/tp_model.py all-reduces it onto x)."""
    from ..errors import UnsupportedConfigError
    if not getattr(cfg, "partial_out", False):
        return False
    if not cfg.resid_in_place:
        raise UnsupportedConfigError(f"{type(cfg).__name__}: partial_out is the plain residual chain's "
                                     "tensor-parallel form; set resid_in_place too")
    prog.buffer("partial", (tokens, hidden), "bf16")
    return True


def add_collapse(prog, site: MHCSite, b: dict, norm_weight: str, x: str = "x", label: str = "") -> tuple:
    """The site's buffers and its first op(s): `x` [M, D] bf16 = the collapse, normed with the fp32
    weight `norm_weight`. Returns (x_ops: what x's readers wait for, the op writing coef)."""
    for name, (shape, dtype, role) in site.buffer_shapes().items():
        prog.buffer(name, shape, dtype, role)
    prog.buffer(x, (site.tokens, site.hidden), "bf16")
    mix = {"streams": "streams", "part": "part", "base": "hc_base", "scale": "hc_scale"}
    if site.kind == "v4":
        coef = {} if "hc_coef" in b else {"coef": "coef"}
        pre = prog.op(b["hc_pre"], {**mix, "norm_weight": norm_weight, **coef, "out": x}, label=label + "hc_pre")
        if not coef:
            return [pre], prog.op(b["hc_coef"], {**mix, "coef": "coef"}, label=label + "hc_coef")
        return [pre], pre
    hin = prog.op(b["hc_in"], {"streams": "streams", "carried": "carried", "norm_weight": norm_weight, "out": x},
                  label=label + "hc_in")
    coef = prog.op(b["hc_coef"], {**mix, "coef": "coef"}, label=label + "hc_coef")
    return [hin], coef


def add_post(prog, b: dict, y: str, waits: list, label: str = "") -> int:
    """The streams' update from the sublayer's output `y`, fused with the next site's partials
    (but at the last site); `waits`: the op writing y and the one writing coef (the streams' last
    readers)."""
    nxt = {"fn_next": "hc_fn_next", "part_next": "part_next"} if b["hc_post"].config.next_rows else {}
    return prog.op(b["hc_post"], {"streams": "streams", "y": y, "coef": "coef", "streams_out": "streams", **nxt},
                   waits=waits, label=label + "hc_post")


def site_weights(site: MHCSite, g: torch.Generator, device="cpu") -> dict:
    """Random hc_base / hc_scale / hc_fn_next (the scales of tests/test_mhc_block.py)."""
    r = lambda *s: torch.randn(*s, generator=g, device=device)
    out = {"hc_base": 0.5 * r(site.rows), "hc_scale": 1 + 0.3 * r(3)}
    if site.next_rows:
        out["hc_fn_next"] = r(site.next_rows, site.hc_mult * site.hidden) * (site.hc_mult * site.hidden) ** -0.5
    return out


def site_fn(site: MHCSite, seed: int = 0, device="cpu") -> torch.Tensor:
    """A random fn of THIS site: the program never reads it (its partials come in `part`);
    site_inputs computes them with it and `reference` takes it for the coefficients."""
    g = torch.Generator(device=device).manual_seed(seed)
    n = site.hc_mult * site.hidden
    return torch.randn(site.rows, n, generator=g, device=device) * n ** -0.5


def site_inputs(site: MHCSite, g: torch.Generator, hc_fn: torch.Tensor, device="cpu") -> dict:
    """Random streams, this site's partials of them with `hc_fn` and, v41, a previous site's coef
    (its pre in (0.05, 0.95))."""
    from ..blocks.mhc import slice_partials
    M, n, D, ds = site.tokens, site.hc_mult, site.hidden, site.d_slice
    streams = torch.randn(M, n, D, generator=g, device=device).to(torch.bfloat16)
    out = {"streams": streams,
           "part": torch.stack([slice_partials(streams, hc_fn, n, D, s * ds, (s + 1) * ds) for s in range(site.slices)])}
    if site.kind == "v41":
        out["carried"] = 0.05 + 0.9 * torch.rand(M, site.rows, generator=g, device=device)
    return out


def reference(site: MHCSite, weights: dict, inputs: dict, hc_fn: torch.Tensor, norm_weight: torch.Tensor,
              sublayer) -> dict:
    """{streams, coef, part_next}: the model's residual (sdk/reference/mhc.py MHCResidual.around;
    V4.1's lagged form for v41, with `carried`'s pre) around sublayer(rms_norm(input, norm_weight))
    - sublayer: bf16 [M, D] -> [M, D] - with this site's fn `hc_fn`."""
    from ..blocks.mhc import slice_partials
    from ..reference.common import rms_norm
    from ..reference.mhc import MHCResidual
    from ..spec import ResidualSpec
    if hc_fn is None:
        raise ValueError("mHC site reference: needs this site's fn (hc_fn, site_fn)")
    M, n, D, ds = site.tokens, site.hc_mult, site.hidden, site.d_slice
    lagged = site.kind == "v41"
    model = SimpleNamespace(norm_eps=site.norm_eps, residual=ResidualSpec(
        kind="mhc", hc_mult=n, sinkhorn_iters=site.iters, eps=site.hc_eps, head="carried" if lagged else "mean",
        lagged_pre=lagged))
    p = "layers.0.hc_attn."
    w = weights
    mres = MHCResidual(model, {p + "fn": hc_fn.float(), p + "base": w["hc_base"], p + "scale": w["hc_scale"]})
    streams = inputs["streams"].view(M, 1, n, D)
    if lagged:
        mres.carried = inputs["carried"][:, :n].float().view(M, 1, n)
    pre, post, comb = mres.coefficients(p, streams)
    norm = norm_weight.to(torch.bfloat16)
    new = mres.around(0, "attn", streams, lambda y: sublayer(rms_norm(y[:, 0], norm, site.norm_eps))[:, None])
    new = new.reshape(M, n, D)
    out = {"streams": new, "coef": torch.cat([pre, post, comb.flatten(-2)], -1).reshape(M, -1)}
    if site.next_rows:
        out["part_next"] = torch.stack([slice_partials(new, w["hc_fn_next"], n, D, s * ds, (s + 1) * ds)
                                        for s in range(site.slices)])
    return out
