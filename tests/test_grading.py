"""spike-course grade runs the exercise as the course wrote it, with only the learner's answers.

Each attack a learner (or a learner's shortcut) can make on grading is planted here: a check
redefined in an added cell, an edited reference or check cell, code changed around an answer,
an answer that borrows a check's own reference or reads solutions/, a deleted check cell. Each
fails grading with a message that says what it was; a right answer still passes.
"""

from pathlib import Path

import nbformat
import pytest

from spike_course.course import conventions, exercises, grading

import course_files

ROOT = Path(__file__).resolve().parents[1]

REFERENCE = "N = 3  # the course's setting"
ANSWER = "def answer():\n    ### BEGIN SOLUTION\n    return N * 14\n    ### END SOLUTION\n\nprint(answer())"
CHECK = "assert answer() == 42, 'answer() should be 42'"


def solution():
    cells = [nbformat.v4.new_code_cell(REFERENCE, id="reference"), nbformat.v4.new_code_cell(ANSWER, id="answer"),
             nbformat.v4.new_code_cell(CHECK, id="check", metadata={"tags": [conventions.CHECK_TAG]})]
    return nbformat.v4.new_notebook(cells=cells)  # fixed ids: grading matches cells by id


def learner(answer="    return 42", **edits):
    """The exercise as a learner leaves it: the blank replaced by ``answer``; ``edits`` maps a
    cell index to new source, and ``added`` adds a cell at the end."""
    notebook = exercises.make_exercise(solution(), "99_probe")
    blank = notebook.cells[1].source
    notebook.cells[1].source = conventions.BLANK_LINES.sub(answer.replace("\\", r"\\"), blank)
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


# Each way an answer could reach past itself, by the name grading gives it: the attacks of
# issue 40's audit (and of the one before), then ones of our own.
ATTACKS = [
    ("    from spike_course.checks.ch10_profiling import _lateness\n    return 42", "BorrowedAnswer"),
    ("    from spike_course import checks\n    return 42", "BorrowedAnswer"),
    ("    import json\n    return len(json.load(open('../solutions/99_probe.ipynb'))) * 0 + 42", "BorrowedAnswer"),
    ("    import json\n    return len(json.load(open('../solu' + 'tions/99_probe.ipynb'))) * 0 + 42", "BorrowedAnswer"),
    ("    part = 'tions'\n    return len(open(f'../solu{\"\"}' 'tions/99_probe.ipynb').read()) * 0 + 42",
     "BorrowedAnswer"),
    ('    globals()["checks"].check_answer = lambda *a, **k: None\n    return 41', "NamespaceReach"),
    ("    vars()['N'] = 3\n    return 41", "NamespaceReach"),
    ("    import math\n    math.isclose = lambda *a, **k: True\n    return 41", "ModulePatched"),
    ("    import math\n    setattr(math, 'isclose', print)\n    return 41", "ModulePatched"),
    ('    import importlib\n    importlib.import_module("spike_course.che" + "cks")\n    return 41', "NamespaceReach"),
    ('    from spike_course import costmodel\n    return getattr(costmodel, "memory_" + "plan")', "NamespaceReach"),
    ("    import sys\n    sys.modules['spike_course'].checks = None\n    return 41", "NamespaceReach"),
    ("    return answer.__globals__['N'] * 0 + 42", "NamespaceReach"),
    ("    return eval('4' + '2')", "NamespaceReach"),
    ("    global checks\n    checks = None\n    return 41", "RebindsCourseName"),
    ("    import gc\n    return len(gc.get_referrers(answer)) * 0 + 42", "NamespaceReach"),
    ("    return ().__class__.__base__.__subclasses__() and 42", "NamespaceReach"),
    # the one shape every check judges by, and a check's table of mistakes
    ("    from spike_course.mistakes import Mistake\n    Mistake.seen = property(lambda m: lambda *a: False)\n"
     "    return 41", "ModulePatched"),
    ("    from spike_course.checks import ch06_zero\n    ch06_zero.NOT_DDP_MISTAKES = ()\n    return 41", "ModulePatched"),
]


@pytest.mark.parametrize("answer, name", ATTACKS)
def test_an_answer_that_reaches_past_itself_fails_grading_by_name(answer, name):
    _, problems = rebuilt(learner(answer))
    assert [p for p in problems if p["error"].startswith(name + ":")], problems


@pytest.mark.parametrize("answer", [
    "    import math, torch\n    x = torch.zeros(3)\n    x[0] = 1\n    return int(math.sqrt(42 * 42))",
    "    checks = [42]  # a local name like the module's is the answer's own\n    return checks[0]",
    "    import json as checks\n    return 42",
    "    import operator, types\n    return operator.attrgetter('value')(types.SimpleNamespace(value=42))",
    "    class Box:\n        pass\n    box = Box()\n    box.value = 42\n    return getattr(box, 'value')",
])
def test_an_answer_that_keeps_to_itself_is_not_refused(answer):
    _, problems = rebuilt(learner(answer))
    assert problems == []


