"""CuTe DSL helpers shared by the blocks and the megakernel. Imports cutlass: import this module
only inside functions that build device code (never at `import sdk`).

- `gmem_tensor(ptr, dtype, shape, align)`: a global tensor with a static row-major layout over a
  raw int64 device address (operand-table entries are raw addresses).
- `smem_tensor(addr, dtype, shape)`: the same over a shared-memory address (ring stages).
- `block_sum(value, scratch)`, `block_sum_multi(values, scratch)`: fp32 sums over the CTA.
- `bounded_wait(...)`: the one spin-wait of every block and the megakernel: acquire polls bounded by
  globaltimer, ending in the error word instead of a hang.
- `peer_wait(...)`: bounded_wait on a flag a peer rank raises (all-reduce, EP).
- `write_hit_list(...)`: the ascending list of experts with tokens, from their counts (router, EP).
- `producer_slot()`: this thread's index among the threads that issue the ring's copies (-1: none).
- `stream_tile(...)`: one tile of a streaming block through the smem ring (the chunk loop shared
  by the megakernel and the standalone kernel).
- `standalone(block, arch)`: the block's own kernel for tests and benchmarks: one CTA per tile,
  or, for a streaming block, a persistent grid (one CTA per SM) walking tiles bid, bid + grid, ...
  through the same smem ring as the megakernel, launched with PDL by default (`pdl=False` opts out).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from .allreduce import ERR_PEER_TIMEOUT
from .base import NUM_THREADS, PRODUCER_FIRST, SCRATCH_WORDS, coresident_stages, ring_geometry, ring_mode
from .formats import E2M1_STEPS

DTYPE_MAP = {
    "bf16": cutlass.BFloat16,
    "fp32": cutlass.Float32,
    "fp8_e4m3": cutlass.Float8E4M3FN,
    "int32": cutlass.Int32,
}


def row_major(shape) -> "cute.Layout":
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return cute.make_layout(tuple(shape), stride=tuple(reversed(stride)))


@cute.jit
def gmem_tensor(addr: Int64, dtype: cutlass.Constexpr, shape: cutlass.Constexpr, align: cutlass.Constexpr = 16):
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)
    return cute.make_tensor(ptr, row_major(shape))


@cute.jit
def swiglu_act(gate: Float32, up: Float32, limit: cutlass.Constexpr, activation: cutlass.Constexpr = "silu",
               betas: cutlass.Constexpr = (4.0, 25.0)) -> Float32:
    """The gated epilogue of the GEMV and expert tiles, for one output, in fp32 (the caller rounds
    once when it stores): activation "silu": silu(gate) * up; "situ" (Kimi K3): beta *
    tanh(gate / beta) * sigmoid(gate) * beta_lin * tanh(up / beta_lin), (beta, beta_lin) = betas
    (sdk/reference/common.py `situ`). The optional clamp limit (gate <= limit, |up| <= limit;
    None: no clamp) applies before either. SiTU's tanh is cute.math.tanh without approx (the
    tanh.approx.f32 instruction's ~2^-11 relative error would be a quarter of a bf16 ulp)."""
    if cutlass.const_expr(limit is not None):
        gate = cute.arch.fmin(gate, Float32(limit))
        up = cute.arch.fmax(cute.arch.fmin(up, Float32(limit)), Float32(-limit))
    out = Float32(0.0)
    if cutlass.const_expr(activation == "situ"):
        b, bl = betas
        g_cap = Float32(b) * cute.math.tanh(gate * Float32(1.0 / b))
        u_cap = Float32(bl) * cute.math.tanh(up * Float32(1.0 / bl))
        out = g_cap / (Float32(1.0) + cute.math.exp(-gate, fastmath=True)) * u_cap
    else:
        out = gate / (Float32(1.0) + cute.math.exp(-gate, fastmath=True)) * up
    return out


@cute.jit
def bits_to_f32(bits: Int32) -> Float32:
    """The fp32 whose bit pattern is `bits` (a register move: built exponents, bit-placed decodes)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[bits])


@cute.jit
def f32_bits(x: Float32) -> Int32:
    """The bit pattern of the fp32 x (a register move)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[x])


@cute.jit
def ue8m0_exponent(amax: Float32, max_value: cutlass.Constexpr) -> Int32:
    """formats.ue8m0_exponents for one group's max |x| >= 0, from its bits: the smallest E
    with amax <= max_value * 2^(E - 127) is amax's biased exponent + 1 - em, + 1 when its mantissa
    exceeds that of fm (max_value = fm 2^em, fm in [0.5, 1)); clamped to [0, 254] (amax 0: 0)."""
    fm, em = math.frexp(max_value)
    bits = f32_bits(amax)
    e = ((bits >> 23) & 255) + (1 - em)
    if (bits & 0x7FFFFF) > int((2 * fm - 1) * (1 << 23)):
        e = e + 1
    if e < 0:
        e = Int32(0)
    if e > 254:
        e = Int32(254)
    return e


