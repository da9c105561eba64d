"""Compile checks with no GPU: every block (in representative static configs) and the megakernel,
for each target arch, through CuTe DSL's `cute.compile(..., options="--gpu-arch sm_XXa")`.

CuTe DSL 4.8.1 compiles to a cubin without a GPU when the kernel's arguments are plain scalars
(our kernels take raw int64 device addresses; no fake tensors needed) and `--gpu-arch` names the
target (the DSL's warpgroup MMA atoms included: MLADecodeBlock mma="wgmma" compiles so). Blocks
on Hopper-only instructions (GemvBlock fp8_decode="wgmma" in inline PTX, MLADecodeBlock
mma="wgmma" through the DSL's warpgroup atoms) are compiled for sm_90a alone
(`hopper_block_cases`, `hopper_megakernel_cases`).

    from sdk.compile import compile_check
    report = compile_check(["sm_90a", "sm_100a", "sm_103a"])   # {arch: {case: seconds | "error: ..."}}

CPU cost (the 2-core CI machine, 2026-12-07): ~17 min an arch, most of it the larger programs
(`program_cases`: sublayers, decoder layers, whole models, TP rank programs). The tests compile
the blocks and the MLP stacks for all three archs and each program for sm_90a and sm_100a as its
own test (sm_103a takes sm_100a's code path in every tile; `megakernel compile-check` compiles
the programs for every arch it is given).
"""
from __future__ import annotations

import time

ARCHS = ("sm_90a", "sm_100a", "sm_103a")


def block_cases():
    from .blocks.gemv import GemvBlock, GemvConfig
    from .blocks.kda import KDABlock, KDAConfig
    from .blocks.rmsnorm import RMSNormBlock, RMSNormConfig
    return [
        RMSNormBlock(RMSNormConfig(d=7168, m=1, residual_in=True)),
        RMSNormBlock(RMSNormConfig(d=7168, m=8, residual_in=False)),
        RMSNormBlock(RMSNormConfig(d=7168, m=2, residual_in=False, src_dtype="fp32", write_resid=False)),
        GemvBlock(GemvConfig(n=7168, k=2048, m=1)),
        GemvBlock(GemvConfig(n=2048, k=7168, m=1, swiglu=True, swiglu_limit=7.0, norm=True, x_dtype="fp32")),
        GemvBlock(GemvConfig(n=2048, k=7168, m=8, weight_dtype="fp8_e4m3", swiglu=True)),           # MMA, f16
        GemvBlock(GemvConfig(n=7168, k=2048, m=8, out_dtype="fp32", residual="fp32")),               # MMA, bf16
        GemvBlock(GemvConfig(n=2048, k=7168, m=1, weight_dtype="fp8_e4m3", swiglu=True, norm=True)),  # CUDA cores
        GemvBlock(GemvConfig(n=2048, k=7168, m=2, weight_dtype="fp8_e4m3", swiglu=True, fp8_decode="int")),
        GemvBlock(GemvConfig(n=2048, k=7168, m=1, weight_dtype="fp8_e4m3", swiglu=True, norm=True, fp8_decode="hfma2")),
        GemvBlock(GemvConfig(n=7168, k=2048, m=64, rows_per_tile=16, weight_dtype="fp8_e4m3", out_dtype="fp32",
                             residual="fp32")),
        # grouped (V4.1-Flash's o_a on one GPU: 8 groups of heads), CUDA cores and MMA
        GemvBlock(GemvConfig(n=8 * 1024, k=4096, m=1, groups=8)),
        GemvBlock(GemvConfig(n=8 * 1024, k=4096, m=8, groups=8, weight_dtype="fp8_e4m3")),
        KDABlock(KDAConfig(batch=64, heads=12, conv=True, out_norm=True)),
        KDABlock(KDAConfig(batch=1, heads=8, v_split=4, tokens=4, commit="accepted", state_dtype="bf16")),
        KDABlock(KDAConfig(batch=8, heads=8, tokens=2, conv=True, out_norm=True, conv_staged=False)),  # per-lane conv
        KDABlock(KDAConfig(batch=64, heads=8, v_split=4, stream=True)),                                # through the ring
    ] + _moe_block_cases() + _mla_block_cases() + _allreduce_block_cases() + _dsv4_block_cases() \
      + _indexer_block_cases()


