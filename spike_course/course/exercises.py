"""Generate ``exercises/`` from ``solutions/``, and tell when the two have drifted
(grading them is ``spike_course.course.grading``; the notebooks' conventions, markers, stub and
tags, are ``spike_course.course.conventions``).

The exercise notebook is the solution notebook with each solution region replaced by the stub,
and with outputs cleared. A region that says where the exercise starts becomes the stub
followed by that file as the notebook's ``%%writefile`` cell writes it: the learner changes a
whole given script (the capstone), and everything after the stub is their answer.

Tags tell CI what to expect of the blank exercise:

* a cell with a solution region, a cell tagged ``check`` (it checks an answer) and a
  cell tagged ``uses-solution`` (it needs the answer to run) get ``raises-exception``,
  so nbval lets them fail on the blank;
* ``check`` cells must fail on the blank: ``tests/test_exercises.py`` runs each
  exercise notebook and asserts it, so a check that passes on nothing is caught.

The markers are nbgrader's convention (https://nbgrader.readthedocs.io), as is grading
with the check cells restored from the source (``grading``).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import nbformat

from .conventions import (BEGIN, CHECK_TAG, RAISES_TAG, STARTS_AS_KEY, STUB, USES_TAG, answers_in, blank_source,
                          has_solution, is_whole_script, lines_as_read, starts_as, written_files)

def make_exercise(solution: nbformat.NotebookNode, name: str = "") -> nbformat.NotebookNode:
    """The exercise notebook for one solution notebook (a new object; the input is untouched)."""
    exercise = nbformat.from_dict(solution)
    if not any(has_solution(cell) for cell in exercise.cells):
        raise ValueError(f"{name}: no {BEGIN} region: a solution notebook needs at least one")
    starters = written_files(solution)
    for index, cell in enumerate(exercise.cells):
        if cell.cell_type != "code":
            continue
        tags = list(cell.metadata.get("tags", []))
        if has_solution(cell):
            if starts_as(cell.source):  # grading and learner_work take the whole script as the answer
                cell.metadata[STARTS_AS_KEY] = starts_as(cell.source)
            cell.source = blank_source(cell.source, f"{name} cell {index}", starters)
        if has_solution(solution.cells[index]) or CHECK_TAG in tags or USES_TAG in tags:
            if RAISES_TAG not in tags:
                tags.append(RAISES_TAG)
        if tags:
            cell.metadata["tags"] = tags
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
    return exercise


def _render(notebook) -> str:
    return nbformat.writes(notebook) + "\n"


def expected_exercises(solutions_dir) -> dict:
    """{exercise file name: the blank notebook}, one per solution notebook."""
    return {path.name: make_exercise(nbformat.read(path, as_version=4), path.name)
            for path in sorted(Path(solutions_dir).glob("*.ipynb"))}


def _numbers(numbers) -> str:
    return ("cell " if len(numbers) == 1 else "cells ") + ", ".join(map(str, numbers))


def answered(cell, blank_cell) -> bool:
    """True when a learner wrote anything at a blank of ``blank_cell``: fewer stubs, or other
    text where a stub stands (a line typed above the raise; a given script they started to
    change). A cell that is only an older blank (the course changed the code around its
    stubs) is not an answer, and may be rewritten."""
    if STUB not in blank_cell.source:
        return False
    if cell.source.count(STUB) < blank_cell.source.count(STUB):
        return True
    # The code around the blanks is the exercise's, so any other difference is at a blank.
    return (answers_in(blank_cell.source, cell.source, is_whole_script(blank_cell)) is not None
            and lines_as_read(cell.source) != lines_as_read(blank_cell.source))


def learner_work(existing, blank) -> list[str]:
    """What a learner made in ``existing`` (an exercise notebook on disk) that ``blank`` (what
    solutions/ generates) does not hold: answers (an answer cell they changed), cells run,
    cells added. Cells are numbered from 1, as JupyterLab shows them. Empty when the file
    holds nothing but the course."""
    course = {cell.get("id"): cell for cell in blank.cells}
    changed_answers, ran, added = [], [], []
    for number, cell in enumerate(existing.cells, 1):
        original = course.get(cell.get("id"))
        if original is None:
            if cell.source.strip():
                added.append(number)
        elif answered(cell, original):
            changed_answers.append(number)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            ran.append(number)
    return [f"{_numbers(numbers)} {what}" for numbers, what in
            ((changed_answers, "answered"), (ran, "run"), (added, "added")) if numbers]


def course_drift(existing, blank) -> list[str]:
    """Where ``existing`` differs from ``blank`` in what the course wrote (its learner's work,
    as :func:`learner_work` sees it, left aside). Empty when the course part is in sync."""
    cells = {cell.get("id"): (number, cell) for number, cell in enumerate(existing.cells, 1)}
    missing, changed = [], []
    for number, original in enumerate(blank.cells, 1):
        found = cells.get(original.get("id"))
        if found is None:
            missing.append(number)
        elif found[1].source != original.source and not answered(found[1], original):
            changed.append(found[0])
    order = [cell.get("id") for cell in existing.cells if cell.get("id") in {c.get("id") for c in blank.cells}]
    problems = [f"{_numbers(changed)} differ from the course"] if changed else []
    if missing:
        problems.append(f"the course's {_numbers(missing)} are missing")
    if not missing and order != [cell.get("id") for cell in blank.cells]:
        problems.append("its cells are in another order than the course's")
    return problems


def check(solutions_dir="solutions", exercises_dir="exercises") -> tuple[list[str], bool]:
    """(one line per exercise notebook, whether the course part of every one is in sync).
    A learner's answers, outputs and added cells are reported, not counted as drift."""
    lines, in_sync = [], True
    for name, blank in expected_exercises(solutions_dir).items():
        path = Path(exercises_dir) / name
        if not path.exists():
            lines.append(f"exercises/{name} is missing: `spike-course exercises` writes it")
            in_sync = False
            continue
        existing = nbformat.read(path, as_version=4)
        drift, work = course_drift(existing, blank), learner_work(existing, blank)
        in_sync = in_sync and not drift
        state = "; ".join(drift) if drift else "in sync with solutions/"
        lines.append(f"exercises/{name}: {state}" + (f" (holds your work: {'; '.join(work)})" if work else ""))
    for path in sorted(Path(exercises_dir).glob("*.ipynb")):
        if not (Path(solutions_dir) / path.name).exists():
            lines.append(f"exercises/{path.name} has no solutions/{path.name}")
            in_sync = False
    return lines, in_sync


