"""mHC (manifold-constrained hyper-connections) device blocks: the residual of DeepSeek-V4(.1) and
GLM-5.3, twice per layer. The definition is sdk/reference/mhc.py (MHCResidual, proven equal to
transformers); this module cuts it into three blocks (docs/mhc.md):

    X [M, N, D]: the N residual streams of M tokens (stream dtype bf16 or fp32)

    MHCMixBlock   tile = a D-slice (all tokens):  part[s, m, r] = sum_{n, d in slice} fn[r, n*D + d] X[m, n, d]
                                                  part[s, m, R] = sum_{n, d in slice} X[m, n, d]^2
    MHCPreBlock   tile = one token: sums the slices' partials; rstd = rsqrt(sumsq / (N D) + norm_eps);
                  mix = part * rstd (== RMSNorm(flatten X) @ fn^T); the coefficients
                    kind "sublayer": pre = sigmoid(mix_pre s0 + b) + eps, post = 2 sigmoid(mix_post s1 + b),
                                     comb = Sinkhorn(softmax_row(mix_comb s2 + b) + eps)  -> coef [M, 2N + N*N]
                    kind "head":     pre = sigmoid(mix s0 + b) + eps                       (V4's weighted head)
                    kind "mean":     pre = 1 / N, no partials, no weights                   (GLM-5.3's head)
                    kind "carried":  no coefficients: the head collapses with the carried pre (V4.1)
                  and the collapsed input c = sum_n pre_n X_n (rounded to the stream dtype, as the
                  reference), fused with the RMSNorm that follows it (out_norm: the sublayer's pre-norm
                  or the model's final norm, `common.rms_norm`: normalise, cast, times the weight).
                  V4.1's lagged pre-mix (`lagged`, kind "sublayer"): c = sum_n carried_n X_n with the
                  pre the PREVIOUS site emitted (operand `carried`: that site's coef, its first N
                  columns; the model's first site: FIRST_SITE_CARRY's one-hot, stream 0 itself); this
                  site's own pre goes to coef as always, for the next site (or the "carried" head).
                  The collapse then needs none of this tile's coefficients and runs first; or it is
                  its own op - kind "carried" - and this one computes the coefficients only
                  (`collapse=False`, no out), so the sublayer need not wait for them.
    MHCPostBlock  tile = a D-slice (all tokens): X'_n = post_n y + sum_j comb[j, n] X_j  (the residual
                  write, in place allowed), fused with the NEXT pre-mix's partials (next_rows > 0:
                  the next sublayer's or the head's fn), so each layer's second and later mixes cost
                  no extra pass over the streams. Under tensor parallelism the same tile is the
                  all-reduce's mHC epilogue (AllReduceConfig.mhc_streams; y = the reduced sum).
                  round_coef: post / comb rounded to the stream dtype first (V4, transformers) or
                  used in fp32 (V4.1's post, one rounding of the sum).

Why this cut: the mix GEMV streams fn ((2+N)N x N D fp32 = 1.97 MB per call at V4.1-Flash, D=5120)
and is spread over D / d_slice tiles (40 at d_slice 128) - one CTA would take ~60 us to read it;
the coefficients (24 numbers, a 4x4 Sinkhorn of 20 iterations) need the whole token's reduction,
so they and the collapse sit in a per-token tile that reads the token's N D stream values once
(80 KB fp32) and also applies the sublayer's RMSNorm (its full-row reduction is already there).
The post-mix needs only per-element data plus the token's coefficients, so it is sliced like the
mix and does the next mix's partial dot products on the values it just wrote (registers).

Device layout: D-slice tiles use one warp per token (tokens w, w + 8, ...), lanes over 4-element
vectors of the slice (d_slice / 128 vectors per stream per lane); fn's slice is staged once per
tile in shared memory (fp32, (2+N)N x N x d_slice x 4 B = 48 KB at V4.1's shapes) by the block's
prologue, before the instruction's wait (fn is a weight). The per-token tile loads the token's
streams first, the 8 warps sum the partials (warp w every 8th slice), warp 0 computes the
coefficients with lane (i, j) = (l // N, l % N) owning comb[i, j] (row sums: xor-shuffles over
the low log2(N) lane bits, column sums over the next log2(N) bits; Sinkhorn is 2
shuffle-reductions and one division per lane per step), then all threads collapse (D / 1024
4-vectors each) and normalise.

Supported: N in {1, 2, 4} (N*N <= 32 lanes, power of two: V4.1-Flash and GLM-5.3 use 4), D a
multiple of 1024 (per-token tile) and of d_slice, d_slice a multiple of 128, M = 1..64, streams
bf16 or fp32, fn fp32 or bf16 (staged as fp32), y bf16 or fp32, V4.1's lagged pre-mix. Not supported:
fp8 streams.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import NUM_THREADS, Block, Cost, DTYPES, OperandSpec

NUM_WARPS = NUM_THREADS // 32


def first_site_carry(m: int, n: int) -> torch.Tensor:
    """The `carried` operand of the model's first lagged site: [M, (2+N)N] fp32, pre = one-hot on
    stream 0 (V4.1 feeds the first sublayer stream 0 itself, the embedding; 1 x X_0 + 0 x X_j is
    X_0 exactly)."""
    c = torch.zeros(m, (2 + n) * n)
    c[:, 0] = 1.0
    return c


def mix_rows(n: int, kind: str = "sublayer") -> int:
    """Rows of fn: (2 + N) N for a sublayer's mix (pre, post, comb), N for the weighted head."""
    return (2 + n) * n if kind == "sublayer" else n


