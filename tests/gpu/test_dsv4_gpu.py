"""DeepSeek-V4 attention decode blocks on the GPU (V4.1-Flash TP8: 8 heads x 512, window 128): the
standalone core + combine tiles against the blocks' fp32 definition (reference(), proven equal
to sdk/reference/dsv4_attention.py on the CPU), fresh random inputs (seed printed), ragged batches,
NaN-poisoned outputs; HCA up to 1M tokens (8192 entries), CSA top-512 over up to 131072
compressed positions, SWA; T = 1..4. Run: `pytest -m gpu tests/gpu/test_dsv4_gpu.py`."""
import pytest
import torch

from harness import clock_seed, need_gpu, run_as_program, run_standalone

pytestmark = pytest.mark.gpu


def make_case(mode, starts, T, seed, heads=8, ratio=None, topk=512, window_dtype="bf16", comp_dtype="bf16",
              max_rows=32):
    """Random q / ring / new kv / compressed cache (cos/sin of real rope angles), CSA selections of
    distinct ready entries (-1 padded), for sequences with `starts` tokens before the call; the
    ring as V4.1's fp8 records with window_dtype="fp8_e4m3" (rows of varied scale)."""
    from sdk.blocks.dsv4_attention import (DSV4CombineBlock, DSV4CombineConfig, DSV4DecodeBlock,
                                           DSV4DecodeConfig, choose_splits, quantize_comp_fp4, quantize_window_fp8)
    g = torch.Generator(device="cuda").manual_seed(seed)
    ratio = ratio or {"swa": 1, "hca": 128, "csa": 4}[mode]
    B, hd, W = len(starts), 512, 128
    E = max(1, (max(starts) + T) // ratio + 1)
    probe = DSV4DecodeBlock(DSV4DecodeConfig(heads=heads, mode=mode, batch=B, q_tokens=T, ratio=ratio,
                                             max_entries=E, topk=topk, window_dtype=window_dtype,
                                             comp_dtype=comp_dtype, max_tile_rows=max_rows))
    splits = choose_splits(B * probe.groups * probe.row_groups, probe.keys_of(max(starts)))
    core = DSV4DecodeBlock(DSV4DecodeConfig(**{**probe.config.__dict__, "num_splits": splits}))
    comb = DSV4CombineBlock(DSV4CombineConfig(heads=heads, batch=B, q_tokens=T, num_splits=splits,
                                              per_token_groups=mode == "csa"))
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    ang = r(B, T, 32)
    t = {"q": r(B, T, heads, hd).to(torch.bfloat16), "window": r(B, W, hd).to(torch.bfloat16),
         "new_kv": r(B, T, hd).to(torch.bfloat16), "comp": r(B, E, hd).to(torch.bfloat16),
         "start": torch.tensor(starts, dtype=torch.int32, device="cuda"),
         "sinks": r(heads), "cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16)}
    if mode == "csa":
        idx = torch.full((B, T, topk), -1, dtype=torch.int32)
        for b, s in enumerate(starts):
            for tq in range(T):
                ready = (s + tq + 1) // ratio
                k = min(topk, ready)
                idx[b, tq, :k] = torch.randperm(ready)[:k].int()
        t["index"] = idx.cuda()
    if window_dtype == "fp8_e4m3":
        t["window"] = quantize_window_fp8((t["window"].float() * 4.0 ** r(B, W, 1)).cpu()).cuda()
    if comp_dtype == "fp4_e2m1":
        t["comp"] = quantize_comp_fp4((t["comp"].float() * 2.0 ** r(B, E, 1)).cpu()).cuda()
    t["o_part"] = torch.full((B, core.groups, splits, core.rows, hd), float("nan"), device="cuda")
    t["lse_part"] = torch.full((B, core.groups, splits, core.rows), float("nan"), device="cuda")
    t["out"] = torch.full((B, T, heads, hd), float("nan"), dtype=torch.bfloat16, device="cuda")
    return core, comb, t


def check(core, comb, t, seed, one_launch=False):
    """Run the core then the combine - two standalone kernels, or (one_launch) the two ops as ONE
    megakernel launch, the combine's instructions waiting for the core's - and compare with the
    blocks' fp32 reference."""
    if one_launch:
        run_as_program([(core, None), (comb, None)], t)
    else:
        run_standalone(core, t)
        run_standalone(comb, t)
    assert torch.isfinite(t["o_part"]).all(), f"seed {seed}: NaN left in o_part"
    assert not torch.isnan(t["lse_part"]).any(), f"seed {seed}: NaN left in lse_part"
    cpu = {k: v.cpu() for k, v in t.items()}
    cpu.update(core.reference(**cpu))
    want = comb.reference(**cpu)["out"]
    got = t["out"].float().cpu()
    assert torch.isfinite(got).all(), f"seed {seed}: NaN in out"
    err = ((got - want).norm() / want.norm()).item()
    assert err <= 1e-2, f"seed {seed}: rel err {err:.3e}"
    fin = torch.isfinite(cpu["lse_part"])
    assert torch.equal(fin, torch.isfinite(t["lse_part"].cpu())), f"seed {seed}: empty splits differ"
    assert (t["lse_part"].cpu()[fin] - cpu["lse_part"][fin]).abs().max() < 2e-2, f"seed {seed}: lse"


@pytest.mark.parametrize("mode,starts,T", [
    ("swa", [0], 1), ("swa", [1, 127, 128, 5000], 1), ("swa", [3, 200], 4),
    ("hca", [0], 1), ("hca", [127, 128, 255, 4000], 1), ("hca", [1048575], 1), ("hca", [131072, 7, 65000], 2),
    ("csa", [10], 1), ("csa", [2047, 3, 100000], 1), ("csa", [524287], 1), ("csa", [4096, 300], 3),
])
def test_dsv4_decode(mode, starts, T):
    need_gpu()
    seed = clock_seed()
    core, comb, t = make_case(mode, starts, T, seed)
    check(core, comb, t, seed)


@pytest.mark.parametrize("mode,starts,T,heads,wd,max_rows", [
    ("csa", [2047, 3, 100000], 1, 64, "bf16", 32), ("hca", [131072, 7], 1, 64, "fp8_e4m3", 32),
    ("swa", [3, 200], 3, 16, "bf16", 32), ("csa", [4096, 300], 2, 48, "fp8_e4m3", 32),
    ("csa", [4096, 300], 1, 32, "bf16", 16), ("hca", [65000, 9], 2, 16, "fp8_e4m3", 16)])
def test_dsv4_decode_row_groups(mode, starts, T, heads, wd, max_rows):
    """More than 32 (or max_tile_rows 16) query rows a group, cut into row groups (a tile each):
    V4.1-Flash's 64 heads on one GPU (CSA, HCA), 16 heads x 3 tokens (2 tiles of 24), 48 heads (2
    of 24); 16-row tiles: V4.1-Flash TP2's 32 heads (2 of 16), 16 heads x 2 tokens."""
    need_gpu()
    seed = clock_seed()
    core, comb, t = make_case(mode, starts, T, seed, heads=heads, window_dtype=wd, max_rows=max_rows)
    assert core.row_groups > 1
    check(core, comb, t, seed)


@pytest.mark.parametrize("mode,starts,T", [("swa", [1, 127, 128, 5000], 1), ("swa", [3, 200], 4),
                                           ("hca", [127, 128, 255, 4000], 1), ("csa", [2047, 3, 100000], 1)])
def test_dsv4_decode_fp8_window(mode, starts, T):
    """The ring as V4.1's SWA records (e4m3 + a UE8M0 scale per 32 values): the tile stages the
    records and dequantises them into its bf16 chunk; equal to the reference over the
    dequantised ring (dequantize_window_fp8)."""
    need_gpu()
    seed = clock_seed()
    core, comb, t = make_case(mode, starts, T, seed, window_dtype="fp8_e4m3")
    check(core, comb, t, seed)


@pytest.mark.parametrize("mode,starts,T,window_dtype", [("hca", [127, 128, 255, 4000], 1, "bf16"),
                                                        ("hca", [131072, 7, 65000], 2, "fp8_e4m3"),
                                                        ("csa", [2047, 3, 100000], 1, "fp8_e4m3"),
                                                        ("csa", [4096, 300], 3, "bf16")])
def test_dsv4_decode_fp4_entries(mode, starts, T, window_dtype):
    """The compressed entries as V4.1's fp4 records (E2M1 codes + an E4M3 scale per 16 values;
    with a bf16 or an fp8 ring): the tile stages them and dequantises them into its bf16 chunk;
    equal to the reference over the dequantised entries (dequantize_comp_fp4)."""
    need_gpu()
    seed = clock_seed()
    core, comb, t = make_case(mode, starts, T, seed, window_dtype=window_dtype, comp_dtype="fp4_e2m1")
    check(core, comb, t, seed)


def test_dsv4_batch64_hca():
    need_gpu()
    seed = clock_seed()
    import random
    rnd = random.Random(seed)
    core, comb, t = make_case("hca", [rnd.randrange(0, 65536) for _ in range(64)], 1, seed)
    check(core, comb, t, seed)


@pytest.mark.parametrize("mode,starts,T", [("swa", [3, 200], 4), ("hca", [131072, 7, 65000], 2),
                                           ("csa", [2047, 3, 100000], 1)])
def test_dsv4_decode_as_megakernel_instructions(mode, starts, T):
    """The core and the combine as ops of one megakernel launch (dependency through the launch's
    counters), ragged batch, poisoned outputs: equal to the reference as the standalone kernels."""
    need_gpu()
    seed = clock_seed()
    core, comb, t = make_case(mode, starts, T, seed)
    check(core, comb, t, seed, one_launch=True)


@pytest.mark.parametrize("heads,batch,T,q_norm", [(8, 1, 1, True), (8, 64, 1, True), (8, 4, 3, True),
                                                  (16, 8, 2, True), (8, 8, 2, False)])
def test_dsv4_prologue(heads, batch, T, q_norm):
    """DSV4PrologueBlock (per-head q RMSNorm + RoPE, kv RMSNorm + RoPE; q_norm=False: V4.1's q, RoPE
    only) against its reference (the model's rms_norm_v4 / Rope), fresh inputs, outputs
    NaN-poisoned: the norms' sums differ in order only, so a bf16 rounding may flip (bound 1e-2,
    the other bf16 outputs')."""
    need_gpu()
    from sdk.blocks.dsv4_prologue import DSV4PrologueBlock, DSV4PrologueConfig
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    blk = DSV4PrologueBlock(DSV4PrologueConfig(heads=heads, batch=batch, tokens=T, q_norm=q_norm))
    M, hd = batch * T, 512
    ang = torch.randn(M, 32, device="cuda", generator=g) * 3
    t = {"q_raw": (4 * torch.randn(M, heads, hd, device="cuda", generator=g)).to(torch.bfloat16),
         "kv_raw": torch.randn(M, hd, device="cuda", generator=g).to(torch.bfloat16),
         "kv_norm": (1 + 0.1 * torch.randn(hd, device="cuda", generator=g)).to(torch.bfloat16),
         "cos": ang.cos().to(torch.bfloat16), "sin": ang.sin().to(torch.bfloat16),
         "q": torch.full((batch, T, heads, hd), float("nan"), device="cuda", dtype=torch.bfloat16),
         "new_kv": torch.full((batch, T, hd), float("nan"), device="cuda", dtype=torch.bfloat16)}
    want = blk.reference(**{k: v.cpu() for k, v in t.items()})
    run_standalone(blk, t)
    for name in ("q", "new_kv"):
        got = t[name].float().cpu()
        assert torch.isfinite(got).all(), f"seed {seed}: {name} not written"
        err = ((got - want[name].float()).norm() / want[name].float().norm()).item()
        assert err <= 1e-2, f"seed {seed}: {name} rel err {err:.3e}"


@pytest.mark.parametrize("batch,T,W,wd", [(64, 1, 128, "bf16"), (3, 4, 128, "bf16"), (2, 200, 128, "bf16"),
                                          (64, 1, 128, "fp8_e4m3"), (3, 4, 128, "fp8_e4m3")])
def test_dsv4_ring_write(batch, T, W, wd):
    """DSV4RingWriteBlock: the call's last min(T, W) tokens into the ring at (start + t) % W, every
    other slot untouched (values moved: exact), ragged starts; fp8: each row quantised into its
    record bit for bit as quantize_window_fp8 (rows of varied scale, some zero groups)."""
    need_gpu()
    from sdk.blocks.dsv4_attention import DSV4RingWriteBlock, DSV4RingWriteConfig, quantize_window_fp8
    seed = clock_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    blk = DSV4RingWriteBlock(DSV4RingWriteConfig(batch=batch, q_tokens=T, window=W, window_dtype=wd))
    new = torch.randn(batch, T, 512, device="cuda", generator=g) * 8.0 ** torch.randn(batch, T, 16, 1, device="cuda",
                                                                                        generator=g).repeat(1, 1, 1, 32).flatten(2)
    new[:, :, :32] = 0.0
    ring = torch.randn(batch, W, 512, device="cuda", generator=g).to(torch.bfloat16)
    t = {"new_kv": new.to(torch.bfloat16),
         "start": torch.randint(0, 100000, (batch,), device="cuda", generator=g, dtype=torch.int32),
         "window": quantize_window_fp8(ring.cpu()).cuda() if wd == "fp8_e4m3" else ring}
    want = blk.reference(**{k: v.cpu() for k, v in t.items()})["window"]
    run_standalone(blk, t)
    assert torch.equal(t["window"].cpu(), want), f"seed {seed}: ring differs"
