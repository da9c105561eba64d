"""The fused in-kernel all-reduce on CPU: N virtual ranks' instruction streams run together by
the multi-rank PyVM (random interleavings, ranks running ahead into the next step) equal the
unsharded torch reference; a missing rank is reported, not hung on; the symmetric-buffer host
logic (virtual ranks and torch symmetric memory, the latter with a faked torch.distributed);
compile checks of the TP megakernel for sm_90a / sm_100a / sm_103a."""
import subprocess
import sys

import pytest
import torch

from sdk.blocks.allreduce import AllReduceBlock, AllReduceConfig
from sdk.comm import CommProgram, SymmetricLayout, VirtualRanks, choose_algo, crossover_bytes
from sdk.comm.vm import MultiRankVM
from sdk.megakernel.mlp_stack import MLPStackConfig, make_weights, reference
from sdk.megakernel.program import Program, encode
from sdk.megakernel.tp_stack import TPStackConfig, build_allreduce_chain, build_program, rank_tensors
from sdk.schedule import ScheduleError, schedule, validate

TOL = 1e-2


def rel_err(got, ref):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), "non-finite output (NaN poison not overwritten)"
    return ((got - ref).norm() / ref.norm()).item()


def _vm(prog, comm, n, num_sms, make_tensors):
    sched = schedule(prog, num_sms)
    validate(prog, sched.per_sm)
    words, lengths = encode(prog, sched.per_sm)
    bufs = VirtualRanks(n, comm.layout, "cpu")
    tensors = [make_tensors(bufs, r) for r in range(n)]
    return MultiRankVM(prog, words, lengths, tensors, sched.per_sm), tensors, bufs


def _tp_stack_run(n, algo, batch, layers, steps=3, seed=0, favor=1.0):
    st = MLPStackConfig(hidden=1024, intermediate=2048, layers=layers, batch=batch)
    cfg = TPStackConfig(st, n, algo=algo)
    prog, comm = build_program(cfg)
    full = make_weights(st, seed=seed)
    vm, T, _ = _vm(prog, comm, n, 4, lambda bufs, r: rank_tensors(cfg, prog, comm, bufs, r, full, "cpu"))
    g = torch.Generator().manual_seed(100 + seed)
    xs = [torch.randn(batch, st.hidden, generator=g).to(torch.bfloat16) for _ in range(steps)]
    outs = {}

    def before(r, s):       # fresh input each step, outputs and intermediates poisoned
        T[r]["x"].copy_(xs[s])
        for name in ("out", "h", "act", "partial"):
            T[r][name].fill_(float("nan"))

    def after(r, s):
        outs[r, s] = T[r]["out"].clone()

    vm.run(steps, before, after, seed=seed, favor=favor)
    return st, full, xs, outs, vm, comm


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
@pytest.mark.parametrize("batch", [1, 3])
def test_tp_mlp_stack_equals_unsharded_reference(n, algo, batch):
    """gate/up column-sharded, down row-sharded, fused all-reduce + residual + norm; 3 layers
    (an odd number of all-reduces per step: the epoch parity is what keeps step s+1's pushes
    off buffers a slower rank still reads), 3 steps. Adversarial interleaving: the lowest rank
    that can progress always goes first (random among its SMs), so rank 0 runs into step s+1
    and pushes while the others still finish step s."""
    st, full, xs, outs, vm, comm = _tp_stack_run(n, algo, batch, layers=3, seed=n + batch)
    assert {r["algo"] for r in comm.records} == {algo}
    for s, x in enumerate(xs):
        ref = reference(st, full, x)
        for r in range(n):
            assert rel_err(outs[r, s], ref) <= TOL, f"rank {r} step {s}"
            assert torch.equal(outs[r, s], outs[0, s]), "ranks disagree: the reduction order differs"
    assert vm.max_skew >= 1, "no rank ever ran ahead into the next step: the test lost its point"


def test_parity_double_buffering_is_needed(monkeypatch):
    """The same run with the epoch parity switched off in the emulation goes wrong: the test above
    does exercise the buffer reuse it claims to."""
    import sdk.blocks.allreduce as A
    orig = A.AllReduceBlock._epoch

    def no_parity(self, t, tile):
        rank, e, _ = orig(self, t, tile)
        return rank, e, 0

    monkeypatch.setattr(A.AllReduceBlock, "_epoch", no_parity)
    st, full, xs, outs, vm, _ = _tp_stack_run(8, "oneshot", 3, layers=3, seed=11)
    errs = [rel_err(outs[r, s], reference(st, full, xs[s])) for s in range(len(xs)) for r in range(8)]
    assert max(errs) > 10 * TOL


