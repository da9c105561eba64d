"""The MoE expert tile alone: one token routed to `hits` local experts of a model's MoE layer
expert op (moe_layer.preset at batch 1, MXFP4, the op's own config), launched standalone - one
tile per CTA, as many CTAs as the op has tiles - with ExpertsConfig overrides per variant.

    python -m bench.experts_bench [--cases deepseek_v41_flash:down:1,...] [--variants "smem_stages=4;mma=1"]

Why: in the MoE layer's batch-1 timelines an expert tile takes ~11-13 us for ONE hit expert
whatever its bytes (V4.1-Flash gate/up 130 KB, down 49 KB a tile: ~0.5-1.2 TB/s over the GPU,
the down tiles running alone on it). The variants say which knob moves it: the staged items'
depth (smem_stages), packed f16 FMAs (mxfp4_decode=hfma2: ~25% fewer instructions an item),
the tensor-core tile (mma=1).

Two timings per variant, each the median per launch of a CUDA graph of launches:
  hot:  the same hit expert every launch (its weights stay in the L2);
  cold: every launch routes the token to another local expert, round the layer's experts
        (all of them random weights), so a launch reads weights the L2 no longer holds.
Each variant's output is checked against the block's fp32 reference (relative error).
"""
from __future__ import annotations

import dataclasses
import time

import torch

DEFAULT_CASES = "deepseek_v41_flash:down:1,deepseek_v41_flash:gateup:1,glm_53:gateup:1,kimi_k3:gateup:1"
DEFAULT_VARIANTS = "base;mxfp4_decode=hfma2;smem_stages=0;smem_stages=4;smem_stages=0,mma=1"


def expert_op(model: str, stage: str):
    """The MoE layer's (batch 1, MXFP4) expert block of this stage, as the layer builds it."""
    from sdk.megakernel.moe_layer import build_program, preset
    prog = build_program(preset(model, 1, expert_dtype="mxfp4"))
    return next(op.block for op in prog.ops if op.label == f"experts.{stage}")


def operands(blk, hits: int, seed: int = 0, device="cuda", routings: int | None = None,
             first: int = 0) -> tuple[dict, list[dict]]:
    """(shared operands: MXFP4 weights, x / act, outputs; per routing r = 0 .. routings - 1 (default:
    every local expert): hits / counts / tok / slot sending the token to the `hits` experts first +
    r, first + r + 1, ... (mod num_local)). Only the experts some routing hits get random weights,
    the others stay zero (a whole random shard is GBs: profile_block's one routing fills only its own)."""
    from sdk.blocks.base import DTYPES
    from sdk.blocks.experts import quantize_mxfp4
    c, g = blk.config, torch.Generator(device=device).manual_seed(seed)
    specs = {s.name: s for s in blk.operand_specs()}
    N, K, L = blk.n_rows, blk.k_dim, c.num_local
    routings = L if routings is None else routings
    i32 = dict(dtype=torch.int32, device=device)
    w, sc = torch.zeros(specs["w"].shape, **i32), torch.zeros(specs["w_scale"].shape, **i32)
    for e in sorted({(first + r + j) % L for r in range(routings) for j in range(hits)}):
        w[e], sc[e] = quantize_mxfp4(torch.randn(N, K, device=device, generator=g) * K ** -0.5)
    shared = {"w": w, "w_scale": sc}
    for name, spec in specs.items():       # activations random; outputs empty
        if name in ("w", "w_scale", "counts", "hits", "tok", "slot") or spec.optional and name != "topk_w":
            continue
        if spec.output:
            shared[name] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=device)
        else:
            v = torch.randn(*spec.shape, device=device, generator=g)
            shared[name] = (v.abs() if name == "topk_w" else v).to(DTYPES[spec.dtype])
    tables = []
    for r in range(routings):
        hit = torch.tensor(sorted((first + r + j) % L for j in range(hits)), **i32)
        t = {"counts": torch.zeros(L, **i32), "tok": torch.zeros(L, specs["tok"].shape[1], **i32),
             "slot": torch.zeros(L, specs["slot"].shape[1], **i32),
             "hits": torch.cat([torch.tensor([hits], **i32), hit, torch.zeros(L - hits, **i32)])}
        t["counts"][hit.long()] = 1
        t["slot"][hit.long(), 0] = torch.arange(hits, **i32)     # the token's assignments 0 .. hits-1
        tables.append(t)
    return shared, tables


