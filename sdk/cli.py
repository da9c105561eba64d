"""`megakernel` command line: models, plan, run, compile-check, bench, demo."""
from __future__ import annotations

import argparse
import sys
import time

from . import plugins
from .errors import SdkError


def cmd_models(args) -> int:
    models = plugins.models()
    print(f"plugins loaded: {', '.join(plugins.loaded_plugins()) or '(none)'}")
    for name, e in sorted(models.items()):
        print(f"  {name:20s} [{e.plugin}] follows transformers '{e.hf_model_type}': {e.summary}")
        print(f"  {'':20s} configs: {', '.join(sorted(e.configs))}; shardings: "
              f"{', '.join(f'{k}(tp={s.tp},ep={s.ep})' for k, s in e.shardings.items()) or '-'}")
    for err in plugins.plugin_errors():
        print(f"  ! {err}")
    return 0


def _fmt_bytes(b: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def cmd_plan(args) -> int:
    from .graph import plan
    from .spec import QuantSpec
    entry = plugins.get_model(args.model)
    spec = entry.spec(args.config)
    native = entry.native_quant or spec.quant
    q = QuantSpec(experts=native.experts if args.weights == "native" else args.weights,
                  dense=native.dense if args.weights == "native" else args.weights,
                  kv_cache=native.kv_cache if args.kv == "native" else args.kv)
    p = plan(spec, tp=args.tp, ep=args.ep, batch=args.batch, ctx=args.ctx, gpu=args.gpu, quant=q)
    print(f"{args.model} ({args.config}) per GPU at tp={p.tp} ep={p.ep}, batch {p.batch}, context {p.ctx}, "
          f"{p.gpu} at {p.bandwidth_tbs} TB/s; weights: experts {q.experts}, dense {q.dense}; KV {q.kv_cache}")
    print(f"{'layer':>5} {'kind':<12} {'weights':>11} {'KV/state':>11} {'floor µs':>9}  ops")
    for l in p.layers:
        print(f"{l.index:>5} {l.kind:<12} {_fmt_bytes(l.weight_bytes):>11} {_fmt_bytes(l.kv_bytes):>11} "
              f"{p.floor_us(l):>9.2f}  {len(l.ops) if args.brief else ', '.join(o.name for o in l.ops)}")
    print(f"{'head':>5} {'lm_head':<12} {_fmt_bytes(p.head.weight_bytes):>11} {'':>11} {p.floor_us(p.head):>9.2f}")
    print(f"step: {_fmt_bytes(p.total_bytes)} per GPU -> floor {p.step_floor_us:.1f} µs, "
          f"{p.tokens_per_s:,.0f} tok/s at batch {p.batch} (activations and all-reduce not counted)")
    if getattr(args, "program", False):
        print(program_report(spec, args.tp, args.ep, args.batch, args.ctx, args.weights))
    return 0


# the experts' formats of the one-launch programs, by plan's --weights name
PROGRAM_EXPERTS = {"bf16": "bf16", "fp8_block128": "fp8_e4m3", "mxfp4": "mxfp4"}


def program_report(spec, tp: int, ep: int, batch: int, ctx: int, weights: str, num_sms: int = 132) -> str:
    """Whether the one-launch-a-step program of one rank builds at these settings, and how it sits
    on the SMs: its ops, the busiest SM's instructions, its records (resident or through a window),
    its weight ring. The programs shard the experts over the tensor-parallel ranks (ep = tp)."""
    from .blocks.base import ring_geometry
    from .errors import UnsupportedConfigError
    from .megakernel import tp_model
    from .megakernel.program import records_geometry
    from .schedule import schedule
    if ep not in (1, tp):
        return (f"one-launch program: not built - the programs hold each rank's experts with its heads "
                f"(ep = tp); ep={ep}, tp={tp}")
    experts = PROGRAM_EXPERTS.get(weights, "bf16")
    plain = spec.residual.kind == "plain"
    cfg = (tp_model.TPModelConfig if plain else tp_model.TPMHCModelConfig)(
        spec, batch=batch, max_seq_len=ctx, ranks=tp, expert_dtype=experts, num_sms=num_sms)
    try:
        prog, _ = (tp_model.build_program if plain else tp_model.build_mhc_program)(cfg)
    except UnsupportedConfigError as exc:
        return f"one-launch program: refused - {exc}"
    max_len = schedule(prog, num_sms).max_len
    _, rec, window = records_geometry(prog.opcodes.blocks, max_len)
    stage, stages, _ = ring_geometry(prog.opcodes.blocks, reserved=rec)
    where = "all resident" if not window else f"through a window of {window} slots"
    return (f"one-launch program per rank ({experts} experts, {num_sms} SMs): {len(prog.ops)} ops, "
            f"{max_len} instructions on the busiest SM, records {where} ({rec / 1024:.1f} KB), "
            f"weight ring {stages} x {stage / 1024:.1f} KB")


def cmd_run(args) -> int:
    import torch
    from .api import build_megakernel
    from .reference.model import random_weights
    config = "tiny" if args.tiny else args.config
    mk = build_megakernel(args.model, config=config, backend=args.backend, tp=args.tp,
                          max_seq_len=args.prompt + args.tokens)
    mk.load_weights(random_weights(mk.spec, seed=args.seed))
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, mk.spec.vocab_size, (args.batch, args.prompt), generator=g)
    t0 = time.perf_counter()
    out = mk.generate(ids, args.tokens)
    dt = time.perf_counter() - t0
    print(f"{args.model} ({config}, random weights, backend {args.backend}"
          f"{f', {args.tp} tensor-parallel ranks' if args.tp > 1 else ''}): {mk.spec.num_layers} layers "
          f"[{', '.join(sorted(set(mk.spec.layer_kinds())))}]")
    print(f"  batch {args.batch}, prompt {args.prompt}, {args.tokens} new tokens in {dt:.2f} s: "
          f"{args.batch * args.tokens / dt:.1f} tok/s")
    print(f"  first row: {out[0, args.prompt:].tolist()}")
    return 0


