"""Tensor-parallel MLA attention on the CPU (sdk/megakernel/tp_attention.py): N ranks' heads
shards (W_UK -> decode -> combine -> W_UV -> row-parallel o_proj -> fused all-reduce + residual
+ RMSNorm) run together by the multi-rank PyVM in random interleavings, two steps without resets,
equal to the unsharded layer; every rank's output bit-equal. GPU twin: tests/gpu/test_tp_attention_gpu.py."""
import pytest
import torch

from sdk.comm import VirtualRanks
from sdk.comm.vm import MultiRankVM
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.mla_attention import MLAAttentionConfig, make_inputs
from sdk.megakernel.program import encode
from sdk.megakernel.tp_attention import TPAttentionConfig, build_program, make_weights, rank_tensors, reference, \
    shard_inputs
from sdk.schedule import schedule, validate


def rel_err(got, ref):
    assert torch.isfinite(got.float()).all(), "NaN poison left in the output"
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("n,algo", [(2, "oneshot"), (4, "twoshot")])
def test_tp_attention_equals_unsharded_layer(n, algo):
    attn = MLAAttentionConfig(heads=8, batch=2, q_tokens=1, num_pages=16, max_seq_len=512, num_splits=3)
    cfg = TPAttentionConfig(attn, n, hidden=1024, algo=algo)
    prog, comm = build_program(cfg)
    labels = [op.label for op in prog.ops]
    assert labels[:5] == ["attn.w_uk", "attn.decode", "attn.combine", "attn.w_uv", "attn.o_proj"]
    assert labels[5:] == (["attn.allreduce"] if algo == "oneshot" else ["attn.allreduce.rs", "attn.allreduce.ag"])
    full = make_weights(cfg, seed=3)
    sched = schedule(prog, 6)
    validate(prog, sched.per_sm)
    words, lengths = encode(prog, sched.per_sm)
    bufs = VirtualRanks(n, comm.layout, "cpu")
    T = [rank_tensors(cfg, prog, comm, bufs, r, full, "cpu") for r in range(n)]
    vm = MultiRankVM(prog, words, lengths, T, sched.per_sm)
    steps = [make_inputs(attn, [300, 41], seed=10 + s) for s in range(2)]
    g = torch.Generator().manual_seed(5)
    for s in steps:
        s["x"] = torch.randn(attn.tokens, cfg.hidden, generator=g).to(torch.bfloat16)
    outs = {}

    def before(r, s):
        for name, v in shard_inputs(cfg, steps[s], r).items():
            T[r][name].copy_(v)
        for name in ("o", "partial", "out"):
            T[r][name].fill_(float("nan"))

    def after(r, s):
        outs[r, s] = T[r]["out"].clone()

    vm.run(2, before, after, seed=n)
    for s, inp in enumerate(steps):
        want = reference(cfg, full, inp)
        for r in range(n):
            assert rel_err(outs[r, s], want) < 1e-2, f"rank {r} step {s}"
            assert torch.equal(outs[r, s], outs[0, s]), "ranks disagree"


def test_heads_must_shard_evenly():
    attn = MLAAttentionConfig(heads=6)
    with pytest.raises(UnsupportedConfigError, match="6 heads do not shard over 4"):
        build_program(TPAttentionConfig(attn, 4))
