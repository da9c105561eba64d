"""DeepSeek-V4 attention decode blocks on the CPU: the chain sdk/reference/dsv4_attention.py
(DSV4AttentionReference, proven equal to transformers) -> the blocks' definition (reference()) ->
their torch twins (emulate_tile + the combine) on ragged batches, T = 1 and 3, SWA / HCA / CSA.

The reference layer is built with o_a = o_b = identity (one group, rank = H * hd = hidden), so its
output IS the attention output after the inverse RoPE; q, kv and the selection are captured from
the same layer. Device tiles: compile-checked in tests/test_blocks_compile.py, run in
tests/gpu/test_dsv4_gpu.py."""
import pytest
import torch

from sdk.blocks.dsv4_attention import (DSV4CombineBlock, DSV4CombineConfig, DSV4DecodeBlock, DSV4DecodeConfig,
                                       choose_splits, even_row_groups)
from sdk.errors import UnsupportedConfigError
from sdk.reference.common import StepInfo
from sdk.reference.dsv4_attention import DSV4AttentionReference, Rope, rms_norm_v4
from sdk.spec import DSAIndexerSpec, DSV4AttentionSpec, RopeSpec


class _Layer:
    def __init__(self, attention):
        self.attention = attention


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def build(mode, H=2, hd=512, W=8, ratio=4, topk=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rope = RopeSpec(dim=64, theta=10000.0, interleaved=True)
    spec = DSV4AttentionSpec(num_heads=H, head_dim=hd, q_lora_rank=32, rope_dim=64, sliding_window=W,
                             compress_ratio={"swa": 0, "hca": ratio, "csa": ratio}[mode],
                             indexer=DSAIndexerSpec(num_heads=2, head_dim=96, topk=topk) if mode == "csa" else None,
                             o_groups=1, o_lora_rank=H * hd, compress_overlap=mode == "csa",
                             rope=rope, compress_rope=rope)
    D = H * hd
    shapes = DSV4AttentionReference.expected_weights(type("M", (), {"hidden_size": D})(), _Layer(spec))
    w = {k: torch.randn(*s, generator=g) * (s[-1] ** -0.5 if len(s) == 2 else 0.5) for k, s in shapes.items()}
    for k in w:
        if k.endswith("norm.weight"):
            w[k] = 1 + 0.1 * torch.randn(w[k].shape, generator=g)
    w["o_a_proj.weight"] = torch.eye(D)
    w["o_b_proj.weight"] = torch.eye(D)
    return spec, w, DSV4AttentionReference(None, _Layer(spec), w)


def run_reference(ref, spec, w, starts, T, seed=1):
    """Prefill each sequence to its start (ragged, one token at a time: exercises the compressors),
    then one T-token call; returns the block inputs captured from that call and its output."""
    g = torch.Generator().manual_seed(seed)
    B, D = len(starts), spec.num_heads * spec.head_dim
    cache = ref.new_cache(B, 64, "cpu", torch.float32)
    lengths = torch.zeros(B, dtype=torch.long)
    for _ in range(max(starts)):               # prefill: rows that are done feed their own positions again? no:
        active = lengths < torch.tensor(starts)   # only advance sequences still below their start
        if not active.any():
            break
        x = torch.randn(B, 1, D, generator=g)
        # sequences already at their start are run on a scratch copy of their caches (discarded)
        saved = {k: v.clone() for k, v in cache.items()}
        ref.forward(x, cache, StepInfo(start=lengths.clone(), positions=lengths[:, None].clone(),
                                       input_ids=torch.zeros(B, 1, dtype=torch.long)))
        for k in cache:
            cache[k][~active] = saved[k][~active]
        lengths = lengths + active.long()
    start = lengths.clone()
    pos = start[:, None] + torch.arange(T)
    step = StepInfo(start=start, positions=pos, input_ids=torch.zeros(B, T, dtype=torch.long))
    x = torch.randn(B, T, D, generator=g)
    # the call's q and kv, as the reference computes them (same helpers, same weights)
    cos, sin = ref.rope.cos_sin(pos, x.dtype)
    q_res = rms_norm_v4(x @ w["q_a_proj.weight"].T, w["q_a_norm.weight"], spec.norm_eps)
    q = (q_res @ w["q_b_proj.weight"].T).view(B, T, spec.num_heads, spec.head_dim)
    q = Rope.apply(rms_norm_v4(q, None, spec.norm_eps), cos[:, :, None], sin[:, :, None])
    kv = Rope.apply(rms_norm_v4(x @ w["kv_proj.weight"].T, w["kv_norm.weight"], spec.norm_eps), cos, sin)
    ring = cache["window"].clone()
    sel = {}
    if ref.indexer is not None:
        orig = ref.select
        ref.select = lambda *a: sel.setdefault("mask", orig(*a))
    out = ref.forward(x, cache, step).view(B, T, spec.num_heads, spec.head_dim)
    t = {"q": q, "window": ring, "new_kv": kv, "start": start.int(), "sinks": w["sinks"],
         "cos": cos, "sin": sin,
         # the projections' outputs before the prologue (DSV4PrologueBlock's inputs)
         "q_raw": (q_res @ w["q_b_proj.weight"].T).view(B * T, spec.num_heads, spec.head_dim),
         "kv_raw": (x @ w["kv_proj.weight"].T).view(B * T, spec.head_dim), "kv_norm": w["kv_norm.weight"]}
    t["window_after"] = cache["window"].clone()          # the ring as the reference leaves it
    if spec.compress_ratio:
        t["comp"] = cache["comp_kv"].clone()
    if "mask" in sel:
        m = sel["mask"]                                              # [B, T, E]
        idx = torch.full((B, T, spec.indexer.topk), -1, dtype=torch.int32)
        for b in range(B):
            for tq in range(T):
                e = torch.nonzero(m[b, tq]).flatten()
                idx[b, tq, :len(e)] = e.int()[torch.randperm(len(e))]    # any order
        t["index"] = idx
    return t, out


def blocks_for(spec, mode, B, T, splits, chunk=16, max_rows=32):
    core = DSV4DecodeBlock(DSV4DecodeConfig(heads=spec.num_heads, mode=mode, batch=B, q_tokens=T,
                                            head_dim=spec.head_dim, window=spec.sliding_window,
                                            ratio=spec.compress_ratio or 1, max_entries=64 // (spec.compress_ratio or 1),
                                            topk=spec.indexer.topk if spec.indexer else 1, num_splits=splits,
                                            chunk=chunk, max_tile_rows=max_rows))
    comb = DSV4CombineBlock(DSV4CombineConfig(heads=spec.num_heads, batch=B, q_tokens=T, head_dim=spec.head_dim,
                                              num_splits=splits, per_token_groups=mode == "csa", rope_dim=64))
    return core, comb


def run_blocks(core, comb, t, emulate=True):
    c = core.config
    t = dict(t)
    t["o_part"] = torch.full((c.batch, core.groups, c.num_splits, core.rows, c.head_dim), float("nan"))
    t["lse_part"] = torch.full((c.batch, core.groups, c.num_splits, core.rows), float("nan"))
    if emulate:
        for tile in range(core.num_tiles()):
            core.emulate_tile(t, tile)
    else:
        t.update(core.reference(**t))
    t["out"] = torch.full((c.batch, c.q_tokens, c.heads, c.head_dim), float("nan"), dtype=torch.bfloat16)
    for tile in range(comb.num_tiles()):
        comb.emulate_tile(t, tile)
    return t


CASES = [("swa", [0, 3, 11], 1, 1), ("swa", [5, 20], 3, 2), ("hca", [2, 9, 30], 1, 3), ("hca", [13, 40], 3, 4),
         ("csa", [6, 25, 41], 1, 2), ("csa", [17, 33], 3, 3)]


@pytest.mark.parametrize("mode,starts,T,splits", CASES)
def test_blocks_equal_reference_attention(mode, starts, T, splits):
    spec, w, ref = build(mode)
    t, want = run_reference(ref, spec, w, starts, T)
    core, comb = blocks_for(spec, mode, len(starts), T, splits)
    # the blocks' definition on fp32 inputs: equal to the reference's attention up to the bf16
    # roundings both apply to the output (o before the inverse RoPE, then after it)
    exact = run_blocks(core, comb, t, emulate=False)
    assert rel(exact["out"], want) < 8e-3
    # the device's twin on bf16 storage (q, caches, cos/sin as the device reads them)
    tb = {k: (v.to(torch.bfloat16) if k in ("q", "window", "new_kv", "comp", "cos", "sin") else v)
          for k, v in t.items()}
    got = run_blocks(core, comb, tb)
    assert torch.isfinite(got["o_part"]).all() and not torch.isnan(got["lse_part"]).any()
    err = rel(got["out"], want)
    print(f"{mode} starts={starts} T={T}: rel err exact {rel(exact['out'], want):.2e}, emulated {err:.2e}")
    assert err < 2e-2


@pytest.mark.parametrize("mode,starts,T,splits", [CASES[1], CASES[3], CASES[5]])
def test_prologue_then_blocks_equal_reference_attention(mode, starts, T, splits):
    """The chain from the projections' outputs: DSV4PrologueBlock (per-head q norm + RoPE, kv norm
    + RoPE; emulated on bf16 inputs, as the device) -> decode core -> combine equals the model's
    attention (DSV4AttentionReference.forward, identity o_a / o_b)."""
    from sdk.blocks.dsv4_prologue import DSV4PrologueBlock, DSV4PrologueConfig
    spec, w, ref = build(mode)
    t, want = run_reference(ref, spec, w, starts, T)
    B, H, hd = len(starts), spec.num_heads, spec.head_dim
    pro = DSV4PrologueBlock(DSV4PrologueConfig(heads=H, head_dim=hd, rope=64, batch=B, tokens=T, eps=spec.norm_eps))
    bf = torch.bfloat16
    tp = {"q_raw": t["q_raw"].to(bf), "kv_raw": t["kv_raw"].to(bf), "kv_norm": t["kv_norm"].to(bf),
          "cos": t["cos"].reshape(B * T, -1).to(bf), "sin": t["sin"].reshape(B * T, -1).to(bf),
          "q": torch.full((B, T, H, hd), float("nan"), dtype=bf), "new_kv": torch.full((B, T, hd), float("nan"), dtype=bf)}
    for tile in range(pro.num_tiles()):
        pro.emulate_tile(tp, tile)
    ref_out = pro.reference(**{k: v for k, v in tp.items()})
    assert torch.equal(ref_out["q"], tp["q"]) and torch.equal(ref_out["new_kv"], tp["new_kv"])
    # the prologue's q / new_kv against the reference's own (fp32 projections, fp32 norm weight)
    assert rel(tp["q"], t["q"]) < 1e-2 and rel(tp["new_kv"], t["new_kv"]) < 1e-2
    core, comb = blocks_for(spec, mode, B, T, splits)
    tb = {k: (v.to(bf) if k in ("window", "comp", "cos", "sin") else v) for k, v in t.items()}
    tb.update(q=tp["q"], new_kv=tp["new_kv"])
    got = run_blocks(core, comb, tb)
    err = rel(got["out"], want)
    assert err < 2e-2, f"{mode}: prologue -> core -> combine rel err {err:.2e}"
    # then the ring write (after the core): the ring the reference leaves
    from sdk.blocks.dsv4_attention import DSV4RingWriteBlock, DSV4RingWriteConfig
    rw = DSV4RingWriteBlock(DSV4RingWriteConfig(batch=B, q_tokens=T, head_dim=hd, window=spec.sliding_window))
    ring = {"new_kv": tp["new_kv"], "start": t["start"], "window": tb["window"].clone()}
    for tile in range(rw.num_tiles()):
        rw.emulate_tile(ring, tile)
    assert torch.equal(ring["window"], rw.reference(new_kv=tp["new_kv"], start=t["start"], window=tb["window"])["window"])
    assert rel(ring["window"], t["window_after"]) < 1e-2


def test_sink_and_split_lse():
    """A huge sink swallows the softmax: the output goes to 0; lse of splits combine exactly."""
    spec, w, ref = build("hca")
    t, _ = run_reference(ref, spec, w, [20], 1)
    core, comb = blocks_for(spec, "hca", 1, 1, 3)
    t1 = run_blocks(core, comb, {**t, "sinks": torch.full((2,), 1e4)}, emulate=False)
    assert t1["out"].abs().max() == 0
    core1, comb1 = blocks_for(spec, "hca", 1, 1, 1)
    a = run_blocks(core, comb, t, emulate=False)["out"]
    b = run_blocks(core1, comb1, t, emulate=False)["out"]
    assert rel(a, b) < 1e-2


def test_keys_and_bytes():
    blk = DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="hca", max_entries=8192))
    assert blk.keys_of(131071) == 128 + 1 + 1024
    assert blk.kv_bytes([131071]) == (128 + 1 + 1024) * 1024
    csa = DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode="csa", ratio=4, q_tokens=2, max_entries=32768))
    assert csa.groups == 2 and csa.rows == 8 and csa.keys_of(5) == 128 + 2 + 512
    assert csa.operands() == ["q", "window", "new_kv", "comp", "index", "start", "o_part", "lse_part"]
    assert choose_splits(1, 128 + 1 + 1024) == 37          # one 32-key chunk a split at batch 1
    assert choose_splits(1, 128 + 1 + 1024, min_chunks=4) == 9
    assert choose_splits(8, 128 + 1 + 1024) == 16          # one wave: 132 // 8 per sequence
    assert choose_splits(64, 641) == 2