def hopper_block_cases():
    """Blocks built on Hopper-only instructions (warpgroup MMA): compiled for sm_90a alone."""
    from .blocks.gemv import GemvBlock, GemvConfig
    from .blocks.mla_decode import MLADecodeBlock, MLADecodeConfig
    return [
        GemvBlock(GemvConfig(n=7168, k=2048, m=1, rows_per_tile=64, weight_dtype="fp8_e4m3", fp8_decode="wgmma")),
        MLADecodeBlock(MLADecodeConfig(heads=12, softmax_scale=192 ** -0.5, num_pages=2048, max_seq_len=131072,
                                       num_splits=128, chunk=64, mma="wgmma")),
        GemvBlock(GemvConfig(n=2048, k=7168, m=2, rows_per_tile=16, weight_dtype="fp8_e4m3", fp8_decode="wgmma",
                             swiglu=True, norm=True, residual="bf16")),
    ]


def _indexer_block_cases():
    from .blocks.indexer import indexer_compile_cases       # GLM-5.3 DSA + V4.1-Flash CSA scores / top-k
    return indexer_compile_cases()


def _dsv4_block_cases():
    from .blocks.dsv4_attention import dsv4_compile_cases   # V4.1-Flash TP8: HCA, CSA, SWA + combine
    from .blocks.dsv4_compress import dsv4_compress_compile_cases   # HCA / CSA / indexer compressors
    from .blocks.dsv4_prologue import dsv4_index_q_compile_cases, dsv4_prologue_compile_cases   # norms + RoPE
    from .blocks.mhc import mhc_compile_cases               # mHC mix / pre / post, V4.1-Flash and GLM-5.3
    from .blocks.embed import embed_compile_cases           # the embedding onto the streams
    return mhc_compile_cases() + embed_compile_cases() + dsv4_compile_cases() + dsv4_compress_compile_cases() \
        + dsv4_prologue_compile_cases() + dsv4_index_q_compile_cases()


def _allreduce_block_cases():
    from .blocks.allreduce import allreduce_compile_cases   # one-shot, two-shot halves, wire dtypes
    return allreduce_compile_cases()


def _mla_block_cases():
    from .blocks.mla_decode import mla_compile_cases
    return mla_compile_cases()


def _moe_block_cases():
    from .megakernel.moe_layer import moe_block_cases   # router + experts, every format and stage
    return moe_block_cases()


def megakernel_cases():
    from .megakernel.mlp_stack import MLPStackConfig
    return [MLPStackConfig(hidden=7168, intermediate=2048, layers=2, batch=1),
            MLPStackConfig(hidden=7168, intermediate=2048, layers=2, batch=8, weight_dtype="fp8_e4m3")]


def hopper_megakernel_cases():
    from .megakernel.mlp_stack import MLPStackConfig
    return [MLPStackConfig(hidden=7168, intermediate=2048, layers=2, batch=1, weight_dtype="fp8_e4m3",
                           fp8_decode="wgmma")]


def hopper_program_cases():
    """(name, build) of megakernels with Hopper-only tiles, compiled for sm_90a alone; build()
    returns the program."""
    def mla_wgmma():
        from .megakernel.mla_attention import MLAAttentionConfig, build_program
        return build_program(MLAAttentionConfig(heads=12, batch=1, num_pages=2048, max_seq_len=131072,
                                                decode_mma="wgmma"))
    return [("megakernel MLA attention program with the wgmma decode tile (Kimi K3 TP8, B=1 128K)", mla_wgmma)]


