"""Chapter 10's checks pass the solution and name each mistake planted in a copy of it.

Each test takes the solution's function (its cell in the solution notebook, without the
solution markers), plants one classic mistake with a string replacement, and runs the check
on the check's own deterministic traces and dumps (no launch: the notebooks feed the checks
their real traces and dumps).
"""

from pathlib import Path

import pytest

from spike_course.checks import CheckFailed, check_hang_diagnosis, check_straggler, ch10_profiling as profiling
from named import names

import course_files

ROOT = Path(__file__).resolve().parents[1]
CELLS = [c.source for c in course_files.notebook(ROOT / "solutions" / "10_profiling_and_debugging.ipynb").cells
         if c.cell_type == "code"]


def solution(name):
    source = next(s for s in CELLS if s.startswith(f"def {name}("))
    return "\n".join(line for line in source.splitlines() if "### " not in line)


def plant(name, *replacements):
    """The solution's function ``name`` with each (old, new) replacement made once."""
    source = solution(name)
    for old, new in replacements:
        assert old in source, f"the solution no longer contains {old!r}: update this test"
        source = source.replace(old, new, 1)
    namespace = {}
    exec(source, namespace)
    return namespace[name]


def test_the_solutions_pass(capsys):
    check_straggler(plant("find_straggler"))
    check_hang_diagnosis(plant("diagnose"))
    assert capsys.readouterr().out.count("check passed") == 2


STRAGGLER_MISTAKES = {  # name: (old, new) replacements in the solution, and what the message says
    "waits instead of lateness": ([("append((called - first) / 1000)", "append((max(calls) - called) / 1000)")],
                                  "WAITED for the last one"),
    "no common clock": ([('base = trace["baseTimeNanoseconds"] / 1000', "base = 0")], "one clock first"),
    "gloo thread starts": ([('e["name"] == "c10d::allreduce_"', 'e["name"].startswith("gloo:")')],
                           "gloo's threads picks the work up"),
    "gloo thread ends": ([('e["name"] == "c10d::allreduce_"', 'e["name"].startswith("gloo:")'),
                          ('base + e["ts"] for e', 'base + e["ts"] + e["dur"] for e')], "nobody looks late"),
    "call ends": ([('base + e["ts"] for e', 'base + e["ts"] + e["dur"] for e')], "calls END"),
    "forward starts": ([('e["name"] == "c10d::allreduce_"', 'e["name"] == "forward"')], "START their steps"),
    "total, not mean": ([("sum(ms) / len(ms)", "sum(ms)")], "added up over all the collectives"),
    "microseconds": ([("append((called - first) / 1000)", "append(called - first)")], "those are microseconds"),
    "the longest communicator": ([('"rank": max(late_ms, key=late_ms.get)',
                                   '"rank": max(traces, key=lambda r: sum(e["dur"] for e in traces[r]["traceEvents"] '
                                   'if e.get("ph") == "X" and e["name"].startswith("gloo:")))')], "is a victim"),
}


@pytest.mark.parametrize("name", sorted(STRAGGLER_MISTAKES))
def test_each_straggler_mistake_is_named(name):
    replacements, message = STRAGGLER_MISTAKES[name]
    with names(name, says=message):
        check_straggler(plant("find_straggler", *replacements))


def test_a_malformed_straggler_answer_is_named():
    with pytest.raises(CheckFailed, match="return a dict with 'rank'"):
        check_straggler(lambda traces: 2)
    with pytest.raises(CheckFailed, match="one entry per rank"):
        check_straggler(lambda traces: {"rank": 2, "late_ms": {2: 6.06}})


def test_an_answer_hard_coded_for_the_small_traces_fails_on_other_ones():
    from spike_course.checks.ch10_profiling import synthetic_traces

    solution = plant("find_straggler")
    other = synthetic_traces()
    for event in other[0]["traceEvents"]:  # rank 0 now arrives 20 ms late at every all-reduce
        if event["name"] == "c10d::allreduce_":
            event["ts"] += 20_000
    check_straggler(solution, other)
    small = solution(synthetic_traces())
    with pytest.raises(CheckFailed, match="on your job's traces you found rank 2 .* expected rank 0"):
        check_straggler(lambda traces: small, other)


DIAGNOSIS_MISTAKES = {
    "names the victim": ("stuck = min(set(dumps) - waiting)", "stuck = min(waiting)", "victim"),
    "counts entries": ('last[key] = max(last.get(key, 0), e["collective_seq_id"])', "last[key] = last.get(key, 0) + 1",
                       "counting entries"),
    "off by one": ("g, s + 1) for (g, r)", "g, s) for (g, r)", "the last one rank 2 entered"),
    "newest collective": ("g, s + 1) for (g, r)", "g, max(last.values())) for (g, r)", "newest one a waiting rank"),
    "outermost frame": ('stack"].splitlines()[1]', 'stack"].splitlines()[-1]', "OUTERMOST frame"),
    "a waiting rank's stack": ('innermost = dumps[stuck]["stack"]', 'innermost = dumps[0]["stack"]',
                               "waiting rank's stack"),
    # The lecture's reading, made for one process group, on the check's dumps of two tensor-parallel pairs:
    "seqs compared across groups": ('key = (e["process_group"][0], rank)', 'key = ("0", rank)',
                                    "each numbers its own collectives"),
    "the default group only": ('for e in dump["fr"]["entries"]:',
                               'for e in [e for e in dump["fr"]["entries"] if e["process_group"][0] == "0"]:',
                               "least far in the default group"),
    "the default group named": ('return {"rank": stuck, "group": group,', 'return {"rank": stuck, "group": "0",',
                                "in another process group"),
}


@pytest.mark.parametrize("name", sorted(DIAGNOSIS_MISTAKES))
def test_each_diagnosis_mistake_is_named(name):
    old, new, message = DIAGNOSIS_MISTAKES[name]
    with names(name, says=message):
        check_hang_diagnosis(plant("diagnose", (old, new)))


CHECK_MODULE, PLANTS = profiling, {**STRAGGLER_MISTAKES, **DIAGNOSIS_MISTAKES}  # tests/named.py


def test_a_malformed_answer_is_named():
    with pytest.raises(CheckFailed, match="return a dict"):
        check_hang_diagnosis(lambda dumps: (2, 31))
    with pytest.raises(CheckFailed, match="keys 'rank', 'group'"):
        check_hang_diagnosis(lambda dumps: {"rank": 2, "seq": 31, "op": "gloo:all_reduce", "stuck_in": "read_shard"})


def test_the_checks_own_reference_is_not_an_answer():
    from spike_course.checks import ch10_profiling as reference

    def find_straggler(traces):  # what `from spike_course.checks.ch10_profiling import _lateness` gives
        late = reference._lateness(traces)
        return {"rank": max(late, key=late.get), "late_ms": late}

    def by_pieces(traces):  # a name split into pieces hides the name, not the call
        late = getattr(reference, "_late" + "ness")(traces)
        return {"rank": max(late, key=late.get), "late_ms": late}

    diagnose = reference._diagnose  # handed over whole, under the answer's name
    for answer in (find_straggler, by_pieces):
        with pytest.raises(CheckFailed, match=r"BorrowedAnswer: find_straggler calls _lateness"):
            check_straggler(answer)
    for answer in (lambda dumps: diagnose(dumps), diagnose):
        with pytest.raises(CheckFailed, match=r"BorrowedAnswer: diagnose calls _diagnose"):
            check_hang_diagnosis(answer)