@cute.jit
def div_rn(a: Float32, b: Float32) -> Float32:
    """IEEE a / b, rounded to nearest (torch's division: the quantisers' reference)."""
    return cute.arch.inline_ptx("div.rn.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


@cute.jit
def e2m1_code(y: Float32) -> Int32:
    """The E2M1 code of y, a value already divided by (or times the reciprocal of) its scale
    (formats.e2m1_codes: nearest, ties to even, saturating at 6; the sign bit kept)."""
    a = cute.arch.fmax(y, -y)
    code = Int32(0)
    for t_, inclusive in E2M1_STEPS:
        if cutlass.const_expr(inclusive):
            code = code + Int32(cutlass.select_(a >= Float32(t_), 1, 0))
        else:
            code = code + Int32(cutlass.select_(a > Float32(t_), 1, 0))
    if y < Float32(0.0):
        code = code | 8
    return code


def redux_u32(x, op: str, dtype=Int32):
    """Warp-wide unsigned `op` ("max" / "min") of the 32-bit x (redux.sync, sm_80+), as `dtype`
    (Int32 or Uint32); every lane gets it. A plain helper: the PTX string depends on op."""
    return cute.arch.inline_ptx(f"redux.sync.{op}.u32 {{$w0}}, {{$r0}}, 0xffffffff;",
                                write_only_types=[dtype], read_only_args=[x])


@cute.jit
def e4m3x4_to_f16x2x2(word: Int32):
    """Four e4m3 bytes (one 32-bit word) -> two f16x2 words (bytes 0, 1 and 2, 3): two
    cvt.rn.f16x2.e4m3x2, exact (every e4m3 value is an f16)."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, {$r0}; "
        "cvt.rn.f16x2.e4m3x2 {$w0}, lo; cvt.rn.f16x2.e4m3x2 {$w1}, hi; }",
        write_only_types=[Int32, Int32], read_only_args=[word])


@cute.jit
def e4m3x4_to_f16x2x2_shifted(word: Int32):
    """Four e4m3 bytes -> two f16x2 words holding bytes (0, 2) and (1, 3), each the e4m3 value
    times 2^-8 exactly (subnormals too), in integer ops only (no F2FP): an e4m3 byte s|eeee|mmm
    placed as f16 bits s|0eeee|mmm0000000 - the sign to bit 15, the other 7 bits to 7..13 - is
    its value times 2^(7 - 15). Bytes 1, 3 sit in bits 8..15 / 24..31 already; bytes 0, 2 first
    move there (word << 8)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 t, s, v; "
        "and.b32 t, {$r0}, 0x7F007F00; shr.b32 t, t, 1; and.b32 s, {$r0}, 0x80008000; or.b32 {$w1}, t, s; "
        "shl.b32 v, {$r0}, 8; "
        "and.b32 t, v, 0x7F007F00; shr.b32 t, t, 1; and.b32 s, v, 0x80008000; or.b32 {$w0}, t, s; }",
        write_only_types=[Int32, Int32], read_only_args=[word])


@cute.jit
def lane_list_get(regs, i, n: cutlass.Constexpr):
    """Entry i of a warp-held list of up to 32 n values (entry 32 k + lane in regs[k] of that lane),
    each lane its own i; every lane must call it (n shuffles)."""
    v = cute.arch.shuffle_sync(regs[0], i % 32)
    for k in cutlass.range_constexpr(1, n):
        v = cutlass.select_(i >= 32 * k, cute.arch.shuffle_sync(regs[k], i % 32), v)
    return v


@cute.jit
def mul_f16x2(a: Int32, b: Int32) -> Int32:
    return cute.arch.inline_ptx("mul.rn.f16x2 {$w0}, {$r0}, {$r1};", write_only_types=[Int32],
                                read_only_args=[a, b])


@cute.jit
def fma_f16x2(a: Int32, b: Int32, c: Int32) -> Int32:
    """a * b + c on f16 pairs (one HFMA2)."""
    return cute.arch.inline_ptx("fma.rn.f16x2 {$w0}, {$r0}, {$r1}, {$r2};", write_only_types=[Int32],
                                read_only_args=[a, b, c])


@cute.jit
def f16x2_sum_f32(v: Int32) -> Float32:
    """The two f16 halves of v, widened and added in fp32."""
    lo, hi = cute.arch.inline_ptx(
        "{ .reg .b16 l, h; mov.b32 {l, h}, {$r0}; cvt.f32.f16 {$w0}, l; cvt.f32.f16 {$w1}, h; }",
        write_only_types=[Float32, Float32], read_only_args=[v])
    return lo + hi


