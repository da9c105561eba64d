"""DeepSeek-V4 attention decode core: split-KV over the sliding window + compressed KV, and a
combine step that adds the per-head sink and undoes RoPE on the output's rope slice.

The definition is the attention math of sdk/reference/dsv4_attention.py (DSV4AttentionReference,
proven equal to transformers): one shared KV head of `head_dim` (K = V, partial RoPE already
applied in the caches), H query heads (this GPU's shard), for query t of sequence b at
qp = start_b + t the keys are

    window: ring [B, W, hd], slot j holds position last - ((last - j) mod W), last = start - 1,
            visible iff that position >= 0 and > qp - W                  (the tokens before this call)
    new:    new_kv [B, T, hd], token t' visible iff t' <= t              (this call's tokens, causal)
    comp:   HCA ("hca"): comp [B, E, hd] entries e < (qp + 1) // ratio
            CSA ("csa"): the indexer's selection index [B, T, K] int32 (distinct entries, -1 = none),
                         entry e visible iff 0 <= e < (qp + 1) // ratio
            "swa": none
    o = softmax over [q.k * scale for visible keys, sink_h] @ V, the sink's share dropped,
    rounded to bf16, then the rope slice rotated by -qp (cos/sin operands, bf16 as the reference).

Blocks:
- `DSV4DecodeBlock`: tile = (sequence b, query group g, KV split s). A query group is all T tokens
  (rows = T * H share one key list) except for CSA, whose selections differ per token (group =
  one token, rows = H). The tile walks keys j in [0, W + T + n_comp) - ring slots, new tokens,
  compressed entries - in chunks of `chunk` keys cut into `num_splits` ranges; writes the
  normalised partial output and its lse (as MLADecodeBlock, whose tensor-core tile it shares:
  `_dsv4_cute.py` is that tile with this module's key -> row map and visibility rule).
- `DSV4CombineBlock`: tile = (sequence b, token t, head h, 128 columns): merges the splits and
  the sink (L = logsumexp(lse_1..S, sink_h), out = sum_s exp(lse_s - L) o_s), rounds to bf16 and
  un-ropes.

Formats: q [B, T, H, hd] bf16 (post-RoPE); window / new_kv / comp bf16; start [B] int32 (tokens
before this call, ragged); o_part [B, G, S, rows, hd] fp32, lse_part [B, G, S, rows] fp32;
sinks [H] fp32; cos / sin [B, T, rope / 2] bf16 (the rope at each query's position); out
[B, T, H, hd] bf16. The ring is written with this call's tokens AFTER the attention (another op:
tiles of other splits may still read it).

Row groups: a tile holds at most 32 query rows; a query group of more (V4.1-Flash's 64 heads on
one GPU, 16 heads x 4 tokens) is cut evenly into `row_groups` tiles that read the same keys:
tile = ((b * G + g) * RG + rg) * S + s.

Supported: any (T or 1) * H rows (row groups of <= 32), head_dim a multiple of 256, T <= W,
bf16 caches, or V4.1's serving records: the ring (window_dtype="fp8_e4m3": 512 e4m3 + 16 UE8M0
scale bytes a token, quantize_window_fp8) and the compressed entries (comp_dtype="fp4_e2m1": 512
E2M1 codes + 32 E4M3 scales, quantize_comp_fp4); chunk 16/32/64. Not yet: one tile over more
than 32 rows (each group reads the keys again), wgmma/tcgen05. The ring write is its own op
after the core (`DSV4RingWriteBlock`).
The indexer (scores, top-k) is `docs/dsv4_attention.md`'s design, not a block yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, OperandSpec
from .formats import e2m1_codes, e2m1_values, pack_nibbles, ue8m0_exponents
from .mla_decode import MAX_TILE_ROWS

MODES = ("swa", "hca", "csa")
WINDOW_DTYPES = ("bf16", "fp8_e4m3")
SCALE_GROUP = 32             # the fp8 window record: one UE8M0 scale per 32 values
WINDOW_AMAX_FLOOR = 1e-4     # V4.1's SWA writer (and DeepSeek's act_quant) floor a group's max here


def window_record_words(head_dim: int) -> int:
    """int32 words of one fp8 window record: head_dim e4m3 values, then head_dim / 32 UE8M0
    scales (V4.1-Flash's SWA cache: 512 + 16 = 528 bytes a token)."""
    return (head_dim + head_dim // SCALE_GROUP) // 4


def window_exponents(x: torch.Tensor) -> torch.Tensor:
    """The fp8 window record's scale bytes: e4m3's max 448 (amax = max(max |x|, 1e-4) = m 2^e with
    m in [1, 2) needs 2^(e - 8), or 2^(e - 7) when m > 1.75)."""
    return ue8m0_exponents(x, SCALE_GROUP, 448.0, WINDOW_AMAX_FLOOR)


def quantize_window_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] -> int32 records [..., window_record_words(hd)] (bytes: the e4m3 values of x /
    2^(E - 127), then the scale bytes E of its groups)."""
    hd = x.shape[-1]
    e = window_exponents(x)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), 127 - e)
    q = (x.float().unflatten(-1, (-1, SCALE_GROUP)) * scale[..., None]).flatten(-2).to(torch.float8_e4m3fn)
    rec = torch.cat([q.view(torch.uint8), e.to(torch.uint8)], dim=-1)
    assert rec.shape[-1] == 4 * window_record_words(hd)
    return rec.contiguous().view(torch.int32)


COMP_DTYPES = ("bf16", "fp4_e2m1")
COMP_GROUP = 16              # the fp4 entry record: one E4M3 scale per 16 values
COMP_AMAX_FLOOR = 6.0 * 2.0 ** -9   # V4.1's writer: a group's scale is at least e4m3's smallest, 2^-9


def comp_record_words(head_dim: int) -> int:
    """int32 words of one fp4 compressed-entry record: head_dim E2M1 values (two a byte, value 2i
    in the low nibble), then head_dim / 16 E4M3 scales (V4.1-Flash's compressed cache: 256 + 32 =
    288 bytes a token)."""
    return (head_dim // 2 + head_dim // COMP_GROUP) // 4


def comp_cache_shape(batch: int, entries: int, head_dim: int) -> tuple:
    """The int32 shape of an fp4 compressed-entry cache: a record per entry."""
    return batch, entries, comp_record_words(head_dim)


def quantize_comp_fp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] -> int32 records [..., comp_record_words(hd)], as V4.1's compressed-cache writer
    (flashinfer 0.7.2's dsv41 record): per 16 values the scale s = e4m3(max(max |x|, 6 x 2^-9) /
    6) (round to nearest even, saturating at 448; at least e4m3's smallest, 2^-9), then each
    value's E2M1 code of x times fp32(1 / s) (e2m1_codes)."""
    hd = x.shape[-1]
    g = x.float().unflatten(-1, (-1, COMP_GROUP))
    s = (g.abs().amax(-1).clamp(min=COMP_AMAX_FLOOR) / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn)
    code = e2m1_codes(g * (1.0 / s.float()[..., None])).flatten(-2)
    rec = torch.cat([pack_nibbles(code), s.view(torch.uint8)], dim=-1)
    assert rec.shape[-1] == 4 * comp_record_words(hd)
    return rec.contiguous().view(torch.int32)


def dequantize_comp_fp4(rec: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 records -> bf16 [..., head_dim]: each E2M1 value times its group's E4M3 scale in
    fp32, rounded to bf16 (exact: 2 + 4 significant bits) - what the decode tile dequantises."""
    by = rec.contiguous().view(torch.uint8)
    v = e2m1_values(by[..., :head_dim // 2])
    s = by[..., head_dim // 2:head_dim // 2 + head_dim // COMP_GROUP].contiguous().view(torch.float8_e4m3fn).float()
    return (v.unflatten(-1, (-1, COMP_GROUP)) * s[..., None]).flatten(-2).to(torch.bfloat16)


def comp_fp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., hd] -> the bf16 values its fp4 record holds (what the decode reads back)."""
    return dequantize_comp_fp4(quantize_comp_fp4(x), x.shape[-1])


def dequantize_window_fp8(rec: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int32 records [..., words] -> bf16 [..., head_dim]: each e4m3 value times its group's
    2^(E - 127) in fp32, rounded to bf16 (exact for every finite record: 4-bit mantissas) - what
    the decode tile dequantises into its chunk."""
    by = rec.contiguous().view(torch.uint8)
    q = by[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    e = by[..., head_dim:head_dim + head_dim // SCALE_GROUP].to(torch.int32)
    scale = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
    return (q.unflatten(-1, (-1, SCALE_GROUP)) * scale[..., None]).flatten(-2).to(torch.bfloat16)


def choose_splits(batch: int, keys: int, num_sms: int = 132, chunk: int = 32, min_chunks: int = 1) -> int:
    """KV splits per (sequence, group): about one wave of tiles, at least `min_chunks` chunks each.
    One chunk a split at small batch: a chunk is latency-bound (H200, V4.1-Flash TP8 HCA 32K batch
    1: 3 splits of 4 chunks 15.8 us, 12 splits 9.7 us; the whole sublayer 54.0 vs 47.5 us)."""
    by_sms = max(1, num_sms // max(1, batch))
    by_len = max(1, -(-keys // chunk) // min_chunks)
    return max(1, min(by_sms, by_len))


@dataclass(frozen=True)
class DSV4DecodeConfig:
    heads: int                   # query heads of this GPU (V4.1-Flash TP8: 8)
    mode: str = "hca"            # "swa" | "hca" | "csa"
    batch: int = 1
    q_tokens: int = 1
    head_dim: int = 512
    window: int = 128
    ratio: int = 128             # compress ratio (HCA 128, CSA 4)
    max_entries: int = 1024      # comp cache entries per sequence (max_seq_len // ratio)
    topk: int = 512              # CSA: index list width
    softmax_scale: float = 0.0   # 0: head_dim ** -0.5
    num_splits: int = 1
    chunk: int = 32
    stages: int = 0              # 0: auto
    window_dtype: str = "bf16"   # "fp8_e4m3": the ring holds V4.1's SWA records (quantize_window_fp8;
                                 # opt-in, GPU-tested on the H200 2026-12-05)
    comp_dtype: str = "bf16"     # "fp4_e2m1": the compressed entries as V4.1's records (quantize_comp_fp4;
                                 # opt-in, GPU-tested on the H200 2026-12-05)
    max_tile_rows: int = MAX_TILE_ROWS   # query rows of one tile (32, or 16: half the query and score
                                         # smem, the keys read by twice the row groups)


def even_row_groups(rows: int, max_rows: int = MAX_TILE_ROWS) -> int:
    """The fewest tiles of at most `max_rows` query rows that cut `rows` evenly."""
    return next(n for n in range(-(-rows // max_rows), rows + 1) if rows % n == 0)


class DSV4DecodeBlock(Block):
    name = "dsv4_decode"
    Config = DSV4DecodeConfig

    # -- static facts --------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.config.q_tokens if self.config.mode == "csa" else 1

    @property
    def tq(self) -> int:                     # query tokens per group
        return 1 if self.config.mode == "csa" else self.config.q_tokens

    @property
    def rows(self) -> int:                   # query rows of a group
        return self.tq * self.config.heads

    @property
    def row_groups(self) -> int:
        """Tiles that share a query group's keys, each with an equal part of its rows, at most
        max_tile_rows (the MMA's two 16-row fragments, or one): the fewest that cut the rows evenly
        (V4.1-Flash on one GPU, 64 heads: 2 of 32; max_tile_rows 16: 4 of 16). Each reads the
        group's keys again."""
        return even_row_groups(self.rows, self.config.max_tile_rows)

    @property
    def tile_rows(self) -> int:
        return self.rows // self.row_groups

    def tile_coords(self, tile: int) -> tuple[int, int, int, int]:
        """(sequence b, query group g, row group rg, split s): tile = ((b * G + g) * RG + rg) * S + s,
        so one row group keeps the one-group numbering."""
        u, s = divmod(tile, self.config.num_splits)
        u, rg = divmod(u, self.row_groups)
        b, g = divmod(u, self.groups)
        return b, g, rg, s

    @property
    def scale(self) -> float:
        return self.config.softmax_scale or self.config.head_dim ** -0.5

    @property
    def n_comp_max(self) -> int:
        c = self.config
        return {"swa": 0, "hca": c.max_entries, "csa": c.topk}[c.mode]

    @property
    def stages(self) -> int:
        """The pipeline's stages: as many as fit 200 KB (at most 8), but no more than a split's
        chunks + 1 - a tile never has more chunks in flight than its split holds, and at small
        batch a split is one chunk (choose_splits): V4.1-Flash TP8 HCA 32K batch 1 took 4
        stages (150 KB) for one chunk, which left the sublayer's weight ring 3 stages of 21 KB."""
        c = self.config
        if c.stages:
            return c.stages
        fixed = self._smem(0)
        keys = c.window + c.q_tokens + self.n_comp_max          # a (sequence, group)'s most keys
        per_split = math.ceil(math.ceil(keys / c.chunk) / c.num_splits)
        return max(2, min(8, (200 * 1024 - fixed) // (self._smem(1) - fixed), per_split + 1))

    def own_smem_bytes(self) -> int:
        return self._smem(self.stages)

    @property
    def fp8_window(self) -> bool:
        return self.config.window_dtype == "fp8_e4m3"

    @property
    def fp4_comp(self) -> bool:
        return self.config.comp_dtype == "fp4_e2m1" and self.config.mode != "swa"

    @property
    def raw_row_bytes(self) -> int:
        """Quantised rows (fp8 window, fp4 entries): a staged record's row stride (the larger
        record + 16 bytes of padding: 16-byte aligned)."""
        hd = self.config.head_dim
        rec = max(4 * window_record_words(hd) if self.fp8_window else 0, 4 * comp_record_words(hd) if self.fp4_comp else 0)
        return rec + 16 if rec else 0

    def _smem(self, stages):
        c = self.config
        mp = 16 * math.ceil(self.tile_rows / 16)
        nwk = NUM_THREADS // 32 // (c.chunk // 8)
        rs = c.head_dim + 8
        # quantised rows (fp8 ring, fp4 entries): each stage also holds its chunk's raw records
        return mp * rs * 2 + nwk * mp * c.chunk * 4 + stages * c.chunk * (rs * 2 + self.raw_row_bytes)

    def check(self):
        c = self.config
        if c.mode not in MODES:
            self.unsupported(f"dsv4_decode: mode {c.mode!r} (supported: {MODES})")
        if c.window_dtype not in WINDOW_DTYPES:
            self.unsupported(f"dsv4_decode: window_dtype {c.window_dtype!r} (supported: {WINDOW_DTYPES})")
        if c.comp_dtype not in COMP_DTYPES:
            self.unsupported(f"dsv4_decode: comp_dtype {c.comp_dtype!r} (supported: {COMP_DTYPES})")
        if c.chunk not in (16, 32, 64):
            self.unsupported(f"dsv4_decode: chunk={c.chunk} (16, 32, 64)")
        if c.heads < 1:
            self.unsupported(f"dsv4_decode: heads={c.heads} (>= 1)")
        if c.max_tile_rows not in (16, MAX_TILE_ROWS):
            self.unsupported(f"dsv4_decode: max_tile_rows={c.max_tile_rows} (16 or {MAX_TILE_ROWS})")
        if c.head_dim % 256:
            self.unsupported(f"dsv4_decode: head_dim={c.head_dim} must be a multiple of 256")
        if not 1 <= c.q_tokens <= c.window:
            self.unsupported(f"dsv4_decode: q_tokens={c.q_tokens} must be in 1..window")
        if c.mode != "swa" and (c.ratio < 1 or c.max_entries < 1):
            self.unsupported("dsv4_decode: compressed modes need ratio >= 1 and max_entries >= 1")
        if c.num_splits < 1 or c.batch < 1:
            self.unsupported("dsv4_decode: batch and num_splits >= 1")
        if self._smem(self.stages) > 227 * 1024:
            self.unsupported(f"dsv4_decode: {self._smem(self.stages)} B of shared memory")

    def operand_specs(self):
        c = self.config
        hd, G, S = c.head_dim, self.groups, c.num_splits
        return [OperandSpec("q", (c.batch, c.q_tokens, c.heads, hd), "bf16"),
                (OperandSpec("window", (c.batch, c.window, window_record_words(hd)), "int32") if self.fp8_window
                 else OperandSpec("window", (c.batch, c.window, hd), "bf16")),
                OperandSpec("new_kv", (c.batch, c.q_tokens, hd), "bf16"),
                (OperandSpec("comp", comp_cache_shape(c.batch, max(c.max_entries, 1), hd), "int32") if self.fp4_comp
                 else OperandSpec("comp", (c.batch, max(c.max_entries, 1), hd), "bf16", optional=c.mode == "swa")),
                OperandSpec("index", (c.batch, c.q_tokens, max(c.topk, 1)), "int32", optional=c.mode != "csa"),
                OperandSpec("start", (c.batch,), "int32"),
                OperandSpec("o_part", (c.batch, G, S, self.rows, hd), "fp32", output=True),
                OperandSpec("lse_part", (c.batch, G, S, self.rows), "fp32", output=True)]

    def num_tiles(self) -> int:
        return self.config.batch * self.groups * self.row_groups * self.config.num_splits

    def keys_of(self, start: int) -> int:
        """Keys of a (sequence, group) with `start` tokens before this call: W + T + compressed."""
        c = self.config
        if c.mode == "hca":
            nc = min(c.max_entries, (start + c.q_tokens) // c.ratio)
        else:
            nc = self.n_comp_max
        return c.window + c.q_tokens + nc

    def cost(self, start: int | None = None) -> Cost:
        c = self.config
        keys = self.keys_of(c.max_entries * c.ratio if start is None else start)
        per = math.ceil(keys / c.num_splits)
        r = self.tile_rows
        b = per * c.head_dim * 2 + r * c.head_dim * (2 + 4) + r * 4
        return Cost(bytes=b, flops=4 * per * r * c.head_dim)

    def kv_bytes(self, starts) -> int:
        """Bytes of KV rows the whole op must read (window + new + compressed; the floor)."""
        c = self.config
        rows = sum(self.groups * self.keys_of(int(s)) for s in starts) * c.head_dim * 2
        if self.fp8_window:      # the window's records instead of bf16 rows
            rows -= len(starts) * self.groups * c.window * (c.head_dim * 2 - 4 * window_record_words(c.head_dim))
        if self.fp4_comp:        # the entries' records
            ent = sum(self.groups * (self.keys_of(int(s)) - c.window - c.q_tokens) for s in starts)
            rows -= ent * (c.head_dim * 2 - 4 * comp_record_words(c.head_dim))
        return rows

    # -- torch faces ---------------------------------------------------------------------------
    def key_rows(self, t: dict, b: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [nk, hd] fp32, visible [tq, nk] bool) of sequence b, query group g, in key order."""
        c = self.config
        W, T = c.window, c.q_tokens
        start = int(t["start"][b])
        nk = self.keys_of(start)
        qp = start + g * self.tq + torch.arange(self.tq)                      # [tq]
        last = start - 1
        j = torch.arange(W)
        ring_pos = last - torch.remainder(last - j, W)
        vis = [(ring_pos[None] >= 0) & (ring_pos[None] > qp[:, None] - W)]
        rows = [self.window_rows(t, b)]
        vis.append(torch.arange(T)[None] <= (qp - start)[:, None])
        rows.append(t["new_kv"][b].float().cpu())
        ready = (qp + 1) // c.ratio if c.mode != "swa" else None
        if c.mode == "hca":
            e = torch.arange(nk - W - T)
            vis.append(e[None] < ready[:, None])
            rows.append(self.comp_rows(t, b)[:nk - W - T])
        elif c.mode == "csa":
            e = t["index"][b, g].long().cpu()                                 # [K]
            ok = (e[None] >= 0) & (e[None] < ready[:, None]) & (e[None] < c.max_entries)
            vis.append(ok)
            rows.append(self.comp_rows(t, b)[e.clamp(0, c.max_entries - 1)])
        return torch.cat(rows), torch.cat(vis, dim=1)

    def window_rows(self, t: dict, b: int) -> torch.Tensor:
        """The ring of sequence b as the tile reads it: [W, hd] fp32 (fp8 records dequantised
        to bf16 first)."""
        w = t["window"][b].cpu()
        if self.fp8_window:
            w = dequantize_window_fp8(w, self.config.head_dim)
        return w.float()

    def comp_rows(self, t: dict, b: int) -> torch.Tensor:
        """The compressed entries of sequence b as the tile reads them: [E, hd] fp32 (fp4 records
        dequantised to bf16 first)."""
        e = t["comp"][b].cpu()
        if self.fp4_comp:
            e = dequantize_comp_fp4(e, self.config.head_dim)
        return e.float()

    def split_range(self, nk: int, split: int) -> tuple[int, int]:
        c = self.config
        n_chunks = -(-nk // c.chunk)
        per = -(-n_chunks // c.num_splits)
        lo = min(split * per, n_chunks) * c.chunk
        return lo, max(lo, min(min((split + 1) * per, n_chunks) * c.chunk, nk))

    def _q(self, t, b, g):
        c = self.config
        return t["q"][b, g * self.tq:(g + 1) * self.tq].float().cpu().reshape(self.rows, c.head_dim)

    def _vis_rows(self, vis):
        return vis.repeat_interleave(self.config.heads, dim=0)                 # [rows, nk]: row = tq * H + h

    def reference(self, **t):
        """The definition: per split, the normalised partial attention (fp32) and its lse."""
        c = self.config
        G, S = self.groups, c.num_splits
        o = torch.zeros(c.batch, G, S, self.rows, c.head_dim)
        lse = torch.full((c.batch, G, S, self.rows), float("-inf"))
        for b in range(c.batch):
            for g in range(G):
                kv, vis = self.key_rows(t, b, g)
                q = self._q(t, b, g)
                vis = self._vis_rows(vis)
                for s in range(S):
                    lo, hi = self.split_range(kv.shape[0], s)
                    if hi <= lo:
                        continue
                    sc = (q @ kv[lo:hi].T * self.scale).masked_fill(~vis[:, lo:hi], float("-inf"))
                    l = torch.logsumexp(sc, -1)
                    p = torch.nan_to_num(torch.exp(sc - l[:, None].clamp_min(-1e30)), nan=0.0)
                    o[b, g, s], lse[b, g, s] = p @ kv[lo:hi], l
        return {"o_part": o, "lse_part": lse}

    def emulate_tile(self, t, tile):
        """Torch twin of one tile: chunked online softmax in fp32, P rounded to bf16 (the MMA input)."""
        c = self.config
        b, g, rg, s = self.tile_coords(tile)
        r0, r1 = rg * self.tile_rows, (rg + 1) * self.tile_rows
        kv, vis = self.key_rows(t, b, g)
        vis = self._vis_rows(vis)[r0:r1]
        q = self._q(t, b, g)[r0:r1]
        lo, hi = self.split_range(kv.shape[0], s)
        m = torch.full((r1 - r0,), float("-inf"))
        l = torch.zeros(r1 - r0)
        acc = torch.zeros(r1 - r0, c.head_dim)
        for c0 in range(lo, hi, c.chunk):
            c1 = min(c0 + c.chunk, hi)
            sc = (q @ kv[c0:c1].T).masked_fill(~vis[:, c0:c1], float("-inf"))
            m_new = torch.maximum(m, sc.max(-1).values)
            m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp((sc - m_use[:, None]) * self.scale)
            alpha = torch.exp((m - m_use) * self.scale)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[:, None] + p.to(torch.bfloat16).float() @ kv[c0:c1]
            m = m_new
        ok = l > 0
        o = torch.where(ok[:, None], acc / l.clamp_min(1e-30)[:, None], torch.zeros_like(acc))
        lse = torch.where(ok, m * self.scale + torch.log(l.clamp_min(1e-30)), torch.full_like(l, float("-inf")))
        t["o_part"][b, g, s, r0:r1] = o.to(t["o_part"].device)
        t["lse_part"][b, g, s, r0:r1] = lse.to(t["lse_part"].device)

    def _build_device_tile(self):
        from ._dsv4_cute import build_dsv4_decode_tile
        return build_dsv4_decode_tile(self)


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSV4CombineConfig:
    heads: int
    batch: int = 1
    q_tokens: int = 1
    head_dim: int = 512
    num_splits: int = 1
    per_token_groups: bool = False   # the core's groups: True for CSA (group = token)
    rope_dim: int = 64               # trailing channels to un-rope (0: none)


COMBINE_COLS = 128      # output columns of one combine tile


class DSV4CombineBlock(Block):
    """out[b, t, h] = unrope(bf16(sum_s exp(lse_s - L) o_s)), L = logsumexp(lse_1..S, sink_h).
    A tile is one (sequence, token, head, 128 output columns): warp 0 reduces the head's S lse
    values and the sink, then thread (split group, 16-byte column group) sums splits g, g + SG, ...
    with several 16-byte loads in flight, and the split groups' sums meet in shared memory. (One
    tile per (sequence, token) walking heads x splits with one dependent load at a time was the
    MLA combine's 363.8 -> 27.4 us lesson at Kimi K3 TP8 B=1 32K; this is the same cut.)
    Supported: head_dim a multiple of 128, rope_dim even and <= head_dim."""
    name = "dsv4_combine"
    Config = DSV4CombineConfig

    @property
    def col_tiles(self) -> int:
        return self.config.head_dim // COMBINE_COLS

    @property
    def groups(self) -> int:
        return self.config.q_tokens if self.config.per_token_groups else 1

    @property
    def rows(self) -> int:
        c = self.config
        return c.heads * (1 if c.per_token_groups else c.q_tokens)

    def check(self):
        c = self.config
        if c.head_dim % COMBINE_COLS or c.rope_dim % 2 or c.rope_dim > c.head_dim:
            self.unsupported(f"dsv4_combine: head_dim={c.head_dim} (multiple of {COMBINE_COLS}), rope_dim={c.rope_dim}")

    def operand_specs(self):
        c = self.config
        r2 = max(c.rope_dim // 2, 1)
        return [OperandSpec("o_part", (c.batch, self.groups, c.num_splits, self.rows, c.head_dim), "fp32"),
                OperandSpec("lse_part", (c.batch, self.groups, c.num_splits, self.rows), "fp32"),
                OperandSpec("sinks", (c.heads,), "fp32"),
                OperandSpec("cos", (c.batch, c.q_tokens, r2), "bf16", optional=not c.rope_dim),
                OperandSpec("sin", (c.batch, c.q_tokens, r2), "bf16", optional=not c.rope_dim),
                OperandSpec("out", (c.batch, c.q_tokens, c.heads, c.head_dim), "bf16", output=True)]

    def num_tiles(self) -> int:
        c = self.config
        return c.batch * c.q_tokens * c.heads * self.col_tiles

    def cost(self) -> Cost:
        c = self.config
        return Cost(bytes=c.num_splits * (COMBINE_COLS + 1) * 4 + COMBINE_COLS * 2,
                    flops=2 * c.num_splits * COMBINE_COLS)

    def own_smem_bytes(self) -> int:
        # split weights [S], the split groups' partial sums [SG, 128], max and denominator
        return 4 * (self.config.num_splits + (NUM_THREADS // (COMBINE_COLS // 4)) * COMBINE_COLS + 2) + 3 * 16

    def _one(self, t, b, tq):
        c = self.config
        g, r0 = (tq, 0) if c.per_token_groups else (0, tq * c.heads)
        op = t["o_part"][b, g, :, r0:r0 + c.heads].float()                    # [S, H, hd]
        lp = t["lse_part"][b, g, :, r0:r0 + c.heads].float()                  # [S, H]
        sink = t["sinks"].float()[None]
        L = torch.logsumexp(torch.cat([lp, sink]), dim=0)                     # [H]
        w = torch.nan_to_num(torch.exp(lp - L[None]), nan=0.0)
        o = (w[..., None] * op).sum(0).to(torch.bfloat16).float()            # the reference's .to(x.dtype)
        if c.rope_dim:
            cos = t["cos"][b, tq].float().repeat_interleave(2)
            sin = t["sin"][b, tq].float().repeat_interleave(2)
            r = o[:, -c.rope_dim:]
            rot = torch.stack((-r[:, 1::2], r[:, 0::2]), dim=-1).flatten(-2)
            o = torch.cat([o[:, :-c.rope_dim], r * cos - rot * sin], dim=-1)
        return o

    def reference(self, **t):
        c = self.config
        out = torch.stack([torch.stack([self._one(t, b, tq) for tq in range(c.q_tokens)]) for b in range(c.batch)])
        return {"out": out}

    def emulate_tile(self, t, tile):
        c = self.config
        bt, rest = divmod(tile, c.heads * self.col_tiles)
        h, cq = divmod(rest, self.col_tiles)
        b, tq = divmod(bt, c.q_tokens)
        cols = slice(cq * COMBINE_COLS, (cq + 1) * COMBINE_COLS)
        t["out"][b, tq, h, cols] = self._one(t, b, tq)[h, cols].to(t["out"].dtype)

    def _build_device_tile(self):
        from ._dsv4_cute import build_dsv4_combine_tile
        return build_dsv4_combine_tile(self)


@dataclass(frozen=True)
class DSV4RingWriteConfig:
    batch: int = 1
    q_tokens: int = 1
    head_dim: int = 512
    window: int = 128
    window_dtype: str = "bf16"   # "fp8_e4m3": each row quantised into V4.1's SWA record (quantize_window_fp8)


class DSV4RingWriteBlock(Block):
    """The sliding-window ring after the attention: window[b, (start[b] + t) % W] = new_kv[b, t]
    for this call's last min(T, W) tokens (as DSV4AttentionReference.forward writes it). A separate
    op that waits for the decode core: the core's tiles of every split read the old ring. Tile =
    one sequence, its rows copied as 16-byte units spread over the threads."""
    name = "dsv4_ring_write"
    Config = DSV4RingWriteConfig

    @property
    def fp8_window(self) -> bool:
        return self.config.window_dtype == "fp8_e4m3"

    def check(self):
        c = self.config
        if c.head_dim % 8 or c.window < 1 or c.q_tokens < 1 or c.batch < 1:
            self.unsupported(f"dsv4_ring_write: head_dim={c.head_dim} (multiple of 8), window={c.window}, "
                             f"q_tokens={c.q_tokens}, batch={c.batch}")
        if c.window_dtype not in WINDOW_DTYPES:
            self.unsupported(f"dsv4_ring_write: window_dtype {c.window_dtype!r} (supported: {WINDOW_DTYPES})")
        if self.fp8_window and c.head_dim % (8 * SCALE_GROUP):
            self.unsupported(f"dsv4_ring_write fp8: head_dim={c.head_dim} must be a multiple of {8 * SCALE_GROUP}")

    def operand_specs(self):
        c = self.config
        ring = (OperandSpec("window", (c.batch, c.window, window_record_words(c.head_dim)), "int32", output=True)
                if self.fp8_window else OperandSpec("window", (c.batch, c.window, c.head_dim), "bf16", output=True))
        return [OperandSpec("new_kv", (c.batch, c.q_tokens, c.head_dim), "bf16"),
                OperandSpec("start", (c.batch,), "int32"), ring]

    def num_tiles(self) -> int:
        return self.config.batch

    def cost(self) -> Cost:
        c = self.config
        return Cost(bytes=4 * min(c.q_tokens, c.window) * c.head_dim, flops=0)

    def _sequence(self, t, b, ring):
        c = self.config
        for tq in range(max(0, c.q_tokens - c.window), c.q_tokens):
            row = t["new_kv"][b, tq]
            ring[b, (int(t["start"][b]) + tq) % c.window] = (quantize_window_fp8(row.cpu()).to(ring.device)
                                                             if self.fp8_window else row.to(ring.dtype))

    def reference(self, **t):
        ring = t["window"].clone()
        for b in range(self.config.batch):
            self._sequence(t, b, ring)
        return {"window": ring}

    def emulate_tile(self, t, tile):
        self._sequence(t, tile, t["window"])

    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Int32

        from ._cute import gmem_tensor

        if self.fp8_window:
            from ._dsv4_cute import build_dsv4_ring_write_fp8_tile
            return build_dsv4_ring_write_fp8_tile(self)
        c = self.config
        B, T, HD, W = c.batch, c.q_tokens, c.head_dim, c.window
        T0 = max(0, T - W)
        U = HD // 8                          # 16-byte units per row
        N = (T - T0) * U

        @cute.jit
        def tile(ptrs, b: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mNew = gmem_tensor(ptrs[0], BFloat16, (B, T, U, 8), 16)
            mStart = gmem_tensor(ptrs[1], Int32, (B,), 4)
            mRing = gmem_tensor(ptrs[2], BFloat16, (B, W, U, 8), 16)
            start = mStart[b]
            for i in cutlass.range(tid, N, NUM_THREADS, unroll=1):
                tq = T0 + i // U
                u = i % U
                mRing[b, (start + tq) % W, u, None].store(mNew[b, tq, u, None].load())

        return tile


def dsv4_compile_cases() -> list:
    """V4.1-Flash TP8 (8 heads, head_dim 512, window 128): HCA at 1M context, CSA top-512, SWA; row
    groups at 64 and 16 x 3 heads, and of 16 rows at 32 heads."""
    return [
        DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="hca", batch=1, max_entries=8192, num_splits=16)),
        DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="csa", ratio=4, batch=8, q_tokens=2, max_entries=32768,
                                         num_splits=4)),
        DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="swa", batch=64, q_tokens=4, chunk=64)),
        DSV4CombineBlock(DSV4CombineConfig(heads=8, batch=1, num_splits=16)),
        DSV4CombineBlock(DSV4CombineConfig(heads=8, batch=8, q_tokens=2, num_splits=4, per_token_groups=True)),
        DSV4RingWriteBlock(DSV4RingWriteConfig(batch=64, q_tokens=2)),
        # V4.1's fp8 SWA records (window_dtype)
        DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="hca", batch=8, max_entries=256, num_splits=4,
                                         window_dtype="fp8_e4m3")),
        DSV4RingWriteBlock(DSV4RingWriteConfig(batch=64, q_tokens=2, window_dtype="fp8_e4m3")),
        # row groups: V4.1-Flash on one GPU (64 heads: CSA 2 tiles of 32 a token), TP4 x 3 tokens (48: 2 of 24)
        DSV4DecodeBlock(DSV4DecodeConfig(heads=64, mode="csa", ratio=4, batch=1, q_tokens=2, max_entries=32768,
                                         num_splits=4)),
        DSV4DecodeBlock(DSV4DecodeConfig(heads=16, mode="hca", batch=8, q_tokens=3, max_entries=256, num_splits=4,
                                         window_dtype="fp8_e4m3")),
        # 16-row tiles (the sublayer's last resort for shared memory): V4.1-Flash TP2, 32 heads in 2 of 16
        DSV4DecodeBlock(DSV4DecodeConfig(heads=32, mode="csa", ratio=4, batch=8, max_entries=8192, num_splits=2,
                                         chunk=16, stages=2, max_tile_rows=16)),
    ]
