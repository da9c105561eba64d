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
