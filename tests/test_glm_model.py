"""A whole GLM-5.3 decode step in one program (sdk/megakernel/mhc_model.py), run by the PyVM (the blocks'
torch twins in a random valid order), against the model itself: the reference backend (sdk/reference:
KDA with the low-rank gates, the DSA MLA with its k-pool indexer and a "shared" indexer layer, dense
MLPs, the MoE, the mHC residual with the mean head) on the same weights, step after step from empty
caches.

The program keeps the model's bf16 activations; the reference runs in fp32 on the same
(bf16-valued) weights, and the program's distance to it is compared with the bf16 reference's own.
Selections: the MoE's correction bias (std 100) is far wider than its scores, so its top-k is the
bias's and never a near-tie. The DSA indexer's top-k is the scores' (pools whose scores differ by
the two sides' ~1e-2 noise are common on random weights): where the program's pick differs from
the model's, every swapped pool (or expert: two bf16 biases may round to one value) must be a
near-tie of the model's own scores, and the model then takes the program's pick - one it could
have made - so that later steps stay comparable (tests/program_choices.py). Any other difference
fails."""
import dataclasses

import pytest
import torch

from sdk import build_megakernel
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner, build_program, program_weights
from sdk.reference.model import random_weights

from program_choices import ProgramChoices

SPEC = build_megakernel("glm_53", "small").spec


def rel(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), "non-finite values (a poisoned value survived)"
    return ((a - b).norm() / b.norm()).item()


