"""Which expert tile runs (CPU): ExpertsBlock.use_mma. By default (ExpertsConfig.mma /
MoELayerConfig.expert_mma None) MXFP4 experts take the tensor-core tile (tile_mma) from a batch of
MMA_MIN_M = 8 tokens and the CUDA-core tile below - GemvBlock's rule (measured on the H200,
2026-12-03: the tensor-core tile is slower at batch 1 on all three models, faster at batch 8 on
Kimi K3 and GLM-5.3); True / False force either; other formats keep the CUDA cores."""
import pytest

from sdk.blocks import gemv
from sdk.blocks.experts import MMA_MIN_M, MMA_RED_WORDS, ExpertsBlock, ExpertsConfig
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.moe_layer import blocks, preset

MODELS = ["kimi_k3", "deepseek_v41_flash", "glm_53"]


def test_threshold_is_the_gemv_rule():
    assert MMA_MIN_M == gemv.MMA_MIN_M == 8
    assert ExpertsConfig.__dataclass_fields__["mma"].default is None
    from sdk.megakernel.moe_layer import MoELayerConfig
    assert MoELayerConfig().expert_mma is None


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("batch", [1, 2, 4, 7, 8, 16, 64])
def test_mxfp4_experts_on_tensor_cores_from_batch_8(model, batch):
    """Real per-GPU shards (balanced tile rows): both stages switch together at batch 8."""
    b = blocks(preset(model, batch, expert_dtype="mxfp4"))
    for stage in ("gateup", "down"):
        assert b[stage].use_mma == (batch >= 8), (model, batch, stage, b[stage].config.rows_per_tile)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_other_formats_stay_on_cuda_cores(model, fmt):
    for batch in (1, 8, 64):
        b = blocks(preset(model, batch, expert_dtype=fmt))
        assert not b["gateup"].use_mma and not b["down"].use_mma


@pytest.mark.parametrize("model", MODELS)
def test_explicit_choice_forces_either_tile(model):
    for stage in ("gateup", "down"):
        assert blocks(preset(model, 1, expert_dtype="mxfp4", expert_mma=True))[stage].use_mma
        assert not blocks(preset(model, 8, expert_dtype="mxfp4", expert_mma=False))[stage].use_mma
        assert not blocks(preset(model, 64, expert_dtype="mxfp4", expert_mma=0))[stage].use_mma   # moe_bench --set


def test_auto_keeps_cuda_cores_where_tile_mma_cannot_run():
    """A gate/up tile of 64 rows needs 2 x 8 x 64 = 1024 words of cross-warp sums (> 512): auto
    keeps the CUDA-core tile (the config stays legal), mma=True still fails loudly."""
    kw = dict(stage="gateup", hidden=2048, intermediate=512, num_local=8, top_k=4, m=8, weight_dtype="mxfp4",
              rows_per_tile=64)
    block = ExpertsBlock(ExpertsConfig(**kw))
    assert block.mma_red_words > MMA_RED_WORDS and not block.use_mma
    with pytest.raises(UnsupportedConfigError, match="cross-warp"):
        ExpertsBlock(ExpertsConfig(**kw, mma=True))
    assert ExpertsBlock(ExpertsConfig(**dict(kw, rows_per_tile=16))).use_mma


def test_expert_parallel_rows_follow_the_layer_batch():
    """Under EP the rule reads the layer's batch m, not the N x m rows an owner rank receives."""
    kw = dict(stage="down", hidden=5120, intermediate=2304, num_local=48, top_k=6, weight_dtype="mxfp4",
              scatter=True)
    assert not ExpertsBlock(ExpertsConfig(**kw, m=1, rows=8)).use_mma
    assert ExpertsBlock(ExpertsConfig(**kw, m=8, rows=64)).use_mma
