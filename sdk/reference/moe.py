"""Reference MLPs: the dense SwiGLU MLP and the routed Mixture-of-Experts with shared experts.

Local weight names (under `layers.{i}.mlp.`):
  dense:  gate_proj.weight [I, D], up_proj.weight [I, D], down_proj.weight [D, I]
  moe:    gate.weight [E, D]                  router
          gate.e_score_correction_bias [E]    if spec.correction_bias (selection only)
          gate.tid2eid [V, k] (int64)         if spec.hash_routed (token id -> experts)
          experts.gate_up_proj [E, 2I, D]     gate rows first, then up rows
          experts.down_proj [E, D, I]
          shared_experts.{gate,up,down}_proj.weight   if spec.num_shared_experts

MoESpec.extra keys read here: "router_logits_dtype" = "model" computes the router logits in the
activations' dtype (DeepSeek-V4) instead of fp32 (the default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import DenseMlpSpec, LayerSpec, ModelSpec, MoESpec
from .common import StepInfo, swiglu

SCORING = ("sigmoid", "softmax", "sqrtsoftplus")


def dense_mlp_weights(prefix: str, hidden: int, inter: int) -> dict[str, tuple]:
    return {f"{prefix}gate_proj.weight": (inter, hidden), f"{prefix}up_proj.weight": (inter, hidden),
            f"{prefix}down_proj.weight": (hidden, inter)}


def dense_mlp(x, w, prefix: str, act: str = "silu", limit: float | None = None):
    gate = F.linear(x, w[f"{prefix}gate_proj.weight"])
    up = F.linear(x, w[f"{prefix}up_proj.weight"])
    return F.linear(swiglu(gate, up, act, limit), w[f"{prefix}down_proj.weight"])


class DenseMLPReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        self.spec: DenseMlpSpec = layer.mlp
        self.w = weights

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        return dense_mlp_weights("", model.hidden_size, layer.mlp.intermediate_size)

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        return dense_mlp(x, self.w, "", self.spec.activation, self.spec.swiglu_limit)


def route(spec: MoESpec, logits: torch.Tensor, bias: torch.Tensor | None,
          hash_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (fp32) -> (weights [N, k], expert ids [N, k]).

    Scores by `spec.scoring`; the correction bias changes which experts are selected, never their
    weights; group-limited top-k keeps the `topk_group` best of `n_group` groups (a group's score
    is the sum of its two best experts); weights are renormalised over the selected experts if
    `norm_topk_prob`, then multiplied by `routed_scaling_factor`. Hash-routed layers take the
    experts from the token-id table instead of a top-k."""
    if spec.scoring == "sigmoid":
        scores = logits.sigmoid()
    elif spec.scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif spec.scoring == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    else:
        raise UnsupportedConfigError(f"unsupported MoE scoring {spec.scoring!r}; supported: {SCORING}")
    if hash_experts is not None:
        ids = hash_experts
    else:
        choice = scores if bias is None else scores + bias
        if spec.n_group > 1:
            n, e = choice.shape
            grouped = choice.view(n, spec.n_group, e // spec.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(e // spec.n_group, dim=1), float("-inf"))
        ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


class MoEReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        self.spec: MoESpec = layer.mlp
        self.w = weights

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: MoESpec = layer.mlp
        d, e, i = model.hidden_size, s.num_experts, s.expert_intermediate_size
        out = {"gate.weight": (e, d), "experts.gate_up_proj": (e, 2 * i, d), "experts.down_proj": (e, d, i)}
        if s.correction_bias:
            out["gate.e_score_correction_bias"] = (e,)
        if s.hash_routed:
            out["gate.tid2eid"] = (model.vocab_size, s.top_k)
        if s.num_shared_experts:
            out.update(dense_mlp_weights("shared_experts.", d, s.shared_intermediate_size))
        return out

    def router(self, x: torch.Tensor, step: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], ids [N, k])."""
        s = self.spec
        if dict(s.extra).get("router_logits_dtype") == "model":
            # DeepSeek-V4 computes logits and scores in the activations' dtype (its gate weight is
            # not kept in fp32), so a bf16 run rounds them to bf16 too.
            logits = F.linear(x, self.w["gate.weight"].to(x.dtype))
        else:
            logits = F.linear(x.to(torch.float32), self.w["gate.weight"].to(torch.float32))
        bias = self.w.get("gate.e_score_correction_bias") if s.correction_bias else None
        hashed = self.w["gate.tid2eid"][step.input_ids.reshape(-1)].long() if s.hash_routed else None
        return route(s, logits, bias, hashed)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Hit experts only: each expert runs on the tokens routed to it."""
        s = self.spec
        out = torch.zeros_like(x)
        gate_up, down = self.w["experts.gate_up_proj"], self.w["experts.down_proj"]
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, s.activation, s.swiglu_limit), down[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None].to(y.dtype)).to(out.dtype))
        return out

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        weights, ids = self.router(flat, step)
        y = self.experts(flat, weights, ids).view(b, t, d)
        if self.spec.num_shared_experts:
            y = y + dense_mlp(x, self.w, "shared_experts.", self.spec.activation, self.spec.swiglu_limit)
        return y
