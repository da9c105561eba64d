"""tests/program_choices.py's rule: a pick that differs from the model's is taken only as a
near-tie; anything else fails, naming the layer, the row and the values."""
import pytest
import torch

from program_choices import DSA_TIE, MOE_TIE, ProgramChoices


def bare():
    return ProgramChoices.__new__(ProgramChoices)


def test_a_near_tie_is_taken_and_recorded():
    c = bare()
    c.forced = []
    scores = torch.tensor([0.90, 0.50, 0.49, 0.10])
    c.check_tie("moe", 3, 1, scores, scores, lost={1}, won={2}, tie=MOE_TIE)
    assert c.forced == [("moe", 3, 1, pytest.approx(0.01 / 0.90))]


@pytest.mark.parametrize("what,tie", [("moe", MOE_TIE), ("dsa", DSA_TIE)])
def test_a_wrong_pick_fails(what, tie):
    """The program picking the worst candidate over the best is no tie."""
    c = bare()
    c.forced = []
    scores = torch.tensor([0.90, 0.50, 0.49, 0.10])
    with pytest.raises(AssertionError, match=rf"{what} layer 2 row 0: the program chose \[3\] over \[0\].*not a near-tie"):
        c.check_tie(what, 2, 0, scores, scores, lost={0}, won={3}, tie=tie)
    assert c.forced == []


def test_the_bias_counts_in_the_gap_not_in_the_scale():
    """MoE: the selection value is score + bias, the tie is measured against the scores' scale -
    two experts with biases 100 apart are no tie however close their scores."""
    c = bare()
    c.forced = []
    scores = torch.tensor([0.6, 0.5])
    values = scores + torch.tensor([100.0, 0.0])
    with pytest.raises(AssertionError, match="not a near-tie"):
        c.check_tie("moe", 0, 0, values, scores, lost={0}, won={1}, tie=MOE_TIE)


def test_pool_magnitudes_bound_the_pool_scores():
    """program_choices.pool_scores: the DSA tie's scale, each pool's score with every term at its
    largest (|head weight| |q_h| |k| / sqrt(d)), bounds |score| and equals it where every head's
    q is a positive multiple of the pool's key and every head weight is positive."""
    from types import SimpleNamespace

    from program_choices import pool_scores
    g = torch.Generator().manual_seed(5)
    b, h, d, m, dim, p = 2, 4, 16, 3, 24, 4
    spec = SimpleNamespace(kpool=p, num_heads=h, head_dim=d)
    w = {"wq_b.weight": torch.randn(h * d, dim, generator=g), "weights_proj.weight": torch.randn(h, dim, generator=g)}
    step = SimpleNamespace(batch=b, num_tokens=1, positions=torch.tensor([[m * p - 1], [m * p]]))
    x, q_resid = torch.randn(b, 1, dim, generator=g), torch.randn(b, 1, dim, generator=g)
    cache = {"index_pool_k": torch.randn(b, 8, d, generator=g)}
    scores, scale = pool_scores(SimpleNamespace(spec=spec, w=w), x, q_resid, cache, step)
    assert scores.shape == scale.shape == (b, 1, m)
    assert (scale >= scores.abs() - 1e-5).all() and (scale > 0).all()
    assert (scale > 3 * scores.abs()).any()            # random signs cancel: the scale is no score
    # aligned: q_h = c_h k for the one pool, positive head weights - no cancellation, no ReLU cut
    k = torch.randn(d, generator=g)
    cache1 = {"index_pool_k": k.view(1, 1, d)}
    wq = torch.zeros(h * d, dim)
    for i in range(h):
        wq[i * d:(i + 1) * d, i] = k * (i + 1)
    w1 = {"wq_b.weight": wq, "weights_proj.weight": torch.eye(h, dim)}
    one = SimpleNamespace(batch=1, num_tokens=1, positions=torch.tensor([[p - 1]]))
    xs = torch.zeros(1, 1, dim)
    xs[0, 0, :h] = 1.0
    s1, m1 = pool_scores(SimpleNamespace(spec=spec, w=w1), xs, xs, cache1, one)
    assert s1.item() > 0 and m1.item() == pytest.approx(s1.item(), rel=1e-5)