@pytest.mark.parametrize("mode,starts,T,H,max_rows", [("swa", [5, 20], 3, 12, 32), ("hca", [13, 40], 3, 12, 32),
                                                      ("csa", [17, 33], 1, 34, 32), ("hca", [13, 40], 2, 12, 16)])
def test_row_groups_equal_reference_attention(mode, starts, T, H, max_rows):
    """More than 32 query rows a group: 12 heads x 3 tokens (2 tiles of 18, the causal rule across
    them), CSA's per-token group of 34 heads (2 of 17); 16-row tiles (max_tile_rows): 12 heads x 2
    tokens in 2 tiles of 12. head_dim 256 keeps the test small."""
    spec, w, ref = build(mode, H=H, hd=256)
    t, want = run_reference(ref, spec, w, starts, T)
    core, comb = blocks_for(spec, mode, len(starts), T, 2, max_rows=max_rows)
    assert (core.row_groups, core.tile_rows) == (2, core.rows // 2)
    assert core.num_tiles() == len(starts) * core.groups * 2 * 2
    tb = {k: (v.to(torch.bfloat16) if k in ("q", "window", "new_kv", "comp", "cos", "sin") else v)
          for k, v in t.items()}
    got = run_blocks(core, comb, tb)
    assert torch.isfinite(got["o_part"]).all() and not torch.isnan(got["lse_part"]).any()
    assert rel(got["out"], want) < 2e-2


def test_even_row_groups():
    assert [even_row_groups(r) for r in (1, 8, 32, 33, 34, 36, 64, 96, 100)] == [1, 1, 1, 3, 2, 2, 2, 3, 4]


@pytest.mark.parametrize("kw", [dict(heads=0), dict(heads=8, q_tokens=0), dict(heads=8, mode="dsa"),
                                dict(heads=8, max_tile_rows=8),
                                dict(heads=8, head_dim=192), dict(heads=8, chunk=48)])
def test_unsupported_configs_fail_loudly(kw):
    with pytest.raises(UnsupportedConfigError):
        DSV4DecodeBlock(DSV4DecodeConfig(**kw))


def test_blocks_are_registered():
    from sdk.blocks import builtin_blocks
    assert {DSV4DecodeBlock, DSV4CombineBlock} <= set(builtin_blocks())


# ---------------------------------------------------------------- V4.1's fp8 sliding-window records
def test_fp8_window_record_format():
    """quantize_window_fp8: 512 e4m3 values then 16 UE8M0 bytes a row (528 B, V4.1-Flash's SWA
    cache); each group's scale the smallest power of two that keeps max(max |x|, 1e-4) <= 448 x
    scale (the exponent rule the device applies to the max's bits agrees with frexp's; 1e-4: V4.1's
    writer's floor), so zero and tiny groups get 2^-22 (E = 105); dequantised values within e4m3's
    half-ulp of the input (zeros stay zero)."""
    from sdk.blocks.dsv4_attention import (dequantize_window_fp8, quantize_window_fp8, window_exponents,
                                           window_record_words)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 7, 512, generator=g) * 10.0 ** torch.randn(4, 7, 16, 1, generator=g).repeat(1, 1, 1, 32)
         .flatten(2)).to(torch.bfloat16)
    x[0, 0, :32] = 0
    x[0, 1, :32] = 3e-5                          # under the floor: quantised at its scale
    rec = quantize_window_fp8(x)
    assert rec.dtype == torch.int32 and rec.shape == (4, 7, window_record_words(512)) == (4, 7, 132)
    e = window_exponents(x)
    assert torch.equal(rec.view(torch.uint8)[..., 512:].int(), e)
    amax = x.float().abs().unflatten(-1, (-1, 32)).amax(-1).clamp(min=1e-4)
    scaled = amax * torch.ldexp(torch.ones_like(amax), 127 - e)
    assert (scaled <= 448).all() and (scaled > 224).all() and e[0, 0, 0] == e[0, 1, 0] == 105
    bits = amax.view(torch.int32)                   # the device's rule on the (floored) max's bits
    dev = ((bits >> 23) & 255) - 8 + ((bits & 0x7FFFFF) > 0x600000).int()
    assert torch.equal(dev.clamp(0, 254), e)
    d = dequantize_window_fp8(rec, 512)
    assert d.dtype == torch.bfloat16 and (d[0, 0, :32] == 0).all()
    err = (d.float() - x.float()).abs() / amax.repeat_interleave(32, -1).clamp_min(1e-30)
    assert err.max() <= 2 ** -4 * 448 / 224 + 1e-6         # half an e4m3 ulp at the group's scale


