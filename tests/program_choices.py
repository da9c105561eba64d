"""Near-tie selections between a whole-model program and the model (the reference backend).

The program keeps the model's bf16 activations, so its scores differ from the fp32 model's by
~1e-2. Where two candidates' scores are that close, the two sides may pick differently - the
program's pick is then one the model could have made. `ProgramChoices` lets the model take the
program's pick exactly there, so that later steps stay comparable, and fails on any other
difference:

- a DSA indexer's top-k pools (the program's `l{i}.attn.index` list): every swapped pool must be
  within DSA_TIE of the row's largest pool magnitude. A pool score is a head-weighted sum of ReLU'd
  dot products with cancellations, so its rounding noise follows the size of its terms, not of the
  score: the magnitude is the same sum with every term at its largest (|head weight| x |q_h| |k|,
  `pool_scores`). Calibrated on the PyVM (bench/dsa_tie_calibration.py: GLM-5.3 small at batch
  8, 36 steps, 42 seeds, 524 swapped pool pairs): the gap reached 0.0047 of the magnitude (p99
  0.0026) but 0.28 of the top score (p99 0.13; the old bound, 0.2 of the top score, failed 2 of 53 seeds there, and the GPU
  once: a gap of 0.035 under a top score below 0.18) - a row's top score may even be 0. A wrong
  pool shows as a gap of the order of the top score: a median 0.036 of the magnitude, 3.6x the
  bound; where a row's top score is itself within the noise, any pick is a tie;
- a learned MoE router's top-k experts (the program's `l{i}.mlp.topk_ids`): every swapped
  expert's selection value (score + correction bias) must be within MOE_TIE of the row's top
  score; the model then weighs the program's experts with its own scores. A wide random bias makes
  such ties rare, not impossible: in bf16 two biases often round to the same value, and the scores
  decide (GLM-5.3 small, seed 303 at batch 8: experts 5 and 11 at a gap of ~1e-3).

A wrong selection (a wrong list, a wrong expert) lies outside these ties."""
import torch

DSA_TIE = 0.01        # of the pools' magnitude: ~2x the calibration's largest gap, ~2.5 bf16 steps
MOE_TIE = 0.05


