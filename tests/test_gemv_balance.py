"""The GEMV's rows over the SMs, and its standalone launch's defaults (CPU).

Balance: the busiest SM's tiles / the mean over all 132 SMs (GemvBlock.tile_balance) stays
<= 1.05 for the decode GEMV shapes at batch 1 and 8, in both launch paths - the standalone
kernel (GemvConfig's 8 rows per tile, tile t on CTA t % grid) and the megakernel
(balanced_config's rows, placed by sdk/schedule.py) - and tile_balance is what those placements
really give. PDL: the standalone streaming kernel launches with it unless told not to (measured
2026-12-03 on the H200: 7168x2048 52.4% -> 69.3% of the copy bandwidth, 4096x7168 73.4% -> 86.7%).
"""
import inspect

import pytest

from sdk.blocks.gemv import TILE_OVERHEAD_BYTES, GemvBlock, GemvConfig, balanced_config
from sdk.megakernel.program import Program
from sdk.schedule import schedule

SMS = 132
SHAPES = [(7168, 2048), (4096, 7168), (18432, 7168), (7168, 18432)]     # (n rows, k)
BALANCE_MAX = 1.05


def _placed(block: GemvBlock, num_sms: int = SMS) -> list[int]:
    """Tiles per SM as the megakernel's scheduler places a program of this one GEMV op."""
    c = block.config
    prog = Program()
    prog.buffer("x", (c.m, c.k), "bf16", "input")
    prog.buffer("w", (c.n, c.k), c.weight_dtype, "weight")
    ops = {"w": "w", "x": "x", "y": "y"}
    if c.weight_dtype == "fp8_e4m3":
        prog.buffer("w_scale", (c.n // 128, c.k // 128), "fp32", "weight")
        ops["w_scale"] = "w_scale"
    prog.buffer("y", (c.m, c.n), "bf16", "output")
    prog.op(block, ops, label="gemv")
    return [len(lst) for lst in schedule(prog, num_sms).per_sm]


def _dealt(block: GemvBlock, num_sms: int = SMS) -> list[int]:
    """Tiles per SM of the standalone persistent kernel: grid min(tiles, SMs), tile t on CTA t % grid."""
    t = block.num_tiles()
    g = min(t, num_sms)
    per = [0] * num_sms
    for i in range(t):
        per[i % g] += 1
    return per


def _ratio(per: list[int]) -> float:
    return max(per) * len(per) / sum(per)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
def test_standalone_gemv_tiles_balanced(n, k, m, wd):
    """The standalone GEMV (the benchmark's launch): 7168 / 4096 / 18432 rows in 8-row tiles are
    896 / 512 / 2304 tiles, 7 / 4 / 18 on the busiest SM: 1.031 x the mean. Tiles stay worth a
    launch's per-tile cost (bf16): at least TILE_OVERHEAD_BYTES of weights, stages of >= 8 KB.
    fp8 on the CUDA cores with K = 7168 (1024-column chunks at most) takes 16 rows, so a chunk
    holds 16 KB (standalone_rows: 65.5% -> 90.2% of copy at 18432 x 7168 on the H200)."""
    block = GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype=wd))
    assert block.config.rows_per_tile == (16 if wd == "fp8_e4m3" and m == 1 and k == 7168 else 8)
    if not block.use_mma:            # every CUDA-core default chunk holds at least 16 KB
        assert block.chunk_bytes() >= 16 * 1024
    assert block.tile_balance(SMS) == pytest.approx(_ratio(_dealt(block)))
    assert block.tile_balance(SMS) <= BALANCE_MAX, (n, k, m, block.num_tiles())
    if wd == "bf16":
        assert block.config.rows_per_tile * k * block.wbytes >= TILE_OVERHEAD_BYTES
        assert block.chunk_bytes() >= 8 * 1024


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_megakernel_gemv_tiles_balanced(n, k, m):
    """The GEMV inside the megakernel (balanced_config's rows, bf16): 7168 rows -> 56-row tiles
    (128 tiles, one per SM, 4 SMs idle), 4096 -> 32 rows (128), 18432 -> 48 rows (384, 3 on the
    busiest SM): 1.031 each; the scheduler's placement gives exactly tile_balance."""
    block = GemvBlock(balanced_config(GemvConfig(n=n, k=k, m=m)))
    assert block.tile_balance(SMS) == pytest.approx(_ratio(_placed(block)))
    assert block.tile_balance(SMS) <= BALANCE_MAX, (n, k, m, block.config.rows_per_tile)


