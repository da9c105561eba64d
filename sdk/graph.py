"""The decode graph: spec + parallelism + batch + context -> per-layer ops with bytes and flops.

Decode is memory-bound, so each op carries the bytes it must move on one GPU (weights it reads,
KV/state it reads and writes) and its flops. `plan()` adds them up per layer and turns bytes into
the floor time at a GPU's bandwidth: no kernel can be faster than that floor.

What is counted (per GPU, one decode step of `batch` sequences at context `ctx`):
  - weights: attention projections sharded over `tp` heads (latent down-projections replicated),
    routed experts actually hit (expected distinct experts for batch*top_k uniform picks) on this
    GPU's `ep` shard (with ep = 1 and tp > 1, MoE-TP: a 1/tp slice of each), shared experts and dense MLPs sharded over `tp`, router replicated, lm_head
    sharded over `tp`;
  - KV/state: MLA latent cache (all heads share it, so every TP rank reads all of it), KDA state
    read and written, V4 sliding window + compressed slots + indexer keys, DSA indexer keys.
Activations and all-reduce traffic are small at decode and not counted (stated in the table).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UnsupportedConfigError
from .spec import LayerSpec, ModelSpec, QuantSpec

# Bytes per weight element, scales included.
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8_block128": 1.0 + 4 / (128 * 128),
                "fp8": 1.0 + 4 / (128 * 128), "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
# Bytes per cached value, scales included. A scheme of per-cache formats maps each cache to its
# bytes (None: every other cache): "v41" is DeepSeek-V4.1's serving caches (MODEL-FACTS F18, F21,
# F22; the megakernel's window_dtype / comp_dtype / index_dtype) - the sliding window 528 B a
# 512-value token (e4m3 + a UE8M0 scale per 32), the compressed entries 288 B (E2M1 + an E4M3
# scale per 16), the indexer's keys 68 B a 128-value key (MXFP4).
KV_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / 128, "fp32": 4.0,
            "v41": {"window": 1.0 + 1 / 32, "compressed": 0.5 + 1 / 16, "index_keys": 0.5 + 1 / 32,
                    None: 1.0 + 4 / 128}}

# Copy bandwidth in TB/s used for the floor. h200: measured on the project's H200 (DESIGN.md);
# b200 / gb300: datasheet 8 TB/s, not measured by us.
GPU_BANDWIDTH_TBS = {"h200": 4.26, "b200": 8.0, "gb300": 8.0}


@dataclass
class Op:
    name: str
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    flops: float = 0.0


@dataclass
class LayerPlan:
    index: int
    kind: str
    ops: list[Op] = field(default_factory=list)

    @property
    def weight_bytes(self):
        return sum(o.weight_bytes for o in self.ops)

    @property
    def kv_bytes(self):
        return sum(o.kv_bytes for o in self.ops)

    @property
    def bytes(self):
        return self.weight_bytes + self.kv_bytes


@dataclass
class Plan:
    model: str
    tp: int
    ep: int
    batch: int
    ctx: int
    gpu: str
    bandwidth_tbs: float
    layers: list[LayerPlan]
    head: LayerPlan

    def floor_us(self, item) -> float:
        return item.bytes / (self.bandwidth_tbs * 1e12) * 1e6

    @property
    def total_bytes(self):
        return sum(l.bytes for l in self.layers) + self.head.bytes

    @property
    def step_floor_us(self):
        return self.total_bytes / (self.bandwidth_tbs * 1e12) * 1e6

    @property
    def tokens_per_s(self):
        return self.batch / (self.step_floor_us * 1e-6)


def kv_value_bytes(kv_cache: str, cache: str | None = None) -> float:
    """Bytes a value of `cache` (a DeepSeek-V4 cache: "window" / "compressed" / "index_keys";
    None: any other) takes in the KV format `kv_cache`."""
    b = KV_BYTES.get(kv_cache)
    if b is None:
        raise UnsupportedConfigError(f"unknown KV cache format {kv_cache!r}; known: {sorted(KV_BYTES)}")
    return b.get(cache, b[None]) if isinstance(b, dict) else b


def _w(quant: str) -> float:
    try:
        return WEIGHT_BYTES[quant]
    except KeyError:
        raise UnsupportedConfigError(f"unknown weight format {quant!r}; known: {sorted(WEIGHT_BYTES)}") from None


def _heads(n: int, tp: int, what: str) -> int:
    if n % tp and tp % n:
        raise UnsupportedConfigError(f"{what}: {n} heads do not shard over tp={tp}")
    return max(1, n // tp)


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by `tokens` tokens picking top_k of num_experts
    (uniform routing; real routing is skewed, which hits fewer)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attention_ops(spec: ModelSpec, layer: LayerSpec, tp: int, batch: int, ctx: int, q: QuantSpec) -> list[Op]:
    a, d, wb, kvb = layer.attention, spec.hidden_size, _w(q.dense), kv_value_bytes(q.kv_cache)
    kind = a.kind
    if kind in ("mla", "dsa_mla"):
        h = _heads(a.num_heads, tp, "MLA")
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        latent = a.kv_lora_rank + a.qk_rope_head_dim
        q_w = (d * a.q_lora_rank + a.q_lora_rank * h * qk) if a.q_lora_rank else d * h * qk
        ops = [Op("q_proj", q_w * wb, flops=2 * batch * q_w),
               Op("kv_a_proj", d * latent * wb, flops=2 * batch * d * latent),
               Op("kv_b_proj (absorbed)", a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) * wb),
               Op("attention (latent)", kv_bytes=batch * ctx * latent * kvb,
                  flops=2 * batch * h * ctx * (latent + a.kv_lora_rank)),
               Op("o_proj", h * a.v_head_dim * d * wb, flops=2 * batch * h * a.v_head_dim * d)]
        if a.indexer is not None:  # DSA: the indexer picks which latent tokens the heads read
            ix = a.indexer
            kpool = getattr(ix, "kpool", 1)
            selected = min(ctx, ix.topk + (kpool - 1))
            if not getattr(ix, "shared", False):  # a shared layer reuses the previous layer's pick
                q_in = a.q_lora_rank or d
                ix_w = q_in * ix.num_heads * ix.head_dim + 2 * d * ix.head_dim + d * ix.num_heads
                ops.insert(3, Op("dsa indexer", ix_w * wb, kv_bytes=batch * (ctx // kpool) * ix.head_dim * kvb,
                                 flops=2 * batch * (ctx // kpool) * ix.num_heads * ix.head_dim))
            ops[-2] = Op("sparse attention (latent)", kv_bytes=batch * selected * latent * kvb,
                         flops=2 * batch * h * selected * (latent + a.kv_lora_rank))
        return ops
    if kind == "kda":
        h = _heads(a.num_heads, tp, "KDA")
        hd = a.head_dim
        proj = 3 * d * h * hd + d * h  # q, k, v, beta
        gates = 2 * (d * hd + hd * h * hd)  # low-rank forget gate and output gate
        state = h * hd * hd * 4.0
        return [Op("qkv+beta proj", proj * wb, flops=2 * batch * proj),
                Op("gates (low-rank)", gates * wb, flops=2 * batch * gates),
                Op("conv + delta rule", kv_bytes=batch * (2 * state + 2 * 3 * h * hd * (a.conv_kernel - 1) * 2),
                   flops=batch * 6 * h * hd * hd),
                Op("o_proj", h * hd * d * wb, flops=2 * batch * h * hd * d)]
    if kind == "dsv4":
        h = _heads(a.num_heads, tp, "DeepSeek-V4 attention")
        hd = a.head_dim
        q_w = d * a.q_lora_rank + a.q_lora_rank * h * hd
        kv_w = d * hd
        # grouped low-rank output: each group maps its heads to o_lora_rank, then all groups to d;
        # groups shard with their heads over tp.
        o_w = h * hd * a.o_lora_rank + max(1, a.o_groups // tp) * a.o_lora_rank * d
        window = min(ctx, a.sliding_window)
        ops = [Op("q_proj (low-rank)", q_w * wb, flops=2 * batch * q_w),
               Op("kv_proj", kv_w * wb, flops=2 * batch * kv_w)]
        slots = 0
        if a.compress_ratio:
            slots = ctx // a.compress_ratio
            ops.append(Op(f"compressor (ratio {a.compress_ratio})", 2 * d * hd * wb, flops=4 * batch * d * hd))
            if a.indexer is not None:
                ix = a.indexer
                ops.append(Op("indexer", (a.q_lora_rank * ix.num_heads * ix.head_dim + d * ix.num_heads) * wb,
                              kv_bytes=batch * slots * ix.head_dim * kv_value_bytes(q.kv_cache, "index_keys"),
                              flops=2 * batch * slots * ix.num_heads * ix.head_dim))
                slots = min(slots, ix.topk)
        kv_window = window * kv_value_bytes(q.kv_cache, "window") + slots * kv_value_bytes(q.kv_cache, "compressed")
        ops.append(Op("attention (window + compressed)", kv_bytes=batch * kv_window * hd,
                      flops=4 * batch * h * (window + slots) * hd))
        ops.append(Op("o_proj (grouped low-rank)", o_w * wb, flops=2 * batch * o_w))
        return ops
    if kind == "gqa":
        h, kvh = _heads(a.num_heads, tp, "GQA"), _heads(a.num_kv_heads, tp, "GQA kv")
        w = d * (h + 2 * kvh) * a.head_dim + h * a.head_dim * d
        return [Op("qkv+o proj", w * wb, flops=2 * batch * w),
                Op("attention", kv_bytes=batch * ctx * 2 * kvh * a.head_dim * kvb,
                   flops=4 * batch * h * ctx * a.head_dim)]
    raise UnsupportedConfigError(f"plan: unsupported attention kind {kind!r}")


def mlp_ops(spec: ModelSpec, layer: LayerSpec, tp: int, ep: int, batch: int, q: QuantSpec) -> list[Op]:
    m, d = layer.mlp, spec.hidden_size
    if m.kind == "dense":
        w = 3 * d * m.intermediate_size / tp
        return [Op("dense mlp", w * _w(q.dense), flops=2 * batch * w)]
    if m.num_experts % ep:
        raise UnsupportedConfigError(f"{m.num_experts} experts do not shard over ep={ep}")
    hit = expected_experts_hit(m.num_experts, m.top_k, batch) / ep
    h = m.latent_size or d                  # the experts' width (Kimi K3: the 3584 latent)
    # ep = 1 with tp > 1 is MoE-TP: every GPU holds a 1/tp slice of every expert's intermediate.
    expert_w = 3 * h * m.expert_intermediate_size / (tp if ep == 1 else 1)
    ops = [Op("router", m.num_experts * d * 2.0, flops=2 * batch * m.num_experts * d)]
    if m.latent_size:       # bf16 latent down (replicated) and up (rows split over TP: MODEL-FACTS F4)
        lw = d * h * (1 + 1 / tp)
        ops.append(Op("latent down/up", lw * 2.0, flops=2 * batch * lw))
    ops.append(Op(f"experts (~{hit:.1f} hit of {m.num_experts // ep})", hit * expert_w * _w(q.experts),
                  flops=2 * batch * m.top_k / ep * expert_w))
    if m.num_shared_experts:
        w = 3 * d * m.shared_intermediate_size / tp
        ops.append(Op("shared experts", w * _w(q.dense), flops=2 * batch * w))
    return ops


def plan(spec: ModelSpec, *, tp: int = 1, ep: int = 1, batch: int = 1, ctx: int = 4096, gpu: str = "h200",
         quant: QuantSpec | None = None) -> Plan:
    if gpu not in GPU_BANDWIDTH_TBS:
        raise UnsupportedConfigError(f"unknown gpu {gpu!r}; known: {sorted(GPU_BANDWIDTH_TBS)}")
    q = quant or spec.quant
    layers = []
    for layer in spec.layers:
        lp = LayerPlan(layer.index, f"{layer.attention.kind}+{layer.mlp.kind}")
        lp.ops = attention_ops(spec, layer, tp, batch, ctx, q) + mlp_ops(spec, layer, tp, ep, batch, q)
        layers.append(lp)
    head_w = spec.vocab_size * spec.hidden_size / tp
    head = LayerPlan(-1, "lm_head", [Op("lm_head", head_w * 2.0, flops=2 * batch * head_w)])
    return Plan(spec.name, tp, ep, batch, ctx, gpu, GPU_BANDWIDTH_TBS[gpu], layers, head)
