"""checks.check_zero1 names the usual ZeRO-1 mistakes (chapter 06)."""

import pytest
import torch

from spike_course.checks import check_zero1, ch06_zero as zero
from named import mistake_of, names

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


STALE = {r: START.clone() for r in range(WORLD)}  # each rank updated its own slice only
STALE[0][0:5], STALE[1][5:10] = DDP[0:5], DDP[5:10]
ONLY_RANK_0S = torch.cat([DDP[0:5], START[5:10]])  # every rank holds rank 0's update, no one else's
UNTOUCHED = {r: START.clone() for r in range(WORLD)}
# A mistake of the check's tables -> what the ranks report with it, and what its message says.
PLANTS = {
    # after several steps without the gather every rank has drifted its own way
    "ranks end apart": (dict(zero1=STALE), "different parameters.*not\\s+all-gathered"),
    "ranks end apart (drifted)": (dict(zero1={0: DDP + 0.1, 1: DDP - 0.1}), "different parameters"),
    "only its own slice updated": (dict(zero1={r: ONLY_RANK_0S.clone() for r in range(WORLD)}),
                                   "its own slice \\[0, 5\\) matches DDP.*not\\s+all-gathered"),
    # the optimizer stepped its own copy of the slice; nothing was copied back into the model
    "the stepped slice never copied back": (dict(zero1=UNTOUCHED), "never changed.*not\\s+all-gathered"),
    # zero_grad between backward and step: the optimizer's own slice never moved either
    "gradient wiped before the step": (dict(zero1=UNTOUCHED, stepped={r: START[r * 5:(r + 1) * 5].clone()
                                                                      for r in range(WORLD)}),
                                       "neither did the slice its optimizer holds: every step saw a zero gradient"),
    # the parameters agree (the gradients were averaged) but every rank held all the state
    "the whole model stepped": (dict(optimizer_numel=(TOTAL, TOTAL)), "steps the whole model"),
    "gradients not averaged": (dict(zero1={r: DDP * 2 for r in range(WORLD)}), "[Aa]verage the gradients"),
    "slices do not tile (overlapping)": (dict(owned=((0, 5), (4, 10))), "do not tile"),
    "slices do not tile (a gap)": (dict(owned=((0, 4), (5, 10))), "do not tile"),
    "shard size rounded down": (dict(owned=((0, 5), (5, 9))), "stop at 9, not at 10: round the shard size up"),
    "last slice past the end": (dict(owned=((0, 5), (5, 11))), "stop at 11, past the end of the model's 10 elements"),
}
CHECK_MODULE = zero  # tests/named.py


@pytest.mark.parametrize("name", PLANTS)
def test_each_mistake_is_named(name):
    reported, says = PLANTS[name]
    with names(mistake_of(name), says=says) as failure:
        check_zero1(results(**reported))
    if name == "gradient wiped before the step":
        assert "all-gathered" not in str(failure.value)  # not blamed on the gather


@pytest.mark.processes
def test_the_worker_with_its_gradient_wiped_or_a_decoy_optimizer_is_named(worker):
    """The mistakes planted in copies of the solution's worker and launched for real."""
    from pathlib import Path

    from spike_course import launch
    from spike_course.course import workers

    root = Path(__file__).resolve().parents[1]
    notebook = course_files.notebook(root / "solutions" / "06_fully_sharded_data_parallel.ipynb")
    source = workers.worker_cells(notebook)["06_fully_sharded_data_parallel/zero1.py"]
    right = "    optimizer.step()\n    optimizer.zero_grad()\n"
    assert source.count(right) == 1
    wiped = source.replace(right, "    optimizer.zero_grad()  # wipes shard.grad before the step\n"
                                  "    optimizer.step()\n")
    reports = launch(worker(wiped), nproc=2, args=["--steps", "2"], echo=False, progress=False,
                     timeout=120).reports
    with names("gradient wiped before the step"):
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
    with names("the whole model stepped", says=r"rank 0's optimizers kept state for \S+ elements .* the whole model"):
        check_zero1(reports)