def test_tile_balance_counts_the_busiest_sm():
    """16-row tiles of 7168 rows: 448 tiles, 4 on some SMs against a mean of 3.39 (+18%)."""
    block = GemvBlock(GemvConfig(n=7168, k=2048, rows_per_tile=16))
    assert block.num_tiles() == 448
    assert block.tile_balance(SMS) == pytest.approx(4 / (448 / 132))
    assert block.tile_balance(SMS) == pytest.approx(_ratio(_placed(block)))
    assert GemvBlock(GemvConfig(n=1056, k=2048)).tile_balance(SMS) == 1.0     # 132 tiles


def test_standalone_launches_with_pdl_by_default():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    # None: on for streaming blocks (the GEMV), off for one-tile-per-CTA kernels unless asked
    assert inspect.signature(standalone).parameters["pdl"].default is None
    block = GemvBlock(GemvConfig(n=7168, k=2048))
    standalone(block, "sm_90a")                 # PDL launch, compiled with no GPU
    standalone(block, "sm_100a", pdl=False)     # the opt-out
    from sdk.blocks.kda import KDABlock, KDAConfig
    kda = KDABlock(KDAConfig(batch=64, heads=8, v_split=4))
    standalone(kda, "sm_100a", pdl=True)                    # one tile per CTA, opt-in
    with pytest.raises(ValueError, match="one tile per CTA"):
        standalone(kda, "sm_90a", num_ctas=132)             # a grid size only streaming blocks take


def test_bench_gemv_cases_default_to_pdl():
    """The megakernel bench: unnamed GEMV cases are the PDL launch; " no-pdl" keeps the plain one
    for the two short GEMVs (7168x2048, 4096x7168) measured both ways."""
    from bench.megakernel_bench import _gemv_name, bench_gemv, gemv_cases
    assert inspect.signature(bench_gemv).parameters["pdl"].default is True
    assert _gemv_name(7168, 2048, 1, "bf16") == "gemv n=7168 k=2048 m=1 bf16"
    assert _gemv_name(7168, 2048, 1, "bf16", pdl=False) == "gemv n=7168 k=2048 m=1 bf16 no-pdl"
    for quick in (True, False):
        cases = gemv_cases(quick)
        assert cases[0][:2] == (7168, 2048) and cases[0][5] is True
        plain = {c[:2] for c in cases if c[5] is False}
        assert (7168, 2048) in plain and all(c[5] is True for c in cases if c[:2] not in plain)
    assert {c[:2] for c in gemv_cases(False) if c[5] is False} == {(7168, 2048), (4096, 7168)}


@pytest.mark.parametrize("n,k,m,wd", [(7168, 2048, 1, "bf16"), (4096, 7168, 1, "bf16"), (18432, 7168, 1, "fp8_e4m3"),
                                      (18432, 7168, 8, "bf16"), (7168, 2048, 64, "bf16")])
def test_coresident_ring_fits_two_ctas_per_sm(n, k, m, wd):
    """With PDL the standalone ring is sized for two CTAs per SM (consecutive launches overlap):
    both CTAs' shared memory (ring + staged x + scratch + the hardware's per-CTA reserve) fits the
    SM, and the ring keeps at least 3 stages."""
    from sdk.blocks.base import CTA_RESERVED_SMEM, SCRATCH_WORDS, SM_SMEM, coresident_stages, ring_geometry
    block = GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype=wd))
    stages = coresident_stages([block])
    stage, got, xbytes = ring_geometry([block], stages)
    assert got == stages >= 3
    per_cta = stage * stages + xbytes + 4 * SCRATCH_WORDS + 256 + CTA_RESERVED_SMEM
    assert 2 * per_cta <= SM_SMEM
    assert ring_geometry([block])[1] > stages          # one CTA per SM would take a deeper ring


