"""A whole DeepSeek-V4.1 decode step in ONE megakernel launch: every layer of the model on one GPU
(its own shard: the spec's heads and experts as they are), from the token ids to the logits.

    ids -> EmbedStreamsBlock (the embedding on the N mHC streams) -> MHCMixBlock (the first site's
           partials: layer 0's attention fn)
        -> per layer: the attention sublayer (sdk/megakernel/dsv4_layer.py) and the MoE layer
           (moe_layer.py), each in V4.1's lagged mHC site (mhc_site.py), chained site after site
           (mhc_layer.chain: a site's coef is the next one's carried pre, its post-mix computes
           the next site's mix partials)
        -> the head: the streams' collapse with the last site's pre ("carried") and the final
           norm (MHCPreBlock kind "carried") -> logits = h @ lm_head^T (fp32, a GEMV)

V4's residual (transformers' deepseek_v4: configs "tiny", "small", ...) is the same chain with
unlagged sites ("v4": each collapses with its own pre) and the weighted head: the last post-mix
computes the head fn's partials, the head (MHCPreBlock kind "head") its coefficients, the
collapse and the final norm.

Every op waits only for what it reads, so each layer's weights stream through the ring while the
layers before it compute. The caches (sliding-window rings, compressor states, compressed
entries, indexer keys) are the program's buffers, updated in place step after step.

`DSV4ModelConfig.layers()` derives each sublayer's config from the ModelSpec; `program_weights`
maps the model's canonical weights (sdk/reference) to the program's names; `DSV4ModelRunner`
(sdk/megakernel/model_runner.py) feeds each step (ids, positions, the host's RoPE tables) and runs
it on the PyVM (CPU: the blocks' torch twins) or the GPU (MegakernelRuntime).

Supported: V4.1's residual (ResidualSpec lagged_pre with the "carried" head: the configs
"tiny_v41" / "small_v41" / "full_v41") and V4's (unlagged, the weighted head), o_groups = 1 per GPU (the attention programs hold one
o_a group), the limits of each block (hidden a multiple of 1024, batch x tokens <= 64, ...).
One token per sequence a step. Not: tensor / expert parallelism across GPUs (the all-reduce and
EP programs are separate), Engram, quantised experts from the model's weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.embed import EmbedStreamsBlock, EmbedStreamsConfig
from ..blocks.gemv import GemvConfig
from ..blocks.mhc import MHCMixBlock, MHCMixConfig, MHCPreBlock, MHCPreConfig, first_site_carry, mix_rows
from ..errors import UnsupportedConfigError
from ..spec import ModelSpec
from . import dsv4_layer, moe_layer
from .mhc_layer import chain
from .mlp_stack import gemv_block
from .model_runner import MegakernelModel, ModelRunner, weights_from
from .program import Program


@dataclass(frozen=True)
class DSV4ModelConfig:
    spec: ModelSpec
    batch: int = 1
    max_seq_len: int = 64
    expert_dtype: str = "bf16"           # the routed experts' format ("bf16" = the model's weights)
    num_sms: int = 132

    @property
    def lagged(self) -> bool:
        return self.spec.residual.lagged_pre

    def check(self):
        r = self.spec.residual
        if r.kind != "mhc" or (r.lagged_pre, r.head) not in ((True, "carried"), (False, "weighted")):
            raise UnsupportedConfigError(
                f"DSV4 model program: the mHC residual of V4.1 (lagged, carried head) or V4 (unlagged, "
                f"weighted head); got {r}")
        for l in self.spec.layers:
            if l.attention.o_groups != 1:
                raise UnsupportedConfigError(f"DSV4 model program: layer {l.index} has o_groups="
                                             f"{l.attention.o_groups}; the attention program holds one o_a group")

    def layers(self) -> list[tuple]:
        """(DSV4LayerConfig, MoELayerConfig) per layer, in V4.1's mHC sites (the last one last)."""
        self.check()
        s, r = self.spec, self.spec.residual
        hc = dict(mhc="v41" if r.lagged_pre else "v4", hc_mult=r.hc_mult, hc_iters=r.sinkhorn_iters, hc_eps=r.eps)
        out = []
        for l in s.layers:
            a, m = l.attention, l.mlp
            mode = "swa" if not a.compress_ratio else ("csa" if a.indexer else "hca")
            ix = a.indexer
            attn = dsv4_layer.DSV4LayerConfig(
                heads=a.num_heads, mode=mode, batch=self.batch, tokens=1, hidden=s.hidden_size, head_dim=a.head_dim,
                q_rank=a.q_lora_rank, o_rank=a.o_lora_rank, rope=a.rope_dim, window=a.sliding_window,
                ratio=a.compress_ratio or 128, max_seq_len=self.max_seq_len, rope_theta=a.rope.theta,
                compress_rope_theta=a.compress_rope.theta, eps=s.norm_eps, num_sms=self.num_sms,
                q_head_norm=a.q_head_norm, **(dict(index_heads=ix.num_heads, index_head_dim=ix.head_dim,
                                                   index_topk=ix.topk) if ix else {}), **hc)
            moe = moe_layer.MoELayerConfig(
                hidden=s.hidden_size, num_experts=m.num_experts, top_k=m.top_k, intermediate=m.expert_intermediate_size,
                shared_intermediate=m.shared_intermediate_size if m.num_shared_experts else 0, scoring=m.scoring,
                correction_bias=m.correction_bias, n_group=m.n_group, topk_group=m.topk_group,
                norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                hash_routed=m.hash_routed, vocab=s.vocab_size if m.hash_routed else 0, swiglu_limit=m.swiglu_limit,
                activation=m.activation, situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta,
                batch=self.batch, expert_dtype=self.expert_dtype, router_dtype="bf16", num_sms=self.num_sms,
                router_logits_bf16=dict(m.extra).get("router_logits_dtype") == "model",
                norm_eps=s.norm_eps, hc_last=l.index == len(s.layers) - 1,
                hc_head_rows=0 if r.lagged_pre else r.hc_mult, **hc)
            out.append((attn, moe))
        return out

    def prefixes(self) -> list[str]:
        return [f"l{i}.{site}." for i in range(len(self.spec.layers)) for site in ("attn", "mlp")]


