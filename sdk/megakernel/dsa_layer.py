"""GLM-5.3's whole DSA attention sublayer of one GPU's head shard in ONE megakernel launch: the
MLA sublayer of sdk/megakernel/mla_layer.py (NoPE) with the lightning indexer between its
projections and its decode, and the decode restricted to the tokens the indexer selects.

    x (bf16, the residual stream entering the sublayer); h = rmsnorm(x) * input_norm (fused into
    every GEMV that reads x)
    q_a, ckv, q_raw, rope_append (cache rows), W_UK                     (mla_layer.py, unchanged)
    index.k_gate = GEMV(h, [wk; gate])   (fp32 [M, 2d])                  waits nothing
    index.w      = GEMV(h, weights_proj) (fp32 [M, H_i])                 waits nothing
    index.q      = GEMV(rmsnorm(q_a) * q_a_norm, wq_b)  [M, H_i, d]      waits q_a  (q_resid of the reference)
    index.key_append: per sequence, per new token p: k = LayerNorm(k_raw) (weight, bias, eps 1e-6)
                 and gate into the P-row ring (slot p % P); the pool a token completes is
                 softmax(gate + ape)-pooled into index_pool_k; start = seq_lens - T      waits k_gate, w
    index.score  = IndexScoreBlock over the complete pools (scale d^-0.5 * H_i^-0.5: ReLU commutes
                 with the positive H_i^-0.5 of the reference's weights)               waits key_append, q
    index.topk   = TopKBlock: top topk / P pools -> their tokens + the tail            waits score, W_UK
    decode (MLADecodeBlock, index_width = topk + P - 1) -> combine -> W_UV           waits rope_append, topk
    resid = x + o @ W_o^T                                                             waits W_UV

The top-k op also waits for W_UK (at most 2 waits per op): the decode's two waits (the cache rows,
the list) then cover every row of its query. The indexer is replicated, not head-sharded: every
GPU of the TP group runs all H_i indexer heads over its own copy of the indexer caches (its
weights are ~1.3 % of the MLA's at GLM-5.3).

`reference()` is sdk/reference/dsa.py's DSAMLAReference.forward (expanded keys and values, its own
indexer with its cache update and top-k, its own norms) on the same caches, plus the residual:
the program is checked against the model's definition. `reference(..., selection=list)` runs the
same forward as a "shared" DSA layer on a given index list (the model's path for a layer that
reuses a selection): the GPU test uses it when the device's top-k took the other side of a
near-tie at the k-th pool (`check_selection` bounds that).

`IndexKeyAppendBlock` (this module: the one piece with no block elsewhere) is the indexer's cache
update: sdk/reference/dsa.py DSAIndexer.update_cache in the program's arithmetic (LayerNorm in
fp32 from the GEMV's fp32 output, ring rows bf16, pooling as the reference: bf16 probabilities x
bf16 keys summed in fp32, rounded once).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..blocks.base import NUM_THREADS, Block, Cost, OperandSpec
from ..blocks.indexer import choose_keys_per_tile, glm53_indexer_blocks
from ..blocks.mla_decode import MLADecodeBlock, choose_splits, row_groups
from . import mla_layer
from .mla_attention import MLAAttentionConfig
from .mla_layer import MLALayerConfig
from .program import Program

KEY_NORM_EPS = 1e-6            # the reference's (Glm5NextTextIndexer k_norm: nn.LayerNorm(eps=1e-6))


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexKeyAppendConfig:
    batch: int = 1
    q_tokens: int = 1
    head_dim: int = 128            # d
    kpool: int = 16                # P
    max_seq_len: int = 4096        # index_pool_k holds max_seq_len // P pools
    eps: float = KEY_NORM_EPS


class IndexKeyAppendBlock(Block):
    """The DSA indexer's cache update; tile = one sequence (its T new tokens in order, so a pool
    that completes mid-call is pooled before the next token's row overwrites the ring). Thread c
    owns channel c of every row (the ring rows it re-reads are its own writes)."""
    name = "dsa_index_key_append"
    Config = IndexKeyAppendConfig

    @property
    def m(self) -> int:
        return self.config.batch * self.config.q_tokens

    @property
    def max_entries(self) -> int:
        return max(1, self.config.max_seq_len // self.config.kpool)

    def check(self):
        c = self.config
        if not 1 <= c.head_dim <= NUM_THREADS:
            self.unsupported(f"dsa_index_key_append: head_dim={c.head_dim} (supported 1..{NUM_THREADS})")
        if c.kpool < 1 or c.kpool > 64 or c.batch < 1 or c.q_tokens < 1:
            self.unsupported(f"dsa_index_key_append: kpool={c.kpool} (1..64), batch, q_tokens >= 1")

    def operand_specs(self):
        c = self.config
        d, P = c.head_dim, c.kpool
        return [OperandSpec("k_gate", (self.m, 2 * d), "fp32"),
                OperandSpec("k_norm_w", (d,), "bf16"),
                OperandSpec("k_norm_b", (d,), "bf16"),
                OperandSpec("ape", (P, d), "bf16"),
                OperandSpec("seq_lens", (c.batch,), "int32"),
                OperandSpec("tail_k", (c.batch, P, d), "bf16", output=True),
                OperandSpec("tail_gate", (c.batch, P, d), "bf16", output=True),
                OperandSpec("pool_k", (c.batch, self.max_entries, d), "bf16", output=True),
                OperandSpec("start", (c.batch,), "int32", output=True)]

    def num_tiles(self) -> int:
        return self.config.batch

    def cost(self) -> Cost:
        c = self.config
        d, P, T = c.head_dim, c.kpool, c.q_tokens
        return Cost(bytes=T * (8 * d + 4 * d + 2 * P * d * 2 + 2 * d) + 2 * P * d + 4 * d,
                    flops=T * (10 * d + 6 * P * d))

    # -- torch faces ---------------------------------------------------------------------------
    def emulate_tile(self, t, b):
        c = self.config
        d, P, T = c.head_dim, c.kpool, c.q_tokens
        start = int(t["seq_lens"][b]) - T
        t["start"][b] = start
        for tq in range(T):
            m, pos = b * T + tq, start + tq
            kg = t["k_gate"][m].float().cpu()
            k = torch.nn.functional.layer_norm(kg[:d], (d,), t["k_norm_w"].float().cpu(),
                                               t["k_norm_b"].float().cpu(), c.eps)
            slot = pos % P
            t["tail_k"][b, slot] = k.to(torch.bfloat16).to(t["tail_k"].device)
            t["tail_gate"][b, slot] = kg[d:].to(torch.bfloat16).to(t["tail_gate"].device)
            if slot == P - 1:
                logits = t["tail_gate"][b].float().cpu() + t["ape"].float().cpu()     # [P, d]
                probs = logits.softmax(dim=0).to(torch.bfloat16).float()
                prod = (probs * t["tail_k"][b].float().cpu()).to(torch.bfloat16).float()
                t["pool_k"][b, pos // P] = prod.sum(0).to(torch.bfloat16).to(t["pool_k"].device)

    def reference(self, **t):
        out = {k: t[k].clone() for k in ("tail_k", "tail_gate", "pool_k", "start")}
        for b in range(self.config.batch):
            self.emulate_tile({**t, **out}, b)
        return out

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ..blocks._cute import block_sum, gmem_tensor

        c = self.config
        B, T, D, P, E = c.batch, c.q_tokens, c.head_dim, c.kpool, self.max_entries
        M = self.m
        eps = c.eps

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mKG = gmem_tensor(ptrs[0], Float32, (M, 2 * D), 4)
            mW = gmem_tensor(ptrs[1], BFloat16, (D,), 2)
            mB = gmem_tensor(ptrs[2], BFloat16, (D,), 2)
            mApe = gmem_tensor(ptrs[3], BFloat16, (P, D), 2)
            mLen = gmem_tensor(ptrs[4], Int32, (B,), 4)
            mTK = gmem_tensor(ptrs[5], BFloat16, (B, P, D), 2)
            mTG = gmem_tensor(ptrs[6], BFloat16, (B, P, D), 2)
            mPool = gmem_tensor(ptrs[7], BFloat16, (B, E, D), 2)
            mStart = gmem_tensor(ptrs[8], Int32, (B,), 4)
            b = t
            start = mLen[b] - T
            if tid == 0:
                mStart[b] = start
            for tq in cutlass.range_constexpr(T):
                m = b * T + tq
                pos = start + tq
                v = Float32(0.0)
                if tid < D:
                    v = mKG[m, tid]
                mean = block_sum(v, scratch) / Float32(D)
                dv = Float32(0.0)
                if tid < D:
                    dv = v - mean
                var = block_sum(dv * dv, scratch) / Float32(D)
                rstd = cute.math.rsqrt(var + Float32(eps), fastmath=False)
                if tid < D:
                    slot = pos % P
                    mTK[b, slot, tid] = (dv * rstd * mW[tid].to(Float32) + mB[tid].to(Float32)).to(BFloat16)
                    mTG[b, slot, tid] = mKG[m, D + tid].to(BFloat16)
                    if slot == P - 1:
                        # softmax over the pool's P tokens, per channel (the reference's order:
                        # bf16 gates + ape in fp32, probabilities rounded to bf16, bf16 products)
                        mx = Float32(-3.0e38)
                        for i in cutlass.range_constexpr(P):
                            mx = cute.arch.fmax(mx, mTG[b, i, tid].to(Float32) + mApe[i, tid].to(Float32))
                        den = Float32(0.0)
                        for i in cutlass.range_constexpr(P):
                            den = den + cute.math.exp(mTG[b, i, tid].to(Float32) + mApe[i, tid].to(Float32) - mx,
                                                      fastmath=False)
                        acc = Float32(0.0)
                        for i in cutlass.range_constexpr(P):
                            e = cute.math.exp(mTG[b, i, tid].to(Float32) + mApe[i, tid].to(Float32) - mx,
                                              fastmath=False)
                            p = (e / den).to(BFloat16).to(Float32)
                            acc = acc + (p * mTK[b, i, tid].to(Float32)).to(BFloat16).to(Float32)
                        mPool[b, pos // P, tid] = acc.to(BFloat16)

        return tile


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSALayerConfig:
    mla: MLALayerConfig                 # NoPE (rope_mode "none", attn.rope 0): GLM-5.3
    index_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    kpool: int = 16
    select_tail: bool = True
    keys_per_tile: int = 0              # IndexScore entries per tile; 0 = choose_keys_per_tile
    index_stages: int = 4               # IndexScore cp.async depth (stepped down to fit the ring)
    decode_chunk: int = 0               # sparse decode tokens per pipeline stage; 0 = the block's (32)
    shared: bool = False                # a "shared" indexer layer: no indexer, the decode over the list
                                        # the previous DSA layer wrote (`index`, an input)

    def __post_init__(self):
        from ..errors import UnsupportedConfigError
        if self.mla.attn.rope or self.mla.rope is not None:
            raise UnsupportedConfigError("DSA layer: GLM-5.3 is NoPE (attn.rope 0, rope_mode 'none')")
        if self.index_topk % self.kpool or not self.select_tail and self.kpool > 1:
            raise UnsupportedConfigError(f"DSA layer: topk={self.index_topk} a multiple of kpool={self.kpool}, "
                                         "select_tail with kpool > 1")

    @property
    def indexer(self):
        from ..spec import DSAIndexerSpec
        return DSAIndexerSpec(num_heads=self.index_heads, head_dim=self.index_head_dim, topk=self.index_topk,
                              kpool=self.kpool, select_tail=self.select_tail)

    @property
    def spec(self):
        """The MLASpec (kind "dsa_mla") `reference()` runs DSAMLAReference with."""
        return replace(self.mla.spec, kind="dsa_mla", indexer=self.indexer)

    @property
    def width(self) -> int:
        return self.index_topk + (self.kpool - 1 if self.select_tail and self.kpool > 1 else 0)

    @property
    def max_entries(self) -> int:
        return max(1, self.mla.attn.max_seq_len // self.kpool)

    def blocks(self):
        """(IndexScoreBlock, TopKBlock) of the layer."""
        a = self.mla.attn
        # GLM-5.3's indexer query is 32 x 128 (8 KB): one 64-entry chunk per tile is enough to
        # amortise it, and at batch 1 the 2048 pools of 32K then spread over 32 SMs, not 8 (the
        # 256-entry minimum left index.score 15 us on 8 SMs on the H200 timeline)
        kpt = self.keys_per_tile or choose_keys_per_tile(a.batch, self.max_entries, a.num_sms, min_keys=64)
        score, topk = glm53_indexer_blocks(self.indexer, a.batch, a.q_tokens, a.max_seq_len, keys_per_tile=kpt)
        d, h = self.index_head_dim, self.index_heads
        score = type(score)(replace(score.config, scale=d ** -0.5 * h ** -0.5, stages=self.index_stages))
        return score, topk


def shard_config(spec, batch: int = 1, max_seq_len: int = 8192, num_pages: int = 0, q_tokens: int = 1, tp: int = 8,
                 num_sms: int = 132, mhc: str = "", **attn_kw) -> DSALayerConfig:
    """The DSA sublayer of a model's spec (a ModelSpec with "dsa_mla" layers: GLM-5.3, models/glm_53)
    at its TP shard: num_heads / tp MLA heads (GLM-5.3 TP8: 8 heads, kv_lora 512, nope 256, v 256,
    NoPE, q_lora 1536, hidden 4096 Flash / 6144), the indexer replicated (32 x 128, top-k 2048,
    kpool 16). Splits of the sparse decode: choose_splits over the list width (2063), not max_seq_len.
    mhc: the layer's mHC site ("v4": GLM-5.3's residual; "" the plain residual)."""
    s = next(l.attention for l in spec.layers if l.attention.kind == "dsa_mla" and not l.attention.indexer.shared)
    ix = s.indexer
    # the sparse decode walks each query's list, not the context: its splits cut topk + kpool - 1,
    # at least 2 chunks each (gathered rows: a long split is a serial walk of scattered loads -
    # 8 chunks per split took 24 us at batch 1 on the H200)
    groups = row_groups(s.num_heads // tp)
    attn_kw.setdefault("num_splits", choose_splits(batch * q_tokens * groups, ix.topk + ix.kpool - 1, num_sms,
                                                   min_chunks_per_split=2))
    attn = MLAAttentionConfig(heads=s.num_heads // tp, kv_lora=s.kv_lora_rank, nope=s.qk_nope_head_dim, rope=0,
                              v=s.v_head_dim, softmax_scale=s.softmax_scale or s.qk_nope_head_dim ** -0.5,
                              batch=batch, q_tokens=q_tokens, max_seq_len=max_seq_len,
                              num_pages=num_pages or batch * -(-max_seq_len // 64) + 4, num_sms=num_sms, **attn_kw)
    mla = MLALayerConfig(attn, hidden=spec.hidden_size, q_lora=s.q_lora_rank, rope_mode="none",
                         eps=s.latent_norm_eps, input_eps=spec.norm_eps, mhc=mhc)
    return DSALayerConfig(mla, index_heads=ix.num_heads, index_head_dim=ix.head_dim, index_topk=ix.topk,
                          kpool=ix.kpool, select_tail=ix.select_tail)


def tiny_config(batch: int = 4, q_tokens: int = 1, max_seq_len: int = 256, **attn_kw) -> DSALayerConfig:
    """A small DSA sublayer for CPU tests: 4 heads, kv_lora 256, nope / v 64, hidden 512, q_lora
    256; indexer 8 x 32, kpool 4, top 16 tokens (4 pools + a tail of <= 3)."""
    attn = MLAAttentionConfig(heads=4, kv_lora=256, nope=64, rope=0, v=64, softmax_scale=64 ** -0.5, batch=batch,
                              q_tokens=q_tokens, page_size=16, max_seq_len=max_seq_len,
                              num_pages=batch * -(-max_seq_len // 16) + 3, num_sms=16, **attn_kw)
    mla = MLALayerConfig(attn, hidden=512, q_lora=256, rope_mode="none", eps=1e-5)
    return DSALayerConfig(mla, index_heads=8, index_head_dim=32, index_topk=16, kpool=4, keys_per_tile=64)


# ------------------------------------------------------------------------------------------------
def build_program(cfg: DSALayerConfig) -> Program:
    """The sublayer's program: mla_layer.build_program's stage / tile stepping with the indexer
    added (`_extend`); if the ring still has no 2 stages, the IndexScore pipeline steps down from
    index_stages to 2, then the sparse decode's chunk to 16 tokens (GLM-5.3 TP8 from batch 8: the
    64 KB of staged activations beside the decode's and the indexer's own shared memory); else
    the ring's error."""
    from ..errors import UnsupportedConfigError
    err = None
    for chunk in dict.fromkeys((cfg.decode_chunk, 16)):
        for st in range(cfg.index_stages, 1, -1):
            c = replace(cfg, index_stages=st, decode_chunk=chunk)
            try:
                return mla_layer.build_program(cfg.mla, builder=lambda m, rows, c=c: _build(replace(c, mla=m), rows))
            except UnsupportedConfigError as exc:
                err = exc
    raise err


