"""GLM-5.3's DSA attention sublayer in one program (sdk/megakernel/dsa_layer.py), on the CPU: the
program through the PyVM (the megakernel's torch twin) against DSAMLAReference.forward + residual
(sdk/reference/dsa.py: the model's definition, its own indexer cache update and top-k); the
indexer's cache-update block against DSAIndexer.update_cache; the ops and their dependencies; the
schedule at GLM-5.3's TP8 shard; the megakernel compile for sm_90a.
GPU twin: tests/gpu/test_dsa_layer_gpu.py."""
import pytest
import torch

from sdk.errors import UnsupportedConfigError
from sdk.megakernel.dsa_layer import (IndexKeyAppendBlock, IndexKeyAppendConfig, build_program, check_selection,
                                      make_inputs, make_weights, reference, shard_config, tiny_config)
from sdk.megakernel.pyvm import PyVM


def glm53_shard(**kw):
    """GLM-5.3's DSA sublayer at TP8 (models/glm_53's full config)."""
    from models.glm_53.config import full, spec_from_config
    return shard_config(spec_from_config(full()), **kw)

SCRATCH = ("q_a", "ckv", "q_raw", "q", "o_part", "lse_part", "o_lat", "lse", "o", "resid", "index_kg", "index_w",
           "index_q", "index_scores")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_vm(prog, w, inp, seed):
    vm, _ = PyVM.from_program(prog, num_sms=9, weights={k: v for k, v in w.items() if k in prog.buffers})
    for name, v in inp.items():
        vm.tensors[name].copy_(v)
    for name in SCRATCH:
        vm.tensors[name].fill_(float("nan"))
    vm.tensors["index"].fill_(2 ** 30)
    vm.tensors["index_start"].fill_(-77)
    vm.step(seed=seed)
    return vm


# contexts shorter than the top-k (16 tokens = 4 pools of 4), at it, and far past it; lengths
# that complete a pool this step (the ring's pooling runs) and ones that do not
@pytest.mark.parametrize("T,lens", [(1, [5, 16, 72, 150]), (2, [2, 19, 104, 201])])
def test_program_equals_dsa_reference_forward(T, lens):
    cfg = tiny_config(batch=len(lens), q_tokens=T)
    prog = build_program(cfg)
    for data_seed in (3, 4):
        w = make_weights(cfg, seed=data_seed + 10)
        inp = make_inputs(cfg, lens, seed=data_seed)
        caches = {}
        want = reference(cfg, w, inp, caches=caches)
        x = inp["x"].float()
        for seed in (0, 1):                                    # two interleavings of the SMs' streams
            vm = run_vm(prog, w, inp, seed)
            got = vm.tensors
            assert not torch.isnan(got["resid"]).any()
            assert rel(got["resid"] - x, want - x) < 2e-2, "attention part"
            assert rel(got["resid"], want) < 1e-2
            # the selection is the definition's (as sets; the program lists pools ascending)
            assert check_selection(cfg, w, inp, got["index"]) == 0
            for b in range(cfg.mla.attn.batch):
                for t in range(T):
                    mine = {int(i) for i in got["index"][b, t] if i >= 0}
                    theirs = {int(i) for i in caches["selection"][b, t] if i >= 0}
                    assert mine == theirs, (b, t)
            # the indexer's caches after the step are the reference's update_cache
            for name in ("index_tail_k", "index_tail_gate", "index_pool_k"):
                assert rel(got[name], caches[name]) < 1e-2, name
            assert torch.equal(got["index_start"], inp["seq_lens"] - T)