def tiny_run_args(model: str, tokens: int = 16) -> argparse.Namespace:
    """`megakernel run MODEL --tiny`'s arguments (the demo's runs)."""
    return build_parser().parse_args(["run", model, "--tiny", "--tokens", str(tokens)])


def cmd_compile_check(args) -> int:
    try:
        import cutlass  # noqa: F401  (CuTe DSL: the `cute` extra)
    except ImportError:
        print("compile-check needs CuTe DSL: pip install -e '.[cute]'")
        return 1
    from .compile import compile_check, failures
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    programs = getattr(args, "programs", None)
    report = compile_check(archs, program_archs=None if programs is None else
                           [a.strip() for a in programs.split(",") if a.strip()])
    for arch, cases in report.items():
        print(f"compile-check {arch}:")
        for case, result in cases.items():
            print(f"  {'ok ' if not isinstance(result, str) else 'ERR'} {case}"
                  f"{f'  {result:.2f} s' if not isinstance(result, str) else '  ' + result}")
    bad = failures(report)
    print(f"compile-check: {sum(len(c) for c in report.values()) - len(bad)} compiled, {len(bad)} failed")
    return 1 if bad else 0


BENCHES = ("megakernel", "moe", "kda", "mla", "dsv4", "indexer", "allreduce", "ep", "layer", "model")


