"""A megakernel program: buffers, an operand table, counters and instructions (before placement).

    prog = Program()
    prog.buffer("x", (m, d), "bf16", role="input")
    ...
    done = prog.op(block, {"src": "x", ...}, waits=[previous], label="layer0.norm")

`op()` adds one instruction per tile of `block`, all reading the same operand-table entries, all
waiting for the given ops' counters (every tile of them: op-level dependencies), all signalling
one new counter whose expected count is the block's number of tiles. Opcodes come from the
program's `OpcodeTable`: one per distinct (block class, static config), in order of first use.

Placement on SMs is `sdk.schedule`; encoding into int32 words is `encode()` here.
"""
from __future__ import annotations

import contextvars
import math

from dataclasses import dataclass, field

import numpy as np

from ..blocks.base import Block
from ..errors import UnsupportedConfigError
from . import isa


class OpcodeTable:
    """Assigns opcodes to block variants (equal static config = same opcode), never by hand."""

    def __init__(self):
        self.blocks: list[Block] = []
        self._index: dict[tuple, int] = {}

    def opcode(self, block: Block) -> int:
        k = block.key()
        if k not in self._index:
            self._index[k] = len(self.blocks)
            self.blocks.append(block)
        return self._index[k]

    def __len__(self):
        return len(self.blocks)


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: str
    role: str            # "weight" | "input" | "output" | "scratch"


@dataclass
class Instruction:
    opcode: int
    block: Block
    operands: int                      # first operand-table index
    tile: int
    waits: tuple                       # ((counter, expected), ...)
    signal: int                        # counter id or NO_COUNTER
    phase: int                         # topological level of the op (placement order)
    label: str
    op_index: int                      # which op of the program


@dataclass
class Op:
    label: str
    block: Block
    bindings: dict
    counter: int
    phase: int
    instructions: list = field(default_factory=list)


class Program:
    def __init__(self):
        self.buffers: dict[str, Buffer] = {}
        self.optab: list[str | None] = []          # buffer name per operand slot (None: null)
        self.counter_names: list[str] = ["<exit>"]  # id 0 is isa.EXIT_COUNTER
        self.expected: list[int] = [0]
        self.opcodes = OpcodeTable()
        self.ops: list[Op] = []
        self.instructions: list[Instruction] = []
        # buffers any op writes / streams through the ring, and by which op first (the hazard check)
        self._written: dict[str, str] = {}
        self._streamed: dict[str, str] = {}

    def buffer(self, name, shape, dtype, role="scratch") -> str:
        if name in self.buffers:
            raise ValueError(f"buffer {name!r} defined twice")
        self.buffers[name] = Buffer(name, tuple(shape), dtype, role)
        return name

    def op(self, block: Block, bindings: dict, waits=(), label: str = "") -> int:
        """Add `block` over all its tiles; returns the op's index (pass it in later ops' waits)."""
        specs = block.operand_specs()
        names = {s.name for s in specs}
        extra = set(bindings) - names
        if extra:
            raise ValueError(f"{label}: {type(block).__name__} has no operand(s) {sorted(extra)}")
        base = len(self.optab)
        for s in specs:
            buf = bindings.get(s.name)
            if buf is not None:
                b = self.buffers[buf]
                # a buffer binds an operand of its dtype and element count: the device sees a base
                # address, so any shape of the same contiguous bytes is the same operand (e.g. the
                # [B, T, H, d] query of the attention core is the [B*T, H, d] output of a GEMV)
                if math.prod(b.shape) != math.prod(s.shape) or b.dtype != s.dtype:
                    raise UnsupportedConfigError(
                        f"{label}: operand {s.name} wants {s.dtype}{list(s.shape)}, buffer {buf!r} "
                        f"is {b.dtype}{list(b.shape)}")
            elif not s.optional:
                raise ValueError(f"{label}: operand {s.name!r} not bound")
            self.optab.append(buf)
        self._check_ring_hazards(block, bindings, label)
        waits = list(waits)
        if len(waits) > isa.MAX_WAITS:
            raise UnsupportedConfigError(f"{label}: at most {isa.MAX_WAITS} dependencies per op")
        phase = 1 + max((self.ops[w].phase for w in waits), default=-1)
        counter = len(self.counter_names)
        self.counter_names.append(label or f"op{len(self.ops)}")
        self.expected.append(block.num_tiles())
        wait_words = tuple((self.ops[w].counter, self.expected[self.ops[w].counter]) for w in waits)
        opcode = self.opcodes.opcode(block)
        op = Op(label, block, dict(bindings), counter, phase)
        for t in range(block.num_tiles()):
            ins = Instruction(opcode, block, base, t, wait_words, counter, phase,
                              f"{label}[{t}]", len(self.ops))
            op.instructions.append(len(self.instructions))
            self.instructions.append(ins)
        self.ops.append(op)
        return len(self.ops) - 1

    def _check_ring_hazards(self, block: Block, bindings: dict, label: str) -> None:
        """The ring reads a block's streamed operands ahead of everything (Block.streamed_operands):
        no other op of the launch may write them, before or after. (Against the buffers all earlier
        ops write and stream, kept as the ops are added: a whole model has thousands of ops.)"""
        streamed = {bindings[n] for n in block.streamed_operands() if bindings.get(n)}
        written = {bindings[s.name] for s in block.operand_specs() if s.output and bindings.get(s.name)}
        for clash, other in ((streamed & set(self._written), self._written),
                             (written & set(self._streamed), self._streamed)):
            if clash:
                raise UnsupportedConfigError(
                    f"{label}: buffer(s) {sorted(clash)} are streamed through the smem ring (read ahead of "
                    f"the dependency waits) by one of {label!r} / {other[min(clash)]!r} and written by the "
                    f"other in the same launch: split them into two launches")
        for buf in written:
            self._written.setdefault(buf, label)
        for buf in streamed:
            self._streamed.setdefault(buf, label)

    def operand_views(self, block: Block, base: int, tensors: dict) -> dict:
        """{operand name: its buffer's tensor from `tensors`, viewed in the operand's shape} of the
        op whose operands start at table index `base` (a buffer may bind a reshape, see op())."""
        out = {}
        for j, spec in enumerate(block.operand_specs()):
            buf = self.optab[base + j]
            if buf is not None:
                out[spec.name] = tensors[buf].view(spec.shape)
        return out

    @property
    def num_counters(self) -> int:
        return len(self.counter_names)

    def bytes_by_role(self, role: str) -> int:
        return sum(self.bytes_of(b.name) for b in self.buffers.values() if b.role == role)

    def bytes_of(self, name: str) -> int:
        """Bytes of one buffer."""
        import torch
        from ..blocks.base import DTYPES
        b = self.buffers[name]
        return int(np.prod(b.shape)) * torch.empty((), dtype=DTYPES[b.dtype]).element_size()


