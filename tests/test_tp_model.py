"""Kimi K3's whole decode step over N tensor-parallel ranks (sdk/megakernel/tp_model.py): one program
per rank, run by the multi-rank PyVM (the ranks interleaved at random, unsynchronised steps), against
the model itself - the reference backend on the unsharded weights - step after step from empty
caches; every rank's hidden state bit-equal to the others'. As tests/test_plain_model.py does, the
program's distance to the fp32 model is set beside the bf16 model's own, and steps where the
model's expert choice is a near-tie are counted apart."""
import dataclasses

import pytest
import torch
from test_plain_model import SPEC, TIE_MARGIN, reference, rel, small_weights

from sdk import build_megakernel
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.tp_model import TPModelConfig, TPModelRunner, build_program, padded, shard_weights


def test_tp_program_equals_the_model_step_after_step(margins):
    """70 steps of small over 2 ranks at batch 2 (the MLA caches cross their first 64-token page):
    the joined logits against the fp32 model (~2e-2, as the one-GPU program), the bf16 model's own
    distance beside them; each step, every rank's x the same bits."""
    w = small_weights(SPEC, seed=1)
    ref32, ref16 = reference(SPEC, w, torch.float32), reference(SPEC, w, torch.bfloat16)
    runner = TPModelRunner(TPModelConfig(SPEC, batch=2, max_seq_len=80, ranks=2), w)
    s32, s16 = ref32.new_state(2), ref16.new_state(2)
    g = torch.Generator().manual_seed(2)
    errs, errs16, ties = [], [], []
    for step in range(70):
        ids = torch.randint(0, SPEC.vocab_size, (2,), generator=g)
        margins.on, margins.values = True, []
        want = ref32.decode(ids[:, None], s32)[:, 0]
        margins.on = False
        err = rel(runner.decode(ids), want)
        (ties if min(margins.values) < TIE_MARGIN else errs).append(err)
        x = [t["x"] for t in runner.rank_tensors()]
        assert all(torch.equal(x[0], xr) for xr in x[1:]), f"step {step}: the ranks' hidden states differ"
        if step < 8:
            errs16.append(rel(ref16.decode(ids[:, None], s16)[:, 0], want))
    print("TP2 program vs fp32 model, per step:", " ".join(f"{e:.1e}" for e in errs))
    print(f"near-tie steps ({len(ties)}):", " ".join(f"{e:.1e}" for e in ties))
    print("bf16 model vs fp32 model, first steps:", " ".join(f"{e:.1e}" for e in errs16))
    assert len(errs) >= 60 and max(errs) < 5e-2 and sum(errs) / len(errs) < 2.5e-2, errs
    assert sum(errs[:8]) < sum(errs16), (errs[:8], errs16)


def test_a_wrong_shard_is_seen():
    """The comparison's power: rank 1 given rank 0's router rotation (it then runs its experts for
    the wrong expert ids) or rank 0's KDA output columns moves the logits far past the tolerance.
    (Weights whose first step has no near-tie of the experts' choice: seed 3's is one - 1e-3 -
    which the one-GPU and the 2-rank programs' rounding resolve differently.)"""
    w = small_weights(SPEC, seed=4)
    ref = reference(SPEC, w, torch.float32)
    ids = torch.tensor([7, 300])
    want = ref.decode(ids[:, None], ref.new_state(2))[:, 0]
    cfg = TPModelConfig(SPEC, batch=2, max_seq_len=80, ranks=2)
    ok = rel(TPModelRunner(cfg, w).decode(ids), want)
    errs = []
    for name in ("l1.mlp.router.weight", "l0.attn.w_o"):
        runner = TPModelRunner(cfg, w)
        t0, t1 = runner.rank_tensors()
        t1[name].copy_(t0[name])
        errs.append(rel(runner.decode(ids), want))
    print(f"right {ok:.1e}, rank 1 with rank 0's router {errs[0]:.1e}, with rank 0's o_proj {errs[1]:.1e}")
    assert ok < 3e-2 and min(errs) > 4 * ok


def test_shards_and_program_shape():
    """Rank r's weights: its heads' rows, its experts first in the router, the padded shards; the
    program: one all-reduce per attention / dense sublayer, two per MoE (the routed sum with its
    norm and column shard, then x), the lm_head a vocabulary slice."""
    w = small_weights(SPEC, seed=0)
    cfg = TPModelConfig(SPEC, batch=1, ranks=2)
    s1 = shard_weights(cfg, w, 1)
    q = "layers.0.attn.q_proj.weight"
    assert torch.equal(s1[q], w[q][256:])
    conv = "layers.0.attn.conv1d.weight"
    assert torch.equal(s1[conv][:256], w[conv][256:512]) and torch.equal(s1[conv][256:512], w[conv][768:1024])
    gate = "layers.1.mlp.gate.weight"
    assert torch.equal(s1[gate][:16], w[gate][16:]) and torch.equal(s1[gate][16:], w[gate][:16])
    assert torch.equal(s1["layers.1.mlp.experts.down_proj"], w["layers.1.mlp.experts.down_proj"][16:])
    assert torch.equal(s1["lm_head.weight"], w["lm_head.weight"][512:])
    prog, comm = build_program(cfg)
    labels = [r["label"] for r in comm.records]
    assert labels[:3] == ["l0.attn.allreduce", "l0.mlp.allreduce", "l1.attn.allreduce"]
    assert labels[3:5] == ["l1.mlp.allreduce.routed", "l1.mlp.allreduce"] and len(labels) == 11
    assert prog.buffers["logits"].shape == (1, 512)
    assert prog.buffers["l1.mlp.zn"].shape == (1, padded(256))

    # the latent's 4-column shards and the padded shared expert at 4 ranks
    (_, moe4), = [p for p in TPModelConfig(SPEC, ranks=4).layers()][1:2]
    assert (moe4.num_local, moe4.shared_intermediate, moe4.latent_shard) == (8, 256, 256)


def test_refusals():
    with pytest.raises(UnsupportedConfigError, match="do not split over 3 ranks"):
        TPModelConfig(SPEC, ranks=3).layers()
    grouped = dataclasses.replace(SPEC, layers=tuple(
        dataclasses.replace(l, mlp=dataclasses.replace(l.mlp, n_group=2, topk_group=1)) if l.mlp.kind == "moe" else l
        for l in SPEC.layers))
    with pytest.raises(UnsupportedConfigError, match="router's groups"):
        TPModelConfig(grouped, ranks=4).layers()


def test_megakernel_backend_with_tp_generates():
    """build_megakernel("kimi_k3", "small", backend="megakernel", tp=2): greedy generation through the
    two ranks' programs equals the (fp32) reference backend's - the same tokens, the logits within
    bf16's distance - with ragged prompts; other models refuse tp > 1 by name."""
    w = small_weights(SPEC, seed=4, bias_std=100.0)
    ref = reference(SPEC, w, torch.float32, max_seq_len=16)
    mk = build_megakernel("kimi_k3", "small", backend="megakernel", tp=2, max_seq_len=16, max_batch=2)
    mk.load_weights(w)
    prompt = torch.tensor([[5, 17, 3, 8], [9, 1, 200, 0]])
    out, want = mk.generate(prompt, 3, prompt_lens=[4, 2]), ref.generate(prompt, 3, prompt_lens=[4, 2])
    assert torch.equal(out, want), (out, want)
    assert rel(mk.last_logits, ref.last_logits) < 5e-2
    with pytest.raises(UnsupportedConfigError, match="glm_53's program on one GPU"):
        build_megakernel("glm_53", "small", backend="megakernel", tp=2)
