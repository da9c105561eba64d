"""The decode graph's byte counts and the CLI."""
import subprocess
import sys

import pytest

from sdk import UnsupportedConfigError, plugins
from sdk.graph import WEIGHT_BYTES, expected_experts_hit, plan
from sdk.spec import DenseMlpSpec, LayerSpec, MLASpec, ModelSpec, MoESpec, QuantSpec


def small_spec(mlp):
    attn = MLASpec(num_heads=8, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=0,
                   v_head_dim=16)
    return ModelSpec(name="t", arch="t", hidden_size=128, vocab_size=1000, layers=(LayerSpec(0, attn, mlp),))


def test_expected_experts_hit():
    assert expected_experts_hit(64, 4, 1) == pytest.approx(4.0)
    assert expected_experts_hit(64, 4, 1000) == pytest.approx(64.0, rel=1e-6)
    # two tokens: 4 + 4 * (60/64) expected distinct
    assert expected_experts_hit(64, 4, 2) == pytest.approx(4 + 4 * 60 / 64)


def test_plan_counts_weights_and_latent_cache_bytes():
    spec = small_spec(DenseMlpSpec(intermediate_size=256))
    p = plan(spec, batch=2, ctx=100, quant=QuantSpec())
    layer = p.layers[0]
    d, h, latent = 128, 8, 64
    attn_w = d * h * 16 + d * latent + latent * h * 32 + h * 16 * d
    assert layer.weight_bytes == pytest.approx(2.0 * (attn_w + 3 * d * 256))
    assert layer.kv_bytes == pytest.approx(2 * 100 * latent * 2.0)
    assert p.head.weight_bytes == pytest.approx(1000 * d * 2.0)
    assert p.step_floor_us == pytest.approx(p.total_bytes / 4.26e12 * 1e6)
    assert p.tokens_per_s == pytest.approx(2 / (p.step_floor_us * 1e-6))


def test_plan_shards_over_tp_and_ep():
    moe = MoESpec(num_experts=16, top_k=2, expert_intermediate_size=64, num_shared_experts=1,
                  shared_intermediate_size=64)
    spec = small_spec(moe)
    one = plan(spec, tp=1, ep=1, batch=1, quant=QuantSpec(experts="mxfp4"))
    two = plan(spec, tp=2, ep=2, batch=1, quant=QuantSpec(experts="mxfp4"))
    experts = lambda p: next(o for o in p.layers[0].ops if o.name.startswith("experts")).weight_bytes
    assert experts(one) == pytest.approx(2 * 3 * 128 * 64 * WEIGHT_BYTES["mxfp4"])
    assert experts(two) == pytest.approx(experts(one) / 2)
    assert two.head.weight_bytes == pytest.approx(one.head.weight_bytes / 2)
    with pytest.raises(UnsupportedConfigError, match="do not shard"):
        plan(spec, ep=3)


@pytest.mark.parametrize("model_id", ["kimi_k3", "deepseek_v41_flash", "glm_53"])
def test_plan_full_models(model_id):
    entry = plugins.get_model(model_id)
    spec = entry.spec("full")
    for name, s in entry.shardings.items():
        p = plan(spec, tp=s.tp, ep=s.ep, batch=1, ctx=32768, quant=entry.native_quant or spec.quant)
        assert p.total_bytes > 1e8, f"{model_id} {name}: implausibly few bytes per GPU"
        assert 0 < p.step_floor_us < 1e5
    # more GPUs -> fewer bytes per GPU
    a = plan(spec, tp=1, ep=1, batch=1, ctx=4096)
    b = plan(spec, tp=1, ep=2, batch=1, ctx=4096)
    assert b.total_bytes < a.total_bytes


