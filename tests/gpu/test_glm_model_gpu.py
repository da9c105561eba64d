"""A whole GLM-5.3 decode step in ONE megakernel launch on the GPU (sdk/megakernel/mhc_model.py: the
embedding onto the mHC streams, KDA, the DSA MLA with its k-pool indexer and a shared-indexer
layer, dense MLPs and the MoE, each in its mHC site, the mean head and the logits) against the model
itself (the reference backend in fp32 on the GPU, same weights), 36 steps from empty caches (the
indexers select from step 19 on); the logits NaN-poisoned before each launch. Where the device's
indexer list or MoE experts differ from the model's, every swapped pool or expert must be a
near-tie of the model's own scores and the model then takes the device's pick
(tests/program_choices.py).
Run: `pytest -m gpu tests/gpu/test_glm_model_gpu.py`."""
import pytest
import torch

from harness import clock_seed, compare_model_steps, need_gpu, ranks_agree

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch,ranks", [(1, 1), (8, 1), (1, 2), (8, 2)])
def test_glm_model_one_launch_a_step(batch, ranks, monkeypatch):
    """ranks 2: the tensor-parallel program (sdk/megakernel/tp_model.py) as 2 virtual ranks on this
    GPU, 66 SMs and one launch each a step, each site's post-mix the all-reduce's epilogue; the
    ranks' streams must stay the same bits."""
    need_gpu()
    from program_choices import ProgramChoices
    from test_glm_model import SPEC, glm_weights, reference
    from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner
    from sdk.megakernel.tp_model import TPMHCModelConfig, TPMHCModelRunner
    seed = clock_seed()
    w = {k: v.cuda() for k, v in glm_weights(seed % 1000).items()}
    ref = reference(w, torch.float32, max_batch=batch, device="cuda")
    choices = ProgramChoices(ref, monkeypatch)
    if ranks == 1:
        runner = MHCModelRunner(MHCModelConfig(SPEC, batch=batch, max_seq_len=64), w, device="cuda")
    else:
        runner = TPMHCModelRunner(TPMHCModelConfig(SPEC, batch=batch, max_seq_len=64, ranks=ranks,
                                                   num_sms=132 // ranks), w, device="cuda")

    compare_model_steps(runner, ref, 36, seed, tol=5e-2, mean_tol=3e-2,
                        after_decode=ranks_agree(runner, "streams", seed, then=lambda: choices.take(runner)))
    print(choices.summary())
