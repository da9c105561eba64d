"""The megakernel's instruction stream, run by the PyVM on CPU, equals the torch reference; the
schedule is valid; broken streams (unsatisfiable waits, cycles) are detected, not hung on."""
import numpy as np
import pytest
import torch

from sdk.megakernel import isa
from sdk.megakernel.mlp_stack import MLPStackConfig, build_program, make_weights, reference
from sdk.megakernel.program import encode
from sdk.megakernel.pyvm import PyVM
from sdk.schedule import ScheduleError, schedule, validate

TINY = dict(hidden=1024, intermediate=512, layers=3)


def _vm(cfg, num_sms=8, seed=0):
    prog = build_program(cfg)
    weights = make_weights(cfg, seed=seed)
    vm, sched = PyVM.from_program(prog, num_sms, weights)
    return prog, sched, vm, weights


@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("batch,limit,fuse", [(1, None, None), (3, 2.0, None), (1, None, False), (3, None, True)])
def test_pyvm_mlp_stack_equals_reference(wd, batch, limit, fuse):
    cfg = MLPStackConfig(**TINY, batch=batch, weight_dtype=wd, swiglu_limit=limit, fuse_norm=fuse)
    prog, sched, vm, weights = _vm(cfg)
    for step in range(3):      # several steps: the counters' epochs, never reset
        x = torch.randn(batch, cfg.hidden).to(torch.bfloat16)
        vm.tensors["x"].copy_(x)
        for name in ("out", "resid", "normed", "act"):
            if name in vm.tensors:
                vm.tensors[name].fill_(float("nan"))
        vm.step(seed=step)
        ref = reference(cfg, weights, x)
        out = vm.tensors["out"].float()
        assert torch.isfinite(out).all()
        err = ((out - ref).norm() / ref.norm()).item()
        assert err <= 1e-2, f"step {step}: relative error {err:.3e}"
    assert vm.counters[isa.EXIT_COUNTER] == 3 * len(sched.per_sm)


def test_pyvm_order_independent():
    """Two legal interleavings give bit-identical results (tiles write disjoint outputs)."""
    cfg = MLPStackConfig(**TINY, batch=2)
    outs = []
    for seed in (1, 2):
        _, _, vm, _ = _vm(cfg)
        torch.manual_seed(0)
        vm.tensors["x"].copy_(torch.randn(2, cfg.hidden).to(torch.bfloat16))
        vm.step(seed=seed)
        outs.append(vm.tensors["out"].clone())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("norm,residual", [(False, None), (True, "fp32"), (True, "bf16")])
def test_blocks_emulation_equals_block_reference(wd, norm, residual):
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    from sdk.megakernel.mlp_stack import quantize_fp8
    b = GemvBlock(GemvConfig(n=256, k=512, m=2, weight_dtype=wd, swiglu=True, swiglu_limit=1.0, norm=norm,
                             x_dtype="fp32" if norm else "bf16", residual=residual, out_dtype="fp32"))
    t = b.alloc_operands()
    for n in ("w_gate", "w_up"):
        w = (torch.randn(256, 512) / 20).to(torch.bfloat16)
        if wd == "fp8_e4m3":
            t[n], t[n + "_scale"] = quantize_fp8(w)
        else:
            t[n] = w
    t["x"] = (torch.randn(2, 512) * 3).to(t["x"].dtype)
    if norm:
        t["norm_weight"] = (1 + 0.1 * torch.randn(512)).to(torch.bfloat16)
    if residual:
        t["res"] = torch.randn(2, 256).to(t["res"].dtype)
    ref = b.reference(**t)["y"]
    for tile in range(b.num_tiles()):
        b.emulate_tile(t, tile)
    assert ((t["y"].float() - ref).norm() / ref.norm()) < 1e-2


def test_gemv_ring_geometry():
    """Chunks of 16-34 KB (taller tiles take wider stages); the ring of the MLP stack's blocks fits
    the smem budget with >= 64 KB of every block's weights in flight per SM (2x what the H200's
    bandwidth x latency needs) and at least 4 stages."""
    from sdk.blocks.base import SMEM_BUDGET, ring_geometry
    for wd in ("bf16", "fp8_e4m3"):
        for inter in (2048, 4096, 12288, 18432):
            for batch in (1, 8, 64):
                prog = build_program(MLPStackConfig(hidden=7168, intermediate=inter, layers=1, batch=batch,
                                                    weight_dtype=wd))
                blocks = prog.opcodes.blocks
                stage, stages, xbytes = ring_geometry(blocks)
                assert 8 * 1024 <= stage <= 34 * 1024
                assert stages * stage + xbytes <= SMEM_BUDGET
                assert stages >= 4, (wd, inter, batch, stages)
                for b in blocks:
                    if b.stream_chunks():
                        assert b.stream_chunks() * b.chunk_k == b.config.k
                        assert stages * b.chunk_bytes() >= 64 * 1024, (wd, inter, batch, b, stages)


