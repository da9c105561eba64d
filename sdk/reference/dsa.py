"""Reference DeepSeek Sparse Attention (DSA) as GLM-5.3 runs it: the k-pool lightning indexer and
NoPE MLA restricted to the tokens it selects.

Follows transformers 5.24 `Glm5NextTextIndexer` and `Glm5NextTextAttention` (models/glm5_next).
For a query token at position p (its sequence's own positions, 0-based), with H indexer heads of
width d and pool size P = `kpool`:

    k_j      = LayerNorm(wk x_j)  (eps 1e-6, weight and bias)            one key per token   [d]
    gate_j   = index_kpool_compress_gate x_j                                                  [d]
    pool m   = tokens mP .. mP+P-1, complete once token mP+P-1 exists:
               K_m = sum_i softmax_i(gate_i + ape_i) * k_i   (softmax over the P tokens, per channel)
    q_h      = wq_b q_resid  (q_resid = the MLA's q_a_layernorm(q_a_proj x))                  [H, d]
    w_h      = weights_proj(x)_h * H^-0.5
    score_m  = sum_h w_h * ReLU(q_h . K_m * d^-0.5)          over the complete pools m < (p+1) // P
    selected = the top min(topk / P, #pools) pools' tokens, plus (if `select_tail`) the tail: the
               (p+1) % P tokens of the incomplete last pool, p itself included
    out      = o_proj(MLA attention of the query over the selected tokens only)

A "shared" layer (`DSAIndexerSpec.shared`) has no indexer: it attends over the selection that the
layer right before it computed for the same query tokens (transformers passes `prev_topk_indices`
down its layer loop; here the selection rides on the call's `StepInfo`, see `handoff`). The model
package checks that the previous layer runs its own indexer.

Local weight names (= the HF names under `self_attn.`): the MLA's (sdk/reference/mla.py) and, for a
layer with its own indexer,
    indexer.wq_b.weight [H*d, q_lora]        indexer.wk.weight [d, D]
    indexer.k_norm.weight [d], indexer.k_norm.bias [d]
    indexer.weights_proj.weight [H, D]
    indexer.index_kpool_compress_ape [P, d]  indexer.index_kpool_compress_gate [d, D]

Cache (all batch-first, updated in place): the MLA's "latent" [B, S, kv_lora] and, with an indexer,
    "index_tail_k"    [B, P, d]     keys of the pool being filled (token p at row p % P)
    "index_tail_gate" [B, P, d]     their gate logits
    "index_pool_k"    [B, S // P, d] pooled keys of complete pools (pool m at row m)
A decode step reads only the pooled keys; a token's own key and gate are needed until its pool
completes, so they live in a P-row ring. Tokens are folded into the ring one position at a time,
so a T-token call equals T single steps; ragged batches carry their own positions.

Not implemented: `index_kpool_always_select_tail=False` with P > 1 (the first P-1 tokens would
attend to nothing; rejected by the model package), padding inside a sequence (transformers pools
from the first unpadded token; the SDK never feeds padding), RoPE in the indexer (GLM is NoPE),
the serving cache formats (FP8 / NVFP4 latent records).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import SdkError, UnsupportedConfigError
from ..spec import DSAIndexerSpec, LayerSpec, MLASpec, ModelSpec
from .common import StepInfo
from .mla import MLAReference
from .weights import Prefixed

KEY_NORM_EPS = 1e-6  # Glm5NextTextIndexer: nn.LayerNorm(head_dim, eps=1e-6), not the config's eps


def handoff(step: StepInfo) -> dict:
    """{layer index: top-k token indices [B, T, W]} of this decode call, for a following "shared"
    layer. Kept on the StepInfo object that every layer of one call receives."""
    selections = getattr(step, "dsa_topk", None)
    if selections is None:
        selections = {}
        step.dsa_topk = selections
    return selections


def selection_mask(indices: torch.Tensor, length: int) -> torch.Tensor:
    """Token indices [B, T, W] (-1 = none) -> BoolTensor [B, T, length]."""
    valid = (indices >= 0) & (indices < length)
    # counts, not a boolean scatter: unused entries land on a clamped index and must not clear it
    counts = torch.zeros(*indices.shape[:2], length, dtype=torch.int32, device=indices.device)
    counts.scatter_add_(-1, indices.clamp(0, max(length - 1, 0)), valid.to(torch.int32))
    return counts > 0


class DSAIndexer:
    """GLM-5.3's k-pool indexer of one layer: its caches and its top-k selection."""

    def __init__(self, model: ModelSpec, spec: DSAIndexerSpec, weights):
        if spec.kpool < 1 or spec.topk < spec.kpool or spec.topk % spec.kpool:
            raise UnsupportedConfigError(f"DSA: topk={spec.topk} must be a positive multiple of kpool={spec.kpool}")
        if not spec.select_tail and spec.kpool > 1:
            raise UnsupportedConfigError("DSA: select_tail=False with kpool > 1 is not implemented")
        self.spec, self.w = spec, weights

    @staticmethod
    def expected_weights(model: ModelSpec, spec: DSAIndexerSpec, q_lora_rank: int) -> dict[str, tuple]:
        d, h, hd = model.hidden_size, spec.num_heads, spec.head_dim
        return {"wq_b.weight": (h * hd, q_lora_rank), "wk.weight": (hd, d),
                "k_norm.weight": (hd,), "k_norm.bias": (hd,), "weights_proj.weight": (h, d),
                "index_kpool_compress_ape": (spec.kpool, hd), "index_kpool_compress_gate": (hd, d)}

    @property
    def width(self) -> int:
        """Entries per query in `select`'s output: topk tokens of pools plus a tail of < kpool."""
        return self.spec.topk + (self.spec.kpool - 1 if self.spec.select_tail else 0)

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        p, hd = self.spec.kpool, self.spec.head_dim
        return {"index_tail_k": torch.zeros(batch, p, hd, device=device, dtype=dtype),
                "index_tail_gate": torch.zeros(batch, p, hd, device=device, dtype=dtype),
                "index_pool_k": torch.zeros(batch, max_seq_len // p, hd, device=device, dtype=dtype)}

    def update_cache(self, x: torch.Tensor, cache: dict, step: StepInfo) -> None:
        """Fold the new tokens' keys into the ring; pool every pool they complete."""
        w, p = self.w, self.spec.kpool
        k = F.layer_norm(F.linear(x, w["wk.weight"]), (self.spec.head_dim,), w["k_norm.weight"],
                         w["k_norm.bias"], KEY_NORM_EPS)
        gate = F.linear(x, w["index_kpool_compress_gate"])
        ring_k, ring_gate, pools = cache["index_tail_k"], cache["index_tail_gate"], cache["index_pool_k"]
        rows = torch.arange(step.batch, device=x.device)
        ape = w["index_kpool_compress_ape"].float()
        for t in range(step.num_tokens):
            pos = step.positions[:, t]
            slot = pos % p
            ring_k[rows, slot] = k[:, t].to(ring_k.dtype)
            ring_gate[rows, slot] = gate[:, t].to(ring_gate.dtype)
            if step.extent is not None:      # static shapes: every row's pool, kept where one completes
                probs = (ring_gate.float() + ape).softmax(dim=1).to(ring_k.dtype)
                pooled = (probs * ring_k).sum(dim=1).to(pools.dtype)
                at = pos // p
                pools[rows, at] = torch.where((slot == p - 1)[:, None], pooled, pools[rows, at])
                continue
            done = rows[slot == p - 1]
            if done.numel():
                probs = (ring_gate[done].float() + ape).softmax(dim=1).to(ring_k.dtype)  # over the pool's tokens
                pools[done, pos[done] // p] = (probs * ring_k[done]).sum(dim=1)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, cache: dict, step: StepInfo) -> torch.Tensor:
        """Token indices [B, T, width] each new query attends to (-1 = unused entry).
        `update_cache` must have run for these tokens."""
        s, w = self.spec, self.w
        p, b, t = s.kpool, step.batch, step.num_tokens
        pos = step.positions                                                     # [B, T]
        visible_pools = (pos + 1) // p                                           # complete pools <= p
        if step.extent is not None:          # static shapes: every pool, the invisible ones masked
            n_pools = cache["index_pool_k"].shape[1] if b and t else 0
        else:
            n_pools = int(visible_pools.max()) if b and t else 0
        parts = []
        if n_pools:
            q = F.linear(q_resid, w["wq_b.weight"]).view(b, t, s.num_heads, s.head_dim)
            keys = cache["index_pool_k"][:, :n_pools]
            scores = F.relu(torch.einsum("bthd,bmd->bthm", q.float(), keys.float()) * s.head_dim ** -0.5)
            weights = F.linear(x, w["weights_proj.weight"]).float() * s.num_heads ** -0.5
            index_scores = torch.einsum("bth,bthm->btm", weights, scores)
            visible = torch.arange(n_pools, device=x.device) < visible_pools[..., None]     # [B, T, M]
            index_scores = index_scores.masked_fill(~visible, float("-inf"))
            top = index_scores.topk(min(s.topk // p, n_pools), dim=-1).indices
            chosen = visible.gather(-1, top)                                     # fewer visible pools than k
            tokens = top[..., None] * p + torch.arange(p, device=x.device)       # [B, T, k, P]
            parts.append(tokens.masked_fill(~chosen[..., None], -1).flatten(-2))
        if s.select_tail and p > 1:
            count = (pos + 1) % p                                                # tokens of the incomplete pool
            offsets = torch.arange(p - 1, device=x.device)
            tail = (pos + 1 - count)[..., None] + offsets
            parts.append(tail.masked_fill(offsets >= count[..., None], -1))
        out = torch.cat(parts, dim=-1) if parts else torch.empty(b, t, 0, dtype=torch.long, device=x.device)
        return F.pad(out, (0, self.width - out.shape[-1]), value=-1)


class DSAMLAReference(MLAReference):
    """MLA (sdk/reference/mla.py) over the tokens GLM-5.3's DSA indexer selects (kind "dsa_mla")."""

    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        super().__init__(model, layer, weights)
        s: MLASpec = layer.attention
        if s.indexer is None:
            raise UnsupportedConfigError(f"layer {layer.index}: dsa_mla needs an indexer spec")
        if not s.q_lora_rank:
            raise UnsupportedConfigError(f"layer {layer.index}: the DSA indexer reads the q latent; q_lora_rank is unset")
        if s.qk_rope_head_dim:
            raise UnsupportedConfigError(f"layer {layer.index}: DSA with RoPE (qk_rope_head_dim="
                                         f"{s.qk_rope_head_dim}) is not implemented")
        self.index = layer.index
        self.indexer = None if s.indexer.shared else DSAIndexer(model, s.indexer, Prefixed(weights, "indexer."))

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: MLASpec = layer.attention
        out = MLAReference.expected_weights(model, layer)
        if not s.indexer.shared:
            out.update({f"indexer.{k}": v for k, v in
                        DSAIndexer.expected_weights(model, s.indexer, s.q_lora_rank).items()})
        return out

    def new_cache(self, batch: int, max_seq_len: int, device, dtype) -> dict:
        cache = super().new_cache(batch, max_seq_len, device, dtype)
        if self.indexer is not None:
            cache.update(self.indexer.new_cache(batch, max_seq_len, device, dtype))
        return cache

    def forward(self, x: torch.Tensor, cache: dict, step: StepInfo) -> torch.Tensor:
        b, t, _ = x.shape
        q_nope, q_pe, q_resid = self.project_q(x, step)
        self.write_cache(cache, step, self.project_kv(x, step))
        selections = handoff(step)
        if self.indexer is not None:
            self.indexer.update_cache(x, cache, step)
            topk = self.indexer.select(x, q_resid, cache, step)
        elif self.index - 1 in selections:
            topk = selections[self.index - 1]
        else:
            raise SdkError(f"layer {self.index} shares the DSA top-k of layer {self.index - 1}, "
                           "which computed none in this call")
        selections[self.index] = topk
        length = step.cache_extent()
        out = self.attend(q_nope, q_pe, cache, step, index_mask=selection_mask(topk, length))
        return F.linear(out.reshape(b, t, -1), self.w["o_proj.weight"], self._bias("o_proj"))

