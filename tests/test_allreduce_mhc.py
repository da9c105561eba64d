"""The all-reduce fused with the mHC post-mix (DeepSeek-V4.1-Flash, GLM-5.3) on CPU: N virtual
ranks through the multi-rank PyVM (random interleavings, ranks running ahead into the next step),
a chain of such all-reduces per step (the first out of place, the rest in place), fresh inputs
and NaN-poisoned outputs every step; every rank's streams and next-mix partials equal the
unsharded definition (the fp32 sum of the partials, then MHCPostBlock.reference) and the other
ranks' bit for bit. Config checks; the megakernel of the chain compiled for each arch."""
import pytest
import torch

from sdk.blocks.allreduce import AllReduceBlock, AllReduceConfig
from sdk.blocks.base import DTYPES
from sdk.blocks.mhc import MHCPostBlock, MHCPostConfig
from sdk.comm import MHCEpilogue, VirtualRanks
from sdk.comm.ops import CommProgram, build_mhc_allreduce_chain, mhc_chain_reference
from sdk.comm.vm import MultiRankVM
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.program import Program, encode
from sdk.schedule import ScheduleError, schedule, validate

HC = 4                 # residual streams (V4.1-Flash and GLM-5.3 both use 4)
ROWS = 24              # the next sublayer's mix: (2 + 4) * 4 rows of fn


def rel_err(got, ref):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), "non-finite output (NaN poison not overwritten)"
    return ((got - ref).norm() / ref.norm()).item()


def mhc_cfg(**kw):
    return AllReduceConfig(**{"ranks": 4, "m": 2, "d": 1024, "residual": "", "norm": False, "mhc_streams": HC,
                              "mhc_next_rows": ROWS, **kw})


def random_coef(m, g):
    """Coefficients shaped like MHCPreBlock's: pre > 0, post in (0, 2), comb ~ doubly stochastic."""
    pre = torch.rand(m, HC, generator=g) + 0.1
    post = 2 * torch.rand(m, HC, generator=g)
    comb = torch.softmax(torch.randn(m, HC, HC, generator=g), -1)
    return torch.cat([pre, post, comb.flatten(1)], 1)


def run_chain(n, m, d, algo, *, wire="bf16", sdt="fp32", d_slice=128, K=3, steps=3, seed=0, sms=4):
    """K chained mHC all-reduces per step, `steps` steps on the multi-rank PyVM, the lowest rank
    that can progress always first (it runs into step s+1 and pushes while the others still finish
    step s). Returns fn_next, the inputs of every step and each rank's outputs after it. With at
    most `sms` slices per op, every SM holds the same slice of every op, so rank 0's next-step
    pushes land on the slices its peers are still reducing: the case the parity buffers exist for."""
    prog, comm = build_mhc_allreduce_chain(n, m, d, K, d_slice=d_slice, algo=algo, wire=wire, stream_dtype=sdt)
    assert {r["algo"] for r in comm.records} == {algo}
    sched = schedule(prog, sms)
    validate(prog, sched.per_sm)
    words, lengths = encode(prog, sched.per_sm)
    bufs = VirtualRanks(n, comm.layout, "cpu")
    T = [comm.alloc_rank_tensors(bufs, r, "cpu") for r in range(n)]
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(ROWS, HC * d, generator=g) * 0.02
    for t in T:
        t["fn_next"].copy_(fn)
    ins = [{"parts": [torch.randn(m, d, generator=g).to(DTYPES[wire]) for _ in range(n)],
            "streams": torch.randn(m, HC, d, generator=g).to(DTYPES[sdt]),
            "coef": [random_coef(m, g) for _ in range(K)]} for _ in range(steps)]
    outs = {}

    def before(r, s):        # fresh inputs, outputs poisoned
        T[r]["partial"].copy_(ins[s]["parts"][r])
        T[r]["streams_in"].copy_(ins[s]["streams"])
        T[r]["streams"].fill_(float("nan"))
        for j in range(K):
            T[r][f"coef.{j}"].copy_(ins[s]["coef"][j])
            T[r][f"part.{j}"].fill_(float("nan"))

    def after(r, s):
        outs[r, s] = {name: T[r][name].clone() for name in ["streams"] + [f"part.{j}" for j in range(K)]}

    vm = MultiRankVM(prog, words, lengths, T, sched.per_sm)
    vm.run(steps, before, after, seed=seed, favor=1.0)
    return fn, ins, outs, vm


