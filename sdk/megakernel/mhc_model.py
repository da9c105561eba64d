"""A whole decode step of an mHC model (DeepSeek-V4.1, DeepSeek-V4, GLM-5.3) in ONE megakernel launch:
every layer of the model on one GPU (its own shard: the spec's heads and experts as they are),
from the token ids to the logits.

    ids -> EmbedStreamsBlock (the embedding on the N mHC streams) -> MHCMixBlock (the first site's
           partials: layer 0's attention fn)
        -> per layer: the attention sublayer - V4's (dsv4_layer.py), KDA (kda_layer.py) or GLM-5.3's
           DSA MLA (dsa_layer.py) - and the MLP - the MoE (moe_layer.py) or a dense one
           (dense_layer.py) - each in its mHC site (mhc_site.py), chained site after site
           (mhc_layer.chain: a site's post-mix computes the next site's mix partials; V4.1's
           lagged sites: its coef is the next one's carried pre)
        -> the head -> logits = h @ lm_head^T (fp32, a GEMV)

The head is the model's: V4.1's collapses with the last site's pre ("carried"), V4's computes its
own weighted pre from the partials the last post-mix computed ("head"), GLM-5.3's takes the
streams' mean ("mean"); each with the final norm (MHCPreBlock). A GLM-5.3 DSA layer whose indexer
is "shared" has no indexer: its decode reads the list the previous layer's indexer wrote (the
chain links the two `index` buffers; that indexer's top-k precedes this layer's first op through
the sites in between).

Every op waits only for what it reads, so each layer's weights stream through the ring while the
layers before it compute. The caches (sliding-window rings, compressor states, compressed
entries, indexer keys and pools, KDA states, paged latent caches) are the program's buffers,
updated in place step after step.

`MHCModelConfig.layers()` derives each sublayer's config from the ModelSpec; `program_weights`
maps the model's canonical weights (sdk/reference) to the program's names; `MHCModelRunner`
(sdk/megakernel/model_runner.py) feeds each step (ids, positions, the host's RoPE tables, the
paged layers' lengths) and runs it on the PyVM (CPU: the blocks' torch twins) or the GPU
(MegakernelRuntime).

Supported: V4.1's residual (ResidualSpec lagged_pre with the "carried" head: the configs
"tiny_v41" / "small_v41" / "full_v41"), V4's (unlagged, the weighted head) and GLM-5.3's
(unlagged, the mean head); V4 attention with any o_groups (a grouped o_a GEMV: one GPU holds
every group; over N ranks each holds one group or N / o_groups of them); KDA; GLM-5.3's NoPE DSA MLA; dense MLPs and the MoE; the limits of each block (hidden a
multiple of 1024, batch x tokens <= 64, ...). One token per sequence a step; the routed experts
in bf16, fp8 or MXFP4 (`expert_dtype`: quantised from the model's weights at load). Not: tensor /
expert parallelism across GPUs (the all-reduce and EP programs are separate), Engram.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.embed import EmbedStreamsBlock, EmbedStreamsConfig
from ..blocks.gemv import GemvConfig
from ..blocks.mhc import MHCMixBlock, MHCMixConfig, MHCPreBlock, MHCPreConfig, first_site_carry, mix_rows
from ..errors import UnsupportedConfigError
from . import dense_layer, dsa_layer, dsv4_layer, kda_layer, mla_layer, moe_layer
from .mhc_layer import chain
from .mlp_stack import gemv_block
from .model_runner import MegakernelModel, ModelConfig, ModelRunner, getter, head_source, mlp_sources, weights_from
from .program import Program, fitted_sublayers

WHAT = "mHC model program"
HEADS = {(True, "carried"), (False, "weighted"), (False, "mean")}      # (lagged_pre, head)


@dataclass(frozen=True)
class MHCModelConfig(ModelConfig):
    @property
    def lagged(self) -> bool:
        return self.spec.residual.lagged_pre

    def check(self):
        r = self.spec.residual
        if r.kind != "mhc" or (r.lagged_pre, r.head) not in HEADS:
            raise UnsupportedConfigError(
                f"{WHAT}: the mHC residual of V4.1 (lagged, carried head), V4 (unlagged, weighted head) or "
                f"GLM-5.3 (unlagged, mean head); got {r}")
        for l in self.spec.layers:
            a, m = l.attention, l.mlp
            if a.kind not in ("dsv4", "kda", "dsa_mla"):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} attention {a.kind!r} "
                                             "(supported: dsv4, kda, dsa_mla)")
            if a.kind == "dsv4" and not self.o_groups_ok(a.o_groups):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} has o_groups={a.o_groups}; over N "
                                             "tensor-parallel ranks a rank holds one o_a group or whole groups "
                                             "(N a multiple of o_groups, or o_groups a multiple of N)")
            if a.kind == "kda" and a.conv_activation != "silu":
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} KDA conv activation {a.conv_activation!r} "
                                             "(the KDA op's short conv is SiLU)")
            if a.kind == "dsa_mla" and (a.attention_bias or a.output_gate):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} DSA MLA with a bias or an output gate")
            if m.kind not in ("moe", "dense"):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} MLP {m.kind!r} (supported: dense, moe)")

    def o_groups_ok(self, groups: int) -> bool:
        """Whether a V4 attention layer's o_groups fit the program (one GPU: all of them)."""
        return True

    def layers(self) -> list[tuple]:
        """(attention config, MLP config) per layer, each in its mHC site (the last one last)."""
        self.check()
        s, r, B = self.spec, self.spec.residual, self.batch
        hc = dict(mhc="v41" if r.lagged_pre else "v4", hc_mult=r.hc_mult, hc_iters=r.sinkhorn_iters, hc_eps=r.eps)
        out = []
        for l in s.layers:
            a, m = l.attention, l.mlp
            if a.kind == "dsv4":
                mode = "swa" if not a.compress_ratio else ("csa" if a.indexer else "hca")
                ix = a.indexer
                attn = dsv4_layer.DSV4LayerConfig(
                    heads=a.num_heads, mode=mode, batch=B, tokens=1, hidden=s.hidden_size, head_dim=a.head_dim,
                    q_rank=a.q_lora_rank, o_rank=a.o_lora_rank, o_groups=a.o_groups, rope=a.rope_dim,
                    window=a.sliding_window,
                    ratio=a.compress_ratio or 128, max_seq_len=self.max_seq_len, rope_theta=a.rope.theta,
                    compress_rope_theta=a.compress_rope.theta, eps=s.norm_eps, num_sms=self.num_sms,
                    q_head_norm=a.q_head_norm, **(dict(index_heads=ix.num_heads, index_head_dim=ix.head_dim,
                                                       index_topk=ix.topk) if ix else {}), **hc)
            elif a.kind == "kda":
                attn = kda_layer.from_spec(a, s.hidden_size, s.norm_eps, B, self.num_sms, **hc)
            else:
                attn = self._dsa(a, **hc)
            if m.kind == "dense":
                mlp = dense_layer.DenseLayerConfig(
                    hidden=s.hidden_size, intermediate=m.intermediate_size, batch=B, activation=m.activation,
                    situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta, swiglu_limit=m.swiglu_limit,
                    eps=s.norm_eps, num_sms=self.num_sms, **hc)
            else:
                mlp = moe_layer.MoELayerConfig(
                    hidden=s.hidden_size, num_experts=m.num_experts, top_k=m.top_k,
                    intermediate=m.expert_intermediate_size,
                    shared_intermediate=m.shared_intermediate_size if m.num_shared_experts else 0, scoring=m.scoring,
                    correction_bias=m.correction_bias, n_group=m.n_group, topk_group=m.topk_group,
                    norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                    hash_routed=m.hash_routed, vocab=s.vocab_size if m.hash_routed else 0,
                    swiglu_limit=m.swiglu_limit, activation=m.activation, situ_beta=m.situ_beta,
                    situ_linear_beta=m.situ_linear_beta, latent=m.latent_size, latent_norm_eps=m.latent_norm_eps,
                    batch=B, expert_dtype=self.expert_dtype, num_sms=self.num_sms,
                    # V4's gate weight is bf16 (its router computes in the activations' dtype); GLM-5.3 keeps it fp32
                    router_dtype="fp32" if r.head == "mean" else "bf16",
                    router_logits_bf16=dict(m.extra).get("router_logits_dtype") == "model", norm_eps=s.norm_eps, **hc)
            out.append((attn, mlp))
        # the last site: no next site's partials (V4's weighted head: the head fn's)
        attn, mlp = out[-1]
        out[-1] = (attn, replace(mlp, hc_last=True, hc_head_rows=r.hc_mult if r.head == "weighted" else 0))
        return out

    def _dsa(self, a, **hc) -> dsa_layer.DSALayerConfig:
        """GLM-5.3's DSA MLA layer (NoPE, the k-pool indexer; "shared": the previous layer's list)."""
        s, ix = self.spec, a.indexer
        mla = mla_layer.MLALayerConfig(self.paged_attention(a, rope=0), hidden=s.hidden_size, q_lora=a.q_lora_rank, rope_mode="none",
                                       eps=a.latent_norm_eps, input_eps=s.norm_eps, **hc)
        return dsa_layer.DSALayerConfig(mla, index_heads=ix.num_heads, index_head_dim=ix.head_dim, index_topk=ix.topk,
                                        kpool=ix.kpool, select_tail=ix.select_tail, shared=ix.shared)

    def index_links(self) -> dict:
        """A shared DSA layer's `index` -> the list its previous layer's indexer writes."""
        out = {}
        for i, l in enumerate(self.spec.layers):
            ix = getattr(l.attention, "indexer", None)
            if l.attention.kind == "dsa_mla" and ix.shared:
                out[f"l{i}.attn.index"] = f"l{i - 1}.attn.index"
        return out


