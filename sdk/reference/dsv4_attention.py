"""DeepSeek-V4 attention, the reference (follows transformers 5.24 `deepseek_v4`: DeepseekV4Attention,
DeepseekV4CSACompressor / DeepseekV4HCACompressor, DeepseekV4Indexer, their caches).

What one layer computes for a token at position p (x = the attention input, already normed):
  q   = RoPE(RMSNorm_head(q_b(RMSNorm(q_a(x)))))             [H, hd]  (per-head norm has no weight)
  kv  = RoPE(RMSNorm(kv_proj(x)))                             [hd]     one shared head, K = V
  keys: the sliding window (positions p-W+1 .. p), then, on compressed layers, the compressed
        entries w < (p+1) // r (CSA: only those the lightning indexer picks, top-k per query)
  o   = softmax([q.k * hd^-0.5, sink_h]) over keys + a per-head sink logit, dropped after softmax
  out = o_b(grouped o_a(RoPE^-1(o)))  the output's rope slice rotated back by -p; o_a is block
        diagonal over `o_groups` groups of heads, each projected to `o_lora_rank`.
RoPE is interleaved (pairs 2i, 2i+1) on the trailing `rope_dim` channels. `spec.rope` is the rope of
q and kv (HF: "main" on sliding-only layers, "compress" on CSA/HCA layers); `spec.compress_rope`
is the rope of the compressed entries and of the indexer's queries ("compress", possibly YaRN).
Supported rope types: "default" and "yarn" (sdk/reference/common.py `rope_inv_freq`, as transformers
computes them, cos/sin multiplied by the attention factor, which V4 pins to 1.0 for YaRN unless the
config sets it). V4 does not fold YaRN's mscale into its softmax scale (unlike DeepSeek-V3's MLA).

Compression (one entry per `r` = compress_ratio tokens of a sequence): the tokens' projections
kv_proj(x), gate_proj(x) + position_bias[p % r] are pooled with a softmax over the window (per
channel, in fp32), the sum goes through RMSNorm (kv_norm) and RoPE at position w*r. HCA
(no overlap): the window is tokens w*r .. w*r+r-1. CSA (`compress_overlap`): features are 2*hd wide,
entry w pools the first half of window w-1's tokens and the second half of window w's tokens
(2r slots; for w = 0 the first half is empty). The indexer (CSA) has its own overlapping compressor
at `indexer.head_dim` and scores entry w for query p as sum_h wts_h * ReLU(q_h . k_w) / sqrt(ihd)
with wts = weights_proj(x) / sqrt(index heads); queries use the compress rope at p.

Caches (batch first, fixed size from max_seq_len, updated in place; sequences are ragged: an entry
is emitted when *that* sequence's position (w+1)*r - 1 is processed):
  window           [B, W, hd]        post-norm, post-RoPE KV of the last W tokens; slot = pos % W
  comp_kv          [B, S // r, hd]   compressed entries, slot w = window index       (CSA, HCA)
  comp_state_kv    [B, L, c]         projected kv of the open window (CSA: and the previous one)
  comp_state_gate  [B, L, c] fp32    gate + position bias of the same tokens; slot = pos % L,
                                     L = 2r, c = 2hd (CSA) or L = r, c = hd (HCA)
  index_keys       [B, S // r, ihd]  the indexer's compressed keys                  (CSA)
  index_state_kv / index_state_gate  [B, 2r, 2*ihd]   the indexer compressor's open windows
A T-token call equals T single-token calls: the compressor state advances token by token, the
attention of all T queries is computed together with per-query masks.

Local weight names (under `layers.{i}.attn.`), shapes for D = hidden, H heads of hd, q rank Q:
  q_a_proj.weight [Q, D]  q_a_norm.weight [Q]  q_b_proj.weight [H*hd, Q]
  kv_proj.weight [hd, D]  kv_norm.weight [hd]  sinks [H]
  o_a_proj.weight [G*R, H*hd/G]  o_b_proj.weight [D, G*R]            (G = o_groups, R = o_lora_rank)
  compressor.{kv_proj,gate_proj}.weight [c, D]  compressor.position_bias [r, c]
  compressor.kv_norm.weight [hd]                                      (compressed layers)
  indexer.{kv_proj,gate_proj}.weight [2*ihd, D]  indexer.position_bias [r, 2*ihd]
  indexer.kv_norm.weight [ihd]  indexer.q_b_proj.weight [IH*ihd, Q]  indexer.weights_proj.weight [IH, D]

Not supported here (DeepSeek-V4.1 serving features, see docs/models/deepseek_v41_flash.md): the
caches in V4.1's FP8 / FP4 / MXFP4 formats (they are the megakernel's, sdk/megakernel/dsv4_layer.py;
here a new entry or key can take a format's round trip: Compressor.entry_format; V4.1's MXFP4
indexer: index_query_format and bf16_index_stages; V4.1's queries without the per-head norm: the
spec's q_head_norm). The attention of a long prefill materialises [B, H, T, W + T + S/r] logits:
fine for an oracle, not for 100K-token prompts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import DSV4AttentionSpec, LayerSpec, ModelSpec, RopeSpec
from .common import StepInfo, rope_inv_freq


# ------------------------------------------------------------------------------------ helpers
def rms_norm_v4(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """DeepSeek-V4's RMSNorm: fp32 math, the (fp32) weight applied before the one cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h if weight is None else weight.float() * h).to(x.dtype)


