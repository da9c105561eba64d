"""GPU tests (the H200): every block standalone and the one-launch MLP stack against the torch
fp32 reference, fresh random inputs, outputs poisoned with NaN before each run; the bounded wait
turning an unsatisfiable dependency into KernelTimeoutError. Run: `pytest -m gpu tests/gpu`."""
import pytest
import torch

from harness import need_gpu, rel_err, run_standalone

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2     # relative Frobenius error vs the fp32 reference (the bound)


def gemv_inputs(block, gen_seed):
    from sdk.megakernel.mlp_stack import quantize_fp8
    c = block.config
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    xdt = torch.bfloat16 if c.x_dtype == "bf16" else torch.float32
    t = {"x": (torch.randn(c.m, c.groups * c.k, device="cuda", generator=g) * (3.0 if c.norm else 1.0)).to(xdt)}
    names = ("w_gate", "w_up") if c.swiglu else ("w",)
    for n in names:
        w = (torch.randn(c.n, c.k, device="cuda", generator=g) * c.k ** -0.5).to(torch.bfloat16)
        if c.weight_dtype == "fp8_e4m3":
            t[n], t[n + "_scale"] = quantize_fp8(w)
        else:
            t[n] = w
    if c.norm:
        t["norm_weight"] = (1 + 0.1 * torch.randn(c.k, device="cuda", generator=g)).to(torch.bfloat16)
    dt = torch.bfloat16 if c.out_dtype == "bf16" else torch.float32
    t["y"] = torch.full((c.m, c.n), float("nan"), dtype=dt, device="cuda")
    if c.residual:
        t["res"] = torch.randn(c.m, c.n, device="cuda", generator=g).to(
            torch.bfloat16 if c.residual == "bf16" else torch.float32)
    return t


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("swiglu", [False, True])
def test_gemv_block(m, wd, swiglu):
    """The persistent streaming GEMV (ring of cp.async chunks), tiles > SMs so CTAs walk several
    tiles and the ring crosses tile boundaries."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=2048, k=2048, m=m, weight_dtype=wd, swiglu=swiglu,
                                 swiglu_limit=3.0 if swiglu else None))
    t = gemv_inputs(block, 100 + m)
    run_standalone(block, t)
    ref = block.reference(**t)["y"]
    assert rel_err(t["y"], ref) <= BF16_TOL


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
def test_gemv_grouped(m, wd):
    """V4.1-Flash's o_a on one GPU: 8 groups of 1024 rows, each over its own 4096 columns of x
    (GemvConfig.groups); 8192 rows in 16-row tiles: a CTA walks tiles of several groups, each
    staging its group's x."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=8 * 1024, k=4096, m=m, groups=8, weight_dtype=wd, rows_per_tile=16))
    t = gemv_inputs(block, 300 + m)
    run_standalone(block, t)
    ref = block.reference(**t)["y"]
    assert rel_err(t["y"], ref) <= BF16_TOL
    # each group against its own product (a wrong group's x would be another random product)
    x, w = t["x"].float(), block.dequant(t["w"], t.get("w_scale"))
    for j in range(8):
        want = x[:, j * 4096:(j + 1) * 4096] @ w[j * 1024:(j + 1) * 1024].T
        assert rel_err(t["y"][:, j * 1024:(j + 1) * 1024], want) <= BF16_TOL, f"group {j}"


@pytest.mark.parametrize("m,norm,decode", [(1, False, "int"), (1, True, "int"), (4, True, "int"), (4, False, "int"),
                                           (1, False, "hfma2"), (1, True, "hfma2"), (4, True, "hfma2"),
                                           (2, False, "hfma2"), (1, False, "hfma2_alu"), (1, True, "hfma2_alu"),
                                           (4, True, "hfma2_alu"), (2, False, "hfma2_alu")])