def generate(solutions_dir="solutions", exercises_dir="exercises", force: bool = False) -> dict:
    """Write every exercise notebook that is missing or out of date, but never over a
    learner's work unless ``force``, and then only after copying it to
    ``exercises/backups/``. Returns {path: "written", "up to date", "kept: <work>" or
    "written (your copy: <backup>)"}."""
    exercises_dir = Path(exercises_dir)
    exercises_dir.mkdir(exist_ok=True)
    done = {}
    for name, blank in expected_exercises(solutions_dir).items():
        path, text = exercises_dir / name, _render(blank)
        if path.exists() and path.read_text() == text:
            done[path] = "up to date"
            continue
        work = learner_work(nbformat.read(path, as_version=4), blank) if path.exists() else []
        if work and not force:
            done[path] = "kept: it holds your work (" + "; ".join(work) + ")"
            continue
        done[path] = "written"
        if work:
            done[path] += f" (your copy: {_back_up(path)})"
        path.write_text(text)
    return done


def _back_up(path: Path) -> Path:
    backups = path.parent / "backups"
    backups.mkdir(exist_ok=True)
    copy = backups / f"{path.stem}.{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
    shutil.copy2(path, copy)
    return copy


def drift(solutions_dir="solutions", exercises_dir="exercises") -> list[str]:
    """Every difference between exercises/ and what solutions/ generates, answers included
    (empty when each file is exactly the blank): what the course itself must ship."""
    problems = []
    for name, blank in expected_exercises(solutions_dir).items():
        path = Path(exercises_dir) / name
        if not path.exists():
            problems.append(f"exercises/{name} is missing")
        elif path.read_text() != _render(blank):
            problems.append(f"exercises/{name} differs from what solutions/{name} generates")
    for path in sorted(Path(exercises_dir).glob("*.ipynb")):
        if not (Path(solutions_dir) / path.name).exists():
            problems.append(f"exercises/{path.name} has no solutions/{path.name}")
    return problems
