"""GLM-5.3 on the reference backend: the tiny config with random weights, a few greedy tokens.

    python examples/glm_53.py

The tiny config has every feature of the architecture: KDA layers, MLA layers restricted to the
tokens the DSA k-pool indexer selects (one of them sharing the previous layer's selection), dense
first layers, MoE, mHC. For real weights pass the transformers model's state dict to
`load_hf_state_dict` instead (vision weights are ignored).
"""
import torch

from sdk import build_megakernel
from sdk.reference.model import random_weights


def main():
    mk = build_megakernel("glm_53", config="tiny", backend="reference", max_seq_len=128)
    print("layers:", ", ".join(mk.spec.layer_kinds()))
    mk.load_weights(random_weights(mk.spec, seed=0, std=0.1))
    prompt = torch.tensor([[11, 42, 7, 99, 3, 150, 21], [5, 8, 13, 0, 0, 0, 0]])
    out = mk.generate(prompt, max_new_tokens=24, prompt_lens=[7, 3])  # ragged: row 1 has 3 prompt tokens
    for row, n in zip(out.tolist(), [7, 3]):
        print("prompt", row[:n], "->", row[n:n + 24])
    indexer = mk.spec.layers[1].attention.indexer
    print(f"DSA: each query attends to at most {indexer.topk} pooled tokens (pools of {indexer.kpool}) "
          f"+ at most {indexer.kpool - 1} tail tokens; row 0 ends with {7 + 24} tokens in context")


if __name__ == "__main__":
    main()
