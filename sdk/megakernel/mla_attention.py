"""MLA decode attention as megakernel instructions: the absorbed chain of one attention layer's
per-GPU head shard in ONE launch (sdk/blocks/mla_decode.py documents each block).

    q[:, :, :, :L]  = q_nope @ W_UK           mla_head_proj  (W_UK^T per head, into the query rows)
    o_part, lse     = split-KV attention      mla_decode     (waits the W_UK op)
    o_lat           = merge of the splits     mla_combine    (waits the decode op)
    o               = o_lat @ W_UV^T          mla_head_proj  (waits the combine op)

The caller (or the ops before it in a larger program) writes q_nope and the query's rope columns
q[..., L:] (q_pe after RoPE), the paged latent cache, the block table and the lengths; the
program writes o [B*T, H, v], the per-head output the o_proj GEMV (and the all-reduce) consume.
Each op waits only on the one before it, so its tiles start as soon as their inputs are complete,
on whatever SMs the schedule gave them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..blocks.base import NUM_THREADS
from ..blocks.mla_decode import (MLACombineBlock, MLACombineConfig, MLADecodeBlock, MLADecodeConfig,
                                 MLAHeadProjBlock, MLAHeadProjConfig, absorb_weights, choose_chunk,
                                 choose_mma, choose_splits, row_groups)
from .program import Program


@dataclass(frozen=True)
class MLAAttentionConfig:
    heads: int = 12                   # query heads of the shard (Kimi K3 TP8)
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v: int = 128
    softmax_scale: float = 192 ** -0.5
    scale_factor: float = 1.0         # extra factor on the scale (YaRN's mscale ** 2: mla_layer folds it in)
    batch: int = 1
    q_tokens: int = 1
    page_size: int = 64
    num_pages: int = 1024
    max_seq_len: int = 4096
    num_splits: int = 0               # 0 = choose_splits(batch, max_seq_len, num_sms)
    num_sms: int = 132
    kv_dtype: str = "bf16"
    # the decode tile's KV pipeline: in the persistent CTA its shared memory sits beside the
    # instruction records and the other tiles' allocations, so fewer stages than standalone
    decode_stages: int = 3
    decode_chunk: int = 0               # cache tokens per decode pipeline stage; 0 = auto: the attention
                                        # program takes 64 where choose_chunk does (its 2 stages of 74 KB;
                                        # Kimi K3 TP8 program B=64 32K 675 -> 639 us, B=8 128K 331 -> 315,
                                        # H200 2026-12-04), else 32; the sublayers 32 (no room beside their ring)
    decode_mma: str = "auto"            # the decode tile's MMAs: "warp" (mma.sync, every arch), "wgmma"
                                        # (Hopper warpgroup MMAs: a bf16 cache, 64-token chunks;
                                        # MLADecodeConfig.mma) or "auto": wgmma where choose_mma takes it
                                        # for this machine's GPU (none: warp) and the chunk is 64 - Kimi
                                        # K3 TP8 program, H100 2026-12-06: B=1 128K 71.5-71.9 -> 69.3-70.0
                                        # us, B=64 32K 851-852 -> 837-839, B=8 128K 417-418 -> 412-413
    decode_max_rows: int = 32           # query rows of a decode tile (16: the sublayers' last resort
                                        # for shared memory - mla_layer.build_program)
    head_proj_in_flight: bool = True    # W_UK / W_UV tiles load all their rows' weights at once
                                        # (MLAHeadProjConfig.rows_in_flight; Kimi K3 TP8 B=1 32K
                                        # sublayer 57.6 -> 53.5 us: W_UK 4.9 -> 2.0 us)

    @property
    def tokens(self) -> int:
        return self.batch * self.q_tokens

    def head_proj(self, n: int, k: int, rows_per_tile: int = 64, **kw) -> MLAHeadProjBlock:
        """The W_UK / W_UV per-head GEMV block: `n` output features per head over `k`, for every token."""
        rif = rows_per_tile // (NUM_THREADS // 32) if self.head_proj_in_flight else 0
        return MLAHeadProjBlock(MLAHeadProjConfig(heads=self.heads, n=n, k=k, m=self.tokens,
                                                  rows_per_tile=rows_per_tile, rows_in_flight=rif, **kw))

    @property
    def d_qk(self) -> int:
        return self.kv_lora + self.rope

    @property
    def splits(self) -> int:
        # each row group of a sequence is a tile of its own: cover the SMs with all of them
        groups = row_groups(self.q_tokens * self.heads, self.decode_max_rows)
        return self.num_splits or choose_splits(self.batch * groups, self.max_seq_len, self.num_sms)


def decode_block(cfg: MLAAttentionConfig) -> MLADecodeBlock:
    chunk = cfg.decode_chunk or (64 if cfg.decode_mma == "wgmma" else 32)    # wgmma takes only 64
    stages = cfg.decode_stages if cfg.decode_chunk or chunk == 32 else 0     # 64 unasked: the auto stages
    mma = cfg.decode_mma
    if mma == "auto":
        groups = row_groups(cfg.q_tokens * cfg.heads, cfg.decode_max_rows)
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        mma = choose_mma(cfg.batch * groups, cfg.max_seq_len, cfg.kv_dtype, cap, cfg.num_sms) if chunk == 64 else "warp"
    return MLADecodeBlock(MLADecodeConfig(
        heads=cfg.heads, softmax_scale=cfg.softmax_scale, batch=cfg.batch, q_tokens=cfg.q_tokens,
        kv_lora=cfg.kv_lora, rope=cfg.rope, scale_factor=cfg.scale_factor, page_size=cfg.page_size,
        num_pages=cfg.num_pages, max_seq_len=cfg.max_seq_len, num_splits=cfg.splits, kv_dtype=cfg.kv_dtype,
        chunk=chunk, stages=stages, max_tile_rows=cfg.decode_max_rows, mma=mma))


def add_cache_inputs(prog: Program, cfg: MLAAttentionConfig) -> MLADecodeBlock:
    """The paged cache (+ fp8 scales), block table and lengths as program inputs; returns the
    decode block they feed."""
    dec = decode_block(cfg)
    prog.buffer("kv", (cfg.num_pages, cfg.page_size, cfg.d_qk), cfg.kv_dtype, "input")
    if dec.fp8:
        prog.buffer("kv_scale", (cfg.num_pages, cfg.page_size, cfg.d_qk // dec.config.scale_group), "fp32", "input")
    prog.buffer("block_table", (cfg.batch, dec.max_pages), "int32", "input")
    prog.buffer("seq_lens", (cfg.batch,), "int32", "input")
    return dec


def add_attention_core(prog: Program, cfg: MLAAttentionConfig, dec: MLADecodeBlock, waits) -> int:
    """decode (waits `waits`: whatever completes the query rows) -> combine -> W_UV, with their
    buffers, reading "q" and the cache inputs and writing "o" [M, H, v]; returns the W_UV op."""
    H, L, M = cfg.heads, cfg.kv_lora, cfg.tokens
    prog.buffer("w_uv", (H, cfg.v, L), "bf16", "weight")
    prog.buffer("o_part", (cfg.batch, cfg.splits, dec.rows, L), "fp32")
    prog.buffer("lse_part", (cfg.batch, cfg.splits, dec.rows), "fp32")
    prog.buffer("o_lat", (cfg.batch, cfg.q_tokens, H, L), "bf16")
    prog.buffer("lse", (cfg.batch, cfg.q_tokens, H), "fp32")
    prog.buffer("o", (M, H, cfg.v), "bf16", "output")
    ops = {"q": "q", "kv": "kv", "block_table": "block_table", "seq_lens": "seq_lens",
           "o_part": "o_part", "lse_part": "lse_part"}
    if dec.fp8:
        ops["kv_scale"] = "kv_scale"
    if dec.sparse:
        ops["index"] = "index"             # DSA: each query token's key list (sdk/megakernel/dsa_layer.py)
    dec_op = prog.op(dec, ops, waits=waits, label="attn.decode")
    comb = MLACombineBlock(MLACombineConfig(heads=H, batch=cfg.batch, q_tokens=cfg.q_tokens, d_v=L,
                                            num_splits=cfg.splits))
    comb_op = prog.op(comb, {"o_part": "o_part", "lse_part": "lse_part", "out": "o_lat", "lse": "lse"},
                      waits=[dec_op], label="attn.combine")
    uv = cfg.head_proj(cfg.v, L, rows_per_tile=32)
    return prog.op(uv, {"x": "o_lat", "w": "w_uv", "y": "o"}, waits=[comb_op], label="attn.w_uv")


def build_program(cfg: MLAAttentionConfig) -> Program:
    """The attention program; decode_chunk 0 takes 64-token chunks (auto stages: the 2 of 74 KB
    that fit, for every supported row count) where choose_chunk does - long splits - else
    decode_block's default (32, or 64 for the wgmma tile)."""
    if not cfg.decode_chunk and choose_chunk(cfg.batch, cfg.max_seq_len, cfg.num_sms) == 64:
        cfg = replace(cfg, decode_chunk=64, decode_stages=0)
    return _build(cfg)


