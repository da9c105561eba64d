"""Kimi K3's whole decode step over N tensor-parallel ranks (sdk/megakernel/tp_model.py): one program
per rank, run by the multi-rank PyVM (the ranks interleaved at random, unsynchronised steps), against
the model itself - the reference backend on the unsharded weights - step after step from empty
caches; every rank's hidden state bit-equal to the others'. As tests/test_plain_model.py does, the
program's distance to the fp32 model is set beside the bf16 model's own, and steps where the
model's expert choice is a near-tie are counted apart."""
import dataclasses

import pytest
import torch
from test_plain_model import SPEC, reference, rel, small_weights, steps_against_the_model

from sdk import build_megakernel, plugins
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.tp_model import (TPMHCModelConfig, TPMHCModelRunner, TPModelConfig, TPModelRunner,
                                     build_mhc_program, build_program, padded, shard_weights)


def test_tp_program_equals_the_model_step_after_step(margins):
    """70 steps of small over 2 ranks at batch 2 (the MLA caches cross their first 64-token page):
    the joined logits against the fp32 model (~2e-2, as the one-GPU program), the bf16 model's own
    distance beside them; each step, every rank's x the same bits."""
    w = small_weights(SPEC, seed=1)
    runner = TPModelRunner(TPModelConfig(SPEC, batch=2, max_seq_len=80, ranks=2), w)

    steps_against_the_model(runner, w, margins, "TP2 program", lambda step: assert_same_x(runner, step))


def assert_same_x(runner, step):
    x = [t["x"] for t in runner.rank_tensors()]
    assert all(torch.equal(x[0], xr) for xr in x[1:]), f"step {step}: the ranks' hidden states differ"


def steps_against(runner, ref, steps, after_step):
    """`steps` decode steps of random ids (batch 2, seed 6) through the TP runner and the model
    (a fresh state); after_step(step) checks the ranks. Returns the logits' rel errs."""
    state = ref.new_state(2)
    g = torch.Generator().manual_seed(6)
    errs = []
    for step in range(steps):
        ids = torch.randint(0, ref.spec.vocab_size, (2,), generator=g)
        errs.append(rel(runner.decode(ids), ref.decode(ids[:, None], state)[:, 0]))
        after_step(step)
    return errs


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
    """Rank r's weights: its heads' rows, its experts' router rows (the bias rotated: its experts
    first, as the gathered logits are), the padded shards; the program: one all-reduce per
    attention / dense sublayer, four collectives per MoE (the gathers of the logits and of z, the
    routed sum with its norm and column shard, x), all in one chain; the lm_head a vocabulary slice."""
    w = small_weights(SPEC, seed=0)
    cfg = TPModelConfig(SPEC, batch=1, ranks=2)
    s1 = shard_weights(cfg, w, 1)
    q = "layers.0.attn.q_proj.weight"
    assert torch.equal(s1[q], w[q][256:])
    conv = "layers.0.attn.conv1d.weight"
    assert torch.equal(s1[conv][:256], w[conv][256:512]) and torch.equal(s1[conv][256:512], w[conv][768:1024])
    gate, bias = "layers.1.mlp.gate.weight", "layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(s1[gate], w[gate][16:])
    assert torch.equal(s1[bias][:16], w[bias][16:]) and torch.equal(s1[bias][16:], w[bias][:16])
    assert torch.equal(s1["layers.1.mlp.experts.down_proj"], w["layers.1.mlp.experts.down_proj"][16:])
    assert torch.equal(s1["lm_head.weight"], w["lm_head.weight"][512:])
    prog, comm = build_program(cfg)
    labels = [r["label"] for r in comm.records]
    assert labels[:3] == ["l0.attn.allreduce", "l0.mlp.allreduce", "l1.attn.allreduce"]
    assert labels[3:7] == ["l1.mlp.gather.logits", "l1.mlp.gather.z", "l1.mlp.allreduce.routed",
                           "l1.mlp.allreduce"] and len(labels) == 17
    comm.layout                                     # the chain check passes
    assert prog.buffers["logits"].shape == (1, 512)
    assert prog.buffers["l1.mlp.zn"].shape == (1, padded(256))

    # the latent's 4-column shards and the padded shared expert at 4 ranks
    (_, moe4), = TPModelConfig(SPEC, ranks=4).layers()[1:2]
    assert (moe4.num_local, moe4.shared_intermediate, moe4.latent_shard) == (8, 256, 256)


def test_refusals():
    with pytest.raises(UnsupportedConfigError, match="do not split over 3 ranks"):
        TPModelConfig(SPEC, ranks=3).layers()
    grouped = dataclasses.replace(SPEC, layers=tuple(
        dataclasses.replace(l, mlp=dataclasses.replace(l.mlp, n_group=2, topk_group=1)) if l.mlp.kind == "moe" else l
        for l in SPEC.layers))
    # 4 ranks leave KDA one 128-wide head: its o_proj's K is under the GEMV's 256 - named by sublayer
    with pytest.raises(UnsupportedConfigError, match="l0.attn \\(KDALayerConfig\\) cut for 4 ranks: gemv"):
        build_program(TPModelConfig(SPEC, ranks=4))
    with pytest.raises(UnsupportedConfigError, match="router's groups"):
        TPModelConfig(grouped, ranks=4).layers()