def bench_variant(model: str, stage: str, hits: int, overrides: dict, state: dict) -> dict:
    from bench.common import cu_stream, graph_time_us
    from sdk.blocks._cute import standalone
    from sdk.blocks.experts import ExpertsBlock
    base = expert_op(model, stage)
    blk = ExpertsBlock(dataclasses.replace(base.config, **overrides))
    key = (model, stage, hits)
    if key not in state:                   # weights shared by the case's variants (same shapes)
        state.clear()
        state[key] = operands(base, hits)
    shared, routings = state[key]
    tables = [torch.tensor([(r | shared)[n].data_ptr() if n in (r | shared) else 0 for n in blk.operands()],
                           dtype=torch.int64, device="cuda") for r in routings]
    fn = standalone(blk)
    out_name = "act" if stage == "gateup" else "out"
    shared[out_name].fill_(float("nan"))   # poisoned: a row the tile misses shows in the error
    fn(tables[0].data_ptr(), cu_stream())
    torch.cuda.synchronize()
    ref = blk.reference(**{k: v.cpu() for k, v in (routings[0] | shared).items()})[out_name].float()
    got = shared[out_name].float().cpu()
    rows = ref[:1] if stage == "down" else ref[:hits]      # the written rows: the token / its assignments
    err = ((got[:rows.shape[0]] - rows).norm() / rows.norm()).item()
    # cu_stream() at each call: under capture it is the capturing stream (a stream taken before
    # would launch outside the graph - an empty graph, timed as ~0.2 us a launch)
    hot = graph_time_us([lambda: fn(tables[0].data_ptr(), cu_stream())] * 20)
    cold = graph_time_us([lambda t=t: fn(t.data_ptr(), cu_stream()) for t in tables])
    hit_bytes = hits * blk.expert_weight_bytes()
    return {"case": f"{model} {stage} hits={hits}", "variant": ",".join(f"{k}={v}" for k, v in overrides.items()) or "base",
            "tiles": blk.num_tiles(), "rows_per_tile": blk.config.rows_per_tile, "smem_stages": blk.config.smem_stages,
            "mma": blk.use_mma, "hot_us": hot, "cold_us": cold, "hit_bytes": int(hit_bytes),
            "cold_gbs": hit_bytes / (cold * 1e3), "rel_err": err}


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:36s} {r['variant']:28s} ERROR {r['error']}"
    return (f"{r['case']:36s} {r['variant']:28s} tiles {r['tiles']:4d}  hot {r['hot_us']:7.2f} us  "
            f"cold {r['cold_us']:7.2f} us ({r['cold_gbs']:5.0f} GB/s)  err {r['rel_err']:.1e}")


def main(argv=None):
    from bench.common import arg_parser, copy_bandwidth, parse_overrides, run_record, write_json
    ap = arg_parser(__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="model:stage:hits,...")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="ExpertsConfig overrides per variant, ';'-separated (base: the op's own config)")
    a = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()["copy"]
    print(f"GPU {props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    results, state = [], {}
    for case in a.cases.split(","):
        model, stage, hits = case.split(":")
        for v in a.variants.split(";"):
            ov = {} if v.strip() == "base" else parse_overrides(v)
            t0 = time.time()
            try:
                r = bench_variant(model, stage, int(hits), ov, state)
            except Exception as exc:
                r = {"case": f"{model} {stage} hits={hits}", "variant": v, "error": f"{type(exc).__name__}: {exc}"[:500]}
            r["wall_s"] = round(time.time() - t0, 1)
            print(_line(r), flush=True)
            results.append(r)
            write_json(a.out, "experts_bench.json", run_record(props, copy_bw, results))
    return results


if __name__ == "__main__":
    main()