@pytest.mark.parametrize("mode,starts,T,splits", [CASES[1], CASES[3], CASES[5]])
def test_fp8_window_decode_is_attention_over_the_dequantised_ring(mode, starts, T, splits):
    """window_dtype="fp8_e4m3": the core reads records; its definition and its torch twin equal
    the bf16 core's over the dequantised ring - exactly - and stay near the model's attention."""
    from dataclasses import replace

    from sdk.blocks.dsv4_attention import dequantize_window_fp8, quantize_window_fp8
    spec, w, ref = build(mode)
    t, want = run_reference(ref, spec, w, starts, T)
    core, comb = blocks_for(spec, mode, len(starts), T, splits)
    core8 = DSV4DecodeBlock(replace(core.config, window_dtype="fp8_e4m3"))
    tb = {k: (v.to(torch.bfloat16) if k in ("q", "new_kv", "comp", "cos", "sin") else v) for k, v in t.items()}
    t8 = {**tb, "window": quantize_window_fp8(t["window"])}
    tdq = {**tb, "window": dequantize_window_fp8(t8["window"], spec.head_dim)}
    for emulate in (False, True):
        a = run_blocks(core8, comb, t8, emulate=emulate)
        b = run_blocks(core, comb, tdq, emulate=emulate)
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["lse_part"], b["lse_part"])
    assert rel(a["out"], want) < 5e-2
    assert core8.operand_specs()[1].shape == (len(starts), spec.sliding_window, 132)
    assert core8.kv_bytes(starts) < core.kv_bytes(starts)


