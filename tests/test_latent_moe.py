"""Kimi K3's SiTU activation and Stable LatentMoE in the reference (sdk/reference/common.py `situ`,
sdk/reference/moe.py `MoEReference`), each against an independent computation written here:
SiTU element by element in fp64 from its stated formula [MODEL-FACTS F1, F7], the latent MoE as a
per-token loop in fp64 (router, top-k, experts on the latent, RMSNorm, up, shared expert)."""
import math
import types

import pytest
import torch
import torch.nn.functional as F

from sdk.reference.common import StepInfo, situ, swiglu
from sdk.reference.moe import MoEReference
from sdk.spec import MoESpec

D, L, E, K, I, S = 48, 32, 16, 4, 24, 40     # hidden, latent, experts, top-k, expert and shared intermediate


def situ_direct(g: float, u: float, beta: float = 4.0, beta_lin: float = 25.0) -> float:
    """beta * tanh(g / beta) * sigmoid(g) * beta_lin * tanh(u / beta_lin), in Python floats (fp64)."""
    return beta * math.tanh(g / beta) / (1.0 + math.exp(-g)) * beta_lin * math.tanh(u / beta_lin)


def test_situ_equals_formula_in_fp64():
    g = torch.Generator().manual_seed(0)
    gate = torch.cat([torch.randn(2000, generator=g) * 6, torch.tensor([0.0, -60.0, 60.0, 1e-3])])
    up = torch.cat([torch.randn(2000, generator=g) * 40, torch.tensor([0.0, 80.0, -80.0, -1e-3])])
    want = torch.tensor([situ_direct(a, b) for a, b in zip(gate.double().tolist(), up.double().tolist())],
                        dtype=torch.float64)
    got = situ(gate, up)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * (1 + want.abs().max())
    assert want.abs().max() < 100                       # bounded by beta * beta_lin
    assert torch.equal(swiglu(gate, up, "situ"), got)   # defaults are K3's betas 4 and 25
    # other betas are honoured
    want2 = torch.tensor([situ_direct(a, b, 2.0, 3.0) for a, b in zip(gate.tolist(), up.tolist())],
                         dtype=torch.float64)
    got2 = swiglu(gate, up, "situ", beta=2.0, linear_beta=3.0)
    assert (got2.double() - want2).abs().max() <= 1e-5 * (1 + want2.abs().max())


def test_situ_bf16_rounds_once():
    """bf16 inputs: computed in fp32, one rounding of the result to bf16 (so, within the fp32
    error, the fp64 value rounded to bf16 - equal but for values sitting on a rounding boundary)."""
    g = torch.Generator().manual_seed(1)
    gate = (torch.randn(4096, generator=g) * 5).to(torch.bfloat16)
    up = (torch.randn(4096, generator=g) * 30).to(torch.bfloat16)
    got = situ(gate, up)
    assert got.dtype == torch.bfloat16
    want = torch.tensor([situ_direct(a, b) for a, b in zip(gate.double().tolist(), up.double().tolist())],
                        dtype=torch.float64)
    exact = (got.double() == want.to(torch.bfloat16).double()).float().mean()
    assert exact >= 0.995
    # and never more than one bf16 ulp away
    assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all()


def latent_spec(**kw) -> MoESpec:
    base = dict(num_experts=E, top_k=K, expert_intermediate_size=I, num_shared_experts=1,
                shared_intermediate_size=S, scoring="sigmoid", correction_bias=True, norm_topk_prob=True,
                routed_scaling_factor=1.0, activation="situ", latent_size=L, latent_norm_eps=1e-5)
    return MoESpec(**{**base, **kw})


def model_of(spec: MoESpec):
    layer = types.SimpleNamespace(index=0, mlp=spec)
    return types.SimpleNamespace(hidden_size=D, vocab_size=8, layers=(layer,)), layer


def random_weights(spec: MoESpec, seed: int) -> dict:
    """Unit-scale weights (logits and activations O(1); SiTU's tanh caps reached now and then)."""
    g = torch.Generator().manual_seed(seed)
    model, layer = model_of(spec)
    out = {}
    for name, shape in MoEReference.expected_weights(model, layer).items():
        if name == "latent_norm.weight":
            out[name] = 1 + 0.3 * torch.randn(shape, generator=g)
        elif name == "gate.e_score_correction_bias":
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) * 2 * shape[-1] ** -0.5
    return out


def step_of(n: int) -> StepInfo:
    return StepInfo(start=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, 1, dtype=torch.long),
                    input_ids=torch.zeros(n, 1, dtype=torch.long))


