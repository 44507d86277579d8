"""Exercises are generated from solutions, stay in sync, and their checks fail on the blank."""

import re
from pathlib import Path

import nbformat
import pytest

from spike_course.course import conventions, exercises, grading

import course_files

ROOT = Path(__file__).resolve().parents[1]
# The blanks as the committed solutions/ generate them: exercises/ may hold a learner's answers.
BLANKS = {path.name: exercises.make_exercise(course_files.notebook(path), path.name)
          for path in course_files.tracked("solutions")}


def _notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_a_solution_region_becomes_an_indented_stub():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n\nprint(f(1))"
    blank = conventions.blank_source(source)
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
        conventions.blank_source(source)


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


def test_the_course_part_of_the_exercises_is_in_sync():
    """What the course wrote in exercises/ is what solutions/ generates. A learner's answers
    and outputs may be there (make test must not fail for them): the next test keeps them
    out of what the course ships."""
    lines, in_sync = exercises.check(ROOT / "solutions", ROOT / "exercises")
    assert in_sync, "\n".join(lines)


def test_the_committed_exercises_are_the_blanks():
    """What git holds (what a learner gets) is exactly the blank, no answers, no outputs."""
    committed = course_files.tracked("exercises")
    assert sorted(path.name for path in committed) == sorted(BLANKS)
    for path in committed:
        assert exercises.learner_work(course_files.notebook(path), BLANKS[path.name]) == [], path


def _course(tmp_path, name="02_distributed_sampling.ipynb"):
    """A course folder with one chapter's solution and its generated exercise."""
    root = tmp_path / "course"
    for folder in ("notebooks", "solutions", "exercises"):
        (root / folder).mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    course_files.copy_to(ROOT / "solutions" / name, root / "solutions")
    exercises.generate(root / "solutions", root / "exercises")
    return root, root / "exercises" / name


def _answer(path):
    """Fill the first blank of the exercise notebook at ``path`` (as a learner would)."""
    notebook = nbformat.read(path, as_version=4)
    number, cell = next((i, c) for i, c in enumerate(notebook.cells, 1) if conventions.STUB in c.source)
    cell.source = cell.source.replace(conventions.STUB, "my_answer = 42  # the learner's line")
    nbformat.write(notebook, path)
    return number


def test_no_exercises_command_overwrites_a_learners_answer(tmp_path, monkeypatch, capsys):
    from spike_course.cli import main

    root, path = _course(tmp_path)
    number = _answer(path)
    answered = path.read_text()
    monkeypatch.chdir(root)

    assert main(["exercises", "--check"]) == 0  # the course part is in sync: nothing to do
    assert f"holds your work: cell {number} answered" in capsys.readouterr().out
    assert main(["exercises"]) == 1
    said = capsys.readouterr().out
    assert f"exercises/{path.name}: kept: it holds your work (cell {number} answered)" in said
    assert "--force" in said and "exercises/backups/" in said
    assert path.read_text() == answered

    assert main(["exercises", "--force"]) == 0
    (backup,) = (root / "exercises" / "backups").glob("*.ipynb")
    assert f"your copy: {backup}" in capsys.readouterr().out
    assert backup.read_text() == answered and "my_answer = 42" not in path.read_text()


def test_a_notebook_that_was_run_is_kept_too(tmp_path):
    root, path = _course(tmp_path)
    notebook = nbformat.read(path, as_version=4)
    first = next(c for c in notebook.cells if c.cell_type == "code")
    first.execution_count = 1
    first.outputs = [nbformat.v4.new_output("stream", text="chapter 02_distributed_sampling\n")]
    nbformat.write(notebook, path)
    run = path.read_text()
    solution = nbformat.read(root / "solutions" / path.name, as_version=4)
    solution.cells[0].source += "\n\nA sentence the course added since."  # the course moved on
    nbformat.write(solution, root / "solutions" / path.name)
    done = exercises.generate(root / "solutions", root / "exercises")
    assert done[path].startswith("kept: it holds your work (cell 2 run)") and path.read_text() == run


