"""A whole Kimi K3 decode step in ONE megakernel launch on the GPU (sdk/megakernel/plain_model.py: the
embedding, KDA and NoPE MLA attention, the dense MLP and the latent MoE with SiTU, each adding onto
the bf16 hidden state in place, the final norm and the logits) against the model itself (the
reference backend in fp32 on the GPU, same weights), step after step from empty caches - 70 steps,
so the MLA caches cross a page; the logits NaN-poisoned before each launch. The correction bias
(std 100) is far wider than the scores, so the selection is mostly the bias's. Where two biases
lie within the scores' range the ~2e-2 difference of the two sides may still flip a pick: the
model then takes the device's, if it is a near-tie (tests/program_choices.py).
ranks 2: the tensor-parallel program (sdk/megakernel/tp_model.py) as 2 virtual ranks on this GPU,
66 SMs and one launch each a step, joined by the in-kernel all-reduce and all-gathers; every step
the ranks' hidden states must be the same bits.
Run: `pytest -m gpu tests/gpu/test_plain_model_gpu.py`."""
import pytest
import torch

from harness import clock_seed, compare_model_steps, need_gpu, ranks_agree, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch,ranks", [(1, 1), (8, 1), (1, 2), (8, 2)])
def test_k3_model_one_launch_a_step(batch, ranks, monkeypatch):
    need_gpu()
    from program_choices import ProgramChoices
    from test_plain_model import SPEC, reference, small_weights
    from sdk.megakernel.plain_model import PlainModelConfig, PlainModelRunner
    from sdk.megakernel.tp_model import TPModelConfig, TPModelRunner
    seed = clock_seed()
    w = {k: v.cuda() for k, v in small_weights(SPEC, seed % 1000, bias_std=100.0).items()}
    ref = reference(SPEC, w, torch.float32, max_batch=batch, device="cuda")
    if ranks == 1:
        runner = PlainModelRunner(PlainModelConfig(SPEC, batch=batch, max_seq_len=80), w, device="cuda")
    else:
        runner = TPModelRunner(TPModelConfig(SPEC, batch=batch, max_seq_len=80, ranks=ranks, num_sms=132 // ranks),
                               w, device="cuda")
    choices = ProgramChoices(ref, monkeypatch)
    # the bf16 model itself is ~3e-2 from the fp32 one
    compare_model_steps(runner, ref, 70, seed, tol=5e-2, mean_tol=3e-2,
                        after_decode=ranks_agree(runner, "x", seed, then=lambda: choices.take(runner)))
    print(choices.summary())


@pytest.mark.parametrize("ranks", [1, 2])
def test_k3_model_through_a_records_window(ranks, monkeypatch):
    """The whole small K3 step with its instruction records streamed through a window of smem
    slots (program.records_geometry: what the full models' hundreds of instructions a SM take;
    forced here by 1 KB budgets: 4 slots, 27 instructions on the busiest SM): 12 steps, the
    logits the same bits as the same program with every record resident, on one GPU and over 2
    virtual ranks."""
    need_gpu()
    from test_plain_model import SPEC, small_weights
    import sdk.megakernel.program as program
    from sdk.megakernel.plain_model import PlainModelConfig, PlainModelRunner
    from sdk.megakernel.tp_model import TPModelConfig, TPModelRunner
    seed = clock_seed()
    w = {k: v.cuda() for k, v in small_weights(SPEC, seed % 1000, bias_std=100.0).items()}

    def runner():
        if ranks == 1:
            return PlainModelRunner(PlainModelConfig(SPEC, batch=2, max_seq_len=16), w, device="cuda")
        return TPModelRunner(TPModelConfig(SPEC, batch=2, max_seq_len=16, ranks=ranks, num_sms=132 // ranks),
                             w, device="cuda")
    resident = runner()
    monkeypatch.setattr(program, "RECORDS_MAX_BYTES", 1024)
    monkeypatch.setattr(program, "RECORDS_WINDOW_BYTES", 1024)      # a window of 4 records
    windowed = runner()
    g = torch.Generator().manual_seed(seed)
    for step in range(12):
        ids = torch.randint(0, SPEC.vocab_size, (2,), generator=g)
        a, b = resident.decode(ids), windowed.decode(ids)
        assert torch.equal(a, b), f"seed {seed}, step {step}: the windowed records' logits differ"


def gpu_weights(spec, seed):
    """Random weights drawn on the GPU, matrices at std fan_in^-1/2 as test_plain_model's
    small_weights, a wide correction bias (std 100), fp32 where the model keeps fp32."""
    from test_plain_model import FP32
    from sdk.reference.model import random_weights
    w = random_weights(spec, seed=seed % 1000, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed % 1000 + 1)
    for k, v in w.items():
        if k.endswith("e_score_correction_bias"):
            w[k] = 100.0 * torch.randn(v.shape, generator=g, device="cuda")
        elif v.dim() >= 2 and v.is_floating_point():
            w[k] = (v.float() * (v.shape[-1] ** -0.5 / 0.02)).to(torch.bfloat16)
        if FP32.search(k):
            w[k] = w[k].float()
    return w


def test_k3_deep_model_one_launch_a_step(monkeypatch):
    """Kimi K3 at small's widths and the full model's depth (config "deep": 61 layers, 898 ops,
    ~370 instructions on the busiest SM - its records stream through a window of smem slots),
    batch 1, one launch a step: 6 steps against the fp32 model, each step as close to it as the
    bf16 model itself is (both ~0.1 at this depth on the CPU: 0.083-0.104 vs 0.110-0.117, PyVM,
    2026-12-05). A learned router's near-tie (60 MoE layers) takes the device's pick."""
    need_gpu()
    from program_choices import ProgramChoices
    from test_plain_model import reference
    from sdk import plugins
    from sdk.megakernel.plain_model import PlainModelConfig, PlainModelRunner
    seed = clock_seed()
    spec = plugins.get_model("kimi_k3").spec("deep")
    w = gpu_weights(spec, seed)
    runner = PlainModelRunner(PlainModelConfig(spec, batch=1, max_seq_len=16), w, device="cuda")
    assert runner.rt.max_len > runner.rt.records_window > 0, "the deep program's records must stream"
    ref32 = reference(spec, w, torch.float32, max_seq_len=16, max_batch=1, device="cuda")
    ref16 = reference(spec, w, torch.bfloat16, max_seq_len=16, max_batch=1, device="cuda")
    s32, s16 = ref32.new_state(1), ref16.new_state(1)
    choices = ProgramChoices(ref32, monkeypatch)
    g = torch.Generator().manual_seed(seed)
    for step in range(6):
        ids = torch.randint(0, spec.vocab_size, (1,), generator=g)
        got = runner.decode(ids)
        choices.take(runner)
        want = ref32.decode(ids[:, None].cuda(), s32)[:, 0]
        err, err16 = rel_err(got, want), rel_err(ref16.decode(ids[:, None].cuda(), s16)[:, 0], want)
        print(f"step {step}: program {err:.3e}, the bf16 model {err16:.3e}")
        assert err <= 1.25 * err16 + 1e-2, f"seed {seed}, step {step}: {err:.3e} vs the bf16 model's {err16:.3e}"
    print(choices.summary())


def test_k3_wide_model_one_launch_a_step(monkeypatch):
    """Kimi K3 at one TP8 / EP16 rank's real widths (config "wide": hidden 7168, 12 MLA and 12 KDA
    heads, the 2304-wide dense MLP, 64 experts of the real 3584 x 3072 shape, the 163840 vocab), 4
    layers, batch 1, one launch a step: 8 steps against the reference backend in bf16 on the GPU
    (an fp32 one would not fit beside the program on an 80 GB card: ~19 GB of bf16 weights, shared).
    Weights drawn on the GPU, matrices at std fan_in^-1/2 as small_weights, a wide correction bias.
    Both sides round to bf16 on their own, so the bounds are sqrt(2) x the fp32 reference's (5e-2
    per step, 3e-2 mean): the H100 measured means of 3.2e-2 / 3.6e-2 (2026-12-07 / the
    twenty-third session), each step ~2.5e-2 from the exact model on the small widths."""
    need_gpu()
    from program_choices import ProgramChoices
    from test_plain_model import reference
    from sdk import plugins
    from sdk.megakernel.plain_model import PlainModelConfig, PlainModelRunner
    seed = clock_seed()
    spec = plugins.get_model("kimi_k3").spec("wide")
    w = gpu_weights(spec, seed)
    ref = reference(spec, w, torch.bfloat16, max_batch=1, device="cuda")
    runner = PlainModelRunner(PlainModelConfig(spec, batch=1, max_seq_len=80), w, device="cuda")
    choices = ProgramChoices(ref, monkeypatch)
    errs = compare_model_steps(runner, ref, 8, seed, tol=5e-2 * 2 ** 0.5, mean_tol=3e-2 * 2 ** 0.5,
                               after_decode=lambda: choices.take(runner))
    print(f"wide K3: logits rel err {min(errs):.2e}..{max(errs):.2e}; {choices.summary()}")
