"""A third-party model: a 2-layer GQA-free dense model built only from SDK pieces (MLA + dense MLP),
registered through the public entry-point group exactly like the in-tree models."""
from sdk import ModelEntry, ModelSpec, hookimpl
from sdk.spec import DenseMlpSpec, LayerSpec, MLASpec, cfg_get

TINY = {"hidden_size": 32, "vocab_size": 64, "num_layers": 2, "heads": 2, "intermediate_size": 48}


def spec_from_config(config):
    d = cfg_get(config, "hidden_size")
    attn = MLASpec(num_heads=cfg_get(config, "heads"), kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
                   softmax_scale=8 ** -0.5)
    mlp = DenseMlpSpec(intermediate_size=cfg_get(config, "intermediate_size"))
    layers = tuple(LayerSpec(i, attn, mlp) for i in range(cfg_get(config, "num_layers")))
    return ModelSpec(name="dummy", arch="dummy", hidden_size=d, vocab_size=cfg_get(config, "vocab_size"),
                     layers=layers)


def _no_hf(_):
    raise NotImplementedError("the dummy model has no transformers counterpart")


ENTRY = ModelEntry(name="dummy", hf_model_type="none", summary="test plugin model",
                   spec_from_config=spec_from_config, configs={"tiny": lambda: dict(TINY)},
                   hf_config=_no_hf, hf_causal_lm="", load_weights=_no_hf)


@hookimpl
def register_models(register):
    register(ENTRY)
