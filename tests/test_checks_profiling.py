"""Chapter 10's checks pass the solution and name each mistake planted in a copy of it.

Each test takes the solution's function (its cell in the solution notebook, without the
solution markers), plants one classic mistake with a string replacement, and runs the check
on the check's own deterministic trace and dumps (no launch: the notebooks feed the checks
their real traces and dumps).
"""

from pathlib import Path

import nbformat
import pytest

from spike_course.checks import CheckFailed, check_exposed_share, check_hang_diagnosis

ROOT = Path(__file__).resolve().parents[1]
CELLS = [c.source for c in nbformat.read(ROOT / "solutions" / "10_profiling_and_debugging.ipynb", as_version=4).cells
         if c.cell_type == "code"]


def solution(name):
    source = next(s for s in CELLS if s.startswith(f"def {name}("))
    return "\n".join(line for line in source.splitlines() if "### " not in line)


def plant(name, old="", new=""):
    source = solution(name)
    assert old in source, f"the solution no longer contains {old!r}: update this test"
    namespace = {}
    exec(source.replace(old, new, 1), namespace)
    return namespace[name]


def test_the_solutions_pass(capsys):
    check_exposed_share(plant("exposed_share"))
    check_hang_diagnosis(plant("diagnose"))
    assert capsys.readouterr().out.count("check passed") == 2


SHARE_MISTAKES = {
    "overlapped instead of exposed": ("return 1 - hidden / total", "return hidden / total", "overlapped share"),
    "c10d enqueue events": ('comm = union(spans("gloo:"))', 'comm = union(spans("c10d::allreduce_"))',
                            "c10d::allreduce_ events"),
    "durations summed": ('comm = union(spans("gloo:"))', 'comm = spans("gloo:")', "counted twice"),
    "backward label": ('spans("autograd::engine::evaluate_function:")', 'spans("backward")',
                       "record_function range named 'backward'"),
    "whole step": ('spans("autograd::engine::evaluate_function:")', 'spans("ProfilerStep")', "whole step"),
}


@pytest.mark.parametrize("name", sorted(SHARE_MISTAKES))
def test_each_exposed_share_mistake_is_named(name):
    old, new, message = SHARE_MISTAKES[name]
    with pytest.raises(CheckFailed, match=message):
        check_exposed_share(plant("exposed_share", old, new))


def test_an_answer_hard_coded_for_the_small_trace_fails_on_a_real_one():
    from spike_course.checks.profiling import synthetic_trace

    other = [e for e in synthetic_trace() if not (e["name"] == "gloo:all_reduce" and e["tid"] == 202)]
    check_exposed_share(plant("exposed_share"), {"ddp_rank0": other})
    with pytest.raises(CheckFailed, match="ddp_rank0: exposed share 0.2222, expected 0.0000"):
        check_exposed_share(lambda events: 4 / 18, {"ddp_rank0": other})


DIAGNOSIS_MISTAKES = {
    "names the victim": ("stuck = min(last, key=last.get)", "stuck = max(last, key=last.get)", "victim"),
    "counts entries": ('last = {rank: max(e["collective_seq_id"] for e in dump["fr"]["entries"])',
                       'last = {rank: len(dump["fr"]["entries"])', "counting entries"),
    "off by one": ("seq = last[stuck] + 1", "seq = last[stuck]", "the last one rank 2 entered"),
    "newest collective": ("seq = last[stuck] + 1", "seq = max(last.values())", "newest one a waiting rank"),
    "outermost frame": ('stack"].splitlines()[1]', 'stack"].splitlines()[-1]', "OUTERMOST frame"),
    "a waiting rank's stack": ('innermost = dumps[stuck]["stack"]', 'innermost = dumps[0]["stack"]',
                               "waiting rank's stack"),
}


@pytest.mark.parametrize("name", sorted(DIAGNOSIS_MISTAKES))
def test_each_diagnosis_mistake_is_named(name):
    old, new, message = DIAGNOSIS_MISTAKES[name]
    with pytest.raises(CheckFailed, match=message):
        check_hang_diagnosis(plant("diagnose", old, new))


def test_a_malformed_answer_is_named():
    with pytest.raises(CheckFailed, match="return a dict"):
        check_hang_diagnosis(lambda dumps: (2, 31))