@cute.jit
def bf16x8_to_f16_pairs(w0: Int32, w1: Int32, w2: Int32, w3: Int32, x_exp: cutlass.Constexpr):
    """Eight bf16 (four words; word k holds elements 2k, 2k + 1) times 2^x_exp -> four f16x2
    words, pair p = elements (p, p + 4) - e2m1_pair's order: word p // 2 and word p // 2 + 2,
    half p % 2. A bf16 half widens to fp32 by placement (low: << 16, high: & 0xFFFF0000) with
    x_exp added to its exponent field in the same integer op (a zero or bf16-subnormal input
    becomes ~2^(x_exp - 127), which rounds to f16 zero), then each two round to f16 together,
    clamped to +-65504 (satfinite)."""
    bias = x_exp << 23
    return cute.arch.inline_ptx(
        "{ .reg .b32 a, b; .reg .f32 fa, fb; "
        f"mad.lo.u32 a, {{$r0}}, 65536, {bias}; mad.lo.u32 b, {{$r2}}, 65536, {bias}; mov.b32 fa, a; mov.b32 fb, b; "
        "cvt.rn.satfinite.f16x2.f32 {$w0}, fb, fa; "
        f"and.b32 a, {{$r0}}, 0xFFFF0000; and.b32 b, {{$r2}}, 0xFFFF0000; add.u32 a, a, {bias}; add.u32 b, b, {bias}; "
        "mov.b32 fa, a; mov.b32 fb, b; cvt.rn.satfinite.f16x2.f32 {$w1}, fb, fa; "
        f"mad.lo.u32 a, {{$r1}}, 65536, {bias}; mad.lo.u32 b, {{$r3}}, 65536, {bias}; mov.b32 fa, a; mov.b32 fb, b; "
        "cvt.rn.satfinite.f16x2.f32 {$w2}, fb, fa; "
        f"and.b32 a, {{$r1}}, 0xFFFF0000; and.b32 b, {{$r3}}, 0xFFFF0000; add.u32 a, a, {bias}; add.u32 b, b, {bias}; "
        "mov.b32 fa, a; mov.b32 fb, b; cvt.rn.satfinite.f16x2.f32 {$w3}, fb, fa; }",
        write_only_types=[Int32, Int32, Int32, Int32], read_only_args=[w0, w1, w2, w3])


