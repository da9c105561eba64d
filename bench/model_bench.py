"""Benchmark of a whole decode step as ONE megakernel launch: DeepSeek-V4.1 (sdk/megakernel/mhc_model.py)
on the config "small_v41" (4 layers: SWA, CSA, HCA, CSA; hidden 1024, 64 experts of which the
step reads the hit ones), Kimi K3 (sdk/megakernel/plain_model.py) on "small" (4 layers: KDA, MLA,
KDA, MLA; a dense MLP then the latent MoE, 32 experts) and GLM-5.3 (mhc_model.py) on "small" (5
layers: KDA, DSA, shared DSA, KDA, DSA; dense MLPs then the MoE) - the blocks' shapes - at batch 1
and 8, sequences some steps in - beside the
same step in PyTorch (the reference backend's capturable form - static shapes, no host syncs,
the experts as grouped GEMMs over the hit experts - under a CUDA graph; eager if the capture
fails, said in the record) and the floor: the bytes the step must read (every dense weight, the hit experts, the
embedding rows, the caches' live rows bounded by their buffers) over the copy bandwidth measured
in this run.

    python -m bench.model_bench --out bench/results/h200

JSON (model_bench.json): per case us per step, the floor and its parts, the reference's us, the
logits' rel err against the reference on the same step (the model taking the program's near-tie
router / indexer picks, as in the whole-model tests: tests/program_choices.py; recorded).

`--wide`: Kimi K3 at one TP8 / EP16 rank's real widths (hidden 7168, 12 MLA and 12 KDA heads, the
2304-wide dense MLP, 64 experts of the real 3584 x 3072 shape, the 163840 vocab), 4 layers, batch 1,
on one GPU with no peers (config "wide"): what a step costs at the real widths. A token takes 16
of the 64 experts here, ~1 on a deployed EP16 rank.

`--tp N`: the tensor-parallel program (sdk/megakernel/tp_model.py) as N virtual ranks
on this one GPU, 132 / N SMs each, one launch per rank a step: what the ranks' collectives and
shards cost beside the one-GPU program (not NVLink: the peers' buffers are local HBM); its floor
is every rank's bytes over this GPU's bandwidth.
"""
from __future__ import annotations

import os
import sys

import torch

from bench.common import add_match_option, arg_parser, record_timeline, run_cases, timed


# model, config, batch, steps before the timed one
CASES = [("deepseek_v41_flash", "small_v41", 1, 32), ("deepseek_v41_flash", "small_v41", 8, 32),
         ("kimi_k3", "small", 1, 32), ("kimi_k3", "small", 8, 32), ("glm_53", "small", 1, 32), ("glm_53", "small", 8, 32)]
# --wide: Kimi K3 at one TP8 / EP16 rank's widths (models/kimi_k3/config.py WIDE), 4 layers, batch 1
WIDE_CASES = [("kimi_k3", "wide", 1, 8)]
# --deep: Kimi K3 at small's widths and the full 61-layer depth (config "deep"): what a step of the
# full instruction count costs, its records through a window (kernel.py)
DEEP_CASES = [("kimi_k3", "deep", 1, 4), ("kimi_k3", "deep", 8, 4)]
SHORT = {"deepseek_v41_flash": "v41", "kimi_k3": "k3", "glm_53": "glm"}
TP_MODELS = ("deepseek_v41_flash", "kimi_k3", "glm_53")   # every model has a tensor-parallel program (tp_model.py)


