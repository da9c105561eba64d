"""The DeepSeek-V4 attention sublayer program (sdk/megakernel/dsv4_layer.py: projections with the
input norm fused, q / kv norms + RoPE, the compressor, split-KV attention with sinks, combine, ring
write, grouped output projection + residual) run by the PyVM equals the model's definition
(DSV4AttentionReference.forward + residual), two calls carrying every cache, ragged sequences
crossing window boundaries; SWA and HCA layers."""
import pytest

from sdk.megakernel.dsv4_layer import DSV4LayerConfig, build_program, make_inputs, make_weights, reference
from sublayer_launches import check_launches

TINY = dict(heads=2, hidden=512, q_rank=256, o_rank=256, window=8, ratio=4, max_seq_len=64, batch=3, tokens=2,
            index_heads=8, index_head_dim=64, index_topk=4)


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode,q_head_norm", [("swa", True), ("hca", True), ("csa", True), ("csa", False)])
def test_pyvm_sublayer_equals_model_reference(mode, q_head_norm):
    """The sublayer program (PyVM) against the model reference; q_head_norm=False: V4.1's queries
    without the per-head RMSNorm (the prologue and the reference's spec alike)."""
    from sdk.megakernel.pyvm import PyVM
    cfg = DSV4LayerConfig(mode=mode, q_head_norm=q_head_norm, **TINY)
    assert cfg.spec.q_head_norm == q_head_norm and cfg.blocks()["prologue"].config.q_norm == q_head_norm
    w = make_weights(cfg, seed=1)
    vm, _ = PyVM.from_program(build_program(cfg), 8, w)
    starts = [0, 5, 30]                          # 30 + 2 closes a window (ratio 4) in the first call
    check_launches(vm.tensors, lambda call: vm.step(seed=call),
                   lambda call: make_inputs(cfg, [s + call * cfg.tokens for s in starts], seed=10 + call),
                   lambda inp: reference(cfg, w, inp), ["window"] + list(cfg.cache_shapes()), rel)
    if mode == "csa":       # and over the program's own index list, checked against the scores
        check_launches(vm.tensors, lambda call: vm.step(seed=call),
                       lambda call: make_inputs(cfg, [s + call * cfg.tokens for s in starts], seed=10 + call),
                       lambda inp: reference(cfg, w, inp, index=vm.tensors["index"]),
                       ["window"] + list(cfg.cache_shapes()), rel, reference_after_run=True)


@pytest.mark.parametrize("mode,mhc", [("swa", "v4"), ("hca", "v41"), ("csa", "v41")])
def test_pyvm_sublayer_with_mhc_equals_model_reference(mode, mhc):
    """The sublayer wrapped in its mHC residual (DSV4LayerConfig.mhc): the streams in, the
    collapse + input norm ("v4": after this site's coefficients; "v41": V4.1's lagged form - with
    the previous site's pre, its own op, the coefficients beside the sublayer), the attention, the
    post-mix of the streams in place fused with the next site's mix partials - against the model's
    MHCResidual.around the model's attention; the coefficients and partials compared too."""
    from sdk.megakernel.mhc_site import site_fn
    from sdk.megakernel.pyvm import PyVM
    cfg = DSV4LayerConfig(mode=mode, mhc=mhc, q_head_norm=mhc != "v41", **{**TINY, "hidden": 1024})
    prog = build_program(cfg)
    if mhc == "v41":     # the sublayer's first GEMVs wait for the collapse only, not the coefficients
        qa = next(op for op in prog.ops if op.label == "v4.q_a")
        assert {prog.counter_names[c] for i in qa.instructions for c, _ in prog.instructions[i].waits} == {"v4.hc_in"}
    w = make_weights(cfg, seed=1)
    fn = site_fn(cfg.site, seed=2)
    vm, _ = PyVM.from_program(prog, 8, w)
    starts = [0, 5, 30]
    ref = (lambda inp: reference(cfg, w, inp, index=vm.tensors["index"], hc_fn=fn)) if mode == "csa" else \
        (lambda inp: reference(cfg, w, inp, hc_fn=fn))
    check_launches(vm.tensors, lambda call: vm.step(seed=call),
                   lambda call: make_inputs(cfg, [s + call * cfg.tokens for s in starts], seed=10 + call, hc_fn=fn),
                   ref, ["window"] + list(cfg.cache_shapes()), rel, reference_after_run=mode == "csa",
                   out=("streams", "streams"), outputs=("coef", "part_next"), poison=("coef", "part_next", "x", "y"))


@pytest.mark.parametrize("mode,window_dtype,comp_dtype,index_dtype", [
    ("swa", "fp8_e4m3", "bf16", "bf16"), ("hca", "fp8_e4m3", "bf16", "bf16"), ("hca", "bf16", "fp4_e2m1", "bf16"),
    ("hca", "fp8_e4m3", "fp4_e2m1", "bf16"), ("csa", "fp8_e4m3", "fp4_e2m1", "bf16"), ("csa", "bf16", "bf16", "mxfp4"),
    ("csa", "fp8_e4m3", "fp4_e2m1", "mxfp4")])