def latent_moe_direct(spec: MoESpec, w: dict, x: torch.Tensor) -> torch.Tensor:
    """Written from MODEL-FACTS' Kimi K3 MoE, token by token in fp64 (the router's logits in fp32,
    as stated, so that the selection is the reference's)."""
    wd = {k: v.double() for k, v in w.items()}
    act = lambda g, u: torch.tensor([situ_direct(a, b, spec.situ_beta, spec.situ_linear_beta)
                                     for a, b in zip(g.tolist(), u.tolist())], dtype=torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        logits = w["gate.weight"].float() @ x[n].float()
        scores = torch.sigmoid(logits).double()
        choice = scores + wd["gate.e_score_correction_bias"]
        ids = sorted(range(E), key=lambda e: -choice[e].item())[:K]
        weights = scores[ids] / scores[ids].sum()
        xn = x[n].double()
        z = wd["latent_down.weight"] @ xn
        acc = torch.zeros(L, dtype=torch.float64)
        for j, e in enumerate(ids):
            gu = wd["experts.gate_up_proj"][e] @ z
            acc += weights[j] * (wd["experts.down_proj"][e] @ act(gu[:I], gu[I:]))
        h = acc / math.sqrt((acc * acc).mean().item() + spec.latent_norm_eps) * wd["latent_norm.weight"]
        shared = wd["shared_experts.down_proj.weight"] @ act(wd["shared_experts.gate_proj.weight"] @ xn,
                                                             wd["shared_experts.up_proj.weight"] @ xn)
        out[n] = wd["latent_up.weight"] @ h + shared
    return out


def test_expected_weights_of_latent_moe():
    model, layer = model_of(latent_spec())
    got = MoEReference.expected_weights(model, layer)
    assert got == {"gate.weight": (E, D), "gate.e_score_correction_bias": (E,),
                   "latent_down.weight": (L, D), "latent_norm.weight": (L,), "latent_up.weight": (D, L),
                   "experts.gate_up_proj": (E, 2 * I, L), "experts.down_proj": (E, L, I),
                   "shared_experts.gate_proj.weight": (S, D), "shared_experts.up_proj.weight": (S, D),
                   "shared_experts.down_proj.weight": (D, S)}
    model, layer = model_of(latent_spec(latent_size=0))
    got = MoEReference.expected_weights(model, layer)
    assert (got["experts.gate_up_proj"], got["experts.down_proj"]) == ((E, 2 * I, D), (E, D, I))
    assert not any(k.startswith("latent_") for k in got)


@pytest.mark.parametrize("seed", [0, 1])
def test_latent_moe_forward_equals_direct_loop(seed):
    spec = latent_spec()
    w = random_weights(spec, seed)
    model, layer = model_of(spec)
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(100 + seed))
    got = MoEReference(model, layer, w).forward(x, step_of(6))
    want = latent_moe_direct(spec, w, x.reshape(-1, D)).reshape(2, 3, D)
    assert want.std() > 0.3
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()
    # the RMSNorm makes the routed part invariant to the scale of the expert sum
    w2 = dict(w, **{"experts.down_proj": 8 * w["experts.down_proj"]})
    assert (MoEReference(model, layer, w2).forward(x, step_of(6)) - got).abs().max() <= 1e-4 * got.abs().max()


def test_latent_moe_bf16_is_close_to_fp64():
    """bf16 weights and activations: the fp32-accumulated latent sum keeps the result within bf16's
    error of the fp64 loop."""
    spec = latent_spec()
    w = {k: (v.to(torch.bfloat16) if k not in ("gate.weight", "gate.e_score_correction_bias") else v)
         for k, v in random_weights(spec, 3).items()}
    model, layer = model_of(spec)
    x = torch.randn(1, 4, D, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = MoEReference(model, layer, w).forward(x, step_of(4))
    assert got.dtype == torch.bfloat16
    want = latent_moe_direct(spec, {k: v.float() for k, v in w.items()}, x.reshape(-1, D).float())
    err = (got.double().reshape(-1, D) - want).abs().max() / want.abs().max()
    assert err <= 3e-2


def test_latent_size_zero_is_the_plain_moe():
    """latent_size = 0: exactly the plain MoE (experts on x, weighted sum in x's dtype), bit for bit
    against that computation written out here, in bf16 where the accumulation dtype shows."""
    spec = latent_spec(latent_size=0, activation="silu")
    w = {k: v.to(torch.bfloat16) if not k.startswith("gate.") else v for k, v in random_weights(spec, 4).items()}
    model, layer = model_of(spec)
    x = torch.randn(1, 5, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = MoEReference(model, layer, w).forward(x, step_of(5))
    flat = x.reshape(-1, D)
    logits = F.linear(flat.float(), w["gate.weight"].float())
    scores = logits.sigmoid()
    ids = torch.topk(scores + w["gate.e_score_correction_bias"], K, dim=-1, sorted=False)[1]
    rw = scores.gather(1, ids)
    rw = rw / (rw.sum(-1, keepdim=True) + 1e-20)
    want = torch.zeros_like(flat)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gate, up = F.linear(flat[tok], w["experts.gate_up_proj"][e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w["experts.down_proj"][e])
        want.index_add_(0, tok, (y * rw[tok, slot, None].to(y.dtype)).to(want.dtype))
    sh = F.linear(F.silu(F.linear(x, w["shared_experts.gate_proj.weight"])) * F.linear(x, w["shared_experts.up_proj.weight"]),
                  w["shared_experts.down_proj.weight"])
    assert torch.equal(got, want.view(1, 5, D) + sh)
