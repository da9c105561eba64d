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