class ProgramChoices:
    """Patches the reference's DSA indexers and MoE routers (monkeypatch); take(runner) after each
    program step hands them the program's picks of that step. `forced`: (what, layer, row, gap /
    top score) of every pick taken from the program."""

    def __init__(self, ref, monkeypatch):
        import sdk.reference.dsa as dsa_ref
        import sdk.reference.moe as moe_ref
        self.picks, self.forced = {}, []
        self.dsa_layers = {id(a.indexer): i for i, a in enumerate(ref.attn)
                           if isinstance(getattr(a, "indexer", None), dsa_ref.DSAIndexer)}
        self.moe_layers = {id(m): i for i, m in enumerate(ref.mlp)
                           if isinstance(m, moe_ref.MoEReference) and not m.spec.hash_routed}
        select, router, outer = dsa_ref.DSAIndexer.select, moe_ref.MoEReference.router, self

        def dsa_select(indexer, x, q_resid, cache, step):
            own = select(indexer, x, q_resid, cache, step)
            layer = outer.dsa_layers.get(id(indexer))
            if layer is None:                   # another model's indexer (a second reference)
                return own
            got = outer.picks[("dsa", layer)].to(own.device).long()
            p = indexer.spec.kpool
            for b in range(own.shape[0]):
                mine, theirs = set(own[b, 0].tolist()) - {-1}, set(got[b, 0].tolist()) - {-1}
                if mine != theirs:
                    scores, scale = pool_scores(indexer, x, q_resid, cache, step)
                    outer.check_tie("dsa", layer, b, scores[b, 0], scale[b, 0], {t // p for t in mine - theirs},
                                    {t // p for t in theirs - mine}, DSA_TIE)
                    own[b] = got[b]
            return own

        def moe_router(mlp, x, step):
            layer = outer.moe_layers.get(id(mlp))
            if layer is None:                   # hash-routed, or another model's
                return router(mlp, x, step)
            logits = mlp.router_logits(x)
            bias = mlp.w.get("gate.e_score_correction_bias") if mlp.spec.correction_bias else None
            weights, own = moe_ref.route(mlp.spec, logits, bias)
            got = outer.picks[("moe", layer)].to(own.device).long()
            if got.shape != own.shape:
                raise AssertionError(f"layer {layer}: the program's topk_ids are {list(got.shape)}, "
                                     f"the model's {list(own.shape)}")
            scores = moe_ref.router_scores(mlp.spec, logits.float())
            choice = scores if bias is None else scores + bias.float()
            differs = False
            for b in range(own.shape[0]):
                mine, theirs = set(own[b].tolist()), set(got[b].tolist())
                if mine != theirs:
                    outer.check_tie("moe", layer, b, choice[b], scores[b], mine - theirs, theirs - mine, MOE_TIE)
                    differs = True
            if not differs:
                return weights, own
            return moe_ref.route(mlp.spec, logits, bias, hash_experts=got)

        monkeypatch.setattr(dsa_ref.DSAIndexer, "select", dsa_select)
        monkeypatch.setattr(moe_ref.MoEReference, "router", moe_router)

    def check_tie(self, what, layer, row, values, scale, lost, won, tie):
        """Every swapped pair's gap within `tie` x the row's top `scale` (DSA: the pools'
        magnitudes; MoE: the router scores)."""
        top = scale.abs().max().item()
        gap = swap_gap(values, lost, won)
        assert gap < tie * top, (
            f"{what} layer {layer} row {row}: the program chose {sorted(won)} over {sorted(lost)}, "
            f"values {[round(v, 4) for v in values.tolist()]}: a gap of {gap:.3g}, not a near-tie")
        self.forced.append((what, layer, row, gap / top))

    def take(self, runner) -> None:
        """The program's picks of its last step (runner.tensors: one rank's - every rank picks the
        same, in the model's own expert order on rank 0)."""
        self.picks = {("dsa", l): runner.tensors[f"l{l}.attn.index"].clone() for l in self.dsa_layers.values()}
        self.picks.update({("moe", l): runner.tensors[f"l{l}.mlp.topk_ids"].clone()
                           for l in self.moe_layers.values()})

    def summary(self) -> str:
        return f"near-tie picks taken from the program ({len(self.forced)}): " + " ".join(
            f"{w}:l{l}/b{b}:{g:.3f}" for w, l, b, g in self.forced)


def swap_gap(values, lost, won) -> float:
    """The largest difference between a value the program dropped and one it chose instead."""
    return max(abs(values[i] - values[j]).item() for i in lost for j in won)


def pool_scores(indexer, x, q_resid, cache, step):
    """The model's index scores of the complete pools [B, T, pools] (sdk/reference/dsa.py select),
    and their magnitudes: the same sums with every term at its largest, |head weight| x |q_h| |k|
    x the softmax scale - the size of the numbers whose rounding the scores carry."""
    import torch.nn.functional as F
    s, w = indexer.spec, indexer.w
    b, t = step.batch, step.num_tokens
    n = int(((step.positions + 1) // s.kpool).max())
    q = F.linear(q_resid, w["wq_b.weight"]).view(b, t, s.num_heads, s.head_dim)
    scores = F.relu(torch.einsum("bthd,bmd->bthm", q.float(), cache["index_pool_k"][:, :n].float()) * s.head_dim ** -0.5)
    weights = F.linear(x, w["weights_proj.weight"]).float() * s.num_heads ** -0.5
    k = cache["index_pool_k"][:, :n].float()
    scale = torch.einsum("bth,bm->btm", weights.abs() * q.float().norm(dim=-1), k.norm(dim=-1)) * s.head_dim ** -0.5
    return torch.einsum("bth,bthm->btm", weights, scores), scale
