"""checks.check_zero1 names the usual ZeRO-1 mistakes (chapter 06)."""

import pytest
import torch

from spike_course.checks import CheckFailed, check_zero1

TOTAL, WORLD = 10, 2
DDP = torch.linspace(-1, 1, TOTAL)
START = torch.zeros(TOTAL)  # the parameters before training


def results(zero1=None, owned=((0, 5), (5, 10)), optimizer_numel=(5, 5)):
    zero1 = zero1 or {r: DDP.clone() for r in range(WORLD)}
    return {r: {"zero1": zero1[r], "ddp": DDP.clone(), "owned": owned[r], "initial": START.clone(),
                "optimizer_numel": optimizer_numel[r]} for r in range(WORLD)}


def test_right_answer_passes(capsys):
    check_zero1(results())
    assert "check passed" in capsys.readouterr().out


def test_not_all_gathered_is_named():
    # each rank updated its own slice only; the other slice still holds the old values
    stale = {r: START.clone() for r in range(WORLD)}
    stale[0][0:5], stale[1][5:10] = DDP[0:5], DDP[5:10]
    with pytest.raises(CheckFailed, match="not\\s+all-gathered"):
        check_zero1(results(zero1=stale))


def test_model_never_updated_is_named():
    # the optimizer stepped its own copy of the slice; nothing was copied back into the model
    untouched = {r: START.clone() for r in range(WORLD)}
    with pytest.raises(CheckFailed, match="never changed.*not\\s+all-gathered"):
        check_zero1(results(zero1=untouched))


def test_ranks_that_disagree_are_named():
    # after several steps without the gather every rank has drifted its own way
    drifted = {0: DDP + 0.1, 1: DDP - 0.1}
    with pytest.raises(CheckFailed, match="different parameters.*not\\s+all-gathered"):
        check_zero1(results(zero1=drifted))


def test_stepping_the_whole_model_is_named():
    # the parameters agree (the gradients were averaged) but every rank held all the state
    with pytest.raises(CheckFailed, match="steps the whole model"):
        check_zero1(results(optimizer_numel=(TOTAL, TOTAL)))


def test_gradients_not_averaged_is_named():
    wrong = {r: DDP * 2 for r in range(WORLD)}
    with pytest.raises(CheckFailed, match="[Aa]verage the gradients"):
        check_zero1(results(zero1=wrong))


@pytest.mark.parametrize("owned", [((0, 5), (4, 10)), ((0, 4), (5, 10)), ((0, 5), (5, 9))])
def test_slices_must_tile_the_model(owned):
    with pytest.raises(CheckFailed, match="slices"):
        check_zero1(results(owned=owned))
