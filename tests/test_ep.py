"""Expert parallelism inside the megakernel on CPU: N virtual ranks' instruction streams (router ->
EP dispatch -> table -> hit-only experts -> EP combine, + shared expert) run together by the
multi-rank PyVM (random interleavings, one rank running ahead into the next step) equal the
single-rank MoE layer on every rank's tokens, for N = 2, 4, 8, batch 1, 8, 64, random and
skewed routing; a rank that never runs is reported, not hung on; the blocks' own faces; compile
checks of the EP blocks and the EP megakernel for sm_90a, sm_100a, sm_103a (no GPU)."""
import pytest
import torch

from sdk.blocks.ep import EPCombineBlock, EPConfig, EPDispatchBlock, EPTableBlock, ep_compile_cases
from sdk.comm import VirtualRanks
from sdk.comm.vm import MultiRankVM
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.ep_moe import EPMoEConfig, build_program, make_weights, rank_tensors, reference
from sdk.megakernel.moe_layer import MoELayerConfig, moe_reference_forward, reference_weights_full
from sdk.megakernel.program import encode
from sdk.schedule import ScheduleError, schedule, validate

TOL = 1e-2
POISON = ("logits", "topk_ids", "topk_w", "act", "y", "out", "tok", "slot", "hits", "counts", "shared_act",
          "shared_out")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The emulation is thousands of tiny torch ops: with 2 intra-op threads on the 2-core CI
    machine under load, the batch-64 N = 8 case took 14 s instead of 3.7 s (measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite output (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def _layer(batch, **kw):
    # tiny: hidden 256, 32 experts top-4, I 64; 32-row expert tiles keep the emulation fast
    base = dict(hidden=256, num_experts=32, top_k=4, intermediate=64, batch=batch, correction_bias=True,
                shared_intermediate=256, expert_rows=32)
    base.update(kw)
    return MoELayerConfig(**base)


def _run(cfg: EPMoEConfig, steps=2, seed=0, favor=1.0, skew=False, absent=(), num_sms=4):
    prog, comm = build_program(cfg)
    sched = schedule(prog, num_sms)
    validate(prog, sched.per_sm)
    words, lengths = encode(prog, sched.per_sm)
    full = make_weights(cfg, seed=seed)
    c = cfg.layer
    if skew:
        # every token of every rank picks the k experts of the LAST rank (bias >> the scores):
        # one owner receives all N*M*k assignments (its tables at capacity), the others none
        full["router.bias"].zero_()
        full["router.bias"][c.num_experts - c.top_k:] = 100.0
    n = cfg.ranks
    bufs = VirtualRanks(n, comm.layout, "cpu")
    T = [rank_tensors(cfg, prog, comm, bufs, r, full, "cpu") for r in range(n)]
    vm = MultiRankVM(prog, words, lengths, T, sched.per_sm)
    g = torch.Generator().manual_seed(1000 + seed)
    xs = [[torch.randn(c.batch, c.hidden, generator=g).to(torch.bfloat16) for _ in range(n)] for _ in range(steps)]
    ids = [[torch.randint(0, max(c.vocab, 1), (c.batch,), generator=g, dtype=torch.int32) for _ in range(n)]
           for _ in range(steps)]
    outs = {}

    def before(r, s):            # fresh tokens every step; every scratch buffer poisoned
        T[r]["x"].copy_(xs[s][r])
        if c.hash_routed:
            T[r]["input_ids"].copy_(ids[s][r])
        for name in POISON:
            t = T[r][name]
            t.fill_(float("nan") if t.dtype.is_floating_point else -7)

    def after(r, s):
        outs[r, s] = T[r]["out"].clone()

    vm.run(steps, before, after, seed=seed, favor=favor, absent=absent)
    return full, xs, ids, outs, vm, T


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("routing", ["random", "skew"])
def test_ep_moe_equals_single_rank_reference(n, batch, routing):
    """Every rank's output = the single-rank layer (all E experts) on its tokens, two steps
    without resets. The lowest rank that can progress always goes first, so rank 0 dispatches
    step 2 into its peers' receive buffers while they still finish step 1."""
    cfg = EPMoEConfig(_layer(batch), n)
    full, xs, _, outs, vm, T = _run(cfg, seed=n * 100 + batch, skew=routing == "skew")
    for s in range(len(xs)):
        for r in range(n):
            ref = reference(cfg, full, xs[s][r])
            assert rel(outs[r, s], ref) <= TOL, f"rank {r} step {s}"
    assert vm.max_skew >= 1, "no rank ran ahead into the next step: the buffer-reuse case was not exercised"
    if routing == "skew":
        last = T[n - 1]
        assert int(last["hits"][0]) == cfg.layer.top_k and int(last["counts"].sum()) == n * batch * cfg.layer.top_k
        assert all(int(T[r]["hits"][0]) == 0 for r in range(n - 1))


@pytest.mark.parametrize("case", ["fp32_wire_fp8_softmax", "mxfp4_hash", "topk1_all_to_one_expert"])
def test_ep_moe_variants(case):
    """Formats and routings through the same EP path: fp32 wire with fp8 experts and grouped
    softmax routing; MXFP4 experts with hash routing (DeepSeek-V4's first layers); top-1 with
    every token on the same single expert."""
    if case == "fp32_wire_fp8_softmax":
        lay = _layer(5, hidden=256, intermediate=128, scoring="softmax", n_group=4, topk_group=2,
                     expert_dtype="fp8_e4m3", correction_bias=False, routed_scaling_factor=2.5, swiglu_limit=1.0)
        cfg = EPMoEConfig(lay, 4, wire="fp32")
    elif case == "mxfp4_hash":
        lay = _layer(6, hidden=256, intermediate=128, scoring="sqrtsoftplus", hash_routed=True, vocab=40,
                     expert_dtype="mxfp4", routed_scaling_factor=1.5, correction_bias=False)
        cfg = EPMoEConfig(lay, 2)
    else:
        cfg = EPMoEConfig(_layer(8, top_k=1), 4)
    full, xs, ids, outs, _, T = _run(cfg, seed=7, skew=case.startswith("topk1"))
    for s in range(len(xs)):
        for r in range(cfg.ranks):
            ref = reference(cfg, full, xs[s][r], ids[s][r] if cfg.layer.hash_routed else None)
            assert rel(outs[r, s], ref) <= TOL, f"rank {r} step {s}"
    if case.startswith("topk1"):
        assert int(T[3]["counts"].sum()) == 4 * 8 and int(T[3]["hits"][0]) == 1


def test_reference_is_the_moe_oracle():
    """The reference used here (and by the GPU tests) is MoEReference.forward itself."""
    cfg = EPMoEConfig(_layer(3), 4)
    full = make_weights(cfg, seed=3)
    x = torch.randn(3, 256).to(torch.bfloat16)
    whole = MoELayerConfig(**{**cfg.layer.__dict__})
    oracle = moe_reference_forward(whole, full, x, None, reference_weights_full(whole, full))
    assert torch.allclose(reference(cfg, full, x), oracle, rtol=1e-5, atol=1e-6)


def test_combine_is_order_independent_bitwise():
    """Any legal interleaving of the ranks gives the same bits (fixed summation order)."""
    cfg = EPMoEConfig(_layer(8), 4)
    outs = [_run(cfg, steps=1, seed=5, favor=f)[3] for f in (0.0, 1.0)]
    outs.append(_run(cfg, steps=1, seed=5, favor=0.5)[3])
    for r in range(4):
        assert torch.equal(outs[0][r, 0], outs[1][r, 0]) and torch.equal(outs[0][r, 0], outs[2][r, 0])


def test_missing_rank_is_reported_not_hung():
    """A rank that never runs: the others stop at their EP table (no dispatch from it), and the
    error names it (the PyVM twin of the GPU's KernelTimeoutError)."""
    cfg = EPMoEConfig(_layer(2), 4)
    with pytest.raises(ScheduleError, match=r"flags of rank\(s\) \[2\] missing") as exc:
        _run(cfg, steps=1, absent=[2])
    assert "absent ranks [2]" in str(exc.value) and "ep.table" in str(exc.value)


def test_blocks_faces():
    """Dispatch / table / combine references against their emulated tiles, on two ranks."""
    c = EPConfig(ranks=2, m=3, hidden=64, top_k=2, num_experts=8, tile_cols=32)
    d, tb, cb = EPDispatchBlock(c), EPTableBlock(c), EPCombineBlock(c)
    assert d.chunks == 2 and d.num_tiles() == 6 and tb.num_tiles() == 1 and cb.num_tiles() == 6
    xs = [torch.randn(3, 64).to(torch.bfloat16) for _ in range(2)]
    ids = [torch.tensor([[0, 5], [1, 2], [7, 6]], dtype=torch.int32), torch.tensor([[4, 3], [0, 7], [6, 5]],
                                                                                   dtype=torch.int32)]
    lay = {n: torch.zeros(6, 64, dtype=torch.bfloat16) for n in ("rx0", "rx1")}
    meta = [torch.zeros(6, 2, dtype=torch.int32) for _ in range(2)]
    flags = [torch.zeros(6, 2, dtype=torch.int32) for _ in range(2)]
    for r in range(2):
        t = {"x": xs[r], "topk_ids": ids[r], "recv_x_0": lay["rx0"], "recv_x_1": lay["rx1"], "meta_0": meta[0],
             "meta_1": meta[1], "dflags_0": flags[0], "dflags_1": flags[1], "state": torch.zeros(6, dtype=torch.int32),
             "params": torch.tensor([r, 0, 0, 0], dtype=torch.int32)}
        for tile in range(6):
            d.emulate_tile(t, tile)
    want = d.reference(xs, ids)
    for o, rx in enumerate((lay["rx0"], lay["rx1"])):
        assert torch.equal(meta[o], want[o]["meta"])
        sent = (want[o]["meta"] >= 0).any(-1)
        assert torch.equal(rx[sent], want[o]["recv_x"][sent])
        assert int(flags[o].min()) == 1
    # rank 0 owns experts 0..3: (s=0, m=0, j=0) -> le 0; (0, 1, 0..1) -> 1, 2; (1, 0, 1) -> 3; (1, 1, 0) -> 0
    assert meta[0].tolist() == [[0, -1], [1, 2], [-1, -1], [-1, 3], [0, -1], [-1, -1]]
    tt = {"meta_self": meta[0], "dflags_self": flags[0], "counts": torch.zeros(4, dtype=torch.int32),
          "hits": torch.zeros(5, dtype=torch.int32), "tok": torch.zeros(4, 6, dtype=torch.int32),
          "slot": torch.zeros(4, 6, dtype=torch.int32), "state": torch.zeros(1, dtype=torch.int32),
          "params": torch.tensor([0, 0, 0, 0], dtype=torch.int32)}
    tb.emulate_tile(tt, 0)
    assert tt["counts"].tolist() == [2, 1, 1, 1] and tt["hits"].tolist() == [4, 0, 1, 2, 3]
    assert tt["tok"][0, :2].tolist() == [0, 4] and tt["slot"][0, :2].tolist() == [0, 8]
    # combine reference: shared + weighted sum in choice order
    w = torch.rand(3, 2)
    ret = torch.randn(6, 64)
    sh = torch.randn(3, 64)
    out = cb.reference(w, ret, sh)
    # (the sum's order differs: near-cancelling elements need an absolute tolerance)
    assert torch.allclose(out[1], sh[1] + w[1, 0] * ret[2] + w[1, 1] * ret[3], atol=1e-6)


def test_experts_rows_and_scatter_checks():
    from sdk.blocks.experts import ExpertsBlock, ExpertsConfig
    base = dict(hidden=256, intermediate=64, num_local=4, top_k=4, m=8)
    b = ExpertsBlock(ExpertsConfig(stage="down", rows=512, scatter=True, out_dtype="fp32", **base))
    spec = {s.name: s for s in b.operand_specs()}
    assert spec["out"].shape == (2048, 256) and spec["tok"].shape == (4, 512) and spec["topk_w"].optional
    for bad in (dict(stage="down", rows=512), dict(stage="gateup", scatter=True), dict(stage="down", rows=4),
                dict(stage="down", scatter=True, shared=True)):
        with pytest.raises(UnsupportedConfigError):
            ExpertsBlock(ExpertsConfig(**{**base, **bad}))


def test_ep_checks():
    for bad in (dict(ranks=33, num_experts=66), dict(ranks=3, num_experts=32), dict(ranks=2, m=65),
                dict(ranks=2, hidden=260), dict(ranks=2, wire="fp8"), dict(ranks=2, tile_cols=100)):
        kw = dict(m=1, hidden=256, top_k=2, num_experts=32)
        kw.update(bad)
        with pytest.raises(UnsupportedConfigError):
            EPDispatchBlock(EPConfig(**kw))
    with pytest.raises(UnsupportedConfigError):
        build_program(EPMoEConfig(_layer(1, num_local=8), 4))
    # auto tiling: row split at small batch, whole rows at batch >= 8
    assert EPDispatchBlock(EPConfig(ranks=8, m=1, hidden=7168, top_k=8, num_experts=64)).chunks == 4
    assert EPDispatchBlock(EPConfig(ranks=8, m=8, hidden=7168, top_k=8, num_experts=64)).chunks == 1


def test_program_regions_and_flag_labels():
    cfg = EPMoEConfig(_layer(8), 4)
    prog, comm = build_program(cfg)
    lay = comm.layout
    assert {"ep.recv_x", "ep.meta", "ep.ret", "ep.dflags", "ep.cflags"} <= set(lay.regions)
    assert lay.regions["ep.dflags"].kind == "flags" and lay.regions["ep.recv_x"].kind == "data"
    assert sorted(comm.flag_buffers.values()) == ["ep.combine", "ep.table"]
    assert comm.op_kinds == {"ep.table": "EP dispatch wait", "ep.combine": "EP combine"}
    labels = [op.label for op in prog.ops]
    assert labels.index("ep.dispatch") < labels.index("ep.table") < labels.index("experts.gateup")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_ep_blocks_and_megakernel_compile(arch):
    """The EP blocks (real shard shapes), the EP experts variants and the EP MoE megakernel compile
    for each target with no GPU."""
    pytest.importorskip("cutlass")
    from sdk.blocks._cute import standalone
    from sdk.blocks.experts import ExpertsBlock, ExpertsConfig
    from sdk.megakernel.ep_moe import compile_check
    for b in ep_compile_cases():
        standalone(b, arch)
    for cfg in (ExpertsConfig(stage="gateup", hidden=5120, intermediate=2304, num_local=48, top_k=6, m=64, rows=512,
                              weight_dtype="mxfp4", swiglu_limit=10.0),
                ExpertsConfig(stage="down", hidden=5120, intermediate=2304, num_local=48, top_k=6, m=64, rows=512,
                              weight_dtype="mxfp4", scatter=True)):
        standalone(ExpertsBlock(cfg), arch)
    report = compile_check([arch])
    bad = {k: v for k, v in report[arch].items() if isinstance(v, str)}
    assert not bad, bad


def test_import_and_build_without_cutlass_or_cuda():
    """The EP blocks' torch faces and the program build import neither CuTe DSL nor CUDA."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['cutlass'] = None; import torch; "
            "from sdk.megakernel.ep_moe import EPMoEConfig, build_program; "
            "from sdk.megakernel.moe_layer import MoELayerConfig; "
            "build_program(EPMoEConfig(MoELayerConfig(hidden=256, num_experts=32, top_k=4, intermediate=64), 4)); "
            "assert not torch.cuda.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