PRE_KINDS = ("sublayer", "head", "mean", "carried")


def _check_common(blk, c, need_slice=True):
    if c.n not in (1, 2, 4):
        blk.unsupported(f"{blk.name}: hc_mult={c.n} (supported: 1, 2, 4)")
    if not 1 <= c.m <= 64:
        blk.unsupported(f"{blk.name}: m={c.m} tokens (supported: 1..64)")
    if c.stream_dtype not in ("bf16", "fp32"):
        blk.unsupported(f"{blk.name}: stream dtype {c.stream_dtype!r} (bf16, fp32)")
    if need_slice and (c.d_slice % 128 or c.d % c.d_slice):
        blk.unsupported(f"{blk.name}: d_slice={c.d_slice} must be a multiple of 128 dividing d={c.d}")


def fn_slice_smem_bytes(rows: int, n: int, d_slice: int) -> int:
    """Shared memory of a D-slice tile that stages fn's slice (fp32, all rows and streams)."""
    return rows * n * d_slice * 4


def _round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values as stored in `dtype` (the rounding a device store does), back in fp32."""
    return x.to(DTYPES[dtype]).float()


def slice_partials(x: torch.Tensor, fn: torch.Tensor, n: int, d: int, lo: int, hi: int) -> torch.Tensor:
    """[M, R + 1] fp32: dot products of fn's rows with X over d in [lo, hi) of every stream, and
    the sum of squares (last column). x [M, N, D] fp32, fn [R, N*D]."""
    xs = x[:, :, lo:hi].float()                                   # [M, N, w]
    fs = fn.float().view(-1, n, d)[:, :, lo:hi]                   # [R, N, w]
    dots = torch.einsum("mnw,rnw->mr", xs, fs)
    return torch.cat([dots, xs.square().sum(dim=(1, 2))[:, None]], dim=1)


def sinkhorn_rows_cols(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference's Sinkhorn order (columns, then iters - 1 x (rows, columns)) in fp32."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def coefficients(raw: torch.Tensor, sumsq: torch.Tensor, base, scale, n: int, nd: int, kind: str,
                 iters: int, eps: float, norm_eps: float) -> torch.Tensor:
    """From the summed partials raw [M, R] and sumsq [M]: the coefficients [M, R'] in fp32 in the
    device's order (dot, then times rstd). sublayer: [pre N, post N, comb N*N]; head: [pre N]."""
    rstd = torch.rsqrt(sumsq / nd + norm_eps)[:, None]
    mix = raw * rstd
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    if kind == "head":
        return pre
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax(mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n), dim=-1) + eps
    comb = sinkhorn_rows_cols(comb, iters, eps)
    return torch.cat([pre, post, comb.flatten(1)], dim=1)


