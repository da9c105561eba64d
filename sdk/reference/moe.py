"""Reference MLPs: the dense gated MLP (SwiGLU or SiTU) and the routed Mixture-of-Experts with
shared experts, optionally on a latent (Kimi K3's Stable LatentMoE).

Local weight names (under `layers.{i}.mlp.`):
  dense:  gate_proj.weight [I, D], up_proj.weight [I, D], down_proj.weight [D, I]
  moe:    gate.weight [E, D]                  router
          gate.e_score_correction_bias [E]    if spec.correction_bias (selection only)
          gate.tid2eid [V, k] (int64)         if spec.hash_routed (token id -> experts)
          experts.gate_up_proj [E, 2I, D]     gate rows first, then up rows
          experts.down_proj [E, D, I]
          shared_experts.{gate,up,down}_proj.weight   if spec.num_shared_experts
  latent moe (spec.latent_size = L > 0; names are ours: no public HF class has this MoE):
          latent_down.weight [L, D]           x -> z, the experts' input
          latent_norm.weight [L]              RMSNorm of the weighted expert sum
          latent_up.weight [D, L]             back to the hidden size
          experts.gate_up_proj [E, 2I, L], experts.down_proj [E, L, I]   (on the latent)
          the router and the shared experts stay on D.

Latent forward: y = latent_up(RMSNorm(sum_j w_j * expert_j(z))) + shared(x), z = latent_down(x).
The weighted sum is accumulated in fp32 (each expert's output is in the activations' dtype, then
weighted and added in fp32); the norm runs on the fp32 sum and rounds once to the activations'
dtype before its weight, as `rms_norm` does. The plain (non-latent) MoE accumulates its weighted
sum in the activations' dtype (transformers' kimi_linear / deepseek order), which is unchanged.

MoESpec.extra keys read here: "router_logits_dtype" = "model" computes the router logits in the
activations' dtype (DeepSeek-V4) instead of fp32 (the default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import DenseMlpSpec, LayerSpec, ModelSpec, MoESpec
from .common import StepInfo, rms_norm, swiglu

SCORING = ("sigmoid", "softmax", "sqrtsoftplus")


def dense_mlp_weights(prefix: str, hidden: int, inter: int) -> dict[str, tuple]:
    return {f"{prefix}gate_proj.weight": (inter, hidden), f"{prefix}up_proj.weight": (inter, hidden),
            f"{prefix}down_proj.weight": (hidden, inter)}


def gated_act(spec: DenseMlpSpec | MoESpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The spec's gated activation (SwiGLU with its clamp, or SiTU with its betas)."""
    return swiglu(gate, up, spec.activation, spec.swiglu_limit, spec.situ_beta, spec.situ_linear_beta)


def dense_mlp(x, w, prefix: str, act: str = "silu", limit: float | None = None,
              beta: float = 4.0, linear_beta: float = 25.0):
    gate = F.linear(x, w[f"{prefix}gate_proj.weight"])
    up = F.linear(x, w[f"{prefix}up_proj.weight"])
    return F.linear(swiglu(gate, up, act, limit, beta, linear_beta), w[f"{prefix}down_proj.weight"])


def spec_dense_mlp(x, w, prefix: str, spec: DenseMlpSpec | MoESpec):
    """dense_mlp with the spec's activation parameters."""
    return dense_mlp(x, w, prefix, spec.activation, spec.swiglu_limit, spec.situ_beta, spec.situ_linear_beta)


class DenseMLPReference:
    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        self.spec: DenseMlpSpec = layer.mlp
        self.w = weights

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        return dense_mlp_weights("", model.hidden_size, layer.mlp.intermediate_size)

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        return spec_dense_mlp(x, self.w, "", self.spec)


def router_scores(spec: MoESpec, logits: torch.Tensor) -> torch.Tensor:
    """Router logits [N, E] -> the experts' scores by `spec.scoring` (what weighs a selected expert;
    the correction bias is added to them only to select)."""
    if spec.scoring == "sigmoid":
        return logits.sigmoid()
    if spec.scoring == "softmax":
        return logits.softmax(dim=-1)
    if spec.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    raise UnsupportedConfigError(f"unsupported MoE scoring {spec.scoring!r}; supported: {SCORING}")


