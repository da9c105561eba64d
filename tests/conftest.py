import importlib

import pytest
import torch

IN_TREE_MODELS = ["kimi_k3", "deepseek_v41_flash", "glm_53"]
HF_VERSION = "5.24.0"


def transformers_or_skip():
    """The oracle needs transformers >= 5.24 (the architectures the models follow); the GPU machine
    has 5.17, where these tests skip with this reason and the rest of the suite still runs."""
    try:
        import transformers
    except ImportError:
        pytest.skip("transformers is not installed")
    from packaging.version import Version
    if Version(transformers.__version__) < Version(HF_VERSION):
        pytest.skip(f"needs transformers>={HF_VERSION} for the oracle; found {transformers.__version__}")
    return transformers


def import_dotted(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(False)
    yield


@pytest.fixture
def margins(monkeypatch):
    """The fp32 reference's top-k margins while `margins.on`: per MoE layer call, the smallest
    (k-th choice - (k+1)-th) over its tokens. Learned routing: a 1e-2 difference of the
    activations may swap experts whose choice values are that close, and then the step's logits
    differ by ~0.4 - a near-tie, not a bug."""
    import sdk.reference.moe as moe_ref
    route = moe_ref.route

    def recording(spec, logits, bias, hash_experts=None):
        if recording.on:
            choice = logits.float().sigmoid() + (0 if bias is None else bias.float())
            top = choice.topk(spec.top_k + 1, dim=-1)[0]
            recording.values.append((top[:, -2] - top[:, -1]).min().item())
        return route(spec, logits, bias, hash_experts)

    recording.on, recording.values = False, []
    monkeypatch.setattr(moe_ref, "route", recording)
    return recording
