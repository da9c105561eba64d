"""MLA decode attention in absorbed form over a paged latent cache, split-KV (FlashMLA-like).

Absorbed MLA (DeepSeek-V2 appendix; kimi_linear / glm5_next decode): with per-head W_UK [nope,
kv_lora] and W_UV [v, kv_lora] (rows of `kv_b_proj`), the per-head keys/values never exist:

    q_lat[h]  = q_nope[h] @ W_UK[h]                          [kv_lora]   (MLAHeadProjBlock)
    q[h]      = [q_lat[h], q_pe[h]]                          [kv_lora + rope] = [d_qk]
    s[h, n]   = (q[h] . cache[n]) * softmax_scale * scale_factor
    o_lat[h]  = softmax(s[h]) @ cache[:, :kv_lora]           [kv_lora]   (this block + combine)
    o[h]      = W_UV[h] @ o_lat[h]                           [v]         (MLAHeadProjBlock)

All heads of the GPU's shard read the same latent row per token (MQA-like), so one tile loads a
KV chunk once for all its query rows: rows = (query token t, head h), r = t * heads + h.

Blocks here:
- `MLADecodeBlock` (the core): tile = (sequence b, KV split s). It walks its split's part of the
  sequence in chunks of `chunk` tokens, through a `stages`-deep cp.async pipeline of KV chunks
  gathered row by row through the page table (one block-table read per chunk when chunks never
  straddle a page; rows addressed from a 64-bit base: pools past 2^31 elements); QK^T and PV on the tensor cores (warp MMA
  m16n8k16 bf16, fp32 accumulate); online softmax; writes the split's normalised partial output
  o_part[b, s] (fp32) and its log-sum-exp lse_part[b, s] (natural log of the scaled scores).
- `MLACombineBlock`: tile = (sequence b, query token t, head h, column slice): merges the S
  splits by their lse into out[b, t, h] (bf16, the latent output o_lat) and lse[b, t, h] (fp32).

Work split inside the core tile (8 warps): for QK^T warp w owns tokens [TPW (w % NWN), +TPW) of
the chunk and the k-slice (w // NWN) of d_qk (NWN = min(chunk / 8, 4) token groups of TPW = chunk /
NWN tokens, NWK = 8 / NWN k-slices; its query slice stays in registers when it fits, `q_regs`);
the partial scores go to shared memory; after one barrier every warp reads the whole chunk's
scores (summing the k-slices), does the same online softmax redundantly (cheap: chunk x rows
exps) and multiplies P by its own 1/8 of the value columns (d_v / 8 columns per warp). Two
barriers per chunk. Masking: token n of the sequence is visible to query t iff
n <= len - T + t (causal among the T new tokens, which are the last T of the context).

Formats:
- q [B, T, H, d_qk] bf16; cache [num_pages, page_size, d_qk] (token n of sequence b lives in page
  block_table[b, n // page_size], row n % page_size); block_table [B, max_pages] int32;
  seq_lens [B] int32 = context length including the T new tokens (ragged).
- kv_dtype "bf16", or "fp8_e4m3" with fp32 scales kv_scale [num_pages, page_size, d_qk / scale_group]:
  one scale per token per `scale_group` (default 64) columns. Why this granularity: a token's
  scales are fixed when it is appended (no re-quantisation of a page), 64 divides both 576
  (Kimi K3: 9 groups, 36 B of scales per 576 B row = +6%) and 512 (GLM-5.3); the rope part gets
  its own group(s). The device tile stages the fp8 rows, then dequantises the chunk into an f16
  buffer (exact e4m3 -> f16, times the f16-rounded scale, one f16 rounding) and runs the MMAs in
  f16 (Q and P converted once): e4m3 -> bf16 would need an fp32 round trip per element (measured
  Kimi K3 TP8 B=64 32K 822 -> 740 us, H200). f16's range: |q| and the dequantised cache values must
  stay below 65504 (MLA's absorbed queries and normalised latents are far inside it). Where a
  chunk lies in one page (`bulk_copy`, the default there; the mma.sync tile) thread 0 copies its
  rows and their scales as two cp.async.bulk copies onto the stage's mbarrier (H100: Kimi K3 TP8
  B=64 32K 0.68 -> 0.81 of the floor, B=1 128K 0.55 -> 0.64).
- o_part [B, S, T*H, d_v] fp32, lse_part [B, S, T*H] fp32 (-inf and zeros for a split with no
  visible token); out [B, T, H, d_v] bf16 and lse [B, T, H] fp32 after the combine.

Split-KV: the sequence's chunks [0, ceil(len / chunk)) are cut into `num_splits` equal ranges of
whole chunks (a static count: the megakernel's tile count is static); splits past the end write
lse = -inf. `choose_splits()` picks a count for (batch, context, SMs).

Row groups: a tile holds at most 32 query rows (two 16-row MMA fragments). More rows - Kimi K3's
96 heads on one GPU, 12 heads verifying T = 4 speculative tokens, GLM-5.3's 64 DSA heads - are cut
into `row_groups` equal groups, a tile each: tile = ((b * T + tq) * G + g) * S + s (dense: no tq).
The groups of one split read the same keys side by side, yet the repeats come mostly from DRAM
(96 heads in 3 groups: x2.3-2.7 the 12-head time, H100 2026-12-05); the floor counts the keys once.

Supported: any T * heads (row groups of <= 32, padded to 16 / 32 MMA rows), d_qk a multiple of 16 * NWK,
d_v = kv_lora a multiple of 128, rope 0 (NoPE: GLM-5.3) or any multiple of 16, page_size >= 1.
Sparse (DSA, GLM-5.3: `index_width` = W > 0): every query token attends only to the tokens of its
own index list index [B, T, W] int32 (TopKBlock's output: distinct tokens, any order, -1 = none),
so a tile is (sequence b, query token t, split s) with rows = heads (t's rows t*H .. t*H+H-1 of
o_part; the combine is unchanged). The tile walks list positions [0, W) instead of tokens: the
loader maps position j -> token index[b, t, j] -> page row (clamped to a real token), and keeps
each chunk's tokens in shared memory for the mask: visible iff 0 <= token <= len - T + t
(the causal rule; -1 entries never are). Splits cut the W positions. A GLM-5.3 "shared" indexer
layer passes the previous layer's list to the same operand.

Hopper variant (`mma="wgmma"`, sm_90a; `_mla_wgmma_cute.py`): the same tile on warpgroup MMAs
from a 128-byte-swizzled chunk of 64 tokens - S^T = K . Q^T and O^T = V^T . P^T read one copy of
the chunk (K-major for the scores, MN-major for the values), 18 + 16 async wgmma per warpgroup a
chunk instead of the mma.sync tile's ldmatrix fragments and MMA chains; a dense cache at chunk
64, tiles of <= 32 rows. bf16: 2 stages (72 KB each at d_qk 576); fp8: padded e4m3 stages
dequantised into one swizzled f16 chunk (f16 MMAs, as the mma.sync tile).

Not yet: one tile over more than 32 rows (row groups read the keys once a group), a per-step dynamic split scheduler
for ragged batches (FlashMLA's tile-scheduler metadata), skipping a sparse list's -1 tail (the
tile reads W rows whatever the context: a count operand would cut short contexts' work), fp8 MMA
(fp8 query), sparse lists on wgmma, a tcgen05 variant, the fused W_UV epilogue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec

NUM_WARPS = NUM_THREADS // 32
MAX_TILE_ROWS = 32                       # query rows of one tile: two 16-row MMA fragments
LOG2_E = 1.4426950408889634


def row_groups(unit_rows: int, max_rows: int = MAX_TILE_ROWS) -> int:
    """Tiles that share the keys of `unit_rows` query rows (a sequence's T x heads; sparse: one
    token's heads), each with at most `max_rows` of them."""
    return -(-unit_rows // max_rows)


def choose_splits(batch: int, context: int, num_sms: int = 132, chunk: int = 32,
                  min_chunks_per_split: int = 8) -> int:
    """KV splits per sequence: enough tiles to cover the SMs about once, but every split at least
    `min_chunks_per_split` chunks long (each split costs a partial-output write and a combine read
    of rows x d_v x 4 B, and a pipeline fill)."""
    by_sms = max(1, num_sms // max(1, batch))
    by_len = max(1, (context // chunk) // min_chunks_per_split)
    return max(1, min(by_sms, by_len))


def choose_chunk(batch: int, context: int, num_sms: int = 132) -> int:
    """Tokens per pipeline stage: 64 when every split walks at least 15 chunks of 64 (half the
    barriers and score exchanges per token; measured at Kimi K3 TP8 B=64 32K: 71% of copy vs 57%
    with 32, 2026-12-03; at batch 1 x 128K - 993 tokens a split - GLM-5.3 TP8 50.3 -> 46.9 us, its
    fp8 cache 58.3 -> 48.6, Kimi K3 TP8 fp8 59.0 -> 55.0, K3 TP8 / TP16 bf16 the same, H200
    2026-12-04), else 32 (at 64 only 2 stages fit, and a short split is mostly its pipeline
    fill: B=1 32K 24% vs 29%)."""
    splits = choose_splits(batch, context, num_sms, chunk=32)
    return 64 if context // splits >= 15 * 64 else 32


def choose_mma(batch: int, context: int, kv_dtype: str = "bf16", capability: tuple | None = None,
               num_sms: int = 132) -> str:
    """The standalone decode's MMA form: "wgmma" on Hopper (compute capability 9.0) for a bf16 cache
    where choose_chunk takes 64 - measured on the H200 (2026-12-06, decode + combine, fraction of
    the copy floor): Kimi K3 TP8 B=1 128K 0.69 -> 0.73, TP16 0.70 -> 0.74, GLM-5.3 TP8 0.68 ->
    0.74, K3 TP8 B=8 32K 0.82 -> 0.87, B=64 32K 0.97 -> 1.01; else "warp": slower there at B=1
    32K (chunk 32's 128 splits vs 64 splits of 64: 22.0 vs 23.9 us) and for the fp8 cache (its
    dequant: B=1 128K 53.5 vs 55.1 us). `capability`: (major, minor), None = none (no wgmma)."""
    if capability != (9, 0) or kv_dtype != "bf16" or choose_chunk(batch, context, num_sms) != 64:
        return "warp"
    return "wgmma"


@dataclass(frozen=True)
class MLADecodeConfig:
    heads: int                         # query heads of this GPU's shard (Kimi K3 TP8: 12)
    softmax_scale: float               # base scale, e.g. (nope + rope) ** -0.5 of the unabsorbed head
    batch: int = 1
    q_tokens: int = 1                  # T new tokens per sequence (MTP / speculative: T > 1)
    kv_lora: int = 512                 # latent width = d_v
    rope: int = 64                     # shared rope key part (0 = NoPE)
    scale_factor: float = 1.0          # extra factor on the scale (YaRN: mscale ** 2)
    page_size: int = 64
    num_pages: int = 1024              # pool size: static shape of the cache operand
    max_seq_len: int = 4096            # -> block table width
    num_splits: int = 1
    kv_dtype: str = "bf16"             # "bf16" | "fp8_e4m3"
    scale_group: int = 64              # fp8: columns per fp32 scale (per token)
    chunk: int = 32                    # tokens per pipeline stage (16, 32 or 64)
    stages: int = 0                    # pipeline depth; 0 = auto (what fits in ~200 KB, 2..8)
    index_width: int = 0               # DSA: entries of each query's index list (0 = dense attention)
    q_in_regs: bool | None = None      # query slice in registers across chunks; None = auto (q_regs)
    max_tile_rows: int = MAX_TILE_ROWS  # query rows of one tile (32, or 16: half the query and score
                                        # smem, the keys read by twice the row groups)
    mma: str = "warp"                  # "warp": mma.sync m16n8k16 from ldmatrix fragments (every arch);
                                       # "wgmma": Hopper warpgroup MMAs from swizzled shared memory
                                       # (sm_90a only; dense cache, chunk 64; _mla_wgmma_cute.py)
    kv_before_wait: bool = False       # standalone PDL launch: each tile copies its first chunks
                                       # BEFORE griddepcontrol.wait, over the previous grid's tail.
                                       # The contract: the grid before it may write q and the step's
                                       # q_tokens new cache rows, not older rows, the block table or
                                       # the lengths (a dense cache; see docs/mla_decode.md)
    bulk_copy: bool | None = None      # each chunk's rows and scales as two cp.async.bulk copies
                                       # (one thread) onto the stage's mbarrier instead of 16-byte
                                       # cp.async by every thread: an fp8 cache on the mma.sync tile
                                       # with chunks within a page. None = wherever that holds
                                       # (docs/mla_decode.md)


class MLADecodeBlock(Block):
    name = "mla_decode"
    Config = MLADecodeConfig
    wide_operands = ("kv", "kv_scale")   # rows addressed from a 64-bit base (pools of > 2^31 elements)

    # -- static facts --------------------------------------------------------------------------
    @property
    def d_qk(self) -> int:
        return self.config.kv_lora + self.config.rope

    @property
    def d_v(self) -> int:
        return self.config.kv_lora

    @property
    def rows(self) -> int:
        return self.config.q_tokens * self.config.heads

    @property
    def sparse(self) -> bool:
        return self.config.index_width > 0

    @property
    def unit_rows(self) -> int:           # query rows that read the same keys: all T tokens' rows,
        return self.config.heads if self.sparse else self.rows   # or one token's (sparse)

    @property
    def row_groups(self) -> int:
        """Tiles that share a unit's keys, each with an equal part of its rows (at most
        max_tile_rows: the MMA's two 16-row fragments, or one). Each group reads the unit's keys
        again."""
        return row_groups(self.unit_rows, self.config.max_tile_rows)

    @property
    def tile_rows(self) -> int:           # query rows of one tile (the last group may have fewer)
        return -(-self.unit_rows // self.row_groups)

    def tile_coords(self, tile: int) -> tuple[int, int, int, int]:
        """(sequence b, query token tq (sparse; else 0), row group g, split s) of tile `tile`:
        tile = ((b * T + tq) * G + g) * S + s (dense: no tq), so a group count of 1 keeps the
        one-group numbering."""
        c = self.config
        u, s = divmod(tile, c.num_splits)
        u, g = divmod(u, self.row_groups)
        b, tq = divmod(u, c.q_tokens) if self.sparse else (u, 0)
        return b, tq, g, s

    def group_span(self, g: int) -> tuple[int, int]:
        """Rows [lo, hi) of the unit that row group g owns."""
        lo = g * self.tile_rows
        return lo, min(lo + self.tile_rows, self.unit_rows)

    @property
    def m_pad(self) -> int:
        return 16 * math.ceil(self.tile_rows / 16)

    @property
    def nwn(self) -> int:                 # warps along the chunk's tokens in QK^T (at most 4)
        return min(self.config.chunk // 8, 4)

    @property
    def tpw(self) -> int:                 # tokens of one warp in QK^T (8, or 16 at chunk 64)
        return self.config.chunk // self.nwn

    @property
    def q_regs(self) -> bool:
        """The warp's query slice held in registers for the whole tile (ldmatrix once, not per
        chunk: the per-chunk Q reads were half the tile's shared-memory traffic, and the tile
        stalled on shared memory - Nsight Compute, Kimi K3 TP8 B=64). Auto: slices up to 288
        columns (72 registers at 16 rows)."""
        c = self.config
        if c.q_in_regs is not None:
            return c.q_in_regs
        return self.m_pad == 16 and self.d_qk // self.nwk <= 288

    @property
    def nwk(self) -> int:                 # warps along d_qk in QK^T (wgmma: the two warpgroups)
        return 2 if self.wgmma else NUM_WARPS // self.nwn

    @property
    def wgmma(self) -> bool:
        return self.config.mma == "wgmma"

    @property
    def stages(self) -> int:
        c = self.config
        if c.stages:
            return c.stages
        # auto: as many stages as fit in ~200 KB (H200 / B200 allow 227 KB; a megakernel's records
        # and other tiles sit beside it), 2..8
        fixed = self._smem_bytes(0)
        per = self._smem_bytes(1) - fixed
        return max(2, min(8, (200 * 1024 - fixed) // per))

    @property
    def fp8(self) -> bool:
        return self.config.kv_dtype == "fp8_e4m3"

    @property
    def bulk_ok(self) -> bool:
        """The bulk copies' conditions: an fp8 cache (its stage is read by the dequant, so its rows
        need no padding), the mma.sync tile, dense chunks that never straddle a page."""
        c = self.config
        return self.fp8 and not self.wgmma and not self.sparse and c.page_size % c.chunk == 0

    @property
    def bulk(self) -> bool:
        return self.bulk_ok if self.config.bulk_copy is None else self.config.bulk_copy

    @property
    def max_pages(self) -> int:
        return math.ceil(self.config.max_seq_len / self.config.page_size)

    @property
    def scale(self) -> float:
        return self.config.softmax_scale * self.config.scale_factor

    def smem_bytes(self) -> int:
        return self._smem_bytes(self.stages)

    def tile_waits_for_grid(self) -> bool:
        return self.config.kv_before_wait

    def own_smem_bytes(self) -> int:
        return self.smem_bytes()

    @property
    def score_row(self) -> int:
        """fp32 row stride of the partial-score buffer: chunk + 8 (padded: conflict-free 8-byte
        accesses of the MMA fragments, see _mla_cute.py); wgmma: chunk + 4 (its accumulator's
        transposed 4-byte stores, see _mla_wgmma_cute.py)."""
        return self.config.chunk + (4 if self.wgmma else 8)

    @property
    def p_row(self) -> int:
        """16-bit row stride of the shared P: chunk + 8, conflict-free ldmatrix."""
        return self.config.chunk + 8

    def _smem_bytes(self, stages: int) -> int:
        c = self.config
        if self.wgmma:                           # 128-byte-swizzled rows, unpadded (1 KB aligned)
            bufs = 1 if self.fp8 else stages     # MMA-ready chunks: the stages, or fp8's f16 buffer
            b = 1024 + bufs * c.chunk * self.d_qk * 2 + self.m_pad * self.d_qk * 2 + self.m_pad * c.chunk * 2
            if self.fp8:                         # padded fp8 stages and their scales
                b += stages * c.chunk * (self.d_qk + 16) + stages * c.chunk * (self.d_qk // c.scale_group) * 4
            return b + self.nwk * self.m_pad * self.score_row * 4 + 3 * self.m_pad * 4
        rs = self.d_qk + 8                       # padded bf16 row: conflict-free ldmatrix
        b = self.m_pad * rs * 2                  # sQ
        b += self.nwk * self.m_pad * self.score_row * 4                    # sS partial scores
        b += self.m_pad * self.p_row * 2 + 3 * self.m_pad * 4              # sP, rescale + row stats
        if self.fp8:
            b += stages * c.chunk * (self.d_qk + (0 if self.bulk else 16))     # fp8 stages (rows padded
            b += stages * 8 if self.bulk else 0                            # for cp.async); bulk: mbarriers
            b += stages * c.chunk * (self.d_qk // c.scale_group) * 4       # their scales
            b += c.chunk * rs * 2                                          # dequantised chunk
        else:
            b += stages * c.chunk * rs * 2
        if self.sparse:
            b += stages * c.chunk * 4                                      # each chunk's tokens
        return b

    def check(self):
        c = self.config
        if c.kv_dtype not in ("bf16", "fp8_e4m3"):
            self.unsupported(f"mla_decode: kv dtype {c.kv_dtype!r} (supported: bf16, fp8_e4m3)")
        if c.chunk not in (16, 32, 64):
            self.unsupported(f"mla_decode: chunk={c.chunk} (supported: 16, 32, 64)")
        if c.heads < 1 or c.q_tokens < 1:
            self.unsupported("mla_decode: heads and q_tokens must be >= 1")
        if c.max_tile_rows not in (16, MAX_TILE_ROWS):
            self.unsupported(f"mla_decode: max_tile_rows={c.max_tile_rows} (16 or {MAX_TILE_ROWS})")
        if c.index_width < 0:
            self.unsupported("mla_decode: index_width >= 0")
        if c.kv_lora % (8 * NUM_WARPS * 2):
            self.unsupported(f"mla_decode: kv_lora={c.kv_lora} must be a multiple of {16 * NUM_WARPS}")
        if c.rope % 16:
            self.unsupported(f"mla_decode: rope={c.rope} must be a multiple of 16 (or 0)")
        if self.d_qk % (16 * self.nwk):
            self.unsupported(f"mla_decode: d_qk={self.d_qk} must split into {self.nwk} multiples of 16")
        if self.fp8 and (self.d_qk % c.scale_group or c.scale_group % 16):
            self.unsupported(f"mla_decode fp8: scale_group={c.scale_group} must divide d_qk={self.d_qk} "
                             f"and be a multiple of 16")
        if c.num_splits < 1 or c.batch < 1 or c.q_tokens < 1:
            self.unsupported("mla_decode: batch, q_tokens and num_splits must be >= 1")
        if c.mma not in ("warp", "wgmma"):
            self.unsupported(f"mla_decode: mma={c.mma!r} (supported: warp, wgmma)")
        if self.wgmma:
            if self.sparse or c.chunk != 64:
                self.unsupported("mla_decode mma=wgmma: a dense cache at chunk 64 (sparse lists take mma=warp)")
            if self.d_qk % 64 or self.d_v % 128:
                self.unsupported(f"mla_decode mma=wgmma: d_qk={self.d_qk} a multiple of 64, d_v={self.d_v} of 128")
        if c.bulk_copy and not self.bulk_ok:
            self.unsupported("mla_decode: bulk_copy needs an fp8 cache, mma='warp', a dense cache and "
                             f"chunks within a page (page_size={c.page_size} a multiple of chunk={c.chunk})")
        if c.kv_before_wait and self.sparse:
            self.unsupported("mla_decode: kv_before_wait needs a dense cache (a sparse tile's rows come from "
                             "index lists the grid before it writes)")
        if self.smem_bytes() > 227 * 1024:
            self.unsupported(f"mla_decode: {self.smem_bytes()} B of shared memory > 227 KiB "
                             f"(lower stages or chunk)")

    def operand_specs(self):
        c = self.config
        kvdt = c.kv_dtype
        specs = [OperandSpec("q", (c.batch, c.q_tokens, c.heads, self.d_qk), "bf16"),
                 OperandSpec("kv", (c.num_pages, c.page_size, self.d_qk), kvdt)]
        if self.fp8:
            specs.append(OperandSpec("kv_scale", (c.num_pages, c.page_size, self.d_qk // c.scale_group), "fp32"))
        specs += [OperandSpec("block_table", (c.batch, self.max_pages), "int32"),
                  OperandSpec("seq_lens", (c.batch,), "int32")]
        if self.sparse:
            specs.append(OperandSpec("index", (c.batch, c.q_tokens, c.index_width), "int32"))
        specs += [OperandSpec("o_part", (c.batch, c.num_splits, self.rows, self.d_v), "fp32", output=True),
                  OperandSpec("lse_part", (c.batch, c.num_splits, self.rows), "fp32", output=True)]
        return specs

    def num_tiles(self) -> int:
        c = self.config
        return c.batch * c.num_splits * self.row_groups * (c.q_tokens if self.sparse else 1)

    def cost(self, context: int | None = None) -> Cost:
        """Per tile at `context` tokens per sequence (default max_seq_len; sparse: the list
        width): its share of the KV rows, the query, the partial outputs."""
        c = self.config
        ctx = c.index_width if self.sparse else (context or c.max_seq_len)
        toks = math.ceil(ctx / c.num_splits)
        row = self.d_qk * (1 if self.fp8 else 2) + (4 * self.d_qk // c.scale_group if self.fp8 else 0)
        r = self.tile_rows
        b = toks * (row + 4 + (4 if self.sparse else 0)) + r * self.d_qk * 2 + r * (self.d_v + 1) * 4
        return Cost(bytes=b, flops=2 * toks * r * (self.d_qk + self.d_v))

    def kv_bytes(self, seq_lens) -> int:
        """Bytes of cache rows (and scales) the whole op must read: its bandwidth floor (sparse:
        min(W, len) selected rows per query token)."""
        c = self.config
        row = self.d_qk * (1 if self.fp8 else 2) + (4 * self.d_qk // c.scale_group if self.fp8 else 0)
        if self.sparse:
            return sum(min(c.index_width, int(x)) for x in seq_lens) * c.q_tokens * row
        return int(sum(int(x) for x in seq_lens)) * row

    # -- torch faces ---------------------------------------------------------------------------
    def split_range(self, length: int, split: int) -> tuple[int, int]:
        """Token range [lo, hi) of `split` for a sequence of `length` tokens (whole chunks);
        sparse: the range of index-list positions (`length` = the list width)."""
        c = self.config
        n_chunks = -(-length // c.chunk)
        per = -(-n_chunks // c.num_splits)
        lo = min(split * per, n_chunks) * c.chunk
        hi = min(min((split + 1) * per, n_chunks) * c.chunk, length)
        return lo, max(lo, hi)

    def gather_kv(self, t: dict, b: int, lo: int, hi: int) -> torch.Tensor:
        """fp32 cache rows of tokens [lo, hi) of sequence b (fp8: dequantised, bf16-rounded)."""
        return self.gather_tokens(t, b, torch.arange(lo, hi))

    def gather_tokens(self, t: dict, b: int, n: torch.Tensor) -> torch.Tensor:
        """fp32 cache rows of tokens n [k] (int64) of sequence b, as gather_kv."""
        c = self.config
        pages = t["block_table"][b].long().cpu()[n // c.page_size].to(t["kv"].device)
        offs = (n % c.page_size).to(t["kv"].device)
        rows = t["kv"][pages, offs].float()
        if self.fp8:
            sc = t["kv_scale"][pages, offs].float()
            # the format's value: bf16(e4m3 * scale), what the device feeds its bf16 MMAs
            rows = (rows * sc.repeat_interleave(c.scale_group, dim=-1)).to(torch.bfloat16).float()
        return rows

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, lo: int, length: int):
        """q [T*H, d_qk] fp32 over rows kv [n, d_qk] fp32 of tokens lo.. : (o [rows, d_v]
        normalised, lse [rows]) with the causal rule; empty -> zeros, -inf."""
        c = self.config
        rows = q.shape[0]
        if kv.shape[0] == 0:
            return torch.zeros(rows, self.d_v), torch.full((rows,), float("-inf"))
        s = (q @ kv.T) * self.scale
        tok = torch.arange(lo, lo + kv.shape[0])
        qpos = length - c.q_tokens + torch.arange(rows) // c.heads
        s = s.masked_fill(tok[None, :] > qpos[:, None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, None].clamp_min(-1e30))
        p = torch.nan_to_num(p, nan=0.0)
        o = p @ kv[:, :self.d_v]
        return o, lse

    def sparse_keys(self, t: dict, b: int, tq: int, lo: int, hi: int):
        """(fp32 rows [hi - lo, d_qk], visible [hi - lo]) of index-list positions [lo, hi) of
        query token tq of sequence b; invisible positions read a clamped real token."""
        length = int(t["seq_lens"][b])
        idx = t["index"][b, tq, lo:hi].long().cpu()
        ok = (idx >= 0) & (idx <= length - self.config.q_tokens + tq)
        return self.gather_tokens(t, b, idx.clamp(0, length - 1)).cpu(), ok

    def _sparse_q(self, t, b, tq):
        c = self.config
        return t["q"][b, tq].float().reshape(c.heads, self.d_qk).cpu()

    def reference(self, **t) -> dict[str, torch.Tensor]:
        """The definition: per split, the normalised partial attention and its lse (fp32)."""
        c = self.config
        if self.sparse:
            return self._sparse_reference(t)
        o_part = torch.zeros(c.batch, c.num_splits, self.rows, self.d_v)
        lse_part = torch.full((c.batch, c.num_splits, self.rows), float("-inf"))
        for b in range(c.batch):
            length = int(t["seq_lens"][b])
            q = t["q"][b].float().reshape(self.rows, self.d_qk).cpu()
            for s in range(c.num_splits):
                lo, hi = self.split_range(length, s)
                kv = self.gather_kv(t, b, lo, hi).cpu()
                o_part[b, s], lse_part[b, s] = self._attend(q, kv, lo, length)
        return {"o_part": o_part, "lse_part": lse_part}

    def _sparse_reference(self, t):
        c, H = self.config, self.config.heads
        o_part = torch.zeros(c.batch, c.num_splits, self.rows, self.d_v)
        lse_part = torch.full((c.batch, c.num_splits, self.rows), float("-inf"))
        for b in range(c.batch):
            for tq in range(c.q_tokens):
                q = self._sparse_q(t, b, tq)
                for s in range(c.num_splits):
                    lo, hi = self.split_range(c.index_width, s)
                    kv, ok = self.sparse_keys(t, b, tq, lo, hi)
                    if not ok.any():
                        continue
                    sc = ((q @ kv.T) * self.scale).masked_fill(~ok[None], float("-inf"))
                    lse = torch.logsumexp(sc, -1)
                    o_part[b, s, tq * H:(tq + 1) * H] = torch.softmax(sc, -1) @ kv[:, :self.d_v]
                    lse_part[b, s, tq * H:(tq + 1) * H] = lse
        return {"o_part": o_part, "lse_part": lse_part}

    def _online_softmax(self, q: torch.Tensor, chunks):
        """The device tile's attention over key chunks in order - `chunks` yields (kv rows, mask of
        the keys each query row may see) - as an online softmax in fp32 with P rounded to bf16
        before P @ V, like the MMA. Returns (o [rows, d_v], lse [rows]; -inf and zeros for a row
        that saw no key)."""
        rows = q.shape[0]
        m = torch.full((rows,), float("-inf"))
        l = torch.zeros(rows)
        acc = torch.zeros(rows, self.d_v)
        for kv, visible in chunks:
            sc = ((q @ kv.T) * self.scale).masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, sc.max(dim=-1).values)
            m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc - m_use[:, None])
            alpha = torch.exp(m - m_use)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + p.to(torch.bfloat16).float() @ kv[:, :self.d_v]
            m = m_new
        ok = l > 0
        o = torch.where(ok[:, None], acc / l.clamp_min(1e-30)[:, None], torch.zeros_like(acc))
        lse = torch.where(ok, m + torch.log(l.clamp_min(1e-30)), torch.full_like(l, float("-inf")))
        return o, lse

    def _emulate_sparse_tile(self, t: dict, tile: int) -> None:
        c, H = self.config, self.config.heads
        b, tq, g, s = self.tile_coords(tile)
        h0, h1 = self.group_span(g)
        lo, hi = self.split_range(c.index_width, s)
        q = self._sparse_q(t, b, tq)[h0:h1]

        def chunks():
            for c0 in range(lo, hi, c.chunk):
                kv, ok = self.sparse_keys(t, b, tq, c0, min(c0 + c.chunk, hi))
                yield kv, ok[None]

        o, lse = self._online_softmax(q, chunks())
        t["o_part"][b, s, tq * H + h0:tq * H + h1] = o.to(t["o_part"].dtype).to(t["o_part"].device)
        t["lse_part"][b, s, tq * H + h0:tq * H + h1] = lse.to(t["lse_part"].dtype).to(t["lse_part"].device)

    def emulate_tile(self, t: dict, tile: int) -> None:
        """Torch twin of one tile: same split bounds, chunk by chunk online softmax in fp32 with
        the bf16 rounding of P and of the dequantised fp8 rows of the bf16 path (an fp8 cache's
        device tile rounds them to f16: finer)."""
        c = self.config
        if self.sparse:
            return self._emulate_sparse_tile(t, tile)
        b, _, g, s = self.tile_coords(tile)
        r0, r1 = self.group_span(g)
        length = int(t["seq_lens"][b])
        lo, hi = self.split_range(length, s)
        q = t["q"][b].float().reshape(self.rows, self.d_qk).cpu()[r0:r1]
        qpos = length - c.q_tokens + torch.arange(r0, r1) // c.heads

        def chunks():
            for c0 in range(lo, hi, c.chunk):
                kv = self.gather_kv(t, b, c0, min(c0 + c.chunk, hi)).cpu()
                tok = torch.arange(c0, c0 + kv.shape[0])
                yield kv, tok[None, :] <= qpos[:, None]

        o, lse = self._online_softmax(q, chunks())
        t["o_part"][b, s, r0:r1] = o.to(t["o_part"].dtype).to(t["o_part"].device)
        t["lse_part"][b, s, r0:r1] = lse.to(t["lse_part"].dtype).to(t["lse_part"].device)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        if self.wgmma:
            from ._mla_wgmma_cute import build_mla_decode_wgmma_tile
            return build_mla_decode_wgmma_tile(self)
        from ._mla_cute import build_mla_decode_tile
        return build_mla_decode_tile(self)


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLACombineConfig:
    heads: int
    batch: int = 1
    q_tokens: int = 1
    d_v: int = 512
    num_splits: int = 1
    cols_per_tile: int = 0              # output columns of one tile (0 = auto: see cols_per_tile)


class MLACombineBlock(Block):
    """out[b, t, h] = sum_s w_s o_part[b, s, t*H+h] with w = softmax over s of lse_part; lse too.
    A tile is one (sequence, query token, head, column slice): many tiles, so that a batch-1 step
    with 128 splits spreads its S x heads x d_v x 4 bytes of partial outputs over many SMs (one
    tile per sequence read them serially: 360 us at Kimi K3 TP8, 32K context). Thread (sg, cg)
    sums splits sg, sg + SG, .. of its 4 columns cg with 16-byte loads, several in flight; the SG
    split groups are summed in shared memory. Supported: d_v a multiple of 128."""
    name = "mla_combine"
    Config = MLACombineConfig
    TILES_WANTED = 128

    @property
    def rows(self) -> int:
        return self.config.q_tokens * self.config.heads

    @property
    def cols_per_tile(self) -> int:
        """Auto, with many splits (16 or more): the widest of 128 / 64 / 32 columns that still
        makes TILES_WANTED tiles (about an SM each: a batch-1 step's combine is a few dependent
        L2 round trips a tile, so its time is how many splits a thread walks; narrower tiles
        give more threads per split), else 32. Few splits: the whole row (a tile reads
        S x d_v x 4 B: few tiles for a large batch of few splits)."""
        c = self.config
        if c.cols_per_tile:
            return c.cols_per_tile
        if c.num_splits < 16:
            return c.d_v
        rows = c.batch * self.rows
        return next((cw for cw in (128, 64) if rows * (c.d_v // cw) >= self.TILES_WANTED), 32)

    def check(self):
        c = self.config
        cw = self.cols_per_tile
        if c.d_v % 128:
            self.unsupported(f"mla_combine: d_v={c.d_v} must be a multiple of 128")
        if cw not in (32, 64, 128, 256, 512, 1024) or c.d_v % cw:
            self.unsupported(f"mla_combine: cols_per_tile={cw} must be 32, 64, 128, 256, 512 or 1024 and divide "
                             f"d_v={c.d_v}")
        if c.num_splits < 1:
            self.unsupported("mla_combine: num_splits >= 1")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("o_part", (c.batch, c.num_splits, self.rows, c.d_v), "fp32"),
                OperandSpec("lse_part", (c.batch, c.num_splits, self.rows), "fp32"),
                OperandSpec("out", (c.batch, c.q_tokens, c.heads, c.d_v), "bf16", output=True),
                OperandSpec("lse", (c.batch, c.q_tokens, c.heads), "fp32", output=True)]

    def num_tiles(self) -> int:
        c = self.config
        return c.batch * c.q_tokens * c.heads * (c.d_v // self.cols_per_tile)

    def own_smem_bytes(self) -> int:
        cw = self.cols_per_tile
        return 4 * self.config.num_splits + 4 * (NUM_THREADS // (cw // 4)) * cw + 16   # weights, split sums, alignment

    def cost(self) -> Cost:
        c = self.config
        cw = self.cols_per_tile
        return Cost(bytes=c.num_splits * (cw + 1) * 4 + cw * 2 + 4, flops=2 * c.num_splits * cw)

    @staticmethod
    def combine(o_part: torch.Tensor, lse_part: torch.Tensor):
        """o_part [..., S, R, d_v], lse_part [..., S, R] -> (o [..., R, d_v], lse [..., R]) fp32."""
        lse = torch.logsumexp(lse_part.float(), dim=-2)
        w = torch.exp(lse_part.float() - lse.unsqueeze(-2).clamp_min(-1e30))
        w = torch.nan_to_num(w, nan=0.0)
        o = (w.unsqueeze(-1) * o_part.float()).sum(dim=-3)
        return o, lse

    def reference(self, **t):
        c = self.config
        o, lse = self.combine(t["o_part"], t["lse_part"])
        return {"out": o.view(c.batch, c.q_tokens, c.heads, c.d_v),
                "lse": lse.view(c.batch, c.q_tokens, c.heads)}

    def emulate_tile(self, t, tile):
        c = self.config
        cw = self.cols_per_tile
        rest, cq = divmod(tile, c.d_v // cw)
        rest, h = divmod(rest, c.heads)
        b, tq = divmod(rest, c.q_tokens)
        r, cols = tq * c.heads + h, slice(cq * cw, (cq + 1) * cw)
        o, lse = self.combine(t["o_part"][b, :, r:r + 1, cols], t["lse_part"][b, :, r:r + 1])
        t["out"][b, tq, h, cols] = o[0].to(t["out"].dtype)
        if cq == 0:
            t["lse"][b, tq, h] = lse[0].to(t["lse"].dtype)

    def _build_device_tile(self):
        from ._mla_cute import build_mla_combine_tile
        return build_mla_combine_tile(self)


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLAHeadProjConfig:
    """y[m, h, n] = sum_k x[m, h, k] * w[h, n, k]: the per-head absorption GEMVs.
    W_UK: x = q_nope [.., nope], w[h] = W_UK[h]^T [kv_lora, nope], y = q_lat (written into the
    first kv_lora columns of the attention query, row stride y_stride = d_qk).
    W_UV: x = o_lat [.., kv_lora], w[h] = W_UV[h] [v, kv_lora], y = o [.., v]."""
    heads: int
    n: int
    k: int
    m: int = 1                          # tokens (batch x q_tokens)
    x_stride: int = 0                   # elements between heads' x rows (0 = k)
    y_stride: int = 0                   # elements between heads' y rows (0 = n)
    rows_per_tile: int = 64
    rows_in_flight: int = 0             # rows a warp loads before using any, x loaded once per tile
                                        # (0: one row at a time, each row a dependent weight
                                        # load; MLAAttentionConfig sets a warp's rows: measured faster)


class MLAHeadProjBlock(Block):
    """Per-head GEMV on the CUDA cores: a tile = `rows_per_tile` output features of one head, for
    all m tokens; one warp per output feature at a time, lanes over k in 8-element (16 B) loads,
    fp32 accumulation. Supported: k a multiple of 8 (k <= 8 * 32 * 8), n a multiple of
    rows_per_tile, m <= 64, bf16 in and out."""
    name = "mla_head_proj"
    Config = MLAHeadProjConfig

    @property
    def xs(self) -> int:
        return self.config.x_stride or self.config.k

    @property
    def ys(self) -> int:
        return self.config.y_stride or self.config.n

    def check(self):
        c = self.config
        if c.k % 8 or c.k > 8 * 32 * 8:
            self.unsupported(f"mla_head_proj: k={c.k} must be a multiple of 8 and <= 2048")
        if c.n % c.rows_per_tile or c.rows_per_tile % NUM_WARPS:
            self.unsupported(f"mla_head_proj: n={c.n}, rows_per_tile={c.rows_per_tile}")
        if not 1 <= c.m <= 64:
            self.unsupported(f"mla_head_proj: m={c.m} (supported 1..64)")
        if c.rows_in_flight and (c.rows_per_tile // NUM_WARPS) % c.rows_in_flight:
            self.unsupported(f"mla_head_proj: rows_in_flight={c.rows_in_flight} must divide a warp's "
                             f"{c.rows_per_tile // NUM_WARPS} rows")
        if self.xs < c.k or self.ys < c.n or self.xs % 8 or self.ys % 2:
            self.unsupported("mla_head_proj: strides must be >= the row widths, x 8-aligned")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("x", (c.m, c.heads, self.xs), "bf16"),
                OperandSpec("w", (c.heads, c.n, c.k), "bf16"),
                OperandSpec("y", (c.m, c.heads, self.ys), "bf16", output=True)]

    def num_tiles(self) -> int:
        return self.config.heads * (self.config.n // self.config.rows_per_tile)

    def cost(self) -> Cost:
        c = self.config
        r = c.rows_per_tile
        return Cost(bytes=r * c.k * 2 + c.m * c.k * 2 + c.m * r * 2, flops=2 * r * c.k * c.m)

    def reference(self, **t):
        c = self.config
        x = t["x"].float()[..., :c.k]
        y = torch.einsum("mhk,hnk->mhn", x, t["w"].float())
        out = t["y"].float().clone() if "y" in t else torch.zeros(c.m, c.heads, self.ys)
        out[..., :c.n] = y
        return {"y": out}

    def emulate_tile(self, t, tile):
        c = self.config
        per = c.n // c.rows_per_tile
        h, j = divmod(tile, per)
        rows = slice(j * c.rows_per_tile, (j + 1) * c.rows_per_tile)
        y = t["x"][:, h, :c.k].float() @ t["w"][h, rows].float().T
        t["y"][:, h, rows] = y.to(t["y"].dtype)

    def _build_device_tile(self):
        from ._mla_cute import build_head_proj_tile
        return build_head_proj_tile(self)


# ------------------------------------------------------------------------------------------------
def quantize_kv_fp8(kv: torch.Tensor, group: int = 64):
    """bf16/fp32 cache rows [..., d] -> (e4m3 [..., d], fp32 scales [..., d / group]): per token
    per group, scale = amax / 448."""
    x = kv.float()
    g = x.unflatten(-1, (-1, group))
    scale = (g.abs().amax(-1) / 448.0).clamp_min(1e-12)
    q = (g / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def absorbed_attention(q: torch.Tensor, kv_rows: torch.Tensor, seq_lens, q_tokens: int, heads: int,
                       d_v: int, scale: float):
    """fp32 absorbed MLA decode over dense per-sequence rows: q [B, T, H, d_qk], kv_rows a list
    of [len_b, d_qk] -> (o_lat [B, T, H, d_v], lse [B, T, H]). The oracle of the blocks above."""
    f = lambda x: x if x.dtype == torch.float64 else x.float()      # fp32, or fp64 when given
    outs, lses = [], []
    for b, length in enumerate(int(x) for x in seq_lens):
        kv = f(kv_rows[b])
        qb = f(q[b]).reshape(q_tokens * heads, -1)
        s = (qb @ kv.T) * scale
        qpos = length - q_tokens + torch.arange(q_tokens * heads, device=s.device) // heads
        s = s.masked_fill(torch.arange(length, device=s.device)[None, :] > qpos[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.softmax(s, -1) @ kv[:, :d_v]).view(q_tokens, heads, d_v))
        lses.append(lse.view(q_tokens, heads))
    return torch.stack(outs), torch.stack(lses)


def absorb_weights(kv_b_proj: torch.Tensor, heads: int, nope: int, v: int):
    """kv_b_proj.weight [H*(nope+v), kv_lora] -> (W_UK^T [H, kv_lora, nope], W_UV [H, v, kv_lora]):
    the operand `w` of MLAHeadProjBlock for the q absorption and for the output."""
    w = kv_b_proj.view(heads, nope + v, -1)
    return w[:, :nope].transpose(1, 2).contiguous(), w[:, nope:].contiguous()


def mla_compile_cases() -> list:
    """Representative static configs for the no-GPU compile checks (sdk/compile.py)."""
    from .mla_prologue import MLARopeAppendBlock, MLARopeAppendConfig
    k3 = 192 ** -0.5
    return [
        MLARopeAppendBlock(MLARopeAppendConfig(heads=12, batch=8, q_tokens=2, num_pages=4096, max_seq_len=131072)),
        MLARopeAppendBlock(MLARopeAppendConfig(heads=8, nope=192, rope=0, batch=1)),        # GLM-5.3: NoPE
        MLARopeAppendBlock(MLARopeAppendConfig(heads=12, batch=8, kv_dtype="fp8_e4m3", num_pages=4096,
                                               max_seq_len=32768)),
        MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=k3, batch=1, num_splits=132,
                                       num_pages=2048, max_seq_len=131072)),             # Kimi K3 TP8
        MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=k3, batch=1, num_splits=132, num_pages=2048,
                                       max_seq_len=131072, chunk=64, kv_before_wait=True)),  # .. its copies early
        MLADecodeBlock(MLADecodeConfig(heads=6, softmax_scale=k3, batch=8, q_tokens=2, num_splits=16,
                                       kv_dtype="fp8_e4m3", num_pages=4096, max_seq_len=32768)),
        MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=k3, batch=1, num_splits=132, num_pages=2048,
                                       max_seq_len=131072, kv_dtype="fp8_e4m3", chunk=64, stages=3,
                                       bulk_copy=True)),                                 # .. fp8, bulk copies
        MLADecodeBlock(MLADecodeConfig(heads=8, softmax_scale=256 ** -0.5, rope=0, batch=64, num_splits=2,
                                       num_pages=32768, max_seq_len=32768, chunk=64, stages=2)),  # GLM-5.3 TP8
        MLACombineBlock(MLACombineConfig(heads=12, batch=1, num_splits=132)),
        MLAHeadProjBlock(MLAHeadProjConfig(heads=12, n=512, k=128, m=8, y_stride=576)),   # W_UK
        MLAHeadProjBlock(MLAHeadProjConfig(heads=12, n=128, k=512, m=8, rows_per_tile=32)),  # W_UV
        MLAHeadProjBlock(MLAHeadProjConfig(heads=12, n=512, k=128, m=1, y_stride=576, rows_in_flight=8)),
        MLAHeadProjBlock(MLAHeadProjConfig(heads=12, n=128, k=512, m=8, rows_per_tile=32, rows_in_flight=4)),
        # GLM-5.3 DSA TP8: NoPE, 8 heads over the 2048 + 15 tokens of each query's index list
        MLADecodeBlock(MLADecodeConfig(heads=8, softmax_scale=256 ** -0.5, rope=0, batch=8, q_tokens=2,
                                       num_splits=4, num_pages=16384, max_seq_len=131072, chunk=64,
                                       index_width=2048 + 15)),
        MLADecodeBlock(MLADecodeConfig(heads=8, softmax_scale=256 ** -0.5, rope=0, batch=1, num_splits=16,
                                       kv_dtype="fp8_e4m3", num_pages=2048, max_seq_len=131072,
                                       index_width=2048 + 15)),
        # row groups: Kimi K3 TP8 verifying 4 speculative tokens (48 rows: 2 tiles of 24 a split),
        # GLM-5.3 DSA on one GPU (64 heads: 2 tiles of 32 a token and split)
        MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=k3, batch=8, q_tokens=4, num_splits=8,
                                       kv_dtype="fp8_e4m3", num_pages=4096, max_seq_len=32768)),
        MLADecodeBlock(MLADecodeConfig(heads=64, softmax_scale=256 ** -0.5, rope=0, batch=1, num_splits=8,
                                       num_pages=2048, max_seq_len=131072, chunk=64, index_width=2048 + 15)),
        # 16-row tiles (the sublayers' last resort for shared memory): Kimi K3 TP4, 24 heads in 2 of 12
        MLADecodeBlock(MLADecodeConfig(heads=24, softmax_scale=k3, batch=8, num_splits=8, num_pages=4096,
                                       max_seq_len=32768, chunk=16, stages=2, max_tile_rows=16)),
    ]
