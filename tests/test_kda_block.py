"""KDA decode block on CPU: its per-tile emulation (what the PyVM runs) equals its whole-op
reference; its reference equals the model oracle (`sdk/reference/kda.py` KDAReference, itself
proven equal to transformers) on a tiny layer; the speculative commit modes equal running the
accepted tokens one decode step at a time; compile checks of the device tile for every target arch."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sdk.blocks.kda import KDABlock, KDAConfig
from sdk.errors import UnsupportedConfigError

def make_inputs(block, seed=0, n_accepted=None):
    return block.random_operands(seed=seed, n_accepted=n_accepted)


def emulate(block, t):
    t = {k: v.clone() for k, v in t.items()}
    for tile in range(block.num_tiles()):
        block.emulate_tile(t, tile)
    return t


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def assert_matches(block, got, ref):
    """Every output of `ref` (fp32) equals `got` (operand dtypes) up to the storage rounding."""
    for name, r in ref.items():
        g = got[name]
        fin = torch.isfinite(r)
        assert torch.equal(torch.isfinite(g), fin), f"{name}: written where it should not be (or not written)"
        r = r.to(g.dtype).float()          # the storage rounding both sides share
        assert rel(g[fin], r[fin]) <= 1e-5, f"{name}: relative error {rel(g[fin], r[fin]):.2e}"


TINY = dict(batch=3, heads=2, head_dim=64)
VARIANTS = [
    dict(),
    dict(v_split=2, gate_kind="softplus"),
    dict(state_dtype="bf16", tokens=2),
    dict(tokens=3, commit="none", gate_kind="log_decay", out_dtype="fp32"),
    dict(tokens=3, v_split=2, commit="accepted"),
    dict(tokens=3, v_split=2, commit="per_token", state_dtype="bf16"),
    dict(conv=True, out_norm=True, tokens=2),
    dict(conv=True, conv_w_dtype="fp32", tokens=4, commit="accepted", gate_kind="softplus"),
    dict(conv=True, out_norm=True, tokens=3, commit="per_token", norm_eps=1e-5),
    dict(stream=True, v_split=2),                                        # tile = (b, h), all slices
    dict(stream=True, v_split=2, tokens=3, commit="accepted", gate_kind="softplus"),
    dict(stream=True, tokens=2, commit="per_token", state_dtype="bf16"),
    dict(stream=True, v_split=2, heads_per_tile=2, tokens=3, commit="accepted"),   # tile = both heads
    dict(conv=True, out_norm=True, beta_width=8),                        # a padded projection's beta rows
]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "base")
def test_emulated_tiles_equal_reference(kw):
    block = KDABlock(KDAConfig(**TINY, **kw))
    t = make_inputs(block, seed=1)
    assert_matches(block, emulate(block, t), block.reference(**t))


@pytest.mark.parametrize("kw", [dict(conv=True, out_norm=True), dict(stream=True, v_split=2)],
                         ids=["conv+norm", "stream"])
def test_pyvm_two_steps_equal_reference(kw):
    """The block as an op of a megakernel program, run by the PyVM for two decode steps (the
    state and conv state carried in place between launches)."""
    from sdk.megakernel.program import Program, encode
    from sdk.megakernel.pyvm import PyVM
    from sdk.schedule import schedule, validate
    block = KDABlock(KDAConfig(**TINY, **kw))
    prog = Program()
    for s in block.operand_specs():
        prog.buffer(s.name, s.shape, s.dtype, role="output" if s.output else "input")
    prog.op(block, {s.name: s.name for s in block.operand_specs()}, label="kda")
    sched = schedule(prog, 4)
    validate(prog, sched.per_sm)
    words, lengths = encode(prog, sched.per_sm)
    vm = PyVM(prog, words, lengths, PyVM.alloc(prog))
    state = None
    for step in range(2):
        t = make_inputs(block, seed=10 + step)
        carried = ("state", "conv_state") if block.config.conv else ("state",)
        if state is not None:
            t.update(state)
        ref = block.reference(**t)
        for k, v in t.items():
            vm.tensors[k].copy_(v)
        vm.step(seed=step)
        assert_matches(block, vm.tensors, ref)
        state = {n: vm.tensors[n].clone() for n in carried}


def test_program_refuses_ring_hazards():
    """The streaming form's ring reads the state ahead of every wait: no other op of the same
    launch may write it (a verify and its commit on one state are two launches)."""
    from sdk.megakernel.program import Program
    kw = dict(**TINY, tokens=2, stream=True)
    verify = KDABlock(KDAConfig(**kw, commit="none"))
    commit = KDABlock(KDAConfig(**kw, commit="accepted"))
    one_tile = KDABlock(KDAConfig(**TINY, tokens=2))
    for first, second in ((verify, commit), (one_tile, verify), (verify, one_tile)):
        prog = Program()
        for b in (first, second):
            for s in b.operand_specs():
                if s.name not in prog.buffers:
                    prog.buffer(s.name, s.shape, s.dtype, role="output" if s.output else "input")
        prog.op(first, {s.name: s.name for s in first.operand_specs()}, label="a")
        with pytest.raises(UnsupportedConfigError, match="streamed through the smem ring"):
            prog.op(second, {s.name: s.name for s in second.operand_specs()}, label="b")
    assert commit.stream_data_mutable() and not verify.stream_data_mutable()


# ------------------------------------------------------------------ the block = the model oracle
def _oracle_layer(gate_kind, seed=0):
    """A tiny KDAReference (2 heads x 32, hidden 64, full-rank output gate as Kimi K3)."""
    from sdk.reference.kda import KDAReference
    from sdk.spec import KDASpec
    H, K, D = 2, 32, 64
    spec = KDASpec(num_heads=H, head_dim=K, gate_kind=gate_kind, a_log_flat=True, output_gate_full_rank=True)
    model = SimpleNamespace(norm_eps=1e-5, hidden_size=D)
    layer = SimpleNamespace(attention=spec)
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in KDAReference.expected_weights(model, layer).items():
        w[name] = (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
    w["forget_gate.dt_bias"] = 0.5 * torch.randn(H * K, generator=g)
    w["forget_gate.A_log"] = torch.empty(H).uniform_(1, 16, generator=g).log()
    w["o_norm.weight"] = (1 + 0.1 * torch.randn(K, generator=g)).to(torch.bfloat16)
    w["conv1d.weight"] = (0.5 * torch.randn(3 * H * K, 1, 4, generator=g)).to(torch.bfloat16)
    return KDAReference(model, layer, w), w


@pytest.mark.parametrize("gate_kind", ["sigmoid", "softplus"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_block_equals_model_oracle(gate_kind, tokens):
    """Projections done in torch (as the megakernel's GEMVs would), the block (conv + recurrence +
    gated norm fused) in between, o_proj after: equals KDAReference.forward and its cache. The
    oracle rounds sigmoid(beta) to bf16 (transformers does), the block keeps it fp32: a <= 1e-2
    difference of the bf16 output, well above the block's own <= 1e-5 fp32 agreement."""
    ref_layer, w = _oracle_layer(gate_kind)
    B, H, K, D = 2, 2, 32, 64
    block = KDABlock(KDAConfig(batch=B, heads=H, head_dim=K, tokens=tokens, gate_kind=gate_kind, conv=True,
                               out_norm=True, norm_eps=1e-5))
    cache = ref_layer.new_cache(B, 16, "cpu", torch.bfloat16)
    cache["conv"].normal_()
    cache["state"].normal_(std=0.3)
    x = torch.randn(B, tokens, D).to(torch.bfloat16)
    t = {"qkv": torch.cat([F.linear(x, w[f"{n}_proj.weight"]) for n in "qkv"], -1),
         "conv_state": cache["conv"].clone(), "conv_w": w["conv1d.weight"][:, 0],
         "g": F.linear(F.linear(x, w["forget_gate.f_a_proj.weight"]), w["forget_gate.f_b_proj.weight"]).view(B, tokens, H, K),
         "dt_bias": w["forget_gate.dt_bias"], "a_log": w["forget_gate.A_log"],
         "beta": F.linear(x, w["b_proj.weight"]), "state": cache["state"].clone(),
         "out_gate": F.linear(x, w["g_proj.weight"]).view(B, tokens, H, K), "norm_w": w["o_norm.weight"],
         "o": torch.full((B, tokens, H, K), float("nan"), dtype=torch.bfloat16)}
    got = emulate(block, t)
    out = F.linear(got["o"].reshape(B, tokens, H * K), w["o_proj.weight"])
    want = ref_layer.forward(x, cache, None)           # KDA reads no positions
    assert rel(out, want) <= 1e-2
    assert torch.equal(got["conv_state"], cache["conv"])
    assert rel(got["state"], cache["state"]) <= 1e-2


