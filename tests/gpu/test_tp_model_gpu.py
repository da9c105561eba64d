"""Kimi K3's whole decode step over 2 tensor-parallel ranks on one GPU (sdk/megakernel/tp_model.py:
one launch per rank and step, 66 SMs each, the ranks joined by the in-kernel all-reduce through
VirtualRanks) against the model itself (the reference backend in fp32 on the GPU, the unsharded
weights), 70 steps from empty caches (the MLA caches cross a page), the logits NaN-poisoned before
each launch; every step the two ranks' hidden states must be the same bits. The correction bias
(std 100) keeps the expert choice away from near-ties (tests/test_tp_model.py counts those on the
CPU). Run: `pytest -m gpu tests/gpu/test_tp_model_gpu.py`."""
import pytest
import torch

from harness import clock_seed, compare_model_steps, need_gpu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch", [1, 8])
def test_k3_tp2_model_one_launch_per_rank_a_step(batch):
    need_gpu()
    from test_plain_model import SPEC, reference, small_weights
    from sdk.megakernel.tp_model import TPModelConfig, TPModelRunner
    seed = clock_seed()
    w = {k: v.cuda() for k, v in small_weights(SPEC, seed % 1000, bias_std=100.0).items()}
    ref = reference(SPEC, w, torch.float32, max_batch=batch, device="cuda")
    runner = TPModelRunner(TPModelConfig(SPEC, batch=batch, max_seq_len=80, ranks=2, num_sms=66), w, device="cuda")

    def same_x():
        x = [t["x"] for t in runner.rank_tensors()]
        assert torch.equal(x[0], x[1]), f"seed {seed}: the ranks' hidden states differ"

    compare_model_steps(runner, ref, 70, seed, tol=5e-2, mean_tol=3e-2, after_decode=same_x)