def bench_model(model, config, batch, warm_steps, copy_bw, timeline_path=None, expert_dtype="bf16", tp=1,
                draw_on="cpu", take_picks=True):
    """draw_on: where the random weights are drawn (the small configs' on the CPU, as in the earlier
    rows; --wide's 19 GB on the GPU). take_picks: the model takes the program's near-tie picks
    (else the two sides pick on their own and rel_err says how far they drift: --deep, whose 61
    bf16 layers move picks by more than a near-tie - the H100 run of 2026-12-05)."""
    from sdk import build_megakernel
    from sdk.megakernel.moe_layer import MoELayerConfig
    from sdk.reference.model import random_weights
    ref = build_megakernel(model, config, dtype=torch.bfloat16, device="cuda", max_seq_len=256, max_batch=batch)
    w = {k: v.cuda() for k, v in random_weights(ref.spec, seed=0, dtype=torch.bfloat16, device=draw_on).items()}
    ref.load_weights(w)
    backend = build_megakernel(model, config, backend="megakernel", max_seq_len=256, max_batch=batch,
                               expert_dtype=expert_dtype, tp=tp)
    cfg = backend.Config(ref.spec, batch=batch, max_seq_len=256, expert_dtype=expert_dtype,
                         **({"ranks": tp, "num_sms": 132 // tp} if tp > 1 else {}))
    runner = backend.Runner(cfg, w, device="cuda")
    state = ref.new_state(batch)
    g = torch.Generator().manual_seed(1)
    # On random weights a router or DSA indexer near-tie may be picked differently by the program
    # (bf16 activations) and the model (fp32 scores); one such pick moves that row's logits from
    # then on (the H200 run of 2026-12-05: rows at 0.1-0.58). As in the whole-model tests, the
    # model takes the program's pick where it is a near-tie (tests/program_choices.py; any other
    # difference raises), so the figure below is the rounding; the picks taken are recorded.
    import pytest                            # MonkeyPatch, for the tests' near-tie rule (tests/)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from program_choices import ProgramChoices
    with pytest.MonkeyPatch.context() as mp:
        choices = ProgramChoices(ref, mp) if take_picks else None
        for _ in range(warm_steps + 1):      # the caches some steps in (windows full, entries written)
            ids = torch.randint(0, ref.spec.vocab_size, (batch,), generator=g)
            got = runner.decode(ids)
            if choices is not None:
                choices.take(runner)
            want = ref.decode(ids[:, None].cuda(), state)[:, 0]
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    row_errs = ((got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).tolist()
    # the floor: weights without the unread experts and embedding rows, + the hit experts, + caches
    # (every rank's, over this one GPU's bandwidth)
    prog, t = runner.prog, runner.tensors
    wbytes, hits = 0, []
    for rank_t in runner.rank_tensors():
        wbytes += prog.bytes_by_role("weight") - prog.bytes_of("embed") + batch * ref.spec.hidden_size * 2
        for i, (_, moe) in enumerate(cfg.layers()):
            if not isinstance(moe, MoELayerConfig):       # a dense MLP: all its weights are read
                continue
            p = f"l{i}.mlp."
            expert_bytes = sum(prog.bytes_of(p + n) for n in ("experts.gate_up.weight", "experts.down.weight",
                                                              "experts.gate_up.scale", "experts.down.scale")
                               if p + n in prog.buffers)
            h = int(rank_t[p + "hits"][0])
            hits.append(h)
            wbytes -= expert_bytes - expert_bytes * h // moe.local
    cache_bytes = len(runner.rank_tensors()) * sum(prog.bytes_of(n) for n, b in prog.buffers.items()
                                                   if b.role == "input" and n.startswith("l"))
    total = wbytes + cache_bytes
    # the step again and again (the caches advance: the positions stay inside the built 256)
    rt = runner.rt
    us, mode = timed([rt.launch] * 8)
    rt.check()
    case = case_name((model, config, batch)) + ("" if expert_dtype == "bf16" else f" {expert_dtype}") \
        + (f" TP{tp} virtual ranks" if tp > 1 else "")
    if timeline_path and tp == 1:
        record_timeline(prog, t, timeline_path, case, us)
    # the same step as PyTorch: the reference backend's capturable form (static shapes, no host
    # syncs: ReferenceModel.capturable) under a CUDA graph, its lengths reset before each replay so
    # that every replay is this step again, as every launch of the program above is
    ref.capturable = True
    ids_dev, lengths = ids[:, None].cuda(), state.lengths.clone()

    def ref_step():
        state.lengths.copy_(lengths)
        ref.decode(ids_dev, state)
    ref_us, ref_mode = timed([ref_step])
    graph = ref_mode == "cuda_graph"
    floor_us = total / (copy_bw * 1e3)
    return {"case": case, "batch": batch, "context": warm_steps + 1, "us": us, "timing_mode": mode,
            "floor_us": floor_us, "floor_bytes": {"weights_read": wbytes, "caches": cache_bytes},
            "fraction_of_floor": floor_us / us, "gbs": total / (us * 1e3), "hit_experts": hits, "rel_err": err,
            "rel_err_rows": [round(e, 5) for e in row_errs],
            "near_tie_picks_taken": [list(f[:3]) + [round(f[3], 4)] for f in choices.forced] if choices else None,
            "reference_us": ref_us, "reference_timing_mode": ref_mode, "torch_graph_us": ref_us if graph else None,
            "speedup_vs_torch_graph": ref_us / us if graph else None,
            "torch_form": f"the reference backend, capturable: attention over all {state.max_seq_len} cache positions, "
                          "masked; the experts as grouped GEMMs", "program_ops": len(prog.ops),
            "instructions": len(prog.instructions), "tp_virtual_ranks": tp}


def case_name(c):
    return f"{SHORT[c[0]]} {c[1]} whole step B={c[2]}"


def main(argv=None):
    ap = arg_parser(out_from_env=False)
    add_match_option(ap)
    ap.add_argument("--expert-dtype", default="bf16", help="the routed experts' format: bf16 (the model's "
                    "weights; the logits compared with the reference), fp8_e4m3 or mxfp4 (quantised at load: "
                    "the logits differ by the quantisation)")
    ap.add_argument("--tp", type=int, default=1, help="the models over this many tensor-parallel ranks, "
                    "as virtual ranks on this GPU (132 / N SMs each)")
    ap.add_argument("--wide", action="store_true", help="the wide case (Kimi K3 at one rank's real widths, "
                    "4 layers, batch 1) instead of the small configs")
    ap.add_argument("--deep", action="store_true", help="the deep cases (Kimi K3 at small's widths, all 61 "
                    "layers, batch 1 and 8) instead of the small configs")
    a = ap.parse_args(argv)
    cases = WIDE_CASES if a.wide else DEEP_CASES if a.deep else CASES
    todo = [c for c in cases if (a.tp == 1 or c[0] in TP_MODELS) and (not a.match or any(m in case_name(c) for m in a.match))]

    def one(c, bw):
        tag = "" if a.expert_dtype == "bf16" else "_" + a.expert_dtype
        tl = os.path.join(a.out, f"timeline_model_{SHORT[c[0]]}_{c[1]}_b{c[2]}{tag}.json") if a.out and c[2] == 1 else None
        return bench_model(*c, bw, tl, expert_dtype=a.expert_dtype, tp=a.tp,
                           draw_on="cuda" if a.wide or a.deep else "cpu", take_picks=not a.deep)
    run_cases("model_bench.json", todo, one, case_name, a.out, case_width=34)


if __name__ == "__main__":
    main()
