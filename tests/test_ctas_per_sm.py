"""Several CTAs sharing an SM in one megakernel launch (MegakernelRuntime(ctas_per_sm=N)): each
CTA's shared-memory budget, the ring that fits it, and the kernel compiling with the register cap
(nvvm.minctasm) with no GPU. The GPU twin: tests/gpu/test_megakernel_gpu.py
test_mlp_stack_two_ctas_per_sm."""
import pytest

from sdk.blocks.base import CTA_RESERVED_SMEM, SM_SMEM, SMEM_BUDGET, ring_geometry, smem_budget


def test_budgets_fit_the_sm():
    assert smem_budget(1) == SMEM_BUDGET
    for n in (2, 3, 4):
        # the same margin below the per-CTA limit as one CTA keeps below its 227 KB
        assert n * (smem_budget(n) + (227 * 1024 - SMEM_BUDGET) + CTA_RESERVED_SMEM) <= SM_SMEM
        assert smem_budget(n) < smem_budget(n - 1)
    with pytest.raises(ValueError, match="ctas_per_sm=0"):
        smem_budget(0)


def test_stack_ring_in_half_the_smem():
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    blocks = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3",
                                          num_sms=264)).opcodes.blocks
    stage, stages, xbytes = ring_geometry(blocks, budget=smem_budget(2))
    one = ring_geometry(blocks)
    assert stage == one[0] and xbytes == one[2] and 2 <= stages < one[1]
    assert stage * stages + xbytes <= smem_budget(2)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_two_ctas_per_sm_compiles(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3", num_sms=264))
    compile_megakernel(prog.opcodes.blocks, 264, schedule(prog, 264).max_len, arch=arch, ctas_per_sm=2)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_relaxed_wait_poll_compiles(arch, monkeypatch):
    """SDK_WAIT_POLL=relaxed (bounded_wait polls with relaxed loads, one fence.acq_rel after):
    the stack compiles, and the compile cache keys on the poll mode."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks import _cute
    from sdk.megakernel import kernel
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program
    from sdk.schedule import schedule
    prog = build_program(MLPStackConfig(intermediate=2048, layers=2, weight_dtype="fp8_e4m3"))
    args = (prog.opcodes.blocks, 132, schedule(prog, 132).max_len)
    a = kernel.compile_megakernel(*args, arch=arch)
    monkeypatch.setattr(_cute, "WAIT_POLL", "relaxed")
    b = kernel.compile_megakernel(*args, arch=arch)
    assert a is not b