@cute.jit
def f16x2_to_f32(bits: Int32):
    """The two f16 halves of an f16x2 word as fp32 (low half first; exact)."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, {$r0}; cvt.f32.f16 {$w0}, lo; cvt.f32.f16 {$w1}, hi; }",
        write_only_types=[Float32, Float32], read_only_args=[bits])


@cute.jit
def f32x2_to_bf16x2(lo: Float32, hi: Float32) -> Int32:
    """Two fp32 values rounded (to nearest even) into one bf16x2 word, `lo` in the low half."""
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Int32],
                                read_only_args=[hi, lo])


@cute.jit
def e2m1_pair(word: Int32, p: cutlass.Constexpr) -> Int32:
    """Nibbles p and p+4 of `word` (eight e2m1 codes) as an fp16 pair (low half: nibble p):
    exponent + mantissa bits at 9..11, sign at 15 - an fp16 with those bits is the e2m1 value *
    2^-14, exactly (integer ops only: sm_90 has no e2m1 conversion)."""
    # the word shifted straight to each field (not first by 4p, then to the field): 4 integer ops a
    # pair, 3 for p = 3 (SASS: 5 / 4 the other way). >> keeps the sign, but only bits 9..11,
    # 25..27 of `mant` and 15, 31 of `sign` are kept
    mant = word << (9 - 4 * p) if 4 * p <= 9 else word >> (4 * p - 9)
    sign = word << (12 - 4 * p) if p < 3 else word
    return (mant & 0x0E000E00) | (sign & Int32(-0x7FFF8000))       # -0x7FFF8000: the bits 0x80008000


@cute.jit
def f32_to_f16x2_splat(x: Float32) -> Int32:
    """x rounded to f16, in both halves of an f16x2 word."""
    return cute.arch.inline_ptx("{ .reg .b16 h; cvt.rn.f16.f32 h, {$r0}; mov.b32 {$w0}, {h, h}; }",
                                write_only_types=[Int32], read_only_args=[x])


@cute.jit
def e4m3_piece(v):
    """8 fp32 values -> (two words of their 8 e4m3 bytes, element e in byte e % 4 of word e // 4;
    the 8 remainders v - e4m3(v) in fp32): one piece of the hi/lo split of x that the wgmma GEMV
    stages (cvt.rn.satfinite.e4m3x2.f32, sm_89+; the remainder is exact in fp32)."""
    return cute.arch.inline_ptx(
        "{ .reg .b16 h0, h1, h2, h3, l0, l1, l2, l3, u0, u1, u2, u3; .reg .b32 f0, f1, f2, f3; "
        ".reg .f32 a0, a1, a2, a3, a4, a5, a6, a7; "
        "cvt.rn.satfinite.e4m3x2.f32 h0, {$r1}, {$r0}; cvt.rn.satfinite.e4m3x2.f32 h1, {$r3}, {$r2}; "
        "cvt.rn.satfinite.e4m3x2.f32 h2, {$r5}, {$r4}; cvt.rn.satfinite.e4m3x2.f32 h3, {$r7}, {$r6}; "
        "mov.b32 {$w0}, {h0, h1}; mov.b32 {$w1}, {h2, h3}; "
        "cvt.rn.f16x2.e4m3x2 f0, h0; cvt.rn.f16x2.e4m3x2 f1, h1; "
        "cvt.rn.f16x2.e4m3x2 f2, h2; cvt.rn.f16x2.e4m3x2 f3, h3; "
        "mov.b32 {l0, u0}, f0; mov.b32 {l1, u1}, f1; mov.b32 {l2, u2}, f2; mov.b32 {l3, u3}, f3; "
        "cvt.f32.f16 a0, l0; cvt.f32.f16 a1, u0; cvt.f32.f16 a2, l1; cvt.f32.f16 a3, u1; "
        "cvt.f32.f16 a4, l2; cvt.f32.f16 a5, u2; cvt.f32.f16 a6, l3; cvt.f32.f16 a7, u3; "
        "sub.f32 {$w2}, {$r0}, a0; sub.f32 {$w3}, {$r1}, a1; sub.f32 {$w4}, {$r2}, a2; "
        "sub.f32 {$w5}, {$r3}, a3; sub.f32 {$w6}, {$r4}, a4; sub.f32 {$w7}, {$r5}, a5; "
        "sub.f32 {$w8}, {$r6}, a6; sub.f32 {$w9}, {$r7}, a7; }",
        write_only_types=[Int32, Int32] + [Float32] * 8, read_only_args=list(v))


def wgmma_fp8_sync(n: int, groups: int, descs_a, descs_b, zero):
    """`groups` accumulator sets of one warpgroup wgmma m64n{n}k32 (e4m3 x e4m3 -> fp32), each
    the sum of 4 k32 steps (a 128-wide K block: the first step with scale-d 0, so the set starts
    from zero), A and B read from shared memory through the descriptors descs_a / descs_b
    (4 * groups Int64 each, set-major); waits for them (wgmma.wait_group 0) and returns the
    groups * n / 2 fp32 accumulators of this thread, set-major (see GemvBlock's wgmma path for
    the fragment layout). `zero`: an Int32 0 (the scale-d predicates are set from it). One
    asm statement: the accumulators are complete when it ends (a plain helper: the PTX string
    depends on n and groups)."""
    nr = n // 2
    na = 4 * groups
    lines = ["{ .reg .pred pz, po; setp.ne.b32 pz, {$r0}, 0; setp.eq.b32 po, {$r0}, 0; wgmma.fence.sync.aligned; "]
    for gi in range(groups):
        regs = ", ".join("{$w%d}" % (gi * nr + j) for j in range(nr))
        for s in range(4):
            ia, ib = 1 + gi * 4 + s, 1 + na + gi * 4 + s
            lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 " + "{" + regs + "}, "
                         + "{$r%d}, {$r%d}, " % (ia, ib) + ("pz" if s == 0 else "po") + ", 1, 1; ")
    lines.append("wgmma.commit_group.sync.aligned; wgmma.wait_group.sync.aligned 0; }")
    return cute.arch.inline_ptx("".join(lines), write_only_types=[Float32] * (groups * nr),
                                read_only_args=[zero, *descs_a, *descs_b])


@cute.jit
def fence_proxy_async_smem():
    """Make this thread's generic-proxy shared-memory writes (st.shared) visible to the async
    proxy (wgmma operand reads): before the barrier that precedes those reads. (Not for the
    ring's cp.async chunks: a fence after each chunk's wait measured 2.4x slower on the H200 -
    it waits for the whole ring in flight - and the cp.async + GMMA pipelines of CUTLASS order
    them by the wait and barrier alone.)"""
    cute.arch.inline_ptx("fence.proxy.async.shared::cta;")


def mma_m16n8k16(kind: str, a, b, c):
    """One warp mma.sync m16n8k16, fp32 accumulate: `kind` "bf16" | "f16" (A and B), a = 4 and
    b = 2 packed 32-bit registers of the fragment layout, c = the 4 fp32 accumulators; returns
    the 4 new accumulators (a plain helper: the PTX string depends on `kind`)."""
    return cute.arch.inline_ptx(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
        "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, "
        "{{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c])


def tree_sum(values: list):
    """Sum of a list of traced values as a balanced tree (a plain Python helper, unrolled when
    traced: the DSL would turn a `while` inside a jit function into a device loop)."""
    while len(values) > 1:
        values = [values[j] + values[j + 1] if j + 1 < len(values) else values[j]
                  for j in range(0, len(values), 2)]
    return values[0]


class TileSmem:
    """The shared memory of a plain tile: a bump allocator (offsets fixed at trace time) over the
    arena that follows `scratch` - the kernel allocates scratch as SCRATCH_WORDS words plus the
    arena (`scratch_region`), 128-byte aligned. Every plain tile of a kernel allocates from the
    same arena (a CTA runs one tile at a time), so their shared memory is the largest of them,
    not the sum. `capacity` = the block's own_smem_bytes(): allocating past it fails the trace."""

    def __init__(self, scratch: cute.Tensor, capacity: int):
        self.base = scratch.iterator.toint() + 4 * SCRATCH_WORDS
        self.offset = 0
        self.capacity = capacity

    def allocate_tensor(self, dtype, layout, byte_alignment: int = 16) -> cute.Tensor:
        self.offset = -(-self.offset // byte_alignment) * byte_alignment
        ptr = cute.make_ptr(dtype, self.base + self.offset, cute.AddressSpace.smem, assumed_align=byte_alignment)
        self.offset += cute.cosize(layout) * dtype.width // 8
        if self.offset > self.capacity:
            raise ValueError(f"TileSmem: {self.offset} B allocated, the block declares {self.capacity} "
                             f"(own_smem_bytes)")
        return cute.make_tensor(ptr, layout)


def scratch_region(smem, blocks) -> cute.Tensor:
    """The `scratch` tensor every tile gets: SCRATCH_WORDS fp32 words, then the plain tiles' arena
    (base.plain_smem_bytes(blocks); TileSmem), 128-byte aligned."""
    from .base import plain_smem_bytes
    words = SCRATCH_WORDS + plain_smem_bytes(blocks) // 4
    return smem.allocate_tensor(Float32, cute.make_layout(words), byte_alignment=128)


@cute.jit
def smem_tensor(addr, dtype: cutlass.Constexpr, shape: cutlass.Constexpr):
    """Row-major tensor at a shared-memory address (16-byte aligned by construction of the ring)."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.smem, assumed_align=16)
    return cute.make_tensor(ptr, row_major(shape))


@cute.jit
def block_sum_multi(values, scratch: cute.Tensor, op: cutlass.Constexpr = "sum"):
    """Sums (op "max": maxima) of len(values) <= 64 fp32 values over all threads; every thread
    gets all of them. Uses scratch[0 : 8 * len(values)]; ends with a barrier."""
    tid, _, _ = cute.arch.thread_idx()
    lane = tid % 32
    warp = tid // 32
    n = len(values)
    for i in cutlass.range_constexpr(n):
        if cutlass.const_expr(op == "max"):
            v = cute.arch.warp_reduction_max(values[i])
        else:
            v = cute.arch.warp_reduction_sum(values[i])
        if lane == 0:
            scratch[warp * n + i] = v
    cute.arch.sync_threads()
    out = []
    for i in cutlass.range_constexpr(n):
        total = scratch[i]
        for w in cutlass.range_constexpr(1, NUM_THREADS // 32):
            if cutlass.const_expr(op == "max"):
                total = cute.arch.fmax(total, scratch[w * n + i])
            else:
                total = total + scratch[w * n + i]
        out.append(total)
    cute.arch.sync_threads()
    return out


@cute.jit
def stream_tile(faces, nch: cutlass.Constexpr, stages: cutlass.Constexpr, stage_bytes: cutlass.Constexpr,
                ptrs, t, ring_base, sx, scratch, fresh, cseq, p0, p1, p2, produce, stamp=None,
                defer_last: cutlass.Constexpr = False, sliced: cutlass.Constexpr = False):
    """Run one tile of a streaming block. Consumer chunk number cseq (over the CTA's whole
    stream) sits in stage cseq % stages; after a chunk is consumed its stage is refilled with
    chunk cseq + stages of the stream (`produce`, which may belong to a later instruction).
    One cp.async group is committed per chunk, so wait_group(stages - 1) means "the oldest
    chunk has landed" for this thread; the barrier after it makes every thread's copies visible.
    `fresh` = 0: the previous streaming tile of this CTA was of the same op (its staged
    activations are still in sx; see sdk/blocks/base.py). Returns the advanced (cseq, producer
    state p0, p1, p2). (Refilling a stage one chunk later, behind the next chunk's barrier - one
    barrier a chunk - measured slower on the H200: docs/megakernel.md.) `stamp` (the megakernel's
    timing record, None without it): stamp("begun") after begin, stamp("chunks") before end.
    `defer_last`: the refill of the tile's last chunk is left to the caller, which issues it after
    the tile's signal (the kernel's REFILL_DEFER: the release then waits behind none of its
    copies; only the last - the wait for a chunk counts on the previous chunk's refill).
    `sliced` (base.ring_mode: every streaming block lays its chunks out in warp slices): each warp
    reads only what its own lanes copied, so after the first chunk (whose CTA barrier publishes
    the activations begin / prep staged) a chunk's wait and its stage's refill need only warp
    barriers."""
    st = faces.begin(ptrs, t, sx, scratch, fresh)
    if cutlass.const_expr(stamp is not None):
        stamp("begun")
    for ch in cutlass.range(nch, unroll=1):
        faces.prep(ptrs, t, ch, st, sx, scratch, fresh)
        cute.arch.cp_async_wait_group(stages - 1)
        if cutlass.const_expr(sliced):
            if ch == 0:
                cute.arch.sync_threads()
            else:
                cute.arch.sync_warp()
            faces.consume(ptrs, t, ch, ring_base + (cseq % stages) * stage_bytes + warp_slice(stage_bytes), st, sx)
            cute.arch.sync_warp()
        else:
            cute.arch.sync_threads()
            faces.consume(ptrs, t, ch, ring_base + (cseq % stages) * stage_bytes, st, sx)
            cute.arch.sync_threads()
        if cutlass.const_expr(not defer_last):
            p0, p1, p2 = produce(p0, p1, p2)
        else:
            if ch < nch - 1:
                p0, p1, p2 = produce(p0, p1, p2)
        cseq = cseq + 1
    if cutlass.const_expr(stamp is not None):
        stamp("chunks")
    faces.end(ptrs, t, st, scratch)
    return cseq, p0, p1, p2


@cute.jit
def warp_slice(stage_bytes: cutlass.Constexpr):
    """This warp's slice offset in a stage of a warp-sliced ring (base.ring_mode)."""
    tid, _, _ = cute.arch.thread_idx()
    return (tid // 32) * (stage_bytes // (NUM_THREADS // 32))


@cute.jit
def timing_stamp(mTim: cute.Tensor, sm, i, k: cutlass.Constexpr):
    """Thread 0: globaltimer into the timing record mTim[sm, i, k]."""
    tid, _, _ = cute.arch.thread_idx()
    if tid == 0:
        mTim[sm, i, k] = cute.arch.globaltimer()


@cute.jit
def bounded_wait(ptr, target: Int32, ebase, timeout_ns: Int64, code: cutlass.Constexpr, scope: cutlass.Constexpr,
                 info) -> Int32:
    """One thread: spin until the int32 at `ptr` >= target (acquire loads at `scope`: "gpu" for
    counters of this launch, "sys" for flags peers write), bounded by `timeout_ns` of globaltimer.
    Returns 1 when met, 0 when it gave up: another CTA had set the error word `ebase`, or the
    timeout expired - then, if the word was still zero, this thread claims it with `code` and
    writes `info` (7 values; None stands for the value last seen) into words 1..7."""
    status = Int32(1)
    v = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
    if v < target:
        t0 = cute.arch.globaltimer()
        while v < target and status == 1:
            v = cute.arch.load(ptr, Int32, sem="acquire", scope=scope)
            # the error word on every poll (on every 8th only measured no faster: H100,
            # 2026-12-07, fp8 stack L=8 I=2048 162.0-164.3 vs 161.9-162.0 us)
            if v < target:
                if cute.arch.load(ebase, Int32, sem="relaxed", scope="gpu") != 0:
                    status = Int32(0)
                if cute.arch.globaltimer() - t0 > timeout_ns:
                    status = Int32(0)
                    old = cute.arch.atomic_cas(ebase, cmp=Int32(0), val=Int32(code), sem="relaxed", scope="gpu")
                    if old == 0:
                        for j, val in enumerate(info):
                            cute.arch.store(ebase + (j + 1), Int32(v if val is None else val), sem="relaxed",
                                            scope="gpu")
    return status


@cute.jit
def peer_wait(fbase, idx: Int32, e: Int32, timeout_ns: Int64, ebase, t: Int32, flag_id: Int32,
              N: cutlass.Constexpr) -> Int32:
    """`bounded_wait` for flags[idx] >= e that a peer rank raises (system scope; flags [tiles, N]:
    the rank is idx % N). On timeout the error word reads [ERR_PEER_TIMEOUT, tile, flag id, SM,
    seen, wanted, rank, wanted] (sdk/comm/runtime.py decodes it)."""
    sm, _, _ = cute.arch.block_idx()
    return bounded_wait(fbase + idx, e, ebase, timeout_ns, ERR_PEER_TIMEOUT, "sys", (t, flag_id, sm, None, e, idx % N, e))


@cute.jit
def block_compact(hit, scratch):
    """All threads: (this thread's slot among the threads with `hit` set, in thread order; how
    many have it) - a warp ballot + popc prefix over the CTA. Uses scratch[0:NUM_THREADS // 32]
    (after a barrier; the caller syncs before reusing it)."""
    tid, _, _ = cute.arch.thread_idx()
    lane = tid % 32
    warp = tid // 32
    ballot = cute.arch.vote_ballot_sync(hit)
    if lane == 0:
        scratch[warp] = Float32(cute.arch.popc(ballot))
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(NUM_THREADS // 32):
        n = Int32(scratch[w])
        before = before + Int32(cutlass.select_(w < warp, n, Int32(0)))
        total = total + n
    return before + cute.arch.popc(ballot & cute.arch.lanemask_lt()), total


@cute.jit
def write_hit_list(count: Int32, mHits, scratch):
    """All threads, `count` = the token count of expert `tid` (0 past the L local experts; L <=
    NUM_THREADS), read after the last update of the counts: hits[0] = H, the number of experts
    with a non-zero count, and hits[1..H] their indices ascending (block_compact). Uses
    scratch[0:NUM_THREADS // 32] and ends with a barrier."""
    tid, _, _ = cute.arch.thread_idx()
    hit = count > 0
    slot, total = block_compact(hit, scratch)
    if hit:
        mHits[1 + slot] = tid
    if tid == 0:
        mHits[0] = total
    cute.arch.sync_threads()


@cute.jit
def l2_evict_first_policy() -> Int64:
    """An L2 cache policy (createpolicy) that marks every line it touches evict-first: for data
    read once per decode step (a layer's weights), so that it leaves the L2 before what the next
    instructions reuse - activations, counters, instruction records, the kernel's code."""
    return cute.arch.inline_ptx("createpolicy.fractional.L2::evict_first.b64 {$w0}, 1.0;",
                                write_only_types=[Int64])


@cute.jit
def cp_async_16_hinted(dst: Int32, src: Int64, policy: Int64):
    """cp.async.cg of one 16-byte unit global -> shared under an L2 cache `policy`; committed and
    waited for with the caller's cp.async groups like cute.copy's."""
    cute.arch.inline_ptx("cp.async.cg.shared.global.L2::cache_hint [{$r0}], [{$r1}], 16, {$r2};",
                         read_only_args=[dst, src, policy])


@cute.jit
def producer_slot():
    """(index among the ring's producer threads, or -1 for warp 0, which issues no copies)."""
    tid, _, _ = cute.arch.thread_idx()
    return tid - PRODUCER_FIRST


@cute.jit
def stage_rows_async(g2s, src: cute.Tensor, row0: Int32, dst: cute.Tensor, rows: cutlass.Constexpr):
    """cp.async rows row0 .. row0 + rows - 1 of src [*, units, 8] into dst [rows_pad, units, 8]
    (16-byte units); dst's rows past `rows` are zero-filled. Every unit's copy is issued before
    any wait (the loop is unrolled: a loop of load + store waits one round trip per step - 4 us of
    the DSV4 decode tile at batch 1). Commit with the caller's next cp.async group."""
    units = cute.size(dst, mode=[1])
    n = cute.size(dst, mode=[0]) * units
    for k in cutlass.range_constexpr(-(-n // NUM_THREADS)):
        tid, _, _ = cute.arch.thread_idx()
        i = tid + k * NUM_THREADS
        if i < n:
            r = i // units
            p = i % units
            if r < rows:
                cute.copy(g2s, src[row0 + r, p, None], dst[r, p, None])
            else:
                dst[r, p, None].fill(0.0)


@cute.jit
def block_sum(value: Float32, scratch: cute.Tensor) -> Float32:
    """Sum of `value` over all NUM_THREADS threads; every thread gets the result.
    Uses scratch[0:NUM_THREADS//32]; ends with a barrier so scratch can be reused at once."""
    tid, _, _ = cute.arch.thread_idx()
    lane = tid % 32
    warp = tid // 32
    v = cute.arch.warp_reduction_sum(value)
    if lane == 0:
        scratch[warp] = v
    cute.arch.sync_threads()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(NUM_THREADS // 32):
        total = total + scratch[w]
    cute.arch.sync_threads()
    return total


def _num_sms(default: int = 132) -> int:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:
        pass
    return default


def standalone(block, arch: str | None = None, num_ctas: int | None = None, max_stages: int | None = None,
               pdl: bool | None = None):
    """Compile `block`'s standalone kernel, operand pointers read from a device int64 array (same
    table format as the megakernel's): grid = block.num_tiles(), one tile per CTA; for a streaming
    block, grid = min(tiles, num_ctas or the SM count), persistent, through the ring. (A persistent
    grid of one-tile CTAs walking the tiles measured slower on the H200 - KDA at batch 64: 53-61% of
    copy with 2 or 3 CTAs per SM vs 81.6% one tile per CTA, 2026-12-03 - so there is none.)

    pdl: launch with programmatic dependent launch. None (the default) = on for streaming blocks,
    off for the one-tile-per-CTA kernel. One tile per CTA with pdl=True: every CTA lets the next
    launch start (griddepcontrol.launch_dependents), then waits (griddepcontrol.wait) before any
    read or write, so only the launch itself (CTA rasterisation, the first wave's start) overlaps
    the previous grid's tail - for short kernels of many CTAs (the KDA state update; loading the
    state before the wait measured slower on the core step, 80.8 vs 81.7% of copy: not kept). A
    block whose tile waits itself (`tile_waits_for_grid`: the MLA decode's `kv_before_wait`) issues
    its first copies of data the previous grid does not write before that wait. Streaming: a
    launch fills its weight ring on the SMs the previous launch has left and waits only before it
    reads activations or writes outputs. Its default:
    measured on the H200 (2026-12-03), GEMV bf16 M=1 7168 x 2048 alone 52.4% -> 69.3% of the copy
    bandwidth, 4096 x 7168 73.4% -> 86.7%, outputs equal. `pdl=False` launches plainly. (The
    megakernel's own launch keeps PDL opt-in: `MegakernelRuntime(pdl=...)`, see its docstring.)
    With PDL and no `max_stages`, the ring is sized so two CTAs share an SM (`coresident_stages`):
    the next launch then streams beside the previous one instead of waiting for its SM (7168 x 2048
    69.3% -> 84.0%).

    Returns `fn(optab_addr: int, stream)`. With `arch` set, compiles for that GPU arch with no GPU
    present (compile check)."""
    if block.stream_chunks() > 0:
        return _standalone_stream(block, arch, num_ctas or (132 if arch else _num_sms()), max_stages,
                                  True if pdl is None else pdl)
    if num_ctas is not None:
        raise ValueError(f"standalone: num_ctas sets a streaming block's persistent grid; {type(block).__name__} "
                         f"runs one tile per CTA ({block.num_tiles()} CTAs)")
    pdl = bool(pdl)
    tile_waits = block.tile_waits_for_grid()     # the tile waits itself, after its early copies
    tile_fn = block.device_tile()
    prologue = block.device_prologue() if block.has_prologue() else None
    nops = len(block.operands())
    ntiles = block.num_tiles()

    @cute.kernel
    def kernel(optab: Int64):
        smem = SmemAllocator()
        scratch = scratch_region(smem, [block])
        mOps = gmem_tensor(optab, Int64, (nops,), 8)
        bid, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(pdl):
            # the next launch may start its CTAs once every CTA of this grid has started (they wait
            # for this grid before they read its outputs): in a chain - decode, combine, decode -
            # the third grid's CTAs then start on the SMs the first one leaves
            cute.arch.griddepcontrol_launch_dependents()
        # the operand table is the host's (no kernel writes it): read before the wait
        ptrs = [mOps[j] for j in range(nops)]
        if cutlass.const_expr(prologue is not None):
            prologue(ptrs, bid, scratch)           # weights only: before the wait, as in the megakernel
        if cutlass.const_expr(pdl and not tile_waits):
            # the previous grid's writes (e.g. the state it updated) are visible after the wait
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(prologue is not None):
            cute.arch.sync_threads()
        tile_fn(ptrs, bid, scratch)

    @cute.jit
    def host(optab: Int64, stream: "cuda.CUstream"):
        kernel(optab).launch(grid=(ntiles, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=pdl)

    import cuda.bindings.driver as cuda
    host.__annotations__["stream"] = cuda.CUstream
    opts = f"--gpu-arch {arch}" if arch else None
    args = (Int64(0), cuda.CUstream(0))
    return cute.compile(host, *args, options=opts) if opts else cute.compile(host, *args)


def _standalone_stream(block, arch, num_ctas, max_stages, pdl):
    faces = block.device_stream()
    nops = len(block.operands())
    ntiles = block.num_tiles()
    nch = block.stream_chunks()
    G = min(ntiles, num_ctas)
    if pdl and max_stages is None:
        # a ring two CTAs fit on one SM: consecutive launches overlap on every SM (coresident_stages)
        max_stages = coresident_stages([block])
    stage_bytes, P, xbytes = ring_geometry([block], max_stages)
    mutable = block.stream_data_mutable()     # e.g. a state the previous launch updates in place
    sliced = ring_mode([block])

    @cute.jit
    def produce(ptrs, bid, mine, ring_base, pi, pc, ps):
        if pi < mine:
            addr = ring_base + (ps % P) * stage_bytes
            if cutlass.const_expr(sliced):
                addr = addr + warp_slice(stage_bytes)
            faces.issue(ptrs, bid + G * pi, pc, addr)
            pc = pc + 1
            if pc == nch:
                pc = Int32(0)
                pi = pi + 1
        cute.arch.cp_async_commit_group()
        return pi, pc, ps + 1

    @cute.kernel
    def kernel(optab: Int64):
        smem = SmemAllocator()
        scratch = scratch_region(smem, [block])
        ring = smem.allocate_tensor(cutlass.Int8, cute.make_layout(P * stage_bytes), byte_alignment=128)
        xs = smem.allocate_tensor(cutlass.Int8, cute.make_layout(xbytes), byte_alignment=128)
        cute.arch.griddepcontrol_launch_dependents()
        mOps = gmem_tensor(optab, Int64, (nops,), 8)
        bid, _, _ = cute.arch.block_idx()
        ptrs = [mOps[j] for j in range(nops)]
        mine = (ntiles - bid + G - 1) // G
        ring_base = ring.iterator.toint()
        sx = xs.iterator.toint()
        pi, pc, ps = Int32(0), Int32(0), Int32(0)
        if cutlass.const_expr(mutable):
            cute.arch.griddepcontrol_wait()
        for _ in cutlass.range_constexpr(P):
            pi, pc, ps = produce(ptrs, bid, mine, ring_base, pi, pc, ps)
        # weights only above (or, `mutable`, data the previous launch may write, after the wait);
        # activations and outputs (the previous launch's) below: with PDL this launch may have
        # started early - wait for the previous grid (no-op without PDL)
        if cutlass.const_expr(not mutable):
            cute.arch.griddepcontrol_wait()
        cseq = Int32(0)
        for j in cutlass.range(mine, unroll=1):
            cseq, pi, pc, ps = stream_tile(
                faces, nch, P, stage_bytes, ptrs, bid + G * j, ring_base, sx, scratch,
                Int32(cutlass.select_(j == 0, 1, 0)), cseq, pi, pc, ps,
                lambda a, b, c: produce(ptrs, bid, mine, ring_base, a, b, c), sliced=sliced)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def host(optab: Int64, stream: "cuda.CUstream"):
        kernel(optab).launch(grid=(G, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream, use_pdl=pdl)

    import cuda.bindings.driver as cuda
    host.__annotations__["stream"] = cuda.CUstream
    args = (Int64(0), cuda.CUstream(0))
    return cute.compile(host, *args, options=f"--gpu-arch {arch}") if arch else cute.compile(host, *args)
