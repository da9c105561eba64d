"""The weight ring's bulk-copy form (SDK_RING_COPIES=bulk, opt-in, not yet measured on a GPU):
one producer warp issues each chunk's row segments as cp.async.bulk onto the stage's mbarrier
and the consumers wait on its phase (sdk/blocks/_cute.py). Compiled here with no GPU for Hopper
and Blackwell, standalone and inside the megakernel; run on the H200 with the GPU suite under
SDK_RING_COPIES=bulk (bench/NOTES.md)."""
import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")


@pytest.fixture
def bulk(monkeypatch):
    import sdk.blocks._cute as C
    monkeypatch.setattr(C, "RING_COPIES", "bulk")


def test_only_row_major_stages_take_bulk_copies(bulk):
    """The GEMV's CUDA-core and mma layouts (row segments contiguous in the stage) offer the bulk
    issue; the wgmma core-matrix layout and the KDA stream do not, so a kernel with them keeps
    cp.async."""
    from sdk.blocks._cute import bulk_ring
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.blocks.kda import KDABlock, KDAConfig
    faces = [GemvBlock(GemvConfig(n=2048, k=7168, m=m, weight_dtype=wd)).device_stream()
             for m, wd in ((1, "bf16"), (1, "fp8_e4m3"), (8, "bf16"))]
    assert bulk_ring(faces)
    wg = GemvBlock(GemvConfig(n=2048, k=7168, m=1, weight_dtype="fp8_e4m3", fp8_decode="wgmma")).device_stream()
    assert not bulk_ring(faces + [wg])
    kda = KDABlock(KDAConfig(batch=1, heads=4, head_dim=128, stream=True))
    assert kda.stream_chunks() and not bulk_ring(faces + [kda.device_stream()])


def test_which_programs_take_the_bulk_form(bulk):
    """The attention sublayers and Kimi K3's MoE layer stream GEMVs only: their kernels take the
    bulk form (what the A/B in bench/optin_gpu_session.sh measures)."""
    from sdk.blocks._cute import bulk_ring
    from sdk.compile import sublayer_megakernel_cases
    from sdk.megakernel.moe_layer import build_program, preset

    def streams(prog):
        return [b.device_stream() for b in prog.opcodes.blocks if b.stream_chunks()]
    for _, prog in sublayer_megakernel_cases():
        assert streams(prog) and bulk_ring(streams(prog))
    moe = streams(build_program(preset("kimi_k3", batch=1)))
    assert moe and bulk_ring(moe)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_bulk_ring_compiles(bulk, arch):
    """Standalone GEMVs (bf16 and fp8 at batch 1, bf16 at batch 8 on the MMA path) and the V4.1
    HCA sublayer's megakernel (GEMVs beside plain tiles; the early-exit drain of issued chunks)."""
    from sdk.blocks._cute import standalone
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.compile import sublayer_megakernel_cases
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.schedule import schedule
    for m, wd in ((1, "bf16"), (1, "fp8_e4m3"), (8, "bf16")):
        standalone(GemvBlock(GemvConfig(n=2048, k=7168, m=m, weight_dtype=wd)), arch)
    for _, prog in sublayer_megakernel_cases():
        compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, timing=True, arch=arch)