# ================================================================================ MHCMixBlock
@dataclass(frozen=True)
class MHCMixConfig:
    d: int                       # hidden size D
    n: int = 4                   # hc_mult N
    m: int = 1                   # tokens
    rows: int = 24               # fn rows: (2+N)N (sublayer) or N (head)
    d_slice: int = 128           # D elements per tile (every stream)
    stream_dtype: str = "fp32"
    fn_dtype: str = "fp32"


class MHCMixBlock(Block):
    """The pre-mix GEMV's partial sums over D-slices (first layer, or when not fused in the post)."""
    name = "mhc_mix"
    Config = MHCMixConfig

    @property
    def slices(self) -> int:
        return self.config.d // self.config.d_slice

    def check(self):
        c = self.config
        _check_common(self, c)
        if not 1 <= c.rows <= 32 or c.fn_dtype not in ("fp32", "bf16"):
            self.unsupported(f"mhc_mix: rows={c.rows} (1..32), fn dtype {c.fn_dtype!r} (fp32, bf16)")

    def operand_specs(self):
        c = self.config
        return [OperandSpec("streams", (c.m, c.n, c.d), c.stream_dtype),
                OperandSpec("fn", (c.rows, c.n * c.d), c.fn_dtype),
                OperandSpec("part", (self.slices, c.m, c.rows + 1), "fp32", output=True)]

    def num_tiles(self) -> int:
        return self.slices

    def own_smem_bytes(self) -> int:
        c = self.config
        return fn_slice_smem_bytes(c.rows, c.n, c.d_slice)

    def cost(self) -> Cost:
        c = self.config
        el = c.n * c.d_slice
        return Cost(bytes=c.rows * el * (4 if c.fn_dtype == "fp32" else 2)
                    + c.m * el * (4 if c.stream_dtype == "fp32" else 2) + c.m * (c.rows + 1) * 4,
                    flops=2 * c.m * el * (c.rows + 1))

    def reference(self, **t):
        c = self.config
        parts = [slice_partials(t["streams"], t["fn"], c.n, c.d, s * c.d_slice, (s + 1) * c.d_slice)
                 for s in range(self.slices)]
        return {"part": torch.stack(parts)}

    def emulate_tile(self, t, tile):
        c = self.config
        lo = tile * c.d_slice
        t["part"][tile] = slice_partials(t["streams"], t["fn"], c.n, c.d, lo, lo + c.d_slice).to(t["part"].dtype)

    def has_prologue(self) -> bool:
        return True                  # fn's slice (a weight) staged before the wait

    def _build_device_tile(self):
        from ._mhc_cute import build_mix_tile
        return build_mix_tile(self)[0]

    def _build_device_prologue(self):
        from ._mhc_cute import build_mix_tile
        return build_mix_tile(self)[1]


# ================================================================================ MHCPreBlock
@dataclass(frozen=True)
class MHCPreConfig:
    d: int
    n: int = 4
    m: int = 1
    kind: str = "sublayer"       # "sublayer" | "head" (weighted) | "mean" | "carried" (V4.1's head)
    slices: int = 40             # partials to sum (the producer's D / d_slice)
    iters: int = 20              # Sinkhorn iterations
    hc_eps: float = 1e-6         # pre floor and Sinkhorn eps
    norm_eps: float = 1e-6       # the flattened streams' RMSNorm (model norm_eps)
    out_norm: bool = True        # fuse the following RMSNorm (weight operand, fp32)
    out_eps: float = 1e-6
    stream_dtype: str = "fp32"
    out_dtype: str = "bf16"
    lagged: bool = False         # V4.1 (kind "sublayer"): collapse with the previous site's pre
    collapse: bool = True        # False: the coefficients only (no out; V4.1 collapses in a "carried" op)
    write_coef: bool = True      # False: the pre only, for this tile's collapse, and no coef output - the
                                 # v4 site's hc_pre when an op of its own (collapse=False) computes the
                                 # coefficients beside the sublayer: the Sinkhorn off the sublayer's path


