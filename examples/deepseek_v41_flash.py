"""DeepSeek-V4.1-Flash (tiny config, random weights) through the reference backend.

    python examples/deepseek_v41_flash.py

The tiny config has a sliding-window layer, two CSA layers (ratio 4, lightning indexer) and an HCA
layer (ratio 8 here; 128 in the real model), hash-routed then learned-routed MoE, and the 4-stream
mHC residual. With real weights, load a transformers `DeepseekV4ForCausalLM` state dict with
`mk.load_hf_state_dict(model.state_dict())` instead of `load_weights`.

`--v41` takes the config "tiny_v41": V4.1's math where it differs from transformers' V4 (the lagged
mHC pre-mix with the carried head, queries without the per-head norm; docs/models/deepseek_v41_flash.md).
"""
import sys

import torch

from sdk import build_megakernel
from sdk.reference.model import random_weights


def main():
    config = "tiny_v41" if "--v41" in sys.argv[1:] else "tiny"
    mk = build_megakernel("deepseek_v41_flash", config=config, backend="reference", max_seq_len=128)
    mk.load_weights(random_weights(mk.spec, seed=0))
    print("layers:", [f"{l.attention.kind}/r{l.attention.compress_ratio}+{'hash' if l.mlp.hash_routed else 'topk'}"
                      for l in mk.spec.layers])
    prompt = torch.tensor([[1, 17, 42, 99, 7, 3, 250], [5, 6, 7, 8, 0, 0, 0]])
    out = mk.generate(prompt, max_new_tokens=24, prompt_lens=[7, 4])  # ragged prompts
    for row, n in zip(out.tolist(), [7, 4]):
        print("prompt", row[:n], "->", row[n:n + 24])


if __name__ == "__main__":
    main()
