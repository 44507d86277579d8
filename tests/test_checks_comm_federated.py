"""The exercise checks of chapters 08 and 09 name the usual mistakes."""

import pytest
import torch

from spike_course import checks, costmodel
from spike_course.checks import CheckFailed


# --- chapter 08: bus bandwidth factors ---

def right_factor(op, n):
    return costmodel.BUS_FACTORS[op](n)


def test_right_factors_pass(capsys):
    checks.check_bus_factor(right_factor)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda op, n: (n - 1) / n if op == "all_reduce" else right_factor(op, n), "factor 2 is missing"),
    (lambda op, n: 2 * (n - 1) / n if op != "broadcast" else 1.0, "all-reduce's factor"),
    (lambda op, n: 1.0, "only for broadcast"),
    (lambda op, n: 1 / right_factor(op, n), "upside down"),
    (lambda op, n: (n - 1) / n if op == "broadcast" else right_factor(op, n), "whole buffer"),
    (lambda op, n: None, "returned None"),
])
def test_wrong_factors_are_named(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_bus_factor(wrong)


# --- chapter 08: predicting the gradient all-reduce ---

def right_prediction(p, n, bidir, b, alpha):
    return 2 * (n - 1) * (alpha + p * b / n / (bidir / 2))


def test_right_prediction_passes(capsys):
    checks.check_allreduce_prediction(right_prediction)
    assert "check passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, message", [
    (lambda p, n, bidir, b, a: 2 * (n - 1) * (a + p * b / n / bidir), "bidirectional"),
    (lambda p, n, bidir, b, a: 2 * (n - 1) * (a + p / n / (bidir / 2)), "counted parameters, not\\s+bytes"),
    (lambda p, n, bidir, b, a: a + p * b / (bidir / 2), "whole buffer once"),
    (lambda p, n, bidir, b, a: a + 2 * p * b / (bidir / 2), "2 instead of 2\\(N-1\\)/N"),
    (lambda p, n, bidir, b, a: a + 2 * (n - 1) * p * b / n / (bidir / 2), "pays alpha"),
    (lambda p, n, bidir, b, a: 1e3 * right_prediction(p, n, bidir, b, a), "milliseconds"),
])
def test_wrong_predictions_are_named(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_allreduce_prediction(wrong)


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
