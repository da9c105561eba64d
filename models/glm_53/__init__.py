"""GLM-5.3 (`glm5_next`, transformers 5.24): KDA + DSA-sparse NoPE MLA hybrid, MoE, mHC.

See docs/models/glm_53.md for the architecture, the source of every number and the assumptions.
"""
from sdk import ModelEntry, Sharding, hookimpl
from sdk.spec import QuantSpec

from .config import full, full_nonflash, hf_config, small, spec_from_config, tiny
from .weights import load_weights

ENTRY = ModelEntry(
    name="glm_53",
    hf_model_type="glm5_next",
    summary="GLM-5.3(-Flash): KDA + DSA k-pool sparse MLA (3:1), 288-expert top-8 MoE, mHC x4",
    spec_from_config=spec_from_config,
    # "small": in the device blocks' shapes (the whole-model program, sdk/megakernel/mhc_model.py)
    configs={"tiny": tiny, "small": small, "full": full, "full-nonflash": full_nonflash},
    hf_config=hf_config,
    # transformers 5.24 has no text-only causal-LM class for glm5_next: the multimodal model, fed
    # text-only input ids, is the oracle (its vision tower never runs).
    hf_causal_lm="transformers.Glm5NextForConditionalGeneration",
    load_weights=load_weights,
    shardings={
        "tp1": Sharding(tp=1, ep=1, note="the ModelOpt NVFP4 presets are TP1 (MODEL-FACTS F13)"),
        "tp8": Sharding(tp=8, ep=8, note="KDA 8 of 64 heads per rank (64/TP, F14), MLA 8 of 64 heads, "
                                         "36 of 288 experts per rank, shared expert TP-sliced"),
        "ep8": Sharding(tp=1, ep=8, note="attention and shared expert replicated, 36 of 288 experts per rank"),
    },
    doc="docs/models/glm_53.md",
    # ModelOpt NVFP4 checkpoints (MODEL-FACTS F13); dense weights assumed BF16; 528 B E4M3 latent records (F25).
    native_quant=QuantSpec(experts="nvfp4", dense="bf16", kv_cache="fp8"),
)


@hookimpl
def register_models(register):
    register(ENTRY)