def test_gemv_fp8_alternative_decodes(m, norm, decode):
    """fp8_decode="int" (e4m3 bits placed into bf16, x staged * 2^64), "hfma2" (packed f16 FMAs,
    x staged as f16 with a per-token power-of-two scale) and "hfma2_alu" (its e4m3 -> f16 in
    integer ops, x staged in the pairs' order): plain, fused norm merged (m = 1) and staged per x
    block (m = 4), SwiGLU, tiles > SMs."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=1024, k=7168, m=m, weight_dtype="fp8_e4m3", swiglu=True, norm=norm,
                                 fp8_decode=decode, rows_per_tile=8))
    t = gemv_inputs(block, 300 + m)
    run_standalone(block, t)
    assert rel_err(t["y"], block.reference(**t)["y"]) <= BF16_TOL


@pytest.mark.parametrize("m,n,k,rows,swiglu,norm,residual", [
    (1, 2048, 2048, 8, False, False, "bf16"),     # 256 tiles: CTAs walk several, the ring crosses them
    (1, 1024, 7168, 8, True, True, None),         # the gate/up shape, fused norm (two-pass)
    (2, 7168, 2048, 64, False, False, None),      # the down shape, 3 pieces x 2 tokens
    (4, 1024, 7168, 16, True, True, None),        # 2 pieces x 4 tokens
    (1, 1024, 18432, 16, False, False, None),     # x staged in 3 blocks, each with its own scale
])
def test_gemv_fp8_wgmma(m, n, k, rows, swiglu, norm, residual):
    """fp8_decode="wgmma": the weights from the ring stage (core-matrix layout) straight into
    warpgroup MMAs against x as e4m3 pieces; equal to the fp32 reference within the bf16 bound."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=n, k=k, m=m, weight_dtype="fp8_e4m3", swiglu=swiglu, norm=norm,
                                 residual=residual, fp8_decode="wgmma", rows_per_tile=rows))
    assert block.wgmma
    t = gemv_inputs(block, 400 + m)
    run_standalone(block, t)
    assert rel_err(t["y"], block.reference(**t)["y"]) <= BF16_TOL


@pytest.mark.parametrize("m,rows,swiglu,residual", [(1, 56, False, "bf16"), (2, 24, True, None), (1, 40, False, "fp32")])
def test_gemv_fp8_straddling_tiles(m, rows, swiglu, residual):
    """fp8 tiles whose rows straddle two 128-row scale blocks (hfma2): each row scaled by its own
    block's scale; n = 48 tiles, so every straddle position occurs."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=48 * rows, k=2048, m=m, weight_dtype="fp8_e4m3", swiglu=swiglu,
                                 residual=residual, out_dtype="fp32" if residual == "fp32" else "bf16",
                                 rows_per_tile=rows))
    assert block.scale_rows == 2
    t = gemv_inputs(block, 600 + rows)
    run_standalone(block, t)
    assert rel_err(t["y"], block.reference(**t)["y"]) <= BF16_TOL


@pytest.mark.parametrize("batch", [1, 2])
def test_mlp_stack_fp8_straddling_down_tiles(batch):
    """The one-launch fp8 stack with 56-row down tiles (128 tiles, straddling scale blocks)."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=batch, weight_dtype="fp8_e4m3",
                         down_rows=56)
    _check_stack_steps(cfg, seed=23, steps=2)


@pytest.mark.parametrize("batch", [1, 2])
def test_mlp_stack_fp8_alu_decode(batch):
    """The one-launch fp8 stack with the CUDA-core tiles' e4m3 -> f16 in integer ops
    (fp8_decode="hfma2_alu")."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=batch, weight_dtype="fp8_e4m3",
                         fp8_decode="hfma2_alu")
    _check_stack_steps(cfg, seed=13, steps=2)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_mlp_stack_fp8_wgmma(batch):
    """The one-launch fp8 stack with every GEMV on warpgroup MMAs (fp8_decode="wgmma")."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=batch, weight_dtype="fp8_e4m3",
                         fp8_decode="wgmma")
    _check_stack_steps(cfg, seed=11, steps=2)


@pytest.mark.parametrize("m,wd,rows,swiglu,norm", [(1, "fp8_e4m3", 16, True, False), (2, "fp8_e4m3", 56, False, False),
                                                    (1, "fp8_e4m3", 16, True, True), (4, "bf16", 16, True, True),
                                                    (1, "bf16", 56, False, False)])