class MHCPreBlock(Block):
    """Per token: coefficients (sigmoid / softmax + Sinkhorn), collapse, fused RMSNorm."""
    name = "mhc_pre"
    Config = MHCPreConfig

    @property
    def rows(self) -> int:
        return 0 if self.config.kind in ("mean", "carried") else mix_rows(self.config.n, self.config.kind)

    @property
    def coef_width(self) -> int:
        n = self.config.n
        return (2 + n) * n if self.config.kind == "sublayer" else n

    @property
    def uses_carried(self) -> bool:
        """The collapse takes the pre from the `carried` operand (V4.1's sites and head)."""
        return self.config.lagged or self.config.kind == "carried"

    def check(self):
        c = self.config
        _check_common(self, c, need_slice=False)
        if c.kind not in PRE_KINDS:
            self.unsupported(f"mhc_pre: kind {c.kind!r} ({', '.join(PRE_KINDS)})")
        if not c.collapse and (c.lagged or not self.rows):
            self.unsupported(f"mhc_pre: collapse=False computes coefficients only: kind 'sublayer' or "
                             f"'head', not lagged (got kind {c.kind!r}, lagged={c.lagged})")
        if not c.write_coef and (not c.collapse or c.kind not in ("sublayer", "head") or c.lagged):
            self.unsupported(f"mhc_pre: write_coef=False computes the pre for this tile's own collapse: "
                             f"kind 'sublayer' or 'head', collapse, not lagged (got kind {c.kind!r}, "
                             f"collapse={c.collapse}, lagged={c.lagged})")
        if c.lagged and c.kind != "sublayer":
            self.unsupported(f"mhc_pre: lagged applies to kind 'sublayer' (got {c.kind!r}; V4.1's head "
                             f"is kind 'carried')")
        if c.d % (4 * NUM_THREADS):
            self.unsupported(f"mhc_pre: d={c.d} must be a multiple of {4 * NUM_THREADS}")
        if self.rows and not 1 <= c.slices <= 1024:
            self.unsupported(f"mhc_pre: slices={c.slices}")
        if c.kind == "sublayer" and c.iters < 1:
            self.unsupported("mhc_pre: sinkhorn iters >= 1")
        if c.out_dtype not in ("bf16", "fp32"):
            self.unsupported(f"mhc_pre: out dtype {c.out_dtype!r}")

    def operand_specs(self):
        c = self.config
        nomix = not self.rows
        return [OperandSpec("streams", (c.m, c.n, c.d), c.stream_dtype),
                OperandSpec("part", (c.slices, c.m, self.rows + 1), "fp32", optional=nomix),
                OperandSpec("base", (max(self.rows, 1),), "fp32", optional=nomix),
                OperandSpec("scale", (3 if c.kind == "sublayer" else 1,), "fp32", optional=nomix),
                OperandSpec("norm_weight", (c.d,), "fp32", optional=not (c.out_norm and c.collapse)),
                # the previous site's coef: its first N columns are the pre this collapse uses
                OperandSpec("carried", (c.m, (2 + c.n) * c.n), "fp32", optional=not self.uses_carried),
                OperandSpec("coef", (c.m, self.coef_width), "fp32", output=True,
                            optional=c.kind == "carried" or not c.write_coef),
                OperandSpec("out", (c.m, c.d), c.out_dtype, output=True, optional=not c.collapse)]

    def num_tiles(self) -> int:
        return self.config.m

    def cost(self) -> Cost:
        c = self.config
        sb = 4 if c.stream_dtype == "fp32" else 2
        b = c.slices * (self.rows + 1) * 4 if self.rows else 0
        if not c.collapse:
            return Cost(bytes=b + self.coef_width * 4, flops=0)
        b += c.n * c.d * sb + c.d * (2 if c.out_dtype == "bf16" else 4)
        return Cost(bytes=b + (4 * c.d if c.out_norm else 0), flops=2 * c.n * c.d + 4 * c.d)

    def _coef(self, t, m):
        c = self.config
        if c.kind == "mean":
            return torch.full((len(m), c.n), 1.0 / c.n)
        if c.kind == "carried":
            return None
        tot = t["part"][:, m].float().sum(0)                    # [|m|, R + 1]
        # write_coef=False needs the pre alone; the whole set costs nothing here (the twin)
        return coefficients(tot[:, :-1], tot[:, -1], t["base"], t["scale"], c.n, c.n * c.d, c.kind,
                            c.iters, c.hc_eps, c.norm_eps)

    def _collapse(self, t, m, coef):
        c = self.config
        x = t["streams"][m].float()                             # [|m|, N, D]
        if c.kind == "mean":
            col = x.sum(1) / c.n
        else:
            pre = t["carried"][m].float()[:, :c.n] if self.uses_carried else coef[:, :c.n]
            col = (pre[:, :, None] * x).sum(1)
        col = _round(col, c.stream_dtype)                       # the reference's .to(stream dtype)
        if not c.out_norm:
            return col
        h = _round(col * torch.rsqrt(col.square().mean(-1, keepdim=True) + c.out_eps), c.stream_dtype)
        return h * t["norm_weight"].float()

    def reference(self, **t):
        m = list(range(self.config.m))
        coef = self._coef(t, m)
        out = {"out": self._collapse(t, m, coef)} if self.config.collapse else {}
        return out if coef is None or not self.config.write_coef else {"coef": coef, **out}

    def emulate_tile(self, t, tile):
        coef = self._coef(t, [tile])
        if coef is not None and self.config.write_coef:
            t["coef"][tile] = coef[0].to(t["coef"].dtype)
        if self.config.collapse:
            t["out"][tile] = self._collapse(t, [tile], coef)[0].to(t["out"].dtype)

    def _build_device_tile(self):
        from ._mhc_cute import build_pre_tile
        return build_pre_tile(self)