def glm_weights(seed, bias_std=100.0):
    """Random weights with bf16 values (fp32 where the model keeps fp32), every matrix at std
    fan_in^-1/2 (random_weights' 0.02 leaves KDA's short conv in its output norm's eps regime),
    the mHC scales near 1 and biases O(0.5) (tests/test_dsv4_model.py), a wide correction bias."""
    from models.glm_53.weights import keep_fp32
    w = random_weights(SPEC, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for k in w:
        if k.endswith("e_score_correction_bias"):
            w[k] = bias_std * torch.randn(w[k].shape, generator=g)
        elif k.endswith(".scale") and ".hc_" in k:
            w[k] = 1 + 0.3 * torch.randn(w[k].shape, generator=g)
        elif k.endswith(".base") and ".hc_" in k:
            w[k] = 0.5 * torch.randn(w[k].shape, generator=g)
        elif w[k].dim() >= 2 and w[k].is_floating_point():
            w[k] *= w[k].shape[-1] ** -0.5 / 0.02
    return {k: (v.to(torch.bfloat16).to(torch.float32 if keep_fp32(k) else torch.bfloat16)
                if v.is_floating_point() else v) for k, v in w.items()}


def reference(w, dtype, max_seq_len=64, max_batch=2, device="cpu"):
    ref = build_megakernel("glm_53", "small", dtype=dtype, max_seq_len=max_seq_len, max_batch=max_batch,
                           device=device)
    return ref.load_weights({k: v.to(dtype) if v.is_floating_point() and v.dtype != torch.float32 else v
                             for k, v in w.items()})


def test_program_equals_the_model_step_after_step(monkeypatch):
    """36 steps of small (KDA + dense, DSA + dense, shared DSA + MoE, KDA + MoE, DSA + MoE) at batch
    2: the indexers select 4 pools (+ the tail) of up to 9 from step 19 on, the shared layer
    attends over its predecessor's list."""
    w = glm_weights(seed=1)
    steps_against_the_model(MHCModelRunner(MHCModelConfig(SPEC, batch=2, max_seq_len=64), w), w, monkeypatch,
                            "program")


def steps_against_the_model(runner, w, monkeypatch, label, steps=36, after_step=None):
    """`steps` steps of runner (batch 2) against the fp32 model on the weights w (the model taking
    the program's picks where they differ by near-ties: ProgramChoices), beside the bf16
    model's own distance; after_step(step): more checks per step."""
    ref32, ref16 = reference(w, torch.float32), reference(w, torch.bfloat16)
    choices = ProgramChoices(ref32, monkeypatch)
    s32, s16 = ref32.new_state(2), ref16.new_state(2)
    g = torch.Generator().manual_seed(2)
    errs, errs16 = [], []
    for step in range(steps):
        ids = torch.randint(0, SPEC.vocab_size, (2,), generator=g)
        got = runner.decode(ids)
        if after_step is not None:
            after_step(step)
        choices.take(runner)
        want = ref32.decode(ids[:, None], s32)[:, 0]
        errs.append(rel(got, want))
        if step < 8:
            errs16.append(rel(ref16.decode(ids[:, None], s16)[:, 0], want))
    print(f"{label} vs fp32 model, per step:", " ".join(f"{e:.1e}" for e in errs))
    print("bf16 model vs fp32 model, first steps:", " ".join(f"{e:.1e}" for e in errs16))
    print(choices.summary())
    assert max(errs) < 5e-2 and sum(errs) / len(errs) < 3e-2, errs
    assert sum(errs[:8]) < sum(errs16), (errs[:8], errs16)
    assert len(choices.forced) < 12          # most selections agree outright


def test_a_wrong_link_is_seen(monkeypatch):
    """The comparison's power: the shared DSA layer reading its own (empty) list instead of the
    previous layer's, or one site's mHC mix from another layer, moves the logits far off."""
    w = glm_weights(seed=3)
    cfg = MHCModelConfig(SPEC, batch=2, max_seq_len=64)
    ids = [torch.tensor([7, 300]), torch.tensor([5, 9])]

    def logits(weights, cfg_links=None):
        if cfg_links is not None:
            monkeypatch.setattr(MHCModelConfig, "index_links", lambda self: cfg_links)
        runner = MHCModelRunner(cfg, weights)
        out = [runner.decode(i) for i in ids][-1]
        monkeypatch.undo()
        return out

    ref = reference(w, torch.float32)
    st = ref.new_state(2)
    want = [ref.decode(i[:, None], st)[:, 0] for i in ids][-1]
    ok = rel(logits(w), want)
    unlinked = rel(logits(w, cfg_links={}), want)
    swapped = rel(logits(dict(w, **{"layers.2.hc_mlp.fn": w["layers.3.hc_mlp.fn"]})), want)
    print(f"right {ok:.1e}, shared layer unlinked {unlinked:.1e}, another site's mix {swapped:.1e}")
    assert ok < 5e-2 and min(unlinked, swapped) > 4 * ok


def test_program_shape_and_refusals():
    cfg = MHCModelConfig(SPEC, batch=2, max_seq_len=64)
    prog = build_program(cfg)
    labels = [op.label for op in prog.ops]
    assert labels[:2] == ["embed", "hc_mix_first"] and labels[-2:] == ["head", "lm_head"]
    # the shared layer has no indexer; its list is layer 1's
    assert not any(lb.startswith("l2.attn.index.") for lb in labels) and "l2.attn.index" not in prog.buffers
    assert any(lb.startswith("l1.attn.index.") for lb in labels) and prog.buffers["l1.attn.index"].role == "scratch"
    assert prog.buffers["l0.attn.conv_w"].dtype == "fp32"          # GLM-5.3 keeps the conv weight fp32
    assert {n for n, b in prog.buffers.items() if b.role == "weight"} == set(program_weights(cfg, glm_weights(0)))
    import models.glm_53.config as glm
    with pytest.raises(UnsupportedConfigError, match="bias"):
        dsa = SPEC.layers[1].attention
        MHCModelConfig(dataclasses.replace(SPEC, layers=tuple(
            dataclasses.replace(l, attention=dataclasses.replace(dsa, attention_bias=True)) if l.index == 1 else l
            for l in SPEC.layers))).layers()
    with pytest.raises(UnsupportedConfigError, match="plain"):
        from sdk.megakernel.plain_model import PlainModelConfig
        PlainModelConfig(SPEC).layers()
    assert glm.small()["text_config"]["hidden_size"] == 1024


def test_megakernel_backend_generates():
    """build_megakernel("glm_53", "small", backend="megakernel"): greedy generation through the
    program; its first new token's logits equal the (fp32) reference backend's."""
    w = glm_weights(seed=4)
    ref = reference(w, torch.float32, max_seq_len=16)
    mk = build_megakernel("glm_53", "small", backend="megakernel", max_seq_len=16, max_batch=2)
    mk.load_weights(w)
    prompt = torch.tensor([[5, 17, 3], [9, 1, 200]])
    out, want = mk.generate(prompt, 2), ref.generate(prompt, 2)
    assert out.shape == want.shape == (2, 5) and torch.equal(out[:, :3], prompt)
    assert rel(mk.last_logits[:, 0], ref.last_logits[:, 0]) < 5e-2
