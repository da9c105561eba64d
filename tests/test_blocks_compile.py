"""Compile every block and the MLP-stack megakernel for sm_90a, sm_100a and sm_103a, and each larger
program (sublayers, decoder layers, whole models, TP rank programs) for sm_90a and sm_100a, with no
GPU. Each program is its own test, so `pytest -n 2` spreads them over the CI machine's cores (the
three archs' programs in one test each took ~17 min a test). sm_103a takes sm_100a's code path in
every tile; `megakernel compile-check` compiles the programs for every arch it is given."""
import pytest

from sdk.compile import ARCHS, compile_check, compile_program, failures, program_cases

PROGRAM_ARCHS = ("sm_90a", "sm_100a")


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all_blocks_and_megakernel(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    report = compile_check([arch], program_archs=())
    assert not failures(report), "\n".join(failures(report))
    assert len(report[arch]) >= 9          # 7 block cases + 2 megakernel cases were compiled
    assert not set(report[arch]) & {name for name, _ in program_cases(arch)}   # the programs: below


@pytest.mark.parametrize("arch,index", [(arch, i) for arch in PROGRAM_ARCHS for i in range(len(program_cases(arch)))])
def test_compile_program(arch, index):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    name, build = program_cases(arch)[index]
    try:
        compile_program(build, arch)
    except Exception as exc:
        pytest.fail(f"{arch}: {name}: {type(exc).__name__}: {exc}")
