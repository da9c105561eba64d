"""Where RouterSelect's ~10 us (Kimi K3 batch 1, timelines v5 / v6) goes: the same select twice
in a row on one SM of a one-launch program, from the timing record. If the second run (its code
now in the instruction caches) is much shorter than the first, the tile is bound by the cold
instruction fetch of code that runs once per step, not by its arithmetic. Each case runs with
both warp argmax forms (RouterSelectConfig.warp_argmax: butterfly shuffles / redux.sync): the top-k
rounds are chains of shuffles (~300 cycles each, 2 x 16 rounds at Kimi K3 batch 1).

    python -m bench.select_bench [--out DIR]     (GPU; JSON select_bench.json)
"""
from __future__ import annotations

import json
import os

import torch

from bench.common import arg_parser

CASES = {   # name: RouterSelectConfig kwargs (the MoE presets' routers)
    "kimi_k3": dict(num_experts=896, top_k=16, correction_bias=True, local_start=56, num_local=56),
    "glm_53": dict(num_experts=288, top_k=8, correction_bias=True, routed_scaling_factor=2.5, num_local=36),
    "deepseek_v41_flash": dict(num_experts=384, top_k=6, scoring="sqrtsoftplus", correction_bias=True,
                               routed_scaling_factor=1.5, num_local=48),
}


def program(name: str, batch: int, repeats: int = 3, argmax: str = "shuffle"):
    from sdk.blocks.router import RouterSelectBlock, RouterSelectConfig
    from sdk.megakernel.program import Program
    blk = RouterSelectBlock(RouterSelectConfig(m=batch, warp_argmax=argmax, **CASES[name]))
    prog = Program()
    for s in blk.operand_specs():
        if s.name in ("tid2eid", "input_ids"):
            continue
        prog.buffer(s.name, s.shape, s.dtype, "output" if s.output else "input")
    binds = {s.name: s.name for s in blk.operand_specs() if s.name in prog.buffers}
    prev = None
    for r in range(repeats):
        prev = prog.op(blk, binds, waits=[] if prev is None else [prev], label=f"select.{r}")
    return prog, blk


def run(out_dir=None):
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    res = {"gpu": torch.cuda.get_device_name(), "cases": []}
    for name, batch, argmax in [(n, b, a) for n in CASES for b in (1, 8) for a in ("shuffle", "redux")]:
        prog, blk = program(name, batch, argmax=argmax)
        t = PyVM.alloc(prog, device="cuda")
        t["logits"].copy_(torch.randn(batch, blk.config.num_experts, device="cuda"))
        if "bias" in t:
            t["bias"].copy_(torch.randn(blk.config.num_experts, device="cuda") * 0.1)
        rt = MegakernelRuntime(prog, t, num_sms=1, timing=True)
        per_launch = []
        for _ in range(3):
            rt.run()
            rec = rt.timing_record()
            per_launch.append([round((e - s) / 1e3, 2) for s, e in zip(rec["start_ns"], rec["end_ns"])])
        r = {"router": name, "batch": batch, "warp_argmax": argmax, "warps_per_token": blk.warps_per_token,
             "us_per_select_by_launch": per_launch}
        print(json.dumps(r), flush=True)
        res["cases"].append(r)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "select_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv=None):
    a = arg_parser(out_from_env=False).parse_args(argv)
    run(a.out)


if __name__ == "__main__":
    main()