def test_fp4_entry_record_format():
    """quantize_comp_fp4: 512 E2M1 codes (two a byte) then 32 E4M3 scales (one per 16 values):
    288 B, V4.1-Flash's compressed cache, as V4.1's writer makes it; ties round to the even code;
    zero groups stay zero."""
    from sdk.blocks.dsv4_attention import comp_record_words, dequantize_comp_fp4, quantize_comp_fp4
    from sdk.blocks.formats import E2M1_VALUES
    assert comp_record_words(512) == 72
    codes = torch.zeros(36, dtype=torch.uint8)                 # every code, scale 1.0 (e4m3 0x38)
    codes[:8] = torch.arange(8, dtype=torch.uint8) * 17 + torch.tensor([0, 8] * 4, dtype=torch.uint8) * 16
    codes[32:] = 0x38
    vals = dequantize_comp_fp4(codes.view(torch.int32), 64)[:16].float()
    assert torch.equal(vals[0::2], E2M1_VALUES[:8])                               # low nibbles: +code
    assert torch.equal(vals[1::2], E2M1_VALUES[:8] * torch.tensor([1.0, -1.0] * 4))
    y = torch.zeros(64)
    y[:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.01, -6, 0.1, 0.3, 2.9, 4.5, 5.5, -1.0])
    got = dequantize_comp_fp4(quantize_comp_fp4(y[None]), 64)[0]
    want = torch.tensor([0, 1, 1, 2, 2, 4, 4, 6, -0.0, -6, 0, 0.5, 3, 4, 6, -1])       # scale e4m3(6 / 6) = 1
    assert torch.equal(got[:16].float(), want) and (got[16:] == 0).all()
    # V4.1's writer: the scale at least e4m3's smallest (max floored at 6 x 2^-9: a tiny group is
    # quantised at 2^-9, a zero group gets scale byte 1), and codes of x times fp32(1 / s) - with s =
    # 0.234375, x = 1.25 s sits on the 1 | 1.5 tie (x / s: down to 1), and 1 / s rounded up pushes
    # it to 1.5
    z = torch.zeros(64)
    z[16], z[32:34] = 1e-3, torch.tensor([1.40625, 0.29296875])
    rec = quantize_comp_fp4(z[None]).view(torch.uint8)[0]
    assert rec[32:36].tolist() == [1, 1, 0x27, 1]                  # scales 2^-9, 2^-9, 0.234375, 2^-9
    v = dequantize_comp_fp4(quantize_comp_fp4(z[None]), 64)[0].float()
    assert v[16] == 2.0 ** -10 and v[33] == 1.5 * 0.234375 and (v[:16] == 0).all()
    g = torch.Generator().manual_seed(4)
    # groups of varied scale in e4m3's normal range (the entries are RMS-normalised: O(1) values;
    # a scale below 2^-6 is an e4m3 subnormal, coarser than this bound)
    x = (torch.randn(3, 5, 512, generator=g) * 2.0 ** torch.randn(3, 5, 32, 1, generator=g).repeat(1, 1, 1, 16)
         .flatten(2)).to(torch.bfloat16)
    rec = quantize_comp_fp4(x)
    assert rec.shape == (3, 5, 72) and rec.dtype == torch.int32
    d = dequantize_comp_fp4(rec, 512).float()
    amax = x.float().abs().unflatten(-1, (-1, 16)).amax(-1).repeat_interleave(16, -1)
    assert ((d - x.float()).abs() <= amax / 6 * 1.0625 + 1e-30).all()    # half the widest step (4 -> 6) at s


