"""Manifold-constrained hyper-connections (mHC), the reference residual of DeepSeek-V4 and GLM-5.3.

Follows transformers 5.24 `deepseek_v4` (DeepseekV4HyperConnection, DeepseekV4DecoderLayer.forward,
DeepseekV4HyperHead) and `glm5_next` (Glm5NextTextHyperConnection, Glm5NextTextHyperHead).

The residual stream is N = `hc_mult` copies of the hidden state, [B, T, N, D]:
  embed:  the embedding repeated on the N streams.
  around: from the streams X, with x = RMSNorm(flatten(X)) (no weight, eps = model norm_eps, fp32),
          m = x @ fn^T  split into  pre [N], post [N], comb [N, N]:
            pre  = sigmoid(m_pre  * scale[0] + base_pre) + eps
            post = 2 * sigmoid(m_post * scale[1] + base_post)
            comb = Sinkhorn(softmax(m_comb * scale[2] + base_comb, over the last axis) + eps)
          y = fn_sublayer(sum_n pre_n X_n)                  (the decoder applies the pre-norm)
          X' = post_n * y + sum_j comb[j, n] X_j            (comb is used transposed: comb^T @ X)
  head:   "weighted" (V4): pre = sigmoid((RMSNorm(flatten(X)) @ fn^T) * scale + base) + eps,
          sum_n pre_n X_n;  "mean" (GLM-5.3): the mean of the N streams, no weights;
          "carried" (V4.1): sum_n pre_n X_n with the last site's pre (lagged, below), no weights.
  lagged (V4.1, `lagged_pre`): a site's input is collapsed with the pre-mix the PREVIOUS site
          computed (the first site of the model: stream 0, the embedding itself); the site's own pre
          is carried to the next site (and from the last to the head). post / comb are the site's
          own, as before. The post-mix is computed in fp32 and rounded once (V4's rounds the
          coefficients to the stream dtype first). Source: vLLM's DeepSeek-V4.1 model
          (`mhc_pre_delayed_torch`, `mhc_post_torch`, DeepseekV4DecoderLayer.forward: "The reference
          collapses each sublayer's input with the *previous* sublayer's pre-mix"; the final collapse
          uses "the pre-mix from the last layer's FFN mixes ... (v4.1 has no learned hc_head)").
Sinkhorn (`sinkhorn`): divide by the column sums (+eps), then `sinkhorn_iters - 1` times by the row
sums and the column sums: columns sum to 1 exactly (up to eps), rows approximately.
The coefficients are computed in fp32; the mixes are cast to the stream's dtype like transformers.

ResidualSpec fields read: kind = "mhc", hc_mult (N), sinkhorn_iters, eps (hc_eps: Sinkhorn and the
pre floor), head ("weighted" | "mean" | "carried"), lagged_pre. The input RMSNorm's eps is `ModelSpec.norm_eps` (both
transformers models use rms_norm_eps there).

Canonical weight names (global; N streams, D = hidden):
  layers.{i}.hc_attn.fn [(2+N)*N, N*D], layers.{i}.hc_attn.base [(2+N)*N], layers.{i}.hc_attn.scale [3]
  layers.{i}.hc_mlp.{fn,base,scale}   the same, around the MLP
  hc_head.fn [N, N*D], hc_head.base [N], hc_head.scale [1]      (head = "weighted" only)
transformers names: V4 `layers.{i}.attn_hc.*`, `layers.{i}.ffn_hc.*`, `hc_head.hc_{fn,base,scale}`;
GLM-5.3 `layers.{i}.attn_hc.*`, `layers.{i}.ffn_hc.*` (its head has no weights).

The lagged state (the carried pre-mix) lives on the instance for one decode call: `embed` starts it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedConfigError
from ..spec import ModelSpec

HEADS = ("weighted", "mean", "carried")
SITES = {"attn": "hc_attn", "mlp": "hc_mlp"}


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive matrices [..., N, N] towards doubly stochastic ones (transformers' order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _flat_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """The unweighted RMSNorm of the flattened streams [B, T, N*D], in fp32."""
    x = streams.flatten(2).float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class MHCResidual:
    def __init__(self, model: ModelSpec, weights):
        r = model.residual
        if r.head not in HEADS:
            raise UnsupportedConfigError(f"mHC head {r.head!r} is not supported; supported: {HEADS}")
        if r.hc_mult < 1 or r.sinkhorn_iters < 1:
            raise UnsupportedConfigError(f"mHC needs hc_mult >= 1 and sinkhorn_iters >= 1; got {r}")
        if r.head == "carried" and not r.lagged_pre:
            raise UnsupportedConfigError("mHC head 'carried' needs lagged_pre (it collapses with the "
                                         "pre-mix the last site carries)")
        self.n, self.iters, self.eps, self.head_kind = r.hc_mult, r.sinkhorn_iters, r.eps, r.head
        self.lagged = r.lagged_pre
        self.norm_eps = model.norm_eps
        self.w = weights
        self.carried = None          # lagged: the pre-mix [B, T, N] the next site collapses with

    @staticmethod
    def expected_weights(model: ModelSpec) -> dict[str, tuple]:
        n, d = model.residual.hc_mult, model.hidden_size
        out = {}
        for layer in model.layers:
            for site in SITES.values():
                p = f"layers.{layer.index}.{site}."
                out.update({p + "fn": ((2 + n) * n, n * d), p + "base": ((2 + n) * n,), p + "scale": (3,)})
        if model.residual.head == "weighted":
            out.update({"hc_head.fn": (n, n * d), "hc_head.base": (n,), "hc_head.scale": (1,)})
        return out

    def coefficients(self, prefix: str, streams: torch.Tensor):
        """(pre [B,T,N], post [B,T,N], comb [B,T,N,N]) in fp32 from the weights under `prefix`."""
        n = self.n
        mixes = F.linear(_flat_norm(streams, self.norm_eps), self.w[prefix + "fn"].float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.w[prefix + "base"].float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.w[prefix + "scale"].float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        return pre, post, sinkhorn(comb, self.iters, self.eps)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        self.carried = None
        return x.unsqueeze(2).expand(-1, -1, self.n, -1).contiguous()

    def around(self, layer: int, site: str, streams: torch.Tensor, fn) -> torch.Tensor:
        dtype = streams.dtype
        pre, post, comb = self.coefficients(f"layers.{layer}.{SITES[site]}.", streams)
        if not self.lagged:
            collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(dtype)
            out = fn(collapsed)
            return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
                    + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))
        collapsed = streams[:, :, 0] if self.carried is None else self._collapse(self.carried, streams)
        self.carried = pre
        out = fn(collapsed)
        x = streams.float()
        return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)).to(dtype)

    @staticmethod
    def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=2).to(streams.dtype)

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        if self.head_kind == "mean":
            return streams.mean(dim=2)
        if self.head_kind == "carried":
            if self.carried is None:
                raise RuntimeError("mHC head 'carried': no site ran since embed()")
            return self._collapse(self.carried, streams)
        mixes = F.linear(_flat_norm(streams, self.norm_eps), self.w["hc_head.fn"].float())
        pre = torch.sigmoid(mixes * self.w["hc_head.scale"].float() + self.w["hc_head.base"].float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
