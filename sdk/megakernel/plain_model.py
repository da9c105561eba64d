"""A whole decode step of a plain-residual model (Kimi K3) in ONE megakernel launch: every layer on
one GPU (its own shard: the spec's heads and experts as they are), from the token ids to the logits.

    ids -> EmbedStreamsBlock (flat: the embedding rows into the hidden state x [B, D] bf16)
        -> per layer: the attention sublayer (KDA: kda_layer.py, or NoPE MLA: mla_layer.py) and the
           MLP sublayer (dense: dense_layer.py, or the latent MoE: moe_layer.py), each with
           `resid_in_place`: its input norm fused into the GEMVs that read x, its last op adding
           its output onto x in place (bf16, as the model's hidden state is)
        -> logits = rmsnorm(x) * norm @ lm_head^T (fp32; one GEMV, the final norm in its prologue)

`chain` joins the sublayer programs: x is the one buffer they share, every other buffer is
prefixed (`l{i}.attn.`, `l{i}.mlp.`), and each sublayer's first ops (those waiting for nothing:
the readers of x) wait for the previous sublayer's writer of x. Each sublayer's writer of x waits
(through its chain of ops) for every op of its sublayer, so x is never rewritten under a reader.
Every op waits only for what it reads, so each layer's weights stream through the ring while the
layers before it compute. The caches (KDA's conv and recurrent states, MLA's paged latent cache)
are program buffers, updated in place step after step.

`PlainModelConfig.layers()` derives each sublayer's config from the ModelSpec; `program_weights`
maps the model's canonical weights (sdk/reference names) to the program's; `PlainModelRunner`
(model_runner.py) feeds each step (ids, each MLA layer's lengths, RoPE'd MLA layers' rotation
tables) and runs it on the PyVM or the GPU; `PlainMegakernelModel` is the `megakernel` backend for kimi_k3.

Supported: the plain residual, KDA and MLA attention (with q_lora, no bias, no output gate; NoPE as
Kimi K3's, or RoPE'd - interleaved pairs or halves, YaRN - as DeepSeek-V3's),
dense MLPs and the latent MoE (Kimi K3's Stable LatentMoE; learned routing), the limits of each
block (hidden a multiple of 1024, batch <= 64, ...), one token per sequence a step; the routed
experts in bf16, fp8 or MXFP4 (`expert_dtype`: quantised from the model's weights at load). Not:
the non-latent MoE in place (its experts read x unnormed). Tensor parallel over N
GPUs: tp_model.py (the same sublayers as shards ending in partials, and the all-reduces).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..blocks.embed import EmbedStreamsBlock, EmbedStreamsConfig
from ..blocks.gemv import GemvConfig
from ..errors import UnsupportedConfigError
from . import dense_layer, kda_layer, mla_layer, moe_layer
from .mhc_layer import replay
from .mlp_stack import gemv_block
from .model_runner import MegakernelModel, ModelConfig, ModelRunner, getter, head_source, mlp_sources, weights_from
from .program import Program, fitted_sublayers

WHAT = "plain model program"


@dataclass(frozen=True)
class PlainModelConfig(ModelConfig):
    def check(self):
        s = self.spec
        if s.residual.kind != "plain":
            raise UnsupportedConfigError(f"{WHAT}: the plain residual (Kimi K3); got {s.residual.kind!r} "
                                         "(mHC models: sdk/megakernel/mhc_model.py)")
        for l in s.layers:
            a, m = l.attention, l.mlp
            if a.kind not in ("kda", "mla"):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} attention {a.kind!r} (supported: kda, mla)")
            if a.kind == "kda" and a.conv_activation != "silu":
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} KDA conv activation {a.conv_activation!r} "
                                             "(the KDA op's short conv is SiLU)")
            if a.kind == "mla":
                bad = [f for f, on in (("q_lora_rank None", not a.q_lora_rank), ("attention_bias", a.attention_bias),
                                       ("output_gate", a.output_gate)) if on]
                if bad:
                    raise UnsupportedConfigError(f"{WHAT}: layer {l.index} MLA with {', '.join(bad)} (supported: "
                                                 "MLA with q_lora, no bias, no output gate - Kimi K3's, DeepSeek-V3's)")
            if m.kind == "moe" and (not m.latent_size or m.hash_routed):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} MoE without the latent (or hash-routed): "
                                             "the in-place MoE is the latent one (Kimi K3's)")
            if m.kind not in ("moe", "dense"):
                raise UnsupportedConfigError(f"{WHAT}: layer {l.index} MLP {m.kind!r} (supported: dense, moe)")

    def layers(self) -> list[tuple]:
        """(attention config, MLP config) per layer, each with resid_in_place."""
        self.check()
        s, B = self.spec, self.batch
        out = []
        for l in s.layers:
            a, m = l.attention, l.mlp
            if a.kind == "kda":
                attn = kda_layer.from_spec(a, s.hidden_size, s.norm_eps, B, self.num_sms, resid_in_place=True)
            else:
                # NoPE (Kimi K3) keeps the rope columns unrotated; RoPE'd MLA (DeepSeek-V3 style, YaRN
                # included) rotates them with the host's per-step tables (PlainModelRunner.step_inputs)
                r = a.rope
                rope = dict(rope_mode="none") if r is None else dict(
                    rope_mode="interleaved" if r.interleaved else "halves", rope_theta=r.theta, rope_scaling=r.scaling)
                attn = mla_layer.MLALayerConfig(self.paged_attention(a, rope=a.qk_rope_head_dim), hidden=s.hidden_size,
                                                q_lora=a.q_lora_rank, eps=a.latent_norm_eps, input_eps=s.norm_eps,
                                                resid_in_place=True, **rope)
            act = dict(activation=m.activation, situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta,
                       swiglu_limit=m.swiglu_limit)
            if m.kind == "dense":
                mlp = dense_layer.DenseLayerConfig(hidden=s.hidden_size, intermediate=m.intermediate_size, batch=B,
                                                   eps=s.norm_eps, resid_in_place=True, num_sms=self.num_sms, **act)
            else:
                mlp = moe_layer.MoELayerConfig(
                    hidden=s.hidden_size, num_experts=m.num_experts, top_k=m.top_k,
                    intermediate=m.expert_intermediate_size,
                    shared_intermediate=m.shared_intermediate_size if m.num_shared_experts else 0,
                    scoring=m.scoring, correction_bias=m.correction_bias, n_group=m.n_group, topk_group=m.topk_group,
                    norm_topk_prob=m.norm_topk_prob, routed_scaling_factor=m.routed_scaling_factor,
                    latent=m.latent_size, latent_norm_eps=m.latent_norm_eps, batch=B, expert_dtype=self.expert_dtype,
                    router_dtype="fp32", norm_eps=s.norm_eps, resid_in_place=True, num_sms=self.num_sms, **act)
            out.append((attn, mlp))
        return out



def chain(progs: list, prefixes, prologue: Program | None = None) -> tuple[Program, int]:
    """The program of `resid_in_place` sublayer programs run one after the other on the hidden
    state x, after `prologue` (which writes x; its buffers keep their names; None: x is the
    program's input). Returns (program, the last sublayer's writer of x)."""
    out = Program()
    for prog, prefix in ([(prologue, "")] if prologue else []) + list(zip(progs, prefixes)):
        for b in prog.buffers.values():
            n = b.name if b.name == "x" else prefix + b.name
            if n in out.buffers:
                have = out.buffers[n]
                if (have.shape, have.dtype) != (b.shape, b.dtype):
                    raise ValueError(f"plain_model.chain: {prefix or 'the prologue'}'s {b.name!r} is "
                                     f"{b.dtype}{list(b.shape)}, the chain's {have.dtype}{list(have.shape)}")
                continue
            out.buffer(n, b.shape, b.dtype, b.role)
    last = replay(out, prologue, lambda n: n, "", None)[1] if prologue else None
    for k, (prog, prefix) in enumerate(zip(progs, prefixes)):
        writers = [i for i, op in enumerate(prog.ops) if op.bindings.get("y") == "x"]
        if len(writers) != 1:
            raise ValueError(f"plain_model.chain: sublayer {k} ({prefix}) has {len(writers)} ops writing x "
                             "(want one: its config's resid_in_place)")
        base, _ = replay(out, prog, lambda n, p=prefix: n if n == "x" else p + n, prefix, last)
        last = base + writers[0]
    return out, last


SUBLAYER_PROGRAMS = {kda_layer.KDALayerConfig: kda_layer.build_program, mla_layer.MLALayerConfig: mla_layer.build_program,
                     dense_layer.DenseLayerConfig: dense_layer.build_program,
                     moe_layer.MoELayerConfig: moe_layer.build_program}


def build_sublayer(c) -> Program:
    return SUBLAYER_PROGRAMS[type(c)](c)


def build_program(cfg: PlainModelConfig) -> Program:
    s, B = cfg.spec, cfg.batch
    D, V = s.hidden_size, s.vocab_size

    pro = Program()                      # the prologue: ids -> x
    pro.buffer("ids", (B,), "int32", "input")
    pro.buffer("embed", (V, D), "bf16", "weight")
    pro.buffer("x", (B, D), "bf16")
    pro.op(EmbedStreamsBlock(EmbedStreamsConfig(vocab=V, d=D, n=1, m=B, flat=True)),
           {"ids": "ids", "table": "embed", "streams": "x"}, label="embed")

    def whole(sub):
        prog, last = chain(sub, cfg.prefixes(), pro)
        add_lm_head(prog, cfg, V, last)
        return prog
    return fitted_sublayers([c for pair in cfg.layers() for c in pair], build_sublayer, whole, cfg.num_sms)


def add_lm_head(prog: Program, cfg, rows: int, last: int) -> None:
    """The final norm fused into the lm_head GEMV over `rows` of the vocabulary (a rank's slice
    when vocabulary parallel), after op `last`: x -> logits [B, rows] fp32."""
    s = cfg.spec
    prog.buffer("head_norm", (s.hidden_size,), "bf16", "weight")
    prog.buffer("lm_head", (rows, s.hidden_size), "bf16", "weight")
    prog.buffer("logits", (cfg.batch, rows), "fp32", "output")
    prog.op(gemv_block(GemvConfig(n=rows, k=s.hidden_size, m=cfg.batch, out_dtype="fp32", norm=True,
                                  norm_eps=s.norm_eps), 0, cfg.num_sms),
            {"w": "lm_head", "x": "x", "norm_weight": "head_norm", "y": "logits"}, waits=[last], label="lm_head")


def program_weights(cfg: PlainModelConfig, weights: dict, device="cpu", prog: Program | None = None) -> dict:
    """The program's weights from the model's canonical ones (sdk/reference names), cast to the
    program's dtypes, the routed experts in cfg.expert_dtype (quantised from the model's weights
    when the program's are: fp8 e4m3 or MXFP4). `prog`: the program if already built
    (build_program(cfg) otherwise)."""
    src = {"embed": "embed.weight", "head_norm": "norm.weight", "lm_head": head_source(cfg.spec, weights)}
    for i, (attn, mlp) in enumerate(cfg.layers()):
        a, m, layer = f"l{i}.attn.", f"l{i}.mlp.", f"layers.{i}."
        get = getter(weights, layer + "attn.", WHAT)
        src[a + "input_norm"] = layer + "attn_norm.weight"
        module = kda_layer if isinstance(attn, kda_layer.KDALayerConfig) else mla_layer
        src.update({a + k: v for k, v in module.weights_from_model(attn, get).items()})
        src[m + "mlp_norm"] = layer + "mlp_norm.weight"
        src.update({m + k: v for k, v in mlp_sources(mlp, weights, layer, WHAT).items()})
    return weights_from(src, weights, prog or build_program(cfg), device, WHAT)


class PlainModelRunner(ModelRunner):
    """Decode steps of the model program (model_runner.ModelRunner): the ids, the MLA layers' paged
    caches (ModelRunner.set_paged) and, for RoPE'd MLA, each step's rotation tables of the new
    tokens' positions; NoPE's identity rotation is set once."""

    name = WHAT
    build_program = staticmethod(build_program)
    program_weights = staticmethod(program_weights)

    def init_model(self, cfg) -> None:
        """The MLA layers: their paged caches, NoPE's identity rotation, RoPE'd layers' configs."""
        mla = [(attn, p) for (attn, _), p in zip(cfg.layers(), cfg.prefixes()[::2])
               if isinstance(attn, mla_layer.MLALayerConfig)]
        self.set_paged([p for _, p in mla])
        self.roped = [(attn, p) for attn, p in mla if attn.rope is not None]
        for t in self.rank_tensors():
            for attn, p in mla:
                if attn.rope is None:
                    t[p + "cos"].fill_(1)
                    t[p + "sin"].zero_()

    def step_inputs(self, ids):
        """RoPE'd MLA layers: cos / sin of the new tokens' positions (the reference's tables)."""
        out = {}
        for attn, p in self.roped:
            out[p + "cos"], out[p + "sin"] = mla_layer.rope_tables(attn, self.lengths[:, None])
        return out


class PlainMegakernelModel(MegakernelModel):
    """The "megakernel" backend of build_megakernel for Kimi K3 (model_runner.MegakernelModel)."""
    Config = PlainModelConfig
    Runner = PlainModelRunner