class Rope:
    """Interleaved partial RoPE on the trailing `dim` channels."""
    # (spec, device) -> inv_freq there: copied to a GPU once, not on every call (a host-to-device
    # copy cannot be captured in a CUDA graph)
    _on_device: dict = {}

    def __init__(self, rope: RopeSpec):
        if not rope.interleaved:
            raise UnsupportedConfigError("deepseek_v4 attention: only interleaved RoPE is implemented")
        self.spec = rope
        self.inv_freq, self.factor = rope_inv_freq(rope)

    def cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., dim/2] (cast to the activations' dtype, as transformers)."""
        key = (self.spec, str(positions.device))
        inv = self._on_device.get(key)
        if inv is None:
            inv = self._on_device[key] = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate pairs (2i, 2i+1) of x's trailing 2*cos.shape[-1] channels; cos/sin broadcast
        against x[..., :-1] (give them a head axis for [.., H, hd] inputs). Negate sin to undo."""
        cos = cos.repeat_interleave(2, dim=-1).float()
        sin = sin.repeat_interleave(2, dim=-1).float()
        rd = cos.shape[-1]
        nope, rope = x[..., :-rd], x[..., -rd:]
        r = rope.float()
        rotated = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([nope, (r * cos + rotated * sin).to(x.dtype)], dim=-1)


class Compressor:
    """The compressor of one layer (main CSA/HCA or the indexer's): pending-token state and the
    emission of one entry per `ratio` tokens of each sequence.

    `capturable` (the benchmarks' CUDA-graphed PyTorch): no host sync on which sequences close a
    window - every sequence's entry is computed and written where it closes one (the same result).
    `entry_format` (None: the cache's dtype): a function applied to each new entry (in the cache's
    dtype) before it is written - a serving format's round trip, e.g. V4.1's fp4 records
    (sdk/megakernel/dsv4_layer.py's comp_dtype)."""
    capturable = False
    entry_format = None

    def __init__(self, w, prefix: str, dim: int, ratio: int, overlap: bool, rope: Rope, eps: float,
                 names: tuple[str, str, str]):
        self.w, self.p, self.dim, self.ratio, self.overlap = w, prefix, dim, ratio, overlap
        self.rope, self.eps = rope, eps
        self.entries, self.state_kv, self.state_gate = names   # cache keys

    @property
    def width(self) -> int:
        return 2 * self.dim if self.overlap else self.dim

    @property
    def slots(self) -> int:
        return 2 * self.ratio if self.overlap else self.ratio

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        return {self.entries: torch.zeros(batch, max_seq_len // self.ratio, self.dim, device=device, dtype=dtype),
                self.state_kv: torch.zeros(batch, self.slots, self.width, device=device, dtype=dtype),
                self.state_gate: torch.zeros(batch, self.slots, self.width, device=device, dtype=torch.float32)}

    def update(self, x: torch.Tensor, cache: dict, step: StepInfo) -> None:
        """Feed this call's tokens one at a time; write each entry a sequence completes."""
        b, t_len, _ = x.shape
        kv = F.linear(x, self.w[self.p + "kv_proj.weight"].to(x.dtype))
        gate = F.linear(x, self.w[self.p + "gate_proj.weight"].to(x.dtype))
        bias = self.w[self.p + "position_bias"].float()
        state_kv, state_gate, entries = cache[self.state_kv], cache[self.state_gate], cache[self.entries]
        rows = torch.arange(b, device=x.device)
        for t in range(t_len):
            pos = step.start + t
            slot = pos % self.slots
            state_kv[rows, slot] = kv[:, t].to(state_kv.dtype)
            state_gate[rows, slot] = gate[:, t].float() + bias[pos % self.ratio]
            if self.capturable:
                window = ((pos + 1) // self.ratio - 1).clamp(min=0)
                closes = ((pos + 1) % self.ratio == 0)[:, None]
                new = self._formatted(self.entry(state_kv, state_gate, rows, window), entries.dtype)
                entries[rows, window] = torch.where(closes, new, entries[rows, window])
                continue
            closing = torch.nonzero((pos + 1) % self.ratio == 0).flatten()
            if closing.numel():
                window = (pos[closing] + 1) // self.ratio - 1
                entries[closing, window] = self._formatted(self.entry(state_kv, state_gate, closing, window),
                                                           entries.dtype)

    def _formatted(self, entry: torch.Tensor, dtype) -> torch.Tensor:
        entry = entry.to(dtype)
        return entry if self.entry_format is None else self.entry_format(entry).to(dtype)

    def entry(self, state_kv, state_gate, rows, window) -> torch.Tensor:
        """The compressed entries [n, dim] of windows `window` [n] of sequences `rows` [n]."""
        r, d = self.ratio, self.dim
        offs = torch.arange(r, device=rows.device)
        if not self.overlap:
            kv, gate = state_kv[rows, :r], state_gate[rows, :r]
        else:
            cur = ((window % 2) * r)[:, None] + offs           # this window's slots
            prev = (((window + 1) % 2) * r)[:, None] + offs    # the previous window's slots
            first = (window == 0)[:, None, None]
            prev_kv = state_kv[rows[:, None], prev][..., :d].masked_fill(first, 0.0)
            prev_gate = state_gate[rows[:, None], prev][..., :d].masked_fill(first, float("-inf"))
            kv = torch.cat([prev_kv, state_kv[rows[:, None], cur][..., d:]], dim=1)
            gate = torch.cat([prev_gate, state_gate[rows[:, None], cur][..., d:]], dim=1)
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        pooled = rms_norm_v4(pooled, self.w[self.p + "kv_norm.weight"], self.eps)
        cos, sin = self.rope.cos_sin(window * r, pooled.dtype)
        return Rope.apply(pooled, cos, sin)


# ---------------------------------------------------------------------------------- attention
class DSV4AttentionReference:
    # V4.1's MXFP4 indexer (set by sdk/megakernel/dsv4_layer.py for index_dtype="mxfp4"; its keys take
    # the indexer compressor's entry_format): the round trip its queries take, and its score with
    # BF16 stage boundaries (staged_index_scores) instead of fp32 throughout
    index_query_format = None
    bf16_index_stages = False

    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        s: DSV4AttentionSpec = layer.attention
        self.s, self.w = s, weights
        self.scale = s.softmax_scale or s.head_dim ** -0.5
        if s.rope is None or (s.compress_ratio and s.compress_rope is None):
            raise UnsupportedConfigError("deepseek_v4 attention: the spec has no rope / compress_rope")
        self.rope = Rope(s.rope)
        self.compressor = self.indexer = None
        if s.compress_ratio:
            crope = Rope(s.compress_rope)
            self.compressor = Compressor(weights, "compressor.", s.head_dim, s.compress_ratio, s.compress_overlap,
                                         crope, s.norm_eps, ("comp_kv", "comp_state_kv", "comp_state_gate"))
            if s.indexer is not None:
                # the indexer's compressor always uses CSA's overlapping windows (as transformers)
                self.indexer = Compressor(weights, "indexer.", s.indexer.head_dim, s.compress_ratio, True,
                                          crope, s.norm_eps, ("index_keys", "index_state_kv", "index_state_gate"))
        elif s.indexer is not None:
            raise UnsupportedConfigError("deepseek_v4 attention: an indexer needs compressed KV (compress_ratio > 0)")

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: DSV4AttentionSpec = layer.attention
        d, h, hd, q = model.hidden_size, s.num_heads, s.head_dim, s.q_lora_rank
        g, rank = s.o_groups, s.o_lora_rank
        out = {"q_a_proj.weight": (q, d), "q_a_norm.weight": (q,), "q_b_proj.weight": (h * hd, q),
               "kv_proj.weight": (hd, d), "kv_norm.weight": (hd,), "sinks": (h,),
               "o_a_proj.weight": (g * rank, h * hd // g), "o_b_proj.weight": (d, g * rank)}
        if s.compress_ratio:
            c = 2 * hd if s.compress_overlap else hd
            out.update({"compressor.kv_proj.weight": (c, d), "compressor.gate_proj.weight": (c, d),
                        "compressor.position_bias": (s.compress_ratio, c), "compressor.kv_norm.weight": (hd,)})
        if s.indexer is not None:
            ih, ihd = s.indexer.num_heads, s.indexer.head_dim
            out.update({"indexer.kv_proj.weight": (2 * ihd, d), "indexer.gate_proj.weight": (2 * ihd, d),
                        "indexer.position_bias": (s.compress_ratio, 2 * ihd), "indexer.kv_norm.weight": (ihd,),
                        "indexer.q_b_proj.weight": (ih * ihd, q), "indexer.weights_proj.weight": (ih, d)})
        return out

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        cache = {"window": torch.zeros(batch, self.s.sliding_window, self.s.head_dim, device=device, dtype=dtype)}
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                cache.update(comp.new_cache(batch, max_seq_len, device, dtype))
        return cache

    # ------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, cache: dict, step: StepInfo) -> torch.Tensor:
        s, w = self.s, self.w
        b, t_len, _ = x.shape
        h, hd, win = s.num_heads, s.head_dim, s.sliding_window
        pos = step.positions                                                  # [B, T]
        cos, sin = self.rope.cos_sin(pos, x.dtype)

        q_res = rms_norm_v4(F.linear(x, w["q_a_proj.weight"].to(x.dtype)), w["q_a_norm.weight"], s.norm_eps)
        q = F.linear(q_res, w["q_b_proj.weight"].to(x.dtype)).view(b, t_len, h, hd)
        if s.q_head_norm:
            q = rms_norm_v4(q, None, s.norm_eps)
        q = Rope.apply(q, cos[:, :, None], sin[:, :, None])
        kv = rms_norm_v4(F.linear(x, w["kv_proj.weight"].to(x.dtype)), w["kv_norm.weight"], s.norm_eps)
        kv = Rope.apply(kv, cos, sin)                                         # [B, T, hd]

        # Sliding window: the ring (tokens before this call) then this call's tokens.
        ring = cache["window"]
        last = (step.start - 1)[:, None]
        ring_pos = last - torch.remainder(last - torch.arange(win, device=x.device), win)   # [B, W]; < 0: empty
        keys = torch.cat([ring.to(kv.dtype), kv], dim=1)
        key_pos = torch.cat([ring_pos, pos], dim=1)
        qp, kp = pos[:, :, None], key_pos[:, None, :]
        visible = (kp >= 0) & (kp <= qp) & (kp > qp - win)                    # [B, T, W + T]

        if self.compressor is not None:
            self.compressor.update(x, cache, step)
            entries = cache["comp_kv"]
            ready = torch.arange(entries.shape[1], device=x.device) < ((pos + 1) // s.compress_ratio)[..., None]
            if self.indexer is not None:
                self.indexer.update(x, cache, step)
                ready = ready & self.select(x, q_res, cache["index_keys"], ready, step)
            keys = torch.cat([keys, entries.to(kv.dtype)], dim=1)
            visible = torch.cat([visible, ready], dim=-1)

        logits = torch.einsum("bthd,bkd->bhtk", q.float(), keys.float()) * self.scale
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        sinks = w["sinks"].float().view(1, h, 1, 1).expand(b, h, t_len, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhtk,bkd->bthd", probs, keys.float()).to(x.dtype)
        out = Rope.apply(out, cos[:, :, None], -sin[:, :, None])              # undo RoPE on V's rope slice

        # Write this call's last W tokens into the ring (after the attention read the old ones).
        keep = torch.arange(max(0, t_len - win), t_len, device=x.device)
        slots = (step.start[:, None] + keep) % win
        ring[torch.arange(b, device=x.device)[:, None], slots] = kv[:, keep].to(ring.dtype)

        g, rank = s.o_groups, s.o_lora_rank
        o_a = w["o_a_proj.weight"].to(x.dtype).view(g, rank, -1)
        grouped = torch.einsum("btgi,gri->btgr", out.reshape(b, t_len, g, -1), o_a).reshape(b, t_len, g * rank)
        return F.linear(grouped, w["o_b_proj.weight"].to(x.dtype))

    def select(self, x, q_res, index_keys, ready, step: StepInfo) -> torch.Tensor:
        """The lightning indexer: mask [B, T, S/r] of the top-k ready entries per query."""
        scores = self.index_scores(x, q_res, index_keys, ready, step)
        k = min(self.s.indexer.topk, scores.shape[-1])
        top = scores.topk(k, dim=-1).indices
        return torch.zeros_like(ready).scatter_(-1, top, True) & ready

    def index_scores(self, x, q_res, index_keys, ready, step: StepInfo) -> torch.Tensor:
        """The lightning indexer's scores [B, T, S/r] (fp32; -inf where not ready)."""
        s, w = self.s, self.w
        b, t_len, _ = x.shape
        ih, ihd = s.indexer.num_heads, s.indexer.head_dim
        cos, sin = self.indexer.rope.cos_sin(step.positions, x.dtype)
        q = F.linear(q_res, w["indexer.q_b_proj.weight"].to(x.dtype)).view(b, t_len, ih, ihd)
        q = Rope.apply(q, cos[:, :, None], sin[:, :, None])
        if self.index_query_format is not None:
            q = self.index_query_format(q)
        head_w = F.linear(x, w["indexer.weights_proj.weight"].to(x.dtype)).float() * ih ** -0.5
        if self.bf16_index_stages:
            scores = staged_index_scores(q, index_keys, head_w * ihd ** -0.5)
        else:
            scores = F.relu(torch.einsum("bthd,bed->bthe", q.float(), index_keys.float())) * ihd ** -0.5
            scores = (scores * head_w[..., None]).sum(dim=2)
        return scores.masked_fill(~ready, float("-inf"))   # [B, T, E]


def staged_index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """V4.1's indexer score with its BF16 stage boundaries: q [..., T, H, d] and keys [..., E, d]
    (their values), weights [..., T, H] fp32 with every scale folded in -> [..., T, E] fp32 holding
    bf16 values. Per head h: dot = q_h . k in fp32, rounded to bf16; term = bf16(ReLU(dot) *
    bf16(w_h)); the score = bf16 of the fp32 sum of the terms in head order 0, 1, ... (the
    published V4.1 contract as flashinfer's MXFP4 DSA indexer states it: the dot, the weighted
    product and the head sum each rounded to BF16; the sum's order kept)."""
    def bf16(t):
        return t.to(torch.bfloat16).float()
    dot = bf16(torch.einsum("...thd,...ed->...the", q.float(), keys.float()))
    term = bf16(F.relu(dot) * bf16(weights.float())[..., None])
    total = term[..., 0, :]
    for h in range(1, term.shape[-2]):
        total = total + term[..., h, :]
    return bf16(total)
