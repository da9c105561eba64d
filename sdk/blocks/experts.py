"""Routed-expert block: the gate/up + SwiGLU stage and the down + weighted-combine stage of the
experts of ONE rank, driven by the router's dispatch table (`router.RouterSelectBlock`).

    stage "gateup":  act[a, :] = silu(gate_e(x[tok])) * up_e(x[tok])    (or SiTU; with the optional clamp
                     limit: gate <= limit, |up| <= limit) for every local assignment a = (tok, j)
                     routed to local expert e;  act is bf16 [M * top_k, I], row a = tok * k + j
    stage "down":    out[m, :] = shared[m, :] + sum over m's local assignments a, in the fixed
                     order of the hit list (experts ascending), of topk_w[a] * down_e(act[a])

A tile is `rows_per_tile` output rows (gate/up: rows of I; down: rows of the hidden size) over
ALL hit experts of the rank: the tile reads `hits` (the hit experts, ascending) and loops over
them only, so an expert with no tokens costs nothing (its weights are never read), and every
tile does the same work (balanced whatever the routing). Inside, each warp owns one output row
at a time and streams the expert's weight row in 16-byte vector loads, dequantised in registers;
tokens of one expert go in groups of at most 8, in kernel variants for 1, 2, 4 and 8 tokens (a
batch-1 step does no wasted math).

Combine: deterministic, no atomics. The down tile owns whole output rows: it accumulates each
token's experts in registers (lane `m % 32` owns token m) in the hit-list order and writes
out = shared + sum once. So the result is bit-reproducible and no output zeroing or separate
combine instruction (and its counter hop, ~0.5 us) is needed; fp32 atomics would be
order-dependent and need a zeroed output first.

Weight formats (per local expert e; `w` is gate_up [E, 2I, D] for "gateup", down [E, D, I]):
  "bf16"      w bf16
  "fp8_e4m3"  w e4m3, w_scale fp32 [E, N/128, K/128]   (128x128 blocks, multiplied in)
  "mxfp4"     w int32 [E, N, K/8]: 8 e2m1 values per word, element 8q+p in bits 4p..4p+3
              (the little-endian byte layout of two values per byte, low nibble first);
              w_scale int32 [E, N, K/128]: 4 ue8m0 bytes per word, byte g%4 of word g/4 is
              the scale 2^(s-127) of elements 32g..32g+31 (DeepSeek-V4's `fp4_e8m0_k32`)
  e2m1 is decoded with integer ops into fp16 bit patterns (exact, no sm_100 instruction), so
  the same code runs on sm_90a and sm_100a; ue8m0 scales above 2^113 are not supported.

Expert parallelism (sdk/blocks/ep.py): `rows` decouples the rows of x and of the tok/slot tables
(the N*M rows an owner rank received) from M, and the down stage's `scatter` mode writes each
assignment's row alone and unweighted (out[slot], [rows * top_k, hidden]) for the source rank
to weigh and sum; then rows may exceed 64.

Tensor cores (`tile_mma`, MXFP4; `ExpertsBlock.use_mma`): by default from MMA_MIN_M = 8 tokens
(the layer's batch `m`), the CUDA-core tile below it; `mma=True` / `mma=False` force either. See
`tile_mma` below and docs/moe.md.

Supported: M = 1..64, top_k <= 32, K (hidden for gate/up, I for down) a multiple of the
elements per 16-byte load (8 bf16, 16 fp8, 32 mxfp4) and, for fp8, of 128. Not yet: the
tensor-core path for large per-expert token counts (a group of 8 re-reads the expert's rows
for each further 8 tokens, from L2), NVFP4. SiTU (Kimi K3's activation, `activation="situ"`)
runs in the gate/up epilogue (GPU-tested with the latent MoE layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference.common import swiglu as swiglu_ref
from .base import NUM_THREADS, Block, Cost, OperandSpec
from .formats import mxfp4_bytes, mxfp4_values
from .gemv import MMA_MIN_M            # MXFP4 expert tiles on the tensor cores from this batch, as the GEMV

FORMATS = ("bf16", "fp8_e4m3", "mxfp4")
ELEMS_PER_LOAD = {"bf16": 8, "fp8_e4m3": 16, "mxfp4": 32}
GROUPS = (1, 2, 4, 8)       # token-group variants
MXFP4_DECODES = ("f32", "hfma2")     # ExpertsConfig.mxfp4_decode
HFMA2_X_EXP = 4                      # mxfp4_decode="hfma2": x enters the f16 products times 2^4
MAX_LOADS_IN_FLIGHT = 16    # 16-byte weight loads per lane per step (64 registers)
MAX_GROUP_LOADS = 8         # ... x tokens, in the 2..8-token variants: each token adds x values and
                            # partial sums; above this ptxas spilled KBs per thread (local ptxas -v)
MMA_RED_WORDS = 512         # tile_mma's cross-warp sums live in the tile's scratch (before STATS_OFFSET)
SMEM_STAGES_MAX_BYTES = 192 * 1024   # ExpertsConfig.smem_stages: the warps' item slots at most (the
                                     # megakernel's weight ring needs the rest of the shared memory)


def balanced_rows(out_rows: int, num_sms: int = 132) -> int:
    """Rows per tile for one tile per SM where possible: the smallest multiple of 8 dividing
    `out_rows` with at most `num_sms` tiles (a tile streams its rows of every hit expert)."""
    for r in range(8, out_rows + 1, 8):
        if out_rows % r == 0 and out_rows // r <= num_sms:
            return r
    return 8


@dataclass(frozen=True)
class ExpertsConfig:
    stage: str                           # "gateup" | "down"
    hidden: int
    intermediate: int
    num_local: int
    top_k: int
    m: int = 1
    weight_dtype: str = "bf16"           # "bf16" | "fp8_e4m3" | "mxfp4"
    swiglu_limit: float | None = None    # gateup
    activation: str = "silu"             # gateup: "silu" (SwiGLU) | "situ" (Kimi K3, with the betas below)
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    shared: bool = False                 # down: add a shared-expert output [M, D] fp32
    out_dtype: str = "bf16"              # down: "bf16" | "fp32"
    rows_per_tile: int = 8
    unroll: int = 0                      # 16-byte loads per lane in flight per row; 0 = auto
    weight_l1: bool = True               # weight loads allocate in L1 (False: L1::no_allocate)
    mma: bool | None = None              # MXFP4 on the tensor cores (tile_mma); None = auto (use_mma)
    smem_stages: int = 0                 # CUDA-core tile: each warp copies its (row, hit expert) items'
                                         # weight rows and scales into its own shared-memory slots with
                                         # cp.async, smem_stages - 1 items ahead of the one it computes
                                         # (0: loads straight into registers); opt-in, written 2026-12-05
    batch1_tile: bool = True             # staged items at m = 1: tile_b1 (hit-major items, x / routing
                                         # loaded per hit); False: the general tile (A/B)
    mxfp4_decode: str = "f32"            # CUDA-core MXFP4: "f32" (each e2m1 pair widened to fp32, fp32
                                         # FMAs) | "hfma2" (packed f16 FMAs on the decoded pairs, x as f16;
                                         # see make_group); opt-in, written 2026-12-07
    expected_hits: float = 1.0           # hit local experts per step: for cost() only
    # expert parallelism (sdk/blocks/ep.py): the experts of an owner rank read the rows that the
    # N ranks dispatched to it. rows: rows of x (gateup) and columns of tok/slot (0 = m); act
    # has rows * top_k rows. scatter (down only): out is [rows * top_k, hidden] and each
    # assignment's row is written alone, unweighted (out[slot] = down_e(act[slot])): the source
    # rank weighs and sums (EPCombineBlock); no per-token combine, so rows may exceed 64.
    rows: int = 0
    scatter: bool = False


# -- host-side formats -------------------------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (packed int32 [..., N, K/8], scales int32 [..., N, K/128]): MXFP4
    (formats.mxfp4_bytes: per 32 along K the smallest power-of-two scale with amax / scale <= 6,
    e2m1's max, amax floored at 6 x 2^-126 as V4.1's writer - a zero group's scale byte is 1;
    values rounded to the nearest e2m1, ties to even)."""
    codes, exps = mxfp4_bytes(w)
    return codes.contiguous().view(torch.int32), exps.contiguous().view(torch.int32)


def dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return mxfp4_values(packed.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8))


def quantize_fp8_experts(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], fp32 scales [E, N/128, K/128]), scale = amax / 448."""
    e, n, k = w.shape
    b = w.float().reshape(e, n // block, block, k // block, block)
    scale = b.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (b / scale[:, :, None, :, None]).reshape(e, n, k).to(torch.float8_e4m3fn)
    return q, scale


def dequant_experts(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """The fp32 value of expert weights in `fmt` (the definition the device matches)."""
    if fmt == "bf16":
        return w.float()
    if fmt == "fp8_e4m3":
        return w.float() * scale.float().repeat_interleave(128, -2).repeat_interleave(128, -1)
    if fmt == "mxfp4":
        return dequant_mxfp4(w, scale)
    raise ValueError(fmt)


class ExpertsBlock(Block):
    name = "experts"
    Config = ExpertsConfig
    wide_operands = ("w", "w_scale")    # addressed per expert from a 64-bit base (expert_views)

    @property
    def n_rows(self) -> int:             # N of one expert's weight (rows streamed)
        c = self.config
        return 2 * c.intermediate if c.stage == "gateup" else c.hidden

    @property
    def k_dim(self) -> int:
        c = self.config
        return c.hidden if c.stage == "gateup" else c.intermediate

    @property
    def out_rows(self) -> int:           # rows of the tiled output dimension
        c = self.config
        return c.intermediate if c.stage == "gateup" else c.hidden

    @property
    def elems_per_load(self) -> int:
        return ELEMS_PER_LOAD[self.config.weight_dtype]

    @property
    def rows_in(self) -> int:            # tokens the dispatch table can name (m, or rows under EP)
        return self.config.rows or self.config.m

    @property
    def unroll(self) -> int:
        c = self.config
        if c.unroll:
            return c.unroll
        # the whole row in flight at once where it fits (one round trip per row): the most loads
        # per lane (<= MAX_LOADS_IN_FLIGHT over the gate and up rows) that divide the row evenly
        nw = self.nw
        per_lane = -(-(self.k_dim // self.elems_per_load) // 32)
        for u in range(min(MAX_LOADS_IN_FLIGHT // nw, per_lane), 0, -1):
            if (self.k_dim // self.elems_per_load) % (32 * u) == 0:
                return u
        return min(MAX_LOADS_IN_FLIGHT // nw, per_lane)

    @property
    def nw(self) -> int:                 # weights per output row: gate and up, or down
        return 2 if self.config.stage == "gateup" else 1

    @property
    def use_mma(self) -> bool:
        """The tensor-core tile (`tile_mma`, MXFP4 only) from MMA_MIN_M tokens in the layer's
        batch (`m`), the CUDA-core tile below - the rule of GemvBlock.use_mma. Measured on the H200
        (2026-12-03, fraction of the bandwidth floor, CUDA-core vs tensor-core tile, outputs equal):
        batch 1 Kimi K3 0.404 vs 0.324, DeepSeek-V4.1-Flash 0.393 vs 0.361, GLM-5.3 0.170 vs
        0.169; batch 8 Kimi K3 0.220 vs 0.251, GLM-5.3 0.148 vs 0.192. `mma=True` / `mma=False`
        force either (True fails loudly where tile_mma cannot run); the automatic choice keeps the
        CUDA cores where tile_mma cannot run (other formats, tiles whose cross-warp sums exceed
        MMA_RED_WORDS)."""
        c = self.config
        if c.mma is not None:
            return bool(c.mma)
        return c.weight_dtype == "mxfp4" and c.m >= MMA_MIN_M and self.mma_red_words <= MMA_RED_WORDS

    @property
    def mma_red_words(self) -> int:
        """tile_mma's cross-warp sums: [weight][8 tokens][rows padded to m16 tiles] fp32."""
        return self.nw * 8 * 16 * -(-self.config.rows_per_tile // 16)

    def check(self):
        c = self.config
        if c.stage not in ("gateup", "down"):
            self.unsupported(f"experts: stage {c.stage!r} (supported: gateup, down)")
        if c.weight_dtype not in FORMATS:
            self.unsupported(f"experts: weight dtype {c.weight_dtype!r} (supported: {FORMATS})")
        if not 1 <= c.m <= 64:
            self.unsupported(f"experts: m={c.m} tokens (supported: 1..64)")
        if not 1 <= c.top_k <= 32:
            self.unsupported(f"experts: top_k={c.top_k} (supported: 1..32)")
        if self.k_dim % self.elems_per_load:
            self.unsupported(f"experts {c.stage}: K={self.k_dim} must be a multiple of {self.elems_per_load}")
        if c.weight_dtype == "fp8_e4m3" and (self.k_dim % 128 or self.n_rows % 128
                                             or (c.stage == "gateup" and c.intermediate % 128)):
            self.unsupported(f"experts fp8: N={self.n_rows}, K={self.k_dim} (and I) must be multiples of 128")
        if c.weight_dtype == "mxfp4" and self.k_dim % 128:
            self.unsupported(f"experts mxfp4: K={self.k_dim} must be a multiple of 128 (4 scales per word)")
        if self.out_rows % c.rows_per_tile or c.rows_per_tile % (NUM_THREADS // 32):
            self.unsupported(f"experts: rows_per_tile={c.rows_per_tile} must divide {self.out_rows} "
                             f"and be a multiple of {NUM_THREADS // 32}")
        if c.out_dtype not in ("bf16", "fp32"):
            self.unsupported(f"experts: out dtype {c.out_dtype!r}")
        if c.stage == "down" and c.swiglu_limit is not None:
            self.unsupported("experts: swiglu_limit belongs to the gateup stage")
        if c.activation not in ("silu", "situ") or (c.activation != "silu" and c.stage != "gateup"):
            self.unsupported(f"experts: activation {c.activation!r} (supported: silu, situ; gateup stage)")
        if c.rows and not (c.m <= c.rows <= 72 * 64):
            self.unsupported(f"experts: rows={c.rows} (supported: m..{72 * 64})")
        if c.rows > 64 and c.stage == "down" and not c.scatter:
            self.unsupported(f"experts: rows={c.rows} > 64 needs scatter (the per-token combine holds 64 tokens)")
        if c.scatter and (c.stage != "down" or c.shared):
            self.unsupported("experts: scatter is a down-stage mode without a shared-expert input")
        if c.mxfp4_decode not in MXFP4_DECODES:
            self.unsupported(f"experts: mxfp4_decode {c.mxfp4_decode!r} (supported: {MXFP4_DECODES})")
        if c.smem_stages:
            if not 2 <= c.smem_stages <= 8:
                self.unsupported(f"experts: smem_stages={c.smem_stages} (supported: 0, or 2..8 items per warp)")
            if self.use_mma:
                self.unsupported("experts: smem_stages is for the CUDA-core tile (the tensor-core tile, mma, "
                                 "loads its weights itself)")
            if self.own_smem_bytes() > SMEM_STAGES_MAX_BYTES:
                self.unsupported(f"experts: smem_stages={c.smem_stages} x {NUM_THREADS // 32} warps x "
                                 f"{4 * self.item_words} B items = {self.own_smem_bytes()} B of shared memory "
                                 f"(at most {SMEM_STAGES_MAX_BYTES}): fewer stages")
        if self.use_mma:
            if c.weight_dtype != "mxfp4":
                self.unsupported(f"experts mma: weight dtype {c.weight_dtype!r} (the tensor-core tile takes mxfp4)")
            if self.mma_red_words > MMA_RED_WORDS:
                self.unsupported(f"experts mma: {self.config.rows_per_tile} rows x {self.nw} weights x 8 tokens "
                                 f"exceed the {MMA_RED_WORDS}-word cross-warp sum in scratch")

    @property
    def scale_words(self) -> int:
        """32-bit scale words of one weight row's K (mxfp4: 4 ue8m0 bytes a word; fp8: the row's 128 x
        128 block row, one fp32 a block); 0 for bf16."""
        return 0 if self.config.weight_dtype == "bf16" else self.k_dim // 128

    @property
    def item_words(self) -> int:
        """smem_stages: one (row, hit expert) item - the nw weight rows' 16-byte chunks, then their
        scale words (padded to 16 bytes) - in 32-bit words."""
        nch = self.k_dim // self.elems_per_load
        return self.nw * (nch * 4 + -(-self.scale_words // 4) * 4)

    def own_smem_bytes(self) -> int:
        c = self.config
        return (NUM_THREADS // 32) * c.smem_stages * 4 * self.item_words if c.smem_stages else 0

    def operand_specs(self):
        c = self.config
        E, N, K, M, L = c.num_local, self.n_rows, self.k_dim, self.rows_in, c.num_local
        fmt = c.weight_dtype
        if fmt == "mxfp4":
            specs = [OperandSpec("w", (E, N, K // 8), "int32"), OperandSpec("w_scale", (E, N, K // 128), "int32")]
        elif fmt == "fp8_e4m3":
            specs = [OperandSpec("w", (E, N, K), fmt), OperandSpec("w_scale", (E, N // 128, K // 128), "fp32")]
        else:
            specs = [OperandSpec("w", (E, N, K), fmt), OperandSpec("w_scale", (1,), "fp32", optional=True)]
        specs += [OperandSpec("counts", (L,), "int32"), OperandSpec("hits", (L + 1,), "int32"),
                  OperandSpec("tok", (L, M), "int32"), OperandSpec("slot", (L, M), "int32")]
        if c.stage == "gateup":
            specs += [OperandSpec("x", (M, c.hidden), "bf16"),
                      OperandSpec("act", (M * c.top_k, c.intermediate), "bf16", output=True)]
        else:
            specs += [OperandSpec("act", (M * c.top_k, c.intermediate), "bf16"),
                      OperandSpec("topk_w", (M, c.top_k), "fp32", optional=c.scatter),
                      OperandSpec("shared", (M, c.hidden), "fp32", optional=not c.shared),
                      OperandSpec("out", (M * c.top_k if c.scatter else M, c.hidden), c.out_dtype, output=True)]
        return specs

    def num_tiles(self) -> int:
        return self.out_rows // self.config.rows_per_tile

    def bytes_per_weight(self) -> float:
        fmt = self.config.weight_dtype
        if fmt == "bf16":
            return 2.0
        if fmt == "fp8_e4m3":
            return 1.0 + 4.0 / (128 * 128)
        return 0.5 + 1.0 / 32

    def expert_weight_bytes(self) -> float:
        """Bytes of one expert's weights of this stage (with scales): the floor per hit expert."""
        return self.n_rows * self.k_dim * self.bytes_per_weight()

    def cost(self) -> Cost:
        c = self.config
        per_row = (2 if c.stage == "gateup" else 1) * self.k_dim * self.bytes_per_weight()
        w = c.expected_hits * c.rows_per_tile * per_row
        toks = min(c.m * c.top_k, c.m * c.top_k * c.expected_hits)
        b = int(w + toks * (self.k_dim * 2 + c.rows_per_tile * 4) + 64 * c.num_local)
        return Cost(bytes=b, flops=int(2 * toks * c.rows_per_tile * self.k_dim * (2 if c.stage == "gateup" else 1)))

    # -- torch faces ---------------------------------------------------------------------------
    def _dequant_rows(self, t, le: int, rows: torch.Tensor) -> torch.Tensor:
        """fp32 rows `rows` of local expert le's weight (only those rows are dequantised)."""
        fmt = self.config.weight_dtype
        w = t["w"][le][rows]
        if fmt == "bf16":
            return w.float()
        s = t["w_scale"][le]
        if fmt == "fp8_e4m3":
            return w.float() * s[rows // 128].float().repeat_interleave(128, -1)
        return dequant_mxfp4(w, s[rows])

    def reference(self, **t):
        """Whole stage, from the dispatch table (fp32 math)."""
        out = {k: v.clone() for k, v in t.items() if k in ("act", "out")}
        t = dict(t, **out)
        for tile in range(self.num_tiles()):
            self.emulate_tile(t, tile)
        return out

    def emulate_tile(self, t, tile):
        c = self.config
        R = c.rows_per_tile
        rows = slice(tile * R, (tile + 1) * R)
        H = int(t["hits"][0])
        hit = [int(v) for v in t["hits"][1:1 + H]]
        if c.stage == "gateup":
            for le in hit:
                n = int(t["counts"][le])
                toks = t["tok"][le, :n].long()
                slots = t["slot"][le, :n].long()
                gate_rows = torch.arange(tile * R, (tile + 1) * R)
                wd = self._dequant_rows(t, le, torch.cat([gate_rows, gate_rows + c.intermediate]))
                x = t["x"][toks].float()
                g = x @ wd[:R].T
                u = x @ wd[R:].T
                t["act"][slots, rows] = swiglu_ref(g, u, c.activation, c.swiglu_limit, c.situ_beta,
                                                   c.situ_linear_beta).to(t["act"].dtype)
        elif c.scatter:
            for le in hit:
                n = int(t["counts"][le])
                slots = t["slot"][le, :n].long()
                wd = self._dequant_rows(t, le, torch.arange(tile * R, (tile + 1) * R))
                t["out"][slots, rows] = (t["act"][slots].float() @ wd.T).to(t["out"].dtype)
        else:
            M = c.m
            acc = torch.zeros(M, R)
            for le in hit:
                n = int(t["counts"][le])
                toks = t["tok"][le, :n].long()
                slots = t["slot"][le, :n].long()
                wd = self._dequant_rows(t, le, torch.arange(tile * R, (tile + 1) * R))
                y = t["act"][slots].float() @ wd.T
                acc.index_add_(0, toks, y * t["topk_w"].reshape(-1)[slots, None].float())
            if c.shared:
                acc = acc + t["shared"][:, rows].float()
            t["out"][:, rows] = acc.to(t["out"].dtype)

    # -- device face ---------------------------------------------------------------------------
    def _build_device_tile(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32, Int64
        from cutlass._mlir import ir

        from cutlass.cute.nvgpu import cpasync

        from ._cute import (DTYPE_MAP, TileSmem, bf16x8_to_f16_pairs, bits_to_f32, e2m1_pair, f16x2_sum_f32,
                            lane_list_get,
                            f16x2_to_f32, fma_f16x2, gmem_tensor, mma_m16n8k16,
                            mul_f16x2, smem_tensor, swiglu_act)

        c = self.config
        fmt = c.weight_dtype
        EPL = self.elems_per_load                  # weight elements per 16-byte load
        U = self.unroll
        N, K = self.n_rows, self.k_dim
        nch = K // EPL                             # 16-byte loads per row
        R = c.rows_per_tile
        NW = NUM_THREADS // 32
        M, KT, L, I, D = self.rows_in, c.top_k, c.num_local, c.intermediate, c.hidden
        scatter = c.scatter
        gateup = c.stage == "gateup"
        nw = self.nw
        limit = c.swiglu_limit
        act, betas = c.activation, (c.situ_beta, c.situ_linear_beta)
        has_shared = c.shared
        odt = DTYPE_MAP[c.out_dtype]
        groups = [g for g in GROUPS if g <= M] or [1]
        GMAX = groups[-1]
        l1_policy = "evict_normal" if c.weight_l1 else "evict_no_allocate"
        xrows = M if gateup else M * KT            # rows of the GEMV input (x or act)

        # operand indices (see operand_specs)
        P_W, P_S, P_CNT, P_HITS, P_TOK, P_SLOT = 0, 1, 2, 3, 4, 5

        @cute.jit
        def load_w(mW, n, ch):
            """One 16-byte weight load (as 4 x int32; unpack() reinterprets it). weight_l1=False
            makes it L1::no_allocate, meant to leave L1 to x - measured slower on the H200 (V4.1
            MoE batch 1: 71.9 vs 42.3 us), so the default allocates."""
            v = cute.arch.load(mW[n, ch, None].iterator, ir.VectorType.get([4], Int32.mlir_type),
                               level1_eviction_priority=l1_policy)
            raw = cute.make_rmem_tensor((4,), Int32)
            raw.store(cute.TensorSSA(v, (4,), Int32))
            return raw

        @cute.jit
        def chunk_scale(mS, n, ch) -> Float32:
            s = Float32(1.0)
            if cutlass.const_expr(fmt == "fp8_e4m3"):
                s = mS[n // 128, (ch * EPL) // 128]
            elif cutlass.const_expr(fmt == "mxfp4"):
                word = mS[n, ch // 4]
                e8 = (word >> ((ch % 4) * 8)) & 255
                # 2^(s-127) times 2^14, the fp16 decode's bias (see weights8 below): exact
                s = bits_to_f32((e8 + 14) << 23)
            return s

        @cute.jit
        def load_staged(sW, i, ch):
            """smem_stages: chunk ch of weight row i of the item in the warp's slot (one LDS.128)."""
            raw = cute.make_rmem_tensor((4,), Int32)
            raw.store(sW[i, ch, None].load())
            return raw

        @cute.jit
        def staged_scale(sS, i, ch) -> Float32:
            """smem_stages: chunk_scale of the item's weight row i from its staged scale words."""
            s = Float32(1.0)
            if cutlass.const_expr(fmt == "fp8_e4m3"):
                s = sS[i, (ch * EPL) // 128]
            elif cutlass.const_expr(fmt == "mxfp4"):
                s = chunk_scale(sS, i, ch)
            return s

        @cute.jit
        def unpack(raw):
            """bf16 / fp8: the load's EPL weights as fp32 (rmem); mxfp4: the raw words (decoded
            8 at a time by weights8, which keeps the registers of a whole row's loads free)."""
            if cutlass.const_expr(fmt == "mxfp4"):
                return raw
            wf = cute.make_rmem_tensor((EPL,), Float32)
            wf.store(cute.recast_tensor(raw, DTYPE_MAP[fmt]).load().to(Float32))
            return wf

        @cute.jit
        def weights8(w, q):
            """Weights 8q..8q+7 of one load as 8 fp32 values (unscaled)."""
            if cutlass.const_expr(fmt == "mxfp4"):
                out = [None] * 8
                word = w[q]
                for p in cutlass.range_constexpr(4):
                    out[p], out[p + 4] = f16x2_to_f32(e2m1_pair(word, p))
                return out
            return [w[8 * q + e] for e in range(8)]

        # mxfp4_decode="hfma2": a 16-byte load is 32 e2m1 weights, one scale group. Its 16 decoded
        # f16 pairs (e2m1_pair: pair 4q + p = elements 8q + p, 8q + p + 4, each the value * 2^-14,
        # exact) multiply x's same elements times 2^HFMA2_X_EXP as f16 pairs, in two chains of 8
        # packed FMAs; the chains' halves are widened, added in fp32 and scaled there by the
        # group's 2^(s - 127) * 2^14 * 2^-HFMA2_X_EXP. Ranges: x * 2^4 clamps at f16's 65504
        # (satfinite), so |x| up to 4096 is exact; a product is then < 6 * 2^-14 * 65504 < 24 and
        # a chain's half < 192 - no overflow. Products below 2^-14 are f16 subnormals (2^-25
        # absolute rounding): x of RMS 0.01 still sums within ~1e-3 relative, RMS 0.001 ~1e-2
        # (tests/test_moe_blocks.py, the arithmetic emulated). SASS, V4.1-Flash batch-1 gate/up
        # item (2 rows x 5120): 1225 instructions against the "f32" path's 1630 (the e2m1 decode
        # ~1.5 a weight either way; f32 widens each weight and FFMAs it, hfma2 one HFMA2 a pair).
        HFMA2 = fmt == "mxfp4" and c.mxfp4_decode == "hfma2"

        def hfma2_load(raw, scl, u, xps, acc, G):
            """Load u of a step: its weights (raw[i][u], every weight row i) times G tokens' x
            (xps[g]: the unit's 16 f16 pairs), into acc (traced inline: u, G and the lists are
            Python values)."""
            pairs = [[e2m1_pair(rr[u][q], p) for q in range(4) for p in range(4)] for rr in raw]
            for g in range(G):
                xp = xps[g]
                for i in range(nw):
                    a0 = mul_f16x2(pairs[i][0], xp[0])
                    a1 = mul_f16x2(pairs[i][1], xp[1])
                    for k in range(1, 8):
                        a0 = fma_f16x2(pairs[i][2 * k], xp[2 * k], a0)
                        a1 = fma_f16x2(pairs[i][2 * k + 1], xp[2 * k + 1], a1)
                    acc[i, g] = acc[i, g] + (scl[i][u] * 2.0 ** -HFMA2_X_EXP) * (f16x2_sum_f32(a0) + f16x2_sum_f32(a1))

        def x_pairs(mXw, xr, ch):
            """hfma2's 16 f16 pairs of x row xr's 16-byte units ch * 4 .. ch * 4 + 3 (mXw: x as
            int32 words, 4 a unit)."""
            xp = []
            for q in range(4):
                xw = mXw[xr, ch * 4 + q, None].load()
                xp += list(bf16x8_to_f16_pairs(xw[0], xw[1], xw[2], xw[3], HFMA2_X_EXP))
            return xp

        def make_group(G, staged=False, xcached=False):
            """Dot products of one output row's weight rows (nw: gate and up, or down) with G
            input rows, for one warp. Per step: every weight load (U_G per weight row per lane)
            and its scale first, so they are in flight together; then per 8 weights one x load per
            token, shared by the gate and up rows. (Streaming 2..7 output rows of a warp at once
            was measured on the H200 - bench/results/h200/moe_bench_variants.json - and made the
            MoE layer 1.3-3.4x slower. But ptxas issues a step's loads in U_G waves interleaved
            with the math, not together - SASS of the GLM-5.3 batch-1 gate/up tile - so a row
            costs several DRAM round trips: `staged` reads the item from the warp's smem slot
            instead - smem_stages, weight row i at index i of mW / mS.) A step past the row's end
            (the last one when 32 * U_G does not divide the row) re-loads the row's last chunk and
            weighs it 0, so its loads stay unconditional (hoisted with the others) instead of a
            branch per load. xcached (tile_b1, G = 1, one step): mX is the warp's x cache -
            load_x_cache's registers - instead of x in global memory."""
            UG = U if G == 1 else max(1, min(U, MAX_GROUP_LOADS // (nw * G)))
            steps = -(-nch // (32 * UG))
            ragged = nch % (32 * UG) != 0

            @cute.jit
            def group(mW, mS, mX, row, xr_list, acc):
                for it in cutlass.range(steps, unroll=1):
                    ch_l = [it * (32 * UG) + 32 * u + cute.arch.lane_idx() for u in range(UG)]
                    ch_c = ch_l
                    if cutlass.const_expr(ragged):
                        ch_c = [Int32(cutlass.select_(ch < nch, ch, nch - 1)) for ch in ch_l]
                    if cutlass.const_expr(staged):
                        raw = [[load_staged(mW, i, ch_c[u]) for u in range(UG)] for i in range(nw)]
                        scl = [[staged_scale(mS, i, ch_c[u]) for u in range(UG)] for i in range(nw)]
                    else:
                        raw = [[load_w(mW, row + i * I, ch_c[u]) for u in range(UG)] for i in range(nw)]
                        scl = [[chunk_scale(mS, row + i * I, ch_c[u]) for u in range(UG)] for i in range(nw)]
                    if cutlass.const_expr(ragged):
                        scl = [[Float32(cutlass.select_(ch_l[u] < nch, sr[u], Float32(0.0))) for u in range(UG)]
                               for sr in scl]
                    for u in cutlass.range_constexpr(UG):
                        if cutlass.const_expr(HFMA2):
                            if cutlass.const_expr(xcached):
                                xps = [[mX[16 * u + k] for k in range(16)]]
                            else:
                                xps = [x_pairs(mX, xr_list[g], ch_c[u]) for g in range(G)]
                            hfma2_load(raw, scl, u, xps, acc, G)
                        else:
                            w = [unpack(rr[u]) for rr in raw]
                            part = [[Float32(0.0) for _ in range(G)] for _ in range(nw)]
                            for q in cutlass.range_constexpr(EPL // 8):
                                if cutlass.const_expr(xcached):
                                    xs = [mX[(EPL // 8) * u + q, None].load().to(Float32)]
                                else:
                                    xs = [mX[xr_list[g], ch_c[u] * (EPL // 8) + q, None].load().to(Float32)
                                          for g in range(G)]
                                for i in cutlass.range_constexpr(nw):
                                    w8 = weights8(w[i], q)
                                    for g in cutlass.range_constexpr(G):
                                        for e in cutlass.range_constexpr(8):
                                            part[i][g] = part[i][g] + w8[e] * xs[g][e]
                            for i in cutlass.range_constexpr(nw):
                                for g in cutlass.range_constexpr(G):
                                    if cutlass.const_expr(fmt == "bf16" and not ragged):
                                        acc[i, g] = acc[i, g] + part[i][g]
                                    else:
                                        acc[i, g] = acc[i, g] + scl[i][u] * part[i][g]

            return group

        STAGED = c.smem_stages > 0 and not self.use_mma
        group_fns = {G: make_group(G, STAGED) for G in groups}

        def pick(n):
            return group_fns[min([g for g in groups if g >= n] or [GMAX])]
        f1, f2, f4, f8 = pick(1), pick(2), pick(4), group_fns[GMAX]

        # bytes of one expert's weights and scales: the expert's views start at base + le * bytes,
        # computed in 64 bits (a real shard's weight tensor exceeds 2^31 elements: Kimi K3's bf16
        # gate_up is 56 x 6144 x 7168; 32-bit indexing of the whole tensor overflows there)
        if fmt == "mxfp4":
            W_BYTES, S_BYTES = N * nch * 16, N * (K // 128) * 4
        elif fmt == "fp8_e4m3":
            W_BYTES, S_BYTES = N * K, (N // 128) * (K // 128) * 4
        else:
            W_BYTES, S_BYTES = N * K * 2, 0

        @cute.jit
        def expert_bases(ptrs, le):
            """Global addresses of local expert le's weights and scales."""
            return ptrs[P_W] + Int64(le) * Int64(W_BYTES), ptrs[P_S] + Int64(le) * Int64(S_BYTES)

        @cute.jit
        def expert_views(ptrs, le: Int32):
            # every format as 16-byte words of 4 x int32 (load_w); unpack() reinterprets them
            wbase, sbase = expert_bases(ptrs, le)
            mW = gmem_tensor(wbase, Int32, (N, nch, 4), 16)
            if cutlass.const_expr(fmt == "mxfp4"):
                mS = gmem_tensor(sbase, Int32, (N, K // 128), 4)
            elif cutlass.const_expr(fmt == "fp8_e4m3"):
                mS = gmem_tensor(sbase, Float32, (N // 128, K // 128), 4)
            else:
                mS = mW          # no scales: never read
            return mW, mS

        # -- smem_stages: a warp's items (row r, hit expert h), r over its rows, h inner, in order
        # j = (r's index among the warp's rows) x hits + h; item j sits in slot j % DS of the warp.
        # Each lane copies chunks lane, lane + 32, .. of the item's weight rows and scale words
        # lane, lane + 32, ..: cp.async (LDGSTS, no register, no consumer) issues where it stands,
        # so an item's copies are all in flight together, DS - 1 items ahead of the one computed -
        # the loads straight into registers are issued by ptxas in waves through the math (SASS of
        # the GLM-5.3 batch-1 gate/up tile: a row's 8 loads in 4 waves, ~4 DRAM round trips a row).
        DS = c.smem_stages
        SW = self.scale_words
        SWP = -(-SW // 4) * 4                      # a weight row's staged scale words (16-byte padded)
        ITEM = 4 * self.item_words                 # bytes of an item's slot
        OWN = self.own_smem_bytes()

        @cute.jit
        def slot_views(base, s):
            """(weights [nw, nch, 4] int32, scales [nw, SWP]) of slot s at the warp's slots `base`."""
            a = base + s * ITEM
            sW = smem_tensor(a, Int32, (nw, nch, 4))
            sS = smem_tensor(a + nw * nch * 16, Float32 if fmt == "fp8_e4m3" else Int32, (nw, max(SWP, 4)))
            return sW, sS

        @cute.jit
        def issue_item(ptrs, t, jj, n_items, n_hit, warp, lane, mHits, base):
            """Copy item jj (if it exists) into slot jj % DS; commits one cp.async group either way."""
            if jj < n_items:
                rr = jj // n_hit
                le = Int64(mHits[1 + jj - rr * n_hit])
                copy_item(ptrs, le, Int64(t * R + warp + NW * rr), base + (jj % DS) * ITEM, lane)
            cute.arch.cp_async_commit_group()

        @cute.jit
        def copy_item(ptrs, le, row, a, lane):
            """cp.async weight row `row` of local expert le (gate and up: and row + I), with its scale
            words, into the slot at smem address a (this lane's chunks)."""
            g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                                      num_bits_per_copy=128)
            g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
            wbase, sbase = expert_bases(ptrs, le)
            for i in cutlass.range_constexpr(nw):
                n = row + Int64(i * I)
                for k in cutlass.range_constexpr(-(-nch // 32)):
                    ch = lane + 32 * k
                    if ch < nch:
                        cute.copy(g2s, gmem_tensor(wbase + (n * Int64(nch) + Int64(ch)) * Int64(16), Int32, (4,), 16),
                                  smem_tensor(a + (i * nch + ch) * 16, Int32, (4,)))
                if cutlass.const_expr(SW > 0):
                    srow = n // Int64(128) if fmt == "fp8_e4m3" else n    # fp8: the 128-row block's scales
                    for k in cutlass.range_constexpr(-(-SW // 32)):
                        w = lane + 32 * k
                        if w < SW:
                            dst = cute.make_ptr(Int32, a + nw * nch * 16 + (i * SWP + w) * 4, cute.AddressSpace.smem,
                                                assumed_align=4)
                            cute.copy(g2s4, gmem_tensor(sbase + (srow * Int64(SW) + Int64(w)) * Int64(4), Int32, (1,), 4),
                                      cute.make_tensor(dst, cute.make_layout(1)))

        @cute.jit
        def tile(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            mCnt = gmem_tensor(ptrs[P_CNT], Int32, (L,), 4)
            mHits = gmem_tensor(ptrs[P_HITS], Int32, (L + 1,), 4)
            mTok = gmem_tensor(ptrs[P_TOK], Int32, (L, M), 4)
            mSlot = gmem_tensor(ptrs[P_SLOT], Int32, (L, M), 4)
            mX = gmem_tensor(ptrs[6], cutlass.BFloat16, (xrows, K // 8, 8), 16)
            if cutlass.const_expr(HFMA2):
                mX = gmem_tensor(ptrs[6], Int32, (xrows, K // 8, 4), 16)     # hfma2_load's words
            if cutlass.const_expr(gateup):
                mAct = gmem_tensor(ptrs[7], cutlass.BFloat16, (M * KT, I), 2)
            else:
                mTw = gmem_tensor(ptrs[7], Float32, (M * KT,), 4)
                mOut = gmem_tensor(ptrs[9], odt, (M * KT if scatter else M, D), 4 if c.out_dtype == "fp32" else 2)
            n_hit = mHits[0]
            if cutlass.const_expr(STAGED):             # the warp's slots; its first DS - 1 items in flight
                slots = TileSmem(scratch, OWN).allocate_tensor(Int32, cute.make_layout(OWN // 4), 16)
                sbase = slots.iterator.toint() + warp * (DS * ITEM)
                n_items = (R // NW) * n_hit
                for jj in cutlass.range_constexpr(DS - 1):
                    issue_item(ptrs, t, Int32(jj), n_items, n_hit, warp, lane, mHits, sbase)
            acc = cute.make_rmem_tensor((nw, GMAX), Float32)
            xr = cute.make_rmem_tensor((GMAX,), Int32)       # input rows of the group
            sl = cute.make_rmem_tensor((GMAX,), Int32)       # their assignment slots
            osum = cute.make_rmem_tensor((2,), Float32)      # down: this lane's tokens lane, lane+32
            shv = cute.make_rmem_tensor((2,), Float32)      # down: the shared experts' sums of the row
            for r in cutlass.range(warp, R, NW, unroll=1):
                row = t * R + r
                osum.fill(0.0)
                if cutlass.const_expr(not gateup and not scatter and has_shared):
                    # loaded as the row starts, used after its hit experts: the L2 round trip (the
                    # shared GEMV wrote them from other SMs) overlaps the row's work instead of
                    # following it - one per row, ~5 a V4.1 batch-1 down tile
                    mSh = gmem_tensor(ptrs[8], Float32, (M, D), 4)
                    for half in cutlass.range_constexpr(2):
                        if lane + 32 * half < M:
                            shv[half] = mSh[lane + 32 * half, row]
                for h in cutlass.range(n_hit, unroll=1):
                    le = mHits[1 + h]
                    if cutlass.const_expr(STAGED):
                        j = ((r - warp) // NW) * n_hit + h
                        issue_item(ptrs, t, j + (DS - 1), n_items, n_hit, warp, lane, mHits, sbase)
                        cute.arch.cp_async_wait_group(DS - 1)     # item j has landed (this lane's copies)
                        cute.arch.sync_warp()                     # ... and every lane's
                        mW, mS = slot_views(sbase, j % DS)    # the group fns read weight row i there
                    else:
                        mW, mS = expert_views(ptrs, le)
                    n = mCnt[le]
                    for g0 in cutlass.range(0, n, GMAX, unroll=1):
                        ng = n - g0
                        for g in cutlass.range_constexpr(GMAX):
                            # rows past the group's end repeat its first row: computed, never stored
                            idx = g0 + g
                            if g >= ng:
                                idx = g0
                            sl[g] = mSlot[le, idx]
                            if cutlass.const_expr(gateup):
                                xr[g] = mTok[le, idx]
                            else:
                                xr[g] = sl[g]
                        acc.fill(0.0)
                        xl = [xr[g] for g in range(GMAX)]
                        if cutlass.const_expr(GMAX == 1):
                            f1(mW, mS, mX, row, xl, acc)
                        else:
                            # the smallest variant that holds the group: batch 1 per expert (the
                            # common case) does no wasted math, 2..4 tokens at most 2x
                            if ng == 1:
                                f1(mW, mS, mX, row, xl, acc)
                            elif ng == 2:
                                f2(mW, mS, mX, row, xl, acc)
                            elif ng <= 4:
                                f4(mW, mS, mX, row, xl, acc)
                            else:
                                f8(mW, mS, mX, row, xl, acc)
                        for g in cutlass.range_constexpr(GMAX):
                            v = cute.arch.warp_reduction_sum(acc[0, g])
                            if cutlass.const_expr(gateup):
                                v = swiglu_act(v, cute.arch.warp_reduction_sum(acc[1, g]), limit, act, betas)
                                if (lane == 0) & (g < ng):
                                    mAct[sl[g], row] = v.to(cutlass.BFloat16)
                            elif cutlass.const_expr(scatter):
                                if (lane == 0) & (g < ng):
                                    mOut[sl[g], row] = v.to(odt)
                            else:
                                if g < ng:
                                    v = v * mTw[sl[g]]
                                    m_tok = mTok[le, g0 + g]
                                    if m_tok == lane:
                                        osum[0] = osum[0] + v
                                    if m_tok == lane + 32:
                                        osum[1] = osum[1] + v
                    if cutlass.const_expr(STAGED):
                        cute.arch.sync_warp()          # every lane is done with the slot: it is refilled next
                if cutlass.const_expr(not gateup and not scatter):
                    for half in cutlass.range_constexpr(2):
                        m_out = lane + 32 * half
                        if m_out < M:
                            v = osum[half]
                            if cutlass.const_expr(has_shared):
                                v = v + shv[half]
                            mOut[m_out, row] = v.to(odt)
            if cutlass.const_expr(STAGED):
                cute.arch.cp_async_wait_group(0)       # no group of this tile outlives it (the ring counts its own)

        # -- the batch-1 tile (tile_b1): one token (m = 1, no EP rows), staged items, a row's K in
        # one step of the 1-token group. The general tile's warp loads per item, each a dependent
        # L2 round trip (Nsight Compute, V4.1-Flash batch-1 down tile: ~300 cycles each at ~5000
        # an item, ~40% of the stall samples): the hit's local expert (for the next item's copy),
        # its count, its slot, x's units, the routing weight. Here the warp takes its items hit-
        # major - item j = (hit j // RWN, its row j % RWN) - and loads per TILE the hit list (lane
        # k holds hits 1 + k, 33 + k, ..: the next copy's expert is a shuffle), per HIT the slot,
        # the routing weight and x's units of this lane (registers: load_x_cache), per ITEM only
        # its staged weights. The down stage's sums of a row over the hits are kept in `scratch`
        # (one word a (warp, row)); the shared experts' sums are loaded as the tile starts.
        RWN = R // NW                               # the warp's rows
        HL = -(-L // 32)                            # hit-list registers a lane
        UG1 = U
        B1 = c.batch1_tile and STAGED and M == 1 and not scatter and nch <= 32 * UG1
        XC_WORDS = 16 * UG1 if HFMA2 else 0          # hfma2: the cache holds x's f16 pairs

        def hit_of(hl, h):
            """Entry h of a lane-held hit list (the hits' local experts, slots, routing weights)."""
            return lane_list_get(hl, h, HL)

        @cute.jit
        def issue_b1(ptrs, t, jj, n_items, warp, lane, hl, base):
            """Copy item jj = (hit jj // RWN, row jj % RWN of the warp), if it exists, into slot jj % DS;
            commits one cp.async group either way."""
            h = jj // RWN
            le = hit_of(hl, Int32(cutlass.select_(jj < n_items, h, 0)))
            if jj < n_items:
                copy_item(ptrs, Int64(le), Int64(t * R + warp + NW * (jj - h * RWN)), base + (jj % DS) * ITEM, lane)
            cute.arch.cp_async_commit_group()

        @cute.jit
        def load_x_cache(mXg, xr, xc):
            """This lane's units of x row xr (its chunks lane + 32 u, clamped past the row's end as
            the group's): bf16 values [UG1 * EPL / 8, 8], or hfma2's f16 pairs [16 * UG1]."""
            lane = cute.arch.lane_idx()
            for u in cutlass.range_constexpr(UG1):
                ch = lane + 32 * u
                if cutlass.const_expr(nch % (32 * UG1) != 0):
                    ch = Int32(cutlass.select_(ch < nch, ch, nch - 1))
                if cutlass.const_expr(HFMA2):
                    xp = x_pairs(mXg, xr, ch)
                    for k in cutlass.range_constexpr(16):
                        xc[16 * u + k] = xp[k]
                else:
                    for q in cutlass.range_constexpr(EPL // 8):
                        xc[(EPL // 8) * u + q, None].store(mXg[xr, ch * (EPL // 8) + q, None].load())

        f1c = make_group(1, True, xcached=True) if B1 else None

        @cute.jit
        def tile_b1(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            mHits = gmem_tensor(ptrs[P_HITS], Int32, (L + 1,), 4)
            mSlot = gmem_tensor(ptrs[P_SLOT], Int32, (L, 1), 4)
            mXg = gmem_tensor(ptrs[6], cutlass.BFloat16, (xrows, K // 8, 8), 16)
            if cutlass.const_expr(HFMA2):
                mXg = gmem_tensor(ptrs[6], Int32, (xrows, K // 8, 4), 16)
            n_hit = mHits[0]
            hl = cute.make_rmem_tensor((HL,), Int32)
            for k in cutlass.range_constexpr(HL):
                hl[k] = 0
                if 32 * k + lane < L:
                    hl[k] = mHits[1 + 32 * k + lane]       # entries past n_hit: read, never used
            # every hit's slot (and at down its routing weight) into lane registers too, beside the
            # first items' copies: a hit's x / act row load then waits on no global load before it
            # (it was a dependent round trip a hit: the slot, then the row)
            sl = cute.make_rmem_tensor((HL,), Int32)
            twl = cute.make_rmem_tensor((HL,), Float32)
            for k in cutlass.range_constexpr(HL):
                sl[k] = 0
                twl[k] = 0.0
                if 32 * k + lane < n_hit:
                    sl[k] = mSlot[hl[k], 0]
            slots = TileSmem(scratch, OWN).allocate_tensor(Int32, cute.make_layout(OWN // 4), 16)
            sbase = slots.iterator.toint() + warp * (DS * ITEM)
            n_items = RWN * n_hit
            for jj in cutlass.range_constexpr(DS - 1):
                issue_b1(ptrs, t, Int32(jj), n_items, warp, lane, hl, sbase)
            shv = cute.make_rmem_tensor((RWN,), Float32)
            if cutlass.const_expr(gateup):
                mAct = gmem_tensor(ptrs[7], cutlass.BFloat16, (KT, I), 2)
            else:
                mTw = gmem_tensor(ptrs[7], Float32, (KT,), 4)
                for k in cutlass.range_constexpr(HL):
                    if 32 * k + lane < n_hit:
                        twl[k] = mTw[sl[k]]
                mOut = gmem_tensor(ptrs[9], odt, (1, D), 4 if c.out_dtype == "fp32" else 2)
                for ri in cutlass.range_constexpr(RWN):
                    shv[ri] = 0.0
                    if cutlass.const_expr(has_shared):
                        mSh = gmem_tensor(ptrs[8], Float32, (1, D), 4)
                        shv[ri] = mSh[0, t * R + warp + NW * ri]
                    if lane == 0:
                        scratch[warp * RWN + ri] = 0.0
            if cutlass.const_expr(HFMA2):
                xc = cute.make_rmem_tensor((XC_WORDS,), Int32)
            else:
                xc = cute.make_rmem_tensor((UG1 * (EPL // 8), 8), cutlass.BFloat16)
            if cutlass.const_expr(gateup):
                load_x_cache(mXg, Int32(0), xc)            # the token's x: every hit's input
            acc = cute.make_rmem_tensor((nw, 1), Float32)
            for h in cutlass.range(n_hit, unroll=1):
                slot = hit_of(sl, h)
                tw = Float32(0.0)
                if cutlass.const_expr(not gateup):
                    tw = hit_of(twl, h)
                    load_x_cache(mXg, slot, xc)            # the assignment's act row
                for ri in cutlass.range(RWN, unroll=1):
                    j = h * RWN + ri
                    issue_b1(ptrs, t, j + (DS - 1), n_items, warp, lane, hl, sbase)
                    cute.arch.cp_async_wait_group(DS - 1)     # item j has landed (this lane's copies)
                    cute.arch.sync_warp()                     # ... and every lane's
                    mW, mS = slot_views(sbase, j % DS)
                    row = t * R + warp + NW * ri
                    acc.fill(0.0)
                    f1c(mW, mS, xc, row, [Int32(0)], acc)
                    v = cute.arch.warp_reduction_sum(acc[0, 0])
                    if cutlass.const_expr(gateup):
                        v = swiglu_act(v, cute.arch.warp_reduction_sum(acc[1, 0]), limit, act, betas)
                        if lane == 0:
                            mAct[slot, row] = v.to(cutlass.BFloat16)
                    else:
                        if lane == 0:
                            scratch[warp * RWN + ri] = scratch[warp * RWN + ri] + v * tw
                    cute.arch.sync_warp()          # every lane is done with the slot: it is refilled next
            if cutlass.const_expr(not gateup):
                for ri in cutlass.range_constexpr(RWN):
                    if lane == 0:
                        mOut[0, t * R + warp + NW * ri] = (scratch[warp * RWN + ri] + shv[ri]).to(odt)
            cute.arch.cp_async_wait_group(0)       # no group of this tile outlives it (the ring counts its own)

        # -- the tensor-core tile (use_mma, MXFP4) ----------------------------------------------
        # Warp mma.sync m16n8k16 (f16 in, fp32 accumulate), swap-AB: weight rows are the MMA's M
        # (MT m-tiles of 16 cover the tile's R rows; rows past R repeat row R-1), the tokens of an
        # expert's group its N (8; tokens past the group's end are zero columns). K is cut into
        # steps of 128 (4 scale groups of 32); warp w takes steps w, w+8, ...; the warps' partial
        # sums meet in `scratch` (shared-memory atomics), then the epilogue runs from there.
        # In a step, thread (g, q) (lane = 4g + q) loads ONE 16-byte chunk (32 e2m1 = one scale
        # group: 4s + q) of each of its rows (g and g+8 of every m-tile, gate and up) and the same
        # 32 columns of x for token g. The scale word of the step holds all 4 groups' exponents;
        # the MMA sums the 4 groups of a row together, so each thread multiplies its decoded f16
        # pairs by 2^(s_q - s_max) (HMUL2; s_max = the row's largest of the 4: values it flushes
        # are < 2^-14 of the row's largest group) and the step's sum is scaled by 2^(s_max - 127)
        # in fp32. K is a reduction, so its order inside an MMA is free: MMA m of the step takes
        # the thread's decoded pairs (2(m%2), 2(m%2)+1) of word m//2 - pair p of a word is
        # elements (p, p+4) - for A, and the same elements of x for B. No conversion to fp32 per
        # weight: the MMA multiplies the f16 pairs the e2m1 decode produces.
        MT = -(-R // 16)
        RP = MT * 16
        STEPS = K // 128
        RW_ = R // NW                               # down epilogue: rows per warp
        RED = self.mma_red_words

        @cute.jit
        def f32x2_to_f16x2(lo: Float32, hi: Float32) -> Int32:
            return cute.arch.inline_ptx("cvt.rn.f16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32],
                                        read_only_args=[hi, lo])

        @cute.jit
        def decode_pairs(raw, factor: Int32):
            """16 f16x2 of one 16-byte e2m1 chunk, pair 4i + p = elements (8i+p, 8i+p+4), each
            the e2m1 value * 2^-14 * factor (f16x2)."""
            out = []
            for i in cutlass.range_constexpr(4):
                word = raw[i]
                for p in cutlass.range_constexpr(4):
                    out.append(mul_f16x2(e2m1_pair(word, p), factor))
            return out

        @cute.jit
        def zero_sums(scratch):
            tid, _, _ = cute.arch.thread_idx()
            for j in cutlass.range_constexpr(-(-RED // NUM_THREADS)):
                if tid + NUM_THREADS * j < RED:
                    scratch[tid + NUM_THREADS * j] = Float32(0.0)
            cute.arch.sync_threads()

        @cute.jit
        def tile_mma(ptrs, t: Int32, scratch):
            tid, _, _ = cute.arch.thread_idx()
            lane = tid % 32
            warp = tid // 32
            g = lane // 4
            q = lane % 4
            mCnt = gmem_tensor(ptrs[P_CNT], Int32, (L,), 4)
            mHits = gmem_tensor(ptrs[P_HITS], Int32, (L + 1,), 4)
            mTok = gmem_tensor(ptrs[P_TOK], Int32, (L, M), 4)
            mSlot = gmem_tensor(ptrs[P_SLOT], Int32, (L, M), 4)
            mX = gmem_tensor(ptrs[6], cutlass.BFloat16, (xrows, K // 8, 8), 16)
            if cutlass.const_expr(gateup):
                mAct = gmem_tensor(ptrs[7], cutlass.BFloat16, (M * KT, I), 2)
            else:
                mTw = gmem_tensor(ptrs[7], Float32, (M * KT,), 4)
                mOut = gmem_tensor(ptrs[9], odt, (M * KT if scatter else M, D), 4 if c.out_dtype == "fp32" else 2)
            # the thread's fragment rows (mt, h): tile row mt*16 + 8h + g, clamped to the tile
            frows = [Int32(cutlass.select_(mt * 16 + 8 * h + g < R, mt * 16 + 8 * h + g, R - 1))
                     for mt in range(MT) for h in range(2)]
            acc = cute.make_rmem_tensor((nw, MT, 4), Float32)
            osum = cute.make_rmem_tensor((max(RW_, 1), 2), Float32)      # down: tokens lane, lane+32
            osum.fill(0.0)
            zero_sums(scratch)
            n_hit = mHits[0]
            for hh in cutlass.range(n_hit, unroll=1):
                le = mHits[1 + hh]
                mW, mS = expert_views(ptrs, le)
                n = mCnt[le]
                for g0 in cutlass.range(0, n, 8, unroll=1):
                    ng = n - g0
                    # B: token g of the group (zero columns past its end)
                    has_tok = g < ng
                    xrow = Int32(0)
                    if has_tok:
                        if cutlass.const_expr(gateup):
                            xrow = mTok[le, g0 + g]
                        else:
                            xrow = mSlot[le, g0 + g]
                    acc.fill(0.0)
                    for st in cutlass.range(warp, STEPS, NW, unroll=1):
                        chunk = 4 * st + q
                        # every load of the step first: weights, scale words, x
                        raws = [[load_w(mW, t * R + frows[f] + i * I, chunk) for f in range(2 * MT)]
                                for i in range(nw)]
                        sws = [[mS[t * R + frows[f] + i * I, st] for f in range(2 * MT)] for i in range(nw)]
                        xv = cute.make_rmem_tensor((4, 8), Float32)
                        xv.fill(0.0)
                        if has_tok:
                            for wi in cutlass.range_constexpr(4):
                                xv[wi, None].store(mX[xrow, chunk * 4 + wi, None].load().to(Float32))
                        xp = [f32x2_to_f16x2(xv[k // 4, k % 4], xv[k // 4, k % 4 + 4]) for k in range(16)]
                        for i in cutlass.range_constexpr(nw):
                            for mt in cutlass.range_constexpr(MT):
                                pairs, rowscale = [], []
                                for h in cutlass.range_constexpr(2):
                                    sw = sws[i][2 * mt + h]
                                    e = [(sw >> (8 * b)) & 255 for b in range(4)]
                                    smax = Int32(cutlass.select_(e[0] > e[1], e[0], e[1]))
                                    smax = Int32(cutlass.select_(e[2] > smax, e[2], smax))
                                    smax = Int32(cutlass.select_(e[3] > smax, e[3], smax))
                                    eq = (sw >> (8 * q)) & 255
                                    d = eq - smax                                   # <= 0
                                    fb = Int32(cutlass.select_(d >= -14, (d + 15) << 10, 0))
                                    pairs.append(decode_pairs(raws[i][2 * mt + h], fb | (fb << 16)))
                                    # 2^(smax - 127) * 2^14: the e2m1 decode's bias
                                    rowscale.append(bits_to_f32((smax + 14) << 23))
                                cf = [Float32(0.0)] * 4
                                for m8 in cutlass.range_constexpr(8):
                                    k0 = 4 * (m8 // 2) + 2 * (m8 % 2)
                                    cf = list(mma_m16n8k16("f16", (pairs[0][k0], pairs[1][k0], pairs[0][k0 + 1],
                                                                   pairs[1][k0 + 1]), (xp[k0], xp[k0 + 1]), cf))
                                for v in cutlass.range_constexpr(4):
                                    acc[i, mt, v] = acc[i, mt, v] + rowscale[v // 2] * cf[v]
                    # the warps' partial sums: [weight][token j][row]; c0, c1 = row g, tokens 2q,
                    # 2q+1; c2, c3 = row g+8
                    for i in cutlass.range_constexpr(nw):
                        for mt in cutlass.range_constexpr(MT):
                            for v in cutlass.range_constexpr(4):
                                row = mt * 16 + g + 8 * (v // 2)
                                j = 2 * q + v % 2
                                cute.arch.atomic_add(scratch.iterator + ((i * 8 + j) * RP + row), acc[i, mt, v],
                                                     scope="cta")
                    cute.arch.sync_threads()
                    # epilogue of the group, then its sums are zeroed for the next one
                    if cutlass.const_expr(gateup or scatter):
                        for e in cutlass.range_constexpr(-(-(8 * R) // NUM_THREADS)):
                            o = tid + NUM_THREADS * e
                            if o < 8 * R:
                                j = o // R
                                row = o - j * R
                                if j < ng:
                                    v = scratch[j * RP + row]
                                    slot = mSlot[le, g0 + j]
                                    if cutlass.const_expr(gateup):
                                        v = swiglu_act(v, scratch[(8 + j) * RP + row], limit, act, betas)
                                        mAct[slot, t * R + row] = v.to(cutlass.BFloat16)
                                    else:
                                        mOut[slot, t * R + row] = v.to(odt)
                    else:
                        for rr in cutlass.range_constexpr(RW_):
                            row = warp + NW * rr
                            for j in cutlass.range_constexpr(8):
                                if j < ng:
                                    v = scratch[j * RP + row] * mTw[mSlot[le, g0 + j]]
                                    m_tok = mTok[le, g0 + j]
                                    if m_tok == lane:
                                        osum[rr, 0] = osum[rr, 0] + v
                                    if m_tok == lane + 32:
                                        osum[rr, 1] = osum[rr, 1] + v
                    cute.arch.sync_threads()
                    zero_sums(scratch)
            if cutlass.const_expr(not gateup and not scatter):
                for rr in cutlass.range_constexpr(RW_):
                    row = warp + NW * rr
                    for half in cutlass.range_constexpr(2):
                        m_out = lane + 32 * half
                        if m_out < M:
                            v = osum[rr, half]
                            if cutlass.const_expr(has_shared):
                                mSh = gmem_tensor(ptrs[8], Float32, (M, D), 4)
                                v = v + mSh[m_out, t * R + row]
                            mOut[m_out, t * R + row] = v.to(odt)

        if self.use_mma:
            return tile_mma
        return tile_b1 if B1 else tile