def _build(cfg: MLAAttentionConfig) -> Program:
    H, L, M = cfg.heads, cfg.kv_lora, cfg.tokens
    prog = Program()
    prog.buffer("q_nope", (M, H, cfg.nope), "bf16", "input")
    prog.buffer("q", (cfg.batch, cfg.q_tokens, H, cfg.d_qk), "bf16", "input")      # rope columns given
    dec = add_cache_inputs(prog, cfg)
    prog.buffer("w_uk_t", (H, L, cfg.nope), "bf16", "weight")
    uk = cfg.head_proj(L, cfg.nope, y_stride=cfg.d_qk)
    uk_op = prog.op(uk, {"x": "q_nope", "w": "w_uk_t", "y": "q"}, label="attn.w_uk")
    add_attention_core(prog, cfg, dec, [uk_op])
    return prog


def make_weights(cfg: MLAAttentionConfig, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random kv_b_proj [H*(nope+v), L] (bf16) and its absorbed halves (the program's weights)."""
    g = torch.Generator(device=device).manual_seed(seed)
    kv_b = (torch.randn(cfg.heads * (cfg.nope + cfg.v), cfg.kv_lora, generator=g, device=device)
            * cfg.kv_lora ** -0.5).to(torch.bfloat16)
    w_uk_t, w_uv = absorb_weights(kv_b, cfg.heads, cfg.nope, cfg.v)
    return {"kv_b_proj": kv_b, "w_uk_t": w_uk_t, "w_uv": w_uv}


def make_inputs(cfg: MLAAttentionConfig, lens, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """q_nope, q (random rope columns), a page pool with every sequence's pages at random places,
    block table (unused entries: wild page ids), lengths."""
    dec = decode_block(cfg)
    if len(lens) != cfg.batch or max(lens) > cfg.max_seq_len or min(lens) < cfg.q_tokens:
        raise ValueError(f"lens {list(lens)}: want {cfg.batch} lengths in [{cfg.q_tokens}, {cfg.max_seq_len}]")
    need = [math.ceil(n / cfg.page_size) for n in lens]
    if sum(need) > cfg.num_pages:
        raise ValueError(f"lens need {sum(need)} pages, the pool has {cfg.num_pages}")
    g = torch.Generator(device=device).manual_seed(seed)
    perm = torch.randperm(cfg.num_pages, generator=g, device=device).int()
    bt = torch.full((cfg.batch, dec.max_pages), 2 ** 30, dtype=torch.int32, device=device)
    k = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[k:k + n]
        k += n
    out = {"q_nope": torch.randn(cfg.tokens, cfg.heads, cfg.nope, generator=g, device=device).to(torch.bfloat16),
           "q": torch.randn(cfg.batch, cfg.q_tokens, cfg.heads, cfg.d_qk, generator=g, device=device).to(torch.bfloat16),
           "block_table": bt, "seq_lens": torch.tensor(list(lens), dtype=torch.int32, device=device)}
    pool = torch.randn(cfg.num_pages, cfg.page_size, cfg.d_qk, generator=g, device=device)
    if dec.fp8:
        from ..blocks.mla_decode import quantize_kv_fp8
        out["kv"], out["kv_scale"] = quantize_kv_fp8(pool, dec.config.scale_group)
    else:
        out["kv"] = pool.to(torch.bfloat16)
    return out


def reference(cfg: MLAAttentionConfig, weights: dict, inputs: dict) -> torch.Tensor:
    """fp32 attention of the shard over the EXPANDED keys and values (sdk/reference/mla.py's
    MLAReference.attend: per-head k = [W_UK c, k_pe], v = W_UV c, no absorption): o [B*T, H, v]."""
    from types import SimpleNamespace

    from ..reference.common import StepInfo
    from ..reference.mla import MLAReference
    from ..spec import MLASpec
    dec = decode_block(cfg)
    spec = MLASpec(num_heads=cfg.heads, kv_lora_rank=cfg.kv_lora, qk_nope_head_dim=cfg.nope,
                   qk_rope_head_dim=cfg.rope, v_head_dim=cfg.v,
                   softmax_scale=cfg.softmax_scale * cfg.scale_factor)
    ref = MLAReference(None, SimpleNamespace(attention=spec), {"kv_b_proj.weight": weights["kv_b_proj"].float()})
    lens = [int(x) for x in inputs["seq_lens"]]
    dev = inputs["q"].device
    dense = torch.zeros(cfg.batch, max(lens), cfg.d_qk, device=dev)
    for b, n in enumerate(lens):
        dense[b, :n] = dec.gather_kv(inputs, b, 0, n).to(dev)
    start = torch.tensor(lens, device=dev) - cfg.q_tokens
    step = StepInfo(start=start, positions=start[:, None] + torch.arange(cfg.q_tokens, device=dev),
                    input_ids=torch.zeros(cfg.batch, cfg.q_tokens, dtype=torch.long, device=dev))
    q_nope = inputs["q_nope"].float().view(cfg.batch, cfg.q_tokens, cfg.heads, cfg.nope)
    o = ref.attend(q_nope, inputs["q"][..., cfg.kv_lora:].float(), {"latent": dense}, step)
    return o.reshape(cfg.tokens, cfg.heads, cfg.v)