# ================================================================================ MHCPostBlock
@dataclass(frozen=True)
class MHCPostConfig:
    d: int
    n: int = 4
    m: int = 1
    d_slice: int = 128
    stream_dtype: str = "fp32"
    y_dtype: str = "bf16"        # the sublayer's output
    next_rows: int = 0           # > 0: fuse the next mix's partials ((2+N)N, or N for the head)
    fn_dtype: str = "fp32"
    round_coef: bool = True      # post / comb rounded to the stream dtype (V4); False: fp32 (V4.1)


class MHCPostBlock(Block):
    """X'_n = post_n y + sum_j comb[j, n] X_j over a D-slice (all tokens); optionally the next
    pre-mix's partials of X'. `streams_out` may alias `streams` (each element is read and written
    by the same thread)."""
    name = "mhc_post"
    Config = MHCPostConfig

    @property
    def slices(self) -> int:
        return self.config.d // self.config.d_slice

    def check(self):
        c = self.config
        _check_common(self, c)
        if c.y_dtype not in ("bf16", "fp32") or c.fn_dtype not in ("fp32", "bf16"):
            self.unsupported(f"mhc_post: y dtype {c.y_dtype!r}, fn dtype {c.fn_dtype!r}")
        if not 0 <= c.next_rows <= 32:
            self.unsupported(f"mhc_post: next_rows={c.next_rows} (0..32)")

    def operand_specs(self):
        c = self.config
        nx = c.next_rows == 0
        return [OperandSpec("streams", (c.m, c.n, c.d), c.stream_dtype),
                OperandSpec("y", (c.m, c.d), c.y_dtype),
                OperandSpec("coef", (c.m, (2 + c.n) * c.n), "fp32"),
                OperandSpec("fn_next", (max(c.next_rows, 1), c.n * c.d), c.fn_dtype, optional=nx),
                OperandSpec("streams_out", (c.m, c.n, c.d), c.stream_dtype, output=True),
                OperandSpec("part_next", (self.slices, c.m, c.next_rows + 1), "fp32", output=True, optional=nx)]

    def num_tiles(self) -> int:
        return self.slices

    def own_smem_bytes(self) -> int:
        c = self.config
        return fn_slice_smem_bytes(c.next_rows, c.n, c.d_slice)

    def cost(self) -> Cost:
        c = self.config
        sb = 4 if c.stream_dtype == "fp32" else 2
        el = c.n * c.d_slice
        b = 2 * c.m * el * sb + c.m * c.d_slice * (2 if c.y_dtype == "bf16" else 4)
        b += c.next_rows * el * (4 if c.fn_dtype == "fp32" else 2) + (c.m * (c.next_rows + 1) * 4 if c.next_rows else 0)
        return Cost(bytes=b, flops=2 * c.m * el * (c.n + 1 + c.next_rows))

    def _mix(self, t, lo, hi, y):
        """X'[:, :, lo:hi] from y [M, hi - lo] (fp32 values)."""
        c = self.config
        n = c.n
        coef = t["coef"].float()
        rnd = (lambda v: _round(v, c.stream_dtype)) if c.round_coef else (lambda v: v)
        post = rnd(coef[:, n:2 * n])                                        # V4's .to(dtype)
        comb = rnd(coef[:, 2 * n:].view(-1, n, n))
        x = t["streams"][:, :, lo:hi].float()
        new = post[:, :, None] * y[:, None, :] + torch.einsum("mjn,mjd->mnd", comb, x)
        return _round(new, c.stream_dtype)

    def reference(self, **t):
        c = self.config
        new = self._mix(t, 0, c.d, t["y"].float())
        out = {"streams_out": new}
        if c.next_rows:
            out["part_next"] = torch.stack([slice_partials(new, t["fn_next"], c.n, c.d, s * c.d_slice,
                                                           (s + 1) * c.d_slice) for s in range(self.slices)])
        return out

    def emulate_tile(self, t, tile):
        c = self.config
        self.emulate_slice(t, tile, t["y"][:, tile * c.d_slice:(tile + 1) * c.d_slice].float())

    def emulate_slice(self, t, tile, y):
        """The tile's work given y over its slice as fp32 values [M, d_slice] (also the
        all-reduce's mHC epilogue, where y is the reduced sum, not an operand)."""
        c = self.config
        lo, hi = tile * c.d_slice, (tile + 1) * c.d_slice
        new = self._mix(t, lo, hi, y)
        if c.next_rows:
            # the partials use the slice's new values as stored (rounded to the stream dtype)
            full = torch.zeros(c.m, c.n, c.d)
            full[:, :, lo:hi] = new
            t["part_next"][tile] = slice_partials(full, t["fn_next"], c.n, c.d, lo, hi).to(t["part_next"].dtype)
        t["streams_out"][:, :, lo:hi] = new.to(t["streams_out"].dtype)

    def has_prologue(self) -> bool:
        return self.config.next_rows > 0     # the next mix's fn slice (a weight) staged before the wait

    def _build_device_tile(self):
        from ._mhc_cute import build_post_tile
        return build_post_tile(self)

    def _build_device_prologue(self):
        from ._mhc_cute import build_post_prologue
        return build_post_prologue(self)


