"""Generate ``exercises/`` from ``solutions/``, and tell when the two have drifted
(grading them is ``spike_course.course.grading``).

In a solution notebook the answer sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` lines. The exercise notebook is the same notebook with each such
region replaced by a stub that raises ``NotImplementedError`` (indented like the
BEGIN line), and with outputs cleared. A region whose BEGIN line says where the exercise
starts, ``### BEGIN SOLUTION (starts as workers/NN_topic/single.py)``, becomes the stub
followed by that file as the notebook's ``%%writefile`` cell writes it: the learner
changes a whole given script (the capstone), and everything after the stub is their answer.

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

import re
import shutil
import time
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, USES_TAG, RAISES_TAG = "check", "uses-solution", "raises-exception"
STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
STARTS_AS_KEY = "spike_course_starts_as"  # in a blank cell's metadata: the given script it starts as
_BEGIN_LINE = re.compile(r"^(\s*)" + re.escape(BEGIN) + r"(?: \(starts as (\S+)\))?\s*$")
_WRITEFILE = re.compile(r"\A%%writefile\s+(\S+)[ \t]*\n")


def written_files(notebook) -> dict:
    """{path: text} of the notebook's ``%%writefile`` cells, as the course wrote them."""
    found = {}
    for cell in notebook.cells:
        match = _WRITEFILE.match(cell.source) if cell.cell_type == "code" else None
        if match:
            found[match.group(1)] = cell.source[match.end():]
    return found


def starts_as(source: str) -> str | None:
    """The file a cell's solution region starts from in the exercise, if it names one."""
    for line in source.splitlines():
        begin = _BEGIN_LINE.match(line)
        if begin and begin.group(2):
            return begin.group(2)
    return None


def blank_source(source: str, where: str = "", starters=None) -> str:
    """Replace every solution region of one cell's source with a stub (followed, for a
    region that starts as a given file, by that file's text from ``starters``)."""
    out, indent = [], None
    for number, line in enumerate(source.splitlines(), 1):
        begin = _BEGIN_LINE.match(line)
        if begin:
            if indent is not None:
                raise ValueError(f"{where} line {number}: {BEGIN} inside another solution region")
            indent = begin.group(1)
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f"{indent}{STUB}")
            if begin.group(2):
                if begin.group(2) not in (starters or {}):
                    raise ValueError(f"{where} line {number}: no %%writefile cell writes {begin.group(2)}")
                out += starters[begin.group(2)].rstrip("\n").splitlines()
        elif line.strip() == END:
            if indent is None:
                raise ValueError(f"{where} line {number}: {END} without a {BEGIN} before it")
            indent = None
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise ValueError(f"{where}: {BEGIN} is never closed by {END}")
    return "\n".join(out)


def has_solution(cell) -> bool:
    return cell.cell_type == "code" and BEGIN in cell.source


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


# The two lines a solution region becomes in the exercise (exercises.blank_source).
BLANK_LINES = re.compile(r"^[ \t]*# YOUR CODE HERE\n[ \t]*" + re.escape(STUB) + r"[ \t]*$", re.M)


def lines_as_read(source: str) -> str:
    """Source compared as a reader sees it: trailing spaces and final newlines do not count."""
    return "\n".join(line.rstrip() for line in source.rstrip().splitlines())


def pieces_around(blank: str, to_the_end: bool) -> list[str]:
    """The exercise cell's text around its blanks. When the blank is followed by a given script
    the learner changes (``to_the_end``), that script is theirs: the last answer runs to the end."""
    pieces = BLANK_LINES.split(lines_as_read(blank))
    if to_the_end:
        pieces[-1] = ""
    return pieces


def answers_in(blank: str, learner: str, to_the_end: bool = False) -> list[str] | None:
    """The learner's text at each blank of an exercise cell, in order, or None when the code
    around the blanks is no longer the exercise's (the learner edited outside an answer)."""
    pieces = pieces_around(blank, to_the_end)
    pattern = "(.*?)".join(re.escape(piece) for piece in pieces)
    found = re.fullmatch(pattern, lines_as_read(learner), re.S)
    return list(found.groups()) if found else None


def is_whole_script(blank_cell) -> bool:
    """True for an exercise cell whose stub is followed by a given script the learner changes."""
    return STARTS_AS_KEY in blank_cell.get("metadata", {})


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