SUBLAYER_PROGRAMS = {dsv4_layer.DSV4LayerConfig: dsv4_layer.build_program, kda_layer.KDALayerConfig:
                     kda_layer.build_program, dsa_layer.DSALayerConfig: dsa_layer.build_program,
                     dense_layer.DenseLayerConfig: dense_layer.build_program,
                     moe_layer.MoELayerConfig: moe_layer.build_program}


def build_sublayer(c) -> Program:
    return SUBLAYER_PROGRAMS[type(c)](c)


def build_program(cfg: MHCModelConfig, fresh=None) -> Program:
    """The whole model's program. fresh() -> (out, replay_ops): mhc_layer.chain's, a new pair for
    each assembly (the tensor-parallel program: its comm program, the post-mixes made
    all-reduces - sdk/megakernel/tp_model.py)."""
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

    def whole(sub):
        out, replay_ops = fresh() if fresh else (None, None)
        prog, last = chain(sub, cfg.prefixes(), prologue=pro, aliases=cfg.index_links(), out=out,
                           replay_ops=replay_ops)
        add_head(prog, cfg, last)
        return prog
    return fitted_sublayers([c for pair in layers for c in pair], build_sublayer, whole, cfg.num_sms)


def add_head(prog: Program, cfg: MHCModelConfig, last: int) -> None:
    """The final collapse of the streams (V4.1: with the last site's pre; V4: its own weighted pre;
    GLM-5.3: their mean) and the (vocabulary-parallel) lm_head, after op `last`."""
    s, B = cfg.spec, cfg.batch
    D, N = s.hidden_size, s.residual.hc_mult
    site = cfg.layers()[0][0].site
    Vr = cfg.vocab_rows
    prog.buffer("head_norm", (D,), "fp32", "weight")
    prog.buffer("lm_head", (Vr, D), "bf16", "weight")
    prog.buffer("h", (B, D), "bf16")
    prog.buffer("logits", (B, Vr), "fp32", "output")
    head_cfg = dict(d=D, n=N, m=B, stream_dtype="bf16", out_dtype="bf16", out_eps=s.norm_eps)
    kind = {"carried": "carried", "weighted": "head", "mean": "mean"}[s.residual.head]
    bind = {"streams": "streams", "norm_weight": "head_norm", "out": "h"}
    if kind == "carried":       # V4.1: the collapse with the last site's pre
        bind["carried"] = "coef"
    else:                       # V4: its own weighted pre, from the partials the last post-mix computed; GLM: 1/N
        prog.buffer("head_coef", (B, N), "fp32")
        bind["coef"] = "head_coef"
    if kind == "head":
        prog.buffer("hc_head_base", (N,), "fp32", "weight")
        prog.buffer("hc_head_scale", (1,), "fp32", "weight")
        bind.update({"part": "part_next", "base": "hc_head_base", "scale": "hc_head_scale"})
        head_cfg.update(slices=site.slices, iters=s.residual.sinkhorn_iters, hc_eps=s.residual.eps,
                        norm_eps=s.norm_eps)
    head = prog.op(MHCPreBlock(MHCPreConfig(**head_cfg, kind=kind)), bind, waits=[last], label="head")
    prog.op(gemv_block(GemvConfig(n=Vr, k=D, m=B, out_dtype="fp32"), 0, cfg.num_sms),
            {"w": "lm_head", "x": "h", "y": "logits"}, waits=[head], label="lm_head")


