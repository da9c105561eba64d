"""DeepSeek-V4.1-Flash: the transformers 5.24 `deepseek_v4` architecture (no V4.1 class exists).

Sliding-window / CSA / HCA attention with attention sinks (sdk.reference.dsv4_attention), hash-
routed then sqrt-softplus-routed MoE with one shared expert (sdk.reference.moe), mHC residual with
4 streams (sdk.reference.mhc). What V4.1 adds beyond V4 and what is assumed: docs/models/deepseek_v41_flash.md.
"""
import copy

from sdk import ModelEntry, Sharding, hookimpl
from sdk.spec import QuantSpec

from .config import FULL, SMALL, TINY, V41_SWITCH, hf_config, spec_from_config
from .weights import load_weights

ENTRY = ModelEntry(
    name="deepseek_v41_flash",
    hf_model_type="deepseek_v4",
    summary="DeepSeek-V4.1-Flash (deepseek_v4): SWA + CSA/HCA compressed attention, 384-expert MoE, mHC",
    spec_from_config=spec_from_config,
    configs={"tiny": lambda: copy.deepcopy(TINY), "full": lambda: copy.deepcopy(FULL),
             # V4.1's math where it differs from transformers' deepseek_v4 (config.with_v41_features)
             "tiny_v41": lambda: {**copy.deepcopy(TINY), V41_SWITCH: True},
             # in the device blocks' shapes: the whole-model program (sdk/megakernel/mhc_model.py)
             "small": lambda: copy.deepcopy(SMALL),
             "small_v41": lambda: {**copy.deepcopy(SMALL), V41_SWITCH: True},
             "full_v41": lambda: {**copy.deepcopy(FULL), V41_SWITCH: True}},
    hf_config=hf_config,
    hf_causal_lm="transformers.DeepseekV4ForCausalLM",
    load_weights=load_weights,
    shardings={
        "tp1": Sharding(tp=1, ep=1, note="one GPU: all 64 heads, all 384 experts (TP1 preset, MODEL-FACTS F13)"),
        "tp4": Sharding(tp=4, ep=1, note="16 heads per rank (F14); experts MoE-TP, 2304/4 = 576 per rank (F13)"),
        "tp8": Sharding(tp=8, ep=1, note="8 heads per rank (F14); experts MoE-TP, 2304/8 = 288 per rank (F13)"),
        "ep8": Sharding(tp=8, ep=8, note="8 heads per rank (F14); 384/8 = 48 whole experts per rank"),
    },
    doc="docs/models/deepseek_v41_flash.md",
    # Released formats (MODEL-FACTS F13, F18, F21, F22, F24): MXFP4 experts, E4M3 dense weights (32x32
    # UE8M0 blocks); the serving caches "v41" (sdk/graph.py): the E4M3 sliding window 528 B a token,
    # the E2M1 compressed entries 288 B, the MXFP4 indexer keys 68 B.
    native_quant=QuantSpec(experts="mxfp4", dense="fp8_block128", kv_cache="v41"),
)


@hookimpl
def register_models(register):
    register(ENTRY)
