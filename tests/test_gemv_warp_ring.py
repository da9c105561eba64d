"""The warp-sliced ring (GemvConfig.warp_ring, base.ring_mode): each warp copies the weight units
its own lanes read into its slice of the stage, so a chunk needs warp barriers only. Its legality
(CUDA-core consumers, whole x), its chunk bytes, the kernels refusing a half-sliced ring, and
that the GEMV alone and the one-launch stack compile with it. The GPU checks against the
reference are in tests/gpu/test_megakernel_gpu.py."""
import pytest

from sdk.blocks.base import ring_mode
from sdk.blocks.gemv import GemvBlock, GemvConfig
from sdk.errors import UnsupportedConfigError


def test_warp_ring_legal_for_cuda_core_consumers_with_whole_x():
    ok = GemvBlock(GemvConfig(n=7168, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=56, warp_ring=True))
    assert ok.warp_ring()
    for kw, why in (({"mma": True}, "CUDA-core"), ({"fp8_decode": "wgmma"}, "CUDA-core"),
                    ({"m": 8, "k": 7168, "mma": False}, "whole x")):
        cfg = dict(n=2048, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=16, warp_ring=True)
        cfg.update(kw)
        with pytest.raises(UnsupportedConfigError, match=why):
            GemvBlock(GemvConfig(**cfg))


def test_warp_ring_chunk_bytes():
    """8 slices, each a warp's rows unpadded then its own copy of the fp8 scales."""
    fp8 = GemvBlock(GemvConfig(n=2048, k=7168, weight_dtype="fp8_e4m3", swiglu=True, rows_per_tile=16,
                               chunk_k=1024, warp_ring=True))
    # per warp: 2 weights x 2 rows x 64 units + 2 weights x 2 scale units (16 bytes each)
    assert fp8.slice_bytes() == 16 * (2 * 2 * 64 + 2 * 2)
    assert fp8.chunk_bytes() == 8 * fp8.slice_bytes()
    bf16 = GemvBlock(GemvConfig(n=7168, k=2048, rows_per_tile=56, chunk_k=512, warp_ring=True))
    assert bf16.chunk_bytes() == 8 * 16 * 7 * 64


def test_ring_mode_all_or_none():
    sliced = GemvBlock(GemvConfig(n=1024, k=2048, rows_per_tile=16, warp_ring=True))
    rows = GemvBlock(GemvConfig(n=1024, k=2048, rows_per_tile=16))
    assert ring_mode([sliced]) and not ring_mode([rows]) and not ring_mode([])
    with pytest.raises(UnsupportedConfigError, match="all or none"):
        ring_mode([sliced, rows])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_warp_ring_compiles(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    standalone(GemvBlock(GemvConfig(n=1024, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=16, swiglu=True,
                                    warp_ring=True)), arch)
    for wd in ("fp8_e4m3", "bf16"):
        prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype=wd, warp_ring=True))
        assert ring_mode(prog.opcodes.blocks)
        compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, arch=arch)


def test_stack_warp_ring_auto():
    """MLPStackConfig.warp_ring=None: sliced wherever every GEMV can be (CUDA cores, whole x)."""
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    for batch, want in ((1, True), (4, True), (8, False), (64, False)):
        prog = build_program(MLPStackConfig(intermediate=2048, layers=1, batch=batch, weight_dtype="fp8_e4m3",
                                            warp_ring=None))
        assert ring_mode(prog.opcodes.blocks) is want, batch