def test_gemv_warp_ring(m, wd, rows, swiglu, norm):
    """The warp-sliced ring (GemvConfig.warp_ring: each warp copies the units it reads, warp
    barriers per chunk): the persistent GEMV with more tiles than SMs, straddling fp8 tiles
    (56 rows) and the fused norm among the cases."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    n = 48 * rows if rows == 56 else 4096
    block = GemvBlock(GemvConfig(n=n, k=2048, m=m, weight_dtype=wd, swiglu=swiglu, norm=norm, rows_per_tile=rows,
                                 warp_ring=True))
    t = gemv_inputs(block, 700 + rows + m)
    run_standalone(block, t)
    assert rel_err(t["y"], block.reference(**t)["y"]) <= BF16_TOL


@pytest.mark.parametrize("batch,wd,down_rows", [(1, "fp8_e4m3", 0), (2, "fp8_e4m3", 0), (4, "fp8_e4m3", 0),
                                                (1, "fp8_e4m3", 56), (1, "bf16", 0), (2, "bf16", 0)])
def test_mlp_stack_warp_ring(batch, wd, down_rows):
    """The one-launch stack on the warp-sliced ring: gate/up and down chunks share every stage's
    warp slices, so a refill needs no CTA barrier whichever op it belongs to."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=batch, weight_dtype=wd,
                         down_rows=down_rows, warp_ring=True)
    _check_stack_steps(cfg, seed=29 + batch, steps=3)


