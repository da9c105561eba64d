"""A whole MLA attention sublayer of one GPU's head shard in ONE megakernel launch: the input
RMSNorm, the q / kv projections with their norms, RoPE and the cache append, the absorbed
split-KV attention and the output projection with the residual add.

    x (bf16, the residual stream entering the sublayer)
    q_a   = GEMV(rmsnorm(x) * input_norm, W_qa)              \\  both read x; the norm is fused
    ckv   = GEMV(rmsnorm(x) * input_norm, W_kva)   (fp32)     /  into each GEMV's prologue
    q_raw = GEMV(rmsnorm(q_a) * q_a_norm, W_qb)               [M, H, nope + rope]
    rope_append: q[..., L:] = rope(q_raw[..., nope:]);  cache row of each new token =
                 [kv_a_norm * rmsnorm(ckv[:L]), rope(ckv[L:])]           (waits ckv and q_raw)
    W_UK:        q[..., :L] = q_raw[..., :nope] @ W_UK                   (waits q_raw)
    decode -> combine -> W_UV                                            (sdk/megakernel/mla_attention.py)
    resid = x + o @ W_o^T        (fp32; the o_proj GEMV's residual epilogue)
          | x += o @ W_o^T       (`resid_in_place`: a plain-residual model's chain, bf16 in place -
                                  the hidden state the next sublayer reads; sdk/megakernel/plain_model.py)

Ops wait only for what they read, so the q and kv branches and the GEMVs stream their weights
concurrently. `reference()` is sdk/reference/mla.py's MLAReference.forward (expanded keys and
values, its own RoPE and norms) on the same cache, plus the residual: the program is checked
against the model's definition, not against its own pieces.

In an mHC residual (`mhc` "v4" / "v41": GLM-5.3's DSA layers; sdk/megakernel/mhc_site.py) the
streams come in instead of x: x = the collapse normed with the fp32 input_norm (its own op), the
GEMVs read it as it is (no fused norm) and wait for it, o_proj writes y and the post-mix updates
the streams (fused with the next site's partials).

RoPE scaling (YaRN, DeepSeek-V3 style) needs no device code: the host's cos / sin tables
(`rope_tables`) come from the reference's rope_cos_sin (YaRN frequencies, times its attention
factor) and the decode's scale is the reference's mla_softmax_scale (times mscale ** 2), both
read off `MLALayerConfig.spec`, the MLASpec that `reference()` runs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.gemv import GemvConfig
from ..blocks.mla_prologue import MLARopeAppendBlock, MLARopeAppendConfig
from . import mla_attention as mla
from .mhc_site import MHCSiteFields, add_collapse, add_post, partial_output
from .mlp_stack import gemv_block
from .program import Program, first_fitting


@dataclass(frozen=True)
class MLALayerConfig(MHCSiteFields):
    # the shard's heads, cache geometry, batch, splits; softmax_scale * scale_factor is the base
    # scale, before YaRN's mscale ** 2 (see `decode_attn`)
    attn: mla.MLAAttentionConfig
    hidden: int = 7168
    q_lora: int = 1536
    rope_theta: float = 50000.0
    rope_mode: str = "interleaved"      # MLARopeAppendConfig.rope_mode
    eps: float = 1e-6                   # the q_a / kv_a norms' (MLASpec.latent_norm_eps)
    input_eps: float = 0.0              # the input norm's (the model's norm_eps; Kimi K3 1e-5); 0: eps
    resid_in_place: bool = False        # x += o_proj(o) (bf16, in place) instead of resid (fp32)
    partial_out: bool = False            # with resid_in_place, tensor parallel: the last GEMV writes this
                                         # rank's partial (bf16 `partial`, no residual); the model's
                                         # all-reduce adds the ranks' partials onto x (tp_model.py)
    rope_scaling: tuple = ()            # RopeSpec.scaling: sorted (key, value) pairs of the HF rope_parameters
    gemv_rows: int = 0                  # rows per tile of every projection (0: build_program's choice)

    def __post_init__(self):
        from ..errors import UnsupportedConfigError
        from ..reference.mla import MLAReference
        if self.rope_scaling and self.rope is None:
            raise UnsupportedConfigError(f"MLA layer: rope_scaling {dict(self.rope_scaling)} without rope "
                                         f"(rope_mode={self.rope_mode!r}, rope={self.attn.rope})")
        MLAReference.check(self.spec)   # an unsupported rope type fails here, naming it

    @property
    def x_eps(self) -> float:
        return self.input_eps or self.eps

    @property
    def site(self):
        """The mHC site around the sublayer (sdk/megakernel/mhc_site.py), or None (plain residual)."""
        from .mhc_site import site_of
        return site_of(self, "MLA layer", self.attn.tokens, self.x_eps)

    @property
    def q_width(self) -> int:
        return self.attn.nope + self.attn.rope

    @property
    def rope(self):
        """The RopeSpec of q_pe and k_pe; None for NoPE (rope_mode "none" or no rope columns)."""
        from ..spec import RopeSpec
        if self.rope_mode == "none" or not self.attn.rope:
            return None
        return RopeSpec(dim=self.attn.rope, theta=self.rope_theta, interleaved=self.rope_mode == "interleaved",
                        scaling=self.rope_scaling)

    @property
    def spec(self):
        """The MLASpec the sublayer computes (what `reference()` runs MLAReference with)."""
        from ..spec import MLASpec
        a = self.attn
        return MLASpec(num_heads=a.heads, q_lora_rank=self.q_lora, kv_lora_rank=a.kv_lora, qk_nope_head_dim=a.nope,
                       qk_rope_head_dim=a.rope, v_head_dim=a.v, softmax_scale=a.softmax_scale * a.scale_factor,
                       rope=self.rope, latent_norm_eps=self.eps)

    @property
    def decode_attn(self) -> mla.MLAAttentionConfig:
        """`attn` with the reference's whole softmax scale (mla_softmax_scale: YaRN's mscale ** 2
        included) folded into softmax_scale, scale_factor 1: the decode computes the very number
        MLAReference multiplies its logits by."""
        from ..reference.mla import mla_softmax_scale
        return replace(self.attn, softmax_scale=mla_softmax_scale(self.spec), scale_factor=1.0)


# rows per tile of the projections when their balanced tiles leave no room: batch 8 at Kimi K3
# TP8 cut o_proj into 56-row tiles (29.6 KB ring stages) beside 57 KB of staged activations and the
# decode's 98 KB (measured: the B=8 sublayer bench refused to build)
FALLBACK_GEMV_ROWS = 16
# weight-ring stages worth a shallower decode pipeline: Kimi K3 TP8 at batch 1 (32K) took 3 decode
# stages (137 KB) and left the ring 2 x 29.6 KB - 2 x 16.6 KB of q_a / kv_a in flight; 2 decode
# stages and a 3-stage ring: 59.4 -> 56.9 us on the H200 (2026-12-04). (16-row projection tiles
# for a 4-6 stage ring instead measured 63.7 us: more, smaller tiles.)
RING_STAGES_WANTED = 3
# decode tokens per pipeline stage when 32 leaves the ring no room: 32-row decode tiles (row groups:
# 96 heads, or 12 heads x 3-4 speculative tokens) at batch 3+ take 125 KB at 2 stages of 32 tokens,
# 88 KB at 16, beside 64+ KB of staged activations (not yet measured on a GPU)
FALLBACK_DECODE_CHUNK = 16


def build_program(cfg: MLALayerConfig, builder=None) -> Program:
    """The sublayer's program with the projections' balanced tiles, else (no room) with
    FALLBACK_GEMV_ROWS-row tiles (smaller ring stages); with the deepest decode pipeline
    (attn.decode_stages down to 2) that leaves their weight ring RING_STAGES_WANTED stages of
    shared memory, else the deepest that leaves it 2; else, with the decode chunk left to the
    builder, all that again over FALLBACK_DECODE_CHUNK-token chunks, then with 16-row decode tiles
    (half the query smem; more row groups); else the ring's error.
    builder(cfg, gemv_rows) -> Program: `_build` unless given (sdk/megakernel/dsa_layer.py passes
    one that adds the DSA indexer)."""
    from ..errors import UnsupportedConfigError
    build = builder or _build
    err = None
    # (decode chunk, rows a decode tile): the builder's, then 16-token chunks, then 16-row tiles
    shapes = (((cfg.attn.decode_chunk, cfg.attn.decode_max_rows),) if cfg.attn.decode_chunk else
              ((0, cfg.attn.decode_max_rows), (FALLBACK_DECODE_CHUNK, cfg.attn.decode_max_rows),
               (FALLBACK_DECODE_CHUNK, 16)))
    for chunk, max_rows in shapes:
        attn = replace(cfg.attn, decode_chunk=chunk, decode_max_rows=max_rows)
        for rows in ((cfg.gemv_rows,) if cfg.gemv_rows else (0, FALLBACK_GEMV_ROWS)):
            try:
                return first_fitting((lambda st=st: build(replace(cfg, attn=replace(attn, decode_stages=st)), rows)
                                      for st in range(cfg.attn.decode_stages, 1, -1)), (RING_STAGES_WANTED, 2))
            except UnsupportedConfigError as exc:
                err = exc
    raise err


def _build(cfg: MLALayerConfig, gemv_rows: int = 0, extend=None) -> Program:
    """gemv_rows: rows per tile of every projection (0: balanced over the SMs). extend (DSA,
    sdk/megakernel/dsa_layer.py): extend(prog, dec, ops, gemv, from_x) -> (decode block, decode
    waits), called before the attention core with the ops so far {"q_a", "kv_a", "q_b",
    "rope_append", "w_uk"}, the GEMV block factory and from_x(n, w, y, label, **gemv kw) -> op:
    a GEMV reading x (its norm fused, or the mHC collapse waited for)."""
    a, D = cfg.decode_attn, cfg.hidden
    H, L, M = a.heads, a.kv_lora, a.tokens
    site = cfg.site
    prog = Program()
    if not site:
        prog.buffer("x", (M, D), "bf16", "input")
    prog.buffer("cos", (M, max(a.rope, 1)), "bf16", "input")
    prog.buffer("sin", (M, max(a.rope, 1)), "bf16", "input")
    dec = mla.add_cache_inputs(prog, a)           # the new tokens' rows are written into the cache
    prog.buffer("input_norm", (D,), "fp32" if site else "bf16", "weight")
    for name, shape in (("q_a_proj", (cfg.q_lora, D)), ("q_a_norm", (cfg.q_lora,)),
                        ("q_b_proj", (H * cfg.q_width, cfg.q_lora)), ("kv_a_proj", (L + a.rope, D)),
                        ("kv_a_norm", (L,)), ("w_uk_t", (H, L, a.nope)), ("o_proj", (D, H * a.v))):
        prog.buffer(name, shape, "bf16", "weight")
    if site:
        for name, (shape, dtype) in site.weight_shapes().items():
            prog.buffer(name, shape, dtype, "weight")
    # mHC: x = the streams' collapse with the input norm (mhc_site.py); o_proj -> y + the post-mix
    x_ops, coef_op = add_collapse(prog, site, site.blocks(), "input_norm", label="attn.") if site else ([], None)
    prog.buffer("q_a", (M, cfg.q_lora), "bf16")
    prog.buffer("ckv", (M, L + a.rope), "fp32")
    prog.buffer("q_raw", (M, H, cfg.q_width), "bf16")
    prog.buffer("q", (a.batch, a.q_tokens, H, a.d_qk), "bf16")
    if site:
        prog.buffer("y", (M, D), "bf16")
    elif not cfg.resid_in_place:
        prog.buffer("resid", (M, D), "fp32", "output")

    def gemv(n, k, eps=cfg.eps, **kw):
        return gemv_block(GemvConfig(n=n, k=k, m=M, norm_eps=eps, **kw), gemv_rows, a.num_sms)

    def from_x(n, w, y, label, **kw):
        """A GEMV of x: the input norm fused (plain), or after the mHC collapse (normed already)."""
        norm = {} if site else {"norm_weight": "input_norm"}
        return prog.op(gemv(n, D, norm=not site, eps=cfg.x_eps, **kw), {"w": w, "x": "x", **norm, "y": y},
                       waits=x_ops, label=label)

    qa = from_x(cfg.q_lora, "q_a_proj", "q_a", "attn.q_a")
    kva = from_x(L + a.rope, "kv_a_proj", "ckv", "attn.kv_a", out_dtype="fp32")
    qb = prog.op(gemv(H * cfg.q_width, cfg.q_lora, norm=True),
                 {"w": "q_b_proj", "x": "q_a", "norm_weight": "q_a_norm", "y": "q_raw"}, waits=[qa], label="attn.q_b")
    rope = MLARopeAppendBlock(MLARopeAppendConfig(
        heads=H, batch=a.batch, q_tokens=a.q_tokens, kv_lora=L, nope=a.nope, rope=a.rope, rope_mode=cfg.rope_mode,
        eps=cfg.eps, page_size=a.page_size, num_pages=a.num_pages, max_seq_len=a.max_seq_len, kv_dtype=a.kv_dtype,
        scale_group=dec.config.scale_group))
    rb = {"q_raw": "q_raw", "ckv": "ckv", "kv_norm": "kv_a_norm", "block_table": "block_table",
          "seq_lens": "seq_lens", "q": "q", "kv": "kv"}
    if rope.rotates:
        rb.update({"cos": "cos", "sin": "sin"})
    if dec.fp8:
        rb["kv_scale"] = "kv_scale"
    ra = prog.op(rope, rb, waits=[kva, qb], label="attn.rope_append")
    uk = prog.op(a.head_proj(L, a.nope, x_stride=cfg.q_width, y_stride=a.d_qk),
                 {"x": "q_raw", "w": "w_uk_t", "y": "q"}, waits=[qb], label="attn.w_uk")
    waits = [ra, uk]
    if extend is not None:
        dec, waits = extend(prog, dec, {"q_a": qa, "kv_a": kva, "q_b": qb, "rope_append": ra, "w_uk": uk}, gemv,
                            from_x)
    uv = mla.add_attention_core(prog, a, dec, waits)
    if site:
        o_proj = prog.op(gemv(D, H * a.v), {"w": "o_proj", "x": "o", "y": "y"}, waits=[uv], label="attn.o_proj")
        add_post(prog, site.blocks(), "y", [o_proj, coef_op], label="attn.")
        return prog
    # every reader of x (q_a, kv_a) is done before W_UV: o_proj may rewrite it in place
    if partial_output(prog, cfg, M, D):
        prog.op(gemv(D, H * a.v), {"w": "o_proj", "x": "o", "y": "partial"}, waits=[uv], label="attn.o_proj")
        return prog
    y, out = ("x", "bf16") if cfg.resid_in_place else ("resid", "fp32")
    prog.op(gemv(D, H * a.v, out_dtype=out, residual="bf16"), {"w": "o_proj", "x": "o", "res": "x", "y": y},
            waits=[uv], label="attn.o_proj")
    return prog


def make_weights(cfg: MLALayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's names (sdk/reference/mla.py) plus the absorbed W_UK /
    W_UV the program reads."""
    a, D = cfg.attn, cfg.hidden
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(torch.bfloat16)

    w = mla.make_weights(a, seed=seed + 7, device=device)
    w.update({"input_norm": norm(D), "q_a_proj": rnd(cfg.q_lora, D), "q_a_norm": norm(cfg.q_lora),
              "q_b_proj": rnd(a.heads * cfg.q_width, cfg.q_lora), "kv_a_proj": rnd(a.kv_lora + a.rope, D),
              "kv_a_norm": norm(a.kv_lora), "o_proj": rnd(D, a.heads * a.v)})
    if cfg.site:            # the input norm fp32 (bf16 values: the model's), the site's mix weights
        from .mhc_site import site_weights
        w["input_norm"] = w["input_norm"].float()
        w.update(site_weights(cfg.site, g, device))
    return w