def test_plan_v41_serving_caches():
    """V4.1's native KV scheme "v41": the sliding window at 528 B a token, the compressed entries at
    288 B and the indexer's keys at 68 B (MODEL-FACTS F18, F21, F22) - per cache, not one dtype."""
    entry = plugins.get_model("deepseek_v41_flash")
    spec = entry.spec("full")
    assert entry.native_quant.kv_cache == "v41"
    ctx, batch = 32768, 2
    p = plan(spec, tp=8, ep=8, batch=batch, ctx=ctx, quant=entry.native_quant)
    by_ratio = {}
    for layer, lp in zip(spec.layers, p.layers):
        by_ratio[layer.attention.compress_ratio] = lp.kv_bytes
    window = 128 * 528
    assert by_ratio[128] == pytest.approx(batch * (window + (ctx // 128) * 288))           # HCA
    assert by_ratio[4] == pytest.approx(batch * (window + 512 * 288 + (ctx // 4) * 68))   # CSA: top-512 + all keys
    fp8 = plan(spec, tp=8, ep=8, batch=batch, ctx=ctx, quant=QuantSpec(experts="mxfp4", dense="fp8_block128",
                                                                         kv_cache="fp8"))
    assert fp8.layers[3].kv_bytes > 1.8 * p.layers[3].kv_bytes
    with pytest.raises(UnsupportedConfigError, match="unknown KV cache format 'fp6'"):
        plan(spec, tp=8, ep=8, quant=QuantSpec(kv_cache="fp6"))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sdk.cli", *args], capture_output=True, text=True)


def test_cli_models_lists_in_tree_models():
    r = run_cli("models")
    assert r.returncode == 0, r.stderr
    for name in ("kimi_k3", "deepseek_v41_flash", "glm_53"):
        assert name in r.stdout


def test_cli_plan_prints_floor():
    r = run_cli("plan", "kimi_k3", "--tp", "8", "--ep", "8", "--batch", "8", "--ctx", "8192", "--gpu", "b200")
    assert r.returncode == 0, r.stderr
    assert "floor" in r.stdout and "tok/s" in r.stdout and "8.0 TB/s" in r.stdout
    r = run_cli("plan", "deepseek_v41_flash", "--tp", "8", "--ep", "8", "--ctx", "32768", "--kv", "bf16", "--brief")
    assert r.returncode == 0, r.stderr
    assert "KV bf16" in r.stdout


def test_cli_plan_builds_the_rank_program():
    """plan --program: one rank's one-launch program at those settings - V4.1-Flash TP8 at batch 8,
    all 43 layers: its records stream through a window; an ep other than tp is refused by name."""
    from sdk import plugins
    from sdk.cli import program_report
    spec = plugins.get_model("deepseek_v41_flash").spec("full_v41")
    line = program_report(spec, 8, 8, 8, 4096, "mxfp4")
    assert "mxfp4 experts" in line and "through a window of" in line and "weight ring" in line, line
    assert "not built" in program_report(spec, 8, 16, 1, 4096, "native")
    r = run_cli("plan", "glm_53", "--tp", "8", "--batch", "1", "--brief", "--program")
    assert r.returncode == 0, r.stderr
    assert "one-launch program per rank" in r.stdout
    import argparse
    from sdk.cli import cmd_plan              # callers that build their own Namespace (the demo's)
    assert cmd_plan(argparse.Namespace(model="glm_53", config="full", tp=8, ep=8, batch=1, ctx=4096, gpu="h200",
                                       weights="native", kv="native", brief=True)) == 0


@pytest.mark.parametrize("model_id", ["kimi_k3", "deepseek_v41_flash", "glm_53"])
def test_cli_run_tiny(model_id):
    r = run_cli("run", model_id, "--tiny", "--tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout


def test_demo_runs_each_tiny_model():
    """The demo's runs (cmd_run on `run MODEL --tiny`'s arguments, in process)."""
    from sdk.cli import cmd_run, tiny_run_args
    assert cmd_run(tiny_run_args("glm_53", tokens=2)) == 0


def test_cli_unknown_model_is_a_clear_error():
    r = run_cli("plan", "nope")
    assert r.returncode == 2
    assert "unknown model 'nope'" in r.stderr and "kimi_k3" in r.stderr
