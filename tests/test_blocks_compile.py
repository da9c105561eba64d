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
