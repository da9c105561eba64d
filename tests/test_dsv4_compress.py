"""DeepSeek-V4 KV compression blocks (sdk/blocks/dsv4_compress.py: the pooling, then the entry norm)
on the CPU: their references and their per-tile emulations (what the PyVM runs; the pooling cut
into channel slices) equal the model's own compressor (sdk/reference/dsv4_attention.py
`Compressor`, proven equal to transformers) over several calls of T tokens with ragged sequence
lengths - HCA, CSA (overlapping windows, incl. the first window) and the indexer's 128-wide
compressor; bad configs fail loudly; compile checks for every arch."""
import pytest
import torch
import torch.nn.functional as F

from sdk.blocks.dsv4_compress import (DSV4CompressBlock, DSV4CompressConfig, DSV4CompressNormBlock, compressor_blocks,
                                      dsv4_compress_compile_cases)
from sdk.errors import UnsupportedConfigError


def model_compressor(dim, ratio, overlap, rope, hidden, seed):
    from sdk.reference.dsv4_attention import Compressor, Rope
    from sdk.spec import RopeSpec
    g = torch.Generator().manual_seed(seed)
    c = 2 * dim if overlap else dim
    w = {"compressor.kv_proj.weight": (torch.randn(c, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16),
         "compressor.gate_proj.weight": (torch.randn(c, hidden, generator=g) * hidden ** -0.5).to(torch.bfloat16),
         "compressor.position_bias": 0.5 * torch.randn(ratio, c, generator=g),
         "compressor.kv_norm.weight": (1 + 0.1 * torch.randn(dim, generator=g)).to(torch.bfloat16)}
    rp = Rope(RopeSpec(dim=rope, theta=10000.0, interleaved=True))
    comp = Compressor(w, "compressor.", dim, ratio, overlap, rp, 1e-6, ("comp_kv", "state_kv", "state_gate"))
    return comp, w, rp


def compressor_calls(comp, w, rp, pool, norm, emu, cache, B, T, ratio, hidden):
    """Successive calls of T tokens, ragged starts (one sequence closes a window at once): per call
    the blocks' references from the state before it, their per-tile emulation (into `emu`) and the
    model's compressor (into `cache`); yields (call, the references, windows closed so far)."""
    from sdk.reference.common import StepInfo
    start = torch.tensor([0, 5, 2 * ratio - 1])
    g = torch.Generator().manual_seed(1)
    closed = 0
    for call in range(4 * ratio // T + 2):
        x = torch.randn(B, T, hidden, generator=g).to(torch.bfloat16)
        pos = start[:, None] + torch.arange(T)
        t = {"kv": F.linear(x, w["compressor.kv_proj.weight"]), "gate": F.linear(x, w["compressor.gate_proj.weight"]),
             "position_bias": w["compressor.position_bias"], "kv_norm": w["compressor.kv_norm.weight"],
             "start": start.int()}
        t["cos"], t["sin"] = rp.cos_sin(pos + 1 - ratio, torch.bfloat16)   # the window each token would close
        ref = pool.reference(**t, **emu)
        ref.update(norm.reference(**{**t, **emu, **ref}))
        for tile in range(pool.num_tiles()):
            pool.emulate_tile({**t, **emu}, tile)
        for b in range(B):
            norm.emulate_tile({**t, **emu}, b)
        comp.update(x, cache, StepInfo(start=start, positions=pos, input_ids=torch.zeros_like(pos)))
        closed += int(((pos + 1) % ratio == 0).sum())
        start = start + T
        yield call, ref, closed


@pytest.mark.parametrize("dim,ratio,overlap,T,cpt", [(512, 8, False, 3, 64), (512, 4, True, 2, 128),
                                                     (128, 4, True, 1, 64), (64, 2, True, 4, 16)],
                         ids=["hca-like", "csa", "indexer", "csa-small"])
def test_blocks_equal_model_compressor(dim, ratio, overlap, T, cpt):
    B, hidden, rope, E = 3, 256, 64, 16
    comp, w, rp = model_compressor(dim, ratio, overlap, rope, hidden, seed=dim + ratio)
    pool, norm = compressor_blocks(DSV4CompressConfig(dim=dim, ratio=ratio, overlap=overlap, rope=rope, batch=B,
                                                      tokens=T, max_entries=E, channels_per_tile=cpt))
    assert pool.num_tiles() == B * dim // cpt
    cache = comp.new_cache(B, E * ratio, "cpu", torch.bfloat16)
    emu = {"state_kv": cache["state_kv"].clone(), "state_gate": cache["state_gate"].clone(),
           "entries": cache["comp_kv"].clone()}
    closed = 0
    for call, ref, closed in compressor_calls(comp, w, rp, pool, norm, emu, cache, B, T, ratio, hidden):
        for name, model in (("state_kv", cache["state_kv"]), ("state_gate", cache["state_gate"]),
                            ("entries", cache["comp_kv"])):
            assert torch.equal(ref[name], emu[name]), f"call {call}: {name}: reference != emulation"
            # the same roundings in the same places: bit-equal (the sums over the window's keys
            # are fp32 before one bf16 rounding, so the order moves nothing at these sizes)
            assert torch.equal(emu[name], model), f"call {call}: {name} differs from the model's compressor"
    assert closed >= B and cache["comp_kv"].abs().sum() > 0      # entries were written and compared


@pytest.mark.parametrize("dim,ratio,overlap,T,cpt,entry_dtype", [(512, 8, False, 3, 64, "fp4_e2m1"),
                                                                 (512, 4, True, 2, 128, "fp4_e2m1"),
                                                                 (128, 4, True, 1, 64, "mxfp4"),
                                                                 (128, 4, True, 3, 32, "mxfp4")],
                         ids=["hca-like-fp4", "csa-fp4", "indexer-mxfp4", "indexer-mxfp4-T3"])
def test_record_entries_equal_the_model_with_the_format_round_trip(dim, ratio, overlap, T, cpt, entry_dtype):
    """entry_dtype="fp4_e2m1" (the main compressor's entries) / "mxfp4" (the indexer's keys): the
    pooling writes `pooled` [B, T, dim] and the norm quantises the entry into V4.1's record;
    dequantised, the records equal the model compressor's entries with the same round trip
    (Compressor.entry_format) bit for bit, reference and emulation alike."""
    B, hidden, rope, E = 3, 256, 64, 64                             # mxfp4: one page of 64 keys
    pool, norm = compressor_blocks(DSV4CompressConfig(dim=dim, ratio=ratio, overlap=overlap, rope=rope, batch=B,
                                                      tokens=T, max_entries=E, channels_per_tile=cpt,
                                                      entry_dtype=entry_dtype))
    quantize, dequantize = norm.quantize, norm.dequantize
    comp, w, rp = model_compressor(dim, ratio, overlap, rope, hidden, seed=dim + ratio)
    comp.entry_format = norm.round_trip
    assert "pooled" in pool.operands() and norm.operand_specs()[-1].dtype == "int32"
    cache = comp.new_cache(B, E * ratio, "cpu", torch.bfloat16)
    emu = {"state_kv": cache["state_kv"].clone(), "state_gate": cache["state_gate"].clone(),
           "pooled": torch.full((B, T, dim), float("nan")).to(torch.bfloat16),
           "entries": quantize(cache["comp_kv"])}
    closed = 0
    for call, ref, closed in compressor_calls(comp, w, rp, pool, norm, emu, cache, B, T, ratio, hidden):
        assert torch.equal(ref["entries"], emu["entries"]), f"call {call}: reference != emulation"
        assert torch.equal(dequantize(emu["entries"]), cache["comp_kv"]), f"call {call}: entries"
        assert torch.equal(emu["state_kv"], cache["state_kv"]) and torch.equal(emu["state_gate"], cache["state_gate"])
    assert closed >= B and cache["comp_kv"].abs().sum() > 0


def test_entries_past_the_cache_are_not_written():
    c = DSV4CompressConfig(dim=64, ratio=2, rope=0, batch=1, tokens=2, max_entries=1)
    pool, norm = compressor_blocks(c)
    t = {"kv": torch.randn(1, 2, 64).to(torch.bfloat16), "gate": torch.randn(1, 2, 64).to(torch.bfloat16),
         "position_bias": torch.zeros(2, 64), "kv_norm": torch.ones(64).to(torch.bfloat16),
         "start": torch.tensor([2], dtype=torch.int32), "state_kv": torch.zeros(1, 2, 64).to(torch.bfloat16),
         "state_gate": torch.zeros(1, 2, 64), "entries": torch.full((1, 1, 64), 7.0).to(torch.bfloat16)}
    out = pool.reference(**t)                                     # closes window 1: past the single entry
    assert torch.equal(out["entries"], t["entries"])
    assert torch.equal(norm.reference(**{**t, **out})["entries"], t["entries"])


@pytest.mark.parametrize("kw", [dict(dim=1024), dict(dim=63), dict(rope=66, dim=64), dict(ratio=0),
                                dict(channels_per_tile=48), dict(channels_per_tile=6, dim=96, rope=0),
                                dict(entry_dtype="fp8"), dict(dim=96, rope=16, channels_per_tile=16,
                                                              entry_dtype="fp4_e2m1"),
                                dict(dim=64, rope=16, channels_per_tile=16, entry_dtype="mxfp4"),
                                dict(dim=128, max_entries=96, entry_dtype="mxfp4")])   # 1.5 pages of 64 keys
def test_unsupported_configs_fail_loudly(kw):
    with pytest.raises(UnsupportedConfigError):
        compressor_blocks(DSV4CompressConfig(**kw))


def test_registered():
    from sdk.blocks import builtin_blocks
    assert DSV4CompressBlock in builtin_blocks() and DSV4CompressNormBlock in builtin_blocks()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_compile(arch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    for block in dsv4_compress_compile_cases():
        standalone(block, arch)
