"""A whole decode step of a plain-residual model (Kimi K3) over N GPUs, tensor parallel: ONE
megakernel launch per rank and step, the ranks joined by the in-kernel all-reduce.

Every rank runs the SAME program (the rank is data: the all-reduce's params) on the same tokens,
with its shard of every layer:

    ids -> embed (replicated table) -> x [B, D] bf16, the same bits on every rank
    per layer, the plain chain's sublayers (plain_model.py) as head / intermediate shards with
    `partial_out`: the readers of x norm it in their prologues, the last GEMV writes this rank's
    partial (no residual), and
        x += sum_r partial_r          one all-reduce op (bf16 x in place; every rank sums in rank
                                      order, so every rank's x stays bit-equal)
      - KDA: heads [r*H/N, (r+1)*H/N) (q/k/v/gate/f_b rows, conv channels, beta, A_log, dt_bias;
        f_a replicated), o_proj by its input columns
      - NoPE MLA: heads (q_b, kv_b rows; the latent cache replicated: each rank appends the same
        rows), o_proj by its input columns
      - dense MLP: gate/up rows, down columns (the Megatron split)
      - the latent MoE (Kimi K3's Stable LatentMoE): experts [r*E/N, (r+1)*E/N) - the router is
        replicated with its rows rotated so that the rank's experts come first (one program:
        local experts [0, E/N) on every rank; the top-k is a set, so the rotation changes nothing
        but the order of exact ties); the latent down replicated; the shared expert's intermediate
        sharded. Then
            routed = sum_r routed_r; zn_r = (RMSNorm(routed) * w_n)[:, rank's latent columns]
                                      all-reduce 1 (fp32 wire, the norm fused; `out_shard`)
            partial_r = shared_r + zn_r @ W_up[:, rank's latent columns]^T    (K-sharded up GEMV;
                                      the shard padded to the GEMV's 256 columns with zeros)
            x += sum_r partial_r      all-reduce 2 (fp32 wire)
    logits[:, rank's vocabulary slice] = rmsnorm(x) * norm @ lm_head[slice]^T     (vocab parallel;
                                      the host joins the slices)

Shard shapes must fit the blocks (a GEMV's K in 256s: heads x head_dim, the intermediate / N, ...);
the shared expert's and the latent's shards are zero-padded where they do not (exact: the padded
activations are 0). The model's weights are cut per rank by `shard_weights` (canonical names in,
the rank's narrower model out) and mapped by plain_model.program_weights.

Runs (`TPModelRunner`, every rank driven from one process): N ranks on the CPU (sdk.comm.vm.
MultiRankVM: the ranks interleaved at random, unsynchronised steps) and N virtual ranks on one GPU
(sdk.comm.runtime.TPRuntime with VirtualRanks: the protocol and the instruction overhead, not
NVLink). One process per GPU binds the same program to TorchSymmetricMemory views
(comm.alloc_rank_tensors); a runner for that is not written yet. Not yet: the router and the latent down
sharded (they are read whole on every rank: at Kimi K3 TP8 that is 26 + 51 MB per MoE layer and
rank), expert parallelism with the EP dispatch (sdk/megakernel/ep_moe.py), the mHC models.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.embed import EmbedStreamsBlock, EmbedStreamsConfig
from ..blocks.gemv import GemvConfig
from ..comm.ops import CommProgram
from ..errors import UnsupportedConfigError
from . import dense_layer, kda_layer, mla_layer, moe_layer
from .mhc_layer import replay
from .mlp_stack import gemv_block
from .plain_model import SUBLAYER_PROGRAMS, PlainMegakernelModel, PlainModelConfig, PlainModelRunner
from .plain_model import program_weights as plain_program_weights
from .program import Program

WHAT = "tensor-parallel model program"
K_GROUP = 256                # a GEMV's K in multiples of 32 lanes x 8 bf16


def padded(n: int) -> int:
    return -(-n // K_GROUP) * K_GROUP


@dataclass(frozen=True)
class TPModelConfig(PlainModelConfig):
    ranks: int = 2
    algo: str = "auto"                   # the all-reduces' algorithm: "auto" | "oneshot" | "twoshot"

    def split(self, n: int, what: str) -> int:
        if n % self.ranks:
            raise UnsupportedConfigError(f"{WHAT}: {what} ({n}) do not split over {self.ranks} ranks")
        return n // self.ranks

    def check(self):
        super().check()
        N = self.ranks
        if N < 1:
            raise UnsupportedConfigError(f"{WHAT}: {N} ranks")
        self.split(self.spec.vocab_size, "the vocabulary's rows")
        for l in self.spec.layers:
            m = l.mlp
            if m.kind == "moe":
                L = self.split(m.num_experts, f"layer {l.index}'s experts")
                group = m.num_experts // m.n_group
                if m.n_group > 1 and L % group:
                    raise UnsupportedConfigError(f"{WHAT}: layer {l.index}: {L} experts a rank cut its router's "
                                                 f"groups of {group} (the rotated router keeps whole groups)")
                if m.latent_size % (4 * N):
                    raise UnsupportedConfigError(f"{WHAT}: layer {l.index}'s latent {m.latent_size} does not "
                                                 f"split into 4-element columns over {N} ranks")

    def layers(self) -> list[tuple]:
        """Each rank's (attention, MLP) sublayer configs: the whole model's (PlainModelConfig) cut
        to one rank's heads, intermediate and experts, ending in partials (`partial_out`)."""
        out = []
        for l, (attn, mlp) in zip(self.spec.layers, super().layers()):
            i = l.index
            if isinstance(attn, kda_layer.KDALayerConfig):
                attn = replace(attn, heads=self.split(attn.heads, f"layer {i}'s KDA heads"), partial_out=True)
            else:
                heads = self.split(attn.attn.heads, f"layer {i}'s MLA heads")
                attn = replace(attn, attn=replace(attn.attn, heads=heads), partial_out=True)
            if isinstance(mlp, dense_layer.DenseLayerConfig):
                mlp = replace(mlp, intermediate=padded(self.split(mlp.intermediate, f"layer {i}'s intermediate")),
                              partial_out=True)
            else:
                s = self.split(mlp.shared_intermediate, f"layer {i}'s shared expert") if mlp.shared_intermediate else 0
                mlp = replace(mlp, num_local=self.split(mlp.num_experts, f"layer {i}'s experts"), rank=0,
                              shared_intermediate=padded(s) if s else 0, partial_out=True,
                              latent_shard=padded(mlp.latent // self.ranks))
            out.append((attn, mlp))
        return out


def build_program(cfg: TPModelConfig) -> tuple[Program, CommProgram]:
    """The per-rank program (identical on every rank) and its comm bindings."""
    s, B, N = cfg.spec, cfg.batch, cfg.ranks
    D, V = s.hidden_size, s.vocab_size
    prog = Program()
    comm = CommProgram(prog, N)
    prog.buffer("ids", (B,), "int32", "input")
    prog.buffer("embed", (V, D), "bf16", "weight")
    prog.buffer("x", (B, D), "bf16")
    last = prog.op(EmbedStreamsBlock(EmbedStreamsConfig(vocab=V, d=D, n=1, m=B, flat=True)),
                   {"ids": "ids", "table": "embed", "streams": "x"}, label="embed")
    for c, prefix in zip([c for pair in cfg.layers() for c in pair], cfg.prefixes()):
        sub = SUBLAYER_PROGRAMS[type(c)](c)
        for b in sub.buffers.values():
            if b.name != "x":
                prog.buffer(prefix + b.name, b.shape, b.dtype, b.role)
        base, _ = replay(prog, sub, lambda n, p=prefix: n if n == "x" else p + n, prefix, last)
        ops = {op.label: base + i for i, op in enumerate(sub.ops)}
        if isinstance(c, moe_layer.MoELayerConfig):
            last = add_moe_tail(prog, comm, c, prefix, ops, cfg.algo)
        else:
            writer = [base + i for i, op in enumerate(sub.ops) if op.bindings.get("y") == "partial"]
            last = comm.allreduce(prefix + "partial", "x", res="x", waits=writer, label=prefix + "allreduce",
                                  algo=cfg.algo, eps=s.norm_eps)
    Vr = V // N
    prog.buffer("head_norm", (D,), "bf16", "weight")
    prog.buffer("lm_head", (Vr, D), "bf16", "weight")
    prog.buffer("logits", (B, Vr), "fp32", "output")
    prog.op(gemv_block(GemvConfig(n=Vr, k=D, m=B, out_dtype="fp32", norm=True, norm_eps=s.norm_eps), 0, cfg.num_sms),
            {"w": "lm_head", "x": "x", "norm_weight": "head_norm", "y": "logits"}, waits=[last], label="lm_head")
    return prog, comm


def add_moe_tail(prog: Program, comm: CommProgram, c: moe_layer.MoELayerConfig, p: str, ops: dict,
                 algo: str) -> int:
    """After a latent MoE shard (`partial_out`): all-reduce 1 (routed, normed, this rank's latent
    columns kept), the K-sharded latent up onto the shared expert's shard, all-reduce 2 onto x.
    Returns the last op."""
    M, D, h = c.batch, c.hidden, c.latent
    prog.buffer(p + "routed_sum", (M, h), "fp32")
    prog.buffer(p + "zn", (M, c.latent_shard), "bf16")        # the padding columns stay 0
    prog.buffer(p + "partial", (M, D), "fp32")
    ar1 = comm.allreduce(p + "routed", p + "routed_sum", norm_weight=p + "latent_norm.weight", out=p + "zn",
                         waits=[ops["experts.down"]], label=p + "allreduce.routed", algo=algo, eps=c.latent_norm_eps,
                         out_shard=True)
    up = {"w": p + "latent_up.weight", "x": p + "zn", "y": p + "partial"}
    waits = [ar1]
    if c.shared_intermediate:
        up["res"] = p + "shared_out"
        waits.append(ops["shared.down"])
    u = prog.op(moe_layer.blocks(c)["latent_up"], up, waits=waits, label=p + "latent.up")
    return comm.allreduce(p + "partial", "x", res="x", waits=[u], label=p + "allreduce", algo=algo)


# -- the ranks' weights -------------------------------------------------------------------------
def _rows(w: torch.Tensor, r: int, n: int, dim: int = 0, pad_to: int = 0) -> torch.Tensor:
    """Slice r of n along `dim`, zero-padded there to `pad_to` (0: none)."""
    k = w.shape[dim] // n
    out = w.narrow(dim, r * k, k)
    if pad_to > k:
        shape = list(out.shape)
        shape[dim] = pad_to - k
        out = torch.cat([out, out.new_zeros(shape)], dim)
    return out.contiguous()


def shard_weights(cfg: TPModelConfig, weights: dict, rank: int) -> dict:
    """Rank `rank`'s model: the canonical weights (sdk/reference names) cut to its heads,
    intermediate, experts and vocabulary slice (padded as its configs are), so that
    plain_model.program_weights maps them like a narrower model's."""
    N, r, s = cfg.ranks, rank, cfg.spec
    out = dict(weights)
    head = weights.get("lm_head.weight", weights["embed.weight"]) if s.tie_word_embeddings else weights["lm_head.weight"]
    out["lm_head.weight"] = _rows(head, r, N)
    for l, (attn, mlp) in zip(s.layers, cfg.layers()):
        a, m = f"layers.{l.index}.attn.", f"layers.{l.index}.mlp."
        if l.attention.kind == "kda":
            for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "g_b_proj", "forget_gate.f_b_proj"):
                if a + n + ".weight" in weights:
                    out[a + n + ".weight"] = _rows(weights[a + n + ".weight"], r, N)
            out[a + "forget_gate.dt_bias"] = _rows(weights[a + "forget_gate.dt_bias"], r, N)
            out[a + "forget_gate.A_log"] = _rows(weights[a + "forget_gate.A_log"].reshape(-1), r, N)   # one per head
            conv = weights[a + "conv1d.weight"]
            out[a + "conv1d.weight"] = torch.cat([_rows(part, r, N) for part in conv.chunk(3)])
            out[a + "o_proj.weight"] = _rows(weights[a + "o_proj.weight"], r, N, 1)
        else:
            for n in ("q_b_proj", "kv_b_proj"):
                out[a + n + ".weight"] = _rows(weights[a + n + ".weight"], r, N)
            out[a + "o_proj.weight"] = _rows(weights[a + "o_proj.weight"], r, N, 1)
        if isinstance(mlp, dense_layer.DenseLayerConfig):
            for n in ("gate_proj", "up_proj"):
                out[m + n + ".weight"] = _rows(weights[m + n + ".weight"], r, N, 0, mlp.intermediate)
            out[m + "down_proj.weight"] = _rows(weights[m + "down_proj.weight"], r, N, 1, mlp.intermediate)
            continue
        L = mlp.local
        for n in ("gate.weight", "gate.e_score_correction_bias"):      # the rank's experts first
            if m + n in weights:
                out[m + n] = torch.roll(weights[m + n], -r * L, 0)
        for n in ("experts.gate_up_proj", "experts.down_proj"):
            out[m + n] = weights[m + n][r * L:(r + 1) * L]
        if mlp.shared_intermediate:
            se = m + "shared_experts."
            for n in ("gate_proj", "up_proj"):
                out[se + n + ".weight"] = _rows(weights[se + n + ".weight"], r, N, 0, mlp.shared_intermediate)
            out[se + "down_proj.weight"] = _rows(weights[se + "down_proj.weight"], r, N, 1, mlp.shared_intermediate)
        out[m + "latent_up.weight"] = _rows(weights[m + "latent_up.weight"], r, N, 1, mlp.latent_shard)
    return out


def program_weights(cfg: TPModelConfig, weights: dict, rank: int, device="cpu", prog: Program | None = None) -> dict:
    """Rank `rank`'s program weights from the model's canonical ones."""
    return plain_program_weights(cfg, shard_weights(cfg, weights, rank), device,
                                 prog if prog is not None else build_program(cfg)[0])


# -- the step driver ---------------------------------------------------------------------------
class TPModelRunner(PlainModelRunner):
    """Decode steps of the N ranks' programs (model_runner.ModelRunner's interface): every rank gets
    the same ids and lengths; the logits are the ranks' vocabulary slices joined. device "cpu": the
    multi-rank PyVM (ranks interleaved at random, seeded per step); "cuda": N virtual ranks on one
    GPU (TPRuntime, one launch per rank and step)."""

    name = WHAT
    build_program = staticmethod(build_program)

    def __init__(self, cfg: TPModelConfig, weights: dict, device="cpu", seed: int | None = 0, timeout_s: float = 2.0):
        from ..comm import VirtualRanks
        from ..schedule import schedule, validate
        from .program import encode
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.prog, self.comm = build_program(cfg)
        N = cfg.ranks
        self.bufs = VirtualRanks(N, self.comm.layout, self.device)
        self.tensors_per_rank = []
        for r in range(N):
            t = self.comm.alloc_rank_tensors(self.bufs, r, self.device, timeout_s)
            t.update(program_weights(cfg, weights, r, self.device, self.prog))
            self.tensors_per_rank.append(t)
        if self.device.type == "cpu":
            from ..comm.vm import MultiRankVM
            sched = schedule(self.prog, 8)
            validate(self.prog, sched.per_sm)
            words, lengths = encode(self.prog, sched.per_sm)
            self.vm = MultiRankVM(self.prog, words, lengths, self.tensors_per_rank, sched.per_sm)
        else:
            from ..comm.runtime import TPRuntime
            self.rt = TPRuntime(self.prog, self.comm, self.bufs, self.tensors_per_rank, num_sms=cfg.num_sms,
                                timeout_s=timeout_s, device=self.device)
        self.tensors = self.tensors_per_rank[0]
        self.lengths = torch.zeros(cfg.batch, dtype=torch.long)
        self.steps = 0
        self.paged = []
        self.set_paged([p for (attn, _), p in zip(cfg.layers(), cfg.prefixes()[::2])
                        if isinstance(attn, mla_layer.MLALayerConfig)])
        for t in self.rank_tensors():
            for p in self.paged:
                t[p + "cos"].fill_(1)
                t[p + "sin"].zero_()

    def rank_tensors(self) -> list[dict]:
        return self.tensors_per_rank

    def launch(self) -> None:
        if self.device.type == "cpu":
            self.vm.run(1, seed=None if self.seed is None else self.seed + self.steps)
        else:
            self.rt.run()

    def logits(self) -> torch.Tensor:
        return torch.cat([t["logits"] for t in self.tensors_per_rank], dim=1).clone()



class TPMegakernelModel(PlainMegakernelModel):
    """The "megakernel" backend of build_megakernel for Kimi K3 with tp=N (model_runner.MegakernelModel;
    every rank driven from this process)."""
    Config = TPModelConfig
    Runner = TPModelRunner
