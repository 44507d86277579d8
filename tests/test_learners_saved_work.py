"""A learner's work in the course folder never fails the tests of what the course ships.

After a day in JupyterLab the folder holds lectures saved with their outputs (JupyterLab
writes a notebook back as soon as it runs a cell, with its own metadata), a scratch cell added
to one, and exercises answered and run. This test plants exactly that in a copy of the course
(a git repository of its own, whose index holds the course's notebooks) and runs there what reads those notebooks:
`spike-course exercises --check`, as `make test` does, and the tests that read the
notebooks. They read git's index (tests/course_files.py), so all of it passes, and pytest's
summary names the notebooks that differ on disk.
"""

import json
import os
import subprocess
import sys

import pytest

from spike_course.course import conventions, exercises

import course_files

pytestmark = pytest.mark.processes  # git, and the commands run in the copy

LECTURES = ["00_welcome_and_setup", "01_message_passing", "02_distributed_sampling", "03_data_parallel",
            "12_context_and_expert_parallel"]
ANSWERED = ["01_message_passing", "02_distributed_sampling", "03_data_parallel"]
# The tests that read notebooks and start no process: make quick's part of them.
READERS = ["tests/test_notebooks.py", "tests/test_exercises.py", "tests/test_rubric.py",
           "tests/test_taught_code.py", "tests/test_hello_mpi_c.py"]


def _saved_by_jupyterlab(notebook, first_count=1):
    """``notebook`` as JupyterLab writes it back once every code cell ran: execution counts,
    outputs (text, and a figure's PNG), and the kernel's language_info in the metadata."""
    from nbformat.v4 import new_output

    count = first_count
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.execution_count = count
            cell.outputs = [new_output("stream", name="stdout", text=f"what cell {count} printed\n"),
                            new_output("display_data", data={"image/png": "iVBORw0KGgo=",
                                                             "text/plain": "<Figure size 640x480>"})]
            count += 1
    notebook.metadata["language_info"] = {"name": "python", "version": "3.12.3", "mimetype": "text/x-python"}
    return notebook


def _answered(stem):
    """The exercise notebook of ``stem`` with every blank answered (the solution's code in
    place of each stub, as a learner would type it) and every cell run."""
    solution = course_files.notebook(f"solutions/{stem}.ipynb")
    notebook = exercises.make_exercise(solution, f"{stem}.ipynb")
    for cell, worked in zip(notebook.cells, solution.cells):
        if conventions.has_solution(worked):
            cell.source = conventions.without_markers(worked.source)
    return _saved_by_jupyterlab(notebook)


def _with_a_scratch_cell(notebook):
    import nbformat

    notebook.cells.insert(2, nbformat.v4.new_code_cell("world_size = 3  # trying it with 3 ranks", id="mine"))
    return notebook


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def learners_course(tmp_path_factory):
    """A copy of the course as the tests see it (course_files.copy_course), in a repository of
    its own, with a learner's day of work on top, not staged."""
    import nbformat

    if not course_files.in_git():
        pytest.skip("not a git checkout: the tests read the working tree, where a learner's work is")
    course = tmp_path_factory.mktemp("learner") / "course"
    course_files.copy_course(course)
    _git("init", "--quiet", cwd=course)
    _git("add", "--all", cwd=course)
    for stem in LECTURES:
        lecture = course_files.notebook(f"notebooks/{stem}.ipynb")
        if stem == "02_distributed_sampling":
            _with_a_scratch_cell(lecture)
        nbformat.write(_saved_by_jupyterlab(lecture), course / "notebooks" / f"{stem}.ipynb")
    for stem in ANSWERED:
        nbformat.write(_answered(stem), course / "exercises" / f"{stem}.ipynb")
    return course


def _run(course, *command):
    env = {**os.environ, "PYTHONPATH": str(course), "SPIKE_COURSE_DATA": "synthetic"}
    return subprocess.run([sys.executable, *command], cwd=course, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_planted_work_is_what_a_working_tree_reader_would_refuse(learners_course):
    """The plant is real: on disk the notebooks carry outputs and answers, and git's copy not."""
    for path in [f"notebooks/{s}.ipynb" for s in LECTURES] + [f"exercises/{s}.ipynb" for s in ANSWERED]:
        cells = json.loads((learners_course / path).read_text())["cells"]
        assert any(c.get("outputs") for c in cells if c["cell_type"] == "code"), path
    answered = (learners_course / "exercises" / "01_message_passing.ipynb").read_text()
    assert conventions.STUB not in answered and "def my_tree_allreduce" in answered


def test_exercises_check_reports_the_work_and_passes(learners_course):
    done = _run(learners_course, "-m", "spike_course.cli", "exercises", "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    for stem in ANSWERED:
        assert f"exercises/{stem}.ipynb: in sync with solutions/ (holds your work:" in done.stdout, done.stdout


def test_the_tests_that_read_notebooks_pass_and_say_what_they_read(learners_course):
    done = _run(learners_course, "-m", "pytest", "-q", "-m", "not processes", *READERS)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "passed" in done.stdout and "failed" not in done.stdout
    summary = done.stdout[done.stdout.index("notebooks read as git stages them"):]
    # the scratch cell and the answers differ from git; outputs alone (lecture 00) do not count
    for path in ["notebooks/02_distributed_sampling.ipynb"] + [f"exercises/{s}.ipynb" for s in ANSWERED]:
        assert path in summary, summary
    assert "notebooks/00_welcome_and_setup.ipynb" not in summary
