"""Calibrates tests/program_choices.py's DSA near-tie bound on the CPU: GLM-5.3 small at batch 8
through the PyVM (the whole-model program's torch twins) for 36 steps a seed, against the fp32
model, the model taking the program's picks (ProgramChoices). Every swapped pool pair is recorded
with its gap, the row's top score and the row's largest pool magnitude (pool_scores); the run
prints the largest, p99 and median gap over each scale. Runs ~25 s a seed (OMP_NUM_THREADS=1):

    OMP_NUM_THREADS=1 python -m bench.dsa_tie_calibration 3000 3001 ...

(2026-12-06, 42 seeds, 524 pairs: gap / magnitude max 0.0047, p99 0.0026; gap / top score max
0.28, p99 0.13 - DSA_TIE = 0.01 of the magnitude.)"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main(seeds: list[int]) -> None:
    import program_choices as pc
    from test_glm_model import SPEC, glm_weights, reference

    from sdk.megakernel.mhc_model import MHCModelConfig, MHCModelRunner
    pairs = []

    def record(self, what, layer, row, values, scale, lost, won, tie):      # instead of asserting
        if what == "dsa":
            top = values.abs().max().item()          # DSA: the values are the scores
            gap = pc.swap_gap(values, lost, won)
            pairs.append((gap / max(scale.abs().max().item(), 1e-30), gap / max(top, 1e-30)))

    class Patch:                                      # monkeypatch's setattr, for the whole run
        setattr = staticmethod(setattr)

    pc.ProgramChoices.check_tie = record
    for seed in seeds:
        w = glm_weights(seed % 1000)
        ref = reference(w, torch.float32, max_batch=8)
        choices = pc.ProgramChoices(ref, Patch())
        runner = MHCModelRunner(MHCModelConfig(SPEC, batch=8, max_seq_len=64), w)
        g, state = torch.Generator().manual_seed(seed), ref.new_state(8)
        for _ in range(36):
            ids = torch.randint(0, SPEC.vocab_size, (8,), generator=g)
            runner.decode(ids)
            choices.take(runner)
            ref.decode(ids[:, None], state)
        print(f"seed {seed}: {len(pairs)} swapped pairs so far", flush=True)
    for k, name in enumerate(("magnitude", "top score")):
        v = sorted(p[k] for p in pairs)
        if v:
            print(f"gap / {name}: max {v[-1]:.4f} p99 {v[int(0.99 * (len(v) - 1))]:.4f} median {v[len(v) // 2]:.4f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [3000])