def _dsv4_sublayer(which: str):
    from .megakernel.dsv4_layer import DSV4LayerConfig, build_program
    tp8 = dict(heads=8, hidden=5120, q_rank=1024, o_rank=1024, window=128, max_seq_len=16384)
    if which == "hca":
        return build_program(DSV4LayerConfig(mode="hca", ratio=128, **tp8))
    if which == "csa":      # V4.1's serving formats: fp8 ring records, fp4 entries, mxfp4 indexer keys
        return build_program(DSV4LayerConfig(mode="csa", ratio=4, batch=8, window_dtype="fp8_e4m3",
                                             comp_dtype="fp4_e2m1", index_dtype="mxfp4", **tp8))
    # HCA as V4.1 runs it: its lagged mHC residual around it, queries without the head norm, fp8 / fp4 caches
    v41 = build_program(DSV4LayerConfig(mode="hca", ratio=128, mhc="v41", q_head_norm=False, window_dtype="fp8_e4m3",
                                        comp_dtype="fp4_e2m1", **tp8))
    if which == "v41":
        return v41
    # the whole V4.1 decoder layer in one launch: that sublayer joined with the MoE layer (EP8 shard)
    from .megakernel import moe_layer
    from .megakernel.mhc_layer import join
    return join(v41, moe_layer.build_program(moe_layer.preset("deepseek_v41_flash", 1, expert_dtype="mxfp4",
                                                               mhc="v41")))


def sublayer_megakernel_cases():
    """(name, build) of the attention sublayers, decoder layers and whole-model programs: megakernels
    whose plain tiles (decode, compressor, prologue) allocate the arena beside the weight ring;
    build() returns the program (built only when compiled: the list is cheap)."""
    return [("megakernel dsv4 hca sublayer (V4.1 TP8, 16K)", lambda: _dsv4_sublayer("hca")),
            ("megakernel dsv4 csa sublayer, V4.1 cache formats (TP8, 16K, B=8)", lambda: _dsv4_sublayer("csa")),
            ("megakernel dsv4 hca sublayer in V4.1's lagged mHC, V4.1 formats (TP8, 16K)", lambda: _dsv4_sublayer("v41")),
            ("megakernel V4.1 decoder layer: that sublayer + the MoE (EP8 shard), one launch",
             lambda: _dsv4_sublayer("layer")),
            ("megakernel V4.1 whole model (small_v41: 4 layers, embedding to logits), B=8",
             lambda: _small_model("deepseek_v41_flash", "small_v41")),
            ("megakernel Kimi K3 decoder layer: KDA (TP8) + latent MoE (EP16 shard), in place, one launch",
             _k3_layer),
            ("megakernel GLM-5.3 decoder layer: DSA (TP8, 32K) + MoE (EP8 shard), each in its mHC site, one launch",
             _glm_layer),
            ("megakernel Kimi K3 whole model (small: KDA, MLA, dense, latent MoE; embedding to logits), B=8",
             _small_k3_model),
            ("megakernel GLM-5.3 whole model (small: KDA, DSA, shared DSA, dense, MoE, mHC; embedding to logits), "
             "B=8", lambda: _small_model("glm_53")),
            ("megakernel Kimi K3 TP8 rank program (its first 4 layers at full width: KDA / MLA heads, dense, latent "
             "MoE with the K-sharded up, the all-reduces and gathers; the vocabulary-parallel head), B=1",
             lambda: _tp8_program("kimi_k3")),
            ("megakernel GLM-5.3 TP8 rank program (its first 4 layers at full width: KDA / DSA heads, dense, MoE, "
             "each post-mix the all-reduce's mHC epilogue; the vocabulary-parallel head), B=1",
             lambda: _tp8_program("glm_53")),
            ("megakernel DeepSeek-V4.1 TP8 rank program (its first 4 layers at full width: HCA x3 + CSA, 8 query "
             "heads and one o_a group a rank, hash-routed then learned MoE; lagged mHC epilogues), B=1",
             lambda: _tp8_program("deepseek_v41_flash", "full_v41")),
            ("megakernel DeepSeek-V4.1 TP8 rank program at batch 64 (its first 4 layers; 166 instructions on one "
             "SM: the records stream through a window of smem slots)",
             lambda: _tp8_program("deepseek_v41_flash", "full_v41", batch=64)),
            ("megakernel DeepSeek-V4.1-Flash TP4 rank program (two o_a groups a rank: one grouped o_a GEMV), B=8",
             lambda: _tp8_program("deepseek_v41_flash", "full_v41", batch=8, ranks=4))]


def program_cases(arch: str):
    """(name, build) of the programs compile_check compiles for `arch`."""
    return sublayer_megakernel_cases() + (hopper_program_cases() if arch == "sm_90a" else [])


