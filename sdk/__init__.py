"""megakernel-sdk: decode megakernels for Mixture-of-Experts LLMs in NVIDIA CuTe DSL.

    from sdk import build_megakernel
    mk = build_megakernel("kimi_k3", config="tiny", backend="reference")

Importing `sdk` loads no plugin, imports neither CuTe DSL nor transformers, and never touches CUDA.
"""
from .api import build_megakernel
from .errors import (CapacityError, KernelTimeoutError, PluginError, SdkError, UnknownModelError,
                     UnsupportedConfigError, WeightsMismatchError)
from .hookspecs import hookimpl
from .registry import ModelEntry, Sharding
from .spec import ModelSpec

__version__ = "0.1.0"
__all__ = ["build_megakernel", "hookimpl", "ModelEntry", "ModelSpec", "Sharding", "SdkError",
           "UnknownModelError", "UnsupportedConfigError", "WeightsMismatchError", "CapacityError",
           "KernelTimeoutError", "PluginError"]