def test_single_rank_runs_in_plain_pyvm():
    """ranks = 1: the all-reduce degenerates to residual + norm and needs no peers, so the plain
    PyVM (emulate_tile) runs the program."""
    from sdk.megakernel.pyvm import PyVM
    st = MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=2)
    cfg = TPStackConfig(st, 1)
    prog, comm = build_program(cfg)
    sched = schedule(prog, 4)
    words, lengths = encode(prog, sched.per_sm)
    full = make_weights(st, seed=3)
    bufs = VirtualRanks(1, comm.layout, "cpu")
    vm = PyVM(prog, words, lengths, rank_tensors(cfg, prog, comm, bufs, 0, full, "cpu"))
    for step in range(2):
        x = torch.randn(2, st.hidden).to(torch.bfloat16)
        vm.tensors["x"].copy_(x)
        vm.tensors["out"].fill_(float("nan"))
        vm.step(seed=step)
        assert rel_err(vm.tensors["out"], reference(st, full, x)) <= TOL


@pytest.mark.parametrize("n,m,d,algo,wire,norm,resid", [
    (2, 1, 1024, "oneshot", "bf16", True, "fp32"), (3, 2, 4096, "oneshot", "fp32", True, "fp32"),
    (8, 1, 7168, "oneshot", "bf16", True, "fp32"), (8, 4, 7168, "twoshot", "bf16", True, "fp32"),
    (4, 3, 2048, "twoshot", "fp32", False, "fp32"), (5, 2, 1280, "twoshot", "bf16", True, "fp32"),
    # a plain-residual model's bf16 hidden state x updated in place (sdk/megakernel/tp_model.py)
    (2, 2, 1024, "oneshot", "bf16", False, "bf16"), (4, 2, 2048, "twoshot", "bf16", True, "bf16")])
def test_allreduce_chain(n, m, d, algo, wire, norm, resid):
    """K all-reduces back to back (resid += sum of partials, norm): resid and out after each step
    equal the fp32 math (bf16 resid: rounded once per all-reduce, as the reference rounds it);
    every rank ends with the same bits."""
    K, steps = 3, 3
    prog, comm = build_allreduce_chain(n, m, d, K, algo=algo, wire=wire, norm=norm, resid_dtype=resid)
    assert {r["algo"] for r in comm.records} == {algo}
    wdt = torch.bfloat16 if wire == "bf16" else torch.float32
    g = torch.Generator().manual_seed(n * 1000 + m)
    nw = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)

    def make(bufs, r):
        t = comm.alloc_rank_tensors(bufs, r, "cpu")
        t["norm.weight"] = nw
        return t

    vm, T, _ = _vm(prog, comm, n, 3, make)
    parts = [[torch.randn(m, d, generator=g).to(wdt) for _ in range(n)] for _ in range(steps)]
    r0 = torch.randn(m, d, generator=g)
    if resid == "bf16":
        r0 = r0.to(torch.bfloat16)
    res = {}

    def before(r, s):
        T[r]["partial"].copy_(parts[s][r])
        if s == 0:
            T[r]["resid"].copy_(r0)
        T[r]["out"].fill_(float("nan"))

    def after(r, s):
        res[r, s] = (T[r]["resid"].clone(), T[r]["out"].clone())

    vm.run(steps, before, after, seed=m, favor=0.7)
    blk = AllReduceBlock(AllReduceConfig(ranks=n, m=m, d=d, norm=norm, wire=wire, resid_dtype=resid))
    want = r0.float()
    for s in range(steps):
        for _ in range(K):
            ref = blk.reference(parts[s], res=want, norm_weight=nw)
            want = ref["resid_out"]
        for r in range(n):
            got_r, got_o = res[r, s]
            assert rel_err(got_r, want) <= (1e-5 if algo == "oneshot" else 1e-2)
            if norm:
                assert rel_err(got_o, ref["out"]) <= TOL
            assert torch.equal(got_r, res[0, s][0])


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_missing_rank_is_reported_not_hung(algo):
    """A rank that never runs: the others stop at the all-reduce, and the error names the
    missing rank's flags (the PyVM twin of the GPU's KernelTimeoutError)."""
    prog, comm = build_allreduce_chain(4, 2, 1024, 2, algo=algo)
    vm, T, _ = _vm(prog, comm, 4, 3, lambda bufs, r: comm.alloc_rank_tensors(bufs, r, "cpu"))
    with pytest.raises(ScheduleError, match=r"flags of rank\(s\) \[2\] missing") as exc:
        vm.run(1, seed=0, absent=[2])
    assert "absent ranks [2]" in str(exc.value)


