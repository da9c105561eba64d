"""What plugins register: model entries (and, through `sdk.blocks`, block classes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Sharding:
    """A per-GPU sharding preset: tensor parallel degree for attention and shared experts,
    expert parallel degree for routed experts."""
    tp: int = 1
    ep: int = 1
    note: str = ""


@dataclass(frozen=True)
class ModelEntry:
    """One model a plugin provides.

    name            SDK model id (`build_megakernel(name, ...)`).
    hf_model_type   the transformers `model_type` whose architecture the reference follows.
    summary         one line for `megakernel models`.
    spec_from_config(config) -> ModelSpec; config is a transformers config object or a dict.
    configs         named config dicts (at least "tiny" and "full"), each a zero-arg callable.
    hf_config(dict) -> the transformers config object (imports transformers lazily).
    hf_causal_lm    dotted path of the transformers class used as the oracle in tests.
    load_weights(spec, state_dict, dtype, device) -> the reference's weights dict; raises
                    `WeightsMismatchError` listing missing, unexpected and mis-shaped keys.
    shardings       named per-GPU sharding presets for `megakernel plan`.
    doc             the model's page under docs/models/.
    native_quant    the weight formats the released checkpoint ships in (a QuantSpec), if known.
    """
    name: str
    hf_model_type: str
    summary: str
    spec_from_config: Callable[[Any], Any]
    configs: Mapping[str, Callable[[], dict]]
    hf_config: Callable[[dict], Any]
    hf_causal_lm: str
    load_weights: Callable[..., dict]
    shardings: Mapping[str, Sharding] = field(default_factory=dict)
    doc: str = ""
    native_quant: Any = None       # sdk.spec.QuantSpec of the released checkpoint (for `megakernel plan`)
    plugin: str = ""               # filled in by the plugin manager: which plugin registered it

    def config(self, name: str = "tiny") -> dict:
        if name not in self.configs:
            from .errors import UnknownModelError
            raise UnknownModelError(
                f"model {self.name!r} has no config {name!r}; it has: {', '.join(sorted(self.configs))}")
        return self.configs[name]()

    def spec(self, config: Any = "tiny"):
        """The ModelSpec of a named config, a dict or a transformers config object."""
        if isinstance(config, str):
            config = self.config(config)
        return self.spec_from_config(config)