def test_what_counts_as_an_answer_in_a_cell():
    """Text at a blank is the learner's, stub or no stub; an older blank is not: the course may
    rewrite it. In a cell that starts as a given script, a change to that script is an answer."""
    blank = nbformat.v4.new_code_cell(f"x = 1\n# YOUR CODE HERE\n{conventions.STUB}\nprint(x)")
    typed_above = f"x = 1\n# YOUR CODE HERE\ny = x + 1  # mine\n{conventions.STUB}\nprint(x)"
    older_blank = f"x = 2\n# YOUR CODE HERE\n{conventions.STUB}\nprint(x)"  # the course changed x since
    assert exercises.answered(nbformat.v4.new_code_cell(typed_above), blank)
    assert exercises.answered(nbformat.v4.new_code_cell("x = 1\ny = 2\nprint(x)"), blank)
    assert not exercises.answered(nbformat.v4.new_code_cell(older_blank), blank)
    assert not exercises.answered(nbformat.v4.new_code_cell(blank.source), blank)

    solution = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%%writefile workers/99_x/single.py\nprint('one gpu')"),
        nbformat.v4.new_code_cell("%%writefile workers/99_x/train.py\n"
                                  "### BEGIN SOLUTION (starts as workers/99_x/single.py)\n"
                                  "print('a job')\n### END SOLUTION")])
    starter = exercises.make_exercise(solution).cells[1]
    assert starter.source == f"%%writefile workers/99_x/train.py\n# YOUR CODE HERE\n{conventions.STUB}\nprint('one gpu')"
    begun = starter.source.replace("print('one gpu')", "print('one gpu, soon a job')")
    assert exercises.answered(nbformat.v4.new_code_cell(begun), starter)
    assert not exercises.answered(nbformat.v4.new_code_cell(starter.source), starter)


def test_course_drift_is_told_from_a_learners_work(tmp_path):
    root, path = _course(tmp_path)
    _answer(path)
    notebook = nbformat.read(path, as_version=4)
    given = next(i for i, c in enumerate(notebook.cells, 1)
                 if c.cell_type == "code" and conventions.STUB not in c.source and "my_answer" not in c.source)
    notebook.cells[given - 1].source += "\nprint('changed')"
    nbformat.write(notebook, path)
    lines, in_sync = exercises.check(root / "solutions", root / "exercises")
    assert not in_sync and f"cell {given} differ from the course" in lines[0] and "answered" in lines[0]


@pytest.mark.processes
@pytest.mark.parametrize("name", sorted(BLANKS), ids=[Path(name).stem for name in sorted(BLANKS)])
def test_blank_exercise_runs_and_every_check_fails(name, tmp_path):
    """The scaffolding runs (cells not tagged raises-exception must pass, as under nbval),
    and every check cell fails on the blank: a check that passes on nothing is no check.
    The blank is generated from solutions/ and runs in a folder of its own: a learner's
    answers in exercises/, and the workers they wrote, are not touched."""
    cells = grading.execute_cells(tmp_path / name, notebook=nbformat.from_dict(BLANKS[name]))
    checks = [cell for cell in cells if conventions.CHECK_TAG in cell["tags"]]
    assert checks, f"{name} has no cell tagged 'check'"
    for cell in checks:
        assert cell["error"], f"{name} cell {cell['index']} passed on the blank exercise:\n{cell['source']}"
    for cell in cells:
        if conventions.RAISES_TAG not in cell["tags"]:
            assert not cell["error"], (f"{name} cell {cell['index']} failed on the blank exercise:\n"
                                       f"{cell['source']}\n{cell['error']}")


@pytest.mark.processes
def test_grade_runs_the_course_checks_not_the_learners(tmp_path, monkeypatch, capfd):
    """A check cell edited to pass still fails a wrong (here: blank) answer: grade runs the
    course's check instead, names each check by its cell as JupyterLab numbers it and by the
    check it calls, and reports the edit itself as a grading problem."""
    from spike_course.cli import main

    name = "02_distributed_sampling.ipynb"
    learner = nbformat.from_dict(BLANKS[name])
    for cell in learner.cells:
        if conventions.CHECK_TAG in cell.metadata.get("tags", []):
            cell.source = "pass  # 'fixed' by the learner"
    (tmp_path / "exercises").mkdir()
    path = tmp_path / "exercises" / name
    nbformat.write(learner, path)

    monkeypatch.chdir(ROOT)  # grade takes the checks from the course it runs in
    assert main(["grade", str(path)]) == 1
    printed = capfd.readouterr()  # the kernel's own output too: it writes to the terminal
    report = printed.out.splitlines()
    assert "WARNING" not in printed.err, printed.err  # ipykernel's warning about TCP, for one
    checks = [number for number, cell in enumerate(learner.cells, 1)
              if conventions.CHECK_TAG in cell.metadata.get("tags", [])]
    # each edited check cell is also a grading problem of its own
    assert report[0] == f"{path}: 0 of {len(checks)} checks pass, and {len(checks)} grading problem(s)"
    lines = [line for line in report[1:] if line.startswith(("  pass", "  FAIL"))]
    assert len(lines) == 2 * len(checks)
    for line, number in zip(lines, checks):
        assert line.startswith(f"  FAIL  cell {number}/{len(learner.cells)}, check_sampler: "), line
    for line, number in zip(lines[len(checks):], checks):
        assert line.startswith(f"  FAIL  cell {number}/{len(learner.cells)}, grading: EditedCell: this "
                               "check cell"), line