@pytest.mark.parametrize("mode,starts,T,splits", [CASES[3], CASES[5]])
@pytest.mark.parametrize("window_dtype", ["bf16", "fp8_e4m3"])
def test_fp4_entries_decode_is_attention_over_the_dequantised_entries(mode, starts, T, splits, window_dtype):
    """comp_dtype="fp4_e2m1" (with a bf16 or an fp8 ring): the core reads entry records; equal
    bit for bit to the bf16 core over the dequantised entries (and ring)."""
    from dataclasses import replace

    from sdk.blocks.dsv4_attention import (dequantize_comp_fp4, dequantize_window_fp8, quantize_comp_fp4,
                                           quantize_window_fp8)
    spec, w, ref = build(mode)
    t, want = run_reference(ref, spec, w, starts, T)
    core, comb = blocks_for(spec, mode, len(starts), T, splits)
    core4 = DSV4DecodeBlock(replace(core.config, comp_dtype="fp4_e2m1", window_dtype=window_dtype))
    tb = {k: (v.to(torch.bfloat16) if k in ("q", "new_kv", "window", "cos", "sin") else v) for k, v in t.items()}
    t4 = {**tb, "comp": quantize_comp_fp4(t["comp"])}
    tdq = {**tb, "comp": dequantize_comp_fp4(t4["comp"], spec.head_dim)}
    if window_dtype == "fp8_e4m3":
        t4["window"] = quantize_window_fp8(t["window"])
        tdq["window"] = dequantize_window_fp8(t4["window"], spec.head_dim)
    for emulate in (False, True):
        a = run_blocks(core4, comb, t4, emulate=emulate)
        b = run_blocks(core, comb, tdq, emulate=emulate)
        assert torch.equal(a["out"], b["out"]) and torch.equal(a["lse_part"], b["lse_part"])
    assert rel(a["out"], want) < 0.15
    assert core4.operand_specs()[3].shape[-1] == 72 and core4.kv_bytes(starts) < core.kv_bytes(starts)


