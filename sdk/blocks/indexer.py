"""Lightning-indexer blocks: the per-entry index scores and their top-k selection, for GLM-5.3's DSA
(k-pool indexer, sdk/reference/dsa.py) and DeepSeek-V4.1-Flash's CSA (compressed indexer keys,
sdk/reference/dsv4_attention.py `select`). The sparse attention over the selection is
MLADecodeBlock with `index_width` (GLM-5.3) or DSV4DecodeBlock in mode "csa" (V4).

Both models score key entries the same way; they differ in what an entry is and what the
selection expands to:

    score[b, t, e] = sum_h w[b, t, h] * ReLU(q[b, t, h, :] . key[b, e, :] * scale)    e < n(t)
    n(t)           = min(max_entries, (start_b + t + 1) // ratio)  entries visible to query t

- GLM-5.3 (DSA): an entry is a complete pool of `kpool` tokens (the cache "index_pool_k",
  ratio = kpool); H = 32, d = 128, scale = d^-0.5; w = weights_proj(x) * H^-0.5. The selection is
  the top topk / kpool pools, expanded to their tokens, plus the tail: the (p+1) % kpool tokens of
  the incomplete pool (p = the query's position).
- V4.1-Flash (CSA): an entry is a compressed indexer key (the cache "index_keys", post-RoPE,
  ratio = compress ratio 4); H = 64, d = 128; scale = d^-0.5 (ReLU commutes with a positive
  scale); w = weights_proj(x) * H^-0.5. The selection is the top-512 entries, the index list
  DSV4DecodeBlock (mode "csa") reads.
q and w are computed by the GEMV blocks before these (q: indexer wq_b / q_b_proj of the q latent,
plus RoPE for V4); this module starts at the scores. GLM-5.3's "shared" indexer layers run none
of this: their MLADecodeBlock reads the previous layer's index list (same operand).

Blocks:
- `IndexScoreBlock`: tile = (sequence b, block of `keys_per_tile` entries). q [T*H, d] of the
  sequence sits in shared memory; key entries stream through a `stages`-deep cp.async pipeline in
  chunks of 64 (8 warps x 8 entries); q.k on the tensor cores (warp MMA m16n8k16 bf16, fp32
  accumulate, MLADecodeBlock's QK^T path with one k-slice); ReLU(. * scale) * w[row] into shared
  memory; the head sum per (token, entry) by 1-4 lanes each; fp32 scores to global. Entries
  >= n(T-1) of the sequence are not written; entries in [n(t), n(T-1)) get -inf for query t.
- `TopKBlock`: tile = (sequence b, query token t): the k largest of score[b, t, :n(t)] (ties ->
  lower index) by a 4-pass radix select (8-bit histograms in shared memory over the order-
  preserving uint32 image of the fp32 scores), then one compaction pass over per-thread
  contiguous ranges: the selected entries are written in ascending order, -1 padded. Up to
  2^31 entries per row in principle; tested to 131072.

Index list format (`TopKBlock` output, [B, T, width] int32, a set: order carries no meaning to
the consumers, entries distinct, -1 = none):
- V4 CSA (expand = 1, no tail): width = k, selected entries ascending, then -1. Exactly what
  DSV4DecodeBlock's "index" operand reads.
- GLM-5.3 (expand = kpool, tail): width = topk + kpool - 1 = the reference's width. Positions
  [0, k * kpool): the selected pools' tokens (pool m -> m*P .. m*P+P-1), pools ascending, -1
  padded; positions [k*P, k*P + P - 1): the tail tokens, -1 padded. sdk/reference/dsa.py's list
  has the same set (its order: pools by score, the tail right after the chosen pools).

V4.1-Flash's MXFP4 indexer (`key_dtype="mxfp4"`; the contract of flashinfer 0.7.2's V4.1 DSA indexer,
experimental/b12x/attention/dsa_indexer/mxfp4.py, which cites the published model):
- keys: 128 E2M1 codes + 4 UE8M0 scales (one per 32 values), 68 B, in planar pages of 64 keys (the
  64 keys' codes, 64 B each, then their scales, 4 B each: 4352 B a page; quantize_index_keys);
- queries: through the same MXFP4 round trip (formats.mxfp4_round_trip; the tile quantises q as it
  stages it);
- the score's BF16 stage boundaries (sdk/reference/dsv4_attention.py `staged_index_scores`): the dot
  rounded to bf16, the weighted term bf16(ReLU(dot) * bf16(w * scale)), the fp32 head sum in head
  order rounded to bf16.

Supported: T * H <= 128 query rows per sequence (GLM TP-any: 32 heads x T <= 4; V4: 64 heads x
T <= 2), head_dim a multiple of 16 (128 in both models), bf16 q, keys bf16 or mxfp4 (head_dim a
multiple of 128, max_entries a multiple of 64: whole pages; a chunk is one page, staged raw and
dequantised into a bf16 chunk), contiguous batch-first key caches (as the references keep them),
k <= 4096, any ratio >= 1.
Not yet: fp8 indexer keys, paged indexer caches, the q / w GEMVs fused into the score tile, a
fused score + top-k (scores stay in global / L2: at 131072 entries a row is 512 KB).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec
from ..reference.dsv4_attention import staged_index_scores
from .formats import MXFP4_GROUP, mxfp4_bytes, mxfp4_round_trip, mxfp4_values

CHUNK = 64                     # entries per pipeline stage: 8 warps x one n8 MMA block each
TOPK_CACHE_MAX = 32 * 1024     # TopKBlock keeps the score row in shared memory up to this size
RADIX_BITS = 8
RADIX_PASSES = 32 // RADIX_BITS


INDEX_KEY_DTYPES = ("bf16", "mxfp4")
INDEX_KEY_PAGE = CHUNK         # keys per page of the mxfp4 key cache (V4.1's page: 64 tokens)


def index_key_words(head_dim: int) -> int:
    """int32 words of one mxfp4 indexer key: head_dim E2M1 codes (two a byte, value 2i in the low
    nibble) and head_dim / 32 UE8M0 scale bytes (V4.1-Flash: 64 + 4 = 68 bytes a key)."""
    return (head_dim // 2 + head_dim // MXFP4_GROUP) // 4


def index_key_page_words(head_dim: int) -> int:
    """int32 words of a page of INDEX_KEY_PAGE mxfp4 keys: the codes of its keys, key after key
    (head_dim / 2 bytes each: every key's codes start on 16 bytes), then their scale bytes
    (head_dim / 32 each) - V4.1's planar page, 64 x 68 = 4352 bytes."""
    return INDEX_KEY_PAGE * index_key_words(head_dim)


def index_key_cache_shape(batch: int, entries: int, head_dim: int) -> tuple:
    """The int32 shape of a paged mxfp4 key cache: [batch, entries / 64, page words]."""
    return batch, entries // INDEX_KEY_PAGE, index_key_page_words(head_dim)


def quantize_index_keys(x: torch.Tensor) -> torch.Tensor:
    """x [..., E, d] (E a multiple of INDEX_KEY_PAGE) -> the int32 key cache [..., E / 64,
    index_key_page_words(d)]: MXFP4 (formats.mxfp4_bytes, the experts' format) in planar pages."""
    codes, scales = mxfp4_bytes(x)
    if x.shape[-2] % INDEX_KEY_PAGE:
        raise ValueError(f"quantize_index_keys: {x.shape[-2]} keys is not a whole number of "
                         f"{INDEX_KEY_PAGE}-key pages")
    def paged(t):                      # [..., E, bytes] -> [..., E / 64, 64 x bytes]
        return t.unflatten(-2, (-1, INDEX_KEY_PAGE)).flatten(-2)
    return torch.cat([paged(codes), paged(scales)], dim=-1).contiguous().view(torch.int32)


def dequantize_index_keys(cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The int32 key cache [..., P, page words] -> its keys' values bf16 [..., P * 64, head_dim]:
    each E2M1 value times 2^(E - 127) in fp32, rounded to bf16 (exact unless it falls below bf16's
    normal range) - what the score tile dequantises."""
    by = cache.contiguous().view(torch.uint8)
    cb = INDEX_KEY_PAGE * head_dim // 2
    def per_key(t):                    # [..., P, 64 x bytes] -> [..., P x 64, bytes]
        return t.unflatten(-1, (INDEX_KEY_PAGE, -1)).flatten(-3, -2)
    return mxfp4_values(per_key(by[..., :cb]), per_key(by[..., cb:])).to(torch.bfloat16)


def write_index_key(cache: torch.Tensor, b: int, w: int, key: torch.Tensor) -> None:
    """Key w of sequence b of the paged cache [B, P, page words] := key's MXFP4 record (its codes
    and scale bytes in their places of the key's page) - the compressor's write."""
    codes, scales = (t.to(cache.device) for t in mxfp4_bytes(key))
    page = cache[b, w // INDEX_KEY_PAGE].view(torch.uint8)
    j, cb, sb = w % INDEX_KEY_PAGE, codes.numel(), scales.numel()
    page[j * cb:(j + 1) * cb] = codes
    page[INDEX_KEY_PAGE * cb + j * sb:INDEX_KEY_PAGE * cb + (j + 1) * sb] = scales


def visible_entries(start, t, ratio: int, max_entries: int):
    """n(t): entries visible to query token t of a sequence with `start` tokens before the call."""
    return min(max_entries, (int(start) + t + 1) // ratio)


def choose_keys_per_tile(batch: int, entries: int, num_sms: int = 132, min_keys: int = 256) -> int:
    """Entries per IndexScore tile: about one wave of tiles, at least `min_keys` entries (each tile
    loads the T*H x d query once: 16 KB at V4's 64 x 128, the cost of 64 key entries), a multiple
    of 64."""
    per = -(-entries // max(1, num_sms // max(1, batch)))
    return max(min_keys, CHUNK * -(-per // CHUNK))


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexScoreConfig:
    heads: int                      # indexer heads (GLM-5.3: 32, V4.1-Flash: 64)
    head_dim: int = 128
    batch: int = 1
    q_tokens: int = 1
    max_entries: int = 8192         # key entries per sequence (max_seq_len // ratio)
    ratio: int = 1                  # tokens per entry: GLM kpool, V4 compress ratio
    scale: float = 0.0              # 0: head_dim ** -0.5
    keys_per_tile: int = 512        # a multiple of 64
    stages: int = 4                 # cp.async pipeline depth (chunks of 64 entries)
    key_dtype: str = "bf16"         # "mxfp4": V4.1's MXFP4 indexer - keys in 68 B records, paged
                                    # (quantize_index_keys), q through MXFP4, BF16 score stages (opt-in,
                                    # written 2026-12-05 / 06, not yet run on a GPU)


class IndexScoreBlock(Block):
    name = "index_score"
    Config = IndexScoreConfig

    @property
    def rows(self) -> int:
        return self.config.q_tokens * self.config.heads

    @property
    def m_pad(self) -> int:
        return 16 * math.ceil(self.rows / 16)

    @property
    def scale(self) -> float:
        return self.config.scale or self.config.head_dim ** -0.5

    @property
    def tiles_per_seq(self) -> int:
        return -(-self.config.max_entries // self.config.keys_per_tile)

    @property
    def mxfp4(self) -> bool:
        return self.config.key_dtype == "mxfp4"

    @property
    def key_bytes_each(self) -> int:
        d = self.config.head_dim
        return 4 * index_key_words(d) if self.mxfp4 else 2 * d

    def own_smem_bytes(self) -> int:
        return self.smem_bytes()

    def smem_bytes(self) -> int:
        c = self.config
        rs = c.head_dim + 8                                   # padded bf16 rows: conflict-free ldmatrix
        # mxfp4: the stages hold the chunks' raw records, dequantised into one bf16 chunk
        keys = (c.stages * CHUNK * self.key_bytes_each + CHUNK * rs * 2) if self.mxfp4 else c.stages * CHUNK * rs * 2
        return self.m_pad * rs * 2 + keys + self.m_pad * (CHUNK + 8) * 4 + self.m_pad * 4

    def check(self):
        c = self.config
        if not 1 <= self.rows <= 128:
            self.unsupported(f"index_score: q_tokens x heads = {self.rows} rows (supported 1..128)")
        if c.head_dim % 16 or c.head_dim < 16:
            self.unsupported(f"index_score: head_dim={c.head_dim} must be a multiple of 16")
        if c.keys_per_tile % CHUNK or c.keys_per_tile < CHUNK:
            self.unsupported(f"index_score: keys_per_tile={c.keys_per_tile} must be a multiple of {CHUNK}")
        if c.ratio < 1 or c.max_entries < 1 or c.batch < 1 or c.q_tokens < 1:
            self.unsupported("index_score: ratio, max_entries, batch, q_tokens >= 1")
        if not 2 <= c.stages <= 8:
            self.unsupported(f"index_score: stages={c.stages} (2..8)")
        if c.key_dtype not in INDEX_KEY_DTYPES:
            self.unsupported(f"index_score: key_dtype {c.key_dtype!r} (supported: {INDEX_KEY_DTYPES})")
        # mxfp4: whole-word records in whole pages (a chunk is a page)
        if self.mxfp4 and (c.head_dim % 128 or c.max_entries % INDEX_KEY_PAGE):
            self.unsupported(f"index_score mxfp4 keys: head_dim={c.head_dim} must be a multiple of 128 and "
                             f"max_entries={c.max_entries} a multiple of the {INDEX_KEY_PAGE}-key page")
        if self.smem_bytes() > 227 * 1024:
            self.unsupported(f"index_score: {self.smem_bytes()} B of shared memory > 227 KiB")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("q", (c.batch, c.q_tokens, c.heads, c.head_dim), "bf16"),
                OperandSpec("weights", (c.batch, c.q_tokens, c.heads), "fp32"),
                OperandSpec("keys", index_key_cache_shape(c.batch, c.max_entries, c.head_dim), "int32") if self.mxfp4
                else OperandSpec("keys", (c.batch, c.max_entries, c.head_dim), "bf16"),
                OperandSpec("start", (c.batch,), "int32"),
                OperandSpec("scores", (c.batch, c.q_tokens, c.max_entries), "fp32", output=True)]

    def num_tiles(self) -> int:
        return self.config.batch * self.tiles_per_seq

    def cost(self) -> Cost:
        c = self.config
        k = c.keys_per_tile
        b = k * self.key_bytes_each + self.rows * (c.head_dim * 2 + 4) + c.q_tokens * k * 4
        return Cost(bytes=b, flops=2 * k * self.rows * c.head_dim + 2 * k * self.rows)

    def key_bytes(self, starts) -> int:
        """Bytes of key entries the whole op must read (its floor), plus the scores it writes."""
        c = self.config
        n = [visible_entries(s, c.q_tokens - 1, c.ratio, c.max_entries) for s in starts]
        return sum(n) * (self.key_bytes_each + 4 * c.q_tokens)

    def n_written(self, start) -> int:
        """Entries of the sequence whose scores are written: n(T - 1)."""
        c = self.config
        return visible_entries(start, c.q_tokens - 1, c.ratio, c.max_entries)

    # -- torch faces ---------------------------------------------------------------------------
    def _scores(self, t, b, lo, hi) -> torch.Tensor:
        """fp32 scores [T, hi - lo] of entries [lo, hi) of sequence b, -inf where invisible."""
        c = self.config
        q = t["q"][b].cpu()
        w = t["weights"][b].float().cpu()
        if self.mxfp4:          # V4.1: the pages holding [lo, hi), q through MXFP4, the BF16 stages
            p0 = lo // INDEX_KEY_PAGE
            k = dequantize_index_keys(t["keys"][b, p0:-(-hi // INDEX_KEY_PAGE)].cpu(), c.head_dim)
            k = k[lo - p0 * INDEX_KEY_PAGE:hi - p0 * INDEX_KEY_PAGE]
            s = staged_index_scores(mxfp4_round_trip(q), k, w * self.scale)
        else:
            k = t["keys"][b, lo:hi].cpu().float()
            s = torch.relu((q.float().reshape(self.rows, -1) @ k.T) * self.scale) * w.reshape(self.rows)[:, None]
            s = s.view(c.q_tokens, c.heads, -1).sum(1)
        start = int(t["start"][b])
        n_t = torch.tensor([visible_entries(start, tq, c.ratio, c.max_entries) for tq in range(c.q_tokens)])
        return s.masked_fill(torch.arange(lo, hi)[None] >= n_t[:, None], float("-inf"))

    def reference(self, **t):
        """Scores [B, T, E] fp32; entries past n(T-1) of a sequence are left -inf."""
        c = self.config
        out = torch.full((c.batch, c.q_tokens, c.max_entries), float("-inf"))
        for b in range(c.batch):
            n = self.n_written(t["start"][b])
            out[b, :, :n] = self._scores(t, b, 0, n)
        return {"scores": out}

    def emulate_tile(self, t, tile):
        """One tile: chunks of 64 entries of its block (fp32 accumulate of bf16 products as the
        MMA); entries past n(T-1) untouched."""
        c = self.config
        b, j = divmod(tile, self.tiles_per_seq)
        n = self.n_written(t["start"][b])
        lo, hi = j * c.keys_per_tile, min((j + 1) * c.keys_per_tile, n)
        for c0 in range(lo, hi, CHUNK):
            c1 = min(c0 + CHUNK, hi)
            t["scores"][b, :, c0:c1] = self._scores(t, b, c0, c1).to(t["scores"].device)

    def _build_device_tile(self):
        from ._indexer_cute import build_index_score_tile
        return build_index_score_tile(self)


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopKConfig:
    k: int                          # entries selected per query (GLM: topk // kpool pools; V4: topk)
    batch: int = 1
    q_tokens: int = 1
    max_entries: int = 8192
    ratio: int = 1                  # as IndexScoreConfig: n(t) = (start + t + 1) // ratio
    expand: int = 1                 # tokens per selected entry written (GLM: kpool)
    tail: bool = False              # GLM select_tail: append the incomplete pool's tokens
    cache_row: bool | None = None   # the row's ordered keys in shared memory after one read from
                                    # L2 (the other 5 passes read them there); None: when
                                    # max_entries x 4 B <= TOPK_CACHE_MAX
    loads: int = 8                  # score loads a thread issues before using any, per loop trip
                                    # (8 measured: 41.6 -> 27.1 us at 8256 entries; 32 with
                                    # branch-free histogram updates measured slower: 24.6 -> 37.3
                                    # us in V4.1's CSA sublayer - bench/NOTES.md)


class TopKBlock(Block):
    name = "index_topk"
    Config = TopKConfig

    @property
    def width(self) -> int:
        c = self.config
        return c.k * c.expand + (c.expand - 1 if c.tail else 0)

    def check(self):
        c = self.config
        if not 1 <= c.k <= 4096:
            self.unsupported(f"index_topk: k={c.k} (supported 1..4096)")
        if c.ratio < 1 or c.expand < 1 or c.max_entries < 1 or c.batch < 1 or c.q_tokens < 1:
            self.unsupported("index_topk: ratio, expand, max_entries, batch, q_tokens >= 1")
        if not 1 <= c.loads <= 64:
            self.unsupported(f"index_topk: loads={c.loads} (supported 1..64)")
        if c.tail and c.expand != c.ratio:
            self.unsupported("index_topk: the tail is the incomplete pool: needs expand == ratio (kpool)")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("scores", (c.batch, c.q_tokens, c.max_entries), "fp32"),
                OperandSpec("start", (c.batch,), "int32"),
                OperandSpec("index", (c.batch, c.q_tokens, self.width), "int32", output=True)]

    @property
    def cache_row(self) -> bool:
        c = self.config
        return c.max_entries * 4 <= TOPK_CACHE_MAX if c.cache_row is None else c.cache_row

    def own_smem_bytes(self) -> int:
        # the radix histogram (one Int32 per thread = bin) and 2 + 2 x 8 exchange words, 16-B
        # aligned; the cached row's keys
        return NUM_THREADS * 4 + 128 + (self.config.max_entries * 4 if self.cache_row else 0)

    def num_tiles(self) -> int:
        return self.config.batch * self.config.q_tokens

    def cost(self, entries: int | None = None) -> Cost:
        """Per tile at `entries` visible entries (default max_entries): the score row is read
        RADIX_PASSES + 1 times (L2-resident right after IndexScore wrote it), the list written."""
        n = entries or self.config.max_entries
        return Cost(bytes=(RADIX_PASSES + 1) * n * 4 + self.width * 4, flops=(RADIX_PASSES + 1) * n)

    # -- torch faces ---------------------------------------------------------------------------
    def _expand(self, chosen: torch.Tensor, start: int, tq: int) -> torch.Tensor:
        """Selected entries (ascending) -> the index list row [width]."""
        c = self.config
        row = torch.full((self.width,), -1, dtype=torch.int32)
        toks = (chosen[:, None] * c.expand + torch.arange(c.expand)).flatten()
        row[:toks.numel()] = toks.int()
        if c.tail:
            pos = start + tq
            count = (pos + 1) % c.expand
            for i in range(count):
                row[c.k * c.expand + i] = pos + 1 - count + i
        return row

    def reference(self, **t):
        """The k largest visible scores, ties to the lower index (a stable sort), ascending."""
        c = self.config
        out = torch.full((c.batch, c.q_tokens, self.width), -1, dtype=torch.int32)
        for b in range(c.batch):
            start = int(t["start"][b])
            for tq in range(c.q_tokens):
                n = visible_entries(start, tq, c.ratio, c.max_entries)
                s = t["scores"][b, tq, :n].float().cpu()
                order = torch.sort(s, descending=True, stable=True).indices[:c.k]
                out[b, tq] = self._expand(order.sort().values, start, tq)
        return {"index": out}

    @staticmethod
    def ordered_key(scores: torch.Tensor) -> torch.Tensor:
        """fp32 -> int64 image of the uint32 key whose unsigned order is the float order (-0.0
        keyed as +0.0: equal floats, equal keys)."""
        u = scores.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
        u = torch.where(u == 0x80000000, torch.zeros_like(u), u)
        return torch.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u | 0x80000000)

    def emulate_tile(self, t, tile):
        """The device algorithm step by step: RADIX_PASSES histogram passes find the k-th key and
        how many of its ties to take; per-thread contiguous ranges and one exclusive scan place
        the selected entries in ascending order."""
        c = self.config
        b, tq = divmod(tile, c.q_tokens)
        start = int(t["start"][b])
        n = visible_entries(start, tq, c.ratio, c.max_entries)
        key = self.ordered_key(t["scores"][b, tq, :n].cpu())
        take_all = n <= c.k
        prefix, mask, krem = 0, 0, c.k
        if not take_all:
            for p in range(RADIX_PASSES):
                shift = 32 - RADIX_BITS * (p + 1)
                cand = key[(key & mask) == prefix]
                hist = torch.bincount((cand >> shift) & 255, minlength=256)
                above = hist.flip(0).cumsum(0).flip(0) - hist                 # entries in higher bins
                j = int(torch.nonzero((above < krem) & (above + hist >= krem)).flatten()[0])
                krem -= int(above[j])
                prefix |= j << shift
                mask |= 255 << shift
        # compaction (the device: thread i owns a contiguous range; an exclusive scan of the
        # counts orders the threads): ties are taken in ascending index order, then everything
        # is written ascending
        if take_all:
            sel = torch.ones(n, dtype=torch.bool)
        else:
            gt, eq = key > prefix, key == prefix
            eq_before = torch.cumsum(eq.long(), 0) - eq.long()
            sel = gt | (eq & (eq_before < krem))
        assert int(sel.sum()) == min(n, c.k), "radix select lost count"
        chosen = torch.nonzero(sel).flatten()
        t["index"][b, tq] = self._expand(chosen, start, tq).to(t["index"].device)

    def _build_device_tile(self):
        from ._indexer_cute import build_topk_tile
        return build_topk_tile(self)


# ------------------------------------------------------------------------------------------------
def glm53_indexer_blocks(spec, batch: int, q_tokens: int, max_seq_len: int, keys_per_tile: int = 512):
    """(IndexScoreBlock, TopKBlock) of a GLM-5.3 layer with its own indexer (spec: DSAIndexerSpec).
    Entries are complete pools: ratio = kpool; the list is the pools' tokens plus the tail."""
    p = spec.kpool
    score = IndexScoreBlock(IndexScoreConfig(heads=spec.num_heads, head_dim=spec.head_dim, batch=batch,
                                             q_tokens=q_tokens, max_entries=max(1, max_seq_len // p), ratio=p,
                                             keys_per_tile=keys_per_tile))
    topk = TopKBlock(TopKConfig(k=spec.topk // p, batch=batch, q_tokens=q_tokens,
                                max_entries=max(1, max_seq_len // p), ratio=p, expand=p,
                                tail=spec.select_tail and p > 1))
    return score, topk


def dsv4_csa_indexer_blocks(spec, ratio: int, batch: int, q_tokens: int, max_seq_len: int,
                            keys_per_tile: int = 512):
    """(IndexScoreBlock, TopKBlock) of a V4 CSA layer (spec: its DSAIndexerSpec; ratio: the layer's
    compress ratio). The list is DSV4DecodeBlock's "index" operand."""
    e = max(1, max_seq_len // ratio)
    score = IndexScoreBlock(IndexScoreConfig(heads=spec.num_heads, head_dim=spec.head_dim, batch=batch,
                                             q_tokens=q_tokens, max_entries=e, ratio=ratio,
                                             keys_per_tile=keys_per_tile))
    topk = TopKBlock(TopKConfig(k=spec.topk, batch=batch, q_tokens=q_tokens, max_entries=e, ratio=ratio))
    return score, topk


def indexer_compile_cases() -> list:
    """Representative static configs for the no-GPU compile checks (sdk/compile.py)."""
    return [
        # GLM-5.3: 32 x 128 heads, kpool 16 at 131072 tokens (8192 pools), top 128 pools + tail
        IndexScoreBlock(IndexScoreConfig(heads=32, batch=1, max_entries=8192, ratio=16, keys_per_tile=256)),
        TopKBlock(TopKConfig(k=128, batch=8, q_tokens=2, max_entries=8192, ratio=16, expand=16, tail=True)),
        # V4.1-Flash CSA: 64 x 128 heads, ratio 4 at 131072 tokens (32768 entries), top 512, T = 2
        IndexScoreBlock(IndexScoreConfig(heads=64, batch=8, q_tokens=2, max_entries=32768, ratio=4,
                                         keys_per_tile=1024, stages=3)),
        # ... and its keys as V4.1's 68 B mxfp4 records, T = 1
        IndexScoreBlock(IndexScoreConfig(heads=64, batch=8, max_entries=32768, ratio=4, keys_per_tile=1024,
                                         key_dtype="mxfp4")),
        TopKBlock(TopKConfig(k=512, batch=8, q_tokens=2, max_entries=32768, ratio=4)),
    ]
