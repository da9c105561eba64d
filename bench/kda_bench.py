"""KDA decode block on the GPU: per-GPU shapes of Kimi K3 at TP8 (12 heads x 128 x 128) and
GLM-5.3 at TP8 (8 heads), batch 1, 8, 64; each beside the same work in PyTorch under a CUDA graph
and the floor (state bytes read + written / copy bandwidth measured in this run:
bench/common.copy_bandwidth, read + write bytes).

    python -m bench.kda_bench --out bench/results/h200 [--quick] [--match "B=64 stream" ...]

Variants: "core" (gate math + l2norm + delta rule; q, k, v given) with v_split 1 / 2 / 4 (tiles
per head), "stream" (the core as a streaming block: a persistent grid, one tile per head, its
V-slices through the smem ring; "2/SM": two CTAs per SM), "megakernel layers" (enough layers
for their states to exceed the L2 in ONE megakernel launch, layer l+1's v = layer l's output,
beside the same layers as standalone PDL launches: bench_chain), "sublayer" (the whole KDA sublayer
with its projections in one launch: bench_sublayer), "fused" (short conv + core + gated output norm, v_split 1; the conv outputs staged in
shared memory), "fused ... per-lane" (conv_staged=False: each conv output computed by every lane
that reads it), "bf16" (bf16 state), and "verify4" (4-token verify pass, commit none, + the
commit pass re-running 2 accepted tokens); at batch 64 also k_warps 1 / 8 and "no-pdl".
The block's standalone kernel (one CTA per tile) launches with PDL (`standalone(block,
pdl=True)`, its opt-in): every CTA waits for the previous grid before its first read, only the
launch overlaps (H200, K3 TP8 batch 64 core v_split 4: 82.1% of copy vs 80.4% without).
Every timing replays a CUDA graph of calls rotating over enough state copies to exceed the L2
(no call finds its state in cache); the inputs (q, k, v, g, beta: a few KB, what the previous
GEMVs just wrote) are shared. JSON: commit, command, GPU, copy bandwidth, per case us, state
GB/s, fraction of the floor, the torch graph's us and the speed-up, and the kernel's error
against the fp32 reference on the timed configuration.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from bench.common import (add_match_option, arg_parser, copy_bandwidth, cu_stream, name_matches, record_timeline,
                          run_record, summary_lines, timed, write_json)

L2_FLUSH_BYTES = 128 << 20      # state copies per timed graph: 2.5x the H200's 50 MB L2
MODELS = {"kimi_k3_tp8": 12, "glm53_tp8": 8}


# ------------------------------------------------------------------ the torch baseline
def torch_step(block, t, state, conv_state=None, n_tokens=None):
    """The block's work as unfused PyTorch (fp32 math, the state updated in place)."""
    c = block.config
    B, T, H, K = c.batch, c.tokens, c.heads, c.head_dim
    T = n_tokens or T
    if c.conv:
        W1 = c.conv_kernel - 1
        full = torch.cat([conv_state, t["qkv"][:, :T].transpose(1, 2)], dim=-1)
        conv_state.copy_(full[..., -W1:])
        w = t["conv_w"]
        y = F.conv1d(full.to(w.dtype), w[:, None, :], groups=w.shape[0])[..., -T:]
        q, k, v = F.silu(y).to(torch.bfloat16).transpose(1, 2).reshape(B, T, 3, H, K).unbind(2)
    else:
        q, k, v = t["q"][:, :T], t["k"][:, :T], t["v"][:, :T]
    g = t["g"][:, :T].float()
    if c.gate_kind == "sigmoid":
        a = c.gate_lower_bound * torch.sigmoid(t["a_log"].exp()[:, None] * (g + t["dt_bias"].view(H, K)))
    elif c.gate_kind == "softplus":
        a = -t["a_log"].exp()[:, None] * F.softplus(g + t["dt_bias"].view(H, K))
    else:
        a = g
    beta = torch.sigmoid(t["beta"][:, :T].float())
    q = F.normalize(q.float(), dim=-1) * K ** -0.5
    k = F.normalize(k.float(), dim=-1)
    s = state.float()
    outs = []
    for i in range(T):
        s = s * a[:, i].exp()[..., None]
        kv = torch.einsum("bhkv,bhk->bhv", s, k[:, i])
        s = s + k[:, i, :, :, None] * ((v[:, i].float() - kv) * beta[:, i, :, None])[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
    if c.commit in ("all", "accepted"):
        state.copy_(s)
    o = torch.stack(outs, 1)
    if c.out_norm:
        o = F.rms_norm(o, (K,), t["norm_w"].float(), c.norm_eps) * torch.sigmoid(t["out_gate"][:, :T].float())
    return o.to(torch.bfloat16)


# ------------------------------------------------------------------ KDA layers in one megakernel launch
PER_LAYER = ("state", "conv_state", "o", "states_out")


def layer_chain(block, layers: int):
    """A megakernel program of `layers` KDA ops of `block`, in one launch as a model's layers
    are: each layer its own state (and conv state, output); without the conv, layer l+1's v is
    layer l's output o and the op waits for layer l (a dependency through the launch's
    counters), with the conv the layers are independent. Per-layer buffers are named
    f"{operand}{l}" (PER_LAYER), the others are shared by the layers. Returns the Program."""
    from sdk.megakernel.program import Program
    prog = Program()
    specs = block.operand_specs()
    chained = any(s.name == "v" for s in specs)
    for s in specs:
        names = [f"{s.name}{i}" for i in range(layers)] if s.name in PER_LAYER else [s.name]
        for n in names:
            prog.buffer(n, s.shape, s.dtype, role="output" if s.output else "input")
    prev = None
    for i in range(layers):
        bind = {s.name: f"{s.name}{i}" if s.name in PER_LAYER else s.name for s in specs}
        if chained and i > 0:
            bind["v"] = f"o{i - 1}"
        prev = prog.op(block, bind, waits=[prev] if chained and prev is not None else [], label=f"kda{i}")
    return prog


def layer_chain_inputs(block, layers: int, seed: int, device="cpu") -> dict:
    """Fresh random tensors for every buffer of layer_chain(block, layers): the shared operands
    and each layer's own state / conv state from block.random_operands (outputs NaN-poisoned)."""
    per = [block.random_operands(seed=seed + 1000 * i, device=device) for i in range(layers)]
    t = {n: v for n, v in per[0].items() if n not in PER_LAYER}
    for i, ti in enumerate(per):
        t.update({f"{n}{i}": v for n, v in ti.items() if n in PER_LAYER})
    return t


def layer_chain_reference(block, t: dict, layers: int) -> dict:
    """The fp32 reference of layer_chain's launch from the tensors `t` (program buffer names):
    {buffer name: expected value} for every per-layer output; a chained layer's v is the bf16
    of the previous layer's reference output (what the device writes and reads)."""
    chained = "v" in block.operands()
    out = {}
    for i in range(layers):
        ti = {n: t[f"{n}{i}" if n in PER_LAYER else n] for n in block.operands() if (f"{n}{i}" in t or n in t)}
        if chained and i > 0:
            ti["v"] = out[f"o{i - 1}"].to(torch.bfloat16)
        for name, v in block.reference(**ti).items():
            out[f"{name}{i}"] = v
    return out


# ------------------------------------------------------------------ one case
def bench_case(model, heads, batch, variant, kw, copy_bw, check=True):
    from sdk.blocks._cute import standalone
    from sdk.blocks.base import coresident_stages
    from sdk.blocks.kda import KDABlock, KDAConfig
    # launched with PDL unless a variant's dict says "pdl": False (standalone's pdl); the streaming
    # form's persistent grid is one CTA per SM unless it says "ctas_per_sm"
    launch_keys = ("pdl", "ctas_per_sm")
    blocks = [KDABlock(KDAConfig(batch=batch, heads=heads, head_dim=128,
                                 **{n: v for n, v in k.items() if n not in launch_keys})) for k in kw]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launcher(b, k):
        if "ctas_per_sm" not in k:
            return standalone(b, pdl=k.get("pdl", True))
        # N CTAs of this launch per SM: the ring sized so that N fit one SM's shared memory
        n = k["ctas_per_sm"]
        return standalone(b, pdl=k.get("pdl", True), num_ctas=sms * n, max_stages=coresident_stages([b], ctas=n))
    fns = [launcher(b, k) for b, k in zip(blocks, kw)]
    # the last block has every operand (verify4's commit pass adds n_accepted)
    t = blocks[-1].random_operands(seed=batch, device="cuda", n_accepted=[2] * batch)
    one_state = t["state"].numel() * t["state"].element_size()
    copies = max(2, -(-L2_FLUSH_BYTES // one_state))
    states = [t["state"].clone() for _ in range(copies)]
    conv_states = [t["conv_state"].clone() for _ in range(copies)] if "conv_state" in t else None
    tables = []
    for i in range(copies):
        per = []
        for b in blocks:
            tt = dict(t, state=states[i])
            if conv_states:
                tt["conv_state"] = conv_states[i]
            per.append(torch.tensor([tt[n].data_ptr() for n in b.operands()], dtype=torch.int64, device="cuda"))
        tables.append(per)
    # correctness of the timed configuration (first block, first copy), output poisoned first
    err = None
    if check:
        ref = blocks[0].reference(**dict(t, state=states[0].clone(),
                                         **({"conv_state": conv_states[0].clone()} if conv_states else {})))
        t["o"].fill_(float("nan"))
        fns[0](tables[0][0].data_ptr(), cu_stream())
        torch.cuda.synchronize()
        fin = torch.isfinite(ref["o"])
        err = ((t["o"].float()[fin] - ref["o"][fin]).norm() / ref["o"][fin].norm()).item()
        if not torch.isfinite(t["o"].float()[fin]).all():
            err = float("nan")
        for s, s0 in zip(states, [t["state"]] * copies):      # restore the states
            s.copy_(s0)

    def call(i):
        for fn, tab in zip(fns, tables[i]):
            fn(tab.data_ptr(), cu_stream())
    us, mode = timed([lambda i=i: call(i) for i in range(copies)] * max(1, 128 // copies))

    def tcall(i):
        for b in blocks:
            n = 2 if b.config.commit == "accepted" else None
            torch_step(b, t, states[i], conv_states[i] if conv_states else None, n)
    torch_us, _ = timed([lambda i=i: tcall(i) for i in range(copies)])
    state_bytes = sum(b.state_bytes() for b in blocks)
    floor_us = state_bytes / (copy_bw * 1e3)
    total_bytes = sum(b.cost().bytes * b.num_tiles() for b in blocks)
    return {"case": f"{model} B={batch} {variant}", "model": model, "heads": heads, "batch": batch,
            "variant": variant, "configs": [str(b.config) for b in blocks], "tiles": blocks[0].num_tiles(),
            "state_bytes": state_bytes, "total_bytes": total_bytes, "us": us,
            "gbs": state_bytes / (us * 1e3), "total_gbs": total_bytes / (us * 1e3),
            "floor_us": floor_us, "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us,
            "speedup_vs_torch_graph": torch_us / us, "timing_mode": mode, "rel_err": err,
            "state_copies": copies,
            "launch": [{"pdl": k.get("pdl", True), "ctas_per_sm": k.get("ctas_per_sm")} for k in kw]}


def bench_chain(model, heads, batch, variant, kw, copy_bw):
    """`layers` KDA layers (layer_chain: layer l+1's v = layer l's output) in ONE megakernel
    launch, against the same layers as standalone launches (PDL) and as PyTorch, one CUDA graph
    of steps each. Enough layers that their states exceed the L2 (every layer's state comes from
    HBM). kw: the KDAConfig fields, plus "pdl" (MegakernelRuntime's) if wanted."""
    from sdk.blocks._cute import standalone
    from sdk.blocks.kda import KDABlock, KDAConfig
    from sdk.megakernel.runtime import program_runtime
    kw = dict(kw)
    pdl = kw.pop("pdl", False)
    block = KDABlock(KDAConfig(batch=batch, heads=heads, head_dim=128, **kw))
    one_state = block.state_bytes() // 2
    L = max(2, -(-L2_FLUSH_BYTES // one_state))
    prog = layer_chain(block, L)
    t = layer_chain_inputs(block, L, seed=batch, device="cuda")
    ref = layer_chain_reference(block, t, L)
    rt = program_runtime(prog, {}, inputs={k: v.clone() for k, v in t.items()}, pdl=pdl)
    rt.run()
    last = f"o{L - 1}"
    err = ((rt.tensors[last].float() - ref[last]).norm() / ref[last].norm()).item()
    us, mode = timed([rt.launch] * 8)
    rt.check()
    # the same layers as standalone launches (PDL), on the runtime's buffers
    fn = standalone(block, pdl=True)
    tabs = [torch.tensor([rt.tensors[op.bindings[n]].data_ptr() if op.bindings.get(n) else 0
                          for n in block.operands()], dtype=torch.int64, device="cuda") for op in prog.ops]
    sa_us, _ = timed([lambda: [fn(tab.data_ptr(), cu_stream()) for tab in tabs]] * 8)

    def tstep():
        for i in range(L):
            ti = {n: rt.tensors[f"{n}{i}" if n in PER_LAYER else n] for n in block.operands()
                  if (f"{n}{i}" if n in PER_LAYER else n) in rt.tensors}
            if "v" in ti and i > 0:
                ti["v"] = rt.tensors[f"o{i - 1}"]
            rt.tensors[f"o{i}"].copy_(torch_step(block, ti, ti["state"], ti.get("conv_state")))
    torch_us, _ = timed([tstep])
    state_bytes = L * block.state_bytes()
    floor_us = state_bytes / (copy_bw * 1e3)
    return {"case": f"{model} B={batch} {variant}", "model": model, "heads": heads, "batch": batch,
            "variant": variant, "configs": [str(block.config)], "layers": L, "tiles": block.num_tiles(),
            "state_bytes": state_bytes, "us": us, "gbs": state_bytes / (us * 1e3), "floor_us": floor_us,
            "fraction_of_floor": floor_us / us, "standalone_pdl_us": sa_us,
            "standalone_fraction_of_floor": floor_us / sa_us, "torch_graph_us": torch_us,
            "speedup_vs_torch_graph": torch_us / us, "timing_mode": mode, "rel_err": err,
            "launch": {"megakernel_pdl": pdl}}


SUBLAYER_SHARDS = {"kimi_k3_tp8": dict(hidden=7168),
                   "glm53_tp8": dict(hidden=6144, output_gate_full_rank=False, conv_w_dtype="fp32")}


def bench_sublayer(model, heads, batch, variant, kw, copy_bw, timeline_path=None):
    """The whole KDA sublayer (sdk/megakernel/kda_layer.py: projections, conv + delta rule +
    gated norm, o_proj + residual) in ONE megakernel launch, against KDAReference.forward (+ the
    input norm and residual) as unfused PyTorch in bf16 under a CUDA graph, and the floor: weights
    + state read and written + conv state + activations. Launches alternate over enough copies of
    the weights and states to exceed the L2. timeline_path: also write the per-instruction record
    of one launch from a flushed L2 there (bench.timeline draws it)."""
    from sdk.megakernel.kda_layer import KDALayerConfig, build_program, make_inputs, make_weights, reference
    from sdk.megakernel.runtime import program_runtime
    cfg = KDALayerConfig(heads=heads, batch=batch, **SUBLAYER_SHARDS[model], **kw)
    prog = build_program(cfg)
    weight_bytes = prog.bytes_by_role("weight")
    # the caches one launch reads (and writes back): the recurrent state and the conv state
    state_rw = 2 * cfg.batch * heads * cfg.head_dim ** 2 * (4 if cfg.state_dtype == "fp32" else 2)
    conv_rw = 2 * cfg.batch * 3 * cfg.channels * (cfg.conv_kernel - 1) * 2
    cache_bytes = (state_rw + conv_rw) // 2
    one = weight_bytes + cache_bytes
    # weights AND states rotate (bench.common.rotated_launches shares the inputs: at batch 64 the
    # states are a third of a launch's bytes)
    copies = max(2, -(-L2_FLUSH_BYTES // one))
    rts, refs = [], []
    for i in range(copies):
        w = make_weights(cfg, seed=i, device="cuda")
        inp = make_inputs(cfg, seed=100 + i, device="cuda")
        rts.append(program_runtime(prog, w, inputs={k: v.clone() for k, v in inp.items()}))
        refs.append((w, inp))
    want = reference(cfg, *refs[0])
    rts[0].run()
    x = refs[0][1]["x"].float()
    err = ((rts[0].tensors["resid"] - x - (want["resid"] - x)).norm() / (want["resid"] - x).norm()).item()
    us, mode = timed([rt.launch for rt in rts] * max(1, 8 // copies))
    for rt in rts:
        rt.check()
    torch_us, _ = timed([lambda i=i: reference(cfg, *refs[i]) for i in range(copies)])
    if timeline_path:
        record_timeline(prog, rts[0].tensors, timeline_path, f"{model} B={batch} {variant}", us)
    M, D = cfg.tokens_total, cfg.hidden
    act_bytes = M * D * (2 + 4)                       # x in, resid out
    floor_bytes = weight_bytes + state_rw + conv_rw + act_bytes
    floor_us = floor_bytes / (copy_bw * 1e3)
    return {"case": f"{model} B={batch} {variant}", "model": model, "heads": heads, "batch": batch,
            "variant": variant, "configs": [str(cfg)], "weight_bytes": weight_bytes, "state_bytes": state_rw,
            "floor_bytes": floor_bytes, "us": us, "gbs": floor_bytes / (us * 1e3), "floor_us": floor_us,
            "fraction_of_floor": floor_us / us, "torch_graph_us": torch_us, "speedup_vs_torch_graph": torch_us / us,
            "timing_mode": mode, "rel_err": err, "copies": copies}


# tiles per head: enough tiles for the SMs at small batch; at batch 64 quarter heads, whose 32-column
# tiles take 4 warps across K (KDABlock.nwk): K3 TP8 80.4% of copy vs 68.4% whole heads (H200)
AUTO_SPLIT = {1: 4, 8: 2, 64: 4}


def cases(quick: bool):
    """quick: the auto v_split and the fused block everywhere, the other variants at batch 64."""
    out = []
    for model, heads in MODELS.items():
        for batch in (1, 8, 64):
            full = not quick or batch == 64
            splits = (1, 2, 4) if full else (AUTO_SPLIT[batch],)
            for vs in splits:
                out.append((model, heads, batch, f"core v_split={vs}", [dict(v_split=vs)]))
            out.append((model, heads, batch, "fused conv+norm", [dict(conv=True, out_norm=True)]))
            out.append((model, heads, batch, "fused conv+norm per-lane",
                        [dict(conv=True, out_norm=True, conv_staged=False)]))
            # the streaming form (KDAConfig.stream: tile = head, V-slices through the smem ring)
            out.append((model, heads, batch, "stream v_split=4", [dict(stream=True, v_split=4)]))
            if batch == 64:
                out.append((model, heads, batch, "stream v_split=4 2/SM", [dict(stream=True, v_split=4, ctas_per_sm=2)]))
                # where the streaming tile's time goes: no state stores (commit none), 32 KB chunks
                for name, extra in (("hpt=4 commit=none", dict(heads_per_tile=4, commit="none")),
                                    ("hpt=6", dict(heads_per_tile=6)), ("v_split=2 hpt=4", dict(v_split=2, heads_per_tile=4))):
                    if heads % extra["heads_per_tile"] == 0:
                        out.append((model, heads, batch, f"megakernel layers stream x {name}",
                                    [dict(dict(stream=True, v_split=4), **extra)]))
                for hpt in [n for n in (2, 3, 4) if heads % n == 0]:   # heads per tile: one begin per group
                    out.append((model, heads, batch, f"stream v_split=4 hpt={hpt}",
                                [dict(stream=True, v_split=4, heads_per_tile=hpt)]))
                    out.append((model, heads, batch, f"megakernel layers stream v_split=4 hpt={hpt}",
                                [dict(stream=True, v_split=4, heads_per_tile=hpt)]))
                # layers in one megakernel launch (bench_chain): the one-tile form walked by one
                # CTA per SM vs the streaming form (the next tiles' state loaded ahead)
                for name, extra in (("core v_split=4", dict(v_split=4)), ("stream v_split=4", dict(v_split=4, stream=True)),
                                    ("stream v_split=4 pdl", dict(v_split=4, stream=True, pdl=True)),
                                    ("conv+norm", dict(conv=True, out_norm=True))):
                    out.append((model, heads, batch, f"megakernel layers {name}", [extra]))
            if batch == 64:     # warps across K (KDAConfig.k_warps; the v_split=2 default is 4)
                for vs, kw_ in ((2, 1), (2, 8), (4, 1), (4, 4)):
                    out.append((model, heads, batch, f"core v_split={vs} k_warps={kw_}",
                                [dict(v_split=vs, k_warps=kw_)]))
                out.append((model, heads, batch, "core v_split=4 no-pdl", [dict(v_split=4, pdl=False)]))
                out.append((model, heads, batch, "fused conv+norm no-pdl", [dict(conv=True, out_norm=True, pdl=False)]))
            out.append((model, heads, batch, "sublayer", [{}]))        # the whole KDA sublayer, one launch
            for rows in (0, 16):      # the x-reading GEMVs' tiles: each balanced alone / 16 rows (default 32)
                out.append((model, heads, batch, f"sublayer x_gemv_rows={rows}", [dict(x_gemv_rows=rows)]))
            if full:
                vs = AUTO_SPLIT[batch]
                out.append((model, heads, batch, f"bf16 state v_split={vs}", [dict(v_split=vs, state_dtype="bf16")]))
                out.append((model, heads, batch, f"verify4+commit2 v_split={vs}",
                            [dict(v_split=vs, tokens=4, commit="none"), dict(v_split=vs, tokens=4, commit="accepted")]))
    return out


def run(out_dir: str, quick: bool = False, match: list[str] | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()["copy"]
    print(f"GPU {props.name}, {props.multi_processor_count} SMs; copy bandwidth {copy_bw:.0f} GB/s")
    results = []
    for model, heads, batch, variant, kw in cases(quick):
        name = f"{model} B={batch} {variant}"
        if not name_matches(name, match):
            continue
        try:
            if variant.startswith("megakernel"):
                r = bench_chain(model, heads, batch, variant, kw[0], copy_bw)
            elif variant.startswith("sublayer"):
                tl = os.path.join(out_dir, f"timeline_kda_sublayer_{model}_b{batch}.json") if batch == 1 else None
                r = bench_sublayer(model, heads, batch, variant, kw[0], copy_bw, tl)
            else:
                r = bench_case(model, heads, batch, variant, kw, copy_bw)
        except Exception as exc:
            r = {"case": f"{model} B={batch} {variant}", "error": f"{type(exc).__name__}: {exc}"}
        print(_line(r), flush=True)
        results.append(r)
        torch.cuda.empty_cache()
        # written after every case: a session cut short by its time limit keeps what ran
        report = run_record(props, copy_bw, results)
        write_json(out_dir, "kda_bench.json", report)
    return report


def _line(r) -> str:
    if "error" in r:
        return f"{r['case']:<44} ERROR {r['error'][:300]}"
    err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
    return (f"{r['case']:<44} {r['us']:8.2f} us {r['gbs']:6.0f} GB/s  floor {r['fraction_of_floor']*100:5.1f}%  "
            f"torch-graph {r['torch_graph_us']:8.1f} us  x{r['speedup_vs_torch_graph']:5.1f}  err {err}")


def summary(report) -> str:
    return summary_lines(report, _line)


def main(argv=None):
    ap = arg_parser(__doc__.splitlines()[0])
    add_match_option(ap)
    a = ap.parse_args(argv)
    rep = run(a.out, quick=a.quick, match=a.match)
    print("\n" + summary(rep))


if __name__ == "__main__":
    main()