def test_schedule_valid_and_balanced():
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=1)
    prog = build_program(cfg)
    sched = schedule(prog, 132)
    validate(prog, sched.per_sm)
    # every instruction placed once, lists in topological (phase) order on every SM
    assert sorted(i for lst in sched.per_sm for i in lst) == list(range(len(prog.instructions)))
    for lst in sched.per_sm:
        phases = [prog.instructions[i].phase for i in lst]
        assert phases == sorted(phases)
    # with op-level dependencies every op is a phase: the best possible makespan is, per op,
    # ceil(tiles / SMs) rounds of its tile time plus one counter hop; the list scheduler meets it
    from sdk.schedule import HOP_NS, instruction_ns
    best = sum(-(-op.block.num_tiles() // 132) * instruction_ns(op.block, 132) + HOP_NS for op in prog.ops)
    assert sched.est_ns <= 1.01 * best, (sched.est_ns, best)
    # and the busy time over the whole step is spread evenly (remainder tiles rotate over SMs)
    assert sched.busy_ns.max() <= 1.10 * sched.busy_ns.mean()


def test_unsatisfiable_dependency_detected():
    cfg = MLPStackConfig(hidden=1024, intermediate=512, layers=1, batch=1)
    prog = build_program(cfg)
    ins = next(i for i in prog.instructions if i.waits)
    c, e = ins.waits[0]
    ins.waits = ((c, e + 1),)            # one signal more than ever comes
    sched = schedule(prog, 4)
    with pytest.raises(ScheduleError, match="only .* instructions signal it"):
        validate(prog, sched.per_sm)
    # the PyVM, which runs the encoded words without trusting validate(), reports the stuck wait
    words, lengths = encode(prog, sched.per_sm)
    tensors = PyVM.alloc(prog)
    tensors.update(make_weights(cfg))
    with pytest.raises(ScheduleError, match="deadlock"):
        PyVM(prog, words, lengths, tensors).step()


def test_cycle_detected():
    cfg = MLPStackConfig(hidden=1024, intermediate=512, layers=1, batch=1)
    prog = build_program(cfg)
    first = prog.ops[0]
    last = prog.ops[-1]
    # make the first op wait for the last one: a cycle through every op
    for i in first.instructions:
        prog.instructions[i].waits = ((last.counter, prog.expected[last.counter]),)
    sched = schedule(prog, 4)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(prog, sched.per_sm)


def test_encode_words():
    cfg = MLPStackConfig(hidden=1024, intermediate=512, layers=1, batch=1)
    prog = build_program(cfg)
    sched = schedule(prog, 4)
    words, lengths = encode(prog, sched.per_sm)
    assert words.dtype == np.int32 and words.shape[2] == isa.WORDS
    assert lengths.sum() == len(prog.instructions)
    # opcodes come from the registry: one per distinct (block, static config): the gate/up and
    # down of layer 0 (bf16 input x) and of the other layers (fp32 residual stream), final norm
    assert len(prog.opcodes) == 3    # layer-0 gate/up (+norm, SwiGLU), layer-0 down (+residual), final norm
    assert set(words[..., isa.OPCODE][words[..., isa.SIGNAL] >= 0].tolist()) == {0, 1, 2}
    two = build_program(MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=1))
    assert len(two.opcodes) == 5     # + gate/up and down of the layers reading the fp32 stream
    unfused = build_program(MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=1, fuse_norm=False))
    assert len(unfused.opcodes) == 5  # norm (bf16 src, fp32 src = the final norm), gate/up, 2 downs


def test_three_waits_and_no_more():
    from sdk.blocks.rmsnorm import RMSNormBlock, RMSNormConfig
    from sdk.errors import UnsupportedConfigError
    from sdk.megakernel.program import Program
    prog = Program()
    for name in ("a", "b", "c", "d", "e"):
        prog.buffer(name, (4, 1024), "bf16")
    prog.buffer("w", (1024,), "bf16", "weight")
    blk = RMSNormBlock(RMSNormConfig(d=1024, m=4, residual_in=False, write_resid=False))
    ops = [prog.op(blk, {"src": "a", "weight": "w", "out": n}, label=n) for n in ("b", "c", "d")]
    last = prog.op(blk, {"src": "b", "weight": "w", "out": "e"}, waits=ops, label="e")
    words, _ = encode(prog, schedule(prog, 2).per_sm)
    waits = [sorted(int(words[s, j, c]) for c, _ in isa.WAITS) for s in range(2) for j in range(words.shape[1])
             if words[s, j, isa.SIGNAL] == prog.ops[last].counter]
    assert waits and all(w == sorted(prog.ops[o].counter for o in ops) for w in waits)
    with pytest.raises(UnsupportedConfigError, match="at most 3"):
        prog.op(blk, {"src": "b", "weight": "w", "out": "a"}, waits=ops + [last], label="too many")