def build_program(cfg: DSV4ModelConfig) -> Program:
    s, B = cfg.spec, cfg.batch
    D, N, V = s.hidden_size, s.residual.hc_mult, s.vocab_size
    layers = cfg.layers()
    site = layers[0][0].site
    pro = Program()                      # the prologue: ids -> streams, the first site's partials
    pro.buffer("ids", (B,), "int32", "input")
    pro.buffer("embed", (V, D), "bf16", "weight")
    pro.buffer("hc_fn_first", (mix_rows(N), N * D), "fp32", "weight")
    pro.buffer("streams", (B, N, D), "bf16")
    pro.buffer("part", (site.slices, B, mix_rows(N) + 1), "fp32")
    emb = pro.op(EmbedStreamsBlock(EmbedStreamsConfig(vocab=V, d=D, n=N, m=B)),
                 {"ids": "ids", "table": "embed", "streams": "streams"}, label="embed")
    pro.op(MHCMixBlock(MHCMixConfig(d=D, n=N, m=B, rows=mix_rows(N), d_slice=site.d_slice, stream_dtype="bf16")),
           {"streams": "streams", "fn": "hc_fn_first", "part": "part"}, waits=[emb], label="hc_mix_first")
    sub = []
    for attn, moe in layers:
        sub += [dsv4_layer.build_program(attn), moe_layer.build_program(moe)]
    prog, last = chain(sub, cfg.prefixes(), prologue=pro)
    prog.buffer("head_norm", (D,), "fp32", "weight")
    prog.buffer("lm_head", (V, D), "bf16", "weight")
    prog.buffer("h", (B, D), "bf16")
    prog.buffer("logits", (B, V), "fp32", "output")
    head_cfg = dict(d=D, n=N, m=B, stream_dtype="bf16", out_dtype="bf16", out_eps=s.norm_eps)
    if cfg.lagged:      # V4.1: the collapse with the last site's pre
        head = prog.op(MHCPreBlock(MHCPreConfig(**head_cfg, kind="carried")),
                       {"streams": "streams", "carried": "coef", "norm_weight": "head_norm", "out": "h"},
                       waits=[last], label="head")
    else:               # V4: its own weighted pre, from the partials the last post-mix computed
        prog.buffer("hc_head_base", (N,), "fp32", "weight")
        prog.buffer("hc_head_scale", (1,), "fp32", "weight")
        prog.buffer("head_coef", (B, N), "fp32")
        head = prog.op(MHCPreBlock(MHCPreConfig(**head_cfg, kind="head", slices=site.slices, iters=s.residual.sinkhorn_iters,
                                                hc_eps=s.residual.eps, norm_eps=s.norm_eps)),
                       {"streams": "streams", "part": "part_next", "base": "hc_head_base", "scale": "hc_head_scale",
                        "norm_weight": "head_norm", "coef": "head_coef", "out": "h"}, waits=[last], label="head")
    prog.op(gemv_block(GemvConfig(n=V, k=D, m=B, out_dtype="fp32"), 0, cfg.num_sms),
            {"w": "lm_head", "x": "h", "y": "logits"}, waits=[head], label="lm_head")
    return prog


