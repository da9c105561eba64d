"""A whole DeepSeek-V4.1 decode step in ONE megakernel launch on the GPU (sdk/megakernel/mhc_model.py:
the embedding, every layer's attention and MoE in V4.1's lagged mHC sites, the head and the logits)
against the model itself (the reference backend, V4.1's math, on the GPU in bf16 on the same
weights), step after step from empty caches; the logits NaN-poisoned before each launch.
Run: `pytest -m gpu tests/gpu/test_dsv4_model_gpu.py`."""
import pytest
import torch

from harness import clock_seed, compare_model_steps, need_gpu, ranks_agree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 8])
def test_v41_model_one_launch_a_step(batch):
    need_gpu()
    from test_dsv4_model import bf16_weights, small_model
    from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner
    seed = clock_seed()
    ref = small_model()
    w = bf16_weights(ref.spec, seed=seed % 1000)
    ref = ref.__class__(ref.entry, ref.spec, device="cuda", dtype=torch.bfloat16, max_seq_len=64, max_batch=8)
    ref.load_weights({k: v.cuda() for k, v in w.items()})
    runner = MHCModelRunner(MHCModelConfig(ref.spec, batch=batch, max_seq_len=64),
                            {k: v.cuda() for k, v in w.items()}, device="cuda")
    compare_model_steps(runner, ref, 12, seed, tol=3e-2)


@pytest.mark.parametrize("batch,ranks", [(1, 1), (8, 1), (1, 2), (8, 2)])
def test_small_v41_all_layer_kinds_one_launch_a_step(batch, ranks, monkeypatch):
    """small_v41 whole - SWA, CSA, HCA, CSA, hash-routed then learned-routed MoE with V4's bf16
    router - against the model (tests/test_dsv4_model.py: test_small_v41_all_layer_kinds); ranks 2:
    the tensor-parallel program as 2 virtual ranks on this GPU (66 SMs each, sdk/megakernel/
    tp_model.py), the ranks' streams the same bits every step. A learned router's near-tie may pick
    differently on the two sides (tests/program_choices.py)."""
    need_gpu()
    from program_choices import ProgramChoices
    from test_dsv4_model import all_kinds_model
    from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner
    from sdk.megakernel.tp_model import TPMHCModelConfig, TPMHCModelRunner
    seed = clock_seed()
    ref, w = all_kinds_model(seed % 1000, device="cuda", batch=batch)
    if ranks == 1:
        runner = MHCModelRunner(MHCModelConfig(ref.spec, batch=batch, max_seq_len=32), w, device="cuda")
    else:
        runner = TPMHCModelRunner(TPMHCModelConfig(ref.spec, batch=batch, max_seq_len=32, ranks=ranks,
                                                   num_sms=132 // ranks), w, device="cuda")
    choices = ProgramChoices(ref, monkeypatch)          # near-tie experts: the model takes the device's
    compare_model_steps(runner, ref, 6, seed, tol=3e-2,
                        after_decode=ranks_agree(runner, "streams", seed, then=lambda: choices.take(runner)))
    print(choices.summary())


@pytest.mark.parametrize("heads,o_groups,ranks", [(4, 2, 1), (4, 4, 2)])
def test_grouped_o_a_one_launch_a_step(heads, o_groups, ranks, monkeypatch):
    """small_v41 with 4 heads in several o_a groups: all of them on one GPU (the o_a one grouped
    GEMV - V4.1-Flash's 8 groups without tensor parallelism), and 4 groups over 2 virtual ranks
    (two whole groups a rank - its 8 groups over 2 or 4 GPUs); 6 steps against the model."""
    need_gpu()
    from program_choices import ProgramChoices
    from test_dsv4_model import all_kinds_model, grouped_spec
    from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner
    from sdk.megakernel.tp_model import TPMHCModelConfig, TPMHCModelRunner
    seed = clock_seed()
    ref, w = all_kinds_model(seed % 1000, device="cuda", batch=2, spec=grouped_spec(heads, o_groups))
    if ranks == 1:
        runner = MHCModelRunner(MHCModelConfig(ref.spec, batch=2, max_seq_len=32), w, device="cuda")
    else:
        runner = TPMHCModelRunner(TPMHCModelConfig(ref.spec, batch=2, max_seq_len=32, ranks=ranks,
                                                   num_sms=132 // ranks), w, device="cuda")
    choices = ProgramChoices(ref, monkeypatch)
    compare_model_steps(runner, ref, 6, seed, tol=3e-2,
                        after_decode=ranks_agree(runner, "streams", seed, then=lambda: choices.take(runner)))
    print(choices.summary())
