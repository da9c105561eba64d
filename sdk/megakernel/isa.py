"""The megakernel's instruction format, counters and error word (host and device agree on these).

An instruction is WORDS int32 words, built on the host, one list per SM:

    word 0  OPCODE      which (block, static config) variant to run; assigned by `OpcodeTable`
    word 1  OPERANDS    index of the instruction's first operand in the operand table (int64
                        device pointers; the block's `operands()` order, consecutive)
    word 2  TILE        the unit of work within the op (rows of a GEMV, a token of a norm, ...)
    word 3  WAIT0       dependency counter id, or NO_COUNTER
    word 4  EXPECT0     signals expected on WAIT0 per step: wait for counter >= epoch * EXPECT0
    word 5  WAIT1       second dependency counter id, or NO_COUNTER
    word 6  EXPECT1
    word 7  WAIT2       third dependency counter id, or NO_COUNTER
    word 8  EXPECT2
    word 9  SIGNAL      counter incremented (release atomic, +1) when the tile is done, or NO_COUNTER
    words 10, 11 (padding: records load as 16-byte vectors)

Counters are int32 in global memory and never reset: launch number `epoch` (1, 2, ...) waits for
`counter >= epoch * expected`. Counter EXIT_COUNTER (id 0) counts CTAs that left the kernel; a
CTA derives the epoch as `counters[0] // num_ctas + 1` at its start (the CTAs of the running
launch that already left add less than num_ctas, so the floor is exact), which needs no host
write per step and is safe under CUDA-graph replay. Int32 counters overflow after 2^31 / expected
steps (over 4 million steps for 512 signals per step); `MegakernelRuntime.reset()` zeroes them.

The error word (ERROR_WORDS int32) is zero while all is well; the first CTA whose bounded wait
expires claims it with a compare-and-swap and fills:
    [ERR_CODE, counter id, instruction index in its SM's list, SM (CTA) index, counter value seen,
     target value, opcode, epoch]
Every other CTA that sees a non-zero error word stops waiting and leaves; the host raises
`sdk.errors.KernelTimeoutError` with these fields decoded.
"""
from __future__ import annotations

WORDS = 12
OPCODE, OPERANDS, TILE, WAIT0, EXPECT0, WAIT1, EXPECT1, WAIT2, EXPECT2, SIGNAL = range(WORDS - 2)
WAITS = ((WAIT0, EXPECT0), (WAIT1, EXPECT1), (WAIT2, EXPECT2))     # (counter word, expected word)
MAX_WAITS = len(WAITS)
NO_COUNTER = -1
EXIT_COUNTER = 0

ERROR_WORDS = 8
ERR_TIMEOUT = 1
ERROR_FIELDS = ("code", "counter", "instruction", "sm", "seen", "target", "opcode", "epoch")

# The optional timing record: int64 [SMs, instructions, TIMING_STAMPS] of globaltimer ns, written
# by thread 0. START (after the waits) and END (after the signal) bound the instruction; WAIT is
# when its waits began (after its prologue), BEGUN when a streaming tile's begin (activations
# staged) returned, CHUNKS when its chunk loop ended (before its epilogue; plain tiles leave
# those two zero), SIGNAL after the tile's closing barrier, before the release atomic.
STAMP_START, STAMP_END, STAMP_WAIT, STAMP_BEGUN, STAMP_CHUNKS, STAMP_SIGNAL = range(6)
TIMING_STAMPS = 6
