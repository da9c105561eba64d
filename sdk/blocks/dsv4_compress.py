"""DeepSeek-V4 KV compression of the new tokens: the compressor state advances token by token and,
on the tokens that close a window, the window's compressed entry is written into the compressed
cache (CSA and HCA layers, and the CSA indexer's own compressor).

The definition is `Compressor.update` / `Compressor.entry` of sdk/reference/dsv4_attention.py
(equal to transformers' DeepseekV4CSACompressor / DeepseekV4HCACompressor), with the two
projections kv = kv_proj(x), gate = gate_proj(x) computed before (GEMVs) and the rope of each
window taken from the host's tables. For a sequence b and its new token t at position
p = start[b] + t, with r = ratio, c = dim (HCA) or 2 * dim (CSA, `overlap`), L = r or 2r slots:

    state_kv[b, p % L]   = kv[b, t]                                   (bf16)
    state_gate[b, p % L] = float(gate[b, t]) + position_bias[p % r]   (fp32)
    if (p + 1) % r == 0, window w = (p + 1) // r - 1:
      HCA: keys = the r slots, channel j of each
      CSA: channel j < dim of window w-1's slots (empty for w = 0), then channel dim + j of window
           w's slots (window w's slots are (w % 2) r .. (w % 2) r + r - 1)
      p_s    = bf16(softmax_s(gate_s))        (fp32 softmax over the window's keys, per channel)
      pooled = bf16(sum_s bf16(kv_s * p_s))
      entry  = RoPE(bf16(kv_norm * rmsnorm(pooled)))   interleaved pairs on the last `rope`
               channels, cos / sin [B, T, rope / 2] bf16 = the rope at position w * r (host table
               of the window that token t closes; unread for tokens that close none)
      entries[b, w] = entry                    (w >= max_entries: not written)

Two blocks, run one after the other (a dependency in a program; two launches standalone):
- `DSV4CompressBlock` - the state and the pooling, which is per channel: tile = (sequence, slice
  of `channels_per_tile` output channels), its T tokens in order (a T-token call equals T
  single-token calls), so that a closing window's state (HCA: 128 slots x 512 channels x 6 bytes
  = 384 KB a sequence) is read by many SMs at once. A thread owns one channel pair of the slice
  (lane) and every 8th key of the window (key lane): its keys' gates and values are loaded in one
  round trip, the max / sum / pooled sums meet across the key lanes in shared memory. It writes
  `pooled` (bf16) into entries[b, w].
- `DSV4CompressNormBlock` - tile = one sequence: the RMSNorm (kv_norm) and RoPE of the entries its
  call closed, in place (one CTA-wide sum an entry).

Supported: dim even and <= 2 * NUM_THREADS (V4.1-Flash: 512 main, 128 indexer), channels_per_tile
dividing dim with its channel pairs dividing NUM_THREADS, rope even and <= dim, ratio >= 1, bf16
projections / state, fp32 gate state; entries bf16 or V4.1's records: entry_dtype="fp4_e2m1" (dim
a multiple of 64; the main compressor's entries, dsv4_attention.quantize_comp_fp4: E2M1 codes +
an E4M3 scale per 16 values, 288 B for 512) or "mxfp4" (dim a multiple of 128, max_entries of 64;
the indexer's keys, indexer.quantize_index_keys: E2M1 codes + a UE8M0 scale per 32 values, 68 B for
128, in V4.1's planar pages of 64 keys: the codes, then the scale bytes). Then the
pooling writes `pooled` [B, T, dim] (the window token t closes) and the norm quantises the
normed, roped entry into the record - a group is the channel pairs of 8 (fp4_e2m1) or 16
(mxfp4) consecutive lanes (max by shuffles), the codes rounded to nearest, ties to even, as the
torch twins (bit for bit: `tests/test_dsv4_compress.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .base import NUM_THREADS, SCRATCH_WORDS, Block, Cost, OperandSpec
from .dsv4_attention import (COMP_AMAX_FLOOR, comp_cache_shape, comp_fp4_round_trip, dequantize_comp_fp4,
                            quantize_comp_fp4)
from .formats import MXFP4_AMAX_FLOOR, MXFP4_GROUP, mxfp4_round_trip
from .indexer import (INDEX_KEY_PAGE, dequantize_index_keys, index_key_cache_shape, index_key_words,
                      quantize_index_keys, write_index_key)

# the pooling's cross-key-lane sums: two fp32 words per thread in `scratch`
assert 2 * NUM_THREADS <= SCRATCH_WORDS


@dataclass(frozen=True)
class DSV4CompressConfig:
    dim: int = 512                       # entry width (the indexer's compressor: its head_dim, 128)
    ratio: int = 128                     # tokens per entry: HCA 128, CSA 4
    overlap: bool = False                # CSA: 2 * dim features, entries pool two windows
    rope: int = 64                       # trailing rope channels of the entry
    batch: int = 1
    tokens: int = 1                      # new tokens per sequence
    max_entries: int = 1024              # entries per sequence (max_seq_len // ratio)
    eps: float = 1e-6
    channels_per_tile: int = 64          # DSV4CompressBlock: output channels a tile pools (min with dim)
    entry_dtype: str = "bf16"            # records (opt-in; the pooling writes `pooled` [B, T, dim], the
                                         # window token t closes, and the norm quantises into `entries`):
                                         # "fp4_e2m1": the main compressor's V4.1 entries (quantize_comp_fp4,
                                         # 2026-12-04); "mxfp4": the indexer's V4.1 keys (indexer.
                                         # quantize_index_keys, 2026-12-05)


@dataclass(frozen=True)
class RecordFormat:
    """A quantised entry format of the compressor's cache: its torch definition."""
    shape: Callable[[int, int, int], tuple]            # (batch, max_entries, dim) -> the cache's int32 shape
    quantize: Callable[[torch.Tensor], torch.Tensor]   # entries [B, E, dim] -> the cache
    dequantize: Callable[[torch.Tensor, int], torch.Tensor]   # (the cache, dim) -> bf16 [B, E, dim]
    write: Callable                                    # (cache, b, w, entry [dim]): entry w of sequence b
    round_trip: Callable[[torch.Tensor], torch.Tensor]  # entries [..., dim] -> the values a reader sees