def test_pyvm_sublayer_with_quantised_caches(mode, window_dtype, comp_dtype, index_dtype):
    """V4.1's serving formats: the ring as fp8 records (window_dtype), the compressed entries as
    fp4 records (comp_dtype), the indexer's keys as mxfp4 records (index_dtype) - the decode and
    the scores read them, the ring write and the compressors' norms write them; two calls
    carrying the records, against the model over the dequantised caches with its new rows /
    entries / keys through the same records (cache_values)."""
    from sdk.megakernel.dsv4_layer import cache_values
    from sdk.megakernel.pyvm import PyVM
    # mxfp4: whole-word records, whole pages of 64 keys
    tiny = {**TINY, "index_head_dim": 128, "max_seq_len": 256} if index_dtype == "mxfp4" else TINY
    cfg = DSV4LayerConfig(mode=mode, window_dtype=window_dtype, comp_dtype=comp_dtype, index_dtype=index_dtype, **tiny)
    prog = build_program(cfg)
    if window_dtype == "fp8_e4m3":
        assert prog.buffers["window"].dtype == "int32" and prog.buffers["window"].shape[-1] == 132
    if comp_dtype == "fp4_e2m1":
        assert prog.buffers["comp"].dtype == "int32" and prog.buffers["comp"].shape[-1] == 72
    if index_dtype == "mxfp4":
        assert prog.buffers["index_keys"].dtype == "int32" and prog.buffers["index_keys"].shape[-2:] == (1, 1088)
    w = make_weights(cfg, seed=1)
    vm, _ = PyVM.from_program(prog, 8, w)
    starts = [0, 5, 30]

    def err(a, b):
        return rel(cache_values(cfg, a.cpu()), cache_values(cfg, b.cpu()))
    ref = (lambda inp: reference(cfg, w, inp, index=vm.tensors["index"])) if mode == "csa" else \
        (lambda inp: reference(cfg, w, inp))
    check_launches(vm.tensors, lambda call: vm.step(seed=call),
                   lambda call: make_inputs(cfg, [s + call * cfg.tokens for s in starts], seed=10 + call),
                   ref, ["window"] + list(cfg.cache_shapes()), err, reference_after_run=mode == "csa")


def test_csa_selection_check_tells_a_wrong_list_from_a_near_tie():
    """dsv4_layer.check_selection: a swap within the tie tolerance passes; a list that leaves out a
    clear winner, or selects a not-ready entry, raises."""
    import torch
    from sdk.megakernel.dsv4_layer import check_selection
    scores = torch.tensor([[[5.0, 4.0, 3.0, 2.999, 1.0, 0.0]]])
    ready = torch.tensor([[[True, True, True, True, True, False]]])
    def mask(*sel):
        m = torch.zeros_like(ready)
        m[0, 0, list(sel)] = True
        return m
    check_selection(scores, ready, mask(0, 1, 2), 3)
    check_selection(scores, ready, mask(0, 1, 3), 3)                  # 2.999 ties 3.0 within 1e-2 x 5
    with pytest.raises(AssertionError, match="no near-tie"):
        check_selection(scores, ready, mask(0, 1, 4), 3)              # 1.0 instead of 3.0
    with pytest.raises(AssertionError, match="not ready"):
        check_selection(scores, ready, mask(0, 1, 5), 3)


