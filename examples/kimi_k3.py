"""Build the tiny Kimi K3 model with random weights on the reference backend and generate a few tokens.

    python examples/kimi_k3.py
"""
import torch

from sdk import build_megakernel
from sdk.reference.model import random_weights


def main():
    mk = build_megakernel("kimi_k3", config="tiny", backend="reference", max_seq_len=64)
    print("layers:", ", ".join(mk.spec.layer_kinds()))
    mk.load_weights(random_weights(mk.spec, seed=0, std=0.1))
    prompt = torch.tensor([[1, 17, 42, 99, 7], [1, 5, 6, 200, 0]])
    # the second prompt is 4 tokens long (ragged batch: it is right-padded)
    out = mk.generate(prompt, max_new_tokens=8, prompt_lens=[5, 4])
    for row, n in zip(out.tolist(), [5, 4]):
        print("prompt", row[:n], "->", row[n:n + 8])


if __name__ == "__main__":
    main()
