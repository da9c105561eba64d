"""The block contract: what every device block in `sdk/blocks/` provides.

A block is one module with one class (a subclass of `Block`) and four faces:

1. a static config (a frozen dataclass, `Block.Config`): shapes, dtypes, quantization, threads;
2. `reference(**inputs)`: plain torch, fp32 math over the whole op - the block's definition;
3. `device_tile()`: the CuTe DSL device function for ONE unit of work (a tile), with the signature
   `tile(ptrs: list[Int64], tile: Int32, scratch: smem Float32 tensor)`; the same function is
   called from the block's own standalone kernel (`standalone_kernel()`, for unit tests and
   benchmarks) and from the megakernel's dispatch loop (it inlines into the one kernel);
4. `cost()`: bytes moved and flops per tile (the scheduler and the roofline report read it).

Besides, `emulate_tile(tensors, tile)` is the torch twin of the device tile that the PyVM runs:
same tile boundaries, same storage dtypes, fp32 math.

Streaming blocks (weight-bound tiles, e.g. `GemvBlock`) instead provide `device_stream()`: their
weights flow through the megakernel's shared-memory ring (cp.async, several chunks in flight,
issued up to a whole ring AHEAD of the tile, across instruction boundaries and before the tile's
dependency is met: weights never depend on activations). Such a block declares
`stream_chunks()` (chunks per tile, static), `chunk_bytes()` (bytes of one chunk in smem) and
`x_smem_bytes()` (smem it needs for staged activations), and its `device_stream()` returns a
`StreamFaces` of five device functions, all called by all NUM_THREADS threads:

    issue(ptrs, tile, c, stage_addr)            cp.async of chunk c into the stage (no commit),
                                                by the PRODUCER threads only (`producer_slot()`)
    state = begin(ptrs, tile, sx, scratch, fresh)   after the tile's dependencies are met
    prep(ptrs, tile, c, state, sx, scratch, fresh)  before chunk c's stage barrier (stage activations)
    consume(ptrs, tile, c, stage_addr, state, sx)   chunk c has landed and is visible
    end(ptrs, tile, state, scratch)             epilogue (reductions, output stores)

`fresh` is 0 when the CTA's previous streaming tile belonged to the same op (same operand-table
entries) and nothing else streamed in between: the activations that tile staged in `sx` are
still there and still current (every tile of an op waits for the same counters, and a program
never overwrites an op's inputs before all its tiles are done), so a block may skip staging
them again. The megakernel owns the ring, the commit/wait accounting and the barriers
(docs/writing-a-block.md).

A plain block may also provide `device_prologue()` (`has_prologue()` True): a device function
`prologue(ptrs, tile, scratch)` the kernels call with all threads BEFORE the tile's dependency
wait, then a barrier, then the tile. It may read weights only (never activations: they are not
ready), e.g. stage the weight slice its tile reads from smem, so that slice's loads overlap the
wait instead of following it (MHCPostBlock's next-mix fn slice).

Only warps 1.. issue the ring's copies (`PRODUCER_FIRST`): warp 0's thread 0 does the waits and
the release signals, and a release fence waits for the issuing thread's outstanding memory
operations - with no cp.async of its own in flight it does not wait for the ring.

Operands are device pointers (int64) in an operand table; their order is `operands()`, their
shapes and dtypes are static (`operand_specs()`), so a kernel never takes per-layer arguments.

Nothing here imports CuTe DSL: `device_tile()` imports it when called (`import sdk` and the PyVM
work without `nvidia-cutlass-dsl`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import UnsupportedConfigError

# Threads per CTA of every block and of the megakernel: 8 warps. One value for the whole kernel
# since all blocks inline into the same persistent CTA.
NUM_THREADS = 256
# fp32 words of the `scratch` smem tensor every tile gets: [0, 512) block reductions of up to 64
# values (8 warps x 64), [512, 576) per-token statistics a tile keeps across its chunks.
SCRATCH_WORDS = 9 * 64
STATS_OFFSET = 8 * 64

# Shared memory of the persistent CTA (H200 / B200 allow 227 KB per block; keep a margin for the
# small static allocations): the weight ring takes what the staged activations leave.
SMEM_BUDGET = 220 * 1024
MAX_STAGES = 16
# Shared memory of one SM (H100 / H200 / B200: 228 KB) and what the hardware reserves per CTA (1 KB):
# `coresident_stages` sizes a ring so that several CTAs share an SM.
SM_SMEM = 228 * 1024
CTA_RESERVED_SMEM = 1024
# Largest operand (in elements) that 32-bit offsets address (see Block.wide_operands).
INDEX_LIMIT = 2 ** 31 - 1
# Threads that issue the weight ring's cp.async copies: all but warp 0 (see the module docstring).
PRODUCER_FIRST = 32
PRODUCER_THREADS = NUM_THREADS - PRODUCER_FIRST


def env_switch(name: str, default: str, meaning: str) -> bool:
    """A kernel-wide 0 / 1 choice read from the environment at import (it is compiled in): True
    for "1" (`meaning`), False for "0"; anything else is refused by name."""
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: 1 ({meaning}) or 0")
    return v == "1"


def ring_geometry(blocks, max_stages: int | None = None, reserved: int = 0) -> tuple[int, int, int]:
    """(stage bytes, number of stages, activation smem bytes) of the smem ring that serves these
    blocks; (0, 0, 0) when none streams. Stages are sized for the largest chunk of any block;
    as many as fit (at most `max_stages`, default MAX_STAGES) beside `reserved` bytes of other
    shared memory (the megakernel's instruction records, and the shared memory the other blocks'
    tiles allocate for themselves: the compiler gives every tile's allocations their own bytes)."""
    stream = [b for b in blocks if b.stream_chunks() > 0]
    if not stream:
        return 0, 0, 0
    own = [(type(b).__name__, b.own_smem_bytes()) for b in blocks if b.stream_chunks() == 0 and b.own_smem_bytes()]
    reserved += plain_smem_bytes(blocks)
    up = lambda v: -(-v // 128) * 128
    stage = up(max(b.chunk_bytes() for b in stream))
    xbytes = up(max(max(b.x_smem_bytes() for b in stream), 16))
    free = SMEM_BUDGET - xbytes - 4 * SCRATCH_WORDS - 256 - reserved
    stages = min(max_stages or MAX_STAGES, free // stage)
    if stages < 2:
        beside = "".join(f", {name} tiles {n} B" for name, n in own)
        raise UnsupportedConfigError(f"smem ring: {stage} B stages and {xbytes} B of activations leave room "
                                     f"for {stages} stage(s) beside {reserved} B of other shared memory"
                                     f"{beside}; need 2 (fewer pipeline stages in those blocks)")
    return stage, stages, xbytes

def ring_mode(blocks) -> bool:
    """True when every streaming block of a kernel uses warp slices (`Block.warp_ring`): each
    warp then copies and reads only its own slice of every stage, whatever op a chunk belongs
    to, so a chunk needs a CTA barrier only at a tile's first chunk (the staged activations)
    and the stage's refill none. A ring shared with a block laid out by rows across warps
    would put one warp's copies over another warp's reads: refused."""
    stream = [b for b in blocks if b.stream_chunks() > 0]
    sliced = [b.warp_ring() for b in stream]
    if any(sliced) and not all(sliced):
        names = sorted({type(b).__name__ for b, s in zip(stream, sliced) if not s})
        raise UnsupportedConfigError(f"smem ring: warp-sliced chunks (warp_ring) beside blocks that "
                                     f"stream without them ({', '.join(names)}): all or none")
    return bool(stream) and all(sliced)


def plain_smem_bytes(blocks) -> int:
    """Shared memory of the plain-tile arena that follows `scratch` (_cute.TileSmem): the largest
    own_smem_bytes() of the blocks - a CTA runs one tile at a time, so every plain tile's
    allocations share it (128-byte multiple)."""
    return -(-max([b.own_smem_bytes() for b in blocks if b.stream_chunks() == 0] + [0]) // 128) * 128


def coresident_stages(blocks, ctas: int = 2, min_stages: int = 3) -> int | None:
    """The most ring stages with which `ctas` CTAs of this ring fit one SM's shared memory, or None
    when fewer than `min_stages` would. The standalone streaming kernel launched with PDL uses it
    (two CTAs): the next launch's CTA then starts beside the previous launch's on the same SM and
    streams its weights while the previous one finishes, instead of after it. Measured on the H200
    (2026-12-03, bf16 GEMV M=1, back-to-back launches): 7168 x 2048 (29 MB) 66.5% -> 84.0% of the
    copy bandwidth, 4096 x 7168 86.7% -> 89.9%, 18432 x 7168 96.0% -> 96.4% (6 stages vs the
    13 / 12 of one CTA per SM)."""
    stream = [b for b in blocks if b.stream_chunks() > 0]
    if not stream:
        return None
    stage, _, xbytes = ring_geometry(blocks, max_stages=2)
    per_cta = SM_SMEM // ctas - CTA_RESERVED_SMEM
    stages = min(MAX_STAGES, (per_cta - xbytes - 4 * SCRATCH_WORDS - 256) // stage)
    return stages if stages >= min_stages else None


DTYPES = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int32": torch.int32,
}


@dataclass(frozen=True)
class Cost:
    """Per tile: bytes that must come from / go to global memory, and flops."""
    bytes: int
    flops: int

    def ns(self, bandwidth_gbs: float = 4260.0, per_sm_share: int = 132) -> float:
        """Time of one tile on one SM when all SMs stream at the measured copy bandwidth."""
        return self.bytes / (bandwidth_gbs / per_sm_share)


@dataclass(frozen=True)
class StreamFaces:
    """The device functions of a streaming block (see the module docstring)."""
    issue: Any
    begin: Any
    prep: Any
    consume: Any
    end: Any


@dataclass(frozen=True)
class OperandSpec:
    name: str
    shape: tuple
    dtype: str          # key of DTYPES
    output: bool = False
    optional: bool = False   # may be left unbound (a null pointer the tile never reads)


class Block:
    """Base class of device blocks. Subclasses set `name` and `Config` and implement the faces."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = object
    # operands whose device code computes 64-bit offsets itself (e.g. the experts' weights, one
    # base per expert); every other operand is indexed with 32-bit element offsets
    wide_operands: ClassVar[tuple] = ()

    def __init__(self, config):
        if not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} takes a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.check()
        self._check_index_range()
        self._device_tile = None
        self._device_prologue = None
        self._device_stream = None

    # -- identity: blocks with equal static config compile to the same code ---------------------
    def key(self) -> tuple:
        return (type(self).__name__, dataclasses.astuple(self.config))

    def __eq__(self, other):
        return isinstance(other, Block) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return f"{type(self).__name__}({self.config})"

    # -- the contract -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise UnsupportedConfigError for a config the device code does not implement."""

    def operand_specs(self) -> list[OperandSpec]:
        raise NotImplementedError

    def _check_index_range(self) -> None:
        """A clear error instead of an illegal address: 32-bit element offsets overflow past
        2^31 - 1 elements (a real Kimi K3 expert shard in bf16 is 2.5e9)."""
        for spec in self.operand_specs():
            n = 1
            for d in spec.shape:
                n *= d
            if n > INDEX_LIMIT and spec.name not in self.wide_operands:
                self.unsupported(f"{type(self).__name__}: operand {spec.name} {list(spec.shape)} has {n} elements; "
                                 f"its device code indexes it with 32-bit offsets (at most {INDEX_LIMIT}): "
                                 f"use a smaller shard or pool")

    def operands(self) -> list[str]:
        return [o.name for o in self.operand_specs()]

    def num_tiles(self) -> int:
        raise NotImplementedError

    def cost(self) -> Cost:
        raise NotImplementedError

    def reference(self, **inputs) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def emulate_tile(self, tensors: dict[str, torch.Tensor], tile: int) -> None:
        raise NotImplementedError

    def device_tile(self):
        """The CuTe DSL device function of one tile (built once per block instance)."""
        if self._device_tile is None:
            self._device_tile = self._build_device_tile()
        return self._device_tile

    def _build_device_tile(self):
        raise NotImplementedError

    def tile_waits_for_grid(self) -> bool:
        """The tile itself calls griddepcontrol.wait, after the copies it may issue before it (e.g.
        MLADecodeConfig.kv_before_wait); a standalone PDL kernel then does not wait at its start.
        (Inside the megakernel the call is a no-op: the launch has waited before any tile runs.)"""
        return False

    # -- an optional prologue before the tile's dependency wait (plain tiles) -------------------
    def has_prologue(self) -> bool:
        """Whether device_prologue() is used (static: the kernels compile it in or not)."""
        return False

    def device_prologue(self):
        """`prologue(ptrs, tile, scratch)`, called by all NUM_THREADS threads BEFORE the tile's
        dependency wait (the megakernel; the standalone kernel before its PDL wait): it may read
        only weights - what no op of a program writes - e.g. stage a weight slice into the tile's
        smem arena, whose loads then overlap the wait; the tile finds it there. No barrier needed
        inside: the kernels put one between the prologue and the tile."""
        if self._device_prologue is None:
            self._device_prologue = self._build_device_prologue()
        return self._device_prologue

    def _build_device_prologue(self):
        raise NotImplementedError

    # -- streaming blocks (weights through the megakernel's smem ring) -------------------------
    def stream_chunks(self) -> int:
        """Weight chunks per tile; 0: not a streaming block (the megakernel calls device_tile())."""
        return 0

    def chunk_bytes(self) -> int:
        return 0

    def warp_ring(self) -> bool:
        """The block lays each chunk out in 8 warp slices (warp w's copies and reads only in
        stage bytes [w S, (w + 1) S), S = stage / 8; its faces get the slice's address): the
        kernels then order a chunk's copies and reads with warp barriers, not CTA barriers
        (see `ring_mode`)."""
        return False

    def own_smem_bytes(self) -> int:
        """Shared memory the block's plain device tile allocates for itself - from the arena after
        `scratch` (`_cute.TileSmem(scratch, this)`), which every plain tile of a kernel shares
        (one tile at a time per CTA): the kernel sizes it to the largest of its blocks, the weight
        ring takes what is left (ring_geometry). 0 for tiles that use only `scratch` and the ring."""
        return 0

    def x_smem_bytes(self) -> int:
        return 0

    def streamed_operands(self) -> tuple[str, ...]:
        """Operands whose data the ring reads AHEAD (before the tile's dependency wait, before
        earlier instructions of the launch have run), when another op could write them: the
        program refuses to let any other op write them (Program.op), and when one is also this
        block's output (a state updated in place, e.g. the streaming KDA) the data changes
        between launches, so a PDL launch fills its ring only after griddepcontrol.wait
        (`stream_data_mutable`). Weights, which nothing writes, need not be listed."""
        return ()

    def stream_data_mutable(self) -> bool:
        """A streamed operand is also an output: the previous launch may be writing it."""
        outs = {s.name for s in self.operand_specs() if s.output}
        return any(n in outs for n in self.streamed_operands())

    def device_stream(self) -> StreamFaces:
        if self._device_stream is None:
            self._device_stream = self._build_device_stream()
        return self._device_stream

    def _build_device_stream(self) -> StreamFaces:
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------------
    def alloc_operands(self, device="cpu", fill=None) -> dict[str, torch.Tensor]:
        """Zero (or `fill`) tensors of every operand's static shape and dtype."""
        out = {}
        for spec in self.operand_specs():
            if spec.optional:
                continue
            t = torch.zeros(spec.shape, dtype=DTYPES[spec.dtype], device=device)
            if fill is not None and spec.output:
                t.fill_(fill)
            out[spec.name] = t
        return out

    @staticmethod
    def unsupported(msg: str):
        raise UnsupportedConfigError(msg)
