"""Exercises are generated from solutions, stay in sync, and their checks fail on the blank."""

from pathlib import Path

import nbformat
import pytest

from spike_course import exercises, grading

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_a_solution_region_becomes_an_indented_stub():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n\nprint(f(1))"
    blank = exercises.blank_source(source)
    assert "return 2 * x" not in blank
    assert "    raise NotImplementedError(" in blank
    assert blank.startswith("def f(x):\n    # YOUR CODE HERE") and blank.endswith("print(f(1))")


@pytest.mark.parametrize("source, problem", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without a"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
])
def test_broken_markers_are_reported(source, problem):
    with pytest.raises(ValueError, match=problem):
        exercises.blank_source(source)


def test_tags_tell_ci_what_may_and_must_fail():
    solution = _notebook(
        nbformat.v4.new_code_cell("import math"),
        nbformat.v4.new_code_cell("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION"),
        nbformat.v4.new_code_cell("assert answer == 42", metadata={"tags": ["check"]}),
        nbformat.v4.new_code_cell("print(answer)", metadata={"tags": ["uses-solution"]}),
    )
    solution.cells[0].outputs = [nbformat.v4.new_output("stream", text="left over")]
    exercise = exercises.make_exercise(solution, "t.ipynb")
    tags = [cell.metadata.get("tags", []) for cell in exercise.cells]
    assert tags[0] == []
    assert tags[1] == ["raises-exception"]
    assert tags[2] == ["check", "raises-exception"]
    assert tags[3] == ["uses-solution", "raises-exception"]
    assert all(cell.outputs == [] for cell in exercise.cells)
    assert "answer = 42" in solution.cells[1].source  # the solution itself is untouched


def test_a_solution_notebook_without_a_region_is_refused():
    with pytest.raises(ValueError, match="no ### BEGIN SOLUTION"):
        exercises.make_exercise(_notebook(nbformat.v4.new_code_cell("x = 1")), "empty.ipynb")


def test_drift_is_detected(tmp_path):
    solutions, target = tmp_path / "solutions", tmp_path / "exercises"
    solutions.mkdir()
    nb = _notebook(nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"))
    nbformat.write(nb, solutions / "01_x.ipynb")
    assert exercises.drift(solutions, target) == ["exercises/01_x.ipynb is missing"]
    exercises.generate(solutions, target)
    assert exercises.drift(solutions, target) == []
    nb.cells[0].source = "### BEGIN SOLUTION\nx = 2\n### END SOLUTION\nprint(x)"
    nbformat.write(nb, solutions / "01_x.ipynb")
    assert exercises.drift(solutions, target) == ["exercises/01_x.ipynb differs from what solutions/01_x.ipynb generates"]


def test_the_course_exercises_are_in_sync():
    assert exercises.drift(ROOT / "solutions", ROOT / "exercises") == []


@pytest.mark.processes
@pytest.mark.parametrize("path", EXERCISES, ids=[p.stem for p in EXERCISES])
def test_blank_exercise_runs_and_every_check_fails(path):
    """The scaffolding runs (cells not tagged raises-exception must pass, as under nbval),
    and every check cell fails on the blank: a check that passes on nothing is no check."""
    cells = grading.execute_cells(path)
    checks = [cell for cell in cells if exercises.CHECK_TAG in cell["tags"]]
    assert checks, f"{path.name} has no cell tagged 'check'"
    for cell in checks:
        assert cell["error"], f"{path.name} cell {cell['index']} passed on the blank exercise:\n{cell['source']}"
    for cell in cells:
        if exercises.RAISES_TAG not in cell["tags"]:
            assert not cell["error"], (f"{path.name} cell {cell['index']} failed on the blank exercise:\n"
                                       f"{cell['source']}\n{cell['error']}")


@pytest.mark.processes
def test_grade_runs_the_course_checks_not_the_learners(tmp_path):
    """A check cell edited to pass still fails a wrong (here: blank) answer: grade puts the
    course's check back before it runs the notebook."""
    name = "02_distributed_sampling.ipynb"
    learner = nbformat.read(ROOT / "exercises" / name, as_version=4)
    for cell in learner.cells:
        if exercises.CHECK_TAG in cell.metadata.get("tags", []):
            cell.source = "pass  # 'fixed' by the learner"
    (tmp_path / "exercises").mkdir()
    path = tmp_path / "exercises" / name
    nbformat.write(learner, path)

    graded = grading.grade(path, solutions_dir=ROOT / "solutions")
    assert graded and all(check["error"] for check in graded), graded
    assert all("fixed" not in check["source"] for check in graded)


def test_a_deleted_check_cell_is_reported_missing():
    exercise = nbformat.read(ROOT / "exercises" / "02_distributed_sampling.ipynb", as_version=4)
    learner = nbformat.from_dict(exercise)
    learner.cells = [cell for cell in learner.cells if exercises.CHECK_TAG not in cell.metadata.get("tags", [])]
    missing = grading.restore_checks(learner, exercise)
    assert missing and all("checks." in source for source in missing)


def test_grade_needs_the_solutions_to_take_the_checks_from(tmp_path):
    path = tmp_path / "99_unknown.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), path)
    with pytest.raises(FileNotFoundError, match="99_unknown.ipynb to take the check cells from"):
        grading.grade(path, solutions_dir=ROOT / "solutions")