def test_fill_stage_widens_chunks_to_the_ring_stage_and_never_past_it():
    """The fp8 stack's gate/up chunks (16 rows x 512 = 16.9 KB) sat in the 33.9 KB stages the
    64-row down tiles make: fill_stage doubles them (33.3 KB); bf16's 16.9 KB gate/up chunk
    would be 33.3 KB past its 29.6 KB stage, so it stays; an explicit chunk_k wins."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program

    def streaming(cfg):
        prog = build_program(cfg)
        blocks = [b for b in prog.opcodes.blocks if b.stream_chunks()]
        return blocks, ring_geometry(prog.opcodes.blocks)[0]

    blocks, stage = streaming(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3"))
    assert [b.chunk_k for b in blocks[:2]] == [1024, 512]
    assert stage == 33920 and all(b.chunk_bytes() <= stage for b in blocks)
    blocks, stage = streaming(MLPStackConfig(intermediate=2048, layers=2))
    assert [b.chunk_k for b in blocks[:2]] == [256, 256] and stage == 29568
    blocks, _ = streaming(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", gateup_chunk_k=512))
    assert blocks[0].chunk_k == 512
    # tensor-core tiles (batch 8) keep their auto chunk: measured slower with the wider one
    blocks, _ = streaming(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", batch=8))
    assert blocks[0].use_mma and blocks[0].chunk_k == 512


def test_wgmma_fp8_config():
    """fp8_decode="wgmma": unpadded rows (core matrices), x staged as 8 rows of e4m3 pieces (3
    pieces up to 2 tokens, 2 up to 4), refused past 4 tokens; the
    CUDA-core paths keep their padded rows; bf16 ignores the knob."""
    import pytest
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.errors import UnsupportedConfigError
    b = GemvBlock(GemvConfig(n=7168, k=2048, m=1, rows_per_tile=64, weight_dtype="fp8_e4m3", fp8_decode="wgmma"))
    assert b.wgmma and b.x_pieces == 3 and b.pitch_units == b.chunk_k // 16
    assert b.x_smem_bytes() == 8 * b.x_block + 16 + 2 * 8 * 64 * 4
    assert GemvBlock(GemvConfig(n=7168, k=2048, m=4, rows_per_tile=64, weight_dtype="fp8_e4m3",
                                fp8_decode="wgmma")).x_pieces == 2
    h = GemvBlock(GemvConfig(n=7168, k=2048, m=1, rows_per_tile=64, weight_dtype="fp8_e4m3"))
    assert not h.wgmma and h.pitch_units == h.chunk_k // 16 + 1
    assert not GemvBlock(GemvConfig(n=7168, k=2048, m=1, fp8_decode="wgmma")).wgmma
    with pytest.raises(UnsupportedConfigError, match="wgmma: m=5"):
        GemvBlock(GemvConfig(n=7168, k=2048, m=5, rows_per_tile=64, weight_dtype="fp8_e4m3", fp8_decode="wgmma"))


def test_standalone_rows_keeps_the_tiles_balanced():
    """standalone_rows takes a taller tile for a fuller chunk only where the tiles stay spread:
    fp8 7168 x 7168 at 16 rows would be 448 tiles (1.18 x the mean on the busiest SM), so it keeps
    8 (8 KB chunks); an explicit rows_per_tile is kept as given."""
    block = GemvBlock(GemvConfig(n=7168, k=7168, m=1, weight_dtype="fp8_e4m3"))
    assert block.config.rows_per_tile == 8
    assert GemvBlock(GemvConfig(n=7168, k=7168, m=1, weight_dtype="fp8_e4m3", rows_per_tile=16)).tile_balance(SMS) > 1.05
    assert GemvBlock(GemvConfig(n=18432, k=7168, m=1, weight_dtype="fp8_e4m3", rows_per_tile=8)).config.rows_per_tile == 8


def test_standalone_whole_k_chunk_at_batch_1():
    """At batch 1 a standalone tile whose whole K fits CHUNK_MAX_BYTES takes it as one chunk (x staged
    once a tile; bf16 7168 x 2048: 83.6 -> 85.4% of copy on the H200); not at batch 4, not over an
    explicit chunk_k, not where K does not fit (7168 columns x 8 rows of bf16 are 112 KB)."""
    assert GemvBlock(GemvConfig(n=7168, k=2048, m=1)).chunk_k == 2048
    assert GemvBlock(GemvConfig(n=7168, k=2048, m=4)).chunk_k == 1024
    assert GemvBlock(GemvConfig(n=7168, k=2048, m=1, chunk_k=1024)).chunk_k == 1024
    assert GemvBlock(GemvConfig(n=18432, k=7168, m=1)).chunk_k == 1024


def test_env_switch_reads_zero_or_one_and_names_anything_else(monkeypatch):
    """The kernel-wide switches (SDK_REFILL_DEFER, SDK_WEIGHT_EVICT_FIRST) take 0 or 1; a typo is
    refused with the variable's name, not read as either."""
    from sdk.blocks.base import env_switch
    monkeypatch.delenv("SDK_TEST_SWITCH", raising=False)
    assert env_switch("SDK_TEST_SWITCH", "1", "on") is True
    monkeypatch.setenv("SDK_TEST_SWITCH", "0")
    assert env_switch("SDK_TEST_SWITCH", "1", "on") is False
    monkeypatch.setenv("SDK_TEST_SWITCH", "yes")
    with pytest.raises(ValueError, match="SDK_TEST_SWITCH='yes'"):
        env_switch("SDK_TEST_SWITCH", "1", "on")