def reference_step(fn, inp, d_slice, wire_round=None):
    """The unsharded definition of a step (sdk.comm.ops.mhc_chain_reference: the fp32 sum of the
    partials, then MHCPostBlock.reference op by op)."""
    return mhc_chain_reference(inp["parts"], inp["streams"], inp["coef"], fn, d_slice=d_slice,
                               wire_round=wire_round)


# Tolerances. fp32 streams: y is the same fp32 sum in the same order as the reference, and the
# post-mix and the partials are the same fp32 ops on a slice instead of the whole row (measured
# error 0.0 here; another BLAS may block einsum's contraction differently: a few ulp, far below
# 1e-5). bf16 streams: such an ulp may flip the bf16 rounding of a stream element (2^-8 relative
# on it); 2e-3 bounds a few flips. Two-shot sends y back in the wire dtype (bf16): against the
# reference with y rounded the same way the bounds above hold; against the unrounded sum the
# error is that rounding (<= 2^-9 relative per element of y, times post; measured 1.7e-3 to
# 2.9e-3), within 1e-2.
TIGHT = {"fp32": 1e-5, "bf16": 2e-3}
D = 512


@pytest.mark.parametrize("n,m,algo,sdt,d_slice,wire", [
    (2, 1, "oneshot", "fp32", 128, "bf16"), (4, 8, "oneshot", "fp32", 256, "bf16"),
    (8, 1, "oneshot", "bf16", 128, "bf16"), (8, 8, "oneshot", "fp32", 128, "fp32"),
    (2, 8, "twoshot", "fp32", 128, "bf16"), (4, 1, "twoshot", "bf16", 256, "bf16"),
    (8, 8, "twoshot", "fp32", 128, "bf16"), (4, 64, "twoshot", "fp32", 128, "bf16"),
    (8, 64, "twoshot", "bf16", 256, "fp32")])
def test_mhc_allreduce_chain_equals_unsharded_reference(n, m, algo, sdt, d_slice, wire):
    """3 chained all-reduces (odd: the receive buffers' epoch parity matters across steps), 3 steps:
    every rank's streams and part_next after each step equal the definition, all ranks agree."""
    d, K = D, 3
    fn, ins, outs, vm = run_chain(n, m, d, algo, wire=wire, sdt=sdt, d_slice=d_slice, K=K, seed=n * 100 + m)
    rounded = wire if algo == "twoshot" else None
    for s, inp in enumerate(ins):
        want_x, want_p = reference_step(fn, inp, d_slice, rounded)
        for r in range(n):
            got = outs[r, s]
            assert rel_err(got["streams"], want_x) <= TIGHT[sdt], f"rank {r} step {s}: streams"
            for j in range(K):
                assert rel_err(got[f"part.{j}"], want_p[j]) <= TIGHT[sdt], f"rank {r} step {s}: part.{j}"
            for name, v in got.items():
                assert torch.equal(v, outs[0, s][name]), f"rank {r} step {s}: {name} differs from rank 0"
        if rounded:
            exact_x, _ = reference_step(fn, inp, d_slice)
            assert rel_err(outs[0, s]["streams"], exact_x) <= 1e-2
    assert vm.max_skew >= 1, "no rank ever ran ahead into the next step: the test lost its point"


def test_parity_double_buffering_is_needed(monkeypatch):
    """The one-shot chain above with the epoch parity switched off goes wrong: it does exercise
    the receive-buffer reuse across steps."""
    import sdk.blocks.allreduce as A
    orig = A.AllReduceBlock._epoch
    monkeypatch.setattr(A.AllReduceBlock, "_epoch", lambda self, t, tile: (*orig(self, t, tile)[:2], 0))
    fn, ins, outs, _ = run_chain(4, 8, D, "oneshot", seed=12)
    errs = [rel_err(outs[r, s]["streams"], reference_step(fn, inp, 128)[0])
            for s, inp in enumerate(ins) for r in range(4)]
    assert max(errs) > 100 * TIGHT["fp32"]