# ------------------------------------------------------------------ speculative commit semantics
def _single_steps(kw, t, j, b):
    """Run the first j tokens of sequence b as j plain decode steps (T=1, commit all), with an
    fp32 state (the multi-token tile keeps the state in fp32 registers between its tokens and
    rounds it to the storage dtype once, when it writes it)."""
    one = KDABlock(KDAConfig(**{**TINY, **kw, "batch": 1, "tokens": 1, "commit": "all", "state_dtype": "fp32"}))
    state = t["state"][b:b + 1].float()
    conv_state = t["conv_state"][b:b + 1].clone() if "conv_state" in t else None
    outs = []
    for i in range(j):
        s = {}
        for spec in one.operand_specs():
            src = t[spec.name]
            if spec.name in ("dt_bias", "a_log", "conv_w", "norm_w"):
                s[spec.name] = src
            elif spec.name == "state":
                s[spec.name] = state
            elif spec.name == "conv_state":
                s[spec.name] = conv_state
            elif spec.name == "o":
                s[spec.name] = torch.full(spec.shape, float("nan"), dtype=src.dtype)
            else:
                s[spec.name] = src[b:b + 1, i:i + 1]
        s = emulate(one, s)
        state, conv_state = s["state"], s.get("conv_state")
        outs.append(s["o"][0, 0])
    return state[0], (conv_state[0] if conv_state is not None else None), outs