def test_block_contract_and_checks():
    b = AllReduceBlock(AllReduceConfig(ranks=8, m=2, d=7168))
    assert b.cols == 1792 and b.chunks == 4 and b.num_tiles() == 8
    names = b.operands()
    assert names[:3] == ["partial", "recv_self", "flags_self"] and "rowcnt" in names and names[-1] == "out"
    rs = AllReduceBlock(AllReduceConfig(ranks=8, m=64, d=7168, phase="rs"))
    assert rs.shard == 64 * 7168 // 8 and rs.rs_tiles * 8 <= 256 and rs.piece * rs.rs_tiles == rs.shard
    from sdk.errors import UnsupportedConfigError
    for bad in (dict(ranks=73, m=1, d=1024), dict(ranks=2, m=1, d=1022), dict(ranks=2, m=1, d=1024, wire="fp8"),
                dict(ranks=3, m=1, d=1028, phase="rs"), dict(ranks=2, m=1, d=1024, tile_elems=1000)):
        with pytest.raises(UnsupportedConfigError):
            AllReduceBlock(AllReduceConfig(**bad))


def test_choose_algo_by_message_size():
    assert choose_algo(1, 7168, 8) == "oneshot"                       # 14 KB
    assert choose_algo(64, 7168, 8) == "twoshot"                      # 917 KB
    assert choose_algo(8, 7168, 8, oneshot_max_bytes=64 * 1024) == "twoshot"
    assert choose_algo(64, 7168, 1) == "oneshot"
    assert choose_algo(3, 1028 * 64, 7) == "oneshot"                  # does not shard evenly: one-shot
    assert choose_algo(64, 7168, 2) == "oneshot"                      # N = 2: same bytes, one round trip
    # the crossover falls with N: (N-1)(1-2/N) B / 900 GB/s = 2.5 us
    assert 400e3 < crossover_bytes(8) < 450e3 and 160e3 < crossover_bytes(16) < 180e3
    assert 30e3 < crossover_bytes(72) < 35e3
    assert choose_algo(36, 7168, 72) == "twoshot" and choose_algo(1, 7168, 72) == "oneshot"
    assert choose_algo(4, 7168, 72) == "oneshot"        # 4 x 7168 does not split into 72 shards of 4-vectors


def test_program_alternates_buffer_colors_and_sizes_regions():
    st = MLPStackConfig(hidden=1024, intermediate=2048, layers=3, batch=64)
    prog, comm = build_program(TPStackConfig(st, 4, oneshot_max_bytes=64 * 1024))
    assert [r["color"] for r in comm.records] == [0, 1, 0]
    assert [r["algo"] for r in comm.records] == ["twoshot"] * 3          # 128 KB > 64 KB
    lay = comm.layout
    assert lay.regions["comm.data.c0"].nbytes == 4 * 64 * 1024 * 2     # rs + ag, two parities
    assert all(r.offset % 256 == 0 for r in lay.regions.values())
    with pytest.raises(ValueError, match="layout was already used"):
        comm.allreduce("partial", "resid", label="late")


def test_collectives_must_chain():
    """Two all-reduces side by side (neither waiting for the other) could overwrite a color's
    receive slots a peer still reads: refused when the layout is fixed, naming the pair."""
    prog = Program()
    comm = CommProgram(prog, 2)
    for n in "ab":
        prog.buffer(n, (1, 1024), "bf16")
        prog.buffer(n + ".sum", (1, 1024), "fp32")
    comm.allreduce("a", "a.sum", label="one")
    comm.allreduce("b", "b.sum", label="two")
    with pytest.raises(ValueError, match="'two' does not wait for 'one'"):
        comm.layout


@pytest.mark.parametrize("rotate", [False, True])
def test_allgather_chain(rotate):
    """An all-gather then an all-reduce of its output, 3 ranks, 3 unsynchronised steps: every rank
    gathers every rank's shard (rotate: its own first) and the reduce sums them."""
    n, m, w = 3, 2, 256
    prog = Program()
    comm = CommProgram(prog, n)
    prog.buffer("shard", (m, w), "fp32", "input")
    prog.buffer("all", (m, n * w), "fp32")
    prog.buffer("sum", (m, n * w), "fp32")
    g_op = comm.allgather("shard", "all", rotate=rotate, label="gather")
    comm.allreduce("all", "sum", waits=[g_op], label="reduce")
    vm, T, _ = _vm(prog, comm, n, 3, lambda bufs, r: comm.alloc_rank_tensors(bufs, r, "cpu"))
    g = torch.Generator().manual_seed(7)
    shards = [[torch.randn(m, w, generator=g) for _ in range(n)] for _ in range(3)]
    got = {}

    def before(r, s):
        T[r]["shard"].copy_(shards[s][r])
        T[r]["all"].fill_(float("nan"))

    def after(r, s):
        got[r, s] = (T[r]["all"].clone(), T[r]["sum"].clone())

    vm.run(3, before, after, seed=1, favor=0.7)
    for s in range(3):
        for r in range(n):
            order = [(r + j) % n for j in range(n)] if rotate else list(range(n))
            assert torch.equal(got[r, s][0], torch.cat([shards[s][k] for k in order], 1)), (r, s)
            # the reduce of the ranks' gathered rows: block j sums shard j over the ranks (n x it),
            # or, rotated, every rank's block j is another shard: each block the sum of all shards
            want = [sum(shards[s]) if rotate else n * shards[s][j] for j in range(n)]
            assert torch.allclose(got[r, s][1], torch.cat(want, 1), atol=1e-5), (r, s)
            assert torch.equal(got[r, s][1], got[0, s][1]), "ranks disagree"