def test_gemv_fp8_int_decode_bits_are_exact():
    """GemvBlock's fp8_decode="int" bit placement (fp8_word_to_f32), emulated on int32 words: every
    e4m3 byte in every byte position gives exactly its value * 2^-120 (subnormals included)."""
    allb = torch.arange(256, dtype=torch.int64)
    vals = allb.to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = torch.isfinite(vals)
    for pos in range(4):
        w = (allb << (8 * pos)).to(torch.int64)
        w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)       # as the device's int32
        half, hi = pos % 2, pos // 2
        v = w.to(torch.int64) >> (8 * half)                                    # arithmetic shift
        pair = ((v & 0x007F007F) << 4) | ((v & 0x00800080) << 8)
        bits = (pair << 16) if hi == 0 else (pair & 0xFFFF0000)
        bits = (bits & 0xFFFFFFFF)
        bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
        got = bits.view(torch.float32).double() * 2.0 ** 120
        assert torch.equal(got[finite], vals[finite].double()), pos


@pytest.mark.parametrize("model", ["kimi_k3", "glm_53"])
def test_critical_path_order_is_topological_and_runs(model):
    """schedule(order="critical") places the routed experts' chain before the shared expert's
    branch and still validates (every SM's list topological, no deadlock)."""
    from sdk.megakernel.moe_layer import build_program, preset
    from sdk.schedule import op_order, schedule, validate
    prog = build_program(preset(model, 1))
    labels = []
    for i in op_order(prog, 132, order="critical"):
        lab = prog.ops[prog.instructions[i].op_index].label
        if lab not in labels:
            labels.append(lab)
    assert labels.index("experts.gateup") < labels.index("shared.down")
    assert labels.index("router.select") < labels.index("shared.gateup")
    validate(prog, schedule(prog, 132, order="critical").per_sm)
    with pytest.raises(ValueError, match="schedule order"):
        schedule(prog, 132, order="fastest")


@pytest.mark.parametrize("model,batch", [("kimi_k3", 1), ("kimi_k3", 8), ("glm_53", 1), ("glm_53", 64),
                                         ("deepseek_v41_flash", 8)])
def test_backfill_order_is_topological(model, batch):
    """order "backfill" (instructions inserted into idle gaps of an SM's list, before instructions
    placed earlier) keeps every SM's list in one global topological order: the simulation runs
    every instruction once, no deadlock; and it fills gaps - its estimated makespan is no longer
    than the critical order's it starts from."""
    from sdk.megakernel.moe_layer import build_program, preset
    from sdk.schedule import schedule, validate
    prog = build_program(preset(model, batch))
    sch = schedule(prog, 132, order="backfill")
    validate(prog, sch.per_sm)
    assert sorted(i for lst in sch.per_sm for i in lst) == list(range(len(prog.instructions)))
    assert sch.est_ns <= schedule(prog, 132, order="critical").est_ns + 1.0


@pytest.mark.parametrize("order", ["phase", "critical", "backfill"])
def test_schedule_estimate_is_a_simulation_of_its_costs(order):
    """bench/schedule_sim.simulate replaying a placement with the cost model's own tile times gives
    the schedule's estimated makespan exactly (the estimate IS that simulation), for the byte-based
    costs and for given costs (cost_ns: what schedule_sim passes from a measured timeline)."""
    from bench.schedule_sim import simulate
    from sdk.megakernel.moe_layer import build_program, preset
    from sdk.schedule import instruction_ns, schedule
    prog = build_program(preset("kimi_k3", 1, expert_dtype="mxfp4"))
    sch = schedule(prog, 132, order=order)
    assert simulate(prog, sch.per_sm, lambda ins: instruction_ns(ins.block, 132)) == pytest.approx(sch.est_ns)
    given = {ins.block.key(): 1000.0 + 37.0 * (sum(map(ord, ins.label.split("[")[0])) % 50) for ins in prog.instructions}
    sch = schedule(prog, 132, order=order, cost_ns=lambda block: given[block.key()])
    assert simulate(prog, sch.per_sm, lambda ins: given[ins.block.key()]) == pytest.approx(sch.est_ns)


