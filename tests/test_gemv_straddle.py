"""fp8 GEMV tiles whose rows straddle two 128-row scale blocks (rows_per_tile not dividing 128: the
CUDA-core hfma2 consumer, opt-in until measured - e.g. the MLP stack's down GEMV in 56-row tiles,
128 of them for 132 SMs instead of 112 of 64 rows). The GPU twins: tests/gpu/test_megakernel_gpu.py
test_gemv_fp8_straddling_tiles, test_mlp_stack_fp8_straddling_down_tiles."""
import pytest

from sdk.blocks.gemv import GemvBlock, GemvConfig, balanced_config
from sdk.errors import UnsupportedConfigError


def test_straddling_rows_legal_for_hfma2_only():
    b = GemvBlock(GemvConfig(n=7168, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=56))
    assert b.hfma2 and b.scale_rows == 2
    # two blocks' scales a chunk: 16 bytes x scale units x 2 more than a dividing tile's one
    assert b.chunk_bytes() == 16 * (56 * b.pitch_units + 2 * b.scale_units)
    assert GemvBlock(GemvConfig(n=7168, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=64)).scale_rows == 1
    assert GemvBlock(GemvConfig(n=7168, k=2048, rows_per_tile=56)).scale_rows == 1        # bf16: no scales
    for kw in ({"fp8_decode": "cvt"}, {"fp8_decode": "wgmma"}, {"mma": True}, {"m": 8}):
        with pytest.raises(UnsupportedConfigError, match="straddle two blocks"):
            GemvBlock(GemvConfig(n=7168, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=56, **kw))


def test_balanced_tiles_do_not_straddle():
    """The balanced cut keeps dividing rows until straddling tiles are measured (64 for 7168)."""
    cfg = balanced_config(GemvConfig(n=7168, k=2048, weight_dtype="fp8_e4m3", out_dtype="fp32", residual="bf16"))
    assert cfg.rows_per_tile == 64


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_straddling_tiles_compile(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    for r in (24, 40):
        standalone(GemvBlock(GemvConfig(n=r * 32, k=2048, weight_dtype="fp8_e4m3", rows_per_tile=r, swiglu=r < 32)), arch)
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", down_rows=56))
    assert [op.instructions and prog.instructions[op.instructions[0]].block.config.rows_per_tile
            for op in prog.ops[:2]] == [16, 56]
    compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, arch=arch)
