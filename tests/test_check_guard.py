"""The checks guard themselves in the kernel a learner runs (checks._guard): what an answer
replaces (a check, a function the checks rely on, the hook that records its calls) fails the
check as Tampering, by name, and never lets it print "check passed"."""

import math
import sys

import pytest
import torch

from spike_course import checks, costmodel
from spike_course.checks import Tampering, _guard, ch08_communication as communication
from spike_course.mistakes import Mistake

import course_files
from test_checks_communication import FIT, SOLUTION, WORLD


def answers(**replaced):
    """Chapter 08's solution functions, with ``replaced`` ones instead."""
    namespace = {"torch": torch, "costmodel": costmodel, "alpha": FIT[0], "beta": FIT[1], "world": WORLD}
    exec(SOLUTION, namespace)  # noqa: S102 - the course's own solution
    namespace.update(replaced)
    return (namespace["ring_from_fit"], namespace["predict_allreduce"], namespace["dgx_busbw"],
            namespace["dgx_allreduce_seconds"])


def run_check(*functions):
    checks.check_dgx_prediction(*functions, fit=FIT, world_size=WORLD)


def test_the_checks_package_refuses_new_values():
    with pytest.raises(Tampering, match="replace spike_course.checks.check_dgx_prediction"):
        checks.check_dgx_prediction = lambda *args, **kwargs: None
    with pytest.raises(Tampering):
        del checks.check_sampler
    with pytest.raises(Tampering):
        setattr(sys.modules["spike_course.checks"], "passed", print)
    assert checks.check_dgx_prediction.__wrapped__ is communication.check_dgx_prediction


@pytest.mark.parametrize("where, name", [(math, "isclose"), (torch, "allclose"), (costmodel, "collective_time"),
                                         (communication, "_ring"), (communication, "passed")])
def test_a_function_replaced_before_the_check_is_named(monkeypatch, capsys, where, name):
    monkeypatch.setattr(where, name, lambda *args, **kwargs: True)
    with pytest.raises(Tampering, match=rf"replaced \S*{name}"):
        run_check(*answers())
    assert "check passed" not in capsys.readouterr().out


@pytest.mark.parametrize("where, name, value", [
    (Mistake, "seen", property(lambda mistake: lambda *readings: False)),  # every table would see nothing
    (communication, "DGX_SLIPS", ()),  # a check's table, emptied
])
def test_the_shape_of_a_verdict_and_a_table_replaced_are_named(monkeypatch, capsys, where, name, value):
    monkeypatch.setattr(where, name, value)
    with pytest.raises(Tampering, match=rf"replaced \S*{name}"):
        run_check(*answers())
    assert "check passed" not in capsys.readouterr().out


def test_a_function_replaced_while_the_check_runs_stops_it_before_it_passes(monkeypatch, capsys):
    ring_from_fit = answers()[0]

    def patching_ring(*args):
        monkeypatch.setattr(math, "isclose", lambda *a, **k: True)
        return ring_from_fit(*args)

    with pytest.raises(Tampering, match="replaced math.isclose"):
        run_check(*answers(ring_from_fit=patching_ring))
    assert "check passed" not in capsys.readouterr().out


def test_an_answer_that_removes_the_recording_hook_is_named():
    ring_from_fit = answers()[0]

    def unhooking_ring(*args):
        sys.setprofile(None)
        return ring_from_fit(*args)

    with pytest.raises(Tampering, match="removed the profile hook"):
        run_check(*answers(ring_from_fit=unhooking_ring))


def test_the_solution_still_passes(capsys):
    run_check(*answers())
    assert "check passed" in capsys.readouterr().out
    assert _guard.replaced() == []


def test_every_check_is_guarded():
    public = [name for name in dir(checks) if name.startswith("check_")]
    assert len(public) >= 20
    assert all(hasattr(getattr(checks, name), "__wrapped__") for name in public)


def test_every_check_cell_calls_a_guarded_check():
    """A check cell that called a submodule's check directly would skip the guard."""
    for path in course_files.tracked("solutions", "[0-9][0-9]_*.ipynb"):
        for cell in course_files.notebook(path).cells:
            if "check" in cell.metadata.get("tags", []):
                assert "checks." in cell.source and "checks._" not in cell.source, (path.name, cell.source)
