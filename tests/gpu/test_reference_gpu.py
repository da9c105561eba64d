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


@pytest.mark.parametrize("model_id,config", [("kimi_k3", "small"), ("deepseek_v41_flash", "small_v41"),
                                             ("glm_53", "small")])
def test_capturable_reference_replays_in_a_cuda_graph(model_id, config):
    """ReferenceModel.capturable (model_bench's PyTorch step): a decode step captured in a CUDA
    graph and replayed from the same caches gives the eager step's logits and caches - the graph
    holds the whole step (no host sync broke the capture, no op ran outside it). bf16, 20 steps
    in (GLM-5.3's indexers select from step 19, V4.1's compressors have closed windows)."""
    ref = build_megakernel(model_id, config, dtype=torch.bfloat16, device="cuda", max_seq_len=64, max_batch=2)
    ref.load_weights({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                      for k, v in random_weights(ref.spec, seed=7).items()})
    state = ref.new_state(2)
    g = torch.Generator().manual_seed(7)
    for _ in range(20):
        ref.decode(torch.randint(0, ref.spec.vocab_size, (2, 1), generator=g).cuda(), state)
    ref.capturable = True
    ids = torch.randint(0, ref.spec.vocab_size, (2, 1), generator=g).cuda()
    saved = [{k: v.clone() for k, v in c.items()} for c in state.caches], state.lengths.clone()

    def restore():
        for c, s in zip(state.caches, saved[0]):
            for k, v in c.items():
                v.copy_(s[k])
        state.lengths.copy_(saved[1])

    def step():
        state.lengths.copy_(saved[1])
        return ref.decode(ids, state)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                  # warm-up outside the capture (library handles)
        step()
    torch.cuda.current_stream().wait_stream(side)
    restore()
    eager = step().float().clone()
    eager_caches = [{k: v.clone() for k, v in c.items()} for c in state.caches]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    restore()
    graph.replay()
    torch.cuda.synchronize()
    got = out.float()
    rel = ((got - eager).norm() / eager.norm()).item()
    assert torch.isfinite(got).all() and rel < 1e-2, f"{model_id}: replayed logits off the eager step by {rel:.2e}"
    for layer, (c, e) in enumerate(zip(state.caches, eager_caches)):
        for k, v in c.items():
            diff = (v.float() - e[k].float()).abs().max().item()
            assert diff <= 1e-2 * max(1.0, e[k].float().abs().max().item()), f"{model_id} layer {layer} cache {k}: {diff:.2e}"
    assert torch.equal(state.lengths, saved[1] + 1)