def close(got, want):
    """Equal up to fp32 reduction order (one torch call over j tokens vs j calls) and the one
    rounding to got's storage dtype."""
    return rel(got, want.to(got.dtype)) <= 1e-5


@pytest.mark.parametrize("kw", [dict(), dict(conv=True, out_norm=True), dict(state_dtype="bf16", v_split=2)],
                         ids=["core", "conv+norm", "bf16-state"])
def test_verify_then_commit_equals_single_steps(kw):
    """Pass 1 (commit="none") gives the T outputs and leaves the state; pass 2 (commit="accepted",
    n_accepted[b] = j_b, different per sequence) re-runs j_b tokens and writes state and conv
    state: both equal j_b plain decode steps; per_token's states_out[b, j-1] equals them too."""
    T = 4
    verify = KDABlock(KDAConfig(**TINY, **kw, tokens=T, commit="none"))
    t = make_inputs(verify, seed=3)
    got_v = emulate(verify, t)
    assert torch.equal(got_v["state"], t["state"])
    if "conv_state" in t:
        assert torch.equal(got_v["conv_state"], t["conv_state"])
    acc = [0, 2, 4]
    commit = KDABlock(KDAConfig(**TINY, **kw, tokens=T, commit="accepted"))
    tc = dict(t, n_accepted=torch.tensor(acc, dtype=torch.int32))
    got_c = emulate(commit, tc)
    per_tok = KDABlock(KDAConfig(**TINY, **kw, tokens=T, commit="per_token"))
    tp = {k: v for k, v in t.items()}
    so = next(s for s in per_tok.operand_specs() if s.name == "states_out")
    tp["states_out"] = torch.full(so.shape, float("nan"), dtype=t["state"].dtype)
    got_p = emulate(per_tok, tp)
    for b, j in enumerate(acc):
        state, conv_state, outs = _single_steps(kw, t, j, b)
        assert close(got_c["state"][b], state)
        if conv_state is not None:
            assert torch.equal(got_c["conv_state"][b], conv_state)     # bf16 inputs, moved not computed
        for i, o in enumerate(outs):
            assert close(got_v["o"][b, i], o.float())
            assert close(got_c["o"][b, i], o.float())
        assert torch.isnan(got_c["o"][b, j:].float()).all()           # tokens not accepted: not written
        if j:
            assert close(got_p["states_out"][b, j - 1], state)
    assert torch.equal(got_p["state"], t["state"])                     # per_token: state untouched


# ------------------------------------------------------------------ static checks
@pytest.mark.parametrize("kw", [dict(v_split=2, conv=True), dict(v_split=2, out_norm=True), dict(v_split=8),
                                dict(head_dim=256), dict(tokens=17), dict(commit="later"),
                                dict(gate_kind="exp"), dict(state_dtype="fp8_e4m3"), dict(k_warps=3),
                                dict(stream=True, conv=True), dict(stream=True, out_norm=True),
                                dict(heads_per_tile=2), dict(stream=True, heads_per_tile=3), dict(beta_width=1)])