def weights_from_model(cfg: MLALayerConfig, get) -> dict[str, torch.Tensor]:
    """The program's weights but the input norm from the model's: get(name) -> its weight under
    the HF name (sdk/reference/mla.py); W_UK / W_UV absorbed from kv_b_proj (absorb_weights)."""
    from ..blocks.mla_decode import absorb_weights
    a = cfg.attn
    w_uk_t, w_uv = absorb_weights(get("kv_b_proj.weight"), a.heads, a.nope, a.v)
    return {"q_a_proj": get("q_a_proj.weight"), "q_a_norm": get("q_a_layernorm.weight"),
            "q_b_proj": get("q_b_proj.weight"), "kv_a_proj": get("kv_a_proj_with_mqa.weight"),
            "kv_a_norm": get("kv_a_layernorm.weight"), "w_uk_t": w_uk_t, "w_uv": w_uv, "o_proj": get("o_proj.weight")}


def rope_tables(cfg: MLALayerConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [M, rope] bf16 of the new tokens' positions [B, T] (the host's per-step tables):
    the reference's rope_cos_sin of the layer's rope (YaRN included). NoPE: the identity rotation
    [M, max(rope, 1)], which the prologue does not read."""
    from ..reference.common import rope_cos_sin
    rope = cfg.rope
    if rope is None:
        shape = (positions.numel(), max(cfg.attn.rope, 1))
        return (torch.ones(shape, dtype=torch.bfloat16, device=positions.device),
                torch.zeros(shape, dtype=torch.bfloat16, device=positions.device))
    cos, sin = rope_cos_sin(rope, positions, torch.bfloat16)
    return cos.reshape(-1, rope.dim), sin.reshape(-1, rope.dim)


def make_inputs(cfg: MLALayerConfig, lens, seed: int = 0, device="cpu", hc_fn=None) -> dict[str, torch.Tensor]:
    """x, the cache (random rows for the tokens before the new ones), table, lengths, cos / sin;
    mHC: the streams instead of x, with this site's partials of them (`hc_fn`: mhc_site.site_fn)."""
    a = cfg.attn
    base = mla.make_inputs(a, lens, seed=seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    lens_t = base["seq_lens"].long()
    positions = lens_t[:, None] - a.q_tokens + torch.arange(a.q_tokens, device=device)
    cos, sin = rope_tables(cfg, positions)
    out = {"x": torch.randn(a.tokens, cfg.hidden, generator=g, device=device).to(torch.bfloat16),
           "kv": base["kv"], "block_table": base["block_table"], "seq_lens": base["seq_lens"], "cos": cos, "sin": sin}
    if "kv_scale" in base:
        out["kv_scale"] = base["kv_scale"]
    if cfg.site:
        from .mhc_site import site_inputs
        del out["x"]
        out.update(site_inputs(cfg.site, g, hc_fn, device))
    return out


def stored_rows(cfg: MLALayerConfig, tensors: dict) -> torch.Tensor:
    """The new tokens' rows as a cache holds them (positions len - T .. len - 1 of each sequence;
    fp8: dequantised): [B, T, d_qk] fp32."""
    dec = mla.decode_block(cfg.attn)
    lens = [int(x) for x in tensors["seq_lens"]]
    return torch.stack([dec.gather_kv(tensors, b, n - cfg.attn.q_tokens, n) for b, n in enumerate(lens)])


def reference(cfg: MLALayerConfig, weights: dict, inputs: dict, stored: dict | None = None,
              with_rows: bool = False, hc_fn=None):
    """x + MLAReference.forward(rmsnorm(x) * input_norm) over the cache's earlier rows (fp32):
    resid [M, D]; mHC: {streams, coef, part_next} - the model's residual around it
    (mhc_site.reference, this site's fn `hc_fn`). The new tokens' rows are the reference's own, in the cache's format - or, with
    `stored` (a runtime's tensors after its launch), read back from the cache that launch wrote
    (`stored_rows`): an fp8 row's e4m3 rounding follows the device's bf16 projections, and a 1-ulp
    difference there moves an element by a whole e4m3 step, so the attention core is compared over
    the same rows. with_rows: returns (resid, the reference's own new rows [B, T, d_qk] fp32)."""
    from types import SimpleNamespace

    from ..reference.common import StepInfo, rms_norm
    from ..reference.mla import MLAReference
    a = cfg.attn
    f = {k: v.float() for k, v in weights.items()}
    ref = MLAReference(None, SimpleNamespace(attention=cfg.spec), {
        "q_a_proj.weight": f["q_a_proj"], "q_a_layernorm.weight": f["q_a_norm"], "q_b_proj.weight": f["q_b_proj"],
        "kv_a_proj_with_mqa.weight": f["kv_a_proj"], "kv_a_layernorm.weight": f["kv_a_norm"],
        "kv_b_proj.weight": f["kv_b_proj"], "o_proj.weight": f["o_proj"]})
    dec = mla.decode_block(a)
    lens = [int(x) for x in inputs["seq_lens"]]
    dev = inputs["seq_lens"].device
    dense = torch.zeros(a.batch, max(lens), a.d_qk, device=dev)
    for b, n in enumerate(lens):                 # the rows before the new tokens
        if n > a.q_tokens:
            dense[b, :n - a.q_tokens] = dec.gather_kv(inputs, b, 0, n - a.q_tokens).to(dev)
    start = torch.tensor(lens, device=dev) - a.q_tokens
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(a.q_tokens, device=dev),
                    input_ids=torch.zeros(a.batch, a.q_tokens, dtype=torch.long, device=dev))
    own = []

    def sublayer(h):
        """MLAReference.forward on the normed input h, with the new rows stored in the cache's
        format (bf16, or the fp8 row's value bf16(e4m3 * scale), what the decode core reads back)."""
        h = h.float().view(a.batch, a.q_tokens, cfg.hidden)
        q_nope, q_pe, _ = ref.project_q(h, step)
        rows = ref.project_kv(h, step).to(torch.bfloat16)
        if dec.fp8:
            from ..blocks.mla_decode import quantize_kv_fp8
            q8, sc = quantize_kv_fp8(rows.float(), dec.config.scale_group)
            rows = (q8.float() * sc.repeat_interleave(dec.config.scale_group, dim=-1)).to(torch.bfloat16)
        own.append(rows.float())
        if stored is not None:
            rows = stored_rows(cfg, stored)
        cache = {"latent": dense}
        ref.write_cache(cache, step, rows.float())
        return ref.project_out(h, ref.attend(q_nope, q_pe, cache, step)).reshape(a.tokens, cfg.hidden)

    if cfg.site:
        from .mhc_site import reference as site_reference
        res = site_reference(cfg.site, weights, inputs, hc_fn, weights["input_norm"], sublayer)
    else:
        x = inputs["x"].float()
        res = x + sublayer(rms_norm(x, f["input_norm"], cfg.x_eps))
    return (res, own[0]) if with_rows else res