def check_weights(program: Program, weights: dict, what: str = "the program") -> None:
    """Raise WeightsMismatchError naming every weight buffer of `program` that `weights` lacks or
    gives with another shape or dtype - before a launch, not as zeros or garbage inside it. Extra
    keys are allowed: one weight dict may serve several programs."""
    from ..blocks.base import DTYPES
    from ..errors import WeightsMismatchError
    missing, misshaped, wrong_dtype = [], [], []
    for name, b in program.buffers.items():
        if b.role != "weight":
            continue
        t = weights.get(name)
        if t is None:
            missing.append(name)
        elif tuple(t.shape) != tuple(b.shape):
            misshaped.append((name, b.shape, tuple(t.shape)))
        elif t.dtype != DTYPES[b.dtype]:
            wrong_dtype.append((name, b.dtype, str(t.dtype).removeprefix("torch.")))
    if missing or misshaped or wrong_dtype:
        raise WeightsMismatchError(missing=missing, misshaped=misshaped, wrong_dtype=wrong_dtype, model=what)


RECORDS_MARGIN = 4096     # smem the kernel's instruction records take beside the ring (a sublayer: a few KB)


RECORDS_MAX_BYTES = 48 * 1024    # shared memory for the instruction records of one CTA, all resident
RECORDS_WINDOW_BYTES = 24 * 1024  # ... when a longer list streams through a window of them