def _build(cfg: DSALayerConfig, gemv_rows: int = 0) -> Program:
    return mla_layer._build(cfg.mla, gemv_rows, extend=lambda *a: _extend(cfg, *a))


def _extend(cfg: DSALayerConfig, prog: Program, dec: MLADecodeBlock, ops: dict, gemv, from_x):
    """The indexer's buffers and ops; returns the sparse decode block and its waits. A "shared"
    layer has none: its decode reads the list `index` the previous layer's indexer wrote (an
    input here; the model's chain links it)."""
    a = cfg.mla.attn
    B, T, M, D = a.batch, a.q_tokens, a.tokens, cfg.mla.hidden
    Hi, d, P = cfg.index_heads, cfg.index_head_dim, cfg.kpool
    score, topk = cfg.blocks()
    E = cfg.max_entries
    sparse = MLADecodeBlock(replace(dec.config, index_width=cfg.width, mma="warp",   # sparse: the mma.sync tile
                                    **({"chunk": cfg.decode_chunk} if cfg.decode_chunk else {})))
    if cfg.shared:
        prog.buffer("index", (B, T, cfg.width), "int32", "input")
        return sparse, [ops["rope_append"], ops["w_uk"]]
    for name, shape in (("index_wq_b", (Hi * d, cfg.mla.q_lora)), ("index_k_gate", (2 * d, D)),
                        ("index_weights_proj", (Hi, D)), ("index_k_norm_w", (d,)), ("index_k_norm_b", (d,)),
                        ("index_ape", (P, d))):
        prog.buffer(name, shape, "bf16", "weight")
    for name, shape in (("index_tail_k", (B, P, d)), ("index_tail_gate", (B, P, d)), ("index_pool_k", (B, E, d))):
        prog.buffer(name, shape, "bf16", "input")             # the indexer's caches, updated in place
    prog.buffer("index_kg", (M, 2 * d), "fp32")
    prog.buffer("index_w", (M, Hi), "fp32")
    prog.buffer("index_q", (M, Hi * d), "bf16")
    prog.buffer("index_start", (B,), "int32")
    prog.buffer("index_scores", (B, T, E), "fp32")
    prog.buffer("index", (B, T, cfg.width), "int32", "output")
    kg = from_x(2 * d, "index_k_gate", "index_kg", "index.k_gate", out_dtype="fp32")
    wp = from_x(Hi, "index_weights_proj", "index_w", "index.weights", out_dtype="fp32")
    iq = prog.op(gemv(Hi * d, cfg.mla.q_lora, norm=True),
                 {"w": "index_wq_b", "x": "q_a", "norm_weight": "q_a_norm", "y": "index_q"}, waits=[ops["q_a"]],
                 label="index.q")
    app = prog.op(IndexKeyAppendBlock(IndexKeyAppendConfig(batch=B, q_tokens=T, head_dim=d, kpool=P,
                                                           max_seq_len=a.max_seq_len)),
                  {"k_gate": "index_kg", "k_norm_w": "index_k_norm_w", "k_norm_b": "index_k_norm_b", "ape": "index_ape",
                   "seq_lens": "seq_lens", "tail_k": "index_tail_k", "tail_gate": "index_tail_gate",
                   "pool_k": "index_pool_k", "start": "index_start"}, waits=[kg, wp], label="index.key_append")
    sc = prog.op(score, {"q": "index_q", "weights": "index_w", "keys": "index_pool_k", "start": "index_start",
                         "scores": "index_scores"}, waits=[app, iq], label="index.score")
    tk = prog.op(topk, {"scores": "index_scores", "start": "index_start", "index": "index"},
                 waits=[sc, ops["w_uk"]], label="index.topk")
    return sparse, [ops["rope_append"], tk]