def test_megakernel_backend_with_tp_generates():
    """build_megakernel("kimi_k3", "small", backend="megakernel", tp=2): greedy generation through the
    two ranks' programs equals the (fp32) reference backend's - the same tokens, the logits within
    bf16's distance - with ragged prompts; expert parallelism is refused by name."""
    w = small_weights(SPEC, seed=4, bias_std=100.0)
    ref = reference(SPEC, w, torch.float32, max_seq_len=16)
    mk = build_megakernel("kimi_k3", "small", backend="megakernel", tp=2, max_seq_len=16, max_batch=2)
    mk.load_weights(w)
    prompt = torch.tensor([[5, 17, 3, 8], [9, 1, 200, 0]])
    out, want = mk.generate(prompt, 3, prompt_lens=[4, 2]), ref.generate(prompt, 3, prompt_lens=[4, 2])
    assert torch.equal(out, want), (out, want)
    assert rel(mk.last_logits, ref.last_logits) < 5e-2
    with pytest.raises(UnsupportedConfigError, match="glm_53's program on one GPU .* or tensor parallel"):
        build_megakernel("glm_53", "small", backend="megakernel", tp=2, ep=2)


def test_tp4_with_padded_shards():
    """small with 8 attention heads over 4 ranks: the dense MLP's (128), the shared expert's (64) and
    the latent's (128) shards zero-padded to the GEMVs' 256, 8 experts a rank behind the rotated
    gather - 12 steps against the fp32 model at batch 2, the 4 ranks interleaved at random and
    their x bit-equal every step."""
    spec = dataclasses.replace(SPEC, layers=tuple(
        dataclasses.replace(l, attention=dataclasses.replace(l.attention, num_heads=8)) for l in SPEC.layers))
    cfg = TPModelConfig(spec, batch=2, max_seq_len=16, ranks=4)
    dense, moe = cfg.layers()[0][1], cfg.layers()[1][1]
    assert (dense.intermediate, moe.shared_intermediate, moe.latent_shard, moe.local) == (256, 256, 256, 8)
    w = small_weights(spec, seed=4, bias_std=100.0)
    ref = reference(spec, w, torch.float32, max_seq_len=16)
    runner = TPModelRunner(cfg, w)
    errs = steps_against(runner, ref, 12, lambda step: assert_same_x(runner, step))
    print("TP4 program vs fp32 model:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 5e-2 and sum(errs) / len(errs) < 3e-2, errs


def test_glm_tp_program_equals_the_model_step_after_step(monkeypatch):
    """GLM-5.3 small over 2 ranks (KDA and DSA heads, dense intermediate, experts sharded; each
    site's post-mix the all-reduce's epilogue; the DSA indexers replicated): 24 steps at batch 2
    against the fp32 model (the indexers select from step 19 on), the ranks' mHC streams bit-equal
    every step."""
    import test_glm_model as glm
    w = glm.glm_weights(seed=1)
    runner = TPMHCModelRunner(TPMHCModelConfig(glm.SPEC, batch=2, max_seq_len=64, ranks=2), w)

    def same_streams(step):
        s = [t["streams"] for t in runner.rank_tensors()]
        assert all(torch.equal(s[0], sr) for sr in s[1:]), f"step {step}: the ranks' streams differ"

    glm.steps_against_the_model(runner, w, monkeypatch, "GLM-5.3 TP2 program", steps=24, after_step=same_streams)


def test_replicated_router():
    """router_gather=False: every rank reads the whole router, its rows rotated (its experts
    first), and no logits gather - 8 steps against the fp32 model. The program's choice where a
    rank's router rows are not whole 8-row groups of the GEMV: GLM-5.3 TP8's 36 (its first four
    layers at full width build so)."""
    cfg = TPModelConfig(SPEC, batch=2, max_seq_len=16, ranks=2, router_gather=False)
    assert cfg.layers()[1][1].router_outputs == 32
    prog, comm = build_program(cfg)
    assert not [r for r in comm.records if "gather.logits" in r["label"]]
    w = small_weights(SPEC, seed=4, bias_std=100.0)
    gate = "layers.1.mlp.gate.weight"
    assert torch.equal(shard_weights(cfg, w, 1)[gate], torch.roll(w[gate], -16, 0))
    ref = reference(SPEC, w, torch.float32, max_seq_len=16)
    runner = TPModelRunner(cfg, w)
    state = ref.new_state(2)
    g = torch.Generator().manual_seed(6)
    errs = [rel(runner.decode(ids), ref.decode(ids[:, None], state)[:, 0])
            for ids in (torch.randint(0, SPEC.vocab_size, (2,), generator=g) for _ in range(8))]
    print("TP2, replicated router:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 5e-2 and sum(errs) / len(errs) < 3e-2, errs

    from sdk import plugins
    full = plugins.get_model("glm_53").spec("full")
    glm8 = TPMHCModelConfig(dataclasses.replace(full, layers=full.layers[:4]), batch=1, max_seq_len=4096, ranks=8)
    prog, comm = build_mhc_program(glm8)
    assert prog.buffers["l3.mlp.router.weight"].shape == (288, 4096)
    assert not [r for r in comm.records if "gather" in r["label"]]


@pytest.mark.parametrize("o_groups", [1, 2])
def test_v41_tp_program_equals_the_model(o_groups):
    """DeepSeek-V4.1 small_v41 over 2 ranks (SWA, CSA, HCA, CSA: the query heads sharded, the kv
    head, compressors and indexer replicated; hash-routed then learned MoE, the hash table's ids
    rotated as the gathered logits are; V4.1's lagged sites, their post-mixes the all-reduces'
    epilogue): 6 steps against the model, the ranks' streams bit-equal. o_groups 2: each rank's
    heads one o_a group (its rows and its o_b columns); 1: the group's columns split, o_b whole."""
    import test_dsv4_model as v4
    spec = build_megakernel("deepseek_v41_flash", "small_v41").spec
    spec = dataclasses.replace(spec, layers=tuple(
        dataclasses.replace(l, attention=dataclasses.replace(l.attention, o_groups=o_groups)) for l in spec.layers))
    ref, w = v4.all_kinds_model(seed=5, spec=spec)
    runner = TPMHCModelRunner(TPMHCModelConfig(spec, batch=2, max_seq_len=32, ranks=2), w)

    def same_streams(step):
        s = [t["streams"] for t in runner.rank_tensors()]
        assert torch.equal(s[0], s[1]), f"step {step}: the ranks' streams differ"
    errs = steps_against(runner, ref, 6, same_streams)
    print(f"small_v41 TP2 (o_groups {o_groups}): logits rel err per step:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 3e-2, errs
    if o_groups == 2:               # a rank's heads in one o_a group, or whole groups a rank
        with pytest.raises(UnsupportedConfigError, match="o_groups=2.*a multiple of o_groups"):
            TPMHCModelConfig(spec, ranks=3).layers()


def test_v41_tp_program_with_whole_groups_a_rank():
    """o_groups a multiple of the ranks (V4.1-Flash's 8 groups over 2 or 4 GPUs): 4 heads in 4 o_a
    groups over 2 ranks - each rank's 2 heads are 2 whole groups, one grouped o_a GEMV, the groups'
    o_a rows and o_b columns - 6 steps against the model, the ranks' streams bit-equal."""
    import test_dsv4_model as v4
    spec = v4.grouped_spec(4, 4)
    ref, w = v4.all_kinds_model(seed=9, spec=spec)
    cfg = TPMHCModelConfig(spec, batch=2, max_seq_len=32, ranks=2)
    assert {a.o_groups for a, _ in cfg.layers()} == {2}
    runner = TPMHCModelRunner(cfg, w)

    def same_streams(step):
        s = [t["streams"] for t in runner.rank_tensors()]
        assert torch.equal(s[0], s[1]), f"step {step}: the ranks' streams differ"
    errs = steps_against(runner, ref, 6, same_streams)
    print("small_v41 4 heads / 4 groups, TP2: logits rel err per step:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 3e-2, errs


def test_whole_rank_programs_fit_one_sms_shared_memory():
    """program.fitted_sublayers: the sublayers of a whole rank program each fit the weight ring
    alone, but the ring's stage, staged activations and plain-tile arena are maxima over all of
    them. Kimi K3 TP4 at batch 8 (its first four layers at full width) built before and could not
    compile (1 ring stage); now its MLA sublayer refits beside the others' streams (16-token
    chunks, 16-row decode tiles) and the whole leaves the ring 2 stages with its records.
    V4.1-Flash TP8 at batch 64 has 166 instructions on one SM, records over the 48 KB they may
    keep resident: they stream through a window of slots (program.records_geometry), and the
    ring fits beside it."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.program import RECORDS_WINDOW_BYTES, records_geometry, whole_records
    from sdk.schedule import schedule
    spec = plugins.get_model("kimi_k3").spec("full")
    spec = dataclasses.replace(spec, layers=spec.layers[:4])
    prog, _ = build_program(TPModelConfig(spec, batch=8, max_seq_len=32768, ranks=4))
    assert ring_geometry(prog.opcodes.blocks, reserved=whole_records(prog, 132))[1] >= 2
    dec = [b for b in prog.opcodes.blocks if b.name == "mla_decode"]
    assert dec and all((b.config.chunk, b.config.max_tile_rows, b.row_groups) == (16, 16, 2) for b in dec)
    v41 = plugins.get_model("deepseek_v41_flash").spec("full_v41")
    prog, _ = build_mhc_program(TPMHCModelConfig(dataclasses.replace(v41, layers=v41.layers[:4]), batch=64,
                                                 max_seq_len=32768, ranks=8))
    max_len = schedule(prog, 132).max_len
    _, rec, window = records_geometry(prog.opcodes.blocks, max_len)
    assert max_len > window > 0 and rec <= RECORDS_WINDOW_BYTES
    assert ring_geometry(prog.opcodes.blocks, reserved=rec)[1] >= 2
