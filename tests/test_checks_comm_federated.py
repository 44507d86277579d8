"""The exercise check of chapter 09 names the usual mistakes (chapter 08: test_checks_communication.py)."""

import pytest
import torch

from spike_course import checks
from spike_course.checks import CheckFailed


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