# the attention program's weights <- the model's (under layers.{i}.attn.)
ATTN_WEIGHTS = {"w_q_a": "q_a_proj.weight", "q_a_norm": "q_a_norm.weight", "w_q_b": "q_b_proj.weight",
                "w_kv": "kv_proj.weight", "kv_norm": "kv_norm.weight", "sinks": "sinks", "w_o_a": "o_a_proj.weight",
                "w_o_b": "o_b_proj.weight", "w_c_kv": "compressor.kv_proj.weight",
                "w_c_gate": "compressor.gate_proj.weight", "c_position_bias": "compressor.position_bias",
                "c_kv_norm": "compressor.kv_norm.weight", "w_i_kv": "indexer.kv_proj.weight",
                "w_i_gate": "indexer.gate_proj.weight", "i_position_bias": "indexer.position_bias",
                "i_kv_norm": "indexer.kv_norm.weight", "w_iq": "indexer.q_b_proj.weight",
                "w_iw": "indexer.weights_proj.weight"}
def program_weights(cfg: DSV4ModelConfig, weights: dict, device="cpu", prog: Program | None = None) -> dict:
    """The program's weights from the model's canonical ones (sdk/reference names), cast to the
    program's dtypes (the bf16 experts only: quantised experts are not mapped yet). `prog`: the
    program if already built (build_program(cfg) otherwise)."""
    if cfg.expert_dtype != "bf16":
        raise UnsupportedConfigError("DSV4 model program: mapping the model's weights to quantised experts "
                                     f"({cfg.expert_dtype}) is not implemented; use expert_dtype='bf16'")
    n = len(cfg.spec.layers)
    src = {"embed": "embed.weight", "hc_fn_first": "layers.0.hc_attn.fn", "head_norm": "norm.weight",
           "lm_head": "embed.weight" if cfg.spec.tie_word_embeddings else "lm_head.weight",
           "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
    for i in range(n):
        a, m = f"l{i}.attn.", f"l{i}.mlp."
        src.update({a + k: f"layers.{i}.attn.{v}" for k, v in ATTN_WEIGHTS.items()})
        src.update({m + k: f"layers.{i}.mlp.{v}" for k, v in moe_layer.MODEL_WEIGHTS.items()})
        src.update({a + "input_norm": f"layers.{i}.attn_norm.weight", a + "hc_base": f"layers.{i}.hc_attn.base",
                    a + "hc_scale": f"layers.{i}.hc_attn.scale", a + "hc_fn_next": f"layers.{i}.hc_mlp.fn",
                    m + "mlp_norm": f"layers.{i}.mlp_norm.weight", m + "hc_base": f"layers.{i}.hc_mlp.base",
                    m + "hc_scale": f"layers.{i}.hc_mlp.scale",
                    m + "hc_fn_next": f"layers.{i + 1}.hc_attn.fn" if i + 1 < n else "hc_head.fn"})
    return weights_from(src, weights, prog or build_program(cfg), device, "DSV4 model program")


class DSV4ModelRunner(ModelRunner):
    """Decode steps of the model program (model_runner.ModelRunner): the ids, each attention
    layer's start and RoPE tables, the hash-routed layers' ids; V4.1's first site carries stream 0."""

    name = "DSV4 model program"
    build_program = staticmethod(build_program)
    program_weights = staticmethod(program_weights)

    def __init__(self, cfg: DSV4ModelConfig, weights: dict, device="cpu", seed: int | None = 0):
        super().__init__(cfg, weights, device, seed)
        if "carried" in self.tensors:        # V4.1's first site: stream 0 itself
            self.tensors["carried"].copy_(first_site_carry(cfg.batch, cfg.spec.residual.hc_mult))
        # what each step's host inputs need, once: per attention layer (prefix, config, its ropes),
        # the hash-routed MoE layers' ids buffers
        from ..reference.dsv4_attention import Rope
        layers = cfg.layers()
        self._attn = [(p, attn, Rope(l.attention.rope), Rope(l.attention.compress_rope) if attn.compressed else None)
                      for (attn, _), l, p in zip(layers, cfg.spec.layers, cfg.prefixes()[::2])]
        self._hash_ids = [f"l{i}.mlp.input_ids" for i, (_, moe) in enumerate(layers) if moe.hash_routed]

    def step_inputs(self, ids: torch.Tensor) -> dict:
        """Each attention layer's start and RoPE tables, the hash-routed layers' ids."""
        out = {name: ids.to(torch.int32) for name in self._hash_ids}
        pos = self.lengths[:, None]
        start = self.lengths.to(torch.int32)
        for p, attn, rope, crope in self._attn:
            out[p + "start"] = start
            out[p + "cos"], out[p + "sin"] = rope.cos_sin(pos, torch.bfloat16)
            if crope is not None:
                out[p + "c_cos"], out[p + "c_sin"] = crope.cos_sin(pos + 1 - attn.ratio, torch.bfloat16)
                if attn.mode == "csa":
                    out[p + "i_cos"], out[p + "i_sin"] = crope.cos_sin(pos, torch.bfloat16)
        return out


class DSV4MegakernelModel(MegakernelModel):
    """The "megakernel" backend of build_megakernel for DeepSeek-V4.1 (model_runner.MegakernelModel)."""
    Config = DSV4ModelConfig
    Runner = DSV4ModelRunner
