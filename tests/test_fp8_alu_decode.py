"""fp8_decode="hfma2_alu" (opt-in; H100, weights hot in the L2: 25% slower than F2FP): the
CUDA-core fp8 GEMV's e4m3 -> f16 step in integer ops (sdk/blocks/_cute.py
e4m3x4_to_f16x2x2_shifted). The bit placement is checked here for every e4m3 byte in every
position of a word, in the same integer ops as the PTX; the kernels compile with no GPU for Hopper
and Blackwell; the GPU twins are in tests/gpu/test_megakernel_gpu.py
(test_gemv_fp8_alternative_decodes, test_mlp_stack_fp8_alu_decode)."""
import pytest
import torch


def shifted_pairs(words: torch.Tensor):
    """The PTX's ops on int64 words (the low 32 bits): f16x2 bits of bytes (0, 2) and (1, 3)."""
    def place(v):
        return ((v & 0x7F007F00) >> 1) | (v & 0x80008000)
    return place((words << 8) & 0xFFFFFFFF), place(words)


def f16_halves(bits: torch.Tensor):
    lo = (bits & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)
    hi = ((bits >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)
    return lo.float(), hi.float()


def test_bit_placement_is_the_e4m3_value_times_2_to_minus_8():
    byte = torch.arange(256, dtype=torch.int64)
    finite = (byte & 0x7F) != 0x7F                  # e4m3fn's NaN encodings (quantizers never write them)
    want = byte.to(torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -8
    other = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    for pos in range(4):
        # the byte under test at `pos`, random bytes elsewhere (they must not leak in)
        words = torch.zeros(256, dtype=torch.int64)
        for q in range(4):
            words |= (byte if q == pos else other.roll(q)) << (8 * q)
        even, odd = shifted_pairs(words)
        got = f16_halves(even if pos % 2 == 0 else odd)[pos // 2]
        assert torch.equal(got[finite], want[finite]), f"byte position {pos}"


def test_unknown_decode_names_the_supported_ones():
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError, match="hfma2_alu"):
        GemvBlock(GemvConfig(n=1024, k=7168, m=1, weight_dtype="fp8_e4m3", fp8_decode="alu"))
    assert GemvBlock(GemvConfig(n=1024, k=7168, m=1, weight_dtype="fp8_e4m3", fp8_decode="hfma2_alu")).hfma2


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_alu_decode_compiles(arch):
    """Standalone GEMVs (plain, the fused norm merged at m = 1, staged per x block at m = 4) and
    the one-launch fp8 stack."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    for m, norm in ((1, False), (1, True), (4, True)):
        standalone(GemvBlock(GemvConfig(n=2048, k=7168, m=m, weight_dtype="fp8_e4m3", norm=norm, swiglu=True,
                                        fp8_decode="hfma2_alu", rows_per_tile=8)), arch)
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", fp8_decode="hfma2_alu"))
    compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, timing=True, arch=arch)