def test_unsupported_configs_fail_loudly(kw):
    with pytest.raises(UnsupportedConfigError):
        KDABlock(KDAConfig(**{**TINY, "head_dim": 128, **kw}))


def test_registered_and_costed():
    from sdk.blocks import builtin_blocks
    assert KDABlock in builtin_blocks()
    block = KDABlock(KDAConfig(batch=64, heads=12, head_dim=128))
    # the floor: every state byte read once and written once
    assert block.state_bytes() == 2 * 64 * 12 * 128 * 128 * 4
    assert block.num_tiles() * block.cost().bytes >= block.state_bytes()
    assert block.num_tiles() == 768


COMPILE_VARIANTS = [
    dict(batch=8, heads=12, tokens=4, v_split=4, state_dtype="bf16", commit="accepted", gate_kind="softplus"),
    dict(batch=1, heads=8, tokens=3, v_split=2, commit="per_token", gate_kind="log_decay", out_dtype="fp32"),
    dict(batch=2, heads=12, tokens=2, commit="none", conv=True, conv_w_dtype="fp32", out_norm=True),
    dict(batch=2, heads=12, tokens=3, commit="accepted", conv=True, out_norm=True),
    dict(batch=2, heads=12, tokens=3, commit="accepted", conv=True, out_norm=True, conv_staged=False),
    dict(batch=2, heads=12, tokens=2, v_split=2, k_warps=4, commit="per_token"),
    dict(batch=2, heads=12, tokens=2, commit="accepted", conv=True, out_norm=True, k_warps=2),
    dict(batch=8, heads=12, tokens=4, v_split=4, state_dtype="bf16", commit="accepted", stream=True),
    dict(batch=2, heads=8, tokens=3, v_split=2, commit="per_token", gate_kind="log_decay", stream=True, k_warps=8),
    dict(batch=64, heads=8, v_split=4, k_warps=1, stream=True),
    dict(batch=64, heads=12, v_split=4, stream=True, heads_per_tile=3, beta_width=16),
    dict(batch=8, heads=12, conv=True, out_norm=True, beta_width=16),
    dict(batch=4, heads=8, v_split=2, tokens=3, commit="accepted", stream=True, heads_per_tile=4, gate_kind="softplus"),
]


@pytest.mark.parametrize("kw,lanes", [(dict(v_split=2, k_warps=1), (2, 16, 8)), (dict(v_split=2), (8, 4, 8)),
                                      (dict(v_split=1), (4, 8, 16)), (dict(v_split=2, k_warps=8), (16, 2, 8)),
                                      (dict(v_split=4), (8, 4, 4)), (dict(v_split=4, k_warps=4), (4, 8, 4)),
                                      (dict(v_split=1, k_warps=2), (8, 4, 16)), (dict(v_split=4, k_warps=2), (2, 16, 4))])
