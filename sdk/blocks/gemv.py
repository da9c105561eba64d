"""GEMV / skinny GEMM block: y[m, n] = sum_k x[m, k] * W[n, k], for M = 1..64 tokens, as a
streaming block (its weights flow through the megakernel's shared-memory ring).

Supported:
- weights bf16, fp32 (routers: Kimi K3's gate is fp32), or fp8-e4m3 with fp32 128x128 block
  scales `scale[n // 128, k // 128]` (the DeepSeek / Kimi checkpoint format: `weight_scale_inv`,
  multiplied in);
- x bf16 or fp32 [M, K]; y bf16 or fp32 [M, N]; fp32 accumulation;
- fused SwiGLU epilogue (`swiglu=True`): two weights (gate, up) and
  y = silu(gate(x)) * up(x), with the optional clamp limit (gate <= limit, |up| <= limit), or
  (`activation="situ"`, Kimi K3) y = SiTU(gate(x), up(x)) with `situ_beta` / `situ_linear_beta`;
- fused RMSNorm prologue (`norm=True`): the tile computes rstd[m] = rsqrt(mean(x[m]^2) + eps)
  over the whole row itself and uses x_n = x * rstd * norm_weight (rounded to bf16, like a
  separate norm op's bf16 output) - no norm op, no dependency hop, no one-CTA critical path;
  the cost is M x K reads of x per tile from L2 (cheap at small M: 28 KB at M=1, K=7168). At
  M <= 2 it is one pass (x and the norm weight held in registers, one round trip);
- fused residual epilogue (`residual="bf16"|"fp32"`): y = res + x @ W^T; `res` may alias `y`
  (the residual stream updated in place: each element is read and written by one thread); the
  residual rows are loaded in the prologue when they fit in registers (rows/warp x M <= 16).
- activations staged once per op per SM when the whole x fits in smem (`fresh` = 0: the previous
  tile of the CTA was of the same op; see sdk/blocks/base.py).
- `balanced_config()`: the rows per tile that finish the op soonest on the GPU's SMs;
  `fill_stage()`: the widest chunk that fits a megakernel ring's stage;
  `GemvBlock.tile_balance()`: the busiest SM's tiles over the mean (1.0 = even).

A tile is `rows_per_tile` (R) output rows over the full K. Its weights are cut into chunks of
R rows x `chunk_k` (KC) columns (~16 KB), copied by cp.async into ring stages laid out
[weight][row][KC/E + 1 units of 16 bytes] (one pad unit per row: rows start on different banks)
followed, for fp8, by the chunk's block scales. The activations of the tile are staged in smem
as bf16 (`x_block` columns at a time, at most 64 KB). Consume: warp w owns rows w, w+8, ...
(and the gate and up rows together); lane l reads 16-byte units l, l+32, ... of each row from
the stage, fp32 FMAs against x from smem, per-token accumulators in registers; the epilogue is a
warp-shuffle reduction per (row, token).

Tensor-core consumer (`use_mma`: from MMA_MIN_M = 8 tokens, bf16 or fp8 weights):
warp mma.sync m16n8k16 with swap-AB (weight rows = the MMA's M, tokens = its N), the 8 warps
splitting each chunk's K, the warps' partial sums added in smem at the end of the tile; see
docs/megakernel.md ("The GEMV consumer").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.common import swiglu as swiglu_ref
from ..errors import UnsupportedConfigError
from .base import NUM_THREADS, PRODUCER_THREADS, STATS_OFFSET, Block, Cost, OperandSpec, StreamFaces, env_switch

# The CUDA-core GEMV's weight copies (rows by producer warps) under an evict-first L2 policy: read
# once a step, they then leave the L2 before the activations, counters, records and code the next
# instructions reuse. The default since the thirty-fourth session (SDK_WEIGHT_EVICT_FIRST=0: plain
# copies). H100, interleaved, three pairs (bench/results/h100/megakernel_v34_evict_first.json):
# one-launch stack L=8 I=2048 fp8 152.0-152.5 vs 155.8-156.0 us (76.5-76.8% vs 74.8-75.0% of
# copy), bf16 263.2-264.4 vs 266.8-267.7; MoE Kimi K3 batch 1 78.9 vs 80.0, V4.1-Flash 66.9 vs 67.0.
WEIGHT_EVICT_FIRST = env_switch("SDK_WEIGHT_EVICT_FIRST", "1", "the ring's weight copies evict-first in the L2")

CHUNK_TARGET_BYTES = 16 * 1024      # weight bytes per ring stage
CHUNK_MAX_BYTES = 32 * 1024         # ... at most, for tiles too tall for the target
X_SMEM_MAX = 64 * 1024              # staged activations per tile at a time
MERGED_NORM_MAX_M = 2               # fused norm in one pass (x held in registers) up to this batch
MMA_MIN_M = 8                       # tensor cores from this batch (below, CUDA cores stream bf16
                                    # at ~90% of the bandwidth and need no cross-warp sum)
MMA_ACCUMULATORS = 64               # fp32 accumulator registers per thread on the MMA path
FP8_DECODES = ("cvt", "int", "hfma2", "hfma2_alu", "wgmma")
WGMMA_MAX_M = 4                     # fp8_decode="wgmma": tokens x x pieces fill one 8-row core matrix
WGMMA_REGS = 64                     # ... fp32 wgmma accumulators per thread per asm statement


@dataclass(frozen=True)
class GemvConfig:
    n: int                               # output features (rows of W)
    k: int                               # input features
    m: int = 1                           # tokens (static: the megakernel is built per batch shape)
    rows_per_tile: int = 0               # 0: auto (standalone_rows; the megakernel programs cut theirs
                                         # with balanced_configs)
    weight_dtype: str = "bf16"           # "bf16" | "fp8_e4m3"
    swiglu: bool = False
    swiglu_limit: float | None = None
    activation: str = "silu"             # the swiglu epilogue's: "silu" | "situ" (Kimi K3, with the betas below)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    out_dtype: str = "bf16"              # "bf16" | "fp32"
    chunk_k: int = 0                     # K columns per ring chunk; 0 = auto (~16 KB of weights)
    x_dtype: str = "bf16"                # "bf16" | "fp32"
    norm: bool = False                   # fused RMSNorm of x (operand norm_weight [K] bf16)
    norm_eps: float = 1e-6
    residual: str | None = None          # None | "bf16" | "fp32": y = res + x @ W^T
    scale_block: int = 128
    mma: bool | None = None              # tensor cores (warp mma.sync); None = auto (use_mma)
    groups: int = 1                      # block-diagonal W: output rows [j n/G, (j+1) n/G) read x's
                                         # columns [j k, (j+1) k) (x is [m, G k]; DeepSeek-V4's grouped
                                         # o_a over the heads of G o_groups)
    fp8_decode: str = "hfma2"            # CUDA-core fp8: "hfma2" (packed f16 FMAs, x scaled per token
                                         # by a power of two into f16's range); "cvt" (e4m3x2 -> f16x2
                                         # -> f32 FMAs); "int" (bit placement, x staged x 2^64). H200,
                                         # one-launch stack L=4 I=18432: 75.9 / 71.1 / 63.5% of copy;
                                         # "wgmma" (Hopper only, up to WGMMA_MAX_M tokens): the
                                         # weights straight from the ring into warpgroup MMAs, x as
                                         # a sum of e4m3 pieces - no per-weight instruction;
                                         # "hfma2_alu" (opt-in): hfma2 with the e4m3 -> f16 step
                                         # in integer ops, no F2FP (H100, weights hot in the L2:
                                         # 25% slower; stack L=8 I=2048 69.0 vs 70.7%)
    warp_ring: bool = False              # chunks in 8 warp slices (Block.warp_ring): warp w copies
                                         # the rows it reads (w, w + 8, ...), so a chunk needs warp
                                         # barriers, not the CTA's two; CUDA-core consumers with the
                                         # whole x staged once per tile; every streaming block of
                                         # the kernel must take it (base.ring_mode). H100: the lone
                                         # fp8 GEMV 5-18% faster, the stack not (docs/megakernel.md)


TILE_OVERHEAD_BYTES = 32 * 1024     # a tile's fixed cost (wait, prologue, epilogue, signal) in bytes
MAX_ACCUMULATORS = 128              # fp32 accumulators per thread (rows per warp x weights x tokens)


def straddles(config: GemvConfig, rows: int) -> bool:
    """fp8 tiles of `rows` rows would straddle two scale blocks: legal for the hfma2 consumer
    (GemvBlock.scale_rows), but unmeasured - the automatic cuts (balanced_configs, standalone_rows)
    skip them; explicit rows_per_tile take them."""
    return config.weight_dtype == "fp8_e4m3" and config.scale_block % rows != 0


def balanced_config(config: GemvConfig, num_sms: int = 132, max_rows: int = 64) -> GemvConfig:
    """`config` with the rows_per_tile that finishes the op soonest on `num_sms` SMs: the most
    tiles any SM gets x (the tile's weight bytes + TILE_OVERHEAD_BYTES), among the legal row
    counts up to `max_rows` that keep at most MAX_ACCUMULATORS per thread; ties go to taller
    tiles (fewer of them)."""
    return balanced_configs([config], num_sms, max_rows)[0]


def balanced_configs(configs: list[GemvConfig], num_sms: int = 132, max_rows: int = 64) -> list[GemvConfig]:
    """`configs` - GEMVs that run side by side (e.g. every projection of one activation) - cut
    alike: the one rows_per_tile (legal for all) whose tiles, all of them spread over `num_sms`
    SMs, finish soonest (balancing each as if it ran alone gives each the whole GPU: together
    they then take two waves on some SMs)."""
    import dataclasses
    best, best_key = None, None
    warps = NUM_THREADS // 32
    for r in range(8, max_rows + 1, 8):
        if any(straddles(c, r) for c in configs):
            continue
        try:
            cands = [GemvBlock(dataclasses.replace(c, rows_per_tile=r, chunk_k=0)) for c in configs]
        except UnsupportedConfigError:
            continue
        if any(b.accumulators > (MMA_ACCUMULATORS if b.use_mma else MAX_ACCUMULATORS) for b in cands) and r > warps:
            continue
        per_tile = max(b.nw * r * b.config.k * b.wbytes for b in cands) + TILE_OVERHEAD_BYTES
        key = (-(-sum(b.num_tiles() for b in cands) // num_sms) * per_tile, -r)
        if best_key is None or key < best_key:
            best, best_key = [b.config for b in cands], key
    if best is None:
        raise UnsupportedConfigError(f"gemv: no legal rows_per_tile <= {max_rows} for {configs}")
    return best


def fill_stage(config: GemvConfig, stage_bytes: int) -> GemvConfig:
    """`config` with the widest legal chunk_k whose chunk fits `stage_bytes` (at least its own
    auto chunk). Inside a megakernel every ring stage is as large as the largest chunk of any
    streaming block (`ring_geometry`), so a block with smaller chunks leaves part of each stage
    empty - fewer of its bytes in flight and fewer independent rows per lane in its consumer.
    Measured on the H200 (one-launch fp8 stack, gate/up chunks 16.9 KB in 33.9 KB stages ->
    33.3 KB): L=8 I=2048 55.5% -> 58.3-58.6% of copy, L=4 I=18432 76.4% -> 79.4%; bf16 L=8 I=2048
    75.6% -> 75.7%. CUDA-core tiles only: the tensor-core consumer lost with the wider chunk
    (fp8 stack at batch 8: 35.1% -> 31.7%), so MMA tiles keep their auto chunk."""
    import dataclasses
    best = GemvBlock(dataclasses.replace(config, chunk_k=0))
    if best.use_mma:
        return best.config
    for kc in (4096, 2048, 1024, 512, 256):
        if kc <= best.chunk_k or config.k % kc:
            continue
        try:
            cand = GemvBlock(dataclasses.replace(config, chunk_k=kc))
        except UnsupportedConfigError:
            continue
        if cand.chunk_bytes() <= stage_bytes:
            return cand.config
    return best.config


STANDALONE_BALANCE_MAX = 1.05       # standalone_rows: the busiest SM's tiles / the mean, at most


def standalone_rows(config: GemvConfig, num_sms: int = 132) -> GemvConfig:
    """`config` with rows_per_tile = the fewest rows (a multiple of 8, legal) whose chunk holds
    CHUNK_TARGET_BYTES of weights with the tiles still spread within STANDALONE_BALANCE_MAX over
    `num_sms` SMs; else the fewest legal rows. A ring chunk has a fixed cost (its wait and barriers)
    beside its bytes: measured on the H200 (2026-12-05, fp8 18432x7168 at batch 1, CUDA cores),
    8 rows (8 KB chunks: K = 7168 takes 1024-column chunks at most) 65.5% of copy, 16 rows (16 KB)
    90.2%, 32 rows with 1024-column chunks 91.2%. bf16 reaches the target at 8 rows (96.2%). Then,
    at batch 1 unless chunk_k is given, one whole-K chunk a tile where it fits CHUNK_MAX_BYTES (x
    staged once a tile): bf16 7168x2048 83.6 -> 85.4% (2026-12-05), 82.4-83.7 -> 84.5% (2026-12-03). The
    tensor-core tile (batch 8+) keeps 8 rows and its own chunks."""
    import dataclasses
    legal = []
    for r in range(8, 129, 8):
        if straddles(config, r):
            continue
        try:
            legal.append(GemvBlock(dataclasses.replace(config, rows_per_tile=r)))
        except UnsupportedConfigError:
            continue
    if not legal:        # the config itself is wrong: the check's own error, at 8 rows
        GemvBlock(dataclasses.replace(config, rows_per_tile=8))
        raise UnsupportedConfigError(f"gemv: no legal rows_per_tile <= 128 for {config}")
    if legal[0].use_mma:            # the tensor-core tile's chunks follow its own rules: 8 rows, as measured
        return legal[0].config
    pick = next((b for b in legal if b.nw * b.config.rows_per_tile * b.chunk_k * b.wbytes >= CHUNK_TARGET_BYTES
                 and b.tile_balance(num_sms) <= STANDALONE_BALANCE_MAX), legal[0])
    if config.chunk_k == 0 and config.m == 1 and pick.chunk_k < config.k \
            and pick.nw * pick.config.rows_per_tile * config.k * pick.wbytes <= CHUNK_MAX_BYTES:
        try:
            return GemvBlock(dataclasses.replace(pick.config, chunk_k=config.k)).config
        except UnsupportedConfigError:
            pass
    return pick.config


class GemvBlock(Block):
    name = "gemv"
    Config = GemvConfig

    def __init__(self, config: GemvConfig):
        if isinstance(config, GemvConfig) and config.rows_per_tile == 0:
            config = standalone_rows(config)
        super().__init__(config)

    # -- static facts --------------------------------------------------------------------------
    @property
    def elems_per_load(self) -> int:
        return {"fp8_e4m3": 16, "bf16": 8, "fp32": 4}[self.config.weight_dtype]

    @property
    def nw(self) -> int:
        return 2 if self.config.swiglu else 1

    @property
    def use_mma(self) -> bool:
        """Tensor cores from MMA_MIN_M tokens (bf16 or fp8 weights; not fp32, the routers).
        Measured on the H200: the MLP stack at batch 8 went from 513 to 314 us (x0.82 -> x1.34
        the CUDA graph), batch 64 from 4141 to 1025 us; but the fp8 GEMV at batch 1 went from
        61% to 41% of the bandwidth, so below MMA_MIN_M the CUDA cores stay (`mma=True` forces
        the MMA)."""
        c = self.config
        if c.weight_dtype == "fp32":
            return False
        if c.mma is not None:
            return bool(c.mma)
        return c.m >= MMA_MIN_M

    @property
    def mma_tiles(self) -> tuple[int, int]:
        """(m16 tiles over the rows, n8 tiles over the tokens) of the MMA path."""
        return -(-self.config.rows_per_tile // 16), -(-self.config.m // 8)

    @property
    def accumulators(self) -> int:
        """fp32 accumulators per thread: rows per warp x weights x tokens (CUDA cores), or 4 per
        (weight, m16 tile, n8 tile) fragment (MMA)."""
        c = self.config
        if self.use_mma:
            mt, nt = self.mma_tiles
            return self.nw * mt * nt * 4
        if self.wgmma:
            return self.nw * c.rows_per_tile // 4
        return c.rows_per_tile // (NUM_THREADS // 32) * self.nw * c.m

    @property
    def wbytes(self) -> int:
        return {"fp8_e4m3": 1, "bf16": 2, "fp32": 4}[self.config.weight_dtype]

    @property
    def chunk_k(self) -> int:
        c = self.config
        if c.chunk_k:
            return c.chunk_k
        # the widest chunk within CHUNK_TARGET_BYTES, preferring the fewest x re-stagings per tile;
        # tall tiles (many rows) take the narrowest legal chunk up to CHUNK_MAX_BYTES instead
        E = self.elems_per_load
        best, best_key = 0, None
        for limit in (CHUNK_TARGET_BYTES, CHUNK_MAX_BYTES):
            for kc in (2048, 1024, 512, 256):
                if c.k % kc == 0 and kc % (32 * E) == 0 and self.nw * c.rows_per_tile * kc * self.wbytes <= limit \
                        and (c.weight_dtype != "fp8_e4m3" or kc % 512 == 0) and self._mma_chunk_ok(kc):
                    kx = self._x_block(kc)
                    key = (kx, kc)
                    if kx and (best_key is None or key > best_key):
                        best, best_key = kc, key
            if best:
                return best
        return best

    def _mma_chunk_ok(self, kc: int) -> bool:
        """MMA: each of the 8 warps takes whole k16 blocks of the chunk (kc % 128 == 0); with fp8,
        a warp's share lies inside one 128-wide scale block (kc <= 1024)."""
        if not self.use_mma:
            return True
        return kc % 128 == 0 and (self.config.weight_dtype != "fp8_e4m3" or kc <= 1024)

    def _x_block(self, kc: int) -> int:
        c = self.config
        best = 0
        for mult in range(1, c.k // kc + 1):
            kx = mult * kc
            if c.k % kx == 0 and self._x_row_bytes(kx) <= X_SMEM_MAX:
                best = kx
        return best

    def _x_row_bytes(self, kx: int) -> int:
        """Shared memory of kx staged columns of x: M rows of bf16 (f16), or (wgmma) one 8-row
        core-matrix column block of e4m3 pieces."""
        return 8 * kx if self.wgmma else self.config.m * kx * 2

    @property
    def wgmma(self) -> bool:
        """fp8 weights through warpgroup MMAs straight from the ring (fp8_decode="wgmma")."""
        c = self.config
        return c.weight_dtype == "fp8_e4m3" and not self.use_mma and c.fp8_decode == "wgmma"

    @property
    def x_pieces(self) -> int:
        """wgmma: e4m3 pieces per token of the staged x (x * scale = p0 + p1 / 16 + p2 / 256:
        3 pieces keep 2^-12 of each value, 2 pieces 2^-8); tokens x pieces <= 8 rows."""
        return 3 if 3 * self.config.m <= 8 else 2

    @property
    def x_block(self) -> int:
        """Columns of x staged in smem at a time: the largest multiple of chunk_k dividing K
        whose M x cols bf16 fit X_SMEM_MAX."""
        return self._x_block(self.chunk_k) if self.chunk_k else 0

    def check(self):
        c = self.config
        if c.weight_dtype not in ("bf16", "fp8_e4m3", "fp32"):
            self.unsupported(f"gemv: weight dtype {c.weight_dtype!r} (supported: bf16, fp8_e4m3, fp32)")
        if c.out_dtype not in ("bf16", "fp32"):
            self.unsupported(f"gemv: out dtype {c.out_dtype!r} (supported: bf16, fp32)")
        if c.x_dtype not in ("bf16", "fp32"):
            self.unsupported(f"gemv: x dtype {c.x_dtype!r} (supported: bf16, fp32)")
        if c.residual not in (None, "bf16", "fp32"):
            self.unsupported(f"gemv: residual {c.residual!r} (supported: None, bf16, fp32)")
        if not 1 <= c.m <= 64:
            self.unsupported(f"gemv: m={c.m} tokens (supported: 1..64)")
        if c.rows_per_tile % (NUM_THREADS // 32) or c.rows_per_tile <= 0:
            self.unsupported(f"gemv: rows_per_tile={c.rows_per_tile} must be a multiple of the "
                             f"{NUM_THREADS // 32} warps")
        if c.n % c.rows_per_tile:
            self.unsupported(f"gemv: n={c.n} must be a multiple of rows_per_tile={c.rows_per_tile}")
        if c.k % 8:
            self.unsupported(f"gemv: k={c.k} must be a multiple of 8")
        if c.groups < 1 or c.n % c.groups or (c.n // c.groups) % c.rows_per_tile:
            self.unsupported(f"gemv: groups={c.groups} must cut n={c.n} into whole tiles of "
                             f"rows_per_tile={c.rows_per_tile}")
        if c.groups > 1 and (c.norm or c.swiglu):
            self.unsupported("gemv: groups > 1 takes neither the fused norm nor swiglu")
        kc = self.chunk_k
        E = self.elems_per_load
        if not kc or c.k % kc or kc % (32 * E):
            self.unsupported(f"gemv: no chunk width for k={c.k} (chunk_k={c.chunk_k}): it must divide k "
                             f"and be a multiple of {32 * E} (every lane reads whole 16-byte units)")
        if c.weight_dtype == "fp8_e4m3":
            if c.n % c.scale_block or c.k % 512 or kc % 512:
                self.unsupported(f"gemv fp8: n={c.n} must be a multiple of {c.scale_block}, k={c.k} and "
                                 f"chunk_k={kc} of 512 (the 128-wide scales are copied 4 at a time)")
            if straddles(c, c.rows_per_tile) and (not self.hfma2 or c.rows_per_tile > c.scale_block):
                self.unsupported(f"gemv fp8: rows_per_tile={c.rows_per_tile} must divide the "
                                 f"{c.scale_block}-row scale block (tiles that straddle two blocks: "
                                 f"the CUDA-core hfma2 consumer only)")
        if not self.x_block:
            self.unsupported(f"gemv: m={c.m} x chunk_k={kc} bf16 activations exceed {X_SMEM_MAX} B of smem")
        if c.swiglu_limit is not None and not c.swiglu:
            self.unsupported("gemv: swiglu_limit without swiglu")
        if c.activation not in ("silu", "situ") or (c.activation != "silu" and not c.swiglu):
            self.unsupported(f"gemv: activation {c.activation!r} (supported: silu, situ; the swiglu epilogue's)")
        if c.fp8_decode not in FP8_DECODES:
            self.unsupported(f"gemv: fp8_decode {c.fp8_decode!r} (supported: {', '.join(FP8_DECODES)})")
        if self.wgmma:
            if c.m > WGMMA_MAX_M:
                self.unsupported(f"gemv fp8_decode=wgmma: m={c.m} tokens (at most {WGMMA_MAX_M}; from "
                                 f"{MMA_MIN_M} the mma.sync path)")
            # the wgmma's N = nw x rows_per_tile <= 2 x 128 (rows_per_tile divides the scale block)
        if c.mma and c.weight_dtype == "fp32":
            self.unsupported("gemv: the MMA path takes bf16 or fp8 weights, not fp32")
        if self.use_mma and not self._mma_chunk_ok(kc):
            self.unsupported(f"gemv MMA: chunk_k={kc} must be a multiple of 128 (and <= 1024 for fp8)")
        if c.warp_ring and self.warp_ring_refusal():
            self.unsupported(self.warp_ring_refusal())

    def warp_ring_refusal(self) -> str | None:
        """Why this GEMV cannot lay its chunks out in warp slices (GemvConfig.warp_ring), or None."""
        c = self.config
        if self.use_mma or self.wgmma:
            return ("gemv warp_ring: the CUDA-core consumers only (each warp reads its own rows; the "
                    "MMA paths split K across warps)")
        if self.x_block != c.k or c.groups > 1:
            return (f"gemv warp_ring: the whole x staged once per tile (m={c.m} x k={c.k} must fit "
                    f"{X_SMEM_MAX} B of smem; no groups): x re-staged between chunks needs the CTA barriers")
        return None

    def operand_specs(self):
        c = self.config
        w, sc = c.weight_dtype, (c.n // c.scale_block, c.k // c.scale_block)
        specs = []
        names = ("w_gate", "w_up") if c.swiglu else ("w",)
        for name in names:
            specs.append(OperandSpec(name, (c.n, c.k), w))
        if c.weight_dtype == "fp8_e4m3":
            for name in names:
                specs.append(OperandSpec(name + "_scale", sc, "fp32"))
        specs.append(OperandSpec("x", (c.m, c.groups * c.k), c.x_dtype))
        if c.norm:
            specs.append(OperandSpec("norm_weight", (c.k,), "bf16"))
        if c.residual:
            specs.append(OperandSpec("res", (c.m, c.n), c.residual))
        specs.append(OperandSpec("y", (c.m, c.n), c.out_dtype, output=True))
        return specs

    def num_tiles(self) -> int:
        return self.config.n // self.config.rows_per_tile

    def tile_balance(self, num_sms: int = 132) -> float:
        """Most tiles on one SM / mean tiles per SM over all `num_sms` SMs (idle ones count):
        1.0 is even; the op's time is this much over a perfect spread of its rows. The standalone
        kernel deals tile t to CTA t % grid, and the megakernel's list scheduling spreads one op's
        equal tiles the same way, so the busiest SM runs ceil(tiles / SMs). Rows per tile 8 (the
        bf16 default) puts 7168 / 4096 / 18432 rows at 1.031 on 132 SMs (7 / 4 / 18 tiles on the
        busiest SM); 16 rows would put 7168 at 1.179 (448 tiles: 4 on some SMs, 3.39 mean)."""
        t = self.num_tiles()
        return -(-t // num_sms) * num_sms / t

    # -- the smem ring ---------------------------------------------------------------------------
    def stream_chunks(self) -> int:
        return self.config.k // self.chunk_k

    @property
    def scale_units(self) -> int:
        """16-byte units of fp32 scales per weight per chunk (fp8 only)."""
        return self.chunk_k // 512 if self.config.weight_dtype == "fp8_e4m3" else 0

    @property
    def pitch_units(self) -> int:
        # one pad unit per row (rows start on different banks); wgmma: none (core matrices)
        return self.chunk_k // self.elems_per_load + (0 if self.wgmma else 1)

    @property
    def scale_rows(self) -> int:
        """fp8: the 128-row scale blocks one tile's rows may touch - 1 when rows_per_tile divides
        the block, else 2 (a straddling tile: the hfma2 consumer only, opt-in)."""
        return 2 if straddles(self.config, self.config.rows_per_tile) else 1

    def chunk_bytes(self) -> int:
        if self.config.warp_ring:
            return (NUM_THREADS // 32) * self.slice_bytes()
        return 16 * (self.nw * self.config.rows_per_tile * self.pitch_units
                     + self.nw * self.scale_units * self.scale_rows)

    def slice_bytes(self) -> int:
        """warp_ring: one warp's share of a chunk - its rows' units, unpadded (a warp's 16-byte
        reads of one row are 512 contiguous bytes), then its own copy of the fp8 scales."""
        rw = self.config.rows_per_tile // (NUM_THREADS // 32)
        return 16 * (self.nw * rw * (self.chunk_k // self.elems_per_load) + self.nw * self.scale_units * self.scale_rows)

    def warp_ring(self) -> bool:
        return self.config.warp_ring

    def x_smem_bytes(self) -> int:
        # hfma2: the staged block's per-token scales (fp32) follow it; wgmma: 16 bytes of them,
        # then the two warpgroups' sums [warpgroup][8 piece rows][nw * R] fp32
        if self.wgmma:
            return self._x_row_bytes(self.x_block) + 16 + 2 * 8 * self.nw * self.config.rows_per_tile * 4
        return self.config.m * self.x_block * 2 + self.red_smem_bytes() + (4 * self.config.m if self.hfma2 else 0)

    @property
    def hfma2(self) -> bool:
        """fp8 on the CUDA cores with packed f16 FMAs (fp8_decode "hfma2" or "hfma2_alu")."""
        c = self.config
        return c.weight_dtype == "fp8_e4m3" and not self.use_mma and c.fp8_decode in ("hfma2", "hfma2_alu")

    def red_smem_bytes(self) -> int:
        """MMA path: the cross-warp sums [weight][token n8-padded][row m16-padded] fp32, after x."""
        if not self.use_mma:
            return 0
        mt, nt = self.mma_tiles
        return self.nw * nt * 8 * mt * 16 * 4

    def cost(self) -> Cost:
        c = self.config
        nw = self.nw
        obytes = 2 if c.out_dtype == "bf16" else 4
        xbytes = 2 if c.x_dtype == "bf16" else 4
        r = c.rows_per_tile
        b = nw * r * c.k * self.wbytes + c.m * c.k * xbytes + c.m * r * obytes     # (a group's x)
        if c.weight_dtype == "fp8_e4m3":
            b += nw * max(1, r // c.scale_block) * (c.k // c.scale_block) * 4
        if c.residual:
            b += c.m * r * (2 if c.residual == "bf16" else 4)
        return Cost(bytes=b, flops=2 * nw * r * c.k * c.m)

    def weight_bytes(self) -> int:
        """Bytes of all weights (and scales) of the whole op: the GEMV's bandwidth floor."""
        c = self.config
        b = self.nw * c.n * c.k * self.wbytes
        if c.weight_dtype == "fp8_e4m3":
            b += self.nw * (c.n // c.scale_block) * (c.k // c.scale_block) * 4
        return b

    # -- torch faces ---------------------------------------------------------------------------
    def dequant(self, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        w = w.float()
        if scale is None:
            return w
        b = self.config.scale_block
        return w * scale.float().repeat_interleave(b, 0).repeat_interleave(b, 1)

    def _x(self, t) -> torch.Tensor:
        """The activations as the device uses them: (normalised,) rounded to bf16, in fp32."""
        c = self.config
        x = t["x"].float()
        if c.norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * t["norm_weight"].float()
        return x.to(torch.bfloat16).float()

    def reference(self, **t) -> dict[str, torch.Tensor]:
        c = self.config
        x = t["x"].float()
        if c.norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * t["norm_weight"].float()
        if c.swiglu:
            g = x @ self.dequant(t["w_gate"], t.get("w_gate_scale")).T
            u = x @ self.dequant(t["w_up"], t.get("w_up_scale")).T
            y = swiglu_ref(g, u, c.activation, c.swiglu_limit, c.situ_beta, c.situ_linear_beta)
        elif c.groups > 1:
            w = self.dequant(t["w"], t.get("w_scale")).view(c.groups, c.n // c.groups, c.k)
            y = torch.einsum("mgk,gnk->mgn", x.view(c.m, c.groups, c.k), w).reshape(c.m, c.n)
        else:
            y = x @ self.dequant(t["w"], t.get("w_scale")).T
        if c.residual:
            y = t["res"].float() + y
        return {"y": y}

    def emulate_tile(self, t: dict[str, torch.Tensor], tile: int) -> None:
        c = self.config
        rows = slice(tile * c.rows_per_tile, (tile + 1) * c.rows_per_tile)
        g = tile * c.rows_per_tile // (c.n // c.groups)        # the tile's group: its x columns
        x = self._x(t)[:, g * c.k:(g + 1) * c.k]

        def part(name):
            w = t[name][rows].float()
            s = t.get(name + "_scale")
            if s is not None:
                b = c.scale_block
                w = w * s.float().repeat_interleave(b, 0)[rows].repeat_interleave(b, 1)
            return x @ w.T

        if c.swiglu:
            y = swiglu_ref(part("w_gate"), part("w_up"), c.activation, c.swiglu_limit, c.situ_beta,
                           c.situ_linear_beta)
        else:
            y = part("w")
        if c.residual:
            y = t["res"][:, rows].float() + y
        t["y"][:, rows] = y.to(t["y"].dtype)

    # -- device faces --------------------------------------------------------------------------
    def _build_device_stream(self) -> StreamFaces:
        import cutlass
        import cutlass.cute as cute
        from cutlass import BFloat16, Float32, Int32
        from cutlass.cute.nvgpu import cpasync

        from cutlass import Int64

        from ._cute import (DTYPE_MAP, bits_to_f32, block_sum_multi, cp_async_16_hinted, e4m3_piece,
                            e4m3x4_to_f16x2x2, e4m3x4_to_f16x2x2_shifted, f16x2_sum_f32, f32_bits,
                            fence_proxy_async_smem, fma_f16x2, gmem_tensor, l2_evict_first_policy, mma_m16n8k16,
                            mul_f16x2, producer_slot, smem_tensor, swiglu_act, tree_sum, wgmma_fp8_sync)

        c = self.config
        NT, NWARP = NUM_THREADS, NUM_THREADS // 32
        E = self.elems_per_load                 # weight elements per 16-byte unit
        M, K, N, R = c.m, c.k, c.n, c.rows_per_tile
        RW = R // NWARP                         # rows per warp (per weight)
        nw = self.nw
        KC = self.chunk_k
        KCU = KC // E                           # 16-byte weight units per row per chunk
        PITCH = self.pitch_units
        WU = nw * R * PITCH                     # weight units in a stage
        WR = c.warp_ring                        # warp slices: the faces get this warp's slice
        WSL = nw * RW * KCU                     # warp_ring: weight units in a slice
        S_OFF = 16 * (WSL if WR else WU)        # fp8: the scales' offset in a stage (a slice)

        def srow(warp, rr):
            """The stage row of this warp's rr-th row: its slice's rr-th (warp_ring), or the
            stage's warp + 8 rr."""
            return rr if WR else warp + NWARP * rr
        SU = self.scale_units
        SRB = self.scale_rows                   # fp8: the scale blocks a tile's rows touch (1 or 2)
        KX = self.x_block
        CPX = KX // KC                          # chunks per staged x block
        XU = KX // 8                            # bf16 x units (8 elements) per token per x block
        fp8 = c.weight_dtype == "fp8_e4m3"
        SB = c.scale_block
        wdt = DTYPE_MAP[c.weight_dtype]
        odt = DTYPE_MAP[c.out_dtype]
        xdt = DTYPE_MAP[c.x_dtype]
        rdt = DTYPE_MAP[c.residual] if c.residual else None
        swiglu, limit, norm, eps = c.swiglu, c.swiglu_limit, c.norm, c.norm_eps
        act, betas = c.activation, (c.situ_beta, c.situ_linear_beta)
        # operand-table positions
        i_w = list(range(nw))
        i_s = list(range(nw, 2 * nw)) if fp8 else []
        i_x = nw * (2 if fp8 else 1)
        i_nw = i_x + 1 if norm else -1
        i_res = i_x + 1 + int(norm) if c.residual else -1
        i_y = i_x + 1 + int(norm) + int(bool(c.residual))
        XV = 16 // (2 if c.x_dtype == "bf16" else 4)   # x elements per 16-byte load (norm pass)
        NP = PRODUCER_THREADS
        NPW = NP // 32                          # producer warps
        XE = min(E, 8)                          # x elements per smem load in consume
        PD = max(1, E // 4)                     # partial sums per 16-byte unit (a power of 2)
        whole_x = CPX == self.stream_chunks()   # x staged once per tile (at chunk 0): reusable
        G = c.groups                            # grouped: tile t reads x's columns of its group
        GN = N // G                             # output rows of a group
        wg = self.wgmma
        merged_norm = norm and whole_x and M <= MERGED_NORM_MAX_M and not wg
        pre_res = c.residual is not None and RW * M <= 16   # residual prefetched in registers
        # the MMA path (see _mma_faces' comments in consume_mma / end_mma)
        mma = self.use_mma
        MT, NTN = self.mma_tiles
        KBW = KC // 128                         # k16 blocks per warp per chunk
        XBYTES = self._x_row_bytes(KX)          # staged x, then the cross-warp sums
        RED_WORDS = self.red_smem_bytes() // 4
        EPI = -(-(R * M) // NT) if (mma or wg) else 0   # epilogue outputs per thread
        # fp8_decode="hfma2" (CUDA cores): e4m3x2 -> f16x2 (one conversion per 2 weights), products
        # as packed f16 FMAs (fma.rn.f16x2) in 2 chains of 4 per 16-byte unit, each chain's f16x2
        # then widened to fp32 and summed there: ~1.5 instructions per weight instead of the "cvt"
        # path's ~4 (e4m3 -> f16 -> f32 per weight, then an fp32 FMA; Nsight Compute: 7.2 issued per
        # weight, H200 2026-12-03). Each staged x block is scaled per token by a power of two that
        # puts its largest |x| in [8, 16) (x_scale): |e4m3| <= 448, so a product is < 7168 and a
        # 4-term f16 sum < 28672 < 65504, whatever the activations' range; the block's inverse
        # scales follow it in smem and multiply each unit's fp32 sum. Each f16 product / partial
        # sum rounds at 2^-11 relative (bf16 outputs round at 2^-8).
        hfma2 = self.hfma2
        # fp8_decode="hfma2_alu" (opt-in): hfma2 with the e4m3 -> f16 step in integer ops
        # (e4m3x4_to_f16x2x2_shifted: 7 ALU ops per 4 weights, fixed latency) instead of F2FP,
        # whose variable latency was a candidate for the fp8 tile's short-scoreboard stalls
        # (Nsight Compute: 40% of its 5.2 cycles between issues, H200 2026-12-03). Measured (H100,
        # 2026-12-06): 25% slower with the weights hot in the L2, and half the words each way
        # (removed) 21% slower there: F2FP is not what bounds the consumer. Its pairs are
        # bytes (0, 2) and (1, 3), so x is staged with elements 1 and 2 of every 4 swapped
        # (x_order), and its weights come out * 2^-8: x is staged * 2^8 more (X_BOOST), the same
        # products as hfma2's, and the inverse scale stays 2^-s.
        alu = hfma2 and c.fp8_decode == "hfma2_alu"
        X_BOOST = 256.0 if alu else 1.0
        SXT = cutlass.Float16 if (fp8 and (mma or hfma2)) else BFloat16   # staged x: the MMA's B type
        # fp8_decode="int" (CUDA cores): e4m3 bits placed into bf16 bits - sign to bit 15, the
        # other 7 bits to 4..10 - read as bf16 that is the e4m3 value * 2^-120 exactly (subnormals
        # too), and bf16 -> fp32 is a shift: no conversion instruction (F2F is quarter rate: the
        # "cvt" path's limit). x is staged * 2^64 so the products stay in fp32's normal range; the
        # chunk scale takes the 2^(120 - 64) back.
        int_fp8 = fp8 and not mma and c.fp8_decode == "int"
        X_PRESCALE = 2.0 ** 64 if int_fp8 else 1.0
        INT_FP8_UNSCALE = 2.0 ** 56
        mma_kind = "f16" if fp8 else "bf16"
        # fp8_decode="wgmma" (Hopper): per 128-wide K block, a warpgroup wgmma m64nNk32 x 4 with
        # the tile's nw x R weight rows as N (B, K-major, read from the ring stage, which the
        # producer lays out as 8-row x 16-byte core matrices: [row / 8][16-byte unit][row % 8])
        # and the staged x as A: the e4m3 pieces of every token (row m P + p: x * 2^s = sum_p
        # piece_p 16^-p) in ONE 8-row core-matrix block whose descriptor repeats it over the
        # 64 rows (stride 0). The block's fp32 sums are then scaled (weight block scale x the
        # piece's 16^-p x the token's 2^-s) into registers: the FP8 tensor core's own
        # accumulation is kept to 128 products, the DeepSeek-V3 promotion interval. The two
        # warpgroups take alternate halves of each chunk's K blocks; warp 0 of each holds the
        # useful rows (D row g = lane / 4 < M P), and end_wgmma adds the two in shared memory.
        # (Warpgroup 0 running every wgmma with warpgroup 1 alone issuing the copies measured
        # the same on the H200: not kept.)
        PX = self.x_pieces if wg else 1
        NC = nw * R                             # the wgmma's N
        KB = KC // 128                          # 128-wide K blocks per chunk
        KBG = KB // 2                           # ... per warpgroup
        GB = max(1, min(KBG, WGMMA_REGS // (NC // 2))) if wg else 1   # blocks per asm statement
        while KBG % GB:
            GB -= 1
        DESC_A_HI = (128 >> 4) << 16            # LBO 128 B (next 16 K bytes), SBO 0: rows repeat
        DESC_B_HI = ((128 >> 4) << 16) | (((KCU * 128) >> 4) << 32)   # SBO: the next 8 weight rows
        RED_OFF = XBYTES + 16                   # wgmma: the warpgroups' sums, after the x scales

        EVICT_FIRST = WEIGHT_EVICT_FIRST and not WR and not wg

        @cute.jit
        def issue(ptrs, t: Int32, ch: Int32, stage_addr):
            p = producer_slot()
            if cutlass.const_expr(EVICT_FIRST):
                policy = l2_evict_first_policy()
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                       wdt, num_bits_per_copy=128)
            sW = smem_tensor(stage_addr, wdt, (nw, R, PITCH, E))
            sW8 = smem_tensor(stage_addr, wdt, (nw * R // 8, KCU, 8, E))     # wgmma: core matrices
            for i in cutlass.range_constexpr(nw):
                mW = gmem_tensor(ptrs[i_w[i]], wdt, (N, K // E, E), 16)
                if cutlass.const_expr(WR):
                    # warp w copies the units its lanes read (rows w, w + 8, ..., lane l units l,
                    # l + 32, ...) into its slice; lane 1 of warp 0 also copies lane 0's: thread 0
                    # releases the signals, and keeps no cp.async in flight (module docstring of
                    # sdk/blocks/base.py)
                    tid, _, _ = cute.arch.thread_idx()
                    lane = tid % 32
                    warp = tid // 32
                    sWs = smem_tensor(stage_addr, wdt, (nw, RW, KCU, E))
                    for b in cutlass.range_constexpr(RW):
                        row = t * R + warp + NWARP * b
                        for a in cutlass.range_constexpr(KCU // 32):
                            if tid != 0:
                                cute.copy(atom, mW[row, ch * KCU + lane + 32 * a, None], sWs[i, b, lane + 32 * a, None])
                            if tid == 1:
                                cute.copy(atom, mW[row, ch * KCU + 32 * a, None], sWs[i, b, 32 * a, None])
                elif cutlass.const_expr(wg):
                    for j in cutlass.range_constexpr(-(-(R * KCU) // NP)):
                        u = p + NP * j
                        if (p >= 0) & (u < R * KCU):
                            # 8 consecutive lanes take rows 0..7 of one unit: their 16-byte
                            # writes fill one 128-byte core-matrix row of banks (no conflict);
                            # 4 units per row per warp: 64 contiguous bytes of each row read
                            rl = u % 8
                            q4 = u // 32
                            cu = 4 * (q4 % (KCU // 4)) + (u // 8) % 4
                            rg = q4 // (KCU // 4)
                            cute.copy(atom, mW[t * R + 8 * rg + rl, ch * KCU + cu, None],
                                      sW8[i * (R // 8) + rg, cu, rl, None])
                else:
                    # producer warp pw copies rows pw, pw + NPW, ..., its lane l units l, l + 32,
                    # ... of each: every copy's addresses are this thread's first ones plus a
                    # constant (one row or 32 units on), and the guard is warp-uniform. (A unit
                    # index p + NP j cut into row and column per copy took ~12 instructions and a
                    # branch each - as many as the fp8 consumer's own per chunk; H100, 2026-12-06:
                    # fp8 stack L=8 I=2048 68.2-68.3% -> 70.9-71.2% of the copy floor, I=18432
                    # 89.1-89.3 -> 90.2-90.4%, bf16 84.6-84.8 -> 85.0-85.2%.)
                    pw = p // 32
                    pl = p - 32 * pw
                    for b in cutlass.range_constexpr(-(-R // NPW)):
                        prow = pw + NPW * b
                        if (p >= 0) & (prow < R):
                            for a in cutlass.range_constexpr(KCU // 32):
                                if cutlass.const_expr(EVICT_FIRST):
                                    # the same copy by address, its L2 lines marked evict-first
                                    dst = stage_addr + ((i * R + prow) * PITCH + pl + 32 * a) * 16
                                    src = ptrs[i_w[i]] + (Int64(t * R + prow) * (K // E) + ch * KCU + pl + 32 * a) * 16
                                    cp_async_16_hinted(dst, src, policy)
                                else:
                                    cute.copy(atom, mW[t * R + prow, ch * KCU + pl + 32 * a, None],
                                              sW[i, prow, pl + 32 * a, None])
            if cutlass.const_expr(fp8):
                satom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                            Float32, num_bits_per_copy=128)
                sS = smem_tensor(stage_addr + S_OFF, Float32, (nw, SRB, SU, 4))
                q = p                           # the scale unit this thread copies, if < SU
                if cutlass.const_expr(WR):
                    q = cute.arch.lane_idx() - 1    # every warp its own copy, by lanes 1 .. SU
                for i in cutlass.range_constexpr(nw):
                    mS = gmem_tensor(ptrs[i_s[i]], Float32, (N // SB, K // 512, 4), 16)
                    for rb in cutlass.range_constexpr(SRB):
                        # block 1: the tile's last row's (the first block again for the tiles
                        # of a straddling cut that lie inside one block)
                        blk = (t * R) // SB
                        if cutlass.const_expr(rb == 1):
                            blk = (t * R + R - 1) // SB
                        if (q >= 0) & (q < SU):
                            cute.copy(satom, mS[blk, ch * SU + q, None], sS[i, rb, q, None])

        @cute.jit
        def begin(ptrs, t: Int32, sx, scratch, fresh: Int32):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            if cutlass.const_expr(mma):
                acc = cute.make_rmem_tensor((nw, MT, NTN, 4), Float32)
                # zero the cross-warp sums (read by the previous tile's end before the barrier
                # that closed its instruction; read by this tile's end after the chunks' barriers)
                sRed = smem_tensor(sx + XBYTES, Float32, (RED_WORDS,))
                for j in cutlass.range_constexpr(-(-RED_WORDS // NT)):
                    if tid + NT * j < RED_WORDS:
                        sRed[tid + NT * j] = Float32(0.0)
            elif cutlass.const_expr(wg):
                acc = cute.make_rmem_tensor((NC // 4,), Float32)    # D rows g: columns 8j + 2q + v
            else:
                acc = cute.make_rmem_tensor((RW, nw, M), Float32)
            acc.fill(0.0)
            # the residual rows of this tile, loaded now so the epilogue does not wait for them
            if cutlass.const_expr(mma or wg):
                # the residual of the epilogue's outputs of this thread: o = tid + NT * e,
                # token-major (see end_mma)
                resv = cute.make_rmem_tensor((max(EPI, 1),), Float32)
                if cutlass.const_expr(c.residual is not None):
                    mR = gmem_tensor(ptrs[i_res], rdt, (M, N), 2 if c.residual == "bf16" else 4)
                    for e in cutlass.range_constexpr(EPI):
                        o = tid + NT * e
                        if o < R * M:
                            resv[e] = mR[o // R, t * R + o % R].to(Float32)
            else:
                resv = cute.make_rmem_tensor((RW, M), Float32)
            if cutlass.const_expr(pre_res and not (mma or wg)):
                mR = gmem_tensor(ptrs[i_res], rdt, (M, N), 2 if c.residual == "bf16" else 4)
                if lane == 0:
                    for rr in cutlass.range_constexpr(RW):
                        for m in cutlass.range_constexpr(M):
                            resv[rr, m] = mR[m, t * R + warp + NWARP * rr].to(Float32)
            if cutlass.const_expr(norm):
                need = fresh != 0
                if cutlass.const_expr(not whole_x):
                    need = fresh >= 0        # x blocks are re-staged per tile: always
                if need:
                    mXv = gmem_tensor(ptrs[i_x], xdt, (M, K // XV, XV), 16)
                    NU = K // XV
                    NJ = -(-NU // NT)
                    if cutlass.const_expr(merged_norm):
                        # one pass: x and the norm weight into registers (one round trip), the
                        # sums of squares, then x * rstd * w as bf16 straight into sx
                        mNWv = gmem_tensor(ptrs[i_nw], BFloat16, (K // XV, XV), 16)
                        xr = cute.make_rmem_tensor((M, NJ, XV), Float32)
                        wr = cute.make_rmem_tensor((NJ, XV), Float32)
                        for j in cutlass.range_constexpr(NJ):
                            u = tid + NT * j
                            if u < NU:
                                wr[j, None].store(mNWv[u, None].load().to(Float32))
                                for m in cutlass.range_constexpr(M):
                                    xr[m, j, None].store(mXv[m, u, None].load().to(Float32))
                        sums = []
                        for m in cutlass.range_constexpr(M):
                            s_ = Float32(0.0)
                            for j in cutlass.range_constexpr(NJ):
                                if tid + NT * j < NU:
                                    v = xr[m, j, None].load()
                                    s_ = s_ + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                            sums.append(s_)
                        tot = block_sum_multi(sums, scratch)
                        sXv = smem_tensor(sx, SXT, (M, NU, XV))
                        rstds = [cute.math.rsqrt(tot[m] / Float32(K) + Float32(eps), fastmath=False)
                                 for m in range(M)]
                        tscale = [Float32(X_PRESCALE) for _ in range(M)]
                        if cutlass.const_expr(hfma2):
                            # per-token scales of the normalised row (see consume_hfma2)
                            amax = [Float32(0.0) for _ in range(M)]
                            for m in cutlass.range_constexpr(M):
                                for j in cutlass.range_constexpr(NJ):
                                    a = abs_max(xr[m, j, None].load() * rstds[m] * wr[j, None].load())
                                    amax[m] = cute.arch.fmax(amax[m], Float32(cutlass.select_(
                                        tid + NT * j < NU, a, Float32(0.0))))
                            tscale = list(token_scales(amax, scratch, sx, X_BOOST))
                        for m in cutlass.range_constexpr(M):
                            for j in cutlass.range_constexpr(NJ):
                                u = tid + NT * j
                                if u < NU:
                                    sXv[m, u, None].store(x_order(xr[m, j, None].load() * (rstds[m] * tscale[m])
                                                                  * wr[j, None].load()).to(SXT))
                    else:
                        # rstd of every token over the whole row, kept in scratch[STATS_OFFSET + m]
                        sums = []
                        for m in cutlass.range_constexpr(M):
                            s_ = Float32(0.0)
                            for j in cutlass.range_constexpr(NJ):
                                u = tid + NT * j
                                if u < NU:
                                    v = mXv[m, u, None].load().to(Float32)
                                    s_ = s_ + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                            sums.append(s_)
                        tot = block_sum_multi(sums, scratch)
                        if tid == 0:
                            for m in cutlass.range_constexpr(M):
                                scratch[STATS_OFFSET + m] = cute.math.rsqrt(tot[m] / Float32(K) + Float32(eps),
                                                                            fastmath=False)
                        cute.arch.sync_threads()
            if cutlass.const_expr(mma or wg):
                return acc, resv, sx
            return acc, resv

        @cute.jit
        def x_scale(amax: Float32):
            """(2^s, 2^-s) with amax * 2^s in [8, 16) (hfma2's staged x), from amax's exponent bits;
            the scale's biased exponent is clamped to 253 so 2^-s stays a normal fp32 (amax 0)."""
            bits = f32_bits(amax)
            se = Int32(257) - ((bits >> 23) & 255)       # amax in [2^(E-127), 2^(E-126)): * 2^(130-E)
            se = Int32(cutlass.select_(se > 253, Int32(253), se))
            return bits_to_f32(se << 23), bits_to_f32((Int32(254) - se) << 23)

        def x_order(v):
            """A staged x vector (a multiple of 4 elements) in the order the weights' pairs come
            in: hfma2_alu pairs bytes (0, 2) and (1, 3) of every 4, so elements 1 and 2 swap."""
            if cutlass.const_expr(not alu):
                return v
            r = cute.make_rmem_tensor((cute.size(v.shape),), Float32)
            r.store(v)
            o = cute.make_rmem_tensor((cute.size(v.shape),), Float32)
            for e in range(cute.size(v.shape)):              # unrolled at trace time
                o[e] = r[e - e % 4 + (0, 2, 1, 3)[e % 4]]
            return o.load()

        def abs_max(v):
            """max |v_i| of a register vector (fp32)."""
            return cute.arch.fmax(v.reduce(cute.ReductionOp.MAX, Float32(0.0), 0),
                                  (-v).reduce(cute.ReductionOp.MAX, Float32(0.0), 0))

        @cute.jit
        def token_scales(amax, scratch, sx, boost: cutlass.Constexpr = 1.0, undo: cutlass.Constexpr = 1.0):
            """hfma2: every token's scale from the per-thread maxima `amax` [M] of the block being
            staged (block-wide max, all threads get them: a tuple of M scales), times `boost`;
            thread 0 writes the inverses (of the unboosted scale, times `undo`) after the staged
            block (sx + XBYTES), where consume_hfma2 reads them."""
            tot = block_sum_multi(amax, scratch, "max")
            scales = [x_scale(tot[mm]) for mm in range(M)]
            if cutlass.const_expr(boost != 1.0 or undo != 1.0):   # wgmma: max |x| * scale in [128, 256)
                scales = [(sc_[0] * Float32(boost), sc_[1] * Float32(undo)) for sc_ in scales]
            tid, _, _ = cute.arch.thread_idx()
            if tid == 0:
                sInv = smem_tensor(sx + XBYTES, Float32, (M,))
                for mm in cutlass.range_constexpr(M):
                    sInv[mm] = scales[mm][1]
            return tuple(sc_[0] for sc_ in scales)

        def scale_of(scales, m):
            """The scale of (dynamic) token m."""
            sc_m = scales[0]
            for mm in range(1, M):
                sc_m = Float32(cutlass.select_(m == mm, scales[mm], sc_m))
            return sc_m

        @cute.jit
        def x_unit(mX, mNW, scratch, xb, j: cutlass.Constexpr, tid):
            """hfma2 staging: 8-element unit tid + NT j of the x block xb (normalised when the GEMV
            norms); units past the end re-do the last one (same max, same store: no branch)."""
            u = Int32(cutlass.select_(tid + NT * j < M * XU, tid + NT * j, M * XU - 1))
            m = u // XU
            ku = u - m * XU
            v = mX[m, xb * XU + ku, None].load().to(Float32)
            if cutlass.const_expr(norm):
                v = v * scratch[STATS_OFFSET + m] * mNW[xb * XU + ku, None].load().to(Float32)
            return m, ku, v

        NJX = -(-(M * XU) // NT)                # 8-element x units per thread per staged block

        @cute.jit
        def block_scales(mX, mNW, scratch, sx, xb, tid, boost: cutlass.Constexpr, undo: cutlass.Constexpr):
            """The per-token scales of x block xb (hfma2 / wgmma staging): every token's max |x|
            over the block (block-wide), then token_scales (which also stores the inverses)."""
            amax = [Float32(0.0) for _ in range(M)]
            for j in cutlass.range_constexpr(NJX):
                m, _, v = x_unit(mX, mNW, scratch, xb, j, tid)
                a = abs_max(v)
                for mm in cutlass.range_constexpr(M):
                    amax[mm] = cute.arch.fmax(amax[mm], Float32(cutlass.select_(m == mm, a, Float32(0.0))))
            return token_scales(amax, scratch, sx, boost, undo)

        @cute.jit
        def prep(ptrs, t: Int32, ch: Int32, state, sx, scratch, fresh: Int32):
            # stage the next x block (bf16) when chunk ch starts one - unless the whole x is
            # already in sx (staged by the previous tile of this op, or by the merged norm);
            # the previous block's readers finished before the last chunk's closing barrier
            if cutlass.const_expr(wg):
                rv = cute.make_rmem_tensor((8,), Float32)
            if cutlass.const_expr(not merged_norm):
                stage = ch % CPX == 0
                if cutlass.const_expr(whole_x and G == 1):
                    # (grouped: the previous tile's x may be another group's - staged at every
                    # tile's first chunk, as the x blocks of a K too wide to keep)
                    stage = (ch == 0) & (fresh != 0)
                if stage:
                    tid, _, _ = cute.arch.thread_idx()
                    xb = ch // CPX
                    sX = smem_tensor(sx, SXT, (M, XU, 8))
                    mX = gmem_tensor(ptrs[i_x], xdt, (M, K // 8, 8), 16)
                    if cutlass.const_expr(G > 1):
                        # x [M, G K]: this tile's group's K columns, rows G K apart
                        xbytes = 2 if c.x_dtype == "bf16" else 4
                        gx = cute.make_ptr(xdt, ptrs[i_x] + Int64((t * R) // GN) * Int64(K * xbytes),
                                           cute.AddressSpace.gmem, assumed_align=16)
                        mX = cute.make_tensor(gx, cute.make_layout((M, K // 8, 8), stride=(G * K, 8, 1)))
                    if cutlass.const_expr(norm):
                        mNW = gmem_tensor(ptrs[i_nw], BFloat16, (K // 8, 8), 16)
                    if cutlass.const_expr(hfma2):
                        # two passes over the block (x is small, the second read hits L1): the
                        # per-token scales (block_scales), then x * its token's scale
                        mNWh = mNW if cutlass.const_expr(norm) else None
                        scales = block_scales(mX, mNWh, scratch, sx, xb, tid, X_BOOST, 1.0)
                        for j in cutlass.range_constexpr(NJX):
                            m, ku, v = x_unit(mX, mNWh, scratch, xb, j, tid)
                            sX[m, ku, None].store(x_order(v * scale_of(scales, m)).to(SXT))
                    elif cutlass.const_expr(wg):
                        # the per-token scales (max |x| * 2^s in [128, 256)), then each unit of 8
                        # scaled values as PX e4m3 pieces (each the remainder of the last, x 16)
                        # into rows m PX + p of the [16-byte unit][row][4 words] core matrices
                        mNWh = mNW if cutlass.const_expr(norm) else None
                        scales = block_scales(mX, mNWh, scratch, sx, xb, tid, 16.0, 1.0 / 16.0)
                        sXp = smem_tensor(sx, Int32, (KX // 16, 8, 4))
                        for j in cutlass.range_constexpr(NJX):
                            m, ku, v = x_unit(mX, mNWh, scratch, xb, j, tid)
                            rv.store(v * scale_of(scales, m))
                            vals = [rv[e] for e in range(8)]
                            for pc in cutlass.range_constexpr(PX):
                                outs = e4m3_piece(vals)
                                row = m * PX + pc
                                sXp[ku // 2, row, (ku % 2) * 2] = outs[0]
                                sXp[ku // 2, row, (ku % 2) * 2 + 1] = outs[1]
                                vals = [outs[2 + e] * Float32(16.0) for e in range(8)]
                        if cutlass.const_expr(M * PX < 8):      # the core matrix's other rows: 0
                            for j in cutlass.range_constexpr(-(-XU // NT)):
                                ku = tid + NT * j
                                if ku < XU:
                                    for row in cutlass.range_constexpr(M * PX, 8):
                                        sXp[ku // 2, row, (ku % 2) * 2] = Int32(0)
                                        sXp[ku // 2, row, (ku % 2) * 2 + 1] = Int32(0)
                        fence_proxy_async_smem()    # the pieces are read by wgmma (async proxy)
                    else:
                        for j in cutlass.range_constexpr(-(-(M * XU) // NT)):
                            u = tid + NT * j
                            if u < M * XU:
                                m = u // XU
                                ku = u - m * XU
                                v = mX[m, xb * XU + ku, None].load().to(Float32)
                                if cutlass.const_expr(norm):
                                    v = v * scratch[STATS_OFFSET + m] * mNW[xb * XU + ku, None].load().to(Float32)
                                if cutlass.const_expr(int_fp8):
                                    v = v * Float32(X_PRESCALE)
                                sX[m, ku, None].store(v.to(SXT))

        @cute.jit
        def fp8_word_to_f32(w: Int32, wr, i, rr, e0):
            """4 e4m3 (the bytes of w, element e0 + j in byte j) -> wr[i, rr, e0 .. e0+3] as fp32
            values * 2^-120 (see int_fp8): bytes 0 and 2, then 1 and 3, as bf16 pairs."""
            for half in cutlass.range_constexpr(2):
                v = w >> (8 * half)
                pair = ((v & 0x007F007F) << 4) | ((v & 0x00800080) << 8)     # bf16 x2: bytes half, half+2
                wr[i, rr, e0 + half] = bits_to_f32(pair << 16)
                wr[i, rr, e0 + half + 2] = bits_to_f32(pair & -65536)

        @cute.jit
        def consume_hfma2(ptrs, t: Int32, ch: Int32, stage_addr, state, sx):
            acc = state[0]
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            sWw = smem_tensor(stage_addr, Int32, (nw, RW, KCU, 4) if WR else (nw, R, PITCH, 4))   # 16 e4m3
            sXw = smem_tensor(sx, Int32, (M, KX // 8, 4))                  # 4 words = 8 f16 of x
            sInv = smem_tensor(sx + XBYTES, Float32, (M,))                 # per-token x scales, inverted
            xo = (ch % CPX) * (KC // 8)
            sc = cute.make_rmem_tensor((nw, RW), Float32)
            # each of this warp's rows: its scale block among the tile's SRB (0: the first)
            rbs = [Int32(0) for _ in range(RW)]
            if cutlass.const_expr(SRB > 1):
                rbs = [(t * R + warp + NWARP * rr) // SB - (t * R) // SB for rr in range(RW)]
            for cj in cutlass.range_constexpr(KCU // 32):
                cu = lane + 32 * cj
                # the unit's weights as 8 f16x2 pairs (elements 2p, 2p + 1) per row. One 16-byte
                # load per unit: four 4-byte loads of 16-byte-strided lanes hit each bank 4 times
                # (x: 8 loads, 8 times) - the bf16 consumer's loads were already whole units
                wp = [[[None] * 8 for _ in range(RW)] for _ in range(nw)]
                rw = cute.make_rmem_tensor((4,), Int32)
                for i in cutlass.range_constexpr(nw):
                    for rr in cutlass.range_constexpr(RW):
                        rw.store(sWw[i, srow(warp, rr), cu, None].load())
                        for wi in cutlass.range_constexpr(4):
                            if cutlass.const_expr(alu):
                                lo, hi = e4m3x4_to_f16x2x2_shifted(rw[wi])
                            else:
                                lo, hi = e4m3x4_to_f16x2x2(rw[wi])
                            wp[i][rr][2 * wi] = lo
                            wp[i][rr][2 * wi + 1] = hi
                sS = smem_tensor(stage_addr + S_OFF, Float32, (nw, SRB, SU * 4))
                for i in cutlass.range_constexpr(nw):
                    if cutlass.const_expr(SRB > 1):
                        for rr in cutlass.range_constexpr(RW):
                            sc[i, rr] = sS[i, rbs[rr], cu // (SB // E)]
                    else:
                        sc[i, 0] = sS[i, 0, cu // (SB // E)]
                rx = cute.make_rmem_tensor((2, 4), Int32)
                for m in cutlass.range_constexpr(M):
                    for h in cutlass.range_constexpr(2):
                        rx[h, None].store(sXw[m, xo + 2 * cu + h, None].load())
                    xp = [rx[h, q] for h in range(2) for q in range(4)]     # 8 f16x2
                    inv_m = sInv[m]                     # the token's x scale, undone
                    for i in cutlass.range_constexpr(nw):
                        for rr in cutlass.range_constexpr(RW):
                            a0 = mul_f16x2(wp[i][rr][0], xp[0])
                            a1 = mul_f16x2(wp[i][rr][1], xp[1])
                            for p in cutlass.range_constexpr(1, 4):
                                a0 = fma_f16x2(wp[i][rr][2 * p], xp[2 * p], a0)
                                a1 = fma_f16x2(wp[i][rr][2 * p + 1], xp[2 * p + 1], a1)
                            d = f16x2_sum_f32(a0) + f16x2_sum_f32(a1)
                            acc[rr, i, m] = acc[rr, i, m] + d * (sc[i, rr if SRB > 1 else 0] * inv_m)

        @cute.jit
        def consume(ptrs, t: Int32, ch: Int32, stage_addr, state, sx):
            acc = state[0]
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            sW = smem_tensor(stage_addr, wdt, (nw, RW, KCU, E) if WR else (nw, R, PITCH, E))
            sX = smem_tensor(sx, BFloat16, (M, KX // XE, XE))
            xo = (ch % CPX) * (KC // XE)
            wr = cute.make_rmem_tensor((nw, RW, E), Float32)
            xr = cute.make_rmem_tensor((E // XE, XE), Float32)
            sc = cute.make_rmem_tensor((nw,), Float32)
            for cj in cutlass.range_constexpr(KCU // 32):
                cu = lane + 32 * cj
                for i in cutlass.range_constexpr(nw):
                    for rr in cutlass.range_constexpr(RW):
                        if cutlass.const_expr(int_fp8):
                            sWw = smem_tensor(stage_addr, Int32, (nw, RW, KCU, 4) if WR else (nw, R, PITCH, 4))
                            for wi in cutlass.range_constexpr(4):
                                fp8_word_to_f32(sWw[i, srow(warp, rr), cu, wi], wr, i, rr, 4 * wi)
                        else:
                            wr[i, rr, None].store(sW[i, srow(warp, rr), cu, None].load().to(Float32))
                if cutlass.const_expr(fp8):
                    sS = smem_tensor(stage_addr + S_OFF, Float32, (nw, SU * 4))
                    for i in cutlass.range_constexpr(nw):
                        sc[i] = sS[i, cu // (SB // E)]
                        if cutlass.const_expr(int_fp8):
                            sc[i] = sc[i] * Float32(INT_FP8_UNSCALE)
                for m in cutlass.range_constexpr(M):
                    for h in cutlass.range_constexpr(E // XE):
                        xr[h, None].store(sX[m, xo + cu * (E // XE) + h, None].load().to(Float32))
                    for i in cutlass.range_constexpr(nw):
                        for rr in cutlass.range_constexpr(RW):
                            # the unit's E products in PD independent chains of 4, summed at the
                            # end: one chain of 16 dependent FMAs (fp8) stalls on FMA latency
                            part = [Float32(0.0) for _ in range(PD)]
                            for e in cutlass.range_constexpr(E):
                                part[e % PD] = part[e % PD] + wr[i, rr, e] * xr[e // XE, e % XE]
                            d = tree_sum(part)
                            if cutlass.const_expr(fp8):
                                d = d * sc[i]
                            acc[rr, i, m] = acc[rr, i, m] + d

        @cute.jit
        def end(ptrs, t: Int32, state, scratch):
            acc, resv = state
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            mY = gmem_tensor(ptrs[i_y], odt, (M, N), 2 if c.out_dtype == "bf16" else 4)
            for rr in cutlass.range_constexpr(RW):
                row = t * R + warp + NWARP * rr
                for m in cutlass.range_constexpr(M):
                    a = cute.arch.warp_reduction_sum(acc[rr, 0, m])
                    if cutlass.const_expr(swiglu):
                        a = swiglu_act(a, cute.arch.warp_reduction_sum(acc[rr, 1, m]), limit, act, betas)
                    if lane == 0:
                        if cutlass.const_expr(pre_res):
                            a = a + resv[rr, m]
                        elif cutlass.const_expr(rdt is not None):
                            mR = gmem_tensor(ptrs[i_res], rdt, (M, N), 2 if c.residual == "bf16" else 4)
                            a = a + mR[m, row].to(Float32)
                        mY[m, row] = a.to(odt)

        # -- the MMA path: mma.sync m16n8k16 (fp32 accumulate), swap-AB: weight rows are the MMA's
        # M (16 per m-tile), tokens its N (8 per n-tile). The 8 warps split each chunk's K (warp
        # w takes k16 blocks [w KBW, (w+1) KBW)); end_mma sums the warps' partials in smem.
        # K is a reduction, so its order inside a k16 block is free: thread (g = lane // 4,
        # q = lane % 4) holds "logical" k {2q, 2q+1, 2q+8, 2q+9} of the fragment layout, mapped to
        # the PHYSICAL elements 4q .. 4q+3 of the block - one 8-byte smem read per row for A (4
        # bytes for fp8: then two e4m3x2 -> f16x2 conversions) and one per token for B.
        WPR = PITCH * 4                         # 32-bit words per weight row in a stage

        @cute.jit
        def consume_mma(ptrs, t: Int32, ch: Int32, stage_addr, state, sx):
            acc = state[0]
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            q = lane % 4
            sWw = smem_tensor(stage_addr, Int32, (nw, R, WPR))
            sXw = smem_tensor(sx, Int32, (M, KX // 2))
            xo = (ch % CPX) * KC                 # the chunk's first column in the staged x block
            # rows of the fragments (m-tile rows past R, when R % 16 == 8, repeat row R-1) and
            # tokens (past M: token M-1): their sums land in the padding of end_mma's buffer
            rsel = [Int32(cutlass.select_(mt * 16 + 8 * h + g < R, mt * 16 + 8 * h + g, R - 1))
                    for mt in range(MT) for h in range(2)]
            toks = [Int32(cutlass.select_(nt * 8 + g < M, nt * 8 + g, M - 1)) for nt in range(NTN)]
            part = acc
            if cutlass.const_expr(fp8):
                part = cute.make_rmem_tensor((nw, MT, NTN, 4), Float32)
                part.fill(0.0)
            for j in cutlass.range_constexpr(KBW):
                kb = warp * KBW + j
                bf = []
                for nt in cutlass.range_constexpr(NTN):
                    w0 = (xo + kb * 16 + 4 * q) // 2
                    bf.append((sXw[toks[nt], w0], sXw[toks[nt], w0 + 1]))
                for i in cutlass.range_constexpr(nw):
                    for mt in cutlass.range_constexpr(MT):
                        af = []
                        for h in cutlass.range_constexpr(2):          # rows g and g + 8
                            r = rsel[2 * mt + h]
                            if cutlass.const_expr(fp8):
                                lo, hi = e4m3x4_to_f16x2x2(sWw[i, r, kb * 4 + q])
                            else:
                                lo = sWw[i, r, kb * 8 + 2 * q]
                                hi = sWw[i, r, kb * 8 + 2 * q + 1]
                            af.append((lo, hi))
                        a = (af[0][0], af[1][0], af[0][1], af[1][1])
                        for nt in cutlass.range_constexpr(NTN):
                            cf = mma_m16n8k16(mma_kind, a, bf[nt], [part[i, mt, nt, v] for v in range(4)])
                            for v in cutlass.range_constexpr(4):
                                part[i, mt, nt, v] = cf[v]
            if cutlass.const_expr(fp8):
                # the warp's k16 blocks lie in one 128-wide scale block (chunk_k <= 1024)
                sS = smem_tensor(stage_addr + 16 * WU, Float32, (nw, SU * 4))
                for i in cutlass.range_constexpr(nw):
                    sc = sS[i, (warp * KBW * 16) // SB]
                    for mt in cutlass.range_constexpr(MT):
                        for nt in cutlass.range_constexpr(NTN):
                            for v in cutlass.range_constexpr(4):
                                acc[i, mt, nt, v] = acc[i, mt, nt, v] + sc * part[i, mt, nt, v]

        @cute.jit
        def end_mma(ptrs, t: Int32, state, scratch):
            acc, resv, sx = state
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            g = lane // 4
            q = lane % 4
            RP, MP = MT * 16, NTN * 8
            # 1. every warp adds its partial sums into [weight][token][row] (fragment c holds
            #    row g (+8 for c >= 2), tokens 2q, 2q+1); padded rows / tokens are never read
            for i in cutlass.range_constexpr(nw):
                for mt in cutlass.range_constexpr(MT):
                    for nt in cutlass.range_constexpr(NTN):
                        for v in cutlass.range_constexpr(4):
                            row = mt * 16 + g + 8 * (v // 2)
                            tok = nt * 8 + 2 * q + v % 2
                            ptr = cute.make_ptr(Float32, sx + XBYTES + 4 * ((i * MP + tok) * RP + row),
                                                cute.AddressSpace.smem, assumed_align=4)
                            cute.arch.atomic_add(ptr, acc[i, mt, nt, v], scope="cta")
            cute.arch.sync_threads()
            # 2. the epilogue: thread tid has outputs o = tid + NT e, token-major (a warp writes
            #    consecutive rows of one token: contiguous in y)
            sRed = smem_tensor(sx + XBYTES, Float32, (nw, MP, RP))
            mY = gmem_tensor(ptrs[i_y], odt, (M, N), 2 if c.out_dtype == "bf16" else 4)
            for e in cutlass.range_constexpr(EPI):
                o = tid + NT * e
                if o < R * M:
                    tok = o // R
                    row = o - tok * R
                    a = sRed[0, tok, row]
                    if cutlass.const_expr(swiglu):
                        a = swiglu_act(a, sRed[1, tok, row], limit, act, betas)
                    if cutlass.const_expr(c.residual is not None):
                        a = a + resv[e]
                    mY[tok, t * R + row] = a.to(odt)
            # the sums are zeroed by the next tile's begin: no thread may still be reading them
            cute.arch.sync_threads()

        @cute.jit
        def consume_wgmma(ptrs, t: Int32, ch: Int32, stage_addr, state, sx):
            acc = state[0]
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            g = lane // 4
            wgi = tid // 128                     # warpgroup: K blocks [wgi KBG, (wgi + 1) KBG)
            xo = (ch % CPX) * KC                 # the chunk's first column in the staged x block
            sS = smem_tensor(stage_addr + 16 * WU, Float32, (nw, KB))
            sInv = smem_tensor(sx + XBYTES, Float32, (M,))
            # this thread's D rows g (and g + 8: the same piece, the descriptor repeats the 8
            # rows) weigh piece g % PX of token g // PX by 16^-p x the token's inverse x scale
            tok = Int32(cutlass.select_(g < M * PX, g // PX, 0))
            pw = Float32(1.0)
            for pc in cutlass.range_constexpr(1, PX):
                pw = Float32(cutlass.select_(g % PX == pc, Float32(16.0 ** -pc), pw))
            pw = Float32(cutlass.select_(g < M * PX, pw * sInv[tok], Float32(0.0)))
            a0 = Int64(((sx + (xo // 16) * 128 + wgi * (KBG * 8 * 128)) >> 4) & 0x3FFF) | Int64(DESC_A_HI)
            b0 = Int64(((stage_addr + wgi * (KBG * 8 * 128)) >> 4) & 0x3FFF) | Int64(DESC_B_HI)
            for gb in cutlass.range_constexpr(KBG // GB):
                # k32 step s of block b: 2 units (16 bytes each) of K past the block's start
                steps = [(gb * GB + b) * 8 + 2 * st for b in range(GB) for st in range(4)]
                da = [a0 + Int64(((o * 128) >> 4)) for o in steps]
                db = [b0 + Int64(((o * 128) >> 4)) for o in steps]
                d = wgmma_fp8_sync(NC, GB, da, db, Int32(0))
                for b in cutlass.range_constexpr(GB):
                    scl = [sS[i, wgi * KBG + gb * GB + b] * pw for i in range(nw)]
                    for j in cutlass.range_constexpr(NC // 8):
                        i = (8 * j) // R
                        for v in cutlass.range_constexpr(2):
                            acc[2 * j + v] = acc[2 * j + v] + d[b * (NC // 2) + 4 * j + v] * scl[i]

        @cute.jit
        def end_wgmma(ptrs, t: Int32, state, scratch):
            acc, resv, sx = state
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            q = lane % 4
            sRed = smem_tensor(sx + RED_OFF, Float32, (2, 8, NC))
            # warp 0 of each warpgroup holds D rows 0..7 (the weighted pieces): its sums to smem
            if warp % 4 == 0:
                for j in cutlass.range_constexpr(NC // 8):
                    for v in cutlass.range_constexpr(2):
                        sRed[warp // 4, g, 8 * j + 2 * q + v] = acc[2 * j + v]
            cute.arch.sync_threads()
            mY = gmem_tensor(ptrs[i_y], odt, (M, N), 2 if c.out_dtype == "bf16" else 4)
            for e in cutlass.range_constexpr(EPI):
                o = tid + NT * e
                if o < R * M:
                    tk = o // R
                    row = o - tk * R
                    part = []
                    for i in cutlass.range_constexpr(nw):
                        a = Float32(0.0)
                        for w2 in cutlass.range_constexpr(2):
                            for pc in cutlass.range_constexpr(PX):
                                a = a + sRed[w2, tk * PX + pc, i * R + row]
                        part.append(a)
                    a = part[0]
                    if cutlass.const_expr(swiglu):
                        a = swiglu_act(a, part[1], limit, act, betas)
                    if cutlass.const_expr(c.residual is not None):
                        a = a + resv[e]
                    mY[tk, t * R + row] = a.to(odt)
            # the sums are rewritten by the next tile's end: no thread may still be reading them
            cute.arch.sync_threads()

        if wg:
            return StreamFaces(issue=issue, begin=begin, prep=prep, consume=consume_wgmma, end=end_wgmma)
        if mma:
            return StreamFaces(issue=issue, begin=begin, prep=prep, consume=consume_mma, end=end_mma)
        return StreamFaces(issue=issue, begin=begin, prep=prep, consume=consume_hfma2 if hfma2 else consume, end=end)
