"""The MLA prologue block and the whole attention sublayer in one program, on the CPU:
MLARopeAppendBlock against sdk/reference/common's rms_norm / apply_rope (bf16, the model's
arithmetic); the sublayer program (sdk/megakernel/mla_layer.py) through the PyVM in several
interleavings against MLAReference.forward + residual - the model's definition, with its own
projections, norms and RoPE. GPU twin: tests/gpu/test_mla_layer_gpu.py."""
import pytest
import torch

from sdk.blocks.mla_prologue import MLARopeAppendBlock, MLARopeAppendConfig
from sdk.errors import UnsupportedConfigError
from sdk.megakernel.mla_attention import MLAAttentionConfig
from sdk.megakernel.mla_layer import (MLALayerConfig, build_program, make_inputs, make_weights, reference,
                                      stored_rows)
from sdk.megakernel.pyvm import PyVM
from sdk.reference.common import apply_rope, rms_norm


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("mode", ["interleaved", "halves", "none"])
def test_rope_append_matches_the_reference_pieces(mode):
    c = MLARopeAppendConfig(heads=3, batch=2, q_tokens=2, kv_lora=256, nope=32, rope=16, rope_mode=mode,
                            page_size=4, num_pages=8, max_seq_len=16)
    blk = MLARopeAppendBlock(c)
    g = torch.Generator().manual_seed(1)
    M = blk.m
    t = {"q_raw": torch.randn(M, 3, 48, generator=g).to(torch.bfloat16), "ckv": torch.randn(M, 272, generator=g),
         "kv_norm": (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16),
         "cos": torch.randn(M, 16, generator=g).to(torch.bfloat16), "sin": torch.randn(M, 16, generator=g).to(torch.bfloat16),
         "block_table": torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]], dtype=torch.int32),
         "seq_lens": torch.tensor([7, 13], dtype=torch.int32),
         "q": torch.full((2, 2, 3, 272), float("nan")).to(torch.bfloat16),
         "kv": torch.full((8, 4, 272), float("nan")).to(torch.bfloat16)}
    for m in range(M):
        blk.emulate_tile(t, m)
    for m in range(M):
        b, tq = divmod(m, 2)
        pos = int(t["seq_lens"][b]) - 2 + tq
        row = t["kv"][int(t["block_table"][b, pos // 4]), pos % 4]
        lat = rms_norm(t["ckv"][m, :256].to(torch.bfloat16), t["kv_norm"], 1e-6)
        kpe, qpe = t["ckv"][m, 256:].to(torch.bfloat16), t["q_raw"][m, :, 32:]
        if mode != "none":
            cos, sin = t["cos"][m][None, None], t["sin"][m][None, None]
            kpe = apply_rope(kpe[None, None], cos, sin, mode == "interleaved")[0, 0]
            qpe = apply_rope(qpe[None, None], cos, sin, mode == "interleaved")[0, 0]
        assert rel(row[:256], lat) < 8e-3 and rel(row[256:], kpe) < 8e-3
        assert rel(t["q"][b, tq, :, 256:], qpe) < 8e-3
        assert torch.isnan(t["q"][b, tq, :, :256].float()).all(), "wrote the latent query columns"
    written = ~torch.isnan(t["kv"].float()).all(-1)
    assert int(written.sum()) == M, "one cache row per new token"


def test_rope_append_fp8_rows_are_the_quantised_bf16_rows():
    """fp8 cache: the appended row and its 9 scales are quantize_kv_fp8 of the bf16 row (the decode
    core reads bf16(e4m3 x scale) back); the bf16 block's row is that bf16 row."""
    from sdk.blocks.mla_decode import quantize_kv_fp8
    kw = dict(heads=2, batch=1, q_tokens=1, page_size=4, num_pages=4, max_seq_len=16)
    b16, b8 = MLARopeAppendBlock(MLARopeAppendConfig(**kw)), MLARopeAppendBlock(MLARopeAppendConfig(kv_dtype="fp8_e4m3", **kw))
    g = torch.Generator().manual_seed(4)
    base = {"q_raw": torch.randn(1, 2, 192, generator=g).to(torch.bfloat16), "ckv": torch.randn(1, 576, generator=g) * 3,
            "kv_norm": (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16),
            "cos": torch.randn(1, 64, generator=g).to(torch.bfloat16), "sin": torch.randn(1, 64, generator=g).to(torch.bfloat16),
            "block_table": torch.tensor([[2, 0, 1, 3]], dtype=torch.int32), "seq_lens": torch.tensor([6], dtype=torch.int32),
            "q": torch.zeros(1, 1, 2, 576).to(torch.bfloat16)}
    t16 = {**base, "kv": torch.zeros(4, 4, 576).to(torch.bfloat16)}
    t8 = {**base, "q": base["q"].clone(), "kv": torch.zeros(4, 4, 576).to(torch.float8_e4m3fn),
          "kv_scale": torch.zeros(4, 4, 9)}
    b16.emulate_tile(t16, 0)
    b8.emulate_tile(t8, 0)
    row16 = t16["kv"][0, 1]                                  # position 5: page table[1] = 0, row 1
    q8, sc = quantize_kv_fp8(row16.float(), 64)
    assert torch.equal(t8["kv"][0, 1].view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(t8["kv_scale"][0, 1], sc)
    assert (sc > 0).all() and int((t8["kv_scale"] != 0).sum()) == 9
    with pytest.raises(UnsupportedConfigError, match="fp8"):
        MLARopeAppendBlock(MLARopeAppendConfig(heads=2, kv_lora=256, kv_dtype="fp8_e4m3"))


def test_rope_append_rejects_what_it_does_not_take():
    with pytest.raises(UnsupportedConfigError, match="rope_mode"):
        MLARopeAppendBlock(MLARopeAppendConfig(heads=2, rope_mode="yarn"))
    with pytest.raises(UnsupportedConfigError, match="kv_lora"):
        MLARopeAppendBlock(MLARopeAppendConfig(heads=2, kv_lora=200))


def pyvm_resid(prog, weights, inputs, seed):
    """The sublayer program through the PyVM (9 SMs, interleaving `seed`), resid poisoned first."""
    vm, _ = PyVM.from_program(prog, num_sms=9, weights={k: v for k, v in weights.items() if k in prog.buffers})
    for name, v in inputs.items():
        vm.tensors[name].copy_(v)
    vm.tensors["resid"].fill_(float("nan"))
    vm.step(seed=seed)
    return vm.tensors["resid"]


@pytest.mark.parametrize("T,mode,kvd", [(1, "interleaved", "bf16"), (2, "halves", "bf16"), (1, "interleaved", "fp8_e4m3")])
def test_layer_program_equals_mla_reference_forward(T, mode, kvd):
    attn = MLAAttentionConfig(heads=4, batch=2, q_tokens=T, num_pages=16, max_seq_len=512, num_splits=3,
                              kv_dtype=kvd)
    cfg = MLALayerConfig(attn, hidden=1024, q_lora=512, rope_mode=mode)
    prog = build_program(cfg)
    w = make_weights(cfg, seed=2)
    inp = make_inputs(cfg, [300, 2 * T], seed=3)
    want = reference(cfg, w, inp)
    for seed in (0, 1):
        got = pyvm_resid(prog, w, inp, seed)
        err = rel(got - inp["x"].float(), want - inp["x"].float())   # the attention's part
        assert err < 2e-2, f"interleaving {seed}: {err}"
        assert rel(got, want) < 1e-2


def test_reference_over_the_stored_fp8_rows():
    """reference(stored=...) reads the new rows back from the cache a launch wrote (the GPU test
    compares the fp8 attention over those rows); rows_out gives the reference's own rows."""
    attn = MLAAttentionConfig(heads=4, batch=2, q_tokens=1, num_pages=16, max_seq_len=512, num_splits=3,
                              kv_dtype="fp8_e4m3")
    cfg = MLALayerConfig(attn, hidden=1024, q_lora=512)
    prog = build_program(cfg)
    w = make_weights(cfg, seed=2)
    inp = make_inputs(cfg, [300, 2], seed=3)
    vm, _ = PyVM.from_program(prog, num_sms=9, weights={k: v for k, v in w.items() if k in prog.buffers})
    for name, v in inp.items():
        vm.tensors[name].copy_(v)
    vm.step(seed=0)
    want, mine = reference(cfg, w, inp, with_rows=True)
    stored = reference(cfg, w, inp, stored=vm.tensors)
    got = stored_rows(cfg, vm.tensors)
    assert mine.shape == got.shape == (2, 1, attn.d_qk)
    assert rel(got, mine) <= 3e-2               # measured 1.2e-2: e4m3 steps and group scales
    x = inp["x"].float()
    # measured 2.9e-3 over the stored rows, 9.1e-3 over the reference's own
    assert rel(vm.tensors["resid"] - x, stored - x) <= 5e-3 < rel(vm.tensors["resid"] - x, want - x)


def test_layer_program_fits_the_ring_or_says_why():
    """Decode stages step down until the projections' ring has 2 stages; T x heads = 24 rows (a
    32-row MMA decode tile) fits only with the fallback 16-row projection tiles; 36 rows (two row
    groups of 18) only with 16-token decode chunks as well; past the GEMVs' 64 tokens a clear error
    names the limit."""
    from sdk.megakernel.mla_layer import FALLBACK_DECODE_CHUNK, FALLBACK_GEMV_ROWS
    ok = build_program(MLALayerConfig(MLAAttentionConfig(heads=12, batch=3, num_pages=200, max_seq_len=9000)))
    assert ok.ops[5].block.stages == 2 and ok.ops[5].block.config.chunk == 32
    t2 = build_program(MLALayerConfig(MLAAttentionConfig(heads=12, batch=3, q_tokens=2, num_pages=200,
                                                         max_seq_len=9000)))
    assert {b.config.rows_per_tile for b in t2.opcodes.blocks if b.stream_chunks()} == {FALLBACK_GEMV_ROWS}
    t3 = build_program(MLALayerConfig(MLAAttentionConfig(heads=12, batch=3, q_tokens=3, num_pages=200,
                                                         max_seq_len=9000)))
    dec = next(op.block for op in t3.ops if op.block.name == "mla_decode")
    assert (dec.row_groups, dec.tile_rows, dec.config.chunk) == (2, 18, FALLBACK_DECODE_CHUNK)
    with pytest.raises(UnsupportedConfigError, match="m=256 tokens"):
        build_program(MLALayerConfig(MLAAttentionConfig(heads=12, batch=64, q_tokens=4, num_pages=200,
                                                        max_seq_len=9000)))


@pytest.mark.parametrize("heads,T", [(40, 1), (12, 3)])
def test_layer_program_with_row_groups_equals_the_reference(heads, T):
    """More query rows than one decode tile holds (row groups of <= 32): the sublayer through the
    PyVM equals MLAReference.forward + residual, as with one group."""
    attn = MLAAttentionConfig(heads=heads, batch=2, q_tokens=T, num_pages=16, max_seq_len=512, num_splits=3)
    cfg = MLALayerConfig(attn, hidden=1024, q_lora=512, rope_mode="interleaved")
    prog = build_program(cfg)
    assert next(op.block for op in prog.ops if op.block.name == "mla_decode").row_groups == 2
    w = make_weights(cfg, seed=2)
    inp = make_inputs(cfg, [300, 2 * T], seed=3)
    want = reference(cfg, w, inp)
    got = pyvm_resid(prog, w, inp, seed=1)
    assert rel(got - inp["x"].float(), want - inp["x"].float()) < 2e-2


def test_batch8_k3_shard_builds_with_balanced_projection_tiles():
    """Kimi K3 TP8 at batch 8: the projections' balanced tiles (o_proj 56 rows: 29.6 KB ring
    stages) beside 57 KB of staged activations and the decode's shared memory - which needed the
    16-row fallback while every plain tile had its own shared memory - fit now that the plain
    tiles share one arena (base.plain_smem_bytes)."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.mla_attention import MLAAttentionConfig
    from sdk.megakernel.mla_layer import FALLBACK_GEMV_ROWS, MLALayerConfig, build_program
    from sdk.megakernel.program import RECORDS_MARGIN
    attn = MLAAttentionConfig(heads=12, batch=8, q_tokens=1, num_pages=8 * 512 + 8, max_seq_len=32768)
    prog = build_program(MLALayerConfig(attn))
    gemvs = [b for b in prog.opcodes.blocks if b.stream_chunks()]
    assert {b.config.rows_per_tile for b in gemvs} != {FALLBACK_GEMV_ROWS}
    assert 56 in {b.config.rows_per_tile for b in gemvs}
    assert ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)[1] >= 2

def test_batch1_k3_shard_trades_a_decode_stage_for_a_deeper_weight_ring():
    """Kimi K3 TP8 at batch 1: 3 decode stages (137 KB) left the projections' ring 2 x 29.6 KB;
    build_program takes 2 decode stages for a 3-stage ring (RING_STAGES_WANTED; measured faster on
    the H200), keeping the balanced projection tiles."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.mla_attention import MLAAttentionConfig
    from sdk.megakernel.mla_layer import FALLBACK_GEMV_ROWS, RING_STAGES_WANTED, MLALayerConfig, build_program
    from sdk.megakernel.program import RECORDS_MARGIN
    attn = MLAAttentionConfig(heads=12, batch=1, q_tokens=1, num_pages=513, max_seq_len=32768)
    prog = build_program(MLALayerConfig(attn))
    assert [b.stages for b in prog.opcodes.blocks if b.name == "mla_decode"] == [2]
    assert ring_geometry(prog.opcodes.blocks, reserved=RECORDS_MARGIN)[1] >= RING_STAGES_WANTED
    assert 56 in {b.config.rows_per_tile for b in prog.opcodes.blocks if b.stream_chunks()} - {FALLBACK_GEMV_ROWS}
    # a fixed decode depth that leaves the ring fewer stages is still built when nothing deeper fits
    shallow = build_program(MLALayerConfig(MLAAttentionConfig(heads=12, batch=8, q_tokens=1, num_pages=8 * 512 + 8,
                                                              max_seq_len=32768)))
    assert ring_geometry(shallow.opcodes.blocks, reserved=RECORDS_MARGIN)[1] == 2
