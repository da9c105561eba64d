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
    from .router import RouterSelectBlock
    from .mla_decode import MLACombineBlock, MLADecodeBlock, MLAHeadProjBlock
    from .mla_prologue import MLARopeAppendBlock
    from .mhc import MHCMixBlock, MHCPostBlock, MHCPreBlock
    from .dsv4_attention import DSV4CombineBlock, DSV4DecodeBlock, DSV4RingWriteBlock
    from .dsv4_compress import DSV4CompressBlock, DSV4CompressNormBlock
    from .dsv4_prologue import DSV4IndexQBlock, DSV4PrologueBlock
    from .indexer import IndexScoreBlock, TopKBlock
    from .ep import EPCombineBlock, EPDispatchBlock, EPTableBlock
    from .embed import EmbedStreamsBlock
    return [RMSNormBlock, GemvBlock, KDABlock, RouterSelectBlock, ExpertsBlock,
            MLADecodeBlock, MLACombineBlock, MLAHeadProjBlock, MLARopeAppendBlock, MHCMixBlock, MHCPreBlock, MHCPostBlock,
            DSV4DecodeBlock, DSV4CombineBlock, DSV4RingWriteBlock, DSV4CompressBlock, DSV4CompressNormBlock, DSV4PrologueBlock,
            DSV4IndexQBlock,
            IndexScoreBlock, TopKBlock, EPDispatchBlock, EPTableBlock, EPCombineBlock, EmbedStreamsBlock]


__all__ = ["Block", "Cost", "OperandSpec", "NUM_THREADS", "builtin_blocks"]
