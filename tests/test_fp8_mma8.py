"""fp8_decode="mma8" (opt-in until measured on a GPU): the CUDA-core fp8 GEMV's weights go from
the ring stage into mma.sync m16n8k32 e4m3 unconverted, against x split into e4m3 pieces laid in
the MMA's columns (sdk/blocks/gemv.py consume_mma8). Here: the pieces' arithmetic in torch (the
split, the per-k32 products of e4m3 values, the column weights 16^-p x the token's inverse scale)
against the fp32 product; the configuration's limits; the kernels compile with no GPU for Hopper
and Blackwell. The GPU twins: tests/gpu/test_megakernel_gpu.py (test_gemv_fp8_mma8,
test_mlp_stack_fp8_mma8)."""
import pytest
import torch

E4M3 = torch.float8_e4m3fn


def split_pieces(x: torch.Tensor, pieces: int):
    """x [M, K] fp32 -> (pieces [M, P, K] as e4m3 values in fp32, inverse scales [M]): each token
    scaled by the power of two putting its max |x| in [128, 256), then the kernel's chain: piece =
    e4m3(v), v = (v - piece) * 16 (e4m3_piece: round to nearest, saturating)."""
    amax = x.abs().amax(dim=1).clamp_min(2.0 ** -100)
    s = 7 - torch.floor(torch.log2(amax))                       # amax * 2^s in [128, 256)
    v = x * torch.exp2(s)[:, None]
    out = []
    for _ in range(pieces):
        p = v.clamp(-448, 448).to(E4M3).float()
        out.append(p)
        v = (v - p) * 16
    return torch.stack(out, 1), torch.exp2(-s)


@pytest.mark.parametrize("m,pieces", [(1, 3), (2, 3), (4, 2), (8, 2)])
def test_pieces_times_e4m3_weights_equal_the_fp32_product(m, pieces):
    g = torch.Generator().manual_seed(m)
    n, k = 64, 1024
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(E4M3).float()   # e4m3 weights
    scale = torch.rand(n // 16, k // 128, generator=g) + 0.5                      # per 16 x 128 block
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, m)[:, None]
    want = x @ (w * scale.repeat_interleave(16, 0).repeat_interleave(128, 1)).T
    p, inv = split_pieces(x, pieces)
    got = torch.zeros(n, m)
    for kb in range(k // 128):                  # one warp's 4 k32 MMAs from zero, then promoted
        cols = slice(128 * kb, 128 * (kb + 1))
        part = w[:, cols] @ p[:, :, cols].reshape(m * pieces, 128).T             # [n, m P] columns
        weight = (16.0 ** -torch.arange(pieces)).repeat(m) * inv.repeat_interleave(pieces)
        sc = scale[:, kb].repeat_interleave(16)
        got += (part * weight * sc[:, None]).reshape(n, m, pieces).sum(-1)
    err = ((got.T - want).norm() / want.norm()).item()
    assert err <= (2e-3 if pieces == 2 else 1e-4), err


def test_mma8_limits_named():
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.errors import UnsupportedConfigError
    b = GemvBlock(GemvConfig(n=1024, k=7168, m=1, weight_dtype="fp8_e4m3", fp8_decode="mma8", rows_per_tile=16))
    assert b.mma8 and b.x_pieces == 3 and b.mma_tiles == (1, 1) and b.chunk_k % 256 == 0
    assert GemvBlock(GemvConfig(n=1024, k=7168, m=4, weight_dtype="fp8_e4m3", fp8_decode="mma8",
                                rows_per_tile=16)).mma_tiles == (1, 1)       # 2 pieces x 4 tokens: one n8 tile
    # from batch 8 the MMA path takes over (it converts); forced off, 8 tokens x 2 pieces = 2 n8 tiles
    assert not GemvBlock(GemvConfig(n=1024, k=7168, m=8, weight_dtype="fp8_e4m3", fp8_decode="mma8",
                                    rows_per_tile=16)).mma8
    assert GemvBlock(GemvConfig(n=1024, k=7168, m=8, weight_dtype="fp8_e4m3", fp8_decode="mma8", mma=False,
                                rows_per_tile=16)).mma_tiles == (1, 2)
    with pytest.raises(UnsupportedConfigError, match="mma8: m=9"):
        GemvBlock(GemvConfig(n=1024, k=7168, m=9, weight_dtype="fp8_e4m3", fp8_decode="mma8", mma=False,
                             rows_per_tile=16))
    with pytest.raises(UnsupportedConfigError, match="mma8: chunk_k=2048"):
        GemvBlock(GemvConfig(n=1024, k=7168 * 2, m=1, weight_dtype="fp8_e4m3", fp8_decode="mma8",
                             rows_per_tile=8, chunk_k=2048))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_mma8_compiles(arch):
    """Standalone GEMVs (8-row tiles, the fused norm merged at m = 1 / 2 from bf16 / fp32 x and in
    two passes at m = 4, 2 n8 tiles at m = 8, x in two staged blocks) and the one-launch fp8 stack."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    for m, n, k, rows, norm, xdt in ((1, 2048, 2048, 8, False, "bf16"), (1, 1024, 7168, 16, True, "bf16"),
                                     (2, 1024, 7168, 16, True, "fp32"), (4, 1024, 7168, 16, True, "bf16"),
                                     (8, 1024, 7168, 32, False, "bf16"), (1, 1024, 36864, 16, True, "bf16")):
        standalone(GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype="fp8_e4m3", norm=norm, swiglu=True, mma=False,
                                        fp8_decode="mma8", rows_per_tile=rows, x_dtype=xdt)), arch)
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", fp8_decode="mma8"))
    compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, timing=True, arch=arch)