def records_geometry(blocks, max_len: int, window: int | None = None) -> tuple[int, int, int]:
    """(operand slots per record, smem bytes of the records, window) of a CTA's instruction
    records: WORDS int32 words + NOPS int64 operand pointers per instruction, NOPS = the most
    operands of any block (the runtime pads the operand table with NOPS null entries: every
    record reads NOPS pointers, whatever its block uses). window 0: all max_len records resident
    in smem (they fit RECORDS_MAX_BYTES); else the list streams through `window` record slots (a
    power of two: the largest whose records fit RECORDS_WINDOW_BYTES - a whole model's hundreds
    of instructions a SM), refilled half a window at a time (kernel.py). `window` forces one (a
    power of two >= 4; tests run small programs through it)."""
    nops = max([len(b.operands()) for b in blocks] + [1])
    per = 4 * isa.WORDS + 8 * nops
    if window == 0:                      # all resident, as asked (the runtime passes its choice on)
        if max_len * per > RECORDS_MAX_BYTES:
            raise UnsupportedConfigError(f"megakernel: {max_len} instruction records of {per} B do not fit the "
                                         f"{RECORDS_MAX_BYTES} B kept resident; use a records window")
        return nops, max_len * per, 0
    if window is None:
        if max_len * per <= RECORDS_MAX_BYTES:
            return nops, max_len * per, 0
        window = 1 << max(2, (RECORDS_WINDOW_BYTES // per).bit_length() - 1)
    if window < 4 or window & (window - 1):
        raise ValueError(f"records window {window}: a power of two >= 4")
    if window >= max_len:
        return nops, max_len * per, 0
    return nops, window * per, window


# the blocks of the rest of a whole program, and its records' bytes, while one of its sublayers is
# rebuilt (fitted_sublayers): the sublayer's first_fitting then fits the ring of the whole
_RING_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("ring_context", default=((), 0))


def first_fitting(builds, ring_stages_wanted=(2,), reserved: int = RECORDS_MARGIN) -> Program:
    """The plain-tile depth vs weight-ring trade of the attention sublayers, decided in one place:
    `builds` are zero-argument program builders, deepest plain-tile pipelines (most arena) first;
    the first program whose weight ring gets ring_stages_wanted[0] stages, else [1], ...; else the
    last builder's UnsupportedConfigError (the ring's, naming what took the shared memory). Inside
    fitted_sublayers the ring is the whole program's: these blocks beside the others'."""
    from ..blocks.base import ring_geometry
    others, others_reserved = _RING_CONTEXT.get()
    reserved = max(reserved, others_reserved)
    err, fitting = None, []                 # (program, its ring's stages), in the builders' order
    for build in builds:
        try:
            prog = build()
            fitting.append((prog, ring_geometry(list(prog.opcodes.blocks) + list(others), reserved=reserved)[1]))
        except UnsupportedConfigError as exc:
            err = exc
    for want in ring_stages_wanted:
        for prog, stages in fitting:
            if stages >= want:
                return prog
    raise err


def encode(program: Program, per_sm: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Instruction words [num_sms, max_len, WORDS] (int32) and list lengths [num_sms]."""
    num_sms = len(per_sm)
    max_len = max(1, max(len(lst) for lst in per_sm))
    words = np.zeros((num_sms, max_len, isa.WORDS), dtype=np.int32)
    words[:, :, [wc for wc, _ in isa.WAITS] + [isa.SIGNAL]] = isa.NO_COUNTER
    lengths = np.array([len(lst) for lst in per_sm], dtype=np.int32)
    for s, lst in enumerate(per_sm):
        for j, i in enumerate(lst):
            ins = program.instructions[i]
            w = words[s, j]
            w[isa.OPCODE] = ins.opcode
            w[isa.OPERANDS] = ins.operands
            w[isa.TILE] = ins.tile
            for (c, e), (wc, we) in zip(ins.waits, isa.WAITS):
                w[wc], w[we] = c, e
            w[isa.SIGNAL] = ins.signal
    return words, lengths


def whole_records(prog: Program, num_sms: int) -> int:
    """Shared-memory bytes of the instruction records of `prog` placed on `num_sms` SMs (the
    kernel's `reserved` beside the ring: all of them, or their window)."""
    from ..schedule import schedule
    return records_geometry(prog.opcodes.blocks, schedule(prog, num_sms).max_len)[1]


def fitted_sublayers(configs, build_sub, build_whole, num_sms: int) -> Program:
    """A whole program whose sublayers each fit the weight ring alone but may not together: the
    largest ring stage of one, the largest staged activations of another and the largest plain
    tile (a decode's pipeline) of a third share one SM's shared memory. build_sub(config) ->
    Program; build_whole(sublayer programs) -> the whole Program.

    When the whole does not fit, each sublayer is rebuilt with its first_fitting seeing, beside
    its own blocks, the streaming blocks of the other sublayers (their ring stages and staged
    activations), the plain tiles no sublayer holds (the collectives', the head's) and the whole's
    records. The ring's stage, activations and plain-tile arena are each a maximum over the
    blocks, so sublayers that each fit beside the others' streams fit together; the whole is
    checked again, and one that still does not fit raises the ring's UnsupportedConfigError now,
    at build time, not at compile time."""
    from ..blocks.base import ring_geometry
    built: dict = {}

    def build(c):
        """A config's program, built once: a model's layers repeat a few configs (Kimi K3 full:
        122 sublayers, 4 configs), and the whole only reads the sublayer programs."""
        try:
            if c not in built:
                built[c] = build_sub(c)
            return built[c]
        except TypeError:               # an unhashable config: built each time
            return build_sub(c)
    subs = [build(c) for c in configs]
    whole = build_whole(subs)
    rec = whole_records(whole, num_sms)
    try:
        ring_geometry(whole.opcodes.blocks, reserved=rec)
        return whole
    except UnsupportedConfigError:
        pass
    in_subs = set().union(*(sub.opcodes.blocks for sub in subs))
    fixed = [b for b in whole.opcodes.blocks if not b.stream_chunks() and b not in in_subs]
    refit = []
    built.clear()                        # the refit builds each config again, beside the others' streams
    for c, sub in zip(configs, subs):
        own = set(sub.opcodes.blocks)
        others = [b for b in whole.opcodes.blocks if b.stream_chunks() and b not in own]
        token = _RING_CONTEXT.set((tuple(others + fixed), rec))
        try:
            refit.append(build(c))
        finally:
            _RING_CONTEXT.reset(token)
    whole = build_whole(refit)
    ring_geometry(whole.opcodes.blocks, reserved=whole_records(whole, num_sms))
    return whole
