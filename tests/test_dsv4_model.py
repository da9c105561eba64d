"""A whole DeepSeek-V4.1 decode step in one program (sdk/megakernel/mhc_model.py), run by the PyVM
(the blocks' torch twins in a random valid order), against the model itself: the reference backend
(sdk/reference, V4.1's math: the lagged mHC, the carried head, queries without the head norm) on
the same bf16 weights, step after step from empty caches, ragged batch positions shared.

The layers here are a sliding-window and an HCA layer with hash-routed MoE: their outputs are
continuous in the inputs (no top-k), so the program and the model - bf16 both, rounded in
different places - stay comparable over many steps; the CSA indexer's and the learned router's
selections are checked where the selection is pinned (tests/test_dsv4_layer.py, test_moe_blocks.py)."""
import re

import pytest
import torch

from sdk import build_megakernel, plugins
from sdk.errors import CapacityError, UnsupportedConfigError
from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner, build_program
from sdk.reference.model import random_weights

# the model keeps these fp32 in a bf16 checkpoint (models/deepseek_v41_flash/weights.py)
FP32 = re.compile(r"(\.hc_(attn|mlp)\.|\.attn\.sinks$|position_bias$|q_a_norm\.weight$|kv_norm\.weight$|"
                  r"e_score_correction_bias$)")


def small_model(layers=("sliding_attention", "heavily_compressed_attention"), mlp=("hash_moe", "hash_moe"),
                v41=True):
    from models.deepseek_v41_flash.config import SMALL, V41_SWITCH
    config = {**SMALL, V41_SWITCH: v41, "num_hidden_layers": len(layers), "layer_types": list(layers),
              "mlp_layer_types": list(mlp)}
    return build_megakernel("deepseek_v41_flash", config, dtype=torch.bfloat16, max_seq_len=64, max_batch=4)


