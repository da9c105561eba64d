"""A DeepSeek-V4 attention sublayer of one GPU's head shard in ONE megakernel launch - the sliding
window (SWA), heavily compressed (HCA) and compressed-sparse (CSA) layers: the input RMSNorm fused
into the projections, the q / kv norms and RoPE, the compression of the new tokens, the CSA
indexer (its queries, keys, scores and top-k), the split-KV attention over the window + new
tokens + compressed entries with the sinks, the ring write, and the grouped output projection
with the residual add.

    x (bf16 [M, D], M = B * T: the residual stream entering the sublayer)
    q_a    = GEMV(rmsnorm(x) * input_norm, W_q_a)                   [M, Q]
    q_raw  = GEMV(rmsnorm(q_a) * q_a_norm, W_q_b)                   [M, H, hd]
    kv_raw = GEMV(rmsnorm(x) * input_norm, W_kv)                    [M, hd]
    q, new_kv = DSV4Prologue(q_raw, kv_raw)        per-head norm + RoPE, kv_norm + RoPE
    HCA / CSA:  c_kv, c_gate = GEMV(rmsnorm(x) * input_norm, W_c_kv / W_c_gate)   [M, hd] (CSA 2 hd)
          comp = DSV4Compress(c_kv, c_gate, state)  pooled entries of the windows this call closes
          comp = DSV4CompressNorm(comp)             their kv_norm + RoPE, in place
    CSA:  the indexer's own compressor (i_kv, i_gate [M, 2 ihd] -> index_keys, as above);
          iq     = DSV4IndexQ(GEMV(rmsnorm(q_a) * q_a_norm, W_iq))  [B, T, IH, ihd]  (RoPE, compress rope)
          iw     = GEMV(rmsnorm(x) * input_norm, W_iw)              [M, IH] fp32
          scores = IndexScore(iq, iw, index_keys)    sum_h iw_h ReLU(iq_h . k) / sqrt(ihd IH)
          index  = TopK(scores)                      the top-k ready entries of each query token
    o_part, lse_part = DSV4Decode(q, window, new_kv, comp[, index])  (waits for the prologue, the
                                                       compressor and, CSA, the top-k)
    out    = DSV4Combine(o_part, lse_part, sinks)                   [B, T, H, hd] (un-roped)
    window = DSV4RingWrite(new_kv)                                  (after the decode read the old ring)
    o_lat  = GEMV(out, W_o_a)                                       [M, G R] (the shard's G o_a groups)
    resid  = x + GEMV(o_lat, W_o_b)                                 (fp32; the row-parallel o_b's
                                                                      all-reduce is the TP program's)

`reference()` is sdk/reference/dsv4_attention.py's DSV4AttentionReference.forward on bf16(rmsnorm(x)
* input_norm) with the model's bf16 weights, plus the residual. Supported: the shard holds any
whole number of o_a groups (`o_groups`; V4.1-Flash TP8: 8 heads = one of 8 groups, one GPU: all 8,
one GEMV with `GemvConfig.groups`); the indexer whole on every GPU (its heads
are not sharded); CSA with T = 1 at any batch, T = 2 at batch 1 (shared memory: the staged x, the
weight ring and the largest plain tile - build_program says so otherwise). The indexer's head
weights iw stay fp32 out of their GEMV (the model rounds F.linear's output to bf16 first: a 2^-9
relative difference in each head's weight, which can swap entries whose scores tie that closely
at the top-k boundary).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..blocks.dsv4_attention import (DSV4CombineBlock, DSV4CombineConfig, DSV4DecodeBlock, DSV4DecodeConfig,
                                     DSV4RingWriteBlock, DSV4RingWriteConfig, choose_splits, comp_cache_shape,
                                     comp_fp4_round_trip, comp_record_words, dequantize_comp_fp4, dequantize_window_fp8,
                                     even_row_groups,
                                     quantize_comp_fp4, quantize_window_fp8, window_record_words)
from ..blocks.dsv4_compress import DSV4CompressConfig, compressor_blocks
from ..blocks.dsv4_prologue import DSV4IndexQBlock, DSV4IndexQConfig, DSV4PrologueBlock, DSV4PrologueConfig
from ..blocks.gemv import GemvBlock, GemvConfig, balanced_configs, fill_stage
from ..blocks.formats import mxfp4_round_trip
from ..blocks.indexer import (IndexScoreBlock, IndexScoreConfig, TopKBlock, TopKConfig, choose_keys_per_tile,
                              dequantize_index_keys, index_key_cache_shape, index_key_page_words,
                              quantize_index_keys)
from .mhc_site import MHCSiteFields, add_collapse, add_post, site_inputs, site_weights
from .mhc_site import reference as site_reference
from .mlp_stack import gemv_block
from .program import Program, first_fitting


@dataclass(frozen=True)
class DSV4LayerConfig(MHCSiteFields):
    heads: int = 8                       # this GPU's query heads (V4.1-Flash TP8: 8)
    mode: str = "hca"                    # "swa" | "hca" | "csa"
    batch: int = 1
    tokens: int = 1
    hidden: int = 4096
    head_dim: int = 512
    q_rank: int = 1024                   # q_lora_rank
    o_rank: int = 1024                   # o_lora_rank of an o_a group
    o_groups: int = 1                    # o_a groups of the shard: its heads in that many groups, each
                                         # projected to o_rank (one GPU, V4.1-Flash: 8; TP8: 1)
    rope: int = 64
    window: int = 128
    ratio: int = 128                     # compress ratio (HCA 128, CSA 4)
    index_heads: int = 64                # CSA indexer
    index_head_dim: int = 128
    index_topk: int = 512
    max_seq_len: int = 4096
    rope_theta: float = 10000.0          # the main rope (q, the window's kv)
    compress_rope_theta: float = 160000.0   # the compressed entries' rope
    eps: float = 1e-6
    num_splits: int = 0                  # 0: choose_splits
    decode_chunk: int = 0                # keys per decode chunk (0: 32; CSA 16 - the largest plain tile
                                         # sizes the shared arena (the indexer's scores, 70 KB at T = 1):
                                         # with chunk 32 the decode's 87 KB leaves batch 8 no ring stages)
    index_stages: int = 2                # the indexer score tile's pipeline stages
    decode_max_rows: int = 32            # query rows of a decode tile (16: build_program's last resort)
    decode_stages: int = 0               # the decode core's pipeline stages (0: its auto; build_program
                                         # lowers them until the projections' weight ring fits beside)
    num_sms: int = 132
    x_gemv_rows: int = 0                 # rows per tile of the GEMVs that read x (they run side by
                                         # side); 0: balanced_configs cuts them alike
    window_dtype: str = "bf16"           # "fp8_e4m3": the sliding-window ring as V4.1's SWA records (e4m3 +
                                         # a UE8M0 scale per 32 values, 528 B a token: quantize_window_fp8);
                                         # opt-in, written 2026-12-04, not yet run on a GPU
    comp_dtype: str = "bf16"             # "fp4_e2m1": the compressed entries as V4.1's records (E2M1 + an E4M3
                                         # scale per 16 values, 288 B a token: quantize_comp_fp4);
                                         # opt-in, written 2026-12-04, not yet run on a GPU
    index_dtype: str = "bf16"            # "mxfp4" (CSA): V4.1's MXFP4 indexer - its keys as records (E2M1 + a
                                         # UE8M0 scale per 32 values, 68 B a key) in pages of 64 (max_seq_len
                                         # / ratio a multiple of 64: indexer.quantize_index_keys), its queries
                                         # through MXFP4, the score's BF16 stages; opt-in, written 2026-12-05
                                         # / 06, not yet run on a GPU
    q_head_norm: bool = True             # V4's per-head q RMSNorm; False: V4.1's queries (RoPE only)
    fill_stage: bool = False             # every GEMV's chunk widened to fill the ring's stage (gemv.fill_stage):
                                         # measured slower on the H200 (2026-12-04, CSA B=1 32K: the
                                         # x GEMVs' 17 -> 33 KB chunks 97.8 -> 101.6 us; HCA B=1 41.1
                                         # vs 40.4, noise) - opt-in

    @property
    def tokens_total(self) -> int:
        return self.batch * self.tokens

    @property
    def max_entries(self) -> int:
        return max(1, self.max_seq_len // self.ratio)

    @property
    def compressed(self) -> bool:
        return self.mode in ("hca", "csa")

    @property
    def topk(self) -> int:
        """CSA: entries the indexer selects per query (at most the cache's)."""
        return min(self.index_topk, self.max_entries)

    @property
    def spec(self):
        """The DSV4AttentionSpec the sublayer computes (what `reference()` runs)."""
        from ..spec import DSAIndexerSpec, DSV4AttentionSpec, RopeSpec
        indexer = (DSAIndexerSpec(num_heads=self.index_heads, head_dim=self.index_head_dim, topk=self.index_topk)
                   if self.mode == "csa" else None)
        return DSV4AttentionSpec(num_heads=self.heads, head_dim=self.head_dim, q_lora_rank=self.q_rank,
                                 rope_dim=self.rope, sliding_window=self.window,
                                 compress_ratio=self.ratio if self.compressed else 0, indexer=indexer,
                                 compress_overlap=self.mode == "csa", o_groups=self.o_groups, o_lora_rank=self.o_rank,
                                 rope=RopeSpec(dim=self.rope, theta=self.rope_theta, interleaved=True),
                                 compress_rope=RopeSpec(dim=self.rope, theta=self.compress_rope_theta, interleaved=True),
                                 norm_eps=self.eps, q_head_norm=self.q_head_norm)

    def splits(self) -> int:
        comp = {"swa": 0, "hca": self.max_entries, "csa": self.topk}[self.mode]
        chunk = self.decode_chunk or (16 if self.mode == "csa" else 32)
        # a query group of more than 32 rows is several tiles (row groups): cover the SMs with all
        groups = even_row_groups(self.heads * (1 if self.mode == "csa" else self.tokens), self.decode_max_rows)
        return self.num_splits or choose_splits(self.batch * groups, self.window + self.tokens + comp, self.num_sms,
                                                chunk=chunk)

    def blocks(self) -> dict:
        """The non-GEMV blocks of the program."""
        from ..errors import UnsupportedConfigError
        if self.mode not in ("swa", "hca", "csa"):
            raise UnsupportedConfigError(f"DSV4 layer: mode {self.mode!r} (supported: swa, hca, csa)")
        if self.o_groups < 1 or self.heads % self.o_groups:
            raise UnsupportedConfigError(f"DSV4 layer: o_groups={self.o_groups} must divide the shard's "
                                         f"{self.heads} heads (whole heads a group)")
        B, T, H, hd = self.batch, self.tokens, self.heads, self.head_dim
        S = self.splits()
        out = {"prologue": DSV4PrologueBlock(DSV4PrologueConfig(heads=H, head_dim=hd, rope=self.rope, batch=B,
                                                                tokens=T, eps=self.eps, q_norm=self.q_head_norm)),
               "decode": DSV4DecodeBlock(DSV4DecodeConfig(heads=H, mode=self.mode, batch=B, q_tokens=T, head_dim=hd,
                                                          window=self.window, ratio=self.ratio if self.compressed else 1,
                                                          max_entries=self.max_entries, topk=max(self.topk, 1),
                                                          num_splits=S, stages=self.decode_stages,
                                                          chunk=self.decode_chunk or (16 if self.mode == "csa" else 32),
                                                          max_tile_rows=self.decode_max_rows,
                                                          window_dtype=self.window_dtype, comp_dtype=self.comp_dtype)),
               "combine": DSV4CombineBlock(DSV4CombineConfig(heads=H, batch=B, q_tokens=T, head_dim=hd, num_splits=S,
                                                             per_token_groups=self.mode == "csa", rope_dim=self.rope)),
               "ring": DSV4RingWriteBlock(DSV4RingWriteConfig(batch=B, q_tokens=T, head_dim=hd, window=self.window,
                                                              window_dtype=self.window_dtype))}
        if self.site:
            out.update(self.site.blocks())
        if self.compressed:
            out["compress"], out["compress_norm"] = compressor_blocks(DSV4CompressConfig(
                dim=hd, ratio=self.ratio, overlap=self.mode == "csa", rope=self.rope, batch=B, tokens=T,
                max_entries=self.max_entries, eps=self.eps, entry_dtype=self.comp_dtype))
        if self.mode == "csa":
            ih, ihd, E = self.index_heads, self.index_head_dim, self.max_entries
            out["i_compress"], out["i_compress_norm"] = compressor_blocks(DSV4CompressConfig(
                dim=ihd, ratio=self.ratio, overlap=True, rope=self.rope, batch=B, tokens=T, max_entries=E, eps=self.eps,
                entry_dtype=self.index_dtype))
            out["index_q"] = DSV4IndexQBlock(DSV4IndexQConfig(heads=ih, head_dim=ihd, rope=self.rope, batch=B, tokens=T))
            # ReLU commutes with a positive scale: the weights' IH^-0.5 joins the score's ihd^-0.5
            out["scores"] = IndexScoreBlock(IndexScoreConfig(
                heads=ih, head_dim=ihd, batch=B, q_tokens=T, max_entries=E, ratio=self.ratio,
                scale=(ihd * ih) ** -0.5, keys_per_tile=choose_keys_per_tile(B, E, self.num_sms),
                stages=self.index_stages, key_dtype=self.index_dtype))
            out["topk"] = TopKBlock(TopKConfig(k=self.topk, batch=B, q_tokens=T, max_entries=E, ratio=self.ratio))
        return out

    @property
    def site(self):
        """The mHC site around the sublayer (sdk/megakernel/mhc_site.py), or None (plain residual)."""
        from .mhc_site import site_of
        return site_of(self, "DSV4 layer", self.tokens_total, self.eps)

    def weight_shapes(self) -> dict:
        D, H, hd, Q, R, G = self.hidden, self.heads, self.head_dim, self.q_rank, self.o_rank, self.o_groups
        w = {"input_norm": ((D,), "fp32" if self.mhc else "bf16"), "w_q_a": ((Q, D), "bf16"), "q_a_norm": ((Q,), "bf16"),
             "w_q_b": ((H * hd, Q), "bf16"), "w_kv": ((hd, D), "bf16"), "kv_norm": ((hd,), "bf16"),
             "sinks": ((H,), "fp32"), "w_o_a": ((G * R, H * hd // G), "bf16"), "w_o_b": ((D, G * R), "bf16")}
        if self.compressed:
            c = 2 * hd if self.mode == "csa" else hd
            w.update({"w_c_kv": ((c, D), "bf16"), "w_c_gate": ((c, D), "bf16"),
                      "c_position_bias": ((self.ratio, c), "fp32"), "c_kv_norm": ((hd,), "bf16")})
        if self.mode == "csa":
            ih, ihd = self.index_heads, self.index_head_dim
            w.update({"w_i_kv": ((2 * ihd, D), "bf16"), "w_i_gate": ((2 * ihd, D), "bf16"),
                      "i_position_bias": ((self.ratio, 2 * ihd), "fp32"), "i_kv_norm": ((ihd,), "bf16"),
                      "w_iq": ((ih * ihd, Q), "bf16"), "w_iw": ((ih, D), "bf16")})
        if self.site:
            w.update(self.site.weight_shapes())
        return w

    def cache_shapes(self) -> dict:
        """The caches a call reads and updates in place (beside the window ring): name -> (shape, dtype)."""
        B, hd, E, r = self.batch, self.head_dim, self.max_entries, self.ratio
        out = {}
        if self.compressed:
            c, L = (2 * hd, 2 * r) if self.mode == "csa" else (hd, r)
            out.update({"state_kv": ((B, L, c), "bf16"), "state_gate": ((B, L, c), "fp32"),
                        "comp": (comp_cache_shape(B, E, hd), "int32") if self.comp_dtype == "fp4_e2m1"
                        else ((B, E, hd), "bf16")})
        if self.mode == "csa":
            ihd = self.index_head_dim
            out.update({"i_state_kv": ((B, 2 * r, 2 * ihd), "bf16"), "i_state_gate": ((B, 2 * r, 2 * ihd), "fp32"),
                        "index_keys": (index_key_cache_shape(B, E, ihd), "int32") if self.index_dtype == "mxfp4"
                        else ((B, E, ihd), "bf16")})
        return out


def build_program(cfg: DSV4LayerConfig) -> Program:
    """The sublayer's program with the deepest decode pipeline (its auto, then 4 .. 2 stages; then
    the same with 16-key chunks; last, 16-row tiles at 2 stages of 16 keys) that leaves the
    projections' weight ring 2 stages of shared memory (the decode tile of 8 heads x 512 takes
    ~187 KB at its auto depth); else the ring's error."""
    from dataclasses import replace

    def build(chunk, st, rows=cfg.decode_max_rows):
        c = replace(cfg, decode_chunk=chunk, decode_stages=st, decode_max_rows=rows)
        prog = _build(c)
        if cfg.fill_stage:
            # every GEMV's chunk widened to fill the ring's stage (its widest chunk: the indexer's q
            # GEMV's 64 rows make 33 KB stages that the other GEMVs' 17 KB chunks half fill)
            prog = _build(c, max(b.chunk_bytes() for b in prog.opcodes.blocks if b.stream_chunks() > 0))
        return prog
    # then the decode's 16-key chunks (V4.1's fp8 window records take the decode tile 122 KB at
    # 32-key chunks and 2 stages: at batch 64, or 8 x 2 tokens, the ring found 1 stage - GPU run 2026-12-05)
    chunks = (cfg.decode_chunk,) if cfg.decode_chunk else (0, 16)
    stages = (cfg.decode_stages,) if cfg.decode_stages else (0, 4, 3, 2)
    # last, 16-row decode tiles (half the query smem; 32 heads then take 2 row groups)
    tall = [lambda ch=ch, st=st: build(ch, st) for ch in chunks for st in stages]
    short = [lambda ch=ch, st=st: build(ch, st, 16) for ch in chunks[-1:] for st in stages[-1:]]
    return first_fitting(tall + (short if cfg.decode_max_rows > 16 and cfg.heads * cfg.tokens > 16 else []))


def _build(cfg: DSV4LayerConfig, stage_bytes: int = 0) -> Program:
    B, T, M, D, H, hd = cfg.batch, cfg.tokens, cfg.tokens_total, cfg.hidden, cfg.heads, cfg.head_dim
    blk = cfg.blocks()
    dec = blk["decode"]
    csa = cfg.mode == "csa"
    prog = Program()
    mhc = cfg.mhc
    if not mhc:
        prog.buffer("x", (M, D), "bf16", "input")
    prog.buffer("start", (B,), "int32", "input")
    r2 = max(cfg.rope // 2, 1)
    # host tables: the main rope at the tokens, the compress rope at the window each token would
    # close (c_) and, CSA, at the tokens (i_: the indexer's queries)
    for name in ("cos", "sin", "c_cos", "c_sin") + (("i_cos", "i_sin") if csa else ()):
        prog.buffer(name, (B, T, r2), "bf16", "input")
    for name, (shape, dtype) in cfg.weight_shapes().items():
        prog.buffer(name, shape, dtype, "weight")
    # mHC: x is the collapse of the streams, normed (the input norm fused there): v4 with this
    # site's own pre (after its coefficients), v41 with the previous site's (its own op)
    x_ops, coef_op = add_collapse(prog, cfg.site, blk, "input_norm", label="v4.") if mhc else ([], None)
    prog.buffer("window", *window_shape(cfg), "input")                     # read, then written in place
    for name, (shape, dtype) in cfg.cache_shapes().items():                # compressor windows, entries
        prog.buffer(name, shape, dtype, "input")                            # (updated in place)
    for name, shape, dtype in (("q_a", (M, cfg.q_rank), "bf16"), ("q_raw", (M, H, hd), "bf16"),
                               ("kv_raw", (M, hd), "bf16"), ("q", (B, T, H, hd), "bf16"), ("new_kv", (B, T, hd), "bf16"),
                               ("o_part", (B, dec.groups, dec.config.num_splits, dec.rows, hd), "fp32"),
                               ("lse_part", (B, dec.groups, dec.config.num_splits, dec.rows), "fp32"),
                               ("out", (B, T, H, hd), "bf16"), ("o_lat", (M, cfg.o_groups * cfg.o_rank), "bf16")):
        prog.buffer(name, shape, dtype)
    if mhc:
        prog.buffer("y", (M, D), "bf16")             # the sublayer's output, into the post-mix
    else:
        prog.buffer("resid", (M, D), "fp32", "output")

    def gemv(n, k, rows=0, **kw):
        block = gemv_block(GemvConfig(n=n, k=k, m=M, norm_eps=cfg.eps, **kw), rows, cfg.num_sms)
        return GemvBlock(fill_stage(block.config, stage_bytes)) if stage_bytes else block

    # the GEMVs of x run side by side: cut alike
    c_width = 2 * hd if csa else hd
    ih, ihd = cfg.index_heads, cfg.index_head_dim
    # (rows, GemvConfig extras) of q_a, kv, the compressor's kv / gate, the indexer's kv / gate and head weights
    x_gemvs = ([(cfg.q_rank, {}), (hd, {})] + ([(c_width, {})] * 2 if cfg.compressed else [])
               + ([(2 * ihd, {})] * 2 + [(ih, {"out_dtype": "fp32"})] if csa else []))
    rows = cfg.x_gemv_rows or balanced_configs([GemvConfig(n=n, k=D, m=M, norm=not mhc, norm_eps=cfg.eps, **kw)
                                                for n, kw in x_gemvs], cfg.num_sms)[0].rows_per_tile

    def from_x(n, w, y, label, **kw):
        if mhc:
            return prog.op(gemv(n, D, rows, **kw), {"w": w, "x": "x", "y": y}, waits=x_ops, label=label)
        return prog.op(gemv(n, D, rows, norm=True, **kw), {"w": w, "x": "x", "norm_weight": "input_norm", "y": y},
                       label=label)

    def compressor(prefix, width, pool_blk, norm_blk, state, entries, label):
        """GEMVs of x into the compressor's kv / gate, its pooling, its entry norm: the last op."""
        prog.buffer(prefix + "kv", (M, width), "bf16")
        prog.buffer(prefix + "gate", (M, width), "bf16")
        ckv = from_x(width, f"w_{prefix}kv", prefix + "kv", f"v4.{label}kv")
        cg = from_x(width, f"w_{prefix}gate", prefix + "gate", f"v4.{label}gate")
        # records (fp4 entries, mxfp4 keys): the pooled entries go through a bf16 buffer, the norm
        # writes the records
        out = {"entries": entries}
        if pool_blk.records:
            prog.buffer(prefix + "pooled", pool_blk.pooled_spec(True).shape, "bf16")
            out = {"pooled": prefix + "pooled"}
        pool = prog.op(pool_blk, {"kv": prefix + "kv", "gate": prefix + "gate", "position_bias": prefix + "position_bias",
                                  "start": "start", "state_kv": state + "state_kv", "state_gate": state + "state_gate",
                                  **out}, waits=[ckv, cg], label=f"v4.{label}compress")
        return prog.op(norm_blk, {"kv_norm": prefix + "kv_norm", "cos": "c_cos", "sin": "c_sin", "start": "start",
                                  **out, "entries": entries}, waits=[pool], label=f"v4.{label}comp_norm")

    qa = from_x(cfg.q_rank, "w_q_a", "q_a", "v4.q_a")
    kv = from_x(hd, "w_kv", "kv_raw", "v4.kv")
    qb = prog.op(gemv(H * hd, cfg.q_rank, norm=True), {"w": "w_q_b", "x": "q_a", "norm_weight": "q_a_norm", "y": "q_raw"},
                 waits=[qa], label="v4.q_b")
    pro = prog.op(blk["prologue"], {"q_raw": "q_raw", "kv_raw": "kv_raw", "kv_norm": "kv_norm", "cos": "cos",
                                    "sin": "sin", "q": "q", "new_kv": "new_kv"}, waits=[qb, kv], label="v4.prologue")
    dbind = {"q": "q", "window": "window", "new_kv": "new_kv", "start": "start", "o_part": "o_part",
             "lse_part": "lse_part"}
    dwaits = [pro]
    if cfg.compressed:
        dwaits.append(compressor("c_", c_width, blk["compress"], blk["compress_norm"], "", "comp", "c_"))
        dbind["comp"] = "comp"
    if csa:
        E = cfg.max_entries
        for name, shape, dtype in (("iq_raw", (M, ih, ihd), "bf16"), ("iq", (B, T, ih, ihd), "bf16"),
                                   ("iw", (M, ih), "fp32"), ("scores", (B, T, E), "fp32"),
                                   ("index", (B, T, cfg.topk), "int32")):
            prog.buffer(name, shape, dtype)
        ikeys = compressor("i_", 2 * ihd, blk["i_compress"], blk["i_compress_norm"], "i_", "index_keys", "i_")
        iw = from_x(ih, "w_iw", "iw", "v4.i_weights", out_dtype="fp32")
        iqg = prog.op(gemv(ih * ihd, cfg.q_rank, norm=True),
                      {"w": "w_iq", "x": "q_a", "norm_weight": "q_a_norm", "y": "iq_raw"}, waits=[qa], label="v4.i_q")
        iq = prog.op(blk["index_q"], {"q_raw": "iq_raw", "cos": "i_cos", "sin": "i_sin", "q": "iq"}, waits=[iqg],
                     label="v4.i_rope")
        sc = prog.op(blk["scores"], {"q": "iq", "weights": "iw", "keys": "index_keys", "start": "start",
                                     "scores": "scores"}, waits=[iq, ikeys, iw], label="v4.i_scores")
        dwaits.append(prog.op(blk["topk"], {"scores": "scores", "start": "start", "index": "index"}, waits=[sc],
                              label="v4.i_topk"))
        dbind["index"] = "index"
    core = prog.op(dec, dbind, waits=dwaits, label="v4.decode")
    comb = prog.op(blk["combine"], {"o_part": "o_part", "lse_part": "lse_part", "sinks": "sinks", "cos": "cos",
                                    "sin": "sin", "out": "out"}, waits=[core], label="v4.combine")
    prog.op(blk["ring"], {"new_kv": "new_kv", "start": "start", "window": "window"}, waits=[core], label="v4.ring")
    # the grouped o_a: group j's o_rank rows read the heads [j H / G, (j + 1) H / G) of out
    G, GR = cfg.o_groups, cfg.o_groups * cfg.o_rank
    oa = prog.op(gemv(GR, H * hd // G, groups=G), {"w": "w_o_a", "x": "out", "y": "o_lat"}, waits=[comb],
                 label="v4.o_a")
    if not mhc:
        prog.op(gemv(D, GR, out_dtype="fp32", residual="bf16"),
                {"w": "w_o_b", "x": "o_lat", "res": "x", "y": "resid"}, waits=[oa], label="v4.o_b")
        return prog
    ob = prog.op(gemv(D, GR), {"w": "w_o_b", "x": "o_lat", "y": "y"}, waits=[oa], label="v4.o_b")
    add_post(prog, blk, "y", [ob, coef_op], label="v4.")
    return prog


def window_shape(cfg: DSV4LayerConfig) -> tuple:
    """(shape, dtype) of the sliding-window ring buffer: bf16 rows, or fp8 records as int32 words."""
    if cfg.window_dtype == "fp8_e4m3":
        return (cfg.batch, cfg.window, window_record_words(cfg.head_dim)), "int32"
    return (cfg.batch, cfg.window, cfg.head_dim), "bf16"


def cache_values(cfg: DSV4LayerConfig, t: torch.Tensor) -> torch.Tensor:
    """Any of the sublayer's caches as values: the fp8 ring's, the fp4 entries' or the mxfp4 keys'
    int32 records (told apart by their width: 132 / 72 / 1088 words at V4.1's shapes - a record, a
    record, a page of 64 keys) dequantised; other tensors as they are. `reference`
    returns values for every cache: compare a program's caches through this."""
    if t.dtype != torch.int32:
        return t
    if t.shape[-1] == window_record_words(cfg.head_dim) and cfg.window_dtype == "fp8_e4m3":
        return dequantize_window_fp8(t, cfg.head_dim)
    if t.shape[-1] == comp_record_words(cfg.head_dim) and cfg.comp_dtype == "fp4_e2m1":
        return dequantize_comp_fp4(t, cfg.head_dim)
    if t.shape[-1] == index_key_page_words(cfg.index_head_dim) and cfg.index_dtype == "mxfp4":
        return dequantize_index_keys(t, cfg.index_head_dim)
    raise ValueError(f"cache_values: an int32 tensor of width {t.shape[-1]} is no record of this sublayer")


def make_weights(cfg: DSV4LayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    w = {}
    for name, (shape, dtype) in cfg.weight_shapes().items():
        if name.startswith("hc_"):          # mHC: mhc_site.site_weights below
            continue
        if name.endswith("norm"):           # bf16 values (mHC's fp32 input norm too: the model's weight)
            x = (1 + 0.1 * torch.randn(*shape, generator=g, device=device)).to(torch.bfloat16)
        elif name in ("sinks", "c_position_bias", "i_position_bias"):
            x = 0.5 * torch.randn(*shape, generator=g, device=device)
        else:
            x = torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5
        w[name] = x.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    if cfg.site:
        w.update(site_weights(cfg.site, g, device))
    return w


def make_inputs(cfg: DSV4LayerConfig, starts, seed: int = 0, device="cpu", hc_fn=None) -> dict[str, torch.Tensor]:
    """x, the caches of sequences with `starts` tokens before this call (random ring rows,
    compressor windows and entries), start and the host's rope tables. mHC: the streams instead of
    x, this site's partials of them with `hc_fn` (mhc_site.site_fn) and, v41, a previous site's
    coef (mhc_site.site_inputs)."""
    from ..reference.dsv4_attention import Rope
    g = torch.Generator(device=device).manual_seed(seed)
    B, T, hd = cfg.batch, cfg.tokens, cfg.head_dim
    start = torch.tensor(starts, dtype=torch.int32, device=device)
    pos = start.long()[:, None] + torch.arange(T, device=device)
    spec = cfg.spec
    cos, sin = Rope(spec.rope).cos_sin(pos, torch.bfloat16)
    crope = Rope(spec.compress_rope)
    c_cos, c_sin = crope.cos_sin(pos + 1 - cfg.ratio, torch.bfloat16)
    t = {"x": torch.randn(cfg.tokens_total, cfg.hidden, generator=g, device=device).to(torch.bfloat16),
         "start": start, "cos": cos, "sin": sin, "c_cos": c_cos, "c_sin": c_sin,
         "window": torch.randn(B, cfg.window, hd, generator=g, device=device).to(torch.bfloat16)}
    if cfg.window_dtype == "fp8_e4m3":
        t["window"] = quantize_window_fp8(t["window"])
    if cfg.site:
        del t["x"]
        t.update(site_inputs(cfg.site, g, hc_fn, device))
    if cfg.mode == "csa":
        t["i_cos"], t["i_sin"] = crope.cos_sin(pos, torch.bfloat16)
    for name, (shape, dtype) in cfg.cache_shapes().items():
        if name == "comp" and dtype == "int32":          # fp4 records of random entries
            t[name] = quantize_comp_fp4(torch.randn(B, cfg.max_entries, hd, generator=g, device=device))
            continue
        if name == "index_keys" and dtype == "int32":    # mxfp4 pages of random keys
            t[name] = quantize_index_keys(torch.randn(B, cfg.max_entries, cfg.index_head_dim, generator=g,
                                                      device=device))
            continue
        v = torch.randn(*shape, generator=g, device=device)
        t[name] = v.to(torch.bfloat16) if dtype == "bf16" else v
    return t


SELECT_TIE_TOL = 1e-2     # a selected entry may miss the reference's top-k by this x max |score|


def reference(cfg: DSV4LayerConfig, weights: dict, inputs: dict, capturable: bool = False,
              index: torch.Tensor | None = None, hc_fn: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """{resid, window, the caches of cache_shapes()}: x + DSV4AttentionReference.forward(bf16(
    rmsnorm(x) * input_norm)) with the bf16 weights, over the given caches (updated as the model
    updates them). `capturable`: the compressor without host syncs (CUDA graphs).

    mHC (cfg.mhc): {streams, coef, part_next, window, caches}: the model's residual
    (sdk/reference/mhc.py MHCResidual.around, V4.1's lagged form for "v41" with `carried`'s pre:
    mhc_site.reference) around the same attention, this site's fn = `hc_fn`; coef = this site's coefficients, part_next
    = the next site's partials (hc_fn_next) of the new streams.

    `index` (CSA): the program's index list [B, T, topk] (-1 padded) - the attention then reads
    exactly those entries, after checking they ARE a top-k of the reference's own scores up to
    near-ties (check_selection). The indexer's scores are bf16 products on the device and fp32
    here, so an entry within ~1e-3 of the k-th score may swap with another; on random caches
    attention can peak on one such entry (a swap measured 5e-2 of the output, H200 and PyVM,
    2026-12-04) - which says nothing about the attention. Without `index` the reference selects."""
    from ..reference.common import StepInfo, rms_norm
    from ..reference.dsv4_attention import DSV4AttentionReference
    w = weights
    hf = {"q_a_proj.weight": w["w_q_a"], "q_a_norm.weight": w["q_a_norm"], "q_b_proj.weight": w["w_q_b"],
          "kv_proj.weight": w["w_kv"], "kv_norm.weight": w["kv_norm"], "sinks": w["sinks"],
          "o_a_proj.weight": w["w_o_a"], "o_b_proj.weight": w["w_o_b"]}
    cache = {"window": cache_values(cfg, inputs["window"]).clone()}
    if cfg.compressed:
        hf.update({"compressor.kv_proj.weight": w["w_c_kv"], "compressor.gate_proj.weight": w["w_c_gate"],
                   "compressor.position_bias": w["c_position_bias"], "compressor.kv_norm.weight": w["c_kv_norm"]})
    if cfg.mode == "csa":
        hf.update({"indexer.kv_proj.weight": w["w_i_kv"], "indexer.gate_proj.weight": w["w_i_gate"],
                   "indexer.position_bias": w["i_position_bias"], "indexer.kv_norm.weight": w["i_kv_norm"],
                   "indexer.q_b_proj.weight": w["w_iq"], "indexer.weights_proj.weight": w["w_iw"]})
    cache.update({CACHE_NAMES[n]: cache_values(cfg, inputs[n]).clone() for n in cfg.cache_shapes()})
    ref = DSV4AttentionReference(None, SimpleNamespace(attention=cfg.spec), hf)
    if cfg.comp_dtype == "fp4_e2m1" and ref.compressor is not None:       # new entries through the records
        ref.compressor.entry_format = comp_fp4_round_trip
    if cfg.index_dtype == "mxfp4" and ref.indexer is not None:            # V4.1's MXFP4 indexer: new keys
        ref.indexer.entry_format = mxfp4_round_trip                        # and the queries through MXFP4,
        ref.index_query_format = mxfp4_round_trip                          # the score's BF16 stages
        ref.bf16_index_stages = True
    if index is not None and cfg.mode == "csa":
        def forced(x_, q_res, index_keys, ready, step_):
            scores = ref.index_scores(x_, q_res, index_keys, ready, step_)
            mask = torch.zeros_like(ready)
            idx = index.to(ready.device).long()
            b_, t_, j_ = torch.nonzero(idx >= 0, as_tuple=True)
            mask[b_, t_, idx[b_, t_, j_]] = True
            check_selection(scores, ready, mask, cfg.topk)
            return mask
        ref.select = forced
    for comp in (ref.compressor, ref.indexer):
        if comp is not None:
            comp.capturable = capturable
    start = inputs["start"].long()
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(cfg.tokens, device=start.device),
                    input_ids=torch.zeros(cfg.batch, cfg.tokens, dtype=torch.long, device=start.device))
    if cfg.site:
        B, T, D = cfg.batch, cfg.tokens, cfg.hidden
        res = site_reference(cfg.site, w, inputs, hc_fn, w["input_norm"],
                             lambda h: ref.forward(h.view(B, T, D), cache, step).reshape(B * T, D))
    else:
        x = inputs["x"].float()
        h = rms_norm(x, w["input_norm"].float(), cfg.eps).to(torch.bfloat16)
        out = ref.forward(h.view(cfg.batch, cfg.tokens, cfg.hidden), cache, step)
        res = {"resid": x + out.float().reshape(cfg.tokens_total, cfg.hidden)}
    # the quantised caches as values (bf16): compare the program's through cache_values. The ring's
    # new rows go through the records as the ring write stores them (its old rows' values are
    # unchanged by the round trip); the new entries went through theirs in the compressor.
    window = cache["window"]
    if cfg.window_dtype == "fp8_e4m3":
        window = dequantize_window_fp8(quantize_window_fp8(window), cfg.head_dim)
    res["window"] = window
    res.update({n: cache[CACHE_NAMES[n]] for n in cfg.cache_shapes()})
    return res


def check_selection(scores: torch.Tensor, ready: torch.Tensor, mask: torch.Tensor, k: int,
                    tol: float = SELECT_TIE_TOL) -> None:
    """Raise AssertionError unless `mask` selects, per query row, min(k, ready) ready entries that
    are a top-k of `scores` up to near-ties (reference.common.near_tie_swaps). The ready entries
    of a row are a prefix (the entries compressed so far)."""
    from ..reference.common import near_tie_swaps
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            n = int(ready[b, t].sum())
            got = set(torch.nonzero(mask[b, t]).flatten().tolist())
            if len(got) != min(k, n) or any(e >= n for e in got):
                raise AssertionError(f"index list (b={b}, t={t}): {len(got)} entries selected, "
                                     f"{sum(e >= n for e in got)} of them not ready; want {min(k, n)} of {n}")
            if 0 < k < n:
                near_tie_swaps(scores[b, t, :n].float(), got, k, tol, f"index list (b={b}, t={t}): ")


# the program's cache buffers -> the reference's cache keys
CACHE_NAMES = {"comp": "comp_kv", "state_kv": "comp_state_kv", "state_gate": "comp_state_gate",
               "index_keys": "index_keys", "i_state_kv": "index_state_kv", "i_state_gate": "index_state_gate"}