# ------------------------------------------------------------------------------------------------
def make_weights(cfg: DSALayerConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """mla_layer's weights plus the indexer's, under the program's names (index_k_gate = [wk;
    gate] stacked: the program's one GEMV) and the checkpoint's pieces (index_wk, index_gate)."""
    w = mla_layer.make_weights(cfg.mla, seed=seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed + 11)
    D, Hi, d, P = cfg.mla.hidden, cfg.index_heads, cfg.index_head_dim, cfg.kpool

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s * shape[-1] ** -0.5).to(torch.bfloat16)

    wk, gate = rnd(d, D), rnd(d, D, s=2.0)
    w.update({"index_wq_b": rnd(Hi * d, cfg.mla.q_lora), "index_wk": wk, "index_gate": gate,
              "index_k_gate": torch.cat([wk, gate]), "index_weights_proj": rnd(Hi, D),
              "index_k_norm_w": (1.0 + 0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16),
              "index_k_norm_b": (0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16),
              "index_ape": (0.5 * torch.randn(P, d, generator=g, device=device)).to(torch.bfloat16)})
    return w


# the indexer's program weights <- the model's (sdk/reference/dsa.py names, under the layer's attn.)
INDEXER_WEIGHTS = {"index_wq_b": "indexer.wq_b.weight", "index_weights_proj": "indexer.weights_proj.weight",
                   "index_k_norm_w": "indexer.k_norm.weight", "index_k_norm_b": "indexer.k_norm.bias",
                   "index_ape": "indexer.index_kpool_compress_ape"}