@pytest.mark.parametrize("phase", ["oneshot", "ag"])
def test_block_reference_is_sum_then_post(phase):
    """AllReduceBlock.reference with the epilogue == MHCPostBlock.reference of the fp32 sum; the
    tiling is MHCPostBlock's (operands but y, tiles, own shared memory)."""
    g = torch.Generator().manual_seed(5)
    m, d = 3, 1024
    blk = AllReduceBlock(mhc_cfg(m=m, d=d, phase=phase, mhc_d_slice=256))
    post = MHCPostBlock(MHCPostConfig(d=d, m=m, d_slice=256, y_dtype="fp32", next_rows=ROWS))
    parts = [torch.randn(m, d, generator=g).to(torch.bfloat16) for _ in range(4)]
    ins = {"streams": torch.randn(m, HC, d, generator=g), "coef": random_coef(m, g),
           "fn_next": torch.randn(ROWS, HC * d, generator=g) * 0.02}
    got = blk.reference(parts, **ins)
    want = post.reference(y=sum(p.float() for p in parts), **ins)
    assert got.keys() == want.keys() == {"streams_out", "part_next"}
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert blk.num_tiles() == post.num_tiles() == 4
    assert blk.operands()[-5:] == ["streams", "coef", "fn_next", "streams_out", "part_next"]
    assert "resid_out" not in blk.operands() and "rowcnt" not in blk.operands()
    assert blk.own_smem_bytes() == post.own_smem_bytes() == ROWS * HC * 256 * 4
    assert blk.cost().bytes > post.cost().bytes - m * 256 * 4


@pytest.mark.parametrize("kw,msg", [
    (dict(residual="fp32"), "replaces the residual add and the norm"),
    (dict(norm=True), "replaces the residual add and the norm"),
    (dict(mhc_streams=3), "hc_mult=3"), (dict(mhc_streams=8), "hc_mult=8"),
    (dict(d=1000), "d_slice=128"), (dict(mhc_d_slice=96), "d_slice=96"),
    (dict(mhc_next_rows=33), "next_rows=33"), (dict(m=65), "m=65"),
    (dict(stream_dtype="fp8_e4m3"), "stream dtype"),
    (dict(phase="rs", m=8), "runs in the ag phase"), (dict(tile_elems=512), "tile_elems=512"),
    (dict(phase="ag", ranks=3, m=1), "must split into 3 shards")])     # ag keeps the two-shot checks
def test_unsupported_mhc_configs_fail_loudly(kw, msg):
    with pytest.raises(UnsupportedConfigError, match=msg):
        AllReduceBlock(mhc_cfg(**kw))


def test_comm_program_mhc_arguments():
    """The epilogue reads N, dtypes and rows off the bound buffers; it excludes resid_out / res /
    norm; fn_next and part_next go together."""
    prog = Program()
    comm = CommProgram(prog, 2)
    prog.buffer("p", (2, 1024), "bf16", "input")
    prog.buffer("x", (2, 2, 1024), "bf16")
    prog.buffer("c", (2, 8), "fp32")
    prog.buffer("fn", (2, 2 * 1024), "bf16")
    prog.buffer("pn", (8, 2, 3), "fp32")
    op = comm.allreduce("p", mhc=MHCEpilogue("x", "c", "x", fn_next="fn", part_next="pn"), label="a")
    c = prog.ops[op].block.config
    assert (c.mhc_streams, c.stream_dtype, c.mhc_next_rows, c.fn_dtype, c.residual, c.norm) == \
        (2, "bf16", 2, "bf16", "", False)
    with pytest.raises(ValueError, match="either resid_out"):
        comm.allreduce("p", "r", mhc=MHCEpilogue("x", "c", "x"), label="b")
    with pytest.raises(ValueError, match="either resid_out"):
        comm.allreduce("p", label="b")
    with pytest.raises(ValueError, match="go together"):
        comm.allreduce("p", mhc=MHCEpilogue("x", "c", "x", fn_next="fn"), label="b")


def test_missing_rank_is_reported_not_hung():
    prog, comm = build_mhc_allreduce_chain(4, 2, 1024, 2, algo="oneshot")
    sched = schedule(prog, 3)
    words, lengths = encode(prog, sched.per_sm)
    bufs = VirtualRanks(4, comm.layout, "cpu")
    vm = MultiRankVM(prog, words, lengths, [comm.alloc_rank_tensors(bufs, r, "cpu") for r in range(4)], sched.per_sm)
    with pytest.raises(ScheduleError, match=r"flags of rank\(s\) \[2\] missing"):
        vm.run(1, seed=0, absent=[2])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_mhc_allreduce_megakernel_compiles(arch):
    """The chains the GPU test runs (V4.1-Flash's D 5120, one-shot; GLM-5.3's D 4096, two-shot
    with bf16 streams), compiled into the megakernel with no GPU."""
    pytest.importorskip("cutlass")
    from sdk.megakernel.kernel import compile_megakernel
    for prog, _ in (build_mhc_allreduce_chain(8, 1, 5120, 3, algo="oneshot"),
                    build_mhc_allreduce_chain(8, 64, 4096, 3, algo="twoshot", stream_dtype="bf16")):
        sched = schedule(prog, 16)
        compile_megakernel(prog.opcodes.blocks, 16, sched.max_len, timing=True, arch=arch)
