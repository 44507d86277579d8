"""checks.check_zero1 names the usual ZeRO-1 mistakes (chapter 06)."""

import pytest
import torch

from spike_course.checks import CheckFailed, check_zero1

import course_files

TOTAL, WORLD = 10, 2
DDP = torch.linspace(-1, 1, TOTAL)
START = torch.zeros(TOTAL)  # the parameters before training


def results(zero1=None, owned=((0, 5), (5, 10)), optimizer_numel=(5, 5), stepped=None):
    zero1 = zero1 or {r: DDP.clone() for r in range(WORLD)}
    stepped = stepped or {r: DDP[slice(*owned[r])].clone() for r in range(WORLD)}
    return {r: {"zero1": zero1[r], "ddp": DDP.clone(), "owned": owned[r], "initial": START.clone(),
                "optimizer_numel": optimizer_numel[r], "stepped": stepped[r]} for r in range(WORLD)}


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


def test_a_gradient_wiped_before_the_step_is_not_blamed_on_the_gather():
    # zero_grad between backward and step: the optimizer's own slice never moved either
    untouched = {r: START.clone() for r in range(WORLD)}
    unmoved = {r: START[r * 5:(r + 1) * 5].clone() for r in range(WORLD)}
    with pytest.raises(CheckFailed, match="neither did the slice its optimizer holds: every step saw a zero "
                                          "gradient") as caught:
        check_zero1(results(zero1=untouched, stepped=unmoved))
    assert "all-gathered" not in str(caught.value)


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


@pytest.mark.parametrize("owned, message", [
    (((0, 5), (4, 10)), "do not tile"),  # overlapping
    (((0, 4), (5, 10)), "do not tile"),  # a gap
    (((0, 5), (5, 9)), "stop at 9, not at 10: round the shard size up"),  # shard size rounded down
    (((0, 5), (5, 11)), "stop at 11, past the end of the model's 10 elements"),  # last slice not cut at the end
])
def test_slices_must_tile_the_model(owned, message):
    with pytest.raises(CheckFailed, match=message):
        check_zero1(results(owned=owned))


@pytest.mark.processes
def test_the_worker_with_its_gradient_wiped_or_a_decoy_optimizer_is_named(worker):
    """The mistakes planted in copies of the solution's worker and launched for real."""
    from pathlib import Path

    from spike_course import launch, workers

    root = Path(__file__).resolve().parents[1]
    notebook = course_files.notebook(root / "solutions" / "06_fully_sharded_data_parallel.ipynb")
    source = workers.worker_cells(notebook)["06_fully_sharded_data_parallel/zero1.py"]
    right = "    optimizer.step()\n    optimizer.zero_grad()\n"
    assert source.count(right) == 1
    wiped = source.replace(right, "    optimizer.zero_grad()  # wipes shard.grad before the step\n"
                                  "    optimizer.step()\n")
    reports = launch(worker(wiped), nproc=2, args=["--steps", "2"], echo=False, progress=False,
                     timeout=120).reports
    with pytest.raises(CheckFailed, match="every step saw a zero gradient"):
        check_zero1(reports)
    check_zero1(launch(worker(source), nproc=2, args=["--steps", "2"], echo=False, progress=False,
                       timeout=120).reports)  # and the solution itself passes

    # A decoy: the slice's Adam is built (and reported as `optimizer`) but never steps, while
    # an Adam over the whole model does the work. What the rank holds is measured, not reported.
    built = "optimizer = torch.optim.Adam([shard], lr=LR)\n"
    decoy = source.replace(built, built + "whole = torch.optim.Adam(params, lr=LR)\n").replace(
        right, "    for p, g in zip(params, torch.split(grad, [p.numel() for p in params])):\n"
               "        p.grad = g.view_as(p).clone()\n"
               "    whole.step()\n"
               "    shard.data = parameters_to_vector(params)[start:end].detach().clone()\n")
    assert decoy.count("whole.step()") == 1
    reports = launch(worker(decoy), nproc=2, args=["--steps", "2"], echo=False, progress=False,
                     timeout=120).reports
    with pytest.raises(CheckFailed, match=r"rank 0's optimizers kept state for \S+ elements .* the whole model"):
        check_zero1(reports)
