"""Chapter 16.3's check passes on the solution and names each mistake planted in a copy of it,
and the simulator it runs the orders in keeps the rules of a pipeline.

The answer is zero_bubble_order, the solution cell's function; each test changes one piece of it
and calls the check in this process (no rank is started: the check runs the orders in
costmodel.simulate_pipeline)."""

import pytest

from spike_course import costmodel
from spike_course.checks import CheckFailed, Tampering, check_zero_bubble_order, ch16_zero_bubble
from named import mistake_of, names
from planting import answer_function, solution_cell

SOLUTION = solution_cell("16_what_large_jobs_run_today", "zero_bubble_order")
HOLD = "if len(held) > rank:"


def planted(old="", new=""):
    return answer_function(SOLUTION, "zero_bubble_order", old, new)


def test_solution_passes(capsys):
    check_zero_bubble_order(planted())
    assert "check passed" in capsys.readouterr().out


def test_the_solution_reaches_the_floor_and_holds_what_1f1b_holds_at_every_size():
    """What the check requires, asserted from the simulator's events here, not its verdict."""
    order = planted()
    for stages, microbatches in ch16_zero_bubble.SIZES.cases + ((8, 8), (5, 11)):
        orders = {r: [(r, phase, i) for phase, i in order(r, stages, microbatches)] for r in range(stages)}
        events = costmodel.simulate_pipeline(orders, {"F": 1, "I": 1, "W": 1})
        assert max(e["end"] for e in events) == 3 * microbatches + stages - 1
        assert costmodel.pipeline_peak_activations(events) == {r: stages for r in range(stages)}


PLANTS = {  # a mistake (its name, and what tells the plant apart) -> (old, new, what the message says)
    "the backward not split": ('order.append(("I", i))\n        held.append(i)\n        if len(held) > rank:\n'
                               '            order.append(("W", held.pop(0)))',
                               'order.append(("B", i))\n        if False:\n            pass', "a whole backward"),
    "an action missing or repeated (a W lost)": ('return order + [("W", i) for i in held]', "return order",
                                                 r"rank \d misses W"),
    "an action missing or repeated (one size only)": ("def zero_bubble_order(rank, stages, microbatches):",
                                                      "def zero_bubble_order(rank, stages, microbatches):\n"
                                                      "    stages, microbatches = 4, 8", "micro-batches it does not"),
    "W before its I": ('return order + [("W", i) for i in held]',
                       'return [("W", i) for i in held] + order', r"runs W\d before I\d"),
    "the ranks wait on each other (too few forwards first)": ("warmup = min(microbatches, stages - rank)",
                                                              "warmup = min(microbatches, stages - rank - 1)",
                                                              "deadlocks: rank 0 waits to run I0"),
    "more activations than 1F1B (a W too many held)": (HOLD, "if len(held) > rank + 1:", "holds 5 micro-batches"),
    "more activations than 1F1B (every W at the end)": (HOLD, "if False:", "rank 0 holds 8"),
    "W right after its I (the lecture's split)": (HOLD, "if len(held) > 0:", "every W runs straight after its I"),
    "a bubble left (one W held at most)": (HOLD, "if len(held) > min(rank, 1):", "takes 29 units"),
}
CHECK_MODULE = ch16_zero_bubble  # tests/named.py


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_each_mistake_is_named(name):
    old, new, message = PLANTS[name]
    with names(mistake_of(name), says=message):
        check_zero_bubble_order(planted(old, new))


def test_the_blank_is_named():
    def zero_bubble_order(rank, stages, microbatches):
        raise NotImplementedError("exercise: replace this line with your code")

    with pytest.raises(CheckFailed, match="still raises NotImplementedError"):
        check_zero_bubble_order(zero_bubble_order)


def test_a_copy_of_the_lecture_fails():
    """Section 16.3's split 1F1B, each B of chapter 04's 1F1B made its I and W, in order."""
    def zero_bubble_order(rank, stages, microbatches):
        events = costmodel.pipeline_schedule("1f1b", stages, microbatches)
        return [(half, e["microbatch"]) for e in events if e["rank"] == rank
                for half in (("I", "W") if e["phase"] == "B" else ("F",))]

    with names("W right after its I", says="against the floor's 27"):
        check_zero_bubble_order(zero_bubble_order)


@pytest.mark.parametrize("returned, says", [
    (lambda r, s, m: None, "returned None"),
    (lambda r, s, m: tuple(("F", i) for i in range(m)), "returned"),
    (lambda r, s, m: [("F", 0.0)], r"holds \('F', 0.0\)"),
    (lambda r, s, m: [("f", 0)], r"holds \('f', 0\)"),
    (lambda r, s, m: [("F", 0, 1)], "each action is a pair"),
    (lambda r, s, m: [["F", 0]], "each action is a pair"),
])
def test_what_is_not_an_answer_is_refused_with_its_reason(returned, says):
    with pytest.raises(CheckFailed, match=says) as failure:
        check_zero_bubble_order(returned)
    assert failure.value.mistake is None


def test_an_answer_that_rebinds_what_the_check_judges_with_is_named(monkeypatch):
    """The lecture's split, and the check's test of the step's length replaced from inside the
    answer (so that no bubble is seen): the guard names it before "check passed"."""
    lecture_split = planted(HOLD, "if len(held) > 0:")

    def zero_bubble_order(rank, stages, microbatches):
        monkeypatch.setattr(ch16_zero_bubble, "_bubble", lambda case: False)
        return lecture_split(rank, stages, microbatches)

    with pytest.raises(Tampering, match="ch16_zero_bubble._bubble"):
        check_zero_bubble_order(zero_bubble_order)


def test_the_simulator_names_a_deadlock_and_each_rank_s_wait():
    """Two ranks, each waiting for what the other runs later: the error names both."""
    orders = {0: [(0, "F", 0), (0, "I", 0), (0, "F", 1)], 1: [(1, "F", 0), (1, "F", 1), (1, "I", 0)]}
    with pytest.raises(costmodel.PipelineDeadlock) as deadlock:
        costmodel.simulate_pipeline(orders, {"F": 1, "I": 1, "W": 1})
    assert set(deadlock.value.waiting) == {0, 1}
    assert "rank 1 waits to run F1 of stage 1 for F1 of stage 0" in str(deadlock.value)


def test_the_simulator_runs_w_after_its_own_stage_s_input_gradient_only():
    """One rank, one stage: W waits for its I, and a split backward takes what B takes."""
    split = costmodel.simulate_pipeline({0: [(0, "F", 0), (0, "I", 0), (0, "W", 0)]}, {"F": 1, "B": 2})
    assert [(e["phase"], e["start"], e["end"]) for e in split] == [("F", 0, 1), ("I", 1, 2), ("W", 2, 3)]
    with pytest.raises(ValueError, match="unknown phase 'X'"):
        costmodel.simulate_pipeline({0: [(0, "X", 0)]}, {"F": 1})
