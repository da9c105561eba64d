"""Bad input gets a clear error naming what is wrong, before any work."""
import pytest
import torch

from sdk import CapacityError, UnsupportedConfigError, WeightsMismatchError, build_megakernel, plugins
from sdk.reference.model import random_weights
from sdk.reference.weights import expected_weights

MODELS = ["kimi_k3", "deepseek_v41_flash", "glm_53"]


def hf_like_state_dict(entry, spec):
    """A state dict under the model's transformers key names, built from random canonical weights."""
    import importlib
    mod = importlib.import_module(f"models.{entry.name}.weights")
    return {mod.to_hf(k): v for k, v in random_weights(spec, seed=0).items()}


@pytest.mark.parametrize("model_id", MODELS)
def test_mismatched_state_dict_lists_every_problem(model_id):
    entry = plugins.get_model(model_id)
    mk = build_megakernel(model_id, config="tiny")
    sd = hf_like_state_dict(entry, mk.spec)
    mk.load_hf_state_dict(dict(sd))  # the complete one loads
    keys = sorted(sd)
    missing, misshaped = keys[0], keys[len(keys) // 2]
    bad = dict(sd)
    del bad[missing]
    bad[misshaped] = torch.zeros(3, 5)
    bad["model.not_a_weight"] = torch.zeros(1)
    with pytest.raises(WeightsMismatchError) as exc:
        mk.load_hf_state_dict(bad)
    msg = str(exc.value)
    assert missing in msg and misshaped in msg and "model.not_a_weight" in msg
    assert "(3, 5)" in msg
    assert exc.value.missing == [missing] and exc.value.unexpected == ["model.not_a_weight"]


@pytest.mark.parametrize("model_id", MODELS)
def test_over_max_seq_len_fails_before_work(model_id):
    mk = build_megakernel(model_id, config="tiny", max_seq_len=16)
    mk.load_weights(random_weights(mk.spec))
    with pytest.raises(CapacityError, match="max_seq_len 16"):
        mk.generate(torch.ones(1, 10, dtype=torch.long), 7)
    with pytest.raises(CapacityError, match="max_batch"):
        build_megakernel(model_id, config="tiny", max_batch=2).load_weights(random_weights(mk.spec)).new_state(3)


def test_decode_without_weights_is_a_clear_error():
    mk = build_megakernel("kimi_k3", config="tiny")
    with pytest.raises(Exception, match="no weights loaded"):
        mk.generate(torch.ones(1, 2, dtype=torch.long), 1)


def test_unknown_backend_and_config_name():
    with pytest.raises(UnsupportedConfigError, match="unknown backend 'warp'"):
        build_megakernel("kimi_k3", config="tiny", backend="warp")
    with pytest.raises(KeyError, match="no config 'huge'"):
        build_megakernel("kimi_k3", config="huge")


def test_expected_weights_cover_every_layer():
    for model_id in MODELS:
        spec = plugins.get_model(model_id).spec("tiny")
        names = expected_weights(spec)
        for layer in spec.layers:
            assert any(n.startswith(f"layers.{layer.index}.attn.") for n in names)
            assert any(n.startswith(f"layers.{layer.index}.mlp.") for n in names)


def test_operand_past_32bit_offsets_is_a_clear_error():
    """An operand larger than 32-bit element offsets can address is refused when the block is
    built (naming the operand), not left to an illegal address in the kernel; the experts'
    weights (addressed per expert) and the MLA page pool (per row), from a 64-bit base, may be
    larger."""
    from sdk.blocks.experts import ExpertsBlock, ExpertsConfig
    from sdk.blocks.indexer import IndexScoreBlock, IndexScoreConfig
    from sdk.blocks.mla_decode import MLADecodeBlock, MLADecodeConfig
    from sdk.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError, match=r"operand keys \[256, 131072, 128\] has 4294967296 elements"):
        IndexScoreBlock(IndexScoreConfig(heads=32, batch=256, max_entries=131072))
    pool = MLADecodeBlock(MLADecodeConfig(heads=16, softmax_scale=0.1, batch=64, num_pages=200000, max_seq_len=131072))
    assert dict((s.name, s.shape) for s in pool.operand_specs())["kv"] == (200000, 64, 576)
    big = ExpertsBlock(ExpertsConfig(stage="gateup", hidden=7168, intermediate=3072, num_local=56, top_k=16))
    shape = dict((s.name, s.shape) for s in big.operand_specs())["w"]
    assert shape[0] * shape[1] * shape[2] > 2 ** 31


def test_tensor_core_paths_reject_what_they_do_not_take():
    """GemvBlock's and ExpertsBlock's MMA switches: a clear error naming the unsupported part."""
    from sdk.blocks.experts import ExpertsBlock, ExpertsConfig
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    with pytest.raises(UnsupportedConfigError, match="MMA path takes bf16 or fp8"):
        GemvBlock(GemvConfig(n=896, k=7168, m=8, weight_dtype="fp32", mma=True))
    assert not GemvBlock(GemvConfig(n=896, k=7168, m=8, weight_dtype="fp32")).use_mma   # routers stay
    assert GemvBlock(GemvConfig(n=4096, k=7168, m=8, rows_per_tile=16)).use_mma
    assert not GemvBlock(GemvConfig(n=4096, k=7168, m=4, rows_per_tile=16)).use_mma
    with pytest.raises(UnsupportedConfigError, match="tensor-core tile takes mxfp4"):
        ExpertsBlock(ExpertsConfig(stage="gateup", hidden=1024, intermediate=512, num_local=4, top_k=2,
                                   weight_dtype="bf16", rows_per_tile=16, mma=True))
    with pytest.raises(UnsupportedConfigError, match="cross-warp sum in scratch"):
        ExpertsBlock(ExpertsConfig(stage="gateup", hidden=1024, intermediate=512, num_local=4, top_k=2,
                                   weight_dtype="mxfp4", rows_per_tile=64, mma=True))
    ok = ExpertsBlock(ExpertsConfig(stage="down", hidden=1024, intermediate=512, num_local=4, top_k=2,
                                    weight_dtype="mxfp4", rows_per_tile=64, mma=True))
    assert ok.mma_red_words == 512
