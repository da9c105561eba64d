"""The reference backend on the GPU: the same decode as on the CPU (fp32), and a bf16 run that stays
close to fp32. It needs no transformers newer than the device's: it compares against the SDK's own
reference on the CPU."""
import pytest
import torch

from sdk import build_megakernel
from sdk.reference.model import random_weights

pytestmark = pytest.mark.gpu
MODELS = ["kimi_k3", "deepseek_v41_flash", "glm_53"]


def run(model_id, device, dtype, seed):
    mk = build_megakernel(model_id, config="tiny", backend="reference", device=device, dtype=dtype, max_seq_len=64)
    mk.load_weights(random_weights(mk.spec, seed=seed, dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, mk.spec.vocab_size, (3, 9), generator=g)
    out = mk.generate(ids, 16, prompt_lens=[9, 5, 7])
    return out.cpu(), mk.last_logits.float().cpu()


@pytest.mark.parametrize("model_id", MODELS)
def test_reference_on_gpu_equals_cpu_fp32(model_id):
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_tokens, cpu_logits = run(model_id, "cpu", torch.float32, seed=5)
    gpu_tokens, gpu_logits = run(model_id, "cuda", torch.float32, seed=5)
    diff = (gpu_logits - cpu_logits).abs().max().item()
    assert diff <= 1e-4, f"{model_id}: GPU fp32 logits differ from CPU by {diff:.2e}"
    assert torch.equal(gpu_tokens, cpu_tokens)


@pytest.mark.parametrize("model_id", MODELS)
def test_reference_bf16_on_gpu_tracks_fp32(model_id):
    _, ref = run(model_id, "cuda", torch.float32, seed=6)
    _, got = run(model_id, "cuda", torch.bfloat16, seed=6)
    # compare the first step's logits only: later steps may pick different tokens in bf16
    rel = ((got[:, 0] - ref[:, 0]).norm() / ref[:, 0].norm()).item()
    assert rel <= 5e-2, f"{model_id}: bf16 first-step logits off fp32 by {rel:.2e} (relative)"
