"""Kimi K3: KDA + NoPE MLA hybrid with a large MoE, following transformers 5.24 `kimi_linear`
(see docs/models/kimi_k3.md for the architecture, sources and assumptions)."""
from sdk import ModelEntry, Sharding, hookimpl
from sdk.spec import QuantSpec

from . import config as _config
from . import weights as _weights

ENTRY = ModelEntry(
    name="kimi_k3",
    hf_model_type="kimi_linear",
    summary="Kimi K3: KDA + NoPE MLA hybrid, 896-expert top-16 latent MoE with SiTU (transformers kimi_linear "
            "+ K3's sigmoid KDA gate, Stable LatentMoE and SiTU)",
    spec_from_config=_config.spec_from_config,
    configs={"tiny": _config.tiny, "tiny_k3": _config.tiny_k3, "full": _config.full,
             # in the device blocks' shapes: the whole-model program (sdk/megakernel/plain_model.py)
             "small": _config.small,
             # one TP8 / EP16 rank's widths, 4 layers, on one GPU: the program at real widths (batch 1)
             "wide": _config.wide,
             # small's widths at the full depth (61 layers): the program at the full instruction count
             "deep": _config.deep},
    hf_config=_config.hf_config,
    hf_causal_lm="transformers.KimiLinearForCausalLM",
    load_weights=_weights.load_weights,
    shardings={
        "tp8": Sharding(tp=8, ep=1, note="MLA/KDA 12 heads per rank; MoE tensor-parallel, expert "
                                         "intermediate 3072/8 = 384 per rank [MODEL-FACTS F8, F10]"),
        "ep8": Sharding(tp=8, ep=8, note="attention TP8 (12 heads per rank); 112 experts per rank "
                                         "(the W4A8 EP8 path [MODEL-FACTS F17])"),
        "tp12": Sharding(tp=12, ep=1, note="GB200/GB300 NVL72: 8 MLA heads per rank; MoE tensor-parallel; "
                                           "latent up rows 7168 = 8*640 + 4*512 [MODEL-FACTS F4, F14]"),
        "ep16": Sharding(tp=16, ep=16, note="assumed, not stated for Kimi K3: 6 heads and 56 experts per rank"),
    },
    doc="docs/models/kimi_k3.md",
    # Released formats (MODEL-FACTS F1, F3, F8, F9): NVFP4 experts; FP8 128x128-block KDA/MLA projections
    # (router, latent and shared weights are BF16, counted as dense here); FP8 paged latent cache.
    native_quant=QuantSpec(experts="nvfp4", dense="fp8_block128", kv_cache="fp8"),
)


@hookimpl
def register_models(register):
    register(ENTRY)