def _write_comp_fp4(cache, b, w, entry):
    cache[b, w] = quantize_comp_fp4(entry).to(cache.device)


# entry_dtype -> its format: the main compressor's V4.1 fp4 entries (a record per entry) and the
# indexer's V4.1 mxfp4 keys (planar pages of 64 keys)
RECORD_FORMATS = {
    "fp4_e2m1": RecordFormat(comp_cache_shape, quantize_comp_fp4, dequantize_comp_fp4, _write_comp_fp4,
                             comp_fp4_round_trip),
    "mxfp4": RecordFormat(index_key_cache_shape, quantize_index_keys, dequantize_index_keys, write_index_key,
                          mxfp4_round_trip),
}
ENTRY_DTYPES = ("bf16",) + tuple(RECORD_FORMATS)


def _window_closed(p: int, ratio: int):
    """The window token position p closes, or None."""
    return (p + 1) // ratio - 1 if (p + 1) % ratio == 0 else None


class _CompressBase(Block):
    Config = DSV4CompressConfig

    @property
    def records(self) -> bool:
        """The entries are quantised records (fp4_e2m1 / mxfp4), written by the norm from `pooled`."""
        return self.config.entry_dtype != "bf16"

    @property
    def format(self) -> RecordFormat:
        return RECORD_FORMATS[self.config.entry_dtype]

    def quantize(self, h: torch.Tensor) -> torch.Tensor:
        """Entries [B, E, dim] -> the int32 cache (the format's torch definition)."""
        return self.format.quantize(h)

    def dequantize(self, cache: torch.Tensor) -> torch.Tensor:
        """The int32 cache -> the entries' bf16 values [B, E, dim] (what their readers dequantise)."""
        return self.format.dequantize(cache, self.config.dim)

    def round_trip(self, h: torch.Tensor) -> torch.Tensor:
        """Entries [..., dim] -> the values their records hold (a model compressor's entry_format)."""
        return self.format.round_trip(h)

    def entries_spec(self) -> OperandSpec:
        c = self.config
        if self.records:
            return OperandSpec("entries", self.format.shape(c.batch, c.max_entries, c.dim), "int32", output=True)
        return OperandSpec("entries", (c.batch, c.max_entries, c.dim), "bf16", output=True)

    def pooled_spec(self, output: bool) -> OperandSpec:
        """Records: the pooled, pre-norm entry of the window each token closes, bf16 [B, T, dim]."""
        c = self.config
        return OperandSpec("pooled", (c.batch, c.tokens, c.dim), "bf16", output=output)

    @property
    def width(self) -> int:
        return 2 * self.config.dim if self.config.overlap else self.config.dim

    @property
    def slots(self) -> int:
        return 2 * self.config.ratio if self.config.overlap else self.config.ratio

    def check(self):
        c = self.config
        if c.dim % 2 or not 2 <= c.dim <= 2 * NUM_THREADS:
            self.unsupported(f"{self.name}: dim={c.dim} (even, at most {2 * NUM_THREADS}: one channel pair a thread)")
        if c.rope % 2 or not 0 <= c.rope <= c.dim:
            self.unsupported(f"{self.name}: rope={c.rope} (even, at most dim={c.dim})")
        if c.ratio < 1 or c.batch < 1 or c.tokens < 1 or c.max_entries < 1:
            self.unsupported(f"{self.name}: ratio={c.ratio}, batch={c.batch}, tokens={c.tokens}, "
                             f"max_entries={c.max_entries} (all >= 1)")
        if c.entry_dtype not in ENTRY_DTYPES:
            self.unsupported(f"{self.name}: entry_dtype {c.entry_dtype!r} (supported: {ENTRY_DTYPES})")
        # whole-word records: fp4_e2m1 9 / 16, mxfp4 17 / 32 bytes a value
        multiple = {"bf16": 1, "fp4_e2m1": 64, "mxfp4": 128}[c.entry_dtype]
        if c.dim % multiple:
            self.unsupported(f"{self.name} {c.entry_dtype} entries: dim={c.dim} must be a multiple of {multiple}")
        if c.entry_dtype == "mxfp4" and c.max_entries % INDEX_KEY_PAGE:
            self.unsupported(f"{self.name} mxfp4 keys: max_entries={c.max_entries} must be a multiple of the "
                             f"{INDEX_KEY_PAGE}-key page")