def test_virtual_ranks_views_alias_the_owner():
    lay = SymmetricLayout()
    lay.add("data", 4096)
    lay.add("f", 64, kind="flags")
    bufs = VirtualRanks(3, lay, "cpu")
    own = bufs.view(2, 2, "data", (2, 256), torch.float32)
    seen_by_0 = bufs.view(2, 0, "data", (2, 256), torch.float32)
    assert own.data_ptr() == seen_by_0.data_ptr()
    seen_by_0[1, 3] = 5.0
    assert own[1, 3] == 5.0
    assert bufs.view(1, 0, "data", (4,), torch.float32, offset_elems=4).data_ptr() == \
        bufs.view(1, 1, "data", (8,), torch.float32).data_ptr() + 16
    f = bufs.view(1, 1, "f", (16,), torch.int32)
    f.fill_(7)
    bufs.view(1, 1, "data", (4,), torch.int32).fill_(9)
    bufs.zero_flags()
    assert int(f.sum()) == 0 and int(bufs.view(1, 1, "data", (4,), torch.int32).sum()) == 36
    with pytest.raises(ValueError, match="overruns"):
        bufs.view(0, 0, "f", (17,), torch.int32)


def test_torch_symmetric_memory_host_logic(monkeypatch):
    """TorchSymmetricMemory with a faked torch.distributed (no GPU, no processes): it allocates
    layout.nbytes through symm_mem.empty, rendezvous over the group, and gives peer views at the
    layout's offsets through get_buffer."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from sdk.comm.buffers import TorchSymmetricMemory
    world = {p: torch.zeros(1024, dtype=torch.uint8) for p in range(4)}
    calls = {}

    class Handle:
        def get_buffer(self, peer, sizes, dtype, storage_offset=0):
            calls.setdefault("peers", []).append(peer)
            return world[peer][:sizes[0]].view(dtype)

    class Group:
        group_name = "g0"

    def empty(n, dtype, device):
        calls["empty"] = n
        return world[1][:n]

    def rendezvous(t, name):
        calls["rendezvous"] = name
        return Handle()

    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda g=None: 1)
    monkeypatch.setattr(dist, "barrier", lambda g=None: calls.setdefault("barrier", True))
    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    lay = SymmetricLayout()
    lay.add("data", 300)
    lay.add("flags", 16, kind="flags")
    bufs = TorchSymmetricMemory(lay, group=Group(), device="cpu")
    assert calls["empty"] == 768 and calls["rendezvous"] == "g0" and calls["barrier"]
    assert bufs.local_ranks == [1] and bufs.world_size == 4 and sorted(calls["peers"]) == [0, 2, 3]
    v = bufs.view(3, 1, "flags", (4,), torch.int32)
    v.fill_(1)
    assert int(world[3][512:528].view(torch.int32).sum()) == 4          # flags region at offset 512
    with pytest.raises(ValueError, match="not driven by this process"):
        bufs.view(3, 0, "flags", (4,), torch.int32)
    world[1][512:528].fill_(3)
    bufs.zero_flags()
    assert int(world[1][512:528].sum()) == 0


def test_import_touches_neither_cuda_nor_symmetric_memory():
    code = ("import sys, torch, sdk.comm, sdk.comm.runtime, sdk.comm.vm, sdk.blocks.allreduce, "
            "sdk.megakernel.tp_stack; assert not torch.cuda.is_initialized(); "
            "assert 'torch.distributed._symmetric_memory' not in sys.modules, 'symm mem imported'; "
            "assert 'cutlass' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_tp_megakernel_compiles(arch):
    """The TP stack's megakernel (GEMVs + one-shot all-reduce) and a two-shot chain, compiled with
    no GPU for each target."""
    pytest.importorskip("cutlass")
    from sdk.megakernel.kernel import compile_megakernel
    st = MLPStackConfig(hidden=7168, intermediate=2048, layers=2, batch=1)
    for prog, _ in (build_program(TPStackConfig(st, 8, algo="oneshot")),
                    build_allreduce_chain(8, 16, 4096, 2, algo="twoshot")):
        sched = schedule(prog, 16)
        compile_megakernel(prog.opcodes.blocks, 16, sched.max_len, timing=True, arch=arch)
