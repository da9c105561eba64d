"""Benchmark of a whole DeepSeek-V4.1 decoder layer in ONE launch (sdk/megakernel/mhc_layer.py):
the attention sublayer (HCA or CSA at 32K, the TP8 shard: 8 heads, hidden 5120) and the MoE layer
(the EP8 shard simulated on one GPU: 48 local MXFP4 experts of 384, the shared expert), each in
V4.1's lagged mHC site, joined - beside the same two programs launched one after the other (what
joining saves: one launch's ramp-up and drain, and the MoE's weights streaming while the attention
computes) and the floor: the attention's weights and KV rows, the MoE's router, shared and hit
experts' weights, the streams (read twice, written once per site), all over the copy bandwidth
measured in this run.

    python -m bench.layer_bench --out bench/results/h200 [--match "hca B=1" ...]

Timing: launches rotate over weight copies (enough to exceed the L2), median of CUDA-graph
replays. The check: the layer's streams against the two sublayers' model references in sequence
(the attention's MHCResidual.around, then the MoE's with the attention's coef as its carried pre).
JSON (layer_bench.json): per case us joined / separate, the floor and its parts, rel err, hits.
"""
from __future__ import annotations

import os

import torch

from bench.common import (L2_FLUSH_BYTES, add_match_option, arg_parser, record_timeline, run_cases, timed)

CASES = [("hca", 32768, 1), ("hca", 32768, 8), ("csa", 32768, 1)]
ENDS = ("streams", "part", "carried")       # the layer's inputs under their own names


def configs(mode, ctx, batch):
    from bench.dsv4_bench import sublayer_config
    from sdk.megakernel.moe_layer import preset
    return (sublayer_config(mode, ctx, batch, mhc="v41", q_head_norm=False),
            preset("deepseek_v41_flash", batch, expert_dtype="mxfp4", mhc="v41"))


