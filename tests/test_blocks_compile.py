"""Compile every block and the megakernel for sm_90a, sm_100a and sm_103a with no GPU."""
import pytest

from sdk.compile import ARCHS, compile_check, failures


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all_blocks_and_megakernel(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    report = compile_check([arch])
    assert not failures(report), "\n".join(failures(report))
    assert len(report[arch]) >= 9          # 7 block cases + 2 megakernel cases were compiled


def test_import_sdk_without_cutlass():
    """`import sdk`, the blocks' torch faces and the PyVM never import CuTe DSL."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['cutlass'] = None; import sdk, sdk.blocks, sdk.schedule, "
            "sdk.megakernel.pyvm, sdk.megakernel.mlp_stack, sdk.compile; "
            "from sdk.megakernel.mlp_stack import MLPStackConfig, build_program; "
            "build_program(MLPStackConfig(hidden=1024, intermediate=512, layers=1)); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr



def test_gemv_ring_rows_compile():
    """GemvBlock's ring copies by rows (producer warp w rows w, w + 7, ...): bf16 and fp8 (with its
    scales), 16 rows over the 7 producer warps (some a row short), one and two weights."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks import gemv
    from sdk.blocks._cute import standalone
    for wd, k, swiglu in (("bf16", 3072, True), ("fp8_e4m3", 5120, True), ("fp8_e4m3", 5120, False)):
        standalone(gemv.GemvBlock(gemv.GemvConfig(n=1024, k=k, weight_dtype=wd, swiglu=swiglu, rows_per_tile=16)),
                   "sm_90a")