def test_glm53_tp8_shard_through_the_pyvm():
    """The GPU test's check on the PyVM: GLM-5.3's TP8 shard, batch 3 (0, 188 and 562 pools, a pool
    completed this step), against the definition; a near-tie flip at the k-th pool is tolerated
    by check_selection and the forward then runs on the program's list."""
    cfg = glm53_shard(batch=3, max_seq_len=9000, num_pages=sum(-(-x // 64) for x in (1, 3008, 9000)) + 4)
    prog = build_program(cfg)
    w, inp = make_weights(cfg, seed=1), make_inputs(cfg, [1, 3008, 9000], seed=2)
    caches = {}
    want = reference(cfg, w, inp, caches=caches)
    vm = run_vm(prog, w, inp, 0)
    if check_selection(cfg, w, inp, vm.tensors["index"]):
        want = reference(cfg, w, inp, selection=vm.tensors["index"])
    x = inp["x"].float()
    assert rel(vm.tensors["resid"] - x, want - x) < 2e-2 and rel(vm.tensors["resid"], want) < 1e-2
    assert rel(vm.tensors["index_pool_k"], caches["index_pool_k"]) < 1e-2
    assert not torch.equal(caches["index_pool_k"][1, 187], inp["index_pool_k"][1, 187])


def test_selection_matters():
    """The sparse decode really drops tokens: the same step attending densely differs."""
    cfg = tiny_config(batch=2)
    w, inp = make_weights(cfg, seed=5), make_inputs(cfg, [150, 201], seed=6)
    x = inp["x"].float()
    want = reference(cfg, w, inp)
    every = torch.arange(201)[None, None].expand(2, 1, 201)
    dense = reference(cfg, w, inp, selection=every)
    assert rel(dense - x, want - x) > 0.1


@pytest.mark.parametrize("T,start", [(1, 3), (3, 2), (3, 9)])
def test_key_append_block_equals_update_cache(T, start):
    """IndexKeyAppendBlock (its torch twin) == DSAIndexer.update_cache on the GEMV's fp32 k / gate:
    ring rows, the pools the tokens complete (mid-call too), nothing else."""
    import torch.nn.functional as F

    from sdk.reference.common import StepInfo
    from sdk.reference.dsa import DSAIndexer
    from sdk.spec import DSAIndexerSpec
    B, d, P, S = 2, 32, 4, 64
    g = torch.Generator().manual_seed(T * 7 + start)
    blk = IndexKeyAppendBlock(IndexKeyAppendConfig(batch=B, q_tokens=T, head_dim=d, kpool=P, max_seq_len=S))
    x = torch.randn(B, T, 48, generator=g)
    wk, gate = torch.randn(d, 48, generator=g) / 7, torch.randn(d, 48, generator=g) / 3
    nw, nb = 1 + 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    ape = 0.5 * torch.randn(P, d, generator=g)
    bf = lambda v: v.to(torch.bfloat16)
    wts = {"wk.weight": wk, "index_kpool_compress_gate": gate, "k_norm.weight": bf(nw).float(),
           "k_norm.bias": bf(nb).float(), "index_kpool_compress_ape": bf(ape).float()}
    idx = DSAIndexer(None, DSAIndexerSpec(num_heads=2, head_dim=d, topk=8, kpool=P), wts)
    starts = torch.tensor([start, start + 5])
    cache = {"index_tail_k": bf(torch.randn(B, P, d, generator=g)),
             "index_tail_gate": bf(torch.randn(B, P, d, generator=g)),
             "index_pool_k": bf(torch.randn(B, S // P, d, generator=g))}
    t = {"k_gate": torch.cat([F.linear(x, wk), F.linear(x, gate)], -1).reshape(B * T, 2 * d),
         "k_norm_w": bf(nw), "k_norm_b": bf(nb), "ape": bf(ape), "seq_lens": (starts + T).int(),
         "tail_k": cache["index_tail_k"].clone(), "tail_gate": cache["index_tail_gate"].clone(),
         "pool_k": cache["index_pool_k"].clone(), "start": torch.zeros(B, dtype=torch.int32)}
    before = t["pool_k"].clone()
    step = StepInfo(start=starts, positions=starts[:, None] + torch.arange(T),
                    input_ids=torch.zeros(B, T, dtype=torch.long))
    idx.update_cache(x, cache, step)
    for b in range(B):
        blk.emulate_tile(t, b)
    for a, name in (("tail_k", "index_tail_k"), ("tail_gate", "index_tail_gate"), ("pool_k", "index_pool_k")):
        assert (t[a].float() - cache[name].float()).abs().max() <= 2 ** -7 * cache[name].float().abs().max(), name
    changed = (t["pool_k"] != before).any(-1)
    want = torch.zeros_like(changed)
    for b in range(B):
        for p in range(int(starts[b]), int(starts[b]) + T):
            if p % P == P - 1:
                want[b, p // P] = True
    assert torch.equal(changed, want)
    assert torch.equal(t["start"], starts.int())


def _waits(prog, i):
    """Labels of the ops op i waits for."""
    ins = prog.instructions[prog.ops[i].instructions[0]]
    return {prog.counter_names[c] for c, _ in ins.waits}


def test_ops_and_dependencies():
    cfg = tiny_config(batch=2)
    prog = build_program(cfg)
    ops = {o.label: i for i, o in enumerate(prog.ops)}
    assert list(ops) == ["attn.q_a", "attn.kv_a", "attn.q_b", "attn.rope_append", "attn.w_uk", "index.k_gate",
                         "index.weights", "index.q", "index.key_append", "index.score", "index.topk", "attn.decode",
                         "attn.combine", "attn.w_uv", "attn.o_proj"]
    want = {"attn.q_b": {"attn.q_a"}, "attn.rope_append": {"attn.kv_a", "attn.q_b"}, "attn.w_uk": {"attn.q_b"},
            "index.k_gate": set(), "index.weights": set(), "index.q": {"attn.q_a"},
            "index.key_append": {"index.k_gate", "index.weights"}, "index.score": {"index.key_append", "index.q"},
            "index.topk": {"index.score", "attn.w_uk"}, "attn.decode": {"attn.rope_append", "index.topk"},
            "attn.combine": {"attn.decode"}, "attn.w_uv": {"attn.combine"}, "attn.o_proj": {"attn.w_uv"}}
    for label, deps in want.items():
        assert _waits(prog, ops[label]) == deps, label
    dec = prog.ops[ops["attn.decode"]]
    assert dec.block.sparse and dec.block.config.index_width == 16 + 3 and dec.bindings["index"] == "index"
    assert dec.block.config.rope == 0
    tk = prog.ops[ops["index.topk"]]
    assert tk.block.config.k == 4 and tk.block.config.expand == 4 and tk.block.config.tail
    sc = prog.ops[ops["index.score"]].block
    assert abs(sc.scale - 32 ** -0.5 * 8 ** -0.5) < 1e-12
    # the decode's waits cover every op before it (transitively)
    seen, todo = set(), ["attn.decode"]
    while todo:
        for dep in _waits(prog, ops[todo.pop()]):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    assert seen == set(list(ops)[:ops["attn.decode"]])


def test_rejects_rope():
    from dataclasses import replace
    cfg = tiny_config()
    with pytest.raises(UnsupportedConfigError, match="NoPE"):
        replace(cfg, mla=replace(cfg.mla, attn=replace(cfg.mla.attn, rope=64), rope_mode="interleaved"))


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_glm53_tp8_shard_schedules(batch):
    """GLM-5.3's TP8 shard (8 MLA heads, the 32 x 128 indexer, top 2048, kpool 16) builds, fits
    the shared memory, schedules and validates on 132 SMs at 32K context."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.program import RECORDS_MARGIN
    from sdk.schedule import schedule, validate
    cfg = glm53_shard(batch=batch, max_seq_len=32768)
    a = cfg.mla.attn
    assert (a.heads, cfg.mla.hidden, a.nope, cfg.index_heads, cfg.width) == (8, 4096, 256, 32, 2063)
    prog = build_program(cfg)
    assert ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)[1] >= 2
    validate(prog, schedule(prog, 132).per_sm)


def test_megakernel_compiles_sm90a():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.schedule import schedule
    prog = build_program(glm53_shard(batch=1, max_seq_len=32768))
    compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, arch="sm_90a")