def weights_from_model(cfg: DSALayerConfig, get) -> dict[str, torch.Tensor]:
    """The program's weights but the input norm from the model's: get(name) -> its weight under
    the HF name - mla_layer's, and the indexer's (none in a "shared" layer) with k_gate = [wk;
    the pool gate] stacked (the program's one GEMV)."""
    w = mla_layer.weights_from_model(cfg.mla, get)
    if not cfg.shared:
        w.update({k: get(v) for k, v in INDEXER_WEIGHTS.items()})
        w["index_k_gate"] = torch.cat([get("indexer.wk.weight"), get("indexer.index_kpool_compress_gate")])
    return w


def make_inputs(cfg: DSALayerConfig, lens, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """mla_layer's inputs (x, the paged cache with random earlier rows at random pages, table,
    lengths) plus the indexer's caches: random pooled keys and ring rows (the earlier tokens')."""
    out = mla_layer.make_inputs(cfg.mla, lens, seed=seed, device=device)
    out.pop("cos"), out.pop("sin")                # NoPE: the program has the tables but never reads them
    a = cfg.mla.attn
    g = torch.Generator(device=device).manual_seed(seed + 5)
    B, P, d, E = a.batch, cfg.kpool, cfg.index_head_dim, cfg.max_entries
    out["index_pool_k"] = torch.randn(B, E, d, generator=g, device=device).to(torch.bfloat16)
    out["index_tail_k"] = torch.randn(B, P, d, generator=g, device=device).to(torch.bfloat16)
    out["index_tail_gate"] = torch.randn(B, P, d, generator=g, device=device).to(torch.bfloat16)
    return out


def _reference_model(cfg: DSALayerConfig, weights: dict, shared: bool):
    from types import SimpleNamespace

    from ..reference.dsa import DSAMLAReference
    f = {k: v.float() for k, v in weights.items()}
    spec = cfg.spec
    if shared:
        spec = replace(spec, indexer=replace(spec.indexer, shared=True))
    names = {"q_a_proj.weight": "q_a_proj", "q_a_layernorm.weight": "q_a_norm", "q_b_proj.weight": "q_b_proj",
             "kv_a_proj_with_mqa.weight": "kv_a_proj", "kv_a_layernorm.weight": "kv_a_norm",
             "kv_b_proj.weight": "kv_b_proj", "o_proj.weight": "o_proj", "indexer.wq_b.weight": "index_wq_b",
             "indexer.wk.weight": "index_wk", "indexer.k_norm.weight": "index_k_norm_w",
             "indexer.k_norm.bias": "index_k_norm_b", "indexer.weights_proj.weight": "index_weights_proj",
             "indexer.index_kpool_compress_ape": "index_ape", "indexer.index_kpool_compress_gate": "index_gate"}
    return DSAMLAReference(None, SimpleNamespace(attention=spec, index=1), {k: f[v] for k, v in names.items()})


def reference(cfg: DSALayerConfig, weights: dict, inputs: dict, selection: torch.Tensor | None = None,
              caches: dict | None = None) -> torch.Tensor:
    """x + DSAMLAReference.forward(rmsnorm(x) * input_norm) (fp32) over the caches' earlier rows:
    resid [M, D]. The latent and the indexer caches are bf16, as the program stores them (the
    forward rounds its new rows into them). selection [B, T, W] (-1 = none): the forward runs as a
    "shared" layer attending over it instead of its own indexer's. caches: a dict that receives
    the reference's caches after the step (to compare the indexer's cache update)."""
    from ..reference.common import StepInfo, rms_norm
    from ..reference.dsa import handoff
    from .mla_attention import decode_block
    a = cfg.mla.attn
    ref = _reference_model(cfg, weights, shared=selection is not None)
    dec = decode_block(a)
    lens = [int(x) for x in inputs["seq_lens"]]
    dev = inputs["x"].device
    dense = torch.zeros(a.batch, a.max_seq_len, a.d_qk, device=dev, dtype=torch.bfloat16)
    for b, n in enumerate(lens):                 # the rows before the new tokens
        if n > a.q_tokens:
            dense[b, :n - a.q_tokens] = dec.gather_kv(inputs, b, 0, n - a.q_tokens).to(dev).to(torch.bfloat16)
    cache = {"latent": dense}
    if selection is None:
        cache.update({k: inputs[k].clone() for k in ("index_tail_k", "index_tail_gate", "index_pool_k")})
    start = torch.tensor(lens, device=dev) - a.q_tokens
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(a.q_tokens, device=dev),
                    input_ids=torch.zeros(a.batch, a.q_tokens, dtype=torch.long, device=dev))
    if selection is not None:
        handoff(step)[0] = selection.long().to(dev)
    x = inputs["x"].float().view(a.batch, a.q_tokens, cfg.mla.hidden)
    h = rms_norm(x, weights["input_norm"].float(), cfg.mla.eps)
    out = ref.forward(h, cache, step)
    if caches is not None:
        caches.update(cache)
        caches["selection"] = handoff(step)[1]
    return (x + out).reshape(a.tokens, cfg.mla.hidden)