def test_capturable_reference_is_the_same():
    """The benchmarks' CUDA-graphed PyTorch (the compressor without host syncs) = the model's."""
    import torch
    cfg = DSV4LayerConfig(mode="hca", **TINY)
    w = make_weights(cfg, seed=2)
    inp = make_inputs(cfg, [2, 5, 30], seed=3)           # 2 + 2 and 30 + 2 close windows, 5 + 2 none
    a, b = reference(cfg, w, inp), reference(cfg, w, inp, capturable=True)
    assert not torch.equal(a["comp"], inp["comp"])
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("mode,ratio", [("hca", 128), ("swa", 128), ("csa", 4)])
def test_v41_tp8_batch1_weight_ring_is_not_starved(mode, ratio):
    """At batch 1 a KV split is one chunk: the decode takes 2 pipeline stages, not 4 (150 KB),
    and the projections' weight ring keeps 4+ stages (it had 2 x 21 KB at HCA / SWA: the x GEMVs
    streamed at 16-20 GB/s per SM on the H200); with fill_stage every GEMV's chunk fills at least
    half a stage."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.program import RECORDS_MARGIN
    v41 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, max_seq_len=32768)
    prog = build_program(DSV4LayerConfig(mode=mode, ratio=ratio, batch=1, **v41))
    blocks = prog.opcodes.blocks
    assert [b.stages for b in blocks if b.name == "dsv4_decode"] == [2]
    stage, stages, _ = ring_geometry(blocks, reserved=RECORDS_MARGIN)
    assert stages >= 4
    # fill_stage (opt-in: measured slower at CSA B=1) widens every GEMV's chunk to half a stage or more
    filled = build_program(DSV4LayerConfig(mode=mode, ratio=ratio, batch=1, fill_stage=True, **v41)).opcodes.blocks
    stage, stages, _ = ring_geometry(filled, reserved=RECORDS_MARGIN)
    assert stages >= 4
    assert all(2 * b.chunk_bytes() >= stage for b in filled if b.stream_chunks() > 0)


def test_csa_past_the_shared_memory_is_refused_clearly():
    """CSA at batch 8 x 2 tokens: the indexer's 128-row score tile and the staged x leave the
    weight ring one stage - a clear error at build time, not a failed launch; T = 1 builds at
    batch 64 (the plain tiles share one arena)."""
    from sdk.errors import UnsupportedConfigError
    v41 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, ratio=4, max_seq_len=16384)
    with pytest.raises(UnsupportedConfigError, match="smem ring"):
        build_program(DSV4LayerConfig(mode="csa", batch=8, tokens=2, **v41))
    build_program(DSV4LayerConfig(mode="csa", batch=64, **v41))


@pytest.mark.parametrize("mode,batch,T", [("swa", 64, 1), ("hca", 8, 2)])
def test_fp8_window_sublayer_falls_back_to_16_key_decode_chunks(mode, batch, T):
    """V4.1's fp8 window records stage beside each decode chunk: at 32-key chunks and 2 stages the
    decode tile takes 122 KB, and at batch 64 (or 8 x 2 tokens) the weight ring found 1 stage - the
    build failed on the H200 (2026-12-05). build_program then takes 16-key chunks; bf16 keeps 32."""
    from sdk.blocks.base import ring_geometry
    from sdk.megakernel.program import RECORDS_MARGIN
    v41 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, ratio=128, max_seq_len=16384)
    for window_dtype, chunk in (("fp8_e4m3", 16), ("bf16", 32)):
        blocks = build_program(DSV4LayerConfig(mode=mode, batch=batch, tokens=T, window_dtype=window_dtype,
                                               **v41)).opcodes.blocks
        assert [b.config.chunk for b in blocks if b.name == "dsv4_decode"] == [chunk]
        assert ring_geometry(blocks, reserved=RECORDS_MARGIN)[1] >= 2


def test_unknown_mode_is_refused_clearly():
    from sdk.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError, match="mode 'mla'"):
        build_program(DSV4LayerConfig(mode="mla", **TINY))


@pytest.mark.parametrize("mode,ratio", [("hca", 128), ("csa", 4)])
def test_v41_tp8_megakernel_compiles(mode, ratio):
    """The V4.1-Flash TP8 HCA / CSA sublayer's megakernel (every block of the program inlined in
    the dispatch loop) compiles for sm_90a with no GPU."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.megakernel.kernel import compile_megakernel
    from sdk.schedule import schedule
    cfg = DSV4LayerConfig(mode=mode, heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, ratio=ratio,
                          max_seq_len=16384)
    prog = build_program(cfg)
    compile_megakernel(prog.opcodes.blocks, 132, schedule(prog, 132).max_len, timing=False, arch="sm_90a")


def test_first_fitting_takes_the_first_program_with_the_wanted_ring():
    """program.first_fitting: the first builder whose program leaves the ring ring_stages_wanted[0]
    stages, else [1]; builders that raise are skipped; none fitting re-raises the last error."""
    from dataclasses import replace

    from sdk.blocks.base import ring_geometry
    from sdk.errors import UnsupportedConfigError
    from sdk.megakernel.program import RECORDS_MARGIN, first_fitting
    cfg = DSV4LayerConfig(mode="hca", heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, ratio=128,
                          max_seq_len=32768 + 256)
    progs = {st: build_program(replace(cfg, decode_stages=st)) for st in (4, 2)}
    ring = {st: ring_geometry(p.opcodes.blocks, reserved=RECORDS_MARGIN)[1] for st, p in progs.items()}
    assert ring[4] < ring[2]

    def refuse():
        raise UnsupportedConfigError("no room")
    pick = lambda wanted: first_fitting([refuse, lambda: progs[4], lambda: progs[2]], wanted)  # noqa: E731
    assert pick((ring[4],)) is progs[4]                 # the deeper decode already leaves enough
    assert pick((ring[4] + 1, 2)) is progs[2]           # more ring wanted: the shallower decode
    assert pick((ring[2] + 1, ring[4])) is progs[4]     # nobody has it: the fallback, deepest first
    with pytest.raises(UnsupportedConfigError, match="no room"):
        first_fitting([refuse, refuse])
