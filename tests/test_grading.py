"""spike-course grade runs the exercise as the course wrote it, with only the learner's answers.

Each attack a learner (or a learner's shortcut) can make on grading is planted here: a check
redefined in an added cell, an edited reference or check cell, code changed around an answer,
an answer that borrows a check's own reference or reads solutions/, a deleted check cell. Each
fails grading with a message that says what it was; a right answer still passes.
"""

from pathlib import Path

import nbformat
import pytest

from spike_course import exercises, grading

import course_files

ROOT = Path(__file__).resolve().parents[1]

REFERENCE = "N = 3  # the course's setting"
ANSWER = "def answer():\n    ### BEGIN SOLUTION\n    return N * 14\n    ### END SOLUTION\n\nprint(answer())"
CHECK = "assert answer() == 42, 'answer() should be 42'"


def solution():
    cells = [nbformat.v4.new_code_cell(REFERENCE, id="reference"), nbformat.v4.new_code_cell(ANSWER, id="answer"),
             nbformat.v4.new_code_cell(CHECK, id="check", metadata={"tags": [exercises.CHECK_TAG]})]
    return nbformat.v4.new_notebook(cells=cells)  # fixed ids: grading matches cells by id


def learner(answer="    return 42", **edits):
    """The exercise as a learner leaves it: the blank replaced by ``answer``; ``edits`` maps a
    cell index to new source, and ``added`` adds a cell at the end."""
    notebook = exercises.make_exercise(solution(), "99_probe")
    blank = notebook.cells[1].source
    notebook.cells[1].source = exercises.BLANK_LINES.sub(answer.replace("\\", r"\\"), blank)
    for index, source in edits.items():
        if index == "added":
            notebook.cells.append(nbformat.v4.new_code_cell(source))
        else:
            notebook.cells[int(index)].source = source
    return notebook


def rebuilt(notebook):
    return grading.rebuild(notebook, solution(), "99_probe")


def test_a_right_answer_is_taken_and_nothing_else():
    notebook, problems = rebuilt(learner(added="print('my scratch work')"))
    assert problems == []
    assert notebook.cells[1].source == "def answer():\n    return 42\n\nprint(answer())"
    assert [c.source for c in notebook.cells] == [REFERENCE, notebook.cells[1].source, CHECK]


@pytest.mark.parametrize("edits, error", [
    ({"added": "checks.check_answer = lambda *args, **kwargs: None"}, "AddedCell"),
    ({"added": "def answer():\n    return 42\ndef check_answer():\n    pass"}, "AddedCell"),
    ({"0": "N = 3.5  # nearer 42 / 14"}, "EditedCell: this reference cell"),
    ({"2": "assert True  # 'fixed'"}, "EditedCell: this check cell"),
])
def test_an_edit_outside_the_answers_fails_grading_and_is_not_run(edits, error):
    notebook, problems = rebuilt(learner(**edits))
    assert [p["error"] for p in problems if p["error"].startswith(error)], problems
    assert [c.source for c in notebook.cells] == [REFERENCE, notebook.cells[1].source, CHECK]


def test_code_changed_around_an_answer_is_named():
    changed = learner()
    changed.cells[1].source = changed.cells[1].source.replace("print(answer())", "print(42)")
    _, problems = rebuilt(changed)
    assert problems and problems[0]["error"].startswith("EditedCell: the code around the answer")


@pytest.mark.parametrize("answer", [
    "    from spike_course.checks.profiling import _lateness\n    return 42",
    "    from spike_course import checks\n    return 42",
    "    import json\n    return len(json.load(open('../solutions/99_probe.ipynb'))) * 0 + 42",
])
def test_an_answer_that_borrows_the_checks_or_the_solutions_fails(answer):
    _, problems = rebuilt(learner(answer))
    assert [p for p in problems if p["error"].startswith("BorrowedAnswer")], problems


def test_the_answer_regions_of_every_course_exercise_come_back_whole():
    """Rebuilding the committed blank of each chapter with the solution's own answers gives
    back the solution's code: the rebuild takes exactly the answer regions, no more."""
    for path in course_files.tracked("solutions", "[0-9][0-9]_*.ipynb"):
        sol = course_files.notebook(path)
        blank = exercises.make_exercise(sol, path.name)
        for index, cell in enumerate(blank.cells):
            if exercises.has_solution(sol.cells[index]):
                regions = [r for r in exercises.re.findall(r"### BEGIN SOLUTION[^\n]*\n(.*?)[ \t]*### END SOLUTION",
                                                           sol.cells[index].source, exercises.re.S)]
                whole_script = exercises.starts_as(sol.cells[index].source) is not None
                if whole_script:  # the given script after the stub is the learner's too
                    filled = cell.source.split(exercises.STUB)[0].rsplit("# YOUR CODE HERE", 1)[0] + regions[0]
                else:
                    filled = exercises.BLANK_LINES.sub(lambda m, it=iter(regions): next(it).rstrip("\n"),
                                                cell.source)
                answers = exercises.answers_in(cell.source, filled, whole_script)
                assert answers is not None, (path.name, index)
                assert [exercises.lines_as_read(a).strip() for a in answers] == [exercises.lines_as_read(r).strip() for r in regions], (path.name, index)


@pytest.mark.processes
def test_grade_reports_each_attack_and_passes_a_right_answer(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    nbformat.write(solution(), tmp_path / "solutions" / "99_probe.ipynb")
    path = tmp_path / "exercises" / "99_probe.ipynb"

    nbformat.write(learner(), path)
    assert [c["error"] for c in grading.grade(path, timeout=60, solutions_dir=tmp_path / "solutions")] == [None]

    attacked = learner("    return 41", added="checks.check_answer = lambda: None")
    attacked.cells[2].source = "assert True"
    nbformat.write(attacked, path)
    report = grading.grade(path, timeout=60, solutions_dir=tmp_path / "solutions")
    errors = [c["error"] or "" for c in report]
    assert errors[0].startswith("AssertionError: answer() should be 42")  # the course's check ran
    assert any(e.startswith("EditedCell: this check cell") for e in errors)
    assert any(e.startswith("AddedCell") for e in errors)

    deleted = learner()
    del deleted.cells[2]
    nbformat.write(deleted, path)
    (check,) = grading.grade(path, timeout=60, solutions_dir=tmp_path / "solutions")
    assert check["index"] is None and check["error"].startswith("MissingCheck")