def cmd_bench(args) -> int:
    """`megakernel bench [NAME] [--out DIR] [--quick]`: bench/NAME_bench.py (default: megakernel)."""
    import importlib
    rest = list(args.rest)
    name = rest.pop(0) if rest and not rest[0].startswith("-") else "megakernel"
    if name not in BENCHES:
        print(f"megakernel bench: unknown benchmark {name!r}; one of: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    try:
        mod = importlib.import_module(f"bench.{name}_bench")
    except ImportError:
        print("megakernel bench runs from the source tree (the bench/ folder) on a CUDA GPU", file=sys.stderr)
        return 1
    mod.main(rest)
    return 0


def cmd_demo(args) -> int:
    """The main job on any machine: list models, run each tiny model, print plans (with one rank's
    one-launch program at that sharding), compile-check."""
    rc = cmd_models(args)
    for name in sorted(plugins.models()):
        print()
        rc |= cmd_run(tiny_run_args(name))
    for name in sorted(plugins.models()):
        e = plugins.get_model(name)
        # the 8-GPU expert-parallel preset where the model has one: the common H200/B200 node
        shard = e.shardings.get("ep8") or next(iter(e.shardings.values()), None)
        print()
        rc |= cmd_plan(argparse.Namespace(model=name, config="full", tp=shard.tp if shard else 1,
                                          ep=shard.ep if shard else 1, batch=1, ctx=32768, gpu="h200",
                                          weights="native", kv="native", brief=True, program=True))
    print()
    rc |= whole_model_check()
    if not args.skip_compile:
        print()
        # the blocks for the three archs, the larger programs for sm_90a only (for all three
        # they took ~50 min on 2 cores)
        rc |= cmd_compile_check(argparse.Namespace(arch="sm_90a,sm_100a,sm_103a", programs="sm_90a"))
    return rc


def whole_model_check(steps: int = 4) -> int:
    """The whole-model megakernel programs (one launch a step) on the PyVM beside the reference
    backend, on the same bf16 random weights: the logits' relative difference per step. DeepSeek-V4.1
    (2 layers in the blocks' shapes: SWA + HCA, hash-routed MoE), Kimi K3 ("small": KDA, MLA, KDA,
    MLA; dense then latent MoE) and GLM-5.3 ("small": KDA, DSA, shared DSA, KDA, DSA; dense then
    MoE); each also over 2 tensor-parallel ranks (one program per rank, the multi-rank PyVM)."""
    import torch
    from .api import build_megakernel
    from .reference.model import random_weights
    v41 = {**plugins.get_model("deepseek_v41_flash").configs["small_v41"](), "num_hidden_layers": 2,
           "mlp_layer_types": ["hash_moe"] * 2, "layer_types": ["sliding_attention", "heavily_compressed_attention"]}
    rc = 0
    for name, config, layers, tp in (("deepseek_v41_flash", v41, "2 layers", 1), ("kimi_k3", "small", "4 layers", 1),
                                     ("kimi_k3", "small", "4 layers", 2), ("glm_53", "small", "5 layers", 1),
                                     ("glm_53", "small", "5 layers", 2), ("deepseek_v41_flash", v41, "2 layers", 2)):
        ref = build_megakernel(name, config, dtype=torch.bfloat16, max_seq_len=16, max_batch=2)
        mk = build_megakernel(name, config, backend="megakernel", tp=tp, max_seq_len=16, max_batch=2)
        w = random_weights(ref.spec)
        if name != "deepseek_v41_flash":      # a correction bias (std 100) far wider than the scores (0..1): the
            # selection is the bias's, so the two sides' ~1e-2 bf16 differences cannot flip a near-tie
            w = {k: 5000 * v if k.endswith("e_score_correction_bias") else v for k, v in w.items()}
        w = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}
        ref.load_weights(w)
        mk.load_weights(w)
        prog = mk.new_state(2).prog
        where = (f"over {tp} tensor-parallel ranks, one launch per rank a step, {len(prog.ops)} ops a rank; run by the "
                 "multi-rank PyVM" if tp > 1 else f"{len(prog.ops)} ops, one launch a step; run by the PyVM")
        print(f"{name} whole-model megakernel program ({layers}, batch 2) {where} (the blocks' torch twins)")
        s_ref, s_mk = ref.new_state(2), mk.new_state(2)
        g = torch.Generator().manual_seed(0)
        errs = []
        for _ in range(steps):
            ids = torch.randint(0, ref.spec.vocab_size, (2, 1), generator=g)
            a, b = ref.decode(ids, s_ref).float(), mk.decode(ids, s_mk).float()
            errs.append(((b - a).norm() / a.norm()).item())
        print("  logits vs the reference backend, rel diff per step: " + " ".join(f"{e:.1e}" for e in errs))
        rc |= 0 if max(errs) < 5e-2 else 1
    return rc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megakernel", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list plugins and models").set_defaults(fn=cmd_models)

    pl = sub.add_parser("plan", help="per-layer bytes and the bandwidth floor per GPU")
    pl.add_argument("model")
    pl.add_argument("--config", default="full")
    pl.add_argument("--tp", type=int, default=1)
    pl.add_argument("--ep", type=int, default=1)
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--ctx", type=int, default=4096)
    pl.add_argument("--gpu", default="h200", choices=["h200", "b200", "gb300"])
    pl.add_argument("--weights", default="native", help="native | bf16 | fp8_block128 | mxfp4 | nvfp4")
    pl.add_argument("--kv", default="native", help="native | bf16 | fp8 | fp32 | v41 (DeepSeek-V4.1's per-cache "
                                                   "formats: 528 / 288 / 68 B a token)")
    pl.add_argument("--brief", action="store_true", help="count each layer's ops instead of naming them")
    pl.add_argument("--program", action="store_true", help="also build one rank's one-launch program (tp ranks, "
                                                            "experts sharded with them): does it fit, how it sits")
    pl.set_defaults(fn=cmd_plan)

    r = sub.add_parser("run", help="a random-weight model end to end")
    r.add_argument("model")
    r.add_argument("--tiny", action="store_true")
    r.add_argument("--config", default="tiny")
    r.add_argument("--backend", default="reference")
    r.add_argument("--tp", type=int, default=1, help="megakernel backend: tensor-parallel ranks")
    r.add_argument("--batch", type=int, default=2)
    r.add_argument("--prompt", type=int, default=8)
    r.add_argument("--tokens", type=int, default=16)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("compile-check", help="compile every block and the megakernel without a GPU")
    c.add_argument("--arch", default="sm_90a,sm_100a,sm_103a")
    c.add_argument("--programs", default=None, help="the archs (of --arch) that also compile the larger programs "
                                                    "(sublayers, layers, whole models); default all")
    c.set_defaults(fn=cmd_compile_check)

    b = sub.add_parser("bench", help="GPU benchmarks: [NAME] [--out DIR] [--quick]; NAME one of "
                                     + ", ".join(BENCHES) + " (JSON into bench/results/<gpu>/)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    d = sub.add_parser("demo", help="the main job: tiny models, plans, compile-checks")
    d.add_argument("--skip-compile", action="store_true")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except SdkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
