"""Cross-rank communication for the megakernel: symmetric buffers and all-reduce ops.

- `buffers`: one symmetric region per rank laid out identically on every rank
  (`SymmetricLayout`), behind one interface (`SymmetricBuffers`) with two implementations:
  `VirtualRanks` (N plain allocations on one GPU or the CPU: a peer's "remote" pointer is just
  the other allocation's pointer; for tests and single-GPU benchmarks) and
  `TorchSymmetricMemory` (one process per GPU, `torch.distributed._symmetric_memory`: peer
  views over NVLink; torch.distributed is imported lazily, nothing touches CUDA at import).
- `ops`: `CommProgram`, which adds fused all-reduce (+ residual + RMSNorm, or + the mHC post-mix:
  `MHCEpilogue`) ops to a megakernel `Program` (one-shot or two-shot by message size) and binds
  the symmetric views per rank.
- `vm`: `MultiRankVM`, the PyVM of N ranks run together (interleaved, unsynchronised steps).
- `runtime`: `TPRuntime`, N virtual ranks as N concurrent megakernel launches on one GPU.

The device code is `sdk/blocks/allreduce.py`; the design and its safety argument are in
docs/allreduce.md.
"""
from .buffers import SymmetricBuffers, SymmetricLayout, TorchSymmetricMemory, VirtualRanks
from .ops import CommProgram, MHCEpilogue, choose_algo, crossover_bytes

__all__ = ["SymmetricBuffers", "SymmetricLayout", "TorchSymmetricMemory", "VirtualRanks", "CommProgram",
           "MHCEpilogue", "choose_algo", "crossover_bytes"]