def compile_program(build, arch: str, num_sms: int = 132) -> None:
    """Compile the megakernel of the program build() returns, with the timing record, for `arch`."""
    from .megakernel.kernel import compile_megakernel
    from .schedule import schedule
    prog = build()
    compile_megakernel(prog.opcodes.blocks, num_sms, schedule(prog, num_sms).max_len, timing=True, arch=arch)


def _k3_layer():
    from .megakernel import kda_layer, moe_layer
    from .megakernel.plain_model import chain
    return chain([kda_layer.build_program(kda_layer.KDALayerConfig(heads=12, eps=1e-5, resid_in_place=True)),
                  moe_layer.build_program(moe_layer.preset("kimi_k3", 1, expert_dtype="mxfp4", norm_eps=1e-5,
                                                           resid_in_place=True))], ["attn.", "mlp."])[0]


def _glm_layer():
    from . import plugins
    from .megakernel import dsa_layer, moe_layer
    from .megakernel.mhc_layer import join
    spec = plugins.get_model("glm_53").spec("full")
    return join(dsa_layer.build_program(dsa_layer.shard_config(spec, max_seq_len=32768, mhc="v4")),
                moe_layer.build_program(moe_layer.preset("glm_53", 1, expert_dtype="mxfp4", mhc="v4", norm_eps=1e-5)))


def _tp8_program(model: str, config: str = "full", batch: int = 1, ranks: int = 8):
    import dataclasses

    from . import plugins
    from .megakernel import tp_model
    spec = plugins.get_model(model).spec(config)
    cfg, build = ((tp_model.TPModelConfig, tp_model.build_program) if model == "kimi_k3" else
                  (tp_model.TPMHCModelConfig, tp_model.build_mhc_program))
    return build(cfg(dataclasses.replace(spec, layers=spec.layers[:4]), batch=batch, max_seq_len=4096,
                     ranks=ranks))[0]


def _small_k3_model():
    from . import plugins
    from .megakernel.plain_model import PlainModelConfig, build_program
    return build_program(PlainModelConfig(plugins.get_model("kimi_k3").spec("small"), batch=8, max_seq_len=256))


def _small_model(model: str, config: str = "small"):
    from . import plugins
    from .megakernel.mhc_model import MHCModelConfig, build_program
    return build_program(MHCModelConfig(plugins.get_model(model).spec(config), batch=8, max_seq_len=256))


def time_case(res: dict, name: str, build) -> None:
    """res[name] = the seconds `build()` took, or "error: ..." if it raised (a compile check
    reports every case, never stops at the first failure)."""
    t0 = time.time()
    try:
        build()
        res[name] = round(time.time() - t0, 3)
    except Exception as exc:
        res[name] = f"error: {type(exc).__name__}: {exc}"


def compile_check(archs=ARCHS, num_sms: int = 132, program_archs=None) -> dict:
    """Compile every block case and the MLP-stack megakernels for each arch, and the larger
    programs (`program_cases`) for the archs in `program_archs` (default: all of `archs`); never
    raises for a failed case (its entry says "error: ..."). Needs nvidia-cutlass-dsl, no GPU."""
    from .blocks._cute import standalone
    from .megakernel.mlp_stack import build_program
    report: dict = {}
    for arch in archs:
        res = report.setdefault(arch, {})
        hopper = arch == "sm_90a"
        for block in block_cases() + (hopper_block_cases() if hopper else []):
            time_case(res, f"{block.name} {block.config}", lambda: standalone(block, arch))
        for cfg in megakernel_cases() + (hopper_megakernel_cases() if hopper else []):
            time_case(res, f"megakernel mlp_stack {cfg}", lambda cfg=cfg: compile_program(lambda: build_program(cfg),
                                                                                          arch, num_sms))
        if program_archs is None or arch in program_archs:
            for name, build in program_cases(arch):
                time_case(res, name, lambda build=build: compile_program(build, arch, num_sms))
    return report


def failures(report: dict) -> list[str]:
    return [f"{arch}: {case}: {v}" for arch, cases in report.items() for case, v in cases.items()
            if isinstance(v, str)]
