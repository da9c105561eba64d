"""CuTe DSL helpers shared by the blocks and the megakernel. Imports cutlass: import this module
only inside functions that build device code (never at `import sdk`).

- `gmem_tensor(ptr, dtype, shape, align)`: a global tensor with a static row-major layout over a
  raw int64 device address (operand-table entries are raw addresses).
- `block_sum(value, scratch)`: fp32 sum over the CTA's threads (warp shuffles + smem).
- `standalone(block, arch)`: the block's own kernel, one CTA per tile, for tests and benchmarks.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from .base import NUM_THREADS

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


def standalone(block, arch: str | None = None):
    """Compile `block`'s standalone kernel: grid = block.num_tiles(), one tile per CTA, operand
    pointers read from a device int64 array (same table format as the megakernel's).

    Returns `fn(optab_addr: int, stream)`. With `arch` set, compiles for that GPU arch with no GPU
    present (compile check)."""
    tile_fn = block.device_tile()
    nops = len(block.operands())
    ntiles = block.num_tiles()

    @cute.kernel
    def kernel(optab: Int64):
        smem = SmemAllocator()
        scratch = smem.allocate_tensor(Float32, cute.make_layout(64), byte_alignment=16)
        mOps = gmem_tensor(optab, Int64, (nops,), 8)
        bid, _, _ = cute.arch.block_idx()
        ptrs = [mOps[j] for j in range(nops)]
        tile_fn(ptrs, bid, scratch)

    @cute.jit
    def host(optab: Int64, stream: "cuda.CUstream"):
        kernel(optab).launch(grid=(ntiles, 1, 1), block=(NUM_THREADS, 1, 1), stream=stream)

    import cuda.bindings.driver as cuda
    host.__annotations__["stream"] = cuda.CUstream
    opts = f"--gpu-arch {arch}" if arch else None
    args = (Int64(0), cuda.CUstream(0))
    return cute.compile(host, *args, options=opts) if opts else cute.compile(host, *args)