def route(spec: MoESpec, logits: torch.Tensor, bias: torch.Tensor | None,
          hash_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (fp32) -> (weights [N, k], expert ids [N, k]).

    Scores by `spec.scoring`; the correction bias changes which experts are selected, never their
    weights; group-limited top-k keeps the `topk_group` best of `n_group` groups (a group's score
    is the sum of its two best experts); weights are renormalised over the selected experts if
    `norm_topk_prob`, then multiplied by `routed_scaling_factor`. Hash-routed layers take the
    experts from the token-id table instead of a top-k."""
    scores = router_scores(spec, logits)
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
    capturable = False      # the experts without host syncs (ReferenceModel.capturable)

    def __init__(self, model: ModelSpec, layer: LayerSpec, weights):
        self.spec: MoESpec = layer.mlp
        self.w = weights

    @staticmethod
    def expected_weights(model: ModelSpec, layer: LayerSpec) -> dict[str, tuple]:
        s: MoESpec = layer.mlp
        d, e, i = model.hidden_size, s.num_experts, s.expert_intermediate_size
        h = s.latent_size or d                  # the experts' width
        out = {"gate.weight": (e, d), "experts.gate_up_proj": (e, 2 * i, h), "experts.down_proj": (e, h, i)}
        if s.latent_size:
            out.update({"latent_down.weight": (h, d), "latent_norm.weight": (h,), "latent_up.weight": (d, h)})
        if s.correction_bias:
            out["gate.e_score_correction_bias"] = (e,)
        if s.hash_routed:
            out["gate.tid2eid"] = (model.vocab_size, s.top_k)
        if s.num_shared_experts:
            out.update(dense_mlp_weights("shared_experts.", d, s.shared_intermediate_size))
        return out

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> the router logits [N, E]."""
        if dict(self.spec.extra).get("router_logits_dtype") == "model":
            # DeepSeek-V4 computes logits and scores in the activations' dtype (its gate weight is
            # not kept in fp32), so a bf16 run rounds them to bf16 too.
            return F.linear(x, self.w["gate.weight"].to(x.dtype))
        return F.linear(x.to(torch.float32), self.w["gate.weight"].to(torch.float32))

    def router(self, x: torch.Tensor, step: StepInfo) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], ids [N, k])."""
        s = self.spec
        logits = self.router_logits(x)
        bias = self.w.get("gate.e_score_correction_bias") if s.correction_bias else None
        hashed = self.w["gate.tid2eid"][step.input_ids.reshape(-1)].long() if s.hash_routed else None
        return route(s, logits, bias, hashed)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                acc_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Hit experts only: each expert runs on the tokens routed to it (x [N, H], H = the
        experts' width). Each expert's output, in x's dtype, is weighted and summed in
        `acc_dtype` (default: x's dtype - the plain MoE; the latent MoE passes fp32)."""
        out = torch.zeros(x.shape, dtype=acc_dtype or x.dtype, device=x.device)
        gate_up, down = self.w["experts.gate_up_proj"], self.w["experts.down_proj"]
        if self.capturable:
            return self._grouped_experts(x, weights, ids, out, acc_dtype is not None)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(gated_act(self.spec, gate, up), down[e])
            w = weights[tok, slot, None]
            out.index_add_(0, tok, (y * w.to(y.dtype)).to(out.dtype) if acc_dtype is None else
                           y.to(out.dtype) * w.to(out.dtype))
        return out

    def _grouped_experts(self, x, weights, ids, out, wide_acc: bool) -> torch.Tensor:
        """`experts` without host syncs (capturable): the (token, slot) pairs sorted by expert, two
        grouped GEMMs over all experts (an empty group reads no weights: only the hit experts'
        are read), the weighted outputs added per token in the same order as the loop's."""
        gate_up, down = self.w["experts.gate_up_proj"], self.w["experts.down_proj"]
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        tok = order // k
        gate, up = torch._grouped_mm(x[tok], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(gated_act(self.spec, gate, up), down.transpose(1, 2), offs=offs)
        w = weights.flatten()[order, None]
        return out.index_add_(0, tok, y.to(out.dtype) * w.to(out.dtype) if wide_acc else
                              (y * w.to(y.dtype)).to(out.dtype))

    def latent_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Stable LatentMoE, routed part: latent_up(RMSNorm(sum_j w_j expert_j(latent_down(x)))),
        x [N, D] -> [N, D] in x's dtype (sum in fp32; module docstring)."""
        s = self.spec
        z = F.linear(x, self.w["latent_down.weight"])
        acc = self.experts(z, weights, ids, acc_dtype=torch.float32)
        h = rms_norm(acc, None, s.latent_norm_eps).to(x.dtype) * self.w["latent_norm.weight"]
        return F.linear(h, self.w["latent_up.weight"])

    def forward(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        weights, ids = self.router(flat, step)
        routed = self.latent_experts if self.spec.latent_size else self.experts
        y = routed(flat, weights, ids).view(b, t, d)
        if self.spec.num_shared_experts:
            y = y + spec_dense_mlp(x, self.w, "shared_experts.", self.spec)
        return y
