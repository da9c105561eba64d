"""A full MoE layer (router -> routed experts -> combine, + shared expert) in ONE megakernel launch.

    logits  = x @ W_router^T                                  GemvBlock (fp32 out; weights through the ring)
    select  : scores, bias, groups, top-k / hash, weights,    RouterSelectBlock  (1 tile)
              dispatch table of this rank's experts
    shared  : act_s = swiglu(x); shared = act_s @ W_down^T    GemvBlock x2       (dense, fp32 out)
    gateup  : act[a] = swiglu_e(x[tok(a)]) for hit experts    ExpertsBlock gateup (I/8 tiles)
    down    : out = shared + sum_a topk_w[a] * down_e(act[a])  ExpertsBlock down  (D/8 tiles)

Dependencies (counters): select waits logits; gateup waits select; shared-down waits shared-gateup;
down waits gateup and shared-down.

Kimi K3's Stable LatentMoE (`latent` = L > 0; sdk/reference/moe.py's latent forward):

    z       = x @ W_ldown^T  [M, L] bf16                      GemvBlock          (waits nothing)
    gateup  : act[a] = act_e(z[tok(a)])                       ExpertsBlock gateup on L (waits select, z)
    down    : routed = sum_a topk_w[a] * down_e(act[a])       ExpertsBlock down, L rows, fp32 out, no shared
    up      : out = shared + RMSNorm(routed) * w_n @ W_lup^T  GemvBlock norm=True, fp32 x, fp32 residual
                                                              (waits down and shared-down)

The norm needs whole latent rows, so the up GEMV waits for every down tile (one more counter hop,
~0.5 us, than the plain layer). Its fused norm rounds norm(routed) * w_n to bf16 once (the
reference rounds before the weight: within the tests' bf16 tolerance). The shared expert and the router run side by side; no host
round trip anywhere (the dispatch table lives in global memory; see sdk/blocks/router.py).

Expert parallelism is simulated on one GPU: the router scores all experts, the layer holds the
experts [rank * num_local, (rank + 1) * num_local) only, tokens routed elsewhere are skipped
(their contribution would come from the other ranks' combine). The expert-parallel layer with
in-kernel dispatch/combine across ranks is sdk/megakernel/ep_moe.py. The shared expert is this rank's TP shard (its output is a
partial sum, all-reduced by a later instruction) or replicated, as the preset says.

`reference(cfg, weights, x, input_ids)` is sdk/reference/moe.py's routing (`route()`) and expert
math on the dequantised weights, the non-local experts skipped; on tiny configs the tests also
check it against `MoEReference.forward` itself, with the non-local experts' weights zero.

In a plain-residual model's chain (`resid_in_place`, Kimi K3; sdk/megakernel/plain_model.py) x is
the hidden state itself: the GEMVs reading it (router logits, latent down, shared gate/up) norm it
with `mlp_norm` in their prologues, the shared down adds it (shared_out = x + shared, fp32) and the
up GEMV writes x = shared_out + latent_up(...) in place (bf16) - every reader of x is done by then.

In the model's mHC residual (`mhc` = "v4" | "v41", DeepSeek-V4(.1), GLM-5.3; sdk/megakernel/mhc_site.py):
the streams in, x = the collapse normed with `mlp_norm` (the ops reading x wait for it), the
streams updated in place from `out` (fused with the next site's mix partials) at the end.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..blocks.experts import (ExpertsBlock, ExpertsConfig, balanced_rows, dequant_experts, quantize_fp8_experts,
                              quantize_mxfp4)
from ..blocks.gemv import MMA_MIN_M, GemvConfig
from ..blocks.router import RouterSelectBlock, RouterSelectConfig
from ..errors import UnsupportedConfigError
from ..reference.common import swiglu
from ..reference.moe import route
from ..spec import MoESpec
from .mhc_site import MHCSiteFields, add_collapse, add_post, site_weights
from .mhc_site import reference as site_reference
from .mlp_stack import gemv_block
from .program import Program


@dataclass(frozen=True)
class MoELayerConfig(MHCSiteFields):
    hidden: int = 1024
    num_experts: int = 64
    top_k: int = 4
    intermediate: int = 256
    num_local: int = 0                   # experts on this rank; 0 = all
    rank: int = 0                        # this rank's experts start at rank * num_local
    shared_intermediate: int = 0         # 0 = no shared expert
    scoring: str = "sigmoid"
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    hash_routed: bool = False
    vocab: int = 0
    swiglu_limit: float | None = None
    activation: str = "silu"             # experts' and shared expert's: "silu" | "situ" (Kimi K3)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    latent: int = 0                      # Stable LatentMoE: experts on this width (0 = on the hidden)
    latent_norm_eps: float = 1e-5
    batch: int = 1
    expert_dtype: str = "bf16"           # "bf16" | "fp8_e4m3" | "mxfp4"
    router_dtype: str = "fp32"           # "fp32" | "bf16"
    router_logits_bf16: bool = False     # DeepSeek-V4's router in bf16 (router_logits_dtype "model"): the
                                         # logits, scores and weights rounded as its bf16 ops round them
    shared_dtype: str = "bf16"           # "bf16" | "fp8_e4m3" (GemvBlock's formats)
    router_rows: int = 0                 # rows per tile of the router GEMV; 0 = balanced
    expert_rows: int = 0                 # ... of the experts (one tile per SM where possible)
    expert_weight_l1: bool = True        # expert weight loads allocate in L1 (ExpertsConfig)
    expert_mma: bool | None = None       # MXFP4 expert tiles on the tensor cores (ExpertsConfig.mma);
                                         # None = from batch 8 (ExpertsBlock.use_mma)
    expert_smem_stages: int | None = None   # CUDA-core expert tiles: each warp's (row, expert) items
                                         # through cp.async into its own smem slots, this many deep
                                         # (ExpertsConfig.smem_stages; 0: loads straight to registers);
                                         # None: auto_smem_stages (MXFP4: 2 below MMA_MIN_M tokens where it fits)
    expert_down_smem_stages: int | None = None   # ... of the down tile alone; None: the gate/up's;
                                         # -1: down_smem_stages' arena-deep ring (opt-in, unmeasured)
    expert_mxfp4_decode: str = "f32"     # CUDA-core MXFP4 expert tiles' math (ExpertsConfig.mxfp4_decode)
    expert_batch1_tile: bool = True      # ExpertsConfig.batch1_tile
    shared_rows: int = 0                 # ... of the shared expert's GEMVs (and the latent ones)
    op_rows: tuple = ()                  # per-op rows overriding shared_rows: (("shared_down", 32),
                                         # ...) over shared_gateup / shared_down / latent_down /
                                         # latent_up (moe_bench --set shared_down_rows=32)
    num_sms: int = 132                   # SMs the balanced tiles are cut for
    norm_eps: float = 1e-6               # mHC: the mix's RMSNorm and the layer's input norm (also resid_in_place's)
    resid_in_place: bool = False         # plain residual chain: x normed in the readers' prologues, the
                                         # output added onto x in place (the latent MoE: module docstring)
    partial_out: bool = False            # with resid_in_place and the latent: one of `tp_ranks` tensor-parallel
    tp_ranks: int = 1                    # ranks (sdk/megakernel/tp_model.py; the TP form below)
    router_gather: bool = True           # partial_out: the router's rows sharded and the logits gathered
                                         # (False: every rank reads the whole router - one collective
                                         # fewer, E / N times the router's bytes)

    @property
    def site(self):
        """The mHC site around the layer (sdk/megakernel/mhc_site.py), or None (plain residual)."""
        from .mhc_site import site_of
        return site_of(self, "MoE layer", self.batch, self.norm_eps)

    @property
    def local(self) -> int:
        return self.num_local or self.num_experts

    @property
    def local_start(self) -> int:
        return self.rank * self.local

    @property
    def router_outputs(self) -> int:
        """The router GEMV's rows (its logits): partial_out's E / tp_ranks (the rank's experts, gathered by the
        model) where that is a whole number of the GEMV's 8-row groups, else all E (replicated,
        its rows rotated so the rank's experts come first: GLM-5.3 TP8's 36)."""
        n = self.num_experts // self.tp_ranks
        return n if self.partial_out and self.router_gather and n % 8 == 0 else self.num_experts

    @property
    def latent_shard(self) -> int:
        """partial_out: K of the rank's latent up - its latent / tp_ranks columns, zero-padded to
        the GEMV's 256s (Kimi K3 TP8: 448 -> 512)."""
        return -(-(self.latent // self.tp_ranks) // 256) * 256

    @property
    def expert_hidden(self) -> int:
        """The experts' width: the latent, or the hidden size."""
        return self.latent or self.hidden

    def moe_spec(self) -> MoESpec:
        """The reference's spec of this layer (sdk/spec.py)."""
        return MoESpec(num_experts=self.num_experts, top_k=self.top_k, expert_intermediate_size=self.intermediate,
                       num_shared_experts=1 if self.shared_intermediate else 0,
                       shared_intermediate_size=self.shared_intermediate, scoring=self.scoring,
                       correction_bias=self.correction_bias, n_group=self.n_group, topk_group=self.topk_group,
                       norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
                       hash_routed=self.hash_routed, activation=self.activation, swiglu_limit=self.swiglu_limit,
                       situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
                       latent_size=self.latent, latent_norm_eps=self.latent_norm_eps,
                       extra=(("router_logits_dtype", "model"),) if self.router_logits_bf16 else ())

    def act_fields(self) -> dict:
        """The gated activation's fields of GemvConfig / ExpertsConfig."""
        return dict(activation=self.activation, situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta)


def expected_hits(cfg: MoELayerConfig) -> float:
    """Expected distinct local experts hit per step (uniform routing): for the scheduler's costs."""
    e, k, m = cfg.num_experts, cfg.top_k, cfg.batch
    return cfg.local * (1.0 - (1.0 - k / e) ** m)


# Each model's per-GPU MoE shard (issue 4). EP shards of the experts; the shared expert is the TP8
# shard where GemvBlock's shapes allow it (K a multiple of 256 for bf16), else replicated.
PRESETS = {
    # Kimi K3: 896 experts top-16, I 3072, EP16 -> 56 local; sigmoid + bias, no groups, no scale;
    # shared expert I 6144 TP8 -> 768; Stable LatentMoE (experts on a 3584 latent) with SiTU
    # (docs/moe.md). preset("kimi_k3", b, activation="silu", latent=0) is the plain layout.
    "kimi_k3": dict(hidden=7168, num_experts=896, top_k=16, intermediate=3072, num_local=56,
                    shared_intermediate=768, scoring="sigmoid", correction_bias=True,
                    routed_scaling_factor=1.0, router_dtype="fp32", activation="situ", latent=3584,
                    # 56 router tiles of 16 rows, not the 112 of 8 that balance the router alone:
                    # its fp32 tiles share phase 0 with latent.down and the shared gate/up, and
                    # every tile pays a start cost (bench/NOTES.md). H200, MXFP4, same-run A/B:
                    # B=1 80.5 -> 69.2 us (32 rows 70.7), B=8 225.4 -> 215.6 us. (V4.1-Flash
                    # B=1 65.5 -> 65.3, GLM-5.3 33.2 -> 35.2: they keep the balanced tiles.)
                    router_rows=16),
    # DeepSeek-V4.1-Flash: 384 experts top-6, I 2304, EP8 -> 48 local; sqrt(softplus) + bias,
    # renorm, x1.5, clamp 10; shared I 2304 replicated (2304 / 8 = 288 does not fit GemvBlock)
    "deepseek_v41_flash": dict(hidden=5120, num_experts=384, top_k=6, intermediate=2304, num_local=48,
                               shared_intermediate=2304, scoring="sqrtsoftplus", correction_bias=True,
                               routed_scaling_factor=1.5, swiglu_limit=10.0, router_dtype="bf16"),
    # GLM-5.3: 288 experts top-8, I 2048, EP8 -> 36 local; sigmoid + bias, renorm, x2.5, clamp 10;
    # shared I 2048 TP8 -> 256
    "glm_53": dict(hidden=4096, num_experts=288, top_k=8, intermediate=2048, num_local=36,
                   shared_intermediate=256, scoring="sigmoid", correction_bias=True,
                   routed_scaling_factor=2.5, swiglu_limit=10.0, router_dtype="fp32"),
}


def preset(model: str, batch: int = 1, **overrides) -> MoELayerConfig:
    return replace(MoELayerConfig(**PRESETS[model]), batch=batch, **overrides)


ROWS_OPS = ("shared_gateup", "shared_down", "latent_down", "latent_up")     # MoELayerConfig.op_rows


SMEM_STAGES_AUTO = 2            # the staged expert tiles' depth by default (3 measured the same)
SMEM_STAGES_RING_MIN = 3        # ... where the layer's weight ring keeps this many stages beside them


@functools.lru_cache(maxsize=64)      # blocks() asks for every build of a config: one trial program each
def auto_smem_stages(cfg: MoELayerConfig) -> int:
    """The expert tiles' smem_stages when the config leaves it None: SMEM_STAGES_AUTO for MXFP4
    experts below MMA_MIN_M tokens (the CUDA-core tile's batches) where the slots fit and the
    layer's weight ring keeps SMEM_STAGES_RING_MIN stages, else 0. Measured on the H200 (2026-12-05,
    batch 1, MXFP4, plain vs 2 / 3 deep): GLM-5.3 31.2 vs 29.9 / 29.6 us, Kimi K3 74.3 vs 69.9 /
    70.1, V4.1-Flash 64.6 vs 58.6 / 58.1 (bench/results/h200/moe_bench_v22_*.json). fp8 experts:
    GPU-tested staged (batch 1 / 4), not yet timed - opt-in."""
    if cfg.batch >= MMA_MIN_M or cfg.expert_dtype != "mxfp4":
        return 0
    from ..blocks.base import ring_geometry
    try:
        prog = build_program(replace(cfg, expert_smem_stages=SMEM_STAGES_AUTO))
        return SMEM_STAGES_AUTO if ring_geometry(prog.opcodes.blocks)[1] >= SMEM_STAGES_RING_MIN else 0
    except UnsupportedConfigError:      # the slots do not fit (bf16 rows; large x at the batch)
        return 0


DOWN_STAGES_MAX = 8              # ExpertsConfig.smem_stages' limit


def down_smem_stages(cfg: MoELayerConfig, gateup: ExpertsBlock, down: ExpertsBlock) -> int:
    """The down tile's smem_stages where the gate/up tile stages its items (else 0 too): the gate/up
    tile's (cfg.expert_down_smem_stages None), that number, or (-1, opt-in until measured) as many
    as fit the
    shared memory the gate/up tile's slots already take - a CTA runs one tile at a time, so the
    plain tiles share one arena (base.plain_smem_bytes) and the deeper down ring costs the weight
    ring nothing. Why deeper: a down item is one short row (V4.1-Flash 1.2 KB against gate/up's
    5.4 KB), computed in ~0.4 us (estimated from its SASS), and 2 deep a warp's 5 items would run
    about one memory round trip apart - our reading of the down tile's time alone (H100: 7.3 us
    for 49 KB), not profiled."""
    ds = down.config.smem_stages
    if cfg.expert_down_smem_stages is None or not ds:
        return ds
    if cfg.expert_down_smem_stages >= 0:
        return cfg.expert_down_smem_stages
    per_stage = down.own_smem_bytes() // ds
    return max(ds, min(DOWN_STAGES_MAX, gateup.own_smem_bytes() // per_stage))


def blocks(cfg: MoELayerConfig) -> dict:
    if cfg.expert_smem_stages is None:
        cfg = replace(cfg, expert_smem_stages=auto_smem_stages(cfg))
    d, m, L, h = cfg.hidden, cfg.batch, cfg.local, cfg.expert_hidden
    if cfg.resid_in_place and not cfg.latent:
        raise UnsupportedConfigError("MoE layer: resid_in_place needs the latent MoE (Kimi K3's: every reader of x "
                                     "a GEMV with the input norm fused); the plain layer's experts read x directly")
    if cfg.partial_out and not (cfg.resid_in_place and cfg.latent or cfg.mhc and not cfg.latent):
        raise UnsupportedConfigError("MoE layer: partial_out (tensor parallel) is the in-place latent MoE's "
                                     "(resid_in_place, latent) or the MoE in an mHC site's")
    norm_x = dict(norm=True, norm_eps=cfg.norm_eps) if cfg.resid_in_place else {}
    hits = expected_hits(cfg)
    er = {st: cfg.expert_rows or balanced_rows(cfg.intermediate if st == "gateup" else h, cfg.num_sms)
          for st in ("gateup", "down")}
    out = {
        # the router GEMV streams its (fp32 or bf16) weights through the smem ring: issued at the
        # launch's start, before x is ready
        "logits": gemv_block(GemvConfig(n=cfg.router_outputs, k=d, m=m, weight_dtype=cfg.router_dtype,
                                        out_dtype="fp32", **norm_x), cfg.router_rows, cfg.num_sms),
        "select": RouterSelectBlock(RouterSelectConfig(
            num_experts=cfg.num_experts, top_k=cfg.top_k, m=m, scoring=cfg.scoring,
            correction_bias=cfg.correction_bias, n_group=cfg.n_group, topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
            hash_routed=cfg.hash_routed, vocab=cfg.vocab, local_start=cfg.local_start, num_local=L,
            logits_bf16=cfg.router_logits_bf16)),
        "gateup": ExpertsBlock(ExpertsConfig(stage="gateup", hidden=h, intermediate=cfg.intermediate,
                                             num_local=L, top_k=cfg.top_k, m=m, weight_dtype=cfg.expert_dtype,
                                             swiglu_limit=cfg.swiglu_limit, **cfg.act_fields(),
                                             rows_per_tile=er["gateup"],
                                             mma=cfg.expert_mma, smem_stages=cfg.expert_smem_stages,
                                             mxfp4_decode=cfg.expert_mxfp4_decode,
                                             batch1_tile=bool(cfg.expert_batch1_tile),
                                             weight_l1=cfg.expert_weight_l1, expected_hits=round(hits, 2))),
        "down": ExpertsBlock(ExpertsConfig(stage="down", hidden=h, intermediate=cfg.intermediate,
                                           num_local=L, top_k=cfg.top_k, m=m, weight_dtype=cfg.expert_dtype,
                                           # latent: the shared expert (on the hidden) joins in the up GEMV
                                           shared=bool(cfg.shared_intermediate) and not cfg.latent,
                                           out_dtype="fp32" if cfg.latent else "bf16", rows_per_tile=er["down"],
                                           mma=cfg.expert_mma, smem_stages=cfg.expert_smem_stages,
                                           mxfp4_decode=cfg.expert_mxfp4_decode,
                                           batch1_tile=bool(cfg.expert_batch1_tile),
                                           weight_l1=cfg.expert_weight_l1, expected_hits=round(hits, 2))),
    }
    out["down"] = ExpertsBlock(replace(out["down"].config, smem_stages=down_smem_stages(cfg, out["gateup"], out["down"])))
    rows = dict(cfg.op_rows)
    unknown = set(rows) - set(ROWS_OPS)
    if unknown:
        raise UnsupportedConfigError(f"MoELayerConfig.op_rows: unknown op(s) {sorted(unknown)} (known: {ROWS_OPS})")
    shared_rows = {op: rows.get(op, cfg.shared_rows) for op in ROWS_OPS}
    if cfg.latent and cfg.partial_out:
        out["latent_down"] = gemv_block(GemvConfig(n=h // cfg.tp_ranks, k=d, m=m, **norm_x), shared_rows["latent_down"],
                                        cfg.num_sms)
        # the rank's partial: its latent columns of up(norm(routed)) + its shared expert shard
        out["latent_up"] = gemv_block(GemvConfig(n=d, k=cfg.latent_shard, m=m, out_dtype="fp32",
                                                 residual="fp32" if cfg.shared_intermediate else None),
                                      shared_rows["latent_up"], cfg.num_sms)
    elif cfg.latent:
        out["latent_down"] = gemv_block(GemvConfig(n=h, k=d, m=m, **norm_x), shared_rows["latent_down"], cfg.num_sms)
        # the residual: the shared expert's output (x added there when in place), else x itself
        res = "fp32" if cfg.shared_intermediate else "bf16" if cfg.resid_in_place else None
        out["latent_up"] = gemv_block(GemvConfig(n=d, k=h, m=m, x_dtype="fp32", norm=True,
                                                 norm_eps=cfg.latent_norm_eps, residual=res),
                                      shared_rows["latent_up"], cfg.num_sms)
    if cfg.shared_intermediate:
        s = cfg.shared_intermediate
        out["shared_gateup"] = gemv_block(GemvConfig(n=s, k=d, m=m, weight_dtype=cfg.shared_dtype, swiglu=True,
                                                     swiglu_limit=cfg.swiglu_limit, **cfg.act_fields(), **norm_x),
                                          shared_rows["shared_gateup"], cfg.num_sms)
        out["shared_down"] = gemv_block(GemvConfig(n=d, k=s, m=m, weight_dtype=cfg.shared_dtype, out_dtype="fp32",
                                                   residual="bf16" if adds_x(cfg) else None),
                                        shared_rows["shared_down"], cfg.num_sms)
    if cfg.site:
        out.update(cfg.site.blocks())
    return out


def _expert_buffers(prog, name, shape, fmt):
    e, n, k = shape
    if fmt == "mxfp4":
        prog.buffer(name + ".weight", (e, n, k // 8), "int32", "weight")
        prog.buffer(name + ".scale", (e, n, k // 128), "int32", "weight")
    else:
        prog.buffer(name + ".weight", shape, fmt, "weight")
        if fmt == "fp8_e4m3":
            prog.buffer(name + ".scale", (e, n // 128, k // 128), "fp32", "weight")


def add_inputs_and_weights(prog: Program, cfg: MoELayerConfig, tokens: int, local: int) -> None:
    """x [tokens, hidden] (mHC: the site's weights; x comes from its collapse), the router's
    weights (bias, hash table and input_ids where the layer has them) and the weights of `local`
    routed experts."""
    d, k, E, I, h = cfg.hidden, cfg.top_k, cfg.num_experts, cfg.intermediate, cfg.expert_hidden
    if cfg.site:
        for name, (shape, dt) in {"mlp_norm": ((d,), "fp32"), **cfg.site.weight_shapes()}.items():
            prog.buffer(name, shape, dt, "weight")
    else:
        prog.buffer("x", (tokens, d), "bf16", "input")
    if cfg.resid_in_place:
        prog.buffer("mlp_norm", (d,), "bf16", "weight")
    prog.buffer("router.weight", (cfg.router_outputs, d), cfg.router_dtype, "weight")
    if cfg.correction_bias:
        prog.buffer("router.bias", (E,), "fp32", "weight")
    if cfg.hash_routed:
        prog.buffer("input_ids", (tokens,), "int32", "input")
        prog.buffer("router.tid2eid", (cfg.vocab, k), "int32", "weight")
    _expert_buffers(prog, "experts.gate_up", (local, 2 * I, h), cfg.expert_dtype)
    _expert_buffers(prog, "experts.down", (local, h, I), cfg.expert_dtype)
    if cfg.latent:
        prog.buffer("latent_down.weight", (h // cfg.tp_ranks, d), "bf16", "weight")
        prog.buffer("latent_norm.weight", (h,), "bf16", "weight")
        prog.buffer("latent_up.weight", (d, cfg.latent_shard if cfg.partial_out else h), "bf16", "weight")


def add_router(prog: Program, cfg: MoELayerConfig, b: dict, table: dict, x_ops=()) -> int:
    """router.logits, then router.select writing topk_ids / topk_w and the dispatch table whose
    buffer names `table` gives (counts, hits, tok, slot). Returns the select op. x_ops: what
    writes x (mHC's collapse)."""
    lg = prog.op(b["logits"], {"w": "router.weight", "x": "x", "y": "logits", **x_norm(cfg)}, waits=x_ops,
                 label="router.logits")
    sb = {"logits": "logits", "topk_ids": "topk_ids", "topk_w": "topk_w", **table}
    if cfg.correction_bias:
        sb["bias"] = "router.bias"
    if cfg.hash_routed:
        sb.update({"tid2eid": "router.tid2eid", "input_ids": "input_ids"})
    return prog.op(b["select"], sb, waits=[lg], label="router.select")


def adds_x(cfg: MoELayerConfig) -> bool:
    """Whether the layer adds its output onto x itself (in place; not a tensor-parallel partial)."""
    return cfg.resid_in_place and not cfg.partial_out


def x_norm(cfg: MoELayerConfig) -> dict:
    """The norm weight binding of a GEMV reading x (resid_in_place: the layer's input norm fused)."""
    return {"norm_weight": "mlp_norm"} if cfg.resid_in_place else {}


def expert_weights(cfg: MoELayerConfig, name: str) -> dict:
    """The weight (and scale) bindings of the experts' `name` buffers."""
    out = {"w": name + ".weight"}
    if cfg.expert_dtype != "bf16":
        out["w_scale"] = name + ".scale"
    return out


def add_shared_expert(prog: Program, cfg: MoELayerConfig, b: dict, x_ops=()) -> int:
    """The shared expert on x: its weights, shared_act, shared_out [tokens, hidden] fp32 and the
    two GEMV ops. Returns the down op (what the combining op waits for). x_ops: what writes x."""
    m, d = prog.buffers["x"].shape
    s, fp8 = cfg.shared_intermediate, cfg.shared_dtype == "fp8_e4m3"
    for name, shape in (("shared.gate", (s, d)), ("shared.up", (s, d)), ("shared.down", (d, s))):
        prog.buffer(name + ".weight", shape, cfg.shared_dtype, "weight")
        if fp8:
            prog.buffer(name + ".scale", (shape[0] // 128, shape[1] // 128), "fp32", "weight")
    prog.buffer("shared_act", (m, s), "bf16")
    prog.buffer("shared_out", (m, d), "fp32")
    g = {"w_gate": "shared.gate.weight", "w_up": "shared.up.weight", "x": "x", "y": "shared_act", **x_norm(cfg)}
    dn = {"w": "shared.down.weight", "x": "shared_act", "y": "shared_out"}
    if adds_x(cfg):                         # shared_out = x + shared: the layer's residual
        dn["res"] = "x"
    if fp8:
        g.update({"w_gate_scale": "shared.gate.scale", "w_up_scale": "shared.up.scale"})
        dn["w_scale"] = "shared.down.scale"
    sg = prog.op(b["shared_gateup"], g, waits=x_ops, label="shared.gateup")
    return prog.op(b["shared_down"], dn, waits=[sg], label="shared.down")


def build_program(cfg: MoELayerConfig) -> Program:
    d, m, k, L, E, I = cfg.hidden, cfg.batch, cfg.top_k, cfg.local, cfg.num_experts, cfg.intermediate
    b = blocks(cfg)
    if cfg.partial_out:
        return build_tp_shard(cfg, b)
    prog = Program()
    add_inputs_and_weights(prog, cfg, m, L)
    # mHC: x = the streams' collapse, normed with mlp_norm; out feeds the post-mix at the end
    x_ops, coef_op = add_collapse(prog, cfg.site, b, "mlp_norm", label="moe.") if cfg.site else ((), None)
    for name, shape, dt in (("logits", (m, E), "fp32"), ("topk_ids", (m, k), "int32"), ("topk_w", (m, k), "fp32"),
                            ("counts", (L,), "int32"), ("hits", (L + 1,), "int32"), ("tok", (L, m), "int32"),
                            ("slot", (L, m), "int32"), ("act", (m * k, I), "bf16")):
        prog.buffer(name, shape, dt)
    if not cfg.resid_in_place:
        prog.buffer("out", (m, d), "bf16", "scratch" if cfg.site else "output")

    table = {"counts": "counts", "hits": "hits", "tok": "tok", "slot": "slot"}
    sel = add_router(prog, cfg, b, table, x_ops)
    # Stable LatentMoE (cfg.latent): z = latent_down(x) is the experts' input, their sum goes to
    # `routed` [M, L] fp32, then out = shared_out + latent_up(RMSNorm(routed)) in one GEMV
    x_in, out, gu_waits = "x", "out", [sel]
    if cfg.latent:
        prog.buffer("z", (cfg.batch, cfg.expert_hidden), "bf16")
        prog.buffer("routed", (cfg.batch, cfg.expert_hidden), "fp32")
        gu_waits.append(prog.op(b["latent_down"], {"w": "latent_down.weight", "x": "x", "y": "z", **x_norm(cfg)},
                                waits=x_ops, label="latent.down"))
        x_in, out = "z", "routed"
    gu = prog.op(b["gateup"], {**expert_weights(cfg, "experts.gate_up"), **table, "x": x_in, "act": "act"},
                 waits=gu_waits, label="experts.gateup")
    down_b = {**expert_weights(cfg, "experts.down"), **table, "act": "act", "topk_w": "topk_w", "out": out}
    last_b, waits = down_b, [gu]
    if cfg.latent:
        waits = [prog.op(b["down"], down_b, waits=[gu], label="experts.down")]
        # in place: x = shared_out (x + shared) + up(...), or x + up(...) without a shared expert
        last_b = {"w": "latent_up.weight", "x": "routed", "norm_weight": "latent_norm.weight",
                  "y": "x" if cfg.resid_in_place else "out"}
        if cfg.resid_in_place and not cfg.shared_intermediate:
            last_b["res"] = "x"
    if cfg.shared_intermediate:             # the shared expert joins the last op's residual input
        waits.append(add_shared_expert(prog, cfg, b, x_ops))
        last_b["res" if cfg.latent else "shared"] = "shared_out"
    last = prog.op(b["latent_up"] if cfg.latent else b["down"], last_b, waits=waits,
                   label="latent.up" if cfg.latent else "experts.down")
    if cfg.site:
        add_post(prog, b, "out", [last, coef_op], label="moe.")
    return prog


def build_tp_shard(cfg: MoELayerConfig, b: dict) -> Program:
    """One tensor-parallel rank's share of the MoE (`partial_out`, N = tp_ranks; the model's
    program: sdk/megakernel/tp_model.py): experts [rank * L, (rank+1) * L) as its local [0, L),
    those experts' router rows, its shard of the shared expert.

        logits_shard = GEMV(x, router rows)              [M, E / N]  - the model gathers these
                                                                       (its own first) into logits
                       (or, where E / N is not a whole number of 8-row groups: logits = the
                       whole router, its rows rotated: `router_outputs`)
        select (logits) -> gateup -> down
    Kimi K3's in-place latent MoE (x normed in the GEMVs' prologues):
        z_shard      = GEMV(norm(x), latent_down rows)   [M, h / N]  - gathered into z
        routed       = this rank's experts' weighted sum on z [M, h] fp32
        partial      = shared_out + zn @ latent_up[:, rank's columns]^T    (fp32 [M, D]; zn: the
                       all-reduce of routed with the latent norm, this rank's columns kept)
    The MoE in an mHC site (GLM-5.3): x = the site's collapse, the experts on x,
        out          = shared_out + this rank's experts' sum (bf16: the all-reduce's partial), then
                       the site's post-mix (which the model's program turns into the all-reduce
                       with the post-mix epilogue).

    The ops reading logits, z and zn wait for nothing here: the model's program inserts the
    collectives writing them before their first reader and makes it wait (tp_model.py)."""
    d, m, k, L, E, I, h, N = (cfg.hidden, cfg.batch, cfg.top_k, cfg.local, cfg.num_experts, cfg.intermediate,
                              cfg.latent, cfg.tp_ranks)
    prog = Program()
    add_inputs_and_weights(prog, cfg, m, L)
    x_ops, coef_op = add_collapse(prog, cfg.site, b, "mlp_norm", label="moe.") if cfg.site else ((), None)
    gathered = cfg.router_outputs < E             # else the replicated router writes logits itself
    if gathered:
        prog.buffer("logits_shard", (m, E // N), "fp32")
    for name, shape, dt in (("logits", (m, E), "fp32"),
                            ("topk_ids", (m, k), "int32"), ("topk_w", (m, k), "fp32"), ("counts", (L,), "int32"),
                            ("hits", (L + 1,), "int32"), ("tok", (L, m), "int32"), ("slot", (L, m), "int32"),
                            ("act", (m * k, I), "bf16")):
        prog.buffer(name, shape, dt)
    table = {"counts": "counts", "hits": "hits", "tok": "tok", "slot": "slot"}
    lg = prog.op(b["logits"], {"w": "router.weight", "x": "x", "y": "logits_shard" if gathered else "logits",
                               **x_norm(cfg)}, waits=x_ops, label="router.logits")
    sb = {"logits": "logits", "topk_ids": "topk_ids", "topk_w": "topk_w", **table}
    if cfg.correction_bias:
        sb["bias"] = "router.bias"
    if cfg.hash_routed:                     # the table's expert ids rotated as the logits are
        sb.update({"tid2eid": "router.tid2eid", "input_ids": "input_ids"})
    sel = prog.op(b["select"], sb, waits=[] if gathered else [lg], label="router.select")
    if not cfg.latent:                      # the mHC site's MoE: out = shared + the experts, the post-mix
        prog.buffer("out", (m, d), "bf16")
        gu = prog.op(b["gateup"], {**expert_weights(cfg, "experts.gate_up"), **table, "x": "x", "act": "act"},
                     waits=[sel], label="experts.gateup")
        down = {**expert_weights(cfg, "experts.down"), **table, "act": "act", "topk_w": "topk_w", "out": "out"}
        waits = [gu]
        if cfg.shared_intermediate:
            waits.append(add_shared_expert(prog, cfg, b, x_ops))
            down["shared"] = "shared_out"
        dn = prog.op(b["down"], down, waits=waits, label="experts.down")
        add_post(prog, b, "out", [dn, coef_op], label="moe.")
        return prog
    for name, shape, dt in (("z_shard", (m, h // N), "bf16"), ("z", (m, h), "bf16"), ("routed", (m, h), "fp32"),
                            ("zn", (m, cfg.latent_shard), "bf16"), ("partial", (m, d), "fp32")):
        prog.buffer(name, shape, dt)
    prog.op(b["latent_down"], {"w": "latent_down.weight", "x": "x", "y": "z_shard", **x_norm(cfg)}, label="latent.down")
    gu = prog.op(b["gateup"], {**expert_weights(cfg, "experts.gate_up"), **table, "x": "z", "act": "act"},
                 waits=[sel], label="experts.gateup")
    prog.op(b["down"], {**expert_weights(cfg, "experts.down"), **table, "act": "act", "topk_w": "topk_w",
                        "out": "routed"}, waits=[gu], label="experts.down")
    up = {"w": "latent_up.weight", "x": "zn", "y": "partial"}
    waits = []
    if cfg.shared_intermediate:
        waits.append(add_shared_expert(prog, cfg, b))
        up["res"] = "shared_out"
    prog.op(b["latent_up"], up, waits=waits, label="latent.up")
    return prog


# -- weights and reference ---------------------------------------------------------------------
# the program's weights <- the model's (sdk/reference/moe.py names, under the layer's mlp.)
# (the experts: experts_from_model, in the program's format)
MODEL_WEIGHTS = {"router.weight": "gate.weight", "router.bias": "gate.e_score_correction_bias",
                 "router.tid2eid": "gate.tid2eid", "shared.gate.weight": "shared_experts.gate_proj.weight",
                 "shared.up.weight": "shared_experts.up_proj.weight",
                 "shared.down.weight": "shared_experts.down_proj.weight", "latent_down.weight": "latent_down.weight",
                 "latent_norm.weight": "latent_norm.weight", "latent_up.weight": "latent_up.weight"}


def make_weights(cfg: MoELayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights of this rank in the kernel's layout (generated on `device`), scaled so
    that logits and activations are O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    d, k, L, E, I, h = cfg.hidden, cfg.top_k, cfg.local, cfg.num_experts, cfg.intermediate, cfg.expert_hidden

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=device) * std

    w = {"router.weight": rnd(E, d, std=d ** -0.5).to(torch.float32 if cfg.router_dtype == "fp32" else torch.bfloat16)}
    if cfg.correction_bias:
        w["router.bias"] = rnd(E, std=0.05)
    if cfg.hash_routed:
        w["router.tid2eid"] = torch.stack([torch.randperm(E, generator=g, device=device)[:k]
                                           for _ in range(cfg.vocab)]).to(torch.int32)
    if cfg.latent:
        w["latent_down.weight"] = rnd(h, d, std=d ** -0.5).to(torch.bfloat16)
        w["latent_norm.weight"] = (1 + 0.2 * rnd(h)).to(torch.bfloat16)
        w["latent_up.weight"] = rnd(d, h, std=h ** -0.5).to(torch.bfloat16)
    for name, shape, fan_in in (("experts.gate_up", (L, 2 * I, h), h), ("experts.down", (L, h, I), I)):
        # generated per expert: the full bf16 tensor of a real shard is several GB
        full = torch.empty(shape, dtype=torch.bfloat16, device=device)
        for e in range(L):
            full[e] = rnd(*shape[1:], std=fan_in ** -0.5).to(torch.bfloat16)
        w.update({f"{name}.{k}": v for k, v in in_expert_format(full, cfg.expert_dtype).items()})
        del full
    if cfg.shared_intermediate:
        from .mlp_stack import quantize_fp8
        s = cfg.shared_intermediate
        for name, shape, fan_in in (("shared.gate", (s, d), d), ("shared.up", (s, d), d), ("shared.down", (d, s), s)):
            t = rnd(*shape, std=fan_in ** -0.5).to(torch.bfloat16)
            if cfg.shared_dtype == "fp8_e4m3":
                w[name + ".weight"], w[name + ".scale"] = quantize_fp8(t)
            else:
                w[name + ".weight"] = t
    if cfg.site:            # the layer's input norm (bf16 values, fp32) and the site's mix weights
        w["mlp_norm"] = (1 + 0.1 * rnd(d)).to(torch.bfloat16).float()
        w.update(site_weights(cfg.site, g, device))
    return w


def in_expert_format(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Experts' weights [E, N, K] (bf16 values) in the kernel's format `fmt`: {"weight"} for bf16,
    + {"scale"}: fp8 e4m3 with 128 x 128 block scales (amax / 448), MXFP4 (e2m1 codes packed 8 to
    an int32, a power-of-two scale per 32 along K; quantised one expert at a time)."""
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    if fmt == "fp8_e4m3":
        q, scale = quantize_fp8_experts(w)
        return {"weight": q, "scale": scale}
    if fmt == "mxfp4":
        q = [quantize_mxfp4(w[e].float()) for e in range(w.shape[0])]
        return {"weight": torch.stack([a for a, _ in q]), "scale": torch.stack([sc for _, sc in q])}
    raise UnsupportedConfigError(f"experts format {fmt!r} (supported: bf16, fp8_e4m3, mxfp4)")


def experts_from_model(cfg: MoELayerConfig, get) -> dict[str, torch.Tensor]:
    """The program's expert buffers (this rank's experts, in cfg.expert_dtype: `in_expert_format`)
    from the model's [E, 2I, h] / [E, h, I] weights: get(name) -> its weight (sdk/reference/moe.py
    names). A quantised format is quantised here, from the weights' bf16 values."""
    out = {}
    local = slice(cfg.local_start, cfg.local_start + cfg.local)
    for name, model_name in (("experts.gate_up", "experts.gate_up_proj"), ("experts.down", "experts.down_proj")):
        w = get(model_name)[local].to(torch.bfloat16)
        out.update({f"{name}.{k}": v for k, v in in_expert_format(w, cfg.expert_dtype).items()})
    return out


def mhc_reference(cfg: MoELayerConfig, weights: dict, inputs: dict, hc_fn: torch.Tensor,
                  input_ids: torch.Tensor | None = None) -> dict:
    """mHC (cfg.mhc): {streams, coef, part_next} - the model's residual around this layer
    (mhc_site.reference; the layer's output rounded to bf16, the model's dtype)."""
    return site_reference(cfg.site, weights, inputs, hc_fn, weights["mlp_norm"],
                          lambda h: reference(cfg, weights, h, input_ids).to(torch.bfloat16))


def _shared_dense(cfg, weights, name):
    t = weights[name + ".weight"].float()
    s = weights.get(name + ".scale")
    if s is not None:
        t = t * s.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return t


def local_expert_weights(cfg: MoELayerConfig, weights: dict, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (gate_up [2I, D], down [D, I]) of local expert e, dequantised."""
    out = []
    for name in ("experts.gate_up", "experts.down"):
        w = weights[name + ".weight"][e]
        s = weights.get(name + ".scale")
        out.append(dequant_experts(w[None], s[e][None] if s is not None else None, cfg.expert_dtype)[0])
    return out[0], out[1]


def router_logits(cfg: MoELayerConfig, weights: dict, x: torch.Tensor) -> torch.Tensor:
    """fp32 logits; router_logits_bf16: rounded to bf16 (the model's bf16 linear: fp32 sums, one
    rounding), which route() then scores in bf16 as the model does."""
    logits = F.linear(x.float(), weights["router.weight"].float())
    return logits.to(torch.bfloat16) if cfg.router_logits_bf16 else logits


def reference(cfg: MoELayerConfig, weights: dict, x: torch.Tensor, input_ids: torch.Tensor | None = None,
              routing: tuple | None = None) -> torch.Tensor:
    """fp32 [M, D]: sdk/reference/moe.py's route() and expert math, this rank's experts only.
    `routing` = (weights, ids) replaces the router (to check the experts on the kernel's own routing)."""
    spec = cfg.moe_spec()
    xf = x.float()
    if routing is None:
        hashed = weights["router.tid2eid"][input_ids.long()].long() if cfg.hash_routed else None
        rw, ids = route(spec, router_logits(cfg, weights, x), weights.get("router.bias"), hashed)
    else:
        rw, ids = routing
    xe = xf @ weights["latent_down.weight"].float().T if cfg.latent else xf     # the experts' input
    out = torch.zeros_like(xe)
    lo = cfg.local_start
    for e in torch.unique(ids).tolist():
        if not lo <= e < lo + cfg.local:
            continue                        # another rank's expert
        gu, dn = local_expert_weights(cfg, weights, e - lo)
        tok, slot = torch.where(ids == e)
        gate, up = F.linear(xe[tok], gu).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, cfg.activation, cfg.swiglu_limit, cfg.situ_beta, cfg.situ_linear_beta), dn)
        out.index_add_(0, tok, y * rw[tok, slot, None].float())
    if cfg.latent:
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg.latent_norm_eps)
        out = (out * weights["latent_norm.weight"].float()) @ weights["latent_up.weight"].float().T
    if cfg.shared_intermediate:
        gate = xf @ _shared_dense(cfg, weights, "shared.gate").T
        up = xf @ _shared_dense(cfg, weights, "shared.up").T
        act = swiglu(gate, up, cfg.activation, cfg.swiglu_limit, cfg.situ_beta, cfg.situ_linear_beta)
        out = out + act @ _shared_dense(cfg, weights, "shared.down").T
    return out


def reference_weights_full(cfg: MoELayerConfig, weights: dict) -> dict[str, torch.Tensor]:
    """The layer's weights in sdk/reference/moe.py's names and layout (fp32), all E experts, the
    non-local ones zero: `MoEReference(...).forward` on these equals this rank's output."""
    h, E, I = cfg.expert_hidden, cfg.num_experts, cfg.intermediate
    lo, L = cfg.local_start, cfg.local
    gu = torch.zeros(E, 2 * I, h)
    dn = torch.zeros(E, h, I)
    for e in range(L):
        gu[lo + e], dn[lo + e] = local_expert_weights(cfg, weights, e)
    w = {"gate.weight": weights["router.weight"].float(), "experts.gate_up_proj": gu, "experts.down_proj": dn}
    if cfg.correction_bias:
        w["gate.e_score_correction_bias"] = weights["router.bias"].float()
    if cfg.hash_routed:
        w["gate.tid2eid"] = weights["router.tid2eid"].long()
    if cfg.latent:
        for n in ("latent_down", "latent_norm", "latent_up"):
            w[f"{n}.weight"] = weights[f"{n}.weight"].float()
    if cfg.shared_intermediate:
        for n in ("gate", "up", "down"):
            w[f"shared_experts.{n}_proj.weight"] = _shared_dense(cfg, weights, f"shared.{n}")
    return w


def moe_reference_forward(cfg: MoELayerConfig, weights: dict, x: torch.Tensor,
                          input_ids: torch.Tensor | None = None, full: dict | None = None) -> torch.Tensor:
    """`MoEReference.forward` (the oracle class itself) on this layer, fp32. `full`: the result of
    `reference_weights_full(cfg, weights)` if already made."""
    from ..reference.common import StepInfo
    from ..reference.moe import MoEReference
    layer = types.SimpleNamespace(mlp=cfg.moe_spec())
    ref = MoEReference(None, layer, full if full is not None else reference_weights_full(cfg, weights))
    m = x.shape[0]
    ids = input_ids if input_ids is not None else torch.zeros(m, dtype=torch.long)
    step = StepInfo(start=torch.zeros(m, dtype=torch.long), positions=torch.zeros(m, 1, dtype=torch.long),
                    input_ids=ids.long().reshape(m, 1))
    return ref.forward(x.float().reshape(m, 1, -1), step).reshape(m, -1)


def weight_bytes_hit(cfg: MoELayerConfig, prog: Program, hit_local: int) -> dict:
    """The floor's bytes: router + shared weights + the hit experts' weights + activations."""
    b = blocks(cfg)
    router = b["logits"].weight_bytes() + (cfg.num_experts * 4 if cfg.correction_bias else 0)
    experts = hit_local * (b["gateup"].expert_weight_bytes() + b["down"].expert_weight_bytes())
    shared = 0
    if cfg.shared_intermediate:
        shared = b["shared_gateup"].weight_bytes() + b["shared_down"].weight_bytes()
    if cfg.latent:                          # replicated bf16 latent down/up (+ the norm weight)
        shared += b["latent_down"].weight_bytes() + b["latent_up"].weight_bytes() + 2 * cfg.latent
    act = cfg.batch * cfg.hidden * 2 * 2
    return {"router": router, "experts": int(experts), "shared": shared, "activations": act,
            "total": int(router + experts + shared + act)}


# -- compile checks (CPU, no GPU) ---------------------------------------------------------------
def moe_block_cases() -> list:
    """Representative MoE block variants (real shard shapes, every format and stage)."""
    # V4.1-Flash at batch 8 on the CUDA-core tile (its 8-token MXFP4 variants; the default there
    # is the tensor-core tile, compiled for K3 below)
    k3, v4, glm = preset("kimi_k3", 1), preset("deepseek_v41_flash", 8, expert_dtype="mxfp4", expert_mma=False), \
        preset("glm_53", 64, expert_dtype="fp8_e4m3")
    b3, b4, bg = blocks(k3), blocks(v4), blocks(glm)
    bm = blocks(preset("kimi_k3", 8, expert_dtype="mxfp4", expert_mma=True))      # the tensor-core tile
    # the staged CUDA-core tiles (opt-in): MXFP4 (GLM-5.3, Kimi K3's ragged latent rows), fp8, bf16
    bp = blocks(preset("glm_53", 1, expert_dtype="mxfp4", expert_smem_stages=3))
    bk = blocks(preset("kimi_k3", 1, expert_dtype="mxfp4", expert_smem_stages=3))
    bf = blocks(preset("glm_53", 4, expert_dtype="fp8_e4m3", expert_smem_stages=2))
    # bf16 rows are 4x the bytes: the gate/up items of the real shapes do not fit (check() says so)
    bb = {"down": ExpertsBlock(replace(bp["down"].config, weight_dtype="bf16", smem_stages=2))}
    return [b3["logits"], b3["select"], b4["select"], b3["gateup"], b4["gateup"], b4["down"], bg["gateup"], bg["down"],
            bm["gateup"], bm["down"], bp["gateup"], bp["down"], bk["gateup"], bk["down"], bf["gateup"], bf["down"],
            bb["down"]] + situ_block_cases()


def situ_block_cases() -> list:
    """Kimi K3's SiTU epilogue (GPU-tested 2026-12-03): the shared expert's gate/up
    GEMV (CUDA-core and tensor-core tiles) and the experts' gate/up stage (CUDA-core and MXFP4
    tensor-core tiles)."""
    one, eight = (blocks(preset("kimi_k3", m, activation="situ", expert_dtype="mxfp4")) for m in (1, 8))
    return [one["shared_gateup"], eight["shared_gateup"], one["gateup"], eight["gateup"]]


def moe_megakernel_cases() -> list:
    base = MoELayerConfig(hidden=1024, num_experts=64, top_k=4, intermediate=256, num_local=16, batch=8,
                          correction_bias=True, shared_intermediate=256, expert_dtype="mxfp4", swiglu_limit=10.0)
    # Kimi K3's shape of layer: Stable LatentMoE (latent down / up GEMVs) and SiTU; the staged
    # CUDA-core expert tiles (their slots in the plain tiles' arena beside the weight ring)
    # and in V4.1's lagged mHC residual (the collapse, the coefficients and the post-mix tiles)
    return [base, replace(base, swiglu_limit=None, activation="situ", latent=512),
            replace(base, batch=1, expert_smem_stages=3), replace(base, mhc="v41")]


def compile_check(archs, num_sms: int = 132, blocks_too: bool = False) -> dict:
    """Compile the MoE megakernel case(s) (and, with blocks_too, the MoE blocks' standalone
    kernels, which sdk.compile.compile_check already covers) for each arch; the report format of
    sdk.compile.compile_check ({arch: {case: seconds | "error: ..."}})."""
    from ..blocks._cute import standalone
    from ..compile import time_case
    from ..schedule import schedule
    from .kernel import compile_megakernel
    report: dict = {}
    for arch in archs:
        res = report.setdefault(arch, {})
        for block in (moe_block_cases() if blocks_too else []):
            time_case(res, f"{block.name} {block.config}", lambda: standalone(block, arch))
        for cfg in moe_megakernel_cases():
            def build(cfg=cfg):
                prog = build_program(cfg)
                compile_megakernel(prog.opcodes.blocks, num_sms, schedule(prog, num_sms).max_len, timing=True, arch=arch)
            time_case(res, f"megakernel moe_layer {cfg}", build)
    return report
