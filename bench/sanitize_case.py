"""A small megakernel case for compute-sanitizer (memcheck, racecheck): a 2-layer MLP stack,
hidden 1024, intermediate 512, batch 2, on 8 CTAs, two steps, checked against the reference.

    compute-sanitizer --tool memcheck python bench/sanitize_case.py
The wait timeout is long (60 s) since the sanitizer slows every memory access."""
import sys

import torch

from sdk.megakernel.mlp_stack import MLPStackConfig, build_program, make_weights, reference
from sdk.megakernel.pyvm import PyVM
from sdk.megakernel.runtime import MegakernelRuntime


def main():
    cfg = MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=2)
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    weights = make_weights(cfg, seed=5, device="cuda")
    tensors.update(weights)
    rt = MegakernelRuntime(prog, tensors, num_sms=8, timeout_s=60.0)
    worst = 0.0
    for step in range(2):
        x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        tensors["x"].copy_(x)
        tensors["out"].fill_(float("nan"))
        rt.run()
        ref = reference(cfg, weights, x)
        worst = max(worst, ((tensors["out"].float() - ref).norm() / ref.norm()).item())
    print(f"sanitize case: 2 steps, worst relative error {worst:.2e}")
    return 0 if worst <= 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
