"""Build the tiny Kimi K3 model with random weights on the reference backend and generate a few tokens;
then the "small" config (the device blocks' shapes) on the megakernel backend - the whole decode step
as ONE launch (on the GPU if there is one, else the same program on the PyVM) - beside the reference.

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

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = build_megakernel("kimi_k3", config="small", backend="reference", max_seq_len=32, dtype=torch.float32)
    mk = build_megakernel("kimi_k3", config="small", backend="megakernel", max_seq_len=32, device=device)
    w = random_weights(ref.spec, seed=0)
    # the program's bf16; a correction bias wider than the router's scores, so that the two sides'
    # bf16 differences cannot flip a near-tie of the top-k on random weights
    w = {k: (5000 * v if k.endswith("correction_bias") else v).to(torch.bfloat16) for k, v in w.items()}
    ref.load_weights({k: v.float() for k, v in w.items()})
    mk.load_weights(w)
    prompt = torch.tensor([[1, 17, 42], [1, 5, 6]])
    got, want = mk.generate(prompt, max_new_tokens=4), ref.generate(prompt, max_new_tokens=4)
    diff = ((mk.last_logits - ref.last_logits).norm() / ref.last_logits.norm()).item()
    print(f"megakernel backend ({device}): {got[:, 3:].tolist()}, reference {want[:, 3:].tolist()}; "
          f"logits rel diff {diff:.1e}")


if __name__ == "__main__":
    main()