def test_the_course_s_own_answers_are_not_refused():
    """Every solution's answers, graded as a learner's, raise no problem: the scan refuses
    only what no answer needs."""
    for path in course_files.tracked("solutions", "[0-9][0-9]_*.ipynb"):
        solution = course_files.notebook(path)
        _, problems = grading.rebuild(answered_with_solution(solution, path.name), solution, path.name)
        assert problems == [], (path.name, problems)


def answered_with_solution(solution, name):
    """The blank exercise with each blank filled by the solution's answer, as a learner would."""
    notebook = exercises.make_exercise(solution, name)
    for index, cell in enumerate(notebook.cells):
        if conventions.has_solution(solution.cells[index]):
            regions = conventions.regions(solution.cells[index].source)
            if conventions.starts_as(solution.cells[index].source) is not None:
                # the given script after the stub is the learner's too
                cell.source = cell.source.split(conventions.STUB)[0].rsplit("# YOUR CODE HERE", 1)[0] + regions[0]
            else:
                cell.source = conventions.BLANK_LINES.sub(lambda m, it=iter(regions): next(it).rstrip("\n"),
                                                        cell.source)
    return notebook


def test_the_answer_regions_of_every_course_exercise_come_back_whole():
    """Rebuilding the committed blank of each chapter with the solution's own answers gives
    back the solution's code: the rebuild takes exactly the answer regions, no more."""
    for path in course_files.tracked("solutions", "[0-9][0-9]_*.ipynb"):
        sol = course_files.notebook(path)
        blank = exercises.make_exercise(sol, path.name)
        filled = answered_with_solution(sol, path.name)
        for index, cell in enumerate(blank.cells):
            if conventions.has_solution(sol.cells[index]):
                regions = conventions.regions(sol.cells[index].source)
                whole_script = conventions.starts_as(sol.cells[index].source) is not None
                answers = conventions.answers_in(cell.source, filled.cells[index].source, whole_script)
                assert answers is not None, (path.name, index)
                assert [conventions.lines_as_read(a).strip() for a in answers] == [conventions.lines_as_read(r).strip() for r in regions], (path.name, index)


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


# Chapter 08's check, in a notebook of three cells: the course's imports, one answer, the check.
GUARDED = [
    "import math\nimport torch\nfrom spike_course import checks, costmodel\nalpha, beta, world = 9e-4, 1 / 0.3e9, 2",
    "### BEGIN SOLUTION\n" + conventions.without_markers("\n".join(
        cell.source for cell in course_files.notebook(ROOT / "solutions" / "08_communication_and_hardware.ipynb").cells
        if cell.cell_type == "code" and conventions.has_solution(cell))) + "\n### END SOLUTION",
    "checks.check_dgx_prediction(ring_from_fit, predict_allreduce, dgx_busbw, dgx_allreduce_seconds,\n"
    "                            fit=(alpha, beta), world_size=world)",
]
# Three attacks the scan of answers cannot all see: a path joined at run time (the audit hook
# refuses it), a patched math.isclose and a rebound check (the kernel's guards name them).
ATTACKED = GUARDED[1].split("\n", 1)[1].rsplit("\n", 1)[0].replace(
    "return step_latency, busbw", "return alpha, 1 / beta") + '''
import json
json.load(open("".join(["..", "/sol", "utions/99_guarded.ipynb"])))
math.isclose = lambda *args, **kwargs: True
globals()["checks"].check_dgx_prediction = lambda *args, **kwargs: print("check passed")
'''


@pytest.mark.processes
def test_each_attack_fails_by_name_in_the_learners_kernel_and_in_grading(tmp_path):
    solution = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(GUARDED[0], id="imports"), nbformat.v4.new_code_cell(GUARDED[1], id="answer"),
        nbformat.v4.new_code_cell(GUARDED[2], id="check", metadata={"tags": [conventions.CHECK_TAG]})])
    (tmp_path / "solutions").mkdir()
    (tmp_path / "exercises").mkdir()
    nbformat.write(solution, tmp_path / "solutions" / "99_guarded.ipynb")
    attacked = exercises.make_exercise(solution, "99_guarded")
    attacked.cells[1].source = conventions.BLANK_LINES.sub(ATTACKED.replace("\\", r"\\"), attacked.cells[1].source)
    path = tmp_path / "exercises" / "99_guarded.ipynb"
    nbformat.write(attacked, path)

    # As the learner runs it: the check is refused the replaced function, and the rebinding fails.
    errors = [cell["error"] or "" for cell in grading.execute_cells(path, timeout=120)]
    assert errors[1].startswith("Tampering: Tampering: this notebook tried to replace spike_course.checks.check_dgx")
    assert errors[2].startswith("Tampering: Tampering: code in this notebook replaced math.isclose")

    # As grade runs it: each attack by name, the solutions' file refused, and the check failing.
    report = grading.grade(path, timeout=120, solutions_dir=tmp_path / "solutions")
    named = [r["error"] for r in report]
    assert any(e.startswith("NamespaceReach:") and "globals(...)" in e for e in named), named
    assert any(e.startswith("ModulePatched:") and "math.isclose = ..." in e for e in named), named
    assert any(e.startswith("PermissionError: BorrowedAnswer:") and "99_guarded.ipynb" in e for e in named), named
    assert [r for r in report if "check" in r["tags"]][0]["error"], report