def bench_layer(mode, ctx, batch, copy_bw, timeline_path=None):
    from sdk.megakernel import dsv4_layer, moe_layer
    from sdk.megakernel.mhc_layer import join, layer_names
    from sdk.megakernel.mhc_site import site_fn
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    attn, moe = configs(mode, ctx, batch)
    pa, pm = dsv4_layer.build_program(attn), moe_layer.build_program(moe)
    prog = join(pa, pm)
    name1, name2 = layer_names()
    starts = [ctx - 1] * batch
    fn = site_fn(attn.site, seed=2, device="cuda")
    inp = dsv4_layer.make_inputs(attn, starts, seed=1, device="cuda", hc_fn=fn)

    def layer_copy(seed):
        """The layer's tensors with one weight copy (the inputs and caches alike in every copy)."""
        t = PyVM.alloc(prog, device="cuda")
        wa, wm = dsv4_layer.make_weights(attn, seed=seed, device="cuda"), moe_layer.make_weights(moe, seed=seed, device="cuda")
        t.update({name1(k): v for k, v in wa.items()})
        t.update({name2(k): v for k, v in wm.items()})
        for k, v in inp.items():
            t[k if k in ENDS else name1(k)].copy_(v)
        return t, wa, wm

    t0, wa, wm = layer_copy(0)
    rt = MegakernelRuntime(prog, t0)
    rt.run()
    csa = mode == "csa"
    want_a = dsv4_layer.reference(attn, wa, inp, index=t0["attn.index"] if csa else None, hc_fn=fn)
    want = moe_layer.mhc_reference(moe, wm, {"streams": want_a["streams"].to(torch.bfloat16),
                                             "carried": want_a["coef"]}, wa["hc_fn_next"])
    s0 = inp["streams"].float()
    d, dw = t0["streams"].float() - s0, want["streams"].float() - s0
    err = ((d - dw).norm() / dw.norm()).item()
    hits = int(t0["mlp.hits"][0])
    # the floor: attention weights + KV rows + its streams; the MoE's hit bytes + its site's weights + streams
    dec = next(op.block for op in pa.ops if op.label == "v4.decode")
    kvb = dec.kv_bytes(starts)
    if csa:
        score = next(op.block for op in pa.ops if op.label == "v4.i_scores")
        kvb += sum(min(attn.max_entries, (s + 1) // attn.ratio) for s in starts) * score.key_bytes_each
    streams_b = 2 * 3 * pa.bytes_of("streams")
    moe_b = moe_layer.weight_bytes_hit(moe, pm, hits)["total"] + sum(
        pm.bytes_of(n) for n in ("hc_base", "hc_scale", "hc_fn_next", "mlp_norm"))
    floor_bytes = {"attention_weights": pa.bytes_by_role("weight"), "kv": kvb, "moe": moe_b, "streams": streams_b}
    total = sum(floor_bytes.values())
    copies = max(1, min(6, -(-L2_FLUSH_BYTES // total)))
    tensors = [t0] + [layer_copy(100 + i)[0] for i in range(1, copies)]
    joined = [MegakernelRuntime(prog, t) for t in tensors]
    # the two sublayer programs over the same tensors (their own buffer names)
    sep = [(MegakernelRuntime(pa, {b: t[name1(b)] for b in pa.buffers}),
            MegakernelRuntime(pm, {b: t[name2(b)] for b in pm.buffers})) for t in tensors]
    reps = max(1, 8 // copies)
    us, mode_t = timed([r.launch for r in joined] * reps)
    us_sep, mode_s = timed([f for a, m in sep for f in (a.launch, m.launch)] * reps)
    for r in joined:
        r.check()
    case = f"v41flash layer {mode} B={batch} ctx={ctx}"
    if timeline_path:
        record_timeline(prog, t0, timeline_path, case, us)
    floor_us = total / (copy_bw * 1e3)
    # unfused PyTorch: the attention's reference in its mHC site (capturable), then the MoE site
    # around moe_bench's static-shape MoE (bf16 dequantised experts, grouped GEMMs)
    from bench.moe_bench import torch_moe, torch_weights
    from sdk.megakernel.mhc_site import reference as site_reference
    tw, y = torch_weights(moe, wm), torch.empty(batch, moe.hidden, dtype=torch.bfloat16, device="cuda")

    def torch_layer():
        a = dsv4_layer.reference(attn, wa, inp, capturable=True, hc_fn=fn)
        return site_reference(moe.site, wm, {"streams": a["streams"].to(torch.bfloat16), "carried": a["coef"]},
                              wa["hc_fn_next"], wm["mlp_norm"], lambda h: (torch_moe(moe, tw, h, y), y)[1])
    terr = ((torch_layer()["streams"].float() - s0 - dw).norm() / dw.norm()).item()
    torch_us, torch_mode = timed([torch_layer])
    graph = torch_mode == "cuda_graph"
    return {"case": case, "mode": mode, "batch": batch, "context": ctx, "us": us, "timing_mode": mode_t,
            "torch_us": torch_us, "torch_timing_mode": torch_mode, "torch_rel_err": terr,
            "torch_graph_us": torch_us if graph else None, "speedup_vs_torch_graph": torch_us / us if graph else None,
            "us_two_launches": us_sep, "two_launches_timing_mode": mode_s, "floor_us": floor_us,
            "floor_bytes": floor_bytes, "fraction_of_floor": floor_us / us, "gbs": total / (us * 1e3),
            "hit_local_experts": hits, "rel_err": err, "weight_copies": copies,
            "program_ops": [op.label for op in prog.ops]}


def case_name(c):
    return f"v41flash layer {c[0]} B={c[2]} ctx={c[1]}"


def run(out_dir=None, match=None):
    todo = [c for c in CASES if not match or any(m in case_name(c) for m in match)]

    def one(c, bw):
        tl = os.path.join(out_dir, f"timeline_layer_{c[0]}_b{c[2]}.json") if out_dir and c[2] == 1 else None
        return bench_layer(*c, bw, tl)
    return run_cases("layer_bench.json", todo, one, case_name, out_dir, case_width=40)


def main(argv=None):
    ap = arg_parser(out_from_env=False)
    add_match_option(ap)
    a = ap.parse_args(argv)
    run(a.out, a.match)


if __name__ == "__main__":
    main()
