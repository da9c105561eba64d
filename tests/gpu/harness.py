"""Helpers shared by the GPU tests (tests/gpu/test_*_gpu.py): skip without a GPU or the CuTe DSL,
run a block's standalone kernel on the current stream, relative error, a clock seed.

Imported as `from harness import ...`: pytest puts this folder on sys.path for the test files in it
(tests/gpu has no __init__.py). Nothing here touches CUDA at import, so the tests still collect on
a machine without a GPU."""
import time

import pytest
import torch


def need_gpu():
    """Skip the calling test unless a CUDA GPU and the CuTe DSL are there."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    try:
        import cutlass  # noqa: F401
    except ImportError:
        pytest.skip("CuTe DSL (nvidia-cutlass-dsl) not importable")


# Compiled standalone kernels by block: blocks with equal static config compile to the same code
# (Block.__eq__ / __hash__ compare key()), so one compile serves every test that uses that config.
_compiled = {}


def run_standalone(block, tensors):
    """Launch `block`'s standalone kernel (one tile per CTA, or persistent for a streaming block) on
    the current stream with the operand pointers of `tensors` and wait for it. An operand missing
    from `tensors` or None goes in as a null pointer (the block's optional operands)."""
    import cuda.bindings.driver as cuda

    from sdk.blocks._cute import standalone
    if block not in _compiled:
        _compiled[block] = standalone(block)
    ptrs = [0 if tensors.get(n) is None else tensors[n].data_ptr() for n in block.operands()]
    optab = torch.tensor(ptrs, dtype=torch.int64, device="cuda")
    _compiled[block](optab.data_ptr(), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()


def run_as_program(ops, tensors, **kw):
    """Run `ops` - [(block, bindings)], bindings {operand: name in `tensors`} for the operands not
    named as the operand itself (None: all are) - as ONE megakernel launch, each op waiting for
    the one before (its instructions as the megakernel runs any op's), over `tensors` in place
    (outputs land there; an optional operand without a tensor is a null pointer). Returns the
    MegakernelRuntime (rt.run() launches again); kw to MegakernelRuntime."""
    from sdk.blocks.base import DTYPES
    from sdk.megakernel.program import Program
    from sdk.megakernel.runtime import MegakernelRuntime
    dtype_name = {v: k for k, v in DTYPES.items()}
    prog = Program()
    prev = None
    for i, (block, names) in enumerate(ops):
        bind = {}
        for s in block.operand_specs():
            n = (names or {}).get(s.name, s.name)
            if tensors.get(n) is None:
                if not s.optional:
                    raise KeyError(f"op {i} ({type(block).__name__}): no tensor {n!r} for operand {s.name}")
                continue
            if n not in prog.buffers:
                t = tensors[n]
                prog.buffer(n, tuple(t.shape), dtype_name[t.dtype], role="output" if s.output else "input")
            bind[s.name] = n
        prev = prog.op(block, bind, waits=[prev] if prev is not None else [], label=f"{i}:{type(block).__name__}")
    rt = MegakernelRuntime(prog, {n: tensors[n] for n in prog.buffers}, **kw)
    rt.run()
    return rt


def program_runtime(prog, weights, **kw):
    """sdk.megakernel.runtime.program_runtime on the GPU (weights: tensors on the GPU)."""
    from sdk.megakernel.runtime import program_runtime as build
    return build(prog, weights, **kw)


def rel_err(got, ref, *, check_finite=True, min_norm=0.0):
    """Relative Frobenius error |got - ref| / |ref| in fp32. check_finite: assert `got` is all
    finite first (a NaN-poisoned output the kernel did not overwrite). min_norm: floor of |ref|,
    for references that may be all zero (0.0: no floor)."""
    got, ref = got.float(), ref.float()
    if check_finite:
        assert torch.isfinite(got).all(), "non-finite values in the output (poison not overwritten?)"
    return ((got - ref).norm() / ref.norm().clamp_min(min_norm)).item()


def compare_model_steps(runner, ref, steps: int, seed: int, tol: float, mean_tol: float | None = None,
                        after_decode=None) -> list:
    """`steps` decode steps of random ids through a whole-model program's runner (on the GPU) and
    the reference backend `ref` (a fresh state), the logits compared each step: rel err < tol,
    their mean < mean_tol. after_decode(): called between the program's step and the reference's
    (the program's near-tie picks handed to the reference: tests/program_choices.py). Returns the
    errors."""
    print(f"seed {seed}")                   # shown with any failure, also one raised by after_decode
    batch, vocab = runner.cfg.batch, runner.cfg.spec.vocab_size
    state = ref.new_state(batch)
    g = torch.Generator().manual_seed(seed)
    errs = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch,), generator=g)
        got = runner.decode(ids)
        if after_decode is not None:
            after_decode()
        errs.append(rel_err(got, ref.decode(ids[:, None].cuda(), state)[:, 0]))
        assert errs[-1] < tol, f"seed {seed}, step {step}: logits rel err {errs[-1]:.3e}"
    if mean_tol is not None:
        assert sum(errs) / len(errs) < mean_tol, (seed, errs)
    runner.rt.check()
    return errs


def ranks_agree(runner, name: str, seed: int, then=None):
    """A check for compare_model_steps' after_decode: every rank's `name` (the residual state) the
    same bits as rank 0's - a tensor-parallel program's ranks sum in one order (one rank: nothing
    to compare); then(): what else to do after the step."""
    def check():
        t = [r[name] for r in runner.rank_tensors()]
        assert all(torch.equal(t[0], x) for x in t[1:]), f"seed {seed}: the ranks' {name} differ"
        if then is not None:
            then()
    return check


def clock_seed() -> int:
    """A fresh seed from the clock: every run tests new inputs; the tests print it on failure."""
    return int(time.time() * 1000) % (2 ** 31)


def expect_missing_rank_timeout(rt, op_label: str, ranks: int = 4) -> None:
    """Run every rank of the multi-rank runtime `rt` but the last: the others must end in
    KernelTimeoutError within seconds (no hang), naming the rank that never arrived, the op that
    waited for it (`op_label`) and every rank that gave up."""
    from sdk import KernelTimeoutError
    t0 = time.time()
    with pytest.raises(KernelTimeoutError) as exc:
        rt.run(ranks=list(range(ranks - 1)))
    assert time.time() - t0 < 10
    msg = str(exc.value)
    assert f"rank {ranks - 1} never arrived" in msg and f"'{op_label}" in msg, msg
    for r in range(ranks - 1):
        assert f"rank {r}:" in msg