def test_k_warps_thread_mapping(kw, lanes):
    """k_warps moves lanes from K to the columns: a warp's state load covers LV * 16 bytes of each
    row it touches (128 with 8 lanes across V); the rows still cover K exactly once. Auto (0):
    8 / 4 warps across K for 32- / 64-column tiles from 512 tiles on (measured faster), 1 otherwise."""
    b = KDABlock(KDAConfig(batch=64, heads=12, head_dim=128, **kw))
    lv, lk, rk = b.lanes
    assert (lv, lk, rk) == lanes
    assert lk * rk * b.nwk == 128 and lv * 4 * (8 // b.nwk) == b.vs
    assert b.own_smem_bytes() == (0 if b.nwk == 1 else 4 * b.nwk * (2 * b.vs + 2))


def test_streaming_form_geometry():
    """stream=True: one tile per (sequence, head group), its heads' V-slices the ring's chunks (the state slice,
    unpadded); the head's staged inputs and the K-sum exchange in the activation area."""
    b = KDABlock(KDAConfig(batch=64, heads=8, head_dim=128, v_split=4, stream=True))
    assert (b.num_tiles(), b.stream_chunks(), b.chunk_bytes()) == (512, 4, 128 * 32 * 4)
    assert b.nwk == 4 and b.own_smem_bytes() == 0
    assert b.x_smem_bytes() == 4 * (4 * 128 + 4 + 4 * (2 * 32 + 2))
    assert b.num_tiles() * b.cost().bytes >= b.state_bytes()
    one = KDABlock(KDAConfig(batch=64, heads=8, head_dim=128, v_split=4))
    assert (one.num_tiles(), one.stream_chunks(), one.x_smem_bytes()) == (2048, 0, 0)
    # heads_per_tile: a tile stages 4 heads' inputs, its chunks are their 4 x 4 slices
    g = KDABlock(KDAConfig(batch=64, heads=8, head_dim=128, v_split=4, stream=True, heads_per_tile=4))
    assert (g.num_tiles(), g.stream_chunks(), g.chunk_bytes()) == (128, 16, 128 * 32 * 4)
    assert g.x_smem_bytes() == 4 * (4 * 4 * 128 + 4 + 4 * (2 * 32 + 2))
    assert g.cost().bytes == 4 * b.cost().bytes


def test_k_warps_auto_needs_many_tiles():
    """Batch 8 (one wave of CTAs, latency-bound) keeps the in-warp K sums: measured 6.2 vs 6.5 us."""
    assert KDABlock(KDAConfig(batch=8, heads=12, v_split=2)).nwk == 1
    assert KDABlock(KDAConfig(batch=64, heads=8, v_split=2)).nwk == 4      # GLM-5.3 TP8: 1024 tiles
    assert KDABlock(KDAConfig(batch=64, heads=8, v_split=4)).nwk == 8      # 32-column tiles
    assert KDABlock(KDAConfig(batch=64, heads=8, v_split=4, stream=True)).nwk == 4


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_compile_variants(arch):
    """Variants beyond sdk/compile.py's cases (which test_blocks_compile covers)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks._cute import standalone
    for kw in COMPILE_VARIANTS:
        standalone(KDABlock(KDAConfig(**kw)), arch)


def test_inlines_into_the_megakernel():
    """The device tile compiles inside the persistent megakernel's dispatch loop, beside another
    block (the 64-float scratch of the megakernel is enough: the tile uses 8)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from sdk.blocks.rmsnorm import RMSNormBlock, RMSNormConfig
    from sdk.megakernel.kernel import compile_megakernel
    blocks = [RMSNormBlock(RMSNormConfig(d=7168, m=8)), KDABlock(KDAConfig(batch=8, heads=12, tokens=2, conv=True, out_norm=True)),
              KDABlock(KDAConfig(batch=8, heads=12, conv=True, out_norm=True, conv_staged=False)),
              KDABlock(KDAConfig(batch=64, heads=12, v_split=2)),
              KDABlock(KDAConfig(batch=64, heads=12, v_split=4, stream=True))]   # through the ring
    compile_megakernel(blocks, 132, 8, arch="sm_90a")
    # the staged conv's [T, 3, K] fp32 outputs (conv_staged is the default); nothing per lane or
    # without conv; the 64-column tile's cross-warp K sums (4 warps across K by default)
    assert blocks[1].own_smem_bytes() == 3 * 128 * 4 * 2
    assert blocks[2].own_smem_bytes() == 0 and blocks[3].own_smem_bytes() == 4 * 4 * (2 * 64 + 2)


@pytest.mark.parametrize("kw", [dict(), dict(stream=True, v_split=2), dict(conv=True, out_norm=True),
                                dict(stream=True, v_split=2, heads_per_tile=2)],
                         ids=["one-tile", "stream", "conv+norm", "stream-2-heads"])
def test_pyvm_layer_chain_equals_reference(kw):
    """Three KDA layers in one megakernel program (bench.kda_bench.layer_chain: layer l+1's v is
    layer l's output, waited for through the counters; independent layers with the conv), run by
    the PyVM: every layer's output and state equal the chained reference."""
    from bench.kda_bench import layer_chain, layer_chain_inputs, layer_chain_reference
    from sdk.megakernel.pyvm import PyVM
    block = KDABlock(KDAConfig(**TINY, **kw))
    prog = layer_chain(block, 3)
    assert len(prog.ops) == 3 and ("v" not in block.operands() or prog.ops[1].bindings["v"] == "o0")
    t = layer_chain_inputs(block, 3, seed=5)
    vm, _ = PyVM.from_program(prog, 4, {k: v.clone() for k, v in t.items()})
    ref = layer_chain_reference(block, t, 3)
    vm.step(seed=0)
    for name, r in ref.items():
        g = vm.tensors[name]
        assert torch.isfinite(g).all(), f"{name}: not written"
        assert rel(g, r.to(g.dtype)) <= 1e-5, f"{name}: relative error {rel(g, r.to(g.dtype)):.2e}"
