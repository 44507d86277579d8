"""Generate ``exercises/`` from ``solutions/``, and tell when the two have drifted
(grading them is ``spike_course.grading``).

In a solution notebook the answer sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` lines. The exercise notebook is the same notebook with each such
region replaced by a stub that raises ``NotImplementedError`` (indented like the
BEGIN line), and with outputs cleared.

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
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_TAG, USES_TAG, RAISES_TAG = "check", "uses-solution", "raises-exception"
STUB = 'raise NotImplementedError("exercise: replace this line with your code")'
_BEGIN_LINE = re.compile(r"^(\s*)" + re.escape(BEGIN) + r"\s*$")


def blank_source(source: str, where: str = "") -> str:
    """Replace every solution region of one cell's source with a stub."""
    out, indent = [], None
    for number, line in enumerate(source.splitlines(), 1):
        begin = _BEGIN_LINE.match(line)
        if begin:
            if indent is not None:
                raise ValueError(f"{where} line {number}: {BEGIN} inside another solution region")
            indent = begin.group(1)
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f"{indent}{STUB}")
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
    for index, cell in enumerate(exercise.cells):
        if cell.cell_type != "code":
            continue
        tags = list(cell.metadata.get("tags", []))
        if has_solution(cell):
            cell.source = blank_source(cell.source, f"{name} cell {index}")
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
    """{exercise file name: the text it should have}, one per solution notebook."""
    expected = {}
    for path in sorted(Path(solutions_dir).glob("*.ipynb")):
        solution = nbformat.read(path, as_version=4)
        expected[path.name] = _render(make_exercise(solution, path.name))
    return expected


def generate(solutions_dir="solutions", exercises_dir="exercises") -> list[Path]:
    """Write every exercise notebook; return the paths written."""
    exercises_dir = Path(exercises_dir)
    exercises_dir.mkdir(exist_ok=True)
    written = []
    for name, text in expected_exercises(solutions_dir).items():
        path = exercises_dir / name
        path.write_text(text)
        written.append(path)
    return written


def drift(solutions_dir="solutions", exercises_dir="exercises") -> list[str]:
    """What is out of sync between solutions/ and exercises/ (empty when in sync)."""
    expected = expected_exercises(solutions_dir)
    problems = []
    for name, text in expected.items():
        path = Path(exercises_dir) / name
        if not path.exists():
            problems.append(f"exercises/{name} is missing")
        elif path.read_text() != text:
            problems.append(f"exercises/{name} differs from what solutions/{name} generates")
    for path in sorted(Path(exercises_dir).glob("*.ipynb")):
        if path.name not in expected:
            problems.append(f"exercises/{path.name} has no solutions/{path.name}")
    return problems