# V4's attention program's weights <- the model's (under layers.{i}.attn.)
DSV4_ATTN_WEIGHTS = {"w_q_a": "q_a_proj.weight", "q_a_norm": "q_a_norm.weight", "w_q_b": "q_b_proj.weight",
                     "w_kv": "kv_proj.weight", "kv_norm": "kv_norm.weight", "sinks": "sinks",
                     "w_o_a": "o_a_proj.weight", "w_o_b": "o_b_proj.weight", "w_c_kv": "compressor.kv_proj.weight",
                     "w_c_gate": "compressor.gate_proj.weight", "c_position_bias": "compressor.position_bias",
                     "c_kv_norm": "compressor.kv_norm.weight", "w_i_kv": "indexer.kv_proj.weight",
                     "w_i_gate": "indexer.gate_proj.weight", "i_position_bias": "indexer.position_bias",
                     "i_kv_norm": "indexer.kv_norm.weight", "w_iq": "indexer.q_b_proj.weight",
                     "w_iw": "indexer.weights_proj.weight"}


def _attn_weights(attn, get) -> dict:
    """The attention program's weights (but its input norm and site) from the model's: get(local name)."""
    if isinstance(attn, dsv4_layer.DSV4LayerConfig):
        return {k: get(v, required=False) for k, v in DSV4_ATTN_WEIGHTS.items()}
    if isinstance(attn, kda_layer.KDALayerConfig):
        return kda_layer.weights_from_model(attn, get)
    return dsa_layer.weights_from_model(attn, get)


