"""The ring's lagged refill (SDK_RING_REFILL=lagged, opt-in, not yet measured on a GPU): a consumed
chunk's stage is refilled after the next chunk's barrier, one barrier a chunk instead of two
(sdk/blocks/_cute.py stream_tile). Compiled here with no GPU for Hopper and Blackwell, standalone
and inside the megakernel; run on the H200 with the GPU suite under SDK_RING_REFILL=lagged."""
import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")


@pytest.fixture
def lagged(monkeypatch):
    import sdk.blocks._cute as C
    monkeypatch.setattr(C, "RING_REFILL", "lagged")


def test_lagged_only_with_three_stages_or_more(lagged):
    """Two stages would leave no chunk in flight beyond the one waited for: they keep the refill
    right after the consume."""
    from sdk.blocks._cute import lagged_refill
    assert [lagged_refill(p) for p in (2, 3, 16)] == [False, True, True]


def test_gemv_restages_x_mid_tile_in_some_cases():
    """The case the lagged form's prep barrier is for: a GEMV whose x does not fit sx whole
    restages it at chunks ch % CPX == 0, ch > 0, while other threads may still read the last one."""
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    b = GemvBlock(GemvConfig(n=1024, k=18432, m=8))
    assert b.x_block < b.config.k and b.stream_chunks() > 1


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_lagged_ring_compiles(lagged, arch):
    """Standalone GEMVs (bf16 / fp8 at batch 1, bf16 at batch 8 with x restaged mid-tile), the
    one-launch stack and the V4.1 HCA sublayer's megakernel (GEMVs beside plain tiles)."""
    from sdk.blocks._cute import standalone
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.compile import sublayer_megakernel_cases
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    for n, k, m, wd in ((2048, 7168, 1, "bf16"), (2048, 7168, 1, "fp8_e4m3"), (1024, 18432, 8, "bf16")):
        standalone(GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype=wd)), arch)
    progs = [prog for _, prog in sublayer_megakernel_cases()][:1]
    progs.append(build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3")))
    for prog in progs:
        compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, timing=True, arch=arch)


def test_unknown_refill_order_is_a_clear_error():
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "import sdk.blocks._cute"], capture_output=True, text=True,
                       env={**os.environ, "SDK_RING_REFILL": "early"})
    assert r.returncode != 0 and "SDK_RING_REFILL='early'" in r.stderr
