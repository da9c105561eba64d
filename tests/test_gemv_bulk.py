"""GemvConfig.bulk (opt-in, megakernel only): a chunk's weight rows and fp8 scale runs as
cp.async.bulk copies issued by one warp, completing on the ring's per-stage mbarrier, instead of
cp.async by every producer thread. Here: what it refuses, and that the one-launch stacks compile
for Hopper and Blackwell with the bulk copies and the per-chunk mbarrier waits in their PTX (the
GPU twin: tests/gpu/test_megakernel_gpu.py::test_mlp_stack_bulk_copies)."""
import pytest


def test_bulk_refuses_the_wgmma_layout_and_standalone_launches():
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError, match="bulk"):
        GemvBlock(GemvConfig(n=1024, k=7168, m=1, weight_dtype="fp8_e4m3", fp8_decode="wgmma", bulk=True))
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    with pytest.raises(UnsupportedConfigError, match="megakernel only"):
        standalone(GemvBlock(GemvConfig(n=1024, k=7168, m=1, weight_dtype="bf16", rows_per_tile=8, bulk=True)), "sm_90a")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("wd,batch", [("fp8_e4m3", 1), ("bf16", 8)])
def test_bulk_stack_compiles(arch, wd, batch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, batch=batch, weight_dtype=wd, bulk=True))
    blocks = prog.opcodes.blocks
    assert all(b.device_stream().issue_bulk is not None for b in blocks if b.stream_chunks())
    compile_megakernel(blocks, 132, schedule(prog, 132).max_len, timing=True, arch=arch)


def test_bulk_stack_ptx_has_the_bulk_copies_and_their_waits(tmp_path):
    """The fp8 stack at batch 1 (sm_90a; the DSL keeps its PTX in the working directory of a fresh
    process): the chunks are bulk copies, each waited for on its stage's mbarrier, no cp.async left."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    import os
    import subprocess
    import sys
    code = ("from sdk.megakernel.kernel import compile_megakernel\n"
            "from sdk.megakernel.mlp_stack import MLPStackConfig, build_program\n"
            "from sdk.schedule import schedule\n"
            "p = build_program(MLPStackConfig(intermediate=2048, layers=1, weight_dtype='fp8_e4m3', bulk=True))\n"
            "compile_megakernel(p.opcodes.blocks, 132, schedule(p, 132).max_len, arch='sm_90a')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_KEEP_PTX="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, timeout=600)
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert ptx, "no PTX kept"
    assert ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes") >= 4
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "cp.async.cg.shared.global" not in ptx