def check_selection(cfg: DSALayerConfig, weights: dict, inputs: dict, index: torch.Tensor, rtol: float = 1e-2) -> int:
    """Pools of the program's index list [B, T, W] that differ from the reference's selection
    (0: the same sets), after checking each difference is a near-tie: the pools only one side
    selected score within rtol x (the row's largest |score|) of the reference's k-th pool. Raises
    AssertionError otherwise."""
    caches = {}
    reference(cfg, weights, inputs, caches=caches)
    sel = caches["selection"]
    a = cfg.mla.attn
    P, k = cfg.kpool, cfg.index_topk // cfg.kpool
    # the reference's own index scores of every pool (its select's arithmetic)
    from ..reference.common import near_tie_swaps, rms_norm
    x = inputs["x"].float().view(a.batch, a.q_tokens, cfg.mla.hidden)
    h = rms_norm(x, weights["input_norm"].float(), cfg.mla.eps)
    f = {n: v.float() for n, v in weights.items()}
    q_resid = rms_norm(h @ f["q_a_proj"].T, f["q_a_norm"], cfg.mla.eps)
    q = (q_resid @ f["index_wq_b"].T).view(a.batch, a.q_tokens, cfg.index_heads, cfg.index_head_dim)
    keys = caches["index_pool_k"].float()
    s = torch.relu(torch.einsum("bthd,bmd->bthm", q, keys) * cfg.index_head_dim ** -0.5)
    wts = (h @ f["index_weights_proj"].T) * cfg.index_heads ** -0.5
    scores = torch.einsum("bth,bthm->btm", wts, s)
    diff = 0
    for b in range(a.batch):
        for t in range(a.q_tokens):
            pos = int(inputs["seq_lens"][b]) - a.q_tokens + t
            n = (pos + 1) // P
            row = scores[b, t, :n]
            got = {int(i) // P for i in index[b, t].tolist() if 0 <= i < n * P}
            want = {int(i) // P for i in sel[b, t].tolist() if 0 <= i < n * P}
            if got != want:
                diff += near_tie_swaps(row, got, min(k, n), rtol, f"sequence {b} token {t}: pool ")
    return diff