@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("xdt,residual", [("fp32", "fp32"), ("bf16", "bf16")])
def test_gemv_block_fused_norm_residual(m, wd, xdt, residual):
    """Fused RMSNorm prologue (x fp32 residual stream or bf16 input), fused residual epilogue
    aliased in place (res is y), like the MLP stack's ops; K=7168 so the x block (m=8) spans
    several chunks."""
    need_gpu()
    from sdk.blocks.gemv import GemvBlock, GemvConfig
    block = GemvBlock(GemvConfig(n=1024, k=7168, m=m, weight_dtype=wd, norm=True, x_dtype=xdt,
                                 residual=residual, out_dtype=residual))
    t = gemv_inputs(block, 200 + m)
    ref = block.reference(**t)["y"]
    if residual == "fp32":
        t["y"] = t["res"]          # in place, as the residual stream: y = y + x_n @ W^T (not poisoned:
        # an unwritten y keeps res, whose error against ref is ~|x_n @ W^T| / |ref| >> the tolerance)
    run_standalone(block, t)
    assert rel_err(t["y"], ref) <= BF16_TOL


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("residual_in,src", [(False, ""), (True, ""), (False, "fp32")])
def test_rmsnorm_block(m, residual_in, src):
    need_gpu()
    from sdk.blocks.rmsnorm import RMSNormBlock, RMSNormConfig
    block = RMSNormBlock(RMSNormConfig(d=7168, m=m, residual_in=residual_in, src_dtype=src))
    src_dt = torch.float32 if (residual_in or src == "fp32") else torch.bfloat16
    t = {"src": torch.randn(m, 7168, device="cuda").to(src_dt),
         "delta": torch.randn(m, 7168, device="cuda") if residual_in else None,
         "weight": (1 + 0.1 * torch.randn(7168, device="cuda")).to(torch.bfloat16),
         "resid_out": torch.full((m, 7168), float("nan"), device="cuda"),
         "out": torch.full((m, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")}
    ref = block.reference(**{k: v for k, v in t.items() if v is not None})
    run_standalone(block, t)
    assert rel_err(t["resid_out"], ref["resid_out"]) <= 1e-6
    assert rel_err(t["out"], ref["out"]) <= BF16_TOL


def test_rmsnorm_block_without_resid_out():
    """write_resid=False (the MLP stack's norms): `out` only; resid_out is never touched."""
    need_gpu()
    from sdk.blocks.rmsnorm import RMSNormBlock, RMSNormConfig
    block = RMSNormBlock(RMSNormConfig(d=7168, m=2, residual_in=False, src_dtype="fp32", write_resid=False))
    src = torch.randn(2, 7168, device="cuda")
    t = {"src": src, "weight": (1 + 0.1 * torch.randn(7168, device="cuda")).to(torch.bfloat16),
         "out": torch.full((2, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")}
    ref = block.reference(**t)
    run_standalone(block, t)
    assert rel_err(t["out"], ref["out"]) <= BF16_TOL


def _stack_runtime(cfg, seed=0, **kw):
    from sdk.megakernel.mlp_stack import build_program, make_weights
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    weights = make_weights(cfg, seed=seed, device="cuda")
    tensors.update(weights)
    return MegakernelRuntime(prog, tensors, **kw), weights


@pytest.mark.parametrize("batch,fuse", [(1, None), (1, False), (8, None), (8, True), (64, None)])
@pytest.mark.parametrize("wd", ["bf16", "fp8_e4m3"])
def test_mlp_stack_one_launch(batch, fuse, wd):
    """hidden 7168, intermediate 2048, 4 layers in one launch per step; three steps (epochs).
    fuse: RMSNorm inside the gate/up tiles (None: the default for the batch)."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig, reference
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=batch, weight_dtype=wd, fuse_norm=fuse)
    rt, weights = _stack_runtime(cfg)
    for step in range(3):
        x = torch.randn(batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        rt.tensors["x"].copy_(x)
        for name in ("out", "resid", "normed", "act"):
            if name in rt.tensors:
                rt.tensors[name].fill_(float("nan"))
        rt.run()
        err = rel_err(rt.tensors["out"], reference(cfg, weights, x))
        assert err <= BF16_TOL, f"step {step}: relative error {err:.3e}"


@pytest.mark.parametrize("window,rows", [(4, 0), (8, 8), (4, 8)])
def test_records_window_equals_resident_records(window, rows):
    """A list of instruction records streamed through a window of `window` smem slots (kernel.py:
    refilled half a window at a time, the ring's producer reading records past it from global
    memory - what a whole model's hundreds of instructions a SM take) gives the same bits as the
    same program with every record resident; 8-row tiles make many instructions a SM (a refill
    every window / 2 of them). Three launches each (counter epochs), fresh x, outputs poisoned."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=4, batch=1, gateup_rows=rows, down_rows=rows)
    resident, _ = _stack_runtime(cfg, seed=11)
    windowed, _ = _stack_runtime(cfg, seed=11, records_window=window)
    assert resident.records_window == 0 and windowed.records_window == window
    assert windowed.max_len >= 2 * window, "the list must cross a refill"
    for step in range(3):
        x = torch.randn(1, cfg.hidden, device="cuda").to(torch.bfloat16)
        outs = []
        for rt in (resident, windowed):
            rt.tensors["x"].copy_(x)
            for name in ("out", "resid", "normed", "act"):
                if name in rt.tensors:
                    rt.tensors[name].fill_(float("nan"))
            rt.run()
            outs.append(rt.tensors["out"].clone())
        assert torch.equal(outs[0], outs[1]), f"step {step}: the windowed records' output differs"


@pytest.mark.parametrize("pdl", [False, True])
def test_mlp_stack_steps_back_to_back_feed_each_other(pdl):
    """Five launches queued back to back, each step's input the previous step's output (x and out
    are ONE tensor), no host work in between; with PDL (pdl=True) a launch starts on the SMs the
    previous one has left and must wait (griddepcontrol.wait) before reading x. Equal to the
    reference applied five times."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig, build_program, make_weights, reference
    from sdk.megakernel.pyvm import PyVM
    from sdk.megakernel.runtime import MegakernelRuntime
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=2, batch=1)
    prog = build_program(cfg)
    tensors = PyVM.alloc(prog, device="cuda")
    weights = make_weights(cfg, seed=4, device="cuda")
    tensors.update(weights)
    tensors["out"] = tensors["x"]       # within a step x is read (layer 0) before out is written
    rt = MegakernelRuntime(prog, tensors, pdl=pdl)
    x0 = torch.randn(1, cfg.hidden, device="cuda").to(torch.bfloat16)
    rt.tensors["x"].copy_(x0)
    for _ in range(5):
        rt.launch()
    torch.cuda.synchronize()
    rt.check()
    want = x0
    for _ in range(5):
        want = reference(cfg, weights, want).to(torch.bfloat16)
    assert rel_err(rt.tensors["x"], want.float()) <= 2 * BF16_TOL


@pytest.mark.parametrize("batch,wd", [(1, "bf16"), (2, "bf16"), (1, "fp8_e4m3")])
def test_mlp_stack_many_tiles_per_sm(batch, wd):
    """Short tiles, several of one op per SM: the activations staged by a tile are reused by the
    next tile of the same op (and its fused norm skipped); results must not change."""
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig
    cfg = MLPStackConfig(hidden=7168, intermediate=2048, layers=3, batch=batch, weight_dtype=wd,
                         gateup_rows=8, down_rows=8)
    _check_stack_steps(cfg, seed=7, steps=3)


def _check_stack_steps(cfg, seed, steps):
    """`steps` launches of the stack, each on fresh random x with the output poisoned, each equal
    to the fp32 reference within the bf16 bound."""
    from sdk.megakernel.mlp_stack import reference
    rt, weights = _stack_runtime(cfg, seed=seed)
    for step in range(steps):
        x = torch.randn(cfg.batch, cfg.hidden, device="cuda").to(torch.bfloat16)
        rt.tensors["x"].copy_(x)
        rt.tensors["out"].fill_(float("nan"))
        rt.run()
        err = rel_err(rt.tensors["out"], reference(cfg, weights, x))
        assert err <= BF16_TOL, f"step {step}: relative error {err:.3e}"


def test_mlp_stack_swiglu_limit_large_intermediate():
    need_gpu()
    from sdk.megakernel.mlp_stack import MLPStackConfig, reference
    cfg = MLPStackConfig(hidden=7168, intermediate=18432, layers=2, batch=1, swiglu_limit=7.0)
    rt, weights = _stack_runtime(cfg, seed=3)
    x = torch.randn(1, cfg.hidden, device="cuda").to(torch.bfloat16)
    rt.tensors["x"].copy_(x)
    rt.tensors["out"].fill_(float("nan"))
    rt.run()
    assert rel_err(rt.tensors["out"], reference(cfg, weights, x)) <= BF16_TOL


def test_unsatisfiable_dependency_raises_not_hangs():
    """A wait that can never be met ends in KernelTimeoutError naming the counter, fast; the
    runtime then recovers (counters reset) and runs correctly again."""
    need_gpu()
    import time

    from sdk import KernelTimeoutError
    from sdk.megakernel import isa
    from sdk.megakernel.mlp_stack import MLPStackConfig, reference
    cfg = MLPStackConfig(hidden=1024, intermediate=512, layers=2, batch=1)
    rt, weights = _stack_runtime(cfg, timeout_s=0.2)
    good = rt.words.clone()
    # the first instruction that waits: make it wait for one signal more than ever comes
    s, j = next((s, j) for s in range(rt.num_sms) for j in range(int(rt.lengths_host[s]))
                if rt.words_host[s, j, isa.WAIT0] >= 0)
    rt.words[s, j, isa.EXPECT0] += 1
    t0 = time.time()
    with pytest.raises(KernelTimeoutError) as exc:
        rt.run()
    assert time.time() - t0 < 10
    # the first wait to expire reports: the broken one, or one downstream of it (whose producer
    # is stuck behind the broken wait) - either way a counter short of its target, named
    import re
    got = re.search(r"SM (\d+), instruction #(\d+) '(.+)' \(opcode \d+\) waited for counter (\d+) \((.+)\) "
                    r">= (\d+), saw (\d+) \(epoch 1\)", str(exc.value))
    assert got, str(exc.value)
    sm, idx, label, counter, cname, target, seen = got.groups()
    assert int(seen) < int(target)
    assert rt.program.counter_names[int(counter)] == cname
    assert int(rt.words_host[int(sm), int(idx), isa.WAIT0]) == int(counter) \
        or int(rt.words_host[int(sm), int(idx), isa.WAIT1]) == int(counter)
    rt.words.copy_(good)
    x = torch.randn(1, cfg.hidden, device="cuda").to(torch.bfloat16)
    rt.tensors["x"].copy_(x)
    rt.tensors["out"].fill_(float("nan"))
    rt.run()
    assert rel_err(rt.tensors["out"], reference(cfg, weights, x)) <= BF16_TOL
