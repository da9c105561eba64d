"""A DeepSeek-V4 attention sublayer of one GPU's head shard in ONE megakernel launch - the sliding
window (SWA) and heavily compressed (HCA) layers: the input RMSNorm fused into the projections,
the q / kv norms and RoPE, the compression of the new tokens, the split-KV attention over the
window + new tokens + compressed entries with the sinks, the ring write, and the grouped output
projection with the residual add.

    x (bf16 [M, D], M = B * T: the residual stream entering the sublayer)
    q_a    = GEMV(rmsnorm(x) * input_norm, W_q_a)                   [M, Q]
    q_raw  = GEMV(rmsnorm(q_a) * q_a_norm, W_q_b)                   [M, H, hd]
    kv_raw = GEMV(rmsnorm(x) * input_norm, W_kv)                    [M, hd]
    q, new_kv = DSV4Prologue(q_raw, kv_raw)        per-head norm + RoPE, kv_norm + RoPE
    HCA:  c_kv, c_gate = GEMV(rmsnorm(x) * input_norm, W_c_kv / W_c_gate)          [M, hd] each
          comp = DSV4Compress(c_kv, c_gate, state)  pooled entries of the windows this call closes
          comp = DSV4CompressNorm(comp)             their kv_norm + RoPE, in place
    o_part, lse_part = DSV4Decode(q, window, new_kv, comp)          (waits for the prologue and the compressor)
    out    = DSV4Combine(o_part, lse_part, sinks)                   [B, T, H, hd] (un-roped)
    window = DSV4RingWrite(new_kv)                                  (after the decode read the old ring)
    o_lat  = GEMV(out, W_o_a)                                       [M, R]  (the shard's one o_a group)
    resid  = x + GEMV(o_lat, W_o_b)                                 (fp32; the row-parallel o_b's
                                                                      all-reduce is the TP program's)

`reference()` is sdk/reference/dsv4_attention.py's DSV4AttentionReference.forward on bf16(rmsnorm(x)
* input_norm) with the model's bf16 weights, plus the residual. Supported: the shard holds one
o_a group (V4.1-Flash TP8: 8 heads = one of 8 groups); CSA layers need the indexer's chain (its
projections, compressor, scores and top-k) in the program: not yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..blocks.dsv4_attention import (DSV4CombineBlock, DSV4CombineConfig, DSV4DecodeBlock, DSV4DecodeConfig,
                                     DSV4RingWriteBlock, DSV4RingWriteConfig, choose_splits)
from ..blocks.dsv4_compress import DSV4CompressConfig, compressor_blocks
from ..blocks.dsv4_prologue import DSV4PrologueBlock, DSV4PrologueConfig
from ..blocks.gemv import GemvConfig, balanced_configs
from .mlp_stack import gemv_block
from .program import Program


@dataclass(frozen=True)
class DSV4LayerConfig:
    heads: int = 8                       # this GPU's query heads (V4.1-Flash TP8: 8)
    mode: str = "hca"                    # "swa" | "hca"
    batch: int = 1
    tokens: int = 1
    hidden: int = 4096
    head_dim: int = 512
    q_rank: int = 1024                   # q_lora_rank
    o_rank: int = 1024                   # o_lora_rank of the shard's o_a group
    rope: int = 64
    window: int = 128
    ratio: int = 128                     # HCA compress ratio
    max_seq_len: int = 4096
    rope_theta: float = 10000.0          # the main rope (q, the window's kv)
    compress_rope_theta: float = 160000.0   # the compressed entries' rope
    eps: float = 1e-6
    num_splits: int = 0                  # 0: choose_splits
    decode_stages: int = 0               # the decode core's pipeline stages (0: its auto; build_program
                                         # lowers them until the projections' weight ring fits beside)
    num_sms: int = 132
    x_gemv_rows: int = 0                 # rows per tile of the GEMVs that read x (they run side by
                                         # side); 0: balanced_configs cuts them alike

    @property
    def tokens_total(self) -> int:
        return self.batch * self.tokens

    @property
    def max_entries(self) -> int:
        return max(1, self.max_seq_len // self.ratio)

    @property
    def spec(self):
        """The DSV4AttentionSpec the sublayer computes (what `reference()` runs)."""
        from ..spec import DSV4AttentionSpec, RopeSpec
        return DSV4AttentionSpec(num_heads=self.heads, head_dim=self.head_dim, q_lora_rank=self.q_rank,
                                 rope_dim=self.rope, sliding_window=self.window,
                                 compress_ratio=self.ratio if self.mode == "hca" else 0, o_groups=1,
                                 o_lora_rank=self.o_rank, rope=RopeSpec(dim=self.rope, theta=self.rope_theta, interleaved=True),
                                 compress_rope=RopeSpec(dim=self.rope, theta=self.compress_rope_theta, interleaved=True),
                                 norm_eps=self.eps)

    def splits(self) -> int:
        keys = self.window + self.tokens + (self.max_entries if self.mode == "hca" else 0)
        return self.num_splits or choose_splits(self.batch, keys, self.num_sms)

    def blocks(self) -> dict:
        """The non-GEMV blocks of the program."""
        from ..errors import UnsupportedConfigError
        if self.mode not in ("swa", "hca"):
            raise UnsupportedConfigError(f"DSV4 layer: mode {self.mode!r} (supported: swa, hca; CSA needs the "
                                         f"indexer's chain in the program, not yet)")
        B, T, H, hd = self.batch, self.tokens, self.heads, self.head_dim
        S = self.splits()
        out = {"prologue": DSV4PrologueBlock(DSV4PrologueConfig(heads=H, head_dim=hd, rope=self.rope, batch=B,
                                                                tokens=T, eps=self.eps)),
               "decode": DSV4DecodeBlock(DSV4DecodeConfig(heads=H, mode=self.mode, batch=B, q_tokens=T, head_dim=hd,
                                                          window=self.window, ratio=self.ratio if self.mode == "hca" else 1,
                                                          max_entries=self.max_entries, num_splits=S,
                                                          stages=self.decode_stages)),
               "combine": DSV4CombineBlock(DSV4CombineConfig(heads=H, batch=B, q_tokens=T, head_dim=hd,
                                                             num_splits=S, rope_dim=self.rope)),
               "ring": DSV4RingWriteBlock(DSV4RingWriteConfig(batch=B, q_tokens=T, head_dim=hd, window=self.window))}
        if self.mode == "hca":
            out["compress"], out["compress_norm"] = compressor_blocks(DSV4CompressConfig(
                dim=hd, ratio=self.ratio, rope=self.rope, batch=B, tokens=T, max_entries=self.max_entries, eps=self.eps))
        return out

    def weight_shapes(self) -> dict:
        D, H, hd, Q, R = self.hidden, self.heads, self.head_dim, self.q_rank, self.o_rank
        w = {"input_norm": ((D,), "bf16"), "w_q_a": ((Q, D), "bf16"), "q_a_norm": ((Q,), "bf16"),
             "w_q_b": ((H * hd, Q), "bf16"), "w_kv": ((hd, D), "bf16"), "kv_norm": ((hd,), "bf16"),
             "sinks": ((H,), "fp32"), "w_o_a": ((R, H * hd), "bf16"), "w_o_b": ((D, R), "bf16")}
        if self.mode == "hca":
            w.update({"w_c_kv": ((hd, D), "bf16"), "w_c_gate": ((hd, D), "bf16"),
                      "c_position_bias": ((self.ratio, hd), "fp32"), "c_kv_norm": ((hd,), "bf16")})
        return w


RECORDS_MARGIN = 4096     # smem the kernel's instruction records take beside the ring


def build_program(cfg: DSV4LayerConfig) -> Program:
    """The sublayer's program with the deepest decode pipeline (its auto, then 4 .. 2 stages) that
    leaves the projections' weight ring 2 stages of shared memory (the decode tile of 8 heads x 512
    takes ~187 KB at its auto depth); else the ring's error."""
    from dataclasses import replace

    from ..blocks.base import ring_geometry
    from ..errors import UnsupportedConfigError
    err = None
    for st in ((cfg.decode_stages,) if cfg.decode_stages else (0, 4, 3, 2)):
        try:
            prog = _build(replace(cfg, decode_stages=st))
            ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)
            return prog
        except UnsupportedConfigError as exc:
            err = exc
    raise err