def test_fp8_ring_write_quantises_the_new_rows():
    from sdk.blocks.dsv4_attention import DSV4RingWriteBlock, DSV4RingWriteConfig, quantize_window_fp8
    g = torch.Generator().manual_seed(5)
    rw = DSV4RingWriteBlock(DSV4RingWriteConfig(batch=2, q_tokens=3, window=8, window_dtype="fp8_e4m3"))
    new = torch.randn(2, 3, 512, generator=g).to(torch.bfloat16)
    old = quantize_window_fp8(torch.randn(2, 8, 512, generator=g))
    start = torch.tensor([6, 0], dtype=torch.int32)
    out = rw.reference(new_kv=new, start=start, window=old)["window"]
    for b in range(2):
        for s in range(8):
            wrote = [tq for tq in range(3) if (int(start[b]) + tq) % 8 == s]
            want = quantize_window_fp8(new[b, wrote[0]]) if wrote else old[b, s]
            assert torch.equal(out[b, s], want), (b, s)
    with pytest.raises(UnsupportedConfigError, match="window_dtype"):
        DSV4RingWriteBlock(DSV4RingWriteConfig(window_dtype="fp4"))
    with pytest.raises(UnsupportedConfigError, match="window_dtype"):
        DSV4DecodeBlock(DSV4DecodeConfig(heads=8, window_dtype="e5m2"))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_fp8_window_tiles_compile(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    from sdk.blocks.dsv4_attention import DSV4RingWriteBlock, DSV4RingWriteConfig
    for mode, kw in (("swa", {}), ("hca", {}), ("csa", dict(ratio=4, max_entries=4096, topk=512))):
        standalone(DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode=mode, batch=2, q_tokens=2, num_splits=4,
                                                    window_dtype="fp8_e4m3", **kw)), arch)
        if mode != "swa":
            standalone(DSV4DecodeBlock(DSV4DecodeConfig(heads=8, mode=mode, batch=2, q_tokens=2, num_splits=4,
                                                        comp_dtype="fp4_e2m1", **kw)), arch)
    standalone(DSV4RingWriteBlock(DSV4RingWriteConfig(batch=4, q_tokens=2, window_dtype="fp8_e4m3")), arch)
