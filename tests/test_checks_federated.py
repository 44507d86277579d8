"""checks.check_fedavg (chapter 09) passes the right aggregate and names the usual mistakes."""

from pathlib import Path

import nbformat
import pytest
import torch

import spike_course
from spike_course import checks
from spike_course.checks import CheckFailed

ROOT = Path(__file__).resolve().parents[1]

# --- chapter 09: FedAvg aggregation ---

SAMPLES = [300, 100]
BEFORE = [{"w": torch.tensor([1.0, 2.0, -3.0]), "b": torch.tensor([0.5])},
          {"w": torch.tensor([5.0, -2.0, 1.0]), "b": torch.tensor([-1.5])}]


def combine(weights):
    return {k: sum(w * s[k] for w, s in zip(weights, BEFORE)) for k in BEFORE[0]}


RIGHT = combine([0.75, 0.25])


def test_right_fedavg_passes(capsys):
    checks.check_fedavg(BEFORE, SAMPLES, [RIGHT, RIGHT])
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("after, message", [
    ([combine([0.5, 0.5])] * 2, "unweighted mean"),
    ([combine([300, 100])] * 2, "not divided by the total"),
    ([combine([1, 1])] * 2, "plain sum"),
    ([combine([150, 50])] * 2, "number of ranks"),
    ([combine([0.375, 0.125])] * 2, "N times too small"),
    (BEFORE, "did not change"),
    ([{k: v * 0.75 for k, v in BEFORE[0].items()}, {k: v * 0.25 for k, v in BEFORE[1].items()}],
     "all-reduce\\s+that adds them up is missing"),
    ([RIGHT, BEFORE[1]], "use all_reduce"),
    ([{"w": RIGHT["w"]}] * 2, "lack \\['b'\\]"),
])
def test_wrong_fedavg_is_named(after, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_fedavg(BEFORE, SAMPLES, after)


SOLUTION_WORKER = "workers/09_federated_learning/fedavg_exercise.py"
PER_TENSOR = """\
    device = next(model.parameters()).device
    total = torch.tensor([float(num_samples)], device=device)
    dist.all_reduce(total)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(num_samples / total.item())
            dist.all_reduce(p)
"""


@pytest.mark.processes
def test_one_allreduce_per_tensor_is_named(worker, no_orphans):
    """The lecture's version, planted in a copy of the solution's worker: right values, nine
    collectives (one for the counts, one per parameter tensor of the CNN)."""
    notebook = nbformat.read(ROOT / "solutions" / "09_federated_learning.ipynb", as_version=4)
    cell = next(c.source for c in notebook.cells if c.source.startswith(f"%%writefile {SOLUTION_WORKER}"))
    solution = cell.split("\n", 1)[1]
    begin, end = solution.index("    ### BEGIN SOLUTION\n"), solution.index("    ### END SOLUTION\n")
    planted = solution[:begin] + PER_TENSOR + solution[end + len("    ### END SOLUTION\n"):]
    result = spike_course.launch(worker(planted), nproc=2, echo=False, progress=False, timeout=120)
    ranks = [result.reports[r] for r in range(2)]
    assert [r["collectives"] for r in ranks] == [9, 9]
    with pytest.raises(CheckFailed, match="one all-reduce per tensor"):
        checks.check_fedavg([r["before"] for r in ranks], [r["samples"] for r in ranks],
                            [r["after"] for r in ranks], collectives=[r["collectives"] for r in ranks])
    checks.check_fedavg(BEFORE, SAMPLES, [RIGHT, RIGHT], collectives=[2, 2])  # two pass