def _build(cfg: DSV4LayerConfig) -> Program:
    B, T, M, D, H, hd = cfg.batch, cfg.tokens, cfg.tokens_total, cfg.hidden, cfg.heads, cfg.head_dim
    blk = cfg.blocks()
    dec = blk["decode"]
    prog = Program()
    prog.buffer("x", (M, D), "bf16", "input")
    for name, shape in (("start", (B,)),):
        prog.buffer(name, shape, "int32", "input")
    r2 = max(cfg.rope // 2, 1)
    for name in ("cos", "sin", "c_cos", "c_sin"):          # host tables: main rope at the tokens, compress rope
        prog.buffer(name, (B, T, r2), "bf16", "input")      # at the window each token would close
    for name, (shape, dtype) in cfg.weight_shapes().items():
        prog.buffer(name, shape, dtype, "weight")
    prog.buffer("window", (B, cfg.window, hd), "bf16", "input")            # read, then written in place
    for name, shape, dtype in (("q_a", (M, cfg.q_rank), "bf16"), ("q_raw", (M, H, hd), "bf16"),
                               ("kv_raw", (M, hd), "bf16"), ("q", (B, T, H, hd), "bf16"), ("new_kv", (B, T, hd), "bf16"),
                               ("o_part", (B, dec.groups, dec.config.num_splits, dec.rows, hd), "fp32"),
                               ("lse_part", (B, dec.groups, dec.config.num_splits, dec.rows), "fp32"),
                               ("out", (B, T, H, hd), "bf16"), ("o_lat", (M, cfg.o_rank), "bf16")):
        prog.buffer(name, shape, dtype)
    prog.buffer("resid", (M, D), "fp32", "output")

    def gemv(n, k, rows=0, **kw):
        return gemv_block(GemvConfig(n=n, k=k, m=M, norm_eps=cfg.eps, **kw), rows, cfg.num_sms)

    x_rows = [cfg.q_rank, hd] + ([hd, hd] if cfg.mode == "hca" else [])      # q_a, kv (c_kv, c_gate)
    rows = cfg.x_gemv_rows or balanced_configs([GemvConfig(n=n, k=D, m=M, norm=True, norm_eps=cfg.eps)
                                                for n in x_rows], cfg.num_sms)[0].rows_per_tile

    def from_x(n, w, y, label):
        return prog.op(gemv(n, D, rows, norm=True), {"w": w, "x": "x", "norm_weight": "input_norm", "y": y}, label=label)

    qa = from_x(cfg.q_rank, "w_q_a", "q_a", "v4.q_a")
    kv = from_x(hd, "w_kv", "kv_raw", "v4.kv")
    qb = prog.op(gemv(H * hd, cfg.q_rank, norm=True), {"w": "w_q_b", "x": "q_a", "norm_weight": "q_a_norm", "y": "q_raw"},
                 waits=[qa], label="v4.q_b")
    pro = prog.op(blk["prologue"], {"q_raw": "q_raw", "kv_raw": "kv_raw", "kv_norm": "kv_norm", "cos": "cos",
                                    "sin": "sin", "q": "q", "new_kv": "new_kv"}, waits=[qb, kv], label="v4.prologue")
    dbind = {"q": "q", "window": "window", "new_kv": "new_kv", "start": "start", "o_part": "o_part",
             "lse_part": "lse_part"}
    dwaits = [pro]
    if cfg.mode == "hca":
        prog.buffer("c_kv", (M, hd), "bf16")
        prog.buffer("c_gate", (M, hd), "bf16")
        prog.buffer("state_kv", (B, cfg.ratio, hd), "bf16", "input")        # the compressor's open window
        prog.buffer("state_gate", (B, cfg.ratio, hd), "fp32", "input")
        prog.buffer("comp", (B, cfg.max_entries, hd), "bf16", "input")      # entries, appended in place
        ckv = from_x(hd, "w_c_kv", "c_kv", "v4.c_kv")
        cg = from_x(hd, "w_c_gate", "c_gate", "v4.c_gate")
        pool = prog.op(blk["compress"], {"kv": "c_kv", "gate": "c_gate", "position_bias": "c_position_bias",
                                         "start": "start", "state_kv": "state_kv", "state_gate": "state_gate",
                                         "entries": "comp"}, waits=[ckv, cg], label="v4.compress")
        comp = prog.op(blk["compress_norm"], {"kv_norm": "c_kv_norm", "cos": "c_cos", "sin": "c_sin", "start": "start",
                                              "entries": "comp"}, waits=[pool], label="v4.comp_norm")
        dbind["comp"] = "comp"
        dwaits.append(comp)
    core = prog.op(dec, dbind, waits=dwaits, label="v4.decode")
    comb = prog.op(blk["combine"], {"o_part": "o_part", "lse_part": "lse_part", "sinks": "sinks", "cos": "cos",
                                    "sin": "sin", "out": "out"}, waits=[core], label="v4.combine")
    prog.op(blk["ring"], {"new_kv": "new_kv", "start": "start", "window": "window"}, waits=[core], label="v4.ring")
    oa = prog.op(gemv(cfg.o_rank, H * hd), {"w": "w_o_a", "x": "out", "y": "o_lat"}, waits=[comb], label="v4.o_a")
    prog.op(gemv(D, cfg.o_rank, out_dtype="fp32", residual="bf16"), {"w": "w_o_b", "x": "o_lat", "res": "x", "y": "resid"},
            waits=[oa], label="v4.o_b")
    return prog


def make_weights(cfg: DSV4LayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, (shape, dtype) in cfg.weight_shapes().items():
        if name.endswith("norm"):
            x = 1 + 0.1 * torch.randn(*shape, generator=g, device=device)
        elif name in ("sinks", "c_position_bias"):
            x = 0.5 * torch.randn(*shape, generator=g, device=device)
        else:
            x = torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5
        w[name] = x.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    return w


def make_inputs(cfg: DSV4LayerConfig, starts, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """x, the caches of sequences with `starts` tokens before this call (random ring rows and
    entries; the compressor's open window random), start and the host's rope tables."""
    from ..reference.dsv4_attention import Rope
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, hd = cfg.batch, cfg.tokens, cfg.head_dim
    start = torch.tensor(starts, dtype=torch.int32, device=device)
    pos = start.long()[:, None] + torch.arange(T, device=device)
    spec = cfg.spec
    cos, sin = Rope(spec.rope).cos_sin(pos, torch.bfloat16)
    c_cos, c_sin = Rope(spec.compress_rope).cos_sin(pos + 1 - cfg.ratio, torch.bfloat16)
    t = {"x": torch.randn(cfg.tokens_total, cfg.hidden, generator=g, device=device).to(torch.bfloat16),
         "start": start, "cos": cos, "sin": sin, "c_cos": c_cos, "c_sin": c_sin,
         "window": torch.randn(B, cfg.window, hd, generator=g, device=device).to(torch.bfloat16)}
    if cfg.mode == "hca":
        t.update({"state_kv": torch.randn(B, cfg.ratio, hd, generator=g, device=device).to(torch.bfloat16),
                  "state_gate": torch.randn(B, cfg.ratio, hd, generator=g, device=device),
                  "comp": torch.randn(B, cfg.max_entries, hd, generator=g, device=device).to(torch.bfloat16)})
    return t


def reference(cfg: DSV4LayerConfig, weights: dict, inputs: dict, capturable: bool = False) -> dict[str, torch.Tensor]:
    """{resid, window (+ state_kv, state_gate, comp)}: x + DSV4AttentionReference.forward(bf16(
    rmsnorm(x) * input_norm)) with the bf16 weights, over the given caches (updated as the model
    updates them). `capturable`: the compressor without host syncs (CUDA graphs)."""
    from ..reference.common import StepInfo, rms_norm
    from ..reference.dsv4_attention import DSV4AttentionReference
    w = weights
    hf = {"q_a_proj.weight": w["w_q_a"], "q_a_norm.weight": w["q_a_norm"], "q_b_proj.weight": w["w_q_b"],
          "kv_proj.weight": w["w_kv"], "kv_norm.weight": w["kv_norm"], "sinks": w["sinks"],
          "o_a_proj.weight": w["w_o_a"], "o_b_proj.weight": w["w_o_b"]}
    cache = {"window": inputs["window"].clone()}
    if cfg.mode == "hca":
        hf.update({"compressor.kv_proj.weight": w["w_c_kv"], "compressor.gate_proj.weight": w["w_c_gate"],
                   "compressor.position_bias": w["c_position_bias"], "compressor.kv_norm.weight": w["c_kv_norm"]})
        cache.update({"comp_kv": inputs["comp"].clone(), "comp_state_kv": inputs["state_kv"].clone(),
                      "comp_state_gate": inputs["state_gate"].clone()})
    ref = DSV4AttentionReference(None, SimpleNamespace(attention=cfg.spec), hf)
    if ref.compressor is not None:
        ref.compressor.capturable = capturable
    x = inputs["x"].float()
    h = rms_norm(x, w["input_norm"].float(), cfg.eps).to(torch.bfloat16)
    start = inputs["start"].long()
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(cfg.tokens, device=start.device),
                    input_ids=torch.zeros(cfg.batch, cfg.tokens, dtype=torch.long, device=start.device))
    out = ref.forward(h.view(cfg.batch, cfg.tokens, cfg.hidden), cache, step)
    res = {"resid": x + out.float().reshape(cfg.tokens_total, cfg.hidden), "window": cache["window"]}
    if cfg.mode == "hca":
        res.update({"comp": cache["comp_kv"], "state_kv": cache["comp_state_kv"], "state_gate": cache["comp_state_gate"]})
    return res
