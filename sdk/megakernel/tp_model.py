"""A whole decode step of a model over N GPUs, tensor parallel: ONE megakernel launch per rank and
step, the ranks joined by the in-kernel all-reduce - Kimi K3 (the plain residual: TPModelConfig),
GLM-5.3 and DeepSeek-V4.1 (the mHC residual: TPMHCModelConfig).

Every rank runs the SAME program (the rank is data: the collectives' params) on the same tokens,
with its shard of every layer:

    ids -> embed (replicated table) -> the residual state, the same bits on every rank
    per layer, each sublayer cut to the rank's share (`TPShards.shard`):
      - KDA: heads [r*H/N, (r+1)*H/N) (q/k/v/gate/f_b rows, conv channels, beta, A_log, dt_bias;
        f_a / g_a replicated), o_proj by its input columns
      - MLA: heads (q_b, kv_b rows; the latent cache replicated: each rank appends the same rows),
        o_proj by its input columns; GLM-5.3's DSA likewise, its indexer replicated (every rank
        computes the same list)
      - V4 attention (V4.1): the query heads (q_b rows, sinks); the one kv head, the compressors,
        the indexer and the sliding window replicated; the rank's heads inside one o_a group (N a
        multiple of o_groups): that group's o_a rows (its heads' columns of them) and o_b columns;
        or whole groups on each rank (o_groups a multiple of N): their o_a rows and o_b columns
      - dense MLP: gate/up rows, down columns (the Megatron split)
      - MoE (moe_layer.build_tp_shard): experts [r*E/N, (r+1)*E/N), the shared expert's
        intermediate, the router's rows: logits = gather_r(router rows_r(x)), an all-gather
        rotated so that this rank's experts come first - every rank's program selects local
        experts [0, E/N) (the top-k is a set: only the order of exact ties could change); where
        E / N is not whole 8-row groups of the GEMV (GLM-5.3 TP8: 36), or router_gather=False,
        every rank reads the whole router with its rows rotated instead; a hash-routed layer's
        table of expert ids is rotated alike
    and its output is this rank's partial, which one collective op adds up:
      - plain (plain_model.py's chain, `partial_out`): the readers of x norm it in their
        prologues, the last GEMV writes the partial without the residual, then
            x += sum_r partial_r      (bf16 x in place; every rank sums in rank order: bit-equal)
        Kimi K3's latent MoE inside its sublayer: z = gather_r(latent_down rows_r(norm(x)));
        routed_r = its experts' sum on z; zn_r = (RMSNorm(sum_r routed_r) * w_n)[:, its latent
        columns] (an all-reduce with the norm fused, `out_shard`); partial_r = shared_r +
        zn_r @ W_up[:, its columns]^T (the K-sharded up, its shard zero-padded to 256)
      - mHC (mhc_model.py's chain of sites): each site's post-mix becomes the all-reduce of the
        sublayer's output with the post-mix epilogue - the streams updated from the ranks' sum,
        the next site's mix partials fused (AllReduceConfig.mhc_streams)
    logits[:, rank's vocabulary slice] = head @ lm_head[slice]^T     (vocab parallel; the host
                                      joins the slices)

Every collective waits for the one before it (`Collectives`: the receive buffers' two colors need
it; CommProgram checks it); one inside a sublayer is inserted before its first reader, which
waits for it. Shard shapes must fit the blocks (a GEMV's K in 256s: heads x head_dim, the
intermediate / N, ...); the dense MLP's, the shared expert's and the latent's shards are
zero-padded where they do not (exact: the padded activations are 0). The model's weights are cut
per rank by `shard_weights` (canonical names in, the rank's narrower model out) and mapped by the
model program's own program_weights.

Runs (`TPRunner`, every rank driven from one process): N ranks on the CPU (sdk.comm.vm.MultiRankVM:
the ranks interleaved at random, unsynchronised steps) and N virtual ranks on one GPU
(sdk.comm.runtime.TPRuntime with VirtualRanks: the protocol and the instruction overhead, not
NVLink). One process per GPU binds the same program to TorchSymmetricMemory views
(comm.alloc_rank_tensors); a runner for that is not written yet. Not yet: expert parallelism with
the EP dispatch (ep_moe.py) in the whole model (tokens per rank instead of the same tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.embed import EmbedStreamsBlock, EmbedStreamsConfig
from ..blocks.mhc import MHCPostBlock
from ..comm.ops import CommProgram, MHCEpilogue
from ..errors import UnsupportedConfigError
from . import dense_layer, dsa_layer, kda_layer, mla_layer, moe_layer
from .mhc_model import MHCMegakernelModel, MHCModelConfig, MHCModelRunner
from .mhc_model import build_program as mhc_build_program
from .mhc_layer import op_waits
from .plain_model import SUBLAYER_PROGRAMS, PlainMegakernelModel, PlainModelConfig, PlainModelRunner, add_lm_head
from .program import Program, fitted_sublayers
from .runtime import check_buffers

WHAT = "tensor-parallel model program"
K_GROUP = 256                # a GEMV's K in multiples of 32 lanes x 8 bf16


def padded(n: int) -> int:
    return -(-n // K_GROUP) * K_GROUP


@dataclass(frozen=True)
class TPShards:
    """The tensor-parallel fields of a model program's config and the cut of its sublayers."""
    ranks: int = 2
    algo: str = "auto"                   # the all-reduces' algorithm: "auto" | "oneshot" | "twoshot"
    router_gather: bool = True           # MoELayerConfig.router_gather

    @property
    def vocab_rows(self) -> int:
        """The lm_head rows of one rank (vocabulary parallel; the host joins the logits)."""
        return self.spec.vocab_size // self.ranks

    def o_groups_ok(self, groups: int) -> bool:
        """V4 attention: each rank's heads inside one o_a group (N a multiple of o_groups), or whole
        groups on each rank (o_groups a multiple of N)."""
        return self.ranks % groups == 0 or groups % self.ranks == 0

    def split(self, n: int, what: str) -> int:
        if n % self.ranks:
            raise UnsupportedConfigError(f"{WHAT}: {what} ({n}) do not split over {self.ranks} ranks")
        return n // self.ranks

    def check(self):
        super().check()                  # the model program's own (the class after TPShards)
        self.check_tp()

    def layers(self) -> list[tuple]:
        """Each rank's (attention, MLP) sublayer configs: the whole model's cut to one rank's heads,
        intermediate and experts (`shard`)."""
        return [self.shard(l.index, a, m, partial=self.partial_outputs)
                for l, (a, m) in zip(self.spec.layers, super().layers())]

    def check_tp(self):
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

    def shard(self, i: int, attn, mlp, partial: bool) -> tuple:
        """Layer i's (attention, MLP) sublayer configs cut to one rank's heads, intermediate and
        experts; `partial`: the plain chain's sublayers end in partials (`partial_out`; an mHC
        site's end in its post-mix, which the program makes the all-reduce's epilogue)."""
        out = dict(partial_out=True) if partial else {}
        if isinstance(attn, kda_layer.KDALayerConfig):
            attn = replace(attn, heads=self.split(attn.heads, f"layer {i}'s KDA heads"), **out)
        elif isinstance(attn, mla_layer.MLALayerConfig):
            attn = replace(attn, attn=replace(attn.attn, heads=self.split(attn.attn.heads, f"layer {i}'s MLA heads")),
                           **out)
        elif isinstance(attn, dsa_layer.DSALayerConfig):     # the indexer replicated: every rank's same list
            a = attn.mla.attn
            attn = replace(attn, mla=replace(attn.mla, attn=replace(a, heads=self.split(a.heads, f"layer {i}'s heads"))))
        else:       # V4's attention: its query heads and their o_a groups (one, or a share of them);
                    # the one kv head, compressor and indexer replicated
            attn = replace(attn, heads=self.split(attn.heads, f"layer {i}'s query heads"),
                           o_groups=max(1, attn.o_groups // self.ranks))
        if isinstance(mlp, dense_layer.DenseLayerConfig):
            mlp = replace(mlp, intermediate=padded(self.split(mlp.intermediate, f"layer {i}'s intermediate")), **out)
        else:
            s = self.split(mlp.shared_intermediate, f"layer {i}'s shared expert") if mlp.shared_intermediate else 0
            mlp = replace(mlp, num_local=self.split(mlp.num_experts, f"layer {i}'s experts"), rank=0,
                          shared_intermediate=padded(s) if s else 0, partial_out=True, tp_ranks=self.ranks,
                          router_gather=self.router_gather)
        return attn, mlp


@dataclass(frozen=True)
class TPModelConfig(TPShards, PlainModelConfig):
    partial_outputs = True               # the plain chain's sublayers end in partials (`partial_out`)


@dataclass(frozen=True)
class TPMHCModelConfig(TPShards, MHCModelConfig):
    partial_outputs = False              # an mHC site ends in its post-mix (made the all-reduce's epilogue)


def build_program(cfg: TPModelConfig) -> tuple[Program, CommProgram]:
    """The per-rank program (identical on every rank) and its comm bindings."""
    s, B, N = cfg.spec, cfg.batch, cfg.ranks
    D, V = s.hidden_size, s.vocab_size
    configs = [c for pair in cfg.layers() for c in pair]
    prefixes = list(cfg.prefixes())
    made = {}

    def build_sub(c):
        try:
            return SUBLAYER_PROGRAMS[type(c)](c)
        except UnsupportedConfigError as exc:
            prefix = prefixes[configs.index(c)]
            raise UnsupportedConfigError(f"{WHAT}: {prefix.rstrip('.')} ({type(c).__name__}) cut for {N} ranks: "
                                         f"{exc}") from exc

    def whole(subs):
        prog = Program()
        comm = made["comm"] = CommProgram(prog, N)
        prog.buffer("ids", (B,), "int32", "input")
        prog.buffer("embed", (V, D), "bf16", "weight")
        prog.buffer("x", (B, D), "bf16")
        last = prog.op(EmbedStreamsBlock(EmbedStreamsConfig(vocab=V, d=D, n=1, m=B, flat=True)),
                       {"ids": "ids", "table": "embed", "streams": "x"}, label="embed")
        chain = Collectives(prog, comm, cfg.algo)
        for c, prefix, sub in zip(configs, prefixes, subs):
            for b in sub.buffers.values():
                if b.name != "x":
                    prog.buffer(prefix + b.name, b.shape, b.dtype, b.role)
            inner = {}
            if isinstance(c, moe_layer.MoELayerConfig):
                prog.buffer(prefix + "routed_sum", (B, c.latent), "fp32")
                inner = moe_collectives(prefix, c)
            _, written = chain.replay(sub, lambda n, p=prefix: n if n == "x" else p + n, prefix, last, inner)
            last = chain.allreduce(prefix + "partial", "x", res="x", waits=[written[prefix + "partial"]],
                                   label=prefix + "allreduce", eps=s.norm_eps)
        add_lm_head(prog, cfg, V // N, last)
        return prog

    prog = fitted_sublayers(configs, build_sub, whole, cfg.num_sms)
    return prog, made["comm"]


def moe_collectives(p: str, latent: moe_layer.MoELayerConfig | None = None) -> dict:
    """The collectives inside an MoE shard under prefix p (moe_layer.build_tp_shard; `latent`: the
    latent MoE's config): the buffer its ops read -> (the buffer the collective reads, how to add it)."""
    out = {p + "logits": (p + "logits_shard", lambda ch, waits: ch.allgather(
        p + "logits_shard", p + "logits", rotate=True, waits=waits, label=p + "gather.logits"))}
    if latent is not None:
        out[p + "z"] = (p + "z_shard", lambda ch, waits: ch.allgather(
            p + "z_shard", p + "z", waits=waits, label=p + "gather.z"))
        out[p + "zn"] = (p + "routed", lambda ch, waits: ch.allreduce(
            p + "routed", p + "routed_sum", norm_weight=p + "latent_norm.weight", out=p + "zn", waits=waits,
            label=p + "allreduce.routed", eps=latent.latent_norm_eps, out_shard=True))
    return out


class Collectives:
    """The program's collectives in one chain: each waits (besides its input's writer) for the one
    before it - what the all-reduces' two alternating buffer colors need (sdk/comm/ops.py: a rank
    reuses a color only after every peer has flagged the collective in between, which a peer
    does only after it finished reading the color's previous use)."""

    def __init__(self, prog: Program, comm: CommProgram, algo: str):
        self.prog, self.comm, self.algo = prog, comm, algo
        self.last: int | None = None

    def _chained(self, waits) -> list:
        return list(waits) + ([self.last] if self.last is not None and self.last not in waits else [])

    def allreduce(self, partial, resid_out, *, waits, label, **kw) -> int:
        self.last = self.comm.allreduce(partial, resid_out, waits=self._chained(waits), label=label, algo=self.algo,
                                        **kw)
        return self.last

    def allgather(self, shard, out, *, waits, label, rotate=False) -> int:
        self.last = self.comm.allgather(shard, out, rotate=rotate, waits=self._chained(waits), label=label)
        return self.last

    def replay(self, sub: Program, name, prefix: str, after: int | None, inner: dict) -> tuple[list, dict]:
        """sub's ops appended (buffers renamed by `name`; ops waiting for nothing wait for
        `after`), each collective of `inner` added just before the first op reading its output,
        which then waits for it; an mHC post-mix (MHCPostBlock) becomes the all-reduce of its y
        with the post-mix epilogue. Returns (the op of each of sub's ops, {buffer: the op that
        last wrote it})."""
        waits = op_waits(sub)
        index, written, added = [], {}, {}
        for i, op in enumerate(sub.ops):
            binds = {k: name(v) for k, v in op.bindings.items() if v is not None}
            w = [index[j] for j in waits[i]] or ([after] if after is not None else [])
            outputs = {spec.name for spec in op.block.operand_specs() if spec.output}
            for operand, buf in binds.items():
                # a collective's output read - unless an op of the sublayer wrote it itself
                if buf in inner and operand not in outputs and buf not in written:
                    if buf not in added:
                        src, add = inner[buf]
                        added[buf] = add(self, [written[src]])
                    w.append(added[buf])
            if isinstance(op.block, MHCPostBlock):
                c = op.block.config
                epi = MHCEpilogue(streams=binds["streams"], coef=binds["coef"], streams_out=binds["streams_out"],
                                  fn_next=binds.get("fn_next"), part_next=binds.get("part_next"), d_slice=c.d_slice,
                                  round_coef=c.round_coef)
                index.append(self.allreduce(binds["y"], None, mhc=epi, waits=w, label=prefix + "allreduce"))
            else:
                index.append(self.prog.op(op.block, binds, waits=w, label=prefix + op.label))
            written.update({binds[n]: index[-1] for n in outputs if n in binds})
        return index, written


# -- the ranks' weights -------------------------------------------------------------------------
def _rows(w: torch.Tensor, r: int, n: int, dim: int = 0, pad_to: int = 0) -> torch.Tensor:
    """Slice r of n along `dim`, zero-padded there to `pad_to` (0: none)."""
    k = w.shape[dim] // n
    out = w.narrow(dim, r * k, k)
    if pad_to > k:
        shape = list(out.shape)
        shape[dim] = pad_to - k
        return torch.cat([out, out.new_zeros(shape)], dim)
    return out.clone(memory_format=torch.contiguous_format)     # its own storage: a view may be unaligned


def shard_weights(cfg: TPShards, weights: dict, rank: int) -> dict:
    """Rank `rank`'s model: the canonical weights (sdk/reference names) cut to its heads,
    intermediate, experts and vocabulary slice (padded as its configs are), so that the model
    program's own program_weights maps them like a narrower model's."""
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
        elif l.attention.kind == "dsv4":
            # the rank's heads lie in o_a group g (N / G ranks a group): that group's o_a rows, its
            # heads' columns of them, and the group's o_b columns - o_b(o_a_r(o_r)) summed over the
            # ranks is the model's o_b(grouped o_a(o)) (G = 1: o_b read whole on every rank)
            for n in ("q_b_proj.weight", "sinks"):
                out[a + n] = _rows(weights[a + n], r, N)
            G, R = l.attention.o_groups, l.attention.o_lora_rank
            if G >= N:      # whole groups a rank: groups [r G / N, (r + 1) G / N), every column of their o_a rows
                rows = slice(r * (G // N) * R, (r + 1) * (G // N) * R)
                out[a + "o_a_proj.weight"] = weights[a + "o_a_proj.weight"][rows].contiguous()
                out[a + "o_b_proj.weight"] = weights[a + "o_b_proj.weight"][:, rows].contiguous()
            else:
                per = N // G
                g = r // per
                out[a + "o_a_proj.weight"] = _rows(weights[a + "o_a_proj.weight"][g * R:(g + 1) * R], r % per, per, 1)
                out[a + "o_b_proj.weight"] = weights[a + "o_b_proj.weight"][:, g * R:(g + 1) * R].contiguous()
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
        gate = weights[m + "gate.weight"]          # its experts' rows, or all rotated: its experts first
        out[m + "gate.weight"] = gate[r * L:(r + 1) * L] if mlp.router_outputs == L else torch.roll(gate, -r * L, 0)
        if m + "gate.e_score_correction_bias" in weights:       # the gathered logits' order: its experts first
            out[m + "gate.e_score_correction_bias"] = torch.roll(weights[m + "gate.e_score_correction_bias"], -r * L, 0)
        if m + "gate.tid2eid" in weights:                       # hash routing, in that order too
            out[m + "gate.tid2eid"] = (weights[m + "gate.tid2eid"] - r * L) % mlp.num_experts
        if mlp.latent:
            out[m + "latent_down.weight"] = _rows(weights[m + "latent_down.weight"], r, N)
        for n in ("experts.gate_up_proj", "experts.down_proj"):
            out[m + n] = weights[m + n][r * L:(r + 1) * L]
        if mlp.shared_intermediate:
            se = m + "shared_experts."
            for n in ("gate_proj", "up_proj"):
                out[se + n + ".weight"] = _rows(weights[se + n + ".weight"], r, N, 0, mlp.shared_intermediate)
            out[se + "down_proj.weight"] = _rows(weights[se + "down_proj.weight"], r, N, 1, mlp.shared_intermediate)
        if mlp.latent:
            out[m + "latent_up.weight"] = _rows(weights[m + "latent_up.weight"], r, N, 1, mlp.latent_shard)
    return out


def build_mhc_program(cfg: TPMHCModelConfig) -> tuple[Program, CommProgram]:
    """The per-rank program of an mHC model (GLM-5.3): mhc_model.build_program over the rank's
    site shards, each post-mix made the all-reduce of the sublayer's partial output with the
    post-mix epilogue (the streams updated from the ranks' sum, the next site's mix partials
    fused), the MoE's router logits gathered; the vocabulary-parallel head."""
    made = {}

    def fresh():                         # a new program and comm program for each assembly
        prog = Program()
        comm = made["comm"] = CommProgram(prog, cfg.ranks)
        chain = Collectives(prog, comm, cfg.algo)

        def replay_ops(out, sub, name, prefix, after):
            return chain.replay(sub, name, prefix, after, moe_collectives(prefix))[0]
        return prog, replay_ops

    prog = mhc_build_program(cfg, fresh=fresh)
    return prog, made["comm"]


# -- the step drivers --------------------------------------------------------------------------
class TPRunner:
    """Decode steps of the N ranks' programs (model_runner.ModelRunner's interface, mixed into a
    model's runner): every rank gets the same ids and host inputs; the logits are the ranks'
    vocabulary slices joined. device "cpu": the multi-rank PyVM (ranks interleaved at random,
    seeded per step); "cuda": N virtual ranks on one GPU (TPRuntime, one launch per rank a step)."""

    name = WHAT

    def __init__(self, cfg, weights: dict, device="cpu", seed: int | None = 0, timeout_s: float = 2.0):
        from ..comm import VirtualRanks
        from ..schedule import schedule, validate
        from .program import encode
        self.cfg, self.device, self.seed = cfg, torch.device(device), seed
        self.prog, self.comm = self.build_program(cfg)
        N = cfg.ranks
        self.bufs = VirtualRanks(N, self.comm.layout, self.device)
        self.tensors_per_rank = []
        for r in range(N):
            t = self.comm.alloc_rank_tensors(self.bufs, r, self.device, timeout_s)
            t.update(self.program_weights(cfg, shard_weights(cfg, weights, r), self.device, self.prog))
            self.tensors_per_rank.append(t)
        if self.device.type == "cpu":
            from ..comm.vm import MultiRankVM
            for t in self.tensors_per_rank:     # what each rank's GPU runtime checks (MegakernelRuntime)
                check_buffers(self.prog, t, "cpu")
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
        self.init_model(cfg)

    def rank_tensors(self) -> list[dict]:
        return self.tensors_per_rank

    def launch(self) -> None:
        if self.device.type == "cpu":
            self.vm.run(1, seed=None if self.seed is None else self.seed + self.steps)
        else:
            self.rt.run()

    def logits(self) -> torch.Tensor:
        return torch.cat([t["logits"] for t in self.tensors_per_rank], dim=1).clone()


class TPModelRunner(TPRunner, PlainModelRunner):
    build_program = staticmethod(build_program)


class TPMHCModelRunner(TPRunner, MHCModelRunner):
    build_program = staticmethod(build_mhc_program)


class TPMegakernelModel(PlainMegakernelModel):
    """The "megakernel" backend of build_megakernel for Kimi K3 with tp=N (model_runner.MegakernelModel;
    every rank driven from this process)."""
    Config = TPModelConfig
    Runner = TPModelRunner


class TPMHCMegakernelModel(MHCMegakernelModel):
    """The "megakernel" backend for GLM-5.3 and DeepSeek-V4.1 with tp=N (every rank driven from this
    process)."""
    Config = TPMHCModelConfig
    Runner = TPMHCModelRunner