def test_each_check_cell_is_named_by_the_check_it_calls():
    for name, exercise in BLANKS.items():
        for cell in exercise.cells:
            if conventions.CHECK_TAG in cell.metadata.get("tags", []):
                assert grading.check_name(cell.source).startswith("check_"), (name, cell.source)
    # a helper called first (it names a blank or crashed rank) is not what the cell checks
    source = "reports = checks.launch_reports(job, 'evaluate')\nchecks.check_distributed_accuracy(reports)"
    assert grading.check_name(source) == "check_distributed_accuracy"
    assert grading.check_name("assert answer == 42") == "the check cell"


def test_grade_needs_the_solutions_to_take_the_checks_from(tmp_path):
    path = tmp_path / "99_unknown.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), path)
    with pytest.raises(FileNotFoundError, match="99_unknown.ipynb to take the check cells from"):
        grading.grade(path, solutions_dir=ROOT / "solutions")


@pytest.mark.processes
def test_a_failed_check_shows_its_message_alone_in_the_notebook(tmp_path):
    from spike_course.lab.headless import run_notebook

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from spike_course.checks import check_capstone_submit\n"
        "check_capstone_submit('torchrun train.py')")])
    path = tmp_path / "check.ipynb"
    nbformat.write(notebook, path)
    (error,) = [o for o in run_notebook(path, allow_errors=True).notebook.cells[0].outputs
                if o.output_type == "error"]
    assert error.ename == "CheckFailed"
    assert error.traceback == [f"\x1b[0;31mCheckFailed\x1b[0m: {error.evalue}"]
    assert "def " not in error.evalue and "Traceback" not in "".join(error.traceback)


def _runs_the_answer(notebook) -> set[str]:
    """The workers of an exercise that run the learner's code: those with a solution region,
    and those that import one of them."""
    written = {Path(path).name: source for path, source in conventions.written_files(notebook).items()}
    answered = {name for name, source in written.items() if conventions.BEGIN in source}
    return answered | {name for name, source in written.items()
                       if any(re.search(rf"^\s*(from|import)\s+{Path(a).stem}\b", source, re.M) for a in answered)}


@pytest.mark.parametrize("name", sorted(BLANKS), ids=[Path(name).stem for name in sorted(BLANKS)])
def test_a_launch_of_the_learners_code_reaches_the_check(name):
    """A rank that crashes in the learner's code must end in the check's named message, not in a
    LaunchError's traceback: every launch of such a worker passes check=False, and the check
    reads its failure (checks.launch_reports)."""
    notebook = course_files.notebook(ROOT / "solutions" / name)
    answering = _runs_the_answer(notebook)
    for cell in notebook.cells:
        for launched in re.findall(r"launch\(\s*WORKERS\s*/\s*[\"']([^\"']+)[\"']", cell.source):
            assert launched not in answering or "check=False" in cell.source, (
                f"{name}: the launch of {launched} raises on a crash before the check can name it:\n{cell.source}")


def test_a_crash_in_the_learners_code_is_named_by_the_check():
    """What a launch with check=False hands the check when rank 1 crashed in the learner's code
    (rank 0 only echoes it): the check names rank 1 and its error, not a KeyError of its own."""
    from spike_course import checks
    from spike_course.lab.launcher import LaunchResult

    job = LaunchResult(reports={0: {}}, nproc=2, seconds=3.0, returncodes={0: 1, 1: 1}, exit_order=[0, 1],
                       output={0: ["RuntimeError: Connection closed by peer [127.0.0.1]:4242"],
                               1: ["Traceback (most recent call last):", "  File \"x.py\", line 3",
                                   "ZeroDivisionError: division by zero"]})
    for check in (lambda: checks.check_zero1(job), lambda: checks.check_fits_budget(job, 1e6),
                  lambda: checks.check_tp_plan(job), lambda: checks.check_pipeline_training(job, "digits.pt")):
        with pytest.raises(checks.CheckFailed, match=r"rank 1 failed \(exit code 1\).*ZeroDivisionError"):
            check()
