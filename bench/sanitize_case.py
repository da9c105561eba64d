"""Small megakernel cases for compute-sanitizer (memcheck, racecheck): 2-layer MLP stacks, hidden
1024, intermediate 512, on 8 CTAs, two steps each, checked against the reference:
  1. bf16, batch 2, RMSNorm fused into the gate/up tiles, residual in the down epilogue;
  2. fp8, batch 3, separate RMSNorm ops (plain tiles between streaming ones).
Both run every ring path: prefetch across instructions, x staging, the fp8 scale copies.

    compute-sanitizer --tool memcheck python bench/sanitize_case.py
The wait timeout is long (60 s) since the sanitizer slows every memory access."""
import sys

import torch

from sdk.megakernel.mlp_stack import MLPStackConfig, build_program, make_weights, reference
from sdk.megakernel.pyvm import PyVM
from sdk.megakernel.runtime import MegakernelRuntime

CASES = [MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=2),
         MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=3, weight_dtype="fp8_e4m3", fuse_norm=False)]


def main():
    worst_all = 0.0
    for cfg in CASES:
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
        print(f"sanitize case {cfg.weight_dtype} batch {cfg.batch} fuse_norm={cfg.norm_fused}: 2 steps, "
              f"worst relative error {worst:.2e}", flush=True)
        worst_all = max(worst_all, worst)
    return 0 if worst_all <= 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