def program_weights(cfg: MHCModelConfig, weights: dict, device="cpu", prog: Program | None = None) -> dict:
    """The program's weights from the model's canonical ones (sdk/reference names), cast to the
    program's dtypes, the routed experts in cfg.expert_dtype (quantised from the model's weights
    when the program's are: fp8 e4m3 or MXFP4). `prog`: the program if already built
    (build_program(cfg) otherwise)."""
    n = len(cfg.spec.layers)
    src = {"embed": "embed.weight", "hc_fn_first": "layers.0.hc_attn.fn", "head_norm": "norm.weight",
           "lm_head": head_source(cfg.spec, weights),
           "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"}
    for i, (attn, mlp) in enumerate(cfg.layers()):
        a, m, layer = f"l{i}.attn.", f"l{i}.mlp.", f"layers.{i}."
        # (V4's layers share one name table: a weight of another mode is not required)
        src.update({a + k: v for k, v in _attn_weights(attn, getter(weights, layer + "attn.", WHAT)).items()
                    if v is not None})
        src.update({m + k: v for k, v in mlp_sources(mlp, weights, layer, WHAT).items()})
        src.update({a + "input_norm": layer + "attn_norm.weight", a + "hc_base": layer + "hc_attn.base",
                    a + "hc_scale": layer + "hc_attn.scale", a + "hc_fn_next": layer + "hc_mlp.fn",
                    m + "mlp_norm": layer + "mlp_norm.weight", m + "hc_base": layer + "hc_mlp.base",
                    m + "hc_scale": layer + "hc_mlp.scale",
                    m + "hc_fn_next": f"layers.{i + 1}.hc_attn.fn" if i + 1 < n else "hc_head.fn"})
    return weights_from(src, weights, prog or build_program(cfg), device, WHAT)


class MHCModelRunner(ModelRunner):
    """Decode steps of the model program (model_runner.ModelRunner): the ids, each V4 attention
    layer's start and RoPE tables, the DSA layers' paged caches (ModelRunner.set_paged), the
    hash-routed layers' ids; V4.1's first site carries stream 0."""

    name = WHAT
    build_program = staticmethod(build_program)
    program_weights = staticmethod(program_weights)

    def init_model(self, cfg: MHCModelConfig) -> None:
        for t in self.rank_tensors():
            if "carried" in t:              # V4.1's first site: stream 0 itself
                t["carried"].copy_(first_site_carry(cfg.batch, cfg.spec.residual.hc_mult))
        # what each step's host inputs need, once: per V4 attention layer (prefix, config, its
        # ropes), the DSA layers' prefixes, the hash-routed MoE layers' ids buffers
        from ..reference.dsv4_attention import Rope
        layers = cfg.layers()
        attn = list(zip((a for a, _ in layers), cfg.spec.layers, cfg.prefixes()[::2]))
        self._dsv4 = [(p, a, Rope(l.attention.rope), Rope(l.attention.compress_rope) if a.compressed else None)
                      for a, l, p in attn if isinstance(a, dsv4_layer.DSV4LayerConfig)]
        self.set_paged([p for a, _, p in attn if isinstance(a, dsa_layer.DSALayerConfig)])
        self._hash_ids = [f"l{i}.mlp.input_ids" for i, (_, m) in enumerate(layers)
                          if isinstance(m, moe_layer.MoELayerConfig) and m.hash_routed]

    def step_inputs(self, ids: torch.Tensor) -> dict:
        """Each V4 attention layer's start and RoPE tables, the hash-routed layers' ids."""
        out = {name: ids.to(torch.int32) for name in self._hash_ids}
        pos = self.lengths[:, None]
        start = self.lengths.to(torch.int32)
        for p, attn, rope, crope in self._dsv4:
            out[p + "start"] = start
            out[p + "cos"], out[p + "sin"] = rope.cos_sin(pos, torch.bfloat16)
            if crope is not None:
                out[p + "c_cos"], out[p + "c_sin"] = crope.cos_sin(pos + 1 - attn.ratio, torch.bfloat16)
                if attn.mode == "csa":
                    out[p + "i_cos"], out[p + "i_sin"] = crope.cos_sin(pos, torch.bfloat16)
        return out


class MHCMegakernelModel(MegakernelModel):
    """The "megakernel" backend of build_megakernel for the mHC models (model_runner.MegakernelModel)."""
    Config = MHCModelConfig
    Runner = MHCModelRunner