def test_schedule_sim_replays_the_dsv4_sublayer():
    """schedule_sim rebuilds the V4.1 TP8 sublayer the bench ran ('dsv4:MODE:BATCH:CTX') and
    replays a record of it: with every tile 1 us, the span is at least the program's longest
    dependency chain (HCA: q_a -> q_b -> prologue -> decode -> combine -> o_a -> o_b, 7 tiles)."""
    from bench.schedule_sim import build, report
    prog = build("dsv4:hca:1:32768")
    labels = [op.label for op in prog.ops]
    assert {"v4.q_a", "v4.c_compress", "v4.decode", "v4.o_b"} <= set(labels)
    rec = {"start_ns": [0] * len(prog.instructions), "end_ns": [1000] * len(prog.instructions),
           "label": [ins.label for ins in prog.instructions]}
    spans = [float(x) for line in report(prog, rec)[1:] for x in line.split()[1:]]
    assert len(spans) == 6 and all(7.0 <= x < 40.0 for x in spans)
    with pytest.raises(ValueError, match="dsv4:MODE:BATCH:CTX"):
        build("dsv4:hca:1")


def _hfma2_dot(wq: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GemvBlock's fp8_decode="hfma2" arithmetic in torch: x scaled by the power of two 2^s that
    puts max |x| in [8, 16) (the device's per-token scale) and rounded to f16; per 16-weight unit,
    pairs (2p, 2p+1) of e4m3 -> f16 weights times x, accumulated as f16x2 in two chains of 4 pairs
    (each step rounded to f16: fma.rn.f16x2), the four f16 halves summed in fp32, times 2^-s.
    wq [N, K] float8_e4m3fn, x [K] -> [N] fp32."""
    n, k = wq.shape
    amax = x.float().abs().max()
    s = 3 - int(torch.floor(torch.log2(amax))) if amax > 0 else 126
    w = wq.float().view(n, k // 16, 8, 2)                    # [N, unit, pair, half]
    xs = (x.float() * 2.0 ** s).half().float().view(k // 16, 8, 2)
    acc = torch.zeros(n, k // 16, 2, 2)                      # [N, unit, chain, half]
    for p in range(4):
        for chain in range(2):
            q = 2 * p + chain
            acc[:, :, chain] = (w[:, :, q] * xs[:, q] + acc[:, :, chain]).half().float()
    assert acc.abs().max() < 65504
    return acc.sum(dim=(2, 3)).sum(dim=1) * 2.0 ** -s


def test_gemv_fp8_hfma2_numerics_over_any_activation_range():
    """The arithmetic of fp8_decode="hfma2" (emulated in torch: a check of the design's range and
    rounding; the kernel itself is tests/gpu/test_megakernel_gpu.py::test_gemv_fp8_alternative_decodes)
    - packed-f16 products and partial sums against the fp64 dot product,
    DeepSeek-style fp8 weights (the whole e4m3 range), activations of rms 1e-4 .. 1e5: the
    per-token power-of-two scale (max |x| into [8, 16)) keeps every f16 4-term sum under 65504 and
    the values normal, so the error stays ~4e-4 (bf16 outputs round at 2^-8)."""
    torch.manual_seed(0)
    k = 7168
    wq = (torch.randn(64, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    for amp in (1e-4, 1e-2, 1.0, 100.0, 1e5):
        x = (torch.randn(k) * amp).to(torch.bfloat16)
        got = _hfma2_dot(wq, x)
        want = wq.double() @ x.double()
        assert torch.isfinite(got).all(), amp
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1.5e-3, (amp, err)


def test_missing_or_misshaped_weights_are_named_before_a_launch():
    """PyVM.from_program / program_runtime check the weight buffers first (program.check_weights):
    a missing, mis-shaped or mistyped weight is a WeightsMismatchError naming it - not zeros or
    garbage inside the kernel. Extra keys are fine (one dict may serve several programs)."""
    from sdk.errors import WeightsMismatchError
    from sdk.megakernel.program import check_weights
    cfg = MLPStackConfig(**TINY, batch=1)
    prog = build_program(cfg)
    w = make_weights(cfg, seed=0)
    name = next(n for n, b in prog.buffers.items() if b.role == "weight" and len(b.shape) == 2)
    check_weights(prog, {**w, "unrelated": torch.zeros(3)})
    other = w[name].float() if w[name].dtype != torch.float32 else w[name].half()
    for bad, word in (({k: v for k, v in w.items() if k != name}, "missing"),
                      ({**w, name: w[name][:, :8]}, "mis-shaped"),
                      ({**w, name: other}, "wrong dtype")):
        with pytest.raises(WeightsMismatchError, match=f"{word}.*{name}") as err:
            PyVM.from_program(prog, 8, bad)
        assert name in str(err.value)