class DSV4CompressBlock(_CompressBase):
    """The compressor state and the softmax pooling of the windows the call closes (pre-norm)."""
    name = "dsv4_compress"

    @property
    def tile_channels(self) -> int:
        return min(self.config.channels_per_tile, self.config.dim)

    @property
    def groups(self) -> int:
        return self.config.dim // self.tile_channels

    def check(self):
        super().check()
        c, tc = self.config, self.tile_channels
        pairs = tc // 2
        if tc < 2 or tc % 2 or c.dim % tc or NUM_THREADS % pairs:
            self.unsupported(f"dsv4_compress: channels_per_tile={c.channels_per_tile} (even, dividing dim={c.dim}, "
                             f"its {pairs} channel pairs dividing {NUM_THREADS} threads)")

    def operand_specs(self):
        c = self.config
        B, T, C = c.batch, c.tokens, self.width
        return [OperandSpec("kv", (B, T, C), "bf16"),
                OperandSpec("gate", (B, T, C), "bf16"),
                OperandSpec("position_bias", (c.ratio, C), "fp32"),
                OperandSpec("start", (B,), "int32"),
                OperandSpec("state_kv", (B, self.slots, C), "bf16", output=True),
                OperandSpec("state_gate", (B, self.slots, C), "fp32", output=True),
                self.pooled_spec(output=True) if self.records else self.entries_spec()]

    def num_tiles(self) -> int:
        return self.config.batch * self.groups

    def cost(self) -> Cost:
        c = self.config
        C = self.width // self.groups
        per_token = C * (2 + 2 + 2 + 4 + 4)          # kv, gate in; state kv, gate out; bias
        # an entry reads the window's state once per `ratio` tokens
        entry = self.slots * C * 6 // c.ratio + self.tile_channels * 2
        return Cost(bytes=c.tokens * (per_token + entry), flops=c.tokens * C * 8)

    def _channels(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(output channels, state channels) of slice g: HCA the same; CSA j and dim + j."""
        tc, d = self.tile_channels, self.config.dim
        out = torch.arange(g * tc, (g + 1) * tc)
        return out, (torch.cat([out, out + d]) if self.config.overlap else out)

    def _pool(self, t: dict, b: int, chans, state_chans, out: dict) -> None:
        """Sequence b's T tokens, in order, on the given channels of the tensors of `out`."""
        c = self.config
        r, d, L = c.ratio, c.dim, self.slots
        bias = t["position_bias"].float()[:, state_chans]
        skv, sg = out["state_kv"], out["state_gate"]
        for tq in range(c.tokens):
            p = int(t["start"][b]) + tq
            skv[b, p % L, state_chans] = t["kv"][b, tq, state_chans].to(skv.dtype)
            sg[b, p % L, state_chans] = t["gate"][b, tq, state_chans].float() + bias[p % r]
            w = _window_closed(p, r)
            if w is None:
                continue
            if c.overlap:
                cur = (w % 2) * r + torch.arange(r)
                prev = ((w + 1) % 2) * r + torch.arange(r)
                pkv, pg = skv[b, prev][:, chans].float(), sg[b, prev][:, chans].float()
                if w == 0:
                    pkv, pg = torch.zeros_like(pkv), torch.full_like(pg, float("-inf"))
                kv = torch.cat([pkv, skv[b, cur][:, chans + d].float()])
                gate = torch.cat([pg, sg[b, cur][:, chans + d].float()])
            else:
                kv, gate = skv[b, :r][:, chans].float(), sg[b, :r][:, chans].float()
            prob = gate.softmax(dim=0).to(torch.bfloat16).float()
            pooled = (kv * prob).to(torch.bfloat16).float().sum(dim=0)
            if self.records:
                out["pooled"][b, tq, chans] = pooled.to(torch.bfloat16)
            elif w < c.max_entries:
                out["entries"][b, w, chans] = pooled.to(out["entries"].dtype)

    def reference(self, **t):
        out = {n: t[n].clone() for n in ("state_kv", "state_gate", "pooled" if self.records else "entries")}
        d = torch.arange(self.config.dim)
        state = torch.cat([d, d + self.config.dim]) if self.config.overlap else d
        for b in range(self.config.batch):
            self._pool(t, b, d, state, out)
        return out

    def emulate_tile(self, t, tile):
        b, g = divmod(tile, self.groups)
        self._pool(t, b, *self._channels(g), t)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import gmem_tensor

        c = self.config
        B, T, D, R, E = c.batch, c.tokens, c.dim, c.ratio, c.max_entries
        C, L, G = self.width, self.slots, self.groups
        HALVES = 2 if c.overlap else 1       # state channel pairs a lane pools from: j, and dim + j (CSA)
        NP = D // 2                          # output channel pairs
        PT = self.tile_channels // 2         # pairs of a tile = lanes
        KL = NUM_THREADS // PT               # key lanes
        NK = L if c.overlap else R           # keys of a window
        KPT = -(-NK // KL)                   # keys a thread holds
        names = self.operands()
        ix = {n: i for i, n in enumerate(names)}
        NEG = -3.0e38

        def bf(x):
            return x.to(BFloat16).to(Float32)

        @cute.jit
        def key_slot(w: Int32, k: Int32, i: Int32):
            """(slot, state channel pair, valid) of key k of window w for output pair i: HCA the
            window's k-th slot; CSA k < r: window w-1's slot k, first-half channels (no window -1:
            invalid), k >= r: window w's slot k - r, second-half channels."""
            sl = k
            u = i
            ok = k < NK
            if cutlass.const_expr(c.overlap):
                if k < R:
                    sl = ((w + 1) % 2) * R + k
                    ok = w > 0
                else:
                    sl = (w % 2) * R + (k - R)
                    u = i + NP
            if k >= NK:
                sl = Int32(0)                # a key lane past the window reads slot 0, unused
                u = i
            return sl, u, ok

        @cute.jit
        def across_keys(vals, scratch, lane: Int32, kl: Int32, is_max: cutlass.Constexpr):
            """Max / sum of the two values of a lane over the KL key lanes (barriers on both sides)."""
            scratch[(kl * PT + lane) * 2] = vals[0]
            scratch[(kl * PT + lane) * 2 + 1] = vals[1]
            cute.arch.sync_threads()
            tot = cute.make_rmem_tensor((2,), Float32)
            for e in cutlass.range_constexpr(2):
                tot[e] = scratch[lane * 2 + e]
                for k in cutlass.range_constexpr(1, KL):
                    v = scratch[(k * PT + lane) * 2 + e]
                    if cutlass.const_expr(is_max):
                        tot[e] = cute.arch.fmax(tot[e], v)
                    else:
                        tot[e] = tot[e] + v
            cute.arch.sync_threads()
            return tot

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            b = t // G
            lane = tid % PT
            kl = tid // PT
            i = (t % G) * PT + lane          # the output channel pair of this lane
            mKV = gmem_tensor(ptrs[ix["kv"]], BFloat16, (B, T, C // 2, 2), 4)
            mG = gmem_tensor(ptrs[ix["gate"]], BFloat16, (B, T, C // 2, 2), 4)
            mBias = gmem_tensor(ptrs[ix["position_bias"]], Float32, (R, C // 2, 2), 8)
            mStart = gmem_tensor(ptrs[ix["start"]], Int32, (B,), 4)
            mSKV = gmem_tensor(ptrs[ix["state_kv"]], BFloat16, (B, L, C // 2, 2), 4)
            mSG = gmem_tensor(ptrs[ix["state_gate"]], Float32, (B, L, C // 2, 2), 8)
            if cutlass.const_expr(self.records):
                mOut = gmem_tensor(ptrs[ix["pooled"]], BFloat16, (B, T, D // 2, 2), 4)
            else:
                mOut = gmem_tensor(ptrs[ix["entries"]], BFloat16, (B, E, D // 2, 2), 4)
            start = mStart[b]
            for tq in cutlass.range(T, unroll=1):
                p = start + tq
                slot = p % L
                # this token into the state: key lanes 0 (and 1, CSA) write one half each
                if kl < HALVES:
                    u = i + kl * NP
                    kv2 = mKV[b, tq, u, None].load()
                    g2 = mG[b, tq, u, None].load().to(Float32) + mBias[p % R, u, None].load()
                    mSKV[b, slot, u, None].store(kv2)
                    mSG[b, slot, u, None].store(g2)
                if (p + 1) % R == 0:                     # uniform over the CTA: b, tq
                    w = (p + 1) // R - 1
                    cute.arch.sync_threads()             # the token's state is read by other key lanes
                    # the lane's keys: gates and values in registers (one round trip)
                    gs = cute.make_rmem_tensor((KPT, 2), Float32)
                    vs = cute.make_rmem_tensor((KPT, 2), Float32)
                    for j in cutlass.range_constexpr(KPT):
                        sl, u, ok = key_slot(w, kl + j * KL, i)
                        g2 = mSG[b, sl, u, None].load()
                        v2 = mSKV[b, sl, u, None].load().to(Float32)
                        for e in cutlass.range_constexpr(2):
                            ge = g2[e]                   # (taken out of the branch: staged values)
                            ve = v2[e]
                            gs[j, e] = Float32(NEG)
                            vs[j, e] = Float32(0.0)
                            if ok:
                                gs[j, e] = ge
                                vs[j, e] = ve
                    part = cute.make_rmem_tensor((2,), Float32)
                    for e in cutlass.range_constexpr(2):
                        part[e] = Float32(NEG)
                        for j in cutlass.range_constexpr(KPT):
                            part[e] = cute.arch.fmax(part[e], gs[j, e])
                    mx = across_keys(part, scratch, lane, kl, True)
                    # no branch per key: a missing key's gate (NEG) gives exp 0 and its value is 0,
                    # so the KPT keys' chains are independent and may interleave (with a branch per
                    # key the tiles took ~12 us each on the H200; this form 4.8-8.4 us in the V4.1
                    # HCA sublayer, 5.3 us alone - latency-bound, 0.22 issues per scheduler-cycle)
                    for e in cutlass.range_constexpr(2):
                        part[e] = Float32(0.0)
                        for j in cutlass.range_constexpr(KPT):
                            gs[j, e] = cute.math.exp(gs[j, e] - mx[e], fastmath=False)
                            part[e] = part[e] + gs[j, e]
                    z = across_keys(part, scratch, lane, kl, False)
                    for e in cutlass.range_constexpr(2):
                        rz = Float32(1.0) / z[e]
                        part[e] = Float32(0.0)
                        for j in cutlass.range_constexpr(KPT):
                            part[e] = part[e] + bf(vs[j, e] * bf(gs[j, e] * rz))
                    pooled = across_keys(part, scratch, lane, kl, False)
                    if cutlass.const_expr(self.records):
                        if kl == 0:
                            mOut[b, tq, i, None].store(pooled.load().to(BFloat16))
                    else:
                        if (kl == 0) & (w < E):
                            mOut[b, w, i, None].store(pooled.load().to(BFloat16))

        return tile


class DSV4CompressNormBlock(_CompressBase):
    """The entries the call closed (pooled by DSV4CompressBlock): kv_norm RMSNorm + RoPE in place."""
    name = "dsv4_compress_norm"

    def operand_specs(self):
        c = self.config
        B, T, R2 = c.batch, c.tokens, max(c.rope // 2, 1)
        return [OperandSpec("kv_norm", (c.dim,), "bf16"),
                OperandSpec("cos", (B, T, R2), "bf16", optional=c.rope == 0),
                OperandSpec("sin", (B, T, R2), "bf16", optional=c.rope == 0),
                OperandSpec("start", (B,), "int32")] + ([self.pooled_spec(output=False)] if self.records else []) \
            + [self.entries_spec()]

    def num_tiles(self) -> int:
        return self.config.batch

    def cost(self) -> Cost:
        c = self.config
        return Cost(bytes=-(-c.tokens // c.ratio) * c.dim * 4 + c.dim * 2, flops=c.tokens * c.dim * 8 // c.ratio)

    def _norm(self, t: dict, b: int, ent: torch.Tensor) -> None:
        c = self.config
        d = c.dim
        for tq in range(c.tokens):
            w = _window_closed(int(t["start"][b]) + tq, c.ratio)
            if w is None or w >= c.max_entries:
                continue
            pooled = (t["pooled"][b, tq] if self.records else ent[b, w]).float()
            h = pooled * torch.rsqrt(pooled.pow(2).mean() + c.eps)
            h = (t["kv_norm"].float() * h).to(torch.bfloat16).float()
            if c.rope:
                cos, sin = t["cos"][b, tq].float(), t["sin"][b, tq].float()
                x = h[d - c.rope:]
                even, odd = x[0::2], x[1::2]
                rot = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten()
                h = torch.cat([h[:d - c.rope], rot.to(torch.bfloat16).float()])
            if self.records:
                self.format.write(ent, b, w, h.cpu())
            else:
                ent[b, w] = h.to(ent.dtype)

    def reference(self, **t):
        ent = t["entries"].clone()
        for b in range(self.config.batch):
            self._norm(t, b, ent)
        return {"entries": ent}

    def emulate_tile(self, t, tile):
        self._norm(t, tile, t["entries"])

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32

        from ._cute import bits_to_f32, block_sum, div_rn, e2m1_code, gmem_tensor, ue8m0_exponent

        c = self.config
        B, T, D, R, RT, E = c.batch, c.tokens, c.dim, c.ratio, c.rope, c.max_entries
        NP = D // 2                          # channel pairs = active threads
        REC = self.records
        MX = c.entry_dtype == "mxfp4"
        RB = 4 * self.entries_spec().shape[-1] if REC else 0       # fp4 records: bytes of one
        KB = 4 * index_key_words(D) if MX else 0                    # mxfp4: bytes of a key (68 at 128)
        PG = INDEX_KEY_PAGE
        # records: the consecutive lanes (channel pairs) of a scale group - mxfp4: 32 values a UE8M0
        # scale; fp4_e2m1: 16 an E4M3
        GL = 16 if MX else 8

        @cute.jit
        def e4m3_round(x: Float32):
            """(the E4M3 byte of x, rounded to nearest even and saturating at 448; its value in fp32)."""
            byte, val = cute.arch.inline_ptx(
                "{ .reg .b16 h, l, u; .reg .b32 p; cvt.rn.satfinite.e4m3x2.f32 h, {$r1}, {$r0}; "
                "cvt.u32.u16 {$w0}, h; and.b32 {$w0}, {$w0}, 255; cvt.rn.f16x2.e4m3x2 p, h; "
                "mov.b32 {l, u}, p; cvt.f32.f16 {$w1}, l; }",
                write_only_types=[Int32, Float32], read_only_args=[x, Float32(0.0)])
            return byte, val

        R2 = max(RT // 2, 1)
        P0 = (D - RT) // 2                   # first rope pair
        eps = float(c.eps)
        names = self.operands()
        ix = {n: i for i, n in enumerate(names)}

        def bf(x):
            return x.to(BFloat16).to(Float32)

        @cute.jit
        def tile(ptrs, b: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            mNW = gmem_tensor(ptrs[ix["kv_norm"]], BFloat16, (D // 2, 2), 4)
            mStart = gmem_tensor(ptrs[ix["start"]], Int32, (B,), 4)
            if cutlass.const_expr(REC):
                mIn = gmem_tensor(ptrs[ix["pooled"]], BFloat16, (B, T, D // 2, 2), 4)
                if cutlass.const_expr(MX):       # a sequence's pages, flat
                    mRecB = gmem_tensor(ptrs[ix["entries"]], cutlass.Int8, (B, E * KB), 1)
                else:
                    mRecB = gmem_tensor(ptrs[ix["entries"]], cutlass.Int8, (B, E, RB), 1)
            else:
                mEnt = gmem_tensor(ptrs[ix["entries"]], BFloat16, (B, E, D // 2, 2), 4)
            mCos = None
            mSin = None
            if cutlass.const_expr(RT > 0):
                mCos = gmem_tensor(ptrs[ix["cos"]], BFloat16, (B, T, R2), 2)
                mSin = gmem_tensor(ptrs[ix["sin"]], BFloat16, (B, T, R2), 2)
            active = tid < NP
            i = tid
            if i >= NP:
                i = Int32(NP - 1)            # idle threads mirror the last pair; they write nothing
            start = mStart[b]
            for tq in cutlass.range(T, unroll=1):
                p = start + tq
                w = (p + 1) // R - 1
                if ((p + 1) % R == 0) & (w < E):         # uniform over the CTA: b, tq
                    if cutlass.const_expr(REC):
                        x2 = mIn[b, tq, i, None].load().to(Float32)
                    else:
                        x2 = mEnt[b, w, i, None].load().to(Float32)
                    x0 = x2[0]
                    x1 = x2[1]
                    ss = Float32(0.0)
                    if active:
                        ss = x0 * x0 + x1 * x1
                    rstd = cute.math.rsqrt(block_sum(ss, scratch) / Float32(D) + Float32(eps), fastmath=False)
                    nw = mNW[i, None].load().to(Float32)
                    h0 = bf(nw[0] * (x0 * rstd))
                    h1 = bf(nw[1] * (x1 * rstd))
                    if cutlass.const_expr(RT > 0):
                        if i >= P0:
                            cs = mCos[b, tq, i - P0].to(Float32)
                            sn = mSin[b, tq, i - P0].to(Float32)
                            r0 = bf(h0 * cs - h1 * sn)
                            h1 = bf(h1 * cs + h0 * sn)
                            h0 = r0
                    if cutlass.const_expr(REC):
                        # a group = the channel pairs of GL consecutive lanes: its max |h| by
                        # shuffles, its scale, each lane's two codes as one byte; the group's first
                        # lane writes the scale byte (NP is a multiple of GL: whole groups)
                        a = cute.arch.fmax(cute.arch.fmax(h0, -h0), cute.arch.fmax(h1, -h1))
                        for sh in cutlass.range_constexpr(GL.bit_length() - 1):
                            a = cute.arch.fmax(a, cute.arch.shuffle_sync_bfly(a, offset=1 << sh))
                        # V4.1's writers floor the max: the scale is never 0 (mxfp4 E >= 1;
                        # fp4 >= e4m3's smallest, 2^-9)
                        if cutlass.const_expr(MX):
                            # the smallest 2^(E - 127) >= max / 6 (exact)
                            sbyte = ue8m0_exponent(cute.arch.fmax(a, Float32(MXFP4_AMAX_FLOOR)), 6.0)
                            sval = bits_to_f32(sbyte << 23)
                        else:
                            sbyte, sval = e4m3_round(cute.arch.fmin(
                                div_rn(cute.arch.fmax(a, Float32(COMP_AMAX_FLOOR)), Float32(6.0)), Float32(448.0)))
                        inv = div_rn(Float32(1.0), sval)         # codes of x times 1 / s, as V4.1's writer
                        code = e2m1_code(h0 * inv) | (e2m1_code(h1 * inv) << 4)
                        if active:
                            if cutlass.const_expr(MX):
                                # the key's codes and scale bytes in their places of its page
                                pg = (w // PG) * (PG * KB)
                                j = w % PG
                                mRecB[b, pg + j * (D // 2) + i] = cutlass.Int8(code)
                                if i % GL == 0:
                                    sb = pg + PG * (D // 2) + j * (D // MXFP4_GROUP) + i // GL
                                    mRecB[b, sb] = cutlass.Int8(sbyte)
                            else:
                                mRecB[b, w, i] = cutlass.Int8(code)
                                if i % GL == 0:
                                    mRecB[b, w, D // 2 + i // GL] = cutlass.Int8(sbyte)
                    else:
                        if active:
                            out2 = cute.make_rmem_tensor((2,), Float32)
                            out2[0] = h0
                            out2[1] = h1
                            mEnt[b, w, i, None].store(out2.load().to(BFloat16))

        return tile


def compressor_blocks(config: DSV4CompressConfig) -> tuple[DSV4CompressBlock, DSV4CompressNormBlock]:
    """The two blocks of a compressor, in their order."""
    return DSV4CompressBlock(config), DSV4CompressNormBlock(config)


def dsv4_compress_compile_cases():
    """V4.1-Flash: the HCA (ratio 128) and CSA (ratio 4, overlapping) main compressors at 512 and
    the CSA indexer's (128 channels), batch 1 / 64, T = 1 / 2."""
    return [blk for cfg in (DSV4CompressConfig(dim=512, ratio=128, batch=64),
                            DSV4CompressConfig(dim=512, ratio=4, overlap=True, batch=1, tokens=2),
                            DSV4CompressConfig(dim=128, ratio=4, overlap=True, batch=8),
                            DSV4CompressConfig(dim=512, ratio=128, batch=8, entry_dtype="fp4_e2m1"),
                            DSV4CompressConfig(dim=128, ratio=4, overlap=True, batch=8, entry_dtype="mxfp4"))
            for blk in compressor_blocks(cfg)]