# ================================================================================ helpers
def mhc_compile_cases() -> list:
    """Static configs for the no-GPU compile checks: V4.1-Flash (D 5120) and GLM-5.3 (D 4096)."""
    return [
        MHCMixBlock(MHCMixConfig(d=5120, m=1)),
        MHCMixBlock(MHCMixConfig(d=4096, m=64, rows=4, stream_dtype="bf16", fn_dtype="bf16")),
        MHCPreBlock(MHCPreConfig(d=5120, m=8, slices=40)),
        MHCPreBlock(MHCPreConfig(d=5120, m=1, kind="head", slices=40, stream_dtype="bf16")),
        MHCPreBlock(MHCPreConfig(d=4096, m=64, kind="mean", slices=32, out_dtype="fp32")),
        MHCPreBlock(MHCPreConfig(d=5120, m=8, slices=40, stream_dtype="bf16", lagged=True)),      # V4.1
        MHCPreBlock(MHCPreConfig(d=5120, m=1, kind="carried", stream_dtype="bf16")),
        MHCPreBlock(MHCPreConfig(d=5120, m=8, slices=40, stream_dtype="bf16", collapse=False)),
        MHCPreBlock(MHCPreConfig(d=4096, m=1, slices=32, stream_dtype="bf16", write_coef=False)),  # GLM v4 site
        MHCPostBlock(MHCPostConfig(d=5120, m=1, next_rows=24)),
        MHCPostBlock(MHCPostConfig(d=5120, m=8, next_rows=24, stream_dtype="bf16", round_coef=False)),
        MHCPostBlock(MHCPostConfig(d=4096, m=64, d_slice=256, stream_dtype="bf16", y_dtype="fp32")),
    ]


def weights_of(w: dict, prefix: str) -> dict:
    """fn / base / scale of one site (`layers.{i}.hc_attn.` ...) as the blocks' fp32 operands."""
    return {"fn": w[prefix + "fn"].float().contiguous(), "base": w[prefix + "base"].float().contiguous(),
            "scale": w[prefix + "scale"].float().contiguous()}