def bf16_weights(spec, seed):
    """Random weights whose values are bf16 (the program's dtype), fp32 where the model keeps fp32;
    the mHC scales near 1 and biases O(0.5) (random_weights' 0.02 would leave every coefficient at
    its sigmoid's midpoint, whatever the streams)."""
    w = random_weights(spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for k in w:
        if k.endswith(".scale") and ".hc_" in k:
            w[k] = 1 + 0.3 * torch.randn(w[k].shape, generator=g)
        elif k.endswith(".base") and ".hc_" in k:
            w[k] = 0.5 * torch.randn(w[k].shape, generator=g)
    return {k: (v.to(torch.bfloat16).to(torch.float32 if FP32.search(k) else torch.bfloat16)
                if v.is_floating_point() else v) for k, v in w.items()}


def all_kinds_model(seed, device="cpu", batch=2, spec=None):
    """(the reference backend on small_v41 - or `spec`, a variant of it - its bf16 weights with a
    wide correction bias) - test_small_v41_all_layer_kinds says why."""
    from sdk.reference.model import ReferenceModel
    spec = spec or build_megakernel("deepseek_v41_flash", "small_v41").spec
    ref = ReferenceModel(plugins.get_model("deepseek_v41_flash"), spec, device=device, dtype=torch.bfloat16,
                         max_seq_len=32, max_batch=batch)
    w = bf16_weights(spec, seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    for k in w:
        if k.endswith("e_score_correction_bias"):
            w[k] = (10 * torch.randn(w[k].shape, generator=g)).to(torch.bfloat16).float()
    w = {k: v.to(device) for k, v in w.items()}
    ref.load_weights(w)
    return ref, w


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite logits (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("v41", [True, False], ids=["v41-lagged-carried-head", "v4-weighted-head"])
def test_program_equals_the_model_step_after_step(v41):
    """V4.1's math (lagged mHC, carried head, no q head norm) and V4's (transformers' deepseek_v4:
    unlagged sites, the weighted head, the q head norm)."""
    ref = small_model(v41=v41)
    assert ref.spec.residual.lagged_pre == v41
    w = bf16_weights(ref.spec, seed=1)
    ref.load_weights(w)
    cfg = MHCModelConfig(ref.spec, batch=2, max_seq_len=64)
    runner = MHCModelRunner(cfg, w)
    state = ref.new_state(2)
    g = torch.Generator().manual_seed(2)
    errs = []
    for step in range(12):                   # the window (8) slides, HCA (ratio 8) closes an entry
        ids = torch.randint(0, ref.spec.vocab_size, (2,), generator=g)
        want = ref.decode(ids[:, None], state)[:, 0]
        got = runner.decode(ids)
        errs.append(rel(got, want))
    print(f"v41={v41}: logits rel err per step:", " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 3e-2, errs


def test_program_shape_and_refusals():
    ref = small_model()
    cfg = MHCModelConfig(ref.spec, batch=2)
    prog = build_program(cfg)
    labels = [op.label for op in prog.ops]
    assert labels[:2] == ["embed", "hc_mix_first"] and labels[-2:] == ["head", "lm_head"]
    assert "l1.mlp.part_next" not in prog.buffers and "part_next" not in prog.buffers   # the last site
    assert prog.buffers["logits"].role == "output" and prog.buffers["l0.attn.window"].role == "input"
    v4 = build_megakernel("deepseek_v41_flash", "small_v41").spec
    import dataclasses
    with pytest.raises(UnsupportedConfigError, match="lagged"):     # V4.1's lag with GLM-5.3's head
        MHCModelConfig(dataclasses.replace(v4, residual=dataclasses.replace(v4.residual, lagged_pre=True,
                                                                              head="mean"))).layers()
    tiny = build_megakernel("deepseek_v41_flash", "tiny_v41").spec            # o_groups 2: one grouped o_a
    assert {a.o_groups for a, _ in MHCModelConfig(tiny).layers()} == {2}
    w = bf16_weights(ref.spec, seed=1)
    runner = MHCModelRunner(MHCModelConfig(ref.spec, batch=2, max_seq_len=2), w)
    with pytest.raises(ValueError, match="vocabulary"):
        runner.decode(torch.tensor([0, ref.spec.vocab_size]))
    runner.decode(torch.tensor([1, 2]))
    runner.decode(torch.tensor([1, 2]))
    with pytest.raises(CapacityError, match="max_seq_len"):
        runner.decode(torch.tensor([1, 2]))


def test_megakernel_backend_generates():
    """build_megakernel(..., backend="megakernel"): the whole-model program behind the reference
    backend's interface - generate's first token's logits equal the reference's; other models and
    ragged prompts are refused by name."""
    ref = small_model()
    w = bf16_weights(ref.spec, seed=3)
    ref.load_weights(w)
    from models.deepseek_v41_flash.config import SMALL, V41_SWITCH
    config = {**SMALL, V41_SWITCH: True, "num_hidden_layers": 2,
              "layer_types": ["sliding_attention", "heavily_compressed_attention"], "mlp_layer_types": ["hash_moe"] * 2}
    mk = build_megakernel("deepseek_v41_flash", config, backend="megakernel", max_seq_len=16, max_batch=2)
    mk.load_weights(w)
    prompt = torch.tensor([[5, 17, 3], [9, 1, 200]])
    out = mk.generate(prompt, 2)
    want = ref.generate(prompt, 2)
    assert out.shape == want.shape == (2, 5) and torch.equal(out[:, :3], prompt)
    assert rel(mk.last_logits[:, 0], ref.last_logits[:, 0]) < 3e-2
    # ragged prompts: the short one generates while the long one is still read (model_runner.generate)
    out, want = mk.generate(prompt, 2, prompt_lens=[3, 2]), ref.generate(prompt, 2, prompt_lens=[3, 2])
    assert out.shape == want.shape and torch.equal(out[0, :3], prompt[0]) and torch.equal(out[1, :2], prompt[1, :2])
    assert rel(mk.last_logits, ref.last_logits) < 3e-2
    with pytest.raises(UnsupportedConfigError, match="multiple of 1024"):      # not the blocks' shapes
        build_megakernel("glm_53", "tiny", backend="megakernel")
    from types import SimpleNamespace

    from sdk.builtin_plugin import _megakernel
    with pytest.raises(UnsupportedConfigError, match="deepseek_v41_flash, glm_53, kimi_k3.*not 'dummy'"):
        _megakernel(SimpleNamespace(name="dummy"), None, device="cpu", dtype=torch.float32, tp=1, ep=1, rank=0,
                    max_seq_len=16, max_batch=2)


def grouped_spec(heads: int, o_groups: int):
    """small_v41 with `heads` query heads in `o_groups` o_a groups (small_v41: 2 heads, 1 group)."""
    import dataclasses
    spec = build_megakernel("deepseek_v41_flash", "small_v41").spec
    return dataclasses.replace(spec, layers=tuple(
        dataclasses.replace(l, attention=dataclasses.replace(l.attention, num_heads=heads, o_groups=o_groups))
        for l in spec.layers))


def test_grouped_o_a_on_one_gpu(monkeypatch):
    """V4.1-Flash's o_a groups all on one GPU (as its 8 without tensor parallelism): 4 heads in 2
    groups, the o_a one grouped GEMV (GemvConfig.groups) - 6 steps against the model (near-ties of
    the router or the indexer: the model takes the program's pick, tests/program_choices.py). With
    each group's o_a rows swapped the logits move far."""
    from program_choices import ProgramChoices
    spec = grouped_spec(4, 2)
    ref, w = all_kinds_model(seed=7, spec=spec)
    cfg = MHCModelConfig(spec, batch=2, max_seq_len=32)
    assert {a.o_groups for a, _ in cfg.layers()} == {2}
    oa = [op.block for op in build_program(cfg).ops if op.label.endswith("v4.o_a")]
    assert oa and all(b.config.groups == 2 and b.config.n == 2 * 256 for b in oa)
    choices = ProgramChoices(ref, monkeypatch)

    def step_errors(weights, steps, after=lambda runner: None):
        runner, state = MHCModelRunner(cfg, weights), ref.new_state(2)
        g = torch.Generator().manual_seed(8)
        errs = []
        for _ in range(steps):
            ids = torch.randint(0, spec.vocab_size, (2,), generator=g)
            got = runner.decode(ids)
            after(runner)
            errs.append(rel(got, ref.decode(ids[:, None], state)[:, 0]))
        return errs
    errs = step_errors(w, 6, choices.take)
    print("small_v41, 4 heads in 2 o_a groups: logits rel err per step:", " ".join(f"{e:.1e}" for e in errs))
    print(choices.summary())
    assert max(errs) < 3e-2, errs
    monkeypatch.undo()
    # the same weights with each o_a group's rows swapped: the program must not agree
    swapped = {k: torch.cat(v.chunk(2)[::-1]) if k.endswith("o_a_proj.weight") else v for k, v in w.items()}
    far = step_errors(swapped, 2)
    assert min(far) > 10 * max(errs), far


def test_small_v41_all_layer_kinds(monkeypatch):
    """small_v41 whole (SWA, CSA, HCA, CSA; hash-routed then learned-routed MoE, its router in bf16
    as V4's: router_logits_bf16) against the model, at batch 8. The two sides' bf16 activations
    differ by ~1e-2, enough to move an expert whose choice is that close to the k-th across the
    top-k: the correction bias here is wide (std 10), so that most selections are the bias's, while
    the learned scores still weigh the experts (the selection rule itself, in bf16 too:
    tests/test_moe_blocks.py). Near-ties remain (two biases of one bf16 value): the model takes the
    program's pick there (tests/program_choices.py). These seeds hold one, found by the H100 run of
    2026-12-05 (row 7, step 3: 1.1e-1 of that row's logits before the model took the program's
    expert). The CSA indexer has at most 2 ready entries in these 6 steps (top-4): it selects all
    of them, as the model does."""
    from program_choices import ProgramChoices
    seed = 1185729754
    ref, w = all_kinds_model(seed % 1000, batch=8)
    spec = ref.spec
    assert {l.attention.compress_ratio for l in spec.layers} == {0, 4, 8} and any(not l.mlp.hash_routed for l in spec.layers)
    assert all(moe.router_logits_bf16 for _, moe in MHCModelConfig(spec).layers())
    choices = ProgramChoices(ref, monkeypatch)
    runner = MHCModelRunner(MHCModelConfig(spec, batch=8, max_seq_len=32), w)
    state = ref.new_state(8)
    g = torch.Generator().manual_seed(seed)
    errs = []
    for _ in range(6):                       # CSA (ratio 4) closes an entry, its indexer selects
        ids = torch.randint(0, spec.vocab_size, (8,), generator=g)
        got = runner.decode(ids)
        choices.take(runner)
        errs.append(rel(got, ref.decode(ids[:, None], state)[:, 0]))
    print("small_v41: logits rel err per step:", " ".join(f"{e:.1e}" for e in errs))
    print(choices.summary())
    assert [(what, row) for what, _, row, _ in choices.forced] == [("moe", 7)]
    assert max(errs) < 3e-2, errs
