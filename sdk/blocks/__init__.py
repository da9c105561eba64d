"""Device blocks of the megakernel: one module, one class each (the contract: `base.Block`).

Registered through the `register_blocks` hook (the SDK's own in `sdk/builtin_plugin.py`); the
module list here is what `builtin_blocks()` returns. Nothing here imports CuTe DSL.
"""
from .base import NUM_THREADS, Block, Cost, OperandSpec


def builtin_blocks() -> list[type]:
    from .gemv import GemvBlock
    from .rmsnorm import RMSNormBlock
    from .kda import KDABlock
    from .experts import ExpertsBlock
    from .router import RouterLogitsBlock, RouterSelectBlock
    from .mla_decode import MLACombineBlock, MLADecodeBlock, MLAHeadProjBlock
    return [RMSNormBlock, GemvBlock, KDABlock, RouterLogitsBlock, RouterSelectBlock, ExpertsBlock,
            MLADecodeBlock, MLACombineBlock, MLAHeadProjBlock]


__all__ = ["Block", "Cost", "OperandSpec", "NUM_THREADS", "builtin_blocks"]
